"""Run by tests/integration/test_megatron_lm_integration.py in a fresh interpreter against a
Megatron-LM checkout ($MEGATRON_LM, core_v0.19.0); prints one JSON line per check.

    python tests/integration/_megatron_lm_probe.py flags  -- <pretrain_gpt.py flags>
        # Megatron-LM's parse_args with the LRMoE provider only (strict: unknown flags fail)
    python tests/integration/_megatron_lm_probe.py parse  -- <pretrain_gpt.py flags>
        # Megatron-LM's parser with the LRMoE provider, its validate_args, and the model
        # config pretrain_gpt.py's __main__ would hand to pretrain() (lrmoe_model_config)
    python tests/integration/_megatron_lm_probe.py build  PATH -- <flags>  # model on meta
        # PATH config: the config's builder (LRMoEGPTModelBuilder / GPTModelBuilder), as
        # pretrain() builds it; PATH provider: partial(model_provider,
        # lrmoe_builder(gpt_builder)), the model-provider path. Adds
        # --use-cpu-initialization: without it Megatron's layers allocate on
        # torch.cuda.current_device(), which the CPU runtime answers with the CPU, so
        # most weights would land in CPU memory despite torch.device("meta").
    python tests/integration/_megatron_lm_probe.py checkpoint DIR -- <flags>
        # Megatron-LM's own save_checkpoint/load_checkpoint (torch_dist, its default
        # --dist-ckpt-strictness) across LRMoE and plain models built by the builders
    python tests/integration/_megatron_lm_probe.py rerun -- <flags>
        # Megatron-LM's own setup_model_and_optimizer, train_step and training_log with
        # its re-run state machine
    python tests/integration/_megatron_lm_probe.py train  PATCHED_DIR -- <flags>
        # runs PATCHED_DIR/pretrain_gpt.py's __main__ (its own parse_and_validate_args,
        # gpt_config_from_args and the patch's lrmoe_model_config) with Megatron's
        # pretrain() replaced by a CPU stand-in (build the config's model with the CPU
        # runtime, one forward/backward step)
    torchrun ... tests/integration/_megatron_lm_probe.py pretrain SCRIPT -- <flags>
        # runs SCRIPT's __main__ (PATCHED_DIR/pretrain_gpt.py, or the wrapper
        # scripts/pretrain_gpt_lrmoe.py with $MEGATRON_LM) with Megatron-LM's own pretrain():
        # initialize_megatron, setup_model_and_optimizer (--load), data iterators, train()
        # with its saves, re-runs and exits; CPU stand-ins only where it needs CUDA
        # (_cpu_megatron_lm). Reports every iteration's loss and LRMoE step state and a
        # digest of the last checkpoint it saved.

Megatron-LM's initialize_megatron needs CUDA, so the single-process probes do what it
does on CPU (_init_world): a gloo world of one, parallel_state and the RNG tracker, and
the re-run state machine; the arguments and the micro-batch calculator come from
Megatron-LM's own parse_args / validate_args / set_global_variables (_parse).
"""

from __future__ import annotations

import json
import os
import sys

ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}  # pretrain_gpt.py's args_defaults


def _parse(argv: list[str], provider=None):
    """What parse_and_validate_args does (core_v0.19.0), without building the tokenizer:
    the probes give --vocab-size and set the padded size to it (no download)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    from megatron_lrmoe.integration.megatron_lm import lrmoe_args_provider

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args(provider or lrmoe_args_provider(None))
    validate_args(args, ARGS_DEFAULTS)
    set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = args.vocab_size
    return args


def _model_config(args):
    """The model config of pretrain_gpt.py's __main__ with the patch (no ModelOpt)."""
    from megatron.training.argument_utils import gpt_config_from_args

    from megatron_lrmoe.integration.megatron_lm import lrmoe_model_config

    return lrmoe_model_config(args, gpt_config_from_args(args))


def _init_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_lrmoe.integration.runtime.cpu import enable_cpu_runtime

    enable_cpu_runtime()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    # What initialize_megatron sets up besides: the re-run state machine (with
    # Megatron-LM's own state functions, which LRMoE chains onto).
    from megatron.core import rerun_state_machine as rsm

    rsm.initialize_rerun_state_machine(state_save_func=lambda: {"megatron": 1},
                                       state_restore_func=lambda state: None)


