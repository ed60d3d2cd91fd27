"""Bias and variance of LRMoE's retained backward against the dropless gradient: the
measurement on each rank (``measure``) and the tables from the ranks' sums.

``benchmarks/studies/retention_bias.py`` runs it on a gloo worker pool and writes the
report; its docstring defines the inputs, the skew, the draws and every column, and
docs/benchmarks.md, "Retention bias", reads the table. ``measure`` runs on every rank of
an initialised process group (the CPU runtime enabled), so it lives in an importable
module: the pool's workers import the task, and unpickle its ``Config``, by module name.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

__all__ = ["Setting", "Config", "SETTINGS", "SWEEP_SETTINGS", "measure", "summarize",
           "format_tables", "format_sweep", "describe"]


@dataclass(frozen=True)
class Setting:
    label: str
    gamma: float
    selection: str = "uniform"
    metric: str = "grad_act"
    hybrid_fraction: float = 0.5
    min_retention: float = 0.0
    store_factor: float = 1.5

    @property
    def random(self) -> bool:
        """Does the rule draw (so seeds matter)?"""
        if math.isinf(self.gamma):
            return False
        return self.selection != "topk" or self.metric == "random"


SETTINGS = (
    Setting("dropless (gamma inf)", math.inf),
    Setting("topk 1.0", 1.0, "topk"),
    Setting("topk 1.0, m 0.25", 1.0, "topk", min_retention=0.25),
    Setting("topk 1.0, m 0.5", 1.0, "topk", min_retention=0.5),
    Setting("topk 0.75", 0.75, "topk"),
    Setting("uniform 0.75", 0.75, "uniform"),
    Setting("uniform 0.75, m 0.25", 0.75, "uniform", min_retention=0.25),
    Setting("uniform 0.75, m 0.5", 0.75, "uniform", min_retention=0.5),
    Setting("uniform 0.5", 0.5, "uniform"),
    Setting("hybrid 0.5, 0.75", 0.75, "hybrid", hybrid_fraction=0.5),
    Setting("sample 0.75", 0.75, "sample"),
    Setting("sample 0.75, prob", 0.75, "sample", metric="prob"),
    Setting("two-stage 0.75", 0.75, "two-stage"),
    Setting("two-stage 0.75, rho 2", 0.75, "two-stage", store_factor=2.0),
)


@dataclass
class Config:
    hidden: int = 384
    ffn: int = 1024
    experts: int = 16
    topk: int = 2
    tokens_per_rank: int = 1024
    micro_batch: int = 4
    ep: int = 2
    seeds: int = 32
    skew: float = 1.7
    mean_norm: float = 0.5
    scale_sigma: float = 0.5
    vocab: int = 256
    data_seed: int = 1
    settings: tuple[Setting, ...] = field(default_factory=lambda: SETTINGS)
    batches: int = 16
    across: tuple[str, ...] = ("topk 1.0", "topk 0.75", "uniform 0.75", "sample 0.75")


# ----------------------------------------------------------------------------- worker side
def _build(cfg: Config, s: Setting):
    """An LRMoELayer as tests/layer/test_lrmoe_layer.py builds it (Megatron's config and local
    spec converted by ``to_lrmoe_spec``), on this rank of an EP=cfg.ep group."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lrmoe.config.transformer_config import LRMoETransformerConfig
    from megatron_lrmoe.integration.step_hooks import setup_lrmoe_layers
    from megatron_lrmoe.layer.spec import to_lrmoe_spec

    config = LRMoETransformerConfig(
        num_layers=1, hidden_size=cfg.hidden, num_attention_heads=4, ffn_hidden_size=cfg.ffn,
        moe_ffn_hidden_size=cfg.ffn, num_moe_experts=cfg.experts, moe_router_topk=cfg.topk,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", expert_model_parallel_size=cfg.ep,
        add_bias_linear=False, bias_activation_fusion=False, gated_linear_unit=True,
        activation_func=F.silu, moe_lrmoe=True, moe_lrmoe_bwd_capacity_factor=s.gamma,
        moe_lrmoe_selection=s.selection, moe_lrmoe_metric=s.metric,
        moe_lrmoe_hybrid_fraction=s.hybrid_fraction, moe_lrmoe_min_retention=s.min_retention,
        moe_lrmoe_store_factor=s.store_factor)
    spec = get_gpt_layer_local_spec(num_experts=cfg.experts).submodules.mlp
    layer = to_lrmoe_spec(spec)(config=config)
    setup_lrmoe_layers([layer], None, 1)
    return layer


