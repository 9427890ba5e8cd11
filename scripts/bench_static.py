#!/usr/bin/env python3
"""Static-embedding throughput, side by side: the engine
(``mlx_embed.load(folder).embed(texts)``), the real server binary under HTTP
load, model2vec's ``StaticModel.encode`` and sentence-transformers'
``SentenceTransformer.encode`` on the same random table and texts, plus the
time of one short text per call, parity of the vectors and where each side's
time goes.

The checkpoint: a [30522, dim] table of seeded random rows written by this
script with NumPy (the engine side needs no torch) beside all-MiniLM-L6-v2's
bert-base-uncased WordPiece tokenizer.json (truncation and padding off, as the
published static models ship it), cached under .bench/static-<shape>/.
Shapes (``--shape``):

  potion      a Model2Vec folder shaped like minishlab/potion-base-8M: dim 256,
              config.json model_type "model2vec", normalize true and no
              max_length key (model2vec's default 512 then applies in both
              libraries: the text cut to 512 x the vocabulary's median token
              length in characters, 512 tokens, [UNK] dropped, as
              models/static.py states), and the modules.json model2vec writes,
              so sentence-transformers loads it too (without model2vec's
              truncation and [UNK] rules: its parity is informative only);
  static-mrl  a sentence-transformers StaticEmbedding -> Normalize folder
              shaped like sentence-transformers/static-retrieval-mrl-en-v1:
              dim 1024, 0_StaticEmbedding/ (embedding.weight), 1_Normalize;
              no truncation, special tokens left out, [UNK] kept;
  tiny, tiny-st  dim 32, the same two layouts (for --dry-run).

Rows are N(0, 1) scaled per token by U(0.25, 2) (trained tables have rows of
very different norms; a plain mean then weighs tokens unevenly, as in the
real models).

Systems, each a long-lived process answering one request at a time, timed in
interleaved rounds (every system once per round, in turn) so all see the same
machine load; figures are medians over rounds:

  mlx_embed        the library call with its defaults: ``embed(corpus)`` in one
                   call (static models default to 8192 padded tokens a pass);
  mlx_embed bt256  the same model loaded with ``batch_tokens=256``, the CPU
                   default for transformers (why static models override it);
  server           target/release/mlx-embed-server --model <folder> --no-cache:
                   the corpus as POST /v1/embeddings requests of --per-request
                   texts (base64 vectors, as the OpenAI client asks) over
                   --connections keep-alive connections (scripts/http_load.py,
                   one client process), bounded by --server-deadline-s; and one
                   short text per request, one connection, back to back
                   (median and p99 over all rounds);
  model2vec        ``StaticModel.encode(corpus)`` with its defaults (batch 1024;
                   its thread pool only starts above 10,000 texts) in
                   --peer-python (default .bench-venv/bin/python; `make bench`
                   installs model2vec there);
  st bs<B>         ``SentenceTransformer(folder).encode(corpus, batch_size=B)``
                   (torch CPU, --peer-threads threads), for each --st-batch-sizes.

Every process keeps the tokenizers library's default parallelism (the
TOKENIZERS_PARALLELISM the script was started with is recorded).

Parity: the engine's vectors of the last timed pass against each peer's and
the server's (the server's from one untimed pass after the rounds): min
cosine (two zero vectors agree) and max |diff|; the script exits 1 if the
min cosine against the format's own library (model2vec for a Model2Vec
folder, sentence-transformers for a StaticEmbedding folder) or the server is
below --min-cosine (0.9999).

    .venv/bin/python scripts/bench_static.py                                    # potion shape, 4,000 mixed texts
    .venv/bin/python scripts/bench_static.py --shape static-mrl --corpus short --deadline-s 150
    .venv/bin/python scripts/bench_static.py --dry-run --no-peer --no-server    # engine only, seconds
    .venv/bin/python scripts/bench_static.py --json docs/static-results.json    # merges into the file's "runs"
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The server gets this interpreter's venv; run by a python outside any venv, it is left to find ./.venv itself.
VENV_ENV = {"VIRTUAL_ENV": sys.prefix} if sys.prefix != sys.base_prefix else {}
sys.path.insert(0, str(Path(__file__).resolve().parent))

import http_load  # noqa: E402
from bench_model import LATENCY_TEXT, make_corpus, short_corpus, versions  # noqa: E402
from bench_splade import _save_json, _serve, _start, minilm_dir, write_safetensors  # noqa: E402

# format: "model2vec" (config.json + model.safetensors "embeddings") or "st"
# (0_StaticEmbedding/ + 1_Normalize, no config.json).
SHAPES = {
    "potion": {"format": "model2vec", "dim": 256, "like": "minishlab/potion-base-8M"},
    "static-mrl": {"format": "st", "dim": 1024, "like": "sentence-transformers/static-retrieval-mrl-en-v1"},
    "tiny": {"format": "model2vec", "dim": 32, "like": "potion layout, for --dry-run"},
    "tiny-st": {"format": "st", "dim": 32, "like": "static-mrl layout, for --dry-run"},
}
SEED = 0
# Bumped whenever the files written for the same shape change (the cache key).
BUILD_VERSION = 1
SERVER = ROOT / "target" / "release" / "mlx-embed-server"
M2V_INSTALL = ("model2vec is not installed in the peer venv: `rm -f .bench-venv/.installed-*; make "
               ".bench-venv/.installed-peers` (or `.bench-venv/bin/pip install --no-deps model2vec`)")

# --------------------------------------------------------------- checkpoint


def random_table(vocab: int, dim: int):
    import numpy as np

    rng = np.random.default_rng(SEED)
    rows = rng.standard_normal((vocab, dim), dtype=np.float32)
    scale = rng.uniform(0.25, 2.0, size=(vocab, 1)).astype(np.float32)
    return np.ascontiguousarray(rows * scale, dtype=np.float32)


def build_checkpoint(shape_name: str) -> Path:
    """.bench/static-<shape>/, built once; rebuilt when its bench-build.json
    differs from what this script would write."""
    shape = SHAPES[shape_name]
    out = ROOT / ".bench" / f"static-{shape_name}"
    src = Path(minilm_dir())
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = len(tok["model"]["vocab"])
    spec = {"build_version": BUILD_VERSION, "seed": SEED, "shape": shape, "vocab_size": vocab,
            "tokenizer": "all-MiniLM-L6-v2 (bert-base-uncased WordPiece)"}
    marker = out / "bench-build.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    t0 = time.perf_counter()
    if out.exists():
        shutil.rmtree(out)
    # The published static models' tokenizer.json has neither (MiniLM's says
    # truncation 128 and padding Fixed(128), which StaticEmbedding would obey).
    tok["truncation"] = None
    tok["padding"] = None
    table = random_table(vocab, shape["dim"])
    out.mkdir(parents=True)
    if shape["format"] == "model2vec":
        # potion-base-8M's config.json keys (no max_length: 512 applies).
        _save_json(out / "config.json", {
            "model_type": "model2vec", "architectures": ["StaticModel"], "tokenizer_name": "bert-base-uncased",
            "apply_pca": shape["dim"], "apply_zipf": True, "hidden_dim": shape["dim"], "seq_length": 1000000,
            "normalize": True})
        write_safetensors(out / "model.safetensors", {"embeddings": table})
        _save_json(out / "tokenizer.json", tok)
        # What model2vec's save_pretrained writes for sentence-transformers.
        _save_json(out / "modules.json", [
            {"idx": 0, "name": "0", "path": ".", "type": "sentence_transformers.models.StaticEmbedding"},
            {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}])
    else:
        sub = out / "0_StaticEmbedding"
        sub.mkdir()
        write_safetensors(sub / "model.safetensors", {"embedding.weight": table})
        _save_json(sub / "tokenizer.json", tok)
        _save_json(out / "modules.json", [
            {"idx": 0, "name": "0", "path": "0_StaticEmbedding",
             "type": "sentence_transformers.models.StaticEmbedding"},
            {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}])
        _save_json(out / "config_sentence_transformers.json", {
            "__version__": {"sentence_transformers": "3.3.0"}, "prompts": {}, "default_prompt_name": None,
            "similarity_fn_name": "cosine"})
    (out / "1_Normalize").mkdir()
    _save_json(out / "1_Normalize" / "config.json", {})
    _save_json(marker, spec)
    print(f"# built {out.relative_to(ROOT)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def corpus(kind: str, n: int) -> list[str]:
    """``mixed``: bench_model's mixed-length texts; ``short``: the load test's
    672 sentences, repeated in order up to ``n`` (nothing here caches: the
    server runs with --no-cache), so a pass is long enough to time."""
    if kind == "mixed":
        return make_corpus(n)
    base = short_corpus(n)
    return [base[i % len(base)] for i in range(n)]


def _best(fn, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _handlers(runs: dict, one):
    """The line protocol's verbs over ``runs`` (label -> function of no
    arguments returning [n, dim] vectors) and ``one`` (embeds one text)."""
    import numpy as np

    keep: dict = {}

    def run(label):
        t0 = time.perf_counter()
        keep[label] = runs[label]()
        return {"seconds": time.perf_counter() - t0}

    def lat(calls):
        out = []
        for _ in range(int(calls)):
            t0 = time.perf_counter()
            one(LATENCY_TEXT)
            out.append(time.perf_counter() - t0)
        return {"seconds": out}

    def dump(label, path):
        vecs = np.asarray(keep[label], dtype=np.float32)
        np.save(path, vecs)
        return {"shape": list(vecs.shape)}

    return {"run": run, "lat": lat, "dump": dump}


# ------------------------------------------------------------------ engine


def engine_serve(args) -> None:
    sys.path.insert(0, str(ROOT / "python"))
    import mlx_embed  # before anything imports mlx.core (BLAS binding)

    model = mlx_embed.load(args.model)
    if model.model_type not in ("model2vec", "static_embedding"):
        raise SystemExit(f"{args.model}: loaded as {model.model_type}, not a static model")
    small = mlx_embed.load(args.model, batch_tokens=256)
    texts = corpus(args.corpus, args.texts)
    runs = {"default": lambda: model.embed(texts), "bt256": lambda: small.embed(texts)}
    if args.engine_calls:
        n = args.engine_calls
        runs[f"calls{n}"] = lambda: [v for i in range(0, len(texts), n) for v in model.embed(texts[i : i + n])]
    for m in (model, small):
        m.embed(texts[:256])
        for _ in range(5):
            m.embed([LATENCY_TEXT])
    lengths = model.count_tokens(texts)
    info = model.info()
    meta = {"name": f"mlx_embed {mlx_embed.__version__}", "model_type": model.model_type,
            "blas": info["blas"], "workers": info["workers"], "device_batch_tokens": info["device_batch_tokens"],
            "bt256_device_batch_tokens": small.batch_tokens, "dim": model.dim, "max_length": model.max_length,
            "texts": len(texts), "tokens": sum(lengths), "tokens_max": max(lengths),
            "latency_tokens": model.count_tokens([LATENCY_TEXT])[0],
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}
    handlers = _handlers(runs, lambda t: model.embed([t]))
    handlers["profile"] = lambda reps: engine_profile(model, texts, int(reps))
    _serve(handlers, meta)


def engine_profile(model, texts: list[str], reps: int) -> dict:
    """Where one ``embed(corpus)`` goes: the tokenizer step as the engine runs
    it (``model.encode``: the HF tokenizer's ``encode_batch_fast`` without
    specials, the character cut and [UNK] drop for Model2Vec), the
    scheduler's passes on those ids (gather, mean, and the
    padding and copies around them), and the whole call; best of ``reps``.
    Also the bare tokenizer calls, for scale: ``encode_batch_fast`` and
    ``encode_batch`` (character offsets too) on the same texts."""
    tok = model.tokenizer._tok
    ids, _ = model.encode(texts)
    secs = {
        "tokenize (model.encode)": _best(lambda: model.encode(texts), reps),
        "passes (scheduler.run on the ids)": _best(lambda: model.scheduler.run(ids), reps),
    }
    whole = _best(lambda: model.embed(texts), reps)
    bare = {"encode_batch_fast": _best(lambda: tok.encode_batch_fast(texts, add_special_tokens=False), reps),
            "encode_batch": _best(lambda: tok.encode_batch(texts, add_special_tokens=False), reps)}
    one = {"tokenize": _best(lambda: model.encode([LATENCY_TEXT]), 20),
           "passes": _best(lambda: model.scheduler.run(model.encode([LATENCY_TEXT])[0]), 20),
           "embed call": _best(lambda: model.embed([LATENCY_TEXT]), 20)}
    return {"seconds": secs, "whole_call": whole, "bare_tokenizer": bare, "one_text_best": one,
            "sub_batches": len(model.scheduler.plan(__import__("numpy").array([len(x) for x in ids])))}


# -------------------------------------------------------------------- peers


def m2v_serve(args) -> None:
    """model2vec's StaticModel (NumPy); run with the peer's interpreter."""
    try:
        import model2vec
        from model2vec import StaticModel
    except ImportError:
        raise SystemExit(M2V_INSTALL)
    model = StaticModel.from_pretrained(args.model)
    texts = corpus(args.corpus, args.texts)
    model.encode(texts[:256])
    for _ in range(3):
        model.encode([LATENCY_TEXT])
    tokens = sum(len(x) for x in model.tokenize([t[: model.max_length * model.median_token_length]
                                                  for t in texts]))
    meta = {"name": f"model2vec {model2vec.__version__}", "model2vec": model2vec.__version__,
            "max_length": model.max_length, "normalize": model.normalize,
            "median_token_length": model.median_token_length, "texts": len(texts), "tokens": tokens,
            "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}
    handlers = _handlers({"default": lambda: model.encode(texts)}, lambda t: model.encode([t]))

    def profile(reps):
        reps = int(reps)
        cut = [t[: model.max_length * model.median_token_length] for t in texts]
        return {"seconds": {"tokenize (StaticModel.tokenize)": _best(lambda: model.tokenize(cut), reps)},
                "whole_call": _best(lambda: model.encode(texts), reps)}

    handlers["profile"] = profile
    _serve(handlers, meta)


def st_serve(args) -> None:
    """sentence-transformers (torch CPU); run with the peer's interpreter."""
    import torch

    torch.set_num_threads(args.peer_threads)
    import warnings

    warnings.filterwarnings("ignore")
    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(args.model, device="cpu")
    if type(st[0]).__name__ != "StaticEmbedding":
        raise SystemExit(f"sentence-transformers loads {args.model}'s first module as {type(st[0]).__name__}")
    texts = corpus(args.corpus, args.texts)
    runs = {}
    for bs in args.st_batch_sizes:
        runs[f"bs{bs}"] = (lambda b: lambda: st.encode(texts, batch_size=b, convert_to_numpy=True))(bs)
        st.encode(texts[:256], batch_size=bs)
    for _ in range(3):
        st.encode([LATENCY_TEXT])
    tokens = sum(len(e.ids) for e in st[0].tokenizer.encode_batch(texts, add_special_tokens=False))
    meta = {"name": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}, "
                    f"threads {args.peer_threads}",
            "sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__,
            "threads": args.peer_threads, "modules": [type(m).__name__ for m in st], "texts": len(texts),
            "tokens": tokens, "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}
    handlers = _handlers(runs, lambda t: st.encode([t]))

    def profile(reps):
        reps, bs = int(reps), args.st_batch_sizes[0]
        # ST's batches: it sorts the corpus by length, then tokenizes each
        # batch with StaticEmbedding.preprocess (encode_batch, offsets kept).
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        batches = [[texts[j] for j in order[i : i + bs]] for i in range(0, len(order), bs)]
        return {"seconds": {f"tokenize (StaticEmbedding.preprocess, batches of {bs})":
                            _best(lambda: [st[0].preprocess(b) for b in batches], reps)},
                "whole_call": _best(lambda: st.encode(texts, batch_size=bs), reps)}

    handlers["profile"] = profile
    _serve(handlers, meta)


