"""``enable_lrmoe`` on Bridge's own recipes, without training: the provider it makes, the
recipe settings it refuses or adapts (from the option table), the options and their
checks, the final checks of ``finalize()`` after overrides, and the launcher's refusals.

The recipes read their models' config.json from the pre-filled Hugging Face cache
(the ``bridge`` fixture). The oracle of what each recipe sets is the recipe's source
(megatron/bridge/recipes/qwen/h100/qwen3_moe.py, megatron/bridge/recipes/glm/h100/glm45.py, Bridge
0.6.2); what LRMoE refuses of it is Megatron's option table, whose own tests hold it to
Megatron.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

QWEN_8 = "qwen3_30b_a3b_pretrain_8gpu_h100_bf16_config"
QWEN_16 = "qwen3_30b_a3b_pretrain_config"        # Bridge's alias of the 16 x H100 recipe
GLM_AIR = "glm45_air_106b_pretrain_config"
DEEPSEEK_V3 = "deepseek_v3_pretrain_config"     # multi-latent attention (an MLA provider)
QWEN3_235B = "qwen3_235b_a22b_pretrain_config"  # context parallelism 2

# What each recipe sets that LRMoE cannot run, on a machine without CUDA (where Bridge's
# apply_flex_dispatcher_backend turns DeepEP on for the 8-GPU recipe), and what it needs.
EXPECTED = {
    QWEN_8: {"model.moe_token_dispatcher_type": ("flex", "alltoall"),
             "model.moe_permute_fusion": (True, False),
             "model.moe_hybridep_num_sms": (16, None)},
    QWEN_16: {"model.moe_token_dispatcher_type": ("flex", "alltoall"),
              "model.cuda_graph_impl": ("transformer_engine", "none"),
              "model.moe_permute_fusion": (True, False),
              "model.moe_flex_dispatcher_backend": ("hybridep", None),
              "model.moe_hybridep_num_sms": (32, None),
              "model.cuda_graph_scope": (["moe_router", "moe_preprocess"], None)},
    GLM_AIR: {"model.moe_shared_expert_overlap": (True, False),
              "model.moe_permute_fusion": (True, False),
              "model.moe_hybridep_num_sms": (16, None)},
    DEEPSEEK_V3: {"model.moe_token_dispatcher_type": ("flex", "alltoall"),
                  "model.moe_permute_fusion": (True, False),
                  "model.moe_flex_dispatcher_backend": ("hybridep", None),
                  "model.moe_hybridep_num_sms": (16, None)},
}


@functools.cache
def _built(name: str):
    from megatron_lrmoe.bridge_launcher.cli import recipe_function

    return recipe_function(name)()


@pytest.fixture
def recipe(bridge):
    """A fresh copy of a recipe's config (built once per recipe)."""
    return lambda name: copy.deepcopy(_built(name))


def _fields(model) -> dict:
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_refused_by_default_naming_each_field_and_what_it_needs(recipe, name):
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    cfg = recipe(name)
    before = _fields(cfg.model)
    with pytest.raises(BridgeConfigError) as info:
        enable_lrmoe(cfg)
    text = str(info.value)
    assert "\n" not in text and "adapt=True" in text
    for path, (value, needs) in EXPECTED[name].items():
        assert f"{path}={value} (needs {needs}:" in text
    assert text.count("(needs ") == len(EXPECTED[name])
    assert _fields(cfg.model) == before          # a refusal changes nothing


