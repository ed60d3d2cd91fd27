"""Launcher flags: YAML config, derived defaults, and invalid configurations that
must fail fast with a message naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import types
import warnings

import pytest

from megatron_lrmoe.config.command_line import build_parser
from megatron_lrmoe.config.flags import (
    ConfigError,
    UnusedLRMoEOptionWarning,
    lrmoe_view,
    tokens_per_rank,
)
from megatron_lrmoe.integration import megatron_lm
from megatron_lrmoe.launcher.arguments import parse_args
from megatron_lrmoe.options.lrmoe import OPTIONS, option

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
    assert args.num_microbatches == 1
    assert args.lr_decay_iters == 10
    assert args.transformer_impl == "local"
    # Micro-batches per step: the global batch over micro-batch x data-parallel size, with
    # the world given (4 ranks, TP 2: DP 2) and not read from WORLD_SIZE (2).
    args = parse_args(BASE + ["--global-batch-size", "24", "--tensor-model-parallel-size", "2",
                             "--sequence-parallel"],
                      world_size=4)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 24 // (2 * 2))


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
    (["--lr-warmup-iters", "11"], 2, "--lr-warmup-iters (11) must be below --train-iters (10); "
                                     "lower it, or give --lr-warmup-fraction"),
    (["--lr-warmup-fraction", "1"], 2, "--lr-warmup-fraction must be in [0, 1), got 1.0"),
    (["--lr-warmup-fraction", "0.5", "--lr-warmup-iters", "2"], 2,
     "--lr-warmup-iters (2) and --lr-warmup-fraction (0.5) are exclusive"),
    (["--lr-warmup-fraction", "0.5", "--lr-decay-iters", "40"], 2,
     "--lr-warmup-fraction (0.5) x --lr-decay-iters (40) gives 20 warm-up iterations, not "
     "below --train-iters (10)"),
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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MOE = [os.path.join(REPO, "configs", "tiny_moe.yaml")]


def test_demo_warmup_scales_with_the_run(world, tmp_path):
    """configs/tiny_moe.yaml's warm-up is a fraction: 20 iterations of 200 as before (every
    value the builders read is the same as with --lr-warmup-iters 20), 2 of a 20-iteration
    run; a warm-up given on the command line replaces the config's fraction."""
    config = ["--config", *TINY_MOE, "--mock-data"]
    default = parse_args(config)
    assert (default.train_iters, default.lr_warmup_iters) == (200, 20)
    old_style = parse_args(config + ["--lr-warmup-iters", "20"])
    assert old_style.lr_warmup_fraction is None
    assert {k: v for k, v in vars(default).items() if k != "lr_warmup_fraction"} == {
        k: v for k, v in vars(old_style).items() if k != "lr_warmup_fraction"}
    assert parse_args(config + ["--train-iters", "20"]).lr_warmup_iters == 2
    assert parse_args(config + ["--train-iters", "5"]).lr_warmup_iters == 0  # round(0.5)
    assert parse_args(config + ["--train-iters", "20", "--lr-warmup-iters=5"]).lr_warmup_iters == 5
    # The other way round: a config's iterations, a command-line fraction.
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr-warmup-iters: 8\n")
    args = parse_args(BASE + ["--config", str(cfg), "--lr-warmup-fraction", "0.2"])
    assert (args.lr_warmup_iters, args.lr_warmup_fraction) == (2, 0.2)
    cfg.write_text("lr-warmup-iters: 8\nlr-warmup-fraction: 0.2\n")
    with pytest.raises(ConfigError, match="are exclusive"):
        parse_args(BASE + ["--config", str(cfg)])


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
        [sys.executable, "-m", "megatron_lrmoe.launcher.pretrain", *BASE, "--num-experts", "3",
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
        [sys.executable, "-m", "megatron_lrmoe.launcher.pretrain", *BASE, "--moe-router-topk", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 2
    assert "error: Megatron-Core refuses this configuration" in proc.stderr
    assert "moe-router-pre-softmax" in proc.stderr
    assert "Traceback" not in proc.stderr


# -----------------------------------------------------------------------------
# LRMoE options: one table (options/lrmoe.py OPTIONS), the flags of both entry points
# generated from it, every check naming the flag whichever path raised it.
# -----------------------------------------------------------------------------

LRMOE_OK = ["--moe-lrmoe", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]

LRMOE_INVALID = [
    (["--moe-lrmoe"], "--moe-token-dispatcher-type: --moe-lrmoe needs "
                      "--moe-token-dispatcher-type alltoall"),
    (LRMOE_OK + ["--moe-expert-capacity-factor", "1.0"],
     "--moe-expert-capacity-factor: --moe-lrmoe keeps the forward exact"),
    (LRMOE_OK + ["--moe-lrmoe-placement", "memory-aware"],
     "--moe-lrmoe-memory-budget-gb: --moe-lrmoe-placement memory-aware needs a budget"),
    (LRMOE_OK + ["--moe-lrmoe-bwd-capacity-factor", "-1"],
     "--moe-lrmoe-bwd-capacity-factor: must be > 0 or inf, got -1"),
    # Megatron 0.16 has no such module either; one a later Megatron adds is refused the
    # same way until LRMoE implements it (docs/design.md, "Recompute").
    (LRMOE_OK + ["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                 "moe_router"],
     "--recompute-modules: 'moe_router' not supported with --moe-lrmoe"),
]


@pytest.mark.parametrize("extra,message", LRMOE_INVALID, ids=[m.split(":")[0]
                                                                for _, m in LRMOE_INVALID])
def test_invalid_lrmoe_flags(world, extra, message):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + extra)
    assert message in str(err.value)


def test_lrmoe_needs_experts(world):
    argv = BASE[:]
    del argv[argv.index("--num-experts"):argv.index("--num-experts") + 2]
    with pytest.raises(ConfigError, match="--num-experts: --moe-lrmoe needs an MoE model"):
        parse_args(argv + ["--moe-lrmoe"])


# Bad values of every option, as command-line text; each must be refused naming its flag.
BAD_VALUES = {
    "moe_lrmoe": [],  # a switch: no value to get wrong on a command line (see the config test)
    "moe_lrmoe_bwd_capacity_factor": ["-1", "0", "nan", "x"],
    "moe_lrmoe_min_retention": ["-0.1", "1.5", "nan"],
    "moe_lrmoe_metric": ["loss"],
    "moe_lrmoe_selection": ["best"],
    "moe_lrmoe_hybrid_fraction": ["1.5", "-0.5", "nan"],
    "moe_lrmoe_store_factor": ["0.5", "inf", "nan"],
    "moe_lrmoe_kernels": ["gpu"],
    "moe_lrmoe_log_interval": ["0", "-3", "1.5"],
    "moe_lrmoe_placement": ["symi"],
    "moe_lrmoe_slots_per_rank": ["0"],
    "moe_lrmoe_memory_budget_gb": ["0", "-1", "inf", "nan"],
    "moe_lrmoe_load_smoothing": ["1", "-0.5", "nan"],
    "moe_lrmoe_calibration": ["/nonexistent/machine.json"],
}
BAD_FLAGS = [(field, text) for field, texts in BAD_VALUES.items() for text in texts]


def _id(field: str, text: str) -> str:
    return f"{field.removeprefix('moe_lrmoe_')}={text}"


def _typed(opt, text: str):
    """``text`` as argparse would hand it over, or None where argparse itself refuses it."""
    try:
        return opt.arg_type(text)
    except ValueError:
        return None


def test_every_option_has_bad_values_to_test():
    assert list(BAD_VALUES) == [o.field for o in OPTIONS]


def _assert_flag_error(opt, message: str) -> None:
    assert message.startswith(f"{opt.flag}: "), message


@pytest.mark.parametrize("lrmoe", [True, False], ids=["with-moe-lrmoe", "without"])
@pytest.mark.parametrize("field,text", BAD_FLAGS, ids=[_id(f, t) for f, t in BAD_FLAGS])
def test_bad_option_value_names_the_flag_in_the_lean_launcher(world, capsys, field, text,
                                                              lrmoe):
    opt = option(field)
    argv = BASE + (LRMOE_OK if lrmoe else []) + [opt.flag, text]
    if _typed(opt, text) is None or opt.choices:  # argparse's own refusal (type, choices)
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert f"argument {opt.flag}: invalid" in capsys.readouterr().err
        return
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    _assert_flag_error(opt, str(err.value))


def _megatron_lm_args(**overrides) -> argparse.Namespace:
    """What Megatron-LM's parser hands the LRMoE check (its dests, plus our flags)."""
    args = argparse.Namespace(
        **{o.field: o.default for o in OPTIONS}, num_experts=4,
        moe_token_dispatcher_type="alltoall", add_bias_linear=False,
        moe_expert_capacity_factor=None, expert_tensor_parallel_size=None,
        tensor_model_parallel_size=1, yaml_cfg=None)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("lrmoe", [True, False], ids=["with-moe-lrmoe", "without"])
@pytest.mark.parametrize("field,text", BAD_FLAGS, ids=[_id(f, t) for f, t in BAD_FLAGS])
def test_bad_option_value_names_the_flag_in_megatron_lm(field, text, lrmoe):
    """Megatron-LM's path: the provider's check on the parsed namespace."""
    opt = option(field)
    value = _typed(opt, text)
    if value is None:
        return  # argparse refuses it first: test_megatron_lm_provider_parser_refuses_...
    with pytest.raises(ConfigError) as err:
        megatron_lm.check_megatron_lm_args(_megatron_lm_args(moe_lrmoe=lrmoe, **{field: value}))
    _assert_flag_error(opt, str(err.value))


@pytest.mark.parametrize("field,text", BAD_FLAGS, ids=[_id(f, t) for f, t in BAD_FLAGS])
def test_megatron_lm_provider_parser_refuses_bad_values(capsys, field, text):
    """The provider's parser (generated flags + the check when parsed) exits with
    argparse's one-line error naming the flag."""
    opt = option(field)
    parser = megatron_lm.lrmoe_args_provider()(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit):
        parser.parse_args([opt.flag, text])
    err = capsys.readouterr().err
    assert f"argument {opt.flag}: invalid" in err or f"error: {opt.flag}: " in err, err


@pytest.mark.parametrize("field,text", BAD_FLAGS + [("moe_lrmoe", "yes")],
                         ids=[_id(f, t) for f, t in BAD_FLAGS + [("moe_lrmoe", "yes")]])
def test_bad_option_value_names_the_flag_in_the_config(field, text):
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.options.lrmoe import LRMoEConfigError

    opt = option(field)
    value = text if opt.type is bool else _typed(opt, text)
    value = text if value is None else value  # the constructor takes any Python value
    for lrmoe in (True, False):
        kwargs = dict(LRMOE_CONFIG, moe_lrmoe=lrmoe)
        kwargs[field] = value
        with pytest.raises(LRMoEConfigError) as err:
            LRMoETransformerConfig(**kwargs)
        _assert_flag_error(opt, str(err.value))


LRMOE_CONFIG = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                    moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                    add_bias_linear=False, moe_lrmoe=True)


@pytest.mark.parametrize("field,value,message", [
    ("moe_token_dispatcher_type", "allgather", "--moe-token-dispatcher-type: "),
    ("moe_expert_capacity_factor", 1.0, "--moe-expert-capacity-factor: "),
    ("num_moe_experts", None, "--num-experts: --moe-lrmoe needs an MoE model"),
    ("moe_lrmoe_placement", "memory-aware", "--moe-lrmoe-memory-budget-gb: "),
])
def test_lrmoe_config_refuses_unsupported_combinations(field, value, message):
    """The config class names the flag, for entry points that bypass the launcher."""
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.options.lrmoe import LRMoEConfigError

    kwargs = dict(LRMOE_CONFIG)
    kwargs[field] = value
    if field == "num_moe_experts":
        kwargs.pop("moe_router_topk")
    with pytest.raises(LRMoEConfigError) as err:
        LRMoETransformerConfig(**kwargs)
    assert str(err.value).startswith(message)
    kwargs["moe_lrmoe"] = False  # the combinations only matter with LRMoE on
    if field != "num_moe_experts":
        LRMoETransformerConfig(**kwargs)


@pytest.mark.parametrize("fields", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),     # Megatron's default module: core_attn
    dict(recompute_granularity="selective", moe_grouped_gemm=True,
         recompute_modules=["core_attn", "layernorm", "mlp", "moe", "moe_act",
                            "shared_experts"]),
], ids=["full-uniform", "full-block", "selective-default", "selective-all"])
def test_lrmoe_config_accepts_recompute(fields):
    """Full and selective recompute with --moe-lrmoe (docs/design.md, "Recompute";
    tests/launcher/test_recompute.py trains with them); mla_up_proj needs multi-latent attention,
    which Megatron-LM refuses with --moe-lrmoe anyway."""
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    config = LRMoETransformerConfig(**dict(LRMOE_CONFIG, **fields))
    assert config.recompute_granularity == fields["recompute_granularity"]


