"""LRMoE's step state (docs/design.md, "Step state"): it travels in the model's
checkpoint, advances once per optimizer step, a re-run step or an evaluation pass
leaves it as one step, and the checkpoint of a fatal re-run holds it as before the step.

The references are independent of the code under test: an uninterrupted run of the
same launcher, Megatron's own ``RerunStateMachine`` (with its error injector) and
``dist_checkpointing``, and runs without re-runs or evaluation.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.launcher.test_launcher import TINY, _train

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
LRMOE = ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75"]
# 4 experts on 2 EP ranks: 2 homes per rank, room for replicas.
POPULARITY = ["--moe-lrmoe-placement", "popularity", "--moe-lrmoe-slots-per-rank", "3"]


def test_lrmoe_layers_is_one_definition_in_chunk_then_module_order():
    """The step state and the statistics find the LRMoE layers with the same function
    (``stats.lrmoe_layers``, re-exported by ``step``): the modules that keep
    ``LRMoELayerStats``, chunk by chunk in module order; the model tests below use it on
    real LRMoE layers."""
    from megatron_lrmoe.integration import step_hooks as step
    from megatron_lrmoe.layer import stats

    assert step.lrmoe_layers is stats.lrmoe_layers
    assert "lrmoe_layers" in step.__all__ and "lrmoe_layers" in stats.__all__

    def layer() -> torch.nn.Module:
        module = torch.nn.Module()
        module.lrmoe_stats = stats.LRMoELayerStats()
        return module

    first, second, third = layer(), layer(), layer()
    chunk0 = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(first), second)
    impostor = torch.nn.Module()
    impostor.lrmoe_stats = {"calls": []}   # not LRMoELayerStats: not an LRMoE layer
    chunk1 = torch.nn.Sequential(impostor, third)
    assert stats.lrmoe_layers([chunk0, chunk1]) == [first, second, third]
    assert stats.lrmoe_layers([chunk1, chunk0]) == [third, first, second]
    assert stats.lrmoe_layers([torch.nn.Linear(2, 2)]) == []


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    """Compute-bound machine constants: memory-aware placement then adds replicas
    whenever they relieve the busiest rank (and a file, unlike a measurement, is the
    same in a resumed process)."""
    path = tmp_path_factory.mktemp("calibration") / "compute_bound.json"
    path.write_text(json.dumps({"gemm_flops_per_s": 1e6, "alltoall_bytes_per_s": 1e18,
                                "alltoall_latency_s": 0.0, "source": "test: compute-bound"}))
    return str(path)


def _memory_aware(calibration: str, budget: str = "0.05") -> list[str]:
    return ["--moe-lrmoe-placement", "memory-aware", "--moe-lrmoe-memory-budget-gb", budget,
            "--moe-lrmoe-calibration", calibration]


# -----------------------------------------------------------------------------
# Pool tasks
# -----------------------------------------------------------------------------


def _checkpoint_contents(path: str) -> dict:
    """Every tensor of a dist_checkpointing directory and every LRMoE step state in it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    tensors = dist_checkpointing.load_plain_tensors(path)
    request = {f"{v.key}@{v.global_offset}": ShardedObject(v.key, None, v.global_shape,
                                                          v.global_offset, replica_id=0)
               for v in load_sharded_metadata(path).values()
               if isinstance(v, ShardedObject) and v.key.endswith("mlp._extra_state")}
    loaded = dist_checkpointing.load(request, path, validate_access_integrity=False)
    return {"tensors": tensors, "lrmoe": {k: loaded[k] for k in request}}   # (less common state)


