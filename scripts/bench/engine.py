"""Engine speed figures on the embedded model, every ratio measured within one run.

    python -m scripts.bench.engine            # ~4K and ~8K prompts, ratios 0.5 .. 0.9

Prints a header (``scripts.measure.machine_header``: cores, threads, torch, load average, the fp32
matmul rate of the moment), then per prompt length and ratio: the prefill time; ResKV construction
(``snapkv+reskv`` compression minus ``snapkv`` compression: validation proxy, k-means and final
entries over all layers and heads) and its share of the prefill (target <= 10%); the same two in
floating-point operations (``torch.utils.flop_counter``): the share construction would take at the
prefill's FLOP rate (its smaller matmuls reach less), so kernel tuning alone cannot bring the time
share much below it; the seconds the construction's own matmuls take replayed alone at their shapes
(``scripts.measure.replayed_matmul_seconds``) as a share of the prefill: the floor at this machine's
rate for each shape, the rest of a target being what everything else may take; decode seconds per
token of ``snapkv``, ``snapkv+reskv`` (target <= 1.03x) and the full cache, eagerly and with
the compiled step (``decode="compiled"``; its first compilation, tens of seconds to minutes, is not
timed; ``--skip-compiled`` leaves it out). A second table
isolates what the entries cost a decode step: one layer's ``shared_softmax_attention`` over the
budget's slots, main cache only against ``r = 0.1 b`` of them residual entries (random tensors of
the model's shapes, hundreds of interleaved calls, so far less noisy than whole decode steps). Last,
``kmeans_peak_memory`` for a Llama-3.1-8B-shaped layer at 32K tokens (peak transient MiB and seconds
on this machine). Decode steps alternate between methods one token at a time (A B C A B C ...) so
machine noise hits all alike; a step's time is the median over ``--decode-tokens`` steps, and a ratio
of two methods' steps the median of their paired steps' ratios, with its 95% interval
(``scripts.measure.median_interval``: a run resolves a target only where the interval lies on one
side of it). Then the
op and host-device sync counts of a whole-prompt compression at Llama-3.1-8B's attention shape
(``scripts.bench.construction_counts``: what a GPU's host pays), the model of its k-means
distance launches at 131K tokens, and the same counts for one decoded token
(``scripts.bench.decode_counts``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from baselines import build_method
from reskv.attention import shared_softmax_attention
from reskv.backbones import load_backbone
from reskv.config import ResidualConfig, budget_for, residual_size
from reskv.decoding import static_cache
from reskv.engine import Prefill
from reskv.method import Method
from reskv.residual import build_residual
from scripts.bench.construction_counts import COUNTED_METHODS, counts_table, launches_table
from scripts.bench.decode_counts import DECODE_COUNTED_METHODS, decode_counts_table
from scripts.measure import (
    counted_gflop,
    machine_header,
    median_interval,
    peak_allocated,
    replayed_matmul_seconds,
)

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def haystack_prompt(tokenizer, tokens: int) -> tuple[list[int], int]:
    """A chat-templated haystack prompt of about ``tokens`` tokens, split before its question."""
    per_sentence = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    context = FILLER * (tokens // per_sentence)
    question = "\nWhat color is the sky?"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + question}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    question_tokens = len(
        tokenizer(question + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    )
    return ids, len(ids) - question_tokens


def prefilled(backbone, prompt_ids: list[int], context_length: int, methods: list) -> Prefill:
    """The prompt prefilled, question included (the aware setting prefills it at its first use)."""
    prefill = Prefill(backbone, prompt_ids, context_length, methods)
    prefill.generate(methods[0], "aware", 1)
    return prefill


def decode_step_seconds(
    prefill: Prefill, methods: dict[str, Method], tokens: int, decode: str = "eager"
) -> dict[str, list[float]]:
    """Seconds of each of ``tokens`` greedy decode steps (forward pass and argmax, which also waits for
    a GPU) for each named method, the methods' caches stepped in lockstep (A B C A B C ...) so drifts
    in the machine's speed hit all alike: the ``i``-th steps of two methods are a pair. Every cache
    starts from the full cache's first answer token and then follows its own greedy choice, as
    ``Prefill.generate`` would. ``decode="compiled"`` steps through ``Prefill.compiled_next_logits``,
    one more step per cache first, untimed: the step compiles (or loads its graph) at its first call."""
    first_token = prefill.generate(build_method("full"), "aware", 1).token_ids[0]
    step = prefill.decode_step(decode)
    untimed = 1 if decode == "compiled" else 0
    caches = {name: decode_cache(prefill, method, tokens + untimed) for name, method in methods.items()}
    next_tokens = dict.fromkeys(methods, first_token)
    samples = {name: [] for name in methods}
    for _ in range(tokens + untimed):
        for name, cache in caches.items():
            start = time.perf_counter()
            next_tokens[name] = int(step([next_tokens[name]], cache).argmax())
            samples[name].append(time.perf_counter() - start)
    return {name: values[untimed:] for name, values in samples.items()}


def decode_seconds_per_token(
    prefill: Prefill, methods: dict[str, Method], tokens: int, decode: str = "eager"
) -> dict[str, float]:
    """The median of each method's ``decode_step_seconds``."""
    samples = decode_step_seconds(prefill, methods, tokens, decode)
    return {name: statistics.median(values) for name, values in samples.items()}


