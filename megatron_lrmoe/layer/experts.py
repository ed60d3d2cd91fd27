"""LRMoE's expert MLP: Megatron's SequentialMLP, read by the region as plain weights.

Storing the experts exactly as SequentialMLP does (``local_experts.<i>.linear_fc1/2``, one
parameter per expert and projection) keeps the dist-checkpoint keys of SequentialMLP and
TEGroupedMLP, so weights move between plain Megatron runs and LRMoE runs in both
directions; optimizer state moves with them between SequentialMLP and LRMoE runs in any
format (same parameters, same order), and to or from TEGroupedMLP runs only in Megatron's
fully reshardable optimizer format (docs/lrmoe.md, "Checkpoints").
The region computes the experts itself (it needs the rows of every pair, and the
backward over retained rows only), so this class only adds ``expert_weights()``; for
grouped GEMMs the region stacks these per-expert weights per call (docs/lrmoe.md,
"Expert GEMMs", says why one parameter per projection was not chosen).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_lrmoe.integration.megatron_privates import forward_pre_hooks
from megatron_lrmoe.layer.region import ExpertWeights


class LRMoESequentialMLP(SequentialMLP):
    """SequentialMLP whose weights the LRMoE region reads directly."""

    def _activation(self, z: torch.Tensor) -> torch.Tensor:
        """fc1 output [N, F1] -> h [N, F], as Megatron's MLP (unfused path) computes it."""
        config = self.config
        if config.gated_linear_unit:
            z_glu, z_linear = torch.chunk(z, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                z_glu = z_glu.clamp(max=clamp)
                z_linear = z_linear.clamp(min=-clamp, max=clamp)
            return config.activation_func(z_glu) * (z_linear + config.glu_linear_offset)
        return config.activation_func(z)

    def expert_weights(self) -> ExpertWeights:
        """The home experts' weights, after the forward pre-hooks their linears would run.

        The region never calls the linears, so hooks registered on them (Megatron DDP's
        wait for the overlapped parameter all-gather) are run here, once per forward.
        """
        for expert in self.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                for hook in forward_pre_hooks(linear):
                    hook(linear, ())
        return ExpertWeights(
            w1=tuple(expert.linear_fc1.weight for expert in self.local_experts),
            w2=tuple(expert.linear_fc2.weight for expert in self.local_experts),
            activation=self._activation,
            gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
        )