def _pg_collection():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def _describe(model) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe = [type(m).__name__ for m in model.modules() if isinstance(m, MoELayer)]
    experts = sorted({type(m.experts).__name__ for m in model.modules() if isinstance(m, MoELayer)})
    return {"moe_layers": moe, "experts": experts,
            "params": sum(p.numel() for p in model.parameters()),
            "devices": sorted({p.device.type for p in model.parameters()})}


def flags(argv: list[str]) -> dict:
    """Megatron-LM's own parse_args with the LRMoE provider, nothing else: the flags are
    all known to core_v0.19.0's parser (it refuses an unknown one) or to ours."""
    from megatron.training.arguments import parse_args

    from megatron_lrmoe.integration.megatron_lm import lrmoe_args_provider

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args(lrmoe_args_provider(None))
    return {"moe_lrmoe": args.moe_lrmoe, "num_experts": args.num_experts,
            "data_path": args.data_path}


def parse(argv: list[str]) -> dict:
    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig

    args = _parse(argv)
    built = []       # every LRMoETransformerConfig made on the way
    post_init = LRMoETransformerConfig.__post_init__

    def counted(self):
        built.append(self)
        post_init(self)

    LRMoETransformerConfig.__post_init__ = counted
    try:
        model_cfg = _model_config(args)
    finally:
        LRMoETransformerConfig.__post_init__ = post_init
    out = {"moe_lrmoe": args.moe_lrmoe, "model_config": type(model_cfg).__name__,
           "builder": model_cfg.get_builder_cls().__name__,
           "transformer_config": type(model_cfg.transformer).__name__}
    if args.moe_lrmoe:
        config = model_cfg.transformer
        out["fields"] = {k: getattr(config, k) for k in (
            "moe_lrmoe", "moe_lrmoe_bwd_capacity_factor", "moe_lrmoe_min_retention",
            "moe_lrmoe_metric", "moe_lrmoe_selection", "moe_lrmoe_placement",
            "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "num_layers",
            "hidden_size", "num_query_groups", "kv_channels", "qk_layernorm",
            "moe_token_dispatcher_type", "expert_tensor_parallel_size")}
        out["configs_built"] = len(built)
        out["budget_gb"] = {"args": args.moe_lrmoe_memory_budget_gb,
                            "config": config.moe_lrmoe_memory_budget_gb}
        if args.moe_lrmoe_memory_budget_gb == "auto":
            from megatron_lrmoe.integration.megatron_lm import _memory_account

            account = _memory_account(args, config)
            out["account_gib"] = {"device": account.device / 2**30,
                                  "outside_moe": account.outside_moe / 2**30}
        # The GPT settings are gpt_config_from_args's, as without --moe-lrmoe.
        out["gpt_fields"] = {k: getattr(model_cfg, k) for k in (
            "vocab_size", "seq_length", "rotary_base", "position_embedding_type",
            "share_embeddings_and_output_weights")}
        # A model config of another class (ModelOpt's ModelOptModelConfig, when --load holds
        # ModelOpt state) would bring its own builder: refused.
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.models import GPTModelConfig

        from megatron_lrmoe.config.flags import ConfigError
        from megatron_lrmoe.integration.megatron_lm import lrmoe_model_config

        other = type("OtherModelConfig", (GPTModelConfig,), {"builder": "elsewhere.Builder"})
        try:
            lrmoe_model_config(args, gpt_config_from_args(args, model_config_cls=other))
        except ConfigError as exc:
            out["other_config_refused"] = str(exc)
    return out