@pytest.mark.parametrize("name", list(EXPECTED))
def test_adapt_sets_what_lrmoe_needs_prints_each_change_and_keeps_the_rest(recipe, capsys,
                                                                           name):
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.bridge import enable_lrmoe, refused_settings
    from megatron_lrmoe.options.lrmoe import OPTIONS
    from megatron_lrmoe.options.megatron import megatron_option

    cfg = recipe(name)
    before = _fields(cfg.model)
    changes = enable_lrmoe(cfg, adapt=True)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"enable_lrmoe: {c}" for c in changes]
    assert {c.path: (c.old, c.new) for c in changes} == EXPECTED[name]
    assert refused_settings(cfg) == []
    model = cfg.model
    assert isinstance(model, GPTModelProvider) and isinstance(model, LRMoETransformerConfig)
    for change in changes:
        assert not megatron_option(change.path.split(".", 1)[1]).refuse(change.new)
    after = _fields(model)
    lrmoe = {o.field for o in OPTIONS}
    changed = {c.path.split(".", 1)[1] for c in changes}
    assert {k: v for k, v in after.items() if k not in lrmoe | changed} == \
        {k: v for k, v in before.items() if k not in changed}
    assert model.moe_lrmoe and all(after[o.field] == o.default for o in OPTIONS[1:])
    model.apply_rope_fusion = False               # a TE kernel (the 16-GPU recipe asks for it)
    model.finalize()                              # Bridge's deferred checks and LRMoE's pass


def test_adapt_leaves_no_refusal_of_the_container(recipe):
    from megatron_lrmoe.integration.bridge import enable_lrmoe, refused_settings

    cfg = recipe(QWEN_16)
    assert cfg.comm_overlap is not None           # the recipe's TP overlap stays
    enable_lrmoe(cfg, adapt=True)
    assert refused_settings(cfg) == []


def test_context_parallelism_is_kept(recipe):
    """Qwen3-235B-A22B's recipe sets CP 2 (with TP 4 and sequence parallelism): accepted,
    CP kept, and the final checks pass (its changes: the recipe table's test). The
    planners are sized for each rank's S / CP tokens."""
    from megatron_lrmoe.integration.bridge import (
        bridge_tokens_per_rank,
        enable_lrmoe,
        refused_settings,
    )

    cfg = recipe(QWEN3_235B)
    enable_lrmoe(cfg, adapt=True)
    assert refused_settings(cfg) == []
    model = cfg.model
    assert (model.context_parallel_size, model.tensor_model_parallel_size,
            model.sequence_parallel) == (2, 4, True)
    model.finalize()
    seq = model.seq_length
    assert bridge_tokens_per_rank(model, 2) == 2 * seq // (4 * 2)
    model.sequence_parallel = False
    assert bridge_tokens_per_rank(model, 2) == 2 * seq // 2


@pytest.mark.parametrize("path, value, needs", [
    ("model.expert_tensor_parallel_size", 2, 1),
    ("model.moe_expert_capacity_factor", 1.25, None),
    ("model.moe_apply_probs_on_input", True, False),
    ("ddp.use_megatron_fsdp", True, False),
    ("dist.use_torch_fsdp2", True, False),
])
def test_what_would_change_the_model_or_its_layout_is_refused_even_with_adapt(recipe, path,
                                                                            value, needs):
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    cfg = recipe(QWEN_8)
    owner, name = path.split(".")
    setattr(getattr(cfg, owner), name, value)
    with pytest.raises(BridgeConfigError) as info:
        enable_lrmoe(cfg, adapt=True)
    assert f"{path}={value} (needs {needs}:" in str(info.value)
    assert "adapt=True" not in str(info.value)


def test_peft_recipes_are_refused(bridge):
    from megatron_lrmoe.bridge_launcher.cli import recipe_function
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    cfg = recipe_function("qwen3_30b_a3b_peft_config")()
    with pytest.raises(BridgeConfigError, match=r"peft=LoRA \(needs None: PEFT/LoRA"):
        enable_lrmoe(cfg, adapt=True)


def test_unsupported_providers_are_refused_by_name(bridge):
    from megatron.bridge.models.llama_nemotron.llama_nemotron_provider import (
        LlamaNemotronHeterogeneousProvider,
    )

    from megatron_lrmoe.integration.bridge import BridgeConfigError, lrmoe_provider_class

    with pytest.raises(BridgeConfigError, match="LlamaNemotronHeterogeneousProvider uses "
                                                "heterogeneous layers"):
        lrmoe_provider_class(LlamaNemotronHeterogeneousProvider)
    with pytest.raises(BridgeConfigError, match="int is not a GPTModelProvider"):
        lrmoe_provider_class(int)


