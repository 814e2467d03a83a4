"""The memory rule a sample's decode batches of views are cut by (``reskv.batching``), with a faked
allocator: what the device can still give, what the construction holds meanwhile, what a batch of views
adds, and the paper grid at 32K on an H100."""

from __future__ import annotations

import dataclasses

import pytest

from reskv.batching import (
    DeviceMemory,
    ModelShape,
    ViewRow,
    memory_limit,
    sample_memory_limit,
    view_batch_bytes,
    view_batches,
    view_step_slots,
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
    assert LLAMA_8B.kv_slot_bytes == 2 * 128 * 2  # a slot's key and value in bf16, at a layer and KV head


def test_the_sample_limit_is_the_rule_with_the_devices_distance_block():
    memory = DeviceMemory(total=64 * GIB, free=30 * GIB, reserved=20 * GIB, allocated=18 * GIB)
    construction = LLAMA_8B.construction_bytes(32768, 1, 128, 2 * GIB)
    expected = int((32 * GIB - construction) * 0.8)
    assert sample_memory_limit(LLAMA_8B, memory, 32768, 1, 128) == expected


def test_a_batch_of_views_holds_masks_entries_appended_slots_adjusted_values_and_a_step_s_logits():
    """By hand at the 8B shape, 32,768 shared slots, 64 appended: two rows without entries, one with 655
    entries a head, one reading CaM's adjusted values. Per layer and KV head (256): 4 masks of 32,768
    bytes, 655 entries of keys, values (2 x 128 x 2 bytes) and an fp32 bias, 4 x 64 appended keys and
    values; per layer each row's 64 fp32 appended biases; one adjusted values tensor (256 x 32,768 x 128
    x 2); and one layer's fp32 logits of 4 rows' 32 query heads over the shared slots and the 655
    entries."""
    rows = [ViewRow(), ViewRow(), ViewRow(655), ViewRow(0, ("cam", "aware"))]
    expected = (
        4 * 32768 * 256
        + 655 * 256 * (2 * 128 * 2 + 4)
        + 4 * 64 * (256 * 2 * 128 * 2 + 32 * 4)
        + 256 * 32768 * 128 * 2
        + 4 * 32 * (32768 + 655) * 4
    )
    assert view_batch_bytes(rows, LLAMA_8B, 32768, 64) == expected
    # ratio 0.9 of 32,768: b = 3,276, and the proxy's largest share 0.2 gives 655; the full cache none
    assert ViewRow.planned(32768, 0.9, (0.0, 0.05, 0.2)).entry_slots == 655
    assert ViewRow.planned(32768, None, (0.2,)).entry_slots == 0 == ViewRow.planned(32768, 0.9).entry_slots
    # the main cache keeps the rest of the budget: 3,276 - 655 and 3,276 shared slots; the full cache all
    assert ViewRow.planned(32768, 0.9, (0.0, 0.05, 0.2)).kept_slots == 2621
    assert ViewRow.planned(32768, 0.9).kept_slots == 3276 and ViewRow.planned(32768, None).kept_slots is None


def test_a_step_reads_the_shared_slots_once_and_an_adjusted_values_tensor_at_its_rows_kept_slots():
    """By hand, 100 shared slots and 4 appended, a slot's key and value being 1: the shared slots once
    (100); CaM's aware values at the 40 slots its larger row keeps, its agnostic values at 30, another
    key's values at every slot, half a slot each ((40 + 30 + 100) / 2); 5 entries; 5 rows' 4 appended."""
    aware, agnostic = ("cam", "aware"), ("cam", "agnostic")
    rows = [ViewRow(), ViewRow(0, aware, 40), ViewRow(0, aware, 10), ViewRow(5, agnostic, 30)]
    rows.append(ViewRow(0, "x"))
    assert view_step_slots(rows, 100, 4) == 100 + (40 + 30 + 100) / 2 + 5 + 5 * 4
    assert view_step_slots([ViewRow(0, aware, 400)], 100, 0) == 100 + 100 / 2  # at most every shared slot


@pytest.mark.parametrize(
    ("limit", "max_rows", "expected"),
    [
        (None, None, [[0, 2, 4, 1, 3]]),  # one batch, CaM's rows (1, 3) together after the others
        (None, 2, [[0, 2], [4, 1], [3]]),  # the fewest batches of at most 2 rows
        (1300, None, [[0, 2, 4], [1, 3]]),  # 1,500 in one; 300 and 1,200 in two
        (1150, None, [[0], [2], [4], [1], [3]]),  # [4, 1] takes 1,200: rows alone
        (50, None, [[0], [2], [4], [1], [3]]),  # a row beyond the limit on its own decodes alone
    ],
)
def test_views_go_in_the_fewest_equal_batches_within_the_memory_and_the_row_cap(limit, max_rows, expected):
    """A tiny shape (one layer and KV head, no query head's logits): a row's mask over 100 shared slots
    is 100 bytes, and CaM's rows read one adjusted values tensor of 100 x 5 x 2 bytes, once a batch."""
    shape = ModelShape(layers=1, kv_heads=1, query_heads=0, head_dim=5, dtype_bytes=2)
    cam = ("cam", "aware")
    rows = [ViewRow(), ViewRow(0, cam), ViewRow(), ViewRow(0, cam), ViewRow()]
    assert view_batch_bytes(rows[:1], shape, 100, 0) == 100
    assert view_batch_bytes(rows[1:4], shape, 100, 0) == 300 + 1000
    assert view_batches(rows, shape, limit, 100, 0, max_rows) == expected


@pytest.mark.parametrize("card", ["h100", "h200"])
def test_the_paper_grid_at_32k_decodes_in_one_batch_of_views_in_the_dry_run_and_the_grid(card, tmp_path):
    """configs/grid/paper_ruler.yaml's 73 configurations at 32K, the 8B shape, the committed H100
    calibration's weights (14.96 GiB of bf16) on an H100 (81,559 MiB) or an H200 (143,771 MiB): the dry
    run cuts the grid's rule on the rows the grid plans (``ViewRow.planned``, the answer's steps fed),
    an allocator holding the weights and both prefilled caches; one batch of every row, its views
    beside the held tensors and the construction under 90% of the card."""
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
    total = {"h100": h100.memory_bytes, "h200": 143_771 << 20}[card]
    on_card = dataclasses.replace(h100, memory_bytes=total)
    load = workload.task_workload(plan, "niah_single_1")  # 128 answer tokens: 32,640 prompt tokens
    planned = cost.decode_batches(plan, plan.grid, load, on_card)
    assert [len(batch) for batch in planned] == [73]

    # The grid's side, by its own inputs: the rows' planned views, the faked allocator, the shape.
    prompt, context = load.prompt_tokens, load.prompt_tokens - load.question_tokens
    shares = (0.0, 0.05, 0.10, 0.15, 0.20, 0.10)  # the residual's grid and its fixed ratio
    rows = [
        ViewRow.planned(
            prompt if e.setting != "agnostic" else context, e.ratio, shares if "+" in e.method else ()
        )
        for e in plan.grid
    ]
    held = h100.weights_bytes + (prompt + context) * 32 * 8 * 2 * 128 * 2  # weights, both caches
    memory = DeviceMemory.holding(total, held)
    limit = sample_memory_limit(LLAMA_8B, memory, prompt, 2, 128)
    appended = load.question_tokens + load.answer_tokens
    assert view_batches(rows, LLAMA_8B, limit, prompt, appended, None) == [list(range(73))]
    construction = LLAMA_8B.construction_bytes(prompt, 2, 128, total // 32)
    peak = held + construction + view_batch_bytes(rows, LLAMA_8B, prompt, appended)
    assert peak < 0.9 * total, f"planned peak {peak / GIB:.1f} GiB of {total / GIB:.1f}"
