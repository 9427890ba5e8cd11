"""TEI's gRPC API (``--grpc-port``, package ``tei.v1``) on the real server,
through Python grpcio with stubs generated at test time from proto/tei.proto:
every method, unary and streaming, answers what the HTTP routes answer for
the same request (the same one path underneath), bit for bit; errors carry
TEI's status codes; limits, the API key, /metrics and the log apply. The
standard health service answers what /health answers, and server reflection
describes every service, through gRPC's own Python clients."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import numpy as np
import pytest
import requests

from harness import FIXTURES, NOMIC, ROOT, TEST_SERVER_BINARY, cosine_rows, free_port, grpc_modules, start_server

SPLADE = FIXTURES / "tiny-splade"
CLASSIFIER = FIXTURES / "tiny-bert-classifier"
RERANKER = FIXTURES / "tiny-bert-reranker"


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """(messages, stubs) generated from the repository's proto/tei.proto."""
    with grpc_modules(tmp_path_factory.mktemp("stubs"), "tei.proto", ROOT / "proto") as modules:
        yield modules


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An embedder (the default), a SPLADE model, a classifier and a reranker,
    with gRPC on; yields (server, channel)."""
    port = free_port()
    srv = start_server(
        tmp_path_factory.mktemp("grpc"),
        "--model",
        str(NOMIC),
        "--model",
        str(SPLADE),
        "--model",
        str(CLASSIFIER),
        "--model",
        str(RERANKER),
        "--no-warmup",
        "--grpc-port",
        str(port),
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield srv, channel
    channel.close()
    assert srv.stop() == 0, srv.log()[-4000:]


@pytest.fixture(scope="module")
def texts():
    golden = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    return [t for t in golden if t][:10]


SERVICES = ["tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize"]


@pytest.fixture(scope="module")
def health():
    """(messages, stubs) of grpc.health.v1 (grpcio-health-checking)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    return health_pb2, health_pb2_grpc


def reflected_services(channel, version: str, metadata=None) -> list[str]:
    """The services server reflection lists, asked of its `version` (v1 or
    v1alpha: the same messages under two packages, so grpcio-reflection's
    v1alpha ones serve both)."""
    from grpc_reflection.v1alpha import reflection_pb2 as r

    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=r.ServerReflectionRequest.SerializeToString,
        response_deserializer=r.ServerReflectionResponse.FromString,
    )
    (answer,) = list(info(iter([r.ServerReflectionRequest(list_services="")]), metadata=metadata))
    return sorted(s.name for s in answer.list_services_response.service)


def f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failed:
        call()
    return failed.value.code()


def test_info_tells_the_default_model(pb, served):
    (m, stubs), (srv, channel) = pb, served
    info = stubs.InfoStub(channel).Info(m.InfoRequest())
    http = srv.get("/info").json()
    assert info.model_type == m.MODEL_TYPE_EMBEDDING
    assert info.model_id == http["model_id"] and info.model_dtype == http["model_dtype"]
    assert info.version == http["version"]
    assert info.max_input_length == http["max_input_length"] > 0
    assert info.max_client_batch_size == http["max_client_batch_size"] == 2048
    assert info.max_batch_requests == http["max_batch_requests"]
    assert info.max_batch_tokens == http["max_batch_tokens"]
    assert info.max_concurrent_requests == http["max_concurrent_requests"]
    assert not info.HasField("sha") and not info.HasField("model_sha")


@pytest.mark.parametrize("normalize", [True, False])
def test_embed_equals_http_embed_bit_for_bit(pb, served, texts, normalize):
    (m, stubs), (srv, channel) = pb, served
    embed = stubs.EmbedStub(channel)
    dim = srv.get("/info").json()["dimension"]
    http = srv.post("/embed", {"inputs": texts, "normalize": normalize})
    assert http.status_code == 200, http.text
    want = f32(http.json())
    got = []
    for text in texts:
        r = embed.Embed(m.EmbedRequest(inputs=text, normalize=normalize, truncate=True))
        assert len(r.embeddings) == dim
        assert r.metadata.compute_chars == len(text) and r.metadata.compute_tokens > 0
        got.append(r.embeddings)
    np.testing.assert_array_equal(f32(got), want)
    # A stream answers each message in order, with the same vectors.
    answers = list(
        embed.EmbedStream(iter([m.EmbedRequest(inputs=t, normalize=normalize, truncate=True) for t in texts]))
    )
    assert len(answers) == len(texts)
    np.testing.assert_array_equal(f32([a.embeddings for a in answers]), want)


def test_a_prompt_name_and_left_truncation_reach_the_path(pb, served):
    (m, stubs), (srv, channel) = pb, served
    embed = stubs.EmbedStub(channel)
    long_text = "word " * 3000
    for side, name in ((m.TRUNCATION_DIRECTION_LEFT, "left"), (m.TRUNCATION_DIRECTION_RIGHT, "right")):
        r = embed.Embed(
            m.EmbedRequest(
                inputs=long_text + "end", normalize=True, truncate=True, truncation_direction=side, prompt_name="query"
            )
        )
        http = srv.post(
            "/embed", {"inputs": long_text + "end", "truncation_direction": name, "prompt_name": "query"}
        ).json()
        np.testing.assert_array_equal(f32(r.embeddings), f32(http[0]))


