"""Mistral decoder as an embedding model (intfloat/e5-mistral-7b-instruct,
Salesforce/SFR-Embedding-Mistral and SFR-Embedding-2_R,
Linq-AI-Research/Linq-Embed-Mistral).

Mistral is Llama's network (RMSNorm, GQA, rotate-half RoPE, SwiGLU, no
biases) with sliding-window attention; mlx-lm runs "mistral" checkpoints as
llama, and so does this file: the network, wrapper, weight names and config
reading are llama.py's; this file adds Mistral's defaults and the window.
Attention is causal, as the checkpoints run under transformers and
sentence-transformers, so right padding needs no mask: a real token never
attends to the padding after it, and pooling takes each row's last real
token.

Sliding window. transformers lets token i see tokens j with
``i - sliding_window < j <= i``. For an input of at most ``sliding_window``
tokens that is every earlier token, i.e. exactly full causal attention; past
it the two differ (the fixture's README measures how much). The usable max
length is therefore capped at ``sliding_window`` (``max_length`` below, which
the loader treats as the model's position limit): every input accepted is
computed exactly as transformers computes it, longer texts are truncated
like any text over the max length (or refused with ``truncate: false``), and
an explicit ``max_length`` above the window is refused at load. Capping,
rather than refusing every input past the window, keeps the behaviour
sentence-transformers users get from e5-mistral's folder, whose inputs are
truncated, and the models were trained on far shorter inputs than 4096
anyway (e5-mistral's card: "inputs longer than 4096 tokens are not
recommended"). A config with ``sliding_window: null`` (full attention) keeps
``max_position_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .llama import JOINED_LINEARS, Model, _lm, llama_params

__all__ = ["EMBEDDING_DEFAULTS", "JOINED_LINEARS", "Model", "ModelArgs"]

# e5-mistral / SFR / Linq: last-token pooling over "<s> ... </s>" (the model
# card's code appends EOS by hand; older tokenizer.json files do not add it),
# queries carry an instruction, documents none.
EMBEDDING_DEFAULTS = {
    "pooling": "last",
    "eos_token": "</s>",
    "instruction_template": "Instruct: {instruction}\nQuery: ",
}


@dataclass
class ModelArgs(_lm.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        # No Mistral embedder scales RoPE and no fixture backs it: refused,
        # not guessed.
        params = llama_params(params, "mistral", scalings=("default",))
        window = params.setdefault("sliding_window", 4096)  # MistralConfig's default
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"mistral: sliding_window={window!r} is not a positive integer")
        # Every layer full causal: identical to the sliding window for the
        # inputs max_length admits (module docstring; Model.max_length).
        return super().from_dict(params)
