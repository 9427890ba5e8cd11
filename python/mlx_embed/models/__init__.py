"""Model architectures, keyed by config.json ``model_type``.

Each architecture is one module in the style of mlx-lm's model files:
``ModelArgs`` (from config.json, checking the fields it relies on), ``Model``
(``model(input_ids, attention_mask) -> last hidden state [B, L, D]`` for
right-padded rows, plus ``sanitize(weights)``) and ``EMBEDDING_DEFAULTS``:
what the engine assumes when the folder does not say (a sentence-transformers
folder's pooling wins), with the keys

- ``pooling``: mean, cls, last (token), max, ...;
- ``eos_token``: appended after the text when the tokenizer does not end
  with it already (decoder embedders pool the last token, trained as EOS);
- ``instruction_template``: how a raw per-request instruction is put before
  the text (``{instruction}`` is replaced).
- ``special_tokens``: False where the model's library encodes without the
  tokenizer's special tokens (static embeddings);
- ``empty_inputs``: True where an input with no tokens is valid (a static
  model's empty bag is the zero vector) instead of refused.
- ``fallback_max_length``: the max length where neither the folder's
  ``max_seq_length`` nor the tokenizer's ``model_max_length`` says, for an
  architecture with no position table to bound it (T5: 512).
- ``truncate_dim``: the Matryoshka dimension the model's library cuts its
  vectors to (before normalizing) where no sentence-transformers pipeline
  (``modules.json``, whose own ``truncate_dim`` wins) is read;
- ``tokenizer_json_only``: True where the model's library reads the
  tokenizer.json alone (static embeddings): ``tokenizer_config.json``'s
  ``model_max_length`` and ``truncation_side`` and sentence-transformers'
  tokenizer settings are not its cut;
- ``batch_tokens``: padded tokens per device pass when ``load()`` is given
  none, where the architecture's measured best differs from the backend's
  (a static model's pass is one gather, so the CPU's 256 costs it 1.6x).

A built ``Model`` may add folder-specific ones as ``model.embedding_defaults``
(Model2Vec's ``max_length``, ``drop_unknown``, ``truncate_chars``, and
``truncation_side``: the side its library always cuts, over the folder's;
jina-embeddings-v3's config ``emb_pooler: "cls"`` as ``pooling`` and its
``truncate_dim``, which the remote code's ``encode()`` reads).

The engine reads only these, never the architecture's name.
"""

import importlib
import inspect
import math
import resource

import mlx.core as mx
import numpy as np

from ..errors import InvalidModel

SUPPORTED = (
    "bert",
    "xlm-roberta",
    "roberta",
    "camembert",
    "distilbert",
    "mpnet",
    "modernbert",
    "eurobert",
    "nomic_bert",
    "qwen2",
    "mistral",
    "llama",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "embedding_gemma2",
    "embedding_gemma2_text",
    "model2vec",
    "static_embedding",
    "deberta-v2",
    "new",
    "gte",
    "t5",
    "mt5",
    "electra",
    "jina_embeddings_v3",
)

# model_type -> module name, where they differ. Static embedding bags
# (models/static.py) are Model2Vec folders and sentence-transformers
# StaticEmbedding folders, which have no config.json (the loader builds them
# as static_embedding).
REMAPPING = {
    "xlm-roberta": "xlm_roberta",
    "roberta": "xlm_roberta",
    "camembert": "xlm_roberta",
    "deberta-v2": "deberta_v2",
    # transformers' native jina-embeddings-v3 (the -hf checkpoint).
    "jina_embeddings_v3": "jina_xlm_roberta",
    # Alibaba GTE (new-impl); TEI reads model_type "gte" as the same
    # network (its GTE config takes both names).
    "new": "gte_new",
    "gte": "gte_new",
    # mT5 is T5 v1.1's network under its own config defaults.
    "mt5": "t5",
    # EmbeddingGemma 2: the multimodal checkpoint's config (text_config inside)
    # and the text model's own save; text only either way.
    "embedding_gemma2_text": "embedding_gemma2",
    "model2vec": "static",
    "static_embedding": "static",
}


