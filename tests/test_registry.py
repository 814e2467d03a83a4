"""The method registry reaches every consumer, and the label codec reads back what it writes."""

from __future__ import annotations

import math
import random
import re
import string
import struct
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from baselines import build_scorer
from baselines.registry import METHODS, OPTIONS, REGISTRY, RESIDUAL_BASES, RESIDUAL_SUFFIX, MethodSpec
from reskv.config import ResidualConfig
from reskv.scoring import TokenScorer
from scripts.harness.plan import compose_plan
from scripts.harness.records import MethodLabel, SampleRecord, field_column

ROOT = Path(__file__).resolve().parent.parent


README = (ROOT / "README.md").read_text()
BASELINES_SPEC = (ROOT / "docs/spec/baselines.md").read_text()


def method_names(registry) -> list[str]:
    """The method names a registry gives (``baselines.registry.METHODS`` of ``REGISTRY``)."""
    pairs = [spec.name + RESIDUAL_SUFFIX for spec in registry if spec.pairs_with_reskv]
    return [spec.name for spec in registry] + pairs


def readme_problems(readme: str, registry) -> list[str]:
    """What the README must say of a registry's methods and does not, each as what to do."""
    (listed,) = re.findall(r"\| `method=` \| one or a list of `([^`]*)`", readme)
    listed, names = listed.split(), method_names(registry)
    row = 'the README\'s `method=` row (the table under "One command, one grid")'
    problems = [f"add `{name}` to {row}" for name in names if name not in listed]
    problems += [
        f"remove `{name}` from {row}: the registry has no such method" for name in listed if name not in names
    ]
    problems += [f"list `{name}` once in {row}" for name in sorted(set(listed)) if listed.count(name) > 1]
    (layout,) = re.findall(r"^\| `baselines/` \| (.*) \|$", readme, flags=re.MULTILINE)
    files = [
        spec.scorer.partition(":")[0].removeprefix("baselines.") + ".py" for spec in registry if spec.scorer
    ]
    problems += [
        f"add `{file}` to the README's layout row for `baselines/`"
        for file in files
        if f"`{file}`" not in layout
    ]
    intro = readme.split("\n\n")[1]
    return problems + [
        f"name {spec.display.split()[0]} in the README's first paragraph, among the methods compared"
        for spec in registry
        if spec.display.split()[0] not in intro
    ]


def spec_problems(spec_text: str, registry) -> list[str]:
    """The sections of docs/spec/baselines.md a registry's methods cite and it lacks, as what to add."""
    sections = re.findall(r"^## (.*)$", spec_text, flags=re.MULTILINE)
    return [
        f"add a `## {spec.spec}` section to docs/spec/baselines.md: the rule {spec.name} follows "
        "(its MethodSpec's spec names the heading)"
        for spec in registry
        if spec.spec not in sections
    ]


def test_the_readme_lists_every_registered_method_and_only_those():
    assert sorted(method_names(REGISTRY)) == sorted(METHODS)
    problems = readme_problems(README, REGISTRY)
    assert not problems, "\n".join(problems)


def test_every_base_method_builds_a_scorer_and_cites_its_spec_section():
    problems = spec_problems(BASELINES_SPEC, REGISTRY)
    assert not problems, "\n".join(problems)
    for spec in REGISTRY:
        if spec.scorer is not None:
            assert isinstance(build_scorer(spec.name), TokenScorer)


def test_the_documentation_checks_say_what_a_new_method_needs_and_where():
    """A registry line for a made-up method nobody will register, its documentation not written yet."""
    made_up = MethodSpec(
        "madeup", "MadeUp", "baselines.snapkv:SnapKV", "MadeUp (a test's method)", pairs_with_reskv=True
    )
    row = 'the README\'s `method=` row (the table under "One command, one grid")'
    assert readme_problems(README, (*REGISTRY, made_up)) == [
        f"add `madeup` to {row}",
        f"add `madeup+reskv` to {row}",
        "name MadeUp in the README's first paragraph, among the methods compared",
    ]
    without_snapkv = README.replace("`snapkv.py`, ", "")
    assert readme_problems(without_snapkv, REGISTRY) == [
        "add `snapkv.py` to the README's layout row for `baselines/`"
    ]
    assert spec_problems(BASELINES_SPEC, (*REGISTRY, made_up)) == [
        "add a `## MadeUp (a test's method)` section to docs/spec/baselines.md: the rule madeup follows "
        "(its MethodSpec's spec names the heading)"
    ]


