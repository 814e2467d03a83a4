"""The GPU check's report: what ran it (``check_machine``), the efficiency figure (``plot``), the
efficiency targets' ratios as printed lines (``summary``) and reports of several calls merged
(``merged``)."""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import reskv.attention
import reskv.decode_kernel
import reskv.nearest_kernel
import reskv.residual
from scripts.bench.gpu_check import efficiency
from scripts.machine import machine
from scripts.measure import matmul_gflops, peak_memory_kind

FLOOR_MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}


def check_machine(device: str) -> dict:
    """What ran the check (``scripts.machine.machine``), the date, the peak memory's kind, the
    attention path of exact layers and how the k-means finds nearest centres."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **machine(),
        "flash_attn_importable": importlib.util.find_spec("flash_attn") is not None,
        "memory_kind": peak_memory_kind(device),
        # The rate a construction's fp32 matmul FLOPs are judged by (``summary``).
        "fp32_matmul_gflops": matmul_gflops(FLOOR_MATMUL_SIZE[device], device=device),
    }
    # Exact layers of half-precision CUDA runs use FlashAttention-2 when it imports (reskv.cache).
    info["attention_path"] = (
        "flash_attention_2 (half precision), sdpa (fp32)"
        if info["cuda_available"] and info["flash_attn_importable"]
        else "sdpa"
    )
    # reskv.residual.nearest_centers, and reskv.attention.shared_softmax_attention for a gated layer's
    # decode step: each a Triton kernel on CUDA where it imports and its switch is on, else torch.
    nearest, decode = reskv.nearest_kernel, reskv.decode_kernel
    info["nearest_centers"] = kernel_path(
        info["cuda_available"] and reskv.residual.CUDA_FUSED_NEAREST,
        nearest,
        f"bf16 points {nearest.precision(True) or 'torch'}, others {nearest.precision(False) or 'torch'}, "
        f"{nearest.POINT_TILE} x {nearest.CENTER_TILE} tiles, "
        f"{nearest.NUM_WARPS} warps",
        "torch (baddbmm + argmin)",
    )
    info["gated_decode_attention"] = kernel_path(
        info["cuda_available"] and reskv.attention.CUDA_FUSED_DECODE,
        decode,
        f"2 launches, {decode.SLOT_TILE}-slot tiles, {decode.NUM_WARPS} warps",
        "torch (logits, gate, softmax, values' product)",
    )
    return info


def kernel_path(switched_on: bool, kernel, details: str, torch_path: str) -> str:
    """What a run's path is where ``kernel`` (a Triton module of ``reskv``) could run: the kernel with
    its ``details`` when ``switched_on`` (CUDA and its switch) and Triton imports, else ``torch_path``."""
    if switched_on and kernel.available():
        return f"Triton {kernel.triton.__version__} kernel, {details}"
    return torch_path


PANELS = (
    ("request_peak_bytes", 2**-30, "peak memory (GiB)", "Peak memory per request (prefill included)"),
    ("cache_bytes_after_decode", 2**-30, "KV slots x 2 x head dim (GiB)", "KV cache after decoding"),
    ("decode_tokens_per_s", 1, "decode tokens / s", "Decode throughput (eager; median, min-max)"),
    ("compiled_tokens_per_s", 1, "decode tokens / s", "Decode throughput (compiled; median, min-max)"),
)


def drawn_panels(rows: Sequence[dict]) -> list[tuple]:
    """The ``PANELS`` some row measured: an eager-only run has no compiled decode rate to draw."""
    return [panel for panel in PANELS if any(row.get(panel[0]) is not None for row in rows)]


def plot(report: dict, out: Path) -> list[Path]:
    """Peak memory, cache size and decode rate versus context length, one line per (shape, method,
    ratio); colour by method and ratio, line style by shape; out-of-memory marked on each panel
    (``drawn_panels``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in report["efficiency"] if "method" in row]
    if not rows:
        return []
    panels = drawn_panels(rows)
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    axes = axes[0]
    shapes = sorted({row["shape"] for row in rows})
    variants = sorted({(row["method"], row["ratio"]) for row in rows}, key=str)
    markers, styles = "osD^vP*X", ("-", "--", ":")
    for (method, ratio), colour in zip(variants, plt.cm.tab10.colors, strict=False):
        for shape in shapes:
            points = sorted(
                (r for r in rows if (r["shape"], r["method"], r["ratio"]) == (shape, method, ratio)),
                key=lambda r: r["length"],
            )
            if not points:
                continue
            ok = [p for p in points if p["status"] == "ok"]
            label = f"{shape} {method}" + ("" if ratio is None else f" {ratio:g}")
            marker = markers[variants.index((method, ratio)) % len(markers)]
            for axis, (field, scale, _, _) in zip(axes, panels, strict=True):
                measured = [p for p in ok if p.get(field) is not None]
                lengths, values = [p["length"] for p in measured], [p[field] * scale for p in measured]
                axis.plot(
                    lengths,
                    values,
                    marker=marker,
                    linestyle=styles[shapes.index(shape) % len(styles)],
                    color=colour,
                    label=label,
                    alpha=0.8,
                )
                runs = [p.get(f"{field}_runs") for p in measured]
                if all(runs) and any(len(point_runs) > 1 for point_runs in runs):
                    # A decode rate is the median of repeated runs: the bar spans the slowest to the fastest.
                    spread = [
                        [
                            value - min(point_runs) * scale
                            for value, point_runs in zip(values, runs, strict=True)
                        ],
                        [
                            max(point_runs) * scale - value
                            for value, point_runs in zip(values, runs, strict=True)
                        ],
                    ]
                    axis.errorbar(
                        lengths, values, yerr=spread, fmt="none", color=colour, alpha=0.6, capsize=2
                    )
                for p in points:
                    if p["status"] == "OOM":
                        axis.axvline(p["length"], color="grey", linewidth=0.5)
                        axis.annotate(
                            "OOM", (p["length"], 0.95), xycoords=("data", "axes fraction"), fontsize=7
                        )
    for axis, (_, _, ylabel, title) in zip(axes, panels, strict=True):
        axis.set(xscale="log", xlabel="context length (tokens)", ylabel=ylabel, title=title)
    where = report["machine"].get("gpu", "CPU (tiny shapes)")
    figure.suptitle(f"{where}, {report['machine']['date'][:10]}, random weights", fontsize=9)
    axes[-1].legend(fontsize=6, loc="best")
    figure.tight_layout()
    paths = [out / "efficiency.png", out / "efficiency.pdf"]
    for path in paths:
        figure.savefig(path, dpi=150)
    plt.close(figure)
    return paths


