"""Shared fixtures: tiny random Llama / Qwen2 backbones (no download) and their prefilled layers."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reskv.attention import joint_attention, joint_buffers
from reskv.backbones import tiny_backbone

# pytest-xdist's workers share the machine's cores: each takes its share of torch's threads, and
# passes it on to the processes it starts (`run.py`, scripts), which would otherwise each take every
# core, and their OpenMP threads, two per core, spin for one another's time slices.
WORKER_THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(WORKER_THREADS)
os.environ["OMP_NUM_THREADS"] = str(WORKER_THREADS)

# (architecture, query heads, KV heads): both architectures, GQA group sizes 1 and > 1.
TINY_CONFIGS = [
    ("tiny-llama", 4, 4),
    ("tiny-llama", 4, 2),
    ("tiny-qwen2", 6, 2),
    ("tiny-qwen2", 2, 2),
]
TINY_IDS = [f"{arch}-h{heads}-kv{kv}" for arch, heads, kv in TINY_CONFIGS]
# The token ids the tests' random prompts draw from (``scripts.measure.random_prompt``): none of the
# embedded tokenizer's special ids (0-2), so no prompt holds an end-of-text token.
TOKENS = range(100, 40000)
# `python run.py` on the tiny random backbone, one RULER vt sample, two answer tokens: seconds.
TINY_RUN = [
    sys.executable,
    "run.py",
    "backbone=tiny-llama",
    "benchmark.length=1024",
    "benchmark.tasks=[vt]",
    "num_samples=1",
    "max_new_tokens=2",
]


@functools.cache
def cached_tiny_backbone(arch: str, heads: int, kv_heads: int):
    return tiny_backbone(arch, num_attention_heads=heads, num_key_value_heads=kv_heads)


@pytest.fixture(params=TINY_CONFIGS, ids=TINY_IDS)
def tiny(request):
    """A tiny backbone of each architecture / group size."""
    return cached_tiny_backbone(*request.param)


def start_interruptible(command: list[str], **popen_options) -> subprocess.Popen:
    """``command`` started in the repository root with SIGINT at its default in the child, so Python
    turns it into KeyboardInterrupt even when the tests themselves were started with SIGINT ignored
    (a background job of a non-interactive shell inherits SIG_IGN, and Python then installs no
    handler)."""
    return subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parent.parent,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **popen_options,
    )


def journaled_samples(runs_dir: Path) -> int:
    """Sample records (lines after the header) in the journals under ``runs_dir`` right now.

    A run deletes a journal right after its finished file is renamed into place, so a journal
    listed by ``rglob`` may be gone by the time it is read: it counts as empty.
    """
    count = 0
    for path in runs_dir.rglob("*.jsonl"):
        try:
            count += max(len(path.read_bytes().splitlines()) - 1, 0)
        except FileNotFoundError:
            continue
    return count


# Triton reads TRITON_INTERPRET when it is imported, so a kernel runs under its interpreter in a child
# process: it reads the cases, calls the kernel on each and writes the results back.
INTERPRETED_KERNEL = """
import importlib, sys, torch
module, name = sys.argv[1].split(":")
kernel = getattr(importlib.import_module(module), name)
cases = torch.load(sys.argv[2], weights_only=False)  # the test's own file (GateTerms in it)
torch.save([kernel(*case) for case in cases], sys.argv[3])
"""


def interpreted(kernel: str, cases: list[tuple], tmp_path: Path) -> list:
    """``kernel`` (``"module:function"``, a Triton kernel's launcher) called on each case on CPU tensors
    under Triton's interpreter (``TRITON_INTERPRET=1``), in a child process; its results."""
    inputs, outputs = tmp_path / "cases.pt", tmp_path / "out.pt"
    torch.save(cases, inputs)
    subprocess.run(
        [sys.executable, "-c", INTERPRETED_KERNEL, kernel, str(inputs), str(outputs)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        check=True,
    )
    return torch.load(outputs)


def separate_attention(
    queries, main_keys, main_values, main_bias, residual_keys, residual_values, residual_log_counts,
    scaling, rule, evicted_fraction=None,
):  # fmt: skip
    """``reskv.attention.joint_attention`` (the spec's form of the decode rule) over a main cache and
    residual entries given apart, as ``joint_buffers`` lays them out in a compressed layer: outputs
    ``[H_kv, Q, d]`` for grouped queries ``[H_kv, Q, d]``; ``main_bias`` carries padding (0 or -inf)."""
    keys, values, bias = joint_buffers(
        residual_keys, residual_values, residual_log_counts, main_keys, main_values, main_bias, rule
    )
    return joint_attention(
        queries, keys, values, bias, residual_keys.shape[1], scaling, rule, evicted_fraction
    )[0]


def state_attention(state, queries, scaling, rule):
    """``separate_attention`` over a ``CompressedLayerState`` as compressed (nothing appended)."""
    residual = state.residual
    return separate_attention(
        queries, state.main_keys, state.main_values, state.main_bias,
        residual.keys, residual.values, residual.log_counts, scaling, rule, state.evicted_fraction,
    )  # fmt: skip
