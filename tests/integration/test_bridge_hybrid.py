"""LRMoE in Bridge's hybrid (Mamba) recipes: Nemotron-3 Nano's pretraining and SFT recipes.

Without training: ``enable_lrmoe(adapt=True)`` accepts them (the 8 x H100 pretraining recipe
writes its provider out; the GB200 and SFT ones build it from the model's Hub config through
AutoBridge, the fixture tests/fixtures/hf_configs/nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16),
changes only what the option table marks adaptable (the oracle of what each recipe sets is
its source in Bridge 0.6.2, megatron/bridge/recipes/nemotronh/h100/nemotron_3_nano.py and
megatron/bridge/recipes/nemotronh/gb200/nemotron_3_nano.py), and every other field, the
architecture included, stays the recipe's. Both pretraining recipes build the same
architecture, which holds the fixture to the 8 x H100 recipe's literal one. The provider's
``provide`` hands Megatron's HybridModel the default (TE) hybrid stack spec with LRMoE in
its MoE layer only: Mamba, attention, MLP and MTP entries are Megatron's, unchanged. An
``auto`` memory budget is refused naming the field (the memory account does not cover
Mamba layers); a fixed budget prices the pattern's MoE layers.

Training: the 8 x H100 recipe shrunk, trained by Bridge's ``pretrain`` at EP 2 on two gloo
ranks with LRMoE at gamma = inf and with Megatron's MoE layer (the same adapted recipe,
``model.moe_lrmoe=false``): the first step's loss (the forward) and every gradient equal,
then every step's loss; the LRMoE run (popularity placement, a fixed budget) saved at step 2
and resumed: bitwise its losses, parameters and step state.

Mamba layers cannot run here: Megatron's MambaMixer runs the GPU kernels of mamba_ssm and
causal_conv1d and refuses to be built without mamba_ssm, which is not installed on this CPU
machine. So the shrunk pattern holds attention and MoE layers only (``*E*E``, in the local
flavour of lrmoe_testing/local_hybrid.py), with one MTP layer (``*E``, as Nemotron-3.5 Lightning
adds).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from lrmoe_testing import bridge as harness
from tests.integration.test_bridge_config import _built, _fields
from tests.integration.test_bridge_training import _enable, _equal
from tests.integration.test_bridge_training import _recorder as training_recorder
from tests.layer.test_lrmoe_layer import ATOL, RTOL

NANO = harness.NEMOTRON_3_NANO                   # the 8 x H100 recipe: its provider written out
NANO_GB200 = "nemotron_3_nano_gb200_pretrain_config"   # from the Hub config, via AutoBridge
NANO_SFT = "nemotron_3_nano_sft_config"                 # full fine-tuning, from the Hub config

# What each recipe sets that LRMoE cannot run, on a machine without CUDA, and what it needs:
# the HybridEP flex dispatcher, permute fusion and TE's per-layer CUDA graphs (the
# pretraining recipes capture attention and Mamba layers, the GB200 one the MoE router and
# preprocess too; the SFT recipe asks for DeepEP, whose backend name is Megatron's default,
# and sets HybridEP's SM count).
_ADAPTED = {"model.moe_token_dispatcher_type": ("flex", "alltoall"),
            "model.cuda_graph_impl": ("transformer_engine", "none"),
            "model.moe_permute_fusion": (True, False),
            "model.moe_flex_dispatcher_backend": ("hybridep", None),
            "model.moe_hybridep_num_sms": (16, None)}
EXPECTED = {
    NANO: {**_ADAPTED, "model.cuda_graph_modules": (["attn", "mamba"], "full")},
    NANO_GB200: {**_ADAPTED, "model.cuda_graph_modules": (
        ["attn", "mamba", "moe_router", "moe_preprocess"], "full")},
    NANO_SFT: {k: _ADAPTED[k] for k in ("model.moe_token_dispatcher_type",
                                        "model.moe_permute_fusion", "model.moe_hybridep_num_sms")},
}


@pytest.fixture
def recipe(bridge):
    """A fresh copy of a recipe's config (built once per recipe, in test_bridge_config's cache)."""
    return lambda name: copy.deepcopy(_built(name))


def _names(value):
    """A list of Megatron's ``CudaGraphModule`` members as their names."""
    return [getattr(v, "name", v) for v in value] if isinstance(value, list) else value


