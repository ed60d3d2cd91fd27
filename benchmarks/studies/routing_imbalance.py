"""Routing imbalance at expert parallelism 8-64, from recorded routing traces.

    .venv/bin/python benchmarks/studies/routing_imbalance.py record --model qwen3  # ~12 min
    .venv/bin/python benchmarks/studies/routing_imbalance.py record --model glm45     # ~12 min
    .venv/bin/python benchmarks/studies/routing_imbalance.py table                    # seconds

``record`` trains a small model whose router is the one of ``configs/<model>.yaml``
(every model, MoE and router flag of the config; Megatron's own MoE layer, dropless:
the config's ``moe-lrmoe*`` keys are left out) with the shape cut to what two CPU
cores train in minutes (``TRACE_SHAPE``), EP=2 on 2 ranks x 1 thread, and the
launcher's ``--record-routing``. Output: ``benchmarks/results/routing_traces/<model>/``
(``trace/`` as written by the launcher, ``log.jsonl.xz``, ``stdout.txt.xz``,
``command.txt``; the log and stdout compressed and the trace repacked once the recording
is done).

``table`` reads every trace there and writes ``benchmarks/results/routing_imbalance.md``
(and ``routing_imbalance.png``): per MoE layer, the routed load max/mean over the EP
ranks at EP 8/16/32/64, with the experts placed contiguously as Megatron does (expert e
on rank e // (E / R)). A trace recorded at EP=2 has 2 sources x M micro-batches of
rows per step; the R sources of one call at EP=R are R consecutive rows in time order
(step, micro-batch, source): ``megatron_lrmoe.data.routing_traces.regroup_sources``. Each
source keeps the tokens of one recorded micro-batch (``tokens_per_source`` in the
header), so a call at EP=R routes R x that many tokens, as R ranks would.

Next to each figure: the same statistic for a uniform router with the same token
counts (per-expert counts Binomial(tokens, k/E), independent across experts: the exact
marginal of a uniform top-k choice), which is the part of max/mean that sampling
alone produces.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from megatron_lrmoe.data.routing_traces import (
    RoutingTrace,
    load_max_over_mean,
    read_routing_trace,
    regroup_sources,
    repack,
    uniform_load_max_over_mean,
)
from megatron_lrmoe.tools import run_log
from megatron_lrmoe.tools.figures import pyplot, save_png
from megatron_lrmoe.tools.provenance import code_version

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = {"qwen3": "configs/qwen3_30b_a3b.yaml", "glm45": "configs/glm45_air.yaml"}
TITLES = {"qwen3": "Qwen3-30B-A3B router (128 experts, top-8, softmax, aux loss 1e-3)",
          "glm45": "GLM-4.5-Air router (128 + 1 shared, top-8, sigmoid + expert bias, "
                   "seq aux loss 1e-4)"}
EP_SIZES = (8, 16, 32, 64)
# Columns: the recorded EP=2, the EP sizes, and one expert per rank (EP = E = 128:
# per-expert max/mean, the figure published measurements quote).
COLUMNS = (2, *EP_SIZES, 128)
TRACES = ROOT / "benchmarks" / "results" / "routing_traces"

# The recorded models' shape: the configs' routers, with everything else cut to what two
# CPU cores train for a few hundred steps (about 1.7 s per step here). Attention keeps
# grouped queries (4 heads, 2 groups) and the configs' RoPE; 4 layers, GLM's first dense
# (as in GLM-4.5-Air). Expert FFN 64 = hidden / 2 (the real models: 0.34-0.38 x hidden).
TRACE_SHAPE = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--kv-channels", "32", "--ffn-hidden-size", "512",
    "--moe-ffn-hidden-size", "64", "--seq-length", "256", "--max-position-embeddings", "256",
    "--make-vocab-size-divisible-by", "128",
    # 2 micro-batches of 8 x 256 tokens per rank and step: 2048 tokens per source row.
    "--micro-batch-size", "8", "--global-batch-size", "32",
    # A small model learns in a few hundred steps only at a higher rate than the configs'.
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "20",
    "--expert-model-parallel-size", "2", "--split", "98,2,0",
    "--eval-interval", "100", "--eval-iters", "4", "--log-interval", "25",
    "--no-progress-bar",
]
MODEL_SHAPE = {"glm45": ["--moe-shared-expert-intermediate-size", "64",
                         "--moe-layer-freq", "([0]*1+[1]*3)"]}


# -----------------------------------------------------------------------------
# Recording
# -----------------------------------------------------------------------------


def record_command(model: str, out: Path, train_iters: int, port: int) -> list[str]:
    from megatron_lrmoe.integration.megatron_lm import config_to_flags

    flags = config_to_flags(str(ROOT / CONFIGS[model]), lrmoe=False)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(port), "-m", "megatron_lrmoe.launcher.pretrain", *flags,
            *TRACE_SHAPE, *MODEL_SHAPE.get(model, []), "--train-iters", str(train_iters),
            "--data-path", "data/stdlib", "--data-cache-path", "data/cache",
            "--log-json", str(out / "log.jsonl"), "--record-routing", str(out / "trace")]


def record(model: str, train_iters: int, port: int, force: bool) -> Path:
    out = TRACES / model
    if (out / "trace").exists():
        if not force:
            raise SystemExit(f"{out / 'trace'} exists; --force replaces it")
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (ROOT / "data" / "stdlib.bin").exists():
        subprocess.check_call([sys.executable, "-m", "megatron_lrmoe.data.prepare",
                               "--output-prefix", "data/stdlib"], cwd=ROOT)
    command = record_command(model, out, train_iters, port)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    with open(out / "stdout.txt", "w") as stdout:
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=stdout,
                               stderr=subprocess.STDOUT)
    if code:
        tail = (out / "stdout.txt").read_text().splitlines()[-15:]
        raise SystemExit(f"recording failed ({code}):\n" + "\n".join(tail))
    display = [Path(command[0]).name, *command[1:]]
    (out / "command.txt").write_text(
        shlex.join(display) + f"\n# {time.perf_counter() - start:.0f} s, {code_version()}\n")
    run_log.compress(out / "log.jsonl")
    run_log.compress(out / "stdout.txt")
    repack(out / "trace")
    return out


# -----------------------------------------------------------------------------
# Analysis (pure: a trace in, numbers out)
# -----------------------------------------------------------------------------


def call_steps(trace: RoutingTrace, ranks: int) -> np.ndarray:
    """The iteration of the last row of each call ``regroup_sources`` forms at ``ranks``."""
    n, _, m, s, _ = trace.counts.shape
    row_steps = np.repeat(trace.iterations, m * s)
    usable = (row_steps.shape[0] // ranks) * ranks
    return row_steps[:usable].reshape(-1, ranks)[:, -1]


def imbalance(trace: RoutingTrace, ranks: int) -> dict[int, np.ndarray]:
    """Per MoE layer: load max/mean of every call at ``ranks`` EP ranks."""
    return {layer: load_max_over_mean(regroup_sources(trace.layer(layer), ranks), ranks)
            for layer in trace.layers}


def uniform_reference(trace: RoutingTrace, ranks: int, calls: int, seed: int = 0
                      ) -> np.ndarray:
    """max/mean of ``calls`` calls of a uniform top-k router with the trace's token counts."""
    model, parallel = trace.header["model"], trace.header["parallel"]
    experts, topk = model["num_experts"], model["topk"]
    return uniform_load_max_over_mean(ranks * parallel["tokens_per_source"], experts, topk,
                                      ranks, calls, seed)


