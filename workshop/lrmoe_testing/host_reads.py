"""A detector of host reads of device data, usable on a CPU-only machine.

On a GPU, reading a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``nonzero``, ...) stalls the CPU until the GPU has drained. On the CPU nothing stalls,
so the detector decides what *would* be device data by data flow:

- **device data** ("tainted"): the sources you name (``taint``: a model's parameters,
  a layer's input), every tensor computed from device data, and every tensor that C++
  code creates on its own (the autograd engine's gradients, collectives' buffers,
  compiled kernels' outputs), since on a GPU those live on the device;
- **host data**: tensors built from Python values (``torch.tensor(list)``, the plan's
  counts), and the result of a host read.

A **host read** is one of these on device data: ``tolist``, ``numpy``, ``cpu`` and
``item`` (seen by a ``TorchFunctionMode``); ``_local_scalar_dense`` (behind ``item``,
``int``, ``float``, ``bool``), ``nonzero``, ``masked_select``, ``unique``, indexing with
a boolean mask, ``repeat_interleave`` with tensor repeats and no ``output_size``,
``bincount``, ``equal`` and ``allclose`` (seen by a ``TorchDispatchMode``). Each read is
recorded with the Python frames that led to it, so tests can attribute it ("inside
the LRMoE region's backward", "inside routed_output").

Limits: compiled kernels (pybind11 calls) are opaque: a sync inside them is invisible
here (the GPU check runs them under ``torch.cuda.set_sync_debug_mode("error")``).
``Tensor.to(device)`` is not counted (on the CPU a move to the CPU cannot be told from
a no-op), nor are blocking host-to-device copies.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostRead", "HostReadDetector"]

_FUNCTION_READS = {"tolist", "numpy", "cpu", "item"}
_DISPATCH_READS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "equal",
                   "allclose", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                   "is_nonzero"}


@dataclass(frozen=True)
class HostRead:
    """One host read: what read it and the Python frames (file, function) that led there."""

    op: str
    frames: tuple[tuple[str, str], ...]

    def inside(self, filename_suffix: str, function: str) -> bool:
        """Whether the read happened (transitively) inside ``function`` of a file ending
        in ``filename_suffix``."""
        return any(f.endswith(filename_suffix) and name == function for f, name in self.frames)

    def where(self) -> str:
        """The innermost frames, for messages."""
        return " <- ".join(f"{f.rsplit('/', 1)[-1]}:{name}" for f, name in self.frames[:6])


def _frames() -> tuple[tuple[str, str], ...]:
    frame, out = sys._getframe(2), []
    while frame is not None:
        code = frame.f_code
        if "/torch/" not in code.co_filename and not code.co_filename.endswith("host_reads.py"):
            out.append((code.co_filename, code.co_name))
        frame = frame.f_back
    return tuple(out)


@dataclass
class _State:
    tainted: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    depth: int = 0          # Python-level torch calls in progress (TorchFunctionMode)
    in_read: bool = False   # inside a read the function mode recorded (no second count)
    reads: list[HostRead] = field(default_factory=list)

    def is_tainted(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t in self.tainted

    def taint(self, t: object) -> None:
        if isinstance(t, torch.Tensor):
            self.tainted[t] = True


class _FunctionMode(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        name = getattr(func, "__name__", "")
        read = name in _FUNCTION_READS and args and state.is_tainted(args[0])
        if read:
            state.reads.append(HostRead(name, _frames()))
        state.depth += 1
        outer, state.in_read = state.in_read, state.in_read or bool(read)
        try:
            out = func(*args, **kwargs)
        finally:
            state.depth -= 1
            state.in_read = outer
        if read and isinstance(out, torch.Tensor):
            if out is args[0]:
                # On a CPU, .cpu() returns the tensor itself; on a GPU it is a new host
                # copy, and the device tensor stays device data: make that copy.
                out = out.clone()
            state.tainted.pop(out, None)                       # host data from here on
        return out


class _DispatchMode(TorchDispatchMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        flat, _ = tree_flatten((args, kwargs))
        tainted_in = any(state.is_tainted(t) for t in flat)
        if tainted_in and not state.in_read and self._is_read(func, args, kwargs):
            state.reads.append(HostRead(func.__name__, _frames()))
        out = func(*args, **kwargs)
        # C++ code creating tensors on its own (state.depth == 0: not below a Python-level
        # torch call) is the autograd engine, a collective or a compiled kernel: device
        # data on a GPU. lift_fresh wraps host data (torch.from_numpy, torch.tensor).
        if tainted_in or (state.depth == 0 and not func.__name__.startswith("lift_fresh")):
            for t in tree_flatten(out)[0]:
                state.taint(t)
            for arg, spec in zip(args, func._schema.arguments, strict=False):
                if spec.alias_info is not None and spec.alias_info.is_write:
                    for t in tree_flatten(arg)[0]:
                        state.taint(t)
        return out

    @staticmethod
    def _is_read(func, args, kwargs) -> bool:
        name = func._schema.name.split("::")[-1]
        if name in _DISPATCH_READS:
            return True
        if name == "repeat_interleave":
            return (func._overloadname == "Tensor" or func._overloadname == "self_Tensor") \
                and kwargs.get("output_size") is None
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else ()
            return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                       for i in indices or ())
        return False


class HostReadDetector:
    """Context manager: records host reads of device data while active.

    >>> with HostReadDetector() as det:
    ...     det.taint(*model.parameters())
    ...     loss = model(x).sum(); loss.backward()
    >>> [r for r in det.reads if r.inside("layer/region.py", "backward")]
    """

    def __init__(self) -> None:
        self._state = _State()
        self._modes: tuple[_FunctionMode, _DispatchMode] | None = None

    @property
    def reads(self) -> list[HostRead]:
        return self._state.reads

    def taint(self, *tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Mark tensors as device data (sources)."""
        for t in tree_flatten(list(tensors))[0]:
            self._state.taint(t)

    def clear(self) -> None:
        self._state.reads.clear()

    def __enter__(self) -> HostReadDetector:
        self._modes = (_FunctionMode(self._state), _DispatchMode(self._state))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None
