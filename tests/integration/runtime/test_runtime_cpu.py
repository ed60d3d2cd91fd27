"""The CPU/gloo runtime: each blocker fails without it, each fix works with it.

Blockers are shown in a fresh interpreter without the runtime; fixes are
exercised in the gloo pool, where the runtime is on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from megatron_lrmoe.integration.runtime import cpu as runtime

# ---------------------------------------------------------------------------
# Without the runtime: the blockers are real
# ---------------------------------------------------------------------------

_BLOCKERS = textwrap.dedent(
    """
    import json, os, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as ps, tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    from megatron_lrmoe.integration.runtime import cpu as runtime   # importing it changes nothing
    ps.initialize_model_parallel()
    out = {}
    def probe(name, fn):
        try:
            fn(); out[name] = "ok"
        except Exception as exc:
            out[name] = type(exc).__name__ + ": " + str(exc)[:200]
    # What each fix replaces, without the runtime (keyed by the fix's name).
    probe("inert_cuda_streams", lambda: torch.cuda.Stream())   # the dispatcher's d2h stream
    probe("cpu_current_device", lambda: torch.cuda.current_device())
    seed = tensor_parallel.model_parallel_cuda_manual_seed
    probe("cpu_rng_for_megatron_tracker", lambda: seed(1))
    probe("numpy_split_sizes_for_gloo", lambda: dist.all_to_all_single(
        torch.empty(2), torch.ones(2), output_split_sizes=torch.tensor([2]),
        input_split_sizes=torch.tensor([2])))
    probe("cpu_device_mode", lambda: torch.zeros(1, device="cuda"))
    # Two blockers sit behind the others: shown with every other fix applied.
    late = ("checkpoint_without_output_without_te", "recompute_under_cpu_device_mode")
    for name, fix in runtime.FIXES.items():
        if name not in late:
            fix()
    seed(1)
    def cuda_literal_layer(x):   # as the causal mask of core attention
        return x * torch.full(x.shape, 3.0, device="cuda")
    probe("checkpoint_without_output_without_te",
          lambda: tensor_parallel.CheckpointWithoutOutput().checkpoint(
              cuda_literal_layer, torch.ones(2, requires_grad=True)))
    probe("recompute_under_cpu_device_mode",
          lambda: tensor_parallel.checkpoint(
              cuda_literal_layer, False, torch.ones(2, requires_grad=True)).sum().backward())
    # Megatron's own placeholder without TE (moe_utils); no fix needed for it.
    out["te_general_gemm"] = repr(moe_utils.te_general_gemm)
    print(json.dumps(out))
    """
)


def test_blockers_exist_without_runtime():
    from lrmoe_testing.gloo_pool import free_port

    env = {"PORT": str(free_port()), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _BLOCKERS], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("te_general_gemm") == "None", out
    assert set(out) == set(runtime.FIXES), "one blocker per fix"
    # This torch is the CUDA build without a driver: CUDA calls fail on the driver.
    no_driver = "RuntimeError: Found no NVIDIA driver"
    assert out["inert_cuda_streams"].startswith("AcceleratorError"), out
    for name in ("cpu_current_device", "cpu_rng_for_megatron_tracker", "cpu_device_mode"):
        assert out[name].startswith(no_driver), (name, out)
    assert out["numpy_split_sizes_for_gloo"].startswith("TypeError"), out
    assert out["checkpoint_without_output_without_te"].startswith(
        "NameError: name 'FP8GlobalStateManager' is not defined"), out
    # Forward ran under the device mode; the recompute in backward did not.
    assert out["recompute_under_cpu_device_mode"].startswith(no_driver), out


# ---------------------------------------------------------------------------
# No-op on CUDA (in-process: nothing gets patched); the version guard: test_megatron_support.py
# ---------------------------------------------------------------------------


def test_noop_when_cuda_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stream_before = torch.cuda.Stream
    assert runtime.enable_cpu_runtime() is False
    assert torch.cuda.Stream is stream_before
    assert not runtime.cpu_runtime_active()


_SKIPPED_COMPILE = textwrap.dedent(
    """
    import sys, torch
    from megatron_lrmoe.integration.runtime.cpu import skip_torch_compile_of_functions
    skip_torch_compile_of_functions()

    def double(x):
        return 2 * x

    compiled = torch.compile(double, backend="eager")
    decorated = torch.compile(backend="eager")(double)
    x = torch.arange(3.0)
    print("functions", compiled is double, decorated is double,
          torch.equal(compiled(x), 2 * x), "torch._dynamo" in sys.modules)
    module = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    print("module", type(module).__name__)
    """
)


def test_torch_compile_of_a_function_returns_it_on_a_machine_without_cuda():
    # A fresh process without CUDA: a function is returned as it is, called, and the
    # compiler never imported; a module is still compiled by torch.
    proc = subprocess.run([sys.executable, "-c", _SKIPPED_COMPILE], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "functions True True True False",
        "module OptimizedModule",
    ], proc.stdout


# ---------------------------------------------------------------------------
# Quieter output: the known benign warnings, and only those, are hidden
# ---------------------------------------------------------------------------

_WARNINGS = textwrap.dedent(
    """
    import logging, os, sys, tempfile, warnings
    if sys.argv[1] == "quiet":
        from megatron_lrmoe.integration.runtime.cpu import quiet_known_warnings
        print("NOTE", quiet_known_warnings(), flush=True)
    import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs  # import time
    import torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.all_gather_into_tensor(torch.empty(1), torch.ones(1))
    # The device-independent ones, from their real emitters (a launcher run's order):
    import megatron.core.models.mimo.config.base_configs  # warns at class definition
    from megatron.core import rerun_state_machine as rsm
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    from megatron.core.models.gpt.gpt_model import GPTModel
    try:  # logs its deprecation first, then fails on the missing config
        GPTModel(config=None, transformer_layer_spec=None, vocab_size=8, max_sequence_length=8)
    except AttributeError:
        pass
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    with tempfile.TemporaryDirectory() as tmp:
        try:  # a synchronous save logs the async deprecation, then needs CUDA here
            TorchDistSaveShardedStrategy("torch_dist", 1).save({}, tmp)
        except RuntimeError:
            pass
    logging.getLogger("megatron.core.rerun_state_machine").warning(
        "RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS")
    logging.getLogger("megatron.core.models.gpt.gpt_model").warning("UNRELATED from gpt_model")
    logging.getLogger("megatron_lrmoe.elsewhere").warning(
        "RerunStateMachine initialized in mode RerunMode.DISABLED")
    warnings.warn_explicit("UNRELATED from base_configs", UserWarning, "z.py", 1,
                           "megatron.core.models.mimo.config.base_configs")
    # Other warnings from the same modules, and a known message from another module:
    for module in ("megatron.core.optimizer", "megatron.core.models.backends",
                   "torch.distributed.c10d_logger"):
        warnings.warn_explicit("UNRELATED from " + module, UserWarning, "x.py", 1, module)
    warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                           "y.py", 1, "megatron_lrmoe.elsewhere")
    # The same for log records:
    logging.getLogger("torch.utils.cpp_extension").warning("UNRELATED from cpp_extension")
    logging.getLogger("torch.utils.cpp_extension").error(
        "No CUDA runtime is found, using CUDA_HOME='%s'", "/as-an-error")
    logging.getLogger("megatron_lrmoe.elsewhere").warning(
        "No CUDA runtime is found, using CUDA_HOME='%s'", "/elsewhere")
    dist.destroy_process_group()
    """
)

# torch logs the CUDA_HOME it would use; set, it is the same on every machine.
_CUDA_HOME = "/nonexistent/cuda-home"


def _run_warnings_script(mode: str) -> subprocess.CompletedProcess:
    from lrmoe_testing.gloo_pool import free_port

    env = {"PORT": str(free_port()), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "CUDA_HOME": _CUDA_HOME}
    proc = subprocess.run([sys.executable, "-c", _WARNINGS, mode], capture_output=True,
                          text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return proc


def _warning_lines(stderr: str) -> list[str]:
    """The lines of warnings.warn ("file:line: Category: message") and of torch's log
    format ("W1201 13:41:15.998000 26280 file:line] message", "[rank0]:"-prefixed once a
    process group exists)."""
    return [line for line in stderr.splitlines()
            if re.match(r"\S+:\d+: \w+Warning: ", line)
            or re.match(r"(\[rank\d+\]:)?[WE]\d{4} ", line)]


def test_known_warnings_are_hidden_and_nothing_else():
    known = [f"{category.__name__}: {message}\n"
             for category, message, _module in runtime.KNOWN_CPU_WARNINGS + runtime.KNOWN_WARNINGS]
    known_logs = [f"] {msg % _CUDA_HOME}\n" for _name, _level, msg in runtime.KNOWN_CPU_LOG_RECORDS]
    # megatron-core's records reach the last-resort handler: the bare message on a line.
    known_logs += [f"\n{msg}\n" for _name, _level, msg in runtime.KNOWN_LOG_RECORDS]
    loud = "\n" + _run_warnings_script("loud").stderr  # every message starts a line
    quiet = _run_warnings_script("quiet")
    quiet.stderr = "\n" + quiet.stderr
    # Without the filters every known warning is printed (so the lists match megatron-core
    # 0.19.2 and torch as installed) ...
    for text in known + known_logs:
        assert text in loud, (text, loud)
    # ... with them none is (but the ones sent from elsewhere below), and one line says
    # what is absent instead.
    elsewhere = "y.py:1: UserWarning: Apex is not installed. Falling back to Torch Norm\n"
    assert quiet.stderr.count(elsewhere) == 1, quiet.stderr
    # (the rerun line is planted once from another logger: it must show exactly once)
    rerun = "\nRerunStateMachine initialized in mode RerunMode.DISABLED\n"
    assert quiet.stderr.count(rerun) == 1, quiet.stderr
    rest = quiet.stderr.replace(elsewhere, "").replace(rerun, "\n")
    for text in known + known_logs:
        assert text not in rest, (text, quiet.stderr)
    assert quiet.stdout.splitlines()[0] == (
        "NOTE cpu runtime: Transformer Engine and Apex not installed; "
        "using megatron-core's local implementations")
    # Not a blanket filter: other warnings of the same modules and loggers still show, a
    # known message from a different module, logger or level still shows ...
    for module in ("megatron.core.optimizer", "megatron.core.models.backends",
                   "torch.distributed.c10d_logger"):
        assert f"UserWarning: UNRELATED from {module}" in quiet.stderr, quiet.stderr
    assert "] UNRELATED from cpp_extension\n" in quiet.stderr, quiet.stderr
    assert "] No CUDA runtime is found, using CUDA_HOME='/as-an-error'\n" in quiet.stderr
    assert "\nNo CUDA runtime is found, using CUDA_HOME='/elsewhere'\n" in quiet.stderr
    assert "\nRerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS\n" in quiet.stderr
    assert "\nUNRELATED from gpt_model\n" in quiet.stderr
    assert "z.py:1: UserWarning: UNRELATED from base_configs" in quiet.stderr
    # ... and the lists are complete: nothing but what the script sent itself is left.
    planted = ("x.py:1: ", "y.py:1: ", "z.py:1: ", "] UNRELATED from ",
               "] No CUDA runtime is found, using CUDA_HOME='/as-an-error'")
    left = [line for line in _warning_lines(quiet.stderr)
            if not any(mark in line for mark in planted)]
    assert not left, quiet.stderr


def test_known_cpu_warnings_left_alone_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "_warnings_quieted", False)
    before = list(warnings.filters)
    loggers = [logging.getLogger(name) for name, _level, _msg in runtime.KNOWN_CPU_LOG_RECORDS]
    filters_before = [list(logger.filters) for logger in loggers]
    assert runtime.quiet_known_cpu_warnings() is None
    assert list(warnings.filters) == before
    assert [list(logger.filters) for logger in loggers] == filters_before


def test_device_independent_warnings_hidden_with_cuda(monkeypatch):
    """On CUDA the command-line tools hide exactly the device-independent rows: one
    warnings filter per KNOWN_WARNINGS row, one record filter per KNOWN_LOG_RECORDS row,
    nothing of the CPU lists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "_warnings_quieted", False)
    monkeypatch.setattr(runtime, "_device_warnings_quieted", False)
    monkeypatch.setattr(sys, "warnoptions", [])
    rows = runtime.KNOWN_LOG_RECORDS + runtime.KNOWN_CPU_LOG_RECORDS
    names = [name for name, _level, _msg in rows]
    before = {name: list(logging.getLogger(name).filters) for name in names}
    with warnings.catch_warnings():
        filters_before = list(warnings.filters)
        try:
            assert runtime.quiet_known_warnings() is None  # no CPU note on CUDA
            added = warnings.filters[:len(warnings.filters) - len(filters_before)]
            assert sorted((f[1].pattern, f[2], f[3].pattern) for f in added) == sorted(
                (re.escape(m) + r"\Z", c, re.escape(mod) + r"\Z")
                for c, m, mod in runtime.KNOWN_WARNINGS)
            for name, level, msg in runtime.KNOWN_LOG_RECORDS:
                new = logging.getLogger(name).filters[len(before[name]):]
                assert [(f.level, f.msg) for f in new] == [(level, msg)]
            for name, _level, _msg in runtime.KNOWN_CPU_LOG_RECORDS:
                assert logging.getLogger(name).filters == before[name]
        finally:
            for name in names:
                logging.getLogger(name).filters[:] = before[name]


