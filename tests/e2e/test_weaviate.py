"""Weaviate's text2vec-transformers inference API against the real server
binary, sent the way Weaviate's module sends it (a single text with no
content type, a batch of texts, task_type query/passage), plus the probes
Weaviate waits on before it starts."""

from __future__ import annotations

import json

import numpy as np
import requests

from harness import NOMIC, cosine_rows, non_empty_golden


def vectors(server, body) -> requests.Response:
    # Weaviate's Go client posts the single-text form without a Content-Type.
    return requests.post(server.url + "/vectors", data=json.dumps(body).encode(), timeout=60)


def test_single_and_batch_match_sentence_transformers(server, golden):
    texts, ref, _ = non_empty_golden(golden, 8)
    r = vectors(server, {"text": texts[0], "config": {"pooling_strategy": "masked_mean", "task_type": "passage"}})
    assert r.status_code == 200, r.text
    one = r.json()
    assert set(one) == {"text", "dims", "vector"} and one["text"] == texts[0] and one["dims"] == 384
    assert cosine_rows(np.asarray([one["vector"]], dtype=np.float32), ref[:1])[0] >= 0.99999
    batch = vectors(server, {"texts": texts, "config": {"task_type": "query", "dimensions": 128}}).json()
    got = np.asarray(batch["vectors"], dtype=np.float32)
    assert batch["dims"] == 128 and got.shape == (8, 128)
    assert cosine_rows(got, ref[:, :128]).min() >= 0.99999


def test_task_type_picks_the_models_prompt(nomic, golden):
    texts, _, idx = non_empty_golden(golden, 6)
    # `document`: what Weaviate's 2024 releases sent for an object (a 422 before).
    for task_type, reference in (("query", "query"), ("passage", "document"), ("document", "document")):
        got = vectors(nomic, {"texts": texts, "config": {"task_type": task_type}}).json()["vectors"]
        ref = np.load(NOMIC / f"reference_{reference}_normalized.npy")[idx]
        assert cosine_rows(np.asarray(got, dtype=np.float32), ref).min() >= 0.99999, task_type


def test_probes_meta_and_errors(server):
    for probe in ("/.well-known/live", "/.well-known/ready"):
        r = server.get(probe)
        assert r.status_code == 204 and r.content == b"", probe
    meta = server.get("/meta").json()["model"]
    assert (meta["name"], meta["model_type"], meta["dimension"], meta["max_input_tokens"], meta["pooling"]) == (
        "all-MiniLM-L6-v2", "bert", 384, 256, "mean")
    for body, status, needle in (
        ({"config": {}}, 400, "send either `text`"),
        ({"text": "", "config": {}}, 400, "input 0 is an empty string"),
        ({"text": "a", "config": {"dimensions": 0}}, 400, "dimensions must be between 1"),
        ({"text": "a", "config": {"task_type": "answer"}}, 422, "unknown variant `answer`"),
        # Not a name at all: the same wrong shape (422), not malformed JSON (400).
        ({"text": "a", "config": {"task_type": 5}}, 422, "invalid type: integer `5`, expected a string"),
        # serde would fill the request from an array, field by field.
        (["a", None, {}], 422, "expected a JSON object"),
    ):
        r = vectors(server, body)
        assert r.status_code == status, (body, r.text)
        assert list(r.json()) == ["error"] and needle in r.json()["error"], r.text
    assert server.healthy()
