"""The configurations of one prompt decoded together as views of its one prefilled cache
(``reskv.grid``, ``reskv.views``): each row as if alone, eager and compiled, in one batch whatever its
rows unless the device's memory asks for more, and never compressed twice."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

import reskv.engine
import reskv.grid
from baselines import build_method
from reskv.batching import (
    DeviceMemory,
    ViewRow,
    check_decode_batch,
    grid_decoding,
    view_batch_bytes,
)
from reskv.cache import ResKVCache
from reskv.config import ResidualConfig
from reskv.decoding import (
    COMPILED_GRAPH_BOUND,
    RECOMPILE_LIMIT_HIT,
    compiled_next_logits,
    forward,
    greedy,
    release_compiled,
)
from reskv.engine import Prefill
from reskv.grid import GridRow, compress, decode_grid, prompted_views
from reskv.views import RowView, ViewLayer, adjusted_values
from scripts.bench.dispatch_counts import count_dispatch
from scripts.measure import random_prompt
from tests.conftest import TINY_RUN, TOKENS, cached_tiny_backbone

ROOT = Path(__file__).resolve().parent.parent

FORCED = [17, 905, 3, 2211, 64, 7]  # tokens fed one at a time, whatever the model would choose
# Rows of every kind a batch mixes: the full cache (the whole prompt kept), bases, ragged AdaKV,
# CaM's merged values at two ratios, and ResKV under each gate rule (default, clamped, closed, another
# tau/alpha, no population weight), at two ratios and in both settings.
RULES = {
    "default": ResidualConfig(),
    "g_min": ResidualConfig(g_min=0.99),
    "no_gate": ResidualConfig(gate=False),
    "tau": ResidualConfig(tau=0.7, alpha=3.0, beta=0.0),
}
REQUESTS = [
    (name, ratio, rule, setting)
    for setting in ("aware", "agnostic")
    for name, ratio, rule in [
        ("full", None, None),
        ("snapkv", 0.9, None),
        ("adakv", 0.6, None),
        ("cam", 0.9, None),
        ("cam", 0.6, None),
        *(
            (name, ratio, rule)
            for name in ("snapkv+reskv", "adakv+reskv")
            for ratio in (0.6, 0.9)
            for rule in RULES
        ),
    ]
]
DEFAULT_RULES = [request for request in REQUESTS if request[2] in (None, "default")]


@pytest.fixture(scope="module")
def prefill() -> Prefill:
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    return Prefill(backbone, random_prompt(TOKENS, 300, seed=3), 270)


def requests(names=REQUESTS):
    return [
        (build_method(name, ratio, residual=RULES.get(rule)), setting) for name, ratio, rule, setting in names
    ]


def grid(prefill: Prefill, methods, **options) -> list:
    """``decode_grid``'s generations in the order of the requests."""
    generations = dict(decode_grid(prefill, methods, **options))
    return [generations[row] for row in range(len(methods))]


def alone_logits(prefill: Prefill, method, setting: str, step=None) -> torch.Tensor:
    """``[1 + len(FORCED) - 1, V]``: what ``generate`` decodes from, after the prompt and along the
    forced tokens, each fed by ``step(token_ids, cache)`` (``prefill.next_logits`` unless given)."""
    step = step or prefill.next_logits
    cache, _ = prefill.compressed(method, setting)
    logits = prefill.prefilled(setting).last_logits
    question = prefill.prompt_ids[prefill.context_length :]
    if setting == "agnostic":
        cache.reserve(len(question) + len(FORCED))
        logits = prefill.next_logits(question, cache)
    cache.reserve(len(FORCED))
    return torch.stack([logits] + [step([token], cache) for token in FORCED[:-1]])


