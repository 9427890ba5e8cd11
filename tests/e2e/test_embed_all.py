"""TEI's ``/embed_all`` (per-token vectors) end to end on the real server
binary serving all-MiniLM-L6-v2: one row per token the model ran (what
``/tokenize`` lists, cut to the model's maximum), raw last hidden states whose
mean is the unnormalized pooled ``/embed`` vector (MiniLM pools by mean)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests

MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length


def _rows(server, texts) -> list[np.ndarray]:
    r = server.post("/embed_all", {"inputs": texts})
    assert r.status_code == 200, r.text
    return [np.array(x, dtype=np.float32) for x in r.json()]


def _pooled(server, texts) -> np.ndarray:
    r = server.post("/embed", {"inputs": texts, "normalize": False})
    assert r.status_code == 200, r.text
    return np.array(r.json(), dtype=np.float32)


def _token_counts(server, texts) -> list[int]:
    r = server.post("/tokenize", {"inputs": texts})
    assert r.status_code == 200, r.text
    return [len(x) for x in r.json()]


def test_rows_are_the_tokens_and_average_to_the_pooled_vector(server, golden):
    texts = [t for t in golden[0][:12] if t] + ["a", "word " * 400]
    rows = _rows(server, texts)
    counts = _token_counts(server, texts)
    assert counts[-1] > MAX_LENGTH  # /tokenize does not truncate; the model does
    assert [x.shape for x in rows] == [(min(n, MAX_LENGTH), 384) for n in counts]
    means = np.stack([x.mean(axis=0) for x in rows])
    pooled = _pooled(server, texts)
    assert np.abs(means - pooled).max() <= 1e-5
    # Raw hidden states: neither pooled nor normalized.
    norms = np.linalg.norm(rows[0], axis=1)
    assert np.abs(norms - 1.0).min() > 0.01
    assert np.abs(rows[0][0] - rows[0][1]).max() > 0.01


def test_single_string_and_request_options(server):
    one = server.post("/embed_all", {"inputs": "hello world"})
    assert one.status_code == 200, one.text
    got = np.array(one.json(), dtype=np.float32)
    assert got.shape == (1, 4, 384)  # [CLS] hello world [SEP]
    long = "one two three four five six seven eight nine ten " * 60
    left = _rows_with(server, {"inputs": [long], "truncation_direction": "Left"})[0]
    right = _rows_with(server, {"inputs": [long], "truncation_direction": "right"})[0]
    assert left.shape == right.shape == (MAX_LENGTH, 384)
    assert np.abs(left - right).max() > 0.01  # each side kept its own end
    assert np.abs(left.mean(axis=0) - _pooled_with(
        server, {"inputs": [long], "truncation_direction": "left", "normalize": False})[0]
    ).max() <= 1e-5
    # X-Priority picks the lane as on /embed.
    r = requests.post(server.url + "/embed_all", json={"inputs": "q"},
                      headers={"X-Priority": "high"}, timeout=60)
    assert r.status_code == 200


def _rows_with(server, body) -> list[np.ndarray]:
    r = server.post("/embed_all", body)
    assert r.status_code == 200, r.text
    return [np.array(x, dtype=np.float32) for x in r.json()]


def _pooled_with(server, body) -> np.ndarray:
    r = server.post("/embed", body)
    assert r.status_code == 200, r.text
    return np.array(r.json(), dtype=np.float32)


def test_token_ids_run_as_given(server):
    """TEI's token-id input: the ids /tokenize lists, specials included, give
    the text's rows, one per id."""
    listed = [t["id"] for t in server.post("/tokenize", {"inputs": "hello world"}).json()[0]]
    by_ids = _rows_with(server, {"inputs": [listed]})[0]
    by_text = _rows_with(server, {"inputs": ["hello world"]})[0]
    assert by_ids.shape == (len(listed), 384)
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)


