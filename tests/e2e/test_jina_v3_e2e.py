"""jina-embeddings-v3 through the real server: Jina AI's `task` on
/v1/embeddings (and the native route's), a TEI `prompt_name` naming a task,
Cohere's and Voyage's `input_type` picking the task, and requests of
different tasks batched together, each answered its own task's reference
vectors (tests/fixtures/tiny-jina-v3/README.md); the -hf layout's PEFT
adapters (tests/fixtures/tiny-jina-v3-hf/README.md)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from harness import FIXTURES, cosine_rows, start_server

REMOTE = FIXTURES / "tiny-jina-v3"
NATIVE = FIXTURES / "tiny-jina-v3-hf"
TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")


def _golden():
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    keep = [i for i, t in enumerate(texts) if t]  # the API refuses "" (400)
    return [texts[i] for i in keep], keep


def _ref(task, folder: Path = REMOTE) -> np.ndarray:
    return np.load(folder / f"reference_{task or 'none'}_normalized.npy")


def _openai(resp) -> np.ndarray:
    assert resp.status_code == 200, resp.text[:500]
    data = sorted(resp.json()["data"], key=lambda d: d["index"])
    return np.asarray([d["embedding"] for d in data], dtype=np.float32)


def _assert_close(got, ref, what):
    c, d = cosine_rows(got, ref).min(), np.abs(got - ref).max()
    print(f"{what}: min cosine {c:.8f}, max |diff| {d:.2e}")
    assert c >= 0.99999 and d <= 1e-5, (what, c, d)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("jina"), "--model", str(REMOTE), "--no-warmup")
    yield srv
    srv.stop()


def test_each_task_on_openai_native_and_tei(server):
    texts, keep = _golden()
    info = server.get("/info").json()
    assert info["tasks"] == list(TASKS) and info["prompts"]["retrieval.query"].startswith("Represent the query")
    for task in TASKS:
        ref = _ref(task)[keep]
        got = _openai(server.post("/v1/embeddings", {"input": texts, "model": "tiny-jina-v3", "task": task}))
        _assert_close(got, ref, f"openai task={task}")
        resp = server.post("/api/v1/embed", {"texts": texts, "task": task})
        assert resp.status_code == 200, resp.text[:500]
        _assert_close(np.asarray(resp.json()["embeddings"], dtype=np.float32), ref, f"native task={task}")
        # TEI has no task field: a prompt_name that is a task's name runs
        # its adapter with its prompt.
        resp = server.post("/embed", {"inputs": texts, "prompt_name": task})
        assert resp.status_code == 200, resp.text[:500]
        _assert_close(np.asarray(resp.json(), dtype=np.float32), ref, f"tei prompt_name={task}")
    # No task: the base weights, no prompt.
    got = _openai(server.post("/v1/embeddings", {"input": texts, "model": "tiny-jina-v3"}))
    _assert_close(got, _ref(None)[keep], "openai no task")


# What each API's "what the text is for" field picks on a model with task
# adapters: the task an explicit `task` names (routes/mod.rs, role_pick).
ROLE_TASKS = [
    ("/v1/embed", "input_type", "search_query", "retrieval.query"),
    ("/v1/embed", "input_type", "search_document", "retrieval.passage"),
    ("/v1/embed", "input_type", "classification", "classification"),
    ("/v1/embed", "input_type", "clustering", "separation"),
    ("/v2/embed", "input_type", "search_query", "retrieval.query"),
    ("/v1/embeddings", "input_type", "query", "retrieval.query"),
    ("/v1/embeddings", "input_type", "document", "retrieval.passage"),
    ("/v1/embeddings", "input_type", "passage", "retrieval.passage"),
    ("/vectors", "task_type", "query", "retrieval.query"),
    ("/vectors", "task_type", "passage", "retrieval.passage"),
]


def _role_vectors(server, route, field, value, texts) -> np.ndarray:
    if route == "/vectors":
        resp = server.post(route, {"texts": texts, "config": {field: value}})
        assert resp.status_code == 200, resp.text[:500]
        return np.asarray(resp.json()["vectors"], dtype=np.float32)
    if route == "/v1/embeddings":
        return _openai(server.post(route, {"input": texts, "model": "tiny-jina-v3", field: value}))
    resp = server.post(route, {"texts": texts, field: value})
    assert resp.status_code == 200, resp.text[:500]
    emb = resp.json()["embeddings"]
    return np.asarray(emb["float"] if route == "/v2/embed" else emb, dtype=np.float32)


def test_input_types_pick_the_task(server):
    """Cohere's and Voyage's `input_type` (and Weaviate's `task_type`) run
    the task an explicit `task` runs: the native route's vectors with that
    task, bit for bit, and its float64 reference."""
    texts, keep = _golden()
    for route, field, value, task in ROLE_TASKS:
        resp = server.post("/api/v1/embed", {"texts": texts, "task": task})
        assert resp.status_code == 200, resp.text[:500]
        native = np.asarray(resp.json()["embeddings"], dtype=np.float32)
        got = _role_vectors(server, route, field, value, texts)
        assert np.array_equal(got, native), (route, value, np.abs(got - native).max())
        _assert_close(got, _ref(task)[keep], f"{route} {field}={value}")


def test_input_type_with_task(server):
    """Both given: the same task is the same request; another one is a 400
    naming input_type (neither silently wins)."""
    body = {"input": ["a query"], "model": "tiny-jina-v3", "input_type": "query"}
    alone = _openai(server.post("/v1/embeddings", body))
    same = _openai(server.post("/v1/embeddings", {**body, "task": "retrieval.query"}))
    assert np.array_equal(alone, same)
    resp = server.post("/v1/embeddings", {**body, "task": "retrieval.passage"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "input_type", err
    assert 'input_type query picks task "retrieval.query"' in err["message"], err
    assert 'task is "retrieval.passage"' in err["message"], err
    resp = server.post("/v1/embeddings", {**body, "prompt_name": "retrieval.query"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input_type", resp.text


# Jina AI's `task` on the routes whose APIs have no such field: each body
# with the texts and the task, and how to read its vectors.
TASK_ROUTES = [
    ("/embed", lambda texts, task: {"inputs": texts, "task": task}, lambda r: r),
    ("/invocations", lambda texts, task: {"inputs": texts, "task": task}, lambda r: r),
    ("/", lambda texts, task: {"inputs": texts, "task": task}, lambda r: r),
    ("/v1/embed", lambda texts, task: {"texts": texts, "task": task}, lambda r: r["embeddings"]),
    ("/v2/embed", lambda texts, task: {"texts": texts, "task": task}, lambda r: r["embeddings"]["float"]),
    ("/vectors", lambda texts, task: {"texts": texts, "task": task}, lambda r: r["vectors"]),
    ("/api/embed", lambda texts, task: {"input": texts, "task": task}, lambda r: r["embeddings"]),
]


def test_task_on_every_route(server):
    """`task` runs the same adapter and prompt on every embedding route as
    on the native route: its vectors bit for bit (a route that ignored it
    answered the untasked vectors with a 200)."""
    texts, keep = _golden()
    for task in TASKS:
        resp = server.post("/api/v1/embed", {"texts": texts, "task": task})
        assert resp.status_code == 200, resp.text[:500]
        native = np.asarray(resp.json()["embeddings"], dtype=np.float32)
        _assert_close(native, _ref(task)[keep], f"native task={task}")
        for route, body, vectors in TASK_ROUTES:
            resp = server.post(route, body(texts, task))
            assert resp.status_code == 200, (route, resp.text[:500])
            got = np.asarray(vectors(resp.json()), dtype=np.float32)
            assert np.array_equal(got, native), (route, task, np.abs(got - native).max())
        # Ollama's legacy route: one text, its vector before normalization.
        raw = server.post("/api/v1/embed", {"texts": texts[:1], "task": task, "normalize": False})
        resp = server.post("/api/embeddings", {"prompt": texts[0], "task": task})
        assert resp.status_code == 200, resp.text[:500]
        assert resp.json()["embedding"] == raw.json()["embeddings"][0], task
    # Other unknown fields are still ignored, as before.
    resp = server.post("/embed", {"inputs": texts[:2], "task": "separation", "not_a_field": 1})
    assert resp.status_code == 200, resp.text


def test_task_beside_token_ids(server):
    """TEI's inputs may mix texts with token-id lists: the texts still take
    the task's prompt (the ids run as given, under the task's adapter).
    Before, one id list in the request dropped the prompt from every text
    with a 200 (cosine 0.984 to the text's own retrieval.query vector)."""
    texts, keep = _golden()
    ids = server.post("/tokenize", {"inputs": texts[1], "add_special_tokens": True}).json()[0]
    ids = [t["id"] for t in ids]
    for task in ("retrieval.query", "retrieval.passage"):
        alone = server.post("/embed", {"inputs": texts[:2], "task": task})
        assert alone.status_code == 200, alone.text[:500]
        alone = np.asarray(alone.json(), dtype=np.float32)
        resp = server.post("/embed", {"inputs": [texts[0], ids], "task": task})
        assert resp.status_code == 200, resp.text[:500]
        mixed = np.asarray(resp.json(), dtype=np.float32)
        # The text: its tasked vector, prompt and all.
        _assert_close(mixed[:1], _ref(task)[keep][:1], f"text beside ids, task={task}")
        assert np.array_equal(mixed[0], alone[0]), (task, np.abs(mixed[0] - alone[0]).max())
        # The ids: the adapter without the prompt (what they say is all).
        plain = server.post("/embed", {"inputs": [ids], "task": task})
        assert np.array_equal(mixed[1], np.asarray(plain.json()[0], dtype=np.float32)), task
    # A prompt the request names itself still cannot go with token ids.
    resp = server.post("/embed", {"inputs": [texts[0], ids], "prompt_name": "retrieval.query"})
    assert resp.status_code == 400, resp.text
    assert "token ids run as given" in resp.text, resp.text


def test_task_on_similarity(server):
    """TEI's /similarity (and POST /'s sentence-similarity body) takes `task`
    as /embed does: the cosines of the task's vectors. Before, it was
    ignored with a 200 (the untasked cosines: text-matching's differed)."""
    texts, _ = _golden()
    source, sentences = texts[0], texts[1:6]
    for task in TASKS:
        vecs = np.asarray(server.post("/embed", {"inputs": [source, *sentences], "task": task}).json())
        want = vecs[1:] @ vecs[0]
        body = {"inputs": {"source_sentence": source, "sentences": sentences}, "task": task}
        for route in ("/similarity", "/"):
            resp = server.post(route, body)
            assert resp.status_code == 200, (route, resp.text[:300])
            np.testing.assert_allclose(resp.json(), want, rtol=0, atol=1e-6, err_msg=f"{route} {task}")
    plain = server.post("/similarity", {"inputs": {"source_sentence": source, "sentences": sentences}}).json()
    tasked = server.post(
        "/similarity", {"inputs": {"source_sentence": source, "sentences": sentences}, "task": "text-matching"}
    ).json()
    assert np.abs(np.asarray(plain) - np.asarray(tasked)).max() > 1e-3
    body = {"inputs": {"source_sentence": source, "sentences": sentences}}
    resp = server.post("/similarity", {**body, "task": "retrieval"})
    assert resp.status_code == 400 and "unknown task" in resp.text, resp.text
    resp = server.post("/similarity", {**body, "task": "separation", "parameters": {"prompt_name": "retrieval.query"}})
    assert resp.status_code == 400 and "prompt_name" in resp.text, resp.text


def _refusal(resp):
    """The message and param of a 400, whatever the route's error shape."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    return (err["message"], err.get("param")) if isinstance(err, dict) else (err, None)


def _answer(body):
    """An answer less what differs between two calls (Cohere's id)."""
    return {k: v for k, v in body.items() if k not in ("id", "usage")} if isinstance(body, dict) else body


def test_task_refusals_on_every_route(server):
    """An unknown task is a 400 naming the valid ones on every route (param
    `task` where the error shape has one); a route's own field that picks
    another task is a 400 naming that field; the same task is the same
    request."""
    valid = "valid tasks are retrieval.query, retrieval.passage, separation, classification, text-matching"
    for route, body, _ in TASK_ROUTES:
        message, param = _refusal(server.post(route, body(["x"], "retrieval")))
        assert message.startswith('unknown task "retrieval": ' + valid), (route, message)
        assert param in ("task", None), (route, param)
    message, _ = _refusal(server.post("/api/embeddings", {"prompt": "x", "task": "nope"}))
    assert message.startswith('unknown task "nope"'), message
    # Checked before Ollama's empty-input answer, as its other fields are.
    message, _ = _refusal(server.post("/api/embed", {"input": [], "task": "nope"}))
    assert message.startswith('unknown task "nope"'), message
    # The Cohere shape names the field.
    assert _refusal(server.post("/v2/embed", {"texts": ["x"], "task": "nope"}))[1] == "task"
    conflicts = [
        ("/embed", {"inputs": ["x"], "prompt_name": "separation"}, "prompt_name", '"separation"', "separation"),
        ("/api/v1/embed", {"texts": ["x"], "prompt_name": "separation"}, "prompt_name", '"separation"', "separation"),
        ("/v1/embeddings", {"input": ["x"], "prompt_name": "separation"}, "prompt_name", '"separation"', "separation"),
        (
            "/v1/embed",
            {"texts": ["x"], "input_type": "search_document"},
            "input_type",
            "search_document",
            "retrieval.passage",
        ),
        ("/v2/embed", {"texts": ["x"], "input_type": "clustering"}, "input_type", "clustering", "separation"),
        ("/vectors", {"text": "x", "config": {"task_type": "passage"}}, "task_type", "passage", "retrieval.passage"),
    ]
    for route, body, field, value, picked in conflicts:
        message, param = _refusal(server.post(route, {**body, "task": "retrieval.query"}))
        assert message == (
            f'{field} {value} picks task "{picked}" on this model, but task is "retrieval.query": '
            "send one of them (or both the same)"
        ), (route, message)
        assert param in (field, None), (route, param)
        # Both the same: the request of either alone.
        same = server.post(route, {**body, "task": picked})
        alone = server.post(route, body)
        assert same.status_code == alone.status_code == 200, (route, same.text[:300], alone.text[:300])
        assert _answer(same.json()) == _answer(alone.json()), route
    # A prompt that names no task runs under the task's adapter, as on the
    # native route (no conflict): a raw prompt here.
    assert server.post("/api/v1/embed", {"texts": ["x"], "task": "separation", "prompt": "p: "}).status_code == 200
    # Per-token output runs the task's adapter (and its prompt), as the
    # library's per-token rows do: test_jina_late_chunking_with_a_task.


def test_mixed_tasks_concurrently(tmp_path):
    """Requests of every task (and none), one text each, sent at once so the
    batcher puts rows of different tasks in one batch: each gets its own
    task's vector. The cache is off, so every input is computed."""
    texts, keep = _golden()
    jobs = [(i, TASKS[i % 5] if i % 6 != 5 else None) for i in range(len(texts))] * 2

    def one(job):
        i, task = job
        body = {"input": texts[i], "model": "tiny-jina-v3", **({"task": task} if task else {})}
        return job, _openai(srv.post("/v1/embeddings", body))[0]

    srv = start_server(tmp_path, "--model", str(REMOTE), "--no-warmup", "--no-cache")
    try:
        merged = []
        for _ in range(3):
            before = _batches(srv)
            with ThreadPoolExecutor(max_workers=16) as pool:
                answers = list(pool.map(one, jobs))
            got = np.stack([v for _, v in answers])
            ref = np.stack([_ref(task)[keep[i]] for (i, task), _ in answers])
            _assert_close(got, ref, "mixed concurrent tasks")
            inputs, calls = (a - b for a, b in zip(_batches(srv), before))
            print(f"{inputs:.0f} inputs computed in {calls:.0f} model calls")
            merged.append(calls < inputs)
            if merged[-1]:
                break
        # Fewer calls than inputs: one-text requests of neighbouring tasks
        # were batched together (and still answered their own task's vector).
        assert any(merged)
    finally:
        srv.stop()


def _batches(server) -> tuple[float, float]:
    """Inputs computed and model calls so far (/metrics)."""
    values = dict(
        line.rsplit(" ", 1)
        for line in server.get("/metrics").text.splitlines()
        if line.startswith(("mlx_embed_batch_size_sum", "mlx_embed_batch_size_count"))
    )
    return float(values["mlx_embed_batch_size_sum"]), float(values["mlx_embed_batch_size_count"])


def test_task_refusals(server, tmp_path):
    resp = server.post("/v1/embeddings", {"input": ["x"], "model": "tiny-jina-v3", "task": "retrieval"})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "task"
    assert (
        'unknown task "retrieval": valid tasks are retrieval.query, retrieval.passage, separation, '
        "classification, text-matching" in err["message"]
    )
    resp = server.post("/api/v1/embed", {"texts": ["x"], "task": "nope"})
    assert resp.status_code == 400 and "valid tasks are" in resp.text, resp.text
    # A task with per-token output: the adapter is for pooled vectors.
    resp = server.post("/embed_all", {"inputs": ["x"], "prompt_name": "separation"})
    assert resp.status_code == 200, resp.text


def test_native_layout_tasks(tmp_path):
    """jina-embeddings-v3-hf: its PEFT adapter subfolders are the tasks
    (float64 transformers + PEFT references), by `task` and by input_type."""
    srv = start_server(tmp_path, "--model", str(NATIVE), "--no-warmup")
    try:
        texts, keep = _golden()
        assert srv.get("/info").json()["tasks"] == list(TASKS)
        for task in TASKS:
            got = _openai(srv.post("/v1/embeddings", {"input": texts, "task": task}))
            _assert_close(got, _ref(task, NATIVE)[keep], f"-hf task={task}")
        got = _role_vectors(srv, "/v1/embed", "input_type", "clustering", texts)
        _assert_close(got, _ref("separation", NATIVE)[keep], "-hf cohere clustering")
    finally:
        srv.stop()


def test_task_on_a_model_without_adapters(tmp_path):
    # The -hf folder without its adapter subfolders.
    base = tmp_path / "hf-base"
    shutil.copytree(
        NATIVE, base, ignore=lambda d, names: [n for n in names if (NATIVE / n / "adapter_config.json").exists()]
    )
    srv = start_server(tmp_path, "--model", str(base), "--no-warmup")
    try:
        texts, keep = _golden()
        _assert_close(_openai(srv.post("/v1/embeddings", {"input": texts})), _ref(None)[keep], "-hf no task")
        resp = srv.post("/v1/embeddings", {"input": ["x"], "task": "retrieval.query"})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "task" and "has no task adapters" in err["message"], err
        assert "tasks" not in srv.get("/info").json()
        # input_type keeps picking prompts by role: none here, the base vectors.
        base = _ref(None)[keep[:3]]
        _assert_close(_role_vectors(srv, "/v1/embed", "input_type", "search_query", texts[:3]), base, "-hf cohere")
        got = _openai(srv.post("/v1/embeddings", {"input": texts[:3], "input_type": "document"}))
        _assert_close(got, base, "-hf voyage")
    finally:
        srv.stop()


def test_jina_normalized_and_late_chunking(server):
    """Jina AI's `normalized: false` answers the raw vectors (the same
    direction, not unit length); `late_chunking: true` pools each chunk in
    the others' context."""
    texts, keep = _golden()
    body = {"input": texts[:4], "model": "tiny-jina-v3", "task": "retrieval.query"}
    unit = _openai(server.post("/v1/embeddings", body))
    answer = server.post("/v1/embeddings", {**body, "normalized": False})
    # Jina's answer, not Mixedbread's: normalized is both APIs', task Jina's alone.
    assert list(answer.json()) == ["object", "data", "model", "usage"], answer.json().keys()
    raw = _openai(answer)
    norms = np.linalg.norm(raw, axis=1)
    assert np.all(np.abs(norms - 1.0) > 1e-3), norms
    _assert_close(raw / norms[:, None], _ref("retrieval.query")[keep[:4]], "normalized: false, renormalized")
    np.testing.assert_allclose(unit, _ref("retrieval.query")[keep[:4]], atol=1e-5)
    assert np.array_equal(_openai(server.post("/v1/embeddings", {**body, "late_chunking": False})), unit)
    # Late chunking without a task runs the base weights: one vector per chunk.
    late = _openai(server.post("/v1/embeddings", {"input": texts[:4], "model": "tiny-jina-v3", "late_chunking": True}))
    assert late.shape == unit.shape
    assert np.abs(late - _ref(None)[keep[:4]]).max() > 1e-3  # each chunk read in the others' context


LATE_CHUNKS = ["Berlin ist die Hauptstadt.", "Café crème à Paris", "東京は日本の首都です。", "emoji 🙂 ok 🚀", "x"]


def test_jina_late_chunking_with_a_task(server):
    """Jina's API takes `late_chunking` with `task`: the task's adapter and
    prompt run over the joined chunks (multilingual here), the library's
    vectors to the bit on /v1/embeddings (`task`, or a `prompt_name` naming
    it), and TEI's /embed_all with a task answers the library's per-token
    rows under the adapter."""
    import mlx_embed

    lib = mlx_embed.load(str(REMOTE))
    for task in ("retrieval.passage", "retrieval.query", "separation"):
        want = lib.embed_late_chunks(LATE_CHUNKS, task=task)
        assert np.abs(want - lib.embed_late_chunks(LATE_CHUNKS)).max() > 1e-3
        body = {"input": LATE_CHUNKS, "model": "tiny-jina-v3", "late_chunking": True}
        resp = server.post("/v1/embeddings", {**body, "task": task})
        assert np.array_equal(_openai(resp), want), task
        ids, _ = lib.encode([" ".join(LATE_CHUNKS)], prompt_name=task)
        assert resp.json()["usage"]["prompt_tokens"] == len(ids[0])
        named = _openai(server.post("/v1/embeddings", {**body, "prompt_name": task}))
        assert np.array_equal(named, want), task
        # The library's prompt_name names the task as the server's does.
        assert np.array_equal(lib.embed_late_chunks(LATE_CHUNKS, prompt_name=task), named), task
        plain = {"input": LATE_CHUNKS, "model": "tiny-jina-v3", "prompt_name": task}
        assert np.array_equal(_openai(server.post("/v1/embeddings", plain)), lib.embed(LATE_CHUNKS, prompt_name=task))
        rows = server.post("/embed_all", {"inputs": LATE_CHUNKS[1:3], "task": task})
        assert rows.status_code == 200, rows.text[:300]
        ids, _ = lib.encode(LATE_CHUNKS[1:3], prompt_name=task)
        res = lib.embed_ids(ids, output="tokens", adapter=[lib.tasks.index(task)] * len(ids))
        flat = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, lib.dim)
        want_rows = np.split(flat, np.cumsum(res.rows)[:-1])
        for got, ref, mine in zip(rows.json(), want_rows, lib.embed_tokens(LATE_CHUNKS[1:3], prompt_name=task)):
            assert np.array_equal(np.asarray(got, dtype=np.float32), ref), task
            assert np.array_equal(mine, ref), task