def _lrmoe_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings
            if s.startswith("--moe-lrmoe")}


@pytest.mark.parametrize("entry", ["launcher", "megatron-lm"])
def test_generated_flags_equal_the_table(entry):
    parser = (build_parser() if entry == "launcher" else
              megatron_lm.lrmoe_args_provider()(argparse.ArgumentParser()))
    actions = _lrmoe_actions(parser)
    assert list(actions) == [o.flag for o in OPTIONS]
    for o in OPTIONS:
        action = actions[o.flag]
        assert action.dest == o.field
        assert action.default == o.default
        assert action.help.startswith(o.help)
        if o.type is bool:
            assert isinstance(action, argparse._StoreTrueAction)
        else:
            assert action.type is o.arg_type
            assert action.choices == o.choices
    assert "GiB" in actions["--moe-lrmoe-memory-budget-gb"].help
    device = {s: a for a in parser._actions for s in a.option_strings}["--device-memory-gb"]
    assert device.dest == "device_memory_gb" and device.default is None
    assert device.type is float and "GiB" in device.help


@pytest.mark.parametrize("entry", ["launcher", "megatron-lm"])
def test_generated_flags_equal_the_fields(entry):
    """Each field of LRMoEOptions and EntryPointOptions is one flag of either entry point:
    the field name with dashes, its dest the field, its default and choices the field's,
    its help the field's help metadata; and no other --moe-lrmoe* flag exists."""
    from megatron_lrmoe.config.flags import EntryPointOptions
    from megatron_lrmoe.options.lrmoe import LRMoEOptions

    parser = (build_parser() if entry == "launcher" else
              megatron_lm.lrmoe_args_provider()(argparse.ArgumentParser()))
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    lrmoe = dataclasses.fields(LRMoEOptions)
    assert list(_lrmoe_actions(parser)) == ["--" + f.name.replace("_", "-") for f in lrmoe]
    for f in lrmoe + dataclasses.fields(EntryPointOptions):
        action = by_flag["--" + f.name.replace("_", "-")]
        assert action.dest == f.name and action.default == f.default, f.name
        assert action.help.startswith(f.metadata["help"]), f.name
        assert action.choices == f.metadata.get("choices"), f.name


