"""Bad input on all four embed routes: exact status and error body, and the
server healthy after each one."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest
import requests

# route -> (path, name of the input field)
ROUTES = {
    "native": ("/api/v1/embed", "texts"),
    "openai": ("/v1/embeddings", "input"),
    "tei": ("/embed", "inputs"),
    "ollama": ("/api/embed", "input"),
}
# What serde says each route's input field should be.
EXPECTED_INPUT = {
    "native": "a sequence",
    "openai": "a string, an array of strings, an array of token ids, or an array of arrays of token ids",
    "tei": "a string, an array of token ids, or an array of strings and arrays of token ids",
    "ollama": "a string or an array of strings",
}
PARSE = "Failed to parse the request body as JSON: "
SHAPE = "Failed to deserialize the JSON body into the target type: "
POSITION = re.compile(r" at line \d+ column \d+")
SURROGATE_HINT = (" (a \\uXXXX escape needs four hex digits, and one in \\uD800-\\uDFFF must be followed "
                  "by the other half of its surrogate pair: lone surrogates are not text)")


def error_body(route: str, status: int, message: str, *, param=None, code=None):
    """The exact error body each API answers with (see crates/mlx-embed-server/src/errors.rs)."""
    kind = "invalid_request_error"
    if route == "native":
        return {"error": {"message": message, "type": kind, "code": status}}
    if route == "openai":
        return {"error": {"message": message, "type": kind, "param": param, "code": code}, "detail": message}
    if route == "tei":
        return {"error": message, "error_type": "Validation"}
    return {"error": message}


def message_of(route: str, body) -> str:
    return body["error"]["message"] if route in ("native", "openai") else body["error"]


def with_message(route: str, body, message: str):
    body = json.loads(json.dumps(body))
    if route in ("native", "openai"):
        body["error"]["message"] = message
        if "detail" in body:
            body["detail"] = message
    else:
        body["error"] = message
    return body


def post_raw(server, path: str, data: bytes, content_type: str | None = "application/json"):
    headers = {"content-type": content_type} if content_type else {}
    return requests.post(server.url + path, data=data, headers=headers, timeout=60)


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()


def cases():
    """(id, route, raw body, content type, status, message, param, code, serde_position)."""
    out = []

    def add(name, route, data, status, message, *, ctype="application/json", param=None, code=None, pos=False):
        if route in ("ollama", "openai") and status == 422:
            status = 400  # Ollama and OpenAI answer a body of the wrong shape with 400
        out.append(pytest.param(route, data, ctype, status, message, param, code, pos, id=f"{route}-{name}"))

    for route, (_, f) in ROUTES.items():
        want = EXPECTED_INPUT[route]
        add("malformed-json", route, b'{"%s": ["a"' % f.encode(), 400,
            f"{PARSE}{f}: EOF while parsing a list", code="invalid_json", pos=True)
        add("empty-body", route, b"", 400, f"{PARSE}EOF while parsing a value", code="invalid_json", pos=True)
        if route != "ollama":
            # Ollama reads any body as JSON, as Ollama does (test_ollama.py).
            for ctype in ("text/plain", None):
                add(f"content-type-{ctype}", route, dumps({f: ["a"]}), 415,
                    "expected a request with `Content-Type: application/json`", ctype=ctype)
        add("two-byte-order-marks", route, b"\xef\xbb\xbf" * 2 + dumps({f: ["a"]}), 400,
            f"{PARSE}expected value", code="invalid_json", pos=True)
        add("body-over-limit", route, dumps({f: ["a" * (2 * 1024 * 1024)]}), 413,
            "request body is larger than the limit of 2097152 bytes (--max-body-bytes)")
        add("ten-mb-string", route, dumps({f: ["b" * (10 * 1024 * 1024)]}), 413,
            "request body is larger than the limit of 2097152 bytes (--max-body-bytes)")
        if route != "ollama":
            # Ollama answers no input with no embeddings (test_ollama.py).
            add("field-missing", route, dumps({"other": ["a"]}), 422, f"{SHAPE}missing field `{f}`",
                param=f, code="missing_required_parameter", pos=True)
            add("field-null", route, dumps({f: None}), 422, f"{SHAPE}{f}: invalid type: null, expected {want}",
                param=f, code="invalid_type", pos=True)
        add("field-number", route, dumps({f: 3}), 422,
            f"{SHAPE}{f}: invalid type: integer `3`, expected {want}", param=f, code="invalid_type", pos=True)
        if route == "openai":
            add("list-with-number", route, dumps({f: ["a", 3]}), 422,
                f"{SHAPE}{f}: the array mixes strings, token ids and token-id arrays; use one form", param=f,
                pos=True)
            # OpenAI's `input` takes one form per list; TEI's takes texts beside id lists.
            add("texts-with-id-lists", route, dumps({f: ["a", [101, 102]]}), 422,
                f"{SHAPE}{f}: the array mixes strings, token ids and token-id arrays; use one form", param=f,
                pos=True)
        if route == "tei":
            add("list-with-number", route, dumps({f: ["a", 3]}), 422,
                f"{SHAPE}{f}: the array mixes token ids with strings or token-id arrays; put each input's ids "
                "in an array of their own", param=f, pos=True)
        if route in ("openai", "tei"):
            add("list-with-null", route, dumps({f: ["a", None]}), 422,
                f'{SHAPE}{f}[1]: invalid type: null, expected a string, a {{"text": string}} object, a token id, '
                "or an array of token ids",
                param=f, code="invalid_type", pos=True)
        else:
            add("list-with-number", route, dumps({f: ["a", 3]}), 422,
                f"{SHAPE}{f}[1]: invalid type: integer `3`, expected a string", param=f, code="invalid_type", pos=True)
            add("list-with-null", route, dumps({f: ["a", None]}), 422,
                f"{SHAPE}{f}[1]: invalid type: null, expected a string", param=f, code="invalid_type", pos=True)
        if route != "ollama":
            add("empty-list", route, dumps({f: []}), 400, "input is empty: send at least one text", param="input")
        if route != "ollama":  # Ollama embeds an empty text in a list (tests/e2e/test_ollama.py)
            add("empty-string-in-list", route, dumps({f: ["ok", ""]}), 400, "input 1 is an empty string",
                param="input")
        if route not in ("native", "ollama"):
            add("empty-string", route, dumps({f: ""}), 400, "input 0 is an empty string", param="input")
        add("100k-inputs", route, dumps({f: ["x"] * 100_000}), 413,
            "100000 inputs is more than the limit of 2048 per request (--max-inputs-per-request); "
            "split the request", param="input")
        add("invalid-utf8", route, b'{"%s": ["ok \xff\xfe bytes"]}' % f.encode(), 400,
            f"{PARSE}{f}[0]: invalid unicode code point", code="invalid_json", pos=True)
        # Decision: a lone surrogate is not text, so it is malformed JSON for us (400),
        # never silently replaced with U+FFFD.
        add("lone-high-surrogate", route, b'{"%s": ["\\ud800"]}' % f.encode(), 400,
            f"{PARSE}{f}[0]: unexpected end of hex escape{SURROGATE_HINT}", code="invalid_json", pos=True)
        add("lone-low-surrogate", route, b'{"%s": ["ok", "x\\udc00y"]}' % f.encode(), 400,
            f"{PARSE}{f}[1]: lone leading surrogate in hex escape{SURROGATE_HINT}", code="invalid_json",
            pos=True)
        # Ollama reads 0 as none, as Ollama does (test_dimensions_bounds_accepted).
        for dims in (-1, 385, -(2**63)) if route == "ollama" else (0, -1, 385, -(2**63)):
            add(f"dimensions-{dims}", route, dumps({f: ["hi"], "dimensions": dims}), 400,
                f"dimensions must be between 1 and the model's dimension 384, got {dims}", param="dimensions")
        add("dimensions-float", route, dumps({f: ["hi"], "dimensions": 1.5}), 422,
            f"{SHAPE}dimensions: invalid type: floating point `1.5`, expected i64", param="dimensions", code="invalid_type", pos=True)
        add("dimensions-too-big-for-i64", route, b'{"%s": ["hi"], "dimensions": 99999999999999999999}' % f.encode(),
            422, f"{SHAPE}dimensions: invalid type: floating point `1e+20`, expected i64", param="dimensions", code="invalid_type", pos=True)
        if route in ("openai", "tei"):
            add("nested-too-deep", route, dumps({f: [[[1]]]}), 422,
                f"{SHAPE}{f}[0][0]: invalid type: sequence, expected u32", param=f, code="invalid_type", pos=True)
            add("nested-5000-deep", route, b'{"%s": ' % f.encode() + b"[" * 5000 + b"]" * 5000 + b"}", 422,
                f"{SHAPE}{f}[0][0]: invalid type: sequence, expected u32", param=f, code="invalid_type", pos=True)
        else:
            add("nested-too-deep", route, dumps({f: [["a"]]}), 422,
                f"{SHAPE}{f}[0]: invalid type: sequence, expected a string", param=f, code="invalid_type", pos=True)
            add("nested-5000-deep", route, b'{"%s": ' % f.encode() + b"[" * 5000 + b"]" * 5000 + b"}", 422,
                f"{SHAPE}{f}[0]: invalid type: sequence, expected a string", param=f, code="invalid_type", pos=True)

    # OpenAI only: encoding_format.
    add("encoding-format-hex", "openai", dumps({"input": "hi", "encoding_format": "hex"}), 422,
        f"{SHAPE}encoding_format: unknown variant `hex`, expected one of `float`, `float16`, `base64`, `int8`, "
        "`uint8`, `binary`, `ubinary`",
        param="encoding_format", code="invalid_value", pos=True)
    add("encoding-format-null-ok-but-number", "openai", dumps({"input": "hi", "encoding_format": 1}), 422,
        f"{SHAPE}encoding_format: invalid type: integer `1`, expected a string or a list of strings",
        param="encoding_format", code="invalid_type", pos=True)
    # OpenAI and TEI: token ids.
    for route in ("openai", "tei"):
        f = ROUTES[route][1]
        add("token-id-at-vocab-size", route, dumps({f: [101, 30522]}), 400,
            "input 0: token id 30522 at position 1 is outside the vocabulary (ids must be below 30522)",
            param="input")
        add("token-id-far-out", route, dumps({f: [[101, 7592, 102], [7592, 99999999]]}), 400,
            "input 1: token id 99999999 at position 1 is outside the vocabulary (ids must be below 30522)",
            param="input")
        add("token-id-over-u32", route, dumps({f: [1, 4294967296]}), 422,
            f"{SHAPE}{f}[1]: token id 4294967296 is out of range", param=f, pos=True)
        add("token-id-negative", route, dumps({f: [-1]}), 422,
            f"{SHAPE}{f}[0]: token id -1 is negative", param=f, pos=True)
        add("empty-token-list", route, dumps({f: [[7592], []]}), 400, "input 1 is an empty token list",
            param="input")
    return out


@pytest.mark.parametrize("route,data,ctype,status,message,param,code,pos", cases())
def test_bad_input_exact_status_and_body(server, route, data, ctype, status, message, param, code, pos):
    path = ROUTES[route][0]
    resp = post_raw(server, path, data, ctype)
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    got = message_of(route, body)
    if pos:
        # serde's position is exact but uninteresting; require it once and compare the rest.
        assert len(POSITION.findall(got)) == 1, got
        body = with_message(route, body, POSITION.sub("", got))
    assert body == error_body(route, status, message, param=param, code=code)
    assert server.healthy()


def first_vector(route: str, body) -> np.ndarray:
    if route == "native":
        return np.asarray(body["embeddings"][0], dtype=np.float32)
    if route == "openai":
        return np.asarray(body["data"][0]["embedding"], dtype=np.float32)
    if route == "tei":
        return np.asarray(body[0], dtype=np.float32)
    return np.asarray(body["embeddings"][0], dtype=np.float32)


@pytest.mark.parametrize("route", list(ROUTES))
def test_control_and_zero_width_characters_embed(server, route):
    path, f = ROUTES[route]
    # BERT's normalizer drops control (Cc) and format (Cf) characters, so these
    # texts are the same as their visible letters.
    weird = ["a\u0000b\u0007\u200b\u200d\ufeffc", "zero\u200bwidth\u2060joiner", "bell\u0007\u001bescape"]
    plain = ["abc", "zerowidthjoiner", "bellescape"]
    for w, p in zip(weird, plain):
        got = post_raw(server, path, dumps({f: [w]}))
        assert got.status_code == 200, got.text
        ref = post_raw(server, path, dumps({f: [p]}))
        assert ref.status_code == 200, ref.text
        v, r = first_vector(route, got.json()), first_vector(route, ref.json())
        assert v.shape == (384,)
        np.testing.assert_allclose(v, r, atol=1e-6, err_msg=repr(w))
    assert server.healthy()


@pytest.mark.parametrize("route", list(ROUTES))
def test_dimensions_bounds_accepted(server, route):
    path, f = ROUTES[route]
    one = post_raw(server, path, dumps({f: ["hello"], "dimensions": 1}))
    assert one.status_code == 200, one.text
    v = first_vector(route, one.json())
    # One component, renormalized: exactly +1 or -1.
    assert v.shape == (1,) and abs(v[0]) == 1.0
    full = post_raw(server, path, dumps({f: ["hello"], "dimensions": 384}))
    assert full.status_code == 200
    assert first_vector(route, full.json()).shape == (384,)
    if route == "ollama":
        # Go clients send a field's zero value when it is not set: Ollama reads it as none.
        none = post_raw(server, path, dumps({f: ["hello"], "dimensions": 0}))
        assert none.status_code == 200, none.text
        np.testing.assert_array_equal(first_vector(route, none.json()), first_vector(route, full.json()))


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("coding", ["gzip", "deflate, gzip"])
def test_compressed_body_is_415(server, route, coding):
    """A compressed body is refused before it is read, in the route's error
    shape, with `Accept-Encoding: identity`; `identity` is no compression."""
    path, f = ROUTES[route]
    resp = requests.post(server.url + path, data=gzip.compress(dumps({f: ["a"]})), timeout=60,
                         headers={"content-type": "application/json", "content-encoding": coding})
    assert resp.status_code == 415, resp.text
    assert resp.headers["accept-encoding"] == "identity"
    message = f"request bodies must not be compressed (Content-Encoding: {coding})"
    assert resp.json() == error_body(route, 415, message)
    resp = requests.post(server.url + path, data=dumps({f: ["a"]}), timeout=60,
                         headers={"content-type": "application/json", "content-encoding": "identity"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_leading_byte_order_mark_is_skipped(server, route):
    """RFC 8259 8.1: a parser may ignore a leading BOM (Windows tools write one)."""
    path, f = ROUTES[route]
    body = dumps({f: ["hello world"]})
    with_bom = post_raw(server, path, b"\xef\xbb\xbf" + body)
    assert with_bom.status_code == 200, with_bom.text
    plain = post_raw(server, path, body).json()
    assert np.array_equal(first_vector(route, with_bom.json()), first_vector(route, plain))


def test_token_id_last_in_vocab_accepted(server):
    resp = post_raw(server, "/v1/embeddings", dumps({"input": [101, 30521, 102]}))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == 3  # as given: nothing is added


@pytest.mark.parametrize("route", list(ROUTES))
def test_deep_nesting_in_an_ignored_field_is_harmless(server, route):
    # Unknown fields are ignored; a million-deep array there (just under the
    # body limit) must neither overflow the stack nor change the answer.
    path, f = ROUTES[route]
    depth = 1_000_000
    data = b'{"%s": ["hello"], "extra": ' % f.encode() + b"[" * depth + b"]" * depth + b"}"
    assert len(data) < 2 * 1024 * 1024
    resp = post_raw(server, path, data)
    assert resp.status_code == 200, resp.text[:500]
    ref = post_raw(server, path, dumps({f: ["hello"]}))
    np.testing.assert_allclose(first_vector(route, resp.json()), first_vector(route, ref.json()), atol=1e-6)
    assert server.healthy()


def test_server_serves_normally_after_bad_input(server, golden):
    texts, reference = golden
    resp = post_raw(server, "/api/v1/embed", dumps({"texts": texts[:3]}))
    assert resp.status_code == 200
    got = np.asarray(resp.json()["embeddings"], dtype=np.float32)
    np.testing.assert_allclose(got, reference[:3], atol=1e-5)
