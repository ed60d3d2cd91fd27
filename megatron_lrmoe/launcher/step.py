"""The step's pieces around Megatron's schedule: the loss function and forward step (the
contract of Megatron-LM's ``pretrain_gpt.py``), the step's statistics reduced over ranks
(once per step, outside the timed regions), and evaluation."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_lrmoe.launcher.data_iterators import MicroBatchIterator

__all__ = ["StepStats", "evaluate", "forward_step", "loss_func", "params_gathered",
           "reduce_step_stats"]


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


def reduce_step_stats(losses_reduced: list[dict], moe_forward_s: float,
                      moe_backward_s: float) -> StepStats:
    """Global loss (over data-parallel ranks) and MoE time (max per stage, sum over stages).

    One all_gather of a 6-vector per rank; the same result on every rank.
    """
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
