"""Glue to Megatron: step hooks, Megatron-LM, supported versions, Megatron's privates, runtimes."""
