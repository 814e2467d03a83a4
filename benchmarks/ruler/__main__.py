"""Materialise RULER items and show them for inspection by eye (needs only the tokenizer).

python -m benchmarks.ruler --task niah_single_1 --length 4096 --num-samples 3
"""

from __future__ import annotations

import argparse

from benchmarks.ruler import TASKS, UPSTREAM_COMMIT, generate_items, load_items
from benchmarks.ruler.prompt import MODEL_TEMPLATE, TEMPLATE_CHOICES


def elide(text: str, keep: int) -> str:
    """The text with its middle replaced by a marker when longer than ``2 * keep`` characters."""
    if keep <= 0 or len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters ...]\n{text[-keep:]}"


def show(item, tokenizer, keep: int) -> None:
    context = tokenizer.decode(item.context_ids)
    question = tokenizer.decode(item.question_ids)
    print(
        f"=== {item.task} #{item.index}: {item.length} prompt tokens (context {item.context_length}, "
        f"question {item.length - item.context_length}) + {item.max_new_tokens} to generate = "
        f"{item.length + item.max_new_tokens} / {item.metadata['max_seq_length']}"
    )
    print(f"references: {list(item.references)}   metric: {item.metric}")
    print(f"metadata: {item.metadata}")
    print("--- context")
    print(elide(context, keep))
    print("--- question")
    print(question)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Show RULER items (NVIDIA/RULER @ {UPSTREAM_COMMIT[:7]}).")
    parser.add_argument("--task", choices=TASKS, required=True)
    parser.add_argument(
        "--length", type=int, default=4096, help="max_seq_length: prompt + tokens to generate"
    )
    parser.add_argument("--num-samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--tokenizer", default="smollm2-135m", help="backbone name, hub id or local directory"
    )
    parser.add_argument(
        "--qa-data-dir", default=None, help="folder with dev-v2.0.json / hotpot_dev_distractor_v1.json"
    )
    parser.add_argument(
        "--template",
        choices=TEMPLATE_CHOICES,
        default=MODEL_TEMPLATE,
        help="model: the backbone's chat template; else RULER's template of that name",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="generate afresh, neither read nor write the cache"
    )
    parser.add_argument(
        "--show-chars",
        type=int,
        default=1500,
        help="characters shown at each end of the context (0: all of it)",
    )
    args = parser.parse_args(argv)

    from reskv.backbones import load_tokenizer  # imported late: it loads torch and transformers

    tokenizer = load_tokenizer(args.tokenizer)
    options = dict(
        length=args.length,
        num_samples=args.num_samples,
        seed=args.seed,
        qa_data_dir=args.qa_data_dir,
        template=args.template,
    )
    if args.no_cache:
        items = generate_items(args.task, tokenizer, **options)
    else:
        items = load_items(args.task, tokenizer, tokenizer_name=args.tokenizer, **options)
    for item in items:
        show(item, tokenizer, args.show_chars)


if __name__ == "__main__":
    main()
