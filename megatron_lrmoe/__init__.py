"""megatron-lrmoe: load-recalibrated Mixture-of-Experts training for Megatron-Core.

Nothing here is imported implicitly by Megatron: the plugin's classes are only
instantiated when a run asks for them (``--moe-lrmoe``).
"""

__version__ = "0.1.0"
