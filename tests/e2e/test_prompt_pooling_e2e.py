"""A model that pools without its prompt (sentence-transformers' Pooling
``include_prompt: false``) through the real server: each input's prompt
positions cross the Rust/Python seam with its ids, on every embed route, and
the cache keeps such vectors apart from the same ids pooled whole."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from harness import FIXTURES, cosine_rows, start_server

CASES = FIXTURES / "prompt-pooling"
CASE = next(c for c in json.loads((CASES / "cases.json").read_text())["cases"] if c["name"] == "minilm-mean")
QUERY = CASE["prompts"]["query"]


@pytest.fixture(scope="module")
def golden_texts():
    return json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """MiniLM with include_prompt false and the case's prompts (the folder
    tests/python/test_prompt_pooling.py checks against sentence-transformers)."""
    from mlx_embed.loading import default_model_path

    source = default_model_path()
    folder = tmp_path_factory.mktemp("prompt-pooling") / "minilm-prompt-out"
    folder.mkdir()
    for name in os.listdir(source):
        if name not in ("1_Pooling", "config_sentence_transformers.json"):
            os.symlink(os.path.join(source, name), folder / name)
    shutil.copytree(os.path.join(source, "1_Pooling"), folder / "1_Pooling")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(CASE["pooling"]))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": CASE["prompts"]}))
    server = start_server(tmp_path_factory.mktemp("srv"), "--model", str(folder), "--no-warmup")
    yield server
    assert server.stop() == 0, server.log()[-3000:]


def _vectors(resp, extract) -> np.ndarray:
    assert resp.status_code == 200, resp.text[:500]
    return np.asarray(extract(resp.json()), dtype=np.float32)


def _openai(r):
    return [d["embedding"] for d in sorted(r["data"], key=lambda d: d["index"])]


def test_every_embed_route_matches_sentence_transformers(srv, golden_texts):
    keep = [i for i, t in enumerate(golden_texts) if t]
    texts = [golden_texts[i] for i in keep]
    for call in CASE["calls"]:
        ref = np.load(CASES / call["reference"])[keep]
        kw = {k: call[k] for k in ("prompt", "prompt_name") if k in call}
        bodies = {"/api/v1/embed": ({"texts": texts, **kw}, lambda r: r["embeddings"])}
        if "prompt" not in kw:
            # TEI's and OpenAI's bodies name prompts; a raw one is the native route's.
            bodies["/embed"] = ({"inputs": texts, **kw}, lambda r: r)
            bodies["/v1/embeddings"] = ({"input": texts, **kw}, _openai)
        for path, (body, extract) in bodies.items():
            got = _vectors(srv.post(path, body), extract)
            label = f"{path} {call['reference']}"
            assert cosine_rows(got, ref).min() >= 0.99999, label
            assert np.abs(got - ref).max() <= 1e-5, label


def test_info_says_the_prompt_is_left_out(srv):
    info = srv.get("/info").json()
    assert json.dumps(info).count('"include_prompt": "false"') >= 1, info


def test_the_cache_keeps_prompt_pooling_apart_from_the_same_ids(srv):
    """The text under its prompt and the same ids sent as token ids are the
    same cache key but for the pool start: the ids pool whole (they run as
    given), and neither answer is served the other's vector."""
    text = "where do rivers meet the sea"
    by_text = _vectors(srv.post("/api/v1/embed", {"texts": [text], "prompt": QUERY}), lambda r: r["embeddings"])
    tokens = srv.post("/tokenize", {"inputs": QUERY + text})
    assert tokens.status_code == 200, tokens.text
    ids = [t["id"] for t in tokens.json()[0]]
    by_ids = _vectors(srv.post("/v1/embeddings", {"input": [ids]}), _openai)
    whole = _vectors(srv.post("/api/v1/embed", {"texts": [QUERY + text]}), lambda r: r["embeddings"])
    assert np.abs(by_text - by_ids).max() > 1e-2
    # The ids pool whole, as the text that carries the prompt without asking
    # for it does (this model has no default prompt).
    assert np.abs(by_ids - whole).max() <= 1e-6
    again = _vectors(srv.post("/api/v1/embed", {"texts": [text], "prompt": QUERY}), lambda r: r["embeddings"])
    assert np.array_equal(again, by_text)
    metrics = srv.get("/metrics").text
    assert "mlx_embed_cache_hits_total" in metrics


def test_token_rows_keep_the_prompt(srv):
    """/embed_all answers a row for every token the model ran, the prompt's too."""
    text = "where do rivers meet the sea"
    rows = srv.post("/embed_all", {"inputs": [text], "prompt_name": "query"})
    assert rows.status_code == 200, rows.text[:300]
    tokens = srv.post("/tokenize", {"inputs": text, "prompt_name": "query"})
    assert tokens.status_code == 200, tokens.text[:300]
    assert len(rows.json()[0]) == len(tokens.json()[0])
