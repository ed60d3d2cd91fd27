"""Where a training run's MoE time goes, forward and backward: expert GEMMs, waiting,
the rest.

    .venv/bin/python benchmarks/profile_moe_layer.py --hidden-size 384 \
        --moe-ffn-hidden-size 1024 --microbatches 4 --steps 24 --skip 8 \
        --policies megatron-dropless,megatron-capacity-1.0 \
        --calibration benchmarks/results/calibration_cpu_h384_f1024_rounds.json \
        --out benchmarks/results/moe_layer_profile.md

Each policy trains the time-to-loss study's model (``benchmarks/studies/time_to_loss.py``: the
same config, shape flags, policies and budget) for ``--steps`` steps, EP = 2 on 2 ranks
with one thread each, with wall-clock timers, per phase, on

- the MoE layer: forward, the span the launcher's ``moe-forward-s`` times; backward,
  from the gradient of the layer's output being ready to the gradient of its input
  being complete (identity autograd nodes on both, as the launcher's ``moe-backward-s``);
- the expert computation inside it: Megatron's experts module (forward: its call;
  backward: identity nodes on its output and input), LRMoE's ``experts_forward`` and
  ``experts_backward`` (the two expert GEMMs, the activation and, in backward, the
  weight-gradient accumulation), with the rows of every instance;
- every ``torch.distributed`` collective called inside it, split into the first of
  each call and the others.

A collective's time includes waiting for the peer. The first one of a call waits for
the other rank to *arrive* at the layer: the peer's non-MoE work or previous backward
took longer, which says nothing of the layer but lands in its span (and, since the
launcher takes the slowest rank per step, in its figures). The later ones wait for the
peer's expert work (routing imbalance) or move data. "Rest" is the span less all of
these: router, planner, permutations, combine, Python.

Per policy, phase and rank the table gives ms per step (sums over the step's calls),
averaged over the steps after ``--skip``, and the expert GEMM rate achieved in training
(FLOP/s from the SwiGLU FLOPs per row, 6 H F forward, 12 H F backward). With
``--calibration``, also what the calibration's GEMM rate tables give for the same rows:
instance by instance (the rows each instance had) and spread evenly over the rank's
instances (what the cost model assumes); measured over either is the number to set
against the simulator's GEMM term.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lrmoe_studies.moe_layer_profile import new_call, summarise
from lrmoe_studies.time_to_loss_policies import (
    STUDY_CONFIG,
    config_value,
    policies,
    study_budget_gb,
)

ROOT = Path(__file__).resolve().parents[1]

# -----------------------------------------------------------------------------
# Inside each rank: timers, then the launcher
# -----------------------------------------------------------------------------

_COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather",
                "all_reduce", "reduce_scatter_tensor", "broadcast")


def _rank_entry(out_path: str, launcher_flags: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.moe import experts as megatron_experts
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_lrmoe.launcher.pretrain as pretrain
    import megatron_lrmoe.layer.region as region
    from megatron_lrmoe.layer.moe_layer import LRMoELayer

    calls: list[dict] = []
    # The open training call of each phase (at most one: on CPU one layer runs at a time,
    # forward or backward) and when its span or its experts' backward began.
    open_call: dict[str, dict | None] = {"fwd": None, "bwd": None}
    started: dict[str, float] = {}

    class _Mark(torch.autograd.Function):
        """Identity whose backward calls ``on_backward`` (the gradient got here)."""

        @staticmethod
        def forward(ctx, x, on_backward):
            ctx.on_backward = on_backward
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            ctx.on_backward()
            return grad, None

    def marked_output(output, on_backward):
        # Megatron's modules return (output, bias); the LRMoE layer the same.
        if isinstance(output, tuple):
            return (_Mark.apply(output[0], on_backward), *output[1:])
        return _Mark.apply(output, on_backward)

    def marked_input(args, kwargs, name, on_backward):
        if args:
            return (_Mark.apply(args[0], on_backward), *args[1:]), kwargs
        return args, dict(kwargs, **{name: _Mark.apply(kwargs[name], on_backward)})

    def layer_forward(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if open_call["fwd"] is not None or not (self.training and torch.is_grad_enabled()):
                return fn(self, *args, **kwargs)
            call = new_call(self.layer_number)

            def backward_enters():
                open_call["bwd"] = call
                started["bwd"] = time.perf_counter()

            def backward_leaves():
                call["bwd_total_s"] = time.perf_counter() - started.pop("bwd")
                open_call["bwd"] = None

            args, kwargs = marked_input(args, kwargs, "hidden_states", backward_leaves)
            open_call["fwd"] = call
            start = time.perf_counter()
            try:
                output = fn(self, *args, **kwargs)
            finally:
                call["fwd_total_s"] = time.perf_counter() - start
                open_call["fwd"] = None
                calls.append(call)
            return marked_output(output, backward_enters)
        return wrapper

    def megatron_experts_forward(fn):
        # forward(self, permuted_local_hidden_states, tokens_per_expert, ...): the
        # forward timed around the call, the backward between marks on output and input.
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            call = open_call["fwd"]
            if call is None:
                return fn(self, *args, **kwargs)
            rows = [int(n) for n in args[1].tolist()]

            def backward_enters():
                started["bwd_experts"] = time.perf_counter()

            def backward_leaves():
                call["bwd_experts_s"] += time.perf_counter() - started.pop("bwd_experts")
                call["bwd_instance_rows"].append(rows)

            args, kwargs = marked_input(args, kwargs, "permuted_local_hidden_states",
                                        backward_leaves)
            start = time.perf_counter()
            output = fn(self, *args, **kwargs)
            call["fwd_experts_s"] += time.perf_counter() - start
            call["fwd_instance_rows"].append(rows)
            return marked_output(output, backward_enters)
        return wrapper

    def region_experts(fn, phase):
        # experts_forward / experts_backward(x, [z, g,] ..., rows, ...): rows per instance.
        rows_at = 1 if phase == "fwd" else 3

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            call = open_call[phase]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if call is not None:
                    call[f"{phase}_experts_s"] += time.perf_counter() - start
                    call[f"{phase}_instance_rows"].append([int(n) for n in args[rows_at]])
        return wrapper

    def collective(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phase = "fwd" if open_call["fwd"] is not None else "bwd"
                call = open_call[phase]
                if call is not None:
                    seconds = time.perf_counter() - start
                    if call[f"{phase}_first_collective_s"] is None:
                        call[f"{phase}_first_collective_s"] = seconds
                    else:
                        call[f"{phase}_other_collectives_s"] += seconds
        return wrapper

    MoELayer.forward = layer_forward(MoELayer.forward)
    if "forward" in LRMoELayer.__dict__:
        LRMoELayer.forward = layer_forward(LRMoELayer.forward)
    for name in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP"):
        cls = getattr(megatron_experts, name, None)
        if cls is not None and "forward" in cls.__dict__:
            cls.forward = megatron_experts_forward(cls.forward)
    region.experts_forward = region_experts(region.experts_forward, "fwd")
    region.experts_backward = region_experts(region.experts_backward, "bwd")
    for name in _COLLECTIVES:
        setattr(dist, name, collective(getattr(dist, name)))
    try:
        pretrain.main(launcher_flags)
    finally:
        rank = int(os.environ.get("RANK", "0"))
        Path(f"{out_path}.rank{rank}.json").write_text(json.dumps(calls))


# -----------------------------------------------------------------------------
# The driver: one torchrun per policy, then the tables
# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--rank-entry":
        _rank_entry(argv[1], argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--policies", default="megatron-dropless,lrmoe-uniform-g0.75")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip", type=int, default=8, help="steps left out of the averages")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--budget-replicas", type=float, default=2.0)
    p.add_argument("--data-path", default="data/stdlib")
    p.add_argument("--data-cache-path", default="data/cache")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/profile_moe_layer"))
    p.add_argument("--calibration", type=Path, default=None,
                   help="a calibrate JSON: add the expert time its GEMM rate tables give "
                        "for the measured rows")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    p.add_argument("--port", type=int, default=29561)
    args = p.parse_args(argv)
    if not 0 <= args.skip < args.steps:
        raise SystemExit(f"--skip {args.skip} must be in [0, --steps {args.steps})")
    warmup = int(config_value("lr-warmup-iters"))
    if args.steps <= warmup:
        raise SystemExit(f"--steps {args.steps} must exceed the config's --lr-warmup-iters "
                         f"({warmup})")

    micro_batch = int(config_value("micro-batch-size"))
    base = ["--config", STUDY_CONFIG,
            "--hidden-size", str(args.hidden_size),
            "--moe-ffn-hidden-size", str(args.moe_ffn_hidden_size),
            "--global-batch-size", str(micro_batch * 2 * args.microbatches),
            "--data-path", args.data_path, "--data-cache-path", args.data_cache_path,
            "--train-iters", str(args.steps), "--eval-interval", str(10 * args.steps),
            "--eval-iters", "1", "--log-interval", str(args.steps), "--no-progress-bar",
            "--seed", str(args.seed)]
    table = policies(study_budget_gb(base, args.budget_replicas))
    chosen = [name for name in args.policies.split(",") if name]
    if bad := [name for name in chosen if name not in table]:
        raise SystemExit(f"unknown policies {bad}; "
                         "benchmarks/studies/time_to_loss.py --list shows them")
    flops_per_row = {"fwd": 6.0 * args.hidden_size * args.moe_ffn_hidden_size,
                     "bwd": 12.0 * args.hidden_size * args.moe_ffn_hidden_size}
    machine = None
    if args.calibration is not None:
        from megatron_lrmoe.planning.machine import MachineConstants
        machine = MachineConstants.from_json(args.calibration)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    results = []
    for name in chosen:
        prefix = args.work_dir / name
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(args.port), str(Path(__file__).resolve()),
                   "--rank-entry", str(prefix), *base, *table[name],
                   "--log-json", f"{prefix}.jsonl"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(f"{prefix}.stdout", "w") as log:
            code = subprocess.call(command, cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        if code != 0:
            raise SystemExit(f"{name} failed ({code}); see {prefix}.stdout")
        per_rank = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in (0, 1)]
        logged = [json.loads(line) for line in Path(f"{prefix}.jsonl").read_text().splitlines()
                  if line.strip()]
        for phase, key in (("fwd", "moe-forward-s"), ("bwd", "moe-backward-s")):
            launcher = [r[key] for r in logged if key in r and r["iteration"] > args.skip]
            parts = summarise(per_rank, args.steps, args.skip, flops_per_row[phase], phase,
                              machine)
            results.append((name, phase,
                            1e3 * statistics.mean(launcher) if launcher else float("nan"),
                            parts))
        print(f"[profile] {name}: done", flush=True)

    from megatron_lrmoe.tools.provenance import code_version

    lines = [
        "# The MoE layer in training: expert GEMMs, waiting, the rest (CPU, EP = 2)", "",
        "- command: `" + " ".join([".venv/bin/python", "benchmarks/profile_moe_layer.py",
                                   *argv]) + "`",
        f"- code: {code_version()}",
        f"- model: the time-to-loss study's, hidden {args.hidden_size}, expert FFN "
        f"{args.moe_ffn_hidden_size}, {args.microbatches} micro-batches per step, seed "
        f"{args.seed}; {args.steps} steps, the first {args.skip} left out; 2 ranks x 1 "
        "thread (gloo)",
        "- ms per step, mean over the steps kept, per rank; launcher: `moe-forward-s` / "
        "`moe-backward-s` (slowest rank per step), mean over the same steps; arrival wait: "
        "the first collective of each call and phase (the peer arriving late); without "
        "wait: the slowest rank's span less its arrival wait; expert rate: rows x 6 H F "
        "(forward) or 12 H F (backward) / expert seconds",
    ]
    if machine is not None:
        lines.append(f"- calibration: `{args.calibration}`; table, each: its GEMM rate "
                     "tables at every instance's rows, summed; table, even: at the rows "
                     "spread evenly over the instances (the cost model's assumption)")
    extra = " | table, each | table, even" if machine is not None else ""
    lines += ["",
              "| policy | phase | launcher | rank | span | experts | arrival wait | other "
              "collectives | rest | span without wait | rows / step | expert GFLOP/s | "
              "median call ms" + extra + " |",
              "|" + "---|" * (13 + (2 if machine is not None else 0))]
    for name, phase, launcher_ms, parts in results:
        without = max(p["total"] - p["arrival_wait"] for p in parts)
        for p in parts:
            cells = [name, phase, f"{launcher_ms:.1f}", str(p["rank"]), f"{p['total']:.1f}",
                     f"{p['experts']:.1f}", f"{p['arrival_wait']:.1f}",
                     f"{p['other_collectives']:.1f}", f"{p['rest']:.1f}", f"{without:.1f}",
                     f"{p['rows_per_step']:.0f}", f"{p['expert_gflops']:.1f}",
                     f"{p['median_call_ms']:.1f}"]
            if machine is not None:
                cells += [f"{p['table_each']:.1f}", f"{p['table_even']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