# ---------------------------------------------------------------------------
# With the runtime (gloo pool): every fix, by name
# ---------------------------------------------------------------------------


def _all_fixes_enabled():
    return runtime.enabled_fixes()


def test_every_fix_enabled_in_workers(gloo1):
    (fixes,) = gloo1.run(_all_fixes_enabled)
    assert fixes == tuple(runtime.FIXES)


def _streams_are_inert():
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.ones(3) * 2
    event = stream.record_event()
    event.synchronize()
    torch.cuda.synchronize()
    return x.sum().item(), event.query(), torch.cuda.current_stream() is torch.cuda.current_stream()


def test_fix_inert_cuda_streams(gloo1):
    (result,) = gloo1.run(_streams_are_inert)
    assert result == (6.0, True, True)


def _current_device_allocations():
    a = torch.empty(2, device=torch.cuda.current_device())
    b = torch.ones(2).to(device=torch.cuda.current_device())
    return a.device.type, b.device.type


def test_fix_cpu_current_device(gloo1):
    (result,) = gloo1.run(_current_device_allocations)
    assert result == ("cpu", "cpu")


def _tracker_behaviour():
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    ps.initialize_model_parallel()
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(handler)
    model_parallel_cuda_manual_seed(1234)
    default_draw = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        forked_1 = torch.rand(4)
    after_fork = torch.rand(4)
    model_parallel_cuda_manual_seed(1234)
    torch.rand(4)
    with get_cuda_rng_tracker().fork():
        forked_2 = torch.rand(4)
    # The default stream continues as if the fork never happened.
    model_parallel_cuda_manual_seed(1234)
    expected_default = torch.rand(8)[4:]
    return default_draw, forked_1, forked_2, after_fork, expected_default, warnings


