"""The GPU each launcher job holds, checked on CPU with faked devices, and the CPU's name."""

from __future__ import annotations

import contextlib
import gc
import platform
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import reskv.backbones
import run
from reskv.decoding import compiled_step
from scripts.harness import devices
from scripts.harness.devices import job_device
from scripts.harness.plan import PlanError, compose_plan
from scripts.machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def four_gpus(monkeypatch):
    """torch sees 4 CUDA devices; ``set_device`` calls are recorded, not made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


def test_run_loads_its_backbone_on_the_gpu_its_job_holds(four_gpus, monkeypatch, tmp_path):
    """run.py's job loads its backbone on the GPU it holds, made the current device first."""
    loaded = []

    def load_backbone(name, dtype, device):
        loaded.append(device)
        raise KeyboardInterrupt

    monkeypatch.setattr("reskv.backbones.load_backbone", load_backbone)
    monkeypatch.setattr(devices, "LOCK_DIR", tmp_path)
    plan = compose_plan(["backbone=llama3.1-8b-instruct", f"results_dir={tmp_path}"])
    with job_device("auto", True, gpus=4, lock_dir=tmp_path), pytest.raises(KeyboardInterrupt):
        run.run(plan, None, job_number=6)  # cuda:0 is held by another job
    assert loaded == ["cuda:1"] and four_gpus == [1]
    assert compose_plan(["jobs_per_gpu=2", f"results_dir={tmp_path}"]).jobs_per_gpu == 2
    with pytest.raises(PlanError, match="jobs_per_gpu 0"):
        compose_plan(["jobs_per_gpu=0", f"results_dir={tmp_path}"])


def test_jobs_take_the_first_free_gpu_slot_and_wait_while_every_slot_is_held(tmp_path):
    """Two faked GPUs, one slot each: two jobs at once hold cuda:0 and cuda:1, a third waits until
    one ends and then takes its GPU; with two slots a GPU, four jobs hold cuda:0, cuda:1, cuda:0,
    cuda:1. Outside a sweep, an explicit device or a single GPU, the configured device is kept."""
    with job_device("auto", True, gpus=2, lock_dir=tmp_path) as first:
        with job_device("cuda", True, gpus=2, lock_dir=tmp_path) as second:
            assert (first, second) == ("cuda:0", "cuda:1")
            taken = []
            third = threading.Thread(target=lambda: taken.append(held_for(tmp_path, 0.0)))
            third.start()
            third.join(timeout=2 * devices.WAIT_S)
            assert third.is_alive() and taken == []  # every slot held: it waits
        third.join(timeout=5 * devices.WAIT_S)
        assert taken == ["cuda:1"]
    with contextlib.ExitStack() as jobs:
        held = [jobs.enter_context(job_device("auto", True, 2, gpus=2, lock_dir=tmp_path)) for _ in range(4)]
    assert held == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [held_for(tmp_path, 0.0, configured) for configured in ("cuda:1", "cpu")] == ["cuda:1", "cpu"]
    with job_device("auto", False, gpus=4, lock_dir=tmp_path) as alone:
        assert alone == "auto"  # not a sweep: the run's own choice
    with job_device("auto", True, gpus=1, lock_dir=tmp_path) as one:
        assert one == "auto"


def held_for(lock_dir: Path, seconds: float, configured: str = "auto") -> str:
    with job_device(configured, True, gpus=2, lock_dir=lock_dir) as device:
        time.sleep(seconds)
        return device


CONCURRENT_JOB = """
import sys, time
from pathlib import Path
from scripts.harness.devices import job_device
with job_device("auto", True, gpus=2, lock_dir=Path(sys.argv[1])) as device:
    print(device, flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_two_concurrent_jobs_in_their_own_processes_hold_two_gpus(tmp_path):
    """Two processes started together (as a launcher's workers) on a node of two faked GPUs: each
    holds its own; a job that dies lets its GPU go (the lock is the process's)."""
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_JOB, str(tmp_path), "3"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    devices_held = sorted(job.stdout.readline().strip() for job in jobs)
    assert devices_held == ["cuda:0", "cuda:1"]
    jobs[0].kill()
    jobs[0].wait()
    freed = subprocess.run(
        [sys.executable, "-c", CONCURRENT_JOB, str(tmp_path), "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    jobs[1].wait()
    assert freed.stdout.strip() in devices_held


def test_a_job_lets_go_of_its_model_and_its_compiled_steps_when_it_ends(monkeypatch, tmp_path):
    """``run.run`` of a tiny grid decoded compiled: when it returns, the compiled step's cache is empty
    and the model it loaded is gone (a reused launcher worker holds none of it)."""
    loaded = []
    load_backbone = reskv.backbones.load_backbone

    def recorded(*args, **kwargs):
        backbone = load_backbone(*args, **kwargs)
        loaded.append(weakref.ref(backbone.model))
        return backbone

    monkeypatch.setattr(reskv.backbones, "load_backbone", recorded)
    plan = compose_plan(
        [
            "backbone=tiny-llama",
            "benchmark.length=1024",
            "benchmark.tasks=[vt]",
            "num_samples=1",
            "max_new_tokens=2",
            "method=[snapkv]",
            "ratio=0.6",
            "setting=aware",
            "decode=compiled",
            f"results_dir={tmp_path}",
        ]
    )
    run.run(plan, None, job_number=0)
    gc.collect()
    assert len(loaded) == 1 and loaded[0]() is None
    assert compiled_step.cache_info().currsize == 0


def test_cpu_model_reads_the_first_model_name_of_cpuinfo(tmp_path):
    cpu_info = tmp_path / "cpuinfo"
    cpu_info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n\n"
        "processor\t: 1\nmodel name\t: another\n"
    )
    assert cpu_model(cpu_info) == "AMD EPYC 7B13 64-Core Processor"
    cpu_info.write_text("processor\t: 0\nmodel name\t:\n")  # named by nothing: the platform's string
    assert cpu_model(cpu_info) == (platform.processor() or None)
    assert cpu_model(tmp_path / "absent") == (platform.processor() or None)
