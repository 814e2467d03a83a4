"""``reskv/lloyd_kernel.py`` under Triton's interpreter on CPU: a k-means group's entries, read by index
from the keys and values, against the plain per-head loop of the spec."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import reskv.residual
from reskv.config import ResidualConfig
from reskv.residual import ResidualEntries, RowGroup
from tests.conftest import interpreted
from tests.test_construction_plan import plain_entries
from tests.test_loss_kernel import proxies_and_sets

ENTRY_WIDTH = 45  # wider than any group's residual size: the slots past it stay unused


def clustered_fields(*case):
    """``lloyd_kernel.cluster`` of a case, its entries' fields (what the interpreter's child returns)."""
    from reskv import lloyd_kernel  # imports Triton

    return lloyd_kernel.cluster(*case).fields()


def clustered_keys(generator, heads: int, seq_len: int, dim: int, dtype) -> torch.Tensor:
    """Keys drawn around 6 centres a head, as real keys cluster, in ``dtype``."""
    centres = torch.randn(heads, 6, dim, generator=generator) * 4
    member = torch.randint(0, 6, (heads, seq_len), generator=generator)
    keys = centres.gather(1, member[..., None].expand(-1, -1, dim))
    return (keys + torch.randn(heads, seq_len, dim, generator=generator)).to(dtype)


def case(generator, dtype, dim, offsets, point_counts, sizes, rows, iterations, repeated=False, form="ieee"):
    """A group of ``rows`` of ``len(point_counts)`` rows over 3 heads of 150 tokens, the keys and values
    a prefix view of 170 tokens' (``reskv.selection.row_stride``); with ``repeated``, each head's tokens
    are 25 distinct ones, repeated, so that initial centres tie and clusters end empty."""
    num_rows, seq_len = len(point_counts), 150
    keys = clustered_keys(generator, 3, seq_len + 20, dim, dtype)
    values = torch.randn(3, seq_len + 20, dim, generator=generator).to(dtype)
    if repeated:
        keys[:, :seq_len] = keys[:, torch.arange(seq_len) % 25]
        values[:, :seq_len] = values[:, torch.arange(seq_len) % 25]
    keys, values = keys[:, :seq_len], values[:, :seq_len]
    order = torch.stack([torch.randperm(seq_len, generator=generator) for _ in range(num_rows)])
    point_counts, sizes = torch.tensor(point_counts), torch.tensor(sizes)
    group = RowGroup(rows, max(sizes[rows].tolist()), max(point_counts[rows].tolist()), equal_sizes=False)
    entries = ResidualEntries(
        keys.new_zeros(num_rows, ENTRY_WIDTH, dim),
        values.new_zeros(num_rows, ENTRY_WIDTH, dim),
        torch.full((num_rows, ENTRY_WIDTH), float("-inf")),
    )
    offsets = None if offsets is None else torch.tensor(offsets)
    heads = torch.arange(num_rows) % 3
    # The bf16 split on TF32 operands: the interpreter multiplies bf16 ones wrongly (reskv/nearest_kernel.py).
    return (
        keys,
        values,
        heads,
        order,
        offsets,
        point_counts,
        sizes,
        group,
        iterations,
        entries,
        form,
        "tf32",
    )


def within_one_ulp(found: torch.Tensor, plain: torch.Tensor) -> bool:
    """Each of ``found`` is ``plain`` or one of its fp32 neighbours (``log`` rounds by its library)."""
    up, down = torch.nextafter(plain, plain + 1), torch.nextafter(plain, plain - 1)
    return bool(((found == plain) | (found == up) | (found == down)).all())


def empty_slots_of_plain_entries(cases, found_cases) -> int:
    """Asserts that each case's clustered entries (``clustered_fields``) give every row of its group the
    plain per-head loop's entries (``plain_entries``: the row's points ``order[i, offset_i :][:
    point_counts[i]]`` of head ``heads[i]``, its best-scored as the initial centres) bit for bit in the
    keys and values and within one fp32 ulp in the log-counts, the non-empty clusters in centre order
    and the rest unused, and rows outside the group untouched; the unused slots within the rows' sizes."""
    empty_slots = 0
    for (keys, values, heads, order, offsets, counts, sizes, group, iterations, *_), found in zip(
        cases, found_cases, strict=True
    ):
        found_keys, found_values, found_log_counts = found
        for row in range(order.shape[0]):
            used = torch.isfinite(found_log_counts[row])
            if row not in group.rows:
                assert not used.any() and not found_keys[row].any() and not found_values[row].any()
                continue
            start = 0 if offsets is None else int(offsets[row])
            points = order[row, start : start + int(counts[row])].tolist()
            head = int(heads[row])
            plain_keys, plain_values, plain_log_counts = plain_entries(
                keys[head], values[head], points, int(sizes[row]), iterations
            )
            assert used.nonzero().max() < sizes[row]
            assert torch.equal(found_keys[row, used], plain_keys.to(keys.dtype)), row
            assert torch.equal(found_values[row, used], plain_values.to(values.dtype)), row
            assert within_one_ulp(found_log_counts[row, used], plain_log_counts)
            assert not found_keys[row, ~used].any() and not found_values[row, ~used].any()
            empty_slots += int(sizes[row]) - int(used.sum())
    return empty_slots


