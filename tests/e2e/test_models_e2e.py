"""`mlx-embed serve --model <fixture>` serves every architecture: the four
embed routes answer the fixture's reference vectors (tests/fixtures/tiny-*)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from harness import FIXTURES, cosine_rows, start_server

MAX_LEN = 128

# folder -> (reference of the folder as served: its default prompt if any, width)
SERVED = {
    "tiny-xlm-roberta": ("reference_mean_normalized.npy", 64),
    "tiny-mpnet": ("reference_mean_normalized.npy", 64),
    "tiny-modernbert": ("reference_cls_normalized.npy", 64),
    "tiny-nomic-bert": ("reference_document_normalized.npy", 64),
    "tiny-qwen2": ("reference_last_token_normalized.npy", 64),
    "tiny-gemma3": ("reference_normalized.npy", 48),
    "tiny-gemma2": ("reference_last_token_normalized.npy", 48),
    "tiny-embedding-gemma2": ("reference_normalized.npy", 48),
    "tiny-mistral": ("reference_last_token_normalized.npy", 64),
    "tiny-llama": ("reference_last_token_normalized.npy", 64),
    "tiny-eurobert": ("reference_mean_normalized.npy", 64),
    "tiny-distilbert": ("reference_mean_normalized.npy", 64),
    "tiny-camembert": ("reference_mean_normalized.npy", 64),
    "tiny-t5": ("reference_mean_normalized.npy", 64),
    "tiny-nomic-moe": ("reference_noprompt_normalized.npy", 64),
}


def _expected_tokens(folder: str, texts: list[str]) -> int:
    """Tokens the texts run as: the folder's default prompt (if any) in
    front, specials included, truncated to the fixture's max length (its
    sentence_bert_config.json's, else MAX_LEN)."""
    st = json.loads((FIXTURES / folder / "config_sentence_transformers.json").read_text())
    prompt = st["prompts"][st["default_prompt_name"]] if st.get("default_prompt_name") else ""
    tok = Tokenizer.from_file(str(FIXTURES / folder / "tokenizer.json"))
    tok.no_padding()
    st_config = FIXTURES / folder / "sentence_bert_config.json"
    max_len = (json.loads(st_config.read_text()) if st_config.exists() else {}).get("max_seq_length", MAX_LEN)
    tok.enable_truncation(max_length=max_len)
    return sum(len(e.ids) for e in tok.encode_batch([prompt + t for t in texts]))


def _routes(name: str) -> dict:
    return {
        "native": ("/api/v1/embed", {"texts": None}, lambda r: r["embeddings"]),
        "openai": ("/v1/embeddings", {"input": None, "model": name},
                   lambda r: [d["embedding"] for d in sorted(r["data"], key=lambda d: d["index"])]),
        "tei": ("/embed", {"inputs": None}, lambda r: r),
        "ollama": ("/api/embed", {"input": None, "model": name}, lambda r: r["embeddings"]),
    }


