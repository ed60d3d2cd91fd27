"""Megatron's options under --moe-lrmoe (options/megatron.py).

Every TransformerConfig field of the installed megatron-core and every Megatron-LM
argument dest with the table's prefixes has a row (the Megatron-LM list is shipped in
tests/fixtures, written from a checkout; the opt-in test regenerates it from $MEGATRON_LM's
own parser); each refusal is enforced by name on the entry points' real paths (the
config's construction, Megatron-LM's config path, the parse-time check both entry points
run, the launcher's parser); and options that work as is are shown doing what Megatron
does with them: routing replay and the router tracer, the shared-expert gate. Recompute's
"works as is" and "implemented" are tests/launcher/test_recompute.py's (bitwise against runs
without recompute); the router score functions' exactness is tested elsewhere.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from megatron_lrmoe.config.command_line import build_parser
from megatron_lrmoe.config.flags import ConfigError, validate_lrmoe_flags
from megatron_lrmoe.integration import megatron_lm
from megatron_lrmoe.launcher.arguments import parse_args
from megatron_lrmoe.options.lrmoe import (
    OPTIONS,
    RECOMPUTE_MODULES,
    LRMoEConfigError,
    flag_of,
)
from megatron_lrmoe.options.megatron import (
    ARCHITECTURE_FIELDS,
    EXTRA_FIELDS,
    MEGATRON_OPTIONS,
    OFFLOAD_MODULES_AS_IS,
    OFFLOAD_MODULES_REFUSED,
    PREFIXES,
    Handling,
    megatron_option,
)

SHIPPED = Path(__file__).parents[1] / "fixtures" / "megatron_lm_0.19_moe_args.tsv"
LRMOE_CONFIG = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                    moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                    add_bias_linear=False, moe_lrmoe=True)
# Megatron's defaults LRMoE refuses by design: what --moe-lrmoe requires instead.
REQUIRED = {"moe_token_dispatcher_type": "alltoall"}


def _shipped() -> dict[str, tuple[list[str], str]]:
    """dest -> (its flags, repr of its default), from the shipped Megatron-LM list."""
    rows = {}
    for line in SHIPPED.read_text().splitlines():
        if line and not line.startswith("#"):
            dest, flags, default = line.split("\t")
            rows[dest] = (flags.split(","), default)
    return rows


def _config_fields() -> dict[str, dataclasses.Field]:
    from megatron.core.transformer import TransformerConfig

    return {f.name: f for f in dataclasses.fields(TransformerConfig)}


def _field_default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


# -----------------------------------------------------------------------------
# Every option classified, against Megatron's own dataclass and parser
# -----------------------------------------------------------------------------


def test_every_prefixed_config_field_is_classified():
    fields = _config_fields()
    prefixed = {name for name in fields if name.startswith(PREFIXES)}
    assert len(prefixed) > 80   # the filter found Megatron's fields
    missing = sorted(prefixed - {row.name for row in MEGATRON_OPTIONS})
    assert not missing, (f"Megatron options not classified for --moe-lrmoe; add each to "
                         f"MEGATRON_OPTIONS (options/megatron.py): {missing}")


def test_every_prefixed_megatron_lm_argument_is_classified():
    dests = set(_shipped())
    assert len(dests) > 80 and "moe_router_topk" in dests and "offload_modules" in dests
    missing = sorted(dests - {row.name for row in MEGATRON_OPTIONS})
    assert not missing, (f"Megatron-LM arguments not classified for --moe-lrmoe; add each to "
                         f"MEGATRON_OPTIONS (options/megatron.py): {missing}")


def test_every_row_is_a_real_megatron_option():
    """No row for an option Megatron does not have (a typo would classify nothing)."""
    fields, dests = _config_fields(), _shipped()
    for row in MEGATRON_OPTIONS:
        if row.args_only:
            assert row.name in dests and row.name not in fields, row.name
            assert row.carried_to is None or row.carried_to in fields, row.name
        else:
            assert row.name in fields, row.name
    assert {row.name for row in MEGATRON_OPTIONS
            if not row.name.startswith(PREFIXES)} == EXTRA_FIELDS


def test_architecture_fields_are_megatron_config_fields():
    """ARCHITECTURE_FIELDS names fields of Megatron's config (MLA's included): a typo
    would protect nothing."""
    from megatron.core.transformer import MLATransformerConfig

    fields = {f.name for f in dataclasses.fields(MLATransformerConfig)}
    assert sorted(ARCHITECTURE_FIELDS - fields) == []


def test_no_adaptable_row_defines_the_model():
    """``adapt`` replaces only implementation choices: every row that refuses a value of
    an architecture, layout or precision field is marked not adaptable, and a row that
    says otherwise is refused when the table is built."""
    from megatron_lrmoe.options.megatron import MegatronOption

    for row in MEGATRON_OPTIONS:
        if row.refuse is not None and row.name in ARCHITECTURE_FIELDS:
            assert not row.adaptable, row.name
    # The option table's refused rows on these fields: they exist, so the check bites.
    assert {"moe_latent_size", "expert_tensor_parallel_size", "moe_expert_capacity_factor",
            "fp8"} <= {r.name for r in MEGATRON_OPTIONS
                       if r.refuse is not None and r.name in ARCHITECTURE_FIELDS}
    with pytest.raises(ValueError, match="hidden_size: defines the model"):
        MegatronOption("hidden_size", Handling.REFUSED, "why", refuse=bool, problem="p")
    MegatronOption("hidden_size", Handling.REFUSED, "why", refuse=bool, problem="p",
                   adaptable=False)


def _megatron_lm_checkout() -> str | None:
    path = os.environ.get("MEGATRON_LM")
    if not path:
        return None
    from megatron_lrmoe.options.megatron_support import megatron_lm_version

    version = megatron_lm_version(path)
    return path if version is not None and version.startswith("0.19.") else None


@pytest.mark.skipif(_megatron_lm_checkout() is None,
                    reason="opt-in: set MEGATRON_LM to a Megatron-LM core_v0.19.0 checkout")
def test_shipped_megatron_lm_arguments_equal_the_checkout():
    """The shipped list is what the checkout's own parser has (regenerated in a process
    of its own: the checkout's megatron package must not meet the installed one)."""
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.options.megatron", "megatron-lm-args",
         _megatron_lm_checkout()], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    assert rows(proc.stdout) == rows(SHIPPED.read_text()), (
        "Megatron-LM's arguments changed: regenerate tests/fixtures/megatron_lm_0.19_moe_args.tsv "
        "with python -m megatron_lrmoe.options.megatron megatron-lm-args CHECKOUT -o ... "
        "and classify the new ones")


