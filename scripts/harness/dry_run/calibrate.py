"""This device's rates for the dry run's estimate: ``python run.py <overrides> dry_run=calibrate``.

On a copy of the plan's backbone (random weights of its shape where ``PAPER_SHAPES`` knows it, so
nothing is downloaded; the embedded and tiny models as they are), at a quarter, half and all of the
plan's length (within the backbone's positions), after one untimed pass at the shortest, each
point the fastest of ``REPEATS`` calls:

- the context prefill, and the question's forward after it (``Prefill.observations("aware")``);
- the prefill's extra time with each of the grid's methods that accumulates attention (H2O);
- one construction of each of the grid's compressing methods at the grid's middle ratio, aware;
- ``DECODE_STEPS`` decode steps in the plan's decode mode: one full-cache row, one compressed row and
  a batch of ``BATCH_ROWS`` compressed rows (where the mode decodes batches).

The points go to ``results/calibration/<device kind>.json`` (``scripts.harness.dry_run.rates`` fits and
reads them), under the plan's backbone, replacing what that backbone held there except the rates of
the other decode mode. Times include the device's queued work (``scripts.measure.timed``).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from baselines import build_method
from baselines.registry import FULL_METHOD, RESIDUAL_SUFFIX
from reskv.backbones import PAPER_SHAPES, Backbone, load_backbone, random_backbone
from reskv.batching import grid_decoding
from reskv.engine import Prefill
from reskv.grid import decode_grid, model_shape
from reskv.method import Method
from scripts.harness.dry_run.cost import row_slots
from scripts.harness.dry_run.rates import SCHEMA
from scripts.harness.dry_run.workload import QUESTION_TOKENS, Workload
from scripts.harness.grid import GridRun
from scripts.harness.plan import GridEntry, Plan
from scripts.harness.store import provenance
from scripts.machine import cpu_name, load_average
from scripts.measure import random_prompt, synchronize, timed

log = logging.getLogger(__name__)
DECODE_STEPS = 16
REPEATS = 2  # each point the fastest of this many calls: a shared host's load only ever adds time
BATCH_ROWS = 8
TOKENS = range(100, 30000)  # token ids the random prompts draw from: no special ids of the tokenizers


def calibration_backbone(plan: Plan, device: str) -> Backbone:
    """The plan's backbone: random weights of its shape where known (no download), else loaded."""
    if plan.backbone not in PAPER_SHAPES:
        return load_backbone(plan.backbone, plan.dtype, device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, plan.dtype) if plan.dtype != "auto" else None
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    torch.manual_seed(0)
    return random_backbone(plan.backbone, dtype, device)