def test_fused_lloyd_gives_each_row_the_plain_loops_entries(tmp_path):
    """Each case's group, clustered by the kernel, gives every row of it the plain per-head loop's
    entries (``plain_entries``: the row's points ``order[i, offset_i :][: point_counts[i]]`` of head
    ``i % 3``, its ``min(sizes[i], |E|)`` best-scored as the initial centres) bit for bit in the keys and
    values, and its log-counts within one fp32 ulp, the non-empty clusters in centre order and the rest
    unused; rows outside the group, and slots past its size, are untouched. The cases: fp32 keys (IEEE
    and TF32x3 products; both exact on the interpreter) of a head dim that is no power of two, rows
    given out of order, point offsets, sizes and counts of every row its own, one row outside the group;
    bf16 keys (the exact bf16 split), without offsets, one step and three, each head's tokens repeated
    so that initial centres tie and clusters end empty."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    ragged = dict(offsets=[0, 3, 10, 0, 7, 2], point_counts=[140, 120, 100, 90, 143, 60])
    cases = [
        case(
            generator,
            torch.float32,
            24,
            **ragged,
            sizes=[40, 33, 7, 40, 12, 9],
            rows=[0, 1, 3, 4, 2],
            iterations=4,
        )
    ]
    cases += [cases[0][:-2] + ("tf32x3", "tf32")]
    for iterations in (1, 3):
        cases.append(
            case(
                generator, torch.bfloat16, 64, None, [150, 130, 149, 150], [40, 5, 31, 1], [0, 1, 2, 3],
                iterations, repeated=True, form="bf16x3",
            )
        )  # fmt: skip
    found_cases = interpreted("tests.test_lloyd_kernel:clustered_fields", cases, tmp_path)
    assert empty_slots_of_plain_entries(cases, found_cases) > 0  # the repeated tokens left clusters empty


def built_by_the_kernel(keys, values, evicted, scores, sizes):
    """``build_residual`` with its groups clustered by ``lloyd_kernel`` (as ``CUDA_FUSED_LLOYD`` on a GPU),
    IEEE products; the entries' fields, and the groups the kernel clustered."""
    from reskv import lloyd_kernel  # imports Triton

    with (
        mock.patch.object(reskv.residual, "fused_lloyd_form", lambda keys: "ieee"),
        mock.patch.object(lloyd_kernel, "cluster", wraps=lloyd_kernel.cluster) as cluster,
    ):
        entries = reskv.residual.build_residual(keys, values, evicted, scores, sizes, iterations=4)
    return entries.fields(), cluster.call_count


