"""On-disk cache of generated RULER items: one jsonl file per (task, length, tokenizer, seed, count).

Generating a 32K sample takes seconds (every binary-search probe tokenizes a whole prompt), so a
rerun reads the items back instead. Files are written to a temporary name and renamed, so an
interrupted run never leaves a truncated file behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from benchmarks.item import Item
from benchmarks.ruler.templates import UPSTREAM_COMMIT
from reskv.assets import ASSETS_DIR

DEFAULT_CACHE_DIR = ASSETS_DIR / "ruler_cache"
# Bump when a change to the generators changes the items, so stale caches are not read.
GENERATOR_VERSION = 1


def tokenizer_key(tokenizer, tokenizer_name: str | None) -> str:
    """The tokenizer's name when given, else a hash of its vocabulary and chat template."""
    if tokenizer_name:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", tokenizer_name)
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(str(tokenizer.chat_template).encode())
    return "vocab-" + digest.hexdigest()[:16]


def cache_file(
    cache_dir: Path,
    task: str,
    length: int,
    tokenizer_id: str,
    seed: int,
    count: int,
    source: str,
    template: str,
) -> Path:
    """``source`` distinguishes items built from different input data (qa files), ``template`` those
    built in a RULER model template (the backbone's own, ``"model"``, adds nothing to the name)."""
    suffix = f"-{source}" if source else ""
    if template != "model":
        suffix += f"-tpl_{template}"
    version = f"{UPSTREAM_COMMIT[:7]}-v{GENERATOR_VERSION}"
    return cache_dir / version / f"{task}-len{length}-{tokenizer_id}-seed{seed}-n{count}{suffix}.jsonl"


def read_items(path: Path) -> list[Item] | None:
    if not path.exists():
        return None
    items = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for name in ("prompt_ids", "references", "stop_token_ids"):
            record[name] = tuple(record[name])
        items.append(Item(**record))
    return items


def write_items(path: Path, items: list[Item]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(dataclasses.asdict(item)) + "\n" for item in items)
    handle, staging = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(lines)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
