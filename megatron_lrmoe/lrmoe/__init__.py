"""LRMoE core: retention planner, autograd region and configuration."""
