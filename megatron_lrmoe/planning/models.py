"""The model recipes the simulator and the projections price (``MODELS``): what they need
of each, its MoE layers' shapes and its batch (``ModelSpec``), shipped with the package.
The recipes' launcher configs (the repository's ``configs/qwen3_30b_a3b.yaml`` and
``configs/glm45_air.yaml``) hold the same numbers; tests/planning/test_models.py reads
them back. Pure: no torch, no file."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lrmoe.planning.shapes import MoEShape

__all__ = ["MODELS", "ModelSpec"]


@dataclass(frozen=True)
class ModelSpec:
    """What the simulator needs of a model recipe: its MoE layers' shapes and its batch."""

    name: str
    num_layers: int
    """MoE layers (``--moe-layer-freq`` applied to ``--num-layers``)."""
    hidden_size: int
    ffn_hidden_size: int
    num_experts: int
    topk: int
    gated: bool
    seq_length: int
    micro_batch_size: int
    global_batch_size: int

    def microbatches_per_step(self, data_parallel: int) -> int:
        return max(1, self.global_batch_size // (self.micro_batch_size * data_parallel))

    def shape(self, ep_size: int, pipeline: int = 1) -> MoEShape:
        """One EP rank's layer shape: EP inside data parallelism (DP = EP, TP = CP = 1),
        the layers of one pipeline stage, bf16 with fp32 replica gradients, the region's
        grouped GEMMs (its CUDA path)."""
        return MoEShape(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                        num_experts=self.num_experts, topk=self.topk, gated=self.gated,
                        dtype_bytes=2, tokens_per_rank=self.seq_length * self.micro_batch_size,
                        num_layers=max(1, self.num_layers // pipeline),
                        microbatches_in_flight=pipeline,
                        microbatches_per_step=self.microbatches_per_step(ep_size),
                        grad_dtype_bytes=4, expert_parallel_size=ep_size,
                        grouped_gemm=True)   # the region's CUDA path


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    # Qwen3-30B-A3B: 48 layers, every one MoE (moe-layer-freq 1).
    ModelSpec("qwen3-30b-a3b", num_layers=48, hidden_size=2048, ffn_hidden_size=768,
              num_experts=128, topk=8, gated=True, seq_length=4096, micro_batch_size=1,
              global_batch_size=512),
    # GLM-4.5-Air: 46 layers, the first dense (moe-layer-freq ([0]*1+[1]*45)).
    ModelSpec("glm45-air", num_layers=45, hidden_size=4096, ffn_hidden_size=1408,
              num_experts=128, topk=8, gated=True, seq_length=4096, micro_batch_size=1,
              global_batch_size=512),
)}