def _launcher_parts(argv: list[str]) -> dict:
    """What ``training.train`` builds before its loop, through the same builders."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.distributed import initialize_distributed
    from megatron_lrmoe.launcher.run_config import build_config

    args = parse_args(argv)
    device, _ = initialize_distributed(args)
    args.num_microbatches = args.global_batch_size // (
        args.micro_batch_size * ps.get_data_parallel_world_size())
    nmc.init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size,
                                         ps.get_data_parallel_world_size())
    tokenizer = builders.build_tokenizer_from_args(args)
    config = build_config(args)
    model = builders.build_model(args, config, tokenizer.vocab_size,
                                 spec_transform=builders.lrmoe_spec_transform(args))
    if args.moe_lrmoe:
        setup_lrmoe_layers(model, args.micro_batch_size * args.seq_length,
                           nmc.get_num_microbatches, config)
    optimizer = builders.build_optimizer(args, model)
    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    return {"args": args, "device": device, "tokenizer": tokenizer, "model": model,
            "optimizer": optimizer, "scheduler": builders.build_scheduler(args, optimizer),
            "forward_backward": get_forward_backward_func()}


def _gathered_weights(model) -> dict:
    """The model's parameters by checkpoint key and global offset, from every rank (so
    runs at different EP sizes compare expert by expert)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.utils import unwrap_model

    local = {}
    for value in unwrap_model(model[0]).sharded_state_dict().values():
        if isinstance(value, ShardedTensor):
            local[(value.key, value.global_offset)] = value.data.detach().clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged = {}
    for part in everyone:
        merged.update(part)
    return merged


def _load_and_describe(argv: list[str], checkpoint: str) -> dict:
    """Build the launcher's model, load ``checkpoint`` as ``--no-load-optim --no-load-rng``
    does; the weights and each LRMoE layer's planner origin and state."""
    from megatron_lrmoe.integration.step_hooks import lrmoe_layers
    from megatron_lrmoe.launcher import checkpointing

    parts = _launcher_parts(argv)
    model = parts["model"]
    progress = checkpointing.load_checkpoint(checkpoint, model, parts["optimizer"],
                                             parts["scheduler"], load_optimizer=False,
                                             load_rng=False)
    layers = lrmoe_layers(model)
    return {"iteration": progress.iteration, "weights": _gathered_weights(model),
            "origins": [layer.planner_state_origin for layer in layers],
            "planner_steps": [layer.placement_planner.step for layer in layers]}


