"""Settings a model folder states beyond its weights, end to end through the
real server binary: sentence_bert_config.json's ``do_lower_case`` (the Rust
tokenizer lower-cases as sentence-transformers does) and config.json's
``problem_type: multi_label_classification`` (a sigmoid per label)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import mlx_embed
from harness import FIXTURES, start_server

# transformers 5.24's text-classification pipeline (top_k=None) on the
# multi-label copy of tiny-bert-classifier, labels negative/neutral/positive
# (printed by scripts/fixtures/make_cross_encoders.py --only bert-classifier).
PIPELINE = {
    "I love this": [0.001631, 0.114224, 0.833630],
    "terrible": [0.008765, 0.624707, 0.696207],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("folders")
    lower = root / "lower"
    shutil.copytree(FIXTURES / "tiny-xlm-roberta", lower)
    cfg = json.loads((lower / "sentence_bert_config.json").read_text())
    (lower / "sentence_bert_config.json").write_text(json.dumps({**cfg, "do_lower_case": True}))
    multi = root / "multilabel"
    shutil.copytree(FIXTURES / "tiny-bert-classifier", multi)
    cfg = json.loads((multi / "config.json").read_text())
    (multi / "config.json").write_text(json.dumps({**cfg, "problem_type": "multi_label_classification"}))
    return lower, multi


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    lower, multi = folders
    srv = start_server(tmp_path_factory.mktemp("srv"), "--model", str(lower), "--model", str(multi), "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def test_do_lower_case_reaches_the_servers_tokenizer(server, folders):
    lower, _ = folders
    texts = ["UPPER Case MiXeD", "ΟΔΟΣ ΣΟΦΟΣ İstanbul STRASSE"]
    r = server.post("/api/v1/embed", {"model": "lower", "texts": texts, "prompt_name": "query"})
    assert r.status_code == 200, r.text
    got = np.array(r.json()["embeddings"], dtype=np.float32)
    model = mlx_embed.load(str(lower))
    want, counts = model.embed_with_counts(texts, prompt_name="query")
    assert float((got * want).sum(axis=1).min()) >= 0.99999
    assert r.json()["usage"]["prompt_tokens"] == sum(counts)
    # The cased tokenizer reads the text lower-cased one character at a time
    # (as sentence-transformers' Lowercase normalizer does it) the same way.
    plain = mlx_embed.load(str(FIXTURES / "tiny-xlm-roberta"))
    ref = plain.embed(["".join(c.lower() for c in t) for t in texts], prompt="query: ")
    assert float((got * ref).sum(axis=1).min()) >= 0.99999
    for text in [texts[0], "İSTANBUL Hello"]:
        tokens = server.post("/tokenize", {"model": "lower", "inputs": text})
        assert tokens.status_code == 200, tokens.text
        spans = tokens.json()[0]
        assert [t["id"] for t in spans] == model.encode([text])[0][0]
        # Offsets and texts are the input's own, not the lower-cased string's
        # (İ lower-cases to two characters).
        raw = text.encode()
        content = [t for t in spans if not t["special"]]
        assert all(raw[t["start"]:t["stop"]].decode() == t["text"] for t in content), content
        assert content[-1]["stop"] == len(raw)


def test_a_multi_label_classifier_answers_a_sigmoid_per_label(server):
    info = server.get("/info").json()
    assert [(m["model"], m["multi_label"]) for m in info["models"]] == [("lower", False), ("multilabel", True)]
    r = server.post("/predict", {"model": "multilabel", "inputs": [[t] for t in PIPELINE]})
    assert r.status_code == 200, r.text
    for text, answer in zip(PIPELINE, r.json()):
        scores = {p["label"]: p["score"] for p in answer}
        got = [scores[label] for label in ("negative", "neutral", "positive")]
        assert np.abs(np.array(got) - PIPELINE[text]).max() <= 2e-6, (text, got)
    raw = server.post("/predict", {"model": "multilabel", "inputs": "terrible", "raw_scores": True})
    logits = {p["label"]: p["score"] for p in raw.json()}
    assert abs(1 / (1 + np.exp(-logits["neutral"])) - PIPELINE["terrible"][1]) <= 2e-6