def test_config_inherits_the_option_fields():
    """The config's fields are Megatron's TransformerConfig fields, in Megatron's order and
    as Megatron defines them, then LRMoEOptions' fields, inherited as defined there (the
    config defines none of them again): Megatron-LM fills a config class from the
    same-named args through dataclasses.fields()."""
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.options.lrmoe import LRMoEOptions

    megatron = dataclasses.fields(TransformerConfig)
    lrmoe = dataclasses.fields(LRMoEOptions)
    fields = dataclasses.fields(LRMoETransformerConfig)
    assert [f.name for f in fields] == [f.name for f in megatron] + [f.name for f in lrmoe]
    # Only the LRMoE fields are named so: none of Megatron's is (a later Megatron adding
    # one would be shadowed silently).
    assert [f.name for f in fields if f.name.startswith("moe_lrmoe")] == [f.name for f in lrmoe]
    for f, theirs in zip(fields, megatron, strict=False):
        assert f.type is theirs.type and f.default is theirs.default, f.name
    for f, own in zip(fields[len(megatron):], lrmoe, strict=True):
        # The type itself, not a string: the options module must not postpone annotations.
        assert not isinstance(f.type, str) and f.type is own.type, f.name
        assert f.default == own.default and type(f.default) is type(own.default), f.name
        assert f.default_factory is dataclasses.MISSING and f.init, f.name
        assert f.metadata == own.metadata and f.metadata["help"], f.name
    assert [(o.field, o.annotation, o.default) for o in OPTIONS] == [
        (f.name, f.type, f.default) for f in lrmoe]
    built = LRMoETransformerConfig(**LRMOE_CONFIG)
    assert (built.moe_lrmoe_bwd_capacity_factor, built.moe_lrmoe_selection) == (1.0, "uniform")
    assert {f.name: getattr(built, f.name) for f in lrmoe[1:]} == {
        f.name: f.default for f in lrmoe[1:]}


