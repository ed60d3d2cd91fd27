"""One LRMoE layer's step state: what it keeps across micro-batches and training steps.

What the state is, when it changes and how it travels in checkpoints: docs/design.md,
"Step state". ``LRMoELayer`` holds one ``LayerStepState`` (``layer.lrmoe_state``) and
delegates Megatron's extra-state protocol to it; ``integration/step_hooks.py`` drives
the step boundaries of a whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
from megatron_lrmoe.planning.planner import LayerPlanner, PlannerSettings

__all__ = ["STEP_STATE_FLAG", "STEP_STATE_FORMAT", "STEP_STATE_VERSION", "carries_step_state",
           "LayerStepState", "MicrobatchesPerStep"]

_LOG = logging.getLogger(__name__)

# The checkpointed step state: the layer's module extra state.
STEP_STATE_FORMAT = "megatron-lrmoe layer step state"
STEP_STATE_VERSION = 1
# Content-metadata flag of a checkpoint whose LRMoE layers saved their step state; the
# sharded state dict holds the state's key only when it is set. Checkpoints saved before
# the flag had this name carry the legacy one, which means the same.
STEP_STATE_FLAG = "lrmoe_step_state"
_LEGACY_STEP_STATE_FLAG = "lrmoe_planner_state"


def carries_step_state(metadata: dict | None) -> bool:
    """Whether a checkpoint's content metadata says its LRMoE layers saved their step
    state (``STEP_STATE_FLAG``, or the name it had before)."""
    metadata = metadata or {}
    return bool(metadata.get(STEP_STATE_FLAG) or metadata.get(_LEGACY_STEP_STATE_FLAG))

MicrobatchesPerStep = int | Callable[[], int]


class LayerStepState:
    """The planner, the steps finished (the draws' step seed) and, within a step, the
    micro-batch ordinal, the backward count and the replica refresh mark of one layer.

    ``layer_number`` arguments only name the layer in errors and logs: Megatron may
    renumber a layer after it is built (``set_layer_number``).
    """

    def __init__(self, config: LRMoETransformerConfig, ep_size: int) -> None:
        self.config = config
        self.ep_size = ep_size
        # Random rules draw from (step seed, layer, micro-batch ordinal): the step seed
        # mixes torch's seed (set from --seed by Megatron's setup; reading it consumes no
        # random numbers) with the training steps this layer finished; ``calls`` counts
        # the current step's training forwards. Both restart at a step's end.
        self.run_seed = torch.initial_seed()
        self.step = 0
        self.calls = 0
        self.seed_base = _step_seed(self.run_seed, self.step)
        self.microbatches_per_step: MicrobatchesPerStep | None = None
        """Micro-batches of a training step (an int, or a function such as Megatron's
        ``get_num_microbatches``): how the layer finds the step's last backward, where
        replica gradients join the homes'. Set by ``setup_planner``; None = not told,
        which is an error once replicas exist."""
        # Built by setup_planner from the settings integration derives from the config
        # (step_hooks.setup_lrmoe_layers, which both entry points run right after building
        # the model): the layer does not read its config to plan.
        self.planner: LayerPlanner | None = None
        self.pending_state: dict | None = None     # loaded before setup_planner ran
        self.planner_state_origin = "fresh"
        """Where the planner state came from: "fresh", "checkpoint", or "fresh: <why>"."""
        self.reports_checkpoint_state = False      # the one layer that logs it (setup)
        self.needs_refresh = True        # replicas must be refreshed before the next forward
        self.backwards_in_step = 0
        self.step_memory: np.ndarray | None = None
        """[R] the most bytes any training micro-batch of this step planned per rank
        (``LayerPlanner.last_memory``); None when the planner reports none."""
        self.last_step_memory: np.ndarray | None = None
        """``step_memory`` of the step ``finish_step`` last ended (None: no training
        micro-batch, or no memory reported)."""

    # ------------------------------------------------------------------ planner
    def require_planner(self, layer_number: int | None) -> LayerPlanner:
        """The planner; an error before ``setup_planner``."""
        if self.planner is None:
            raise RuntimeError(
                f"LRMoE layer {layer_number} has no planner: its settings come from the run "
                "at model setup; call megatron_lrmoe.integration.step_hooks."
                "setup_lrmoe_layers(model, tokens_per_rank, microbatches_per_step) (both "
                "entry points do) before the first forward")
        return self.planner

    def setup_planner(self, settings: PlannerSettings,
                      microbatches_per_step: MicrobatchesPerStep) -> LayerPlanner:
        """See ``LRMoELayer.setup_planner``."""
        self.microbatches_per_step = microbatches_per_step
        previous = self.planner.state_dict() if self.planner is not None else None
        self.planner = LayerPlanner(settings)
        if previous is not None:
            self.planner.load_state_dict(previous)
        elif self.pending_state is not None:
            self._apply(self.pending_state)
        self.pending_state = None
        return self.planner

    # ------------------------------------------------------------ micro-batches
    def step_microbatches(self, layer_number: int | None) -> int:
        """Micro-batches of a step as told; an error when not told or not a positive int."""
        told = self.microbatches_per_step
        if told is None:
            raise RuntimeError(
                f"LRMoE layer {layer_number} holds replicas but was never told how many "
                "micro-batches a training step has, so it cannot find the step's last "
                "backward (where replica gradients must join the homes'): run "
                "megatron_lrmoe.integration.step_hooks.setup_lrmoe_layers(model, ...) "
                "(both entry points do), or set layer.microbatches_per_step when driving the layer "
                "by hand")
        count = told() if callable(told) else told
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"LRMoE layer {layer_number}: microbatches_per_step gave "
                             f"{count!r}, expected a positive int")
        return count

    def microbatches_told(self) -> int:
        """Micro-batches of a step as told, unchecked (1 when driven by hand)."""
        told = self.microbatches_per_step
        if told is None:
            return 1
        return told() if callable(told) else told

    def draw_seed(self, layer: int) -> int:
        """The seed of this micro-batch's draws: (step seed, layer, ordinal)."""
        return _mix_seed(self.seed_base, layer, self.calls)

    def count_training_forward(self) -> None:
        """One more training micro-batch in this step (the next draw ordinal); its plan's
        memory (``LayerPlanner.last_memory``, when reported) joins the step's most."""
        self.calls += 1
        memory = None if self.planner is None else self.planner.last_memory
        if memory is not None:
            self.step_memory = (memory.copy() if self.step_memory is None
                                else np.maximum(self.step_memory, memory))

    def count_backward(self, layer_number: int | None) -> bool:
        """One more backward with replicas in this step; True for the step's last
        (the ``microbatches_per_step``-th), which restarts the count."""
        self.backwards_in_step += 1
        if self.backwards_in_step < self.step_microbatches(layer_number):
            return False
        self.backwards_in_step = 0
        return True

    # -------------------------------------------------------------- step boundary
    def finish_step(self, observations: tuple[torch.Tensor | None, int,
                                              list[torch.Tensor]] | None,
                    replica_grads_pending: bool, layer_number: int | None) -> None:
        """See ``LRMoELayer.finish_step``."""
        if self.backwards_in_step or replica_grads_pending:
            raise RuntimeError(
                f"LRMoE layer {layer_number}: the step ended after {self.backwards_in_step} "
                f"backward pass(es) of the {self.step_microbatches(layer_number)} it was told "
                "a step has; the replica gradients never reached the home experts")
        self.last_step_memory, self.step_memory = self.step_memory, None
        if not self.calls:
            return
        planner = self.require_planner(layer_number)
        if observations is not None:
            planner.replace_observations(*observations)
        planner.next_step()
        self._set_step(self.step + 1)
        self.calls = 0
        self.needs_refresh = True

    def snapshot(self, layer_number: int | None) -> dict[str, Any]:
        """Everything a step changes here, to undo it (a copy)."""
        return {"planner": self.require_planner(layer_number).state_dict(), "step": self.step,
                "calls": self.calls, "backwards": self.backwards_in_step,
                "needs_refresh": self.needs_refresh}

    def restore(self, state: dict[str, Any], layer_number: int | None) -> None:
        """Undo what happened since ``snapshot()`` returned ``state``."""
        self.require_planner(layer_number).load_state_dict(state["planner"])
        self._set_step(state["step"])
        self.calls = state["calls"]
        self.backwards_in_step = state["backwards"]
        self.needs_refresh = state["needs_refresh"]

    # -------------------------------------------------------------- checkpoints
    def extra_state(self) -> dict[str, Any]:
        """The module extra state: planner (smoothed loads, step, placement), the
        finished steps that seed the draws, and what the planner is valid for (EP
        size, experts, policy)."""
        if self.planner is None and self.pending_state is not None:
            return self.pending_state        # loaded before setup_planner: saved unchanged
        return {"format": STEP_STATE_FORMAT, "version": STEP_STATE_VERSION,
                "ep_size": self.ep_size, "num_experts": self.config.num_moe_experts,
                "policy": self.config.moe_lrmoe_placement, "step": self.step,
                "planner": None if self.planner is None else self.planner.state_dict()}

    def set_extra_state(self, state: Any) -> None:
        """Load the module extra state (kept for ``setup_planner`` when no planner yet)."""
        if self.planner is None:
            self.pending_state = state      # applied by setup_planner
            self._reset_progress()
            if isinstance(state, dict) and "step" in state:
                self._set_step(int(state["step"]))
            return
        self._apply(state)

    def load_without_state(self) -> None:
        """The checkpoint holds no step state for this layer: start fresh at step 0."""
        self._reset_progress()
        self.pending_state = None
        self._set_step(0)
        self._start_fresh("the checkpoint holds no LRMoE step state (saved without "
                          "--moe-lrmoe, or before LRMoE saved it)")

    def report_origin(self, layer_number: int | None) -> None:
        """Log where the planner state came from (the one layer chosen at setup)."""
        if not self.reports_checkpoint_state:
            return
        origin = self.planner_state_origin
        if origin == "checkpoint":
            _LOG.info("LRMoE: planner and draw state loaded from the checkpoint")
        else:
            _LOG.warning("LRMoE layer %s (and the others of this pipeline stage): the planner "
                         "starts %s", layer_number, origin)

    def _apply(self, state: Any) -> None:
        """Load a saved step state, or start the planner fresh (and say why) when it does
        not apply to this run: another EP size, expert count or placement policy."""
        self._reset_progress()
        if not isinstance(state, dict) or state.get("format") != STEP_STATE_FORMAT:
            self._start_fresh("the checkpoint's state of this layer is not an LRMoE step state")
            return
        if state.get("version") != STEP_STATE_VERSION:
            self._start_fresh(f"step state version {state.get('version')!r}, this code reads "
                              f"{STEP_STATE_VERSION}")
            return
        self._set_step(int(state["step"]))
        saved = (state.get("ep_size"), state.get("num_experts"), state.get("policy"))
        here = (self.ep_size, self.config.num_moe_experts, self.config.moe_lrmoe_placement)
        if saved != here or state.get("planner") is None:
            self._start_fresh(f"the checkpoint's planner is for (EP, experts, placement) = "
                              f"{saved}, this run has {here}")
            return
        # Not None here: setup_planner applies a pending state after building it.
        self.planner.load_state_dict(state["planner"])
        self.planner_state_origin = "checkpoint"

    def _start_fresh(self, why: str) -> None:
        if self.planner is not None:
            self.planner = LayerPlanner(self.planner.settings)
        self.planner_state_origin = f"fresh: {why}"

    def _reset_progress(self) -> None:
        self.calls = 0
        self.step_memory = None
        self.backwards_in_step = 0
        self.needs_refresh = True

    def _set_step(self, step: int) -> None:
        self.step = step
        self.seed_base = _step_seed(self.run_seed, step)


def _step_seed(run_seed: int, step: int) -> int:
    """A 63-bit seed of one training step of the run, a different one for each step
    (``_mix_seed`` then mixes in the layer and the micro-batch ordinal)."""
    value = (run_seed * 0xD6E8FEB86659FD93 + step * 0x94D049BB133111EB + 0x5EED) & (2**64 - 1)
    value ^= value >> 29
    return value & (2**63 - 1)


def _mix_seed(base: int, layer: int, call: int) -> int:
    """A 63-bit seed from (base, layer, call), different for every triple."""
    value = (base * 0x9E3779B97F4A7C15 + layer * 0xBF58476D1CE4E5B9 + call) & (2**64 - 1)
    value ^= value >> 31
    return value & (2**63 - 1)
