"""The shared measurement helper (scripts.measure) against allocations of known size."""

from __future__ import annotations

import torch

from scripts.measure import machine, peak_allocated, peak_memory, random_prompt

MIB = 2**20


def test_peak_memory_rises_by_at_least_a_tensor_allocated_in_the_block():
    with peak_memory("cpu") as idle:
        pass
    with peak_memory("cpu") as busy:
        held = torch.ones(64 * MIB // 4)  # ones: every page written, so resident
        del held
    assert busy.bytes - idle.bytes >= 64 * MIB


def test_peak_allocated_counts_what_is_held_at_once_not_the_sum():
    _before = torch.ones(MIB // 4)  # allocated before the block: not counted
    with peak_allocated("cpu") as peak:
        for _ in range(3):
            transient = torch.ones(4 * MIB // 4)
            del transient
    assert peak.bytes == 4 * MIB


def test_random_prompt_draws_from_the_vocabulary_as_torch_randint_does():
    prompt = random_prompt(range(100, 40000), 500, seed=3)
    generator = torch.Generator().manual_seed(3)
    assert prompt == torch.randint(100, 40000, (500,), generator=generator).tolist()
    assert set(random_prompt([7, 11], 50, seed=0)) == {7, 11}


def test_machine_names_the_cores_threads_and_load():
    info = machine()
    assert info["torch_threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    assert len(info["load_average"]) == 3 and info["cpu_count"] >= 1