def test_megatron_lm_fill_sets_every_option(monkeypatch):
    """Megatron-LM's own parser and config builder (installed with megatron-core) fill
    the inherited LRMoE fields from the flags ``add_lrmoe_args`` adds."""
    import torch

    argument_utils = pytest.importorskip("megatron.training.argument_utils")
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_lrmoe.config.flags import add_lrmoe_args
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    monkeypatch.setattr(sys, "argv", [
        "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear", "--swiglu",
        "--no-rope-fusion", "--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.5",
        "--moe-lrmoe-selection", "hybrid", "--moe-lrmoe-slots-per-rank", "3"])
    args = arguments.parse_args(extra_args_provider=add_lrmoe_args)
    args.params_dtype = torch.float32          # what Megatron-LM's validate_args sets
    config = argument_utils.core_transformer_config_from_args(args, LRMoETransformerConfig)
    assert type(config) is LRMoETransformerConfig
    assert (config.moe_lrmoe, config.moe_lrmoe_bwd_capacity_factor, config.moe_lrmoe_selection,
            config.moe_lrmoe_slots_per_rank, config.num_moe_experts) == (True, 0.5, "hybrid",
                                                                         3, 4)
    assert {o.field: getattr(config, o.field) for o in OPTIONS} == {
        o.field: getattr(args, o.field) for o in OPTIONS}


