"""The Triton kernels compile for an H100/H200 (sm_90) at the tiles their launchers use, and ptxas
keeps those tiles in registers (scripts.bench.kernel_resources; compiled with Triton's own toolchain,
no GPU needed)."""

from __future__ import annotations

import pytest

from reskv import nearest_kernel
from scripts.bench.kernel_resources import compiled_resources, kernel_builds

pytest.importorskip("triton")


@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16"])
def test_every_kernel_compiles_for_sm90_without_spilling_at_the_paper_backbones_head_dim(cache_dtype):
    for build in kernel_builds(128, cache_dtype):
        resources = compiled_resources(build, 90)
        assert resources.stack_bytes == 0, build.name
        assert 0 < resources.registers <= 255, build.name


def test_the_resource_reading_sees_the_spills_of_tiles_too_large_for_the_registers(monkeypatch):
    """64 x 64 point-by-centre tiles with 4 warps, the nearest-centre kernel's first tiles: at head dim
    128 in IEEE fp32 ptxas spilled several KiB a thread (Triton 3.6 and 3.9)."""
    monkeypatch.setattr(nearest_kernel, "CENTER_TILE", 64)
    monkeypatch.setattr(nearest_kernel, "NUM_WARPS", 4)
    ieee = next(build for build in kernel_builds(128, "fp32") if build.name == "nearest (ieee)")
    assert compiled_resources(ieee, 90).stack_bytes > 1024
