"""Lean GPT(-MoE) pretraining on megatron.core: ``python -m megatron_lrmoe.launcher.pretrain``.

For machines without a Megatron-LM checkout (the CPU demo, quick experiments).
It takes Megatron-LM's flag names (see ``arguments.py``) and uses Megatron-Core
for everything that matters: GPTModel and its layer specs, the pipeline
schedules (``get_forward_backward_func``), DistributedDataParallel,
``get_megatron_optimizer``, OptimizerParamScheduler, dist_checkpointing and
GPTDataset. On a machine without CUDA it enables the CPU/gloo runtime.

Run it under torchrun, e.g. expert parallel over two CPU processes, through
``megatron_lrmoe.launcher``, which checks the flags before torchrun starts workers::

    python -m megatron_lrmoe.launcher --nproc-per-node 2 --config configs/tiny_moe.yaml

With ``--device-memory-gb`` the run is held to that device size: after every step each
rank's predicted peak (and on CUDA the allocator's) must fit, else every rank stops with
``DeviceOutOfMemory`` (``_hold_to_device``).

The file reads top to bottom: setup, then the training loop, then the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from megatron_lrmoe.config.flags import ConfigError, tokens_per_rank
from megatron_lrmoe.launcher.arguments import parse_args

if TYPE_CHECKING:   # megatron.core is imported only once the runtime is set up
    from megatron_lrmoe.launcher.checkpointing import TrainingProgress

# -----------------------------------------------------------------------------
# Distributed setup
# -----------------------------------------------------------------------------


def initialize_distributed(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """Process group (gloo on CPU), Megatron's parallel state and RNG tracker.

    Returns the device and whether this call created the process group (a caller
    that already has one, such as the test harness, keeps it after training).
    """
    from megatron.core import parallel_state, tensor_parallel

    from megatron_lrmoe.integration.runtime.compat import (
        fp8_off_in_checkpoint_without_output_when_te_absent,
    )

    fp8_off_in_checkpoint_without_output_when_te_absent()  # Megatron's layernorm recompute
    cuda = torch.cuda.is_available()
    if not cuda:
        from megatron_lrmoe.integration.runtime.cpu import enable_cpu_runtime

        enable_cpu_runtime()
    # Single-process runs without torchrun get a loopback rendezvous.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend=args.distributed_backend or ("nccl" if cuda else "gloo"))
    if dist.get_world_size() != args.world_size:
        raise ConfigError(
            f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE says "
            f"{args.world_size}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    # Explicitly, as Megatron-LM's initialize_megatron does (its default --rerun-mode
    # disabled); otherwise the schedule's first call warns of an implicit initialization.
    # Fresh for each run (a process that trains twice, like the test harness, re-creates it).
    from megatron.core import rerun_state_machine as rsm

    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, created


def log0(*parts: object) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def lrmoe_log_line(iteration: int, stats: dict[str, float]) -> str:
    """The launcher's LRMoE log line: its iteration prefix and the words Megatron-LM's
    prints too (``telemetry.format_lrmoe_stats``)."""
    from megatron_lrmoe.layer.telemetry import format_lrmoe_stats

    return f"iter {iteration:6d} | LRMoE {format_lrmoe_stats(stats)}"


# -----------------------------------------------------------------------------
# Loss and forward step (the same contract as Megatron-LM's pretrain_gpt.py)
# -----------------------------------------------------------------------------


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses and the token count; the schedule normalises."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.view(1).float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# -----------------------------------------------------------------------------
# Step statistics, reduced over ranks once per step (outside the timed regions)
# -----------------------------------------------------------------------------


@dataclass
class StepStats:
    loss_sum: float = 0.0
    loss_tokens: float = 0.0
    moe_forward_s: float = 0.0
    moe_backward_s: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.loss_tokens, 1.0)


def _local_loss(losses_reduced: list[dict]) -> tuple[float, float]:
    total = sum((d["lm loss"] for d in losses_reduced), torch.zeros(2))
    return float(total[0]), float(total[1])


def reduce_step_stats(losses_reduced: list[dict], moe_forward_s: float, moe_backward_s: float):
    """Global loss (over data-parallel ranks) and MoE time (max per stage, sum over stages).

    One all_gather of a 6-vector per rank; the same result on every rank.
    """
    from megatron.core import parallel_state as ps

    counts_loss = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    loss_sum, loss_tokens = _local_loss(losses_reduced) if counts_loss else (0.0, 0.0)
    row = torch.tensor(
        [moe_forward_s, moe_backward_s, ps.get_pipeline_model_parallel_rank(), loss_sum,
         loss_tokens, 0.0],
        dtype=torch.float64,
    )
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    table = torch.stack(rows)
    stats = StepStats(loss_sum=float(table[:, 3].sum()), loss_tokens=float(table[:, 4].sum()))
    for stage in table[:, 2].unique():
        in_stage = table[table[:, 2] == stage]
        stats.moe_forward_s += float(in_stage[:, 0].max())
        stats.moe_backward_s += float(in_stage[:, 1].max())
    return stats


# -----------------------------------------------------------------------------
# Logging sinks: progress bar, TensorBoard, JSON lines (rank 0 only)
# -----------------------------------------------------------------------------


@dataclass
class Logger:
    args: argparse.Namespace
    writer: object | None = None
    json_file: object | None = None
    bar: object | None = None
    history: list[dict] = field(default_factory=list)

    @classmethod
    def create(cls, args: argparse.Namespace, start_iteration: int) -> Logger:
        log = cls(args)
        if dist.get_rank() != 0:
            return log
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            log.writer = SummaryWriter(log_dir=args.tensorboard_dir)
        if args.log_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
            log.json_file = open(args.log_json, "a")  # noqa: SIM115 - closed in close()
        if not args.no_progress_bar:
            from tqdm import tqdm

            log.bar = tqdm(total=args.train_iters, initial=start_iteration, unit="it",
                           dynamic_ncols=True, file=sys.stdout)
        return log

    def write(self, record: dict) -> None:
        self.history.append(record)  # every rank: the records are reduced globally
        if dist.get_rank() != 0:
            return
        if self.json_file:
            self.json_file.write(json.dumps(record) + "\n")
            self.json_file.flush()
        if self.writer:
            step = record["iteration"]
            for key, value in record.items():
                if key != "iteration" and isinstance(value, int | float):
                    self.writer.add_scalar(key, value, step)

    def line(self, text: str) -> None:
        if dist.get_rank() != 0:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, postfix: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        for sink in (self.bar, self.json_file, self.writer):
            if sink is not None:
                sink.close()
        self.bar = self.json_file = self.writer = None


# -----------------------------------------------------------------------------
# Evaluation
# -----------------------------------------------------------------------------


@contextlib.contextmanager
def params_gathered(args: argparse.Namespace, model):
    """With --overlap-param-gather, parameters are gathered lazily by forward pre-hooks;
    evaluation and checkpointing need them complete first (as in Megatron-LM)."""
    if not args.overlap_param_gather:
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()


def evaluate(args, model, forward_backward, valid_dataset, device, moe_timer) -> float:
    """Mean validation loss over ``--eval-iters`` global batches, the same ones every time."""
    from megatron.core import parallel_state as ps

    from megatron_lrmoe.launcher.data_iterators import MicroBatchIterator

    for chunk in model:
        chunk.eval()
    iterator = MicroBatchIterator(
        valid_dataset, args.micro_batch_size, ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(), 0, device,
    )
    total = StepStats()
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = forward_backward(
                forward_step_func=forward_step, data_iterator=iterator, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=True,
            )
            step = reduce_step_stats(losses, 0.0, 0.0)
            total.loss_sum += step.loss_sum
            total.loss_tokens += step.loss_tokens
    moe_timer.reset()  # evaluation is not training time
    for chunk in model:
        chunk.train()
    return total.loss


# -----------------------------------------------------------------------------
# Main
# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    # Before anything imports megatron.core (most of its known benign warnings fire at
    # import): hide those; on CPU, say in one line what they were about.
    from megatron_lrmoe.integration.runtime.cpu import quiet_known_warnings

    cpu_note = quiet_known_warnings()
    args = parse_args_or_exit(argv)
    if cpu_note and int(os.environ.get("RANK", "0")) == 0:
        print(cpu_note, flush=True)
    from megatron_lrmoe.planning.memory_account import DeviceOutOfMemory

    try:
        return train(args)
    except DeviceOutOfMemory as exc:   # every rank stops at the same step, with this line
        # One write per rank: print() writes the text and the newline separately, and the
        # ranks' lines interleave in a shared log.
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None


def parse_args_or_exit(argv: list[str] | None = None,
                       world_size: int | None = None) -> argparse.Namespace:
    """Every check that needs no process group (ours, then Megatron-Core's config); a
    refusal is one ``error:`` line on stderr (rank 0) and exit status 2. Also the
    pre-flight check of ``megatron_lrmoe.launcher``, before torchrun starts workers."""
    try:
        args = parse_args(argv, world_size)
        resolve_auto_budget(args)
        check_megatron_accepts(args)
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return args


def _vocab_size(args: argparse.Namespace) -> int:
    """The padded vocabulary the model is built with (the tokenizer's, padded as
    ``builders.build_model`` pads it)."""
    from megatron_lrmoe.launcher import builders

    try:
        vocab = builders.build_tokenizer_from_args(args).vocab_size
    except Exception as exc:  # noqa: BLE001 - the tokenizer's own error, one line
        raise ConfigError(f"--tokenizer-type {args.tokenizer_type}: {exc}") from exc
    return builders.padded_vocab_size(vocab, args)


def resolve_auto_budget(args: argparse.Namespace, vocab_size: int | None = None) -> None:
    """``--moe-lrmoe-memory-budget-gb auto`` (with ``--moe-lrmoe``): the device's size
    (``--device-memory-gb``, or the CUDA device's) less everything but the MoE part of the
    memory account, in GiB, in place (``config.planner_inputs.resolve_memory_budget``);
    refused naming both flags below the floor. Idempotent; nothing to do otherwise.
    ``vocab_size``: the padded vocabulary, where the tokenizer cannot give it (a
    projection of a run with a Hugging Face tokenizer, tools/fitting.py)."""
    from megatron_lrmoe.config.options import AUTO

    if not args.moe_lrmoe or args.moe_lrmoe_memory_budget_gb != AUTO:
        return
    from megatron_lrmoe.config.options import LRMoEConfigError
    from megatron_lrmoe.config.planner_inputs import (
        device_memory_bytes,
        memory_account,
        resolve_memory_budget,
    )
    from megatron_lrmoe.launcher.builders import transformer_config_from_args

    # The model's numbers from a config built with a placeholder budget (the account's
    # parts other than the MoE one do not depend on it).
    probe = argparse.Namespace(**vars(args))
    probe.moe_lrmoe_memory_budget_gb = 1.0
    try:
        config = transformer_config_from_args(probe)
        microbatches = args.global_batch_size // (args.micro_batch_size
                                                  * args.data_parallel_size)
        account = memory_account(config, args, vocab_size or _vocab_size(args), microbatches,
                                 device_memory_bytes(getattr(args, "device_memory_gb", None)))
        args.moe_lrmoe_memory_budget_gb = resolve_memory_budget(account, config, args,
                                                                microbatches)
    except LRMoEConfigError as exc:
        raise ConfigError(str(exc)) from exc
    except (ValueError, AssertionError) as exc:
        raise ConfigError(str(exc)) from exc
    args.lrmoe_budget_source = "auto: the device less the rest of the account"


def check_megatron_accepts(args: argparse.Namespace) -> None:
    """Build the TransformerConfig once before any process group exists, so that
    Megatron-Core's own refusals (its __post_init__ checks) surface as a clean error."""
    from megatron_lrmoe.config.options import LRMoEConfigError
    from megatron_lrmoe.launcher.builders import transformer_config_from_args

    try:
        transformer_config_from_args(args)
    except LRMoEConfigError as exc:  # ours: already names the flag
        raise ConfigError(str(exc)) from exc
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"Megatron-Core refuses this configuration: {exc}") from exc


# -----------------------------------------------------------------------------
# Training: train() reads top to bottom as setup, resume, then the loop (step, log,
# evaluate, checkpoint), then shutdown. Each stage is one function below it, in that
# order; the operations run in the same order as when they were one function (the
# checkpoint-resume test and the bitwise-loss comparisons depend on it).
# -----------------------------------------------------------------------------


def train(args: argparse.Namespace) -> dict:
    """Train to ``--train-iters`` (or ``--exit-interval``); the summary, on every rank.
    Held to its device (``--device-memory-gb``), a step whose peak exceeds the device
    raises ``DeviceOutOfMemory`` on every rank, after the same teardown as a finished run."""
    from megatron_lrmoe.planning.memory_account import DeviceOutOfMemory

    # ---- setup: parallel state, model, optimizer, instruments ---------------
    device, owns_process_group = _setup_parallel_state(args)
    run = _setup_model_and_optimizer(args, device)
    # ---- resume, then data (the sampler continues from the consumed samples) --
    progress = _resume(args, run)
    _setup_data(args, run, progress)
    run.forward_backward = _schedule()

    # ---- the loop --------------------------------------------------------------
    logger = Logger.create(args, progress.iteration)
    tally = _Tally(train_start=time.perf_counter())
    first_iteration = progress.iteration
    while progress.iteration < args.train_iters:
        losses, grad_norm, step_time = _train_step(args, run)
        progress.iteration += 1
        progress.consumed_train_samples += args.global_batch_size
        record, loss = _step_record(args, run, tally, progress, losses, grad_norm, step_time)
        try:
            _hold_to_device(args, run, progress.iteration, record)
        except DeviceOutOfMemory:   # the out-of-memory stop: every rank, at this step
            _teardown(run, logger, owns_process_group)
            raise
        logger.advance({"loss": f"{loss:.3f}"})
        _check_allocator(args, run, logger, progress.iteration - first_iteration)
        _log_interval(args, logger, tally, progress, record)
        _log_lrmoe(args, run, logger, progress, record)
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
    tokenizer: object
    model: list
    optimizer: object
    scheduler: object
    moe_timer: object
    recorder: object | None
    tokens_per_step: int
    train_iter: object | None = None
    valid_ds: object | None = None
    forward_backward: object | None = None
    memory_account: object | None = None
    megatron_memory: object | None = None
    """Held to the device with Megatron's own MoE layer: its layers' memory model
    (``_megatron_memory``)."""


@dataclass
class _Tally:
    """Running figures of the loop: the log interval's, the run's and the last validation."""

    train_start: float
    cumulative_moe_s: float = 0.0
    interval: StepStats = field(default_factory=StepStats)
    interval_steps: int = 0
    interval_time: float = 0.0
    val_loss: float | None = None

    def add(self, stats: StepStats, step_time: float) -> None:
        self.interval.loss_sum += stats.loss_sum
        self.interval.loss_tokens += stats.loss_tokens
        self.interval.moe_forward_s += stats.moe_forward_s
        self.interval.moe_backward_s += stats.moe_backward_s
        self.interval_steps += 1
        self.interval_time += step_time

    def reset_interval(self) -> None:
        self.interval = StepStats()
        self.interval_steps, self.interval_time = 0, 0.0


# ---- setup -------------------------------------------------------------------


def _setup_parallel_state(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """Process group, parallel state and Megatron's micro-batch calculator; one log line."""
    device, owns_process_group = initialize_distributed(args)

    from megatron.core import num_microbatches_calculator
    from megatron.core import parallel_state as ps

    args.num_microbatches = args.global_batch_size // (
        args.micro_batch_size * ps.get_data_parallel_world_size()
    )
    # Megatron's own micro-batch bookkeeping, as Megatron-LM sets it up: LRMoE layers are
    # told its get_num_microbatches to find a step's last backward (replica gradients).
    num_microbatches_calculator.init_num_microbatches_calculator(
        dist.get_rank(), None, args.global_batch_size, args.micro_batch_size,
        ps.get_data_parallel_world_size())
    log0(
        f"megatron_lrmoe.launcher.pretrain: world {dist.get_world_size()} ({dist.get_backend()}), "
        f"TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} "
        f"EP {args.expert_model_parallel_size} DP {ps.get_data_parallel_world_size()}, "
        f"{torch.get_num_threads()} thread(s)/rank, {args.num_microbatches} micro-batch(es)/step"
    )
    return device, owns_process_group


def _setup_model_and_optimizer(args: argparse.Namespace, device: torch.device) -> _Run:
    """Model (with LRMoE planners), optimizer and scheduler, then the MoE timer and the
    routing recorder; one log line of the parameter count."""
    from megatron_lrmoe.launcher import builders

    tokenizer = builders.build_tokenizer_from_args(args)
    model, account, config = _build_model(args, device, tokenizer)
    optimizer, scheduler = _build_optimizer(args, model)
    moe_timer, moe_layers, recorder = _attach_instruments(args, model)
    n_params = sum(p.numel() for p in model[0].parameters())
    log0(f"model: {n_params / 1e6:.2f} M parameters on rank 0, {moe_layers} MoE layer(s) timed")
    return _Run(device=device, tokenizer=tokenizer, model=model, optimizer=optimizer,
                scheduler=scheduler, moe_timer=moe_timer, recorder=recorder,
                tokens_per_step=args.global_batch_size * args.seq_length,
                memory_account=account, megatron_memory=_megatron_memory(args, config))


def _build_model(args: argparse.Namespace, device: torch.device, tokenizer
                 ) -> tuple[list, object | None, object]:
    """The model chunks, the memory account (printed; with --moe-lrmoe or a run held to
    its device, else None) and the TransformerConfig; the memory budget is checked first
    (a refusal before anything is allocated) and the planners are set up right after the
    build."""
    from megatron.core import num_microbatches_calculator

    from megatron_lrmoe.launcher import builders

    resolve_auto_budget(args)
    config = builders.transformer_config_from_args(args)
    account = None
    if args.moe_lrmoe or _held(args):
        account = _print_memory_account(args, config, tokenizer)
    if args.moe_lrmoe:
        from megatron_lrmoe.config.planner_inputs import check_memory_budget

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
        from megatron_lrmoe.integration.step_hooks import (
            machine_constants_line,
            setup_lrmoe_layers,
        )

        machine = setup_lrmoe_layers(
            model, tokens, num_microbatches_calculator.get_num_microbatches, config,
            hold_memory=_held(args))
        if machine is not None:
            log0(machine_constants_line(machine))
    return model, account, config


def _print_memory_account(args: argparse.Namespace, config, tokenizer) -> object:
    """The run's memory account (planning/memory_account.py), printed once on rank 0:
    its parts in GiB, the device's size and the MoE budget the planner uses."""
    from megatron_lrmoe.config.planner_inputs import GIB, device_memory_bytes, memory_account
    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.planning.memory_account import account_line

    account = memory_account(config, args,
                             builders.padded_vocab_size(tokenizer.vocab_size, args),
                             args.num_microbatches,
                             device_memory_bytes(getattr(args, "device_memory_gb", None)))
    budget = args.moe_lrmoe_memory_budget_gb if args.moe_lrmoe else None
    source = getattr(args, "lrmoe_budget_source", "--moe-lrmoe-memory-budget-gb")
    line = account_line(account, None if budget is None else budget * GIB, source)
    if _held(args):
        line += "; held to the device: a step whose peak exceeds it stops the run"
    log0(f"megatron_lrmoe.launcher.pretrain: {line}")
    return account


def _check_allocator(args: argparse.Namespace, run: _Run, logger: Logger,
                     steps_run: int) -> None:
    """Once, after this process's second step on CUDA: the caching allocator's peak
    against the memory account (one host read; the planner keeps the account's budget)."""
    if steps_run != 2 or run.device.type != "cuda" or run.memory_account is None:
        return
    from megatron_lrmoe.config.planner_inputs import GIB, allocator_check

    budget = args.moe_lrmoe_memory_budget_gb
    peak = torch.cuda.max_memory_allocated(run.device)
    logger.line("megatron_lrmoe.launcher.pretrain: " + allocator_check(
        run.memory_account, peak, None if budget is None else budget * GIB))


def _build_optimizer(args: argparse.Namespace, model: list) -> tuple[object, object]:
    """Optimizer and scheduler, and the model config's hooks into them (loss scaling,
    gradient finalisation, overlapped gradient reduction) that the schedule calls."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    from megatron_lrmoe.launcher import builders

    optimizer = builders.build_optimizer(args, model)
    scheduler = builders.build_scheduler(args, optimizer)
    model_config = get_model_config(model[0])
    model_config.grad_scale_func = optimizer.scale_loss
    model_config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        model_config.no_sync_func = model[0].no_sync
        model_config.grad_sync_func = model[0].start_grad_sync
    return optimizer, scheduler


def _attach_instruments(args: argparse.Namespace, model: list) -> tuple[object, int, object]:
    """MoE-layer timer and routing recorder; returns (timer, MoE layers timed, recorder)."""
    from megatron_lrmoe.launcher.moe_timing import MoETimer, attach_moe_timer

    moe_timer = MoETimer(sync_cuda=torch.cuda.is_available())
    moe_layers = 0 if args.no_moe_timing else attach_moe_timer(model[0], moe_timer)
    recorder = None
    # Held to the device, Megatron's own layer needs each step's routed counts too (the
    # recorder without a trace); LRMoE's planners report their memory themselves.
    counts_needed = _held(args) and not args.moe_lrmoe and args.num_experts is not None
    if args.record_routing or counts_needed:
        # After the timer: the count reduction then falls outside its spans.
        from megatron_lrmoe.launcher.routing_record import RoutingRecordError, start_recording

        try:
            recorder = start_recording(args, model, args.record_routing or None)
        except RoutingRecordError as error:
            raise ConfigError(str(error)) from None
    return moe_timer, moe_layers, recorder


# ---- resume and data -----------------------------------------------------------


def _resume(args: argparse.Namespace, run: _Run) -> TrainingProgress:
    """The progress of the checkpoint in ``--load`` (with its state loaded), else zero."""
    from megatron_lrmoe.launcher import checkpointing

    progress = checkpointing.TrainingProgress()
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
    from megatron.core import parallel_state as ps

    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.launcher.data_iterators import MicroBatchIterator

    train_ds, run.valid_ds, _ = builders.build_datasets(args, run.tokenizer)
    run.train_iter = MicroBatchIterator(
        train_ds, args.micro_batch_size, ps.get_data_parallel_rank(),
        ps.get_data_parallel_world_size(), progress.consumed_train_samples, run.device,
    )


# ---- the step ------------------------------------------------------------------


def _schedule():
    """Megatron's pipeline schedule for this parallel state (imported only now: megatron.core
    is first imported by initialize_distributed, after the CPU runtime is on)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


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
        from megatron_lrmoe.integration.step_hooks import finish_lrmoe_step

        finish_lrmoe_step(run.model)
    if update_ok:
        run.scheduler.step(increment=args.global_batch_size)
    return losses, grad_norm, time.perf_counter() - step_start


