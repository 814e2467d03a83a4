"""The paper's numbers as data (scripts.report.paper_numbers) against the paper's LaTeX: every number
of its four result tables is in the data once, under the configuration its row and column name, and
every comparative claim says what its sentence says and what the tables give.

The tables are parsed here from ``tests/data/reskv-paper-excerpt.tex``, verbatim excerpts of the paper
(which is not shipped); ``test_the_excerpt_is_verbatim_from_the_paper`` checks them against a copy of
the paper where one is found (``RESKV_PAPER``, or ``shared/seed/reskv-paper.tex`` above the clone).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from scripts.report.paper_numbers import paper_numbers

REPO = Path(__file__).resolve().parent.parent
EXCERPT = Path(__file__).resolve().parent / "data" / "reskv-paper-excerpt.tex"
SEPARATOR = "%%% excerpt\n"

# How the paper names things, read off the paper by hand (not from the code under test).
BACKBONES = {"LLaMA-3.1-8B": "llama3.1-8b-instruct", "Qwen-2.5-7B": "qwen2.5-7b-instruct"}
LENGTHS = {"4K": 4096, "32K": 32768}
RATIOS = {"10%": 0.9, "20%": 0.8, "30%": 0.7, "40%": 0.6}
SETTINGS = {"q-Aware": "aware", "q-Agnostic": "agnostic"}
METHODS = {"AdaKV": "adakv", "SnapKV": "snapkv", "+CaM": "cam"}
# tab:ablation_main rows (the harness's ablation switches, docs/spec/reskv.md) and columns: S1 and VT
# from RULER-4K, Gov. and Repo from LongBench ("representative tasks from RULER-4K and LongBench").
ABLATION_ROWS = {
    "ResKV": "snapkv+reskv",
    "w/o validation": "snapkv+reskv~validate=false",
    "w/o dynamic gate": "snapkv+reskv~gate=false",
    "w/o shared softmax": "snapkv+reskv~shared_softmax=false",
}
ABLATION_COLUMNS = {
    "S1": ("ruler", 4096, "niah_single_1"),
    "VT": ("ruler", 4096, "vt"),
    "Gov.": ("longbench", None, "gov_report"),
    "Repo": ("longbench", None, "repobench-p"),
}
# tab:snapkv_cam_reskv_tasks (Qwen, 10%, query-agnostic); the paper gives no length for its RULER tasks.
CAM_COLUMNS = {
    "NrtvQA": ("longbench", None, "narrativeqa"),
    "HotpotQA": ("longbench", None, "hotpotqa"),
    "RB-P": ("longbench", None, "repobench-p"),
    "FWE": ("ruler", None, "fwe"),
    "S-1": ("ruler", None, "niah_single_1"),
    "QA-1": ("ruler", None, "qa_1"),
}


def excerpt() -> str:
    return EXCERPT.read_text()


def grid(label: str) -> list[list[str]]:
    """The rows of the tabular before ``\\label{label}``, cells plain text, multicolumns repeated."""
    tex = excerpt()
    end = tex.index(rf"\label{{{label}}}")
    body = tex[tex.rindex(r"\begin{tabular}", 0, end) : tex.rindex(r"\end{tabular}", 0, end)]
    body = body[body.index("\n") :]
    body = re.sub(r"\\(specialrule|cmidrule(\(lr\))?|rowcolor)(\{[^}]*\})+", "", body)
    body = re.sub(r"\\multirow\{\d+\}\{\*\}\{\\rotatebox\[origin=c\]\{90\}\{(.*?)\}\}", r"\1", body)
    body = re.sub(r"\\multirow\{\d+\}\{\*\}\{(.*?)\}", r"\1", body)
    body = re.sub(r"\\textbf\{([^{}]*)\}", r"\1", body)
    body = re.sub(r"\\textbf\{([^{}]*)\}", r"\1", body)
    rows = []
    for line in body.split(r"\\"):
        cells = []
        for cell in line.split("&"):
            cell = cell.strip().replace(r"\%", "%")
            span = re.fullmatch(r"\\multicolumn\{(\d+)\}\{(?:[^{}]|\{[^{}]*\})*\}\{(.*)\}", cell)
            cells += [span[2]] * int(span[1]) if span else [cell]
        if any(cells):
            rows.append(cells)
    return rows


def averages(label: str, benchmark: str) -> dict[tuple, float]:
    """An averages table as {(table, backbone, benchmark, length, setting, method, ratio, task): value}."""
    rows = grid(label)
    heads = [row for row in rows if not re.search(r"\d\.\d\d", " ".join(row))]
    data = rows[len(heads) :]
    columns = list(zip(*(head[2:] for head in heads), strict=True))
    found = {}
    for column, value in zip(columns, data[0][2:], strict=True):  # the full cache, spanning budgets
        backbone, length = BACKBONES[column[0]], LENGTHS.get(column[1])
        key = (label, backbone, benchmark, length, None, "full", None, None)
        assert found.setdefault(key, float(value)) == float(value)
    setting = base = None
    for row in data[1:]:
        setting = SETTINGS.get(row[0], setting)
        method = base + "+reskv" if row[1] == "+ResKV" else METHODS[row[1]]
        base = method.removesuffix("+reskv")
        for column, value in zip(columns, row[2:], strict=True):
            backbone, length, ratio = BACKBONES[column[0]], LENGTHS.get(column[1]), RATIOS[column[-1]]
            found[(label, backbone, benchmark, length, setting, method, ratio, None)] = float(value)
    return found


def task_table(label: str, backbone: str, rows: dict, columns: dict) -> tuple[dict, dict]:
    """A task table as cells (keyed as ``averages``) and the drops printed in parentheses."""
    table = grid(label)
    cells, drops = {}, {}
    for row in table[1:]:
        method = rows[row[0]]
        for head, text in zip(table[0][1:], row[1:], strict=True):
            benchmark, length, task = columns[head]
            value, *drop = re.findall(r"-?\d+\.\d\d", text)
            cells[(label, backbone, benchmark, length, "agnostic", method, 0.9, task)] = float(value)
            if drop:
                drops[(method, task)] = float(drop[0])
    return cells, drops


def parsed_tables() -> tuple[dict, dict]:
    cam, _ = task_table(
        "tab:snapkv_cam_reskv_tasks",
        "qwen2.5-7b-instruct",
        {"SnapKV": "snapkv", "+CaM": "cam", "+ResKV": "snapkv+reskv"},
        CAM_COLUMNS,
    )
    ablation, drops = task_table("tab:ablation_main", "llama3.1-8b-instruct", ABLATION_ROWS, ABLATION_COLUMNS)
    cells = {
        **averages("tab:ruler_paper", "ruler"),
        **averages("tab:longbench_paper", "longbench"),
        **cam,
        **ablation,
    }
    return cells, drops


def key(cell) -> tuple:
    return (
        cell.table,
        cell.backbone,
        cell.benchmark,
        cell.length,
        cell.setting,
        cell.method,
        cell.ratio,
        cell.task,
    )


def test_every_number_of_the_four_tables_is_in_the_data_once():
    cells, _ = parsed_tables()
    data = [key(cell) for cell in paper_numbers().cells]
    assert len(data) == len(set(data))  # no configuration twice
    assert {key(cell): cell.value for cell in paper_numbers().cells} == cells
    # 4 + 64 + 64 RULER, 2 + 32 + 32 LongBench, 18 CaM, 16 ablation numbers (the drops below).
    assert len(cells) == 132 + 66 + 18 + 16


def test_the_ablation_drops_are_the_pairs_gains():
    _, drops = parsed_tables()
    gains = {
        (pair.other.method, pair.other.task): pair.gain
        for pair in paper_numbers().pairs()
        if pair.reskv.table == "tab:ablation_main"
    }
    assert len(drops) == 12
    assert {entry: -gain for entry, gain in gains.items()} == drops


def flat(text: str) -> str:
    return " ".join(text.split())


# The claims the text makes with a number, and the pairs each speaks of (table, setting, ratio).
STATED = {
    "RULER: configurations improved": ("tab:ruler_paper", None, None),
    "RULER: mean gain": ("tab:ruler_paper", None, None),
    "RULER q-Agnostic: mean gain": ("tab:ruler_paper", "agnostic", None),
    "RULER q-Aware: mean gain": ("tab:ruler_paper", "aware", None),
    "RULER 10%: mean gain": ("tab:ruler_paper", None, 0.9),
    "RULER 20%: mean gain": ("tab:ruler_paper", None, 0.8),
    "LongBench: configurations improved": ("tab:longbench_paper", None, None),
    "LongBench: mean gain": ("tab:longbench_paper", None, None),
    "LongBench 10%: mean gain": ("tab:longbench_paper", None, 0.9),
    "LongBench 20%: mean gain": ("tab:longbench_paper", None, 0.8),
}


def test_the_papers_claims_are_in_the_data_as_the_text_states_them():
    claims = {claim.name: claim for claim in paper_numbers().claims}
    stated = {(claim.kind, claim.stated) for claim in claims.values()}
    listed = {("share", (63, 64)), ("share", (32, 32))}
    listed |= {("gain", gain) for gain in (3.38, 4.54, 2.22, 3.47, 3.66, 1.02, 1.43, 1.17)}
    assert listed <= stated
    text = flat(excerpt())
    for claim in claims.values():
        assert flat(claim.statement) in text, claim.name
        if claim.kind == "gain" and claim.stated is not None:
            assert f"{claim.stated:.2f}" in claim.statement
    assert "63 of the 64" in claims["RULER: configurations improved"].statement
    assert "all 32" in claims["LongBench: configurations improved"].statement


def table_gains(cells: dict, table: str) -> dict[tuple, float]:
    """Each +ResKV cell of an averages table less its baseline's, keyed (backbone, length, setting,
    ratio, method)."""
    gains = {}
    for (label, backbone, benchmark, length, setting, method, ratio, task), value in cells.items():
        if label == table and method.endswith("+reskv"):
            base = (label, backbone, benchmark, length, setting, method.removesuffix("+reskv"), ratio, task)
            gains[(backbone, length, setting, ratio, method)] = value - cells[base]
    return gains


def test_stated_claims_agree_with_the_tables():
    cells, _ = parsed_tables()
    claims = {claim.name: claim for claim in paper_numbers().claims}
    for name, (table, setting, ratio) in STATED.items():
        gains = {
            where: gain
            for where, gain in table_gains(cells, table).items()
            if setting in (None, where[2]) and ratio in (None, where[3])
        }
        claim = claims[name]
        scoped = {
            (cell.backbone, cell.length, cell.setting, cell.ratio, cell.method)
            for pair in paper_numbers().pairs()
            if claim.scope.admits(pair) and (cell := pair.reskv)
        }
        assert scoped == set(gains), name  # the claim speaks of the pairs its sentence names
        if claim.kind == "share":
            assert claim.stated == (sum(gain > 0 for gain in gains.values()), len(gains)), name
        else:
            # The text rounds its means to two decimals (and writes 1.17 for LongBench's 1.175).
            assert abs(claim.stated - sum(gains.values()) / len(gains)) <= 0.005 + 1e-9, name


def test_claims_without_a_number_say_what_the_tables_show():
    cells, drops = parsed_tables()
    claims = {claim.name: claim for claim in paper_numbers().claims}
    pairs = paper_numbers().pairs()

    def scoped(name):
        return [pair for pair in pairs if claims[name].scope.admits(pair)]

    # "ResKV gives stronger gains" than CaM, on each of the CaM table's six tasks; ResKV "performs best
    # on all evaluated tasks" of the ablation table, against each of its three ablations.
    over_cam, over_snapkv = scoped("CaM table: +ResKV over +CaM"), scoped("CaM table: +ResKV over SnapKV")
    assert len(over_cam) == len(over_snapkv) == 6
    assert all(pair.gain > 0 for pair in over_cam + over_snapkv)
    best = scoped("Ablations: ResKV best on every task")
    assert len(best) == 12 and all(pair.gain > 0 for pair in best)
    # The drops the text names are the table's.
    for name, (method, task) in {
        "w/o validation: S1 drop": ("snapkv+reskv~validate=false", "niah_single_1"),
        "w/o validation: VT drop": ("snapkv+reskv~validate=false", "vt"),
        "w/o dynamic gate: S1 drop": ("snapkv+reskv~gate=false", "niah_single_1"),
        "w/o dynamic gate: VT drop": ("snapkv+reskv~gate=false", "vt"),
        "w/o shared softmax: RB-P drop": ("snapkv+reskv~shared_softmax=false", "repobench-p"),
    }.items():
        assert claims[name].stated == -drops[(method, task)]
        assert [(pair.other.method, pair.other.task) for pair in scoped(name)] == [(method, task)]


def paper_copy() -> Path | None:
    if os.environ.get("RESKV_PAPER"):
        return Path(os.environ["RESKV_PAPER"])
    for parent in REPO.parents:
        if (candidate := parent / "shared" / "seed" / "reskv-paper.tex").is_file():
            return candidate
    return None


def test_the_excerpt_is_verbatim_from_the_paper():
    paper = paper_copy()
    if paper is None:
        pytest.skip("no copy of reskv-paper.tex here (RESKV_PAPER names one)")
    chunks = excerpt().split(SEPARATOR)[1:]
    assert len(chunks) == 9
    for chunk in chunks:
        assert chunk in paper.read_text()


def test_contrasts_set_the_pairs_their_sentence_names_against_each_other():
    cells, _ = parsed_tables()
    claims = {claim.name: claim for claim in paper_numbers().claims}
    pairs = paper_numbers().pairs()

    def gains(scope) -> dict[tuple, float]:
        return {
            (
                pair.reskv.backbone,
                pair.reskv.length,
                pair.reskv.setting,
                pair.reskv.ratio,
                pair.reskv.method,
            ): (pair.gain)
            for pair in pairs
            if scope.admits(pair)
        }

    for name, table, side, other in (
        ("RULER: q-Agnostic gain above q-Aware", "tab:ruler_paper", ("agnostic", None), ("aware", None)),
        (
            "LongBench: q-Agnostic gain above q-Aware",
            "tab:longbench_paper",
            ("agnostic", None),
            ("aware", None),
        ),
        (
            "LongBench: gain at 10-20% above 30-40%",
            "tab:longbench_paper",
            (None, (0.9, 0.8)),
            (None, (0.7, 0.6)),
        ),
    ):
        claim = claims[name]
        assert claim.kind == "contrast"
        for scope, (setting, ratios) in ((claim.scope, side), (claim.versus, other)):
            expected = {
                where
                for where in table_gains(cells, table)
                if setting in (None, where[2]) and (ratios is None or where[3] in ratios)
            }
            assert set(gains(scope)) == expected, name
    # The RULER sentence states both means: 4.54 - 2.22.
    assert claims["RULER: q-Agnostic gain above q-Aware"].stated == 2.32


def test_the_share_of_the_loss_recovered_from_the_papers_own_rows():
    cells, _ = parsed_tables()
    numbers = paper_numbers()
    # RULER's 64 pairs: sum of gains over the sum of (full cache - baseline), each against the full
    # cache of its backbone and length, from the parsed table.
    gains = losses = 0.0
    for (label, backbone, benchmark, length, setting, method, ratio, task), value in cells.items():
        if label == "tab:ruler_paper" and method in ("snapkv", "adakv"):
            reskv = cells[(label, backbone, benchmark, length, setting, method + "+reskv", ratio, task)]
            gains += reskv - value
            losses += cells[(label, backbone, benchmark, length, None, "full", None, None)] - value
    ruler = [pair for pair in numbers.pairs() if pair.reskv.table == "tab:ruler_paper"]
    assert numbers.recovered_share(ruler) == pytest.approx(gains / losses, abs=1e-6)
    # The task tables print no full cache: no share.
    cam = [pair for pair in numbers.pairs() if pair.reskv.table == "tab:snapkv_cam_reskv_tasks"]
    assert numbers.recovered_share(cam) is None
