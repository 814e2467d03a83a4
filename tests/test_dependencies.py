"""The dependencies the project declares hold for the code that runs on them."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# The torch release that added ``torch.bmm(..., out_dtype=)`` (the ``aten::bmm.dtype`` overload),
# which the gated decode's CUDA products call.
BMM_OUT_DTYPE_SINCE = Version("2.8")
# The oldest torch the whole suite and the GPU path ran on (the GPU image's, results/gpu/README.md).
OLDEST_RUN = Version("2.11.0")


def torch_requirement() -> SpecifierSet:
    (torch_spec,) = re.findall(r'^\s*"torch([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    return SpecifierSet(torch_spec)


def test_the_torch_floor_admits_no_version_without_the_bmm_out_dtype_overload():
    """Every torch pyproject.toml admits has ``bmm``'s ``out_dtype`` and has been run: none below
    2.8 (the first gated CUDA step would raise), and the oldest version run is admitted."""
    admitted = torch_requirement()
    floors = [Version(spec.version) for spec in admitted if spec.operator == ">="]
    assert floors and min(floors) >= BMM_OUT_DTYPE_SINCE
    assert OLDEST_RUN in admitted
    assert Version(torch.__version__.split("+")[0]) in admitted


def test_the_makefiles_torch_versions_are_ones_pyproject_admits():
    """The Makefile's default ``TORCH_SPEC`` and the version its comment offers for a GPU machine."""
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.findall(r"torch==([0-9][0-9.]*[0-9])", makefile)
    assert len(pinned) >= 2
    admitted = torch_requirement()
    assert all(Version(version) in admitted for version in pinned), pinned


def test_the_installed_torch_has_bmm_out_dtype_for_half_precision_operands():
    """The overload the CUDA path calls, on the meta device (the CPU build has no kernel for it):
    bf16 operands, an fp32 product."""
    left = torch.empty(2, 3, 4, dtype=torch.bfloat16, device="meta")
    right = torch.empty(2, 4, 5, dtype=torch.bfloat16, device="meta")
    product = torch.bmm(left, right, out_dtype=torch.float32)
    assert product.dtype == torch.float32 and product.shape == (2, 3, 5)