def test_build_residual_clusters_by_the_kernel_where_the_fused_lloyd_form_says(tmp_path):
    """``reskv.residual.cluster_rows`` hands each group to the kernel where ``fused_lloyd_form`` names a
    form: ``build_residual`` of 4 rows over 2 heads (evicted sets and sizes of each its own, one row
    with none) gives the torch path's entries, bit for bit in the keys and values, the log-counts
    within one fp32 ulp."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(1)
    keys = clustered_keys(generator, 2, 120, 32, torch.float32)
    values = torch.randn(2, 120, 32, generator=generator)
    evicted = torch.rand(4, 120, generator=generator) < torch.tensor([0.9, 0.5, 0.7, 0.0])[:, None]
    scores = torch.rand(4, 120, generator=generator)
    sizes = torch.tensor([20, 9, 33, 5])
    plain = reskv.residual.build_residual(keys, values, evicted, scores, sizes, iterations=4)
    [(found, groups)] = interpreted(
        "tests.test_lloyd_kernel:built_by_the_kernel", [(keys, values, evicted, scores, sizes)], tmp_path
    )
    assert groups > 0
    assert torch.equal(found[0], plain.keys) and torch.equal(found[1], plain.values)
    assert within_one_ulp(found[2], plain.log_counts)
    assert torch.isfinite(plain.log_counts).sum(-1).tolist()[3] == 0


class Launches:
    """A Triton kernel's stand-in: each launch's grid and keyword arguments, recorded."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **arguments: self.calls.append((grid, arguments))


def test_the_lloyd_steps_launch_at_the_nearest_centre_kernels_tiles_as_they_are_at_the_call(monkeypatch):
    """The tiles, warps and split operands (the dtype of the centres' parts) are
    ``reskv.nearest_kernel``'s when ``cluster`` runs (a GPU check sets them there): 2 rows of up to 150
    points and 40 centres, 16-point and 8-centre tiles, 4 steps: 4 assignment launches over 2 x 10
    programs, 5 of the centres' (the initial ones, 3 updates, the entries) over 2 x 5."""
    pytest.importorskip("triton")
    from reskv import lloyd_kernel, nearest_kernel

    assign, centres = Launches(), Launches()
    monkeypatch.setattr(lloyd_kernel, "_assign_kernel", assign)
    monkeypatch.setattr(lloyd_kernel, "_centres_kernel", centres)
    for flag, value in (("POINT_TILE", 16), ("CENTER_TILE", 8), ("NUM_WARPS", 2), ("SPLIT_OPERANDS", "tf32")):
        monkeypatch.setattr(nearest_kernel, flag, value)
    generator = torch.Generator().manual_seed(0)
    arguments = case(generator, torch.bfloat16, 64, None, [150, 130], [40, 5], [0, 1], 4, form="bf16x3")
    lloyd_kernel.cluster(*arguments[:-1])  # the split operands: the module's
    assert [grid for grid, _ in assign.calls] == [(2, 10)] * 4
    assert [grid for grid, _ in centres.calls] == [(2, 5)] * 5
    for _, launch in assign.calls:
        assert (launch["POINT_TILE"], launch["CENTER_TILE"], launch["num_warps"]) == (16, 8, 2)
    for _, launch in [*assign.calls, *centres.calls]:
        assert (launch["CENTER_TILE"], launch["num_warps"]) == (8, 2)
        assert launch["center_parts"].dtype == torch.float32  # TF32 operands: the parts in fp32


def nested_case(generator, dtype, dim, iterations, form, repeated=False):
    """Rows over one ranking per head whose centres and points end where their family's do (as a
    validation proxy's candidates of one head and ratio: ``reskv.proxy``), so that each one's initial
    centres are the last of its leader's and its points the last of its leader's: head 0's family of
    sizes 7, 19 and 30; head 1's two equal rows and a row alone; one row outside the group. With
    ``repeated``, each head's tokens are 25 distinct ones, repeated, so that initial centres tie. The
    arguments of ``lloyd_kernel.cluster``, families last."""
    seq_len = 150
    keys = clustered_keys(generator, 2, seq_len, dim, dtype)
    values = torch.randn(2, seq_len, dim, generator=generator).to(dtype)
    if repeated:
        keys, values = keys[:, torch.arange(seq_len) % 25], values[:, torch.arange(seq_len) % 25]
    ranking = torch.stack([torch.randperm(seq_len, generator=generator) for _ in range(2)])
    heads = torch.tensor([0, 1, 0, 1, 1, 0, 0])
    sizes = torch.tensor([19, 12, 7, 12, 9, 30, 11])
    offsets = torch.tensor([21, 20, 33, 20, 5, 10, 0])  # a family's offset + size: 40 (head 0), 32
    point_counts = torch.tensor([119, 100, 107, 100, 120, 130, 140])  # offset + count: 140, 120
    group = RowGroup([5, 3, 0, 4, 1, 2], 30, 130, equal_sizes=False)
    entries = ResidualEntries(
        keys.new_zeros(7, ENTRY_WIDTH, dim),
        values.new_zeros(7, ENTRY_WIDTH, dim),
        torch.full((7, ENTRY_WIDTH), float("-inf")),
    )
    order = ranking[heads]
    families = [[2, 0, 5], [1, 3]]
    return (
        keys, values, heads, order, offsets, point_counts, sizes, group, iterations, entries, form, "tf32",
        families,
    )  # fmt: skip


