#!/usr/bin/env python
"""Megatron-LM's pretrain_gpt.py with the LRMoE plugin, without patching Megatron-LM.

    MEGATRON_LM=/path/to/Megatron-LM torchrun --nproc-per-node 8 \
        scripts/pretrain_gpt_lrmoe.py <pretrain_gpt.py flags> --moe-lrmoe [--moe-lrmoe-* ...]

Same flags as pretrain_gpt.py plus ``--moe-lrmoe*``; without ``--moe-lrmoe`` the run is
pretrain_gpt.py's. The checkout comes from ``$MEGATRON_LM`` or an importable
``pretrain_gpt`` module and must be of tag core_v0.19.0 (any megatron-core 0.19.x). It
runs pretrain_gpt.py's ``__main__`` steps with pretrain_gpt.py's own dataset provider,
forward step and embedding ranks; all logic lives in ``megatron_lrmoe.integration.megatron_lm``
(``run_pretrain_gpt``).
"""

import os
import sys

# Run from a source tree without installing: the package sits next to scripts/.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lrmoe.config.flags import ConfigError  # noqa: E402
from megatron_lrmoe.integration.megatron_lm import run_pretrain_gpt  # noqa: E402

if __name__ == "__main__":
    try:
        run_pretrain_gpt()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
