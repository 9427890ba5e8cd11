"""Server vs library, bit for bit: the real server binary's vectors for the
golden texts against ``mlx_embed.load(folder).embed(...)``'s.

For each model (the default one and tiny fixtures of last-token, CLS and mean
pooling), the 39 non-empty texts of tests/fixtures/golden/minilm_texts.json go
through TEI's ``/embed`` and OpenAI's ``/v1/embeddings`` (float and base64),
normalized and not, cut to ``dimensions`` (against the library's unnormalized
rows cut and normalized by ``mlx_embed.pooling.unit_rows``) and a second time
(answered from the cache); then, on a server without the cache, one text per
request, against the library's one call and its calls of one text each.
Prints, per case, how many floats differ from the library's and the largest
difference in float32 ulps; exits 1 if any differs but the one-text requests
against the library's one call (batch composition: see
docs/architecture.md, "Same bits").

    VIRTUAL_ENV=<venv> <venv>/bin/python scripts/server_library_bits.py \
        [--server target/release/mlx-embed-server] [FOLDER ...]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
MODELS = [
    "all-MiniLM-L6-v2",
    str(FIXTURES / "tiny-qwen3"),
    str(FIXTURES / "tiny-modernbert"),
    str(FIXTURES / "tiny-xlm-roberta"),
]
CUT = 16


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance between same-position floats, in float32 ulps (the
    integers of their ordered bit patterns)."""

    def ordered(x):
        i = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return int(np.abs(ordered(a) - ordered(b)).max(initial=0))


def start(server: str, model: str, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [server, "--host", "127.0.0.1", "--port", str(port), "--no-warmup", *extra]
    if model != "all-MiniLM-L6-v2":
        args += ["--model", model]
    proc = subprocess.Popen(
        args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "VIRTUAL_ENV": sys.prefix}, cwd=ROOT
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(900):
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not healthy after 180 s")


def _tei(url: str, body: dict) -> np.ndarray:
    r = requests.post(url + "/embed", json=body, timeout=120)
    r.raise_for_status()
    return np.asarray(r.json(), dtype=np.float32)


def cases(url: str, texts: list[str]):
    """(case, the server's rows, what the library side is: normalize, cut)."""

    def openai(body, b64=False):
        r = requests.post(
            url + "/v1/embeddings", json={**body, "encoding_format": "base64" if b64 else "float"}, timeout=120
        )
        r.raise_for_status()
        data = sorted(r.json()["data"], key=lambda d: d["index"])
        if b64:
            return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
        return np.asarray([d["embedding"] for d in data], dtype=np.float32)

    yield "/embed", _tei(url, {"inputs": texts}), (True, None)
    yield "/embed again (cache)", _tei(url, {"inputs": texts}), (True, None)
    yield "/embed normalize false", _tei(url, {"inputs": texts, "normalize": False}), (False, None)
    yield "/v1/embeddings float", openai({"input": texts}), (True, None)
    yield "/v1/embeddings base64", openai({"input": texts}, b64=True), (True, None)
    yield f"/v1/embeddings dimensions {CUT}", openai({"input": texts, "dimensions": CUT}), (True, CUT)
    yield f"/v1/embeddings dimensions {CUT} base64", openai({"input": texts, "dimensions": CUT}, b64=True), (True, CUT)


def alone_cases(url: str, texts: list[str]):
    """Batch composition, on a server without the cache: each text in a
    request of its own, against the library's one call (all texts) and its
    calls of one text each."""
    alone = np.concatenate([_tei(url, {"inputs": [t]}) for t in texts])
    yield "/embed one text per request (no cache)", alone, (True, None)
    yield "  the same vs library one text per call", alone, "alone"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default=str(ROOT / "target" / "release" / "mlx-embed-server"))
    parser.add_argument("models", nargs="*", default=MODELS)
    args = parser.parse_args()
    import mlx_embed
    from mlx_embed import pooling

    texts = [t for t in json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text()) if t]
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            lib = mlx_embed.load(model)
            raw = lib.embed(texts, normalize=False)
            want = {
                (True, None): lib.embed(texts),
                (False, None): raw,
                (True, CUT): pooling.unit_rows(raw[:, :CUT]),
                "alone": np.concatenate([lib.embed([t]) for t in texts]),
            }
            print(f"{Path(model).name}:")
            for extra, table in (((), cases), (("--no-cache",), alone_cases)):
                proc, url = start(args.server, model, Path(tmp) / "server.log", *extra)
                try:
                    for name, got, side in table(url, texts):
                        ref = want[side]
                        differ = int((got != ref).sum()) if got.shape == ref.shape else -1
                        if table is cases:
                            worst = max(worst, differ)
                        print(
                            f"  {name:40s} {differ:6d} of {ref.size} floats differ, max {ulps(got, ref)} ulp, "
                            f"max |diff| {float(np.abs(got - ref).max(initial=0)):.1e}"
                        )
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=60)
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
