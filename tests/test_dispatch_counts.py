"""The op and sync counter (scripts.bench.dispatch_counts) on hand-counted code, the construction's
host-device syncs: a fixed number per layer batch, however many layers, the ops of a decode step's
attention as the spec lists them, and the compiled step's kernels."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from baselines import build_method
from reskv.attention import shared_softmax_attention
from reskv.decode_rule import DecodeRule
from reskv.decoding import compiled_next_logits, static_cache
from scripts.bench.construction_counts import LLAMA_ATTENTION, count_compression, synthetic_prefilled_cache
from scripts.bench.decode_counts import narrow_llama_8b_attention
from scripts.bench.dispatch_counts import compiled_kernels, count_dispatch, launched, uncounted


def test_counter_counts_launching_ops_and_syncs_by_hand():
    a = torch.randn(3, 4)
    with count_dispatch() as counts:
        b = a + 1  # 1 op
        c = b[1:].t()  # views: no op
        total = c.sum()  # 1 op
        total.item()  # 1 op (the copy to the host) and 1 sync
        torch.empty(5)  # an allocation launches nothing
        b.tolist()  # 1 sync, dispatching nothing on CPU
    assert (counts.ops, counts.syncs) == (3, 2)
    assert counts.syncs_by_op == {"_local_scalar_dense": 1, "tolist": 1}


def test_counter_counts_a_blocking_copy_of_host_data_to_a_device_as_a_sync():
    """On CUDA a copy from the host that is not ``non_blocking`` waits for the stream, though no op shows
    it on CPU: Python data given a device, and a host-made tensor (from Python data, or drawn from a
    CPU generator) moved to one, count a sync each; a ``non_blocking`` move, a device tensor moved, a
    tensor of a tensor and a draw from the default generator do not."""
    device = torch.device("cpu")
    with count_dispatch() as counts:
        torch.tensor([1, 2], device=device)  # 1
        torch.as_tensor([1.0], device=device)  # 1
        torch.tensor([3, 4]).to(device)  # 1
        torch.rand(3, generator=torch.Generator().manual_seed(0)).to(device)  # 1
        torch.tensor([5]).to(device, non_blocking=True)
        (torch.ones(2) + 1).to(device)
        torch.as_tensor(torch.ones(2), device=device)
        torch.rand(3).to(device)
    assert counts.syncs == 4
    assert counts.syncs_by_op == {"tensor(device=)": 1, "as_tensor(device=)": 1, "to(device)": 2}


def test_counter_counts_the_fp32_bytes_ops_write():
    """Each launching op's fp32 results, in place too; other dtypes and views add nothing."""
    with count_dispatch() as counts:
        a = torch.ones(10)  # 40 bytes
        a.add_(1)  # 40
        a.to(torch.float64)  # 0
        a[2:].view(2, 4)  # a view: no op
        torch.ones(3, dtype=torch.long)  # 0
    assert counts.fp32_bytes_by_stage == {"other": 80} and counts.largest_fp32_bytes == 40


def test_counter_counts_a_read_under_inference_mode():
    """Under ``inference_mode`` (the engine's) ``int()`` dispatches ``aten.item``, not
    ``_local_scalar_dense``: still one sync."""
    with torch.inference_mode(), count_dispatch() as counts:
        int(torch.ones(1).sum())
    assert counts.syncs == 1


