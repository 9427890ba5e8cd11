"""Cohere's embed API through Cohere's own Python client (`Client.embed`,
`ClientV2.embed`) against the real server binary: vectors against
sentence-transformers' references, the byte forms against NumPy computed
from the float answer, input_type -> the model's prompts, and bad input."""

from __future__ import annotations

import base64

import cohere
import numpy as np
import pytest

from harness import FIXTURES, NOMIC, cosine_rows, non_empty_golden, start_server

EMBEDDER = "all-MiniLM-L6-v2"


def test_v1_floats_match_sentence_transformers(server, golden):
    texts, ref, _ = non_empty_golden(golden, 12)
    res = cohere.Client(api_key="unused", base_url=server.url).embed(texts=texts, model=EMBEDDER)
    assert res.response_type == "embeddings_floats"
    got = np.asarray(res.embeddings, dtype=np.float32)
    assert got.shape == (12, 384) and cosine_rows(got, ref).min() >= 0.99999
    assert res.texts == texts
    assert res.meta.api_version.version == "1" and res.meta.billed_units.input_tokens > 12


def test_byte_forms_are_the_float_vector_quantized(server, golden):
    texts, ref, _ = non_empty_golden(golden, 6)
    res = cohere.Client(api_key="unused", base_url=server.url).embed(
        texts=texts, model=EMBEDDER, embedding_types=["float", "int8", "uint8", "binary", "ubinary", "base64"])
    assert res.response_type == "embeddings_by_type"
    e = res.embeddings
    f = np.asarray(e.float_, dtype=np.float32)
    assert cosine_rows(f, ref).min() >= 0.99999
    np.testing.assert_array_equal(np.asarray(e.int8), np.round(f * 127).astype(np.int64))
    np.testing.assert_array_equal(np.asarray(e.uint8), np.round(f * 127).astype(np.int64) + 128)
    packed = np.packbits(f > 0, axis=1).astype(np.int64)
    assert packed.shape == (6, 48)
    np.testing.assert_array_equal(np.asarray(e.ubinary), packed)
    np.testing.assert_array_equal(np.asarray(e.binary), packed - 128)
    decoded = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in e.base64])
    np.testing.assert_array_equal(decoded, f)


def test_v2_output_dimension_and_priority(server, golden):
    texts, ref, _ = non_empty_golden(golden, 4)
    co2 = cohere.ClientV2(api_key="unused", base_url=server.url)
    res = co2.embed(texts=texts, model=EMBEDDER, input_type="search_document", embedding_types=["float"],
                    output_dimension=128, priority=-1)
    got = np.asarray(res.embeddings.float_, dtype=np.float32)
    assert got.shape == (4, 128)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert cosine_rows(got, ref[:, :128]).min() >= 0.99999
    # v2 answers by form, float when none is asked for.
    plain = server.post("/v2/embed", {"texts": texts[:1], "model": EMBEDDER, "input_type": "search_query"}).json()
    assert plain["response_type"] == "embeddings_by_type" and list(plain["embeddings"]) == ["float"]


def test_v2_inputs_of_text_content_are_texts(server, golden):
    """Cohere v2's `inputs` form (Embed v4's), text content only: one text
    each, the same vectors as `texts`."""
    texts, ref, _ = non_empty_golden(golden, 5)
    co2 = cohere.ClientV2(api_key="unused", base_url=server.url)
    inputs = [{"content": [{"type": "text", "text": t}]} for t in texts]
    res = co2.embed(inputs=inputs, model=EMBEDDER, input_type="search_document", embedding_types=["float"])
    got = np.asarray(res.embeddings.float_, dtype=np.float32)
    assert got.shape == (5, 384) and cosine_rows(got, ref).min() >= 0.99999
    by_texts = co2.embed(texts=texts, model=EMBEDDER, input_type="search_document", embedding_types=["float"])
    assert res.embeddings.float_ == by_texts.embeddings.float_ and res.texts == texts