# ---- logging -------------------------------------------------------------------


def _step_record(args: argparse.Namespace, run: _Run, tally: _Tally, progress: TrainingProgress,
                 losses: list[dict], grad_norm, step_time: float) -> tuple[dict, float]:
    """The step's JSON-lines record from statistics reduced over ranks (one all_gather,
    plus the recorder's), and the step's loss; adds the step to the tally."""
    stats = reduce_step_stats(losses, run.moe_timer.forward_seconds,
                              run.moe_timer.backward_seconds)
    tally.cumulative_moe_s += stats.moe_forward_s + stats.moe_backward_s
    record = {
        "iteration": progress.iteration,
        "lm-loss": stats.loss,
        "learning-rate": run.optimizer.param_groups[0]["lr"],
        "grad-norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "step-time-s": step_time,
        "tokens-per-sec": run.tokens_per_step / step_time,
        "moe-forward-s": stats.moe_forward_s,
        "moe-backward-s": stats.moe_backward_s,
        "moe-cumulative-s": tally.cumulative_moe_s,
        "consumed-samples": progress.consumed_train_samples,
    }
    if run.recorder is not None:   # one all_gather of the step's routed counts
        loads = run.recorder.end_step(progress.iteration)
        if args.record_routing:
            record.update(loads)
    tally.add(stats, step_time)
    return record, stats.loss


