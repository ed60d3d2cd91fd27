"""Micro-batch iterators over Megatron datasets, resumable by sample count.

Sample order: global batch ``g`` holds samples ``[g*G, (g+1)*G)`` of the
training dataset (G = global batch size). It is cut into ``G / (b*D)``
micro-batch rounds (b = micro-batch size, D = data-parallel size); in each round
data-parallel rank ``r`` takes ``b`` consecutive samples at offset ``r*b``, as
Megatron-LM's pretraining sampler does. Tensor- and pipeline-parallel peers of a
rank compute the same indices, so they see the same tokens.

The position is a plain sample count, saved in checkpoints: resuming at
``consumed_samples`` replays exactly the data an uninterrupted run would see.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {
        key: torch.stack([torch.as_tensor(sample[key]) for sample in samples])
        for key in BATCH_KEYS
    }


class MicroBatchIterator(Iterator[dict[str, torch.Tensor]]):
    """Yields this data-parallel rank's micro-batches in Megatron-LM's order."""

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        consumed_samples: int = 0,
        device: torch.device | None = None,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("the dataset is empty: prepare more data or lower --seq-length")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.round_size = micro_batch_size * data_parallel_size
        self.consumed_samples = consumed_samples
        self.device = device

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        # Megatron's GPTDataset already wraps over epochs; the modulo guards other datasets.
        indices = [(start + i) % len(self.dataset) for i in range(self.micro_batch_size)]
        self.consumed_samples += self.round_size
        batch = _collate([self.dataset[i] for i in indices])
        if self.device is not None and self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch
