"""The memory rule a sample's decode batches are cut by (``reskv.batching``), with a faked allocator:
what the device can still give, what the construction holds meanwhile, and the paper grid at 32K on
an H100."""

from __future__ import annotations

from reskv.batching import (
    DeviceMemory,
    ModelShape,
    decode_batches,
    memory_limit,
    predicted_slots,
    sample_batches,
    sample_memory_limit,
)
from scripts.harness.plan import compose_plan

GIB = 1 << 30
# Llama-3.1-8B-Instruct's attention (its config.json) in bf16.
LLAMA_8B = ModelShape(layers=32, kv_heads=8, query_heads=32, head_dim=128, dtype_bytes=2)


def test_what_a_device_can_still_give_counts_the_allocators_reserved_but_unused_bytes():
    """10 GiB free to the driver, 6 GiB reserved by the allocator of which 4 GiB allocated: 12 GiB can
    still be taken; with 2 GiB set aside for the construction, a batch gets 0.8 x 10 GiB."""
    memory = DeviceMemory(total=80 * GIB, free=10 * GIB, reserved=6 * GIB, allocated=4 * GIB)
    assert memory.available == 12 * GIB
    assert memory_limit(memory, 2 * GIB) == int(0.8 * 10 * GIB)
    assert memory_limit(None, 2 * GIB) is None
    assert memory_limit(memory, 20 * GIB) == 0  # a construction beyond the device: rows decode alone


def test_a_construction_holds_its_stacked_copies_its_fp32_points_and_a_distance_block():
    """At the 8B shape and 32K tokens, by hand: per setting, every layer's keys and values
    (2 x 8 heads x 32,768 x 128 x 2 bytes x 32 layers = 4 GiB) and 128 observed queries of 32 heads
    (32 MiB); one fp32 copy of every head's points (8 x 32,768 x 128 x 4 x 32 = 4 GiB); the distance
    block, a 32nd of an 80 GiB card (2.5 GiB)."""
    construction = LLAMA_8B.construction_bytes(
        32768, settings=2, observed_queries=128, distances=80 * GIB // 32
    )
    assert construction == 2 * (4 * GIB + 32 * (1 << 20)) + 4 * GIB + int(2.5 * GIB)
    # a slot of a stacked cache: keys and values in bf16, an fp32 bias, an entry mark, per KV head and layer
    assert LLAMA_8B.slot_bytes == 32 * 8 * (2 * 128 * 2 + 4 + 1)


def test_the_sample_limit_is_the_rule_with_the_devices_distance_block():
    memory = DeviceMemory(total=64 * GIB, free=30 * GIB, reserved=20 * GIB, allocated=18 * GIB)
    construction = LLAMA_8B.construction_bytes(32768, 1, 128, 2 * GIB)
    expected = int((32 * GIB - construction) * 0.8)
    assert sample_memory_limit(LLAMA_8B, memory, 32768, 1, 128) == expected


def test_the_predicted_slots_hold_the_budget_the_question_and_the_fed_tokens():
    """A 1,000-token prompt of which 900 are context, 32 tokens fed: aware at 0.9 keeps 100 of the
    1,000, agnostic 90 of the 900; both hold the 100 question slots (masked where not fed); the full
    cache keeps its whole prompt."""
    assert predicted_slots(1000, 900, 0.9, "aware", 32) == 100 + 100 + 32
    assert predicted_slots(1000, 900, 0.9, "agnostic", 32) == 90 + 100 + 32
    assert predicted_slots(1000, 900, None, "aware", 32) == 1000 + 100 + 32


def test_the_quality_copy_of_each_row_counts_against_the_limit():
    """Rows of 10 slots, 1 byte a slot, a limit of 60: two rows take 2 x 10 + 20 = 40 (fit), three 30
    + 30 = 60 (fit); with each row's cache before the question kept (2 copies) two take 20 + 40 = 60
    and three 30 + 60 = 90 (do not)."""
    assert decode_batches([10, 10, 10], 1, 60, None) == [[0, 1, 2]]
    assert decode_batches([10, 10, 10], 1, 60, None, state_copies=2) == [[0, 1], [2]]


# nvidia-smi's memory.total of an H100 80GB HBM3 (81,559 MiB); the weights of the 8B shape in bf16
# (results/gpu/README.md, 14.96 GiB) and the prefilled caches of a 32K sample: the context's and the
# whole prompt's (each 4 GiB there: the full cache's "KV cache GiB" at 32,768).
H100_BYTES = 81559 << 20
WEIGHTS = int(14.96 * GIB)


def paper_grid(tmp_path) -> list:
    """The configurations of configs/grid/paper_ruler.yaml, as the runner plans them."""
    overrides = ["grid=paper_ruler", "backbone=llama3.1-8b-instruct", "benchmark.length=32768"]
    return compose_plan([*overrides, f"results_dir={tmp_path}"]).grid


def test_the_paper_grid_at_32k_on_an_h100_plans_batches_whose_peak_stays_under_90_percent(tmp_path):
    """The grid's and the dry run's rule (``sample_batches``) at the 8B shape, a 32K RULER prompt (64
    question tokens, 128 fed), a faked H100 allocator holding the weights and both prefilled caches:
    every batch's stacked cache and states, beside the held tensors and the construction, stay under
    90% of the card, and the grid takes a few batches (not one per row)."""
    prompt, question, feeds = 32768 - 128, 64, 128
    grid = paper_grid(tmp_path)
    assert len(grid) == 73
    slots = [predicted_slots(prompt, prompt - question, e.ratio, e.setting or "aware", feeds) for e in grid]
    held = WEIGHTS + 2 * 4 * GIB
    reserved = held + 3 * GIB  # what the prefills' activations left in the allocator's cache
    memory = DeviceMemory(total=H100_BYTES, free=H100_BYTES - reserved, reserved=reserved, allocated=held)
    batches, limit = sample_batches(slots, LLAMA_8B, memory, prompt, 2, 128, None)
    construction = LLAMA_8B.construction_bytes(prompt, 2, 128, H100_BYTES // 32)
    assert sorted(row for batch in batches for row in batch) == list(range(73))
    largest = max(
        (len(batch) * max(slots[row] for row in batch) + sum(slots[row] for row in batch))
        * LLAMA_8B.slot_bytes
        for batch in batches
    )
    assert largest <= limit
    peak = held + construction + largest
    assert peak < 0.9 * H100_BYTES, f"planned peak {peak / GIB:.1f} GiB of {H100_BYTES / GIB:.1f}"
    assert 2 <= len(batches) <= 6, [len(batch) for batch in batches]