def test_an_mla_provider_gets_the_lrmoe_mla_config(bridge):
    """Bridge's MLAModelProvider (DeepSeek, Kimi, Moonlight) keeps Megatron's MLA config
    class: its LRMoE provider is also an LRMoEMLATransformerConfig, MLA's fields and
    defaults kept, and Bridge's finalize runs MLA's post-init with LRMoE's checks."""
    from megatron.bridge.models.mla_provider import MLAModelProvider
    from megatron.core.transformer import MLATransformerConfig

    from megatron_lrmoe.config.transformer_config import LRMoEMLATransformerConfig
    from megatron_lrmoe.integration.bridge import BridgeConfigError, lrmoe_provider_class

    cls = lrmoe_provider_class(MLAModelProvider)
    assert cls.__name__ == "LRMoEMLAModelProvider"
    assert issubclass(cls, MLAModelProvider) and issubclass(cls, LRMoEMLATransformerConfig)
    theirs = {f.name: f.default for f in dataclasses.fields(MLAModelProvider)}
    ours = {f.name: f.default for f in dataclasses.fields(cls)}
    assert {k: ours[k] for k in theirs} == theirs
    small = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                 moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                 add_bias_linear=False, q_lora_rank=16, kv_lora_rank=8)
    provider = cls(**small, moe_lrmoe=True)
    provider.finalize()
    assert isinstance(provider, MLATransformerConfig) and provider.moe_lrmoe
    # MLA's own post-init check runs (it is MLATransformerConfig's, not TransformerConfig's).
    with pytest.raises(NotImplementedError, match="Output gate is not supported for MLA"):
        cls(**small, moe_lrmoe=True, attention_output_gate=True).finalize()
    with pytest.raises(BridgeConfigError, match="model.moe_lrmoe_bwd_capacity_factor"):
        cls(**small, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=0.0).finalize()


def test_a_provider_subclass_keeps_its_class_and_fields(bridge):
    from megatron.bridge.models.stepfun.step35_provider import Step35ModelProvider

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.bridge import lrmoe_provider_class

    cls = lrmoe_provider_class(Step35ModelProvider)
    assert issubclass(cls, Step35ModelProvider) and issubclass(cls, LRMoETransformerConfig)
    assert lrmoe_provider_class(Step35ModelProvider) is cls
    assert lrmoe_provider_class(cls) is cls
    theirs = {f.name: f.default for f in dataclasses.fields(Step35ModelProvider)}
    ours = {f.name: f.default for f in dataclasses.fields(cls)}
    assert {k: ours[k] for k in theirs} == theirs


# One bad value per option, and one good (not the default), by field name.
BAD = {"moe_lrmoe_bwd_capacity_factor": (-1.0, 0.75), "moe_lrmoe_min_retention": (1.5, 0.1),
       "moe_lrmoe_metric": ("nope", "grad"), "moe_lrmoe_selection": ("nope", "topk"),
       "moe_lrmoe_hybrid_fraction": (2.0, 0.25), "moe_lrmoe_store_factor": (0.5, 2.0),
       "moe_lrmoe_kernels": ("nope", "torch"),
       "moe_lrmoe_log_interval": (0, 5), "moe_lrmoe_placement": ("nope", "popularity"),
       "moe_lrmoe_slots_per_rank": (0, 2), "moe_lrmoe_memory_budget_gb": (-1.0, 40.0),
       "moe_lrmoe_load_smoothing": (1.0, 0.9), "moe_lrmoe_calibration": ("/no/such.json", None)}


def test_every_option_has_a_case():
    from megatron_lrmoe.options.lrmoe import OPTIONS

    assert set(BAD) == {o.field for o in OPTIONS[1:]}


@pytest.mark.parametrize("field", list(BAD))
def test_each_option_by_field_name_with_its_flags_check(recipe, field):
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe
    from megatron_lrmoe.options.lrmoe import option

    bad, good = BAD[field]
    cfg = recipe(QWEN_8)
    with pytest.raises(BridgeConfigError) as info:
        enable_lrmoe(cfg, adapt=True, **{field: bad})
    assert str(info.value) == f"model.{field}: {option(field).problem(bad)}"
    cfg = recipe(QWEN_8)
    enable_lrmoe(cfg, adapt=True, **{field: good})
    assert getattr(cfg.model, field) == good


