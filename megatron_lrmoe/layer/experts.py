"""LRMoE's expert MLP: Megatron's SequentialMLP, read by the region as plain weights.

Storing the experts exactly as SequentialMLP does (``local_experts.<i>.linear_fc1/2``, one
parameter per expert and projection) keeps the dist-checkpoint keys of SequentialMLP and
TEGroupedMLP, so weights move between plain Megatron runs and LRMoE runs in both
directions; optimizer state moves with them between SequentialMLP and LRMoE runs in any
format (same parameters, same order), and to or from TEGroupedMLP runs only in Megatron's
fully reshardable optimizer format (docs/implementation.md, "Choices inside the layer").
The region computes the experts itself (it needs the rows of every pair, and the
backward over retained rows only), so this class only adds ``expert_weights()``. For
grouped GEMMs it hands the region the weights as [L, F1, H] and [L, H, F] views of the
storage they live in (``expert_gemms.weight_stack``, cached until a weight moves): the
experts' weights are allocated in one buffer per layer (each parameter a view of it,
names and registration order unchanged), which Megatron's DDP keeps without the
distributed optimizer; with it, DDP moves them into its own buffer, last expert first,
and the views list them in that order (the region runs its groups in it). Where no
uniform layout exists the region stacks them per call (docs/implementation.md,
"Grouped GEMMs").
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from torch._subclasses.fake_tensor import is_fake

from megatron_lrmoe.layer.expert_gemms import WeightStack, weight_stack
from megatron_lrmoe.layer.region import ExpertWeights
from megatron_lrmoe.megatron_privates import forward_pre_hooks

# Each expert weight starts at a multiple of this many elements of the layer's buffer
# (as Megatron's distributed optimizer aligns parameters): 16-byte aligned in any dtype.
_ALIGN = 64


def share_one_buffer(weights: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Re-point the experts' (W1, W2) ``.data`` into one new buffer, expert by expert
    (W1 then W2, each start aligned), values copied: grouped GEMMs then read each
    projection as one strided view. False (nothing changed) unless every weight is the
    sole tensor of its own storage (as a new parameter is; never one that Megatron's DDP
    moved into its buffer) and they agree in shape, dtype and device."""
    if not weights:
        return False
    w1, w2 = weights[0]
    if any(a.shape != w1.shape or b.shape != w2.shape or a.dtype != w1.dtype
           or b.dtype != w1.dtype or a.device != w1.device or b.device != w1.device
           or not (_owns_storage(a) and _owns_storage(b)) for a, b in weights):
        return False
    size1 = -(-w1.numel() // _ALIGN) * _ALIGN
    per_expert = size1 + -(-w2.numel() // _ALIGN) * _ALIGN
    buffer = torch.empty(len(weights) * per_expert, dtype=w1.dtype, device=w1.device)
    with torch.no_grad():
        for e, (a, b) in enumerate(weights):
            for w, start in ((a, e * per_expert), (b, e * per_expert + size1)):
                view = buffer[start:start + w.numel()].view(w.shape)
                view.copy_(w.data)
                w.data = view
    return True


def _owns_storage(w: torch.Tensor) -> bool:
    # Plain tensors only: a quantized parameter (Transformer Engine's FP8) keeps its
    # data in its own structures.
    return ((type(w.data) is torch.Tensor or is_fake(w.data)) and w.is_contiguous()
            and w.storage_offset() == 0
            and w.untyped_storage().nbytes() == w.numel() * w.element_size())


class LRMoESequentialMLP(SequentialMLP):
    """SequentialMLP whose weights the LRMoE region reads directly."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stack_key: tuple | None = None
        self._stack: WeightStack | str | None = None
        self._share_buffer()

    def _weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in self.local_experts]

    def _share_buffer(self) -> None:
        share_one_buffer(self._weights())
        self._stack_key = self._stack = None

    def _apply(self, fn, recurse: bool = True):
        # ``.cuda()``, ``.to()``, ``.bfloat16()`` convert each parameter on its own:
        # gather the experts into one buffer again afterwards.
        out = super()._apply(fn, recurse)
        self._share_buffer()
        return out

    def weight_stack(self) -> WeightStack | str:
        """The home experts' weights as grouped_mm reads them (zero-copy views), or why
        there are none."""
        w1, w2 = zip(*self._weights(), strict=True)
        return self._stack_of(w1, w2)

    def _stack_of(self, w1: tuple[torch.Tensor, ...],
                  w2: tuple[torch.Tensor, ...]) -> WeightStack | str:
        """``weight_stack`` of these weights, derived again whenever one's storage or
        place in it changed (Megatron's DDP re-pointing ``.data`` into its buffer, a
        checkpoint load that replaced a tensor)."""
        # Data pointers: host metadata, the cheapest key (fake tensors have none).
        key = (tuple((w.untyped_storage()._cdata, w.storage_offset()) for w in (*w1, *w2))
               if is_fake(w1[0]) else tuple(map(torch.Tensor.data_ptr, (*w1, *w2))))
        if key != self._stack_key:
            self._stack = weight_stack(w1, w2)
            self._stack_key = key
        return self._stack

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
        w1, w2, b1, b2 = [], [], [], []
        for expert in self.local_experts:
            for linear, weights, biases in ((expert.linear_fc1, w1, b1),
                                            (expert.linear_fc2, w2, b2)):
                for hook in forward_pre_hooks(linear):
                    hook(linear, ())
                weights.append(linear.weight)
                # Megatron's expert MLP builds its linears with skip_bias_add and adds the
                # bias itself (fc2's scaled by p): the region adds it in its place.
                if self.config.add_bias_linear:
                    biases.append(linear.bias)
        w1, w2 = tuple(w1), tuple(w2)
        return ExpertWeights(
            w1=w1, w2=w2, activation=self._activation,
            gradient_accumulation_fusion=self.config.gradient_accumulation_fusion,
            stack=self._stack_of(w1, w2), b1=tuple(b1), b2=tuple(b2),
        )