def test_bad_input_codes(server):
    long = "word " * 400
    cases = [
        ({"inputs": []}, 400),
        ({"inputs": ["ok", ""]}, 400),
        ({"inputs": [True]}, 422),
        ({"input": "a"}, 422),
        ({"inputs": "a", "truncation_direction": "up"}, 422),
        ({"inputs": "a", "prompt_name": "query"}, 400),  # MiniLM has no named prompts
        ({"inputs": ["ok", long], "truncate": False}, 422),
    ]
    for body, status in cases:
        r = server.post("/embed_all", body)
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()
        assert isinstance(err["error"], str) and isinstance(err["error_type"], str), err
    r = server.post("/embed_all", {"inputs": ["ok", long], "truncate": False})
    assert "input 1" in r.json()["error"], r.text
    r = requests.post(server.url + "/embed_all", data="{", timeout=30,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = requests.post(server.url + "/embed_all", data="inputs=a", timeout=30,
                      headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = requests.post(server.url + "/embed_all", json={"inputs": "a"},
                      headers={"X-Priority": "urgent"}, timeout=30)
    assert r.status_code == 400


def test_concurrent_pooled_and_token_requests_get_their_own_answers(server, golden):
    """Both kinds in flight at once share the queue but never a model call:
    every answer is its own text's, in its own kind."""
    texts = [t for t in golden[0] if t][:24]
    pooled = _pooled(server, texts)
    counts = [min(n, MAX_LENGTH) for n in _token_counts(server, texts)]

    def call(i: int):
        t = texts[i % len(texts)]
        if i % 2:
            r = server.post("/embed_all", {"inputs": [t]})
            assert r.status_code == 200, r.text
            rows = np.array(r.json()[0], dtype=np.float32)
            assert rows.shape == (counts[i % len(texts)], 384)
            return np.abs(rows.mean(axis=0) - pooled[i % len(texts)]).max()
        r = server.post("/embed", {"inputs": [t], "normalize": False})
        assert r.status_code == 200, r.text
        return np.abs(np.array(r.json()[0], dtype=np.float32) - pooled[i % len(texts)]).max()

    with ThreadPoolExecutor(16) as pool:
        errors = list(pool.map(call, range(96)))
    assert max(errors) <= 1e-5


def test_an_answer_of_more_token_rows_than_the_bound_is_refused_before_compute(server):
    """Every token's 384 floats come back as JSON: a 300 KB request of 512
    long texts asked for 600 MB of answer. The bound is 2**24 floats
    (TEI's own worst case), so 43690 rows of MiniLM's 384: 413 past it,
    counted exactly after truncation, before any compute."""
    long = " ".join(["a"] * 300)  # 302 tokens, cut to 256
    max_rows = 2**24 // 384
    fits = max_rows // MAX_LENGTH  # 170 inputs of 256 rows
    before = server.get("/metrics").text
    r = server.post("/embed_all", {"inputs": [long] * (fits + 1)})
    assert r.status_code == 413, r.text
    assert r.json()["error"] == (
        f"these inputs have {(fits + 1) * MAX_LENGTH} tokens in all, more than the {max_rows} token "
        "rows one request may have (every token's vector is answered); send fewer or shorter "
        "inputs per request"
    ), r.text
    after = server.get("/metrics").text
    batches = [line for line in after.splitlines() if line.startswith("mlx_embed_batches_total")]
    assert batches == [line for line in before.splitlines() if line.startswith("mlx_embed_batches_total")]
    # Short texts: the same count of inputs is far under the bound.
    r = server.post("/embed_all", {"inputs": ["a b"] * (fits + 1)})
    assert r.status_code == 200, r.text
    assert [len(x) for x in r.json()] == [4] * (fits + 1)


def test_tokenize_lists_at_most_a_million_tokens(server):
    """/tokenize answers an object per token: a 2 MB text of punctuation was a
    142 MB answer. Past 2**20 tokens in all it is a 413."""
    r = server.post("/tokenize", {"inputs": ["!" * 600_000, "!" * 600_000]})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"] == (
        "these texts have more than 1048576 tokens in all, the most one answer lists; "
        "send fewer or shorter texts per request"), r.text
    r = server.post("/tokenize", {"inputs": ["!" * 1000]})
    assert r.status_code == 200 and len(r.json()[0]) == 1002, r.text[:300]
