"""The real server binary's log at debug level: what clients send (a model
name, a path, a value serde quotes back) is escaped, never a line of its
own that reads as the server's; and a model name answered by the one model
that can do the job is warned about once per name, not on every request."""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest

from harness import FIXTURES, NOMIC, start_server

RERANKER = FIXTURES / "tiny-bert-reranker"
FORGED = "2026-11-29T17:30:00.000000Z  INFO request{id=1}: request done status=200"
ANOTHER = "request names another model; serving ours"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An embedder beside a reranker: a name neither has is answered by the
    embedder on the embedding routes, and is a 404 where both could answer."""
    srv = start_server(tmp_path_factory.mktemp("log-lines"), "--model", str(NOMIC), "--rerank-model",
                       str(RERANKER), "--no-warmup", env={"MLX_EMBED_LOG": "debug"})
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def log_lines(server) -> list[str]:
    return re.sub(r"\x1b\[[0-9;]*m", "", server.log()).splitlines()


def test_client_values_with_newlines_stay_inside_their_log_line(server):
    # Served (the embedder answers any name), warned about.
    r = server.post("/v1/embeddings", {"model": f"x\n{FORGED}", "input": "hi"})
    assert r.status_code == 200, r.text
    # Refused, at debug, with reasons that quote the name or the value.
    r = server.get("/v1/models/a%0A" + quote(FORGED, safe=""))
    assert r.status_code == 404, r.text
    r = server.get("/v1/models/b%0D%0A" + quote(FORGED, safe=""))
    assert r.status_code == 404, r.text
    r = server.post("/v2/embed", {"texts": ["hi"], "input_type": f"zz\n{FORGED}",
                                  "embedding_types": ["float"]})
    assert r.status_code in (400, 422), r.text
    assert "unknown variant" in r.text
    lines = log_lines(server)
    assert not [line for line in lines if line.startswith(FORGED)]
    assert not [line for line in lines if "\r" in line]
    refused = [line for line in lines if "request refused:" in line and FORGED in line]
    assert len(refused) == 3, "\n".join(lines[-20:])
    assert all("\\n" + FORGED in line for line in refused), refused


def test_an_unknown_model_name_is_warned_about_once_per_name(server):
    for _ in range(5):
        assert server.post("/v1/embeddings", {"model": "m1", "input": "hi"}).status_code == 200
    for _ in range(3):
        assert server.post("/api/embed", {"model": "m2", "input": "hi"}).status_code == 200
    assert server.post("/v1/embeddings", {"model": "m1", "input": "hi"}).status_code == 200
    lines = [line for line in log_lines(server) if ANOTHER in line]
    for name, times in (("m1", 6), ("m2", 3)):
        named = [line for line in lines if f'requested="{name}"' in line]
        assert [" WARN " in line for line in named] == [True] + [False] * (times - 1), named
        assert all(" DEBUG " in line for line in named[1:]), named
