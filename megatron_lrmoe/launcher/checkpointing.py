"""Atomic dist_checkpointing save/load for the launcher.

Layout (Megatron-LM's, so a user recognises it)::

    SAVE/latest_checkpointed_iteration.txt   iteration of the newest complete checkpoint
    SAVE/iter_0000100/                        dist_checkpointing directory

Atomicity: every rank writes into ``iter_XXXXXXX.tmp``; after a barrier, global
rank 0 renames it to ``iter_XXXXXXX`` and only then rewrites the tracker file
(write to a temporary file, ``os.replace``). A crash at any point leaves the
tracker on the previous complete checkpoint and, at worst, a ``.tmp`` folder
that loading never reads and the next save removes. This assumes a shared
filesystem visible to rank 0, as dist_checkpointing does.

What a checkpoint holds: the model's sharded state dict (with LRMoE, each layer's
step state too: planner and draw seeds, docs/design.md "Step state"), the optimizer's
(built from the model's, so it reshards with Megatron), the scheduler, the iteration
and consumed samples, and every rank's RNG states (CPU generator, CUDA generator
when present, Megatron's tracker) so a resumed run draws the same dropout masks
as an uninterrupted one.

The sharded state dicts are built with a metadata dict that is saved as the
checkpoint's content metadata, as Megatron-LM does, and on load the checkpoint's own
content metadata is passed back: that is how a model knows which optional state the
checkpoint holds (LRMoE's step state) before it builds the load request.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.utils import get_model_config, unwrap_model

from megatron_lrmoe.integration.step_hooks import checkpoint_content_metadata

TRACKER_FILE = "latest_checkpointed_iteration.txt"
# The distributed optimizer's default sharding ("fully_sharded_model_space") relies on
# ShardedTensor.flattened_range, which dist_checkpointing refuses; "dp_reshardable" is
# what Megatron-LM saves by default (megatron/training/checkpointing.py, core_v0.19.0).
SHARDED_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass
class TrainingProgress:
    iteration: int = 0
    consumed_train_samples: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """Iteration of the newest complete checkpoint under ``root``, or None."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise RuntimeError(f"--load {root}: {TRACKER_FILE} holds {text!r}, not an iteration")
    return int(text)


def content_metadata(model) -> dict[str, Any]:
    """The sharded state dict metadata this run saves with (and as the checkpoint's
    content metadata): the optimizer format and, with LRMoE, the step-state flag."""
    return {**SHARDED_METADATA, **checkpoint_content_metadata(get_model_config(model[0]))}


def _rank_state() -> dict[str, Any]:
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rank_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(
    model, optimizer, scheduler, progress, include_optimizer, include_rng, metadata,
    is_loading=False,
):
    # Keys of the bare GPTModel (no DDP/Float16Module prefix), as Megatron-LM saves them.
    # Copies of the metadata: Megatron adds its process groups to the dict it is given.
    model_sd = unwrap_model(model[0]).sharded_state_dict(metadata=dict(metadata))
    state: dict[str, Any] = {
        "model": model_sd,
        "iteration": progress.iteration,
        "consumed_train_samples": progress.consumed_train_samples,
    }
    if include_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=dict(metadata)
        )
        state["opt_param_scheduler"] = scheduler.state_dict()
    if include_rng:
        # One object per global rank: each rank resumes its own generators.
        state["rng_state"] = ShardedObject(
            "rng_state", _rank_state(), (dist.get_world_size(),), (dist.get_rank(),),
            replica_id=0,
        )
    return state


def _materialize_optimizer_state(optimizer) -> None:
    """Give every optimizer parameter its (zero) state before building a load template.

    The template must have the structure of a trained optimizer. Megatron's
    ``init_state_fn`` creates Adam's moments but not torch's per-parameter
    ``step``, which the distributed optimizer reads when TE/apex optimizers are
    absent; the loaded values replace all of it.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.init_state_fn is None:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                opt.optimizer.state[param].setdefault("step", torch.tensor(0.0))


def _restore_step_counters(optimizer) -> None:
    """Give each parameter its own, correct Adam ``step`` after a load.

    Without TE/apex, megatron-core's DistributedOptimizer (read in 0.16.1) keeps torch
    Adam's per-parameter ``step`` out of the checkpointed parameter state (a
    non-persistent local object: the load template's value comes back) and saves
    the count once, in the param groups. Its load_state_dict also hands one
    shared tensor to every parameter, which torch's Adam would then advance once
    per parameter per iteration. We set a private tensor from the param group's
    saved count, which is torch's own semantics.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                param_state = opt.optimizer.state.get(param)
                if param_state is not None and torch.is_tensor(param_state.get("step")):
                    param_state["step"] = torch.tensor(float(group["step"]))


def save_checkpoint(root: str, model, optimizer, scheduler, progress: TrainingProgress) -> str:
    """Save atomically; returns the final checkpoint directory."""
    final = checkpoint_dir(root, progress.iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    metadata = content_metadata(model)
    state = _sharded_state_dict(model, optimizer, scheduler, progress, True, True, metadata)
    dist_checkpointing.save(state, tmp, content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):
            # Re-saving the same iteration: move the old one out of the way first.
            stale = final + ".old"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            os.rename(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER_FILE + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(progress.iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER_FILE))
    dist.barrier()
    return final


def load_checkpoint(
    root: str, model, optimizer, scheduler, load_optimizer: bool = True, load_rng: bool = True
) -> TrainingProgress | None:
    """Load the newest complete checkpoint under ``root``; None when there is none."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise RuntimeError(
            f"--load {root}: tracker names iteration {iteration} but {path} is missing"
        )
    if load_optimizer:
        _materialize_optimizer_state(optimizer)
    # What the checkpoint says it holds decides what is asked of it (Megatron-LM's way):
    # a checkpoint of a plain Megatron run has no LRMoE step state, and asking for a key
    # it lacks fails at the default strictness. Checkpoints from before content metadata
    # was saved hold no step state either.
    metadata = dist_checkpointing.load_content_metadata(path) or dict(SHARDED_METADATA)
    template = _sharded_state_dict(
        model, optimizer, scheduler, TrainingProgress(), load_optimizer, load_rng, metadata,
        is_loading=True,
    )
    state = dist_checkpointing.load(template, path, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    unwrap_model(model[0]).load_state_dict(state["model"])
    if load_optimizer:
        # Without mixed precision the distributed optimizer's main params are views of
        # the model's leaf parameters; writing them must not be recorded by autograd.
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        _restore_step_counters(optimizer)
        scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        _set_rank_state(state["rng_state"])
    return TrainingProgress(state["iteration"], state["consumed_train_samples"])
