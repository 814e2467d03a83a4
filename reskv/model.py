"""The loaded model as the engine sees it: ``Backbone`` (a causal LM, its tokenizer, its stop tokens and
each layer's kind) and ``BackboneError``. ``reskv.backbones`` builds one by name; the engine's modules
read it. A layer is of one of two kinds, read from the model's config as transformers reads it
(``layer_windows``): full attention, which methods compress, or a sliding window, kept exact.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The layer kinds the engine runs (transformers' ``config.layer_types`` values).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass
class Backbone:
    """A causal LM, its tokenizer and the token ids that end an answer."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def scaling(self) -> float:
        """The attention logits' scale: ``query_pre_attn_scalar ** -0.5`` where the model sets it (Gemma),
        else ``head_dim ** -0.5``."""
        return (getattr(self.model.config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5

    @property
    def device(self) -> torch.device:
        return self.model.device

    @functools.cached_property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window, ``None`` for full attention (``layer_windows``)."""
        return layer_windows(self.model.config)

    @functools.cached_property
    def cache_argument(self) -> str:
        """The name of the model's forward argument that takes the cache: transformers 5.24 renamed
        ``past_key_values`` to ``cache`` (the old name warns until its removal in 5.40)."""
        return "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"


class BackboneError(ValueError):
    """Unknown backbone name, a checkpoint that cannot be found, or a model the engine cannot run."""


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (``None``: full attention), read as transformers' models read it:
    ``config.layer_types`` where the config has one (Gemma 2/3, gpt-oss, Qwen2), else one
    ``config.sliding_window`` for every layer where it is set (Mistral v0.1), else full attention. Any
    other layer kind (chunked, linear, ...) is refused, naming the layer."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * num_layers
    windows = []
    for index, kind in enumerate(layer_types[:num_layers]):
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION) or (kind == SLIDING_ATTENTION and not window):
            raise BackboneError(
                f"layer {index} of the model is of kind {kind!r} (sliding_window={window}): the engine runs "
                f"{FULL_ATTENTION!r} layers and {SLIDING_ATTENTION!r} layers with a sliding_window only"
            )
        windows.append(window if kind == SLIDING_ATTENTION else None)
    return windows