def build(path: str, argv: list[str]) -> dict:
    import functools
    import resource

    import torch

    if "--use-cpu-initialization" not in argv:
        # Megatron's layers then create weights without a device argument, so the
        # meta default device below applies to all of them (checked by _describe's devices).
        argv = [*argv, "--use-cpu-initialization"]
    args = _parse(argv)
    _init_world()
    with torch.device("meta"):
        if path == "config":
            model_cfg = _model_config(args)
            model = model_cfg.get_builder_cls()(model_cfg).build_model(_pg_collection(),
                                                                      True, True)
        else:
            import pretrain_gpt

            from megatron_lrmoe.integration.megatron_lm import lrmoe_builder

            model = functools.partial(pretrain_gpt.model_provider,
                                      lrmoe_builder(pretrain_gpt.gpt_builder))(True, True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # Linux: KiB
    return {**_describe(model), "peak_rss_mib": peak_mib}


def checkpoint(workdir: str, argv: list[str]) -> dict:
    """Save and load through Megatron-LM's checkpointing (torch_dist, default strictness):
    an LRMoE model's step state comes back into a new LRMoE model; a plain model loads an
    LRMoE checkpoint, and an LRMoE model a plain one, without an error (planner fresh)."""
    import torch
    from megatron.training import checkpointing

    from megatron_lrmoe.integration.step_hooks import finish_lrmoe_step, lrmoe_layers

    lrmoe_ckpt, plain_ckpt = os.path.join(workdir, "lrmoe"), os.path.join(workdir, "plain")
    args = _parse([*argv, "--ckpt-format", "torch_dist", "--no-save-optim", "--no-load-optim",
                   "--no-load-rng"])
    _init_world()

    def build(lrmoe: bool):
        args.moe_lrmoe = lrmoe
        model_cfg = _model_config(args)
        return model_cfg.get_builder_cls()(model_cfg).build_model(_pg_collection(), True, True)

    def step(model) -> None:   # a forward-backward, then the step boundary the plugin runs
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
        position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
        model(tokens, position_ids, None, labels=tokens).float().mean().backward()
        finish_lrmoe_step([model])

    def save(model, directory: str, iteration: int) -> None:
        args.save = directory
        checkpointing.save_checkpoint(iteration, [model], None, None, 0)

    def load(model, directory: str) -> int:
        args.load = directory
        return checkpointing.load_checkpoint([model], None, None)[0]

    def weights(model) -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()
                if isinstance(v, torch.Tensor)}

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    trained = build(True)
    for _ in range(3):
        step(trained)
    save(trained, lrmoe_ckpt, 3)
    resumed = build(True)
    iteration = load(resumed, lrmoe_ckpt)
    saved_states = [layer.placement_planner.state_dict() for layer in lrmoe_layers([trained])]
    got_states = [layer.placement_planner.state_dict() for layer in lrmoe_layers([resumed])]
    plain = build(False)
    plain_iteration = load(plain, lrmoe_ckpt)
    save(plain, plain_ckpt, 3)
    from_plain = build(True)
    load(from_plain, plain_ckpt)
    return {
        "strictness": args.dist_ckpt_strictness,
        "iterations": [iteration, plain_iteration],
        "origins": [layer.planner_state_origin for layer in lrmoe_layers([resumed])],
        "planner_steps": [s["step"] for s in got_states],
        "states_equal": all(
            a["step"] == b["step"] and a["replicas"] == b["replicas"]
            and torch.equal(a["smoothed_counts"], b["smoothed_counts"])
            for a, b in zip(saved_states, got_states, strict=True)),
        "draw_steps": [layer.lrmoe_state.step for layer in lrmoe_layers([resumed])],
        "weights_equal": [same(weights(trained), weights(resumed)),
                          same({k: v for k, v in weights(trained).items()
                                if not k.endswith("_extra_state")}, weights(plain)),
                          same(weights(plain), {k: v for k, v in weights(from_plain).items()})],
        "from_plain_origins": [layer.planner_state_origin
                               for layer in lrmoe_layers([from_plain])],
    }