def test_unknown_option_and_the_switch_are_refused_by_name(recipe):
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    with pytest.raises(BridgeConfigError, match=r"model.moe_lrmoe_bwd_capacity: not an LRMoE "
                                                r"option \(did you mean moe_lrmoe_bwd_capacity_"
                                                r"factor\?\)"):
        enable_lrmoe(recipe(QWEN_8), adapt=True, moe_lrmoe_bwd_capacity=0.5)
    with pytest.raises(BridgeConfigError, match="model.moe_lrmoe: is what enable_lrmoe"):
        enable_lrmoe(recipe(QWEN_8), adapt=True, moe_lrmoe=False)
    cfg = recipe(QWEN_8)
    enable_lrmoe(cfg, adapt=True)
    with pytest.raises(BridgeConfigError, match="enabled on this config already"):
        enable_lrmoe(cfg, adapt=True)


def test_overrides_reach_the_lrmoe_fields_and_finalize_checks_the_final_values(recipe):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    cfg = recipe(GLM_AIR)
    enable_lrmoe(cfg, adapt=True)
    cls = type(cfg.model)
    process_config_with_overrides(cfg, cli_overrides=[
        "model.moe_lrmoe_bwd_capacity_factor=0.75", "model.moe_lrmoe_selection=hybrid"])
    assert type(cfg.model) is cls
    assert (cfg.model.moe_lrmoe_bwd_capacity_factor, cfg.model.moe_lrmoe_selection) == \
        (0.75, "hybrid")
    cfg.model.finalize()
    for override, words in [
            ("model.moe_lrmoe_bwd_capacity_factor=-2", "model.moe_lrmoe_bwd_capacity_factor: "
                                                        "must be > 0 or inf, got -2"),
            ("model.moe_token_dispatcher_type=flex", "model.moe_token_dispatcher_type: "
                                                      "--moe-lrmoe needs"),
            ("model.cuda_graph_impl=local", "model.cuda_graph_impl: CUDA graphs are not"),
            ("model.moe_lrmoe_placement=memory-aware", "model.moe_lrmoe_memory_budget_gb: "
                                                        "--moe-lrmoe-placement memory-aware "
                                                        "needs a budget")]:
        bad = copy.deepcopy(cfg)
        process_config_with_overrides(bad, cli_overrides=[override])
        with pytest.raises(BridgeConfigError) as info:
            bad.model.finalize()
        assert str(info.value).startswith(words)


def test_inf_capacity_survives_the_overrides_round_trip(recipe):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_lrmoe.integration.bridge import enable_lrmoe

    cfg = recipe(QWEN_8)
    enable_lrmoe(cfg, adapt=True, moe_lrmoe_bwd_capacity_factor=math.inf)
    process_config_with_overrides(cfg, cli_overrides=["train.train_iters=3"])
    assert cfg.model.moe_lrmoe_bwd_capacity_factor == math.inf


def test_fp8_from_the_mixed_precision_recipe_is_refused_at_finalize(recipe):
    from megatron.bridge.training.mixed_precision import bf16_with_fp8_delayed_scaling_mixed

    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe

    cfg = recipe(QWEN_8)
    enable_lrmoe(cfg, adapt=True)
    cfg.model.finalize()                 # bf16 recipe: its FP8 knobs act on nothing
    bf16_with_fp8_delayed_scaling_mixed().setup(cfg.model)
    with pytest.raises(BridgeConfigError, match="model.fp8: FP8 is not supported"):
        cfg.model.finalize()


