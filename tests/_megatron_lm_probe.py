"""Run by tests/test_megatron_lm_integration.py in a fresh interpreter against a
Megatron-LM checkout ($MEGATRON_LM, core_v0.16.1); prints one JSON line per check.

    python tests/_megatron_lm_probe.py parse  -- <pretrain_gpt.py flags>
    python tests/_megatron_lm_probe.py build  -- <flags>   # model on the meta device
        # (adds --use-cpu-initialization: without it Megatron's layers allocate on
        # torch.cuda.current_device(), which the CPU runtime answers with the CPU, so
        # most weights would land in CPU memory despite torch.device("meta"))
    python tests/_megatron_lm_probe.py train  PATCHED_DIR -- <flags>
        # runs PATCHED_DIR/pretrain_gpt.py's __main__ with Megatron's pretrain() replaced by
        # a CPU stand-in (parse, build with the CPU runtime, one forward/backward step)

Megatron-LM's initialize_megatron needs CUDA, so the stand-in does what it does on CPU:
parse_args + validate_args + set_args, then a gloo world of one and parallel_state.
"""

from __future__ import annotations

import json
import os
import sys


def _parse(argv: list[str], provider=None):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    from megatron_lrmoe.megatron_lm import lrmoe_args_provider

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args(provider or lrmoe_args_provider(None))
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    set_args(args)
    return args


def _init_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_lrmoe.runtime.cpu import enable_cpu_runtime

    enable_cpu_runtime()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def _describe(model) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe = [type(m).__name__ for m in model.modules() if isinstance(m, MoELayer)]
    experts = sorted({type(m.experts).__name__ for m in model.modules() if isinstance(m, MoELayer)})
    return {"moe_layers": moe, "experts": experts,
            "params": sum(p.numel() for p in model.parameters()),
            "devices": sorted({p.device.type for p in model.parameters()})}


def parse(argv: list[str]) -> dict:
    from megatron_lrmoe.megatron_lm import lrmoe_config_from_args

    args = _parse(argv)
    out = {"moe_lrmoe": args.moe_lrmoe}
    if args.moe_lrmoe:
        config = lrmoe_config_from_args(args)
        out["config_class"] = type(config).__name__
        out["fields"] = {k: getattr(config, k) for k in (
            "moe_lrmoe", "moe_lrmoe_bwd_capacity_factor", "moe_lrmoe_min_retention",
            "moe_lrmoe_metric", "moe_lrmoe_selection", "moe_lrmoe_placement",
            "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "num_layers",
            "hidden_size", "num_query_groups", "kv_channels", "qk_layernorm",
            "moe_token_dispatcher_type", "expert_tensor_parallel_size")}
    return out


def build(argv: list[str]) -> dict:
    import functools

    import pretrain_gpt
    import torch

    from megatron_lrmoe.megatron_lm import lrmoe_builder

    if "--use-cpu-initialization" not in argv:
        # Megatron's layers then create weights without a device argument, so the
        # meta default device below applies to all of them (checked by _describe's devices).
        argv = [*argv, "--use-cpu-initialization"]
    args = _parse(argv)
    args.padded_vocab_size = args.vocab_size
    _init_world()
    provider = functools.partial(pretrain_gpt.model_provider,
                                 lrmoe_builder(pretrain_gpt.gpt_builder))
    with torch.device("meta"):
        model = provider(True, True)
    import resource

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # Linux: KiB
    return {**_describe(model), "peak_rss_mib": peak_mib}


def train(patched_dir: str, argv: list[str]) -> dict:
    """pretrain_gpt.py's own __main__ (patched), with a CPU stand-in for pretrain()."""
    import runpy

    import megatron.training as training
    import torch

    result: dict = {}

    def cpu_pretrain(datasets, model_provider, model_type, forward_step,
                     extra_args_provider=None, args_defaults=None, **_kw):
        args = _parse(argv, provider=extra_args_provider)
        args.padded_vocab_size = args.vocab_size
        _init_world()
        model = model_provider(True, True)
        result.update(_describe(model))
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length))
        position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
        loss = model(tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        result["loss"] = float(loss)
        result["grads"] = sum(p.grad is not None for p in model.parameters())
        from megatron_lrmoe.lrmoe.moe_layer import LRMoELayer

        stats = [m.lrmoe_stats.summary() for m in model.modules() if isinstance(m, LRMoELayer)]
        result["retained"] = [s["retained-fraction"] for s in stats]

    training.pretrain = cpu_pretrain
    sys.argv = ["pretrain_gpt.py", *argv]
    runpy.run_path(os.path.join(patched_dir, "pretrain_gpt.py"), run_name="__main__")
    return result


def main() -> None:
    from megatron_lrmoe.megatron_lm import find_megatron_lm

    command, rest = sys.argv[1], sys.argv[2:]
    split = rest.index("--")
    positional, argv = rest[:split], rest[split + 1:]
    if command == "train":
        find_megatron_lm(positional[0])
        out = train(positional[0], argv)
    else:
        find_megatron_lm()
        out = {"parse": parse, "build": build}[command](argv)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