@pytest.mark.parametrize(
    ("scorer", "problem"),
    [
        (
            "baselines.madeup:MadeUp",
            "no module baselines.madeup (a method's rule is its file, baselines/<name>.py",
        ),
        (
            "baselines.snapkv:SnapKv",
            "module baselines.snapkv defines no class SnapKv; its classes: ['SnapKV']",
        ),
        ("baselines.snapkv.SnapKV", "write it as 'module:Class', e.g. 'baselines.snapkv:SnapKV'"),
        ("baselines.registry:MethodSpec", "MethodSpec does not derive from reskv.scoring.TokenScorer"),
    ],
)
def test_a_registry_line_with_a_bad_scorer_is_refused_as_it_is_declared(scorer, problem):
    """The line names its method, its scorer and what is wrong, before any scorer or torch loads."""
    expected = f"baselines/registry.py, the line of 'madeup': scorer '{scorer}': {problem}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        MethodSpec("madeup", "MadeUp", scorer, "MadeUp (a test's method)")


def test_the_registry_checks_its_scorers_without_importing_them():
    """Every line's scorer is a TokenScorer, found from the source (CaM and AdaKV through SnapKV)."""
    code = (
        "import sys; from baselines.registry import REGISTRY, MethodSpec; "
        "MethodSpec('madeup', 'MadeUp', 'baselines.adakv:AdaKV', 'MadeUp'); "
        "assert not {'torch', 'baselines.snapkv', 'baselines.adakv'} & set(sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# A value other than the default for every declared option: a new option needs one here, and the
# test below then checks that it reaches a run.
NON_DEFAULT = {
    "h2o_window_only": True,
    "tau": 0.5,
    "alpha": 6.0,
    "g_min": 0.1,
    "beta": 0.5,
    "gate": False,
    "shared_softmax": False,
    "grid": (0.0, 0.1),
    "validate": False,
    "fixed_ratio": 0.2,
    "delta": 0.02,
    "kmeans_iterations": 2,
    "fit_queries": 64,
    "validation_queries": 16,
    "final_selection": "fit",
}


def declared_options() -> list[str]:
    """Every option as declared: each registry line's, then ResKV's settings' fields."""
    return [option.name for spec in REGISTRY for option in spec.options] + [
        field.name for field in fields(ResidualConfig)
    ]


def test_each_method_option_is_declared_once_and_the_yaml_declares_none():
    """Labels name base and ResKV options alike (``~name=value``), and the configuration holds the
    base options beside its own keys: one name declared twice would leave one of them unreachable."""
    declared = declared_options()
    assert len(declared) == len(set(declared)), sorted(name for name in declared if declared.count(name) > 1)
    config = yaml.safe_load((ROOT / "configs/config.yaml").read_text())
    assert not set(config) & {*declared, "reskv"}


def hydra_text(value) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(str(part) for part in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_declared_option_reaches_a_run_from_the_command_line_and_from_a_label(tmp_path):
    """Each option, set to a value other than its default by its config key and by a method
    label, is what the grid entry runs with and names its label; a base option builds its scorer."""
    missing = [name for name in declared_options() if name not in NON_DEFAULT]
    assert not missing, (
        f"add {missing} to NON_DEFAULT in tests/test_registry.py, each with a value other than its default"
    )
    assert sorted(NON_DEFAULT) == sorted(declared_options()), "NON_DEFAULT names an option no longer declared"
    common = [f"results_dir={tmp_path}", "ratio=0.5", "setting=aware"]
    owners = [(spec.name, option.name, f"{option.name}=") for spec in REGISTRY for option in spec.options]
    owners += [("snapkv+reskv", field.name, f"reskv.{field.name}=") for field in fields(ResidualConfig)]
    for method, name, key in owners:
        value = NON_DEFAULT[name]
        label = str(MethodLabel(method, {name: value}))
        for overrides in ([f"method={method}", key + hydra_text(value)], [f"method=['{label}']"]):
            (entry,) = compose_plan([*overrides, *common]).grid
            assert entry.label == label, overrides
            if name in OPTIONS:
                assert dict(entry.options)[name] == value, overrides
                build_scorer(method, options=dict(entry.options))
            else:
                assert getattr(entry.residual, name) == value, overrides


def test_an_option_of_the_wrong_type_or_method_is_refused():
    with pytest.raises(ValueError, match="h2o_window_only takes true or false, got 'yes'"):
        build_scorer("h2o", options={"h2o_window_only": "yes"})
    with pytest.raises(ValueError, match="snapkv takes no option"):
        build_scorer("snapkv", options={"h2o_window_only": True})
    assert build_scorer("h2o", options={"h2o_window_only": True}).window_only


def test_display_names_pair_every_residual_base():
    assert MethodLabel("snapkv+reskv").display() == "SnapKV+ResKV"
    assert MethodLabel("full").display() == "Full Cache"
    assert all(base + RESIDUAL_SUFFIX in METHODS for base in RESIDUAL_BASES)


@pytest.mark.parametrize(
    ("label", "alone", "under_baseline"),
    [
        ("snapkv", "SnapKV", "SnapKV"),
        ("snapkv+reskv", "SnapKV+ResKV", "+ResKV"),
        ("snapkv+reskv~gate=false", "SnapKV+ResKV (gate=false)", "SnapKV+ResKV (gate=false)"),
        ("h2o~h2o_window_only=true", "H2O (h2o_window_only=true)", "H2O (h2o_window_only=true)"),
        ("cam", "CaM", "CaM"),
    ],
)
def test_a_label_is_displayed_by_its_method_and_options(label, alone, under_baseline):
    """One display name per label: a label with options names its method in full, in its own row."""
    assert MethodLabel.parse(label).display() == alone
    assert MethodLabel.parse(label).display(under_baseline=True) == under_baseline


@pytest.mark.parametrize(
    ("text", "method", "options"),
    [
        ("snapkv", "snapkv", {}),
        ("snapkv+reskv~validate=false", "snapkv+reskv", {"validate": False}),
        ("snapkv+reskv~alpha=8,tau=0.3", "snapkv+reskv", {"alpha": 8, "tau": 0.3}),
        ("snapkv+reskv~grid=0-0.05-0.1", "snapkv+reskv", {"grid": (0, 0.05, 0.1)}),
        ("h2o~h2o_window_only=true", "h2o", {"h2o_window_only": True}),
        ("adakv+reskv~final_selection=fit", "adakv+reskv", {"final_selection": "fit"}),
    ],
)
def test_labels_parse_to_their_options_and_format_back_to_the_same_text(text, method, options):
    label = MethodLabel.parse(text)
    assert (label.method, label.options) == (method, options)
    assert str(label) == text
    assert label.residual == method.endswith("+reskv")


def float_values(rng: random.Random, count: int) -> list[float]:
    """Floats of every sign and magnitude: the edges (exponent notation, subnormals, the largest,
    infinities, values ``:g`` rounds) and random 64-bit patterns (NaN left out: it equals nothing)."""
    edges = [0.0, -0.0, 1e-05, -1e-05, 0.1 + 0.2, 8.0, -12.0, 0.123456789, 1234567.0, 1e22, -2.5e-300]
    edges += [5e-324, sys.float_info.min, sys.float_info.max, -sys.float_info.max, math.inf, -math.inf]
    drawn = []
    while len(drawn) < count:
        (value,) = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))
        if not math.isnan(value):
            drawn.append(value)
    return edges + drawn


def option_samples(seed: int = 0) -> list[tuple[str, str, object]]:
    """(method, option, value): values of every type an option takes, each under a declared option of
    that type (a label reads a value as its option's type)."""
    rng = random.Random(seed)
    floats = float_values(rng, 300)
    ints = [0, -1, 7, 2**63, -(10**30)] + [rng.randint(-(10**12), 10**12) for _ in range(50)]
    texts = ["", "base", "fit", "true", "3", "1e-05", "0-1", "inf", "a-b.c_d+e"]
    texts += ["".join(rng.choices(string.ascii_letters + string.digits + "-_.+", k=rng.randint(1, 12)))]
    grids = [(), (0.1,), (0.0, 1e-05, 0.2), (-0.5, 3e20, -1e-07)]
    grids += [tuple(rng.choices(floats, k=rng.randint(0, 5))) for _ in range(100)]
    samples = [("h2o", "h2o_window_only", flag) for flag in (True, False)]
    samples += [("snapkv+reskv", "validate", flag) for flag in (True, False)]
    samples += [("snapkv+reskv", name, value) for name in ("delta", "tau") for value in floats]
    samples += [("snapkv+reskv", "kmeans_iterations", value) for value in ints]
    samples += [("snapkv+reskv", "final_selection", value) for value in texts]
    samples += [("snapkv+reskv", "grid", value) for value in grids]
    return samples


def typed(value) -> object:
    """A value with the type and sign of each of its numbers, for an exact comparison (-0.0 is not 0.0)."""
    if isinstance(value, tuple):
        return tuple(typed(part) for part in value)
    if isinstance(value, float):
        return (float, value, math.copysign(1, value))
    return (type(value), value)


def test_the_label_codec_reads_back_every_value_an_option_takes():
    """A label written with any value of its option's type (floats of any sign and magnitude, in
    exponent notation too, ints, bools, text, grids) parses back to that value and type, alone
    and beside other options."""
    samples = option_samples()
    assert {type(value) for _, _, value in samples} == {bool, int, float, str, tuple}
    for method, name, value in samples:
        text = str(MethodLabel(method, {name: value}))
        (read,) = MethodLabel.parse(text).options.values()
        assert typed(read) == typed(value), text
    several = {"delta": 1e-05, "grid": (0.0, 1e-05, 0.15), "final_selection": "fit", "tau": -0.5}
    assert MethodLabel.parse(str(MethodLabel("snapkv+reskv", several))).options == several


def test_a_value_no_label_can_hold_is_refused_by_name():
    for text in ("a,b", "a=b", "a~b", "a/b"):
        with pytest.raises(ValueError, match=f"option value '{text}' cannot be written in a method label"):
            str(MethodLabel("snapkv+reskv", {"final_selection": text}))


@pytest.mark.parametrize(
    "override",
    [
        "reskv.delta=0.00001",
        "reskv.alpha=1e+20",
        "reskv.tau=-0.5",
        "reskv.fixed_ratio=0.123456789",
        "reskv.grid=[0,0.00001,0.2]",
        "reskv.grid=[0.1]",
        "reskv.kmeans_iterations=7",
        "reskv.final_selection=fit",
    ],
)
def test_the_label_a_run_wrote_is_accepted_back_as_its_method(tmp_path, override):
    """The label a configuration is filed under, passed back as ``method=[...]``, plans the same run."""
    common = [f"results_dir={tmp_path}", "ratio=0.5", "setting=aware"]
    (entry,) = compose_plan(["method=snapkv+reskv", override, *common]).grid
    assert entry.label != "snapkv+reskv"
    (again,) = compose_plan([f"method=['{entry.label}']", *common]).grid
    assert (again.label, again.residual) == (entry.label, entry.residual)


def test_a_label_option_without_a_value_names_the_option_and_the_label():
    with pytest.raises(
        ValueError, match=r"'validate' of 'snapkv\+reskv~validate' must be written name=value"
    ):
        MethodLabel.parse("snapkv+reskv~validate")


def test_a_committed_sample_record_reads_and_writes_back_unchanged():
    """The typed record keeps the on-disk format: every committed sample round-trips exactly."""
    import json

    path = next((ROOT / "results/ruler4k/runs").rglob("0.9.json"))
    for sample in json.loads(path.read_text())["samples"]:
        assert SampleRecord.from_json(sample).to_json() == sample


def test_a_frame_column_names_a_declared_field_or_fails():
    assert field_column("quality", "kl") == "quality.kl"
    with pytest.raises(KeyError, match="quality has no field 'kll'"):
        field_column("quality", "kll")


def test_help_and_validation_stay_torch_free():
    code = "import sys, run; run.usage(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_readme_command_blocks_activate_the_venv_and_run_as_written_in_a_new_shell():
    """Each README block that calls ``python`` starts with the activation; a shell with no venv on
    its PATH then finds the project's packages (``--help`` needs hydra)."""
    import os

    readme = (ROOT / "README.md").read_text()
    blocks = [
        block for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL) if "\npython " in block
    ]
    assert blocks and all(block.startswith("source .venv/bin/activate\n") for block in blocks)
    clean = {name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "PYTHONPATH")}
    clean["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    done = subprocess.run(
        ["bash", "-c", "source .venv/bin/activate && python run.py --help"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
    )
    assert done.returncode == 0 and b"method=" in done.stdout