def rerun(argv: list[str]) -> dict:
    """Megatron-LM's own setup_model_and_optimizer (from the config container, as
    pretrain() calls it), train_step and training_log (core_v0.19.0) on an LRMoE model,
    with the re-run state machine in validate_results mode and its error injector (rate 1,
    transient, the loss check not fatal): every step after the first runs twice. Returns
    the losses, forward-backward passes and planner states, to compare with a run
    without re-runs."""
    import torch
    from megatron.core import rerun_state_machine as rsm
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_lrmoe.integration.step_hooks import lrmoe_layers

    injected = "--error-injection-rate" in argv
    args = _parse([*argv, "--log-interval", "1000", "--eval-interval", "1000"])
    _init_world()
    # initialize_megatron's machine, with Megatron-LM's own state functions.
    from megatron.core import tensor_parallel

    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(
        state_save_func=lambda: {"rng_tracker_states":
                                 tensor_parallel.get_cuda_rng_tracker().get_states()},
        state_restore_func=lambda s: tensor_parallel.get_cuda_rng_tracker().set_states(
            s["rng_tracker_states"]),
        mode=rsm.RerunMode(args.rerun_mode),
        error_injector=rsm.RerunErrorInjector(
            error_injection_rate=args.error_injection_rate,
            error_injection_type=rsm.RerunDiagnostic(args.error_injection_type)))
    model, optimizer, scheduler = training.setup_model_and_optimizer(
        ModelType.encoder_or_decoder,
        cfg_container=pretrain_cfg_container_from_args(args, _model_config(args)),
        pg_collection=_pg_collection())
    config = get_model_config(model[0])
    machine = rsm.get_rerun_state_machine()
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length),
                             generator=generator) for _ in range(64)]
    data = rsm.RerunDataIterator(iter(batches))
    passes = []

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        passes.append(1)
        position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
        output = chunk(tokens, position_ids, None, labels=tokens)

        def loss_func(output_tensor):
            loss = output_tensor.float().sum()
            machine.validate_result(result=loss, rejection_func=torch.isnan,
                                    message="loss is NaN", tolerance=0.0, fatal=False)
            tokens_count = torch.tensor(output_tensor.numel(), dtype=torch.int)
            return loss, tokens_count, {"lm loss": torch.stack(
                [loss.detach(), tokens_count.float()])}

        return output, loss_func

    losses = []
    for iteration in range(4):
        loss_dict, skipped, _, exit_now, _, grad_norm, _, _ = training.train_step(
            forward_step, data, model, optimizer, scheduler, config,
            get_forward_backward_func(), iteration=iteration)
        assert not exit_now
        losses.append(float(loss_dict["lm loss"]))
        training.training_log(loss_dict, {}, 1e-4, iteration + 1, 1.0, False, skipped,
                              grad_norm, None, None, 0)
    layers = lrmoe_layers(model)
    return {"injected": injected, "losses": losses, "passes": len(passes),
            "planner_steps": [layer.placement_planner.step for layer in layers],
            "draw_steps": [layer.lrmoe_state.step for layer in layers],
            "smoothed": [layer.placement_planner.smoothed_counts.tolist() for layer in layers],
            "region_calls": [len(layer.lrmoe_stats.calls) for layer in layers]}


def train(patched_dir: str, argv: list[str]) -> dict:
    """pretrain_gpt.py's own __main__ (patched), with a CPU stand-in for pretrain()."""
    import runpy

    import megatron.training as training
    import torch

    result: dict = {}

    def cpu_pretrain(full_config, datasets, model_type, forward_step, **_kw):
        from megatron.training import get_args

        args = get_args()    # parsed and validated by pretrain_gpt.py's __main__
        _init_world()
        model_cfg = full_config.model
        result["model_config"] = type(model_cfg).__name__
        model = model_cfg.get_builder_cls()(model_cfg).build_model(_pg_collection(), True, True)
        result.update(_describe(model))
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
        position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        result["loss"] = float(loss)
        result["grads"] = sum(p.grad is not None for p in model.parameters())
        from megatron_lrmoe.layer.moe_layer import LRMoELayer

        stats = [m.lrmoe_stats.summary() for m in model.modules() if isinstance(m, LRMoELayer)]
        result["retained"] = [s["retained-fraction"] for s in stats]

    # pretrain_gpt.py imports pretrain from megatron.training when it runs.
    training.pretrain = cpu_pretrain
    sys.argv = ["pretrain_gpt.py", *argv]
    runpy.run_path(os.path.join(patched_dir, "pretrain_gpt.py"), run_name="__main__")
    return result