def test_input_type_picks_the_models_prompt(nomic, golden):
    texts, _, keep = non_empty_golden(golden, 8)
    co2 = cohere.ClientV2(api_key="unused", base_url=nomic.url)
    for input_type, reference in (("search_query", "query"), ("search_document", "document")):
        res = co2.embed(texts=texts, model="tiny-nomic-bert", input_type=input_type, embedding_types=["float"])
        got = np.asarray(res.embeddings.float_, dtype=np.float32)
        ref = np.load(NOMIC / f"reference_{reference}_normalized.npy")[keep]
        assert cosine_rows(got, ref).min() >= 0.99999, input_type
    for input_type, prompt in (("clustering", "clustering"), ("classification", "classification")):
        res = co2.embed(texts=texts[:2], model="tiny-nomic-bert", input_type=input_type, embedding_types=["float"])
        native = nomic.post("/api/v1/embed", {"texts": texts[:2], "prompt_name": prompt}).json()["embeddings"]
        np.testing.assert_array_equal(np.asarray(res.embeddings.float_, dtype=np.float32),
                                      np.asarray(native, dtype=np.float32))
    # No input_type: the folder's default prompt (document).
    v1 = cohere.Client(api_key="unused", base_url=nomic.url).embed(texts=texts, model="tiny-nomic-bert")
    ref = np.load(NOMIC / "reference_document_normalized.npy")[keep]
    assert cosine_rows(np.asarray(v1.embeddings, dtype=np.float32), ref).min() >= 0.99999


def test_a_text_prefixed_by_its_client_gets_no_default_prompt_on_any_route(nomic, golden):
    """Ollama's users of nomic-embed-text (and frameworks' query_instruction)
    write `search_query: ` themselves: every route embeds that text as the
    query, not as `search_document: search_query: ...`."""
    texts, _, keep = non_empty_golden(golden, 4)
    queries = ["search_query: " + t for t in texts]
    ref = np.load(NOMIC / "reference_query_normalized.npy")[keep]
    answers = {
        "/api/embed": nomic.post("/api/embed", {"model": "tiny-nomic-bert", "input": queries}).json()["embeddings"],
        "/v1/embeddings": [d["embedding"] for d in nomic.post(
            "/v1/embeddings", {"model": "tiny-nomic-bert", "input": queries}).json()["data"]],
        "/embed": nomic.post("/embed", {"inputs": queries}).json(),
        "/api/v1/embed": nomic.post("/api/v1/embed", {"texts": queries}).json()["embeddings"],
    }
    for route, got in answers.items():
        assert cosine_rows(np.asarray(got, dtype=np.float32), ref).min() >= 0.99999, route


MISTRAL = FIXTURES / "tiny-mistral"
# The instruction that makes tiny-mistral's own query prompt in its template.
TASK = "Given a web search query, retrieve relevant passages that answer the query"