def test_embed_sparse_equals_http(pb, served, texts):
    (m, stubs), (srv, channel) = pb, served
    embed = stubs.EmbedStub(channel)
    http = srv.post("/embed_sparse", {"model": "tiny-splade", "inputs": texts[:4]})
    assert http.status_code == 200, http.text
    unary = [embed.EmbedSparse(m.EmbedSparseRequest(inputs=t, truncate=True)) for t in texts[:4]]
    streamed = list(embed.EmbedSparseStream(iter([m.EmbedSparseRequest(inputs=t, truncate=True) for t in texts[:4]])))
    for want, one, two in zip(http.json(), unary, streamed, strict=True):
        assert len(want) > 0
        for got in (one, two):
            assert [v.index for v in got.sparse_embeddings] == [v["index"] for v in want]
            np.testing.assert_array_equal(
                f32([v.value for v in got.sparse_embeddings]), f32([v["value"] for v in want])
            )


def test_embed_all_equals_http(pb, served, texts):
    (m, stubs), (srv, channel) = pb, served
    embed = stubs.EmbedStub(channel)
    dim = srv.get("/info").json()["dimension"]
    streamed = list(embed.EmbedAllStream(iter([m.EmbedAllRequest(inputs=t, truncate=True) for t in texts[:3]])))
    for text, two in zip(texts[:3], streamed, strict=True):
        # Per text, as the gRPC call asks: rows of one input computed beside
        # others are padded otherwise (no cache holds token rows).
        http = srv.post("/embed_all", {"inputs": text})
        assert http.status_code == 200, http.text
        (want,) = http.json()
        one = embed.EmbedAll(m.EmbedAllRequest(inputs=text, truncate=True))
        tokens = srv.post("/tokenize", {"inputs": text}).json()[0]
        rows = f32([t.embeddings for t in one.token_embeddings])
        assert rows.shape == (len(tokens), dim)
        np.testing.assert_array_equal(rows, f32(want))
        # A stream's messages may share a model call, padded to the longest
        # (measured: 1.7e-6 at most), as an HTTP request's inputs do.
        streamed_rows = f32([t.embeddings for t in two.token_embeddings])
        assert streamed_rows.shape == rows.shape
        np.testing.assert_allclose(streamed_rows, rows, rtol=0, atol=1e-5)
        assert cosine_rows(streamed_rows, rows).min() >= 0.99999


def test_predict_equals_http_predict(pb, served, texts):
    (m, stubs), (srv, channel) = pb, served
    predict = stubs.PredictStub(channel)
    labels = set(srv.get("/info").json()["models"][2]["labels"])
    for raw in (False, True):
        for text in texts[:3]:
            want = srv.post("/predict", {"inputs": text, "raw_scores": raw}).json()
            got = predict.Predict(m.PredictRequest(inputs=text, truncate=True, raw_scores=raw))
            tokens = srv.post("/tokenize", {"model": "tiny-bert-classifier", "inputs": text}).json()[0]
            assert got.metadata.compute_tokens == len(tokens)
            assert got.metadata.compute_chars == len(text)
            assert {p.label for p in got.predictions} == labels
            assert [p.label for p in got.predictions] == [p["label"] for p in want]
            np.testing.assert_array_equal(f32([p.score for p in got.predictions]), f32([p["score"] for p in want]))
        pair = texts[:2]
        want = srv.post("/predict", {"inputs": pair, "raw_scores": raw}).json()
        got = predict.PredictPair(m.PredictPairRequest(inputs=pair, truncate=True, raw_scores=raw))
        assert [p.label for p in got.predictions] == [p["label"] for p in want]
        np.testing.assert_array_equal(f32([p.score for p in got.predictions]), f32([p["score"] for p in want]))
    want = srv.post("/predict", {"inputs": [[t] for t in texts[:5]]}).json()
    answers = list(predict.PredictStream(iter([m.PredictRequest(inputs=t, truncate=True) for t in texts[:5]])))
    assert len(answers) == 5
    for got, w in zip(answers, want, strict=True):
        np.testing.assert_array_equal(f32([p.score for p in got.predictions]), f32([p["score"] for p in w]))
    pairs = [texts[i : i + 2] for i in range(4)]
    want = srv.post("/predict", {"inputs": pairs}).json()
    answers = list(predict.PredictPairStream(iter([m.PredictPairRequest(inputs=p, truncate=True) for p in pairs])))
    assert [[p.label for p in a.predictions] for a in answers] == [[p["label"] for p in w] for w in want]
    for got, w in zip(answers, want, strict=True):
        np.testing.assert_array_equal(f32([p.score for p in got.predictions]), f32([p["score"] for p in w]))
    three = m.PredictPairRequest(inputs=texts[:3], truncate=True)
    assert code_of(lambda: predict.PredictPair(three)) == grpc.StatusCode.INVALID_ARGUMENT


