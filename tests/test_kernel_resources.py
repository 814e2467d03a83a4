"""The Triton kernels compile for an H100/H200 (sm_90) at the tiles their launchers use, and ptxas
keeps those tiles in registers (scripts.bench.kernel_resources; compiled with Triton's own toolchain,
no GPU needed)."""

from __future__ import annotations

import pytest

from reskv import nearest_kernel
from scripts.bench.kernel_resources import (
    NEAREST_TILES,
    aligned_arguments,
    compiled_resources,
    kernel_builds,
    longest_loop,
    tile_builds,
)

pytest.importorskip("triton")


@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16"])
def test_every_kernel_compiles_for_sm90_without_spilling_at_the_paper_backbones_head_dim(cache_dtype):
    for build in kernel_builds(128, cache_dtype):
        resources = compiled_resources(build, 90)
        assert resources.stack_bytes == 0, build.name
        assert 0 < resources.registers <= 255, build.name


def test_the_resource_reading_sees_the_spills_of_tiles_too_large_for_the_registers(monkeypatch):
    """64 x 64 point-by-centre tiles with 4 warps, the nearest-centre kernel's first tiles: at head dim
    128 in IEEE fp32 ptxas spills them (Triton 3.6 and 3.9)."""
    monkeypatch.setattr(nearest_kernel, "CENTER_TILE", 64)
    monkeypatch.setattr(nearest_kernel, "NUM_WARPS", 4)
    ieee = next(build for build in kernel_builds(128, "fp32") if build.name == "nearest (ieee)")
    assert compiled_resources(ieee, 90).stack_bytes > 0


def test_the_longest_loop_spans_the_widest_backward_branch_of_the_listing():
    """``cuobjdump -sass``'s listing, written by hand: a forward branch, a predicated backward branch
    over 2 instructions, a plain one over 6 (0x10 to 0x60, 16 bytes each) and the end's branch to
    itself; the loop's opcodes counted, without their modifiers; without a backward branch, none."""
    listing = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                      /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                          /* 0x0000000000007919 */
        /*0020*/              @!P0 BRA 0x60 ;                                  /* 0x0000002c008c8947 */
        /*0030*/                   FADD R2, R2, R3 ;                           /* 0x0000000302027221 */
        /*0040*/              @!P3 BRA 0x30 ;                                  /* 0xffffffd80034b947 */
        /*0050*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0060*/                   BRA 0x10 ;                                  /* 0xffffffd80034b947 */
        /*0070*/                   BRA 0x70;                                   /* 0xfffffffc00fc7947 */
    """
    assert longest_loop(listing) == {"S2R": 1, "BRA": 3, "FADD": 1, "HGMMA": 1}
    assert longest_loop(listing.replace("BRA 0x10", "BRA 0x70")) == {"FADD": 1, "BRA": 1}
    assert longest_loop("        /*0000*/                   EXIT ;") == {}


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_bf16x3_scans_load_the_centres_parts_asynchronously_and_split_nothing_in_their_loops(head_dim):
    """The centres are split once (``nearest_kernel.split_centers``, the Lloyd steps' centre updates), so
    the scans' loops convert nothing (no ``F2F``, ``F2FP``, ``PRMT``: fp32 to bf16 and packing) and
    copy the parts into shared memory asynchronously (``LDGSTS``), ahead of the products (``HGMMA``)."""
    scans = [
        build
        for build in kernel_builds(head_dim, "bf16")
        if build.name in ("nearest (bf16x3)", "lloyd assign (bf16x3)", "lloyd assign (bf16x3, values)")
    ]
    assert len(scans) == 3
    for build in scans:
        opcodes = compiled_resources(build, 90).loop_opcodes
        assert opcodes["LDGSTS"] > 0 and opcodes["HGMMA"] > 0, build.name
        assert not {"F2F", "F2FP", "PRMT"} & set(opcodes), build.name


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_lloyd_steps_add_a_points_key_and_value_to_its_cluster_four_floats_an_atomic(head_dim):
    """A cluster's key and value sums are rows of ``2 d`` floats, 16-byte aligned, so each thread adds
    its share of a tile of points (``POINT_TILE x d`` floats over the program's threads, the keys and,
    on the last step, the values) by vector atomics of four fp32 (``REDG.E.ADD.F32x4``, sm_90's
    ``red.global.add.v4.f32``), and one scalar atomic adds its point to the count."""
    steps = [build for build in kernel_builds(head_dim, "bf16") if build.name.startswith("lloyd assign")]
    assert len(steps) == 4  # with and without the values, alone and a family's shared first step
    for build in steps:
        atomics = compiled_resources(build, 90).atomics
        floats = nearest_kernel.POINT_TILE * head_dim * (2 if "values" in build.name else 1)
        per_thread = floats // (32 * nearest_kernel.NUM_WARPS)
        vector = sum(count for mnemonic, count in atomics.items() if mnemonic.startswith("REDG.E.ADD.F32x4."))
        scalar = sum(count for mnemonic, count in atomics.items() if mnemonic.startswith("REDG.E.ADD.F32."))
        assert (vector, scalar, atomics.total()) == (per_thread // 4, 1, per_thread // 4 + 1), build.name


def test_the_tile_builds_are_the_k_means_kernels_at_the_given_tiles_and_the_launchers_left_as_they_were():
    launchers = (nearest_kernel.POINT_TILE, nearest_kernel.CENTER_TILE, nearest_kernel.NUM_WARPS)
    builds = tile_builds(128, (128, 64, 4))
    assert [build.name for build in builds] == [
        "nearest (bf16x3)",
        "lloyd assign (bf16x3)",
        "lloyd assign (bf16x3, values)",
        "lloyd assign (bf16x3, shared)",
        "lloyd assign (bf16x3, values, shared)",
        *(f"lloyd centres ({mode})" for mode in ("init", "update", "final")),
    ]
    for build in builds:
        assert build.num_warps == 4 and build.constexprs["CENTER_TILE"] == 64
        assert build.constexprs.get("POINT_TILE", 128) == 128
    assert (nearest_kernel.POINT_TILE, nearest_kernel.CENTER_TILE, nearest_kernel.NUM_WARPS) == launchers
    assert NEAREST_TILES[0] == launchers


def test_a_build_is_compiled_with_the_alignment_a_launch_gives_its_pointers_and_head_dim():
    """Triton's JIT marks a 16-byte-aligned pointer and an integer multiple of 16 divisible by 16
    unless the kernel names it in ``do_not_specialize``: the nearest-centre kernel's pointers and head
    dim, not its point and centre counts (which it names), nor the proxy's validation count."""
    nearest = next(build for build in kernel_builds(128, "fp32") if build.name == "nearest (ieee)")
    assert aligned_arguments(nearest) == [
        "points", "centers", "center_norms", "nearest_index", "point_counts", "center_counts", "dim",
    ]  # fmt: skip
    errors = next(build for build in kernel_builds(128, "bf16") if build.name == "proxy errors")
    aligned = aligned_arguments(errors)
    assert {"queries_head", "queries_query", "full_head", "full_query", "dim"} <= set(aligned)
    assert not {"validation_count", "num_queries", "row_stride", "boundary"} & set(aligned)
