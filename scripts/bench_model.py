#!/usr/bin/env python3
"""Model-engine throughput, side by side: texts/s and real tokens/s per batch
size for the engine's configurations, ONNX Runtime and sentence-transformers,
and the time of one short text per call.

Every configuration is a long-lived subprocess (the BLAS and the element-wise
path are picked at import) that loads, warms up, then times one whole-corpus
pass per request; rounds are interleaved (config A, B, ..., peer, A, B, ...)
so all see the same machine load. Medians over rounds.

Engine configurations (``--configs``):
  mlx_embed   the default: native SIMD kernels, OpenBLAS, length-sorted
              sub-batches, two MLX workers
  unsorted    the same with sub-batches cut in input order (no length sort)
  avx2        the default on the kernels' AVX2+FMA build (MLX_EMBED_SIMD=avx2):
              what a CPU without AVX-512 runs (the same as the default there)
  mlx-ops     element-wise ops as compiled MLX graphs (MLX_EMBED_FAST_OPS=mlx)
  exact-ops   MLX's built-in erf/softmax/layer norm (MLX_EMBED_FAST_OPS=0)
  ref-blas    MLX's bundled reference BLAS (MLX_EMBED_BLAS=none); slow, so it
              runs in the first round only (--ref-rounds)
Peers, run by --peer-python (default .bench-venv/bin/python, made by `make bench`):
  torch-Nt    sentence-transformers on torch CPU, N threads (--peer-threads)
  ort-Nt      ONNX Runtime (CPU execution provider, N intra-op threads,
              --ort-threads) on the same weights exported to ONNX by optimum
              (cached under .bench/onnx), HF tokenizer, mean pooling and
              normalization in NumPy: the path sentence-transformers' ONNX
              backend takes, without its Python wrapper
Corpora (--corpus, each its own interleaved run in the same session):
  mixed       the deterministic mixed-length corpus below (~108 tokens/text)
  short       the load test's sentences (scripts/wrk-common.lua, ~22 tokens)
Every process also times one short text per call (--latency-calls per round;
the median over all rounds is the "one short text" latency).

    .venv/bin/python scripts/bench_model.py                       # everything
    .venv/bin/python scripts/bench_model.py --configs mlx_embed --peer-threads 2,1
    .venv/bin/python scripts/bench_model.py --configs mlx_embed --corpus short --no-torch
    .venv/bin/python scripts/bench_model.py --no-peer --configs mlx_embed,ref-blas
    .venv/bin/python scripts/bench_model.py --profile             # per-op profile, one forward

The corpus is generated deterministically (mixed lengths, ~108 tokens per
text for MiniLM). The summary reports each configuration's best, the ratio
to the peer's best, whether batching ever loses to one-at-a-time, and the
fraction of the measured fp32 GEMM peak the best pass reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are "
    "which this be or has had not but its new after who first also they two been "
    "their one year all other more some time can over into these would only most "
    "embedding vector model server request latency throughput token batch search "
    "retrieval document query similarity cosine index cluster memory kernel thread "
    "python rust network protocol benchmark encoder attention layer normalization "
    "history science river mountain library museum village festival election "
    "weather football orchestra painting chemistry mathematics philosophy economy"
).split()


def make_corpus(n: int, seed: int = 0) -> list[str]:
    """Mixed lengths: mostly short/medium sentences plus some long passages,
    so that padding and sub-batching matter the way they do in real traffic."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            words = rng.randint(3, 20)
        elif r < 0.8:
            words = rng.randint(40, 120)
        else:
            words = rng.randint(150, 260)
        text = " ".join(rng.choice(_WORDS) for _ in range(words))
        out.append(text[0].upper() + text[1:] + ".")
    return out


def short_corpus(n: int) -> list[str]:
    """``n`` sentences spread evenly over the load test's 672 (the texts wrk
    sends, read from scripts/wrk-common.lua by scripts/loadtest's parser)."""
    from importlib.machinery import SourceFileLoader

    loadtest = SourceFileLoader("mlx_embed_loadtest", str(ROOT / "scripts" / "loadtest")).load_module()
    texts = loadtest.lua_corpus()
    step = len(texts) / min(n, len(texts))
    return [texts[int(i * step)] for i in range(min(n, len(texts)))]


