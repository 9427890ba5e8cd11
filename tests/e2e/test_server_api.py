"""The four embed routes, the OpenAI client, limits and concurrency, against the real server."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import re

import numpy as np
import openai
import pytest

from harness import cosine_rows, non_empty_golden

ROUTES = {
    "native": ("/api/v1/embed", lambda texts: {"texts": texts}, lambda r: r["embeddings"]),
    "openai": ("/v1/embeddings", lambda texts: {"input": texts, "model": "all-MiniLM-L6-v2"},
               lambda r: [d["embedding"] for d in sorted(r["data"], key=lambda d: d["index"])]),
    "tei": ("/embed", lambda texts: {"inputs": texts}, lambda r: r),
    "ollama": ("/api/embed", lambda texts: {"model": "all-MiniLM-L6-v2", "input": texts}, lambda r: r["embeddings"]),
}


def embed_via(server, route: str, texts: list[str]) -> np.ndarray:
    path, make_body, extract = ROUTES[route]
    resp = server.post(path, make_body(texts))
    assert resp.status_code == 200, resp.text
    return np.asarray(extract(resp.json()), dtype=np.float32)


@pytest.mark.parametrize("encoding", ["base64", "float"])
def test_openai_client_matches_golden(server, golden, encoding):
    texts, reference = golden
    # The API refuses empty strings (400), so the golden row for "" is left out.
    keep = [i for i, t in enumerate(texts) if t != ""]
    texts, reference = [texts[i] for i in keep], reference[keep]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    if encoding == "base64":
        result = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client's default
    else:
        result = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float")
    got = np.asarray([d.embedding for d in sorted(result.data, key=lambda d: d.index)], dtype=np.float32)
    assert got.shape == reference.shape
    assert cosine_rows(got, reference).min() >= 0.99999
    assert np.abs(got - reference).max() <= 1e-5
    assert result.usage.prompt_tokens > len(texts)


def test_four_routes_agree(server, golden):
    texts = golden[0][:3] + golden[0][4:9]  # row 3 is "", which the API refuses
    results = {route: embed_via(server, route, texts) for route in ROUTES}
    for route, vectors in results.items():
        assert vectors.shape == (8, 384), route
        np.testing.assert_allclose(vectors, results["native"], atol=1e-6, err_msg=route)
    np.testing.assert_allclose(results["native"], np.concatenate([golden[1][:3], golden[1][4:9]]), atol=1e-5)


def test_native_response_shape(server):
    body = server.post("/api/v1/embed", {"texts": ["hello world", "second"]}).json()
    assert body["model"] == "all-MiniLM-L6-v2"
    assert body["dimension"] == 384
    assert len(body["embeddings"]) == 2
    # [CLS] hello world [SEP] = 4, [CLS] second [SEP] = 3
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "cache_hits": body["usage"]["cache_hits"]}
    again = server.post("/api/v1/embed", {"texts": ["hello world", "second"]}).json()
    assert again["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "cache_hits": 2}


def test_dimensions_keeps_prefix_and_renormalizes(server, golden):
    text = golden[0][0]
    full = embed_via(server, "native", [text])[0]
    resp = server.post("/v1/embeddings", {"input": text, "dimensions": 64, "encoding_format": "base64"})
    assert resp.status_code == 200, resp.text
    short = np.frombuffer(base64.b64decode(resp.json()["data"][0]["embedding"]), dtype="<f4")
    assert short.shape == (64,)
    expected = full[:64] / np.linalg.norm(full[:64])
    np.testing.assert_allclose(short, expected, atol=1e-6)
    tei = server.post("/embed", {"inputs": text, "dimensions": 64}).json()
    np.testing.assert_allclose(np.asarray(tei[0]), expected, atol=1e-6)


def test_token_id_input_equals_text(server):
    """Token ids run as given, as vLLM and TEI run them: "hello world" in the
    MiniLM vocabulary with its [CLS]/[SEP], as /tokenize lists them, is the
    text's vector; nothing is added to ids without them (TEI's route), and
    the OpenAI route refuses those as another tokenizer's."""
    by_text = server.post("/v1/embeddings", {"input": "hello world"}).json()["data"][0]["embedding"]
    listed = [t["id"] for t in server.post("/tokenize", {"inputs": "hello world"}).json()[0]]
    assert listed == [101, 7592, 2088, 102]
    by_ids = server.post("/v1/embeddings", {"input": listed}).json()
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], by_text, atol=1e-6)
    assert by_ids["usage"]["prompt_tokens"] == 4
    by_id_lists = server.post("/v1/embeddings", {"input": [listed, [101, 7592, 102]]}).json()["data"]
    assert len(by_id_lists) == 2
    np.testing.assert_allclose(by_id_lists[0]["embedding"], by_text, atol=1e-6)
    by_hello = server.post("/v1/embeddings", {"input": "hello"}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(by_id_lists[1]["embedding"], by_hello, atol=1e-6)
    # TEI's /embed takes the same forms.
    tei = server.post("/embed", {"inputs": [listed, [101, 7592, 102]]}).json()
    np.testing.assert_allclose(tei, [by_text, by_hello], atol=1e-6)
    # TEI's `inputs` may also mix texts and id lists in one list (its `Input` is
    # a list of either); each runs as it would alone, in order.
    mixed = server.post("/embed", {"inputs": ["hello world", [101, 7592, 102], "hello"]})
    assert mixed.status_code == 200, mixed.text
    np.testing.assert_allclose(mixed.json(), [by_text, by_hello, by_hello], atol=1e-6)
    root = server.post("/", {"inputs": [[101, 7592, 102], "hello world"]})
    assert root.status_code == 200, root.text
    np.testing.assert_allclose(root.json(), [by_hello, by_text], atol=1e-6)
    rows = server.post("/embed_all", {"inputs": ["hello world", [101, 7592, 102]]})
    assert rows.status_code == 200, rows.text
    assert [len(r) for r in rows.json()] == [4, 3]
    # Without the specials the ids are another input, run as sent on TEI's route.
    bare = server.post("/embed", {"inputs": [7592, 2088]})
    assert bare.status_code == 200, bare.text
    assert float(np.dot(bare.json()[0], by_text)) < 0.999
    # The OpenAI route (and vLLM's /pooling) refuses them: LangChain's default
    # sends tiktoken's ids ("hello world" is [15339, 1917] there), which
    # would get another text's vector with a 200.
    for path, body in (
        ("/v1/embeddings", {"input": [[15339, 1917]], "model": "all-MiniLM-L6-v2"}),
        ("/v1/embeddings", {"input": [listed, [7592, 2088]]}),
        ("/pooling", {"input": [7592, 2088, 102]}),
    ):
        refused = server.post(path, body)
        assert refused.status_code == 400, f"{path}: {refused.text}"
        message = refused.json()["error"]["message"]
        assert "begin with [CLS] (101) and end with [SEP] (102)" in message, message
        assert "check_embedding_ctx_length=False" in message and "  " not in message, message
    # Over the model's 256 tokens, ids in [CLS] ... [SEP] are cut inside them like
    # text (the vector is the truncated text's), or refused on request.
    long = [101] + [7592] * 300 + [102]
    cut = server.post("/v1/embeddings", {"input": [long]}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    as_text = server.post("/v1/embeddings", {"input": "hello " * 300}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(cut["data"][0]["embedding"], as_text, atol=1e-6)
    refused = server.post("/v1/embeddings", {"input": [long], "truncate": False})
    assert refused.status_code == 400, refused.text  # as OpenAI refuses an over-long input
    assert refused.json()["error"]["code"] == "context_length_exceeded", refused.text


def test_64_concurrent_clients_get_their_own_vectors(server):
    texts = [f"concurrent client {i} writes about topic number {i * 7 % 13} and item {i}" for i in range(64)]
    singles = {t: embed_via(server, "native", [t])[0] for t in texts[:16]}

    def call(i):
        route = list(ROUTES)[i % 4]
        return texts[i], embed_via(server, route, [texts[i]])[0]

    with cf.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(call, range(64)))
    assert len(results) == 64
    for text, vector in results:
        # Each answer is for its own text: compare with a fresh single-request result.
        expected = singles[text] if text in singles else embed_via(server, "native", [text])[0]
        np.testing.assert_allclose(vector, expected, atol=1e-5)
    assert len({tuple(np.round(v, 4)) for _, v in results}) == 64


LIMIT_CASES = [
    # (route, body or raw bytes, headers, expected status)
    ("/api/v1/embed", {"texts": []}, None, 400),
    ("/api/v1/embed", {"texts": [""]}, None, 400),
    ("/api/v1/embed", {"texts": ["ok", 3]}, None, 422),
    ("/api/v1/embed", {"wrong": ["ok"]}, None, 422),
    ("/api/v1/embed", b'{"texts": ["unterminated', {"content-type": "application/json"}, 400),
    ("/api/v1/embed", b'{"texts": ["ok"]}', {"content-type": "text/plain"}, 415),
    ("/api/v1/embed", {"texts": ["x"] * 2049}, None, 413),
    ("/v1/embeddings", {"input": "hi", "dimensions": 0}, None, 400),
    ("/v1/embeddings", {"input": "hi", "dimensions": 385}, None, 400),
    # A wrong shape on OpenAI's route: 400, as OpenAI answers (the native route: 422).
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, None, 400),
    ("/v1/embeddings", {"input": [[1, 99999999]]}, None, 400),
    ("/embed", {"inputs": []}, None, 400),
    # Ollama answers no input with no embeddings (and embeds an empty text
    # among others, tests/e2e/test_ollama.py), but a non-string item is refused.
    ("/api/embed", {"model": "m", "input": ["ok", 3]}, None, 400),
]


@pytest.mark.parametrize("path,body,headers,status", LIMIT_CASES)
def test_limits_give_exact_status(server, path, body, headers, status):
    import requests

    if isinstance(body, bytes):
        resp = requests.post(server.url + path, data=body, headers=headers, timeout=30)
    else:
        resp = server.post(path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()
    if path.startswith("/v1/"):
        assert set(error["error"]) >= {"message", "type", "param", "code"}
    elif path in ("/embed", "/api/embed"):
        assert isinstance(error["error"], str) and error["error"]
    else:
        assert error["error"]["message"] and error["error"]["code"] == status
    assert server.healthy()


def test_body_over_limit_is_413(server):
    resp = server.post("/api/v1/embed", {"texts": ["a" * (3 * 1024 * 1024)]})
    assert resp.status_code == 413
    assert server.healthy()


def test_too_long_without_truncation_is_422(server):
    long_text = "word " * 400
    resp = server.post("/api/v1/embed", {"texts": ["short", long_text], "truncate": False})
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert "input 1 " in message and "402" in message  # index 1, 400 words + [CLS] + [SEP]
    ok = server.post("/api/v1/embed", {"texts": ["short", long_text]})
    assert ok.status_code == 200
    assert ok.json()["usage"]["prompt_tokens"] == 3 + 256


def test_a_per_request_cut_is_the_same_on_every_route(server):
    """Cohere's max_tokens, vLLM's truncate_prompt_tokens (embeddings, pooling,
    score), Ollama's options.num_ctx and the native truncate_to cut inputs at
    that many tokens, special tokens included: each route's vector is that of
    the text's first 10 tokens, [CLS] and [SEP] kept (run as token ids)."""
    text = "the quick brown fox jumps over the lazy dog near the quiet river bank at dawn"
    listed = [t["id"] for t in server.post("/tokenize", {"inputs": text}).json()[0]]
    assert len(listed) > 12
    n = 10
    want = server.post("/v1/embeddings", {"input": [listed[: n - 1] + listed[-1:]]}).json()["data"][0]["embedding"]
    got = {
        "native": server.post("/api/v1/embed", {"texts": [text], "truncate_to": n}).json()["embeddings"][0],
        "openai/vllm": server.post("/v1/embeddings", {"input": text, "truncate_prompt_tokens": n}).json()["data"][0][
            "embedding"
        ],
        "pooling": server.post("/pooling", {"input": text, "truncate_prompt_tokens": n}).json()["data"][0]["data"],
        "cohere": server.post("/v2/embed", {"texts": [text], "max_tokens": n, "embedding_types": ["float"]}).json()[
            "embeddings"
        ]["float"][0],
        "ollama": server.post("/api/embed", {"input": text, "options": {"num_ctx": n}}).json()["embeddings"][0],
        # Ollama reads JSON numbers as float64: 10.0 is 10 there.
        "ollama float": server.post("/api/embed", {"input": text, "options": {"num_ctx": float(n)}}).json()[
            "embeddings"
        ][0],
    }
    # The text's own ids at vLLM's cut: the same vector (ids kept their last k
    # as sent, cosine 0.84 to the text's); vLLM's truncation_side "left" keeps
    # the end of both, [CLS] and [SEP] kept.
    got["openai/vllm ids"] = server.post("/v1/embeddings", {"input": [listed], "truncate_prompt_tokens": n}).json()[
        "data"][0]["embedding"]
    for route, vector in got.items():
        assert float(np.dot(want, vector)) >= 0.99999, route
    end = server.post("/v1/embeddings", {"input": [listed[:1] + listed[-n + 1:]]}).json()["data"][0]["embedding"]
    for body in ({"input": text}, {"input": [listed]}):
        left = server.post("/v1/embeddings", {**body, "truncate_prompt_tokens": n, "truncation_side": "left"})
        assert float(np.dot(end, left.json()["data"][0]["embedding"])) >= 0.99999, body
    usage = server.post("/v1/embeddings", {"input": [text, "short"], "truncate_prompt_tokens": n}).json()["usage"]
    assert usage["prompt_tokens"] == n + 3
    # vLLM's score of the cut text against itself cut the same way.
    score = server.post("/score", {"text_1": text, "text_2": " ".join(text.split()[:6]), "truncate_prompt_tokens": 8})
    assert score.status_code == 200, score.text
    assert score.json()["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    # A cut over the model's 256 tokens is the model's; none is a 400/422.
    assert server.post("/api/v1/embed", {"texts": [text], "truncate_to": 100000}).status_code == 200
    # With truncation off a longer input is refused at the cut, not the model's maximum.
    refused = server.post("/api/v1/embed", {"texts": [text], "truncate_to": n, "truncate": False})
    assert refused.status_code == 422, refused.text
    assert f"{len(listed)} tokens, more than the request's cut of {n}" in refused.text, refused.text
    refused = server.post("/v2/embed", {"texts": [text], "max_tokens": n, "truncate": "NONE"})
    assert refused.status_code == 400, refused.text
    # Too short to hold [CLS] and [SEP] with any text, or not a count.
    short = server.post("/api/v1/embed", {"texts": [text], "truncate_to": 2})
    assert short.status_code == 400 and "leaves no room for text" in short.text, short.text
    assert server.post("/api/v1/embed", {"texts": [text], "truncate_to": 0}).status_code == 400
    assert server.post("/api/embed", {"input": text, "options": {"num_ctx": -1}}).status_code == 400


def test_nvidia_nim_truncate_on_the_openai_route(server):
    """NVIDIA NIM's embeddings API takes `truncate` as NONE, START or END, and its
    clients send it on every call (LangChain's NVIDIAEmbeddings, Haystack's
    Nvidia embedders, the OpenAI client with NIM's documented
    `extra_body={"input_type": ..., "truncate": ...}`): END keeps an over-long
    input's start, START its end, NONE refuses it as `truncate: false` does."""
    text = "the cat sat on the mat. " * 50 + "quantum fields describe particles. " * 50  # 602 tokens
    native = {side: server.post("/api/v1/embed", {"texts": [text], "truncation_direction": side}).json()[
        "embeddings"][0] for side in ("right", "left")}
    assert float(np.dot(native["right"], native["left"])) < 0.9  # the two ends differ
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def nim(truncate, **extra):
        return client.embeddings.create(model="all-MiniLM-L6-v2", input=[text], encoding_format="float",
                                        extra_body={"input_type": "query", "truncate": truncate, **extra})

    for truncate, side in (("END", "right"), ("START", "left")):
        got = nim(truncate)
        assert got.usage.prompt_tokens == 256
        assert float(np.dot(got.data[0].embedding, native[side])) >= 0.99999, truncate
    # vLLM's truncation_side may say the same end; another is a 400 naming it.
    assert float(np.dot(nim("START", truncation_side="left").data[0].embedding, native["left"])) >= 0.99999
    with pytest.raises(openai.BadRequestError) as conflict:
        nim("END", truncation_side="left")
    assert conflict.value.body["param"] == "truncation_side", conflict.value.body
    with pytest.raises(openai.BadRequestError) as refused:
        nim("NONE")
    assert refused.value.body["code"] == "context_length_exceeded", refused.value.body
    assert "set truncate to END or START" in refused.value.body["message"], refused.value.body
    # An input that fits is answered as any other.
    short = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello world"], encoding_format="float",
                                     extra_body={"truncate": "NONE"})
    assert float(np.dot(short.data[0].embedding, embed_via(server, "native", ["hello world"])[0])) >= 0.99999
    # NONE with Voyage's truncation true is one setting said twice, differently.
    with pytest.raises(openai.BadRequestError) as twice:
        nim("NONE", truncation=True)
    assert twice.value.body["param"] == "truncation", twice.value.body
    # The boolean form is unchanged; an unknown name is a 400 that lists the names.
    assert server.post("/v1/embeddings", {"input": "hi", "truncate": True}).status_code == 200
    wrong = server.post("/v1/embeddings", {"input": "hi", "truncate": "MIDDLE"})
    assert wrong.status_code == 400, wrong.text
    assert wrong.json()["error"]["param"] == "truncate" and "`NONE`, `START` or `END`" in wrong.text, wrong.text


def test_mixedbread_prompt_on_the_openai_route(server):
    """Mixedbread's embeddings API (POST /v1/embeddings, as its SDK and the LlamaIndex
    and LangChain integrations send it) takes `prompt`, a text put before each input,
    beside `normalized` and `dimensions`. Left unread, the answer was each input's
    vector without it: another vector, with a 200. It is the native route's `prompt`."""
    prompt = "Represent this sentence for searching relevant passages: "
    texts = ["why is bread so tasty?", "the river runs to the sea"]
    native = server.post("/api/v1/embed", {"texts": texts, "prompt": prompt}).json()["embeddings"]
    joined = embed_via(server, "native", [prompt + t for t in texts])
    plain = embed_via(server, "native", texts)
    assert cosine_rows(np.asarray(native, dtype=np.float32), joined).min() >= 0.99999
    assert cosine_rows(joined, plain).max() < 0.99  # the prompt changes the vectors
    got = server.post("/v1/embeddings", {"model": "mixedbread-ai/mxbai-embed-large-v1", "input": texts,
                                         "prompt": prompt, "normalized": True, "encoding_format": "float"})
    assert got.status_code == 200, got.text
    vectors = np.asarray([d["embedding"] for d in got.json()["data"]], dtype=np.float32)
    assert cosine_rows(vectors, joined).min() >= 0.99999
    assert got.json()["usage"]["prompt_tokens"] == server.post(
        "/api/v1/embed", {"texts": texts, "prompt": prompt}).json()["usage"]["prompt_tokens"]
    # Matryoshka and unnormalized, as Mixedbread's clients may ask.
    cut = server.post("/v1/embeddings", {"input": texts[:1], "prompt": prompt, "dimensions": 64,
                                         "normalized": False}).json()["data"][0]["embedding"]
    raw = server.post("/api/v1/embed", {"texts": texts[:1], "prompt": prompt, "dimensions": 64,
                                        "normalize": False}).json()["embeddings"][0]
    np.testing.assert_allclose(cut, raw, atol=1e-5)
    # One prompt per request: with prompt_name or input_type too, a 400 naming the field.
    for other in ({"prompt_name": "query"}, {"input_type": "query"}):
        both = server.post("/v1/embeddings", {"input": texts, "prompt": prompt, **other})
        assert both.status_code == 400, both.text
        assert both.json()["error"]["param"] == "prompt", both.text


def test_mixedbread_truncation_strategy_on_the_openai_route(server):
    """Mixedbread's `truncation_strategy` (`start`, `end`, `none`; its clients'
    option) was dropped unread: `start` cut the wrong end and `none` answered a
    cut vector, each with a 200. It is NIM's `truncate` in lowercase."""
    text = "the cat sat on the mat. " * 50 + "quantum fields describe particles. " * 50  # 602 tokens
    native = {side: server.post("/api/v1/embed", {"texts": [text], "truncation_direction": side}).json()[
        "embeddings"][0] for side in ("right", "left")}
    assert float(np.dot(native["right"], native["left"])) < 0.9
    for strategy, side in (("end", "right"), ("start", "left")):
        got = server.post("/v1/embeddings", {"input": [text], "truncation_strategy": strategy})
        assert got.status_code == 200, got.text
        assert got.json()["usage"]["prompt_tokens"] == 256
        assert float(np.dot(got.json()["data"][0]["embedding"], native[side])) >= 0.99999, strategy
    refused = server.post("/v1/embeddings", {"input": [text], "truncation_strategy": "none"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert error["message"].endswith("shorten it or set truncation_strategy to end or start"), error
    clash = server.post("/v1/embeddings", {"input": [text], "truncation_strategy": "start", "truncate": "END"})
    assert clash.status_code == 400, clash.text
    assert clash.json()["error"]["param"] == "truncation_strategy", clash.text
    assert clash.json()["error"]["message"] == (
        "truncate END and truncation_strategy start name different ends to cut: send one"), clash.text


def test_ops_routes(server):
    assert server.get("/health").status_code == 200
    info = server.get("/info").json()
    assert info["dimension"] == 384 and info["max_input_tokens"] == 256
    assert info["details"]["blas"] != "reference"
    # The server's embedded interpreter must reach the same fast path as
    # in-process use, not fall back silently.
    assert info["details"]["elementwise_ops"].startswith("native (")
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == "all-MiniLM-L6-v2"
    spec = server.get("/openapi.json").json()
    for path in ["/api/v1/embed", "/v1/embeddings", "/embed", "/api/embed"]:
        assert path in spec["paths"], path
    metrics = server.get("/metrics").text
    for name in ["batch_size", "queue_wait", "gil_wait", "model_seconds", "padding"]:
        assert name in metrics, name


MEMORY_KINDS = ("active", "cache", "peak")


def mlx_memory_gauges(metrics: str) -> dict[str, int]:
    """``mlx_embed_mlx_memory_bytes{kind="..."} N`` lines of a /metrics body."""
    found = re.findall(r'^mlx_embed_mlx_memory_bytes\{kind="(\w+)"\} (\d+)$', metrics, re.M)
    return {kind: int(value) for kind, value in found}


def test_info_and_metrics_show_mlx_memory(server):
    """The engine's MLX memory reaches /info and /metrics, read at request
    time: after a batch, the peak covers what was active, and both routes
    report the same process-wide figures."""
    resp = server.post("/api/v1/embed", {"texts": ["memory figures " * 40]})
    assert resp.status_code == 200, resp.text
    info = server.get("/info").json()
    memory = info["memory"]
    for kind in MEMORY_KINDS:
        assert isinstance(memory[f"{kind}_bytes"], int) and memory[f"{kind}_bytes"] >= 0, memory
    assert memory["peak_bytes"] >= memory["active_bytes"], memory
    # The weights are live arrays: a loaded model holds at least 1 MB active.
    assert memory["active_bytes"] > 2**20, memory
    # The live details are the same figures, in MB, beside the load-time ones.
    details = info["details"]
    assert float(details["peak_mb"]) >= float(details["active_mb"]) > 1.0, details
    assert float(details["blas_gflops"]) > 0, details
    assert details["dtype"] == "float32"
    # The limit the engine applied at load (0 on the CPU: cache off), in bytes.
    assert memory["cache_limit_bytes"] == int(details["cache_limit_mb"]) * 2**20, (memory, details)

    gauges = mlx_memory_gauges(server.get("/metrics").text)
    assert set(gauges) == {*MEMORY_KINDS, "cache_limit"}, gauges
    assert gauges["peak"] >= gauges["active"] > 2**20, gauges
    # No batch ran in between, and the peak never drops.
    assert gauges["peak"] >= memory["peak_bytes"], (gauges, memory)
    assert gauges["cache_limit"] == memory["cache_limit_bytes"], (gauges, memory)


@pytest.mark.parametrize("streams,threads", [(1, 1), (2, 1), (2, 2)])
def test_pipelined_server_answers_each_client_its_golden_vectors(tmp_path, golden, streams, threads):
    """``--pipeline true`` forces the across-batch overlap on the CPU (the
    engine's default only on a GPU): batch k+1 is queued before batch k is
    collected, with ``--streams 2`` on the other stream than batch k, and
    with ``--model-threads 2`` by two model threads on the one model.
    Concurrent clients still get exactly their own vectors, in order."""
    from harness import start_server

    texts, reference = golden
    srv = start_server(tmp_path, "--no-warmup", "--no-cache", "--pipeline", "true", "--streams", str(streams),
                       "--model-threads", str(threads))
    try:
        info = srv.get("/info").json()
        details = info["details"]
        assert details["pipeline"] == "true"
        assert details.get("streams", "1") == str(streams), details
        assert info["batching"]["model_threads"] == threads
        if threads > 1:
            assert "model threads started" in srv.log() and "threads=2" in re.sub(r"\x1b\[[0-9;]*m", "", srv.log())
        # The bridge read it too, so the model thread runs the pipelined loop.
        assert "pipelines=true" in re.sub(r"\x1b\[[0-9;]*m", "", srv.log()), srv.log()[-3000:]
        # Client i asks for 1-3 consecutive golden texts, so batches mix
        # requests of several sizes (the golden set's empty text is refused: left out).
        usable = [r for r, t in enumerate(texts) if t.strip()]
        spans = [(i % len(usable), 1 + i % 3) for i in range(48)]

        def call(span):
            start, n = span
            rows = [usable[(start + k) % len(usable)] for k in range(n)]
            resp = srv.post("/api/v1/embed", {"texts": [texts[r] for r in rows]})
            assert resp.status_code == 200, resp.text
            return rows, np.asarray(resp.json()["embeddings"], dtype=np.float32)

        with cf.ThreadPoolExecutor(48) as pool:
            results = list(pool.map(call, spans))
        for rows, got in results:
            assert got.shape == (len(rows), reference.shape[1])
            assert cosine_rows(got, reference[rows]).min() >= 0.99999, rows
        batches = re.findall(r"^mlx_embed_batches_total (\d+)$", srv.get("/metrics").text, re.M)
        assert batches and int(batches[0]) >= 2, batches
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_mlx_embed_serve_command(tmp_path, golden):
    """The `mlx-embed serve` console script (Python process hosting the Rust server) serves the same vectors."""
    import sys
    from pathlib import Path

    from harness import start_server

    command = [str(Path(sys.prefix) / "bin" / "mlx-embed"), "serve"]
    srv = start_server(tmp_path, "--no-warmup", command=command)
    try:
        texts, reference = golden
        resp = srv.post("/api/v1/embed", {"texts": texts[:3]})
        assert resp.status_code == 200, resp.text
        np.testing.assert_allclose(np.asarray(resp.json()["embeddings"]), reference[:3], atol=1e-5)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_jinas_embedding_type_and_text_objects(server, golden):
    """Jina AI's request shape on /v1/embeddings: `{"text": ...}` input
    objects are texts, and `embedding_type` is the answer's form (it was
    read past, answering floats to a client that asked for bits)."""
    texts, ref, _ = non_empty_golden(golden, 4)
    ref = ref.astype(np.float32)
    url = "/v1/embeddings"

    def embeddings(body):
        resp = server.post(url, {"input": [{"text": t} for t in texts], **body})
        assert resp.status_code == 200, resp.text
        return [d["embedding"] for d in resp.json()["data"]]

    floats = np.asarray(embeddings({"embedding_type": "float"}), dtype=np.float32)
    assert floats.shape == (4, 384) and cosine_rows(floats, ref).min() >= 0.99999
    bits = np.packbits(floats > 0, axis=1).astype(np.int64)
    assert bits.shape == (4, 48)
    np.testing.assert_array_equal(np.asarray(embeddings({"embedding_type": "ubinary"})), bits)
    np.testing.assert_array_equal(np.asarray(embeddings({"embedding_type": "binary"})), bits - 128)
    decoded = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in embeddings({"embedding_type": "base64"})]
    np.testing.assert_array_equal(np.stack(decoded), floats)
    # The same as Voyage's names for it, and with them where they agree.
    agreeing = {"embedding_type": "binary", "output_dtype": "binary", "encoding_format": "float"}
    np.testing.assert_array_equal(np.asarray(embeddings(agreeing)), bits - 128)
    assert server.post("/pooling", {"input": texts, "embedding_type": "ubinary"}).json()["data"][0]["data"] == \
        bits[0].tolist()

    for body, param, needle in [
        ({"input": ["a"], "embedding_type": "int8"}, "embedding_type", "unknown variant `int8`"),
        ({"input": ["a"], "embedding_type": ["binary"]}, "embedding_type", "invalid type"),
        ({"input": ["a"], "embedding_type": "binary", "encoding_format": "base64"}, "embedding_type",
         "embedding_type binary is encoding_format float with output_dtype binary"),
        ({"input": ["a"], "embedding_type": "base64", "output_dtype": "int8"}, "embedding_type",
         "embedding_type base64 is encoding_format base64 with output_dtype float"),
        ({"input": ["a"], "embedding_type": "ubinary", "normalized": False}, "embedding_type",
         "embedding_type other than float quantizes the unit vector"),
        ({"input": [{"image": "https://example.com/a.png"}]}, "input", "an `image` input is not supported"),
        ({"input": [{"text": "a"}, 101]}, "input", "mixes"),
        ({"input": [{}]}, "input", "missing field `text`"),
    ]:
        resp = server.post(url, body)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param and needle in err["message"], (body, err)


def test_jina_clients_older_encoding_type_name(server, golden):
    """LangChain's JinaEmbeddings and LlamaIndex's JinaEmbedding send the
    answer's form as `encoding_type` (float, binary, ubinary) and unpack the
    bits they asked for: read past, a client asking for bits got floats with
    a 200 and unpacked them into garbage. It is `embedding_type`'s other name."""
    texts, _, _ = non_empty_golden(golden, 4)
    url = "/v1/embeddings"

    def embeddings(body):
        resp = server.post(url, {"input": texts, **body})
        assert resp.status_code == 200, resp.text
        return np.asarray([d["embedding"] for d in resp.json()["data"]])

    floats = embeddings({"encoding_type": "float"}).astype(np.float32)
    np.testing.assert_array_equal(floats, embeddings({}).astype(np.float32))
    bits = np.packbits(floats > 0, axis=1).astype(np.int64)
    np.testing.assert_array_equal(embeddings({"encoding_type": "ubinary"}), bits)
    np.testing.assert_array_equal(embeddings({"encoding_type": "binary"}), bits - 128)
    np.testing.assert_array_equal(embeddings({"encoding_type": "binary", "embedding_type": "binary"}), bits - 128)
    resp = server.post("/pooling", {"input": texts, "encoding_type": "ubinary"})
    assert resp.json()["data"][0]["data"] == bits[0].tolist(), resp.text

    for body, needle in [
        (
            {"input": ["a"], "encoding_type": "binary", "embedding_type": "ubinary"},
            "embedding_type (ubinary) and encoding_type (binary) are the same setting and disagree",
        ),
        (
            {"input": ["a"], "encoding_type": "ubinary", "output_dtype": "binary"},
            "encoding_type ubinary is encoding_format float with output_dtype ubinary",
        ),
        (
            {"input": ["a"], "encoding_type": "ubinary", "normalized": False},
            "encoding_type other than float quantizes the unit vector",
        ),
        ({"input": ["a"], "encoding_type": "int8"}, "unknown variant `int8`"),
    ]:
        resp = server.post(url, body)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert err["param"] == "encoding_type" and needle in err["message"], (body, err)