def test_counter_counts_a_conversion_under_inference_mode_but_not_a_view():
    """``inference_mode`` dispatches ``to`` and ``contiguous`` undecomposed, flagged as views: a dtype
    conversion and the copy of a transposed tensor launch a kernel (2 ops); the same calls where
    they return their input, a slice and a split launch none."""
    a = torch.randn(3, 4)
    with torch.inference_mode(), count_dispatch() as counts:
        a.to(torch.bfloat16)  # 1 op: a new dtype is a copy
        a.t().contiguous()  # 1 op: a copy in the new layout
        a.to(torch.float32)  # a itself
        a.contiguous()  # a itself
        a[1:].split(1)  # views
    assert counts.ops == 2
    assert dict(counts.by_op) == {"to": 1, "contiguous": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_steps_attention_takes_the_ops_the_spec_lists(dtype):
    """reskv.md ("How the harness decodes"): a base layer's decode attention is one SDPA call (its bias
    converted to the queries' dtype); with entries and the gate, the fp32 logits, the main softmax and
    its max, the gate's two ops, the in-place add, the softmax and the values' matmul (on CPU, half
    precision adds the fp32 copies of the logits' operands and of the values)."""
    queries, keys, values = (torch.randn(2, n, 16, dtype=dtype) for n in (3, 40, 40))
    bias = torch.zeros(2, 1, 40)
    counted = {}
    for residual_slots in (0, 5):
        with torch.inference_mode(), count_dispatch() as counts:
            shared_softmax_attention(queries, keys, values, bias, residual_slots, 0.25, DecodeRule())
        counted[residual_slots] = dict(counts.by_op)
    conversions = {"to": 1} if dtype != torch.float32 else {}
    assert counted[0] == {**conversions, "scaled_dot_product_attention": 1}
    gated = {"baddbmm": 1, "softmax": 2, "amax": 1, "rsub": 1, "log_sigmoid": 1, "add_": 1, "bmm": 1}
    assert counted[5] == {**({"to": 3} if conversions else {}), **gated}


@pytest.mark.parametrize("layers", [2, 5])
@pytest.mark.parametrize("base", ["snapkv", "adakv", "tova", "h2o"])
def test_compression_syncs_do_not_grow_with_layers(base, layers):
    """A base method plans on the host (uniform budgets) or reads its heads' budgets once (AdaKV);
    with ResKV the chosen sizes and the surviving entries once more each, for all layers together.
    Its host->device copies do not wait (``reskv.selection.uploaded``)."""
    cache = synthetic_prefilled_cache(600, num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=16)
    reads = 1 if base == "adakv" else 0
    assert count_compression(cache, base, 0.5, 16)[1] == reads
    assert count_compression(cache, base + "+reskv", 0.5, 16)[1] == reads + 2


@pytest.mark.parametrize("base", ["snapkv", "adakv", "tova", "h2o"])
def test_reskv_adds_the_same_ops_to_its_base_whatever_the_number_of_layers(base):
    """ResKV's own work (the proxy's candidates, the k-means, the losses) runs once for a batch of
    layers stacked along the heads, 1,000 tokens at ratio 0.6 (every candidate admissible): the ops it
    adds to its base's are the same for 2 and for the 8B model's 32 layers, up to the few that a
    larger stack's k-means groups add, and stay within 700 + 5%. A GPU's host pays them once per
    batch, so ResKV's construction does not grow with the model's depth (the base's selection does
    not either: its layers are selected as one stack, ~30 ops a layer for scoring and gathering)."""
    extra = {}
    for layers in (2, 32):
        cache = synthetic_prefilled_cache(1000, num_layers=layers, num_heads=8, num_kv_heads=4, head_dim=16)
        base_ops = count_compression(cache, base, 0.6, 16)[0]
        extra[layers] = count_compression(cache, base + "+reskv", 0.6, 16)[0] - base_ops
    assert extra[32] <= 1.15 * extra[2] and extra[32] <= 735


def test_compiled_kernels_reads_the_launches_of_inductors_code_by_hand():
    """On CPU a matmul is a library call and inductor fuses the elementwise work between two of them
    into one C++ kernel, and a reduction after the last into another: 2 + 2 launches."""
    x, w = torch.randn(8, 8), torch.randn(8, 8)

    def two_layers(x, w):
        return (torch.mm(x, w).relu() * 2 @ w).sum()

    kernels = compiled_kernels(torch.compile(two_layers, fullgraph=True), x, w)
    assert kernels == {"extern_kernels.mm": 2, "fused": 2}


@pytest.mark.slow
def test_the_compiled_decode_step_attends_a_base_layer_by_one_sdpa_call_and_a_reskv_layer_by_two_products():
    """reskv.md ("How the harness decodes"), compiled: a cache without entries (a base method's, the full
    cache's) has no gate, so each layer's attention is one SDPA call, as eagerly; a +ResKV layer's is
    the logits' product, the gate and softmax, and the values' product. One graph serves every base
    and one every +ResKV method (2 layers of the 8B attention shape, CPU). A base layer computing the
    gate over no entries would launch +ResKV's kernels, more than its own."""
    backbone = narrow_llama_8b_attention(num_layers=2)
    cache = synthetic_prefilled_cache(600, **dict(LLAMA_ATTENTION, num_layers=2))
    kernels = {}
    for name in ("full", "snapkv", "snapkv+reskv", "adakv", "adakv+reskv"):
        compressed, _ = build_method(name, 0.6).compress(cache, LLAMA_ATTENTION["head_dim"] ** -0.5)
        compressed = static_cache(compressed, 1)
        compressed.reserve(1)
        with torch.inference_mode():
            kernels[name] = compiled_kernels(compiled_next_logits, backbone, [7], compressed)

    def attention(counted: Counter) -> dict:
        return {kind: count for kind, count in counted.items() if "scaled_dot" in kind or "bmm" in kind}

    for base in ("full", "snapkv", "adakv"):
        assert attention(kernels[base]) == {
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default": 2
        }
        assert kernels[base] == kernels["full"]
    for name in ("snapkv+reskv", "adakv+reskv"):
        assert attention(kernels[name]) == {"extern_kernels.baddbmm": 2, "extern_kernels.bmm": 2}
        assert kernels[name] == kernels["snapkv+reskv"]


def test_launches_no_op_shows_count_as_ops_and_uncounted_work_counts_nothing():
    """``launched`` counts one op with its fp32 bytes in the current count (none outside a count);
    under ``uncounted`` neither ops, syncs nor ``launched`` count."""
    launched("kernel outside a count", 8)
    with count_dispatch() as counts:
        launched("kernel", 400)
        with uncounted():
            (torch.ones(3) + 1).tolist()
            launched("kernel", 400)
            torch.tensor([1], device="cpu")
    assert (counts.ops, counts.syncs, counts.by_op) == (1, 0, {"kernel": 1})
    assert counts.fp32_bytes_by_stage["other"] == 400


def test_a_group_clustered_by_the_fused_lloyd_kernel_counts_its_launches_by_hand():
    """Under ``grid_constructions.fused_lloyd_launches`` a k-means group of bf16 keys takes, besides the
    entries' three allocations, one zeroed scratch and 1 + 2 x 4 launches of ``reskv.lloyd_kernel``
    (init, four assignment steps, three updates, final), and its entries are the torch path's."""
    pytest.importorskip("triton")
    import reskv.residual
    from scripts.bench.grid_constructions import fused_lloyd_launches

    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 100, 16, generator=generator).bfloat16()
    values = torch.randn(2, 100, 16, generator=generator).bfloat16()
    heads, order = (
        torch.arange(3) % 2,
        torch.stack([torch.randperm(100, generator=generator) for _ in range(3)]),
    )
    counts_, sizes = torch.tensor([90, 80, 70]), torch.tensor([12, 9, 12])
    group = reskv.residual.RowGroup([0, 2, 1], 12, 90, equal_sizes=False)
    arguments = (keys, values, heads, order, None, counts_, sizes, [group], 4)
    with fused_lloyd_launches(), count_dispatch() as counts:
        entries = reskv.residual.cluster_rows(*arguments)
    plain = reskv.residual.cluster_rows(*arguments)
    assert counts.ops == 3 + 1 + 9 and counts.syncs == 0
    lloyd = {name: n for name, n in counts.by_op.items() if name.startswith("lloyd")}
    assert lloyd == {
        "lloyd centres init": 1,
        "lloyd assign": 4,
        "lloyd centres update": 3,
        "lloyd centres final": 1,
    }
    for found, expected in zip(entries.fields(), plain.fields(), strict=True):
        assert torch.equal(found, expected)


