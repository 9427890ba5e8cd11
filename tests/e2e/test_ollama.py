"""The Ollama API through Ollama's own Python client (`ollama` on PyPI), against
the real server binary: `embed`, the legacy `embeddings`, and the model
listings (`list`, `ps`, `show`) that clients read before they embed."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import ollama
import pytest
import requests

from harness import FIXTURES, cosine_rows, non_empty_golden, start_server

EMBEDDER = "all-MiniLM-L6-v2"
RERANKER = "tiny-bert-reranker"
# all-MiniLM-L6-v2 without its unused pooler: sentence-transformers counts
# 22,713,216 with it, and the pooler is 384 x 384 + 384 = 147,840.
MINILM_PARAMETERS = 22_565_376


@pytest.fixture(scope="module")
def duo(tmp_path_factory):
    """The default embedding model plus the BERT reranker: two listed models."""
    srv = start_server(tmp_path_factory.mktemp("ollama-duo"), "--rerank-model", str(FIXTURES / RERANKER))
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


def test_embed_matches_sentence_transformers(server, golden):
    texts, ref, _ = non_empty_golden(golden, 16)
    out = client(server).embed(model=EMBEDDER, input=texts)
    got = np.asarray(out.embeddings, dtype=np.float32)
    assert got.shape == (16, 384)
    assert cosine_rows(got, ref).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert out.model == EMBEDDER and out.prompt_eval_count > 16


def test_legacy_embeddings_are_the_unnormalized_vector(server, golden):
    texts, ref, _ = non_empty_golden(golden, 6)
    c = client(server)
    for i in (0, 5):
        out = c.embeddings(model=f"{EMBEDDER}:latest", prompt=texts[i])
        got = np.asarray(out.embedding, dtype=np.float32)
        raw = server.post("/api/v1/embed", {"texts": [texts[i]], "normalize": False}).json()["embeddings"][0]
        np.testing.assert_allclose(got, np.asarray(raw, dtype=np.float32), atol=1e-6)
        # Ollama answers this route before normalization; the direction is the model's.
        assert abs(np.linalg.norm(got) - 1.0) > 0.1
        assert cosine_rows(got[None, :], ref[i : i + 1])[0] >= 0.99999


def test_no_input_answers_no_embeddings_as_ollama_does(server):
    """Ollama's clients send an empty request to load a model; Ollama answers
    200 with no embeddings and echoes the model as named."""
    c = client(server)
    for empty in ("", []):
        out = c.embed(model=f"{EMBEDDER}:latest", input=empty)
        assert out.embeddings == [] and out.model == f"{EMBEDDER}:latest" and out.prompt_eval_count == 0
    bare = server.post("/api/embed", {"model": EMBEDDER})
    assert bare.status_code == 200 and bare.json()["embeddings"] == [], bare.text
    assert c.embeddings(model=EMBEDDER, prompt="").embedding == []
    resp = server.post("/api/embeddings", {"model": EMBEDDER})
    assert resp.status_code == 200 and resp.json() == {"embedding": []}, resp.text
    # Its options are still read: a context of 0 tokens is a 400 with no input too.
    for path, body in (
        ("/api/embed", {"options": {"num_ctx": 0}}),
        ("/api/embeddings", {"options": {"num_ctx": 0}}),
        ("/api/embed", {"dimensions": -1}),
        ("/api/embed", {"dimensions": 385}),
    ):
        resp = server.post(path, {"model": EMBEDDER, **body})
        field = next(iter(body["options"])) if "options" in body else "dimensions"
        assert resp.status_code == 400 and field in resp.json()["error"], f"{path} {body}: {resp.text}"
    # An empty text among others is embedded, as Ollama's handler keeps every
    # list item (chromadb and langchain-ollama send a collection's empty
    # chunks; a 400 failed the whole collection): the model's vector of no words.
    import mlx_embed

    got = c.embed(model=EMBEDDER, input=["ok", ""]).embeddings
    want = mlx_embed.load().embed(["ok", ""])
    assert len(got) == 2
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, atol=1e-6)
    # The name is echoed as sent, tag and all.
    assert c.embed(model=f"{EMBEDDER}:latest", input=["hello"]).model == f"{EMBEDDER}:latest"
    assert server.healthy()


def test_list_ps_and_show_describe_the_served_model(server):
    c = client(server)
    (listed,) = c.list().models
    assert listed.model == f"{EMBEDDER}:latest"
    assert listed.size == MINILM_PARAMETERS * 4  # float32 weights
    d = listed.details
    assert (d.format, d.family, d.families, d.parameter_size, d.quantization_level) == (
        "safetensors", "bert", ["bert"], "23M", "F32")
    assert listed.modified_at is not None and listed.modified_at.year >= 2024

    assert server.get("/api/version").json() == {"version": "0.12.0"}  # the Ollama API served

    (running,) = c.ps().models
    assert running.model == f"{EMBEDDER}:latest"
    assert (running.size, running.size_vram, running.context_length) == (MINILM_PARAMETERS * 4, 0, 256)
    # Always loaded: as far ahead as Ollama reports keep_alive -1 (its start
    # plus Go's longest duration, 2**63 - 1 ns, about 292 years), which
    # `ollama ps` shows as Forever; left out, it read as the zero time, "Stopping...".
    gap = running.expires_at - listed.modified_at
    assert abs(gap.total_seconds() - (2**63 - 1) / 1e9) < 1, running.expires_at

    for name in (EMBEDDER, f"{EMBEDDER}:latest"):
        shown = c.show(name)
        assert shown.capabilities == ["embedding"]
        assert shown.modelinfo == {
            "general.architecture": "bert",
            "general.parameter_count": MINILM_PARAMETERS,
            "bert.context_length": 256,
            "bert.embedding_length": 384,
        }
        assert shown.details.parameter_size == "23M"


def test_two_models_listed_and_picked_by_tagged_name(duo, golden):
    texts, ref, _ = non_empty_golden(golden, 2)
    c = client(duo)
    assert [m.model for m in c.list().models] == [f"{EMBEDDER}:latest", f"{RERANKER}:latest"]
    assert [m.model for m in c.ps().models] == [f"{EMBEDDER}:latest", f"{RERANKER}:latest"]

    reranker = c.show(f"{RERANKER}:latest")
    assert reranker.capabilities == []
    assert reranker.modelinfo["general.architecture"] == "bert"
    assert reranker.modelinfo["bert.embedding_length"] == 1  # one relevance logit

    out = c.embed(model=f"{EMBEDDER}:latest", input=texts)
    assert cosine_rows(np.asarray(out.embeddings, dtype=np.float32), ref).min() >= 0.99999

    with pytest.raises(ollama.ResponseError) as e:
        c.show("nope:latest")
    assert e.value.status_code == 404 and "nope" in e.value.error
    # Tools pull a model before they embed with it: a served one is there already.
    for name in (EMBEDDER, f"{RERANKER}:latest"):
        assert c.pull(name).status == "success"
        assert [p.status for p in c.pull(name, stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("nope")
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model=f"{RERANKER}:latest", input="x")
    assert e.value.status_code == 400 and "embedding model" in e.value.error
    # The one embedding model answers whatever an embedding client names
    # (Ollama's default nomic-embed-text): the reranker cannot embed.
    assert c.embeddings(model="nomic-embed-text", prompt=texts[0]).embedding == \
        c.embeddings(model=EMBEDDER, prompt=texts[0]).embedding
    out = c.embed(model="nope", input=[])
    assert out.embeddings == [] and out.model == "nope"
    assert c.embeddings(model="nope", prompt="").embedding == []
    assert duo.healthy()


def test_a_request_ollama_cannot_take_is_a_400(server):
    """Ollama answers 400 where other APIs answer 422: an input over the
    model's context with ``truncate: false``, a field of the wrong type."""
    c = client(server)
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model=EMBEDDER, input=["short", "word " * 600], truncate=False)
    assert e.value.status_code == 400 and e.value.error.startswith("input 1 has 602 tokens, more than the model's maximum of 256")
    # The same text cut to the context answers.
    assert len(c.embed(model=EMBEDDER, input=["word " * 600]).embeddings) == 1
    resp = server.post("/api/embed", {"model": EMBEDDER, "input": 3})
    assert resp.status_code == 400 and "expected a string or an array of strings" in resp.json()["error"]
    resp = server.post("/api/embeddings", {"model": EMBEDDER, "prompt": ["a"]})
    assert resp.status_code == 400, resp.text
    assert server.healthy()