def reads_type_ids(model) -> bool:
    """Whether ``model``'s forward uses token type ids: its own
    ``reads_type_ids`` where it says (DistilBERT's takes and ignores them),
    else whether its ``__call__`` takes ``token_type_ids``."""
    takes = "token_type_ids" in inspect.signature(model.__call__).parameters
    return bool(getattr(model, "reads_type_ids", takes))


def config_args(cls, params: dict) -> dict:
    """The config.json keys that are ``cls``'s init fields (a ModelArgs
    dataclass): an architecture takes what it reads and leaves the rest
    (training settings, ``auto_map``, other heads' keys) to the checkpoint."""
    fields = {k for k, f in cls.__dataclass_fields__.items() if f.init}
    return {k: v for k, v in params.items() if k in fields}


def module_for(model_type: str, config: dict) -> str:
    """The module name for a config.json: ``REMAPPING``, except where one
    ``model_type`` covers two networks. JinaBERT checkpoints say
    ``model_type: "bert"``; their ALiBi positions (no position table) tell
    them apart from BERT, as rotary ones tell jina-embeddings-v3 from
    XLM-RoBERTa."""
    if model_type == "bert" and config.get("position_embedding_type") == "alibi":
        return "jina_bert"
    # jina-embeddings-v3's remote-code folder: XLM-R with rotary positions
    # (and task LoRA), no position table.
    if model_type == "xlm-roberta" and config.get("position_embedding_type") == "rotary":
        return "jina_xlm_roberta"
    return REMAPPING.get(model_type, model_type)


def decoder_weights(weights: dict, drop=("lm_head.", "score."), skip="rotary_emb.inv_freq") -> dict:
    """A decoder checkpoint's weights under mlx-lm's ``model.`` prefix: the
    bare ``*Model`` saves have none, ``*ForCausalLM`` and mlx-lm conversions
    do. Heads an embedding never uses (names starting with ``drop``) and
    saved RoPE buffers (names containing ``skip``) are left out."""
    out = {}
    for name, w in weights.items():
        if name.startswith(drop) or skip in name:
            continue
        out[name if name.startswith("model.") else "model." + name] = w
    return out


