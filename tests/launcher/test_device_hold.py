"""A run held to its device (``--device-memory-gb``), end to end on 2 gloo ranks: a device
smaller than a step's predicted peak stops the run at that step, on every rank, with the
out-of-memory message naming the step, the rank, the need and the device, for Megatron's
own MoE layer and for LRMoE's; a large enough device trains exactly as an unheld run."""

from __future__ import annotations

import json
import re

import pytest

from megatron_lrmoe.planning.memory_account import GIB

TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "4", "--global-batch-size", "16",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "3", "--split", "95,5,0",
    "--eval-iters", "0", "--log-interval", "1", "--no-progress-bar",
    "--expert-model-parallel-size", "2", "--seed", "1234",
]


def _train_held(argv: list[str]) -> dict:
    """Train; the out-of-memory stop comes back as its fields (every rank raises it)."""
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train
    from megatron_lrmoe.planning.memory_account import DeviceOutOfMemory

    try:
        return {"summary": train(parse_args(argv))}
    except DeviceOutOfMemory as exc:
        return {"oom": str(exc), "step": exc.step, "rank": exc.rank, "need": exc.need,
                "device": exc.device}


def _peaks(log) -> list[float]:
    return [json.loads(line)["memory-predicted-peak-gib"]
            for line in log.read_text().splitlines()]


@pytest.mark.parametrize("variant", [[], ["--moe-lrmoe"]], ids=["megatron", "lrmoe"])
def test_held_run_stops_at_the_first_step_over_its_device(gloo2, corpus, tmp_path, variant):
    """A device large enough trains exactly as an unheld run and logs each step's
    predicted peak; a device between the smallest and the largest of those peaks stops
    the run at the first step over it, on every rank, naming that step, the rank with
    the largest need (the logged peak), and the device."""
    base = TINY + variant + ["--data-path", corpus]
    unheld = gloo2.run(_train_held, base, timeout=300)[0]["summary"]["losses"]
    log = tmp_path / "held.jsonl"
    held = gloo2.run(_train_held, base + ["--device-memory-gb", "80", "--log-json", str(log)],
                     timeout=300)
    assert held[0]["summary"]["losses"] == unheld            # bitwise: holding is read-only
    peaks = _peaks(log)
    assert len(peaks) == 3 and all(0 < p < 80 for p in peaks)
    low, high = min(peaks), max(peaks)
    device = (low + high) / 2 if high > low else high * (1 - 1e-6)
    step = next(i + 1 for i, p in enumerate(peaks) if p > device)
    stopped = gloo2.run(_train_held, base + ["--device-memory-gb", repr(device)], timeout=300)
    assert all("oom" in r for r in stopped)
    assert stopped[0] == stopped[1]                           # same stop, same message
    oom = stopped[0]
    assert oom["step"] == step and oom["rank"] in (0, 1)
    assert oom["need"] == pytest.approx(peaks[step - 1] * GIB, rel=1e-12)
    assert oom["device"] == pytest.approx(device * GIB)
    match = re.match(rf"out of memory at step {step} on rank {oom['rank']}: needs "
                     r"([\d.]+) MiB, the device holds ([\d.]+) MiB \(--device-memory-gb ",
                     oom["oom"])
    assert match, oom["oom"]
    assert float(match[1]) == pytest.approx(oom["need"] / 2**20, abs=0.006)
    assert float(match[2]) == pytest.approx(device * 1024, abs=0.006)
    assert float(re.search(r"MoE layers ([\d.]+) MiB", oom["oom"])[1]) > 0
    assert "--micro-batch-size" in oom["oom"]
    assert ("--moe-lrmoe-memory-budget-gb auto" in oom["oom"]) == bool(variant)
    if variant:
        # LRMoE plans toward the device as before (--moe-lrmoe-memory-budget-gb auto: gamma
        # lowered); what fits after that trains on, held.
        device = low * (1 - 1e-4)
        log = tmp_path / "auto.jsonl"
        fitted = gloo2.run(_train_held, base + [
            "--moe-lrmoe-memory-budget-gb", "auto", "--device-memory-gb", repr(device),
            "--log-json", str(log), "--moe-lrmoe-log-interval", "1"], timeout=300)
        assert "summary" in fitted[0], fitted[0]
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert all(r["memory-predicted-peak-gib"] <= device for r in records)
        assert sum(r["lrmoe/budget-adjusted-calls"] for r in records) > 0


def _main_exit(argv: list[str]) -> tuple[object, str, list[str]]:
    """The entry point's ``main`` as torchrun runs it: (exit status, stderr, stderr's
    writes one by one)."""
    import contextlib
    import io

    from megatron_lrmoe.launcher.pretrain import main

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, s: str) -> int:
            self.writes.append(s)
            return super().write(s)

    err = Writes()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            return exc.code, err.getvalue(), err.writes
    return 0, err.getvalue(), err.writes


def test_entry_point_exits_non_zero_with_the_message_on_every_rank(gloo2):
    results = gloo2.run(_main_exit, TINY + ["--mock-data", "--moe-lrmoe",
                                            "--device-memory-gb", "0.001"], timeout=300)
    for code, err, writes in results:
        assert code == 1
        line = [x for x in err.splitlines() if x.startswith("error: ")]
        assert len(line) == 1 and line[0].startswith(
            "error: out of memory at step 1 on rank "), err
        assert "the device holds 1.02 MiB (--device-memory-gb 0.001)" in line[0]
        # in one write, newline included: the ranks share torchrun's log, and a line
        # written in parts interleaves with the other rank's
        assert line[0] + "\n" in writes, writes
    assert results[0][1].splitlines()[-1] == results[1][1].splitlines()[-1]
