"""The compiled per-call planner (``kernels/planner.cpp``, in ``megatron_lrmoe._kernels``).

One ``NativePlanner`` per placement computes what the Python planner computes per layer
call, on the same numbers and to the same bit: the instance assignment under receive limits
(``instance_assignment``), the uniform retention quotas (``retention.plan_retention``),
each rank's memory (``CostModel.rank_memory``, as ``planner._memory`` calls it) and the
region's host layout (``layer.region_layout.CallLayout``). The Python code stays the
specification, the fallback and the oracle of the property tests
(tests/planning/test_native_planner.py); ``LayerPlanner(native=False)`` runs it.

Why compiled: the planning sits between the counts read and the first dispatch
all-to-all of every MoE layer call, so the GPU waits for it. In numpy it is a few hundred
small array ops (~1 us each); here it is one pass over a few thousand integers.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from megatron_lrmoe.planning.cost_model import CostModel
from megatron_lrmoe.planning.placement import Placement
from megatron_lrmoe.planning.retention import decimal_fraction

__all__ = ["native_available", "native_greedy", "native_judge", "native_local_greedy",
           "native_planner", "native_popularity", "native_pricer"]

try:
    import torch  # noqa: F401  (the extension links torch's libraries: load them first)

    from megatron_lrmoe import _kernels
except ImportError:  # not built: the Python planner runs
    _kernels = None
_NativePlanner = getattr(_kernels, "NativePlanner", None)
if not (hasattr(_NativePlanner, "rank_loads")       # an extension built from older sources
        and hasattr(_kernels, "LocalGreedyReplicas") and hasattr(_kernels, "PlacementJudge")):
    _NativePlanner = None


def native_available() -> bool:
    """Whether the extension in this checkout has the compiled planner (as these sources
    define it: one built before ``rank_loads``, ``LocalGreedyReplicas`` or
    ``PlacementJudge`` counts as absent)."""
    return _NativePlanner is not None


def native_planner(placement: Placement, cost: CostModel | None,
                   replicas: np.ndarray, returned: np.ndarray | None = None) -> Any:
    """The compiled planner of ``placement`` (with ``cost``'s rank memory when given;
    ``replicas`` [R]: the replicas each rank hosts; ``returned`` [R]: the placement's
    ``cost.returned_gradient_bytes``, computed here when not given)."""
    if _NativePlanner is None:
        raise RuntimeError("megatron_lrmoe._kernels has no NativePlanner: rebuild the "
                           "extension (pip install --no-build-isolation -e .)")
    if cost is not None and returned is None:
        returned = cost.returned_gradient_bytes(placement)
    return _NativePlanner(placement.num_ranks, placement.num_experts,
                          list(placement.instance_rank), list(placement.instance_expert),
                          list(placement.home_instance),
                          None if cost is None else _memory_model(cost, replicas, returned))


def native_judge(cost: CostModel, num_ranks: int, num_experts: int,
                 share: float | None) -> Any:
    """The compiled judge of candidate placements (``PlacementJudge.evaluate``: what
    ``LayerPlanner`` computes per candidate with ``_context``, ``_unbudgeted``, ``_fits``
    and ``_plan_times``, to the bit) for ``cost`` at EP ``num_ranks`` and the layer's
    ``share`` of the budget (None: no receive limits)."""
    if _NativePlanner is None:
        raise RuntimeError("megatron_lrmoe._kernels has no PlacementJudge: rebuild the "
                           "extension (pip install --no-build-isolation -e .)")
    constants, table = _rank_terms(cost)
    s = cost.shape
    return _kernels.PlacementJudge(num_ranks, num_experts, constants, table,
                                   float(s.grad_dtype_bytes or s.dtype_bytes),
                                   float(s.parameter_elements),
                                   float(s.fc1_size * s.hidden_size),
                                   None if share is None else float(share),
                                   _pricer_terms(cost, num_ranks))


@functools.lru_cache(maxsize=16)
def native_pricer(cost: CostModel, num_ranks: int | None = None) -> Any:
    """The compiled time model of ``cost`` at EP ``num_ranks`` (None: the shape's):
    ``LayerPricer.load_time`` and ``replica_cost`` are ``CostModel.load_times`` and
    ``replica_cost_per_microbatch``, to the bit."""
    if _NativePlanner is None:
        raise RuntimeError("megatron_lrmoe._kernels has no LayerPricer: rebuild the "
                           "extension (pip install --no-build-isolation -e .)")
    return _kernels.LayerPricer(_pricer_terms(cost, num_ranks))


def native_greedy(routed: list[int], num_ranks: int, num_experts: int) -> Any:
    """The compiled moves of ``placement_policies.greedy_replicas`` on the experts' routed
    pairs ``routed`` [E] (``GreedyReplicas.advance(target)``: moves up to ``target``)."""
    if _kernels is None or not hasattr(_kernels, "GreedyReplicas"):
        raise RuntimeError("megatron_lrmoe._kernels has no GreedyReplicas: rebuild the "
                           "extension (pip install --no-build-isolation -e .)")
    return _kernels.GreedyReplicas([int(n) for n in routed], num_ranks, num_experts)


def native_local_greedy(counts: np.ndarray, num_ranks: int, num_experts: int) -> Any:
    """The compiled moves of ``placement_policies.local_greedy_replicas`` on the [R, E]
    float64 ``counts`` (``LocalGreedyReplicas.advance(target)``)."""
    if _NativePlanner is None:
        raise RuntimeError("megatron_lrmoe._kernels has no LocalGreedyReplicas: rebuild the "
                           "extension (pip install --no-build-isolation -e .)")
    return _kernels.LocalGreedyReplicas(np.ascontiguousarray(counts, dtype=np.float64),
                                        num_ranks, num_experts)


def native_popularity(popularity: np.ndarray, num_ranks: int, num_experts: int, slots: int,
                      counts: np.ndarray | None, compute: float, network: float
                      ) -> tuple[list[tuple[int, int]], int]:
    """``placement_policies.popularity_replicas`` compiled, from the D'Hondt order to the
    placement loop: (replicas, skipped)."""
    if _NativePlanner is None:
        raise RuntimeError("megatron_lrmoe._kernels has no popularity_replicas: rebuild the "
                           "extension (pip install --no-build-isolation -e .)")
    if counts is not None:
        counts = np.ascontiguousarray(counts, dtype=np.float64)
    replicas, skipped = _kernels.popularity_replicas(
        np.ascontiguousarray(popularity, dtype=np.float64), num_ranks, num_experts, slots,
        counts, compute, network)
    return replicas, int(skipped)


def _memory_model(cost: CostModel, replicas: np.ndarray,
                  returned: np.ndarray) -> dict[str, Any]:
    """The per-rank terms and byte counts ``CostModel.rank_memory`` reads, taken from the
    cost model itself (its ``_layout``, ``_held_weight_grads`` and ``_grouped_terms``, and
    the placement's ``returned`` gradient bytes, which the planner budgets on every
    micro-batch), so that the compiled rank memory starts from the very numbers the
    Python one does. The per-rank terms depend on a rank's replica count only, so they
    are read from a table of each count (``_rank_terms``: the same elementwise
    arithmetic, the same bits)."""
    constants, table = _rank_terms(cost)
    rows = table[:, np.asarray(replicas, dtype=np.int64)]
    return {**constants, "nrep": rows[0], "rc": rows[1], "w1": rows[2], "w2": rows[3],
            "held_dw2": rows[4], "held_dw": rows[5],
            "returned": np.array(returned, dtype=np.float64)}


@functools.lru_cache(maxsize=16)
def _rank_terms(cost: CostModel) -> tuple[dict[str, Any], np.ndarray]:
    """(the placement-free entries of ``_memory_model``; [6, E - E/R + 1] float64 table
    of nrep, rc, w1, w2, held_dw2 and held_dw at each replica count a rank can host)."""
    s = cost.shape
    counts = np.arange(s.num_experts + 1, dtype=np.float64)
    xc, rc, local = cost._layout(counts)
    held_dw2, held_dw = cost._held_weight_grads(counts, local)
    dw1, dw2, _ = cost._grouped_terms(1.0)                  # one expert's dW1, dW2
    if s.grouped_gemm:
        w1, w2, conv = cost._grouped_terms(local)
    else:
        w1, w2, conv = np.zeros(len(counts)), np.zeros(len(counts)), 0.0
    p = s.source_pairs
    rho = None if s.store_factor is None else decimal_fraction(s.store_factor)
    table = np.stack([np.broadcast_to(np.asarray(v, dtype=np.float64), counts.shape)
                      for v in (counts, rc, w1, w2, held_dw2, held_dw)])
    constants = {
        "grouped": s.grouped_gemm, "forward_retention": s.forward_retention,
        # two-stage's rho as the exact decimal (stored rows: floor(rho q) per cell), 0/1
        # for the other rules.
        "store_num": rho.numerator if rho is not None else 0,
        "store_den": rho.denominator if rho is not None else 1,
        "xc": float(xc), "conv": float(conv), "row": s.row_bytes,
        "sr": s.saved_bytes_per_routed_pair, "p": p, "pss": p * s.saved_bytes_per_source_pair,
        "meta": p * s.metadata_bytes_per_source_pair,
        "f_b": s.ffn_hidden_size * s.dtype_bytes, "f1_b": s.fc1_size * s.dtype_bytes,
        "hb": s.hidden_size * s.dtype_bytes, "fac": s.forward_activation_factor,
        "ob": s.output_bytes, "pbb": p * s.backward_bytes_per_source_pair,
        "wgt_tmp": s.weight_gradient_temporary_bytes, "ib": s.instance_bytes,
        "kappa_mif": s.kept_layers_fraction * s.microbatches_in_flight,
        "kappa": float(s.kept_layers_fraction), "rerun": s.rerun_output_bytes,
        "lyr": s.num_layers, "mif": s.microbatches_in_flight,
        "replica_dw": float(dw1 + dw2), "replica_dw2": float(dw2),
    }
    return constants, table


@functools.lru_cache(maxsize=16)
def _pricer_terms(cost: CostModel, num_ranks: int | None) -> dict[str, Any]:
    """What ``CostModel.layer_times`` with ``instance_gemm_times``, ``load_times`` and
    ``replica_cost_per_microbatch`` read at EP ``num_ranks`` (None: the shape's), taken
    from the cost model itself (its machine's rate tables, its ``_row_passes``,
    ``_router_times``, ``_fixed_times`` and ``_local_instances``), so that the compiled
    price starts from the very numbers the Python one does."""
    s, m = cost.shape, cost.machine
    routed_passes, retained_passes, gather = cost._row_passes(num_ranks)
    f_router, b_router = cost._router_times()
    f_fixed, b_fixed = cost._fixed_times()
    memory = m.memory_bytes_per_s > 0
    grad_bytes = s.grad_dtype_bytes or s.dtype_bytes
    return {
        "local": float(cost._local_instances(num_ranks)),
        "source_pairs": float(s.source_pairs),
        "router_sum": float(sum(cost._router_times())),
        "latency": float(m.alltoall_latency_s),
        "refresh_bytes": float(s.parameter_elements * s.dtype_bytes),
        "reduction_bytes": float(s.parameter_elements * grad_bytes),
        "microbatches_per_step": float(s.microbatches_per_step),
        "gemm_rows": [float(x) for x in m.gemm_rows],
        "gemm_forward": [float(x) for x in m.gemm_forward_flops_per_s],
        "gemm_backward": [float(x) for x in m.gemm_backward_flops_per_s],
        "gemm_flops_per_s": float(m.gemm_flops_per_s),
        "forward_flops": float(s.forward_flops_per_pair),
        "backward_flops": float(s.backward_flops_per_pair),
        "memory": memory, "forward_retention": bool(s.forward_retention),
        "store_factor": 0.0 if s.store_factor is None else float(s.store_factor),
        "routed_f": float(routed_passes), "retained_b": float(retained_passes),
        "gather": float(gather), "h": float(s.hidden_size),
        "th": float(s.tokens_per_rank * s.hidden_size),
        "per_byte": s.dtype_bytes / m.memory_bytes_per_s if memory else 0.0,
        "alltoall_sizes": [float(x) for x in m.alltoall_sizes],
        "alltoall_rates": [float(x) for x in m.alltoall_size_bytes_per_s],
        "alltoall_bytes_per_s": float(m.alltoall_bytes_per_s),
        "forward_messages": [float(x) for x in s.forward_alltoall_messages],
        "backward_messages": [float(x) for x in s.backward_alltoall_messages],
        "f_router": float(f_router), "b_router": float(b_router),
        "f_fixed": float(f_fixed), "b_fixed": float(b_fixed),
    }
