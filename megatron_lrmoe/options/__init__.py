"""The ground floor's option definitions: LRMoE's options with their checks (``lrmoe``) and
the classification of Megatron's options under ``--moe-lrmoe`` (``megatron``).

Torch-free and Megatron-free: every other floor (planning, config, the launchers, the
Megatron-LM glue before Megatron is importable) reads them.
"""
