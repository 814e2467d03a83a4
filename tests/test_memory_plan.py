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
from scripts.harness.dry_run import cost, rates, workload
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


def test_the_paper_grid_at_32k_on_an_h100_plans_the_same_batches_in_the_dry_run_and_the_grid(tmp_path):
    """configs/grid/paper_ruler.yaml's 73 configurations at 32K, the 8B shape, the committed H100
    calibration (81,559 MiB, 14.96 GiB of bf16 weights): the dry run's batches are the grid's rule on
    the rows the grid predicts (``predicted_slots``, the answer's steps fed), an allocator holding the
    weights and both prefilled caches; every batch's stacked cache and states, beside the held
    tensors and the construction, stay under 90% of the card, in a few batches (not one per row)."""
    plan = compose_plan(
        [
            "grid=paper_ruler",
            "backbone=llama3.1-8b-instruct",
            "benchmark.length=32768",
            "decode_batch=auto",
            f"results_dir={tmp_path}",
        ]
    )
    assert len(plan.grid) == 73
    h100 = rates.read_rates(rates.CALIBRATION_DIR / "nvidia-h100-80gb-hbm3.json", plan.backbone)
    load = workload.task_workload(plan, "niah_single_1")  # 128 answer tokens: 32,640 prompt tokens
    planned = cost.decode_batches(plan, plan.grid, load, h100)
    assert sorted(plan.grid.index(entry) for batch in planned for entry in batch) == list(range(73))

    # The grid's side, by its own inputs: the rows' predicted slots, the faked allocator, the shape.
    prompt, context, feeds = load.prompt_tokens, load.prompt_tokens - load.question_tokens, load.answer_tokens
    slots = [predicted_slots(prompt, context, e.ratio, e.setting or "aware", feeds) for e in plan.grid]
    held = h100.weights_bytes + (prompt + context) * 32 * 8 * 2 * 128 * 2  # weights, both caches
    memory = DeviceMemory(
        total=h100.memory_bytes, free=h100.memory_bytes - held, reserved=held, allocated=held
    )
    batches, limit = sample_batches(slots, LLAMA_8B, memory, prompt, 2, 128, None)
    assert [[plan.grid[row] for row in batch] for batch in batches] == planned

    construction = LLAMA_8B.construction_bytes(prompt, 2, 128, h100.memory_bytes // 32)
    largest = max(
        (len(batch) * max(slots[row] for row in batch) + sum(slots[row] for row in batch))
        * LLAMA_8B.slot_bytes
        for batch in batches
    )
    assert largest <= limit
    peak = held + construction + largest
    assert peak < 0.9 * h100.memory_bytes, (
        f"planned peak {peak / GIB:.1f} GiB of {h100.memory_bytes / GIB:.1f}"
    )
    assert 2 <= len(batches) <= 6, [len(batch) for batch in batches]
