"""Model architectures, keyed by config.json ``model_type``.

Each architecture is one module in the style of mlx-lm's model files:
``ModelArgs`` (from config.json, checking the fields it relies on), ``Model``
(``model(input_ids, attention_mask) -> last hidden state [B, L, D]`` for
right-padded rows, plus ``sanitize(weights)``) and ``EMBEDDING_DEFAULTS``,
what the engine assumes when the folder says nothing (no sentence-transformers
modules). The engine reads only these, never the architecture's name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

# config.json model_type -> module under mlx_embed.models.
ARCHITECTURES = {
    "bert": "bert",
    "xlm-roberta": "xlm_roberta",
    "roberta": "xlm_roberta",
    "mpnet": "mpnet",
    "modernbert": "modernbert",
    "nomic_bert": "nomic_bert",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3_text",
}

SUPPORTED = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class EmbeddingDefaults:
    """An architecture's embedding conventions, used where the checkpoint
    folder does not say (a sentence-transformers folder overrides pooling)."""

    # Sentence-transformers pooling mode: mean, cls, lasttoken, max, ...
    pooling: str = "mean"
    # Token appended after the text when the tokenizer does not already end
    # with it: decoder embedders pool the last token and were trained with EOS.
    append_token: Optional[str] = None
    # Template for a raw per-request instruction ("{instruction}" is replaced);
    # None: the architecture has no instruction convention.
    instruction_template: Optional[str] = None


def get_module(model_type: Optional[str]) -> ModuleType:
    """The architecture module for a config.json ``model_type``; a clear
    error listing what is supported otherwise."""
    name = ARCHITECTURES.get(model_type or "")
    if name is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED)}"
        )
    # Imported lazily: the decoder files pull in mlx-lm (~1 s of imports).
    return importlib.import_module(f"{__name__}.{name}")


def build(config: dict):
    """(model, architecture module) for a parsed config.json."""
    arch = get_module(config.get("model_type"))
    return arch.Model(arch.ModelArgs.from_dict(config)), arch