def _log_interval(args: argparse.Namespace, logger: Logger, tally: _Tally,
                  progress: TrainingProgress, record: dict) -> None:
    """Every ``--log-interval`` steps and at the last: the interval's figures, one line."""
    if progress.iteration % args.log_interval == 0 or progress.iteration == args.train_iters:
        interval, steps, seconds = tally.interval, tally.interval_steps, tally.interval_time
        logger.line(
            f"iter {progress.iteration:6d}/{args.train_iters} | loss {interval.loss:.4f} | "
            f"lr {record['learning-rate']:.3e} | grad norm {record['grad-norm']:.3f} | "
            f"{args.global_batch_size * args.seq_length * steps / seconds:8.0f} tok/s | "
            f"MoE fwd {1e3 * interval.moe_forward_s / steps:7.1f} ms "
            f"bwd {1e3 * interval.moe_backward_s / steps:7.1f} ms per step "
            f"({100 * (interval.moe_forward_s + interval.moe_backward_s) / seconds:.0f}%"
            f" of step time)"
        )
        tally.reset_interval()


def _log_lrmoe(args: argparse.Namespace, run: _Run, logger: Logger, progress: TrainingProgress,
               record: dict) -> None:
    """With --moe-lrmoe, every ``--moe-lrmoe-log-interval`` (default ``--log-interval``)
    steps and at the last: LRMoE statistics into the record, and a line."""
    lrmoe_interval = args.moe_lrmoe_log_interval or args.log_interval
    if args.moe_lrmoe and (
        progress.iteration % lrmoe_interval == 0 or progress.iteration == args.train_iters
    ):
        from megatron_lrmoe.layer.telemetry import collect_lrmoe_stats

        lrmoe_stats = collect_lrmoe_stats(run.model, args.num_layers, args.num_experts)
        record.update(lrmoe_stats)
        if "lrmoe/retained-fraction" in lrmoe_stats:
            logger.line(lrmoe_log_line(progress.iteration, lrmoe_stats))