def prompted_batch(
    prefill: Prefill, methods, feeds: int, decode: str = "eager"
) -> tuple[ResKVCache, torch.Tensor]:
    """``methods`` compressed and viewed as ``decode_grid`` builds a batch, after the whole prompt (in the
    requests' order: the tests' rows of one values key are consecutive)."""
    rows = [GridRow(index, method, setting) for index, (method, setting) in enumerate(methods)]
    with prefill.sharing_construction():
        for row in rows:
            compress(prefill, row, quality=False)
        return prompted_views(prefill, rows, feeds, decode)


def batch_logits(prefill: Prefill, methods, step) -> torch.Tensor:
    """``[rows, len(FORCED), V]``: the batch's logits after the prompt and along the forced tokens,
    ``step(token_ids, cache)`` feeding one token per row."""
    cache, logits = prompted_batch(prefill, methods, len(FORCED))
    assert any(isinstance(layer, ViewLayer) for layer in cache.layers)
    steps = [logits] + [step([token] * len(methods), cache) for token in FORCED[:-1]]
    return torch.stack(steps, dim=1)


def eager_step(prefill: Prefill):
    """One token per row through the batch's eager forward: ``(token_ids, cache) -> [rows, V]``."""

    def step(token_ids: list[int], cache: ResKVCache) -> torch.Tensor:
        return forward(prefill.backbone, torch.tensor(token_ids)[:, None], cache)[:, -1]

    return step


def test_view_rows_get_the_logits_each_gets_alone(prefill):
    """Along the same forced tokens, every row of one batch of views (both settings: the question fed
    to the query-agnostic rows while the query-aware ones pass through) gets the logits its own cache
    gives it alone (``shared_softmax_attention``, itself checked against the spec's loop): reading the
    shared cache through a keep mask, the entries from one pool and the appended slots apart changes
    nothing but the fp32 rounding of the longer reduction."""
    methods = requests()
    together = batch_logits(prefill, methods, eager_step(prefill))
    for row, (method, setting) in enumerate(methods):
        expected = alone_logits(prefill, method, setting)
        torch.testing.assert_close(together[row], expected, rtol=0, atol=2e-5, msg=f"row {REQUESTS[row]}")


def test_views_copy_no_main_key_or_value(prefill):
    """A batch's layers read the prefilled keys and values themselves (the same storage), the query-
    agnostic rows their first ``context_length`` slots only; CaM's rows read one adjusted values tensor
    per setting, their kept sets nested (``reskv.batching.view_step_slots`` reads it at the most slots
    one of them keeps); every row's keep mask is its construction's kept set, and the entry pool holds
    every row's entries, end to end."""
    methods = requests(DEFAULT_RULES)
    rows = [GridRow(index, method, setting) for index, (method, setting) in enumerate(methods)]
    with prefill.sharing_construction():
        for row in rows:
            compress(prefill, row, quality=False)
        cache, _ = prompted_views(prefill, rows, 4)
    shared = prefill.prefilled("aware").cache.layers
    for index, layer in enumerate(cache.layers):
        assert layer.shared.keys.data_ptr() == shared[index].keys.data_ptr()
        values = [source for _, _, source in layer.shared.sources]
        assert values[0].data_ptr() == shared[index].values.data_ptr()
        cam = [key for key in {row.values_key for row in rows} if key is not None]
        assert len({source.data_ptr() for source in values}) == 1 + len(cam) == 3
        for row, view in enumerate(row.views[index] for row in rows):
            kept = ~layer.shared.hidden[row]
            if view.keep is None:
                assert kept[:, : view.seen].all() and not kept[:, view.seen :].any()
            else:
                assert torch.equal(kept[:, : view.seen], view.keep) and not kept[:, view.seen :].any()
        entries = [view.entries[0] for view in (row.views[index] for row in rows) if view.entries]
        assert torch.equal(layer.entries.keys, torch.cat(entries, 1))
        for key in cam:
            kept = sorted(
                (~layer.shared.hidden[row] for row, of in enumerate(rows) if of.values_key == key),
                key=lambda mask: int(mask.sum()),
            )
            assert len(kept) == 2 and not (kept[0] & ~kept[1]).any() and kept[0].sum() < kept[1].sum()
    seen = {row.setting: row.views[0].seen for row in rows}
    assert seen == {"aware": len(prefill.prompt_ids), "agnostic": prefill.context_length}


