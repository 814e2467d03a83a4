"""Peak memory and decode throughput versus context length (fig:analysis (a) and (b)).

    python -m scripts.bench.efficiency [--backbone smollm2-135m] [--lengths 1024 2048 4096 8192]
        [--methods full snapkv snapkv+reskv] [--ratio 0.9] [--new-tokens 32] [--results-dir results]

``--backbone llama3.1-8b-attention`` measures a random model with Llama-3.1-8B's attention (32
layers, 32 query heads, 8 KV heads, head dim 128, bf16) and hidden and MLP widths of 256
(``scripts.bench.decode_counts.narrow_llama_8b_attention``): the 8B model's KV cache and attention
transients on a CPU, without its weights, where the spec compares +ResKV's peak with its base's
(``docs/spec/reskv.md``, "Where the full cache lives").

For every (context length, method): prefill a random-token prompt of that length, compress,
decode exactly ``--new-tokens`` tokens (end-of-sequence tokens do not stop it, so every run
decodes the same amount), and record the peak memory of the whole request. A compressed method's
request compresses each layer inside the prefill and frees it (``Prefill(..., retain="compressed")``,
as kvpress and KVCache-Factory do): no full cache of every layer exists, which is the paper's
memory behaviour; the full method keeps its cache. The decode rate is the
inverse of the median step time over ``--new-tokens`` greedy steps in which all methods' caches,
compressed from one more prefill, take turns (A B C A B C ...), so drifts in the machine's speed
hit all methods alike.
Peak memory is ``scripts.measure.peak_allocated``'s: the most bytes the request held allocated at
once beyond what was allocated before it (the model weights), from CUDA's allocator statistics on
a GPU and from the profiler's allocation events on CPU. A request that runs out of memory is
recorded as None (a gap in the figure). Report: ``<results-dir>/runs/_bench/efficiency_<backbone>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from baselines import build_method
from reskv.backbones import Backbone, load_backbone
from reskv.engine import Prefill
from scripts.bench.decode_counts import narrow_llama_8b_attention
from scripts.bench.engine import decode_seconds_per_token
from scripts.measure import machine_header, peak_allocated, random_prompt

NARROW_8B = "llama3.1-8b-attention"


def random_token_prompt(backbone: Backbone, length: int, seed: int) -> list[int]:
    """Token ids drawn uniformly from the vocabulary minus special tokens (fixed seed)."""
    special = set(backbone.tokenizer.all_special_ids)
    return random_prompt([i for i in range(len(backbone.tokenizer)) if i not in special], length, seed)


def measure(
    backbone: Backbone,
    lengths: Sequence[int],
    names: Sequence[str],
    ratio: float,
    new_tokens: int,
    seed: int = 42,
) -> list[dict]:
    """One row per (length, method): peak memory of one request (prefill, compression, ``new_tokens``
    decoded tokens) and the decode rate, from a second prefill whose compressed caches decode
    ``new_tokens`` steps in lockstep (``scripts.bench.engine.decode_seconds_per_token``)."""
    unstoppable = dataclasses.replace(backbone, stop_token_ids=())
    rows = []
    for length in lengths:
        prompt = random_token_prompt(backbone, length, seed)
        methods = {name: build_method(name, ratio, seed=seed) for name in names}
        at_length = {}
        for name, method in methods.items():
            gc.collect()
            try:
                retain = "full" if method.scorer is None else "compressed"
                with peak_allocated(backbone.device) as peak:
                    prefill = Prefill(unstoppable, prompt, length, [method], retain=retain)
                    generation = prefill.generate(method, "aware", max_new_tokens=new_tokens)
                timings = prefill.timings  # the whole prompt is the context: one forward either way
                at_length[name] = {
                    "peak_memory_bytes": peak.bytes,
                    "retain": retain,
                    "prefill_s": timings.get("prefill_s", timings.get("prompt_prefill_s")),
                    **generation.timings,
                }
                del prefill, generation
            except torch.OutOfMemoryError:
                at_length[name] = {"peak_memory_bytes": None, "error": "out of memory"}
        fitting = {name: methods[name] for name, row in at_length.items() if "error" not in row}
        gc.collect()
        try:
            prefill = Prefill(unstoppable, prompt, length, list(fitting.values()))
            seconds = decode_seconds_per_token(prefill, fitting, new_tokens)
            del prefill
        except torch.OutOfMemoryError:
            seconds = {}
        for name, row in at_length.items():
            row["decode_tokens_per_s"] = 1 / seconds[name] if name in seconds else None
            rows.append({"method": name, "context_length": length, **row})
            print(f"{name:>14} @ {length:>6}: {row}")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    parser.add_argument("--methods", nargs="+", default=["full", "snapkv", "snapkv+reskv"])
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    backbone = narrow_llama_8b_attention() if args.backbone == NARROW_8B else load_backbone(args.backbone)
    machine = {"start": machine_header()}
    rows = measure(backbone, args.lengths, args.methods, args.ratio, args.new_tokens)
    out = args.results_dir / "runs" / "_bench" / f"efficiency_{args.backbone.replace('/', '--')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "backbone": args.backbone,
                "ratio": args.ratio,
                "new_tokens": args.new_tokens,
                "decode_rate": "1 / median of new_tokens lockstep greedy steps (decode_s: the request's own)",
                "memory_kind": "allocated beyond the weights",
                "machine": {**machine, "end": machine_header()},  # cores, threads, torch, load, matmul rate
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