def test_refusals_name_megatron_lm_flags():
    """A refusal names the flag a Megatron-LM user typed (read from Megatron-LM's parser);
    a field that no flag sets is named as the field."""
    dests = _shipped()
    carried = {row.carried_to: row.name for row in MEGATRON_OPTIONS if row.carried_to}
    for row in MEGATRON_OPTIONS:
        if row.refuse is None:
            continue
        flag = flag_of(row.name)
        if row.name in dests:
            assert flag in dests[row.name][0], (row.name, flag)
        elif row.name in carried and carried[row.name] in dests:
            assert flag in dests[carried[row.name]][0], (row.name, flag)
        elif row.name.startswith(PREFIXES):      # a config field without a flag
            assert flag == row.name, (row.name, flag)


def test_megatron_defaults_are_not_refused():
    """Leaving an option alone never trips a refusal: Megatron-Core's dataclass default,
    Megatron-LM's parser default, and the default after Megatron's __post_init__ all pass
    (but for what --moe-lrmoe requires instead: REQUIRED)."""
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    fields, dests = _config_fields(), _shipped()
    built = LRMoETransformerConfig(**LRMOE_CONFIG)
    for row in MEGATRON_OPTIONS:
        if row.refuse is None:
            continue
        defaults = []
        if row.name in fields:
            defaults += [_field_default(fields[row.name]), getattr(built, row.name)]
        if row.name in dests:
            defaults.append(ast.literal_eval(dests[row.name][1]))
        assert defaults, row.name
        for default in defaults:
            if row.name in REQUIRED:
                assert not row.refuse(REQUIRED[row.name]), row.name
            else:
                assert not row.refuse(default), (row.name, default)