# -----------------------------------------------------------------------------
# Megatron-LM's own training loop on the CPU
# -----------------------------------------------------------------------------


def _cpu_megatron_lm() -> None:
    """Let Megatron-LM's ``pretrain()`` (core_v0.19.0) run on the CPU with gloo, one process
    per rank (torchrun), changing only what needs a GPU:

    * the CPU runtime (megatron_lrmoe.integration.runtime.cpu), as the lean launcher uses it;
    * ``initialize_megatron``'s assertion that CUDA is available (``allow_no_cuda``);
    * ``_initialize_distributed`` and ``_set_random_seed`` skip the model-parallel groups
      and the RNG tracker when ``torch.cuda.device_count()`` is 0, so they see one device
      (and ``set_device`` does nothing): Megatron-LM's own calls then build the groups
      and seed the tracker;
    * ``_compile_dependencies``: the dataset index helpers come prebuilt (below); the
      fused kernels are CUDA only;
    * ``set_jit_fusion_options``: it only warms up the CUDA fusions.
    """
    import contextlib

    import torch
    from megatron.training import initialize, training

    from megatron_lrmoe.integration.runtime.cpu import enable_cpu_runtime

    enable_cpu_runtime()
    real_initialize = training.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return real_initialize(*args, **kwargs)

    @contextlib.contextmanager
    def one_device():
        count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda device: None
        try:
            yield
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, set_device

    def seen_with_one_device(function):
        def wrapped(*args, **kwargs):
            with one_device():
                return function(*args, **kwargs)
        return wrapped

    training.initialize_megatron = initialize_megatron
    initialize._initialize_distributed = seen_with_one_device(initialize._initialize_distributed)
    initialize._set_random_seed = seen_with_one_device(initialize._set_random_seed)
    initialize._compile_dependencies = _cpu_compile_dependencies
    training.set_jit_fusion_options = lambda *args, **kwargs: None


def _cpu_compile_dependencies() -> None:
    """The dataset index helpers (megatron/core/datasets/helpers.cpp), which Megatron-LM
    compiles with make on rank 0: taken from the installed megatron-core when its
    helpers.cpp is the checkout's (the checkout is the test's own copy)."""
    import filecmp
    import glob
    import importlib.metadata
    import shutil

    import megatron.core.datasets as datasets
    import torch.distributed as dist

    here = os.path.dirname(datasets.__file__)
    if dist.get_rank() == 0 and not glob.glob(os.path.join(here, "helpers_cpp*.so")):
        installed = str(importlib.metadata.distribution("megatron-core")
                        .locate_file("megatron/core/datasets"))
        built = glob.glob(os.path.join(installed, "helpers_cpp*.so"))
        if not built or not filecmp.cmp(os.path.join(installed, "helpers.cpp"),
                                        os.path.join(here, "helpers.cpp"), shallow=False):
            raise RuntimeError(f"no prebuilt dataset helpers matching {here}/helpers.cpp")
        shutil.copy(built[0], here)
    dist.barrier()


