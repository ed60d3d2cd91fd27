"""What the launcher writes: rank 0's lines, each step's record (JSON lines, TensorBoard,
the progress bar), the interval and LRMoE lines, and the summary at the end.

Every figure is reduced over the ranks before it gets here (``step.reduce_step_stats``,
``layer_stats.collect_lrmoe_stats``), so every rank holds the same records; only rank 0
writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field

import torch.distributed as dist
from tqdm import tqdm

from megatron_lrmoe.launcher.checkpointing import TrainingProgress
from megatron_lrmoe.launcher.step import StepStats
from megatron_lrmoe.layer import stats as layer_stats

__all__ = ["Logger", "Tally", "log0", "log_interval", "log_lrmoe", "lrmoe_log_line",
           "print_summary", "summary", "unigram_baseline"]


def log0(*parts: object) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def lrmoe_log_line(iteration: int, stats: dict[str, float]) -> str:
    """The launcher's LRMoE log line: its iteration prefix and the words Megatron-LM's
    prints too (``layer_stats.format_lrmoe_stats``)."""
    return f"iter {iteration:6d} | LRMoE {layer_stats.format_lrmoe_stats(stats)}"


@dataclass
class Logger:
    """The sinks (rank 0 only): progress bar, TensorBoard, JSON lines; and every rank's
    history of records (the summary's losses)."""

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
            # Only with --tensorboard-dir: importing TensorBoard takes a while.
            from torch.utils.tensorboard import SummaryWriter

            log.writer = SummaryWriter(log_dir=args.tensorboard_dir)
        if args.log_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.log_json)), exist_ok=True)
            log.json_file = open(args.log_json, "a")  # noqa: SIM115 - closed in close()
        if not args.no_progress_bar:
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


@dataclass
class Tally:
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


def log_interval(args: argparse.Namespace, logger: Logger, tally: Tally,
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


def log_lrmoe(args: argparse.Namespace, model: list, logger: Logger,
              progress: TrainingProgress, record: dict) -> None:
    """With --moe-lrmoe, every ``--moe-lrmoe-log-interval`` (default ``--log-interval``)
    steps and at the last: LRMoE statistics into the record, and a line."""
    lrmoe_interval = args.moe_lrmoe_log_interval or args.log_interval
    if args.moe_lrmoe and (
        progress.iteration % lrmoe_interval == 0 or progress.iteration == args.train_iters
    ):
        lrmoe_stats = layer_stats.collect_lrmoe_stats(model, args.num_layers, args.num_experts)
        record.update(lrmoe_stats)
        if "lrmoe/retained-fraction" in lrmoe_stats:
            logger.line(lrmoe_log_line(progress.iteration, lrmoe_stats))


def summary(logger: Logger, tally: Tally, progress: TrainingProgress, wall: float) -> dict:
    """The run's summary (every rank): what ``train`` returns and ``print_summary`` shows."""
    history = logger.history
    return {
        "iterations": progress.iteration,
        "wall-s": wall,
        "final-lm-loss": history[-1]["lm-loss"] if history else None,
        "first-lm-loss": history[0]["lm-loss"] if history else None,
        "validation-loss": tally.val_loss,
        "moe-cumulative-s": tally.cumulative_moe_s,
        "losses": [r["lm-loss"] for r in history],
    }


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
