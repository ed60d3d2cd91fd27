"""The lean launcher's training loop: ``train(args, config)``.

Megatron is imported here, at the top: ``pretrain.train`` imports this module once the
runtime is on (without CUDA, the CPU/gloo runtime of ``integration/runtime/cpu.py``).

``train`` reads top to bottom as setup, resume, then the loop (step, log, hold to the
device, evaluate, checkpoint), then shutdown. Each stage is one function below it, in
that order; the operations run in the same order as when they were one function (the
checkpoint-resume test and the bitwise-loss comparisons depend on it).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import num_microbatches_calculator
from megatron.core import parallel_state as ps
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_model_config

from megatron_lrmoe.config.flags import ConfigError, tokens_per_rank
from megatron_lrmoe.integration.planner_inputs import check_memory_budget
from megatron_lrmoe.integration.step_hooks import (
    finish_lrmoe_step,
    machine_constants_line,
    setup_lrmoe_layers,
)
from megatron_lrmoe.launcher import builders, checkpointing, device_hold
from megatron_lrmoe.launcher.checkpointing import TrainingProgress
from megatron_lrmoe.launcher.data_iterators import MicroBatchIterator
from megatron_lrmoe.launcher.device_hold import DeviceHold
from megatron_lrmoe.launcher.distributed import setup_parallel_state, take_down_parallel_state
from megatron_lrmoe.launcher.logger import (
    Logger,
    Tally,
    log0,
    log_interval,
    log_lrmoe,
    print_summary,
    summary,
)
from megatron_lrmoe.launcher.moe_timing import MoETimer, attach_moe_timer
from megatron_lrmoe.launcher.routing_record import (
    RoutingRecorder,
    RoutingRecordError,
    start_recording,
)
from megatron_lrmoe.launcher.run_config import build_config
from megatron_lrmoe.launcher.step import (
    evaluate,
    forward_step,
    params_gathered,
    reduce_step_stats,
)
from megatron_lrmoe.planning.memory_account import DeviceOutOfMemory, MemoryAccount

__all__ = ["train"]


def train(args: argparse.Namespace, config: TransformerConfig | None = None) -> dict:
    """Train to ``--train-iters`` (or ``--exit-interval``); the summary, on every rank.
    ``config``: the run's (``run_config.build_config``; built here when not given).
    Held to its device (``--device-memory-gb``), a step whose peak exceeds the device
    raises ``DeviceOutOfMemory`` on every rank, after the same teardown as a finished run."""
    if config is None:
        config = build_config(args)

    # ---- setup: parallel state, model, optimizer, instruments ---------------
    device, owns_process_group = setup_parallel_state(args)
    run = _setup_model_and_optimizer(args, config, device)
    # ---- resume, then data (the sampler continues from the consumed samples) --
    progress = _resume(args, run)
    _setup_data(args, run, progress)
    run.forward_backward = get_forward_backward_func()

    # ---- the loop --------------------------------------------------------------
    logger = Logger.create(args, progress.iteration)
    tally = Tally(train_start=time.perf_counter())
    first_iteration = progress.iteration
    while progress.iteration < args.train_iters:
        losses, grad_norm, step_time = _train_step(args, run)
        progress.iteration += 1
        progress.consumed_train_samples += args.global_batch_size
        record, loss = _step_record(args, run, tally, progress, losses, grad_norm, step_time)
        if run.hold is not None:
            try:
                run.hold.check_step(run.model, run.recorder, progress.iteration, record)
            except DeviceOutOfMemory:   # the out-of-memory stop: every rank, at this step
                _teardown(run, logger, owns_process_group)
                raise
        logger.advance({"loss": f"{loss:.3f}"})
        _check_allocator(run, logger, progress.iteration - first_iteration)
        log_interval(args, logger, tally, progress, record)
        log_lrmoe(args, run.model, logger, progress, record)
        _evaluate_if_due(args, run, logger, tally, progress, record)
        logger.write(record)
        if _checkpoint_and_check_exit(args, run, logger, progress):
            break

    # ---- shutdown --------------------------------------------------------------
    return _shutdown(args, run, logger, tally, progress, owns_process_group)


@dataclass
class _Run:
    """What setup builds and every later stage uses."""

    device: torch.device
    config: TransformerConfig
    tokenizer: object
    model: list
    optimizer: object
    scheduler: object
    moe_timer: MoETimer
    recorder: RoutingRecorder | None
    tokens_per_step: int
    account: MemoryAccount | None = None
    """The memory account (with --moe-lrmoe or --device-memory-gb)."""
    hold: DeviceHold | None = None
    """Held to the device (--device-memory-gb): what each step is checked with."""
    train_iter: MicroBatchIterator | None = None
    valid_ds: object | None = None
    forward_backward: object | None = None


# ---- setup -------------------------------------------------------------------


def _setup_model_and_optimizer(args: argparse.Namespace, config: TransformerConfig,
                               device: torch.device) -> _Run:
    """Model (with LRMoE planners), optimizer and scheduler, then the MoE timer and the
    routing recorder; one log line of the parameter count."""
    tokenizer = builders.build_tokenizer_from_args(args)
    model, account = _build_model(args, config, device, tokenizer)
    optimizer, scheduler = _build_optimizer(args, model)
    moe_timer, moe_layers, recorder = _attach_instruments(args, model)
    n_params = sum(p.numel() for p in model[0].parameters())
    log0(f"model: {n_params / 1e6:.2f} M parameters on rank 0, {moe_layers} MoE layer(s) timed")
    return _Run(device=device, config=config, tokenizer=tokenizer, model=model,
                optimizer=optimizer, scheduler=scheduler, moe_timer=moe_timer,
                recorder=recorder, tokens_per_step=args.global_batch_size * args.seq_length,
                account=account, hold=device_hold.hold(args, config, account, device))


def _build_model(args: argparse.Namespace, config: TransformerConfig, device: torch.device,
                 tokenizer) -> tuple[list, MemoryAccount | None]:
    """The model chunks and the memory account (printed; with --moe-lrmoe or a run held
    to its device, else None); the memory budget is checked first (a refusal before
    anything is allocated) and the planners are set up right after the build."""
    account = None
    if args.moe_lrmoe or device_hold.held(args):
        account = device_hold.print_memory_account(
            args, config, builders.padded_vocab_size(tokenizer.vocab_size, args))
    if args.moe_lrmoe:
        tokens = tokens_per_rank(args)
        try:
            fit = check_memory_budget(config, args.expert_model_parallel_size, tokens,
                                      args.num_microbatches, device.type,
                                      args.micro_batch_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if fit:
            log0(f"megatron_lrmoe.launcher.pretrain: {fit}")
    model = builders.build_model(
        args, config, tokenizer.vocab_size, spec_transform=builders.lrmoe_spec_transform(args)
    )
    if args.moe_lrmoe:   # planners built now, before any checkpoint is loaded or step runs
        machine = setup_lrmoe_layers(
            model, tokens, num_microbatches_calculator.get_num_microbatches, config,
            hold_memory=device_hold.held(args))
        if machine is not None:
            log0(machine_constants_line(machine))
    return model, account


def _build_optimizer(args: argparse.Namespace, model: list) -> tuple[object, object]:
    """Optimizer and scheduler, and the model config's hooks into them (loss scaling,
    gradient finalisation, overlapped gradient reduction) that the schedule calls."""
    optimizer = builders.build_optimizer(args, model)
    scheduler = builders.build_scheduler(args, optimizer)
    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        model_config.no_sync_func = model[0].no_sync
        model_config.grad_sync_func = model[0].start_grad_sync
    return optimizer, scheduler


def _attach_instruments(args: argparse.Namespace, model: list
                        ) -> tuple[MoETimer, int, RoutingRecorder | None]:
    """MoE-layer timer and routing recorder; returns (timer, MoE layers timed, recorder)."""
    moe_timer = MoETimer(sync_cuda=torch.cuda.is_available())
    moe_layers = 0 if args.no_moe_timing else attach_moe_timer(model[0], moe_timer)
    recorder = None
    # Held to the device, Megatron's own layer needs each step's routed counts too (the
    # recorder without a trace); LRMoE's planners report their memory themselves.
    counts_needed = (device_hold.held(args) and not args.moe_lrmoe
                     and args.num_experts is not None)
    if args.record_routing or counts_needed:
        # After the timer: the count reduction then falls outside its spans.
        try:
            recorder = start_recording(args, model, args.record_routing or None)
        except RoutingRecordError as error:
            raise ConfigError(str(error)) from None
    return moe_timer, moe_layers, recorder


# ---- resume and data -----------------------------------------------------------


def _resume(args: argparse.Namespace, run: _Run) -> TrainingProgress:
    """The progress of the checkpoint in ``--load`` (with its state loaded), else zero."""
    progress = TrainingProgress()
    if args.load:
        loaded = checkpointing.load_checkpoint(
            args.load, run.model, run.optimizer, run.scheduler,
            load_optimizer=not args.no_load_optim, load_rng=not args.no_load_rng,
        )
        if loaded is None:
            log0(f"--load {args.load}: no checkpoint yet, starting from scratch")
        else:
            progress = loaded
            log0(f"resumed from {args.load} at iteration {progress.iteration}")
    return progress


def _setup_data(args: argparse.Namespace, run: _Run, progress: TrainingProgress) -> None:
    """Datasets, and the training iterator from the samples already consumed."""
    train_ds, run.valid_ds, _ = builders.build_datasets(args, run.tokenizer)
    run.train_iter = MicroBatchIterator(
        train_ds, args.micro_batch_size, ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(), progress.consumed_train_samples, run.device,
    )


# ---- the step ------------------------------------------------------------------


def _train_step(args: argparse.Namespace, run: _Run) -> tuple[list[dict], object, float]:
    """One optimizer step over a global batch; returns (losses, grad norm, seconds)."""
    step_start = time.perf_counter()
    run.moe_timer.reset()
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    losses = run.forward_backward(
        forward_step_func=forward_step, data_iterator=run.train_iter, model=run.model,
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
        forward_only=False,
    )
    update_ok, grad_norm, _ = run.optimizer.step()
    if args.moe_lrmoe:   # the step boundary of LRMoE's planners and replicas
        finish_lrmoe_step(run.model)
    if update_ok:
        run.scheduler.step(increment=args.global_batch_size)
    return losses, grad_norm, time.perf_counter() - step_start


def _step_record(args: argparse.Namespace, run: _Run, tally: Tally, progress: TrainingProgress,
                 losses: list[dict], grad_norm, step_time: float) -> tuple[dict, float]:
    """The step's JSON-lines record from statistics reduced over ranks (one all_gather,
    plus the recorder's), and the step's loss; adds the step to the tally."""
    stats = reduce_step_stats(losses, run.moe_timer.forward_seconds,
                              run.moe_timer.backward_seconds)
    # Timings to the microsecond: the clock's jitter between steps is far above it, and
    # the floats' 17 digits were a fifth of a stored log. The cumulative MoE time is the
    # sum of the logged steps' figures, as a reader of the log adds them up.
    forward_s, backward_s = round(stats.moe_forward_s, 6), round(stats.moe_backward_s, 6)
    tally.cumulative_moe_s += forward_s + backward_s
    record = {
        "iteration": progress.iteration,
        "lm-loss": stats.loss,
        "learning-rate": run.optimizer.param_groups[0]["lr"],
        "grad-norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "step-time-s": round(step_time, 6),
        "tokens-per-sec": round(run.tokens_per_step / step_time, 1),
        "moe-forward-s": forward_s,
        "moe-backward-s": backward_s,
        "moe-cumulative-s": tally.cumulative_moe_s,
        "consumed-samples": progress.consumed_train_samples,
    }
    if run.recorder is not None:   # one all_gather of the step's routed counts
        loads = run.recorder.end_step(progress.iteration, interval_end=(
            progress.iteration % args.log_interval == 0 or progress.iteration == args.train_iters))
        if args.record_routing:
            record.update(loads)
    tally.add(stats, step_time)
    return record, stats.loss


def _check_allocator(run: _Run, logger: Logger, steps_run: int) -> None:
    """Once, after this process's second step on CUDA: the allocator's peak against the
    memory account."""
    if steps_run == 2 and run.device.type == "cuda" and run.account is not None:
        logger.line(device_hold.allocator_line(run.account, run.config, run.device))


# ---- evaluation and checkpointing ------------------------------------------------


def _evaluate_if_due(args: argparse.Namespace, run: _Run, logger: Logger, tally: Tally,
                     progress: TrainingProgress, record: dict) -> None:
    """Every ``--eval-interval`` steps and at the last (with ``--eval-iters`` > 0)."""
    if args.eval_iters > 0 and (
        progress.iteration % args.eval_interval == 0 or progress.iteration == args.train_iters
    ):
        with params_gathered(args, run.model):
            tally.val_loss = evaluate(args, run.model, run.forward_backward, run.valid_ds,
                                      run.device, run.moe_timer)
        record["validation-loss"] = tally.val_loss
        logger.line(f"iter {progress.iteration:6d} | validation loss {tally.val_loss:.4f}")


def _checkpoint_and_check_exit(args: argparse.Namespace, run: _Run, logger: Logger,
                               progress: TrainingProgress) -> bool:
    """Save every ``--save-interval`` steps and at the end (the last step or an
    ``--exit-interval`` stop); True when ``--exit-interval`` stops the run here."""
    exiting = bool(args.exit_interval) and progress.iteration % args.exit_interval == 0
    last = exiting or progress.iteration == args.train_iters
    periodic = bool(args.save_interval) and progress.iteration % args.save_interval == 0
    if args.save and (periodic or last):
        with params_gathered(args, run.model):
            path = checkpointing.save_checkpoint(
                args.save, run.model, run.optimizer, run.scheduler, progress
            )
        logger.line(f"saved checkpoint {path}")
    if exiting:
        logger.line(f"exiting at iteration {progress.iteration} (--exit-interval)")
    return exiting


# ---- shutdown --------------------------------------------------------------------


def _shutdown(args: argparse.Namespace, run: _Run, logger: Logger, tally: Tally,
              progress: TrainingProgress, owns_process_group: bool) -> dict:
    """Close the sinks, print the summary (rank 0), then take down Megatron's state and
    the process group if train() created it. Returns the summary."""
    logger.close()
    if run.recorder is not None:
        run.recorder.close()
    wall = time.perf_counter() - tally.train_start
    result = summary(logger, tally, progress, wall)
    if logger.history and dist.get_rank() == 0:
        print_summary(args, result, wall)
    _teardown(run, logger, owns_process_group)
    return result


def _teardown(run: _Run, logger: Logger, owns_process_group: bool) -> None:
    """Close the sinks (again: idempotent), then take down Megatron's state and the
    process group if train() created it: the end of a run, or its out-of-memory stop
    (every rank at the same step)."""
    logger.close()
    if run.recorder is not None:
        run.recorder.close()
    take_down_parallel_state(owns_process_group)
