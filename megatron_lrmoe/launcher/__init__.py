"""The lean launcher: python -m megatron_lrmoe.launcher (flags checked, then torchrun)."""
