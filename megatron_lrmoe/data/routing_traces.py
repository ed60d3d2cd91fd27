"""Routing traces: the file format the launcher's ``--record-routing DIR`` writes, its
reader, and the load arithmetic on recorded counts (numpy only, no torch).

Notation: n recorded steps, L MoE layers, M micro-batches per step, S sources (the
ranks that route tokens of a layer: every rank of its pipeline stage), E experts,
R expert-parallel ranks. ``counts[i, l, m, s, e]`` is the number of tokens source s
routed to expert e in micro-batch m of step ``iterations[i]`` at MoE layer
``layers[l]``: the column sums of the router's routing map, i.e. the pairs the layer
dispatched (after Megatron's capacity drop when ``--moe-expert-capacity-factor`` is
set, since its router drops before returning the map).

A trace is a directory::

    DIR/header.json          model, parallel layout, sources (see ``make_header``)
    DIR/counts_000001.npz    iterations [n] int64, counts [n, L, M, S, E] int32
    DIR/counts_000002.npz    ...

Chunks are numbered in the order they were written. The writer compresses them with
zlib (``np.savez_compressed``: fast enough to flush while training); a finished trace
may be repacked with LZMA inside the same ``.npz`` zip (``repack``: about 40% smaller,
read by ``np.load`` as the same arrays). A run resumed from a checkpoint
appends chunks and may record some iterations again (the steps after the checkpoint
it resumed from); the reader keeps the latest record of each iteration, which is the
history the resumed run continued.

Load figures use Megatron's expert layout: at R ranks, expert e lives on rank
e // (E / R), so a rank's load in a call is the sum of its E / R contiguous experts'
counts over all sources.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "FORMAT",
    "RoutingTrace",
    "ep_groups",
    "header_mismatch",
    "load_max_over_mean",
    "make_header",
    "rank_loads",
    "read_routing_trace",
    "regroup_sources",
    "repack",
    "uniform_load_max_over_mean",
    "write_chunk",
    "write_header",
]

FORMAT = "megatron-lrmoe routing trace"
VERSION = 1
HEADER = "header.json"
# Header sections that must match when a resumed run appends to an existing trace.
_COMPARED = ("format", "version", "model", "parallel", "sources")


def make_header(model: dict, parallel: dict, sources: dict[int, list[dict]]) -> dict:
    """The header: ``model`` (num_layers, hidden_size, num_experts, topk, score_function,
    load_balancing_type, aux_loss_coeff, expert_bias, shared_expert_size,
    capacity_factor, moe_lrmoe, moe_layers), ``parallel`` (world_size, tp, pp, ep, dp,
    microbatches_per_step, micro_batch_size, seq_length, tokens_per_source), and per MoE
    layer its sources in row order, each ``{"rank", "ep_rank", "ep_group"}`` (ep_group:
    the lowest global rank of the source's expert-parallel group)."""
    return {"format": FORMAT, "version": VERSION, "model": model, "parallel": parallel,
            "sources": {str(layer): rows for layer, rows in sources.items()}}


def header_mismatch(existing: dict, new: dict) -> str | None:
    """None when a run with header ``new`` may append to a trace with ``existing``,
    else the name of the first section that differs."""
    for key in _COMPARED:
        if existing.get(key) != new.get(key):
            return key
    return None


def write_header(path: str | os.PathLike, header: dict) -> None:
    """Write ``DIR/header.json`` atomically (creating DIR)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (HEADER + ".tmp")
    tmp.write_text(json.dumps(header, indent=1))
    os.replace(tmp, directory / HEADER)


def next_chunk_number(path: str | os.PathLike) -> int:
    """1 + the highest chunk number in DIR (1 for a new trace)."""
    numbers = [int(p.stem.split("_")[1]) for p in Path(path).glob("counts_*.npz")]
    return max(numbers, default=0) + 1


def write_chunk(path: str | os.PathLike, number: int, iterations: np.ndarray,
                counts: np.ndarray) -> Path:
    """Write one chunk atomically: ``iterations`` [n], ``counts`` [n, L, M, S, E]."""
    iterations = np.asarray(iterations, dtype=np.int64)
    counts = np.asarray(counts)
    if counts.ndim != 5 or counts.shape[0] != iterations.shape[0]:
        raise ValueError(f"counts {counts.shape} must be [n, L, M, S, E] with n = "
                         f"{iterations.shape[0]} iterations")
    if counts.size and (counts.min() < 0 or counts.max() > np.iinfo(np.int32).max):
        raise ValueError("routed counts out of int32 range")
    final = Path(path) / f"counts_{number:06d}.npz"
    tmp = final.with_name(final.stem + ".tmp.npz")
    np.savez_compressed(tmp, iterations=iterations, counts=counts.astype(np.int32))
    os.replace(tmp, final)
    return final


def repack(path: str | os.PathLike) -> None:
    """Rewrite a finished trace's chunks with LZMA inside their ``.npz`` zip: ``np.load``
    (and so ``read_routing_trace``) returns the same arrays, dtypes and shapes. Chunks
    already in LZMA are left as they are; the bytes depend on the arrays only (fixed
    zip timestamps), so repacking again changes nothing."""
    for chunk in sorted(Path(path).glob("counts_*.npz")):
        with zipfile.ZipFile(chunk) as packed:
            if all(i.compress_type == zipfile.ZIP_LZMA for i in packed.infolist()):
                continue
        with np.load(chunk) as data:
            arrays = {name: data[name] for name in data.files}
        tmp = chunk.with_name(chunk.name + ".tmp")     # not a counts_*.npz the reader sees
        with zipfile.ZipFile(tmp, "w") as packed:
            for name, array in arrays.items():
                entry = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
                entry.compress_type = zipfile.ZIP_LZMA
                with packed.open(entry, "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, array, allow_pickle=False)
        os.replace(tmp, chunk)


@dataclass(frozen=True)
class RoutingTrace:
    """A recorded trace: ``counts`` [n, L, M, S, E] int64 for ``iterations`` [n]
    (increasing) and MoE ``layers`` (global layer numbers, 1-based)."""

    header: dict
    iterations: np.ndarray
    counts: np.ndarray

    @property
    def layers(self) -> list[int]:
        return list(self.header["model"]["moe_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.header["model"]["num_experts"])

    @property
    def ep(self) -> int:
        return int(self.header["parallel"]["ep"])

    @property
    def world_size(self) -> int:
        """The ranks of the recorded run."""
        return int(self.header["parallel"]["world_size"])

    def layer(self, layer_number: int) -> np.ndarray:
        """[n, M, S, E] of one MoE layer (by its global layer number)."""
        return self.counts[:, self.layers.index(layer_number)]

    def ep_groups(self, layer_number: int) -> list[list[int]]:
        """Source rows of each expert-parallel group of a layer, each in EP-rank order."""
        return ep_groups(self.header["sources"][str(layer_number)])


def ep_groups(sources: list[dict]) -> list[list[int]]:
    """Rows of ``sources`` (a layer's header entry) grouped by expert-parallel group,
    each group in EP-rank order: the sources of one all-to-all."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for index, row in enumerate(sources):
        groups.setdefault(row["ep_group"], []).append((row["ep_rank"], index))
    return [[index for _, index in sorted(members)] for _, members in sorted(groups.items())]


def read_routing_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace directory written by ``--record-routing``.

    Repeated iterations (a resumed run re-recording steps) keep the record of the
    latest chunk. Raises ``FileNotFoundError``/``ValueError`` naming the path.
    """
    directory = Path(path)
    header_path = directory / HEADER
    if not header_path.is_file():
        raise FileNotFoundError(f"{directory}: no {HEADER}; not a routing trace written by "
                                f"--record-routing")
    header = json.loads(header_path.read_text())
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{header_path}: not a {FORMAT} version {VERSION}")
    latest: dict[int, np.ndarray] = {}
    shape: tuple[int, ...] | None = None
    for chunk in sorted(directory.glob("counts_*.npz"), key=lambda p: int(p.stem.split("_")[1])):
        with np.load(chunk) as data:
            iterations, counts = data["iterations"], data["counts"]
        if shape is None:
            shape = counts.shape[1:]
        elif counts.shape[1:] != shape:
            raise ValueError(f"{chunk}: counts {counts.shape[1:]} per step, earlier chunks "
                             f"{shape}")
        for i, iteration in enumerate(iterations.tolist()):
            latest[iteration] = counts[i]
    model = header["model"]
    if shape is not None and (shape[0] != len(model["moe_layers"])
                              or shape[-1] != model["num_experts"]):
        raise ValueError(f"{directory}: counts {shape} per step do not match the header "
                         f"({len(model['moe_layers'])} MoE layers, {model['num_experts']} "
                         f"experts)")
    order = sorted(latest)
    if order:
        counts = np.stack([latest[i] for i in order]).astype(np.int64)
    else:
        m = header["parallel"]["microbatches_per_step"]
        s = len(next(iter(header["sources"].values()), []))
        counts = np.zeros((0, len(model["moe_layers"]), m, s, model["num_experts"]), np.int64)
    return RoutingTrace(header, np.asarray(order, dtype=np.int64), counts)


# -----------------------------------------------------------------------------
# Load arithmetic
# -----------------------------------------------------------------------------


def rank_loads(counts: np.ndarray, ranks: int) -> np.ndarray:
    """Pairs each of ``ranks`` expert-parallel ranks receives: counts [..., S, E] ->
    [..., ranks], experts placed contiguously (expert e on rank e // (E / ranks))."""
    experts = counts.shape[-1]
    if ranks <= 0 or experts % ranks:
        raise ValueError(f"{experts} experts cannot be placed evenly on {ranks} ranks")
    per_expert = counts.sum(axis=-2)
    return per_expert.reshape(*per_expert.shape[:-1], ranks, experts // ranks).sum(axis=-1)


def load_max_over_mean(counts: np.ndarray, ranks: int) -> np.ndarray:
    """max / mean of the rank loads of each call: counts [..., S, E] -> [...]
    (1.0 for a call that routed nothing)."""
    loads = rank_loads(counts, ranks).astype(np.float64)
    mean = loads.mean(axis=-1)
    return np.divide(loads.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)


def regroup_sources(layer_counts: np.ndarray, ranks: int) -> np.ndarray:
    """Calls of ``ranks`` sources formed from a trace with fewer: [n, M, S, E] ->
    [calls, ranks, E].

    The recorded rows are taken in time order (step, then micro-batch, then source) and
    every ``ranks`` consecutive rows become the sources of one call, so each call sees
    ``ranks`` micro-batches' worth of tokens from at most ranks / (M x S) + 1 consecutive
    steps. Rows left over at the end (fewer than ``ranks``) are dropped.
    """
    experts = layer_counts.shape[-1]
    rows = layer_counts.reshape(-1, experts)
    usable = (rows.shape[0] // ranks) * ranks
    return rows[:usable].reshape(-1, ranks, experts)


def uniform_load_max_over_mean(tokens: int, experts: int, topk: int, ranks: int, calls: int,
                               seed: int = 0) -> np.ndarray:
    """max / mean of the rank loads of ``calls`` calls of a uniform top-k router that routes
    ``tokens`` tokens: per-expert counts Binomial(tokens, k/E), independent across experts
    (the exact marginal of a uniform top-k choice), placed contiguously -> [calls]."""
    rng = np.random.default_rng(seed)
    counts = rng.binomial(tokens, topk / experts, size=(calls, 1, experts))
    return load_max_over_mean(counts, ranks)