def test_a_familys_first_step_shared_gives_each_row_the_plain_loops_entries(tmp_path):
    """Families clustered with their first step shared (``cluster``'s ``families``: the leader scans
    its centres' suffixes, smallest first, and adds each point to every member whose points hold it)
    give every row the plain per-head loop's entries over its own points and size, bit for bit in the
    keys and values, the log-counts within one fp32 ulp; the row outside the group untouched. Cases:
    fp32 keys (IEEE products) and bf16 keys (the exact bf16 split), 4 steps, and 1 (the shared step
    the last: the values summed in it), and repeated tokens, whose ties go to the lowest centre."""
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(4)
    cases = [
        nested_case(generator, torch.float32, 24, 4, "ieee"),
        nested_case(generator, torch.bfloat16, 64, 4, "bf16x3"),
        nested_case(generator, torch.bfloat16, 64, 1, "bf16x3"),
        nested_case(generator, torch.bfloat16, 64, 4, "bf16x3", repeated=True),
    ]
    found_cases = interpreted("tests.test_lloyd_kernel:clustered_fields", cases, tmp_path)
    empty_slots_of_plain_entries(cases, found_cases)


def candidates_by_the_kernel(proxy, sets):
    """``proxy.candidate_rows(sets)`` with its k-means by ``lloyd_kernel`` (as ``CUDA_FUSED_LLOYD`` on a
    GPU; IEEE products, the tiny model's keys being fp32): the entries' fields, and the families the
    kernel was given."""
    from reskv import lloyd_kernel  # imports Triton

    with (
        mock.patch.object(reskv.residual, "fused_lloyd_form", lambda keys: "ieee"),
        mock.patch.object(lloyd_kernel, "cluster", wraps=lloyd_kernel.cluster) as cluster,
    ):
        every_row, _ = proxy.candidate_rows(sets)
    return every_row.residual.fields(), [call.kwargs["families"] for call in cluster.call_args_list]


def test_a_proxys_candidates_cluster_with_their_first_step_shared_to_the_torch_paths_entries(tmp_path):
    """A validation proxy's candidates at two ratios (SnapKV's budgets: every head's equal, so each
    head's candidates of a ratio form one family), built by the kernel with their first step shared,
    give the torch path's entries (each row clustered alone): the keys and values bit for bit, the
    log-counts within one fp32 ulp. Each family is one head's rows whose centres and points end alike,
    by increasing size."""
    pytest.importorskip("triton")
    proxy, sets = next(proxies_and_sets("snapkv", (ResidualConfig(),)))
    [(found, families)] = interpreted(
        "tests.test_lloyd_kernel:candidates_by_the_kernel", [(proxy, sets)], tmp_path
    )
    plain = proxy.candidate_rows(sets)[0]
    assert torch.equal(found[0], plain.residual.keys) and torch.equal(found[1], plain.residual.values)
    assert within_one_ulp(found[2], plain.residual.log_counts)
    # By the layout (``candidate_rows``: a set's rows after the last's, candidate by candidate, head by
    # head), a family is a set's one head's candidates with entries, by increasing size.
    sizes, expected, first = plain.entry_counts.tolist(), [], 0
    for budgets, candidates in sets:
        heads = len(budgets)
        for head in range(heads):
            rows = [first + c * heads + head for c in range(len(candidates))]
            expected.append(sorted((row for row in rows if sizes[row]), key=lambda row: (sizes[row], row)))
        first += heads * len(candidates)
    assert families == [[members for members in expected if len(members) > 1]]
    assert max(map(len, expected)) > 2  # nested three deep or more