def test_fix_cpu_rng_for_megatron_tracker(gloo1):
    ((default, forked_1, forked_2, after, expected, warnings),) = gloo1.run(_tracker_behaviour)
    assert torch.equal(forked_1, forked_2), "tracked state must be reproducible"
    assert not torch.equal(forked_1, default), "tracked state must differ from the default one"
    assert torch.equal(after, expected), "fork() must restore the default generator"
    assert not any("CPU RNG state changed" in w for w in warnings)


def _checkpoint_without_output():
    """Selective recompute as transformer_layer.py builds it: no argument, output released
    in forward, recomputed by the hook in backward."""
    from megatron.core import tensor_parallel

    recompute = tensor_parallel.CheckpointWithoutOutput()
    x = torch.arange(4.0, requires_grad=True)
    w = torch.full((4,), 2.0, requires_grad=True)
    y = recompute.checkpoint(torch.square, x)
    out = y * w                    # saves y for w's gradient: the recomputed values
    recompute.discard_output_and_register_recompute(out)
    out.sum().backward()
    return recompute.fp8, x.grad, w.grad


def test_fix_checkpoint_without_output_without_te(gloo1):
    ((fp8, x_grad, w_grad),) = gloo1.run(_checkpoint_without_output)
    assert fp8 is False
    assert torch.equal(x_grad, torch.tensor([0.0, 4.0, 8.0, 12.0]))
    assert torch.equal(w_grad, torch.tensor([0.0, 1.0, 4.0, 9.0]))