def corpora(n: int) -> dict[str, list[str]]:
    return {"mixed": make_corpus(n), "short": short_corpus(n)}


# The "one short text" of the latency figure: a load-test sentence of the
# short corpus' typical length (21 tokens with MiniLM's specials).
LATENCY_TEXT = "Document 3-4-5 criticises the new vector index and what it means for the team."

# Texts whose vectors every process reports, to show the peers run the same model.
SAMPLE_TEXTS = [LATENCY_TEXT, "hello world", make_corpus(3)[2]]


def _serve(embed, meta: dict, texts: dict[str, list[str]]) -> None:
    """Line protocol for the interleaved side-by-side run. ``embed(list of
    str)`` returns L2-normalized vectors [n, dim]. Prints meta (with the
    sample vectors), then answers each stdin line:
    ``run <corpus> <batch_size>``: seconds for one pass over that corpus in
    calls of batch_size texts; ``lat <calls>``: seconds of each of that many
    one-short-text calls."""
    meta["sample"] = [[round(float(v), 7) for v in row] for row in embed(SAMPLE_TEXTS)]
    print(json.dumps(meta), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        if parts[0] == "lat":
            one = [LATENCY_TEXT]
            out = []
            for _ in range(int(parts[1])):
                t0 = time.perf_counter()
                embed(one)
                out.append(time.perf_counter() - t0)
            print(json.dumps({"seconds": out}), flush=True)
            continue
        corpus, bs = texts[parts[1]], int(parts[2])
        t0 = time.perf_counter()
        for i in range(0, len(corpus), bs):
            embed(corpus[i : i + bs])
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


ENGINE_CONFIGS = {
    "mlx_embed": {},
    "unsorted": {},
    "avx2": {"MLX_EMBED_SIMD": "avx2"},
    "mlx-ops": {"MLX_EMBED_FAST_OPS": "mlx"},
    "exact-ops": {"MLX_EMBED_FAST_OPS": "0"},
    "ref-blas": {"MLX_EMBED_BLAS": "none"},
}


def forward_flops(config: dict, lengths: list[int]) -> float:
    """Useful FLOPs of one forward pass over texts of these token counts:
    the linear layers (2 per multiply-add) plus attention's two [n, n] GEMMs
    per layer. Padding excluded: it is work, not useful work."""
    d, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    per_token = layers * 2 * (4 * d * d + 2 * d * inter)
    return float(sum(n * per_token + layers * 4 * n * n * d for n in lengths))


def gemm_peak_gflops() -> dict:
    """The machine's fp32 GEMM peak through MLX, on the model's shapes at 1024
    tokens and a large square one, best of 5 each, measured two ways: one
    GEMM with the BLAS's own threads, and one single-threaded GEMM per core
    running at once (how the engine's workers use the BLAS)."""
    import threading

    import mlx.core as mx
    from mlx_embed import _blas

    shapes = [(1024, 384, 1536), (1024, 1536, 384), (1024, 384, 1152), (2048, 2048, 2048)]
    cores = os.cpu_count() or 1
    out = {}
    threads_before = _blas.get_num_threads()
    for m, k, n in shapes:
        a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
        mx.eval(a, b, a @ b)
        # The engine leaves OpenBLAS at 1 thread after a parallel call.
        _blas.set_num_threads(cores)
        best = min(_timed(lambda: mx.eval(a @ b)) for _ in range(5))
        out[f"{m}x{k}x{n} {cores} blas threads"] = 2 * m * k * n / best / 1e9

        def worker(barrier, reps=5):
            with mx.stream(mx.new_stream(mx.cpu)):
                barrier.wait()
                for _ in range(reps):
                    mx.eval(a @ b)

        _blas.set_num_threads(1)
        walls = []
        for _ in range(3):
            barrier = threading.Barrier(cores + 1)
            ts = [threading.Thread(target=worker, args=(barrier,)) for _ in range(cores)]
            for t in ts:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in ts:
                t.join()
            walls.append(time.perf_counter() - t0)
        out[f"{m}x{k}x{n} {cores}x1 thread"] = cores * 5 * 2 * m * k * n / min(walls) / 1e9
    if threads_before:
        _blas.set_num_threads(threads_before)
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _plan_in_input_order(model):
    """The engine's planner without the length sort (for the `unsorted`
    configuration): consecutive texts, cut under the same token budget."""
    import numpy as np

    def plan(lengths):
        batches, start = [], 0
        while start < len(lengths):
            end, longest = start + 1, int(lengths[start])
            while end < len(lengths):
                longest_next = max(longest, int(lengths[end]))
                if longest_next * (end - start + 1) > model.batch_tokens:
                    break
                end, longest = end + 1, longest_next
            batches.append(np.arange(start, end))
            start = end
        return batches

    return plan


def engine_serve(args) -> None:
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed

    model = mlx_embed.load(args.model, batch_tokens=args.batch_tokens)
    if args.unsorted:
        model.scheduler.plan = _plan_in_input_order(model)
    texts = corpora(args.texts)
    with open(os.path.join(model.path, "config.json")) as f:
        config = json.load(f)
    tokens, flops = {}, {}
    for name, corpus in texts.items():
        lengths = model.count_tokens(corpus)
        tokens[name], flops[name] = sum(lengths), forward_flops(config, lengths) / 1e9
        model.embed(corpus[: max(args.batch_sizes)])
    for _ in range(5):
        model.embed([LATENCY_TEXT])

    info = model.info()
    meta = {"blas": info["blas"], "blas_gflops": round(info["blas_gflops"], 1),
            "ops_path": model.context.describe(), "workers": model.workers,
            "texts": {k: len(v) for k, v in texts.items()}, "tokens": tokens, "forward_gflop": flops,
            "latency_tokens": model.count_tokens([LATENCY_TEXT])[0],
            "device_batch_tokens": info["device_batch_tokens"]}
    if args.gemm_peak:
        meta["gemm_peak_gflops"] = {k: round(v, 1) for k, v in gemm_peak_gflops().items()}
    _serve(model.embed, meta, texts)


def peer_serve(args) -> None:
    """sentence-transformers (torch CPU) on the same corpora; run with the
    peer's interpreter (it must have torch + sentence-transformers)."""
    import torch

    torch.set_num_threads(args.peer_threads)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(args.model, device="cpu")
    texts = corpora(args.texts)
    tokens = {k: sum(len(x) for x in st.tokenizer(v, truncation=True, max_length=st.max_seq_length)["input_ids"])
              for k, v in texts.items()}
    for corpus in texts.values():
        st.encode(corpus[: max(args.batch_sizes)], batch_size=max(args.batch_sizes))

    def embed(batch):
        return st.encode(batch, batch_size=len(batch), normalize_embeddings=True)

    from importlib.metadata import version
    _serve(embed, {"name": f"sentence-transformers {version('sentence-transformers')} "
                           f"torch {torch.__version__} threads {args.peer_threads}",
                   "texts": {k: len(v) for k, v in texts.items()}, "tokens": tokens}, texts)


def export_onnx(model_dir: str) -> str:
    """The model exported to ONNX by optimum (feature extraction: input ids,
    attention mask, token types -> last hidden state), cached under
    .bench/onnx/<folder name>-<hash of its config and weights' size>."""
    import hashlib

    src = Path(model_dir)
    key = hashlib.sha256((src / "config.json").read_bytes()
                         + str((src / "model.safetensors").stat().st_size).encode()).hexdigest()[:12]
    out = ROOT / ".bench" / "onnx" / f"{src.name}-{key}"
    if not (out / "model.onnx").exists():
        from optimum.exporters.onnx import main_export

        # library_name: the plain encoder (last hidden state), not optimum's
        # sentence-transformers graph with pooling inside; pooling is ours.
        main_export(str(src), output=str(out), task="feature-extraction", device="cpu",
                    library_name="transformers")
    return str(out / "model.onnx")


def ort_serve(args) -> None:
    """ONNX Runtime on the CPU, same weights, texts and thread count; run
    with the peer's interpreter (onnxruntime, optimum, transformers)."""
    import numpy as np
    import onnxruntime as ort
    from transformers import AutoTokenizer

    path = export_onnx(args.model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.ort_threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(os.path.join(args.model, "sentence_bert_config.json")) as f:
        max_len = int(json.load(f)["max_seq_length"])

    def embed(batch):
        enc = tok(batch, padding=True, truncation=True, max_length=max_len, return_tensors="np")
        feed = {k: v.astype(np.int64) for k, v in enc.items() if k in names}
        h = sess.run(["last_hidden_state"], feed)[0]
        m = enc["attention_mask"][..., None].astype(np.float32)
        v = (h * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)

    texts = corpora(args.texts)
    tokens = {k: sum(len(x) for x in tok(v, truncation=True, max_length=max_len)["input_ids"])
              for k, v in texts.items()}
    for corpus in texts.values():
        embed(corpus[: max(args.batch_sizes)])
    from importlib.metadata import version
    _serve(embed, {"name": f"onnxruntime {ort.__version__} (optimum {version('optimum-onnx')} export) "
                           f"threads {args.ort_threads}",
                   "texts": {k: len(v) for k, v in texts.items()}, "tokens": tokens}, texts)


def _default_model_dir() -> str:
    sys.path.insert(0, str(ROOT / "python"))
    from mlx_embed.engine import default_model_path

    return default_model_path()


def side_by_side(args) -> int:
    """All configurations as long-lived subprocesses, interleaved round by
    round so every one sees the same machine load."""
    model = args.model or _default_model_dir()
    common = ["--texts", str(args.texts), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
              "--model", model]
    if args.batch_tokens:
        common += ["--batch-tokens", str(args.batch_tokens)]
    base_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                    TOKENIZERS_PARALLELISM="false")
    # Started one after another: each loads, warms up and (the first)
    # measures the GEMM peak while the others are not yet running.
    commands = {}
    for name in args.configs:
        extra = ["--unsorted"] if name == "unsorted" else []
        if name == args.configs[0] and not args.no_gemm_peak:
            extra.append("--gemm-peak")
        commands[name] = ([sys.executable, __file__, "--engine-serve", *extra, *common],
                          {**base_env, **ENGINE_CONFIGS[name]})
    if args.peer_python and not args.no_peer:
        for th in [] if args.no_ort else args.ort_threads_list:
            commands[f"ort-{th}t"] = (
                [args.peer_python, __file__, "--ort-serve", "--ort-threads", str(th), *common], base_env)
        for th in [] if args.no_torch else args.peer_threads_list:
            commands[f"torch-{th}t"] = (
                [args.peer_python, __file__, "--peer-serve", "--peer-threads", str(th), *common],
                base_env)
    procs, meta = {}, {}
    for k, (cmd, env) in commands.items():
        procs[k] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True, env=env)
        line = procs[k].stdout.readline()
        if not line:
            raise SystemExit(f"{k} failed to start")
        meta[k] = json.loads(line)

    def ask(pr, request: str) -> dict:
        pr.stdin.write(request + "\n")
        pr.stdin.flush()
        return json.loads(pr.stdout.readline())

    times = {c: {k: {bs: [] for bs in args.batch_sizes} for k in procs} for c in args.corpus}
    latency = {k: [] for k in procs}
    load0 = os.getloadavg()
    t_start = time.time()
    for rnd in range(args.repeats):
        for k, pr in procs.items():
            if args.latency_calls and not (k == "ref-blas" and rnd >= args.ref_rounds):
                latency[k] += ask(pr, f"lat {args.latency_calls}")["seconds"]
        for c in args.corpus:
            for bs in args.batch_sizes:
                for k, pr in procs.items():
                    if k == "ref-blas" and rnd >= args.ref_rounds:
                        continue
                    times[c][k][bs].append(ask(pr, f"run {c} {bs}")["seconds"])
    load1 = os.getloadavg()
    for pr in procs.values():
        pr.stdin.write("quit\n")
        pr.stdin.close()
        pr.wait()

    import numpy as np

    head = args.configs[0]
    print(f"# {json.dumps(versions())}")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    for k, m in meta.items():
        print(f"# {k}: {json.dumps({a: b for a, b in m.items() if a != 'sample'})}")
    ref = np.array(meta[head]["sample"])
    for k, m in meta.items():
        if k != head:
            print(f"# {k}: max |diff| of its vectors vs {head} on {len(ref)} sample texts: "
                  f"{np.abs(np.array(m['sample']) - ref).max():.1e}")
    print(f"# {args.repeats} interleaved rounds (ref-blas {min(args.ref_rounds, args.repeats)}), medians; "
          f"{time.time() - t_start:.0f} s; load average (1/5/15 min) before {_load(load0)}, after {_load(load1)}")
    names = list(procs)
    summary: dict = {"corpora": {}}
    for c in args.corpus:
        n_texts, n_tokens = meta[head]["texts"][c], meta[head]["tokens"][c]
        tps = {k: {bs: n_texts / statistics.median(v) for bs, v in t.items()} for k, t in times[c].items()}
        print(f"\n## corpus {c}: {n_texts} texts, {n_tokens} real tokens ({n_tokens / n_texts:.1f} per text)")
        for unit, scale in (("texts/s", 1.0), ("real tokens/s", n_tokens / n_texts)):
            print()
            print("| batch | " + " | ".join(f"{k} {unit}" for k in names) + " |")
            print("|---:|" + "---:|" * len(names))
            for bs in args.batch_sizes:
                cells = [f"{tps[k][bs] * scale:.1f}" if unit == "texts/s" else f"{tps[k][bs] * scale:.0f}"
                         for k in names]
                print(f"| {bs} | " + " | ".join(cells) + " |")
        best = {k: max(v.values()) for k, v in tps.items()}
        print()
        print("best texts/s: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()))
        s = {"texts_per_s": tps, "best": best}
        for prefix in ("ort-", "torch-"):
            peers = {k: v for k, v in best.items() if k.startswith(prefix)}
            if peers:
                s[f"ratio_vs_{prefix[:-1]}_best"] = best[head] / max(peers.values())
                print(f"{head} best / {prefix[:-1]} best = {s[f'ratio_vs_{prefix[:-1]}_best']:.2f}x")
        for k in args.configs:
            if 1 in tps[k] and len(tps[k]) > 1:
                worst = min(v / tps[k][1] for bs, v in tps[k].items() if bs != 1)
                print(f"{k}: batched / one-at-a-time, worst batch size: {worst:.2f}x")
        if "gemm_peak_gflops" in meta[head]:
            peak = max(meta[head]["gemm_peak_gflops"].values())
            reached = meta[head]["forward_gflop"][c] * best[head] / n_texts
            s["gemm_fraction"] = reached / peak
            print(f"{head} best pass: {reached:.0f} GFLOP/s of useful work "
                  f"({meta[head]['forward_gflop'][c]:.0f} GFLOP per corpus), {100 * reached / peak:.0f}% of the "
                  f"measured fp32 GEMM peak {peak:.0f} GFLOP/s")
        summary["corpora"][c] = s
    if args.latency_calls:
        med = {k: statistics.median(v) * 1e3 for k, v in latency.items() if v}
        print(f"\n## one short text per call ({meta[head].get('latency_tokens')} tokens: {LATENCY_TEXT!r}), "
              f"median of {len(latency[head])} calls")
        print()
        print("| | " + " | ".join(med) + " |")
        print("|---|" + "---:|" * len(med))
        print("| ms | " + " | ".join(f"{v:.2f}" for v in med.values()) + " |")
        summary["latency_ms"] = med
        for prefix in ("ort-", "torch-"):
            peers = {k: v for k, v in med.items() if k.startswith(prefix)}
            if peers:
                r = med[head] / min(peers.values())
                summary[f"latency_vs_{prefix[:-1]}"] = r
                print(f"{head} / fastest {prefix[:-1]}: {r:.2f}x the time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "meta": meta, "times": times, "latency": latency,
                       "load": [load0, load1], "summary": summary}, f, indent=2)
    return 0


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def profile(args) -> None:
    """Per-op wall time of one BERT forward pass, evaluating after every op
    (so each op is timed alone; the sum is a bit above a normal pass)."""
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed
    from mlx_embed import ops

    model = mlx_embed.load(args.model)
    if model.model_type != "bert":
        raise SystemExit("--profile supports bert models")
    # The model's own element-wise settings, active for the whole profile.
    with ops.forward_context(model.context):
        _profile_forward(args, model, model.context)