def test_ollamas_documented_curl_works(server):
    """Ollama's docs post with curl's default `Content-Type`
    (application/x-www-form-urlencoded) and Ollama reads the body as JSON
    whatever its type: so do its routes here. The other APIs keep their 415."""
    body = '{"model": "all-minilm", "input": "Why is the sky blue?"}'
    want = client(server).embed(model=EMBEDDER, input="Why is the sky blue?").embeddings
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", f"{server.url}/api/embed", "-d", body],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        answer, _, status = out.rpartition("\n")
        assert status == "200", answer
        assert np.allclose(json.loads(answer)["embeddings"], want, atol=1e-6)
    form = {"content-type": "application/x-www-form-urlencoded"}
    for path, raw in [
        ("/api/embed", body),
        ("/api/embeddings", '{"model": "all-minilm", "prompt": "Why is the sky blue?"}'),
        ("/api/show", '{"model": "all-minilm"}'),
    ]:
        for headers in (form, {"content-type": "text/plain"}, {}):
            r = requests.post(server.url + path, data=raw.encode(), headers=headers, timeout=60)
            assert r.status_code == 200, (path, headers, r.text)
    r = requests.post(server.url + "/api/embed", data=b'{"input": [', headers=form, timeout=60)
    assert r.status_code == 400 and r.json()["error"].startswith("Failed to parse the request body as JSON")
    r = requests.post(server.url + "/v1/embeddings", data=b'{"input": "a"}', headers=form, timeout=60)
    assert r.status_code == 415, r.text


def test_the_digest_follows_the_models_files_not_its_folder_name(tmp_path):
    """Ollama's clients notice a changed model by its digest: a copy of a model
    under another folder has the same digest (as `ollama cp` keeps it), and a
    copy whose weights differ by one value has another."""
    original = FIXTURES / "tiny-gte-en"
    copy = tmp_path / "copy-gte"
    shutil.copytree(original, copy)
    changed = tmp_path / "changed" / "tiny-gte-en"
    shutil.copytree(original, changed)
    weights = changed / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor's data
    weights.write_bytes(bytes(data))

    def digest(folder, label: str) -> str:
        # Logs outside the model's folder: a file written there is part of the model.
        logs = tmp_path / f"logs-{label}"
        logs.mkdir()
        srv = start_server(logs, "--model", str(folder), "--no-warmup")
        try:
            tags = [m["digest"] for m in client(srv).list().models]
            ps = [m["digest"] for m in client(srv).ps().models]
        finally:
            assert srv.stop() == 0, srv.log()[-4000:]
        assert len(tags) == 1 and tags == ps, (tags, ps)
        return tags[0]

    first = digest(original, "original")
    assert len(first) == 64 and int(first, 16) >= 0
    assert digest(copy, "copy") == first, "the same files under another folder name"
    assert digest(changed, "changed") != first, "one byte of the weights changed"
