"""Launcher flags: YAML config, derived defaults, and invalid configurations that
must fail fast with a message naming the flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_lrmoe.arguments import ConfigError, parse_args

BASE = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
    "--mock-data", "--num-experts", "4", "--moe-router-topk", "2",
]


@pytest.fixture
def world(monkeypatch):
    def set_world(size: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", str(size))

    set_world(2)
    return set_world


def test_valid_config_and_derived_defaults(world):
    args = parse_args(BASE + ["--expert-model-parallel-size", "2"])
    assert args.ffn_hidden_size == 256  # 4 x hidden, as Megatron-LM
    assert args.moe_ffn_hidden_size == 256
    assert args.max_position_embeddings == 64
    assert args.global_batch_size == 4  # micro-batch x data-parallel size 2
    assert args.lr_decay_iters == 10
    assert args.transformer_impl == "local"


def test_yaml_config_with_command_line_override(world, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layers: 2\nhidden_size: 32\nswiglu: true\nlr: 5.0e-4\n"
                   "moe-layer-freq: '([0]+[1]*3)'\n")
    args = parse_args(BASE + ["--config", str(cfg), "--lr", "2e-3"])
    assert args.num_layers == 4  # BASE on the command line wins over the file
    assert args.hidden_size == 64
    assert args.swiglu is True
    assert args.lr == 2e-3
    assert args.moe_layer_freq == [0, 1, 1, 1]
    argv = BASE[:]
    del argv[argv.index("--num-layers"):argv.index("--num-layers") + 2]
    args = parse_args(argv + ["--config", str(cfg), "--moe-layer-freq", "2"])
    assert args.num_layers == 2  # from the file
    assert args.moe_layer_freq == 2


def test_yaml_unknown_key_is_named(world, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num-layerz: 2\n")
    with pytest.raises(ConfigError, match="num-layerz"):
        parse_args(BASE + ["--config", str(cfg)])


def test_yaml_missing_file(world):
    with pytest.raises(ConfigError, match="--config /nonexistent.yaml: file not found"):
        parse_args(BASE + ["--config", "/nonexistent.yaml"])


INVALID = [
    # (extra flags, world size, text the message must contain)
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (["--moe-router-topk", "5"], 2, "--moe-router-topk (5) exceeds --num-experts (4)"),
    (["--moe-token-dispatcher-type", "flex"], 2, "--moe-token-dispatcher-type 'flex'"),
    (["--hidden-size", "66"], 2, "--hidden-size (66) must be divisible by --num-attention-heads"),
    (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads (4) must be divisible by "
                                               "--tensor-model-parallel-size (3)"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers (4) must be divisible by "
                                                 "--pipeline-model-parallel-size (3)"),
    (["--global-batch-size", "3"], 2, "--global-batch-size (3) must be a multiple of"),
    (["--expert-model-parallel-size", "4"], 2, "--expert-model-parallel-size (4) x "
                                               "--expert-tensor-parallel-size"),
    (["--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--max-position-embeddings", "32"], 2, "--seq-length (64) exceeds --max-position-embeddings"),
    (["--lr-warmup-iters", "11"], 2, "--lr-warmup-iters (11) must be below --train-iters (10)"),
    (["--save-interval", "5"], 2, "--save-interval needs --save"),
    (["--moe-grouped-gemm"], 2, "--moe-grouped-gemm needs Transformer Engine"),
    (["--num-query-groups", "2"], 2, "--num-query-groups needs --group-query-attention"),
    (["--tensor-model-parallel-size", "4"], 6, "world size 6 must be divisible by"),
    (["--moe-layer-freq", "[1,0]"], 2, "--moe-layer-freq lists 2 layers but --num-layers is 4"),
    (["--fp16"], 2, "--fp16 needs CUDA"),
    (["--min-lr", "1.0"], 2, "--min-lr (1.0) exceeds --lr"),
    (["--train-iters", "0"], 2, "--train-iters must be positive"),
]


@pytest.mark.parametrize("extra,world_size,message", INVALID,
                         ids=[m.split()[0] for _, _, m in INVALID])
def test_invalid_configuration_names_the_flag(world, extra, world_size, message):
    world(world_size)
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + extra)
    assert message in str(err.value)


def test_missing_data_path(world):
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ConfigError, match="--data-path is required"):
        parse_args(argv)
    with pytest.raises(ConfigError, match=r"--data-path /nowhere/x: /nowhere/x.bin/.idx not found"):
        parse_args(argv + ["--data-path", "/nowhere/x"])


def test_missing_required_flag(world):
    argv = BASE[:]
    i = argv.index("--lr")
    del argv[i:i + 2]
    with pytest.raises(ConfigError, match="--lr is required"):
        parse_args(argv)


def test_unknown_flag_is_refused(world, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--moe-not-a-flag", "1"])
    assert "--moe-not-a-flag" in capsys.readouterr().err


def test_command_line_reports_error_and_exit_code_2():
    """The real entry point: a clear one-line error, exit status 2, no traceback."""
    env = dict(os.environ, WORLD_SIZE="2")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.pretrain", *BASE, "--num-experts", "3",
         "--expert-model-parallel-size", "2"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: --num-experts (3) must be divisible by --expert-model-parallel-size (2)" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_megatron_core_refusal_is_reported_cleanly():
    """Checks Megatron-Core makes itself (TransformerConfig.__post_init__) come out
    as the same one-line error as ours."""
    env = dict(os.environ, WORLD_SIZE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lrmoe.pretrain", *BASE, "--moe-router-topk", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: Megatron-Core refuses this configuration" in proc.stderr
    assert "moe-router-pre-softmax" in proc.stderr
    assert "Traceback" not in proc.stderr


LRMOE_INVALID = [
    (["--moe-lrmoe"], "--moe-lrmoe needs --moe-token-dispatcher-type alltoall"),
    (["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall"],
     "--moe-lrmoe needs --disable-bias-linear"),
    (["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
      "--moe-expert-capacity-factor", "1.0"], "drop --moe-expert-capacity-factor"),
    (["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
      "--moe-lrmoe-bwd-capacity-factor", "0"], "--moe-lrmoe-bwd-capacity-factor must be > 0"),
    (["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
      "--moe-lrmoe-min-retention", "1.5"], "--moe-lrmoe-min-retention must be in [0, 1]"),
    (["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
      "--moe-lrmoe-selection", "hybrid", "--moe-lrmoe-hybrid-fraction", "1.5"],
     "--moe-lrmoe-hybrid-fraction must be in [0, 1]"),
    (["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
      "--moe-lrmoe-hybrid-fraction", "nan"], "--moe-lrmoe-hybrid-fraction must be in [0, 1]"),
]


@pytest.mark.parametrize("extra,message", LRMOE_INVALID, ids=[m for _, m in LRMOE_INVALID])
def test_invalid_lrmoe_flags(world, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + extra)
    assert message in str(err.value)


def test_lrmoe_needs_experts(world):
    argv = BASE[:]
    del argv[argv.index("--num-experts"):argv.index("--num-experts") + 2]
    with pytest.raises(ConfigError, match="--moe-lrmoe needs an MoE model"):
        parse_args(argv + ["--moe-lrmoe"])


@pytest.mark.parametrize("field,value,message", [
    ("moe_token_dispatcher_type", "allgather", "moe_token_dispatcher_type"),
    ("moe_expert_capacity_factor", 1.0, "moe_expert_capacity_factor"),
    ("add_bias_linear", True, "add_bias_linear"),
    ("recompute_granularity", "full", "recompute_granularity"),
    ("moe_lrmoe_selection", "best", "moe_lrmoe_selection"),
    ("moe_lrmoe_metric", "loss", "moe_lrmoe_metric"),
    ("moe_lrmoe_bwd_capacity_factor", -1.0, "moe_lrmoe_bwd_capacity_factor"),
    ("moe_lrmoe_hybrid_fraction", -0.5, "moe_lrmoe_hybrid_fraction"),
    ("moe_lrmoe_hybrid_fraction", float("nan"), "moe_lrmoe_hybrid_fraction"),
])
def test_lrmoe_config_refuses_unsupported_fields(field, value, message):
    """The config class names the field, for entry points that bypass the launcher."""
    from megatron_lrmoe.lrmoe.config import LRMoETransformerConfig

    kwargs = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                  moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
                  moe_lrmoe=True)
    kwargs[field] = value
    if field == "recompute_granularity":
        kwargs["recompute_method"] = "uniform"
        kwargs["recompute_num_layers"] = 1
    with pytest.raises(ValueError, match=message):
        LRMoETransformerConfig(**kwargs)


def test_without_moe_lrmoe_nothing_of_the_plugin_is_built(world):
    """No --moe-lrmoe: Megatron's TransformerConfig and an untouched spec."""
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.training.builders import (
        lrmoe_spec_transform,
        transformer_config_from_args,
    )

    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall"])
    assert type(transformer_config_from_args(args)) is TransformerConfig
    assert lrmoe_spec_transform(args) is None
    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall", "--moe-lrmoe",
                              "--disable-bias-linear", "--moe-lrmoe-selection", "sample"])
    config = transformer_config_from_args(args)
    assert type(config).__name__ == "LRMoETransformerConfig"
    assert config.moe_lrmoe and config.moe_lrmoe_selection == "sample"
    assert config.moe_lrmoe_hybrid_fraction == 0.5  # DESIGN section 8 default
    assert lrmoe_spec_transform(args) is not None


@pytest.mark.parametrize("selection", ["uniform", "hybrid"])
def test_new_selection_rules_reach_the_config(world, selection):
    from megatron_lrmoe.training.builders import transformer_config_from_args

    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall", "--moe-lrmoe",
                              "--disable-bias-linear", "--moe-lrmoe-selection", selection,
                              "--moe-lrmoe-hybrid-fraction", "0.25"])
    config = transformer_config_from_args(args)
    assert config.moe_lrmoe_selection == selection
    assert config.moe_lrmoe_hybrid_fraction == 0.25
