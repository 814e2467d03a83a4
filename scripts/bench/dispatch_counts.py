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
  reads memory without dispatching, so it is counted by a wrapper for the duration of the count).

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

    def op(self, name: str) -> None:
        self.ops += 1
        self.by_op[name] += 1
        self.ops_by_stage[_STAGE.get()] += 1

    def sync(self, name: str) -> None:
        self.syncs += 1
        self.syncs_by_op[name] += 1
        self.syncs_by_stage[_STAGE.get()] += 1


# The stage counted ops and syncs are attributed to (``stage``).
_STAGE: contextvars.ContextVar[str] = contextvars.ContextVar("stage", default="other")


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
            self.counts.op(func.overloadpacket.__name__)
        return result


def _aliases(result, source) -> bool:
    """Whether a view-flagged op's ``result`` is a view of ``source`` (the tuples of ``split`` and
    ``unbind`` are), rather than a copy (``to`` another dtype)."""
    if not isinstance(result, torch.Tensor) or not isinstance(source, torch.Tensor):
        return True
    return result.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


@contextlib.contextmanager
def count_dispatch():
    """``with count_dispatch() as counts: ...``: ``counts.ops`` and ``counts.syncs`` of the block."""
    counts = DispatchCounts()
    original_tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        counts.sync("tolist")
        return original_tolist(tensor)

    torch.Tensor.tolist = counted_tolist
    try:
        with _Counter(counts):
            yield counts
    finally:
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