def summary(report: dict) -> list[str]:
    """The efficiency targets' ratios as printed lines, per (shape, length, ratio) and base method X:
    ResKV's construction (``construct_s`` of X+reskv minus X's) over the full prefill's time, and over
    its fp32 matmul FLOPs' time at the machine's fp32 matmul rate (the floor); each request's peak
    over the full cache's, +ResKV's over X's; +ResKV's decode rate over X's, eager and compiled, and
    the compiled rates."""
    rows = {
        (row["shape"], row["length"], row["method"], row["ratio"]): row
        for row in report["efficiency"]
        if row.get("status") == "ok"
    }
    gflops = report["machine"]["fp32_matmul_gflops"]
    lines = [f"fp32 matmul {gflops:.0f} GFLOP/s; ratios of +ResKV to its base X unless named"]
    for shape, length, name, ratio in rows:
        reskv = rows.get((shape, length, f"{name}+reskv", ratio))
        full = rows.get((shape, length, "full", None))
        if reskv is None or "+" in name:
            continue
        base = rows[shape, length, name, ratio]
        line = f"{shape} {length} {name} {ratio:g}:"
        if "construct_s" in reskv and full is not None:
            seconds = reskv["construct_s"] - base["construct_s"]
            floor = (reskv["construct_gflop"] - base["construct_gflop"]) / gflops
            line += f" construction {seconds:.3f}s = {seconds / full['prefill_s']:.3f} x prefill"
            line += f", {seconds / floor:.1f} x fp32 FLOP floor {floor:.3f}s"
            variants = [key for key in efficiency.CONSTRUCTION_VARIANTS if key in reskv]
            if variants:
                line += (
                    " (other paths: "
                    + ", ".join(
                        f"{key.removeprefix('construct_s_').replace('_', ' ')} "
                        f"{reskv[key] - base['construct_s']:.3f}s"
                        + ("" if reskv[key.replace("construct_s_", "same_sizes_")] else " (other sizes)")
                        for key in variants
                    )
                    + ")"
                )
            line += ";"
        if full is not None:
            line += f" peak / full {base['request_peak_bytes'] / full['request_peak_bytes']:.3f}"
            line += f" (X) {reskv['request_peak_bytes'] / full['request_peak_bytes']:.3f} (+ResKV);"
        line += f" peak {reskv['request_peak_bytes'] / base['request_peak_bytes']:.3f};"
        line += f" eager decode {reskv['decode_tokens_per_s'] / base['decode_tokens_per_s']:.3f}"
        if "decode_tokens_per_s_torch_attention" in reskv:
            torch_form = reskv["decode_tokens_per_s_torch_attention"] / base["decode_tokens_per_s"]
            same = "" if reskv["torch_attention_same_tokens"] else ", other tokens"
            line += f" (torch attention {torch_form:.3f}{same})"
        if "compiled_tokens_per_s" in reskv:
            line += f"; compiled decode {reskv['compiled_tokens_per_s'] / base['compiled_tokens_per_s']:.3f}"
            line += f" ({base['compiled_tokens_per_s']:.0f} / {reskv['compiled_tokens_per_s']:.0f} tok/s)"
        lines.append(line)
    for row in report["efficiency"]:
        for key, what in (("construct_profile", "construction"), ("compiled_profile", "compiled decode")):
            if key not in row:
                continue
            profile = row[key]
            ratio = "" if row["ratio"] is None else f" {row['ratio']:g}"
            line = f"profile of the {what}, {row['shape']} {row['length']} {row['method']}{ratio}:"
            line += f" {profile['profiled_s']:.3f}s profiled, device busy {profile['device_busy_s']:.3f}s"
            line += f" in {profile['device_launches']} launches, {profile['aten_calls']} aten calls;"
            line += " top (device/host ms): " + "; ".join(
                f"{op['op']} x{op['calls']} {op['self_device_s'] * 1e3:.1f}/{op['self_host_s'] * 1e3:.1f}"
                for op in profile["top"][:6]
            )
            if profile.get("top_kernels"):
                line += "; top kernels (ms): " + "; ".join(
                    f"{kernel['kernel'][:60]} x{kernel['launches']} {kernel['device_s'] * 1e3:.1f}"
                    for kernel in profile["top_kernels"][:6]
                )
            lines.append(line)
    return lines


def merged(reports: Sequence[dict]) -> dict:
    """One report from several runs on one machine: the first run's machine block (the others'
    dates listed), all correctness rows, the efficiency rows with a later run's row replacing an
    earlier one of the same (shape, length, method, ratio), likewise the grid rows by (shape, length),
    correctness passed only if every run's did."""
    latest = {
        (row["shape"], row["length"], row.get("method"), row.get("ratio")): row
        for part in reports
        for row in part["efficiency"]
    }
    grid = {(row["shape"], row["length"]): row for part in reports for row in part.get("grid", [])}
    report = {
        "machine": {**reports[0]["machine"], "runs": [part["machine"]["date"] for part in reports]},
        "correctness": [row for part in reports for row in part["correctness"]],
        "efficiency": list(latest.values()),
        "grid": list(grid.values()),
    }
    verdicts = [part["correctness_passed"] for part in reports if "correctness_passed" in part]
    if verdicts:
        report["correctness_passed"] = all(verdicts)
    return report
