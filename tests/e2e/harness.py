"""Start the real server binary on a free loopback port and talk HTTP to it.

A module of its own, not conftest.py: tests/python has a conftest too, and
`from conftest import` would pick whichever pytest loaded last."""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SERVER_BINARY = ROOT / "target" / "release" / "mlx-embed-server"
# The same server with the test hooks (MLX_EMBED_TEST_FAULT / MLX_EMBED_TEST_KILL);
# built by `make build` with the launcher's `test-hooks` feature, never shipped.
TEST_SERVER_BINARY = ROOT / "target" / "release" / "mlx-embed-server-test"
STARTUP_TIMEOUT_S = 180
NOMIC = FIXTURES / "tiny-nomic-bert"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body, **kwargs) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=kwargs.pop("timeout", 60), **kwargs)

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=kwargs.pop("timeout", 30), **kwargs)

    def healthy(self) -> bool:
        try:
            return self.get("/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# Every server started, so the session can stop those a failing test left
# running (an assertion before `server.stop()` skips it).
STARTED: list[Server] = []


def stop_leftovers() -> None:
    for server in STARTED:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def start_server(tmp_path: Path, *args: str, env: dict | None = None, command: list[str] | None = None,
                 host: str | None = "127.0.0.1") -> Server:
    """Starts the server and waits until /health answers 200.

    host=None leaves out --host (and MLX_EMBED_HOST), to test the default listen address."""
    if command is None:
        command = [str(SERVER_BINARY)]
    if not Path(command[0]).exists() and command[0] in (str(SERVER_BINARY), str(TEST_SERVER_BINARY)):
        pytest.fail(f"{command[0]} is missing: run `make build` (make test does)")
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    full_env = {**os.environ, "VIRTUAL_ENV": sys.prefix, "MLX_EMBED_LOG": "info", **(env or {})}
    if host is None:
        full_env.pop("MLX_EMBED_HOST", None)
    host_args = [] if host is None else ["--host", host]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, *host_args, "--port", str(port), *args],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
        )
    server = Server(proc=proc, url=f"http://127.0.0.1:{port}", log_path=log_path, args=list(args))
    STARTED.append(server)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during startup:\n{server.log()[-4000:]}")
        if server.healthy():
            return server
        time.sleep(0.2)
    server.stop()
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


def non_empty_golden(golden, n: int):
    """The first ``n`` golden texts every route takes (an empty string is a
    400), their references and their positions in the golden set."""
    texts, ref = golden
    idx = [i for i, t in enumerate(texts) if t][:n]
    return [texts[i] for i in idx], ref[idx], idx


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def assert_logits_close(got, ref) -> None:
    """Raw reranker logits to rtol 1e-5 and an absolute 1e-5 that grows with
    the largest logit (2e-6 of it): a logit near zero carries the float32
    rounding of a network whose other logits reach +-12, and that rounding
    follows the CPU's BLAS kernel."""
    ref = np.asarray(ref)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6 * max(5.0, float(np.abs(ref).max())))



def instruction_taking(engine, n: int) -> str:
    """An instruction with which a template reranker ``engine``'s empty pair
    is ``n`` tokens before any cut: ``max_length - 1`` leaves a document one
    token, ``max_length`` none (the library refuses it, saying how many
    tokens the prompt takes of the room)."""
    import re

    from mlx_embed.errors import InvalidInput

    for k in range(2 * engine.max_length):
        for tail in ("", "a", "ab", "x y"):
            instruction = "find " * k + tail
            try:
                (_, _, (size,)) = engine.encode_pairs([("", "")], instruction=instruction)
            except InvalidInput as e:
                used, room = map(int, re.search(r"takes (\d+) of the (\d+) tokens", str(e)).groups())
                size = engine.max_length + used - room
            if size == n:
                return instruction
    raise AssertionError(f"no instruction of {n} tokens")


def assert_template_instruction_limit(server, model: str, engine) -> None:
    """A template reranker (``model`` served, ``engine`` its library model)
    refuses an instruction that leaves a document no room, naming
    `instruction`, with the library's message (every document was cut away
    whole and all scored alike, answered 200); one a token short of that
    still answers the library's scores, and one with room to spare reads
    the documents."""
    from mlx_embed.errors import InvalidInput

    docs = ["Rivers flow into the sea.", "Bread is baked in ovens."]
    over = instruction_taking(engine, engine.max_length)
    with pytest.raises(InvalidInput) as refused:
        engine.score([("q", d) for d in docs], instruction=over)
    message = str(refused.value)
    assert message.startswith("the instruction leaves the documents no room within max_length "), message
    for extra in ({}, {"max_chunks_per_doc": 2}):
        r = server.post("/v1/rerank", {"model": model, "query": "q", "documents": docs, "instruction": over, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "instruction" and r.json()["error"]["message"] == message, r.text
    r = server.post("/rerank", {"model": model, "query": "q", "texts": docs, "instruction": over})
    assert r.status_code == 400 and r.json()["error"] == message, r.text
    for size in (engine.max_length - 1, engine.max_length - 12):
        instruction = instruction_taking(engine, size)
        r = server.post("/rerank", {"model": model, "query": "q", "texts": docs, "raw_scores": True,
                                    "instruction": instruction})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["score"] for x in r.json()}
        want = engine.score([("q", d) for d in docs], raw_scores=True, instruction=instruction)[:, 0]
        np.testing.assert_allclose([got[0], got[1]], want, rtol=0, atol=1e-5)
    assert abs(got[0] - got[1]) > 1e-4, got


@contextlib.contextmanager
def grpc_modules(out: Path, proto: str, *include: Path) -> Iterator[tuple]:
    """(messages, stubs) of `proto` (found in `include` or `out`), generated by
    grpcio-tools into `out` and importable while the context lasts."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(str(importlib.resources.files(grpc_tools) / "_proto"))
    dirs = [*include, out, well_known]
    rc = protoc.main(["protoc", *(f"-I{d}" for d in dirs), f"--python_out={out}", f"--grpc_python_out={out}", proto])
    assert rc == 0, f"protoc failed on {proto}"
    stem = Path(proto).stem
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module(f"{stem}_pb2"), importlib.import_module(f"{stem}_pb2_grpc")
    finally:
        sys.path.remove(str(out))
