"""What machine a run or a measurement ran on, without importing torch: the CPU's and the GPU's names,
the name a calibration file is kept under, and the machine block records and reports carry.

It sits on the ground floor of ``scripts``: the harness, the dry run and the measurement scripts
read it, and it reads none of them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

CPU_INFO = Path("/proc/cpuinfo")


def cpu_model(cpu_info: Path = CPU_INFO) -> str | None:
    """The CPU's model name (Linux's ``/proc/cpuinfo``, else the platform's processor string; None if
    neither names one). fp32 results can differ between CPU models at near ties, so records name it."""
    with contextlib.suppress(OSError):
        for line in cpu_info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or None


def cpu_name() -> str:
    """The CPU's model name and core count: CPU rates depend on both."""
    return f"{cpu_model() or platform.machine()} {os.cpu_count()} cores"


def nvidia_smi(*query: str) -> str | None:
    """``nvidia-smi``'s answer to ``query``, stripped; None without a driver or an answer."""
    try:
        answer = subprocess.run(
            ["nvidia-smi", *query], capture_output=True, text=True, check=False, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return answer or None


def gpu_name(index: int) -> str | None:
    """GPU ``index``'s name as the driver gives it (torch's ``get_device_name`` too), or None."""
    return nvidia_smi(f"--id={index}", "--query-gpu=name", "--format=csv,noheader")


def device_name(device: str) -> str:
    """The name of the device a plan's ``backbone.device`` runs on."""
    if device == "cpu":
        return cpu_name()
    index = int(device.removeprefix("cuda:")) if device.startswith("cuda:") else 0
    return gpu_name(index) or cpu_name()


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def machine() -> dict[str, Any]:
    """What ran a measurement: the CPU's model, cores, load average, versions and, where this process
    has loaded torch (this module never imports it), its threads and, with CUDA, the GPU, its driver
    and CUDA version."""
    torch = sys.modules.get("torch")
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else importlib.metadata.version("torch"),
        "transformers": importlib.metadata.version("transformers"),
    }
    if torch is None:
        return info
    info |= {"torch_threads": torch.get_num_threads(), "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        driver = nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
        info |= {"gpu": torch.cuda.get_device_name(), "driver": driver, "cuda": torch.version.cuda}
    return info
