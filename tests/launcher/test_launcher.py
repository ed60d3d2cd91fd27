"""The launcher end to end on CPU/gloo: EP, PP (1F1B), TP with sequence parallel,
the distributed optimizer, and bitwise-exact checkpoint resume.

Runs go through ``megatron_lrmoe.launcher.pretrain.train`` inside the long-lived gloo pool
(same code path as torchrun, minus process start-up); one test also drives the
real ``torchrun`` command line.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A model small enough for CI, with every MoE feature the launcher wires up.
TINY = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
    "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01",
    "--micro-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--split", "95,5,0", "--log-interval", "5", "--eval-interval", "1000", "--eval-iters", "0",
    "--no-progress-bar", "--seed", "1234",
]


def _train(argv: list[str]) -> dict:
    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.pretrain import train

    return train(parse_args(argv))


def _train_and_describe(argv: list[str]) -> dict:
    """Train, and report what Megatron built (schedule, layers per stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_lrmoe.launcher.arguments import parse_args
    from megatron_lrmoe.launcher.distributed import initialize_distributed
    from megatron_lrmoe.launcher.pretrain import train

    args = parse_args(argv)
    initialize_distributed(args)
    schedule = get_forward_backward_func().__name__
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    ps.destroy_model_parallel()
    summary = train(args)
    summary.update(schedule=schedule, pp_rank=pp_rank, tp_rank=tp_rank)
    return summary


def _decreased(losses: list[float], window: int = 3, margin: float = 0.5) -> bool:
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    return last < first - margin


def test_ep2_trains_on_real_corpus(gloo2, corpus):
    results = gloo2.run(_train, TINY + ["--data-path", corpus, "--train-iters", "20",
                                        "--expert-model-parallel-size", "2"], timeout=300)
    losses = results[0]["losses"]
    assert len(losses) == 20
    assert results[0]["losses"] == results[1]["losses"], "all ranks report the same loss"
    assert _decreased(losses), losses
    assert results[0]["moe-cumulative-s"] > 0


def test_pp2_uses_1f1b_and_trains(gloo2, corpus):
    results = gloo2.run(_train_and_describe, TINY + [
        "--data-path", corpus, "--train-iters", "15", "--pipeline-model-parallel-size", "2",
        "--global-batch-size", "16",  # 4 micro-batches in flight through 2 stages
    ], timeout=300)
    assert {r["schedule"] for r in results} == {"forward_backward_pipelining_without_interleaving"}
    assert sorted(r["pp_rank"] for r in results) == [0, 1]
    assert _decreased(results[0]["losses"]), results[0]["losses"]


def test_tp2_sequence_parallel_trains(gloo2, corpus):
    results = gloo2.run(_train_and_describe, TINY + [
        "--data-path", corpus, "--train-iters", "15", "--tensor-model-parallel-size", "2",
        "--sequence-parallel",
    ], timeout=300)
    assert sorted(r["tp_rank"] for r in results) == [0, 1]
    assert _decreased(results[0]["losses"]), results[0]["losses"]


def test_distributed_optimizer_matches_plain_optimizer(gloo2, corpus):
    base = TINY + ["--data-path", corpus, "--train-iters", "6", "--expert-model-parallel-size",
                   "2", "--hidden-dropout", "0", "--attention-dropout", "0"]
    plain = gloo2.run(_train, base, timeout=300)[0]["losses"]
    sharded = gloo2.run(_train, base + ["--use-distributed-optimizer"], timeout=300)[0]["losses"]
    # Same maths on shards of the same parameters: equal up to reduction order.
    assert sharded == pytest.approx(plain, rel=1e-4)


def test_overlapped_grad_reduce_and_param_gather_match(gloo2, corpus):
    base = TINY + ["--data-path", corpus, "--train-iters", "6", "--expert-model-parallel-size",
                   "2", "--hidden-dropout", "0", "--attention-dropout", "0",
                   "--use-distributed-optimizer", "--eval-iters", "1", "--eval-interval", "3"]
    plain = gloo2.run(_train, base, timeout=300)[0]
    overlapped = gloo2.run(
        _train, base + ["--overlap-grad-reduce", "--overlap-param-gather"], timeout=300
    )[0]
    assert overlapped["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert overlapped["validation-loss"] == pytest.approx(plain["validation-loss"], rel=1e-4)


@pytest.mark.parametrize("optimizer_flags", [[], ["--use-distributed-optimizer"]],
                         ids=["optimizer", "distributed-optimizer"])
def test_checkpoint_resume_is_bitwise_exact(gloo2, corpus, tmp_path, optimizer_flags):
    # Dropout on, so the resumed run must also restore every rank's RNG state.
    base = TINY + ["--data-path", corpus, "--train-iters", "8", "--expert-model-parallel-size",
                   "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", *optimizer_flags]
    straight = gloo2.run(_train, base, timeout=300)[0]["losses"]
    ckpt = str(tmp_path / "ckpt")
    first = gloo2.run(_train, base + ["--save", ckpt, "--exit-interval", "4"], timeout=300)
    assert first[0]["iterations"] == 4
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    with open(tracker) as f:
        assert f.read() == "4"
    assert not [d for d in os.listdir(ckpt) if d.endswith(".tmp")], "no partial checkpoint left"
    resumed = gloo2.run(_train, base + ["--load", ckpt], timeout=300)[0]
    assert first[0]["losses"] == straight[:4]
    assert resumed["losses"] == straight[4:], (resumed["losses"], straight[4:])


def test_pp2_ep2_distributed_optimizer_on_4_ranks(gloo4, corpus, tmp_path):
    results = gloo4.run(_train, TINY + [
        "--data-path", corpus, "--train-iters", "10", "--pipeline-model-parallel-size", "2",
        "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
        "--global-batch-size", "16", "--save", str(tmp_path / "ckpt4"),
    ], timeout=420)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    assert _decreased(results[0]["losses"], margin=0.3), results[0]["losses"]
    assert os.path.isdir(tmp_path / "ckpt4" / "iter_0000010")


def test_torchrun_command_line(tmp_path):
    """The user path: torchrun, two processes, TensorBoard and JSON-lines output."""
    log = tmp_path / "log.jsonl"
    tb = tmp_path / "tb"
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "2",
        "--master-port", str(_free_port()), "-m", "megatron_lrmoe.launcher.pretrain",
        *TINY, "--mock-data", "--train-iters", "4", "--expert-model-parallel-size", "2",
        "--log-json", str(log), "--tensorboard-dir", str(tb), "--eval-iters", "1",
        "--eval-interval", "2",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained 4 iterations" in proc.stdout
    assert "MoE fwd" in proc.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert all(r["moe-forward-s"] > 0 and r["moe-backward-s"] > 0 for r in records)
    # Timings to the microsecond; the cumulative MoE time is the logged steps' sum.
    timings = ("step-time-s", "moe-forward-s", "moe-backward-s")
    assert all(round(r[key], 6) == r[key] for r in records for key in timings)
    assert all(round(r["tokens-per-sec"], 1) == r["tokens-per-sec"] for r in records)
    assert [r["moe-cumulative-s"] for r in records] == list(itertools.accumulate(
        r["moe-forward-s"] + r["moe-backward-s"] for r in records))
    assert "validation-loss" in records[1]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))


