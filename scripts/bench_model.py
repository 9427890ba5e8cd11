#!/usr/bin/env python3
"""Model-engine throughput: texts/s and real tokens/s per batch size.

Each BLAS configuration runs in its own subprocess because the BLAS is chosen
when ``mlx_embed`` is first imported. The corpus is generated
deterministically (mixed lengths, ~110 tokens on average for MiniLM).

    python scripts/bench_model.py                    # OpenBLAS vs reference BLAS
    python scripts/bench_model.py --blas auto        # only the default BLAS
    python scripts/bench_model.py --model DIR --texts 128 --batch-sizes 1,16,64
    python scripts/bench_model.py --profile          # per-op profile, one forward
    python scripts/bench_model.py --blas auto --peer-python .bench-venv/bin/python
        # side by side with sentence-transformers (torch CPU) in one run:
        # engine, peer, engine, peer, ... on the same corpus; medians, ratio
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


def child(args) -> None:
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed  # BLAS is picked here, from MLX_EMBED_BLAS

    model = mlx_embed.load(args.model, batch_tokens=args.batch_tokens)
    texts = make_corpus(args.texts)
    tokens = sum(model.count_tokens(texts))
    # Warm-up: thread pools, page faults, compiled kernels for these shapes.
    model.embed(texts[: max(args.batch_sizes)])
    results = []
    for bs in args.batch_sizes:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for i in range(0, len(texts), bs):
                model.embed(texts[i : i + bs])
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results.append(
            {
                "batch_size": bs,
                "seconds": med,
                "texts_per_s": len(texts) / med,
                "tokens_per_s": tokens / med,
                "runs": len(times),
            }
        )
    info = model.info()
    print(
        json.dumps(
            {
                "blas": info["blas"],
                "blas_gflops": info["blas_gflops"],
                "model": info["name"],
                "texts": len(texts),
                "tokens": tokens,
                "preferred_batch_tokens": info["preferred_batch_tokens"],
                "results": results,
            }
        )
    )


def _serve(run_once, meta: dict) -> None:
    """Line protocol for the interleaved side-by-side run: print meta, then
    for each "<batch_size>" line on stdin time one pass over the corpus."""
    print(json.dumps(meta), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        bs = int(line)
        t0 = time.perf_counter()
        run_once(bs)
        print(json.dumps({"batch_size": bs, "seconds": time.perf_counter() - t0}), flush=True)


def engine_serve(args) -> None:
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed

    model = mlx_embed.load(args.model, batch_tokens=args.batch_tokens)
    texts = make_corpus(args.texts)
    tokens = sum(model.count_tokens(texts))
    model.embed(texts[: max(args.batch_sizes)])

    def run_once(bs):
        for i in range(0, len(texts), bs):
            model.embed(texts[i : i + bs])

    info = model.info()
    _serve(run_once, {"name": "mlx_embed", "blas": info["blas"], "blas_gflops": info["blas_gflops"],
                      "texts": len(texts), "tokens": tokens,
                      "preferred_batch_tokens": info["preferred_batch_tokens"]})


def peer_serve(args) -> None:
    """sentence-transformers (torch CPU) on the same corpus; run with the
    peer's interpreter (it must have torch + sentence-transformers)."""
    import torch

    torch.set_num_threads(args.peer_threads)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(args.model, device="cpu")
    texts = make_corpus(args.texts)
    tokens = sum(len(x) for x in st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"])
    st.encode(texts[: max(args.batch_sizes)], batch_size=max(args.batch_sizes))

    def run_once(bs):
        for i in range(0, len(texts), bs):
            st.encode(texts[i : i + bs], batch_size=bs)

    from importlib.metadata import version
    _serve(run_once, {"name": f"sentence-transformers {version('sentence-transformers')} "
                              f"torch {torch.__version__} threads {args.peer_threads}",
                      "texts": len(texts), "tokens": tokens})


def _default_model_dir() -> str:
    sys.path.insert(0, str(ROOT / "python"))
    from mlx_embed.engine import default_model_path

    return default_model_path()


def side_by_side(args) -> int:
    """Engine and peer(s) as long-lived subprocesses, runs interleaved
    (engine, peer, engine, peer, ...) so both see the same machine load."""
    model = args.model or _default_model_dir()
    common = ["--texts", str(args.texts), "--batch-sizes", ",".join(map(str, args.batch_sizes)),
              "--model", model]
    if args.batch_tokens:
        common += ["--batch-tokens", str(args.batch_tokens)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    procs = {"mlx_embed": subprocess.Popen([sys.executable, __file__, "--engine-serve", *common],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)}
    for th in args.peer_threads_list:
        procs[f"torch-{th}t"] = subprocess.Popen(
            [args.peer_python, __file__, "--peer-serve", "--peer-threads", str(th), *common],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    meta = {}
    for k, pr in procs.items():  # each loads and warms up alone, in turn
        line = pr.stdout.readline()
        if not line:
            raise SystemExit(f"{k} failed to start")
        meta[k] = json.loads(line)
    times = {k: {bs: [] for bs in args.batch_sizes} for k in procs}
    load0 = os.getloadavg()
    for _ in range(args.repeats):
        for bs in args.batch_sizes:
            for k, pr in procs.items():
                pr.stdin.write(f"{bs}\n")
                pr.stdin.flush()
                times[k][bs].append(json.loads(pr.stdout.readline())["seconds"])
    load1 = os.getloadavg()
    for pr in procs.values():
        pr.stdin.write("quit\n")
        pr.stdin.close()
        pr.wait()
    n = meta["mlx_embed"]["texts"]
    tps = {k: {bs: n / statistics.median(v) for bs, v in t.items()} for k, t in times.items()}
    print(f"# {json.dumps(versions())}")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    for k, m in meta.items():
        print(f"# {k}: {json.dumps(m)}")
    print(f"# load average (1/5/15 min) before {load0}, after {load1}; "
          f"{args.repeats} interleaved rounds, medians")
    print()
    names = list(procs)
    print("| batch | " + " | ".join(f"{k} texts/s" for k in names) + " |")
    print("|---:|" + "---:|" * len(names))
    for bs in args.batch_sizes:
        print(f"| {bs} | " + " | ".join(f"{tps[k][bs]:.1f}" for k in names) + " |")
    best = {k: max(v.values()) for k, v in tps.items()}
    peer_best = max(v for k, v in best.items() if k != "mlx_embed")
    print()
    print("best: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()))
    print(f"ratio ours_best / peer_best = {best['mlx_embed'] / peer_best:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "meta": meta, "times": times,
                       "texts_per_s": tps, "load": [load0, load1],
                       "ratio": best["mlx_embed"] / peer_best}, f, indent=2)
    return 0


def profile(args) -> None:
    """Per-op wall time of one BERT forward pass, evaluating after every op
    (so each op is timed alone; the sum is a bit above a normal pass)."""
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed
    import mlx.core as mx
    import numpy as np

    from mlx_embed import ops

    model = mlx_embed.load(args.model)
    if model.model_type != "bert":
        raise SystemExit("--profile supports bert models")
    texts = make_corpus(args.texts)[: args.profile_batch]
    ids = [model.tokenizer.finish(c)[0] for c in model.tokenizer.encode_contents(texts)]
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
        if ops.PATH == "native":
            # The kernel works in place, so its repeats re-normalize the same
            # buffer: same cost, and the values stay a valid softmax.
            q, k, v = timed("qkv split/transpose", lambda t: (t[0], t[1], t[2]), qkv)
            s = timed("scores q@k^T", lambda a, b: a @ b.swapaxes(-1, -2), q, k)
            p_ = timed("softmax (masked)", lambda t: ops._native.masked_softmax_(
                ops._writable_view(t), key_mask.lengths, att.scale, ops._kernel_threads) or t, s)
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
        mx.eval(model._forward(ids_mx, mask_mx, mx.array(msk.sum(1) - 1)))
        whole.append(time.perf_counter() - t0)
    total = sum(totals.values())
    print(f"# batch {len(ids)} x {L} tokens ({int(msk.sum())} real), BLAS {mlx_embed.blas_info()['library']}, "
          f"ops path {ops.PATH}")
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
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ref-repeats", type=int, default=1, help="repeats for the (slow) reference BLAS")
    p.add_argument("--blas", choices=["both", "auto", "none"], default="both")
    p.add_argument("--json", help="also write raw results here")
    p.add_argument("--batch-tokens", type=int, help="override the engine's sub-batch token budget")
    p.add_argument("--profile", action="store_true", help="per-op profile of one forward pass")
    p.add_argument("--profile-batch", type=int, default=32)
    p.add_argument("--profile-repeats", type=int, default=3)
    default_peer = ROOT / ".bench-venv" / "bin" / "python"
    p.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None,
                   help="interpreter with torch + sentence-transformers: run them side by side "
                        "with the engine, interleaved (default .bench-venv/bin/python if present)")
    p.add_argument("--no-peer", action="store_true", help="skip the side-by-side peer run")
    p.add_argument("--peer-threads", default="2", help="torch thread counts to run, e.g. 2,1")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine-serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.peer_threads_list = [int(x) for x in str(args.peer_threads).split(",")]
    args.peer_threads = args.peer_threads_list[0]
    if args.child:
        child(args)
        return 0
    if args.engine_serve:
        engine_serve(args)
        return 0
    if args.peer_serve:
        peer_serve(args)
        return 0
    if args.profile:
        profile(args)
        return 0

    if args.peer_python and not args.no_peer and args.blas != "none":
        return side_by_side(args)

    configs = {"both": ["auto", "none"], "auto": ["auto"], "none": ["none"]}[args.blas]
    runs = {}
    for cfg in configs:
        env = dict(os.environ)
        if cfg == "none":
            env["MLX_EMBED_BLAS"] = "none"
        cmd = [sys.executable, __file__, "--child", "--texts", str(args.texts),
               "--batch-sizes", ",".join(map(str, args.batch_sizes)),
               "--repeats", str(args.ref_repeats if cfg == "none" else args.repeats)]
        if args.model:
            cmd += ["--model", args.model]
        if args.batch_tokens:
            cmd += ["--batch-tokens", str(args.batch_tokens)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return r.returncode
        runs[cfg] = json.loads(r.stdout.strip().splitlines()[-1])

    print(f"# {json.dumps(versions())}")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    first = next(iter(runs.values()))
    print(f"# model {first['model']}, {first['texts']} texts, {first['tokens']} real tokens, "
          f"preferred_batch_tokens {first['preferred_batch_tokens']}")
    print()
    print("| BLAS | GFLOP/s | batch | texts/s | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for cfg, run in runs.items():
        name = "reference" if run["blas"] == "reference" else os.path.basename(run["blas"])
        for res in run["results"]:
            print(f"| {name} | {run['blas_gflops']:.0f} | {res['batch_size']} | "
                  f"{res['texts_per_s']:.1f} | {res['tokens_per_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions(), "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
