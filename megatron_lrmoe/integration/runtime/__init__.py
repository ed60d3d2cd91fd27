"""Runtimes that let Megatron-Core run without Transformer Engine or a GPU."""
