"""``python -m megatron_lrmoe.bridge``: a Megatron-Bridge recipe with LRMoE, trained by
Bridge's own ``pretrain`` (``cli.py``; the integration itself: ``integration/bridge.py``)."""