@pytest.mark.parametrize("name", list(EXPECTED))
def test_adapt_changes_only_implementation_choices(recipe, capsys, name):
    from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.bridge import enable_lrmoe, refused_settings
    from megatron_lrmoe.options.lrmoe import OPTIONS
    from megatron_lrmoe.options.megatron import megatron_option

    cfg = recipe(name)
    before = _fields(cfg.model)
    changes = enable_lrmoe(cfg, adapt=True)
    assert capsys.readouterr().out.splitlines() == [f"enable_lrmoe: {c}" for c in changes]
    assert {c.path: (_names(c.old), c.new) for c in changes} == EXPECTED[name]
    assert refused_settings(cfg) == []
    model = cfg.model
    assert isinstance(model, HybridModelProvider) and isinstance(model, LRMoETransformerConfig)
    changed = {c.path.removeprefix("model.") for c in changes}
    assert all(megatron_option(f).adaptable and not megatron_option(f).refuse(getattr(model, f))
               for f in changed)
    assert not changed & {*ARCHITECTURE, "num_layers", "hybrid_layer_pattern"}
    # Every other field of the recipe's provider is kept, and LRMoE's start at their defaults.
    after = _fields(model)
    ours = {o.field: o.default for o in OPTIONS} | {"moe_lrmoe": True}
    assert after.keys() - ours.keys() == before.keys()
    assert [f for f in before.keys() - changed if after[f] != before[f]] == []
    assert all(after[f] == value for f, value in ours.items())
    model.apply_rope_fusion = False               # a TE kernel the recipes ask for
    model.finalize()                              # Bridge's deferred checks and LRMoE's pass


# The architecture of a Nemotron-3 Nano provider: what both recipes must agree on.
ARCHITECTURE = [
    "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_router_topk", "moe_router_topk_scaling_factor", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "activation_func",
    "normalization", "gated_linear_unit", "add_bias_linear", "position_embedding_type",
    "layernorm_epsilon", "share_embeddings_and_output_weights", "is_hybrid_model",
]


def _pattern(model) -> str:
    return model.hybrid_layer_pattern or model.hybrid_override_pattern


def test_both_recipes_build_the_same_architecture(recipe):
    """The GB200 recipe's provider comes from the fixture config.json through Bridge's
    Nemotron-H conversion, the 8 x H100 one is written out in its recipe: the same model."""
    ours, theirs = recipe(NANO_GB200).model, recipe(NANO).model
    assert {f: getattr(ours, f) for f in ARCHITECTURE} == {f: getattr(theirs, f)
                                                            for f in ARCHITECTURE}
    assert _pattern(ours) == _pattern(theirs)
    assert ours.num_layers == theirs.num_layers == 52


def test_provide_hands_megatron_the_stack_spec_with_lrmoe_in_its_moe_layer(recipe,
                                                                          monkeypatch):
    """Bridge's ``provide`` with the recipe's default (TE) hybrid stack spec, up to
    Megatron's HybridModel (a recording stand-in: TE's layers cannot be built here)."""
    import megatron.bridge.models.hybrid.hybrid_provider as hybrid_provider
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lrmoe.integration.bridge import enable_lrmoe
    from megatron_lrmoe.layer.experts import LRMoESequentialMLP
    from megatron_lrmoe.layer.moe_layer import LRMoELayer
    from megatron_lrmoe.layer.spec_utils import builder_class, builder_submodules

    cfg = recipe(NANO)
    enable_lrmoe(cfg, adapt=True)
    model = cfg.model
    model.vocab_size = 256
    built = []
    monkeypatch.setattr(hybrid_provider, "MCoreHybridModel",
                        lambda **kwargs: built.append(kwargs["hybrid_stack_spec"]))
    model.provide(pre_process=True, post_process=True)
    model.moe_lrmoe = False
    model.provide(pre_process=True, post_process=True)
    lrmoe, megatron = built
    assert model.hybrid_stack_spec is None              # the field keeps the recipe's value
    assert megatron is hybrid_stack_spec
    assert lrmoe.module is megatron.module
    for field in dataclasses.fields(megatron.submodules):
        if field.name != "moe_layer":                   # Mamba, attention, MLP, MTP: Megatron's
            assert getattr(lrmoe.submodules, field.name) is getattr(megatron.submodules,
                                                                    field.name), field.name
    ours, theirs = lrmoe.submodules.moe_layer.submodules, megatron.submodules.moe_layer.submodules
    assert builder_class(theirs.mlp) is MoELayer
    assert builder_class(ours.mlp) is LRMoELayer
    assert builder_class(builder_submodules(ours.mlp).experts) is LRMoESequentialMLP
    assert builder_submodules(ours.mlp).router is builder_submodules(theirs.mlp).router
    assert ours.pre_mlp_layernorm is theirs.pre_mlp_layernorm


