"""A batch's layer of views of one prefilled cache (``reskv.views``): its attention against the spec's
shared softmax written as a plain loop over each row's own slots in float64, and the CUDA kernel of
its shared and entry parts (``reskv.decode_kernel.view_partials``) against the torch form under
Triton's interpreter (fp32 inputs: the interpreter multiplies bf16 ``tl.dot`` operands wrongly)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from reskv.batching import ModelShape
from reskv.decode_rule import DecodeRule
from reskv.views import entry_partial, grouped, shared_partial
from scripts.bench.gpu_check.first import view_inputs, view_layer_output, views_float64
from tests.conftest import interpreted

SHAPE = ModelShape(layers=1, kv_heads=2, query_heads=8, head_dim=16, dtype_bytes=4)
RULES = [
    DecodeRule(),
    DecodeRule(g_min=0.9),
    DecodeRule(tau=0.6, alpha=3.0, beta=0.5),
    DecodeRule(gate=False),
]


@pytest.mark.parametrize("rule", RULES, ids=["default", "g_min", "tau-alpha-beta", "no-gate"])
def test_a_layer_of_views_gives_each_row_the_shared_softmax_over_its_own_slots(rule):
    """Nine rows keeping random halves of 300 shared slots, reading three values tensors, 0 to 40
    entries each, 4 appended slots: every row's output is the spec's, computed row by row in float64
    over its entries, the shared slots it keeps (with the values it reads) and its appended slots."""
    layer, queries = view_inputs(SHAPE, 300, 9, rule, torch.Generator().manual_seed(1))
    assert len({id(values) for _, _, values in layer.shared.sources}) == 3
    assert layer.entries.first.tolist() != layer.entries.last.tolist()  # some row has entries
    output = view_layer_output(layer, queries)
    torch.testing.assert_close(output.double(), views_float64(layer, queries, rule), rtol=0, atol=2e-6)


def test_the_view_kernel_gives_the_torch_form_s_partial_softmaxes(tmp_path):
    """Under Triton's interpreter, on fp32 inputs: the shared slots' and the entry pool's partial
    softmaxes of the kernel (split into chunks, merged) equal the torch form's to fp32 rounding: the
    same maxima (``-inf`` where a row sees nothing of a pool), and the same normalised outputs. Each
    values tensor the kernel gets holds NaN at the slots that none of its rows keeps: a tile loads its
    values only where one of its rows sees a slot (a weight of 0 times NaN would be NaN)."""
    generator = torch.Generator().manual_seed(2)
    cases, expected = [], []
    for slots, rows in ((300, 9), (2000, 5)):
        layer, queries = view_inputs(SHAPE, slots, rows, DecodeRule(), generator)
        scaling = SHAPE.head_dim**-0.5
        unread = [
            (first, last, values.masked_fill(layer.shared.hidden[first:last].all(0)[..., None], float("nan")))
            for first, last, values in layer.shared.sources
        ]
        assert all(values.isnan().any() for _, _, values in unread)
        shared = dataclasses.replace(layer.shared, sources=unread)
        cases.append((queries, shared, layer.entries, scaling))
        expected.append(
            (
                shared_partial(grouped(queries), layer.shared, scaling),
                entry_partial(grouped(queries), layer.entries, scaling),
            )
        )
    results = interpreted("reskv.decode_kernel:view_partials", cases, tmp_path)
    for parts, reference_parts in zip(results, expected, strict=True):
        for (maximum, total, output), (reference_max, reference_total, reference_output) in zip(
            parts, reference_parts, strict=True
        ):
            assert torch.equal(torch.isneginf(maximum), torch.isneginf(reference_max))
            seen = torch.isfinite(reference_max)
            torch.testing.assert_close(maximum[seen], reference_max[seen], rtol=0, atol=1e-5)
            normalised = output / total.clamp(min=1e-30)
            reference = reference_output / reference_total.clamp(min=1e-30)
            torch.testing.assert_close(normalised, reference, rtol=0, atol=1e-5)