# ---- held to the device (--device-memory-gb) ---------------------------------------


def _held(args: argparse.Namespace) -> bool:
    """Whether the run is held to its device: ``--device-memory-gb`` given."""
    return getattr(args, "device_memory_gb", None) is not None


@dataclass(frozen=True)
class _MegatronMemory:
    """What Megatron's own MoE layers hold per rank, from their routed counts."""

    model: object
    """``MegatronMoEMemory`` of the layer's shape (its recompute fields: the run's, which
    the stage composes)."""
    capacity_factor: float | None
    pad: bool


def _megatron_memory(args: argparse.Namespace, config) -> _MegatronMemory | None:
    """Held with Megatron's own MoE layer: its memory model (None otherwise). The run's
    recompute is the shape's (``planner_inputs.recomputed_moe_layers``);
    ``--moe-expert-capacity-factor`` drops (or, with ``--moe-pad-expert-input-to-capacity``,
    pads) to capacity; ``--moe-grouped-gemm`` is TEGroupedMLP."""
    if not _held(args) or args.moe_lrmoe or config.num_moe_experts is None:
        return None
    from megatron_lrmoe.config.planner_inputs import moe_shape
    from megatron_lrmoe.planning.cost_model import MegatronMoEMemory

    shape = moe_shape(config, tokens_per_rank(args), args.num_microbatches,
                      args.expert_model_parallel_size)
    return _MegatronMemory(
        model=MegatronMoEMemory(shape, grouped=bool(args.moe_grouped_gemm),
                                padded=bool(args.moe_pad_expert_input_to_capacity)),
        capacity_factor=args.moe_expert_capacity_factor,
        pad=bool(args.moe_pad_expert_input_to_capacity))


