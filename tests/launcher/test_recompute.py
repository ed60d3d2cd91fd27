"""Activation recompute with --moe-lrmoe (docs/design.md, "Recompute").

The reference is the same run without recompute: with Megatron's selective recompute
(core_attn; moe with shared_experts; layernorm with moe_act) and full-layer recompute
(uniform, block, under 1F1B pipeline parallelism), every step's losses and every
parameter's gradient are those of the run without it, and so are the draws (the kept
pairs and their scales, per layer and micro-batch) and the planners' state: bitwise,
except losses and gradients under ``layernorm``, which Megatron's own recompute of the
norms re-associates (fp32-equal as docs/design.md, "Exactness", defines it; the same
without --moe-lrmoe). The runs go through the launcher's builders, its ``forward_step``
and Megatron's schedules, with the launcher's MoE timing hooks on; one test runs the
launcher itself with ``--record-routing``, one the CPU runtime's recompute paths, one
the refusal of modules LRMoE does not implement.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.launcher.test_launcher import TINY

BASE = TINY + [
    "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--moe-shared-expert-intermediate-size", "32", "--micro-batch-size", "2",
    "--lr-warmup-iters", "0", "--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75",
]
# EP 2 on 2 ranks (DP 2), 2 micro-batches per step; 4 experts, 3 instance slots per rank:
# from the second step on the planner places replicas, so refresh and replica
# gradients run under recompute too.
EP2 = ["--expert-model-parallel-size", "2", "--global-batch-size", "8",
       "--moe-lrmoe-placement", "popularity", "--moe-lrmoe-slots-per-rank", "3"]
STEPS = 2

SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
FULL = ["--recompute-granularity", "full", "--recompute-method"]
# Megatron accepts moe_act only with --moe-grouped-gemm (grouped GEMMs in the region).
GROUPED = ["--moe-grouped-gemm"]
VARIANTS = {
    "core_attn": ([], SELECTIVE + ["core_attn"]),
    "moe+shared_experts": ([], SELECTIVE + ["moe", "shared_experts"]),
    "layernorm+moe_act": (GROUPED, SELECTIVE + ["layernorm", "moe_act"]),
    "full-uniform-1": ([], FULL + ["uniform", "--recompute-num-layers", "1"]),
}
RULES = {"uniform": ["--moe-lrmoe-selection", "uniform"],
         "topk": ["--moe-lrmoe-selection", "topk", "--moe-lrmoe-metric", "grad_act"]}


# -----------------------------------------------------------------------------
# Pool task
# -----------------------------------------------------------------------------


def _train(argv: list[str]) -> dict:
    """``--train-iters`` steps as the launcher trains them; returns per step the
    micro-batches' losses and every parameter's gradient (after Megatron's gradient
    reduction), the draws, the planners' state, and what recompute engaged."""
    import torch.distributed as dist
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_lrmoe.integration.step_hooks import (
        finish_lrmoe_step,
        lrmoe_layers,
        setup_lrmoe_layers,
    )
    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.data_iterators import MicroBatchIterator
    from megatron_lrmoe.launcher.distributed import initialize_distributed
    from megatron_lrmoe.launcher.moe_timing import MoETimer, attach_moe_timer
    from megatron_lrmoe.launcher.run_config import build_config
    from megatron_lrmoe.launcher.step import forward_step
    from megatron_lrmoe.layer.region import record_kept_pairs

    args = parse_args(argv)
    device, _ = initialize_distributed(args)
    dp = ps.get_data_parallel_world_size()
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    nmc.init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size,
                                         args.micro_batch_size, dp)
    tokenizer = builders.build_tokenizer_from_args(args)
    config = build_config(args)
    model = builders.build_model(args, config, tokenizer.vocab_size,
                                 spec_transform=builders.lrmoe_spec_transform(args))
    setup_lrmoe_layers(model, args.micro_batch_size * args.seq_length,
                       nmc.get_num_microbatches, config)
    optimizer = builders.build_optimizer(args, model)
    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    attach_moe_timer(model[0], MoETimer())

    layers = lrmoe_layers(model)
    exchanges = [0] * len(layers)
    for i, layer in enumerate(layers):      # counts exchanges: one per pass of the layer
        def counted(routing_map, i=i, inner=layer.counts_exchange.gather_counts):
            exchanges[i] += 1
            return inner(routing_map)
        layer.counts_exchange.gather_counts = counted

    train_ds, _, _ = builders.build_datasets(args, tokenizer)
    data = MicroBatchIterator(train_ds, args.micro_batch_size, ps.get_data_parallel_rank(),
                              dp, 0, device)
    forward_backward = get_forward_backward_func()
    losses, grads = [], []
    with record_kept_pairs() as kept:
        for _ in range(args.train_iters):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=False)
            losses.append([r["lm loss"].clone() for r in reduced])
            grads.append({name: p.main_grad.detach().clone()
                          for name, p in model[0].named_parameters()})
            optimizer.step()
            finish_lrmoe_step(model)

    modules = list(model[0].modules())
    return {
        "losses": losses, "grads": grads,
        "draws": [(r.layer, r.call, r.pair_token, r.pair_expert, r.kept, r.scale)
                  for r in kept.records],
        "planners": [layer.placement_planner.state_dict() for layer in layers],
        "steps": [layer.lrmoe_state.step for layer in layers],
        "stats_calls": [len(layer.lrmoe_stats.calls) for layer in layers],
        "replicas": [len(layer.placement_planner.placement.replicas) for layer in layers],
        "microbatches": args.num_microbatches,
        "exchanges": exchanges,
        "engaged": {
            "core_attn": any(getattr(m, "checkpoint_core_attention", False) for m in modules),
            "layernorm": any(getattr(m, "recompute_pre_mlp_layernorm", False)
                             for m in modules),
            "moe": all(layer.moe_layer_recompute for layer in layers),
            "shared_experts": all(layer.shared_experts_recompute for layer in layers),
        },
    }