def test_adjusted_values_that_disagree_are_refused():
    """Two rows of one values key that put different values at a position they both keep: an error
    rather than either row reading the other's values."""
    values = torch.zeros(1, 4, 2)
    keep = torch.tensor([[True, True, False, False]])
    one = RowView(4, keep, None, ResidualConfig(), "cam", torch.ones(1, 2, 2))
    other = RowView(4, keep, None, ResidualConfig(), "cam", torch.full((1, 2, 2), 2.0))
    source = adjusted_values([one, one], values)
    assert torch.equal(source[0, :2], torch.ones(2, 2)) and not source[0, 2:].any()
    with pytest.raises(ValueError, match="'cam' adjust the values of one position differently"):
        adjusted_values([one, other], values)


@pytest.mark.slow
def test_the_compiled_batch_step_gives_the_eager_batch_logits(prefill):
    """The batch's decode step compiled as one graph (``torch.compile(fullgraph=True)``: no graph break)
    gives the eager batch's logits to fp32 rounding, and one graph serves batches of other rows (as
    many values tensors), another prompt and another number of rows."""
    release_compiled()
    methods = requests(DEFAULT_RULES)
    eager = batch_logits(prefill, methods, eager_step(prefill))

    def compiled(token_ids, cache):
        return compiled_next_logits(prefill.backbone, token_ids, cache)

    first = batch_logits(prefill, methods, compiled)
    torch.testing.assert_close(first, eager, rtol=1e-4, atol=1e-5)
    assert torch.equal(first.argmax(-1), eager.argmax(-1))
    other = Prefill(prefill.backbone, random_prompt(TOKENS, 280, seed=4), 250)
    batch_logits(other, methods, compiled)
    batch_logits(other, methods[:3] + methods[6:], compiled)  # fewer rows, as many values tensors
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_greedy_feeds_a_row_that_stopped_and_ignores_its_logits():
    """Scripted logits: row 0 stops at its third token, row 2 at its first (once ``min_new_tokens = 1``
    allows it: its first choice is the stop token, masked), row 1 runs to ``max_new_tokens``; every
    step feeds all three rows, a stopped row its last choice."""
    stop, vocabulary = 9, 10
    scripts = {0: [4, 5, stop, 1, 1], 1: [1, 2, 3, 4, 5], 2: [stop, stop, 2, 2, 2]}
    runner_up = {0: 6, 1: 6, 2: 7}  # each row's second choice: what the masked stop gives way to
    fed = []

    def logits_at(produced: int) -> torch.Tensor:
        logits = torch.zeros(3, vocabulary)
        for row in range(3):
            logits[row, scripts[row][produced]] = 2.0
            logits[row, runner_up[row]] = 1.0
        return logits

    def step(token_ids: list[int]) -> torch.Tensor:
        fed.append(token_ids)
        return logits_at(len(fed))

    answers = greedy(logits_at(0), step, 5, 1, {stop})
    assert answers == [[4, 5], [1, 2, 3, 4, 5], [7]]
    assert fed == [[4, 1, 7], [5, 2, stop], [stop, 3, 2], [1, 4, 2]]