def test_rerank_equals_http_rerank(pb, served, texts):
    (m, stubs), (srv, channel) = pb, served
    rerank = stubs.RerankStub(channel)
    query, docs = texts[0], texts[1:8]
    for raw in (False, True):
        want = srv.post("/rerank", {"query": query, "texts": docs, "raw_scores": raw, "return_text": True}).json()
        got = rerank.Rerank(m.RerankRequest(query=query, texts=docs, truncate=True, raw_scores=raw, return_text=True))
        assert [r.index for r in got.ranks] == [r["index"] for r in want]
        assert sorted(r.index for r in got.ranks) == list(range(len(docs)))
        assert got.metadata.compute_tokens > len(docs)
        assert [r.text for r in got.ranks] == [docs[r.index] for r in got.ranks]
        np.testing.assert_array_equal(f32([r.score for r in got.ranks]), f32([r["score"] for r in want]))
        # The stream's first message sets raw_scores and return_text.
        messages = [
            m.RerankStreamRequest(query=query, text=d, truncate=True, raw_scores=raw and i == 0, return_text=i == 0)
            for i, d in enumerate(docs)
        ]
        streamed = rerank.RerankStream(iter(messages))
        assert streamed.metadata.compute_tokens == got.metadata.compute_tokens
        assert [r.index for r in streamed.ranks] == [r["index"] for r in want]
        assert [r.text for r in streamed.ranks] == [docs[r.index] for r in streamed.ranks]
        np.testing.assert_array_equal(f32([r.score for r in streamed.ranks]), f32([r["score"] for r in want]))
    plain = rerank.Rerank(m.RerankRequest(query=query, texts=docs, truncate=True))
    assert not any(r.HasField("text") for r in plain.ranks)
    empty = m.RerankRequest(query=query, texts=[], truncate=True)
    assert code_of(lambda: rerank.Rerank(empty)) == grpc.StatusCode.INVALID_ARGUMENT
    # Pairs of two queries in one stream: each scored as /rerank scores it
    # under its own query, all ranked by score at their stream positions.
    queries = [texts[0] if i % 2 else texts[9] for i in range(len(docs))]
    mixed = rerank.RerankStream(
        iter([m.RerankStreamRequest(query=q, text=d, truncate=True) for q, d in zip(queries, docs, strict=True)])
    )
    want = {}
    for q in set(queries):
        positions = [i for i, x in enumerate(queries) if x == q]
        for r in srv.post("/rerank", {"query": q, "texts": [docs[i] for i in positions]}).json():
            want[positions[r["index"]]] = r["score"]
    assert sorted(r.index for r in mixed.ranks) == list(range(len(docs)))
    np.testing.assert_array_equal(f32([r.score for r in mixed.ranks]), f32([want[r.index] for r in mixed.ranks]))
    scores = [r.score for r in mixed.ranks]
    assert scores == sorted(scores, reverse=True)


def te_success(srv) -> float:
    """``te_request_success`` over both methods, from /metrics."""
    lines = srv.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("te_request_success{"))