# -----------------------------------------------------------------------------
# The launcher's errors: one line, exit status 2
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["--recipe", "qwen3_30b_a3b_pretrain_cfg"],
     "error: --recipe qwen3_30b_a3b_pretrain_cfg: not a recipe of megatron.bridge.recipes; "
     "did you mean"),
    (["--recipe", QWEN_16], "error: LRMoE cannot run these recipe settings: "
                            "model.moe_token_dispatcher_type=flex (needs alltoall"),
    (["--recipe", QWEN_8, "--adapt", "model.moe_lrmoe_bwd_capacity_factor=-1"],
     "error: model.moe_lrmoe_bwd_capacity_factor: must be > 0 or inf, got -1"),
    (["--recipe", QWEN_8, "--adapt", "model.moe_lrmoe_metric=nope"],
     "error: model.moe_lrmoe_metric: 'nope' is not one of grad_act, grad, prob, random"),
    (["--recipe", QWEN_8, "--adapt", "model.moe_token_dispatcher_type=allgather"],
     "error: model.moe_token_dispatcher_type: --moe-lrmoe needs"),
    (["--recipe", QWEN_8, "--adapt", "model.no_such_field=1"], "error: "),
    (["--recipe", QWEN_8, "--adapt", "train.train_iters"], "error: train.train_iters: an "
                                                           "override is KEY=VALUE"),
])
def test_launcher_errors_are_one_line(bridge, capsys, argv, words):
    from megatron_lrmoe.bridge_launcher.cli import main

    assert main([*argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(words) and err.count("\n") == 1, err
    assert "Traceback" not in out + err


def test_launcher_dry_run_prints_the_final_config(bridge, capsys):
    from megatron_lrmoe.bridge_launcher.cli import main

    assert main(["--recipe", QWEN_16, "--adapt", "--dry-run",
                 "model.moe_lrmoe_bwd_capacity_factor=0.75", "train.train_iters=7"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "enable_lrmoe: model.cuda_graph_impl: transformer_engine -> none" in out
    assert "model.moe_lrmoe: True" in out
    assert "model.moe_lrmoe_bwd_capacity_factor: 0.75" in out
    assert "model.moe_token_dispatcher_type: alltoall" in out
    assert "train.train_iters: 7" in out
    # The recipe's RoPE fusion (qwen3_moe.py sets it) is a TE kernel, checked off without TE.
    assert (ROPE_NOTE in out) == TE_ABSENT


ROPE_NOTE = ("dry run: model.apply_rope_fusion=True checked as False (a Transformer Engine "
             "kernel; TE is not installed here)")
TE_ABSENT = importlib.util.find_spec("transformer_engine") is None


def test_dry_run_checks_te_kernel_switches_off_only_where_te_is_absent(recipe, monkeypatch):
    """Without TE the switch is checked off on a copy (the config keeps it). With TE it is
    checked as set: claimed here, that meets Megatron-Core's own refusal of the missing
    kernel, so the dry run's leniency is tied to TE's absence alone."""
    from megatron_lrmoe.bridge_launcher.cli import check_final_values
    from megatron_lrmoe.integration.bridge import enable_lrmoe

    cfg = recipe(QWEN_16)
    enable_lrmoe(cfg, adapt=True)
    assert cfg.model.apply_rope_fusion is True
    assert check_final_values(cfg.model) == ([ROPE_NOTE] if TE_ABSENT else [])
    assert cfg.model.apply_rope_fusion is True
    if not TE_ABSENT:
        return
    real_find_spec = importlib.util.find_spec
    te_spec = real_find_spec("json")                   # any spec: "TE is installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: te_spec
                        if name == "transformer_engine" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        check_final_values(cfg.model)


# -----------------------------------------------------------------------------
# The launcher as users run it: a fresh process, without Transformer Engine, offline
# -----------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
HF_CONFIG = {QWEN_16: "Qwen--Qwen3-30B-A3B", GLM_AIR: "zai-org--GLM-4.5-Air",
             QWEN_8: "Qwen--Qwen3-30B-A3B"}


def _user_env(**extra: str) -> dict[str, str]:
    """A bare environment plus the offline Hub cache conftest filled (HF_HUB_CACHE)."""
    from lrmoe_testing.hf_cache import offline_hf_environment

    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "OMP_NUM_THREADS": "1",
            **offline_hf_environment(os.environ["HF_HUB_CACHE"]), **extra}


def _architecture_lines(recipe: str) -> list[str]:
    """What the printed config must carry of the model's Hub config.json (the fixture)."""
    hf = json.loads((REPO / "tests" / "fixtures" / "hf_configs" / HF_CONFIG[recipe]
                     / "config.json").read_text())
    experts = hf.get("num_experts", hf.get("n_routed_experts"))
    return [f"model.num_layers: {hf['num_hidden_layers']}",
            f"model.hidden_size: {hf['hidden_size']}", f"model.num_moe_experts: {experts}",
            f"model.moe_router_topk: {hf['num_experts_per_tok']}"]


AS_USERS_RUN_IT = [QWEN_16, GLM_AIR]        # the launcher's dry run, in a fresh process each
LAUNCHER_NAMES = ["megatron_lrmoe.bridge_launcher", "megatron_lrmoe.bridge"]    # one each
USER_SCRIPT = "qwen3_30b_a3b_bridge_lrmoe.sh"   # the script's dry run, with the real launcher


@pytest.fixture(scope="module")
def dry_runs():
    """The fresh-process dry runs, started together: each is about 10 s of CPU, nearly all
    of it ``import megatron.bridge``, so they overlap on the cores while the tests wait."""
    env = _user_env()
    overrides = ["model.moe_lrmoe_bwd_capacity_factor=0.75", "model.moe_lrmoe_metric=prob",
                 "train.train_iters=7"]
    # GLM's under the launcher's first name, ``megatron_lrmoe.bridge``, which users still run.
    commands = {name: [sys.executable, "-m", module, "--recipe", name, "--adapt", "--dry-run",
                       *overrides]
                for name, module in zip(AS_USERS_RUN_IT, LAUNCHER_NAMES, strict=True)}
    commands[USER_SCRIPT] = ["bash", str(REPO / "scripts" / USER_SCRIPT), "--dry-run",
                             "model.moe_lrmoe_bwd_capacity_factor=0.5"]
    started = {key: subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE,
                                     env={**env, "PYTHON": sys.executable})
               for key, command in commands.items()}

    def finished(key: str) -> subprocess.CompletedProcess[str]:
        out, err = started[key].communicate(timeout=300)
        return subprocess.CompletedProcess(commands[key], started[key].returncode, out, err)

    yield finished
    for process in started.values():                # those of deselected tests
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("name", AS_USERS_RUN_IT)
def test_launcher_dry_run_as_users_run_it(dry_runs, name):
    """``python -m megatron_lrmoe.bridge_launcher --recipe R --adapt --dry-run`` (or under the
    alias ``megatron_lrmoe.bridge``) in a fresh process without Transformer Engine: exit
    status 0, the adaptations the recipe's source calls for (EXPECTED), the architecture of
    the Hub config, and the override values."""
    done = dry_runs(name)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert not [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert [line for line in out if line.startswith("enable_lrmoe: ")] == [
        f"enable_lrmoe: {path}: {old} -> {new}" for path, (old, new) in EXPECTED[name].items()]
    assert (ROPE_NOTE in out) == (TE_ABSENT and name == QWEN_16)   # GLM's leaves it off
    assert f"recipe: {name} (LRMoEGPTModelProvider)" in out
    for line in [*_architecture_lines(name), "model.moe_lrmoe: True",
                 "model.moe_lrmoe_bwd_capacity_factor: 0.75", "model.moe_lrmoe_metric: prob",
                 "model.moe_token_dispatcher_type: alltoall", "train.train_iters: 7"]:
        assert line in out


# -----------------------------------------------------------------------------
# The launch scripts: --dry-run runs the launcher's own --dry-run (the recipe and the
# overrides built and checked here, its output on stderr), then prints the command
# -----------------------------------------------------------------------------

SCRIPTS = {"qwen3_30b_a3b_bridge_lrmoe.sh": (QWEN_8, "1"),
           "qwen3_30b_a3b_16gpu_bridge_lrmoe.sh": (QWEN_16, "2"),
           "glm45_air_bridge_lrmoe.sh": (GLM_AIR, "4")}

# A Python that records the launcher arguments the script's check runs with, and exits
# with FAKE_STATUS (what a refused launch returns): the script's side, without the
# launcher's 10 s of imports; the arguments then run through the real launcher in-process.
FAKE_PYTHON = """#!/bin/sh
[ "$1" = -m ] && [ "$2" = megatron_lrmoe.bridge_launcher ] || exit 99
shift 2
printf '%s\n' "$@" > "$RECORD"
[ "${FAKE_STATUS:-0}" = 0 ] || echo "error: refused" >&2
exit "${FAKE_STATUS:-0}"
"""


def _fake_python(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return {"PYTHON": str(fake), "RECORD": str(tmp_path / "argv")}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_launch_script_dry_run(bridge, capsys, tmp_path, script):
    from megatron_lrmoe.bridge_launcher.cli import main

    env = _user_env(**_fake_python(tmp_path))
    done = subprocess.run(["bash", str(REPO / "scripts" / script), "--dry-run",
                           "model.moe_lrmoe_bwd_capacity_factor=0.5"],
                          capture_output=True, text=True, env=env, timeout=60, check=True)
    command = shlex.split(done.stdout)
    recipe, nodes = SCRIPTS[script]
    assert command[command.index("--nnodes") + 1] == nodes
    args = command[command.index("megatron_lrmoe.bridge_launcher") + 1:]
    assert args[:3] == ["--recipe", recipe, "--adapt"]
    checked = Path(env["RECORD"]).read_text().splitlines()
    assert checked == [*args, "--dry-run"]          # the check is the launch, dry
    assert main(checked) == 0                       # and passes the launcher's checks
    out = capsys.readouterr().out
    assert "model.moe_lrmoe_bwd_capacity_factor: 0.5" in out and "model.moe_lrmoe: True" in out
    assert f"checkpoint.save: {REPO}/runs/" in out
    lrmoe_off = subprocess.run(["bash", str(REPO / "scripts" / script), "--dry-run"],
                               capture_output=True, text=True, env={**env, "LRMOE": "0"},
                               timeout=60, check=True)
    assert " --no-lrmoe " in lrmoe_off.stdout
    assert "--no-lrmoe" in Path(env["RECORD"]).read_text().splitlines()


def test_launch_script_dry_run_stops_where_the_launchers_check_fails(tmp_path):
    env = _user_env(**_fake_python(tmp_path), FAKE_STATUS="2")
    done = subprocess.run(["bash", str(REPO / "scripts" / "glm45_air_bridge_lrmoe.sh"),
                           "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""                        # no command for a launch that fails
    assert done.stderr.endswith("error: refused\n")


def test_launch_script_dry_run_as_users_run_it(dry_runs):
    """The real launcher behind a script's dry run, in its own process, offline: stdout is
    the command, stderr the launcher's checked config."""
    done = dry_runs(USER_SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    command = shlex.split(done.stdout)
    recipe = SCRIPTS[USER_SCRIPT][0]
    assert command[command.index("megatron_lrmoe.bridge_launcher") + 1:][:2] == ["--recipe", recipe]
    checked = done.stderr.splitlines()
    for line in [f"recipe: {recipe} (LRMoEGPTModelProvider)", *_architecture_lines(recipe),
                 "model.moe_lrmoe_bwd_capacity_factor: 0.5",
                 f"checkpoint.save: {REPO}/runs/qwen3_30b_a3b-bridge/checkpoints"]:
        assert line in checked


def test_launch_script_refuses_a_stray_argument():
    script = REPO / "scripts" / "glm45_air_bridge_lrmoe.sh"
    done = subprocess.run(["bash", str(script), "--train-iters", "5"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == ("error: --train-iters: expected --dry-run, --config-file FILE or an "
                           "override KEY=VALUE\n")


# -----------------------------------------------------------------------------
# Asynchronous saves: what a save captures is a copy of the step state
# -----------------------------------------------------------------------------


def test_a_saved_step_state_is_a_copy_later_steps_leave_alone():
    """An asynchronous save writes the state dict built at the save while training goes
    on: the step state it holds must not follow later steps (Bridge builds the sharded
    state dict synchronously, from each LRMoE layer's ``get_extra_state``)."""
    import torch

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.planner_inputs import planner_settings
    from megatron_lrmoe.layer.step_state import LayerStepState

    config = LRMoETransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
        moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
        moe_lrmoe=True, moe_lrmoe_placement="popularity")
    state = LayerStepState(config, ep_size=2)
    state.setup_planner(planner_settings(config, 2), 1)
    counts = torch.tensor([[3.0, 1.0, 0.0, 2.0], [1.0, 4.0, 2.0, 0.0]])
    state.count_training_forward()
    state.finish_step((counts, 1), False, 1)
    saved = state.extra_state()
    kept = copy.deepcopy(saved)
    for _ in range(2):                          # training goes on while the save is written
        state.count_training_forward()
        state.finish_step((counts * 2, 1), False, 1)
    assert saved["step"] == kept["step"] == 1 and state.step == 3
    assert torch.equal(saved["planner"]["smoothed_counts"], kept["planner"]["smoothed_counts"])
    assert not torch.equal(saved["planner"]["smoothed_counts"],
                           state.extra_state()["planner"]["smoothed_counts"])


@pytest.mark.parametrize("name, expected", [
    ("qwen3_30b_a3b_sft_config", {"model.moe_permute_fusion": (True, False)}),
    ("glm45_air_106b_sft_config", {"model.moe_shared_expert_overlap": (True, False),
                                   "model.moe_permute_fusion": (True, False),
                                   "model.moe_hybridep_num_sms": (16, None)}),
])
def test_sft_recipes_convert_like_the_pretraining_ones(recipe, name, expected):
    from megatron_lrmoe.integration.bridge import LRMoEGPTModelProvider, enable_lrmoe

    cfg = recipe(name)
    changes = enable_lrmoe(cfg, adapt=True)
    assert {c.path: (c.old, c.new) for c in changes} == expected
    assert isinstance(cfg.model, LRMoEGPTModelProvider)
    cfg.model.apply_rope_fusion = False          # a TE kernel; no TE here
    cfg.model.finalize()


# -----------------------------------------------------------------------------
# Every setting the option table refuses, set on a recipe
# -----------------------------------------------------------------------------


def _refusing_fields() -> list[str]:
    from tests.options.test_megatron import CONFIG_REFUSING

    return CONFIG_REFUSING


@pytest.mark.parametrize("name", _refusing_fields())
def test_each_refused_setting_is_named_and_adapted_only_where_the_table_allows(recipe, name):
    from megatron_lrmoe.integration.bridge import BridgeConfigError, enable_lrmoe
    from megatron_lrmoe.options.megatron import megatron_option
    from tests.options.test_megatron import REFUSED_EXAMPLES

    value = REFUSED_EXAMPLES[name]
    row = megatron_option(name)

    def with_setting():
        cfg = recipe(QWEN_8)
        for knob in ("fp8", "fp4"):     # a knob of a precision acts (is checked) when it is on
            if name.startswith(knob + "_"):
                setattr(cfg.model, knob, REFUSED_EXAMPLES[knob])
        setattr(cfg.model, name, value)
        return cfg

    with pytest.raises(BridgeConfigError) as info:
        enable_lrmoe(with_setting())
    assert f"model.{name}={value} (needs " in str(info.value)
    cfg = with_setting()
    # A precision's knob is refused with its precision, which adapt never changes.
    blocker = next((k for k in ("fp8", "fp4") if name.startswith(k + "_")), None)
    if row.adaptable and blocker is None:
        changes = {c.path: c for c in enable_lrmoe(cfg, adapt=True)}
        assert not row.refuse(getattr(cfg.model, name))
        assert changes[f"model.{name}"].old == value
    else:
        blocker = blocker or name
        with pytest.raises(BridgeConfigError) as info:
            enable_lrmoe(cfg, adapt=True)
        assert f"model.{blocker}={REFUSED_EXAMPLES[blocker]} (needs " in str(info.value)
        assert "adapt=True" not in str(info.value)