def test_config_survives_copy_and_pickle():
    # Megatron's SequentialMLP deepcopies the config when moe_ffn_hidden_size differs
    # from ffn_hidden_size; checkpoints and spawned workers pickle it.
    import copy
    import pickle

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    config = LRMoETransformerConfig(**{**LRMOE_CONFIG, "moe_lrmoe_selection": "hybrid",
                                       "moe_lrmoe_hybrid_fraction": 0.25,
                                       "moe_lrmoe_log_interval": 3})
    for clone in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert type(clone) is LRMoETransformerConfig
        assert dataclasses.asdict(clone).keys() == dataclasses.asdict(config).keys()
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if not callable(value):     # init methods: new partials, equal only by identity
                assert getattr(clone, f.name) == value, f.name
        assert (clone.moe_lrmoe_selection, clone.moe_lrmoe_hybrid_fraction,
                clone.moe_lrmoe_log_interval) == ("hybrid", 0.25, 3)


def test_lrmoe_values_without_moe_lrmoe_are_checked(world, monkeypatch):
    """Invalid: an error, as with --moe-lrmoe. Valid but unused: a warning (rank 0)."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match=r"^--moe-lrmoe-bwd-capacity-factor: must be > 0 or "
                                          r"inf, got -1$"):
        parse_args(BASE + ["--moe-lrmoe-bwd-capacity-factor", "-1"])
    with pytest.raises(ConfigError, match="^--moe-lrmoe-bwd-capacity-factor: "):
        megatron_lm.check_megatron_lm_args(_megatron_lm_args(moe_lrmoe_bwd_capacity_factor=-1.0))
    message = ("--moe-lrmoe-bwd-capacity-factor, --moe-lrmoe-selection given without "
               "--moe-lrmoe: no effect")
    with pytest.warns(UnusedLRMoEOptionWarning, match=message):
        args = parse_args(BASE + ["--moe-lrmoe-bwd-capacity-factor", "0.5",
                                  "--moe-lrmoe-selection", "topk"])
    assert not args.moe_lrmoe
    with pytest.warns(UnusedLRMoEOptionWarning, match=message):
        megatron_lm.check_megatron_lm_args(_megatron_lm_args(moe_lrmoe_bwd_capacity_factor=0.5,
                                                             moe_lrmoe_selection="topk"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedLRMoEOptionWarning)
        parse_args(BASE)  # defaults only: silent
        megatron_lm.check_megatron_lm_args(_megatron_lm_args())
        parse_args(BASE + LRMOE_OK + ["--moe-lrmoe-bwd-capacity-factor", "0.5"])
        monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
        parse_args(BASE + ["--moe-lrmoe-bwd-capacity-factor", "0.5"])


def test_megatron_lm_combination_checks_name_the_flag():
    check = megatron_lm.check_megatron_lm_args
    for overrides, message in [
        (dict(moe_token_dispatcher_type="allgather"), "--moe-token-dispatcher-type: "),
        (dict(tensor_model_parallel_size=2), "--expert-tensor-parallel-size: --moe-lrmoe needs "
                                             "--expert-tensor-parallel-size 1"),
        (dict(num_experts=None), "--num-experts: --moe-lrmoe needs an MoE model"),
        (dict(yaml_cfg="x.yaml"), "--yaml-cfg builds a plain TransformerConfig"),
    ]:
        with pytest.raises(ConfigError) as err:
            check(_megatron_lm_args(moe_lrmoe=True, **overrides))
        assert str(err.value).startswith(message), err.value
        check(_megatron_lm_args(moe_lrmoe=False, **overrides))  # Megatron's own run: fine
    check(_megatron_lm_args(moe_lrmoe=True, tensor_model_parallel_size=2,
                            expert_tensor_parallel_size=1))


def test_one_lrmoe_view_maps_both_entry_points(world):
    """``lrmoe_view`` is the one mapping of either namespace to the config's field names:
    the launcher's --disable-bias-linear and Megatron-LM's add_bias_linear dest give the
    same view, and an --expert-tensor-parallel-size not given is the TP size in both."""
    launcher = parse_args(BASE + ["--disable-bias-linear", "--tensor-model-parallel-size", "2",
                                  "--sequence-parallel", "--moe-token-dispatcher-type",
                                  "alltoall"])
    launcher_view = lrmoe_view(launcher)
    megatron_view = lrmoe_view(_megatron_lm_args(tensor_model_parallel_size=2))
    for name in [o.field for o in OPTIONS] + ["num_moe_experts", "add_bias_linear",
                                              "moe_token_dispatcher_type",
                                              "expert_tensor_parallel_size"]:
        assert getattr(launcher_view, name) == getattr(megatron_view, name), name
    assert launcher_view.add_bias_linear is False
    assert launcher_view.num_moe_experts == 4
    assert launcher_view.expert_tensor_parallel_size == 2
    assert lrmoe_view(parse_args(BASE)).add_bias_linear is True
    missing = lrmoe_view(argparse.Namespace(num_experts=None))
    assert vars(missing) == {"num_moe_experts": None, "expert_tensor_parallel_size": 1}


def test_tokens_per_rank_of_either_entry_point(world):
    """One micro-batch's tokens on one rank: micro-batch x sequence, split by CP, and by
    TP only under sequence parallelism (both entry points' namespaces carry these dests;
    the launcher's has no context_parallel_size)."""
    assert tokens_per_rank(parse_args(BASE)) == 2 * 64
    assert tokens_per_rank(parse_args(BASE + ["--tensor-model-parallel-size", "2",
                                              "--sequence-parallel"])) == 64
    megatron_args = argparse.Namespace(micro_batch_size=3, seq_length=100,
                                       tensor_model_parallel_size=4, sequence_parallel=True)
    assert tokens_per_rank(megatron_args) == 3 * 100 // 4
    megatron_args.sequence_parallel = False
    assert tokens_per_rank(megatron_args) == 300
    # Context parallelism: each CP rank holds S / CP of every sequence.
    megatron_args.context_parallel_size = 2
    assert tokens_per_rank(megatron_args) == 150
    megatron_args.sequence_parallel = True
    assert tokens_per_rank(megatron_args) == 3 * 100 // (4 * 2)


@pytest.fixture
def fake_megatron_training(monkeypatch):
    """A stand-in for Megatron-LM's ``megatron.training.arguments`` (no checkout here)."""
    def install(builder):
        training = types.ModuleType("megatron.training")
        arguments = types.ModuleType("megatron.training.arguments")
        arguments.core_transformer_config_from_args = builder
        training.arguments = arguments
        monkeypatch.setitem(sys.modules, "megatron.training", training)
        monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)

    return install


