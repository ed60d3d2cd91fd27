"""``python -m megatron_lrmoe.bridge_launcher``: a Megatron-Bridge recipe with LRMoE, trained
by Bridge's own ``pretrain`` (``cli.py``; the integration itself: ``integration/bridge.py``;
``python -m megatron_lrmoe.bridge`` is the same command under its first name)."""
