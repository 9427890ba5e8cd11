"""TEI's per-request figures on the real server: the ``x-compute-*`` /
``x-*-time`` headers on every answer the model worked for (TEI's routes and
the others alike), exact characters and tokens, phase times that add up, and
TEI's ``te_*`` metrics counting exactly. gRPC's ``Metadata`` is in
test_grpc.py."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import time

import pytest

from harness import FIXTURES, NOMIC, TEST_SERVER_BINARY, start_server

SPLADE = FIXTURES / "tiny-splade"
CLASSIFIER = FIXTURES / "tiny-bert-classifier"
RERANKER = FIXTURES / "tiny-bert-reranker"

HEADERS = (
    "x-compute-type",
    "x-compute-time",
    "x-compute-characters",
    "x-compute-tokens",
    "x-total-time",
    "x-tokenization-time",
    "x-queue-time",
    "x-inference-time",
)

TEXTS = ["héllo wörld ✓", "a second, longer text about timing headers"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """An embedder (the default), a SPLADE model, a classifier and a reranker."""
    server = start_server(
        tmp_path_factory.mktemp("timing"),
        "--model",
        str(NOMIC),
        "--model",
        str(SPLADE),
        "--model",
        str(CLASSIFIER),
        "--model",
        str(RERANKER),
        "--no-warmup",
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def figures(resp) -> dict[str, int]:
    """The timing headers of a 200, as numbers (the type apart), checked."""
    assert resp.status_code == 200, resp.text
    got = {name: resp.headers.get(name) for name in HEADERS}
    assert None not in got.values(), got
    numbers = {name: int(value) for name, value in got.items() if name != "x-compute-type"}
    assert all(n >= 0 for n in numbers.values()), numbers
    # Whole milliseconds rounded down: the sum of the floors is at most the
    # floor of the sum, which is at most the total.
    assert numbers["x-compute-time"] == numbers["x-total-time"]
    phases = numbers["x-tokenization-time"] + numbers["x-queue-time"] + numbers["x-inference-time"]
    assert numbers["x-total-time"] >= phases, numbers
    return numbers


def device_of(srv) -> str:
    """The backend word of the device /info names (``cpu (…)`` is ``cpu``)."""
    info = srv.get("/info").text
    found = re.search(r'"device":\s*"(\w+)', info)
    assert found, info
    return found.group(1)


def chars(texts) -> int:
    return sum(len(t) for t in texts)  # code points, as TEI counts


ROUTES = [
    ("/embed", {"inputs": TEXTS}),
    ("/embed_all", {"inputs": TEXTS[0]}),
    ("/embed_sparse", {"model": "tiny-splade", "inputs": TEXTS}),
    ("/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": [TEXTS[1]]}}),
    ("/v1/embeddings", {"input": TEXTS}),
    ("/api/embed", {"input": TEXTS}),
    ("/v2/embed", {"texts": TEXTS, "input_type": "search_document", "embedding_types": ["float"]}),
    ("/api/v1/embed", {"texts": TEXTS}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
def test_every_route_that_runs_the_model_carries_the_headers(srv, path, body):
    resp = srv.post(path, body)
    got = figures(resp)
    assert resp.headers["x-compute-type"] == device_of(srv)
    assert got["x-compute-tokens"] > 0
    expected = chars([TEXTS[0]]) if path == "/embed_all" else chars(TEXTS)
    assert got["x-compute-characters"] == expected


def test_tokens_are_the_requests_usage_exactly(srv):
    texts = ["tokens are counted exactly", "over two inputs, special tokens included"]
    openai = srv.post("/v1/embeddings", {"input": texts})
    usage = openai.json()["usage"]["prompt_tokens"]
    assert figures(openai)["x-compute-tokens"] == usage
    tokenized = sum(len(t) for t in srv.post("/tokenize", {"inputs": texts}).json())
    assert usage == tokenized
    # The same texts on TEI's route: the cache answers, the count is the same.
    tei = srv.post("/embed", {"inputs": texts})
    assert figures(tei)["x-compute-tokens"] == usage
    assert figures(tei)["x-compute-characters"] == chars(texts)


def test_predict_and_rerank_count_as_tei_does(srv):
    query, docs = "which is about timing", ["timing headers", "something else", "ünïcödé"]
    rerank = srv.post("/rerank", {"query": query, "texts": docs})
    got = figures(rerank)
    # TEI counts the query once per pair.
    assert got["x-compute-characters"] == len(query) * len(docs) + chars(docs)
    cohere = srv.post("/v2/rerank", {"model": "tiny-bert-reranker", "query": query, "documents": docs})
    assert figures(cohere)["x-compute-tokens"] == got["x-compute-tokens"]
    pair = srv.post("/predict", {"inputs": [query, docs[0]]})
    assert figures(pair)["x-compute-characters"] == len(query) + len(docs[0])
    single = srv.post("/predict", {"inputs": docs[2]})
    tokens = srv.post("/tokenize", {"model": "tiny-bert-classifier", "inputs": docs[2]}).json()[0]
    assert figures(single)["x-compute-tokens"] == len(tokens)


def test_a_computed_call_shows_its_inference_and_a_cached_one_none(srv):
    text = "a text no other test sends, computed once then cached"
    first = figures(srv.post("/embed", {"inputs": text}))
    again = figures(srv.post("/embed", {"inputs": text}))
    # The tiny model runs in well under a millisecond: only the cache's zero is exact.
    assert again["x-queue-time"] == 0 and again["x-inference-time"] == 0
    assert first["x-compute-tokens"] == again["x-compute-tokens"]


def test_no_headers_without_model_work_or_on_a_refusal(srv):
    for resp in (
        srv.post("/tokenize", {"inputs": "hi"}),
        srv.get("/info"),
        srv.get("/health"),
        srv.post("/embed", {"inputs": ""}),
        srv.post("/embed", {"inputs": []}),
    ):
        assert not any(name in resp.headers for name in HEADERS), (resp.status_code, dict(resp.headers))


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of `name`'s samples whose labels include `labels` (any model)."""
    total = 0.0
    for line in text.splitlines():
        found = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if found and labels in (found.group(1) or ""):
            total += float(found.group(2))
    return total