def _alltoall_round_trip(num_experts: int, topk: int):
    """Dispatch then combine with identity experts: every token comes back topk times."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    ep = dist.get_world_size()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(7)
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=num_experts,
        moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, add_bias_linear=False,
    )
    local = num_experts // ep
    experts = list(range(dist.get_rank() * local, (dist.get_rank() + 1) * local))
    dispatcher = MoEAlltoAllTokenDispatcher(
        local, experts, config=config, pg_collection=get_default_pg_collection()
    )
    tokens = 6 + 3 * dist.get_rank()  # uneven token counts: uneven split sizes
    generator = torch.Generator().manual_seed(dist.get_rank())
    hidden = torch.randn(tokens, 8, generator=generator)
    choice = torch.stack([torch.randperm(num_experts, generator=generator)[:topk]
                          for _ in range(tokens)])
    routing_map = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter_(1, choice, True)
    probs = routing_map.float() / topk
    h, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, counts, p = dispatcher.dispatch_postprocess(h, p)
    received = int(counts.sum())
    h = dispatcher.combine_preprocess(h)
    h = dispatcher.token_combine(h)
    out = dispatcher.combine_postprocess(h)
    return torch.allclose(out, topk * hidden), received


@pytest.mark.parametrize("num_experts,topk", [(4, 2), (8, 3)])
def test_fix_numpy_split_sizes_for_gloo(gloo2, num_experts, topk):
    results = gloo2.run(_alltoall_round_trip, num_experts, topk)
    assert all(ok for ok, _ in results), results
    # Every routed pair is received by exactly one rank.
    assert sum(received for _, received in results) == (6 + 9) * topk


def _device_mode_behaviour():
    t = torch.ones(2)
    return (
        torch.zeros(1, device="cuda").device.type,
        torch.tensor([1.0], device="cuda:0").device.type,
        t.cuda() is t,
        t.to("cuda").device.type,
        t.type(),
        t.to(torch.bfloat16).type(),
        t.type(torch.float64).dtype == torch.float64,  # conversions still work
    )


def test_fix_cpu_device_mode(gloo1):
    (result,) = gloo1.run(_device_mode_behaviour)
    assert result == ("cpu", "cpu", True, "cpu", "torch.cuda.FloatTensor",
                      "torch.cuda.BFloat16Tensor", True)


def _device_mode_in_backward():
    """Megatron's two recompute paths over a ``device='cuda'`` literal; whether the device
    mode is on in the recompute and in the rest of backward."""
    from megatron.core import tensor_parallel
    from torch.overrides import _get_current_function_mode_stack

    seen = {}

    def layer(x):
        if torch.is_grad_enabled():  # the recompute (forward runs under no_grad)
            seen.setdefault("recompute", []).append(bool(_get_current_function_mode_stack()))
        return x * torch.full(x.shape, 3.0, device="cuda")

    def mark_backward(grad):
        seen.setdefault("backward", []).append(bool(_get_current_function_mode_stack()))
        return grad

    grads = []
    x = torch.arange(4.0, requires_grad=True)
    y = tensor_parallel.checkpoint(layer, False, x)
    y.register_hook(mark_backward)
    y.sum().backward()
    grads.append(x.grad)
    x = torch.arange(4.0, requires_grad=True)
    recompute = tensor_parallel.CheckpointWithoutOutput()
    out = recompute.checkpoint(layer, x) * 2
    out.register_hook(mark_backward)
    recompute.discard_output_and_register_recompute(out)
    out.sum().backward()
    grads.append(x.grad)
    return seen, grads


def test_fix_recompute_under_cpu_device_mode(gloo1):
    ((seen, grads),) = gloo1.run(_device_mode_in_backward)
    assert seen == {"recompute": [True, True], "backward": [False, False]}, seen
    assert torch.equal(grads[0], torch.full((4,), 3.0))
    assert torch.equal(grads[1], torch.full((4,), 6.0))
