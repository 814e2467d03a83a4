"""The paper's analysis figures (fig:analysis) and score-versus-budget plots, as PNG and PDF.

    python -m scripts.report.figures [--results-dir results] [--out-dir results/figures]

- ``efficiency_<backbone>``: (a) peak memory and (b) decode throughput versus context length for
  the full cache, a baseline and +ResKV, from ``scripts.bench.efficiency``'s measurements.
- ``budget_<backbone>_<benchmark>-<length>_<setting>``: average score versus retained budget,
  one line per method, the full cache as a horizontal line: the averages table's numbers (pairs
  on shared samples), titled with the tables' names, a note of the tasks and samples per task.
- ``layers_<backbone>_<benchmark>-<length>_<setting>``: the quality measures per layer
  (``scripts.report.frames.layers_frame``): (a) attention-output error against the full cache of
  every method at the tightest budget, (b) the share of attention mass on residual entries of
  every +ResKV method at every budget; means over samples and tasks.
- ``evicted_keys_<backbone>``: PCA projections of the keys evicted from the main cache for chosen
  layers and KV heads, coloured by residual cluster, from ``scripts.bench.evicted_keys``.

A figure whose data is missing is named on stdout with the ``make`` target that produces it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

import benchmarks  # noqa: E402
from scripts.harness.records import MethodLabel, display_name  # noqa: E402
from scripts.harness.store import ResultStoreError, load_results  # noqa: E402
from scripts.report.frames import frames_from_results, layers_frame  # noqa: E402
from scripts.report.index import ResultIndex  # noqa: E402
from scripts.report.names import (  # noqa: E402
    SETTING_NAMES,
    TASK_NAMES,
    averaged_task_set,
    backbone_name,
    benchmark_name,
)
from scripts.report.paper_tables import method_blocks  # noqa: E402
from scripts.report.render import Cell, samples_note  # noqa: E402

FORMATS = ("png", "pdf")
MEBIBYTE = 2**20


def save(figure, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{suffix}" for suffix in FORMATS]
    for path in paths:
        # A PDF records when it was written; without the date `make figures` rewrites the committed
        # files byte for byte from the same results (PNG holds no date).
        metadata = {"CreationDate": None} if path.suffix == ".pdf" else None
        figure.savefig(path, bbox_inches="tight", dpi=150, metadata=metadata)
    plt.close(figure)
    return paths


def efficiency_figure(measurements: dict, out_dir: Path) -> list[Path]:
    """Panels (a) peak memory and (b) decode throughput per method versus context length.

    ``measurements`` is ``scripts.bench.efficiency``'s report: ``backbone``, ``memory_kind`` (what "peak
    memory" is on that device) and ``rows`` of ``method``, ``context_length``, ``peak_memory_bytes``,
    ``decode_tokens_per_s`` (None where the run failed, e.g. out of memory: drawn as a gap).
    """
    figure, (memory_axis, speed_axis) = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    methods = list(dict.fromkeys(row["method"] for row in measurements["rows"]))
    for method in methods:
        rows = sorted(
            (row for row in measurements["rows"] if row["method"] == method),
            key=lambda row: row["context_length"],
        )
        lengths = [row["context_length"] for row in rows]
        memory = [
            np.nan if row["peak_memory_bytes"] is None else row["peak_memory_bytes"] / MEBIBYTE
            for row in rows
        ]
        speed = [np.nan if row["decode_tokens_per_s"] is None else row["decode_tokens_per_s"] for row in rows]
        name = MethodLabel.parse(method).display()
        memory_axis.plot(lengths, memory, marker="o", label=name)
        speed_axis.plot(lengths, speed, marker="o", label=name)
    for axis, title, unit in (
        (memory_axis, "(a) Peak memory", f"MiB ({measurements['memory_kind']})"),
        (speed_axis, "(b) Decode throughput", "tokens / s"),
    ):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("context length (tokens)")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    speed_axis.legend()
    figure.suptitle(f"{backbone_name(measurements['backbone'])}: efficiency versus context length")
    return save(figure, out_dir, f"efficiency_{measurements['backbone'].replace('/', '--')}")


MARKERS = "osD^vP*X"
# The layer figures draw up to a dozen method labels and four ratios: a label keeps one colour of
# tab20 in every panel and figure, a ratio one line style, so no two lines look alike.
LABEL_COLOURS = plt.get_cmap("tab20").colors
RATIO_STYLES = ("-", "--", "-.", ":")
OFFSET_SHARE = 0.08  # of the narrowest budget gap between neighbouring curves, so equal curves stay visible


def budget_curves(index: ResultIndex, backbone: str, benchmark: str, length: int, setting: str) -> dict:
    """``{label: [Cell per ratio]}`` as the averages table shows them (pairs on shared samples)."""
    curves = {}
    for block in method_blocks(index, backbone, benchmark, length, setting):
        columns = [
            index.block_averages(backbone, benchmark, length, setting, ratio, block)
            for ratio in index.ratios(backbone, benchmark, length)
        ]
        curves |= {label: [column[label] for column in columns] for label in block}
    return {label: cells for label, cells in curves.items() if any(cell.value is not None for cell in cells)}


def budget_figures(index: ResultIndex, out_dir: Path) -> list[Path]:
    """Average score versus retained budget per method, one figure per backbone x benchmark x setting."""
    return [
        path
        for benchmark in benchmarks.BENCHMARKS
        for backbone in index.backbones(benchmark)
        for length in index.lengths(backbone, benchmark)
        for setting in SETTING_NAMES
        for path in budget_figure(index, backbone, benchmark, length, setting, out_dir)
    ]


def budget_figure(index: ResultIndex, backbone, benchmark, length, setting, out_dir: Path) -> list[Path]:
    """One budget figure (none without results). Each method has its own marker and a slight
    horizontal offset, so a curve equal to another (SnapKV and +ResKV on a tiny model) stays
    visible; the note under the plot names the averaged tasks and the samples per task."""
    curves = budget_curves(index, backbone, benchmark, length, setting)
    if not curves:
        return []
    budgets = np.array([round((1 - ratio) * 100, 1) for ratio in index.ratios(backbone, benchmark, length)])
    gap = np.diff(np.sort(budgets)).min() if len(budgets) > 1 else 10.0
    full = index.block_averages(backbone, benchmark, length, None, None, ["full"])["full"]
    figure, axis = plt.subplots(figsize=(4.5, 3.6), layout="constrained")
    for number, (label, cells) in enumerate(curves.items()):
        _, residual, _ = index.label_parts[label]
        axis.plot(
            budgets + (number - (len(curves) - 1) / 2) * OFFSET_SHARE * gap,
            [np.nan if cell.value is None else cell.value for cell in cells],
            marker=MARKERS[number % len(MARKERS)],
            markerfacecolor="none",
            linestyle="--" if residual else "-",
            label=index.method_name(label),
        )
    if full.value is not None:
        axis.axhline(full.value, color="black", linewidth=1, label="Full Cache")
    axis.set_xlabel("retained KV budget (%)")
    axis.set_ylabel("average score")
    axis.set_title(f"{backbone_name(backbone)} {benchmark_name(benchmark, length)} {SETTING_NAMES[setting]}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    cells = [cell for cells in curves.values() for cell in cells] + [full]
    figure.text(0, 0, budget_note(index, backbone, benchmark, length, cells), fontsize=6, va="top")
    return save(figure, out_dir, f"budget_{backbone.replace('/', '--')}_{benchmark}-{length}_{setting}")


def budget_note(index: ResultIndex, backbone: str, benchmark: str, length: int, cells: list[Cell]) -> str:
    """Tasks averaged and samples per task of a budget figure, and why curves are offset."""
    tasks = [TASK_NAMES.get(task, task) for task in index.averaged_tasks(backbone, benchmark, length)]
    lines = [f"Average over {len(tasks)} of {len(averaged_task_set(benchmark))} tasks: {', '.join(tasks)}."]
    lines += [note for note in [samples_note(cells)] if note]
    if any(cell.partial for cell in cells if cell.value is not None):
        lines.append("Some points have fewer samples than their task has (see the tables' \u2020).")
    lines.append("Curves are offset slightly along x so equal values stay visible.")
    return "\n".join(lines)


def evicted_keys_figure(panels: Sequence[dict], backbone: str, out_dir: Path) -> list[Path]:
    """PCA of evicted keys per panel (``layer``, ``head``, ``projection`` [n, 2], ``clusters`` [n])."""
    figure, axes = plt.subplots(
        1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False, layout="constrained"
    )
    for axis, panel in zip(axes[0], panels, strict=True):
        projected = np.asarray(panel["projection"], dtype=np.float64)
        axis.scatter(projected[:, 0], projected[:, 1], c=panel["clusters"], cmap="tab20", s=6)
        axis.set_title(
            f"layer {panel['layer']}, KV head {panel['head']} ({len(set(panel['clusters']))} clusters)",
            fontsize=9,
        )
        axis.set_xlabel("PC 1")
        axis.set_ylabel("PC 2")
    figure.suptitle(f"{backbone_name(backbone)}: evicted keys, coloured by residual cluster")
    return save(figure, out_dir, f"evicted_keys_{backbone.replace('/', '--')}")


def layer_figures(layers, out_dir: Path) -> list[Path]:
    """Per-layer attention error and residual share (the quality measures), one figure per setting:
    (a) every method label at the tightest budget, (b) every +ResKV label (ablations included) at
    every budget; a label has one colour in every panel and figure, a ratio one line style."""
    paths = []
    compressed = layers[layers["setting"].notna()]
    groups = compressed.groupby(["backbone", "benchmark", "length", "setting"])
    labels = sorted(set(compressed["label"]))
    colours = {label: LABEL_COLOURS[number % len(LABEL_COLOURS)] for number, label in enumerate(labels)}
    for (backbone, benchmark, length, setting), rows in groups:
        means = rows.groupby(["label", "ratio", "layer"])[["attention_error", "residual_share"]].mean()
        tightest = rows["ratio"].max()
        residual = set(rows.loc[rows["residual"].astype(bool), "label"])
        ratios = sorted(set(rows["ratio"]))
        figure, (error_axis, share_axis) = plt.subplots(1, 2, figsize=(14, 3.6), layout="constrained")
        parts = (
            rows[["label", "base_method", "residual", "options"]]
            .drop_duplicates("label")
            .sort_values("label")
        )
        for label, base, with_residual, options in parts.values:
            name, colour = display_name(base, with_residual, options), colours[label]
            if (label, tightest) in means.index.droplevel("layer"):
                curve = means.loc[(label, tightest)]
                error_axis.plot(curve.index, curve["attention_error"], marker=".", color=colour, label=name)
            if label in residual:
                for ratio in sorted(set(rows.loc[rows["label"] == label, "ratio"])):
                    curve = means.loc[(label, ratio)]
                    share_axis.plot(
                        curve.index,
                        curve["residual_share"],
                        marker=".",
                        color=colour,
                        linestyle=RATIO_STYLES[ratios.index(ratio) % len(RATIO_STYLES)],
                        label=f"{name} {ratio:g}",
                    )
        error_axis.set(
            xlabel="layer",
            ylabel="||o - o_full|| / ||o_full||",
            title=f"(a) attention error, ratio {tightest:g}",
        )
        share_axis.set(
            xlabel="layer", ylabel="attention mass on residual entries", title="(b) residual share"
        )
        for axis in (error_axis, share_axis):  # legends beside the panels: the curves fill them
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        samples = len(rows[["task", "index"]].drop_duplicates())
        figure.suptitle(
            f"{backbone_name(backbone)}, {benchmark_name(benchmark, length)}, {SETTING_NAMES[setting]}: "
            f"{samples} samples, every layer fed the full cache's hidden states"
        )
        name = f"layers_{backbone.replace('/', '--')}_{benchmark}-{length}_{setting}"
        paths += save(figure, out_dir, name)
    return paths


def all_figures(results_dir: Path, out_dir: Path) -> list[Path]:
    """Every figure whose data is present under ``results_dir``; says which is missing and how to make it."""
    runs_dir = results_dir / "runs"
    results, unavailable, _ = load_results(runs_dir)
    index = ResultIndex(*frames_from_results(results, unavailable))
    paths = budget_figures(index, out_dir)
    if not paths:
        print(f"budget figures: no results under {runs_dir}; `make run` (or python run.py) produces them")
    paths += layer_figures(layers_frame(results), out_dir)
    bench_dir = runs_dir / "_bench"
    for kind, draw in (
        ("efficiency", lambda data: efficiency_figure(data, out_dir)),
        ("evicted_keys", lambda data: evicted_keys_figure(data["panels"], data["backbone"], out_dir)),
    ):
        found = sorted(bench_dir.glob(f"{kind}_*.json"))
        for path in found:
            paths += draw(json.loads(path.read_text()))
        if not found:
            print(
                f"{kind} figure: no {kind}_<backbone>.json under {bench_dir}; "
                f"`make bench RESULTS={results_dir}` produces it"
            )
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    parser.add_argument("--out-dir", type=Path, default=None, help="default: <results-dir>/figures")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or args.results_dir / "figures"
    try:
        paths = all_figures(args.results_dir, out_dir)
    except ResultStoreError as error:
        sys.exit(f"scripts.report.figures: error: {error}")
    print(f"{len(paths)} figure files written to {out_dir}")


if __name__ == "__main__":
    main()