def calibration_lengths(plan: Plan, max_positions: int) -> list[int]:
    longest = min(plan.length, max_positions - DECODE_STEPS)
    shortest = 2 * QUESTION_TOKENS  # a context as long as the question at least
    return sorted({max(shortest, longest // 4), max(shortest, longest // 2), max(shortest, longest)})


def middle_ratio(plan: Plan) -> float:
    ratios = sorted(plan.ratios)
    return ratios[len(ratios) // 2] if ratios else 0.9


def kind(label: str) -> str:
    return "reskv" if RESIDUAL_SUFFIX in label else "base"


def fastest(device: torch.device, fn, *args) -> tuple[Any, float]:
    """``fn(*args)``'s last result and its fastest time over ``REPEATS`` calls."""
    best = math.inf
    for _ in range(REPEATS):
        result = None  # the previous call's result is let go before the next call
        result, seconds = timed(device, fn, *args)
        best = min(best, seconds)
    return result, best


def decode_point(
    prefill: Prefill, rows: list[tuple[Method, GridEntry]], mode: str, workload: Workload
) -> list[float] | None:
    """``[rows, slots, seconds a step]`` of one batch of ``rows`` decoded ``DECODE_STEPS`` steps;
    None where the mode does not decode such a batch."""
    requests = [(method, entry.setting or "aware") for method, entry in rows]
    options = dict(max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS, decode=mode, max_rows=len(rows))
    seconds = math.inf
    for _ in range(REPEATS):
        try:
            generations = list(decode_grid(prefill, requests, **options))
        except ValueError:
            return None
        timings = generations[0][1].timings  # decode_s: the batch's time shared by its rows
        seconds = min(seconds, timings["decode_s"] * len(rows) / timings["decode_tokens"])
    return [len(rows), row_slots(rows[0][1], workload), round(seconds, 6)]


def measure(plan: Plan, backbone: Backbone) -> dict[str, Any]:
    """The backbone's entry of a calibration file: every stage's points, with their sources."""
    device = backbone.device
    mode, _ = grid_decoding(plan.decode, plan.decode_batch, device.type)  # "auto" on this device
    ratio = middle_ratio(plan)
    # One configuration per compressing label, at the middle ratio, compressing the whole prompt.
    entries = {e.label: dataclasses.replace(e, setting="aware") for e in plan.grid if e.ratio == ratio}
    built = GridRun(plan, backbone, {}).methods
    methods = {label: built[label, ratio] for label in entries}
    accumulating = [label for label, method in methods.items() if method.needs_accumulated_attention]
    full = (build_method(FULL_METHOD), GridEntry(FULL_METHOD, None, None, FULL_METHOD))
    # The decode rows: a base method's where the grid has one (its construction is the cheapest).
    labels = sorted(entries, key=lambda label: (kind(label) != "base", label in accumulating))
    row = (methods[labels[0]], entries[labels[0]]) if labels else full
    batches = [[full], *([[row], [row] * BATCH_ROWS] if labels else [])]
    lengths = calibration_lengths(plan, backbone.model.config.max_position_embeddings)
    points: dict[str, list] = {"prefill": [], "question": [], "decode": []}
    with_method: dict[str, list] = {label: [] for label in accumulating}
    construction: dict[str, list] = {label: [] for label in entries}
    for number, length in enumerate([lengths[0], *lengths]):
        kept = number > 0  # the first pass warms up: kernels chosen, allocator grown, steps compiled
        prompt = random_prompt(TOKENS, length, seed=length)
        context = length - QUESTION_TOKENS
        workload = Workload(1, length, QUESTION_TOKENS, DECODE_STEPS, "random")
        prefill, seconds = fastest(device, Prefill, backbone, prompt, context)
        _, question = timed(device, prefill.observations, "aware")  # computed once per Prefill
        if kept:
            points["prefill"].append([context, round(seconds, 6)])
            points["question"].append([QUESTION_TOKENS, round(question, 6)])
        if accumulating:  # the grid's prefill then accumulates attention for all of them
            del prefill
            prefill, accumulated = fastest(device, Prefill, backbone, prompt, context, list(methods.values()))
            for label in accumulating if kept else ():
                with_method[label].append([context, round(max(accumulated - seconds, 1e-6), 6)])
        for label in entries:
            _, seconds = fastest(device, prefill.compressed, methods[label], "aware")
            if kept:
                construction[label].append([length, round(seconds, 6)])
        for rows in batches:
            point = decode_point(prefill, rows, mode, workload)
            if kept and point is not None:
                points["decode"].append(point)
        del prefill
        gc.collect()
        synchronize(device)
    points |= {"prefill_with": with_method, "construction": construction}
    return rates_entry(plan, backbone, mode, lengths, ratio, points)


def rates_entry(
    plan: Plan, backbone: Backbone, mode: str, lengths: list[int], ratio: float, points: dict
) -> dict:
    """The measured points as a calibration file's rates (``scripts.harness.dry_run.rates``)."""
    where = f"measured by dry_run=calibrate at {', '.join(map(str, lengths))} tokens"
    construction = {
        label: {
            "terms": ["1", "s", "s2"],
            "points": found,
            "ratio": ratio,
            "source": f"{where}, ratio {ratio:g}, aware",
        }
        for label, found in points["construction"].items()
    }
    for group in ("base", "reskv"):
        pooled = [
            point
            for label, found in points["construction"].items()
            if kind(label) == group
            for point in found
        ]
        if pooled:
            source = f"{where}: every {group} method of the calibrating grid pooled"
            terms = ["1", "s", "s2"]
            construction[group] = {"terms": terms, "points": pooled, "ratio": ratio, "source": source}
    batches = sorted({point[0] for point in points["decode"]})
    decode_terms = ["1", "B", "BL"] if len(batches) > 1 else ["1", "BL"]
    return {
        "dtype": str(backbone.model.dtype).removeprefix("torch."),
        "prefill": {"terms": ["1", "s", "s2"], "points": points["prefill"], "source": where},
        "question": {
            "terms": ["1"],
            "points": points["question"],
            "source": f"{where}: the question's forward after the context",
        },
        "prefill_with": {
            label: {
                "terms": ["1", "s", "s2"],
                "points": found,
                "source": f"{where}: the prefill with it less without",
            }
            for label, found in points["prefill_with"].items()
        },
        "construction": construction,
        "decode": {
            mode: {
                "terms": decode_terms,
                "points": points["decode"],
                "source": f"{where}: {DECODE_STEPS} steps of batches of {batches} rows",
            }
        },
        "measured": {
            "at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            **{name: value for name, value in provenance().items() if name.startswith("git_")},
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average": load_average(),
            "lengths": lengths,
        },
    }


def write_calibration(
    path: Path, device: str, device_type: str, backbone: str, entry: dict[str, Any], memory: int | None = None
) -> None:
    """Put ``entry`` under ``backbone`` in the calibration file ``path``, keeping its other
    backbones and this backbone's rates of other decode modes; ``memory``: the device's bytes."""
    notes = [
        "Measured by dry_run=calibrate: each backbone's 'measured' block says when, on which commit, "
        "with how many torch threads and at what load average."
    ]
    document = {"schema": SCHEMA, "device": device, "device_type": device_type, "notes": notes}
    document["backbones"] = {}
    if path.exists():
        existing = json.loads(path.read_text())
        if existing.get("schema") == SCHEMA:
            document = existing
    if memory is not None:
        document["memory_bytes"] = memory
    previous = document["backbones"].get(backbone, {})
    entry["decode"] = {**previous.get("decode", {}), **entry["decode"]}
    document["backbones"][backbone] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    # One line per innermost list (a point, a rate's terms), as the committed files are written.
    text = re.sub(
        r"\[\s+([^][{}]*?)\s+\]",
        lambda m: "[" + re.sub(r"\s+", " ", m[1]) + "]",
        json.dumps(document, indent=1),
    )
    path.write_text(text + "\n")


def calibrate(plan: Plan, device: str, path: Path) -> Path:
    """Measure this device's rates for ``plan``'s backbone and file them in ``path``."""
    backbone = calibration_backbone(plan, device)
    log.info("calibrating %s on %s into %s", plan.backbone, backbone.device, path)
    cuda = backbone.device.type == "cuda"
    name = torch.cuda.get_device_name(backbone.device) if cuda else cpu_name()
    entry = measure(plan, backbone)
    # What the dry run's memory rule needs (``scripts.harness.dry_run.cost.device_memory``).
    entry["weights_bytes"] = sum(p.numel() * p.element_size() for p in backbone.model.parameters())
    entry["shape"] = dataclasses.asdict(model_shape(backbone))
    memory = torch.cuda.mem_get_info(backbone.device)[1] if cuda else None
    write_calibration(path, name, backbone.device.type, plan.backbone, entry, memory)
    return path