def test_serve_instruction_is_the_query_prompt_and_documents_skip_it(tmp_path, golden):
    """`serve --instruction` embeds queries with it, and still lets a caller
    that says it sends documents embed them without it (Cohere's
    search_document, prompt_name "document"); /info shows both prompts."""
    texts, _, keep = non_empty_golden(golden, 8)
    query_ref = np.load(MISTRAL / "reference_query_normalized.npy")[keep]
    plain_ref = np.load(MISTRAL / "reference_last_token_normalized.npy")[keep]
    srv = start_server(tmp_path, "--model", str(MISTRAL), "--instruction", TASK, "--no-warmup")
    try:
        info = srv.get("/info").json()
        assert info["prompts"] == {"query": f"Instruct: {TASK}\nQuery: ", "document": ""}, info
        assert info["default_prompt_name"] == "query", info
        co2 = cohere.ClientV2(api_key="unused", base_url=srv.url)
        for input_type, reference in (("search_query", query_ref), ("search_document", plain_ref)):
            res = co2.embed(texts=texts, model="tiny-mistral", input_type=input_type, embedding_types=["float"])
            assert cosine_rows(np.asarray(res.embeddings.float_, dtype=np.float32), reference).min() >= 0.99999
        # A route that cannot say what an input is gets the instruction.
        openai = srv.post("/v1/embeddings", {"input": texts, "model": "tiny-mistral"}).json()
        got = np.asarray([d["embedding"] for d in openai["data"]], dtype=np.float32)
        assert cosine_rows(got, query_ref).min() >= 0.99999
        tei = srv.post("/embed", {"inputs": texts, "prompt_name": "document"})
        assert tei.status_code == 200, tei.text
        assert cosine_rows(np.asarray(tei.json(), dtype=np.float32), plain_ref).min() >= 0.99999
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_truncate_start_keeps_the_end(server):
    tail = " ".join(f"river{i % 7} bank{i % 5}" for i in range(150))
    long = "mountains and valleys " * 60 + tail
    start = server.post("/v1/embed", {"texts": [long], "truncate": "START"}).json()["embeddings"][0]
    left = server.post("/api/v1/embed", {"texts": [long], "truncation_direction": "left"}).json()["embeddings"][0]
    end = server.post("/v1/embed", {"texts": [long]}).json()["embeddings"][0]
    right = server.post("/api/v1/embed", {"texts": [long]}).json()["embeddings"][0]
    assert start == left and end == right and start != end
    r = server.post("/v1/embed", {"texts": [long], "truncate": "NONE"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "input 0" in message, message  # as Cohere answers
    # In Cohere's words: its truncate is NONE, START or END, not a boolean.
    assert message.endswith("shorten it or set truncate to END or START"), message


@pytest.mark.parametrize("body,status,param,needle", [
    ({"images": ["data:image/png;base64,AAAA"]}, 400, "images", "embeds text: send `texts`"),
    ({"texts": ["a"], "input_type": "image"}, 400, "input_type", "input_type `image` is for images"),
    ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "inputs", "input 0 holds an image: this server embeds text"),
    ({"inputs": [{"content": [{"type": "text", "text": "a"}]},
                 {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     400, "inputs", "input 1 has 2 content items; this server embeds one text per input"),
    ({"inputs": [{"text": "a"}]}, 400, "inputs", "input 0 must be an object with a `content` list"),
    ({"inputs": [{"content": [{"type": "text", "text": 3}]}]}, 400, "inputs", "input 0's content must be"),
    ({"inputs": [{"content": []}]}, 400, "inputs", "input 0 has 0 content items"),
    ({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "a"}]}]}, 400, "inputs", "not both"),
    ({"model": EMBEDDER}, 400, "texts", "texts is required"),
    ({"texts": []}, 400, "input", "input is empty"),
    ({"texts": ["a"], "output_dimension": 0}, 400, "output_dimension",
     "output_dimension must be between 1 and the model's dimension 384, got 0"),
    ({"texts": ["a"], "max_tokens": 0}, 400, "max_tokens", "at least 1 token"),
    ({"texts": ["a"], "embedding_types": []}, 400, "embedding_types", "embedding_types is empty: name at least one"),
    # A wrong shape: 400, as Cohere answers (the native and TEI routes answer 422), naming its field.
    ({"texts": ["a"], "embedding_types": ["float", "hex"]}, 400, "embedding_types", "unknown variant `hex`"),
    ({"texts": ["a"], "input_type": "search"}, 400, "input_type", "unknown variant `search`"),
    ({"texts": ["a"], "truncate": "end"}, 400, "truncate", "unknown variant `end`"),
    # Not a name at all (OpenAI's boolean truncate): the same wrong shape, not malformed JSON.
    ({"texts": ["a"], "truncate": True}, 400, "truncate", "invalid type: boolean `true`, expected a string"),
    ({"texts": ["a"], "input_type": 5}, 400, "input_type", "invalid type: integer `5`, expected a string"),
    ({"texts": ["a"], "embedding_types": [1]}, 400, "embedding_types", "invalid type: integer `1`"),
])
def test_bad_input(server, body, status, param, needle):
    for path in ("/v1/embed", "/v2/embed"):
        r = server.post(path, body)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["param"] == param, (path, err)
        assert "  " not in err["message"], err
    with pytest.raises(cohere.errors.BadRequestError):
        cohere.ClientV2(api_key="unused", base_url=server.url).embed(
            texts=["a"], model=EMBEDDER, input_type="search_query", embedding_types=["float"], max_tokens=0)
    ok = server.post("/v2/embed", {"texts": ["a"], "max_tokens": 100000})
    assert ok.status_code == 200
    assert server.healthy()
