"""Inside a training step: LRMoELayer, its autograd region, experts, replicas, statistics."""