def _steps(argv: list[str], steps: int, rerun: bool, evaluate: bool, fatal: str | None = None,
           save: str | None = None) -> dict:
    """Megatron-LM's train_step loop around the launcher's model (core_v0.19.0,
    megatron/training/training.py): forward-backward under the re-run state machine, the
    loss checked by ``validate_result`` (as pretrain_gpt.py's loss_func does), optimizer
    step, then LRMoE's step boundary; optionally an evaluation pass after every step.

    ``rerun``: the machine in ``validate_results`` mode with its error injector at rate
    1, transient and not fatal, so every step after the first is run twice and then
    continues; Megatron-LM's own state_save_func/state_restore_func (the RNG tracker) are
    installed first, and LRMoE chains onto them.

    ``fatal``: the machine in ``validate_results`` mode with the injector at rate 1 and
    this error type, and the check fatal (pretrain_gpt.py's NaN/Inf check is): the second
    step ends with the machine asking for a checkpoint and an exit, which are done as
    Megatron-LM's train() does them (train_step returns before the optimizer step; the
    loop saves at the iteration reached, without training_log, and stops).

    ``save``: a checkpoint directory (the launcher's save_checkpoint, dist_checkpointing):
    a checkpoint after every step, or with ``fatal`` only the one the machine asks for.
    """
    from megatron.core import rerun_state_machine as rsm
    from megatron.core import tensor_parallel
    from megatron.core.parallel_state import get_data_parallel_rank, get_data_parallel_world_size

    from megatron_lrmoe.integration.step_hooks import (
        chain_to_rerun_state_machine,
        finish_lrmoe_step,
        lrmoe_layers,
        snapshot_lrmoe_state,
    )
    from megatron_lrmoe.launcher.builders import build_datasets
    from megatron_lrmoe.launcher.checkpointing import TrainingProgress, save_checkpoint
    from megatron_lrmoe.launcher.data_iterators import MicroBatchIterator
    from megatron_lrmoe.launcher.step import forward_step

    parts = _launcher_parts(argv)
    args, model, optimizer = parts["args"], parts["model"], parts["optimizer"]
    train_ds, valid_ds, _ = build_datasets(args, parts["tokenizer"])

    def save_tracker():
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def restore_tracker(state):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])

    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(
        state_save_func=save_tracker, state_restore_func=restore_tracker,
        mode=rsm.RerunMode.VALIDATE_RESULTS if rerun or fatal else rsm.RerunMode.DISABLED,
        error_injector=rsm.RerunErrorInjector(
            error_injection_rate=1 if rerun or fatal else 0,
            error_injection_type=rsm.RerunDiagnostic(fatal or "transient_error")))
    chain_to_rerun_state_machine(lambda: model)
    machine = rsm.get_rerun_state_machine()
    data = rsm.RerunDataIterator(MicroBatchIterator(
        train_ds, args.micro_batch_size, get_data_parallel_rank(),
        get_data_parallel_world_size(), 0, parts["device"]))

    def checked_forward_step(data_iterator, chunk):
        output, loss_func = forward_step(data_iterator, chunk)

        def checked(output_tensor):
            loss_sum, tokens, report = loss_func(output_tensor)
            machine.validate_result(result=loss_sum, rejection_func=torch.isnan,
                                    message="loss is NaN", tolerance=0.0,
                                    fatal=fatal is not None)
            return loss_sum, tokens, report

        return output, checked

    def run(iterator, forward_only: bool) -> list[dict]:
        return parts["forward_backward"](
            forward_step_func=checked_forward_step, data_iterator=iterator, model=model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
            forward_only=forward_only)

    def save_at(iteration: int) -> None:
        save_checkpoint(save, model, optimizer, parts["scheduler"],
                        TrainingProgress(iteration=iteration))

    losses, passes, evaluation_changed, exit_code = [], 0, [], None
    for step in range(steps):
        while machine.should_run_forward_backward(data):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            reported = run(data, False)
            passes += 1
        should_checkpoint, should_exit, code = machine.should_checkpoint_and_exit()
        if fatal is None:
            assert (should_checkpoint, should_exit, code) == (False, False, 0)
        if should_checkpoint:
            save_at(step)          # Megatron-LM's train(): the iterations completed so far
        if should_exit:
            exit_code = code
            break
        optimizer.step()
        finish_lrmoe_step(model)
        if save is not None and fatal is None:
            save_at(step + 1)
        total = sum((d["lm loss"] for d in reported), torch.zeros(2))
        losses.append(float(total[0] / total[1]))
        if evaluate:   # as Megatron-LM's evaluate(): eval mode, no re-runs
            before = snapshot_lrmoe_state(model)
            mode = machine.get_mode()
            machine.set_mode(rsm.RerunMode.DISABLED)
            for chunk in model:
                chunk.eval()
            with torch.no_grad():
                run(MicroBatchIterator(valid_ds, args.micro_batch_size, get_data_parallel_rank(),
                                       get_data_parallel_world_size(), 0, parts["device"]),
                    True)
            for chunk in model:
                chunk.train()
            machine.set_mode(mode)
            # The replicas' refresh mark may go (evaluation refreshes them, with the
            # step's new weights); the planner, step count and draw ordinal may not.
            after = snapshot_lrmoe_state(model)
            kept = ("planner", "step", "calls", "backwards", "stats")
            evaluation_changed.append(_differs([{k: s[k] for k in kept} for s in before],
                                               [{k: s[k] for k in kept} for s in after]))
    layers = lrmoe_layers(model)
    return {"losses": losses, "passes": passes, "evaluation_changed": evaluation_changed,
            "exit_code": exit_code,
            "planners": [layer.placement_planner.state_dict() for layer in layers],
            "steps": [layer.lrmoe_state.step for layer in layers],
            "region_calls": [len(layer.lrmoe_stats.calls) for layer in layers],
            "weights": _gathered_weights(model)}


