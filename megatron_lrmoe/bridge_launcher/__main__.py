"""``python -m megatron_lrmoe.bridge_launcher --recipe NAME [--config-file FILE] [--adapt]
[overrides]``."""

import sys

from megatron_lrmoe.bridge_launcher.cli import main

sys.exit(main())
