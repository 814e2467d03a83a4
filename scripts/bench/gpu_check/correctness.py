"""The GPU check's correctness part: tiny random Llama and Qwen2 models (GQA groups 1 and 4) run every
method at ratios 0.6 and 0.9 in both settings, once on the CPU in fp32 (the reference) and on the
device in fp32, bf16 and fp16. Per layer: the kept sets and residual sizes must equal the CPU's in fp32
(hard checks), every compressed layer's decode-step output for the last observed queries must be finite
and within tolerance of the CPU's, and every head must hold no more than its budget (AdaKV: the layer's
total). Each configuration also decodes a few tokens end to end on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from baselines import METHODS, build_method
from reskv.backbones import Backbone, random_backbone
from reskv.cache import CompressedLayer
from reskv.compress import compress_layer
from reskv.config import SETTINGS
from reskv.engine import Prefill
from scripts.measure import random_prompt

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (shape, query heads, KV heads) by name: both architectures, GQA group sizes 1 and 4.
TINY_MODELS = {
    f"{shape}-h{heads}-kv{kv_heads}": (shape, heads, kv_heads)
    for shape, heads, kv_heads in (
        ("llama3.1-8b-instruct", 4, 4),
        ("llama3.1-8b-instruct", 8, 2),
        ("qwen2.5-7b-instruct", 4, 4),
        ("qwen2.5-7b-instruct", 8, 2),
    )
}
CHECK_RATIOS = (0.6, 0.9)
CHECK_PROMPT, CHECK_QUESTION, CHECK_DECODE = 1024, 32, 4
# Observed queries whose decode-step outputs are compared per layer: a step's query each.
CHECK_QUERIES = 8
# Scores closer than this, relative to the layer's largest score, are a tie to fp32 rounding.
TIE_TOLERANCE = 1e-5
# Relative error of a compressed layer's output against the CPU fp32 one (same kept set), per
# device dtype: a few units of the format's rounding (bf16 keeps 8 bits of mantissa, fp16 11).
OUTPUT_TOLERANCE = {"fp32": 1e-3, "bf16": 0.05, "fp16": 0.03}


def tiny_model(shape: str, heads: int, kv_heads: int) -> Backbone:
    """A small random model of ``shape``'s architecture in fp32 on the CPU (fixed seed)."""
    torch.manual_seed(0)
    return random_backbone(
        shape,
        torch.float32,
        "cpu",
        num_hidden_layers=2,
        hidden_size=heads * 16,
        intermediate_size=128,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        vocab_size=512,
    )


def moved(backbone: Backbone, device: str, dtype: torch.dtype) -> Backbone:
    """The same weights on ``device`` in ``dtype`` (the original model is left as it is)."""
    model = type(backbone.model)(backbone.model.config).to(device, dtype)
    model.load_state_dict(backbone.model.state_dict())
    model.eval().requires_grad_(False)
    return dataclasses.replace(backbone, model=model)


def layer_results(prefill: Prefill, method_name: str, ratio: float, setting: str) -> list[dict]:
    """Per compressed layer: kept mask, residual sizes, slots and the decode-step outputs
    (``decode_outputs``) for the last observed queries."""
    method = build_method(method_name, ratio)
    results = []
    observations = prefill.observations(setting)
    for observation in observations:
        state = compress_layer(observation, method.scorer, ratio, method.residual, len(observations))
        if state is None:
            continue
        scores = method.scorer.prompt_scores(observation)
        allotted = method.scorer.head_budgets(
            scores, state.stats["budget"], layer_idx=observation.layer_idx, num_layers=len(observations)
        )
        layer = CompressedLayer(state, observation.seq_len, method.decode_rule, spare_slots=0)
        results.append(
            {
                "kept": state.kept.cpu(),
                "residual_slots": state.stats["residual_slots"],
                "slots": (state.kept.sum(-1) + state.residual.entries_per_head).tolist(),
                "budget": state.stats["budget"],
                "layer_budget": int(allotted.max()),
                "output": decode_outputs(layer, observation.queries[:, -CHECK_QUERIES:], observation.scaling),
                "scores": scores.float().cpu(),
            }
        )
    return results