def _allowed_by_megatron(field: str, **settings: Any) -> set[str]:
    """Megatron's own list of valid module names for ``field``, from its refusal of an
    unknown one (the set is local to TransformerConfig.__post_init__)."""
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(AssertionError) as err:
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                          **{field: ["no_such_module"]}, **settings)
    text = str(err.value)
    assert "Allowed modules are: " in text, text
    return ast.literal_eval(text.split("Allowed modules are: ", 1)[1].strip())


def test_every_megatron_recompute_module_is_classified():
    """Each selective-recompute module Megatron knows is implemented under --moe-lrmoe
    (RECOMPUTE_MODULES); one it adds fails here until classified."""
    allowed = _allowed_by_megatron("recompute_modules", recompute_granularity="selective")
    assert "moe" in allowed and "gdn_norm_out" in allowed
    assert allowed == set(RECOMPUTE_MODULES)


def test_every_megatron_offload_module_is_classified():
    allowed = _allowed_by_megatron("offload_modules", fine_grained_activation_offloading=True)
    assert "expert_fc1" in allowed and "core_attn" in allowed
    assert allowed == set(OFFLOAD_MODULES_AS_IS) | set(OFFLOAD_MODULES_REFUSED)
    assert not set(OFFLOAD_MODULES_AS_IS) & set(OFFLOAD_MODULES_REFUSED)


# -----------------------------------------------------------------------------
# Every refusal enforced, naming the flag
# -----------------------------------------------------------------------------

# A value each refusing row refuses (what a user would set), chosen here, not by the table.
REFUSED_EXAMPLES: dict[str, Any] = {
    "moe_token_dispatcher_type": "allgather",
    "moe_expert_capacity_factor": 1.0, "expert_tensor_parallel_size": 2,
    "moe_apply_probs_on_input": True, "overlap_moe_expert_parallel_comm": True,
    "delay_wgrad_compute": True, "moe_shared_expert_overlap": True, "cuda_graph_impl": "local",
    "moe_latent_size": 4, "fp8": "e4m3", "moe_router_dtype": "fp64",
    "moe_token_drop_policy": "position", "moe_pad_expert_input_to_capacity": True,
    "moe_permute_fusion": True, "moe_router_padding_for_quantization": True,
    "moe_router_padding_for_fp8": True, "moe_pad_experts_for_cuda_graph_inference": True,
    "moe_single_grouped_weight": True, "moe_single_grouped_bias": True,
    "moe_mlp_glu_interleave_size": 32, "moe_expert_rank_capacity_factor": 1.5,
    "moe_paged_stash": True, "moe_paged_stash_page_size": 128,
    "moe_paged_stash_buffer_size_factor_cuda": 1.5, "moe_paged_stash_buffer_size_factor_cpu": 1.0,
    "moe_enable_deepep": True, "moe_flex_dispatcher_backend": "hybridep",
    "moe_flex_dispatcher_num_sms": 24, "moe_deepep_num_sms": 20, "moe_hybridep_num_sms": 16,
    "moe_hybridep_num_blocks_permute": 8, "moe_hybridep_num_blocks_unpermute": 8,
    "moe_hybridep_num_sms_preprocessing": 64, "moe_hybridep_pad_uneven_dispatch_inputs": True,
    "moe_permute_fusion_into_hybridep": True, "moe_ncclep_static_shape": True,
    "moe_ncclep_zero_copy": True, "overlap_dispatch_backward_with_experts_wgrad": True,
    "mlp_chunks_for_training": 2, "transformer_impl": "inference_optimized",
    "cuda_graph_modules": ["moe_router"], "cuda_graph_scope": ["moe"],
    "cuda_graph_scope_deprecated": ["attn"], "cuda_graph_warmup_steps": 5,
    "cuda_graph_use_single_mempool": False, "cuda_graph_retain_backward_graph": True,
    "enable_cuda_graph": True, "external_cuda_graph": True,
    "offload_modules": ["core_attn", "moe_act"], "cpu_offloading": True,
    "fp8_recipe": "tensorwise", "fp8_param": True, "fp8_param_gather": True,
    "fp8_quantizer_factory": "pkg.quantizers.factory", "fp8_margin": 1, "fp8_interval": 2,
    "fp8_amax_history_len": 16, "fp8_amax_compute_algo": "max", "fp8_wgrad": False,
    "fp8_output_proj": True, "fp8_dot_product_attention": True,
    "fp8_multi_head_attention": True, "fp4": "e2m1", "fp4_recipe": "custom", "fp4_param": True,
    "fp4_quantizer_factory": "pkg.quantizers.factory", "moe_use_upcycling": True,
    "moe_upcycling_granularity": 2,
}
REFUSING = [row.name for row in MEGATRON_OPTIONS if row.refuse is not None]
CONFIG_REFUSING = [name for name in REFUSING if not megatron_option(name).args_only]