def test_unrelated_megatron_error_is_not_blamed_on_lrmoe(fake_megatron_training):
    text = "apply_rope_fusion is not available. Please install TE >= 1.4."

    def refuse(args, config_class):
        raise ValueError(text)

    fake_megatron_training(refuse)
    with pytest.raises(ValueError) as err:
        megatron_lm.lrmoe_config_from_args(_megatron_lm_args(moe_lrmoe=True))
    assert str(err.value) == text and not isinstance(err.value, ConfigError)


@pytest.mark.parametrize("fields,message", [
    (dict(moe_lrmoe_min_retention=1.5), "--moe-lrmoe-min-retention: must be in [0, 1], got 1.5"),
    (dict(moe_expert_capacity_factor=1.0),
     "--moe-expert-capacity-factor: --moe-lrmoe keeps the forward exact"),
])
def test_lrmoe_config_refusal_names_the_flag_in_megatron_lm(fake_megatron_training, fields,
                                                            message):
    fake_megatron_training(lambda args, cls: cls(**dict(LRMOE_CONFIG, **fields)))
    with pytest.raises(ConfigError) as err:
        megatron_lm.lrmoe_config_from_args(_megatron_lm_args(moe_lrmoe=True))
    assert str(err.value).startswith(message)


def test_without_moe_lrmoe_nothing_of_the_plugin_is_built(world):
    """No --moe-lrmoe: Megatron's TransformerConfig and an untouched spec."""
    from megatron.core.transformer import TransformerConfig

    from megatron_lrmoe.launcher.builders import lrmoe_spec_transform
    from megatron_lrmoe.launcher.run_config import transformer_config_from_args

    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall"])
    assert type(transformer_config_from_args(args)) is TransformerConfig
    assert lrmoe_spec_transform(args) is None
    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall", "--moe-lrmoe",
                              "--disable-bias-linear", "--moe-lrmoe-selection", "sample"])
    config = transformer_config_from_args(args)
    assert type(config).__name__ == "LRMoETransformerConfig"
    assert config.moe_lrmoe and config.moe_lrmoe_selection == "sample"
    assert config.moe_lrmoe_hybrid_fraction == 0.5  # docs/design.md, "Flags"
    assert lrmoe_spec_transform(args) is not None


