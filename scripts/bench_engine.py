"""Engine speed figures on the embedded model, every ratio measured within one run.

    python -m scripts.bench_engine            # ~4K and 8K prompts, ratio 0.9

Prints: ResKV construction time (k-means + validation over all layers and heads) against the
prefill time; decode time per token of ``snapkv+reskv`` against ``snapkv``; compressed against
full-cache decode at 8K. Decode runs alternate between methods (A B A B ...) so machine noise
hits both alike; every generation is forced to its full length (EOS ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
from rich.console import Console
from rich.table import Table

from baselines import build_method
from reskv.backbones import load_backbone
from reskv.engine import Prefill

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


def decode_seconds_per_token(prefill: Prefill, names: list[str], ratio: float, tokens: int, rounds: int):
    """Median decode seconds per token for each method, rounds interleaved."""
    methods = {name: build_method(name, ratio) for name in names}
    samples = {name: [] for name in names}
    for _ in range(rounds):
        for name, method in methods.items():
            generation = prefill.generate(method, "aware", max_new_tokens=tokens)
            samples[name].append(generation.timings["decode_s"] / generation.timings["decode_tokens"])
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    console = Console(width=200)  # every column readable when printed to a file or a narrow terminal
    backbone = load_backbone("smollm2-135m")
    backbone = dataclasses.replace(backbone, stop_token_ids=())  # always decode the full length
    table = Table(title=f"Engine speed, SmolLM2-135M, ratio {args.ratio}, {torch.get_num_threads()} threads")
    for column in (
        "prompt tokens",
        "prefill s",
        "snapkv compress s",
        "snapkv+reskv compress s",
        "construction / prefill",
        "decode s/tok snapkv",
        "decode s/tok +reskv",
        "+reskv / snapkv",
        "decode s/tok full",
        "compressed / full",
    ):
        table.add_column(column, justify="right")
    for length in args.lengths:
        prompt_ids, context_length = haystack_prompt(backbone.tokenizer, length)
        methods = [build_method(name, args.ratio) for name in ("snapkv", "snapkv+reskv")]
        prefill = Prefill(backbone, prompt_ids, context_length, methods)
        prefill.generate(methods[0], "aware", 1)  # the aware setting prefills the question too
        prefill_seconds = prefill.timings["prefill_s"] + prefill.timings.get("question_prefill_s", 0.0)
        compress = {
            method.name: statistics.median(
                prefill.generate(method, "aware", 1).timings["compress_s"] for _ in range(args.rounds)
            )
            for method in methods
        }
        construction = compress["snapkv+reskv"] - compress["snapkv"]
        decode = decode_seconds_per_token(
            prefill, ["snapkv", "snapkv+reskv", "full"], args.ratio, args.decode_tokens, args.rounds
        )
        table.add_row(
            str(len(prompt_ids)),
            f"{prefill_seconds:.2f}",
            f"{compress['snapkv']:.3f}",
            f"{compress['snapkv+reskv']:.3f}",
            f"{construction / prefill_seconds:.3f}",
            f"{decode['snapkv']:.4f}",
            f"{decode['snapkv+reskv']:.4f}",
            f"{decode['snapkv+reskv'] / decode['snapkv']:.3f}",
            f"{decode['full']:.4f}",
            f"{decode['snapkv+reskv'] / decode['full']:.3f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
