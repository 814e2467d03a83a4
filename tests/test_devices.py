"""The GPU each launcher job runs on, checked on CPU with a faked device count, and the CPU's name."""

from __future__ import annotations

import platform

import pytest
import torch

import run
from scripts.harness.devices import cpu_model, job_device, use_device
from scripts.harness.plan import compose_plan


@pytest.fixture
def four_gpus(monkeypatch):
    """torch sees 4 CUDA devices; ``set_device`` calls are recorded, not made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


def test_each_launcher_job_gets_its_own_gpu(four_gpus, monkeypatch, tmp_path):
    assert [job_device("auto", number) for number in range(6)] == [f"cuda:{n}" for n in (0, 1, 2, 3, 0, 1)]
    assert job_device("cuda", 7) == "cuda:3"
    assert job_device("cuda:2", 5) == "cuda:2" and job_device("cpu", 5) == "cpu"
    assert job_device("auto", None) == "auto"  # not a sweep: the run's own choice
    use_device("cuda:3")
    use_device("cpu")
    assert four_gpus == [3]
    # run.py's job 6 loads its backbone on cuda:2, made the current device first.
    loaded = []

    def load_backbone(name, dtype, device):
        loaded.append(device)
        raise KeyboardInterrupt

    monkeypatch.setattr("reskv.backbones.load_backbone", load_backbone)
    plan = compose_plan(["backbone=llama3.1-8b-instruct", f"results_dir={tmp_path}"])
    with pytest.raises(KeyboardInterrupt):
        run.run(plan, None, job_number=6)
    assert loaded == ["cuda:2"] and four_gpus == [3, 2]


def test_one_visible_gpu_keeps_the_configured_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert job_device("auto", 3) == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert job_device("auto", 3) == "auto"


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