def test_te_metrics_count_exactly(srv):
    before = srv.get("/metrics").text
    n = 5
    for i in range(n):
        figures(srv.post("/embed", {"inputs": f"metrics text {i}"}))
    batch = figures(srv.post("/embed", {"inputs": ["metrics batch a", "metrics batch b", "metrics batch c"]}))
    assert srv.post("/embed", {"inputs": ""}).status_code == 400
    assert srv.post("/tokenize", {"inputs": "not a model call"}).status_code == 200
    after = srv.get("/metrics").text

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("te_request_success", 'method="single"') == n
    assert delta("te_request_success", 'method="batch"') == 1
    assert delta("te_request_count", 'method="single"') == n + 1  # the refused one too
    assert delta("te_request_count", 'method="batch"') == 1
    assert delta("te_request_failure", 'err="validation"') == 1
    for name in (
        "te_request_duration",
        "te_request_tokenization_duration",
        "te_request_queue_duration",
        "te_request_inference_duration",
    ):
        assert delta(f"{name}_count") == n + 1, name
        assert delta(f"{name}_bucket", 'le="+Inf"') == n + 1, name
    # Each input is tokenized once, cache hit or not; each was new here.
    assert delta("te_request_input_length_count") == n + 3
    # Beside our names, from the same counts; TEI's batch tokens are the
    # real ones (no padding), which every batch here ran without a fault.
    assert metric(after, "te_batch_next_size_count") == metric(after, "mlx_embed_batch_size_count")
    assert metric(after, "te_batch_next_tokens_sum") == metric(after, "mlx_embed_real_tokens_total") > 0
    assert metric(after, "te_batch_next_tokens_count") == metric(after, "mlx_embed_batches_total")
    assert metric(after, "te_queue_size") == metric(after, "mlx_embed_queued_inputs") == 0
    assert re.search(r"^# TYPE te_request_duration histogram$", after, re.M)
    assert batch["x-compute-tokens"] > 3