def test_a_grid_beyond_the_memory_limit_is_cut_and_every_row_is_decoded(prefill, monkeypatch):
    """A faked allocator whose free and reserved-but-unused bytes, less what the construction holds,
    leave 0.8 x that about four rows' views: the grid is decoded in the fewest batches within it, each
    row's tokens as alone."""
    methods = requests(DEFAULT_RULES)
    config = prefill.backbone.model.config
    layers, kv, heads = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads
    head_dim, prompt = prefill.backbone.head_dim, len(prefill.prompt_ids)
    total = 1 << 30
    stacked = layers * (2 * kv * prompt + heads * prefill.observation_window) * head_dim * 4
    construction = 2 * stacked + layers * kv * prompt * head_dim * 4 + total // 32
    shape = reskv.grid.model_shape(prefill.backbone)
    appended = prompt - prefill.context_length + 4
    four = view_batch_bytes([ViewRow(30)] * 4, shape, prompt, appended)
    available = construction + int(four / 0.8)
    reserved, allocated = 5 << 20, 3 << 20
    faked = DeviceMemory(total, available - (reserved - allocated), reserved, allocated)
    monkeypatch.setattr(reskv.grid, "device_memory", lambda device: faked)
    together = grid(prefill, methods, max_new_tokens=4)
    sizes = [generation.run["batch_rows"] for generation in together]
    assert 1 < max(sizes) < len(methods)
    alone = [prefill.generate(method, setting, max_new_tokens=4) for method, setting in methods]
    assert [generation.token_ids for generation in together] == [generation.token_ids for generation in alone]


def compressions_counted(monkeypatch) -> list:
    """Each compression ``Prefill.compressed_layers`` runs from now on, as ``(method name, setting)``."""
    counted, compressed_layers = [], Prefill.compressed_layers

    def counting(self, method, setting="aware"):
        counted.append((method.name, method.ratio, setting))
        return compressed_layers(self, method, setting)

    monkeypatch.setattr(Prefill, "compressed_layers", counting)
    return counted


def test_a_batch_the_device_cannot_allocate_is_decoded_in_halves_from_the_same_views(prefill, monkeypatch):
    """A device that cannot hold more than two rows' views (a faked out-of-memory error): every row is
    still decoded, in halves, each with the tokens of the same rows batched by ``max_rows=2``, no row
    is compressed twice, and its run section counts the splits."""
    methods = [request for request in requests(DEFAULT_RULES) if request[0].scorer is not None][:4]
    prompted = reskv.grid.prompted_views

    def two_rows_at_most(prefill, rows, *options):
        if len(rows) > 2:
            raise torch.OutOfMemoryError("faked: CUDA out of memory")
        return prompted(prefill, rows, *options)

    expected = grid(prefill, methods, max_new_tokens=4, max_rows=2)
    monkeypatch.setattr(reskv.grid, "prompted_views", two_rows_at_most)
    counted = compressions_counted(monkeypatch)
    together = grid(prefill, methods, max_new_tokens=4)
    assert sorted(counted) == sorted((method.name, method.ratio, setting) for method, setting in methods)
    assert [generation.token_ids for generation in together] == [
        generation.token_ids for generation in expected
    ]
    assert [generation.run["batch_rows"] for generation in together] == [2, 2, 2, 2]
    assert [generation.run.get("out_of_memory_splits") for generation in together] == [1, 1, 1, 1]


@pytest.mark.parametrize("answer", [[11, 205, 3, 3000, 41], [11]], ids=["answer", "one-token-answer"])
def test_a_batch_of_one_is_generate_bit_for_bit_and_every_row_its_quality_measures(prefill, answer):
    """``max_rows=1`` decodes each request as ``generate`` does. In one batch of views each row's tokens
    and statistics are ``generate``'s, and its quality measures too, bit for bit: they are taken from
    the row's own cache, as ``generate`` takes them, whatever decoded its answer."""
    methods = requests(DEFAULT_RULES)
    alone = [
        prefill.generate(method, setting, max_new_tokens=8, answer_ids=answer) for method, setting in methods
    ]
    for max_rows in (1, None):
        together = grid(prefill, methods, max_new_tokens=8, answer_ids=answer, max_rows=max_rows)
        for one, batched in zip(alone, together, strict=True):
            assert batched.token_ids == one.token_ids and batched.cache_stats == one.cache_stats
            assert batched.quality == one.quality
        batches = [generation.run["batch_rows"] for generation in together]
        assert batches == [1 if max_rows == 1 else len(methods)] * len(methods)