@pytest.mark.parametrize("selection", ["uniform", "hybrid"])
def test_new_selection_rules_reach_the_config(world, selection):
    from megatron_lrmoe.launcher.run_config import transformer_config_from_args

    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall", "--moe-lrmoe",
                              "--disable-bias-linear", "--moe-lrmoe-selection", selection,
                              "--moe-lrmoe-hybrid-fraction", "0.25"])
    config = transformer_config_from_args(args)
    assert config.moe_lrmoe_selection == selection
    assert config.moe_lrmoe_hybrid_fraction == 0.25


def test_grouped_gemm_with_lrmoe_is_accepted_without_transformer_engine(world):
    """--moe-grouped-gemm with --moe-lrmoe means the region's grouped GEMMs (any device)."""
    from megatron_lrmoe.launcher.run_config import transformer_config_from_args

    args = parse_args(BASE + ["--moe-token-dispatcher-type", "alltoall", "--moe-lrmoe",
                              "--disable-bias-linear", "--moe-grouped-gemm"])
    assert args.transformer_impl == "local"
    assert transformer_config_from_args(args).moe_grouped_gemm


# -----------------------------------------------------------------------------
# --moe-lrmoe-memory-budget-gb auto and --device-memory-gb (docs/design.md, "Memory budget")
# -----------------------------------------------------------------------------

TINY = ["--config", "configs/tiny_moe.yaml", "--mock-data", "--moe-lrmoe"]


def test_auto_budget_is_parsed_and_left_to_the_entry_point(world):
    args = parse_args(BASE + LRMOE_OK + ["--moe-lrmoe-memory-budget-gb", "auto",
                                         "--device-memory-gb", "40"])
    assert args.moe_lrmoe_memory_budget_gb == "auto" and args.device_memory_gb == 40.0
    assert parse_args(BASE + LRMOE_OK + ["--moe-lrmoe-memory-budget-gb", "2"]
                      ).moe_lrmoe_memory_budget_gb == 2.0     # the numeric form, unchanged


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan"])
def test_bad_device_memory_names_the_flag(world, text):
    with pytest.raises(ConfigError, match="--device-memory-gb: must be a positive"):
        parse_args(BASE + LRMOE_OK + ["--device-memory-gb", text])


def test_auto_resolves_once_on_the_one_config_in_the_lean_launcher(world, monkeypatch):
    """The flags keep ``auto``; the run's config, built once, holds the GiB the memory
    account leaves, and is the config of that budget given as a number."""
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.launcher.pretrain import parse_args_or_exit

    world(2)
    built = []
    post_init = LRMoETransformerConfig.__post_init__
    monkeypatch.setattr(LRMoETransformerConfig, "__post_init__",
                        lambda self: (built.append(self), post_init(self))[1])
    args, config = parse_args_or_exit(TINY + ["--device-memory-gb", "1",
                                              "--moe-lrmoe-memory-budget-gb", "auto"], 2)
    assert built == [config]
    assert args.moe_lrmoe_memory_budget_gb == "auto"
    budget = config.moe_lrmoe_memory_budget_gb
    assert isinstance(budget, float) and 0 < budget < 1
    _, given = parse_args_or_exit(TINY + ["--device-memory-gb", "1",
                                          "--moe-lrmoe-memory-budget-gb", repr(budget)], 2)
    assert [getattr(given, f.name) for f in dataclasses.fields(given)
            if f.name.startswith("moe_lrmoe")] == [
        getattr(config, f.name) for f in dataclasses.fields(config)
        if f.name.startswith("moe_lrmoe")]


