"""Every Megatron option that touches the MoE layer, classified for ``--moe-lrmoe``.

``MEGATRON_OPTIONS`` holds one row per option: each field of Megatron-Core's
``TransformerConfig`` and each Megatron-LM argument (argparse dest) whose name starts
with one of ``PREFIXES``, plus the few other settings that act on the MoE layer
(``EXTRA_FIELDS``). Each row says, for a run with ``--moe-lrmoe``, one of

* ``AS_IS``: Megatron's own code does what the option asks, unchanged, because it acts
  outside what the LRMoE layer replaces (the router, the shared experts, attention,
  the block's recompute and logging are Megatron's);
* ``IMPLEMENTED``: LRMoE does it itself (the region replaces Megatron's dispatch ->
  experts -> combine);
* ``REFUSED``: a run that sets it stops at start-up with ``--flag: problem and fix``.

A row may refuse some values of an option that otherwise works (``refuse``): the
all-to-all dispatcher is implemented, allgather and flex are refused. ``why`` records
what Megatron does with the option and what LRMoE does instead: the reason for the
class. Where it was not certain that an option combines with the LRMoE region, it is
refused by name: a refusal is honest, a silently ignored option is a bug.

The refusals are enforced by ``options.check_combination`` (the one combination check of
both entry points): on ``LRMoETransformerConfig`` when it is built, and at parse time on
each entry point's parsed flags. ``tests/options/test_megatron.py`` checks that every
field of the installed TransformerConfig and every Megatron-LM dest with these prefixes
has a row, so an option a new Megatron adds fails the suite until someone classifies it.
The Megatron-LM dests are not installed with megatron-core; their list is shipped as
``tests/fixtures/megatron_lm_0.19_moe_args.tsv``, written from a checkout by
``python -m megatron_lrmoe.options.megatron megatron-lm-args CHECKOUT``.

Like options.py, this module imports neither torch nor Megatron (the flag tools read
it before torchrun); only the list generator imports a checkout's Megatron-LM.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ARCHITECTURE_FIELDS", "EXTRA_FIELDS", "MEGATRON_OPTIONS", "NO_FIX",
    "OFFLOAD_MODULES_AS_IS", "OFFLOAD_MODULES_REFUSED", "PREFIXES", "Handling", "MegatronOption",
    "megatron_lm_argument_rows", "megatron_option",
    "refused_offload_modules",
]

#: Name prefixes of the Megatron options every one of which must be classified here.
PREFIXES: tuple[str, ...] = ("moe_", "offload", "recompute", "cuda_graph", "fp8",
                             "fine_grained", "overlap_moe", "delay_wgrad")


class Handling(enum.Enum):
    """What a run with ``--moe-lrmoe`` does with a Megatron option."""

    AS_IS = "works as is"
    IMPLEMENTED = "implemented"
    REFUSED = "refused"


AS_IS, IMPLEMENTED, REFUSED = Handling.AS_IS, Handling.IMPLEMENTED, Handling.REFUSED


class _NoFix:
    def __repr__(self) -> str:
        return "NO_FIX"


#: ``MegatronOption.fix`` when Megatron's default of the field is what LRMoE needs.
NO_FIX: Any = _NoFix()


#: The ``TransformerConfig`` fields that define the model rather than how it is computed:
#: its shape and function (attention, MLA, experts and routing, MTP, norms, activations,
#: biases), its parallel layout and its precision. No row may mark one of them
#: ``adaptable``: ``enable_lrmoe(cfg, adapt=True)`` changes implementation choices only
#: (dispatcher, fusions, overlaps, CUDA graphs, offloading), so a model trained with
#: LRMoE is the recipe's model (``MegatronOption.__post_init__`` holds it).
ARCHITECTURE_FIELDS: frozenset[str] = frozenset({
    # shape and attention
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "kv_channels", "add_qkv_bias", "attention_output_gate",
    "qk_layernorm", "softmax_type", "window_size", "window_attn_skip_freq", "no_rope_freq",
    "rotary_interleaved", "experimental_attention_variant", "linear_attention_freq",
    # multi-latent attention
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
    "qk_pos_emb_head_dim", "v_head_dim",
    # MLPs, experts and routing (their function)
    "add_bias_linear", "gated_linear_unit", "activation_func", "activation_func_clamp_value",
    "glu_linear_offset", "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_latent_size", "moe_expert_capacity_factor",
    "moe_apply_probs_on_input",
    # depth beyond the decoder, norms
    "mtp_num_layers", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
    # parallel layout
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "context_parallel_size", "hierarchical_context_parallel_sizes",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    # precision
    "params_dtype", "fp8", "fp4",
})


@dataclass(frozen=True)
class MegatronOption:
    """One Megatron option under ``--moe-lrmoe``.

    ``name`` is a TransformerConfig field, or (``args_only``) a Megatron-LM argparse dest
    that has no field; ``carried_to`` names the field Megatron-LM sets from such a dest.
    ``refuse(value)`` says whether a value is refused; ``problem`` is the refusal after
    ``--flag: `` (a format string with ``{value}``, or a function of the value). ``flag``
    is the command-line flag when it is not the name with dashes (for a field without a
    Megatron-LM flag: the field name itself).

    For a refused value, ``fix`` is what LRMoE needs instead (a value, or a function of
    the refused value); ``NO_FIX`` means Megatron's default of the field, which no row
    refuses unless it sets ``fix``. ``adaptable``: a Bridge recipe's value may be
    replaced by the fix (``enable_lrmoe(cfg, adapt=True)``). Only implementation choices
    are (dispatcher, fusions, overlaps, CUDA graphs, offloading): settings that change the
    model's parameters or function, its parallel layout, or its precision are not: a row of
    one of ``ARCHITECTURE_FIELDS`` marked adaptable fails at import.
    """

    name: str
    handling: Handling
    why: str
    refuse: Callable[[Any], bool] | None = None
    problem: str | Callable[[Any], str] | None = None
    flag: str | None = None
    args_only: bool = False
    carried_to: str | None = None
    fix: Any = NO_FIX
    adaptable: bool = True

    def __post_init__(self) -> None:
        # A refused option refuses something; a row that refuses names the fix.
        if self.handling is REFUSED and self.refuse is None:
            raise ValueError(f"{self.name}: a refused option needs its refuse predicate")
        if (self.refuse is None) != (self.problem is None):
            raise ValueError(f"{self.name}: refuse and problem go together")
        if self.refuse is not None and self.adaptable and self.name in ARCHITECTURE_FIELDS:
            raise ValueError(f"{self.name}: defines the model (ARCHITECTURE_FIELDS), so a "
                             "recipe's value is refused, never adapted: adaptable=False")

    def fix_for(self, value: Any) -> Any:
        """What LRMoE needs instead of the refused ``value``; ``NO_FIX``: Megatron's
        default of the field."""
        return self.fix(value) if callable(self.fix) else self.fix

    def problem_for(self, value: Any) -> str:
        """The refusal text for ``value`` (the caller prefixes the flag)."""
        assert self.problem is not None, self.name
        if callable(self.problem):
            return self.problem(value)
        return self.problem.format(value=value)


# -----------------------------------------------------------------------------
# Which values are refused (each reads the option's own value only, so a check on
# the values as given, before Megatron derives others, refuses the same ones).
# -----------------------------------------------------------------------------


def _on(value: Any) -> bool:
    """A switch turned on, or a non-empty value."""
    return bool(value)


def _given(value: Any) -> bool:
    return value is not None


def _graph_modules(value: Any) -> bool:
    """CUDA-graph modules named: an empty list and the deprecated "full" (the whole
    layer, Megatron's default) capture nothing without --cuda-graph-impl."""
    return bool(value) and value != "full"


def _differs(default: Any) -> Callable[[Any], bool]:
    """Refused when set to anything but Megatron's default (an option that only acts
    through a refused feature: setting it says the user expects that feature)."""
    return lambda value: value != default


# Megatron's fine-grained activation offloading (--offload-modules) under --moe-lrmoe.
# The groups below live in Megatron's TransformerLayer and attention, outside the MoE
# layer: the offload manager hooks the saved tensors of those modules only, and an LRMoE
# layer, like a Megatron MoE layer without expert offloading, adds no group of its own.
OFFLOAD_MODULES_AS_IS: dict[str, str] = {
    "attn_norm": "Megatron's TransformerLayer (input norm)",
    "qkv_linear": "Megatron's attention",
    "core_attn": "Megatron's attention",
    "attn_proj": "Megatron's attention",
    "mlp_norm": "Megatron's TransformerLayer (pre-MLP norm input; the group spans the MoE "
                "layer, whose backward runs before the norm's)",
}
# The groups inside Megatron's grouped experts, which the LRMoE region replaces: the
# region saves its own tensors (x_exp, the fc1 output z) and would never offload them.
# Offloading them is not simple: the region's saved rows are compacted to the retained
# pairs in forward or not (by rule), its tables are host-planned, and Megatron's offload
# manager is CUDA-only (events, streams), so it could not be tested here. Refused.
OFFLOAD_MODULES_REFUSED: dict[str, str] = {
    "expert_fc1": "the input of Megatron's expert fc1: the region saves its own x_exp",
    "moe_act": "the input of Megatron's expert activation: the region saves its own fc1 "
               "output z",
    "fused_group_mlp": "the input of Megatron's fused grouped MLP (TE op fuser), which the "
                       "region replaces",
}


def refused_offload_modules(value: Iterable[str] | None) -> list[str]:
    """The modules of ``--offload-modules`` that --moe-lrmoe refuses: every module not
    known to work (a module a later Megatron adds is refused until classified)."""
    return [m for m in (value or ()) if m not in OFFLOAD_MODULES_AS_IS]


def _offload_problem(value: Any) -> str:
    names = refused_offload_modules(value)
    return (f"{', '.join(map(repr, names))} not supported with --moe-lrmoe (the LRMoE region "
            f"replaces Megatron's experts and keeps its own saved tensors on the device); "
            f"offload only {', '.join(OFFLOAD_MODULES_AS_IS)}")


# Shared reasons and refusals.
_ROUTER = "Megatron's router, which the LRMoE layer keeps (route() before the region)"
_SHARED = "Megatron's shared experts, which LRMoELayer.forward calls"
_FLEX = ("the flex dispatcher (DeepEP, HybridEP, NCCL EP) is not supported with --moe-lrmoe, "
         "whose region is the all-to-all dispatcher; drop the flag")
_FP8 = ("FP8 is not supported with --moe-lrmoe yet (the region runs its expert GEMMs in the "
        "parameters' dtype); drop the flag")
_FP4 = ("FP4 is not supported with --moe-lrmoe yet (the region runs its expert GEMMs in the "
        "parameters' dtype); drop the flag")
_NO_GRAPHS = ("CUDA graphs are not supported with --moe-lrmoe (the region's sizes come from "
              "the host at every call)")
_GRAPHS = _NO_GRAPHS + "; keep --cuda-graph-impl none and drop the flag"
_FORWARD_CAPACITY = ("only acts with --moe-expert-capacity-factor, which --moe-lrmoe refuses "
                     "(its forward is exact); drop the flag")
_STASH = ("paged stash is not supported with --moe-lrmoe: it pages the saved activations of "
          "Megatron's experts, which the LRMoE region replaces (it saves its own, only the "
          "retained rows when drawn in forward), and needs --moe-expert-rank-capacity-factor "
          "(flex dispatcher only); drop the flag")
_TRACE = ("Megatron-LM's router tracer: forward hooks on every TopKRouter, which the LRMoE "
          "layer keeps and calls once per layer pass")


def _as_is(name: str, why: str, **kw: Any) -> MegatronOption:
    return MegatronOption(name, AS_IS, why, **kw)


def _implemented(name: str, why: str, **kw: Any) -> MegatronOption:
    return MegatronOption(name, IMPLEMENTED, why, **kw)


def _refused(name: str, problem: str | Callable[[Any], str],
             refuse: Callable[[Any], bool] = _on, why: str | None = None,
             **kw: Any) -> MegatronOption:
    return MegatronOption(name, REFUSED, why or str(problem), refuse=refuse, problem=problem,
                          **kw)


# -----------------------------------------------------------------------------
# The table. Checked in this order: what a Megatron MoE command line most often has
# to change for --moe-lrmoe comes first, so it is what a refusal names first.
# -----------------------------------------------------------------------------

MEGATRON_OPTIONS: tuple[MegatronOption, ...] = (
    # --- what --moe-lrmoe requires ---------------------------------------------------
    _implemented(
        "moe_token_dispatcher_type",
        "the LRMoE region is the all-to-all dispatcher's dispatch -> experts -> combine as one "
        "autograd function; allgather and flex are refused",
        refuse=lambda v: v != "alltoall",
        problem="--moe-lrmoe needs --moe-token-dispatcher-type alltoall (its backward region "
                "is an all-to-all dispatcher), got {value!r}", fix="alltoall"),
    _implemented(
        "add_bias_linear",
        "expert biases (gpt-oss): the region adds each instance's fc1 and fc2 bias in "
        "forward (fc2's inside the output p scales, as Megatron's experts do) and returns "
        "their gradients over the retained pairs, reweighted as the weights' are; replicas "
        "carry them", flag="--disable-bias-linear"),
    _refused("moe_expert_capacity_factor",
             "--moe-lrmoe keeps the forward exact: drop --moe-expert-capacity-factor (a "
             "forward capacity drops pairs in forward)", refuse=_given, adaptable=False),
    _refused("expert_tensor_parallel_size",
             "--moe-lrmoe needs --expert-tensor-parallel-size 1 (expert tensor parallelism is "
             "not supported yet; Megatron-LM defaults it to --tensor-model-parallel-size), "
             "got {value}", refuse=lambda v: v not in (None, 1), fix=1, adaptable=False),
    _refused("moe_apply_probs_on_input",
             "not supported with --moe-lrmoe (LRMoE applies the probabilities after the "
             "combine, and its router gradient is <dy, o>); drop the flag", adaptable=False),
    _refused("overlap_moe_expert_parallel_comm",
             "not supported with --moe-lrmoe: the 1F1B overlap schedules the stages of "
             "Megatron's dispatcher and experts, which the LRMoE region replaces; drop the "
             "flag"),
    _refused("delay_wgrad_compute",
             "not supported with --moe-lrmoe: the region computes the expert weight gradients "
             "in its own backward, as soon as each exists, with no separate wgrad stage to "
             "delay; drop the flag"),
    _refused("moe_shared_expert_overlap",
             "not supported with --moe-lrmoe: the overlap runs the shared experts inside "
             "Megatron's dispatcher, which the region replaces (without it they run before "
             "the router); drop the flag"),
    _refused("cuda_graph_impl", _NO_GRAPHS + "; use --cuda-graph-impl none",
             refuse=lambda v: v != "none"),
    _implemented(
        "context_parallel_size",
        "each context-parallel rank's MoE layer routes its own S / CP tokens (attention "
        "exchanges the keys and values); the region, its counts exchange and the planner "
        "work over the expert-parallel group, cut from TP x CP x DP, so one may mix CP "
        "ranks, and the router's auxiliary losses reduce over TP x CP as in Megatron's "
        "layer; the planner and the memory account count S / CP tokens per rank"),
    _refused("moe_latent_size",
             "not supported with --moe-lrmoe (the latent projections wrap Megatron's "
             "dispatcher, which the region replaces); drop the flag", refuse=_given,
             adaptable=False),
    _refused("fp8", _FP8, refuse=_given, flag="--fp8-format", adaptable=False),

    # --- routing: Megatron's router ---------------------------------------------------
    _as_is("moe_router_topk", _ROUTER),
    _as_is("moe_router_load_balancing_type",
           _ROUTER + "; aux losses attach to its probabilities, whose gradient the region "
           "returns; sinkhorn and quantile_balancing (bias updated in finalize_model_grads) "
           "act in the router too"),
    _as_is("moe_aux_loss_coeff", _ROUTER),
    _as_is("moe_z_loss_coeff", _ROUTER),
    _as_is("moe_input_jitter_eps", _ROUTER),
    _as_is("moe_router_score_function",
           _ROUTER + " (softmax, sigmoid, sqrtsoftplus: the region only reads probabilities)"),
    _as_is("moe_router_pre_softmax", _ROUTER),
    _as_is("moe_router_topk_scaling_factor", _ROUTER),
    _as_is("moe_router_num_groups", _ROUTER + " (group-limited routing)"),
    _as_is("moe_router_group_topk", _ROUTER + " (group-limited routing)"),
    _as_is("moe_router_topk_limited_devices",
           _ROUTER + " (deprecated; Megatron turns it into group-limited routing)"),
    _as_is("moe_router_enable_expert_bias",
           _ROUTER + "; the bias update runs in Megatron's finalize_model_grads"),
    _as_is("moe_router_bias_update_rate", _ROUTER),
    _as_is("moe_router_quantile_balancing_ema", _ROUTER + " (quantile balancing)"),
    _as_is("moe_router_force_load_balancing", _ROUTER + " (random logits, for benchmarks)"),
    _as_is("moe_router_force_biased", _ROUTER + " (biased logits, for benchmarks)"),
    _as_is("moe_router_fusion", _ROUTER + " (TE's fused top-k and aux loss)"),
    _as_is("moe_enable_routing_replay",
           _ROUTER + ": the recorded or replayed top-k indices are taken inside the router's "
           "top-k, before the region, which dispatches the replayed pairs "
           "(tests/options/test_megatron.py)"),
    _as_is("moe_per_layer_logging", _ROUTER + " (per-layer aux and z losses)"),
    _as_is("moe_grad_scale_func",
           "set by Megatron's schedules to scale the router's aux-loss gradients"),
    _implemented(
        "moe_router_dtype",
        "routing runs in Megatron's router in this dtype; the weighted combine is LRMoE's, "
        "which multiplies and sums in fp32 (for 16-bit and fp32 rows), i.e. what fp32 asks; "
        "fp64 is refused",
        refuse=lambda v: v == "fp64",
        problem="--moe-lrmoe combines expert outputs in fp32, so fp64 is not supported: use "
                "--moe-router-dtype fp32", fix="fp32"),

    # --- what the region replaces: dispatch, experts, combine --------------------------
    _implemented("moe_grouped_gemm",
                 "selects grouped GEMMs inside the LRMoE region (torch grouped_mm), on every "
                 "device (docs/design.md, \"Expert GEMMs\")"),
    _implemented("deterministic_mode",
                 "Megatron picks deterministic kernels; the LRMoE region's one reduction in an "
                 "order the hardware picks (the token gradient's scatter-add, atomic on CUDA) "
                 "then sums each token's rows in pair order (a sorted segment sum); so does "
                 "torch.use_deterministic_algorithms (docs/design.md, \"Region\")"),
    _as_is("moe_ffn_hidden_size", "the experts' shape; the region reads their weights"),
    _as_is("moe_layer_freq", "Megatron's spec; the converter replaces only its MoE layers"),
    _refused("moe_token_drop_policy", _FORWARD_CAPACITY, refuse=_differs("probs")),
    _refused("moe_pad_expert_input_to_capacity", _FORWARD_CAPACITY),
    _as_is("moe_token_dropping",
           "read by nothing in Megatron-Core 0.19 (documented as unsupported): no effect with "
           "or without --moe-lrmoe"),
    _refused("moe_permute_fusion",
             "fuses the permutation of Megatron's all-to-all dispatcher, which the --moe-lrmoe "
             "region replaces with its own kernels, so it would have no effect; drop the flag"),
    _refused("moe_router_padding_for_quantization",
             "pads Megatron's dispatch for FP8/FP4 expert GEMMs, which --moe-lrmoe does not "
             "run; drop the flag"),
    _refused("moe_router_padding_for_fp8",
             "pads Megatron's dispatch for FP8 expert GEMMs, which --moe-lrmoe does not run; "
             "drop the flag"),
    _refused("moe_pad_experts_for_cuda_graph_inference",
             "pads Megatron's inference dispatch for CUDA-graph decoding; --moe-lrmoe replaces "
             "that dispatch and runs no CUDA graphs; drop the flag"),
    _refused("moe_single_grouped_weight",
             "stores TEGroupedMLP's experts as one grouped parameter; the --moe-lrmoe experts "
             "keep one parameter per expert (SequentialMLP's layout and checkpoint keys); drop "
             "the flag"),
    _refused("moe_single_grouped_bias",
             "stores TEGroupedMLP's expert biases as one grouped parameter; the --moe-lrmoe "
             "experts keep one bias per expert (SequentialMLP's layout and checkpoint keys); "
             "drop the flag"),
    _refused("moe_mlp_glu_interleave_size",
             "block-interleaved GLU is TEGroupedMLP's fc1 layout; the --moe-lrmoe experts read "
             "fc1 as [gate; linear] halves (SequentialMLP's), so it would be ignored and an "
             "interleaved checkpoint misread; drop the flag", refuse=_given),
    _refused("moe_expert_rank_capacity_factor",
             "bounds the tokens each rank receives in forward, with the flex dispatcher only "
             "(hybridep, ncclep), which --moe-lrmoe refuses; LRMoE's forward is exact and its "
             "per-rank bound is on backward pairs: --moe-lrmoe-bwd-capacity-factor "
             "(docs/design.md, \"Per-rank bounds\")", refuse=_given),
    _refused("moe_paged_stash", _STASH),
    _refused("moe_paged_stash_page_size", _STASH, refuse=_differs(64)),
    _refused("moe_paged_stash_buffer_size_factor_cuda", _STASH, refuse=_differs(1.1)),
    _refused("moe_paged_stash_buffer_size_factor_cpu", _STASH, refuse=_differs(0.0)),
    _refused("moe_enable_deepep", _FLEX),
    # Megatron's default (deepep) and Bridge's None choose no flex backend.
    _refused("moe_flex_dispatcher_backend", _FLEX, refuse=lambda v: v not in ("deepep", None),
             fix=None),
    _refused("moe_flex_dispatcher_num_sms", _FLEX, refuse=_given),
    _refused("moe_deepep_num_sms", _FLEX, refuse=_given),
    _refused("moe_hybridep_num_sms", _FLEX, refuse=_given),
    _refused("moe_hybridep_num_blocks_permute", _FLEX, refuse=_given),
    _refused("moe_hybridep_num_blocks_unpermute", _FLEX, refuse=_given),
    _refused("moe_hybridep_num_sms_preprocessing", _FLEX, refuse=_differs(108)),
    _refused("moe_hybridep_pad_uneven_dispatch_inputs", _FLEX),
    _refused("moe_permute_fusion_into_hybridep", _FLEX),
    _refused("moe_ncclep_static_shape", _FLEX),
    _refused("moe_ncclep_zero_copy", _FLEX),
    _refused("overlap_dispatch_backward_with_experts_wgrad",
             "its hooks sit in MoELayer.dispatch and routed_experts_compute, which the "
             "--moe-lrmoe layer does not call, so it would have no effect; drop the flag"),
    _refused("mlp_chunks_for_training",
             "runs the MoE layer once per sequence chunk of a micro-batch, while the "
             "--moe-lrmoe planner, draws and step-end replica reduction count one call per "
             "micro-batch; use --mlp-chunks-for-training 1",
             refuse=lambda v: v not in (None, 1)),
    _as_is("transformer_impl",
           "Megatron's attention, norms and dense layers (the LRMoE experts are its own "
           "either way); inference_optimized is refused",
           refuse=lambda v: v == "inference_optimized",
           problem="inference_optimized picks Megatron's inference dispatchers inside "
                   "MoELayer.forward, which the --moe-lrmoe layer replaces; use local or "
                   "transformer_engine", adaptable=False),

    # --- shared experts: Megatron's ---------------------------------------------------
    _as_is("moe_shared_expert_intermediate_size", _SHARED),
    _as_is("moe_shared_expert_gate", _SHARED + " (the gate is inside them; tested)"),
    _as_is("moe_shared_expert_glu_interleave_size", _SHARED),

    # --- recompute ----------------------------------------------------------------------
    _implemented("recompute_granularity",
                 "full: Megatron checkpoints whole layers and the LRMoE layer treats the first "
                 "pass (no autograd) as planning only; selective: RECOMPUTE_MODULES "
                 "(docs/design.md, \"Recompute\"; tests/launcher/test_recompute.py)"),
    _as_is("recompute_method", "Megatron's TransformerBlock chooses the recomputed layers"),
    _as_is("recompute_num_layers", "Megatron's TransformerBlock chooses the recomputed layers"),
    _implemented("recompute_modules",
                 "each module as RECOMPUTE_MODULES (options/lrmoe.py) says; any other refused "
                 "by options.check_recompute"),
    _implemented("moe_layer_recompute",
                 "deprecated spelling of --recompute-modules moe, which LRMoELayer.forward "
                 "implements (tensor_parallel.checkpoint over the layer)"),
    _as_is("recompute_activations",
           "Megatron-LM turns it into --recompute-granularity selective (core_attn)",
           args_only=True, carried_to="recompute_granularity"),

    # --- CUDA graphs ------------------------------------------------------------------
    _refused("cuda_graph_modules",
             _NO_GRAPHS + "; keep --cuda-graph-impl none and drop --cuda-graph-modules (or "
             "--cuda-graph-scope, which Megatron-LM turns into it)",
             refuse=_graph_modules),
    _refused("cuda_graph_scope", _GRAPHS, refuse=_graph_modules, flag="cuda_graph_scope"),
    _refused("cuda_graph_scope_deprecated", _GRAPHS, refuse=_graph_modules,
             flag="--cuda-graph-scope",
             args_only=True, carried_to="cuda_graph_modules"),
    _refused("cuda_graph_warmup_steps", _GRAPHS, refuse=_differs(3)),
    _refused("cuda_graph_use_single_mempool", _GRAPHS, refuse=_differs(True),
             flag="cuda_graph_use_single_mempool"),
    _refused("cuda_graph_retain_backward_graph", _GRAPHS,
             flag="cuda_graph_retain_backward_graph"),
    _refused("enable_cuda_graph", _GRAPHS),
    _refused("external_cuda_graph", _GRAPHS),

    # --- activation offloading --------------------------------------------------------
    _as_is("fine_grained_activation_offloading",
           "Megatron's offload manager; the modules it may offload are --offload-modules'"),
    _as_is("offload_modules",
           "attention-side and norm modules offload in Megatron's layer, outside the MoE layer "
           "(OFFLOAD_MODULES_AS_IS); expert_fc1, moe_act, fused_group_mlp are refused "
           "(OFFLOAD_MODULES_REFUSED)",
           refuse=lambda v: bool(refused_offload_modules(v)), problem=_offload_problem,
           fix=lambda v: [m for m in v if m in OFFLOAD_MODULES_AS_IS]),
    _as_is("fine_grained_offloading_max_inflight_offloads", "Megatron's offload manager"),
    _refused("cpu_offloading",
             "layer-level CPU offloading would move the --moe-lrmoe region's saved tensors, "
             "which is not supported; use the fine-grained offloading of attention modules "
             "instead", flag="cpu_offloading"),

    # --- low precision: FP8, FP4 --------------------------------------------------------
    _refused("fp8_recipe", _FP8, refuse=_differs("delayed")),
    _refused("fp8_param", _FP8, flag="--fp8-param-gather"),
    _refused("fp8_param_gather", _FP8, args_only=True, carried_to="fp8_param"),
    _refused("fp8_quantizer_factory", _FP8, refuse=_given),
    _refused("fp8_margin", _FP8, refuse=_differs(0)),
    _refused("fp8_interval", _FP8, refuse=_differs(1)),
    _refused("fp8_amax_history_len", _FP8, refuse=_differs(1)),
    _refused("fp8_amax_compute_algo", _FP8, refuse=_differs("most_recent")),
    _refused("fp8_wgrad", _FP8, refuse=_differs(True), flag="--no-fp8-wgrad"),
    _refused("fp8_output_proj", _FP8),
    _refused("fp8_dot_product_attention", _FP8, flag="fp8_dot_product_attention"),
    _refused("fp8_multi_head_attention", _FP8, flag="fp8_multi_head_attention"),
    _refused("fp4", _FP4, refuse=_given, flag="--fp4-format", adaptable=False),
    _refused("fp4_recipe", _FP4, refuse=_differs("nvfp4")),
    _refused("fp4_param", _FP4, flag="--fp4-param-gather"),
    _refused("fp4_quantizer_factory", _FP4, refuse=_given),

    # --- Megatron-LM only: router trace, upcycling --------------------------------------
    _as_is("moe_routing_trace_path", _TRACE + " (tests/options/test_megatron.py)",
           args_only=True),
    _as_is("moe_routing_trace_max_training_iters", _TRACE, args_only=True),
    _as_is("moe_routing_trace_capture_logits", _TRACE, args_only=True),
    _as_is("moe_routing_trace_capture_hidden_states", _TRACE, args_only=True),
    _as_is("moe_routing_trace_dump_weights", _TRACE, args_only=True),
    _refused("moe_use_upcycling",
             "not supported with --moe-lrmoe: upcycling builds the dense model from the same "
             "flags, which --moe-lrmoe cannot build; upcycle without --moe-lrmoe, then train "
             "from that checkpoint with it (the expert checkpoint keys are the same)",
             args_only=True),
    _refused("moe_upcycling_granularity",
             "only acts with --moe-use-upcycling, which --moe-lrmoe refuses; drop the flag",
             refuse=_differs(1), args_only=True),
)

#: Fields without one of the PREFIXES that act on the MoE layer, classified as well.
EXTRA_FIELDS: frozenset[str] = frozenset({
    "add_bias_linear", "expert_tensor_parallel_size", "context_parallel_size",
    "overlap_dispatch_backward_with_experts_wgrad", "mlp_chunks_for_training",
    "transformer_impl", "enable_cuda_graph", "external_cuda_graph", "cpu_offloading",
    "fp4", "fp4_recipe", "fp4_param", "fp4_quantizer_factory", "deterministic_mode",
})

_BY_NAME = {row.name: row for row in MEGATRON_OPTIONS}
if len(_BY_NAME) != len(MEGATRON_OPTIONS):  # one row per option: defined and checked once
    raise RuntimeError("megatron_options: an option has two rows")


def megatron_option(name: str) -> MegatronOption:
    """The row of Megatron option ``name`` (config field or Megatron-LM dest)."""
    return _BY_NAME[name]


# -----------------------------------------------------------------------------
# The Megatron-LM argument list shipped for the tests, from a checkout
# -----------------------------------------------------------------------------


def megatron_lm_argument_rows(checkout: str) -> list[tuple[str, str, str]]:
    """(dest, its flags comma-joined, repr of its default) of every Megatron-LM argument
    whose dest starts with one of ``PREFIXES``, read from the checkout's own parser
    (``add_megatron_arguments``), sorted by dest.

    Imports the checkout's ``megatron`` package: run it in a process of its own
    (``python -m megatron_lrmoe.options.megatron megatron-lm-args CHECKOUT``), not
    where the installed megatron-core is already imported."""
    sys.path.insert(0, os.path.abspath(checkout))
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags: dict[str, list[str]] = {}
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if action.dest.startswith(PREFIXES):
            flags.setdefault(action.dest, []).extend(action.option_strings)
            defaults.setdefault(action.dest, action.default)
    return [(dest, ",".join(flags[dest]), repr(defaults[dest])) for dest in sorted(flags)]


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lrmoe.options.megatron",
        description="Write the Megatron-LM argument list the option-table tests compare with.")
    sub = parser.add_subparsers(dest="command", required=True)
    lm = sub.add_parser("megatron-lm-args", help="dests with the table's prefixes, from a "
                                                  "Megatron-LM checkout's parser")
    lm.add_argument("checkout", help="Megatron-LM checkout (e.g. at core_v0.19.0)")
    lm.add_argument("--output", "-o", default=None, help="file to write (default: stdout)")
    args = parser.parse_args(argv)
    rows = megatron_lm_argument_rows(args.checkout)
    from megatron_lrmoe.options.megatron_support import megatron_lm_version

    lines = [f"# Megatron-LM arguments whose dest starts with {', '.join(PREFIXES)}: dest, "
             "flags, default.",
             f"# Written by: python -m megatron_lrmoe.options.megatron megatron-lm-args "
             f"CHECKOUT (megatron-core {megatron_lm_version(args.checkout)})"]
    lines += ["\t".join(row) for row in rows]
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
