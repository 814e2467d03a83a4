"""Keys evicted from the main cache and their residual clusters (fig:analysis (c) and (d)).

    python -m scripts.bench.evicted_keys [--backbone smollm2-135m] [--task niah_single_2]
        [--length 4096] [--method snapkv+reskv] [--ratio 0.9] [--heads 4:0 20:1] [--results-dir results]

Prefills one RULER prompt's context (the query-agnostic cache), compresses every layer with the
method and, for each chosen (layer, KV head), stores the PCA projection of the evicted keys (the
prompt's keys that are not in the main cache) with the index of their residual entry. The entry
of a key is its nearest residual mean key, which is the k-means assignment up to the last centre
update. With ``--heads auto`` the two (layer, head) pairs holding the most residual entries are
shown.
Report: ``<results-dir>/runs/_bench/evicted_keys_<backbone>.json``; ``make figures`` draws it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import benchmarks
from baselines import build_method
from reskv.backbones import load_backbone
from reskv.compress import compress_layer
from reskv.engine import Prefill


def pca_projection(points: np.ndarray) -> np.ndarray:
    """The first two principal components of ``points`` ([n, d]) by SVD of the centred data."""
    centred = points - points.mean(axis=0, keepdims=True)
    _, _, components = np.linalg.svd(centred, full_matrices=False)
    return centred @ components[:2].T


def evicted_with_clusters(keys: torch.Tensor, kept: torch.Tensor, residual_keys: torch.Tensor) -> tuple:
    """Evicted keys of one head (``kept`` is its main-cache mask) and their nearest residual mean key."""
    evicted = keys[~kept].float()
    if residual_keys.shape[0] == 0:
        return evicted, torch.zeros(evicted.shape[0], dtype=torch.long)
    return evicted, torch.cdist(evicted, residual_keys.float()).argmin(dim=-1)


def collect(
    backbone_name: str, task: str, length: int, method_name: str, ratio: float, heads: list[str]
) -> dict:
    backbone = load_backbone(backbone_name)
    item = benchmarks.load_items(
        "ruler", task, backbone.tokenizer, length=length, num_samples=1, tokenizer_name=backbone_name
    )[0]
    method = build_method(method_name, ratio)
    prefill = Prefill(backbone, item.prompt_ids, item.context_length, [method])
    states = {
        layer_idx: (observation, compress_layer(observation, method.scorer, ratio, method.residual))
        for layer_idx, observation in enumerate(prefill.observations("agnostic"))
    }
    if heads == ["auto"]:
        counts = [
            (int(entries), layer_idx, head)
            for layer_idx, (_, state) in states.items()
            if state is not None
            for head, entries in enumerate(state.residual.entries_per_head)
        ]
        chosen = [(layer_idx, head) for _, layer_idx, head in sorted(counts, reverse=True)[:2]]
    else:
        chosen = [tuple(int(part) for part in pair.split(":")) for pair in heads]
    panels = []
    for layer_idx, head in chosen:
        observation, state = states[layer_idx]
        if state is None:
            raise SystemExit(f"layer {layer_idx} was not compressed (the budget covers the prompt)")
        valid_residual = torch.isfinite(state.residual.log_counts[head])
        evicted, clusters = evicted_with_clusters(
            observation.keys[head], state.kept[head], state.residual.keys[head][valid_residual]
        )
        panels.append(
            {
                "layer": layer_idx,
                "head": head,
                # The 2-D PCA projection, not the d-dimensional keys: what the figure draws, in a
                # fraction of the space (5 significant digits).
                "projection": [
                    [float(f"{value:.5g}") for value in point]
                    for point in pca_projection(evicted.double().numpy()).tolist()
                ],
                "clusters": clusters.tolist(),
                "residual_entries": int(valid_residual.sum()),
            }
        )
    return {
        "backbone": backbone_name,
        "task": task,
        "length": length,
        "method": method_name,
        "ratio": ratio,
        "panels": panels,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="smollm2-135m")
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--method", default="snapkv+reskv")
    parser.add_argument("--ratio", type=float, default=0.9)
    parser.add_argument("--heads", nargs="+", default=["auto"], help="layer:head pairs, or auto")
    parser.add_argument("--results-dir", type=Path, default=Path("results"))
    args = parser.parse_args(argv)
    data = collect(args.backbone, args.task, args.length, args.method, args.ratio, args.heads)
    out = args.results_dir / "runs" / "_bench" / f"evicted_keys_{args.backbone.replace('/', '--')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data) + "\n")
    print(f"{len(data['panels'])} panels written to {out}")


if __name__ == "__main__":
    main()