@pytest.mark.parametrize("folder", sorted(SERVED))
def test_serve_fixture_on_four_routes(folder, tmp_path):
    ref_name, dim = SERVED[folder]
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    reference = np.load(FIXTURES / folder / ref_name)
    # The API refuses empty strings (400), so the golden row for "" is left out.
    keep = [i for i, t in enumerate(texts) if t != ""]
    texts, reference = [texts[i] for i in keep], reference[keep]

    command = [str(Path(sys.prefix) / "bin" / "mlx-embed"), "serve"]
    srv = start_server(tmp_path, "--model", str(FIXTURES / folder), "--no-warmup", command=command)
    try:
        info = srv.get("/info").json()
        assert info["dimension" if "dimension" in info else "dim"] == dim, info
        for route, (path, body, extract) in _routes(folder).items():
            key = next(k for k, v in body.items() if v is None)
            resp = srv.post(path, {**body, key: texts})
            assert resp.status_code == 200, f"{route}: {resp.text[:500]}"
            got = np.asarray(extract(resp.json()), dtype=np.float32)
            assert got.shape == reference.shape, route
            c, d = cosine_rows(got, reference).min(), np.abs(got - reference).max()
            print(f"{folder} {route}: min cosine {c:.8f}, max |diff| {d:.2e}")
            assert c >= 0.99999, route
            assert d <= 1e-5, route
            if route == "native":
                # Usage counts every token run, a default prompt's included.
                assert resp.json()["usage"]["prompt_tokens"] == _expected_tokens(folder, texts)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def e5_server(tmp_path_factory):
    """The e5-style folder (prompts query/passage, no default) served."""
    srv = start_server(tmp_path_factory.mktemp("e5"), "--model", str(FIXTURES / "tiny-xlm-roberta"),
                       "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _native(srv, texts, **extra) -> tuple[np.ndarray, int]:
    resp = srv.post("/api/v1/embed", {"texts": texts, **extra})
    assert resp.status_code == 200, resp.text[:500]
    body = resp.json()
    return np.asarray(body["embeddings"], dtype=np.float32), body["usage"]["prompt_tokens"]


def test_prompt_name_on_native_tei_and_openai(e5_server, golden):
    texts = [t for t in golden[0] if t != ""]
    keep = [i for i, t in enumerate(golden[0]) if t != ""]
    reference = np.load(FIXTURES / "tiny-xlm-roberta" / "reference_query_normalized.npy")[keep]
    bodies = {
        "/api/v1/embed": ({"texts": texts, "prompt_name": "query"}, lambda r: r["embeddings"]),
        "/embed": ({"inputs": texts, "prompt_name": "query"}, lambda r: r),
        # extra_body={"prompt_name": ...} in the OpenAI client sends it top level.
        "/v1/embeddings": ({"input": texts, "model": "tiny-xlm-roberta", "prompt_name": "query"},
                           lambda r: [d["embedding"] for d in sorted(r["data"], key=lambda d: d["index"])]),
    }
    for path, (body, extract) in bodies.items():
        resp = e5_server.post(path, body)
        assert resp.status_code == 200, f"{path}: {resp.text[:500]}"
        got = np.asarray(extract(resp.json()), dtype=np.float32)
        assert cosine_rows(got, reference).min() >= 0.99999, path
        assert np.abs(got - reference).max() <= 1e-5, path
    resp = e5_server.post("/embed", {"inputs": texts[:1], "prompt_name": "nope"})
    assert resp.status_code == 400, resp.text


def test_prompt_name_equals_the_raw_prefixed_text(e5_server, golden):
    texts = [t for t in golden[0][:34] if t != ""]  # shorter than max length
    named, n_named = _native(e5_server, texts, prompt_name="query")
    raw, n_raw = _native(e5_server, ["query: " + t for t in texts])
    plain, n_plain = _native(e5_server, texts)
    assert np.array_equal(named, raw)
    # Usage counts the prompt's tokens.
    assert n_named == n_raw > n_plain


def test_truncation_direction_left_keeps_the_last_tokens(e5_server):
    tail = " ".join(f"river{i % 7} bank{i % 5}" for i in range(150))
    a = "mountains and valleys " * 60 + tail
    b = "the quick brown fox " * 70 + tail
    left, _ = _native(e5_server, [a, b], truncation_direction="left")
    right, _ = _native(e5_server, [a, b], truncation_direction="right")
    tei = e5_server.post("/embed", {"inputs": [a, b], "truncation_direction": "Left"})
    assert tei.status_code == 200, tei.text[:500]
    # Both keep the same last tokens (the tail): the same vector.
    assert np.abs(left[0] - left[1]).max() <= 1e-6
    assert np.abs(np.asarray(tei.json(), dtype=np.float32) - left).max() <= 1e-6
    assert np.abs(right[0] - right[1]).max() > 1e-2
    assert np.abs(left[0] - right[0]).max() > 1e-2


def test_a_folder_that_cuts_on_the_left_is_cut_so_on_every_route(tmp_path):
    """tokenizer_config.json's truncation_side "left": a request that names
    no direction (native, TEI, OpenAI, Cohere without truncate) is cut from
    the left, as sentence-transformers cuts that folder; one that names a
    direction gets it. The Rust tokenizer reads it from the model's spec."""
    import json
    import shutil

    import mlx_embed

    folder = tmp_path / "left-cut"
    shutil.copytree(FIXTURES / "tiny-xlm-roberta", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "truncation_side": "left"}))
    texts = ["mountains and valleys " * 60 + "the river bank at the end", "short"]
    model = mlx_embed.load(str(folder))
    want_left, want_right = model.embed(texts), model.embed(texts, truncation_direction="right")
    assert np.abs(want_left[0] - want_right[0]).max() > 1e-2
    srv = start_server(tmp_path, "--model", str(folder), "--no-warmup")
    try:
        got, _ = _native(srv, texts)
        assert np.abs(got - want_left).max() <= 1e-5
        tei = srv.post("/embed", {"inputs": texts})
        assert np.abs(np.asarray(tei.json(), dtype=np.float32) - want_left).max() <= 1e-5
        oa = srv.post("/v1/embeddings", {"input": texts, "model": "left-cut"}).json()["data"]
        assert np.abs(np.asarray([d["embedding"] for d in oa], dtype=np.float32) - want_left).max() <= 1e-5
        co = srv.post("/v2/embed", {"texts": texts, "model": "left-cut", "input_type": "classification",
                                    "embedding_types": ["float"]})
        assert co.status_code == 200, co.text[:300]
        assert np.abs(np.asarray(co.json()["embeddings"]["float"], dtype=np.float32) - want_left).max() <= 1e-5
        right, _ = _native(srv, texts, truncation_direction="right")
        assert np.abs(right - want_right).max() <= 1e-5
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_embedding_gemma2_prompt_names_through_the_server(tmp_path, golden):
    """EmbeddingGemma 2's multimodal checkpoint served (text only, the towers
    left out at load): prompt names on the OpenAI and native routes give the
    prompted references, usage counts the prompt's tokens, an unknown name is
    a 400, and /info reports the projected width."""
    folder = "tiny-embedding-gemma2"
    keep = [i for i, t in enumerate(golden[0]) if t != ""]
    texts = [golden[0][i] for i in keep]
    srv = start_server(tmp_path, "--model", str(FIXTURES / folder), "--no-warmup")
    try:
        info = srv.get("/info").json()
        assert info["dimension" if "dimension" in info else "dim"] == 48, info
        for name in ("query", "document"):
            reference = np.load(FIXTURES / folder / f"reference_{name}_normalized.npy")[keep]
            resp = srv.post("/v1/embeddings", {"input": texts, "model": folder, "prompt_name": name})
            assert resp.status_code == 200, resp.text[:500]
            got = np.asarray([d["embedding"] for d in sorted(resp.json()["data"], key=lambda d: d["index"])],
                             dtype=np.float32)
            c, d = cosine_rows(got, reference).min(), np.abs(got - reference).max()
            print(f"{folder} /v1/embeddings prompt_name={name}: min cosine {c:.8f}, max |diff| {d:.2e}")
            assert c >= 0.99999 and d <= 1e-5, name
            native, n_named = _native(srv, texts, prompt_name=name)
            assert np.abs(native - got).max() <= 1e-6
        _, n_plain = _native(srv, texts)
        assert n_named > n_plain
        # Matryoshka (the model card: 768 with 512/256/128 prefixes): a prefix, renormalized.
        resp = srv.post("/v1/embeddings", {"input": texts, "model": folder, "dimensions": 16})
        assert resp.status_code == 200, resp.text[:500]
        got = np.asarray([d["embedding"] for d in sorted(resp.json()["data"], key=lambda d: d["index"])],
                         dtype=np.float32)
        cut = np.load(FIXTURES / folder / "reference_normalized.npy")[keep][:, :16]
        cut /= np.linalg.norm(cut, axis=1, keepdims=True)
        assert got.shape == cut.shape and np.abs(got - cut).max() <= 1e-5
        resp = srv.post("/v1/embeddings", {"input": texts[:1], "model": folder, "prompt_name": "passage"})
        assert resp.status_code == 400, resp.text
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
