"""Recorded routing (``--record-routing``): the trace format and its load arithmetic
against brute-force loops, and end to end on 2 gloo ranks: the recorded counts equal the
column sums of the routing maps every rank's router produced (captured by an independent
hook and counted with bincount), for Megatron's MoELayer (dropless and capacity drop)
and for LRMoELayer."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest

from megatron_lrmoe.data import routing_traces as rt

# -----------------------------------------------------------------------------
# Pure: format and arithmetic
# -----------------------------------------------------------------------------


def _header(layers=(1, 2), m=2, s=2, e=8, ep=2):
    sources = {n: [{"rank": r, "ep_rank": r % ep, "ep_group": (r // ep) * ep}
                   for r in range(s)] for n in layers}
    return rt.make_header(
        {"num_experts": e, "moe_layers": list(layers), "topk": 2},
        {"microbatches_per_step": m, "ep": ep, "tokens_per_source": 16, "world_size": s},
        sources)


def test_rank_loads_and_ratio_match_loops():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=(3, 4, 16))       # [calls, S, E]
    for ranks in (1, 2, 4, 8, 16):
        loads = rt.rank_loads(counts, ranks)
        ratio = rt.load_max_over_mean(counts, ranks)
        per = 16 // ranks
        for c in range(3):
            expected = [sum(int(counts[c, s, e]) for s in range(4)
                            for e in range(r * per, (r + 1) * per)) for r in range(ranks)]
            assert loads[c].tolist() == expected
            assert ratio[c] == pytest.approx(max(expected) / (sum(expected) / ranks))
    assert rt.load_max_over_mean(np.zeros((2, 2, 4), np.int64), 2).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="cannot be placed evenly"):
        rt.rank_loads(counts, 3)


def test_regroup_takes_consecutive_rows_in_time_order():
    n, m, s, e = 3, 2, 2, 4
    counts = np.arange(n * m * s * e).reshape(n, m, s, e)
    calls = rt.regroup_sources(counts, 3)
    rows = [counts[i, j, k] for i in range(n) for j in range(m) for k in range(s)]
    assert calls.shape == (4, 3, e)                     # 12 rows -> 4 calls of 3
    for c in range(4):
        for r in range(3):
            assert calls[c, r].tolist() == rows[3 * c + r].tolist()
    assert rt.regroup_sources(counts, 5).shape == (2, 5, e)   # 2 leftover rows dropped


def test_chunks_round_trip_and_latest_record_wins(tmp_path):
    header = _header()
    rt.write_header(tmp_path, header)
    rng = np.random.default_rng(1)
    first = rng.integers(0, 9, size=(3, 2, 2, 2, 8))
    again = rng.integers(0, 9, size=(2, 2, 2, 2, 8))       # a resume re-records 3 and adds 4
    rt.write_chunk(tmp_path, 1, np.array([1, 2, 3]), first)
    rt.write_chunk(tmp_path, 2, np.array([3, 4]), again)
    assert rt.next_chunk_number(tmp_path) == 3
    trace = rt.read_routing_trace(tmp_path)
    assert trace.iterations.tolist() == [1, 2, 3, 4]
    assert np.array_equal(trace.counts[:2], first[:2])
    assert np.array_equal(trace.counts[2:], again)
    assert np.array_equal(trace.layer(2), trace.counts[:, 1])
    assert trace.ep_groups(1) == [[0, 1]]


def test_repacked_chunks_load_as_the_same_arrays(tmp_path):
    import zipfile

    rng = np.random.default_rng(2)
    counts = [rng.integers(0, 2**31 - 1, size=(3, 2, 2, 2, 8)), np.zeros((2, 2, 2, 2, 8))]

    def write(directory) -> list:
        rt.write_header(directory, _header())
        rt.write_chunk(directory, 1, np.array([1, 2, 3]), counts[0])
        rt.write_chunk(directory, 2, np.array([4, 5]), counts[1])
        return sorted(directory.glob("counts_*.npz"))

    def arrays(chunks) -> list[dict[str, np.ndarray]]:
        out = []
        for chunk in chunks:
            with np.load(chunk) as data:
                out.append({name: data[name] for name in data.files})
        return out

    trace_dir = tmp_path / "trace"
    chunks = write(trace_dir)
    before, trace = arrays(chunks), rt.read_routing_trace(trace_dir)
    rt.repack(trace_dir)
    for old, new in zip(before, arrays(chunks), strict=True):
        assert old.keys() == new.keys()
        for name in old:
            assert new[name].dtype == old[name].dtype and np.array_equal(new[name], old[name])
    for chunk in chunks:
        with zipfile.ZipFile(chunk) as packed:
            assert {i.compress_type for i in packed.infolist()} == {zipfile.ZIP_LZMA}
    again = rt.read_routing_trace(trace_dir)
    assert np.array_equal(again.iterations, trace.iterations)
    assert np.array_equal(again.counts, trace.counts)
    assert sorted(trace_dir.iterdir()) == sorted([*chunks, trace_dir / rt.HEADER])  # no tmp
    stored = [chunk.read_bytes() for chunk in chunks]
    rt.repack(trace_dir)                                   # repacked already: unchanged
    assert [chunk.read_bytes() for chunk in chunks] == stored
    copy = write(tmp_path / "copy")                        # the bytes depend on the arrays
    rt.repack(tmp_path / "copy")
    assert [chunk.read_bytes() for chunk in copy] == stored


def test_reader_and_writer_refuse_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a routing trace"):
        rt.read_routing_trace(tmp_path)
    rt.write_header(tmp_path, _header())
    with pytest.raises(ValueError, match=r"\[n, L, M, S, E\]"):
        rt.write_chunk(tmp_path, 1, np.array([1]), np.zeros((1, 2, 8)))
    rt.write_chunk(tmp_path, 1, np.array([1]), np.zeros((1, 3, 2, 2, 8)))  # 3 layers, header 2
    with pytest.raises(ValueError, match="do not match the header"):
        rt.read_routing_trace(tmp_path)


def test_ep_groups_order_sources_by_ep_rank():
    sources = [{"rank": 0, "ep_rank": 1, "ep_group": 0}, {"rank": 1, "ep_rank": 0, "ep_group": 0},
               {"rank": 2, "ep_rank": 0, "ep_group": 2}, {"rank": 3, "ep_rank": 1, "ep_group": 2}]
    assert rt.ep_groups(sources) == [[1, 0], [2, 3]]


def test_existing_trace_of_another_model_is_refused(tmp_path):
    from megatron_lrmoe.launcher.routing_record import _prepare_directory

    assert _prepare_directory(str(tmp_path / "new"), _header()) is None
    assert (tmp_path / "new" / "header.json").is_file()
    assert _prepare_directory(str(tmp_path / "new"), _header()) is None     # resume: same
    message = _prepare_directory(str(tmp_path / "new"), _header(e=16))
    assert message.startswith("--record-routing") and "another model" in message
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    assert "not a routing trace" in _prepare_directory(str(tmp_path / "other"), _header())


def test_flag_checks_name_the_flag(tmp_path, monkeypatch):
    from megatron_lrmoe.config.flags import ConfigError
    from megatron_lrmoe.launcher.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-3", "--mock-data"]
    with pytest.raises(ConfigError, match="--record-routing needs an MoE model"):
        parse_args(base + ["--record-routing", str(tmp_path / "t")])
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="--record-routing .*not a directory"):
        parse_args(base + ["--num-experts", "2", "--record-routing", str(tmp_path / "file")])


# -----------------------------------------------------------------------------
# End to end on 2 ranks
# -----------------------------------------------------------------------------

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "4", "--global-batch-size", "16",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "4", "--split", "95,5,0",
    "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1", "--no-progress-bar",
    "--expert-model-parallel-size", "2", "--seed", "1234",
]


def _keep_counts(store: list, layer: int, module, args, output) -> None:
    """Reference: this call's routed tokens per expert, from the map's nonzero entries."""
    import torch

    if module.training and torch.is_grad_enabled():
        _, experts = output[1].nonzero(as_tuple=True)
        store.append((layer, np.bincount(experts.cpu().numpy(),
                                         minlength=output[1].shape[1]).tolist()))


def _train_with_reference_maps(argv: list[str]) -> list:
    """Train, with a reference hook on every router registered as the model is built."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    from megatron_lrmoe.launcher import builders
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train

    store: list = []
    original = builders.build_model

    def build_model(*args, **kwargs):
        model = original(*args, **kwargs)
        for chunk in model:
            for module in chunk.modules():
                if isinstance(module, BaseMoELayer):
                    module.router.register_forward_hook(
                        partial(_keep_counts, store, module.layer_number))
        return model

    builders.build_model = build_model
    try:
        train(parse_args(argv))
    finally:
        builders.build_model = original
    return store


