"""Which device a run loads its backbone on (one GPU per launcher job on a node with several), and
what the CPU is called, without torch.

``python run.py -m hydra/launcher=local hydra.launcher.n_jobs=8 ... shard.index=0,1,...,7`` starts
8 jobs in one node's worker processes; each loads its own model, and without a device of its own
every job would load it on the first GPU. A job whose configured device is ``auto`` or ``cuda``
takes the GPU of its job number modulo the visible devices (``CUDA_VISIBLE_DEVICES`` narrows them);
an explicit device (``cuda:3``, ``cpu``), one visible GPU, or a run outside a sweep keep the
configured device as it is.
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

CPU_INFO = Path("/proc/cpuinfo")
SHARED_DEVICES = ("auto", "cuda")  # configured devices a job may be given a GPU of its own for


def job_device(configured: str, job_number: int | None) -> str:
    """The device launcher job ``job_number`` (None: not a sweep) runs on: ``cuda:<job_number mod
    visible GPUs>`` where ``configured`` leaves the GPU open and several are visible, else
    ``configured``."""
    if job_number is None or configured not in SHARED_DEVICES:
        return configured
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return configured
    return f"cuda:{job_number % torch.cuda.device_count()}"


def use_device(device: str) -> None:
    """Make an indexed GPU the current CUDA device of this process, so that what launches on the
    current device (Triton kernels, memory queries, CUDA graphs) runs where the model lies."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(int(device.removeprefix("cuda:")))


def cpu_model(cpu_info: Path = CPU_INFO) -> str | None:
    """The CPU's model name (Linux's ``/proc/cpuinfo``, else the platform's processor string; None if
    neither names one). fp32 results can differ between CPU models at near ties, so records name it."""
    with contextlib.suppress(OSError):
        for line in cpu_info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or None
