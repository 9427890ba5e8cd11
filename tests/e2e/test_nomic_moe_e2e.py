"""nomic-embed-text-v2-moe served by the real binary: the tiny-nomic-moe
fixture (NomicBERT with mixture-of-experts layers, XLM-R tokenizer, prompts
query/passage and no default) answers its float64 reference's vectors on
/v1/embeddings by prompt name, with the prompt written by the client, and cut
to `dimensions` (Matryoshka: the leading dimensions, renormalized)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from harness import FIXTURES, cosine_rows, start_server

FOLDER = FIXTURES / "tiny-nomic-moe"
NAME = "tiny-nomic-moe"


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("nomic-moe"), "--model", str(FOLDER), "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def texts():
    # The API refuses empty strings (400), so the golden row for "" is left out.
    golden = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    keep = [i for i, t in enumerate(golden) if t != ""]
    return [golden[i] for i in keep], keep


def _openai(srv, body: dict) -> tuple[np.ndarray, dict]:
    resp = srv.post("/v1/embeddings", {"model": NAME, **body})
    assert resp.status_code == 200, resp.text[:500]
    r = resp.json()
    rows = [d["embedding"] for d in sorted(r["data"], key=lambda d: d["index"])]
    return np.asarray(rows, dtype=np.float32), r["usage"]


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    c, d = cosine_rows(got, ref).min(), np.abs(got - ref).max()
    print(f"min cosine {c:.8f}, max |diff| {d:.2e}")
    assert c >= 0.99999 and d <= 1e-5


def _tokens(prompt: str, texts: list[str]) -> int:
    tok = Tokenizer.from_file(str(FOLDER / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=128)
    return sum(len(e.ids) for e in tok.encode_batch([prompt + t for t in texts]))


@pytest.mark.parametrize("prompt_name, ref, prompt", [
    ("query", "query", "search_query: "),
    ("passage", "passage", "search_document: "),
    (None, "noprompt", ""),
])
def test_prompt_names_on_openai_route(moe_server, texts, prompt_name, ref, prompt):
    texts, keep = texts
    body = {"input": texts} if prompt_name is None else {"input": texts, "prompt_name": prompt_name}
    got, usage = _openai(moe_server, body)
    _close(got, np.load(FOLDER / f"reference_{ref}_normalized.npy")[keep])
    assert usage["prompt_tokens"] == _tokens(prompt, texts)


def test_prompt_written_by_the_client(moe_server, texts):
    texts, keep = texts
    short = [(t, i) for t, i in zip(texts, keep) if len(t) < 200][:10]
    got, _ = _openai(moe_server, {"input": ["search_query: " + t for t, _ in short]})
    _close(got, np.load(FOLDER / "reference_query_normalized.npy")[[i for _, i in short]])


@pytest.mark.parametrize("dims", [16, 48])
def test_dimensions_cut_and_renormalize(moe_server, texts, dims):
    texts, keep = texts
    got, _ = _openai(moe_server, {"input": texts, "prompt_name": "query", "dimensions": dims})
    full = np.load(FOLDER / "reference_query_normalized.npy")[keep][:, :dims]
    _close(got, full / np.linalg.norm(full, axis=1, keepdims=True))


def test_info_names_the_folder(moe_server):
    info = moe_server.get("/info").json()
    model = info["models"][0] if "models" in info else info
    assert model.get("dimension", model.get("dim")) == 64
    assert set(model["prompts"]) >= {"query", "passage"} and model.get("default_prompt_name") is None
