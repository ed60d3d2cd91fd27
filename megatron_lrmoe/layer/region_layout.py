"""What the LRMoE region knows on the host before it touches a tensor: the call's layout.

Every size and index the region needs (split sizes, rows per expert, where each
kept row lands on its expert's rank, which reorders are identities) follows from
the plan, which every rank already holds on the host (docs/design.md, "Plan").
``CallLayout`` computes them once per call in numpy, and packs the few per-chunk
tables the device needs into one int64 buffer that goes to the device in one
copy, without blocking (pinned host memory on CUDA). The device expands the
per-chunk tables into per-row indices with ``repeat_interleave`` given its output
size, which needs no host sync. Nothing here reads a device value.

Notation (docs/design.md, "Notation"), on rank s with local instances [a, b):
  R, I, L = b - a      ranks, instances, local instances
  n[s, i], q[s, i]     routed and retained pairs of cell (s, i) (the plan's counts
                       and quotas); a source's pairs are instance-major
  src-major / exp-major  the receiver's row orders: (source, local instance, pair)
                       as the all-to-all delivers them, (local instance, source,
                       pair) as the expert GEMMs need them
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_lrmoe.planning.retention import RetentionPlan

__all__ = ["CallLayout", "DeviceTables", "chunk_permutation", "chunk_permutations", "to_device"]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor built from host data) on ``device`` without a blocking copy.

    On CUDA the data goes through pinned memory (torch's caching host allocator, so no
    new pinned allocation per call once warm) with ``non_blocking=True``; the copy is
    ordered on the current stream before any kernel that reads it.
    """
    if device.type == "cpu":
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def _shuffle_tables(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-chunk tables of the reorder between src-major and exp-major rows.

    sizes [R, L]: rows of chunk (source, local instance). Returns (delta_exp,
    sizes_exp, delta_src, sizes_src): chunk by chunk in exp-major (l, s) order, the
    shift from a row's exp-major position to its src-major one, and the reverse in
    src-major order. exp_major = src_major[arange + repeat(delta_exp, sizes_exp)].
    """
    flat = sizes.reshape(-1)
    start_src = (np.cumsum(flat) - flat).reshape(sizes.shape)           # [R, L]
    flat_exp = sizes.T.reshape(-1)
    start_exp = (np.cumsum(flat_exp) - flat_exp).reshape(sizes.T.shape)  # [L, R]
    delta_exp = start_src.T - start_exp                                  # [L, R]
    return delta_exp.reshape(-1), flat_exp, (-delta_exp).T.reshape(-1), flat


def _is_identity(sizes: np.ndarray) -> bool:
    """Whether src-major and exp-major orders coincide: the non-empty chunks, listed by
    source then instance, never go back to a lower instance."""
    _, instance = np.nonzero(sizes)                    # row-major: by source, then instance
    return bool((np.diff(instance) >= 0).all())


def chunk_permutation(delta: torch.Tensor, sizes: torch.Tensor, total: int) -> torch.Tensor:
    """Row index [total] of a reorder of contiguous chunks, expanded on the device.

    ``delta[c]``: how far chunk c's rows (in the target order) sit from their source
    positions; ``sizes[c]``: its rows. ``total`` = sum of sizes, known on the host, so
    ``repeat_interleave`` needs no sync.
    """
    base = torch.arange(total, device=delta.device)
    return base + torch.repeat_interleave(delta, sizes, output_size=total)


def chunk_permutations(deltas: torch.Tensor, sizes: torch.Tensor, total: int) -> torch.Tensor:
    """Two reorders of the same ``total`` rows, [2, total], expanded by one
    ``chunk_permutation``'s ops: ``deltas`` and ``sizes`` hold the first reorder's chunk
    tables followed by the second's (each reorder's sizes sum to ``total``)."""
    shifts = torch.repeat_interleave(deltas, sizes, output_size=2 * total)
    return shifts.view(2, total).add_(torch.arange(total, device=deltas.device))


@dataclass(frozen=True)
class DeviceTables:
    """Views into the one device copy of the packed tables (int64)."""

    cell_offsets: torch.Tensor   # [I + 1] this source's cells in its pair list
    quotas: torch.Tensor         # [I] q[s, :]
    pos_delta: torch.Tensor      # [I] destination exp-major row minus pair index, per cell
    fwd: tuple[torch.Tensor, ...]   # delta_exp, sizes_exp, delta_src, sizes_src (forward)
    bwd: tuple[torch.Tensor, ...]   # the same over the retained rows (backward)
    fwd_pair: tuple[torch.Tensor, torch.Tensor]   # (delta_exp + delta_src, sizes_exp +
    bwd_pair: tuple[torch.Tensor, torch.Tensor]   # sizes_src): ``chunk_permutations``'s
    offs_fwd: torch.Tensor       # [L] int32 cumulative rows per local instance (forward)
    offs_bwd: torch.Tensor       # [L] int32, the same over the retained rows


class CallLayout:
    """The host-side layout of one region call on rank ``rank`` (see the module docstring)."""

    def __init__(self, plan: RetentionPlan, rank: int, local: range) -> None:
        counts = plan.counts.numpy()
        quotas = plan.quotas.numpy()
        self.rank, self.local = rank, local
        self.num_ranks, self.num_instances = counts.shape
        inst_rank = np.asarray(plan.instance_rank)
        s = rank
        # ---- split sizes (host lists, as the all-to-alls take them) -----------------
        self.send_fwd, self.recv_fwd = plan.forward_send_splits(s), plan.forward_recv_splits(s)
        self.send_bwd, self.recv_bwd = plan.send_splits(s), plan.recv_splits(s)
        # ---- source side -------------------------------------------------------------
        self.num_pairs = int(counts[s].sum())
        self.num_kept = int(quotas[s].sum())
        self.source_keeps_all = self.num_kept == self.num_pairs
        # A receiver that keeps every row it got needs no positions (its kept rows are
        # all its rows, in order); the sender knows which receivers those are.
        drops = np.zeros(self.num_ranks, dtype=bool)
        np.logical_or.at(drops, inst_rank, (quotas != counts).any(0))
        keeps_all = (~drops).tolist()
        self.receiver_keeps_all = keeps_all[s]
        self.positions_exchanged = not all(keeps_all)
        self.send_pos = [0 if keeps_all[r] else k for r, k in enumerate(self.send_bwd)]
        self.recv_pos = [0 if keeps_all[s] else k for k in self.recv_bwd]
        cell_off = np.concatenate([[0], np.cumsum(counts[s])])
        # Where cell (s, i)'s rows sit in the forward exp-major buffer of i's rank:
        # after the rank's earlier instances, then after the earlier sources' rows.
        # (Instances are rank-major, so a rank's instances are one contiguous run.)
        routed_i = counts.sum(0)
        before = np.cumsum(routed_i) - routed_i
        first = np.searchsorted(inst_rank, inst_rank)           # each rank's first instance
        exp_start = before - before[first] + (np.cumsum(counts, 0) - counts)[s]
        pos_delta = exp_start - cell_off[:-1]
        # ---- receiver side -----------------------------------------------------------
        c_fwd = counts[:, local.start:local.stop]
        c_bwd = quotas[:, local.start:local.stop]
        self.rows_fwd = c_fwd.sum(0).tolist()          # rows per local instance, forward
        self.rows_bwd = c_bwd.sum(0).tolist()          # retained rows per local instance
        self.received = int(c_fwd.sum())
        self.received_kept = int(c_bwd.sum())
        self.fwd_identity = _is_identity(c_fwd)
        self.bwd_identity = _is_identity(c_bwd)
        fwd, bwd = _shuffle_tables(c_fwd), _shuffle_tables(c_bwd)
        # The grouped GEMMs' int32 offsets, two to an int64 word: on the device a view
        # (no conversion op). 2L values, so they fill whole slots.
        offs = np.concatenate([np.cumsum(c_fwd.sum(0)), np.cumsum(c_bwd.sum(0))])
        if self.received >= 2**31:
            raise ValueError(f"rank {rank} receives {self.received} rows: the grouped GEMMs' "
                             "int32 offsets hold at most 2**31 - 1")
        # Each direction's two reorders as deltas then sizes (``chunk_permutations``).
        parts = [cell_off, quotas[s], pos_delta, *(np.concatenate(t[i::2]) for t in (fwd, bwd)
                                                   for i in (0, 1)),
                 offs.astype(np.int32).view(np.int64)]
        self._sizes = [len(p) for p in parts]
        self._packed = torch.from_numpy(np.concatenate(parts).astype(np.int64))

    @classmethod
    def from_native(cls, rank: int, local: range, sizes: tuple, tables: tuple) -> CallLayout:
        """The layout the compiled planner computed (``NativePlanner.layout``: the same
        values as ``CallLayout(plan, rank, local)``, without the numpy passes)."""
        lay = cls.__new__(cls)
        lay.rank, lay.local = rank, local
        (lay.send_fwd, lay.recv_fwd, lay.send_bwd, lay.recv_bwd, lay.num_pairs, lay.num_kept,
         lay.receiver_keeps_all, lay.positions_exchanged, lay.send_pos, lay.recv_pos) = sizes
        (lay.rows_fwd, lay.rows_bwd, lay.received, lay.received_kept, lay.fwd_identity,
         lay.bwd_identity, lay._sizes, packed) = tables
        lay.num_ranks, lay.num_instances = len(lay.send_fwd), lay._sizes[1]
        lay.source_keeps_all = lay.num_kept == lay.num_pairs
        lay._packed = torch.from_numpy(packed)
        return lay

    def device_tables(self, device: torch.device) -> tuple[torch.Tensor, DeviceTables]:
        """The packed tables on ``device`` (one non-blocking copy) and views into them."""
        packed = to_device(self._packed, device)
        return packed, self.views(packed)

    @staticmethod
    def joint_device_tables(layouts: tuple[CallLayout, ...], device: torch.device
                            ) -> list[tuple[torch.Tensor, DeviceTables]]:
        """``device_tables`` of several layouts of one call from one copy (their packed
        tables joined on the host): each layout's device buffer and views."""
        packed = to_device(torch.cat([lay._packed for lay in layouts]), device)
        parts = torch.split(packed, [lay._packed.numel() for lay in layouts])
        return [(part, lay.views(part)) for lay, part in zip(layouts, parts, strict=True)]

    def views(self, packed: torch.Tensor) -> DeviceTables:
        """Named views into a device copy of the packed tables (no copy, no sync)."""
        parts = torch.split(packed, self._sizes)
        offs = parts[7].view(torch.int32)
        n = len(self.local)

        def four(deltas: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, ...]:
            (d_exp, d_src), (s_exp, s_src) = deltas.chunk(2), sizes.chunk(2)
            return d_exp, s_exp, d_src, s_src

        return DeviceTables(cell_offsets=parts[0], quotas=parts[1], pos_delta=parts[2],
                            fwd=four(parts[3], parts[4]), bwd=four(parts[5], parts[6]),
                            fwd_pair=(parts[3], parts[4]), bwd_pair=(parts[5], parts[6]),
                            offs_fwd=offs[:n], offs_bwd=offs[n:])
