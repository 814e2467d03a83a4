"""Tensor ops and host-device syncs of a piece of code, counted on CPU.

On a GPU the construction and the decode step are bound by the host: each aten op costs the same
wall time there whatever its size (results/gpu/README.md), and each sync stalls the host until the
device has caught up. Both are properties of the code, not of the device, so they are counted here
on CPU with a ``TorchDispatchMode``:

- an *op* is one aten call that launches work: view ops (``func.is_view``: slices, reshapes,
  transposes, ``expand``) and bare allocations (``empty``), which launch no kernel, are left out.
  An op that may alias its input but copies (``to`` another dtype, ``contiguous`` of a strided tensor:
  under ``inference_mode`` these reach the counter undecomposed, flagged as views) is counted when its
  result does not share its input's storage;
- a *sync* is a call that makes the host wait for a device's data: ``item``/``int()``/``bool()``
  (``aten.item`` under ``inference_mode``, ``aten._local_scalar_dense`` outside it), ``nonzero``,
  ``unique`` and ``masked_select`` (their output shape is data), and ``Tensor.tolist`` (which on CPU
  reads memory without dispatching, so it is counted by a wrapper for the duration of the count);
  and a copy from the host to a device that is not ``non_blocking``: on CUDA it waits for the stream
  (torch's ``memcpy_and_sync``) though no op counter sees it. Such a copy is ``torch.tensor`` or
  ``torch.as_tensor`` of Python data with a ``device``, or ``Tensor.to(device)`` of a host tensor: one
  made from Python data without a device, or drawn from a CPU generator without one (wrappers count
  them, as for ``tolist``: on CPU the device is the host, so no op shows the copy).

Each op's fp32 result is counted in bytes too (``fp32_bytes``, by stage; in-place results included):
what a piece of code writes in fp32, the transient memory traffic of a construction.

A ``torch.compile``d function runs no aten op of its own that a dispatch mode could see: its launches
are read from the code inductor generates for it instead (``compiled_kernels``).
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}
SYNC_OPS = {
    aten.item.default,
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
}
SYNC_PACKETS = {aten._unique2, aten.unique_dim, aten.unique_consecutive, aten._unique}


@dataclass
class DispatchCounts:
    """What ran under ``count_dispatch``: ops and syncs, by name (for profiling) and by the ``stage``
    they ran in."""

    ops: int = 0
    syncs: int = 0
    by_op: Counter = field(default_factory=Counter)
    syncs_by_op: Counter = field(default_factory=Counter)
    ops_by_stage: Counter = field(default_factory=Counter)
    syncs_by_stage: Counter = field(default_factory=Counter)
    fp32_bytes_by_stage: Counter = field(default_factory=Counter)
    largest_fp32_bytes: int = 0  # the largest fp32 result one op wrote

    def op(self, name: str, fp32_bytes: int = 0) -> None:
        if _PAUSED.get():
            return
        self.ops += 1
        self.by_op[name] += 1
        self.ops_by_stage[_STAGE.get()] += 1
        self.fp32_bytes_by_stage[_STAGE.get()] += fp32_bytes
        self.largest_fp32_bytes = max(self.largest_fp32_bytes, fp32_bytes)

    def sync(self, name: str) -> None:
        if _PAUSED.get():
            return
        self.syncs += 1
        self.syncs_by_op[name] += 1
        self.syncs_by_stage[_STAGE.get()] += 1


# The stage counted ops and syncs are attributed to (``stage``).
_STAGE: contextvars.ContextVar[str] = contextvars.ContextVar("stage", default="other")
# The counts of the innermost ``count_dispatch``, for launches no dispatch mode sees (``launched``).
_ACTIVE: contextvars.ContextVar[DispatchCounts | None] = contextvars.ContextVar("counts", default=None)
# Whether counting is paused (``uncounted``).
_PAUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("paused", default=False)


def launched(name: str, fp32_bytes: int = 0) -> None:
    """Count one launch that no aten op shows (a Triton kernel's) as an op of the current count."""
    counts = _ACTIVE.get()
    if counts is not None:
        counts.op(name, fp32_bytes)


@contextlib.contextmanager
def uncounted():
    """``with uncounted(): ...``: the block's ops and syncs are not counted (a stand-in's own work,
    computing what a launch counted by ``launched`` would have)."""
    token = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(token)


def current_stage() -> str:
    """The stage ops and syncs are attributed to now (``stage``)."""
    return _STAGE.get()


@contextlib.contextmanager
def stage(name: str):
    """``with stage("decode"): ...``: ops and syncs counted in the block are the ``name`` stage's (the
    innermost stage wins)."""
    token = _STAGE.set(name)
    try:
        yield
    finally:
        _STAGE.reset(token)


class _Counter(TorchDispatchMode):
    def __init__(self, counts: DispatchCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS or func.overloadpacket in SYNC_PACKETS:
            self.counts.sync(func.overloadpacket.__name__)
        result = func(*args, **(kwargs or {}))
        if func not in NO_KERNEL and not (func.is_view and _aliases(result, args[0])):
            self.counts.op(func.overloadpacket.__name__, _fp32_bytes(result))
        return result


def _fp32_bytes(result) -> int:
    """Bytes of the fp32 tensors an op returned."""
    tensors = result if isinstance(result, tuple | list) else (result,)
    return sum(
        tensor.numel() * 4
        for tensor in tensors
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
    )


def _aliases(result, source) -> bool:
    """Whether a view-flagged op's ``result`` is a view of ``source`` (the tuples of ``split`` and
    ``unbind`` are), rather than a copy (``to`` another dtype)."""
    if not isinstance(result, torch.Tensor) or not isinstance(source, torch.Tensor):
        return True
    return result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


# What a tensor made on the host carries while counted (module docstring): its copy to a device syncs.
_HOST_MADE = "_counted_on_host"
# Factories that draw from a generator: on a CPU generator without a device, the draw is on the host.
RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm")


def _device_given(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device (a device, its name, or a tensor whose it takes)."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, torch.device | str | int | torch.Tensor)


@contextlib.contextmanager
def _counted_host_copies(counts: DispatchCounts):
    """While counting, ``torch.tensor``/``torch.as_tensor`` of Python data with a device, and
    ``Tensor.to(device)`` of a tensor made on the host (``_HOST_MADE``) without ``non_blocking``, count
    a sync each (module docstring)."""
    originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor", *RANDOM_FACTORIES)}
    original_to = torch.Tensor.to

    def from_data(name):
        def made(data, *args, **kwargs):
            tensor = originals[name](data, *args, **kwargs)
            if not isinstance(data, torch.Tensor):
                if kwargs.get("device") is not None:
                    counts.sync(f"{name}(device=)")
                else:
                    setattr(tensor, _HOST_MADE, True)
            return tensor

        return made

    def drawn(name):
        def made(*args, **kwargs):
            tensor = originals[name](*args, **kwargs)
            generator = kwargs.get("generator")
            if kwargs.get("device") is None and generator is not None and generator.device.type == "cpu":
                setattr(tensor, _HOST_MADE, True)
            return tensor

        return made

    def moved(tensor, *args, **kwargs):
        arriving = getattr(tensor, _HOST_MADE, False) and _device_given(args, kwargs)
        if arriving and not kwargs.get("non_blocking"):
            counts.sync("to(device)")
        result = original_to(tensor, *args, **kwargs)
        if arriving and result is tensor:  # on CPU the host tensor itself stands for the device's copy
            delattr(result, _HOST_MADE)
        return result

    wrapped = {"tensor": from_data("tensor"), "as_tensor": from_data("as_tensor")}
    wrapped |= {name: drawn(name) for name in RANDOM_FACTORIES}
    with contextlib.ExitStack() as stack:
        for name, function in wrapped.items():
            stack.enter_context(mock.patch.object(torch, name, function))
        stack.enter_context(mock.patch.object(torch.Tensor, "to", moved))
        yield


@contextlib.contextmanager
def count_dispatch():
    """``with count_dispatch() as counts: ...``: ``counts.ops`` and ``counts.syncs`` of the block."""
    counts = DispatchCounts()
    original_tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        counts.sync("tolist")
        return original_tolist(tensor)

    torch.Tensor.tolist = counted_tolist
    token = _ACTIVE.set(counts)
    try:
        with _counted_host_copies(counts), _Counter(counts):
            yield counts
    finally:
        _ACTIVE.reset(token)
        torch.Tensor.tolist = original_tolist


def compiled_kernels(function, *args) -> Counter:
    """Kernels one call of ``function`` (``torch.compile``d) launches, by kind: ``fused`` for inductor's
    own kernels (C++ on CPU, Triton on CUDA), the library call's name (``extern_kernels.mm``) or the
    aten fallback's (``torch.ops.aten.sort.default``) for the others. Read from the ``call`` of the code
    inductor generates (``run_and_get_code``, which empties torch._dynamo's caches first, so the call
    compiles): straight-line code, one line per launch. Allocations and views launch nothing."""
    _, sources = run_and_get_code(function, *args)
    kernels = Counter()
    for source in sources:
        fused = set(re.findall(r"^(\w+) = async_compile\.", source, re.M))
        call = source[source.index("def call(") :]
        call = re.split(r"\n(?=\S| {0,4}def )", call, maxsplit=1)[0]  # up to the next definition
        for name in re.findall(LAUNCH, call, re.M):
            if name in fused:
                kernels["fused"] += 1
            elif "." in name:
                kernels[name] += 1
    return kernels


# A statement of inductor's ``call`` that may launch: ``name(...)``, ``name.run(...)`` (Triton) or
# ``buf = name(...)``, the name a fused kernel's, a library call's or an aten op's.
LAUNCH = r"^ +(?:\w+ = )?((?:extern_kernels|torch\.ops\.\w+)\.[\w.]+|\w+)(?:\.run)?\("


def count_parser(description: str, methods: Sequence[str]) -> argparse.ArgumentParser:
    """The command line of the op-count tables (``construction_counts``, ``decode_counts``): the
    prompt lengths, the ratio and the methods counted."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # 4K by default: at 32K a count holds more than 24 GB of host memory (more than this project's CPU
    # machine has), which a GPU machine's host has.
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--methods", nargs="+", default=list(methods))
    return parser