def concentration(trace: RoutingTrace, first_step: int) -> dict[int, tuple[float, int]]:
    """Per layer, over all tokens of steps >= ``first_step``: the top expert's share of the
    routed pairs and how many experts take 90% of them (the figures a published Qwen3
    measurement quotes)."""
    late = trace.iterations >= first_step
    out = {}
    for layer in trace.layers:
        totals = np.sort(trace.layer(layer)[late].sum(axis=(0, 1, 2)))[::-1]
        share = np.cumsum(totals) / totals.sum()
        out[layer] = (float(totals[0] / totals.sum()), int(np.searchsorted(share, 0.9) + 1))
    return out


def summarize(trace: RoutingTrace) -> dict:
    """Per EP size: per-layer mean, p95 and max of max/mean over the calls of the second
    half of training, the same over all layers by training phase, and the uniform
    reference."""
    last = int(trace.iterations[-1])
    phases = [(1, max(1, last // 10)), (last // 10 + 1, last // 2), (last // 2 + 1, last)]
    out = {"last": last, "phases": phases, "ep": {},
           "concentration": concentration(trace, last // 2 + 1)}
    for ranks in COLUMNS:
        steps = call_steps(trace, ranks)
        per_layer = imbalance(trace, ranks)
        late = steps > last // 2
        row = {"calls_late": int(late.sum()), "layers": {}, "phase": []}
        for layer, ratios in per_layer.items():
            r = ratios[late]
            row["layers"][layer] = (float(r.mean()), float(np.percentile(r, 95)),
                                    float(r.max()))
        for lo, hi in phases:
            sel = (steps >= lo) & (steps <= hi)
            values = np.concatenate([ratios[sel] for ratios in per_layer.values()])
            row["phase"].append(float(values.mean()) if values.size else float("nan"))
        row["uniform"] = float(uniform_reference(trace, ranks, 2000).mean())
        row["series"] = {layer: (steps, ratios) for layer, ratios in per_layer.items()}
        out["ep"][ranks] = row
    return out


# -----------------------------------------------------------------------------
# Report
# -----------------------------------------------------------------------------

PUBLISHED = """\
## Published figures found, and how far the small models are from them

Searched (pages and docs indexes) for measured per-rank or per-expert load of real MoE
models. Found, and what each says:

- FEPLB (Qi, Liu, Zhao, arXiv 2604.19654), as summarised in a technical review
  (https://zzz0906.github.io/2026/04/29/2026-04-29-FEPLB-technical-review-en/): in GLM-5
  MoE layers with 128 routed experts at EP=8 and no auxiliary loss, the imbalance wastes
  18.6% of GPU time per MoE layer on average. If expert time is proportional to rows, a
  waste w = 1 - mean/max means max/mean = 1 / (1 - w) = 1.23 (our reading; the review
  gives no max/mean).
- A third-party routing measurement of Qwen3-30B-A3B in inference (llama.cpp expert
  counts; https://mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/): the top
  expert takes 4.3% of a layer's routing (diverse text, ~1k tokens) and 6.3% (single-domain
  Python, ~8k tokens), i.e. 5.5x and 8.1x a uniform share (0.78%); 65/128 and 58/128
  experts take 90% of it. The page does not say whether these are one layer's figures
  or a median over layers.
- Ma et al., DODOCO (arXiv 2605.20982, abstract at https://arxiv.org/html/2605.20982):
  on five trained checkpoints including Qwen3-30B (inference, real text, EP 4 to 32 on
  H100), EP changes the per-expert max/mean by at most 5%, and mock tokens overstate
  routing Gini by up to 2.35x. The abstract gives no absolute max/mean.
- Not found with numbers: the Qwen3, GLM-4.5, DeepSeek-V3 and Mixtral reports describe
  their balancing (Qwen3-MoE uses a global-batch aux loss, Qiu et al., ACL 2025;
  DeepSeek-V3 bias-based loss-free balancing) but the pages found give no per-rank
  max/mean during training.
"""


def comparison(summaries: dict[str, dict]) -> str:
    """How far the recorded small models are from the published figures, in numbers."""
    lines = ["How far the small models are (second half of training):", ""]
    for name, summary in summaries.items():
        ep8 = [v[0] for v in summary["ep"][8]["layers"].values()]
        top = [100 * v[0] for v in summary["concentration"].values()]
        cover = [v[1] for v in summary["concentration"].values()]
        lines.append(
            f"- {name}: EP 8 max/mean {min(ep8):.2f}-{max(ep8):.2f} by layer (mean "
            f"{np.mean(ep8):.2f}) against about 1.23 implied for GLM-5 at EP 8 without an "
            f"aux loss; top expert {min(top):.1f}-{max(top):.1f}% of a layer's pairs and "
            f"{min(cover)}-{max(cover)} of 128 experts for 90% (over all tokens of the "
            f"second half) against 4.3-6.3% and 58-65 for Qwen3-30B-A3B in inference.")
    ep8 = [v[0] for summary in summaries.values() for v in summary["ep"][8]["layers"].values()]
    expert = [v[0] for summary in summaries.values()
              for v in summary["ep"][128]["layers"].values()]
    lines += [
        "",
        f"Reading: at EP 8 the small models' layers span {min(ep8):.2f}-{max(ep8):.2f}, "
        f"{min(ep8) - 1.23:+.2f} to {max(ep8) - 1.23:+.2f} from the one training figure "
        "found (implied, another model). Over a whole half of training their experts are "
        "less concentrated than the real Qwen3's over a few thousand inference tokens "
        "(perhaps because aggregating many steps flattens a router whose favourites "
        f"move), while the per-call per-expert max/mean ({min(expert):.1f}-"
        f"{max(expert):.1f}) brackets the real model's 5.5-8.1x. Beyond EP 8 nothing "
        "published was found to "
        "compare with; the growth with EP is arithmetic (fewer experts per rank average "
        "less), which is why EP 32-64 is where one hot expert sets the pace. The "
        "comparisons are loose: different token counts, inference against training, a "
        "4-layer hidden-128 model trained 400 steps on Python source.",
        "",
    ]
    return "\n".join(lines)


def fmt_layer(stats: tuple[float, float, float]) -> str:
    return f"{stats[0]:.2f} ({stats[1]:.2f})"


def _column(ranks: int) -> str:
    return f"EP {ranks}" + (" (per expert)" if ranks == 128 else "")


def _number(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.2f}"


def markdown(summaries: dict[str, dict], traces: dict[str, RoutingTrace], command: str
             ) -> str:
    lines = [
        "# Routing imbalance at EP 8-64 from recorded traces",
        "",
        f"- command: `{command}`",
        f"- code: {code_version()}",
        f"- date: {datetime.date.today().isoformat()}",
        "",
        "Each figure is the routed load max/mean over the EP ranks of one MoE call "
        "(Megatron's contiguous expert layout), i.e. the hot rank's expert rows relative "
        "to a balanced share. Calls at EP=R are formed from R consecutive recorded "
        "source rows (module docstring of `benchmarks/studies/routing_imbalance.py`). EP 2 is the "
        "recorded run itself.",
        "",
    ]
    for name, summary in summaries.items():
        trace = traces[name]
        header = trace.header
        par = header["parallel"]
        lines += [
            f"## {TITLES.get(name, name)}",
            "",
            f"Trace: `benchmarks/results/routing_traces/{name}/trace` "
            f"({len(trace.iterations)} steps, MoE layers {trace.layers}, "
            f"{par['microbatches_per_step']} micro-batches x {par['world_size']} sources per "
            f"step, {par['tokens_per_source']} tokens per source row; recorded with "
            f"`{name}/command.txt`).",
            "",
            "Per layer, second half of training (steps "
            f"{summary['last'] // 2 + 1}-{summary['last']}): mean (95th percentile) over "
            "calls.",
            "",
            "| layer | " + " | ".join(_column(r) for r in COLUMNS)
            + " | top expert's share | experts for 90% |",
            "|---|" + "---|" * (len(COLUMNS) + 2),
        ]
        for layer in trace.layers:
            cells = [fmt_layer(summary["ep"][r]["layers"][layer]) for r in COLUMNS]
            top, cover = summary["concentration"][layer]
            lines.append(f"| {layer} | " + " | ".join(cells) + f" | {100 * top:.1f}% | "
                         f"{cover}/{trace.num_experts} |")
        lines.append("| calls per layer | " + " | ".join(
            str(summary["ep"][r]["calls_late"]) for r in COLUMNS) + " | | |")
        lines.append("| uniform router, same tokens | " + " | ".join(
            f"{summary['ep'][r]['uniform']:.2f}" for r in COLUMNS)
            + f" | {100 / trace.num_experts:.1f}% | "
            f"{math.ceil(0.9 * trace.num_experts)}/{trace.num_experts} |")
        lines += [
            "",
            "All layers, mean over calls by training phase (`-`: no complete call):",
            "",
            "| steps | " + " | ".join(_column(r) for r in COLUMNS) + " |",
            "|---|" + "---|" * len(COLUMNS),
        ]
        for i, (lo, hi) in enumerate(summary["phases"]):
            lines.append(f"| {lo}-{hi} | " + " | ".join(
                _number(summary["ep"][r]["phase"][i]) for r in COLUMNS) + " |")
        lines.append("")
    lines += [PUBLISHED, comparison(summaries),
              "Plot: `routing_imbalance.png` (per layer, max/mean per call over "
              "training at EP 8 and EP 64)."]
    return "\n".join(lines) + "\n"


def plot(summaries: dict[str, dict], traces: dict[str, RoutingTrace], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(len(summaries), 2, figsize=(11, 3.6 * len(summaries)),
                             squeeze=False)
    for row, (name, summary) in enumerate(summaries.items()):
        for col, ranks in enumerate((8, 64)):
            ax = axes[row][col]
            for layer, (steps, ratios) in summary["ep"][ranks]["series"].items():
                ax.plot(steps, ratios, linewidth=0.8, label=f"layer {layer}")
            ax.axhline(summary["ep"][ranks]["uniform"], color="grey", linestyle=":",
                       linewidth=0.8, label="uniform router")
            ax.set_title(f"{name}: EP {ranks}", fontsize=9)
            ax.set_xlabel("training step")
            ax.set_ylabel("routed load max/mean")
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def table(out: Path, command: str) -> str:
    traces = {}
    for name in CONFIGS:
        if (TRACES / name / "trace").is_dir():
            traces[name] = read_routing_trace(TRACES / name / "trace")
    if not traces:
        raise SystemExit(f"no traces under {TRACES}; run the record command first")
    summaries = {name: summarize(trace) for name, trace in traces.items()}
    text = markdown(summaries, traces, command)
    out.write_text(text)
    plot(summaries, traces, out.with_suffix(".png"))
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="train a small model with a config's router, recording")
    rec.add_argument("--model", choices=tuple(CONFIGS), required=True)
    rec.add_argument("--train-iters", type=int, default=400)
    rec.add_argument("--port", type=int, default=29571)
    rec.add_argument("--force", action="store_true", help="replace an existing recording")
    tab = sub.add_parser("table", help="write the imbalance table from the recorded traces")
    tab.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results"
                     / "routing_imbalance.md")
    args = p.parse_args(argv)
    if args.command == "record":
        print(f"recorded into {record(args.model, args.train_iters, args.port, args.force)}")
        return 0
    command = shlex.join([".venv/bin/python", "benchmarks/studies/routing_imbalance.py",
                          *(sys.argv[1:] if argv is None else argv)])
    print(table(args.out, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