def test_a_row_without_the_shared_softmax_decodes_alone_and_eagerly(prefill):
    ablation = build_method("snapkv+reskv", 0.9, residual=ResidualConfig(shared_softmax=False))
    methods = [(ablation, "aware"), *requests(REQUESTS[:3])]
    together = grid(prefill, methods, max_new_tokens=4, max_rows=8)
    assert [generation.run["batch_rows"] for generation in together] == [1, 3, 3, 3]
    assert together[0].token_ids == prefill.generate(ablation, "aware", max_new_tokens=4).token_ids
    compiled = grid(prefill, methods, max_new_tokens=4, decode="compiled")
    assert [generation.run["decode"] for generation in compiled] == [
        "eager",
        "compiled",
        "compiled",
        "compiled",
    ]


def test_a_prefill_that_keeps_no_full_cache_decodes_every_row_alone():
    """``retain="compressed"`` keeps no prefilled cache to view: each row decodes alone, as
    ``generate`` decodes it."""
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    methods = [request for request in requests(DEFAULT_RULES) if request[0].scorer is not None][:3]
    prompt = random_prompt(TOKENS, 300, seed=3)
    compressed = Prefill(backbone, prompt, 270, [method for method, _ in methods], retain="compressed")
    together = grid(compressed, methods, max_new_tokens=4, max_rows=8)
    assert [generation.run["batch_rows"] for generation in together] == [1, 1, 1]
    alone = [compressed.generate(method, setting, max_new_tokens=4) for method, setting in methods]
    assert [generation.token_ids for generation in together] == [generation.token_ids for generation in alone]


def test_a_batch_step_makes_no_host_read(prefill):
    """A batch's forward reads nothing back from the device (its slots are a device-side position);
    greedy decoding reads the rows' choices once a step, after copying the stop tokens to the device
    once where they are masked (``min_new_tokens``; a copy that is not ``non_blocking``: a sync on
    CUDA, ``scripts.bench.dispatch_counts``)."""
    methods = requests(DEFAULT_RULES)
    cache, _ = prompted_batch(prefill, methods, len(FORCED))
    step = eager_step(prefill)
    step([FORCED[0]] * len(methods), cache)
    with count_dispatch() as counts:
        step([FORCED[1]] * len(methods), cache)
    assert counts.syncs == 0 and counts.by_op["index_copy_"] == 3 * len(cache.layers)
    for min_new_tokens, uploads in ((0, 0), (2, 1)):
        with count_dispatch() as counts:
            greedy(
                torch.zeros(len(methods), 8), lambda ids: torch.zeros(len(methods), 8), 5, min_new_tokens, {7}
            )
        assert counts.syncs == uploads + 5 and counts.syncs_by_op["tolist"] == 5


@pytest.mark.parametrize(
    ("device", "decode", "decode_batch", "expected"),
    [
        ("cuda", "auto", "auto", ("compiled", None)),
        ("cpu", "auto", "auto", ("eager", 1)),
        ("cuda", "eager", 4, ("eager", 4)),
        ("cpu", "compiled", "auto", ("compiled", 1)),
    ],
)
def test_auto_decodes_a_gpu_s_grid_compiled_in_one_batch_and_a_cpu_s_as_before(
    device, decode, decode_batch, expected
):
    assert grid_decoding(decode, decode_batch, device) == expected


def test_a_bad_decode_choice_is_refused_naming_the_values():
    with pytest.raises(
        ValueError, match=r"decode_batch 0 must be a positive integer \(1: each configuration"
    ):
        check_decode_batch(0)
    with pytest.raises(ValueError, match=r"unknown decode mode 'fast'; choose one of \['auto', 'eager'"):
        grid_decoding("fast", 1, "cpu")