def test_examples_cover_every_refusal():
    assert sorted(REFUSED_EXAMPLES) == sorted(REFUSING)
    for name in REFUSING:
        assert megatron_option(name).refuse(REFUSED_EXAMPLES[name]), name


def _assert_names_the_flag(name: str, message: str) -> None:
    flag = flag_of(name)
    assert message.startswith(f"{flag}: "), message
    assert "--moe-lrmoe" in message, message   # says whose refusal it is


@pytest.mark.parametrize("name", CONFIG_REFUSING)
def test_refused_by_the_config(name):
    """LRMoETransformerConfig, which both entry points build: refused by name with
    --moe-lrmoe, before Megatron's own checks of it; without --moe-lrmoe not LRMoE's
    business (Megatron may still refuse it on its own)."""
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    kwargs = dict(LRMOE_CONFIG, **{name: REFUSED_EXAMPLES[name]})
    with pytest.raises(LRMoEConfigError) as err:
        LRMoETransformerConfig(**kwargs)
    assert err.value.field == name
    _assert_names_the_flag(name, str(err.value))
    kwargs["moe_lrmoe"] = False
    try:
        LRMoETransformerConfig(**kwargs)
    except Exception as exc:  # noqa: BLE001 - Megatron's refusals are any exception type
        assert not isinstance(exc, LRMoEConfigError), exc


@pytest.fixture
def megatron_lm_config_builder(monkeypatch):
    """Megatron-LM's ``core_transformer_config_from_args`` as far as LRMoE depends on it:
    same-named args fill the config class (no checkout here)."""
    def build(args, config_class):
        fields = {f.name for f in dataclasses.fields(config_class)}
        return config_class(**{k: v for k, v in vars(args).items() if k in fields})

    training = types.ModuleType("megatron.training")
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = build
    training.arguments = arguments
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)


@pytest.mark.parametrize("name", CONFIG_REFUSING)
def test_refused_on_megatron_lm_config_path(megatron_lm_config_builder, name):
    """Megatron-LM's path: the config built from its args, the refusal a ConfigError
    naming the flag (what pretrain_gpt.py reports)."""
    args = argparse.Namespace(**{**{o.field: o.default for o in OPTIONS}, **LRMOE_CONFIG,
                                 name: REFUSED_EXAMPLES[name]})
    with pytest.raises(ConfigError) as err:
        megatron_lm.lrmoe_config_from_args(args)
    _assert_names_the_flag(name, str(err.value))