def paired_ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> str:
    """The median ratio of two methods' paired steps (``decode_step_seconds``) with its 95% interval
    (``median_interval``), as ``1.019 [0.990, 1.050]``: a whole-step ratio moves between runs on a
    shared CPU by more than the targets' margins, and the interval says what one run resolves."""
    ratios = [a / b for a, b in zip(samples[numerator], samples[denominator], strict=True)]
    median, low, high = median_interval(ratios)
    return f"{median:.3f} [{low:.3f}, {high:.3f}]"


def decode_cache(prefill: Prefill, method: Method, tokens: int):
    """The cache ``Prefill.generate`` decodes ``tokens`` tokens with for ``method`` (query-aware)."""
    cache, _ = prefill.compressed(method, "aware")
    cache.reserve(tokens)
    return static_cache(cache, tokens)


def attention_step_seconds(backbone, slots: int, entries: int, calls: int = 300) -> tuple[float, float]:
    """Median seconds of one decode step's attention (``shared_softmax_attention``) for one layer of
    ``backbone``'s shapes over ``slots`` slots: all main cache, and ``entries`` of them residual entries
    (calls interleaved)."""
    config, head_dim = backbone.model.config, backbone.head_dim
    num_kv_heads = config.num_key_value_heads
    queries = torch.randn(num_kv_heads, config.num_attention_heads // num_kv_heads, head_dim)
    keys, values = torch.randn(2, num_kv_heads, slots, head_dim)
    main_only = torch.zeros(num_kv_heads, 1, slots)
    with_entries = main_only.clone()
    with_entries[..., :entries] = torch.rand(num_kv_heads, 1, entries) * 5  # beta * log(count)
    rule, scaling = ResidualConfig(), head_dim**-0.5
    runs = {"main only": (0, main_only, []), "with entries": (entries, with_entries, [])}
    for _ in range(calls):
        for residual_slots, bias, seconds in runs.values():
            start = time.perf_counter()
            shared_softmax_attention(queries, keys, values, bias, residual_slots, scaling, rule)
            seconds.append(time.perf_counter() - start)
    return tuple(statistics.median(seconds) for _, _, seconds in runs.values())


def kmeans_peak_memory(
    seq_len: int = 32768,
    ratio: float = 0.6,
    residual_ratio: float = 0.2,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> dict:
    """Peak transient memory and time of one layer's residual clustering on random tensors.

    Defaults: a Llama-3.1-8B-shaped layer (8 KV heads, head dim 128) at 32K tokens, ratio 0.6,
    and the largest residual the grid allows (``r = 0.2 b``), every head evicting ``s - b`` tokens.
    The peak is what ``build_residual`` holds allocated beyond its inputs
    (``scripts.measure.peak_allocated``). Returns ``{"peak_bytes", "seconds", "points", "entries"}``
    (points and entries per head).
    """
    generator = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(num_kv_heads, seq_len, head_dim, generator=generator, device=device).to(dtype)
    values = torch.randn(num_kv_heads, seq_len, head_dim, generator=generator, device=device).to(dtype)
    scores = torch.rand(num_kv_heads, seq_len, generator=generator, device=device)
    budget = budget_for(seq_len, ratio)
    evicted = scores.argsort(dim=-1).argsort(dim=-1) < seq_len - budget  # the lowest-scored s - b tokens
    sizes = torch.full((num_kv_heads,), residual_size(residual_ratio, budget), device=device)
    with peak_allocated(device) as peak:
        start = time.perf_counter()
        entries = build_residual(keys, values, evicted, scores, sizes, iterations=4)
        if device != "cpu":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {
        "peak_bytes": peak.bytes,
        "seconds": seconds,
        "points": seq_len - budget,
        "entries": int(entries.entries_per_head.max()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9])
    parser.add_argument("--decode-tokens", type=int, default=32, help="decode steps per method (median)")
    parser.add_argument("--rounds", type=int, default=2, help="compressions per method and ratio (median)")
    parser.add_argument("--skip-memory", action="store_true", help="skip the 32K k-means memory figure")
    parser.add_argument("--skip-compiled", action="store_true", help="skip the compiled step's decode times")
    parser.add_argument(
        "--count-lengths",
        type=int,
        nargs="*",
        default=[4096],
        help="prompt lengths of the op and sync counts at the 8B attention shape (none: skip them; "
        "32768 needs more than 24 GB of host memory)",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    console = Console(width=480)  # every column readable when printed to a file or a narrow terminal
    console.print(machine_header())
    backbone = load_backbone("smollm2-135m")
    backbone = dataclasses.replace(backbone, stop_token_ids=())  # decode timing needs a first answer token
    table = Table(title="Engine speed, SmolLM2-135M (medians; ratios within one run)")
    steps = Table(
        title="Decode attention, one layer and step (shared_softmax_attention, medians of 300 calls)"
    )
    for column in (
        "prompt tokens",
        "ratio",
        "slots b",
        "entries r",
        "main only us",
        "with entries us",
        "with / without",
        f"extra ms per token ({backbone.num_layers} layers)",
    ):
        steps.add_column(column, justify="right")
    for column in (
        "prompt tokens",
        "ratio",
        "prefill s",
        "snapkv compress s",
        "+reskv compress s",
        "construction s",
        "construction / prefill",
        "construction GFLOP",
        "construction / prefill GFLOP",
        "its matmuls alone / prefill",
        "decode s/tok snapkv",
        "decode s/tok +reskv",
        "+reskv / snapkv",
        "decode s/tok full",
        "+reskv / full",
        "compiled s/tok snapkv",
        "compiled +reskv / snapkv",
        "compiled +reskv / full",
    ):
        table.add_column(column, justify="right")
    for length in args.lengths:
        prompt_ids, context_length = haystack_prompt(backbone.tokenizer, length)
        methods = [build_method(name, ratio) for ratio in args.ratios for name in ("snapkv", "snapkv+reskv")]
        prefill = prefilled(backbone, prompt_ids, context_length, methods)
        # A second, counted prefill: counting slows it, so the timed one runs bare.
        prefill_gflop = counted_gflop(prefilled, backbone, prompt_ids, context_length, methods)
        prefill_seconds = prefill.timings["prefill_s"] + prefill.timings.get("question_prefill_s", 0.0)
        for ratio in args.ratios:
            compress = {
                name: statistics.median(
                    prefill.generate(build_method(name, ratio), "aware", 1).timings["compress_s"]
                    for _ in range(args.rounds)
                )
                for name in ("snapkv", "snapkv+reskv")
            }
            construction = compress["snapkv+reskv"] - compress["snapkv"]
            construction_gflop = counted_gflop(
                prefill.generate, build_method("snapkv+reskv", ratio), "aware", 1
            ) - counted_gflop(prefill.generate, build_method("snapkv", ratio), "aware", 1)
            construction_matmul_seconds = replayed_matmul_seconds(
                prefill.compressed, build_method("snapkv+reskv", ratio), "aware"
            ) - replayed_matmul_seconds(prefill.compressed, build_method("snapkv", ratio), "aware")
            decoded = {name: build_method(name, ratio) for name in ("snapkv", "snapkv+reskv", "full")}
            samples = decode_step_seconds(prefill, decoded, args.decode_tokens)
            decode = {name: statistics.median(seconds) for name, seconds in samples.items()}
            compiled = []
            if not args.skip_compiled:
                stepped = decode_step_seconds(prefill, decoded, args.decode_tokens, decode="compiled")
                compiled = [
                    f"{statistics.median(stepped['snapkv']):.4f}",
                    paired_ratio(stepped, "snapkv+reskv", "snapkv"),
                    paired_ratio(stepped, "snapkv+reskv", "full"),
                ]
            table.add_row(
                str(len(prompt_ids)),
                f"{ratio:.1f}",
                f"{prefill_seconds:.2f}",
                f"{compress['snapkv']:.3f}",
                f"{compress['snapkv+reskv']:.3f}",
                f"{construction:.3f}",
                f"{construction / prefill_seconds:.3f}",
                f"{construction_gflop:.1f}",
                f"{construction_gflop / prefill_gflop:.3f}",
                f"{construction_matmul_seconds / prefill_seconds:.3f}",
                f"{decode['snapkv']:.4f}",
                f"{decode['snapkv+reskv']:.4f}",
                paired_ratio(samples, "snapkv+reskv", "snapkv"),
                f"{decode['full']:.4f}",
                paired_ratio(samples, "snapkv+reskv", "full"),
                *compiled,
            )
            slots = budget_for(len(prompt_ids), ratio)
            entries = residual_size(0.1, slots)
            main_only, with_entries = attention_step_seconds(backbone, slots, entries)
            steps.add_row(
                str(len(prompt_ids)),
                f"{ratio:.1f}",
                str(slots),
                str(entries),
                f"{main_only * 1e6:.0f}",
                f"{with_entries * 1e6:.0f}",
                f"{with_entries / main_only:.2f}",
                f"{(with_entries - main_only) * backbone.num_layers * 1e3:.1f}",
            )
    console.print(table)
    console.print(steps)
    if args.count_lengths:
        console.print(counts_table(args.count_lengths, 0.9, list(COUNTED_METHODS)))
        console.print(
            decode_counts_table(args.count_lengths, 0.9, list(DECODE_COUNTED_METHODS), not args.skip_compiled)
        )
        console.print(launches_table(131072, 0.9))
    if not args.skip_memory:
        memory = kmeans_peak_memory()
        console.print(
            f"k-means, Llama-3.1-8B-shaped layer (8 KV heads, head dim 128, bf16) at 32K, ratio 0.6, "
            f"r = 0.2 b: {memory['points']} points, {memory['entries']} entries per head, "
            f"peak {memory['peak_bytes'] / 2**20:.0f} MiB, {memory['seconds']:.2f} s"
        )
    console.print(machine_header())


if __name__ == "__main__":
    main()
