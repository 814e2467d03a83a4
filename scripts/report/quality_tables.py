"""Tables of the quality measures (reskv.quality) next to the scores (scripts.report.tables).

For every backbone, benchmark and length whose samples carry the measures:

- ``quality_<backbone>_<benchmark>-<length>``: per budget, setting and method, the average score
  (as in the task tables) and the mean over samples of the answer log-likelihood gap to the full
  cache, the KL to the full cache over the forced steps, the attention-output error (mean over
  layers) and the share of attention mass on residual entries, with the residual's footprint: the
  share of (layer, KV head) pairs that got entries and the mean residual size ``r / b`` the proxy
  chose.
- ``pairs_<backbone>_<benchmark>-<length>``: each baseline against its +ResKV, per budget and
  setting, on the samples both ran: in how many samples +ResKV is closer to the full cache (smaller
  ``|log-likelihood gap|``, KL, attention error; strictly, so ties count for neither) and in how many
  tasks its score is higher (strictly).
- ``pairs_summary_<backbone>_<benchmark>-<length>``: the same pairs counted per configuration (task
  x budget x setting, means over its shared samples) and per base method, with the mean difference
  +ResKV minus base: the paper's "beats its base in 63 of 64 configurations" for each measure.
- ``proxy_<backbone>_<benchmark>-<length>``: how often the validation proxy chose each ratio of
  the grid, per +ResKV method, budget and setting (``scripts.report.frames.heads_frame``'s
  ``residual_choice``, as the compressor recorded it).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from baselines.registry import FULL_METHOD, RESIDUAL_BASES, RESIDUAL_SUFFIX, UNPAIRED_METHODS
from reskv.config import ResidualConfig
from scripts.harness.records import display_name, field_column
from scripts.report.frames import RESIDUAL_HEADS
from scripts.report.index import ResultIndex
from scripts.report.names import SETTING_NAMES, backbone_name, benchmark_name, retained
from scripts.report.render import CMIDRULE, MIDRULE, Cell, Row, Table
from scripts.report.statistics import Member, interval_text, mean_of_means, sign_test_interval

GAP, KL, ERROR, SHARE = (
    field_column("quality", name)
    for name in ("answer_log_prob_gap", "kl", "attention_error", "residual_share")
)
RESIDUAL_SLOTS, BUDGET = field_column("cache_stats", "residual_slots"), field_column("cache_stats", "budget")
# (column head, sample column, decimals, how "closer to the full cache" is read)
MEASURES = (
    ("LL gap", GAP, 3, "abs"),
    ("KL", KL, 4, "value"),
    ("Attn. err.", ERROR, 4, "value"),
)
RESIDUAL_MASS = ("Res. mass", SHARE, 3, None)  # shown beside the measures, not compared
NOTES = [
    "LL gap: answer log-likelihood under the method minus under the full cache (nats, teacher forced, "
    "first reference); KL: KL(full || method) of the next-token distributions over the first 16 decode "
    "steps, both fed the full cache's greedy continuation; Attn. err.: ||o - o_full|| / ||o_full|| of "
    "the attention output at those steps, every layer fed the full model's hidden states, mean over "
    "layers, heads and steps; Res. mass: share of attention mass on residual entries; Res. heads: "
    "(layer, KV head) pairs with residual entries; r/b: residual slots over the budget (reskv.quality).",
    "Means over the samples every method of a row block (a baseline and its +ResKV) ran.",
]


def _blocks(rows: pd.DataFrame) -> list[list[str]]:
    """The method labels of ``rows`` in blocks: pairs first (the paper's order), then unpaired
    methods, then labels with options alone."""
    labels = set(rows["label"])
    blocks = [[base, base + RESIDUAL_SUFFIX] for base in RESIDUAL_BASES]
    blocks = [[label for label in block if label in labels] for block in blocks]
    blocks += [[method] for method in UNPAIRED_METHODS if method in labels]
    blocks += [[label] for label in sorted(set(rows.loc[rows["options"] != "", "label"]))]
    return [block for block in blocks if block]


def _shared(rows: pd.DataFrame, members: list[str]) -> pd.DataFrame:
    """The rows of the method labels ``members`` on the (task, index) samples all of them measured."""
    rows = rows[rows["label"].isin(members) & rows[KL].notna()]
    counts = rows.groupby(["task", "index"])["label"].transform("nunique")
    return rows[counts == len(members)]


def _quality_cells(index: ResultIndex, where: tuple, setting: str, ratio: float, block: list[str], rows):
    backbone, benchmark, length = where
    compared = index.compare(backbone, benchmark, length, setting or None, ratio or None, block)
    shared = _shared(rows, block)
    for label in block:
        own = shared[shared["label"] == label]
        score = index.average(backbone, benchmark, length, compared[label])
        cells = [score]
        for _, column, digits, _ in (*MEASURES, RESIDUAL_MASS):
            cells.append(Cell(own[column].mean() if len(own) else None, digits=digits))
        footprint = [np.nan, np.nan]
        if label != FULL_METHOD and len(own):
            footprint = [
                100 * own[RESIDUAL_HEADS].mean(),
                100 * (own[RESIDUAL_SLOTS] / own[BUDGET]).mean(),
            ]
        cells += [Cell(None if np.isnan(value) else value, digits=1) for value in footprint]
        cells.append(Cell(float(len(own)), digits=0))
        yield label, cells


def _slices(index: ResultIndex, where: tuple) -> Iterator[tuple[str, float, pd.DataFrame]]:
    """(setting, ratio, sample rows) of one backbone/benchmark/length, tightest budget first."""
    backbone, benchmark, length = where
    for ratio in index.ratios(backbone, benchmark, length):
        for setting in SETTING_NAMES:
            rows = index.slices.get((backbone, benchmark, length, setting, ratio))
            if rows is not None and rows[KL].notna().any():
                yield setting, ratio, rows


def quality_table(index: ResultIndex, where: tuple) -> Table:
    backbone, benchmark, length = where
    table = Table(
        f"quality_{backbone.replace('/', '--')}_{benchmark}-{length}",
        f"{benchmark_name(benchmark, length)}, {backbone_name(backbone)}: score and closeness to the "
        "full cache.",
        f"tab:{benchmark}{length}_{backbone}_quality",
        ["Budget", "Setting", "Method"],
        [
            [
                (head, 1)
                for head in (
                    "Score",
                    *(head for head, _, _, _ in (*MEASURES, RESIDUAL_MASS)),
                    "Res. heads %",
                    "r/b %",
                    "n",
                )
            ]
        ],
        notes=list(NOTES),
    )
    full = index.slices.get((backbone, benchmark, length, "", 0.0))
    if full is not None and full[KL].notna().any():
        for _, cells in _quality_cells(index, where, "", 0.0, [FULL_METHOD], full):
            table.body.append(Row(["Full Cache"], cells))
    for setting, ratio, rows in _slices(index, where):
        for number, block in enumerate(_blocks(rows)):
            table.body.append(CMIDRULE if number else MIDRULE)
            for label, cells in _quality_cells(index, where, setting, ratio, block, rows):
                name = index.method_name(label, under_baseline=True)
                table.body.append(Row([retained(ratio), SETTING_NAMES[setting], name], cells))
    return table


def closer(base: pd.Series, reskv: pd.Series, reading: str) -> pd.Series:
    """Where +ResKV is strictly closer to the full cache than its base (aligned series)."""
    if reading == "abs":
        return reskv.abs() < base.abs()
    return reskv < base


CONFIGURATION = ["base", "setting", "ratio", "task"]  # a pair's configuration in a pairs frame
SCORE_DIFFERENCE_NOTE = (
    "Score difference: +ResKV minus baseline, the mean over tasks (as the averages weight them) of the "
    "mean over the pair's shared samples, with its 95% paired interval (the sign-flip test's over the "
    "samples of each task, or the exact bound where fewer than 6 differ; scripts/report/statistics.py)."
)
COMPARED = (("score", "higher"), *((column, reading) for _, column, _, reading in MEASURES))


def wins(frame: pd.DataFrame, column: str, reading: str, side: str = "reskv") -> pd.Series:
    """Rows of a pairs frame where ``side`` (+ResKV, or ``"base"``) strictly beats the other on ``column``."""
    other = "base" if side == "reskv" else "reskv"
    theirs, ours = frame[f"{column}:{other}"], frame[f"{column}:{side}"]
    return ours > theirs if reading == "higher" else closer(theirs, ours, reading)


def score_differences(pairs: pd.DataFrame) -> Member:
    """Per task, each shared sample's score difference +ResKV minus baseline (points) of pairs frame
    rows: a member of ``statistics.mean_of_means``, which averages the tasks as the tables do."""
    return {
        task: 100 * (rows["score:reskv"] - rows["score:base"]).set_axis(rows["index"])
        for task, rows in pairs.groupby("task")
    }


def pairs_frame(index: ResultIndex, where: tuple) -> pd.DataFrame:
    """One row per pair and shared sample: ``setting``, ``ratio``, ``base``, ``task``, ``index`` and
    ``<column>:base`` / ``<column>:reskv`` for the score and each measure."""
    frames = []
    for setting, ratio, rows in _slices(index, where):
        for base in RESIDUAL_BASES:
            shared = _shared(rows, [base, base + RESIDUAL_SUFFIX])
            if shared.empty:
                continue
            side = shared["label"].map({base: "base", base + RESIDUAL_SUFFIX: "reskv"})
            wide = shared.assign(side=side).pivot(
                index=["task", "index"], columns="side", values=[c for c, _ in COMPARED]
            )
            wide.columns = [f"{column}:{side}" for column, side in wide.columns]
            frames.append(wide.reset_index().assign(setting=setting, ratio=ratio, base=base))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def pairs_table(index: ResultIndex, where: tuple, pairs: pd.DataFrame) -> Table:
    backbone, benchmark, length = where
    table = Table(
        f"pairs_{backbone.replace('/', '--')}_{benchmark}-{length}",
        f"{benchmark_name(benchmark, length)}, {backbone_name(backbone)}: tasks where +ResKV scores "
        "higher than its baseline, samples where it is closer to the full cache (strictly; k/n), and "
        "its mean distance to the full cache relative to the baseline's.",
        f"tab:{benchmark}{length}_{backbone}_pairs",
        ["Budget", "Setting", "Baseline"],
        [
            [
                ("Closer to full (k/n)", 1 + len(MEASURES)),
                ("+ResKV vs baseline, mean (%)", len(MEASURES)),
                ("Score difference (points)", 2),
            ],
            [
                ("Score (tasks)", 1),
                *((f"{head} (samples)", 1) for head, _, _, _ in MEASURES),
                *((f"{'|LL gap|' if reading == 'abs' else head}", 1) for head, _, _, reading in MEASURES),
                ("Mean", 1),
                ("95% CI", 1),
            ],
        ],
        notes=[
            "Ties count for neither side; the measures' columns compare the means over the pair's samples "
            "(+ResKV / baseline - 1, in percent; negative is closer to the full cache). " + NOTES[0],
            SCORE_DIFFERENCE_NOTE,
        ],
    )
    previous = None
    for (ratio, setting, base), group in pairs.groupby(["ratio", "setting", "base"], sort=False):
        task_means = group.groupby("task")[["score:base", "score:reskv"]].mean()
        cells = [Cell(count=(int(wins(task_means, "score", "higher").sum()), len(task_means)))]
        cells += [
            Cell(count=(int(wins(group, column, reading).sum()), len(group)))
            for _, column, _, reading in MEASURES
        ]
        for _, column, _, reading in MEASURES:
            base_values, reskv_values = group[f"{column}:base"], group[f"{column}:reskv"]
            if reading == "abs":
                base_values, reskv_values = base_values.abs(), reskv_values.abs()
            base_mean = base_values.mean()
            cells.append(Cell(100 * (reskv_values.mean() / base_mean - 1) if base_mean else None, digits=1))
        difference = mean_of_means([score_differences(group)])
        cells += [Cell(difference.value), Cell(text=difference.interval_text())]
        table.body.append(CMIDRULE if (ratio, setting) == previous else MIDRULE)
        previous = (ratio, setting)
        table.body.append(Row([retained(ratio), SETTING_NAMES[setting], display_name(base, False)], cells))
    return table


def pairs_summary_table(where: tuple, pairs: pd.DataFrame) -> Table:
    backbone, benchmark, length = where
    configs = pairs.groupby(CONFIGURATION, sort=False).mean(numeric_only=True).reset_index()
    heads = [("Score", 1), *((head, 1) for head, _, _, _ in MEASURES)]
    table = Table(
        f"pairs_summary_{backbone.replace('/', '--')}_{benchmark}-{length}",
        f"{benchmark_name(benchmark, length)}, {backbone_name(backbone)}: configurations (task x budget x "
        "setting) where +ResKV beats its baseline and where the baseline beats it (k/n: higher score, "
        "closer to the full cache; ties count for neither), and the mean difference +ResKV minus "
        "baseline (score in points).",
        f"tab:{benchmark}{length}_{backbone}_pairs_summary",
        ["Baseline", "Setting"],
        [
            [
                ("Configurations won", len(heads)),
                ("Configurations lost", len(heads)),
                ("Mean difference", len(heads)),
                ("Score, paired", 3),
            ],
            [*heads * 3, ("Difference 95% CI", 1), ("Won / decided", 1), ("Sign-test 95% CI", 1)],
        ],
        notes=[
            "A configuration's values are means over the samples both methods ran. " + NOTES[0],
            "Difference 95% CI: of the mean score difference, the paired sign-flip test's (each sample's "
            "whole contribution flipped within its task, every configuration of the sample with it; the "
            "exact bound where fewer than 6 samples differ: scripts/report/statistics.py). "
            "Won / decided: the share of configurations with a higher score among those not tied, with "
            "the sign test's exact (Clopper-Pearson) interval.",
        ],
    )
    groups = [
        (
            display_name(base, False),
            SETTING_NAMES[setting],
            configs[(configs["base"] == base) & (configs["setting"] == setting)],
        )
        for base in RESIDUAL_BASES
        for setting in SETTING_NAMES
    ]
    groups += [
        ("All", SETTING_NAMES[setting], configs[configs["setting"] == setting]) for setting in SETTING_NAMES
    ]
    groups.append(("All", "both", configs))
    for number, (name, setting, rows) in enumerate(groups):
        if rows.empty:
            continue
        won, lost = (
            [
                Cell(count=(int(wins(rows, column, reading, side).sum()), len(rows)))
                for column, reading in COMPARED
            ]
            for side in ("reskv", "base")
        )
        differences = [
            Cell(
                float((rows[f"{column}:reskv"] - rows[f"{column}:base"]).mean())
                * (100 if column == "score" else 1),
                digits=2 if column == "score" else 4,
            )
            for column, _ in COMPARED
        ]
        config_pairs = pairs.merge(rows[CONFIGURATION], on=CONFIGURATION)
        difference = mean_of_means(
            [score_differences(group) for _, group in config_pairs.groupby(CONFIGURATION, sort=False)]
        )
        decided = won[0].count[0] + lost[0].count[0]
        sign_test = sign_test_interval(won[0].count[0], decided)
        paired = [
            Cell(text=difference.interval_text()),
            Cell(won[0].count[0] / decided if decided else None),
            Cell(text=interval_text(*sign_test)) if sign_test else Cell(),
        ]
        if name == "All" and groups[number - 1][0] != "All":
            table.body.append(MIDRULE)
        table.body.append(Row([name, setting], won + lost + differences + paired))
    return table


def proxy_table(where: tuple, heads: pd.DataFrame) -> Table | None:
    """How often the validation proxy chose each residual size of the grid, per +ResKV method."""
    backbone, benchmark, length = where
    rows = heads[
        (heads["backbone"] == backbone)
        & (heads["benchmark"] == benchmark)
        & (heads["length"] == length)
        & heads["residual"]
    ]
    if rows.empty:
        return None
    default_grid = [value for value in ResidualConfig().grid if value > 0]
    # Files written before the compressor recorded its choice: the ratio of the default grid nearest
    # to r / b, which is the proxy's choice where a run used that grid (r = floor(g * b + 0.5)).
    share = rows["residual_slots"] / rows["budget"]
    nearest = pd.Series(
        np.array(default_grid)[np.abs(share.to_numpy()[:, None] - np.array(default_grid)).argmin(1)],
        rows.index,
    )
    derived = nearest.where(rows["residual_slots"] > 0, 0.0)
    rows = rows.assign(choice=rows["residual_choice"].astype(float).fillna(derived))
    grid = sorted({*default_grid, *rows["choice"]} - {0.0})
    table = Table(
        f"proxy_{backbone.replace('/', '--')}_{benchmark}-{length}",
        f"{benchmark_name(benchmark, length)}, {backbone_name(backbone)}: the residual size the validation "
        "proxy chose, as the share (%) of (layer, KV head) pairs per grid value r / b (0: main cache only).",
        f"tab:{benchmark}{length}_{backbone}_proxy",
        ["Budget", "Setting", "Method"],
        [[("r = 0", 1), *((f"{value:g}", 1) for value in grid), ("Entries / r", 1), ("Heads", 1)]],
        notes=[
            "Entries / r: residual entries built over slots chosen (fewer when clusters end empty); "
            "Heads: (layer, KV head) pairs counted over all samples. Without validation every head "
            "gets the fixed ratio."
        ],
    )
    previous = None
    groups = rows.groupby(["ratio", "setting", "label", "base_method", "residual", "options"], sort=False)
    for (ratio, setting, _, base, residual, options), group in sorted(
        groups, key=lambda item: (-item[0][0], item[0][1], item[0][2])
    ):
        counts = group["choice"].value_counts(normalize=True)
        cells = [Cell(100 * counts.get(value, 0.0), digits=1) for value in [0.0, *grid]]
        chosen = group["residual_slots"].sum()
        cells.append(Cell(group["residual_entries"].sum() / chosen if chosen else None, digits=3))
        cells.append(Cell(float(len(group)), digits=0))
        table.body.append(CMIDRULE if (ratio, setting) == previous else MIDRULE)
        previous = (ratio, setting)
        table.body.append(
            Row([retained(ratio), SETTING_NAMES[setting], display_name(base, residual, options)], cells)
        )
    return table


def quality_tables(index: ResultIndex, heads: pd.DataFrame | None = None) -> list[Table]:
    """The quality, pairs and pairs-summary tables; with ``heads``
    (``scripts.report.frames.heads_frame``) also the proxy's choices."""
    samples = index.samples
    if KL not in samples.columns:
        return []
    measured = samples[samples[KL].notna()]
    tables = []
    for where in sorted(
        set(measured[["backbone", "benchmark", "length"]].itertuples(index=False, name=None))
    ):
        tables.append(quality_table(index, where))
        pairs = pairs_frame(index, where)
        if not pairs.empty:
            tables += [pairs_table(index, where, pairs), pairs_summary_table(where, pairs)]
        if heads is not None and (table := proxy_table(where, heads)):
            tables.append(table)
    return tables
