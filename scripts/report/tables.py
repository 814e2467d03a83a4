"""The paper's tables from the results frames (scripts.report.frames): LaTeX (booktabs), markdown, CSV.

    python -m scripts.report.tables [--results-dir results [...]] [--out-dir results/tables] [--show-n]
        [--summary]

Several results roots are read as one (their tables then need ``--out-dir``); ``--summary`` writes the
averages and the verdict's claims only: ``make tables-combined``, the committed reproductions' view,
both backbones and both lengths side by side, the verdict pooling a backbone's lengths as the paper's
claims do.

Tables (each as ``<name>.tex``, ``<name>.md``, ``<name>.csv``; ``tables.tex`` inputs them all),
and the frames themselves as ``results.csv`` (one row per configuration, with its score's 95% interval
``score_low``, ``score_high``: scripts.report.statistics), ``samples.csv`` and, where
the quality measures ran, ``layers.csv`` (per layer; the quality tables are scripts.report.quality_tables):

- ``ruler_averages``, ``longbench_averages`` (tab:ruler_paper, tab:longbench_paper): average score
  per setting x method x backbone x length x retained budget, a full-cache row, bold for the better
  of each baseline / +ResKV pair.
- ``tasks_<backbone>_<benchmark>-<length>`` (the appendix tables): every task and the average per
  budget x setting x method; bold on the better average of each pair.
- ``cam_<backbone>_<ratio>_<setting>`` (tab:snapkv_cam_reskv_tasks): SnapKV, +CaM, +ResKV per
  task; bold on the best of each column.
- ``ablation_<backbone>_<method>_<ratio>_<setting>`` (tab:ablation_main): ResKV and its three
  ablations per task with the drop from ResKV; bold on the best of each column.
- ``verdict_claims_<backbone>``, ``verdict_pairs_<backbone>``, ``verdict_cells_<backbone>``: the
  paper's claims, +ResKV pairs and numbers against the results (scripts.report.verdict_tables).

Rules every table follows: a configuration that was not run is shown as missing (``--``),
never as 0; rows shown side by side (a baseline and its +ResKV, the CaM and ablation rows) are
scored, task by task, on the samples all of them scored, so a pair never compares different
samples; a cell whose samples are fewer than its task has so far (the most any configuration of the
task has) is marked partial (dagger); the notes give the samples per task (``--show-n``: per cell
in .md and .csv); a task whose data is unavailable is shown as ``n/a`` and left out of averages;
an average needs every averaged task of its row, otherwise it is missing.
Averages are the unweighted mean of the task scores shown (each the benchmark's own
``task_score``), rounded to two decimals; bold marks a strict winner of the two-decimal values
only, none on a tie. LongBench averages cover its 16 English tasks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

import benchmarks
from scripts.harness.store import ResultStoreError, load_results
from scripts.report.frames import (
    KEY_COLUMNS,
    as_written,
    frames_from_results,
    heads_frame,
    layers_frame,
    write_frames,
)
from scripts.report.index import ResultIndex
from scripts.report.paper_tables import ablation_tables, averages_table, cam_tables, task_table
from scripts.report.quality_tables import quality_tables
from scripts.report.render import Table, write_tables
from scripts.report.statistics import score_intervals
from scripts.report.verdict_tables import verdict_tables


def averages_tables(index: ResultIndex) -> list[Table]:
    """Each benchmark's averages table, where the results hold that benchmark."""
    return [
        table for table in (averages_table(index, benchmark) for benchmark in benchmarks.BENCHMARKS) if table
    ]


def all_tables(index: ResultIndex, heads: pd.DataFrame | None = None) -> list[Table]:
    """Every table the results support; ``heads`` (``scripts.report.frames.heads_frame``) adds the proxy's
    choices to the quality tables."""
    tables = averages_tables(index)
    for benchmark in benchmarks.BENCHMARKS:
        for backbone in index.backbones(benchmark):
            tables += [
                task_table(index, backbone, benchmark, length)
                for length in index.lengths(backbone, benchmark)
            ]
    tables += cam_tables(index) + ablation_tables(index) + quality_tables(index, heads)
    return tables + verdict_tables(index)


def summary_tables(index: ResultIndex) -> list[Table]:
    """The view across reproductions (``--summary``): each benchmark's averages and each backbone's
    verdict on the paper's claims."""
    claims = [table for table in verdict_tables(index) if table.name.startswith("verdict_claims_")]
    return averages_tables(index) + claims


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results-dir",
        type=Path,
        nargs="+",
        default=[Path("results")],
        help="results roots, read as one (each <dir>/runs; default: results)",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: <results-dir>/tables (one root)")
    parser.add_argument(
        "--show-n", action="store_true", help="append each cell's samples per task to the .md and .csv cells"
    )
    parser.add_argument(
        "--summary",
        action="store_true",
        help="the averages and the verdict's claims only, without the results as data",
    )
    args = parser.parse_args(argv)
    missing = [str(root) for root in args.results_dir if not root.is_dir()]
    if missing:
        parser.error(f"--results-dir {', '.join(missing)}: no such directory")
    if args.out_dir is None and len(args.results_dir) > 1:
        parser.error(
            f"--out-dir is needed with several --results-dir ({', '.join(map(str, args.results_dir))})"
        )
    try:  # read once, used thrice
        results, unavailable, warnings = load_results(*(root / "runs" for root in args.results_dir))
    except ResultStoreError as error:
        sys.exit(f"scripts.report.tables: error: {error}")
    samples, configs = frames_from_results(results, unavailable)
    for warning in warnings:
        print(f"warning: {warning}")
    index = ResultIndex(samples, configs)
    tables = summary_tables(index) if args.summary else all_tables(index, heads_frame(results))
    out_dir = args.out_dir or args.results_dir[0] / "tables"
    write_tables(tables, out_dir, args.show_n)
    if args.summary:
        print(f"{len(tables)} tables written to {out_dir} (.tex, .md, .csv; tables.md has them all)")
        return
    intervals = score_intervals(samples, KEY_COLUMNS)
    configs = configs.merge(intervals, on=KEY_COLUMNS, how="left")
    configs.insert(configs.columns.get_loc("score") + 1, "score_low", configs.pop("score_low"))
    configs.insert(configs.columns.get_loc("score") + 2, "score_high", configs.pop("score_high"))
    frames = write_frames(samples, configs, out_dir)
    layers = layers_frame(results)
    if len(layers):
        as_written(layers).to_csv(out_dir / "layers.csv", index=False)
        frames.append(out_dir / "layers.csv")
    print(
        f"{len(tables)} tables written to {out_dir} (.tex, .md, .csv; tables.md has them all); "
        f"the results as data: {', '.join(path.name for path in frames)}"
    )


if __name__ == "__main__":
    main()