def _free_port() -> int:
    from lrmoe_testing.gloo_pool import free_port

    return free_port()


# -----------------------------------------------------------------------------
# megatron_lrmoe.launcher: the flags are checked before torchrun starts any worker
# -----------------------------------------------------------------------------


def test_launch_splits_torchrun_options_from_launcher_flags():
    from megatron_lrmoe.launcher.__main__ import split_argv, world_size_of

    torchrun, flags = split_argv(["--nproc-per-node", "2", "--master-port=29999", "--standalone",
                                  "--config", "c.yaml", "--log-interval", "5"])
    assert torchrun == ["--nproc-per-node", "2", "--master-port=29999", "--standalone"]
    assert flags == ["--config", "c.yaml", "--log-interval", "5"]
    assert split_argv(["--nnodes", "1", "--", "--seed", "1"]) == (["--nnodes", "1"],
                                                                  ["--seed", "1"])
    assert world_size_of(["--nnodes", "2", "--nproc_per_node", "3"]) == 6
    assert world_size_of([]) == 1
    assert world_size_of(["--nnodes", "1:2", "--nproc-per-node", "2"]) is None  # elastic


def test_launch_flag_names_do_not_overlap_torchrun_options():
    """The split takes the first name torchrun does not know as the launcher's: a flag of
    the launcher with a torchrun name would be handed to torchrun instead."""
    from torch.distributed.run import get_args_parser

    from megatron_lrmoe.config.command_line import build_parser

    ours = set(build_parser()._option_string_actions) - {"-h", "--help"}
    assert not ours & set(get_args_parser()._option_string_actions)


def _launch(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "megatron_lrmoe.launcher", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


def test_launch_refuses_before_any_worker_starts():
    """One error line, exit status 2, no worker output and no torchrun traceback; the world
    size checked is the one --nproc-per-node asks for."""
    port = str(_free_port())
    proc = _launch("--nproc-per-node", "3", "--master-port", port, *TINY, "--mock-data",
                   "--train-iters", "4", "--expert-model-parallel-size", "2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: --expert-model-parallel-size (2) x "
                           "--expert-tensor-parallel-size (1) must divide the ranks of a pipeline "
                           "stage (3); launch more processes or lower them\n")
    assert proc.stdout == ""
    proc = _launch("--nproc-per-node", "2", "-m", "megatron_lrmoe.launcher.pretrain", *TINY)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: -m is not for megatron_lrmoe.launcher"), proc.stderr


def test_demo_refused_flag_prints_one_error_line(tmp_path):
    """The demo as a user runs it, with setup stubbed (the suite's environment is set up
    already; a real setup.sh run may rebuild it): a refused flag is exactly one line on
    stderr and exit status 2. Its corpus is the demo's own (data/, prepared once)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "demo.sh"), root / "scripts" / "demo.sh")
    (root / "scripts" / "setup.sh").write_text("exit 0\n")
    os.makedirs(os.path.join(REPO, "data"), exist_ok=True)
    for name in (".venv", "configs", "data"):
        os.symlink(os.path.join(REPO, name), root / name)
    env = dict(os.environ, PYTHONPATH=REPO, MASTER_PORT=str(_free_port()))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(["bash", str(root / "scripts" / "demo.sh"), "--train-iters", "20",
                           "--lr-warmup-iters", "20"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: --lr-warmup-iters (20) must be below --train-iters (20); "
                           "lower it, or give --lr-warmup-fraction to scale the warm-up with "
                           "the run\n")
    assert "report of" not in proc.stdout  # nothing after the refusal ran
    assert not (root / "runs").exists() or not os.listdir(root / "runs" / "demo")