# -----------------------------------------------------------------------------
# Comparison
# -----------------------------------------------------------------------------


def _bitwise(a, b, where: str = "") -> None:
    """Assert ``a`` and ``b`` are identical: tensors bit for bit, containers by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: differs (max abs {(a - b).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _bitwise(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _same_training(reference: dict, run: dict, bitwise: bool = True) -> None:
    """Same training: draws and planners bitwise; losses and gradients bitwise, or
    fp32-equal (rtol 1e-5, atol 1e-6) when ``bitwise`` is False."""
    for key in ("draws", "planners", "steps", "stats_calls", "replicas"):
        _bitwise(reference[key], run[key], key)
    for key in ("losses", "grads"):
        if bitwise:
            _bitwise(reference[key], run[key], key)
        else:
            torch.testing.assert_close(run[key], reference[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda text, key=key: f"{key}: {text}")


# -----------------------------------------------------------------------------
# Tests
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("rule", sorted(RULES))
def test_recompute_leaves_training_unchanged(gloo2, rule):
    """EP 2: each recompute variant against the run without recompute (same GEMM path)."""
    base = BASE + EP2 + RULES[rule] + ["--train-iters", str(STEPS)]
    references = {}
    for name, (extra, recompute) in VARIANTS.items():
        key = tuple(extra)
        if key not in references:
            references[key] = gloo2.run(_train, base + extra, timeout=300)
            for result in references[key]:
                assert result["exchanges"] == [STEPS * result["microbatches"]] * 2
                assert not any(result["engaged"].values())
        runs = gloo2.run(_train, base + extra + recompute, timeout=300)
        for rank, (reference, run) in enumerate(zip(references[key], runs, strict=True)):
            where = f"{rule}, {name}, rank {rank}"
            # Every micro-batch planned once per pass, observed and counted once.
            passes = 2 if name.startswith(("moe", "full")) else 1
            assert run["exchanges"] == [passes * STEPS * run["microbatches"]] * 2, where
            assert run["stats_calls"] == [STEPS * run["microbatches"]] * 2, where
            for module, engaged in run["engaged"].items():
                assert engaged == (module in name.split("+")), (where, module)
            assert any(run["replicas"]), f"{where}: no replicas were placed"
            assert any(len(kept) < len(tokens) for _, _, tokens, _, kept, _ in run["draws"]), \
                f"{where}: nothing was dropped"
            try:
                # Megatron's layernorm recompute returns the norm's input gradient as
                # one sum, added to the residual's after: another association of the
                # same terms than without it (docs/design.md, "Recompute").
                _same_training(reference, run, bitwise="layernorm" not in name)
            except AssertionError as error:
                raise AssertionError(f"{where}: {error}") from None


def test_full_recompute_under_1f1b_pipeline(gloo2):
    """PP 2 (1F1B, 4 micro-batches: stage 0 runs two forwards before its first
    backward): recomputed passes run in backward order, which is micro-batch order, so
    the draws and everything else equal the run without recompute."""
    base = BASE + RULES["uniform"] + [
        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
        "--train-iters", "2"]
    reference = gloo2.run(_train, base, timeout=300)
    runs = gloo2.run(_train, base + FULL + ["block", "--recompute-num-layers", "1"],
                     timeout=300)
    for rank, (ref, run) in enumerate(zip(reference, runs, strict=True)):
        assert run["microbatches"] == 4
        assert run["exchanges"] == [2 * ref["exchanges"][0]], rank
        assert [r[1] for r in run["draws"]] == [0, 1, 2, 3] * 2, rank   # ordinals
        _same_training(ref, run)


def test_launcher_records_routing_under_recompute(gloo2, tmp_path):
    """The launcher end to end (``pretrain.train``, with dropout) under `moe` recompute,
    whose recorded router call runs in backward: the same routing recorded, once per
    micro-batch, and the same losses as without recompute."""
    from megatron_lrmoe.data.routing_traces import read_routing_trace
    from tests.launcher.test_launcher import _train as launcher_train

    base = TINY + ["--mock-data", "--train-iters", "2", "--lr-warmup-iters", "0",
                   "--expert-model-parallel-size", "2", "--global-batch-size", "8",
                   "--micro-batch-size", "2", "--moe-lrmoe"]
    losses, traces = {}, {}
    for name, recompute in {"none": [], "moe": SELECTIVE + ["moe"]}.items():
        path = str(tmp_path / name)
        losses[name] = gloo2.run(launcher_train, base + recompute + ["--record-routing", path],
                                 timeout=300)[0]["losses"]
        traces[name] = read_routing_trace(path)
    assert traces["none"].counts.shape[:3] == (2, 2, 2)      # steps, layers, micro-batches
    assert losses["moe"] == losses["none"]
    assert np.array_equal(traces["moe"].counts, traces["none"].counts)


def _recompute_under_the_cpu_runtime() -> list[torch.Tensor]:
    """Megatron's two recompute paths over code with a ``device='cuda'`` literal, which
    the CPU runtime redirects in forward: in backward too (integration/runtime/cpu.py)."""
    from megatron.core import tensor_parallel

    def layer(x):
        return x * torch.full(x.shape, 3.0, device="cuda")

    grads = []
    x = torch.arange(4.0, requires_grad=True)
    tensor_parallel.checkpoint(layer, False, x).sum().backward()
    grads.append(x.grad)
    x = torch.arange(4.0, requires_grad=True)
    recompute = tensor_parallel.CheckpointWithoutOutput()
    out = recompute.checkpoint(layer, x) * 2
    recompute.discard_output_and_register_recompute(out)
    out.sum().backward()
    grads.append(x.grad)
    return grads


def test_recompute_runs_under_the_cpu_runtime(gloo2):
    for grads in gloo2.run(_recompute_under_the_cpu_runtime):
        assert torch.equal(grads[0], torch.full((4,), 3.0))
        assert torch.equal(grads[1], torch.full((4,), 6.0))


def test_unknown_recompute_module_is_refused_by_name():
    """A module LRMoE does not implement (say one a later Megatron adds) is refused,
    naming the flag, never accepted as a no-op; every module Megatron 0.19 has passes
    (test_megatron_options.py checks the list against Megatron's own validation)."""
    from types import SimpleNamespace

    from megatron_lrmoe.options.lrmoe import (
        RECOMPUTE_MODULES,
        LRMoEConfigError,
        check_recompute,
    )

    megatron_modules = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                        "shared_experts", "gdn_norm_out"}
    assert set(RECOMPUTE_MODULES) == megatron_modules
    check_recompute(SimpleNamespace(recompute_granularity="selective",
                                    recompute_modules=sorted(megatron_modules)))
    check_recompute(SimpleNamespace(recompute_granularity="selective", recompute_modules=None))
    check_recompute(SimpleNamespace(recompute_granularity="full", recompute_modules=["x"]))
    with pytest.raises(LRMoEConfigError) as err:
        check_recompute(SimpleNamespace(recompute_granularity="selective",
                                        recompute_modules=["core_attn", "moe_router"]))
    assert str(err.value).startswith("--recompute-modules: 'moe_router' not supported with "
                                     "--moe-lrmoe")
