"""Bridge's own ``pretrain()`` on two gloo ranks (EP 2) with ``enable_lrmoe(..., adapt=True)``:
the Qwen3-30B-A3B 8 x H100 recipe and GLM-4.5-Air's, shrunk in width and depth by
overrides (on CPU also the local spec: no Transformer Engine here).

For each recipe, four runs of 20 steps on one pool:

* LRMoE (popularity placement, so the step state holds replicas and smoothed loads): the
  loss falls, and every MoE layer, GLM's MTP layer included, is an LRMoE layer (GLM's
  first layer stays dense);
* LRMoE at gamma = inf and the same adapted recipe with Megatron's MoE layer
  (``model.moe_lrmoe=false``): the same losses within the layer tests' bars;
* the first run saves at step 10 (Qwen's asynchronously, GLM's synchronously), a new one
  resumes from that checkpoint to step 20: bitwise the losses, parameters and LRMoE step
  state of the uninterrupted run. The first run also logs to TensorBoard and to W&B (a
  recording stand-in for the ``wandb`` module, not installed here): LRMoE's statistics
  land in both, at the same steps with the same values.

One recipe runs through the API (``enable_lrmoe``, Bridge's ``process_config_with_overrides``,
``pretrain``) and saves/resumes through the launcher (``python -m megatron_lrmoe.bridge_launcher``'s
``main``), the other the other way round, so the launcher's runs are compared bitwise with
the API's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch

from lrmoe_testing import bridge as harness
from tests.layer.test_lrmoe_layer import ATOL, RTOL

QWEN_8 = harness.QWEN3_30B_A3B_8GPU
GLM_AIR = harness.GLM45_AIR
LRMOE = ["model.moe_lrmoe_placement=popularity", "model.moe_lrmoe_bwd_capacity_factor=0.5"]


def _enable(cfg) -> None:
    """The conversion under test, after the recipe is built and before the overrides."""
    from megatron_lrmoe.integration.bridge import enable_lrmoe

    enable_lrmoe(cfg, adapt=True)


def _recorder(out: dict):
    from megatron.bridge.training.callbacks import Callback
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lrmoe.integration.step_hooks import lrmoe_layers, snapshot_lrmoe_state

    class Record(Callback):
        def on_train_step_end(self, context):
            out["losses"].append(float(context.loss_dict["lm loss"]))

        def on_train_end(self, context):
            out["state"] = snapshot_lrmoe_state(context.model)
            out["params"] = [p.detach().clone() for p in context.model[0].parameters()]
            out["moe"] = [(name, type(m).__name__) for name, m in
                          context.model[0].named_modules() if isinstance(m, MoELayer)]
            layers = lrmoe_layers(context.model)
            out["origin"] = layers[0].lrmoe_state.planner_state_origin if layers else None
            out["async_saves"] = context.state.async_calls_queue is not None

    return Record()


def _recording_wandb() -> types.ModuleType:
    """A stand-in for the ``wandb`` module (not installed here) with what Bridge's training
    calls on it (state.py:wandb_logger, train_utils.py:training_log, train.py):
    ``init(**kwargs)``, ``log(data, step)``, ``finish()``; it records the calls."""
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.calls = []
    module.init = lambda **kwargs: module.calls.append(("init", kwargs["project"]))
    module.log = lambda data, step=None, commit=None: module.calls.append(
        ("log", dict(data), step))
    module.finish = lambda: module.calls.append(("finish",))
    return module


def train(recipe: str, overrides: list[str], launcher: bool, wandb: bool = False) -> dict:
    """One Bridge run on this rank (a pool task), through the API or the launcher: losses,
    the final parameters, LRMoE step state and MoE layer classes, and where the planner
    state came from; with ``wandb``, Bridge's W&B logging on (project "lrmoe") into a
    recording ``wandb`` module, whose calls are ``out["wandb"]``."""
    if not wandb:
        return _train(recipe, overrides, launcher, contextlib.nullcontext)
    recorder = _recording_wandb()

    @contextlib.contextmanager
    def recording():
        # Only while Bridge trains (after the recipes are imported: some of their imports
        # probe for wandb and would take the stand-in for the package).
        before = sys.modules.get("wandb")
        sys.modules["wandb"] = recorder
        try:
            yield
        finally:
            if before is None:
                sys.modules.pop("wandb")
            else:
                sys.modules["wandb"] = before

    out = _train(recipe, [*overrides, "logger.wandb_project=lrmoe",
                          "logger.wandb_exp_name=test"], launcher, recording)
    out["wandb"] = recorder.calls
    return out


def _train(recipe: str, overrides: list[str], launcher: bool, around) -> dict:
    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    out: dict = {"losses": []}
    overrides = [*harness.EP2, *overrides]
    if not launcher:
        from megatron_lrmoe.integration.bridge import LRMoECallback

        cfg = harness.build_recipe(recipe, overrides, convert=_enable)
        with around():
            harness.run_pretrain(cfg, [LRMoECallback(), _recorder(out)])
        return out
    from megatron.bridge.training import pretrain as bridge_pretrain

    from megatron_lrmoe.bridge_launcher.cli import main
    from megatron_lrmoe.megatron_privates import swapped_bridge_mtp_block_spec

    real = bridge_pretrain.pretrain

    def pretrain(cfg, forward_step, callbacks=None):
        with around():
            return real(cfg, forward_step, callbacks=[*callbacks, _recorder(out)])

    bridge_pretrain.pretrain = pretrain
    cpu = harness.cpu()
    try:
        mtp = (swapped_bridge_mtp_block_spec(harness.local_mtp_block_spec) if cpu
               else contextlib.nullcontext())
        with mtp:
            argv = ["--recipe", recipe, "--adapt", *harness.recipe_overrides(recipe, overrides)]
            assert main(argv, customize=harness.use_local_spec if cpu else None) == 0
    finally:
        bridge_pretrain.pretrain = real
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("recipe, api_runs_first, async_save",
                         [(QWEN_8, True, True), (GLM_AIR, False, False)])
def test_recipe_trains_with_lrmoe_exact_at_inf_and_resumes_bitwise(gloo2, tmp_path, recipe,
                                                                   api_runs_first, async_save):
    run = functools.partial(gloo2.run, train, recipe, timeout=600)
    # The uninterrupted run saves at steps 10 and 20 (one recipe asynchronously, through
    # Bridge's persistent worker process); the resumed one starts from step 10.
    board = tmp_path / "tensorboard"
    full = run([*LRMOE, *harness.checkpoint_overrides(save=str(tmp_path), interval=10,
                                                      async_save=async_save),
                f"logger.tensorboard_dir={board}"], launcher=not api_runs_first, wandb=True)
    inf = run([*LRMOE[:1], "model.moe_lrmoe_bwd_capacity_factor=inf"],
              launcher=not api_runs_first)
    off = run(["model.moe_lrmoe=false"], launcher=not api_runs_first)
    resumed = run([*LRMOE, *harness.checkpoint_overrides(load=str(tmp_path)),
                   "checkpoint.ckpt_step=10"], launcher=api_runs_first)

    glm = recipe == GLM_AIR
    for rank in range(2):
        losses = full[rank]["losses"]
        assert len(losses) == 20
        assert sum(losses[-5:]) < sum(losses[:5]) - 0.1, losses
        # Every MoE layer is LRMoE's: Qwen3's two, GLM's two after its dense first layer
        # and its MTP layer.
        names = [name for name, _ in full[rank]["moe"]]
        assert len(names) == (3 if glm else 2)
        assert {cls for _, cls in full[rank]["moe"]} == {"LRMoELayer"}
        if glm:
            assert "module.decoder.layers.0.mlp" not in names
            assert "module.mtp.layers.0.mtp_model_layer.mlp" in names
        assert [cls for _, cls in off[rank]["moe"]] == ["MoELayer"] * len(names)
        torch.testing.assert_close(torch.tensor(inf[rank]["losses"]),
                                   torch.tensor(off[rank]["losses"]), rtol=RTOL, atol=ATOL)
        assert full[rank]["async_saves"] == async_save
        assert resumed[rank]["losses"] == losses[10:]
        assert resumed[rank]["origin"] == "checkpoint"
        assert _equal(resumed[rank]["params"], full[rank]["params"])
        assert _equal(resumed[rank]["state"], full[rank]["state"])
        assert full[rank]["state"][0]["planner"]["smoothed_counts"] is not None
    # LRMoE's statistics in Bridge's TensorBoard writer, at the logger's interval (5).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("lrmoe/retained-fraction")] == [5, 10, 15, 20]
    # And in its W&B run, which Bridge starts on the last rank only: the same scalars at
    # the same steps (TensorBoard keeps float32).
    assert full[0]["wandb"] == []
    calls = full[1]["wandb"]
    assert calls[0] == ("init", "lrmoe")
    logged: dict[str, list] = {}
    for call in calls[1:]:
        for key, value in (call[1].items() if call[0] == "log" else ()):
            if key.startswith("lrmoe/"):
                logged.setdefault(key, []).append((call[2], float(np.float32(value))))
    board_tags = [t for t in events.Tags()["scalars"] if t.startswith("lrmoe/")]
    assert sorted(logged) == sorted(board_tags) and "lrmoe/retained-fraction" in logged
    for tag in board_tags:
        assert logged[tag] == [(e.step, e.value) for e in events.Scalars(tag)], tag


def count_parameters(recipe: str, lrmoe: bool) -> tuple[int, int]:
    """(parameters, of which in experts) of the full-size recipe model on this rank (EP 2,
    PP 1), built on the meta device: nothing allocated (a pool task)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_lrmoe.integration.bridge import enable_lrmoe
    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    cfg = harness.recipe_function(recipe)()
    enable_lrmoe(cfg, adapt=True)
    if harness.cpu():
        harness.use_local_spec(cfg)
    model = cfg.model
    model.moe_lrmoe = lrmoe
    model.tensor_model_parallel_size = model.pipeline_model_parallel_size = 1
    model.expert_model_parallel_size = dist.get_world_size()
    model.sequence_parallel, model.pipeline_dtype = False, None
    model.mtp_num_layers = None          # Bridge builds MTP with TE only; counted elsewhere
    # On the meta device, created without a device (Megatron's CPU initialization path)
    # and not initialized: no byte of weight is allocated.
    model.init_model_with_meta_device = model.use_cpu_initialization = True
    model.perform_initialization = False
    model.apply_rope_fusion = model.persist_layer_norm = False
    model.finalize()
    parallel_state.initialize_model_parallel(
        expert_model_parallel_size=model.expert_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        gpt = model.provide(pre_process=True, post_process=True)
        params = dict(gpt.named_parameters())
        assert all(p.is_meta for p in params.values())
        experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
        return sum(p.numel() for p in params.values()), experts
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("recipe, billions", [(QWEN_8, 30.5), (GLM_AIR, 106)])
def test_full_size_parameter_counts_equal_with_and_without_lrmoe(gloo2, recipe, billions):
    ours = gloo2.run(count_parameters, recipe, True, timeout=600)
    theirs = gloo2.run(count_parameters, recipe, False, timeout=600)
    assert ours == theirs
    # Both ranks hold the same non-expert parameters and half of the experts each.
    total = ours[0][0] + ours[1][1]
    assert abs(total / 1e9 - billions) / billions < 0.02, total


def train_without_the_callback(recipe: str) -> str:
    """A pool task: an LRMoE recipe run without ``LRMoECallback``; the error it stops with."""
    from megatron_lrmoe.integration.runtime.cpu import enable_bridge_cpu_runtime

    enable_bridge_cpu_runtime()
    cfg = harness.build_recipe(recipe, [*harness.EP2, "train.train_iters=1"], convert=_enable)
    try:
        harness.run_pretrain(cfg)
    except RuntimeError as exc:
        return str(exc)
    return "trained"


def test_a_run_without_the_step_callback_stops_naming_it(gloo2):
    for message in gloo2.run(train_without_the_callback, QWEN_8, timeout=300):
        assert message.startswith("LRMoE in Megatron-Bridge needs its step callback: "
                                  "pretrain(cfg, forward_step, callbacks=[megatron_lrmoe."
                                  "integration.bridge.LRMoECallback()])"), message