@pytest.mark.slow
def test_the_runner_decodes_a_sample_s_configurations_together_when_asked_and_records_it(tmp_path):
    """``decode_batch=4``: every configuration's record holds the tokens and statistics of
    ``decode_batch=1`` (tiny model: no near ties) and its quality measures bit for bit, its batch's
    size in its record, and the plan's batch in its provenance."""
    records = {}
    for decode_batch in (1, 4):
        command = [
            *TINY_RUN,
            "max_new_tokens=6",
            "method=[full,snapkv,snapkv+reskv,adakv+reskv]",
            "ratio=[0.6,0.9]",
            "setting=[aware,agnostic]",
            "backbone.quality=true",
            f"decode_batch={decode_batch}",
            f"results_dir={tmp_path / str(decode_batch)}",
        ]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        for path in sorted((tmp_path / str(decode_batch) / "runs").rglob("*.json")):
            result = json.loads(path.read_text())
            assert result["provenance"]["machine"]["decode_batch"] == decode_batch
            (sample,) = result["samples"]
            records.setdefault(decode_batch, []).append(sample)
    assert len(records[1]) == 13 == len(records[4])  # the full cache once, 12 compressed
    for alone, batched in zip(records[1], records[4], strict=True):
        for key in ("prediction_token_ids", "cache_stats", "quality"):
            assert batched[key] == alone[key], key
    assert sorted(sample["run"]["batch_rows"] for sample in records[4]) == [1] + [4] * 12
    assert {sample["run"]["batch_rows"] for sample in records[1]} == {1}


def past_the_recompile_limit(*args, **kwargs):
    raise RECOMPILE_LIMIT_HIT("faked: recompile limit (8) hit with fullgraph=True")


def test_a_compiled_batch_past_the_recompile_limit_decodes_eagerly_and_says_so(prefill, monkeypatch):
    """Every compiled step fails at the recompile limit (faked): each batch and each row alone is
    decoded eagerly instead, with the eager grid's tokens, and its run section names the fallback."""
    methods = requests(DEFAULT_RULES)
    eager = grid(prefill, methods, max_new_tokens=4, max_rows=4)
    monkeypatch.setattr(reskv.grid, "compiled_next_logits", past_the_recompile_limit)
    monkeypatch.setattr(reskv.engine, "compiled_next_logits", past_the_recompile_limit)
    compiled = grid(prefill, methods, max_new_tokens=4, max_rows=4, decode="compiled")
    assert [generation.token_ids for generation in compiled] == [generation.token_ids for generation in eager]
    assert {generation.run["compile_fallback"] for generation in compiled} == {"FailOnRecompileLimitHit"}
    assert {generation.run["decode"] for generation in compiled} == {"eager"}
    assert [g.run["batch_rows"] for g in compiled] == [g.run["batch_rows"] for g in eager]


def test_a_compiled_row_alone_decodes_beside_a_copy_and_alone_eagerly_if_the_copy_does_not_fit(
    prefill, monkeypatch
):
    """Compiled, a row alone reaches the step as two rows (itself and a copy, so that torch._dynamo
    never compiles a graph for one row), gives the tokens and quality measures ``generate`` gives it
    alone, and records a batch of one; where the two rows cannot be allocated (faked), it decodes
    alone and eagerly, its run section saying why. The compiled step is the eager forward here (no
    compilation): what is checked is which rows reach it."""
    methods = [requests(DEFAULT_RULES)[index] for index in (0, 3)]  # the full cache, a gated +ResKV
    answer = [11, 205, 3]
    alone = [
        prefill.generate(method, setting, max_new_tokens=4, answer_ids=answer) for method, setting in methods
    ]
    rows_seen = []

    def eager_as_compiled(backbone, token_ids, cache):
        rows_seen.append(len(token_ids))
        return forward(backbone, torch.tensor(token_ids)[:, None], cache)[:, -1]

    monkeypatch.setattr(reskv.grid, "compiled_next_logits", eager_as_compiled)
    compiled = grid(prefill, methods, max_new_tokens=4, answer_ids=answer, max_rows=1, decode="compiled")
    assert set(rows_seen) == {2}
    for one, copied in zip(alone, compiled, strict=True):
        assert copied.token_ids == one.token_ids
        assert copied.run == {"decode": "compiled", "batch_rows": 1}
        assert copied.quality == one.quality

    prompted = reskv.grid.prompted_views

    def one_row_at_most(prefill, rows, *options):
        if len(rows) > 1:
            raise torch.OutOfMemoryError("faked: CUDA out of memory")
        return prompted(prefill, rows, *options)

    monkeypatch.setattr(reskv.grid, "prompted_views", one_row_at_most)
    fallen_back = grid(prefill, methods, max_new_tokens=4, max_rows=1, decode="compiled")
    assert [generation.token_ids for generation in fallen_back] == [one.token_ids for one in alone]
    assert [generation.run for generation in fallen_back] == [
        {"decode": "eager", "batch_rows": 1, "compile_fallback": "OutOfMemoryError"}
    ] * 2