def _differs(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    return a != b


# -----------------------------------------------------------------------------
# Tests
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy, selection", [("popularity", "uniform"),
                                               ("memory-aware", "sample")])
def test_resume_is_bitwise_with_and_without_rng(gloo2, corpus, tmp_path, calibration, policy,
                                                selection):
    """Losses, final weights and the final planner states of a resumed run equal the
    uninterrupted run's, also under --no-load-rng: the draws and the planner come from
    the model's checkpoint. Two micro-batches per step (draw ordinals, replica gradient
    accumulation), distributed optimizer."""
    placement = POPULARITY if policy == "popularity" else _memory_aware(calibration)
    base = TINY + NO_DROPOUT + LRMOE + placement + [
        "--moe-lrmoe-selection", selection, "--data-path", corpus, "--train-iters", "8",
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
        "--global-batch-size", "16"]
    dirs = {name: str(tmp_path / name) for name in ("straight", "half", "resumed", "no_rng")}
    straight = gloo2.run(_train, base + ["--save", dirs["straight"]], timeout=300)[0]["losses"]
    half = gloo2.run(_train, base + ["--save", dirs["half"], "--exit-interval", "4"],
                     timeout=300)[0]["losses"]
    resumed = gloo2.run(_train, base + ["--load", dirs["half"], "--save", dirs["resumed"]],
                        timeout=300)[0]["losses"]
    no_rng = gloo2.run(_train, base + ["--load", dirs["half"], "--save", dirs["no_rng"],
                                       "--no-load-rng"], timeout=300)[0]["losses"]
    assert half == straight[:4]
    assert resumed == straight[4:], (resumed, straight)
    assert no_rng == straight[4:], (no_rng, straight)
    final = {name: gloo2.run(_checkpoint_contents, dirs[name] + "/iter_0000008")[0]
             for name in ("straight", "resumed", "no_rng")}
    reference = final["straight"]
    assert len(reference["lrmoe"]) == 2, "one step state per MoE layer"
    for state in reference["lrmoe"].values():
        assert state["step"] == 8 and state["planner"]["step"] == 8
        assert state["planner"]["smoothed_counts"] is not None
    for name in ("resumed", "no_rng"):
        got = final[name]
        assert got["tensors"].keys() == reference["tensors"].keys()
        unequal = [k for k in reference["tensors"]
                   if _differs(got["tensors"][k], reference["tensors"][k])]
        assert not unequal, (name, unequal[:5])
        assert not _differs(got["lrmoe"], reference["lrmoe"]), name


def test_rerun_and_evaluation_leave_one_step(gloo2, corpus):
    """Megatron's re-run state machine re-runs every step after the first (its error
    injector); with LRMoE chained onto its state functions each step still counts once:
    losses, weights and planner states equal a run without re-runs, and evaluation
    passes between steps change nothing."""
    argv = TINY + NO_DROPOUT + LRMOE + POPULARITY + [
        "--moe-lrmoe-selection", "sample", "--data-path", corpus,
        "--expert-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters", "4"]
    plain = gloo2.run(_steps, argv, 4, False, False, timeout=300)
    rerun = gloo2.run(_steps, argv, 4, True, True, timeout=300)
    for p, r in zip(plain, rerun, strict=True):
        assert p["passes"] == 4 and r["passes"] == 7, "steps 2-4 are run twice"
        assert r["losses"] == p["losses"]
        assert r["steps"] == p["steps"] == [4, 4]
        assert not _differs(r["planners"], p["planners"])
        assert r["region_calls"] == p["region_calls"] == [8, 8], "statistics count once"
        assert r["evaluation_changed"] == [False] * 4
        assert not _differs(r["weights"], p["weights"])
    assert all(state["replicas"] for p in plain for state in p["planners"]), \
        "replicas were placed (their gradients are part of the check)"