def _all_sum(t):
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def _loads(x, weight, topk: int):
    """Routed pairs per expert over all ranks (top-k of the router logits)."""
    import torch

    idx = (x @ weight.t()).topk(topk, dim=-1).indices.reshape(-1)
    return _all_sum(torch.bincount(idx, minlength=weight.shape[0]).double())


def _skewness(loads, ep: int) -> tuple[float, float]:
    """(max/mean over ranks, max/mean over experts) of routed loads."""
    per_rank = loads.view(ep, -1).sum(1)
    return float(per_rank.max() / per_rank.mean()), float(loads.max() / loads.mean())


def _data(cfg: Config, rank: int, batch: int):
    """(x [S, B, H], dy function of y) of one micro-batch on this rank."""
    import torch

    shared = torch.Generator().manual_seed(cfg.data_seed)
    mu = torch.randn(cfg.hidden, generator=shared)
    mu = mu / mu.norm() * cfg.mean_norm * math.sqrt(cfg.hidden)
    w_out = torch.randn(cfg.hidden, cfg.vocab, generator=shared) / math.sqrt(cfg.hidden)
    teacher = torch.randn(cfg.hidden, cfg.vocab, generator=shared)
    g = torch.Generator().manual_seed(cfg.data_seed * 7919 + 1000 * batch + rank + 1)
    tokens = cfg.tokens_per_rank
    scale = torch.exp(cfg.scale_sigma * torch.randn(tokens, 1, generator=g))
    x = scale * (torch.randn(tokens, cfg.hidden, generator=g) + mu)
    target = (x @ teacher).argmax(-1)

    def output_grad(y):
        y = y.detach().reshape(tokens, cfg.hidden).requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(y @ w_out, target, reduction="sum")
        (dy,) = torch.autograd.grad(loss / (tokens * cfg.ep), y)
        return dy

    shape = (tokens // cfg.micro_batch, cfg.micro_batch, cfg.hidden)
    return x.view(shape), mu, output_grad


def _skew_router(layer, cfg: Config, x, mu) -> dict:
    """Add b_e mu/||mu|| to the router rows, beta by bisection to reach cfg.skew."""
    import torch

    weight = layer.router.weight
    grade = torch.linspace(1.0, -1.0, cfg.experts).unsqueeze(1) * (mu / mu.norm())
    flat = x.reshape(-1, cfg.hidden)
    which = 0 if cfg.ep > 1 else 1

    def skew_at(beta: float) -> float:
        return _skewness(_loads(flat, weight.detach() + beta * grade, cfg.topk), cfg.ep)[which]

    lo, hi = 0.0, 1e-3
    while skew_at(hi) < cfg.skew:
        lo, hi = hi, hi * 2
        if hi > 1e3:
            raise RuntimeError(f"cannot reach load max/mean {cfg.skew}")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if skew_at(mid) < cfg.skew else (lo, mid)
    with torch.no_grad():
        weight.add_(hi * grade)
    loads = _loads(flat, weight.detach(), cfg.topk)
    rank_skew, expert_skew = _skewness(loads, cfg.ep)
    return {"beta": hi, "rank_skew": rank_skew, "expert_skew": expert_skew,
            "loads": loads.tolist()}


def _pass(layer, x, output_grad):
    """One training forward and backward: (expert grads per local expert, router grad,
    dX), all float64, and the retention plan of the call."""
    import torch

    for p in layer.parameters():
        p.grad = None
    xg = x.clone().requires_grad_(True)
    out, _ = layer(xg)
    out.backward(output_grad(out).view_as(out))
    experts = [torch.cat([e.linear_fc1.weight.grad.reshape(-1),
                          e.linear_fc2.weight.grad.reshape(-1)]).double()
               for e in layer.experts.local_experts]
    router = _all_sum(layer.router.weight.grad.detach().clone()).double().reshape(-1)
    return experts, router, xg.grad.double().reshape(-1), layer.last_plan.retention


class _Moments:
    """Running sums over seeds of the deviations v - ref of a list of vectors from their
    references (shifted by the reference, so near-exact settings lose no precision)."""

    def __init__(self, refs) -> None:
        import torch

        self.refs = refs
        self.sum = [torch.zeros_like(r) for r in refs]
        self.sq = [0.0 for _ in refs]
        self.n = 0

    def add(self, vectors) -> None:
        for i, (v, ref) in enumerate(zip(vectors, self.refs, strict=True)):
            dev = v - ref
            self.sum[i] += dev
            self.sq[i] += float(dev.dot(dev))
        self.n += 1

    def against(self) -> list[dict]:
        """Per vector, sums that add over vectors: d2 = ||mean - ref||^2, g2 = ||ref||^2,
        e2 = ||mean||^2, eg = <mean, ref>, var = E||v - mean||^2 (unbiased), n."""
        out = []
        for s, sq, ref in zip(self.sum, self.sq, self.refs, strict=True):
            bias = s / self.n
            d2, g2, bg = float(bias.dot(bias)), float(ref.dot(ref)), float(bias.dot(ref))
            var = max(0.0, sq - self.n * d2) / (self.n - 1) if self.n > 1 else 0.0
            out.append({"d2": d2, "g2": g2, "e2": g2 + 2 * bg + d2, "eg": g2 + bg,
                        "var": var, "n": self.n})
        return out


def measure(cfg: Config) -> dict:
    """Run on every rank of an EP=cfg.ep gloo group (the CPU runtime enabled): each
    setting's moments against the dropless gradients. Returns this rank's sums: per
    setting, per local expert, for the router and for dX (docstring of the module)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.set_num_threads(1)
    rank = dist.get_rank()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=cfg.ep)
    model_parallel_cuda_manual_seed(123)
    x, mu, output_grad = _data(cfg, rank, 0)
    reference = _build(cfg, Setting("dropless", math.inf))
    skew = _skew_router(reference, cfg, x, mu)
    state = reference.state_dict()
    ref_experts, ref_router, ref_dx, ref_plan = _pass(reference, x, output_grad)
    refs = ref_experts + [ref_router, ref_dx]
    local = [int(i) for i in reference.local_expert_indices]
    x2, _, output_grad2 = _data(cfg, rank, 1)
    batch = _Moments(ref_experts)
    batch.add(_pass(reference, x2, output_grad2)[0])
    del reference
    result = {"rank": rank, "local_experts": local, "skew": skew,
              "routed": ref_plan.counts.sum(0).tolist(), "batch": batch.against(),
              "settings": {}}
    for s in cfg.settings:
        started = time.perf_counter()
        layer = _build(cfg, s)
        layer.load_state_dict(state)
        layer.train()
        moments = _Moments(refs)
        kept = None
        for _ in range(cfg.seeds if s.random else 2):
            experts, router, dx, plan = _pass(layer, x, output_grad)
            moments.add(experts + [router, dx])
            kept = plan.quotas.sum(0).tolist() if kept is None else kept
            layer.finish_step()     # next step seed: the next draw
        sums = moments.against()
        result["settings"][s.label] = {
            "experts": sums[:-2], "router": sums[-2], "dx": sums[-1], "kept": kept,
            "seeds": moments.n, "seconds": time.perf_counter() - started}
        del layer
    result["across"] = _across_batches(cfg, rank, state) if cfg.batches else {}
    return result


def _across_batches(cfg: Config, rank: int, state: dict) -> dict:
    """Is a setting's error systematic? Over cfg.batches further micro-batches b, one pass
    each (one draw of a random rule), per local expert: the summed error e = sum_b
    (G_hat_b - G_b) and sum_b ||G_hat_b - G_b||^2, and the same of the dropless G_b."""
    chosen = [s for s in cfg.settings if s.label in cfg.across]
    layers = {}
    for s in [Setting("dropless", math.inf), *chosen]:
        layers[s.label] = _build(cfg, s)
        layers[s.label].load_state_dict(state)
    sums = {label: None for label in layers}
    sq = {label: None for label in layers}
    for b in range(cfg.batches):
        x, _, output_grad = _data(cfg, rank, 100 + b)
        ref = _pass(layers["dropless"], x, output_grad)[0]
        for label, layer in layers.items():
            g = ref if label == "dropless" else _pass(layer, x, output_grad)[0]
            layer.finish_step()
            err = g if label == "dropless" else [u - v for u, v in zip(g, ref, strict=True)]
            if sums[label] is None:
                sums[label] = [e.clone() for e in err]
                sq[label] = [0.0 for _ in err]
            else:
                for i, e in enumerate(err):
                    sums[label][i] += e
            for i, e in enumerate(err):
                sq[label][i] += float(e.dot(e))
    del layers
    return {label: [{"sum2": float(v.dot(v)), "sq": q, "n": cfg.batches}
                    for v, q in zip(sums[label], sq[label], strict=True)] for label in sums}


# ----------------------------------------------------------------------------- parent side
def _ratios(parts: list[dict]) -> dict:
    """The reported columns from additive sums (a group's vectors concatenated)."""
    tot = {k: sum(p[k] for p in parts) for k in ("d2", "g2", "e2", "eg", "var")}
    n = parts[0]["n"]
    g = math.sqrt(tot["g2"]) or 1.0
    sd = math.sqrt(tot["var"]) / g
    cos = tot["eg"] / math.sqrt(tot["e2"] * tot["g2"]) if tot["e2"] and tot["g2"] else 1.0
    par = tot["eg"] / g ** 2
    perp = math.sqrt(max(0.0, tot["e2"] - tot["eg"] ** 2 / g ** 2)) / g
    return {"bias": math.sqrt(tot["d2"]) / g, "se": sd / math.sqrt(n), "sd": sd, "cos": cos,
            "norm": math.sqrt(tot["e2"]) / g, "par": par, "perp": perp, "seeds": n}


def _across_ratios(parts: list[dict], ref: list[dict]) -> dict:
    """Over K batches with errors e_b = G_hat_b - G_b:
    err = ||sum_b e_b|| / ||sum_b G_b||, the error of the batch-averaged gradient;
    coherence = ||sum_b e_b|| / sqrt(sum_b ||e_b||^2): about 1 when the batches' errors
    are independent, sqrt(K) when they repeat;
    systematic = ||E_b e|| / ||E_b G||, the error of the expected gradient over batches
    against it: with e_b = b + n_b (b common to all batches, n_b independent with mean 0),
    (||sum e||^2 - sum ||e_b||^2) / (K (K - 1)) estimates ||b||^2 without bias (0 when the
    estimate is negative), the same of the G_b estimates ||E_b G||^2;
    share = that ||b||^2 / (sum_b ||e_b||^2 / K): the part of a batch's squared error
    common to all batches (for dropless: the mean gradient's part of a batch's)."""
    k = parts[0]["n"]

    def common(ps: list[dict]) -> tuple[float, float]:
        sum2, sq = sum(p["sum2"] for p in ps), sum(p["sq"] for p in ps)
        return (sum2 - sq) / (k * (k - 1)) if k > 1 else 0.0, sq / k

    b2, per_batch = common(parts)
    g2, _ = common(ref)
    sum2, sq = sum(p["sum2"] for p in parts), sum(p["sq"] for p in parts)
    g_sum2 = sum(p["sum2"] for p in ref)
    return {"err": math.sqrt(sum2 / g_sum2) if g_sum2 else 0.0,
            "coherence": math.sqrt(sum2 / sq) if sq else 0.0,
            "systematic": math.sqrt(max(0.0, b2) / g2) if g2 > 0 else float("nan"),
            "share": max(0.0, b2) / per_batch if per_batch else 0.0, "batches": k}


def summarize(per_rank: list[dict], cfg: Config) -> dict:
    """Combine the ranks' sums: per setting, per expert and per load group."""
    routed = per_rank[0]["routed"]
    by_expert: dict[str, dict[int, dict]] = {}
    batch: dict[int, dict] = {}
    for r in per_rank:
        for j, e in enumerate(r["local_experts"]):
            batch[e] = r["batch"][j]
            for label, st in r["settings"].items():
                by_expert.setdefault(label, {})[e] = st["experts"][j]
    order = sorted(range(cfg.experts), key=lambda e: (-routed[e], e))
    q = max(1, cfg.experts // 4)
    groups = {f"hot {q}": order[:q], f"next {q}": order[q:2 * q],
              f"cold {cfg.experts - 2 * q}": order[2 * q:], "all": order}
    out = {"skew": per_rank[0]["skew"], "routed": routed, "order": order, "groups": groups,
           "batch": {g: _ratios([batch[e] for e in es]) for g, es in groups.items()},
           "settings": {}}
    across: dict[str, dict[int, dict]] = {}
    for r in per_rank:
        for label, parts in r["across"].items():
            for j, e in enumerate(r["local_experts"]):
                across.setdefault(label, {})[e] = parts[j]
    out["across"] = {}
    for label, parts in across.items():
        out["across"][label] = {g: _across_ratios([parts[e] for e in es],
                                                  [across["dropless"][e] for e in es])
                                for g, es in groups.items()}
    for s in cfg.settings:
        first = per_rank[0]["settings"][s.label]
        kept = first["kept"]
        rows = {}
        for g, es in groups.items():
            row = _ratios([by_expert[s.label][e] for e in es])
            row["retained"] = sum(kept[e] for e in es) / max(1, sum(routed[e] for e in es))
            rows[g] = row
        experts = {}
        for e in order:
            row = _ratios([by_expert[s.label][e]])
            row["retained"] = kept[e] / max(1, routed[e])
            experts[e] = row
        router = _ratios([first["router"]])          # summed over ranks: the same on each
        dx = _ratios([r["settings"][s.label]["dx"] for r in per_rank])
        out["settings"][s.label] = {
            "groups": rows, "experts": experts, "router": router, "dx": dx,
            "seeds": first["seeds"],
            "seconds": max(r["settings"][s.label]["seconds"] for r in per_rank)}
    return out


def _f(v: float) -> str:
    return f"{v:.3f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def format_tables(summary: dict, cfg: Config) -> str:
    cols = "| setting | group | retained | bias | se | sd | cos | norm | par | perp |"
    lines = ["Expert weight gradients (W1 and W2 together), by load group:", "", cols,
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, st in summary["settings"].items():
        for g, row in st["groups"].items():
            lines.append(f"| {label} | {g} | {row['retained']:.3f} | {_f(row['bias'])} | "
                         f"{_f(row['se'])} | {_f(row['sd'])} | {row['cos']:.4f} | "
                         f"{row['norm']:.3f} | {row['par']:.3f} | {_f(row['perp'])} |")
    lines += ["", "Router weight gradient and dX (all tokens):", "",
              "| setting | seeds | router bias | router sd | dX bias | dX se | dX sd | dX cos "
              "| dX norm |", "|---|---|---|---|---|---|---|---|---|"]
    for label, st in summary["settings"].items():
        r, d = st["router"], st["dx"]
        lines.append(f"| {label} | {st['seeds']} | {_f(r['bias'])} | {_f(r['sd'])} | "
                     f"{_f(d['bias'])} | {_f(d['se'])} | {_f(d['sd'])} | {d['cos']:.4f} | "
                     f"{d['norm']:.3f} |")
    lines += ["", "Batch-to-batch: dropless gradient of a second micro-batch against the "
              "first, ||G2 - G|| / ||G||: " + ", ".join(
                  f"{g} {row['bias']:.3f}" for g, row in summary["batch"].items()), ""]
    if summary.get("across"):
        n = next(iter(next(iter(summary["across"].values())).values()))["batches"]
        lines += [f"Across {n} further micro-batches (one pass, one draw each; formulas in "
                  "`_across_ratios`): err = ||sum_b (G_hat_b - G_b)|| / ||sum_b G_b||; coh = "
                  "coherence of the errors, 1 for independent ones, "
                  f"sqrt({n}) = {math.sqrt(n):.2f} for a repeated one; share = the part of a "
                  "batch's squared error common to all batches; sys = ||E_b(G_hat - G)|| / "
                  "||E_b G||, the error of the expected gradient (an estimate; for the random "
                  "rules, whose batch errors are mostly draw noise, a noisy one: read their coh). "
                  "Dropless row: coh and share of the gradients G_b themselves.", "",
                  "| setting | " + " | ".join(
                      f"{g}: err / coh / share / sys" for g in summary["groups"]) + " |",
                  "|---|" + "---|" * len(summary["groups"])]
        for label, rows in summary["across"].items():
            cells = []
            for row in rows.values():
                if not row["coherence"]:
                    cells.append("no error")
                elif label == "dropless":
                    cells.append(f"- / {row['coherence']:.2f} / {row['share']:.2f} / -")
                else:
                    cells.append(f"{_f(row['err'])} / {row['coherence']:.2f} / "
                                 f"{row['share']:.2f} / {_f(row['systematic'])}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    detail = [lab for lab in summary["settings"] if lab.startswith(("topk 1.0", "uniform 0.75"))
              and ", m" not in lab]
    routed = summary["routed"]
    total = sum(routed)
    lines += ["Per expert (by routed load; share = the expert's share of routed pairs):", "",
              "| expert | share | " + " | ".join(
                  f"{lab}: retained / bias / sd / cos / norm" for lab in detail) + " |",
              "|---|---|" + "---|" * len(detail)]
    for e in summary["order"]:
        if not routed[e]:
            lines.append(f"| {e} | 0 | " + " | ".join("no pairs" for _ in detail) + " |")
            continue
        cells = []
        for lab in detail:
            row = summary["settings"][lab]["experts"][e]
            cells.append(f"{row['retained']:.2f} / {_f(row['bias'])} / {_f(row['sd'])} / "
                         f"{row['cos']:.3f} / {row['norm']:.3f}")
        lines.append(f"| {e} | {routed[e] / total:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SWEEP_SETTINGS = ("topk 1.0", "topk 0.75", "uniform 0.75")


def format_sweep(runs: list[tuple[Config, dict]]) -> str:
    """The hottest experts' figures at each routing skew (rows sorted by skew)."""
    lines = ["Hot experts (the 4 most loaded) by routing skew, for the settings of the "
             "question (the main run's skew with its seeds and batches, the others with "
             "min(seeds, 16) seeds and min(batches, 8) batches):", "",
             "| load max/mean ranks / experts | setting | retained | bias | sd | par | perp "
             "| sys across batches |", "|---|---|---|---|---|---|---|---|"]
    for _cfg, summary in sorted(runs, key=lambda r: r[0].skew):
        sk = summary["skew"]
        hot = next(iter(summary["groups"]))
        for label, st in summary["settings"].items():
            if label not in SWEEP_SETTINGS:
                continue
            row = st["groups"][hot]
            across = summary.get("across", {}).get(label, {}).get(hot)
            sys_text = _f(across["systematic"]) if across else "-"
            lines.append(f"| {sk['rank_skew']:.2f} / {sk['expert_skew']:.2f} | {label} | "
                         f"{row['retained']:.3f} | {_f(row['bias'])} | {_f(row['sd'])} | "
                         f"{row['par']:.3f} | {_f(row['perp'])} | {sys_text} |")
    return "\n".join(lines)


def describe(summary: dict, cfg: Config) -> str:
    """One line: the layer, the routing skew reached, the inputs and the seeds."""
    sk = summary["skew"]
    return (f"H={cfg.hidden}, expert FFN {cfg.ffn}, {cfg.experts} experts top-{cfg.topk}, "
            f"SwiGLU, fp32, EP={cfg.ep} ({cfg.ep} gloo ranks), {cfg.tokens_per_rank} tokens "
            f"per rank ({cfg.tokens_per_rank // cfg.micro_batch} x {cfg.micro_batch}); routed "
            f"load max/mean {sk['rank_skew']:.2f} over ranks, {sk['expert_skew']:.2f} over "
            f"experts (router skew beta {sk['beta']:.3g}); inputs mean norm "
            f"{cfg.mean_norm} sqrt(H), token scales lognormal(0, {cfg.scale_sigma}); "
            f"random rules over {cfg.seeds} seeds (training steps), deterministic ones 2")