def _profile_forward(args, model, ctx) -> None:
    import mlx.core as mx
    import mlx_embed
    import numpy as np
    from mlx_embed import ops

    texts = make_corpus(args.texts)[: args.profile_batch]
    ids, _ = model.encode(texts)
    L = max(map(len, ids))
    arr = np.zeros((len(ids), L), np.int32)
    msk = np.zeros((len(ids), L), np.int32)
    for i, row in enumerate(ids):
        arr[i, : len(row)] = row
        msk[i, : len(row)] = 1
    ids_mx, mask_mx = mx.array(arr), mx.array(msk)
    net = model.model
    totals: dict = {}

    def timed(name, fn, *a):
        out = fn(*a)
        mx.eval(out)
        t0 = time.perf_counter()
        for _ in range(args.profile_repeats):
            out = fn(*a)
            mx.eval(out)
        totals[name] = totals.get(name, 0.0) + (time.perf_counter() - t0) / args.profile_repeats
        return out

    x = timed("embeddings+layernorm", net.embeddings, ids_mx)
    key_mask = ops.KeyMask(mask_mx, x.dtype)
    B, _, D = x.shape
    for layer in net.layers:
        att = layer.attention
        qkv = timed("qkv linear", att.qkv, x)
        qkv = mx.contiguous(
            qkv.reshape(B, L, 3, att.n_heads, att.head_dim).transpose(2, 0, 3, 1, 4))
        if ctx.path == "native":
            # The kernel works in place, so its repeats re-normalize the same
            # buffer: same cost, and the values stay a valid softmax.
            q, k, v = timed("qkv split/transpose", lambda t: (t[0], t[1], t[2]), qkv)
            s = timed("scores q@k^T", lambda a, b: a @ b.swapaxes(-1, -2), q, k)
            p_ = timed("softmax (masked)", lambda t: ops._native.masked_softmax_(
                ops._native_buffer(t), key_mask.lengths, att.scale, ctx.kernel_threads) or t, s)
        else:
            q, k, v = timed("qkv split/transpose", lambda t: (t[0] * att.scale, t[1], t[2]), qkv)
            s = timed("scores q@k^T", lambda a, b: a @ b.swapaxes(-1, -2) + key_mask.additive, q, k)
            p_ = timed("softmax (masked)", ops.softmax, s)
        o = timed("probs@v + merge heads",
                  lambda a, b: (a @ b).transpose(0, 2, 1, 3).reshape(B, L, D), p_, v)
        o = timed("attn out linear", att.out_proj, o)
        x = timed("residual+layernorm", lambda a, b: ops.add_layer_norm(
            a, b, layer.attention_norm, overwrite_input=True), o, x)
        h = timed("ffn up linear", layer.ffn.up, x)
        h = timed("gelu", lambda t: ops.gelu(t, overwrite_input=True), h)
        h = timed("ffn down linear", layer.ffn.down, h)
        x = timed("residual+layernorm", lambda a, b: ops.add_layer_norm(
            a, b, layer.ffn_norm, overwrite_input=True), h, x)
    m = mask_mx.astype(x.dtype)[..., None]
    timed("mean pooling", lambda a: (a * m).sum(1) / m.sum(1), x)

    whole = []
    for _ in range(args.profile_repeats):
        t0 = time.perf_counter()
        mx.eval(model.scheduler.head(net(ids_mx, mask_mx), mask_mx))
        whole.append(time.perf_counter() - t0)
    total = sum(totals.values())
    print(f"# batch {len(ids)} x {L} tokens ({int(msk.sum())} real), BLAS {mlx_embed.blas_info()['library']}, "
          f"ops path {ctx.describe()}")
    print(f"# whole forward (lazy graph, one eval): {statistics.median(whole) * 1e3:.1f} ms; "
          f"sum of per-op times: {total * 1e3:.1f} ms")
    print("| op (all layers) | ms | share |")
    print("|---|---:|---:|")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {t * 1e3:.1f} | {100 * t / total:.0f}% |")


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        from importlib.metadata import version

        for pkg in ("mlx", "numpy", "tokenizers", "mlx-lm"):
            out[pkg] = version(pkg)
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    out["cpu"] = line.split(":", 1)[1].strip()
                    break
        out["cores"] = os.cpu_count()
    except OSError:
        pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--ref-rounds", type=int, default=1, help="rounds for the (slow) ref-blas configuration")
    p.add_argument("--configs", default=",".join(ENGINE_CONFIGS),
                   help=f"engine configurations, first one is the headline ({', '.join(ENGINE_CONFIGS)})")
    p.add_argument("--json", help="also write raw results here")
    p.add_argument("--batch-tokens", type=int, help="override the engine's sub-batch token budget")
    p.add_argument("--profile", action="store_true", help="per-op profile of one forward pass")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--profile-repeats", type=int, default=3)
    default_peer = ROOT / ".bench-venv" / "bin" / "python"
    p.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None,
                   help="interpreter with torch, sentence-transformers and onnxruntime (default .bench-venv/bin/python "
                        "if present; `make bench` creates it)")
    p.add_argument("--no-peer", action="store_true", help="skip sentence-transformers")
    p.add_argument("--peer-threads", default="2,1", help="torch thread counts to run, e.g. 2,1")
    p.add_argument("--ort-threads", default="2", help="ONNX Runtime intra-op thread counts to run, e.g. 2,1")
    p.add_argument("--no-torch", action="store_true", help="skip sentence-transformers (keep ONNX Runtime)")
    p.add_argument("--no-ort", action="store_true", help="skip ONNX Runtime")
    p.add_argument("--corpus", default="mixed,short", help="corpora to run: mixed, short or both")
    p.add_argument("--latency-calls", type=int, default=40,
                   help="one-short-text calls per process per round (0: no latency figure)")
    p.add_argument("--no-gemm-peak", action="store_true", help="skip the GEMM peak measurement")
    p.add_argument("--engine-serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unsorted", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gemm-peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ort-serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.peer_threads_list = [int(x) for x in str(args.peer_threads).split(",")]
    args.peer_threads = args.peer_threads_list[0]
    args.ort_threads_list = [int(x) for x in str(args.ort_threads).split(",")]
    args.ort_threads = args.ort_threads_list[0]
    args.corpus = [c.strip() for c in args.corpus.split(",") if c.strip()]
    if any(c not in ("mixed", "short") for c in args.corpus):
        p.error("--corpus takes mixed, short or both")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in ENGINE_CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown}; choose from {list(ENGINE_CONFIGS)}")
    if args.engine_serve:
        engine_serve(args)
        return 0
    if args.peer_serve:
        peer_serve(args)
        return 0
    if args.ort_serve:
        ort_serve(args)
        return 0
    if args.profile:
        profile(args)
        return 0
    if not args.no_peer and not args.peer_python:
        print("# peer skipped: no .bench-venv (make bench creates it) and no --peer-python", file=sys.stderr)
    return side_by_side(args)


if __name__ == "__main__":
    raise SystemExit(main())