def _parsed(**overrides: Any) -> SimpleNamespace:
    """Parsed flags under the config's field names, as both entry points hand them to
    ``validate_lrmoe_flags``."""
    view = {o.field: o.default for o in OPTIONS}
    view.update(moe_lrmoe=True, num_moe_experts=4, moe_token_dispatcher_type="alltoall",
                add_bias_linear=False, expert_tensor_parallel_size=1)
    view.update(overrides)
    return SimpleNamespace(**view)


@pytest.mark.parametrize("name", REFUSING)
def test_refused_at_parse_time(name):
    """The parse-time check of both entry points (``validate_lrmoe_flags``), for every
    refusing row, Megatron-LM-only arguments included, whenever the parsed flags carry
    it; and not without --moe-lrmoe."""
    with pytest.raises(ConfigError) as err:
        validate_lrmoe_flags(_parsed(**{name: REFUSED_EXAMPLES[name]}))
    _assert_names_the_flag(name, str(err.value))
    validate_lrmoe_flags(_parsed(moe_lrmoe=False, **{name: REFUSED_EXAMPLES[name]}))


def test_offload_refusal_names_the_modules():
    with pytest.raises(ConfigError) as err:
        validate_lrmoe_flags(_parsed(offload_modules=["core_attn", "mlp_norm", "moe_act",
                                                       "expert_fc1"]))
    message = str(err.value)
    assert message.startswith("--offload-modules: 'moe_act', 'expert_fc1' not supported")
    validate_lrmoe_flags(_parsed(fine_grained_activation_offloading=True,
                                 offload_modules=sorted(OFFLOAD_MODULES_AS_IS)))


LAUNCHER_BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
    "--mock-data", "--num-experts", "4", "--moe-router-topk", "2", "--moe-lrmoe",
    "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
]
# The launcher's flags that the table refuses (some values of), as command-line text.
LAUNCHER_REFUSED = {
    "moe_router_dtype": ["--moe-router-dtype", "fp64"],
    "moe_token_drop_policy": ["--moe-token-drop-policy", "position"],
    "moe_pad_expert_input_to_capacity": ["--moe-pad-expert-input-to-capacity"],
    "moe_permute_fusion": ["--moe-permute-fusion"],
    "moe_expert_capacity_factor": ["--moe-expert-capacity-factor", "1.0"],
    "expert_tensor_parallel_size": ["--expert-tensor-parallel-size", "2"],
}
# Tested with the launcher in tests/launcher/test_arguments.py (LRMOE_INVALID) or refused by its
# argparse choices already.
LAUNCHER_ELSEWHERE = {"moe_token_dispatcher_type", "recompute_modules", "transformer_impl"}


def test_launcher_refusals_cover_its_flags():
    dests = {a.dest for a in build_parser()._actions}
    refusable = {row.name for row in MEGATRON_OPTIONS if row.refuse is not None} & dests
    assert refusable == set(LAUNCHER_REFUSED) | (LAUNCHER_ELSEWHERE & refusable)


@pytest.mark.parametrize("name", sorted(LAUNCHER_REFUSED))
def test_refused_by_the_launcher(monkeypatch, name):
    """The lean launcher refuses at parse time, before any process group, by name."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as err:
        parse_args(LAUNCHER_BASE + LAUNCHER_REFUSED[name])
    # (--moe-permute-fusion meets the launcher's "needs Transformer Engine" first off CUDA)
    assert str(err.value).startswith(flag_of(name)), err.value


MEGATRON_LM_ONLY_REFUSING = [row.name for row in MEGATRON_OPTIONS
                             if row.args_only and row.refuse is not None]


@pytest.mark.parametrize("name", MEGATRON_LM_ONLY_REFUSING)
def test_megatron_lm_parse_time_check_sees_megatron_lm_only_arguments(name):
    """Megatron-LM-only arguments (no TransformerConfig field) are refused at parse time,
    named, not later under another flag's name."""
    defaults = {o.field: o.default for o in OPTIONS} | {"moe_lrmoe": True}
    args = argparse.Namespace(**defaults, num_experts=4, moe_token_dispatcher_type="alltoall",
                              add_bias_linear=False, moe_expert_capacity_factor=None,
                              expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                              yaml_cfg=None, **{name: REFUSED_EXAMPLES[name]})
    with pytest.raises(ConfigError) as err:
        megatron_lm.check_megatron_lm_args(args)
    _assert_names_the_flag(name, str(err.value))