@pytest.mark.parametrize("variant", [
    [], ["--moe-expert-capacity-factor", "1.0"],
    ["--moe-lrmoe", "--moe-lrmoe-bwd-capacity-factor", "0.75"],
], ids=["megatron-dropless", "megatron-capacity", "lrmoe"])
def test_recorded_counts_equal_the_routing_maps(gloo2, corpus, tmp_path, variant):
    trace_dir, log = tmp_path / "trace", tmp_path / "log.jsonl"
    argv = TINY + variant + ["--data-path", corpus, "--record-routing", str(trace_dir),
                             "--log-json", str(log)]
    per_rank = gloo2.run(_train_with_reference_maps, argv, timeout=300)
    trace = rt.read_routing_trace(trace_dir)
    steps, m, layers, e = 4, 2, [1, 2], 8
    assert trace.iterations.tolist() == [1, 2, 3, 4]
    assert trace.layers == layers and trace.counts.shape == (steps, 2, m, 2, e)
    header = trace.header
    assert header["model"]["capacity_factor"] == (1.0 if "--moe-expert-capacity-factor"
                                                  in variant else None)
    assert header["model"]["moe_lrmoe"] == ("--moe-lrmoe" in variant)
    assert header["parallel"]["tokens_per_source"] == 4 * 64
    # Reference: rank r's calls of each layer, in order (step, micro-batch); evaluation
    # passes are not training calls, so neither the hook nor the recorder sees them.
    for rank, calls in enumerate(per_rank):
        for li, layer in enumerate(layers):
            mine = [c for n, c in calls if n == layer]
            assert len(mine) == steps * m
            expected = np.array(mine).reshape(steps, m, e)
            source = [s["rank"] for s in header["sources"][str(layer)]].index(rank)
            assert np.array_equal(trace.counts[:, li, :, source], expected)
    rows = trace.counts.sum(axis=-1)
    if "--moe-expert-capacity-factor" in variant:
        assert (rows <= 4 * 64 * 2).all() and (rows < 4 * 64 * 2).any()   # drops happened
    else:
        assert (rows == 4 * 64 * 2).all()             # every token routed to top-2
    # Logged per-step load figure: max over micro-batches of the 2-rank max/mean.
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for i, record in enumerate(records):
        for li, layer in enumerate(layers):
            worst = 0.0
            for mb in range(m):
                loads = [sum(trace.counts[i, li, mb, s, r * 4:(r + 1) * 4].sum()
                             for s in range(2)) for r in range(2)]
                worst = max(worst, max(loads) / (sum(loads) / 2))
            assert record[f"routing/layer{layer}/load-max-over-mean"] == pytest.approx(worst)


def test_resumed_run_appends_to_its_trace(gloo2, corpus, tmp_path):
    trace_dir, ckpt = tmp_path / "trace", tmp_path / "ckpt"
    argv = TINY + ["--data-path", corpus, "--record-routing", str(trace_dir), "--save",
                   str(ckpt), "--save-interval", "2", "--eval-iters", "0"]
    gloo2.run(_train_with_reference_maps, [*argv, "--train-iters", "4", "--exit-interval",
                                           "2"], timeout=300)
    assert rt.read_routing_trace(trace_dir).iterations.tolist() == [1, 2]
    gloo2.run(_train_with_reference_maps, [*argv, "--train-iters", "4", "--load", str(ckpt)],
              timeout=300)
    trace = rt.read_routing_trace(trace_dir)
    assert trace.iterations.tolist() == [1, 2, 3, 4]
    assert sorted(p.name for p in trace_dir.glob("counts_*.npz")) == [
        "counts_000001.npz", "counts_000002.npz"]