@pytest.mark.parametrize("extra,words", [
    ([], "give --device-memory-gb"),
    (["--device-memory-gb", "0.05"], "below the floor"),
], ids=["no-device-size", "below-floor"])
def test_auto_refusal_names_both_flags_in_the_lean_launcher(world, capsys, extra, words):
    import torch

    from megatron_lrmoe.launcher.pretrain import parse_args_or_exit

    if not extra and torch.cuda.is_available():
        pytest.skip("on CUDA the device's size is the default")
    with pytest.raises(SystemExit) as exit_:
        parse_args_or_exit(TINY + extra + ["--moe-lrmoe-memory-budget-gb", "auto"], 2)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--moe-lrmoe-memory-budget-gb auto" in err and "--device-memory-gb" in err, err
    assert words in err


def test_megatron_lm_provider_takes_auto_and_the_device_size():
    parser = megatron_lm.lrmoe_args_provider()(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    args = parser.parse_args(["--moe-lrmoe-memory-budget-gb", "auto", "--device-memory-gb",
                              "80"])
    assert args.moe_lrmoe_memory_budget_gb == "auto" and args.device_memory_gb == 80.0


def test_megatron_lm_resolves_auto_and_prints_the_account(fake_megatron_training, monkeypatch):
    """Megatron-LM's path: ``lrmoe_config_from_args`` builds one config and resolves auto
    on it (``args`` keeps auto), and prints the account once (print_rank_0)."""
    from megatron.core import num_microbatches_calculator as calculator

    printed: list[str] = []
    built: list[object] = []

    def build(args, cls):
        built.append(cls(**dict(LRMOE_CONFIG, hidden_size=64, num_attention_heads=2,
                                moe_lrmoe_memory_budget_gb=args.moe_lrmoe_memory_budget_gb)))
        return built[-1]

    fake_megatron_training(build)
    utils = types.ModuleType("megatron.training.utils")
    utils.print_rank_0 = printed.append
    monkeypatch.setitem(sys.modules, "megatron.training.utils", utils)
    monkeypatch.setattr(megatron_lm, "_ACCOUNT", {"account": None, "budget_bytes": None,
                                                  "steps": 0})
    calculator.init_num_microbatches_calculator(0, None, 2, 2, 1)
    try:
        args = _megatron_lm_args(
            moe_lrmoe=True, moe_lrmoe_memory_budget_gb="auto", device_memory_gb=1.0,
            padded_vocab_size=128, seq_length=32, micro_batch_size=2, sequence_parallel=False,
            data_parallel_size=1, expert_model_parallel_size=1, optimizer="adam",
            use_distributed_optimizer=False)
        config = megatron_lm.lrmoe_config_from_args(args)
        assert built == [config] and args.moe_lrmoe_memory_budget_gb == "auto"
        account = megatron_lm._memory_account(args, config)
        assert config.moe_lrmoe_memory_budget_gb == pytest.approx(
            (account.device - account.outside_moe) / 2**30, rel=1e-12)
        account = [line for line in printed if "memory account" in line]
        assert len(account) == 1 and "device 1.000" in account[0]
        assert "MoE budget" in account[0] and "(auto" in account[0]
        megatron_lm.lrmoe_config_from_args(args)           # printed once per process
        assert len([line for line in printed if "memory account" in line]) == 1
        args.device_memory_gb = 1e-4
        monkeypatch.setattr(megatron_lm, "_ACCOUNT", {"account": None, "budget_bytes": None,
                                                      "steps": 0})
        with pytest.raises(ConfigError) as err:
            megatron_lm.lrmoe_config_from_args(args)
        assert "--moe-lrmoe-memory-budget-gb auto" in str(err.value)
        assert "--device-memory-gb" in str(err.value)
    finally:
        calculator.destroy_num_microbatches_calculator()