@pytest.mark.parametrize("injected, exit_code, saves", [
    # The re-run reproduces the result: EXIT_CODE_RESUME_TO_DISAMBIGUATE, with a checkpoint
    # to resume from (to re-run the step elsewhere).
    ("persistent_error", 16, True),
    # It does not: EXIT_CODE_FAILED_ON_RESULT_VALIDATION; since megatron-core 0.19 without a
    # checkpoint (the job resumes from its last regular one).
    ("transient_error", 17, False),
])
def test_fatal_rerun_checkpoint_holds_the_pre_step_state(gloo2, corpus, tmp_path, injected,
                                                         exit_code, saves):
    """Megatron-LM's default re-run mode with a fatal check (pretrain_gpt.py's NaN/Inf
    check): after the re-run of a rejected step the machine asks for an exit, and for a
    checkpoint where the re-run reproduced the result; Megatron-LM's train() saves right
    after train_step returns, with no optimizer step and no training_log, hence no LRMoE
    step boundary. The machine has restored its saved state (LRMoE's chained snapshot
    included) before it answers, so the checkpoint holds the state from before the failed
    step: step state, weights and optimizer state equal those of a run without re-runs
    saved after its first step."""
    argv = TINY + NO_DROPOUT + LRMOE + POPULARITY + [
        "--moe-lrmoe-selection", "sample", "--data-path", corpus,
        "--expert-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters", "4"]
    plain_dir, fatal_dir = str(tmp_path / "plain"), str(tmp_path / "fatal")
    plain = gloo2.run(_steps, argv, 2, False, False, save=plain_dir, timeout=300)
    fatal = gloo2.run(_steps, argv, 2, False, False, fatal=injected, save=fatal_dir,
                      timeout=300)
    for p, f in zip(plain, fatal, strict=True):
        assert p["exit_code"] is None and f["exit_code"] == exit_code
        assert f["passes"] == 3, "step 1, then step 2 and its re-run in place"
        assert f["losses"] == p["losses"][:1]
    if not saves:
        assert not os.path.exists(fatal_dir), os.listdir(fatal_dir)
        return
    with open(os.path.join(fatal_dir, "latest_checkpointed_iteration.txt")) as tracker:
        assert tracker.read() == "1"
    before, after = (gloo2.run(_checkpoint_contents, os.path.join(plain_dir, name))[0]
                     for name in ("iter_0000001", "iter_0000002"))
    got = gloo2.run(_checkpoint_contents, os.path.join(fatal_dir, "iter_0000001"))[0]
    assert len(got["lrmoe"]) == 2, "one step state per MoE layer"
    assert not _differs(got["lrmoe"], before["lrmoe"])
    assert _differs(after["lrmoe"], before["lrmoe"]), "the step changes the state"
    for state in got["lrmoe"].values():
        assert state["step"] == 1 and state["planner"]["step"] == 1
        assert state["planner"]["observed"] == 0 and state["planner"]["replicas"]
    assert got["tensors"].keys() == before["tensors"].keys()
    unequal = [k for k in before["tensors"] if _differs(got["tensors"][k], before["tensors"][k])]
    assert not unequal, unequal[:5]


def _train_saving_the_legacy_flag(argv: list[str]) -> dict:
    """``_train``, its checkpoints saved as before the step-state flag was renamed: their
    content metadata names the state ``lrmoe_planner_state``."""
    from megatron_lrmoe.launcher import checkpointing

    def legacy(config) -> dict:
        return {"lrmoe_planner_state": True} if config.moe_lrmoe else {}

    current = checkpointing.checkpoint_content_metadata
    checkpointing.checkpoint_content_metadata = legacy
    try:      # the pool's workers live on: put the function back
        return _train(argv)
    finally:
        checkpointing.checkpoint_content_metadata = current