def _jsonable(value):
    """Tensors as (dtype, shape, float.hex of each element); containers recursively."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "shape": list(value.shape),
                "values": [float(x).hex() for x in value.detach().double().reshape(-1).tolist()]}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value.hex()
    if value is None or isinstance(value, bool | int | str):
        return value
    return repr(value)


def _checkpoint_digest(path: str) -> dict:
    """What a torch_dist checkpoint holds: a SHA-256 of every tensor (model and optimizer),
    each LRMoE layer's step state, and Megatron-LM's common state that a resume reads
    (iteration, consumed samples, the learning-rate scheduler). Collective (all ranks)."""
    import hashlib

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    def sha(tensor: torch.Tensor) -> str:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return f"{tensor.dtype}{list(tensor.shape)}:{hashlib.sha256(raw).hexdigest()}"

    tensors = dist_checkpointing.load_plain_tensors(path)
    request = {f"{v.key}@{v.global_offset}": ShardedObject(v.key, None, v.global_shape,
                                                          v.global_offset, replica_id=0)
               for v in load_sharded_metadata(path).values()
               if isinstance(v, ShardedObject) and v.key.endswith("mlp._extra_state")}
    lrmoe = dist_checkpointing.load(request, path, validate_access_integrity=False)
    common = dist_checkpointing.load_common_state_dict(path)
    return {"tensors": {k: sha(v) for k, v in sorted(tensors.items()) if torch.is_tensor(v)},
            "lrmoe": {k: _jsonable(lrmoe[k]) for k in sorted(request)},
            "iteration": common["iteration"],
            "consumed_train_samples": common["args"].consumed_train_samples,
            "opt_param_scheduler": _jsonable(common.get("opt_param_scheduler"))}


def pretrain(script: str, argv: list[str]) -> dict:
    """SCRIPT's __main__ with Megatron-LM's own pretrain() on the CPU: a patched
    pretrain_gpt.py, or the wrapper scripts/pretrain_gpt_lrmoe.py (which finds the
    checkout through $MEGATRON_LM).

    Records, after each iteration's training_log (where the plugin ends the LRMoE step):
    the iteration's loss as train_step reduced it, bitwise, and every LRMoE layer's step
    state (its checkpoint extra state). A SystemExit from the loop (--exit-interval, a
    fatal re-run) is recorded, not raised; then the last checkpoint under --save is
    digested (_checkpoint_digest)."""
    import functools
    import inspect
    import runpy

    import torch.distributed as dist
    from megatron.training import get_args, training

    from megatron_lrmoe.integration.megatron_lm import built_models
    from megatron_lrmoe.integration.step_hooks import lrmoe_layers

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")      # a world of one without torchrun
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    _cpu_megatron_lm()
    iterations: list[dict] = []
    real_log = training.training_log
    signature = inspect.signature(real_log)

    @functools.wraps(real_log)
    def training_log(*args, **kwargs):
        # Installed before the model is built, so the plugin's wrapper (which ends the
        # LRMoE step first) calls this one: the states recorded are the step's outcome.
        bound = signature.bind(*args, **kwargs).arguments
        loss = bound["loss_dict"].get("lm loss")
        iterations.append({
            "iteration": int(bound["iteration"]), "skipped": int(bound["skipped_iter"]),
            "loss": None if loss is None else float(loss),
            "lrmoe": [_jsonable(layer.get_extra_state())
                      for layer in lrmoe_layers(built_models())]})
        return real_log(*args, **kwargs)

    training.training_log = training_log
    exit_code = None
    sys.argv = [script, *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else repr(exc.code)
    args = get_args()
    from megatron.training.checkpointing import get_checkpoint_name, read_metadata

    tracker = os.path.join(args.save or "", "latest_checkpointed_iteration.txt")
    saved = read_metadata(tracker)[0] if args.save and os.path.isfile(tracker) else None
    digest = (_checkpoint_digest(get_checkpoint_name(args.save, saved, return_base_dir=True))
              if saved is not None else None)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "exit_code": exit_code,
            "iterations": iterations, "saved_iteration": saved, "checkpoint": digest}


def main() -> None:
    from megatron_lrmoe.integration.megatron_lm import find_megatron_lm

    command, rest = sys.argv[1], sys.argv[2:]
    split = rest.index("--")
    positional, argv = rest[:split], rest[split + 1:]
    if command == "train":
        find_megatron_lm(positional[0])
        out = train(positional[0], argv)
    elif command == "pretrain":
        script = positional[0]
        # A patched pretrain_gpt.py names its checkout; the wrapper reads $MEGATRON_LM.
        find_megatron_lm(os.path.dirname(script) if os.path.basename(script) == "pretrain_gpt.py"
                         else None)
        out = pretrain(script, argv)
        if out["rank"] != 0:    # one report per run (torchrun passes every rank's output)
            return
    elif command == "checkpoint":
        find_megatron_lm()
        out = checkpoint(positional[0], argv)
    elif command == "rerun":
        find_megatron_lm()
        out = rerun(argv)
    elif command == "build":
        find_megatron_lm()
        out = build(positional[0], argv)
    else:
        find_megatron_lm()
        out = {"parse": parse, "flags": flags}[command](argv)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
