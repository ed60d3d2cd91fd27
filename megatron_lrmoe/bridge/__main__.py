"""``python -m megatron_lrmoe.bridge --recipe NAME [--config-file FILE] [--adapt] [overrides]``."""

import sys

from megatron_lrmoe.bridge.cli import main

sys.exit(main())