# ------------------------------------------------------------------ server


class Server:
    """The real server binary on a free loopback port."""

    def __init__(self, folder: Path, log_path: Path, extra: list[str]):
        if not SERVER.exists():
            raise SystemExit(f"{SERVER} is missing: run `make build` (or pass --no-server)")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, **VENV_ENV, "MLX_EMBED_LOG": "warn"}
        self.args = ["--model", str(folder), "--no-cache", *extra]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([str(SERVER), "--host", "127.0.0.1", "--port", str(self.port), *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited during startup:\n{log_path.read_text()[-3000:]}")
            try:
                if self.get("/health").status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit("server not healthy after 180 s")

    def get(self, path: str):
        return urllib.request.urlopen(self.url + path, timeout=10)

    def info(self) -> dict:
        return json.loads(self.get("/info").read())

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.get("/metrics").read().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def server_pass(server: Server, bodies_path: Path, n_bodies: int, n_texts: int, args, keep: int = 0) -> dict:
    """The corpus once through /v1/embeddings (scripts/http_load.py in its own
    process); texts/s over the span from the first request to the last answer."""
    before = server.metrics()
    try:
        out = http_load.run_in_child(server.url + "/v1/embeddings", bodies_path, args.connections, 1,
                                     args.server_deadline_s, keep)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
    after = server.metrics()
    if out["statuses"] != {"200": n_bodies} or out["errors"]:
        print(f"# server pass incomplete: {out['statuses']}, errors {out['errors']} "
              f"(--server-deadline-s {args.server_deadline_s})", file=sys.stderr)
    answered = min(n_texts, out["statuses"].get("200", 0) * args.per_request)
    out["texts"] = answered
    out["texts_per_s"] = answered / out["seconds"]

    def delta(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    out["model_seconds"] = delta("mlx_embed_model_seconds_sum")
    out["batches"] = delta("mlx_embed_batches_total")
    out["real_tokens"] = delta("mlx_embed_real_tokens_total")
    out["padded_tokens"] = delta("mlx_embed_padded_tokens_total")
    return out


def server_latency(server: Server, calls: int) -> list[float]:
    """One short text per request, back to back on one keep-alive connection."""
    body = json.dumps({"input": LATENCY_TEXT, "encoding_format": "base64"}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    out = []
    try:
        for _ in range(calls):
            t0 = time.perf_counter()
            conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            out.append(time.perf_counter() - t0)
            if resp.status != 200:
                raise SystemExit(f"server answered {resp.status} to the latency request")
    finally:
        conn.close()
    return out


# -------------------------------------------------------------------- main


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


def compare(a, b) -> dict:
    """Min cosine (two zero rows agree, a zero row against a non-zero one is
    0) and max |diff| of the rows as given."""
    import numpy as np

    a, b = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    cos = np.where(both_zero, 1.0, (a * b).sum(1) / np.maximum(na * nb, 1e-30))
    return {"texts": len(a), "min_cosine": float(cos.min()), "max_abs_diff": float(np.abs(a - b).max()),
            "zero_rows": int(both_zero.sum())}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def side_by_side(args) -> int:
    import numpy as np

    shape = SHAPES[args.shape]
    folder = build_checkpoint(args.shape)
    common = ["--model", str(folder), "--texts", str(args.texts), "--corpus", args.corpus]
    commands = {"mlx_embed": [sys.executable, __file__, "--engine-serve", *common,
                              "--engine-calls", str(args.engine_calls)]}
    if args.peer_python and not args.no_peer:
        if shape["format"] == "model2vec" and "m2v" in args.peers:
            commands["model2vec"] = [args.peer_python, __file__, "--m2v-serve", *common]
        if "st" in args.peers:
            commands["st"] = [args.peer_python, __file__, "--st-serve", *common, "--peer-threads",
                              str(args.peer_threads), "--st-batch-sizes", ",".join(map(str, args.st_batch_sizes))]
    # The format's own library: the parity that must hold.
    reference = "model2vec" if shape["format"] == "model2vec" else "st"
    t_start = time.time()
    procs, meta, ask = _start(commands)
    texts = corpus(args.corpus, args.texts)
    tmp = Path(tempfile.mkdtemp(prefix="bench-static-"))
    server = None
    bodies_path = tmp / "bodies.jsonl"
    bodies = [json.dumps({"input": texts[i : i + args.per_request], "encoding_format": "base64"})
              for i in range(0, len(texts), args.per_request)]
    bodies_path.write_text("\n".join(bodies) + "\n")
    if not args.no_server:
        server = Server(folder, tmp / "server.log", [])
        info = server.info()
        meta["server"] = {"name": f"mlx-embed-server {info.get('version', '')}".strip(),
                          "batching": info.get("batching"), "args": server.args,
                          "connections": args.connections, "per_request": args.per_request}
        server_pass(server, bodies_path, len(bodies), len(texts), args)  # warm-up, untimed
        server_latency(server, 5)

    # Columns: (process, label); "server" is the HTTP pass.
    cols = [("mlx_embed", "default"), ("mlx_embed", "bt256")]
    if args.engine_calls:
        cols.append(("mlx_embed", f"calls{args.engine_calls}"))
    if server:
        cols.append(("server", f"{args.per_request}x{args.connections}"))
    if "model2vec" in procs:
        cols.append(("model2vec", "default"))
    if "st" in procs:
        cols += [("st", f"bs{bs}") for bs in args.st_batch_sizes]
    times: dict = {f"{k} {label}": [] for k, label in cols}
    latency: dict = {k: [] for k in [*procs, *(["server"] if server else [])]}
    server_runs: list = []
    load0 = os.getloadavg()
    t_bench = time.time()
    rounds_done = 0
    for rnd in range(args.rounds):
        if args.deadline_s and rnd and time.time() - t_bench > args.deadline_s:
            print(f"# --deadline-s {args.deadline_s} passed: stopping after {rnd} rounds", file=sys.stderr)
            break
        # One call at a time, alternating, so all see the same moments.
        for _ in range(args.latency_calls):
            for k in procs:
                latency[k] += ask(k, "lat", 1)["seconds"]
            if server:
                latency["server"] += server_latency(server, 1)
        for k, label in cols:
            if k == "server":
                got = server_pass(server, bodies_path, len(bodies), len(texts), args)
                server_runs.append({x: got[x] for x in ("seconds", "texts", "texts_per_s", "latency_ms",
                                                        "model_seconds", "batches", "real_tokens",
                                                        "padded_tokens")})
                times[f"{k} {label}"].append(got["seconds"] * len(texts) / max(got["texts"], 1))
            else:
                times[f"{k} {label}"].append(ask(k, "run", label)["seconds"])
        rounds_done += 1
        print(f"# round {rnd + 1}: " + ", ".join(f"{c} {v[-1]:.3f} s" for c, v in times.items()), file=sys.stderr)
    load1 = os.getloadavg()

    parity: dict = {}
    ask("mlx_embed", "dump", "default", tmp / "engine.npy")
    eng = np.load(tmp / "engine.npy")
    for k in procs:
        if k == "mlx_embed":
            continue
        label = "default" if k == "model2vec" else f"bs{args.st_batch_sizes[0]}"
        ask(k, "dump", label, tmp / f"{k}.npy")
        parity[k] = compare(eng, np.load(tmp / f"{k}.npy"))
        parity[k]["enforced"] = k == reference
    if server:
        got = server_pass(server, bodies_path, len(bodies), len(texts), args, keep=len(bodies))
        parity["server"] = compare(eng, http_load.answered_vectors(got["answers"], args.per_request, len(texts)))
        parity["server"]["enforced"] = True
    profiles = {}
    if args.profile:
        for k in procs:
            profiles[k] = ask(k, "profile", args.profile_repeats)
    if server:
        meta["server"]["exit_code"] = server.stop()
    for pr in procs.values():
        pr.stdin.write("quit\n")
        pr.stdin.close()
        pr.wait()
    shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------ report
    em = meta["mlx_embed"]
    n_texts, n_tokens = em["texts"], em["tokens"]
    vers = versions()
    names = {"mlx_embed": "mlx_embed", "server": "mlx-embed-server (HTTP)",
             **{k: meta[k]["name"] for k in procs if k != "mlx_embed"}}
    print(f"# {json.dumps(vers)}")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"# checkpoint: .bench/static-{args.shape} {json.dumps(shape)}")
    for k, m in meta.items():
        print(f"# {k}: {json.dumps(m)}")
    print(f"# {rounds_done} interleaved rounds, medians; {time.time() - t_start:.0f} s in all; "
          f"load average (1/5/15 min) before {_load(load0)}, after {_load(load1)}")
    print(f"\n## {args.corpus} corpus: {n_texts} texts, {n_tokens} tokens averaged by the engine "
          f"({n_tokens / n_texts:.1f} per text, longest {em['tokens_max']})")
    print()
    print("| system | call | texts/s | tokens/s | s per pass (median) |")
    print("|---|---|---:|---:|---:|")
    tps = {}
    for k, label in cols:
        med = statistics.median(times[f"{k} {label}"])
        tps[f"{k} {label}"] = n_texts / med
        print(f"| {names[k]} | {label} | {n_texts / med:.0f} | {n_tokens / med:.0f} | {med:.3f} |")
    summary: dict = {"texts_per_s": tps, "engine": tps["mlx_embed default"]}
    ratios = {}
    for c in tps:
        if not c.startswith("mlx_embed "):
            ratios[f"engine / {c}"] = tps["mlx_embed default"] / tps[c]
    # The same ratios within each round (passes of one round ran back to
    # back): steadier than ratios of medians under load.
    per_round = {c: [times[c][r] / times["mlx_embed default"][r] for r in range(rounds_done)]
                 for c in times if c != "mlx_embed default"}
    summary["ratios"] = ratios
    summary["ratio_per_round_median"] = {f"engine / {c}": statistics.median(v) for c, v in per_round.items() if v}
    if ratios:
        print("\nengine (default call) relative to each: " + ", ".join(
            f"{c}: {r:.2f}x (per round median {summary['ratio_per_round_median'][k]:.2f}x)"
            for k, r in ratios.items() for c in [k.split(' / ', 1)[1]]))
    if server_runs:
        ms = statistics.median(r["model_seconds"] / r["seconds"] for r in server_runs)
        summary["server_model_share"] = ms
        summary["server_batches_per_pass"] = statistics.median(r["batches"] for r in server_runs)
        print(f"server: model calls busy {100 * ms:.0f}% of each pass's span (mlx_embed_model_seconds), "
              f"{summary['server_batches_per_pass']:.0f} batches per pass; request latency under load "
              f"p50 {statistics.median(r['latency_ms']['p50'] for r in server_runs):.1f} ms, "
              f"p99 {statistics.median(r['latency_ms']['p99'] for r in server_runs):.1f} ms")
    if args.latency_calls:
        lat = {k: {"median_ms": statistics.median(v) * 1e3, "p99_ms": pct(v, 0.99) * 1e3, "min_ms": min(v) * 1e3,
                   "calls": len(v)} for k, v in latency.items() if v}
        summary["latency_ms"] = {k: v["median_ms"] for k, v in lat.items()}
        summary["latency"] = lat
        print(f"\n## one short text per call ({em['latency_tokens']} tokens: {LATENCY_TEXT!r}), alternating; "
              "the server's over HTTP, one connection")
        print()
        print("| | " + " | ".join(names[k] for k in lat) + " |")
        print("|---|" + "---:|" * len(lat))
        for q in ("median_ms", "p99_ms", "min_ms"):
            print(f"| {q.replace('_ms', '')} ms | " + " | ".join(f"{v[q]:.3f}" for v in lat.values()) + " |")
    if parity:
        summary["parity"] = parity
        print(f"\n## parity on the {n_texts} timed texts (engine vectors against each; "
              f"enforced: min cosine >= {args.min_cosine})")
        for k, p in parity.items():
            print(f"- {names[k]}: min cosine {p['min_cosine']:.8f}, max |diff| {p['max_abs_diff']:.2e}"
                  f"{'' if p['enforced'] else ' (informative: not this format library)'}")
    for k, p in profiles.items():
        print(f"\n## where {names[k]}'s time goes (best of {args.profile_repeats}, the whole corpus)")
        print()
        print("| step | s | share of the whole call |")
        print("|---|---:|---:|")
        for name, s in p["seconds"].items():
            print(f"| {name} | {s:.3f} | {100 * s / p['whole_call']:.0f}% |")
        print(f"| whole call | {p['whole_call']:.3f} | |")
        if "bare_tokenizer" in p:
            print("\nbare tokenizer on the same texts: " + ", ".join(
                f"{n} {s:.3f} s" for n, s in p["bare_tokenizer"].items())
                  + f"; {p['sub_batches']} sub-batches; one short text (best of 20): "
                  + ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in p["one_text_best"].items()))
    if args.json:
        label = f"{args.shape} {args.corpus} {n_texts}"
        result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(["python", *sys.argv]),
                  "shape": {"name": args.shape, **shape}, "corpus": args.corpus, "versions": vers,
                  "cpu_count": os.cpu_count(), "meta": meta, "rounds": rounds_done, "times": times,
                  "server_runs": server_runs, "latency": latency, "load": [load0, load1],
                  "profiles": profiles, "summary": summary}
        path = Path(args.json)
        doc = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(doc.get("runs"), dict):
            doc = {"runs": {}}
        doc["runs"][label] = result
        path.write_text(json.dumps(doc, indent=1) + "\n")
    bad = {k: p["min_cosine"] for k, p in parity.items() if p["enforced"] and p["min_cosine"] < args.min_cosine}
    if bad:
        print(f"FAIL: min cosine below {args.min_cosine}: {bad}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), help="checkpoint shape (default potion; tiny with --dry-run)")
    p.add_argument("--texts", type=int, help="texts in the corpus (default 4000; 64 with --dry-run)")
    p.add_argument("--corpus", choices=("mixed", "short"), default="mixed",
                   help="mixed: bench_model.py's mixed-length corpus (~100 tokens/text); "
                        "short: the load test's 672 sentences (~20 tokens), repeated up to --texts")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 7; 1 with --dry-run)")
    p.add_argument("--st-batch-sizes", help="sentence-transformers encode batch sizes (default 32,1024: "
                                            "its default and model2vec's)")
    p.add_argument("--engine-calls", type=int, default=0,
                   help="also time the engine in calls of this many texts (0: no; e.g. 32)")
    p.add_argument("--latency-calls", type=int, help="one-short-text calls per system per round "
                                                     "(default 200 / rounds; 5 with --dry-run)")
    p.add_argument("--per-request", type=int, default=32, help="texts per server request (default 32)")
    p.add_argument("--connections", type=int, default=4, help="concurrent server connections (default 4)")
    p.add_argument("--server-deadline-s", type=float, default=60.0,
                   help="longest one server pass may take (the rest of it is not sent)")
    p.add_argument("--no-server", action="store_true", help="skip the server binary")
    default_peer = ROOT / ".bench-venv" / "bin" / "python"
    p.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None,
                   help="interpreter with model2vec and sentence-transformers (default .bench-venv/bin/python)")
    p.add_argument("--peers", default="m2v,st", help="which peers: m2v, st (default both)")
    p.add_argument("--peer-threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--no-peer", action="store_true", help="no peers, no peer parity")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the time breakdown")
    p.add_argument("--profile-repeats", type=int, default=3, help="best of this many per step")
    p.add_argument("--min-cosine", type=float, default=0.9999, help="parity threshold (exit 1 below it)")
    p.add_argument("--deadline-s", type=float, help="start no new round after this many seconds of timing")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, 64 texts, 1 round: a smoke test")
    p.add_argument("--json", help="merge the results into this file's \"runs\" (keyed shape, corpus, texts)")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--engine-serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--m2v-serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--st-serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    dry = args.dry_run
    args.shape = args.shape or ("tiny" if dry else "potion")
    args.texts = args.texts or (64 if dry else 4000)
    args.rounds = args.rounds or (1 if dry else 7)
    args.st_batch_sizes = [int(x) for x in (args.st_batch_sizes or "32,1024").split(",")]
    args.peers = set(args.peers.split(","))
    if args.latency_calls is None:
        args.latency_calls = 5 if dry else max(1, -(-200 // args.rounds))
    if dry:
        args.profile_repeats = 1
        args.server_deadline_s = min(args.server_deadline_s, 30.0)
    if args.engine_serve:
        engine_serve(args)
        return 0
    if args.m2v_serve:
        m2v_serve(args)
        return 0
    if args.st_serve:
        st_serve(args)
        return 0
    if not args.no_peer and not args.peer_python:
        print("# peers skipped: no .bench-venv and no --peer-python", file=sys.stderr)
    if not args.no_peer and args.peer_python and "m2v" in args.peers:
        r = subprocess.run([args.peer_python, "-c", "import model2vec"], capture_output=True)
        if r.returncode != 0:
            raise SystemExit(M2V_INSTALL)
    return side_by_side(args)


if __name__ == "__main__":
    raise SystemExit(main())
