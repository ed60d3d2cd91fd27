"""Options and configuration: the LRMoE options, the Megatron option table, the config class."""