@pytest.mark.slow
def test_a_compiled_grid_compiles_at_most_the_graph_bound_whatever_its_rows_and_prompts():
    """Two samples of other lengths, every kind of row and gate rule (a second ``tau`` and ``alpha``
    among them), decoded in one batch without CaM's rows (the step's values tensors padded with views of
    the prefilled ones) and with them, in batches of at most 3 and each alone (beside its copy): the
    compiled step compiles at most ``COMPILED_GRAPH_BOUND`` graphs (one), below torch._dynamo's
    recompile limit, and no row falls back to eager decoding."""
    backbone = cached_tiny_backbone("tiny-llama", 4, 2)
    release_compiled()
    without_cam = requests([request for request in REQUESTS if request[0] != "cam"])
    for length, seed in ((300, 3), (410, 5)):
        prefill = Prefill(backbone, random_prompt(TOKENS, length, seed=seed), length - 30)
        for methods, max_rows in ((without_cam, None), (requests(), None), (requests(), 3), (requests(), 1)):
            generations = grid(prefill, methods, max_new_tokens=3, max_rows=max_rows, decode="compiled")
            assert not any("compile_fallback" in generation.run for generation in generations)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= COMPILED_GRAPH_BOUND
    assert COMPILED_GRAPH_BOUND < torch._dynamo.config.recompile_limit


def test_a_compiled_batch_lays_its_pool_and_appended_slots_out_in_buckets(prefill):
    """For the compiled step every layer's entry pool exists (a batch of base rows has unused slots)
    and it and the appended slots take a multiple of 64 slots; eagerly a layer holds its rows' entries
    and the fed tokens exactly, and no pool where no row has entries."""
    methods = requests(DEFAULT_RULES)
    eager, _ = prompted_batch(prefill, methods, len(FORCED))
    question = len(prefill.prompt_ids) - prefill.context_length
    assert {layer.capacity for layer in eager.layers} == {question + len(FORCED)}
    compiled, _ = prompted_batch(prefill, methods, len(FORCED), "compiled")
    assert {layer.capacity for layer in compiled.layers} == {64 * math.ceil((question + len(FORCED)) / 64)}
    for eager_layer, compiled_layer in zip(eager.layers, compiled.layers, strict=True):
        slots = eager_layer.entries.slots
        assert compiled_layer.entries.slots == 64 * math.ceil(slots / 64)
        assert torch.isneginf(compiled_layer.entries.bias[:, slots:]).all()
    bases, _ = prompted_batch(prefill, requests(REQUESTS[:3]), len(FORCED))
    assert all(layer.entries is None for layer in bases.layers)
    bases, _ = prompted_batch(prefill, requests(REQUESTS[:3]), len(FORCED), "compiled")
    assert all(layer.entries.outside.all() for layer in bases.layers)