def test_summary_of_the_table():
    """The classes as docs/decisions.md reports them (a change here is a decision)."""
    refused = {row.name for row in MEGATRON_OPTIONS if row.handling is Handling.REFUSED}
    assert {"moe_enable_routing_replay", "moe_router_score_function",
            "moe_router_load_balancing_type", "fine_grained_activation_offloading",
            "moe_router_force_biased", "moe_routing_trace_path"}.isdisjoint(refused)
    assert {"moe_expert_rank_capacity_factor", "moe_paged_stash", "cuda_graph_modules",
            "moe_mlp_glu_interleave_size", "moe_single_grouped_weight",
            "moe_use_upcycling"} <= refused
    assert megatron_option("offload_modules").refuse(["expert_fc1"])
    assert megatron_option("offload_modules").refuse(["moe_act"])


# -----------------------------------------------------------------------------
# Works as is: Megatron's router features under the LRMoE layer (pool tasks)
# -----------------------------------------------------------------------------

HIDDEN, FFN, EXPERTS, TOKENS = 16, 24, 8, 12
RTOL, ATOL = 1e-5, 1e-6     # "Equal" as docs/design.md, "Exactness", defines it (fp32)


def _layers(ep: int, **settings: Any):
    """Megatron's MoELayer and an LRMoELayer (no drops) with the same weights."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(123)
    common = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                  moe_ffn_hidden_size=FFN, num_moe_experts=EXPERTS, moe_router_topk=2,
                  moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                  moe_router_load_balancing_type="aux_loss", expert_model_parallel_size=ep,
                  add_bias_linear=False, bias_activation_fusion=False, gated_linear_unit=True,
                  activation_func=F.silu, **settings)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp
    # 0.19's MoE position is a builder (functools.partial of MoELayer): called with the config.
    megatron = spec(config=TransformerConfig(**common))
    lrmoe = to_lrmoe_spec(spec)(config=LRMoETransformerConfig(
        **common, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=math.inf))
    lrmoe.load_state_dict(megatron.state_dict())
    setup_lrmoe_layers([lrmoe], None, 1)
    return megatron, lrmoe


def _inputs():
    import torch.distributed as dist

    g = torch.Generator().manual_seed(2000 + dist.get_rank())
    return torch.randn(TOKENS, 2, HIDDEN, generator=g), torch.randn(TOKENS, 2, HIDDEN, generator=g)


def _run(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def _equal(a, b) -> bool:
    out_a, dx_a, grads_a = a
    out_b, dx_b, grads_b = b
    return (torch.allclose(out_a, out_b, rtol=RTOL, atol=ATOL)
            and torch.allclose(dx_a, dx_b, rtol=RTOL, atol=ATOL)
            and sorted(grads_a) == sorted(grads_b)
            and all(torch.allclose(g, grads_b[n], rtol=RTOL, atol=ATOL)
                    for n, g in grads_a.items()))


def _dispatched_pairs(log) -> list[tuple[int, int]]:
    """(token, expert) of every pair the region dispatched on this rank (one call)."""
    (record,) = log.records
    return sorted(zip(record.pair_token.tolist(), record.pair_expert.tolist(), strict=True))


def _routing_replay(ep: int) -> dict:
    """Record one routing, then replay another: the LRMoE layer dispatches exactly the
    replayed pairs and equals Megatron's MoELayer replaying the same indices."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_lrmoe.layer.region import record_kept_pairs

    megatron, lrmoe = _layers(ep, moe_enable_routing_replay=True)
    x, dy = _inputs()
    replays = (megatron.router.router_replay, lrmoe.router.router_replay)
    try:
        for replay in replays:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        natural = _run(lrmoe, x, dy)
        _run(megatron, x, dy)
        recorded = replays[1].get_recorded_indices().clone()
        same_record = torch.equal(recorded, replays[0].get_recorded_indices())
        # Another routing: every token's experts shifted by one (still k distinct).
        target = (recorded + 1) % EXPERTS
        for replay in replays:
            replay.clear_indices()
            replay.set_target_indices(target)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        with record_kept_pairs() as log:
            replayed = _run(lrmoe, x, dy)
        reference = _run(megatron, x, dy)
    finally:
        RouterReplay.clear_global_router_replay_instances()
    wanted = sorted((t, e) for t in range(target.shape[0]) for e in target[t].tolist())
    return {"same_record": same_record, "recorded_shape": tuple(recorded.shape),
            "dispatched_replayed": _dispatched_pairs(log) == wanted,
            "equals_megatron": _equal(replayed, reference),
            "differs_from_natural": not torch.allclose(replayed[0], natural[0])}