def _megatron_moe_bytes(memory: _MegatronMemory, recorder) -> float:
    """This rank's MoE bytes of the step the recorder last gathered: per MoE layer it
    holds, the most over the micro-batches of its EP group's levels
    (``planning.memory_account.megatron_layer_levels``), composed over those layers under
    the run's recompute (``cost_model.stage_moe_memory``)."""
    from megatron_lrmoe.data import routing_traces as rt
    from megatron_lrmoe.planning.cost_model import stage_moe_memory
    from megatron_lrmoe.planning.memory_account import megatron_layer_levels

    step, me = recorder.last_step, dist.get_rank()      # step: [L, M, S, E]
    saved, peak = [], []
    for index, number in enumerate(recorder.layers):
        sources = recorder.header["sources"][str(number)]
        ranks = [row["rank"] for row in sources]
        if me not in ranks:
            continue
        mine = ranks.index(me)
        group = next(g for g in rt.ep_groups(sources) if mine in g)    # by EP rank
        s, p = megatron_layer_levels(memory.model, step[index][:, group],
                                     memory.capacity_factor, memory.pad)
        saved.append(s[group.index(mine)])
        peak.append(p[group.index(mine)])
    if not saved:
        return 0.0
    shape = memory.model.shape
    return float(stage_moe_memory(
        np.array(saved)[:, None], np.array(peak)[:, None], np.zeros((len(saved), 1)),
        shape.output_bytes, shape.microbatches_in_flight, shape.recompute_moe,
        shape.full_recompute_layers)[0])


