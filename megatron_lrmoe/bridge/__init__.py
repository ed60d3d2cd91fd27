"""``python -m megatron_lrmoe.bridge``: the Bridge recipe launcher under its first name, kept
for the scripts and users that call it (the launcher: ``megatron_lrmoe.bridge_launcher``;
the integration itself: ``integration/bridge.py``)."""