# mlx-lm's decoder blocks project one input three times (queries, keys,
# values) and twice (gate, up); the loader runs each group as one matmul
# (sibling_linears.py). An architecture opts in with JOINED_LINEARS.
DECODER_SIBLINGS = (
    (("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    (("gate_proj", "up_proj"), "gate_up_proj"),
)


# A linear layer's tensors, quantized ones included; all of them are cut
# along the output axis (0), so fused projections split and join there.
LINEAR_TENSORS = ("weight", "bias", "scales", "biases")


def checked_decoder_params(params: dict, arch: str, activation_key: str = "hidden_act",
                           activation: str = "silu") -> dict:
    """``params`` for one of mlx-lm's decoders, refusing what it would run
    silently wrong: another activation than the one it hard-codes, attention
    biases its file has no weights for, and RoPE scalings it gets wrong (a
    ``longrope``/``su`` one, which it runs with its long factors at every
    length); a ``yarn`` scaling without ``original_max_position_embeddings``
    takes ``max_position_embeddings``, as transformers does (mlx-lm: 4096)."""
    params = dict(params)
    act = params.get(activation_key, activation)
    if act != activation:
        raise InvalidModel(f"{arch}: {activation_key}={act!r} is not supported (only {activation!r})")
    if params.get("attention_bias"):
        raise InvalidModel(f"{arch}: attention_bias=true is not supported (no query/key/value biases)")
    scaling = params.get("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type") or scaling.get("type") or "default"
        if kind in ("longrope", "su"):
            raise InvalidModel(f"{arch}: rope_scaling type {kind!r} is not supported")
        if kind == "yarn" and "original_max_position_embeddings" not in scaling:
            original = params.get("max_position_embeddings")
            params["rope_scaling"] = {**scaling, "original_max_position_embeddings": original}
    return params


def plain_rope_only(params: dict, arch: str) -> None:
    """In place: refuses a RoPE scaling for a decoder whose mlx-lm file runs
    plain RoPE whatever the config says (Gemma, Gemma 2), and takes
    ``rope_theta`` from transformers 5's ``rope_parameters``, which replace it."""
    rope = params.get("rope_parameters")
    if isinstance(rope, dict):
        if rope.get("rope_type", "default") != "default":
            raise InvalidModel(f"{arch}: rope_type={rope['rope_type']!r} is not supported (only plain RoPE)")
        params.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = params.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type") or "default") != "default":
        raise InvalidModel(f"{arch}: rope_scaling={scaling!r} is not supported (only plain RoPE)")


def join_linears(weights: dict, parts, joined: str) -> None:
    """In place: the linears named ``parts`` (prefixes) concatenated along the
    output axis into ``joined``, where the checkpoint has all of them (one
    fused q/k/v projection from three)."""
    for suffix in LINEAR_TENSORS:
        names = [f"{p}.{suffix}" for p in parts]
        if all(n in weights for n in names):
            weights[f"{joined}.{suffix}"] = mx.concatenate([weights.pop(n) for n in names], axis=0)


def split_linear(weights: dict, fused: str, parts) -> None:
    """In place: the linear ``fused`` cut into equal ``parts`` along the
    output axis, in order (a GLU's up and gate halves)."""
    for suffix in LINEAR_TENSORS:
        name = f"{fused}.{suffix}"
        if name in weights:
            for part, w in zip(parts, mx.split(weights.pop(name), len(parts), axis=0)):
                weights[f"{part}.{suffix}"] = w


def relative_position_buckets(relative: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """The bidirectional bucket of each ``key - query`` distance that T5 and
    MPNet index their position bias by: half the
    buckets for keys after the query; in each half, exact distances below
    a quarter of the buckets, then log-spaced ones up to ``max_distance``,
    and the last bucket past it. The log is taken in float32, as
    transformers takes it, so the boundaries land in the same bucket."""
    half = num_buckets // 2
    out = (relative > 0).astype(np.int64) * half
    n = np.abs(relative)
    max_exact = half // 2
    # Distances below max_exact take the exact branch; 1 keeps the log finite.
    ratio = np.log(np.maximum(n, 1).astype(np.float32) / np.float32(max_exact))
    large = max_exact + (
        ratio / np.float32(math.log(max_distance / max_exact)) * np.float32(half - max_exact)
    ).astype(np.int64)
    large = np.minimum(large, half - 1)
    return out + np.where(n < max_exact, n, large)


class LengthTables:
    """Constant tables that depend only on the padded input length (RoPE's
    cos/sin, ALiBi's biases), built with NumPy by ``build(length)`` once per
    length and kept as MLX arrays that hold their data, so a pass pays no
    host copy. What a pass derives from them (a dtype cast, a slice) is lazy
    and is made by the pass itself, on the thread that runs it: a lazy array
    built on one worker's stream cannot be evaluated on another's. Lengths
    repeat (the scheduler pads to a few shapes), so a few are kept."""

    def __init__(self, build, keep: int = 16):
        self._build = build
        self._keep = keep
        self._cache: dict = {}

    def __call__(self, length: int) -> tuple:
        hit = self._cache.get(length)
        if hit is None:
            hit = tuple(mx.array(t) for t in self._build(length))
            mx.eval(*hit)
            if len(self._cache) >= self._keep:
                self._cache.clear()
            self._cache[length] = hit
        return hit


def mlx_lm_model(name: str):
    """``mlx_lm.models.<name>``, imported without the side effect of mlx-lm's
    package: ``mlx_lm.utils`` sets the process's open-file limit to (2048,
    4096) when imported, lowering the hard limit for good, so a server of a
    Qwen3, Qwen2, Llama, Mistral or Gemma model could hold no more than 2,048
    connections and files."""
    set_limit = resource.setrlimit
    resource.setrlimit = lambda *args, **kwargs: None
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    finally:
        resource.setrlimit = set_limit