def _hold_to_device(args: argparse.Namespace, run: _Run, iteration: int,
                    record: dict) -> None:
    """With ``--device-memory-gb``, after each step: every rank's predicted peak (the
    account outside the MoE layers plus this step's MoE bytes: LRMoE's planners' per-call
    memory, or Megatron's layer memory of the gathered routed counts) and, on CUDA, the
    allocator's peak, against the device; one all_reduce of a [world, 2] table, so every
    rank raises the same ``DeviceOutOfMemory`` at the same step. The worst predicted peak
    goes into the record (``memory-predicted-peak-gib``)."""
    if not _held(args) or run.memory_account is None:
        return
    from megatron_lrmoe.config.planner_inputs import GIB
    from megatron_lrmoe.planning.memory_account import check_device, step_peak

    if args.moe_lrmoe:
        from megatron_lrmoe.integration.step_hooks import lrmoe_step_memory

        moe = sum(lrmoe_step_memory(run.model))
    elif run.megatron_memory is not None and run.recorder is not None:
        moe = _megatron_moe_bytes(run.megatron_memory, run.recorder)
    else:
        moe = 0.0
    cuda = run.device.type == "cuda"
    measured = float(torch.cuda.max_memory_allocated(run.device)) if cuda else 0.0
    table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64, device=run.device)
    table[dist.get_rank()] = torch.tensor([moe, measured], dtype=torch.float64)
    dist.all_reduce(table)
    table = table.cpu().numpy()
    account = run.memory_account
    record["memory-predicted-peak-gib"] = float(
        step_peak(account.outside_moe, table[None, :, 0]).max()) / GIB
    if cuda:
        record["memory-allocator-peak-gib"] = float(table[:, 1].max()) / GIB
    check_device(iteration, account, table[:, 0], table[:, 1] if cuda else None,
                 lrmoe=bool(args.moe_lrmoe))