def test_a_proxys_errors_by_the_fused_loss_kernel_count_one_launch():
    """Under ``grid_constructions.fused_loss_launches`` a validation proxy's errors of two candidate sets
    (two ratios') take one launch of ``reskv.loss_kernel`` (its output an allocation, which launches
    nothing), and are the torch path's."""
    pytest.importorskip("triton")
    from scripts.bench.grid_constructions import fused_loss_launches
    from tests.test_loss_kernel import proxies_and_candidates

    proxy, candidates = next(proxies_and_candidates("snapkv"))
    assert len(candidates[1]) == 2
    with fused_loss_launches(), count_dispatch() as counts:
        errors = proxy.sets_errors(*candidates)
    assert (counts.ops, counts.syncs, dict(counts.by_op)) == (1, 0, {"proxy errors": 1})
    assert counts.fp32_bytes_by_stage["other"] == 4 * errors.numel()
    assert torch.equal(errors, proxy.sets_errors(*candidates))


def test_attention_sums_by_the_fused_kernels_count_their_launches_by_hand():
    """Under ``grid_constructions.fused_sum_launches`` SnapKV's window means of bf16 queries take the
    column-sum kernels' two launches and one scaling by the query count, and a proxy's full outputs one
    launch (their outputs allocations, which launch nothing); the means are the torch path's within
    rounding (a sum scaled where the torch path takes a mean), the outputs its bits."""
    pytest.importorskip("triton")
    from reskv import scoring
    from scripts.bench.grid_constructions import fused_sum_launches

    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(4, 6, 16, generator=generator).bfloat16()
    keys, values = (torch.randn(2, 20, 16, generator=generator).bfloat16() for _ in "kv")
    positions, scaling = range(14, 20), 0.25
    with fused_sum_launches(), count_dispatch() as counts:
        means = scoring.mean_attention(queries, keys, positions, scaling)
    assert (counts.ops, counts.syncs) == (3, 0)
    assert dict(counts.by_op) == {"attention sums": 1, "column sums": 1, "mul_": 1}
    assert torch.allclose(means, scoring.mean_attention(queries, keys, positions, scaling), rtol=1e-6)
    with fused_sum_launches(), count_dispatch() as counts:
        outputs = scoring.attention_outputs(queries, keys, values, positions, scaling)
    assert (counts.ops, counts.syncs, dict(counts.by_op)) == (1, 0, {"attention sums": 1})
    assert torch.equal(outputs, scoring.attention_outputs(queries, keys, values, positions, scaling))


def test_the_k_means_flops_launched_leave_out_the_first_steps_a_family_shares():
    """``grid_constructions.KmeansWork``: a group whose kernel skips padding (3 rows: 100, 50 and 90
    points; 10, 5 and 20 centres; 2 d x 4 steps = 128) launches the formula's 128 x (1,000 + 250 +
    1,800) = 390,400 FLOP; where rows 1 and 0 share their first step with row 2 (2 d = 32), their
    32 x (250 + 1,000) = 40,000 are not launched."""
    from scripts.bench.grid_constructions import KmeansWork

    counts, sizes = torch.tensor([100, 50, 90]), torch.tensor([10, 5, 20])
    work = KmeansWork(groups=[(counts, sizes, 128, True)])
    assert work.formula() == work.launched() == 390_400
    work.shared.append((counts, sizes, 32, [[1, 0, 2]]))
    assert work.saved() == 40_000 and work.launched() == 350_400 and work.formula() == 390_400