@pytest.mark.parametrize("pool_name,ep", [("gloo1", 1), ("gloo2", 2)])
def test_routing_replay_works_as_is(request, pool_name, ep):
    for rank, r in enumerate(request.getfixturevalue(pool_name).run(_routing_replay, ep)):
        assert r["recorded_shape"] == (TOKENS * 2, 2), (rank, r)
        assert r["same_record"] and r["dispatched_replayed"], (rank, r)
        assert r["equals_megatron"] and r["differs_from_natural"], (rank, r)


def _router_trace(output_dir: str) -> dict:
    """Megatron-LM's router tracer on a model holding an LRMoE layer: its record is the
    routing the region dispatched."""
    from megatron.core.transformer.moe.router_trace import RouterTracer

    from megatron_lrmoe.layer.region import record_kept_pairs

    _, lrmoe = _layers(1)
    model = torch.nn.Module()      # named as GPTModel names it: decoder.layers.<n>.mlp
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].mlp = lrmoe
    tracer = RouterTracer(output_dir, max_steps=1, rank=0, training_mode=True)
    tracer.register_hooks(model)
    x, dy = _inputs()
    # The hook skips CUDA-graph capture by asking CUDA, which a CPU machine cannot answer
    # (torch's CUDA build without a driver raises): nothing is being captured here.
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False), \
            record_kept_pairs() as log:
        _run(lrmoe, x, dy)
    tracer.advance_step()
    with open(tracer.output_path) as f:
        records = [json.loads(line) for line in f]
    traced = sorted((t, e) for record in records
                    for t, experts in enumerate(record["top_indices"]) for e in experts)
    return {"records": len(records), "layer": records[0]["layer"] if records else None,
            "equal": traced == _dispatched_pairs(log)}


def test_router_trace_works_as_is(gloo1, tmp_path):
    (r,) = gloo1.run(_router_trace, str(tmp_path))
    assert r == {"records": 1, "layer": 0, "equal": True}


def _shared_expert_gate(ep: int) -> dict:
    megatron, lrmoe = _layers(ep, moe_shared_expert_intermediate_size=32,
                              moe_shared_expert_gate=True)
    x, dy = _inputs()
    ours, reference = _run(lrmoe, x, dy), _run(megatron, x, dy)
    return {"gate": "shared_experts.gate_weight" in ours[2], "equal": _equal(ours, reference)}


def test_shared_expert_gate_works_as_is(gloo2):
    for rank, r in enumerate(gloo2.run(_shared_expert_gate, 2)):
        assert r == {"gate": True, "equal": True}, (rank, r)