def test_checkpoints_cross_plain_megatron_and_ep_sizes(gloo2, corpus, tmp_path):
    """Plain Megatron -> LRMoE -> plain Megatron, and LRMoE EP=2 -> EP=1 as
    ``--no-load-optim --no-load-rng`` loads it: never an error (dist_checkpointing's
    default strictness), weights identical, the planner fresh where the checkpoint has
    no state for it."""
    # (--train-iters is each run's last flag; the loading helper builds for 8.)
    base = TINY + NO_DROPOUT + ["--data-path", corpus, "--expert-model-parallel-size", "2",
                                "--use-distributed-optimizer", "--lr-warmup-iters", "1",
                                "--train-iters", "8"]
    # Four slots per rank: valid at EP=2 (two replicas) and at EP=1.
    lrmoe = LRMOE + ["--moe-lrmoe-placement", "popularity", "--moe-lrmoe-slots-per-rank", "4"]
    plain_dir, lrmoe_dir = str(tmp_path / "plain"), str(tmp_path / "lrmoe")
    gloo2.run(_train, base + ["--train-iters", "2", "--save", plain_dir], timeout=300)
    as_plain = gloo2.run(_load_and_describe, base, plain_dir, timeout=300)[0]
    as_lrmoe = gloo2.run(_load_and_describe, base + lrmoe, plain_dir, timeout=300)[0]
    assert not _differs(as_lrmoe["weights"], as_plain["weights"])
    assert all(o.startswith("fresh: the checkpoint holds no LRMoE step state")
               for o in as_lrmoe["origins"]), as_lrmoe["origins"]

    gloo2.run(_train, base + lrmoe + ["--train-iters", "4", "--load", plain_dir,
                                      "--save", lrmoe_dir], timeout=300)
    lrmoe_ep2 = gloo2.run(_load_and_describe, base + lrmoe, lrmoe_dir, timeout=300)[0]
    assert lrmoe_ep2["iteration"] == 4
    assert lrmoe_ep2["origins"] == ["checkpoint"] * 2 and lrmoe_ep2["planner_steps"] == [2, 2]
    back_to_plain = gloo2.run(_load_and_describe, base, lrmoe_dir, timeout=300)[0]
    assert not _differs(back_to_plain["weights"], lrmoe_ep2["weights"])
    # A checkpoint saved before the step-state flag had its name loads its state alike.
    legacy_dir = str(tmp_path / "legacy")
    gloo2.run(_train_saving_the_legacy_flag, base + lrmoe + [
        "--train-iters", "4", "--load", plain_dir, "--save", legacy_dir], timeout=300)
    legacy = gloo2.run(_load_and_describe, base + lrmoe, legacy_dir, timeout=300)[0]
    assert legacy["origins"] == ["checkpoint"] * 2 and legacy["planner_steps"] == [2, 2]
    assert not _differs(legacy["weights"], lrmoe_ep2["weights"])

    ep1 = list(base)
    ep1[ep1.index("--expert-model-parallel-size") + 1] = "1"
    lrmoe_ep1 = gloo2.run(_load_and_describe, ep1 + lrmoe, lrmoe_dir, timeout=300)[0]
    assert not _differs(lrmoe_ep1["weights"], lrmoe_ep2["weights"])
    assert all("is for (EP, experts, placement) = (2, 4, 'popularity'), this run has "
               "(1, 4, 'popularity')" in o for o in lrmoe_ep1["origins"]), lrmoe_ep1["origins"]
    assert lrmoe_ep1["planner_steps"] == [0, 0]
    # And the launcher trains on from it (the RNG and dp_reshardable optimizer state do
    # not reshard across EP sizes, hence the two flags).
    resumed = gloo2.run(_train, ep1 + lrmoe + ["--train-iters", "5", "--load", lrmoe_dir,
                                               "--no-load-optim", "--no-load-rng"], timeout=300)
    assert len(resumed[0]["losses"]) == 1
