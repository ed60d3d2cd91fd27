"""Expert placement: which ranks hold an instance of which expert (a value type).

Notation (docs/design.md, "Notation")
  R        ranks of the expert-parallel group
  E        experts, a multiple of R; E_loc = E / R; home rank of expert e is e // E_loc
  I        instances: the E homes plus the replicas (I = E + number of replicas)

Instance order is rank-major: rank 0's E_loc home experts ascending, then the replicas
rank 0 hosts by expert ascending, then rank 1, ... So the instances of a rank are
contiguous, and without replicas instance i is expert i (Megatron's layout).

How pairs are assigned to instances is ``instance_assignment.py``; which placement a layer uses
each step is decided by ``planner.py`` with the policies of ``placement_policies.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """Which instances exist on which rank: Megatron's homes plus replicas.

    ``replicas`` are (expert, rank) pairs. They are normalised, not refused: any order
    is accepted and stored sorted by (rank, expert), so two placements with the same
    replicas are equal and hash alike. Refused: a replica on the expert's home rank,
    a duplicate, an expert or rank out of range.
    """

    num_ranks: int
    num_experts: int
    replicas: tuple[tuple[int, int], ...] = ()
    instance_expert: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[I] expert whose weights instance i holds."""
    instance_rank: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[I] rank hosting instance i."""
    home_instance: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[E] instance id of expert e's home."""
    rank_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """[R + 1] first instance id of each rank, then the number of instances: rank ``r``
    hosts instances ``rank_starts[r]`` up to ``rank_starts[r + 1]``."""

    def __post_init__(self) -> None:
        num_ranks, num_experts = self.num_ranks, self.num_experts
        for name, value in (("num_ranks", num_ranks), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Placement.{name} must be a positive int, got {value!r}")
        if num_experts % num_ranks:
            raise ValueError(f"Placement.num_experts={num_experts} must be a multiple of "
                             f"num_ranks={num_ranks}")
        per_rank = num_experts // num_ranks
        # Array work: the memory-aware choice builds a dozen placements per layer and
        # step, some with hundreds of replicas at EP 64.
        pairs = np.asarray(self.replicas, dtype=np.int64)
        if pairs.size == 0:
            pairs = pairs.reshape(0, 2)
        elif pairs.ndim != 2 or pairs.shape[1] != 2:
            raise ValueError(f"Placement.replicas must be (expert, rank) pairs, got an array "
                             f"of shape {pairs.shape}")
        order = np.lexsort((pairs[:, 0], pairs[:, 1]))          # by rank, then expert
        expert, rank = pairs[order, 0], pairs[order, 1]
        bad = ((expert < 0) | (expert >= num_experts) | (rank < 0) | (rank >= num_ranks)
               | (rank == expert // per_rank))
        bad[1:] |= (expert[1:] == expert[:-1]) & (rank[1:] == rank[:-1])
        if bad.any():
            k = int(np.argmax(bad))
            e, r = int(expert[k]), int(rank[k])
            if not (0 <= e < num_experts and 0 <= r < num_ranks):
                raise ValueError(f"Placement.replicas: ({e}, {r}) out of range "
                                 f"(E={num_experts}, R={num_ranks})")
            if r == e // per_rank:
                raise ValueError(f"Placement.replicas: ({e}, {r}) is expert {e}'s home rank")
            raise ValueError(f"Placement.replicas: ({e}, {r}) appears twice")
        object.__setattr__(self, "replicas", tuple(zip(expert.tolist(), rank.tolist(),
                                                        strict=True)))

        # Rank-major instances: rank r's homes, then the replicas it hosts by expert.
        hosted = np.bincount(rank, minlength=num_ranks)                   # [R]
        starts = np.zeros(num_ranks + 1, dtype=np.int64)
        np.cumsum(per_rank + hosted, out=starts[1:])
        home = (starts[:-1, None] + np.arange(per_rank)).ravel()          # [E]
        first_hosted = np.cumsum(hosted) - hosted                           # [R]
        hosted_at = starts[rank] + per_rank + np.arange(len(rank)) - first_hosted[rank]
        instance_expert = np.empty(int(starts[-1]), dtype=np.int64)
        instance_expert[home] = np.arange(num_experts)
        instance_expert[hosted_at] = expert
        object.__setattr__(self, "instance_expert", tuple(instance_expert.tolist()))
        object.__setattr__(self, "instance_rank", tuple(
            np.repeat(np.arange(num_ranks), per_rank + hosted).tolist()))
        object.__setattr__(self, "home_instance", tuple(home.tolist()))
        object.__setattr__(self, "rank_starts", tuple(starts.tolist()))

    @classmethod
    def static(cls, num_ranks: int, num_experts: int) -> Placement:
        """Megatron's layout: homes only."""
        return cls(num_ranks, num_experts)

    @property
    def experts_per_rank(self) -> int:
        """E_loc."""
        return self.num_experts // self.num_ranks

    @property
    def num_instances(self) -> int:
        """I = E + number of replicas."""
        return len(self.instance_expert)

    def home_rank(self, expert: int) -> int:
        """Rank owning expert's weights and optimizer state (Megatron's layout)."""
        return expert // self.experts_per_rank

    def rank_instances(self, rank: int) -> range:
        """Instance ids on ``rank`` (contiguous: homes first, then replicas by expert)."""
        return range(self.rank_starts[rank], self.rank_starts[rank + 1])

    @cached_property
    def _instances_of(self) -> tuple[tuple[int, ...], ...]:
        out = [[h] for h in self.home_instance]
        for i in range(self.num_instances):       # rank-major: replicas come by rank
            e = self.instance_expert[i]
            if i != self.home_instance[e]:
                out[e].append(i)
        return tuple(tuple(v) for v in out)

    def instances_of(self, expert: int) -> tuple[int, ...]:
        """Instance ids of ``expert``: home first, then replicas by rank."""
        return self._instances_of[expert]

    def replicas_per_expert(self) -> tuple[int, ...]:
        """[E] number of replicas of each expert (instances minus the home)."""
        return tuple(len(v) - 1 for v in self._instances_of)

    def replicas_per_rank(self) -> tuple[int, ...]:
        """[R] replica instances each rank hosts (what costs it replica memory)."""
        per_rank, starts = self.experts_per_rank, self.rank_starts
        return tuple(starts[r + 1] - starts[r] - per_rank for r in range(self.num_ranks))

    def describe(self) -> str:
        """One line for logs."""
        per_expert = self.replicas_per_expert()
        most = max(per_expert) if per_expert else 0
        return (f"placement R={self.num_ranks} E={self.num_experts}: "
                f"{len(self.replicas)} replicas of "
                f"{sum(1 for c in per_expert if c)} experts (most {most} of one expert)")