AUTO_REFUSED = (r"^model\.moe_lrmoe_memory_budget_gb: auto is not supported for hybrid "
                r"\(Mamba\) models")


def test_auto_budget_is_refused_and_a_fixed_one_prices_the_patterns_moe_layers(recipe):
    from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_layer_counts

    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe
    from megatron_lrmoe.integration.planner_inputs import planner_settings, resolve_memory_budget
    from megatron_lrmoe.planning.machine import MachineConstants

    with pytest.raises(BridgeConfigError, match=AUTO_REFUSED):
        enable_lrmoe(recipe(NANO), adapt=True, moe_lrmoe_memory_budget_gb="auto")
    cfg = recipe(NANO)
    enable_lrmoe(cfg, adapt=True, moe_lrmoe_memory_budget_gb=40.0)
    model = cfg.model
    model.apply_rope_fusion = False
    model.finalize()
    machine = MachineConstants(gemm_flops_per_s=1e15, alltoall_bytes_per_s=1e11,
                               source="test")
    settings = planner_settings(model, 8, 8192, 1, machine)
    assert settings.budget_bytes == 40 * 2**30
    # Megatron's own count of the pattern's MoE layers (23 of Nano's 52 layers).
    assert settings.cost.shape.num_layers == get_hybrid_layer_counts(_pattern(model))["E"] == 23
    with pytest.raises(ValueError, match="--moe-lrmoe-memory-budget-gb auto is not supported "
                                         r"for hybrid \(Mamba\) models"):
        resolve_memory_budget(None, model, None)
    model.moe_lrmoe_memory_budget_gb = "auto"          # as an override would set it
    with pytest.raises(BridgeConfigError, match=AUTO_REFUSED):
        model.finalize()


def test_a_hybrid_provider_subclass_keeps_its_class_and_the_hybrid_checks(bridge):
    from megatron.bridge.models.mamba.mamba_provider import MambaModelProvider

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.bridge import (
        LRMoEHybridModelProvider,
        lrmoe_provider_class,
    )
    from megatron_lrmoe.options.lrmoe import LRMoEConfigError

    cls = lrmoe_provider_class(MambaModelProvider)       # Bridge's deprecated Mamba provider
    assert issubclass(cls, MambaModelProvider) and issubclass(cls, LRMoETransformerConfig)
    assert cls is not LRMoEHybridModelProvider and lrmoe_provider_class(cls) is cls
    model = cls(num_moe_experts=4, moe_lrmoe=True, moe_lrmoe_memory_budget_gb="auto")
    with pytest.raises(LRMoEConfigError, match="auto is not supported for hybrid"):
        model.check_lrmoe()


def _hybrid(pattern: str, pp: int = 1, **recompute) -> SimpleNamespace:
    fields = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                  recompute_modules=None)
    return SimpleNamespace(hybrid_layer_pattern=pattern, pipeline_model_parallel_size=pp,
                           num_layers=None, moe_layer_freq=1, **{**fields, **recompute})


def test_moe_layers_of_a_stage_follow_the_pattern():
    from megatron_lrmoe.integration.planner_inputs import recomputed_moe_layers, stage_moe_layers

    assert stage_moe_layers(_hybrid("MEM*EE/*E")) == 3            # MTP layers are not counted
    assert stage_moe_layers(_hybrid("M*E|MEE", pp=2)) == 2        # stages cut at "|"
    assert stage_moe_layers(_hybrid("MEMEM*EE", pp=2)) == 2       # MEME | M*EE
    full = dict(recompute_granularity="full", recompute_num_layers=2)
    assert recomputed_moe_layers(_hybrid("E*EE", **full, recompute_method="uniform")) == \
        (False, 3)
    assert recomputed_moe_layers(_hybrid("E*EE", **full, recompute_method="block")) == (False, 1)