def test_metadata_times_and_headers_are_the_http_figures(pb, served):
    """Metadata's six fields are measured (not 0), agree with the x-* headers
    the call's response carries (the same figures, as TEI sends both) and
    with HTTP's headers for the same input; each unary call counts in
    te_request_success once."""
    (m, stubs), (srv, channel) = pb, served
    embed = stubs.EmbedStub(channel)
    before = te_success(srv)
    text = "a text only this test sends, with ünïcödé"
    answer, call = embed.Embed.with_call(m.EmbedRequest(inputs=text, truncate=True, normalize=True))
    meta = answer.metadata
    tokens = srv.post("/tokenize", {"inputs": text}).json()[0]
    assert (meta.compute_chars, meta.compute_tokens) == (len(text), len(tokens))
    # Computed, not found in the cache: every phase took some time.
    assert meta.tokenization_time_ns > 0 and meta.queue_time_ns > 0 and meta.inference_time_ns > 0
    assert meta.total_time_ns >= meta.tokenization_time_ns + meta.queue_time_ns + meta.inference_time_ns
    headers = dict(call.initial_metadata())
    ms = 1_000_000
    assert headers["x-compute-characters"] == str(meta.compute_chars)
    assert headers["x-compute-tokens"] == str(meta.compute_tokens)
    assert headers["x-total-time"] == headers["x-compute-time"] == str(meta.total_time_ns // ms)
    assert headers["x-tokenization-time"] == str(meta.tokenization_time_ns // ms)
    assert headers["x-queue-time"] == str(meta.queue_time_ns // ms)
    assert headers["x-inference-time"] == str(meta.inference_time_ns // ms)
    http = srv.post("/embed", {"inputs": text})
    assert http.status_code == 200, http.text
    assert headers["x-compute-type"] == http.headers["x-compute-type"] != ""
    assert http.headers["x-compute-characters"] == headers["x-compute-characters"]
    assert http.headers["x-compute-tokens"] == headers["x-compute-tokens"]
    # A stream's messages carry their own Metadata.
    fresh = [f"stream text {i} for the metadata test" for i in range(3)]
    streamed = list(embed.EmbedStream(iter([m.EmbedRequest(inputs=t, truncate=True) for t in fresh])))
    for t, a in zip(fresh, streamed, strict=True):
        assert a.metadata.compute_chars == len(t) and a.metadata.inference_time_ns > 0
    # Scoring methods: the same counts as their HTTP routes.
    query, docs = "what is timed", ["the phases", "the tokens", "the characters"]
    ranked = stubs.RerankStub(channel).Rerank(m.RerankRequest(query=query, texts=docs, truncate=True))
    http = srv.post("/rerank", {"query": query, "texts": docs})
    assert ranked.metadata.compute_chars == len(query) * len(docs) + sum(len(d) for d in docs)
    assert http.headers["x-compute-characters"] == str(ranked.metadata.compute_chars)
    assert http.headers["x-compute-tokens"] == str(ranked.metadata.compute_tokens)
    assert ranked.metadata.inference_time_ns > 0
    predicted = stubs.PredictStub(channel).Predict(m.PredictRequest(inputs=docs[0], truncate=True))
    http = srv.post("/predict", {"inputs": docs[0]})
    assert http.headers["x-compute-tokens"] == str(predicted.metadata.compute_tokens)
    # 1 embed + 1 rerank + 1 predict unary gRPC calls, 3 HTTP requests; the
    # 3 streamed messages in none, as TEI's stream() counts none.
    assert te_success(srv) - before == 6


def sample_sum(text: str, prefix: str) -> float:
    """The sum of the /metrics samples whose name and labels start with `prefix`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_a_cancelled_call_counts_once_as_dropped(pb, tmp_path):
    """A unary call its client cancels while its batch runs is TEI's
    te_request_failure{err="dropped"}, counted once, and no success."""
    m, stubs = pb
    hold, release, port = "@@hold@@", tmp_path / "release-the-model", free_port()
    hooks = {"MLX_EMBED_TEST_HOLD": hold, "MLX_EMBED_TEST_RELEASE": str(release)}
    srv = start_server(
        tmp_path,
        "--model",
        str(NOMIC),
        "--no-warmup",
        "--grpc-port",
        str(port),
        env=hooks,
        command=[str(TEST_SERVER_BINARY)],
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        before = srv.get("/metrics").text
        started = sample_sum(before, "mlx_embed_queue_wait_seconds_count")
        call = stubs.EmbedStub(channel).Embed.future(m.EmbedRequest(inputs=f"{hold} cancelled", truncate=True))
        deadline = time.monotonic() + 30
        while sample_sum(srv.get("/metrics").text, "mlx_embed_queue_wait_seconds_count") <= started:
            assert time.monotonic() < deadline, "the model never took the batch"
            time.sleep(0.01)
        assert call.cancel()
        while sample_sum(after := srv.get("/metrics").text, 'te_request_failure{err="dropped"}') < 1:
            assert time.monotonic() < deadline, "the cancelled call was never counted"
            time.sleep(0.01)
        release.touch()
    finally:
        release.touch()
        channel.close()
        assert srv.stop() == 0, srv.log()[-4000:]

    def delta(prefix):
        return sample_sum(after, prefix) - sample_sum(before, prefix)

    assert delta('te_request_failure{err="dropped"}') == 1
    assert delta("te_request_failure{") == 1
    assert delta('te_request_count{method="single"}') == 1
    assert delta("te_request_success{") == 0


def test_tokenize_and_decode_equal_http(pb, served, texts):
    (m, stubs), (srv, channel) = pb, served
    tok = stubs.TokenizeStub(channel)
    sample = [*texts[:4], "héllo wörld"]
    for specials in (True, False):
        want = srv.post("/tokenize", {"inputs": sample, "add_special_tokens": specials}).json()
        streamed = list(
            tok.TokenizeStream(iter([m.EncodeRequest(inputs=t, add_special_tokens=specials) for t in sample]))
        )
        for text, w, two in zip(sample, want, streamed, strict=True):
            one = tok.Tokenize(m.EncodeRequest(inputs=text, add_special_tokens=specials))
            for got in (one, two):
                assert [(t.id, t.text, t.special) for t in got.tokens] == [
                    (t["id"], t["text"], t["special"]) for t in w
                ]
                assert [(t.start, t.stop) if t.HasField("start") else None for t in got.tokens] == [
                    (t["start"], t["stop"]) if t["start"] is not None else None for t in w
                ]
            assert any(t.special for t in one.tokens) == specials
    ids = [[t["id"] for t in w] for w in srv.post("/tokenize", {"inputs": sample}).json()]
    for skip in (True, False):
        want = srv.post("/decode", {"ids": ids, "skip_special_tokens": skip}).json()
        got = [tok.Decode(m.DecodeRequest(ids=i, skip_special_tokens=skip)).text for i in ids]
        streamed = [
            a.text for a in tok.DecodeStream(iter([m.DecodeRequest(ids=i, skip_special_tokens=skip) for i in ids]))
        ]
        assert got == streamed == want
    bad = m.DecodeRequest(ids=[10**9])
    assert code_of(lambda: tok.Decode(bad)) == grpc.StatusCode.INVALID_ARGUMENT


def test_errors_carry_teis_codes_and_end_a_stream(pb, served, texts):
    (m, stubs), (srv, channel) = pb, served
    embed = stubs.EmbedStub(channel)
    assert code_of(lambda: embed.Embed(m.EmbedRequest(inputs=""))) == grpc.StatusCode.INVALID_ARGUMENT
    # Over the model's maximum with truncate off (proto3's default): refused, as TEI does.
    long_text = "word " * 3000
    with pytest.raises(grpc.RpcError) as refused:
        embed.Embed(m.EmbedRequest(inputs=long_text))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "set truncate to true" in refused.value.details()
    assert (
        code_of(lambda: embed.Embed(m.EmbedRequest(inputs="a", prompt_name="nope"))) == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(lambda: embed.Embed(m.EmbedRequest(inputs="a", truncation_direction=5)))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    # The first bad message ends the stream with its status, after the answers before it.
    messages = [m.EmbedRequest(inputs=t, truncate=True) for t in (texts[0], texts[1], "", texts[2])]
    got = []
    with pytest.raises(grpc.RpcError) as ended:
        for answer in embed.EmbedStream(iter(messages)):
            got.append(answer)
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(got) == 2
    # A stream of many messages answers every one, in order.
    many = [texts[i % len(texts)] + f" {i}" for i in range(150)]
    answers = list(embed.EmbedStream(iter([m.EmbedRequest(inputs=t, truncate=True, normalize=True) for t in many])))
    assert len(answers) == 150
    want = f32(srv.post("/embed", {"inputs": many[:150:37]}).json())
    np.testing.assert_array_equal(f32([a.embeddings for a in answers[::37]]), want)
    # A method no service has.
    unknown = channel.unary_unary(
        "/tei.v1.Nope/Nope", request_serializer=lambda x: x, response_deserializer=lambda x: x
    )
    assert code_of(lambda: unknown(b"")) == grpc.StatusCode.UNIMPLEMENTED


def test_calls_are_counted_and_failures_logged(pb, served):
    (m, stubs), (srv, channel) = pb, served
    stubs.InfoStub(channel).Info(m.InfoRequest())
    with pytest.raises(grpc.RpcError):
        stubs.EmbedStub(channel).Embed(m.EmbedRequest(inputs=""))
    metrics = srv.get("/metrics").text
    counts = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("mlx_embed_grpc_requests_total{")
    }
    assert counts['mlx_embed_grpc_requests_total{method="/tei.v1.Info/Info",code="OK"}'] >= 2
    assert counts['mlx_embed_grpc_requests_total{method="/tei.v1.Embed/Embed",code="INVALID_ARGUMENT"}'] >= 1
    assert counts['mlx_embed_grpc_requests_total{method="/tei.v1.Embed/EmbedStream",code="OK"}'] >= 1
    log = srv.log()
    assert "gRPC call done" in log and "code=INVALID_ARGUMENT" in log and "method=/tei.v1.Embed/Embed" in log


def test_health_answers_what_http_health_answers(served, health):
    """A Kubernetes `grpc:` probe or grpc_health_probe: SERVING for the server
    ("") and each tei.v1 service while /health says 200; NOT_FOUND for a
    service the server does not have; a watch starts with the status now."""
    (srv, channel), (h, stubs) = served, health
    probe = stubs.HealthStub(channel)
    assert srv.get("/health").status_code == 200
    for service in ["", *SERVICES]:
        answer = probe.Check(h.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == h.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as unknown:
        probe.Check(h.HealthCheckRequest(service="tei.v1.Nope"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    watch = probe.Watch(h.HealthCheckRequest(service="tei.v1.Embed"))
    assert next(watch).status == h.HealthCheckResponse.SERVING
    watch.cancel()
    # The standard's Watch: an unknown service is SERVICE_UNKNOWN, not an error.
    watch = probe.Watch(h.HealthCheckRequest(service="tei.v1.Nope"))
    assert next(watch).status == h.HealthCheckResponse.SERVICE_UNKNOWN
    watch.cancel()
    metrics = srv.get("/metrics").text
    assert 'mlx_embed_grpc_requests_total{method="/grpc.health.v1.Health/Check",code="OK"} 6' in metrics
    assert 'mlx_embed_grpc_requests_total{method="/grpc.health.v1.Health/Check",code="NOT_FOUND"} 1' in metrics


def test_reflection_lists_every_service(served):
    """What `grpcurl list` asks (v1, or v1alpha before grpcurl 1.8.8), and the
    descriptors a client builds its calls from."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, channel = served
    want = sorted(
        [
            *SERVICES,
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    )
    assert reflected_services(channel, "v1") == want
    assert reflected_services(channel, "v1alpha") == want
    database = ProtoReflectionDescriptorDatabase(channel)
    assert sorted(database.get_services()) == want
    pool = DescriptorPool(database)
    embed = pool.FindServiceByName("tei.v1.Embed").FindMethodByName("Embed")
    assert embed.input_type.full_name == "tei.v1.EmbedRequest"
    assert embed.output_type.full_name == "tei.v1.EmbedResponse"
    assert pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest").fields_by_name["service"].number == 1


def test_api_key_and_message_size_limit(pb, health, tmp_path):
    m, stubs = pb
    port = free_port()
    srv = start_server(
        tmp_path,
        "--model",
        str(NOMIC),
        "--no-warmup",
        "--api-key",
        "k1",
        "--max-body-bytes",
        "1000",
        env={"MLX_EMBED_GRPC_PORT": str(port)},
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=30)
        embed = stubs.EmbedStub(channel)
        ok = [("authorization", "Bearer k1")]
        for metadata in (None, [("authorization", "Bearer k2")], [("authorization", "k1")]):
            with pytest.raises(grpc.RpcError) as refused:
                embed.Embed(m.EmbedRequest(inputs="hi"), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in refused.value.details()
        assert len(embed.Embed(m.EmbedRequest(inputs="hi"), metadata=ok).embeddings) > 0
        with pytest.raises(grpc.RpcError) as refused:
            embed.Embed(m.EmbedRequest(inputs="x" * 2000), metadata=ok)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-body-bytes" in refused.value.details()
        messages = iter([m.EmbedRequest(inputs="hi"), m.EmbedRequest(inputs="x" * 2000)])
        with pytest.raises(grpc.RpcError) as refused:
            list(embed.EmbedStream(messages, metadata=ok))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # A probe carries no key: health needs none, as /health needs none;
        # reflection describes the API, so it needs the key as /openapi.json does.
        h, health_stubs = health
        assert health_stubs.HealthStub(channel).Check(h.HealthCheckRequest()).status == h.HealthCheckResponse.SERVING
        assert requests.get(srv.url + "/health", timeout=30).status_code == 200
        assert code_of(lambda: reflected_services(channel, "v1")) == grpc.StatusCode.UNAUTHENTICATED
        assert requests.get(srv.url + "/openapi.json", timeout=30).status_code == 401
        assert "tei.v1.Embed" in reflected_services(channel, "v1", metadata=ok)
        metrics = requests.get(srv.url + "/metrics", headers={"Authorization": "Bearer k1"}, timeout=30).text
        assert 'mlx_embed_grpc_requests_total{method="/tei.v1.Embed/Embed",code="UNAUTHENTICATED"} 3' in metrics
        # A shutdown drains the gRPC listener with the HTTP one: the client's
        # open connection is told to go (GOAWAY) and the exit is a clean one.
        assert srv.stop() == 0, srv.log()[-4000:]
        assert "shut down" in srv.log()
    finally:
        channel.close()


def test_info_of_a_classifier_and_a_method_its_model_cannot_answer(pb, tmp_path):
    m, stubs = pb
    port = free_port()
    srv = start_server(tmp_path, "--model", str(CLASSIFIER), "--no-warmup", "--grpc-port", str(port))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        assert stubs.InfoStub(channel).Info(m.InfoRequest()).model_type == m.MODEL_TYPE_CLASSIFIER
        with pytest.raises(grpc.RpcError) as refused:
            stubs.EmbedStub(channel).Embed(m.EmbedRequest(inputs="hi"))
        http = srv.post("/embed", {"inputs": "hi"})
        assert http.status_code == 400
        # TEI's code for a method its model cannot answer (its HTTP says 424),
        # which a client tells from a bad field's INVALID_ARGUMENT.
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == http.json()["error"]
        # The server's own mark of a client's mistake stays in the server.
        assert not [k for k, _ in refused.value.trailing_metadata() if "fault" in k]
        rerank = m.RerankRequest(query="q", texts=["a"])
        assert code_of(lambda: stubs.RerankStub(channel).Rerank(rerank)) == grpc.StatusCode.FAILED_PRECONDITION
        pairs = iter([m.RerankStreamRequest(query="q", text="a")])
        assert code_of(lambda: stubs.RerankStub(channel).RerankStream(pairs)) == grpc.StatusCode.FAILED_PRECONDITION
        answers = stubs.EmbedStub(channel).EmbedSparseStream(iter([m.EmbedSparseRequest(inputs="hi")]))
        assert code_of(lambda: list(answers)) == grpc.StatusCode.FAILED_PRECONDITION
        assert not [k for k, _ in answers.trailing_metadata() if "fault" in k]
        # A bad field is still the request's fault.
        assert (
            code_of(lambda: stubs.PredictStub(channel).Predict(m.PredictRequest(inputs="")))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
    assert srv.stop() == 0, srv.log()[-4000:]
    # The client's mistakes, not the server's failures: no warning (debug, as HTTP's 4xx).
    log = srv.log()
    assert "code=FAILED_PRECONDITION" in log and "gRPC call failed" not in log


def test_a_rerank_stream_holds_no_more_than_one_rerank_body(pb, tmp_path):
    """RerankStream keeps every pair until the client ends the stream: held to
    what one /rerank body may hold (--max-body-bytes), not that per message."""
    m, stubs = pb
    port = free_port()
    srv = start_server(
        tmp_path, "--model", str(RERANKER), "--no-warmup", "--grpc-port", str(port), "--max-body-bytes", "1000"
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        rerank = stubs.RerankStub(channel)
        text = "word " * 20
        small = rerank.RerankStream(
            iter([m.RerankStreamRequest(query="q", text=text, truncate=True) for _ in range(5)])
        )
        assert sorted(r.index for r in small.ranks) == list(range(5))
        # 20 messages of 100 bytes, each under the per-message cap.
        with pytest.raises(grpc.RpcError) as refused:
            rerank.RerankStream(iter([m.RerankStreamRequest(query="q", text=text, truncate=True) for _ in range(20)]))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-body-bytes" in refused.value.details()
        http = srv.post("/rerank", {"query": "q", "texts": [text] * 20})
        assert http.status_code == 413
    assert srv.stop() == 0, srv.log()[-4000:]


def test_no_grpc_listener_without_the_flag(tmp_path):
    srv = start_server(tmp_path, "--model", str(NOMIC), "--no-warmup")
    log = srv.log()
    assert srv.stop() == 0
    assert "grpc://" not in log and "gRPC" not in log


def stop_ends_unavailable(srv, answers) -> None:
    """Stops `srv` with `answers`' stream held open by its client: the server
    exits 0 at once (not after --drain-timeout-secs), and the stream ends
    UNAVAILABLE, "shutting down"."""
    started = time.monotonic()
    assert srv.stop(timeout=20) == 0, srv.log()[-4000:]
    assert time.monotonic() - started < 15
    with pytest.raises(grpc.RpcError) as ended:
        next(answers)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in ended.value.details()


def test_a_shutdown_ends_a_stream_the_client_holds_open(pb, health, tmp_path):
    """A stream held open, idle, does not hold the drain: the messages read are
    answered, then the stream ends UNAVAILABLE and the server exits at once,
    cleanly (it waited for --drain-timeout-secs, then dropped the stream).
    A health watch sees the drain: NOT_SERVING, then it ends, holding nothing."""
    m, stubs = pb
    h, health_stubs = health
    port = free_port()
    srv = start_server(
        tmp_path, "--model", str(NOMIC), "--no-warmup", "--grpc-port", str(port), "--drain-timeout-secs", "60"
    )
    release = threading.Event()

    def held_open():
        yield from (m.EmbedRequest(inputs=f"text {i}", truncate=True) for i in range(3))
        release.wait(90)

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        answers = stubs.EmbedStub(channel).EmbedStream(held_open())
        got = [next(answers) for _ in range(3)]
        watch = health_stubs.HealthStub(channel).Watch(h.HealthCheckRequest())
        assert next(watch).status == h.HealthCheckResponse.SERVING
        try:
            stop_ends_unavailable(srv, answers)
            assert [a.status for a in watch] == [h.HealthCheckResponse.NOT_SERVING]
            assert watch.code() == grpc.StatusCode.OK
        finally:
            release.set()
    assert all(len(a.embeddings) > 0 for a in got)


def test_te_counts_follow_teis_grpc_server(pb, served):
    """TEI's gRPC server counts a unary call in te_request_count (`single`,
    a Rerank `batch`) but a stream's messages in none (its stream() counts
    no request), while each message's input is in te_embed_count."""
    (m, stubs), (srv, channel) = pb, served
    before = srv.get("/metrics").text
    embed, rerank = stubs.EmbedStub(channel), stubs.RerankStub(channel)
    embed.Embed(m.EmbedRequest(inputs="one unary call", truncate=True))
    got = list(embed.EmbedStream(iter([m.EmbedRequest(inputs=f"stream {i}", truncate=True) for i in range(3)])))
    assert len(got) == 3
    rerank.Rerank(m.RerankRequest(query="q", texts=["one", "two"], truncate=True))
    stubs.PredictStub(channel).PredictPair(m.PredictPairRequest(inputs=["a", "pair"], truncate=True))
    after = srv.get("/metrics").text

    def delta(prefix):
        return sample_sum(after, prefix) - sample_sum(before, prefix)

    assert delta('te_request_count{method="single"}') == 2
    assert delta('te_request_count{method="batch"}') == 1
    assert delta('te_request_success{method="single"}') == 2
    assert delta('te_request_success{method="batch"}') == 1
    assert delta("te_request_duration_count") == 3 + 3  # the stream's messages too
    assert delta("te_embed_count ") == delta("te_embed_success ") == 1 + 3
    assert delta("te_predict_count ") == delta("te_predict_success ") == 2 + 1


def test_an_unsent_truncation_direction_cuts_on_the_right_as_teis(pb, tmp_path):
    """TEI's proto declares truncation_direction plain, so an unset one is
    RIGHT, and TEI cuts on the right: a folder that cuts on the left is cut
    on the right over gRPC unless the message says LEFT; over HTTP an unsaid
    direction is the folder's."""
    import shutil

    m, stubs = pb
    folder = tmp_path / "left-cut"
    shutil.copytree(FIXTURES / "tiny-xlm-roberta", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "truncation_side": "left"}))
    port = free_port()
    srv = start_server(tmp_path, "--model", str(folder), "--no-warmup", "--grpc-port", str(port))
    text = "mountains and valleys " * 60 + "the river bank at the end"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            embed = stubs.EmbedStub(channel)
            unset = f32(embed.Embed(m.EmbedRequest(inputs=text, truncate=True, normalize=True)).embeddings)
            left = f32(
                embed.Embed(
                    m.EmbedRequest(
                        inputs=text, truncate=True, normalize=True, truncation_direction=m.TRUNCATION_DIRECTION_LEFT
                    )
                ).embeddings
            )
        http_right = f32(srv.post("/embed", {"inputs": text, "truncation_direction": "right"}).json()[0])
        http_unsaid = f32(srv.post("/embed", {"inputs": text}).json()[0])
        np.testing.assert_array_equal(unset, http_right)
        np.testing.assert_array_equal(left, http_unsaid)
        assert np.abs(unset - http_unsaid).max() > 1e-2
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]


def test_streams_never_read_hold_at_most_the_answer_room(pb, tmp_path):
    """A stream's finished answers (up to 64) wait in it while its client
    does not read; they count in --max-unsent-answers-mb from before they are
    computed, so streams that are never read hold the room and no more: the
    rest of their messages wait for room (and, past --max-queue-wait-ms, end
    their streams RESOURCE_EXHAUSTED). Before, none was counted: 16 such
    streams held up to 16 x 64 answers of 256 KiB (1000 tokens x 64 floats)."""
    m, stubs = pb
    port = free_port()
    room_mb = 8
    srv = start_server(
        tmp_path,
        "--model",
        str(NOMIC),
        "--no-warmup",
        "--grpc-port",
        str(port),
        "--max-unsent-answers-mb",
        str(room_mb),
        "--max-queue-wait-ms",
        "30000",
        "--drain-timeout-secs",
        "5",
    )

    def rss_mib() -> float:
        status = open(f"/proc/{srv.proc.pid}/status").read()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024

    def gauge(name: str) -> float:
        return sample_sum(srv.get("/metrics").text, name + " ")

    release = threading.Event()
    streams, messages = 16, 70

    def never_done(s, n):
        for i in range(n):
            yield m.EmbedAllRequest(inputs=f"stream {s} message {i} " + "word " * 1000, truncate=True)
        release.wait(60)

    # A client that reads nothing at all: grpcio's transport would otherwise
    # take every answer into its own buffers (its window grows as it likes).
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
    calls = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            embed = stubs.EmbedStub(channel)
            # The model's own memory first, on streams of the same shape, read.
            for warm in [embed.EmbedAllStream(never_done(100 + s, 20)) for s in range(4)]:
                assert len([next(warm) for _ in range(20)]) == 20
                warm.cancel()
            rss_before = rss_mib()
            calls = [embed.EmbedAllStream(never_done(s, messages)) for s in range(streams)]
            deadline = time.monotonic() + 60
            while gauge("mlx_embed_http_unsent_answer_bytes") < (room_mb << 20) // 2:
                assert time.monotonic() < deadline, "the unread stream answers were never counted"
                time.sleep(0.1)
            peak_unsent, peak_rss, waiting = 0.0, 0.0, 0.0
            for _ in range(30):  # 3 s of the steady state
                peak_unsent = max(peak_unsent, gauge("mlx_embed_http_unsent_answer_bytes"))
                waiting = max(waiting, gauge("mlx_embed_http_requests_waiting_for_answer_room"))
                peak_rss = max(peak_rss, rss_mib())
                time.sleep(0.1)
            print(
                f"\nunread streams: RSS {rss_before:.1f} -> {peak_rss:.1f} MiB, unsent {peak_unsent / 2**20:.1f} "
                f"MiB, {waiting:.0f} messages waiting for room"
            )
            # The room, plus what one computation reserves over it.
            assert peak_unsent <= (room_mb + 1) << 20, peak_unsent
            assert waiting > 0, "every message was answered: the room bounded nothing"
            # Unbounded, 16 x 64 answers of 256 KiB would be 256 MiB of answers.
            assert peak_rss - rss_before < 256, (rss_before, peak_rss)
            for call in calls:
                call.cancel()
            release.set()
        deadline = time.monotonic() + 30
        while gauge("mlx_embed_http_unsent_answer_bytes") > 0 or gauge(
            "mlx_embed_http_requests_waiting_for_answer_room"
        ):
            assert time.monotonic() < deadline, "the cancelled streams' answers were kept"
            time.sleep(0.1)
    finally:
        release.set()
        for call in calls:
            call.cancel()
        assert srv.stop() == 0, srv.log()[-4000:]


def test_a_read_stream_of_answers_larger_than_the_room_answers_every_message(pb, tmp_path):
    """An answer larger than the whole answer room goes alone, once the room is
    empty, over gRPC as over HTTP: a stream whose client reads each answer
    answers every message. Before, the answer handed to tonic stayed counted
    until the next one was computed, which waited for an empty room: the
    second message waited --max-queue-wait-ms and ended the stream
    RESOURCE_EXHAUSTED."""
    import shutil

    m, stubs = pb
    # The fixture's model, cut at 2,048 tokens rather than 128 (its positions
    # go to 8,192), so that one answer may be larger than the smallest room.
    folder = tmp_path / "long-nomic"
    shutil.copytree(NOMIC, folder)
    for name, key in (("tokenizer_config.json", "model_max_length"), ("sentence_bert_config.json", "max_seq_length")):
        cfg = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**cfg, key: 2048}))
    port = free_port()
    srv = start_server(
        tmp_path,
        "--model",
        str(folder),
        "--no-warmup",
        "--grpc-port",
        str(port),
        "--max-unsent-answers-mb",
        "1",
        "--max-queue-wait-ms",
        "2000",
    )
    # 5,000 bytes: room is kept for up to 2,048 rows of 64 floats (1.7 MB
    # told), more than the 1 MiB room; each answer is ~1,000 rows.
    messages = [m.EmbedAllRequest(inputs=f"message {i} " + "word " * 1000, truncate=True) for i in range(3)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            answers = list(stubs.EmbedStub(channel).EmbedAllStream(iter(messages)))
        assert [len(a.token_embeddings) > 1000 for a in answers] == [True] * 3
        deadline = time.monotonic() + 10
        while sample_sum(srv.get("/metrics").text, "mlx_embed_http_unsent_answer_bytes ") > 0:
            assert time.monotonic() < deadline, "a finished stream's answers stayed counted"
            time.sleep(0.1)
    finally:
        assert srv.stop() == 0, srv.log()[-4000:]


def test_a_shutdown_ends_an_open_reflection_stream(tmp_path):
    """A reflection stream its client holds open, idle, does not hold the
    drain: it ends UNAVAILABLE and the server exits at once, 0 (it waited for
    --drain-timeout-secs before)."""
    from grpc_reflection.v1alpha import reflection_pb2 as r

    port = free_port()
    srv = start_server(
        tmp_path, "--model", str(NOMIC), "--no-warmup", "--grpc-port", str(port), "--drain-timeout-secs", "60"
    )
    release = threading.Event()

    def held_open():
        yield r.ServerReflectionRequest(list_services="")
        release.wait(90)

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=r.ServerReflectionRequest.SerializeToString,
            response_deserializer=r.ServerReflectionResponse.FromString,
        )
        answers = info(held_open())
        first = next(answers)
        assert "tei.v1.Embed" in [s.name for s in first.list_services_response.service]
        try:
            stop_ends_unavailable(srv, answers)
        finally:
            release.set()
