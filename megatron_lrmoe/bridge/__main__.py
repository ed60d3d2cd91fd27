"""``python -m megatron_lrmoe.bridge ...``: ``python -m megatron_lrmoe.bridge_launcher ...``."""

import sys

from megatron_lrmoe.bridge_launcher.cli import main

sys.exit(main())