# ---- evaluation and checkpointing ------------------------------------------------


def _evaluate_if_due(args: argparse.Namespace, run: _Run, logger: Logger, tally: _Tally,
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
    from megatron_lrmoe.launcher import checkpointing

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


def _shutdown(args: argparse.Namespace, run: _Run, logger: Logger, tally: _Tally,
              progress: TrainingProgress, owns_process_group: bool) -> dict:
    """Close the sinks, print the summary (rank 0), then take down Megatron's state and
    the process group if train() created it. Returns the summary."""
    logger.close()
    if run.recorder is not None:
        run.recorder.close()
    wall = time.perf_counter() - tally.train_start
    history = logger.history
    summary = {
        "iterations": progress.iteration,
        "wall-s": wall,
        "final-lm-loss": history[-1]["lm-loss"] if history else None,
        "first-lm-loss": history[0]["lm-loss"] if history else None,
        "validation-loss": tally.val_loss,
        "moe-cumulative-s": tally.cumulative_moe_s,
        "losses": [r["lm-loss"] for r in history],
    }
    if history and dist.get_rank() == 0:
        print_summary(args, summary, wall)
    _teardown(run, logger, owns_process_group)
    return summary


def _teardown(run: _Run, logger: Logger, owns_process_group: bool) -> None:
    """Close the sinks (again: idempotent), then take down Megatron's state and the
    process group if train() created it: the end of a run, or its out-of-memory stop
    (every rank at the same step)."""
    from megatron.core import num_microbatches_calculator
    from megatron.core import parallel_state as ps

    logger.close()
    if run.recorder is not None:
        run.recorder.close()
    dist.barrier()
    num_microbatches_calculator.destroy_num_microbatches_calculator()
    ps.destroy_model_parallel()
    if owns_process_group:
        dist.destroy_process_group()


def print_summary(args: argparse.Namespace, summary: dict, wall: float) -> None:
    lines = [
        "",
        "=" * 72,
        f"trained {summary['iterations']} iterations in {wall:.1f} s "
        f"({args.global_batch_size * args.seq_length * len(summary['losses']) / wall:.0f} tok/s)",
        f"training loss {summary['first-lm-loss']:.4f} -> {summary['final-lm-loss']:.4f}",
    ]
    if summary["validation-loss"] is not None:
        lines.append(f"validation loss {summary['validation-loss']:.4f}")
    baseline = unigram_baseline(args)
    if baseline is not None:
        lines.append(
            f"unigram baseline of the corpus {baseline:.4f} nats/token "
            f"(a model that learned nothing beyond token frequencies scores this)"
        )
    lines.append(
        f"time inside MoE layers (forward + backward, slowest rank per stage): "
        f"{summary['moe-cumulative-s']:.1f} s = {100 * summary['moe-cumulative-s'] / wall:.0f}% "
        f"of wall time"
    )
    lines.append("=" * 72)
    print("\n".join(lines), flush=True)


def unigram_baseline(args: argparse.Namespace) -> float | None:
    """Unigram entropy recorded by the prepare tool next to a single data prefix."""
    if args.mock_data or not args.data_path or len(args.data_path) != 1:
        return None
    meta = args.data_path[0] + ".meta.json"
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        value = json.load(f).get("unigram_entropy_nats")
    return float(value) if value is not None and math.isfinite(value) else None


if __name__ == "__main__":
    main()