def decode_outputs(layer: CompressedLayer, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[n, H, d]`` fp32 on the CPU: ``layer.attend`` (what a decode step runs: the shared softmax, or on
    CUDA the fused decode kernel) for each of ``queries`` ``[H, n, d]`` as one step's query, over the
    layer as compressed."""
    return (
        torch.cat(
            [
                layer.attend(None, queries[None, :, step : step + 1], layer.keys, layer.values, scaling)[0]
                for step in range(queries.shape[1])
            ]
        )
        .float()
        .cpu()
    )


def budget_ok(scope: str, layer: dict) -> bool:
    """By the rule's ``TokenScorer.budget_scope``: no head holds more than ``b`` slots ("uniform"); the
    layer holds at most ``H_kv * b`` ("head": AdaKV); no head holds more than its layer's budget
    ("layer": PyramidKV, whose layers' budgets average ``b``)."""
    slots, budget = layer["slots"], layer["budget"]
    if scope == "layer":
        return max(slots) <= layer["layer_budget"]
    if scope == "head":
        return sum(slots) <= len(slots) * budget
    return max(slots) <= budget


def check_model(
    model_name: str, device: str, dtypes: Sequence[str], methods: Sequence[str] = METHODS
) -> list[dict]:
    """Rows of the correctness report for one tiny model (``TINY_MODELS``): every method, ratio,
    setting and dtype."""
    reference_model = tiny_model(*TINY_MODELS[model_name])
    prompt = random_prompt(range(1, 512), CHECK_PROMPT, seed=1)
    context_length = CHECK_PROMPT - CHECK_QUESTION
    all_methods = [build_method(name, 0.9) for name in methods]
    reference = Prefill(reference_model, prompt, context_length, all_methods)
    rows = []
    for dtype_name in dtypes:
        backbone = moved(reference_model, device, DTYPES[dtype_name])
        prefill = Prefill(backbone, prompt, context_length, all_methods)
        for method_name in methods:
            if method_name == "full":
                continue
            for ratio in CHECK_RATIOS:
                for setting in SETTINGS:
                    expected = layer_results(reference, method_name, ratio, setting)
                    got = layer_results(prefill, method_name, ratio, setting)
                    generation = prefill.generate(build_method(method_name, ratio), setting, CHECK_DECODE)
                    row = {
                        "model": model_name,
                        "dtype": dtype_name,
                        "method": method_name,
                        "ratio": ratio,
                        "setting": setting,
                        **compare_layers(build_method(method_name, ratio).scorer.budget_scope, got, expected),
                        "decoded_tokens": len(generation.token_ids),
                    }
                    row["passed"] = passed(row)
                    rows.append(row)
    return rows


def near_tie(got: dict, expected: dict) -> bool:
    """Whether every token that one cache keeps and the other evicts has a reference score equal,
    to fp32 rounding, to all the others that swapped: a tie broken differently, not a different rule."""
    swapped = got["kept"] != expected["kept"]
    scores = expected["scores"][swapped]
    return bool((scores.max() - scores.min()) <= TIE_TOLERANCE * expected["scores"].abs().max())


def compare_layers(budget_scope: str, got: list[dict], expected: list[dict]) -> dict:
    """One configuration's per-layer results on the device against the CPU fp32 reference.

    The output error is taken over the layers whose kept sets and residual sizes equal the
    reference's: where low precision flips a near-tied score, the two caches hold different
    tokens and their outputs are not comparable (the agreement of the kept sets says how often).
    """
    same_kept = [torch.equal(g["kept"], e["kept"]) for g, e in zip(got, expected, strict=True)]
    same_sizes = [g["residual_slots"] == e["residual_slots"] for g, e in zip(got, expected, strict=True)]
    same_cache = [kept and sizes for kept, sizes in zip(same_kept, same_sizes, strict=True)]
    errors = [
        float((g["output"] - e["output"]).norm() / e["output"].norm().clamp(min=1e-30))
        for g, e, same in zip(got, expected, same_cache, strict=True)
        if same
    ]
    return {
        "layers": len(got),
        "layers_with_equal_caches": sum(same_cache),
        "layers_with_near_tie_flips": sum(
            sizes and not kept and near_tie(g, e)
            for g, e, kept, sizes in zip(got, expected, same_kept, same_sizes, strict=True)
        ),
        "layers_with_equal_residual_sizes": sum(same_sizes),
        "kept_agreement": sum(
            float((g["kept"] == e["kept"]).float().mean()) for g, e in zip(got, expected, strict=True)
        )
        / max(1, len(got)),
        "residual_heads": sum(sum(size > 0 for size in g["residual_slots"]) for g in got),
        "finite": all(bool(torch.isfinite(g["output"]).all()) for g in got),
        "budget_ok": all(budget_ok(budget_scope, g) for g in got),
        "max_output_error": max(errors, default=0.0),
    }


def passed(row: dict) -> bool:
    """Hard checks: finite outputs, budgets, outputs within tolerance where the caches agree; in
    fp32 also every layer's kept set and residual sizes equal, except kept sets that differ only by
    tokens whose reference scores tie to fp32 rounding (low precision may flip any near tie)."""
    ok = row["finite"] and row["budget_ok"] and row["max_output_error"] <= OUTPUT_TOLERANCE[row["dtype"]]
    if row["dtype"] == "fp32":
        ok = ok and row["layers_with_equal_caches"] + row["layers_with_near_tie_flips"] == row["layers"]
    return ok