def test_duration_buckets_print_as_clean_numbers(srv):
    """TEI's 1.5x steps from 15 us, each a short decimal a person can read
    and a query can name (computed, the first is 0.000015000000000000002)."""
    text = srv.get("/metrics").text
    bounds = re.findall(r'^te_request_duration_bucket\{le="([^"]+)"\}', text, re.M)
    assert len(bounds) == 36 and bounds[-1] == "+Inf", bounds
    assert bounds[:4] == ["0.000015", "0.0000225", "0.00003375", "0.000050625"], bounds
    for bound in bounds[:-1]:
        digits = bound.replace("0.", "", 1).lstrip("0").replace(".", "")
        assert len(digits) <= 5, bound
    values = [float(b) for b in bounds[:-1]]
    assert all(b / a == pytest.approx(1.5, rel=1e-4) for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(1e-5 * 1.5**35, rel=1e-4)


def test_te_request_method_is_the_requests_shape_and_each_input_counts_per_operation(srv):
    """TEI's `method` follows the JSON shape, not the input count (a list of
    one is a batch, a pair one input, a rerank a batch even of one text), and
    its te_embed_* / te_predict_* count every input of every request."""
    before = srv.get("/metrics").text
    sent = [
        ("/embed", {"inputs": ["a list of one is a batch"]}),  # batch, 1 embed
        ("/embed", {"inputs": "one bare text"}),  # single, 1 embed
        ("/v1/embeddings", {"input": ["x one", "x two"]}),  # batch, 2 embed
        ("/predict", {"inputs": ["a pair is", "one input"]}),  # single, 1 predict
        ("/predict", {"inputs": [["batch of"], ["two inputs"]]}),  # batch, 2 predict
        ("/rerank", {"query": "q", "texts": ["a rerank of one text"]}),  # batch, 1 predict
    ]
    for path, body in sent:
        figures(srv.post(path, body))
    after = srv.get("/metrics").text

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("te_request_count", 'method="single"') == 2
    assert delta("te_request_count", 'method="batch"') == 4
    assert delta("te_request_success", 'method="single"') == 2
    assert delta("te_request_success", 'method="batch"') == 4
    assert (delta("te_embed_count"), delta("te_embed_success")) == (4, 4)
    assert (delta("te_predict_count"), delta("te_predict_success")) == (4, 4)
    for op, n in (("embed", 4), ("predict", 4)):
        for phase in ("duration", "tokenization_duration", "queue_duration", "inference_duration"):
            assert delta(f"te_{op}_{phase}_count") == n, (op, phase)
            assert delta(f"te_{op}_{phase}_bucket", 'le="+Inf"') == n, (op, phase)
    assert re.search(r"^# TYPE te_embed_count counter$", after, re.M)
    assert re.search(r"^# TYPE te_predict_inference_duration histogram$", after, re.M)


def test_refusals_count_where_tei_counts_them(srv):
    """TEI counts a request once its body is read (by its shape), a refusal by
    its `err`, and an input in te_embed_count only once it reaches
    tokenization: a request refused before (empty, too many inputs, the wrong
    kind of model) is in te_request_count but none of its inputs is."""
    before = srv.get("/metrics").text
    too_many = 2048  # --max-inputs-per-request's default
    refused = [
        ("/embed", {"inputs": []}, 400),  # batch: validation
        ("/embed", {"inputs": ["x"] * (too_many + 1)}, 413),  # batch: batch_size
        ("/embed", {"model": "tiny-bert-classifier", "inputs": "not an embedder"}, 400),  # single: model_type
        ("/embed", {"inputs": "word " * 20000, "truncate": False}, 422),  # single: tokenization
        ("/embed", {"inputs": 5}, 422),  # unreadable: in no count, as in TEI
    ]
    for path, body, status in refused:
        resp = srv.post(path, body)
        assert resp.status_code == status, (body if len(str(body)) < 100 else path, resp.text)
    after = srv.get("/metrics").text

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("te_request_count", 'method="batch"') == 2
    assert delta("te_request_count", 'method="single"') == 2
    assert delta("te_request_success") == 0
    for err in ("validation", "batch_size", "model_type", "tokenization"):
        assert delta("te_request_failure", f'err="{err}"') == 1, err
    assert delta("te_request_failure") == 4
    # Only the over-long input was tokenized (and refused there).
    assert (delta("te_embed_count"), delta("te_embed_success")) == (1, 0)
    assert delta("te_request_duration_count") == 0


def test_each_vertex_instance_is_a_tei_request(srv):
    """TEI's /vertex answers each instance through its route's handler, so
    each is a request in te_request_* (by its own shape), the /vertex request
    none; /invocations is the one request it carries."""
    before = srv.get("/metrics").text
    vertex = srv.post(
        "/vertex",
        {
            "instances": [
                {"inputs": "vertex one"},
                {"inputs": ["vertex two a", "vertex two b"]},
                {"query": "q", "texts": ["vertex t1", "vertex t2"]},
            ]
        },
    )
    figures(vertex)
    assert len(vertex.json()["predictions"]) == 3
    figures(srv.post("/invocations", {"inputs": ["invoked a", "invoked b"]}))
    # One instance refused before any runs: that one is counted, refused.
    refused = srv.post("/vertex", {"instances": [{"inputs": "vertex fine"}, {"inputs": []}]})
    assert refused.status_code == 400, refused.text
    # An instance its route cannot read: in no count, as in TEI.
    unread = srv.post("/vertex", {"instances": [{"model": "tiny-bert-classifier", "inputs": 5}]})
    assert unread.status_code in (400, 422), unread.text
    after = srv.get("/metrics").text

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("te_request_count", 'method="single"') == 1
    assert delta("te_request_count", 'method="batch"') == 4
    assert delta("te_request_success", 'method="single"') == 1
    assert delta("te_request_success", 'method="batch"') == 3
    assert delta("te_request_failure", 'err="validation"') == 1
    assert delta("te_request_failure") == 1
    assert (delta("te_embed_count"), delta("te_embed_success")) == (5, 5)
    assert (delta("te_predict_count"), delta("te_predict_success")) == (2, 2)
    assert delta("te_request_duration_count") == 4
    assert delta("te_embed_inference_duration_count") == 5


def test_input_length_buckets_stop_at_each_models_maximum(srv):
    """TEI's exporter buckets te_request_input_length by powers of two up to
    the model's max_input_length; te_batch_next_size by 2^0..2^12."""
    text = srv.get("/metrics").text
    models = srv.get("/info").json()["models"]
    assert len(models) == 4
    for m in models:
        name, longest = m["model"], m["max_input_tokens"]
        bounds = re.findall(rf'^te_request_input_length_bucket\{{model="{re.escape(name)}",le="([^"]+)"\}}', text, re.M)
        powers = [str(2**k) for k in range(20) if 2**k <= longest]
        assert bounds == powers + ["+Inf"], (name, longest, bounds)
        sizes = re.findall(rf'^te_batch_next_size_bucket\{{model="{re.escape(name)}",le="([^"]+)"\}}', text, re.M)
        assert sizes == [str(2**k) for k in range(13)] + ["+Inf"], sizes


def test_a_body_over_the_limit_is_in_no_te_count(srv):
    """TEI's body limit (axum's DefaultBodyLimit) refuses before its handler
    counts anything: a 413 on size is in no te_* family, as here."""
    before = srv.get("/metrics").text
    resp = srv.post("/embed", {"inputs": "x" * (3 << 20)})
    assert resp.status_code == 413, resp.status_code
    after = srv.get("/metrics").text
    for name in ("te_request_count", "te_request_failure", "te_embed_count"):
        assert metric(after, name) == metric(before, name), name


HOLD = "@@hold@@"


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """The test-hooks server: a batch with a HOLD text holds the model until
    the release file exists (each test removes it first, and makes it last)."""
    tmp = tmp_path_factory.mktemp("held")
    release = tmp / "release-the-model"
    hooks = {"MLX_EMBED_TEST_HOLD": HOLD, "MLX_EMBED_TEST_RELEASE": str(release)}
    server = start_server(tmp, "--model", str(NOMIC), "--no-warmup", env=hooks, command=[str(TEST_SERVER_BINARY)])
    yield server, release
    release.touch()
    assert server.stop() == 0, server.log()[-4000:]


def wait_for(server, name: str, above: float, labels: str = "", timeout: float = 30):
    deadline = time.monotonic() + timeout
    while metric(server.get("/metrics").text, name, labels) <= above:
        assert time.monotonic() < deadline, f"{name}{{{labels}}} never rose above {above}"
        time.sleep(0.01)


def test_phase_times_are_measured_where_they_happen(held):
    """A held batch's request shows the hold as inference; a request queued
    behind it, as queue: each phase where its time went, not merely some."""
    server, release = held
    release.unlink(missing_ok=True)
    hold_s = 0.3
    try:
        before = server.get("/metrics").text
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(server.post, "/embed", {"inputs": f"{HOLD} the held request"})
            wait_for(server, "mlx_embed_queue_wait_seconds_count", metric(before, "mlx_embed_queue_wait_seconds_count"))
            second = pool.submit(server.post, "/embed", {"inputs": ["queued behind it", "and its second text"]})
            wait_for(server, "mlx_embed_in_flight_inputs", 2)
            time.sleep(hold_s)
            release.touch()
            held_one, queued = figures(first.result()), figures(second.result())
    finally:
        release.touch()
    ms = hold_s * 1000
    assert held_one["x-inference-time"] >= ms and held_one["x-queue-time"] < ms, held_one
    assert queued["x-queue-time"] >= ms and queued["x-inference-time"] < ms, queued
    assert held_one["x-total-time"] >= held_one["x-inference-time"] + held_one["x-queue-time"]


def test_a_client_that_leaves_is_counted_once_as_dropped(held):
    """TEI counts a request whose client leaves as err="dropped"; here the
    client leaves while its batch runs, so the request never finishes."""
    server, release = held
    release.unlink(missing_ok=True)
    try:
        before = server.get("/metrics").text
        body = json.dumps({"inputs": f"{HOLD} a text whose client leaves"}).encode()
        port = int(server.url.rsplit(":", 1)[1])
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(
            b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(server, "mlx_embed_queue_wait_seconds_count", metric(before, "mlx_embed_queue_wait_seconds_count"))
        conn.close()
        left = metric(before, "mlx_embed_http_requests_total", 'route="/embed",code="499"')
        wait_for(server, "mlx_embed_http_requests_total", left, 'route="/embed",code="499"')
        release.touch()
        assert server.post("/embed", {"inputs": "after the release"}).status_code == 200
        after = server.get("/metrics").text
    finally:
        release.touch()

    def delta(name, labels=""):
        return metric(after, name, labels) - metric(before, name, labels)

    assert delta("te_request_count", 'method="single"') == 2
    assert delta("te_request_success", 'method="single"') == 1
    assert delta("te_request_failure", 'err="dropped"') == 1
    assert delta("te_request_failure") == 1
    # Its time is no answer's: the histograms hold the answered one only.
    assert delta("te_request_duration_count") == 1