# -----------------------------------------------------------------------------
# Training: LRMoE at gamma = inf against Megatron's MoE layer
# -----------------------------------------------------------------------------

# Four steps; LRMoE's statistics are reduced and written at steps 2 and 4.
STEPS = ["train.train_iters=4", "scheduler.lr_decay_iters=4", "scheduler.lr_warmup_iters=1",
         "logger.log_interval=2"]
# One MTP layer of attention and MoE, as Nemotron-3.5 Lightning's recipe adds to Nano's:
# Megatron builds it from the hybrid stack's submodules, so its MoE layer is LRMoE's too.
MTP = ["model.mtp_num_layers=1", "model.mtp_hybrid_override_pattern=*E"]


def _grads_and_prices(out: dict):
    """A callback recording the first step's gradients (as DDP reduced them) and the MoE
    layers each LRMoE planner prices (test_bridge_training's recorder keeps the rest)."""
    from megatron.bridge.training.callbacks import Callback

    from megatron_lrmoe.integration.step_hooks import lrmoe_layers

    class Record(Callback):
        def on_train_step_end(self, context):
            if "grads" not in out:
                out["grads"] = {name: p.main_grad.detach().clone()
                                for name, p in context.model[0].named_parameters()}

        def on_train_end(self, context):
            costs = [layer.lrmoe_state.planner.settings.cost
                     for layer in lrmoe_layers(context.model)]
            out["priced_layers"] = [c.shape.num_layers for c in costs if c is not None]

    return Record()


def train(lrmoe: bool, overrides: list[str]) -> dict:
    """A pool task: the shrunk Nemotron-3 Nano recipe with one MTP layer, adapted, trained
    by Bridge's ``pretrain`` at EP 2, LRMoE at gamma = inf with popularity placement under a
    fixed memory budget (or, without ``lrmoe``, Megatron's MoE layer): the losses, first
    gradients, MoE layers, final parameters and LRMoE step state."""
    from megatron_lrmoe.integration.bridge import LRMoECallback
    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    setting = (["model.moe_lrmoe_bwd_capacity_factor=inf", "model.moe_lrmoe_placement=popularity",
                "model.moe_lrmoe_memory_budget_gb=4"] if lrmoe else ["model.moe_lrmoe=false"])
    cfg = harness.build_recipe(NANO, [*harness.EP2, *STEPS, *MTP, *setting, *overrides],
                               convert=_enable)
    out: dict = {"losses": []}
    harness.run_pretrain(cfg, [LRMoECallback(), training_recorder(out), _grads_and_prices(out)])
    return out


def test_shrunk_nano_with_lrmoe_at_inf_equals_megatron_and_resumes_bitwise(gloo2, tmp_path):
    ours = gloo2.run(train, True, harness.checkpoint_overrides(save=str(tmp_path), interval=2),
                     timeout=600)
    theirs = gloo2.run(train, False, [], timeout=600)
    resumed = gloo2.run(train, True, [*harness.checkpoint_overrides(load=str(tmp_path)),
                                      "checkpoint.ckpt_step=2"], timeout=600)
    for rank in range(2):
        a, b = ours[rank], theirs[rank]
        names = [name for name, _ in a["moe"]]
        assert names == ["module.decoder.layers.1.mlp", "module.decoder.layers.3.mlp",
                         "module.mtp.layers.0.mtp_model_layer.layers.1.mlp"]
        assert {cls for _, cls in a["moe"]} == {"LRMoELayer"}
        assert b["moe"] == [(name, "MoELayer") for name in names]
        # Every layer's planner prices the decoder's MoE layers (MTP's are not counted in
        # the budget, as for GPT models).
        assert a["priced_layers"] == [2] * len(names)
        assert len(a["losses"]) == 4 and all(math.isfinite(x) for x in a["losses"])
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]),
                                   rtol=RTOL, atol=ATOL)
        assert a["grads"].keys() == b["grads"].keys()
        for name, grad in a["grads"].items():
            torch.testing.assert_close(grad, b["grads"][name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        # Saved at step 2 and resumed: bitwise the rest of the uninterrupted run.
        c = resumed[rank]
        assert c["origin"] == "checkpoint" and c["losses"] == a["losses"][2:]
        assert _equal(c["params"], a["params"]) and _equal(c["state"], a["state"])
        assert a["state"][0]["planner"]["smoothed_counts"] is not None
