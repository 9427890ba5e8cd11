"""A per-request cut too short for the tokens a model adds of its own
(special tokens, a reranker's prompt) is the cut field's
fault, not the input's: every route answers 400 naming the field the client
sets (vLLM's `truncate_prompt_tokens`, Cohere's `max_tokens`, Ollama's
`num_ctx`, the native `truncate_to`), with how many tokens the model needs."""

from __future__ import annotations

import pytest

from harness import FIXTURES, start_server

EMBEDDER = "tiny-gemma3"  # [BOS] ... [EOS]: 2 special tokens
RERANKER = "tiny-qwen3-reranker"  # its chat prompt and instruction: 71 tokens around a pair
CLASSIFIER = "tiny-bert-classifier"  # [CLS] ... [SEP]

SPECIALS = "the model adds 2 special tokens, so cut at 3 or more"
TEMPLATE = (
    "the model adds 71 tokens of its own around a pair (its prompt and special tokens), so cut at 72 or more"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("cut"),
        *("--model", str(FIXTURES / EMBEDDER)),
        *("--model", str(FIXTURES / RERANKER)),
        *("--model", str(FIXTURES / CLASSIFIER)),
        "--no-warmup",
    )
    yield srv
    srv.stop()


def _refused(resp, field: str, says: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    message, param = (err["message"], err.get("param")) if isinstance(err, dict) else (err, None)
    assert param in (field, None), resp.text
    assert message.startswith(f"{field}: a cut at "), message
    assert message.endswith(says), message


def test_a_cut_too_short_names_the_cut_field(server):
    texts = ["what is the capital of France", "Paris"]
    cases = [
        ("/v1/embeddings", {"model": EMBEDDER, "input": texts, "truncate_prompt_tokens": 2}, SPECIALS),
        # The query prompt is cut with the text (as sentence-transformers
        # cuts it): only the special tokens must fit.
        ("/v1/embeddings", {"model": EMBEDDER, "input": texts, "input_type": "query", "truncate_prompt_tokens": 1},
         SPECIALS),
        ("/pooling", {"model": EMBEDDER, "input": texts, "truncate_prompt_tokens": 2}, SPECIALS),
        ("/classify", {"model": CLASSIFIER, "input": texts, "truncate_prompt_tokens": 2},
         "the model adds 2 special tokens, so cut at 3 or more"),
        ("/score", {"model": RERANKER, "text_1": texts[0], "text_2": texts[1:], "truncate_prompt_tokens": 30},
         TEMPLATE),
        ("/v1/rerank", {"model": RERANKER, "query": texts[0], "documents": texts[1:], "truncate_prompt_tokens": 71},
         TEMPLATE),
    ]
    for route, body, says in cases:
        _refused(server.post(route, body), "truncate_prompt_tokens", says)
    _refused(server.post("/v2/embed", {"model": EMBEDDER, "texts": texts, "max_tokens": 2}), "max_tokens", SPECIALS)
    _refused(server.post("/api/v1/embed", {"model": EMBEDDER, "texts": texts, "truncate_to": 1}), "truncate_to",
             SPECIALS)
    _refused(server.post("/api/embed", {"model": EMBEDDER, "input": texts, "options": {"num_ctx": 2}}), "num_ctx",
             SPECIALS)
    # At what the message asks for, the cut is taken.
    ok = [
        ("/v1/embeddings", {"model": EMBEDDER, "input": texts, "input_type": "query", "truncate_prompt_tokens": 3}),
        ("/pooling", {"model": EMBEDDER, "input": texts, "truncate_prompt_tokens": 3}),
        ("/classify", {"model": CLASSIFIER, "input": texts, "truncate_prompt_tokens": 3}),
        ("/score", {"model": RERANKER, "text_1": texts[0], "text_2": texts[1:], "truncate_prompt_tokens": 72}),
        ("/v2/embed", {"model": EMBEDDER, "texts": texts, "max_tokens": 3}),
    ]
    for route, body in ok:
        resp = server.post(route, body)
        assert resp.status_code == 200, (route, resp.text[:300])
    # Any other refusal of an input still names the input.
    resp = server.post("/v1/embeddings", {"model": EMBEDDER, "input": ["a", ""], "truncate_prompt_tokens": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input", resp.text


def test_a_cut_too_short_for_an_instruction_names_the_cut(server):
    """A reranker's instruction is its own tokens too: a cut that leaves it
    no room (where the model's own length would) is the cut's fault, with
    the cut that fits. Before, the cut the message without an instruction
    asks for (72) was refused as the input's fault ('the instruction leaves
    the documents no room'), naming no cut that would do."""
    instruction = "Given a web search query, retrieve relevant passages that answer the query in French"
    body = {"model": RERANKER, "query": "what is the capital of France", "documents": ["Paris", "Lyon"],
            "instruction": instruction}
    resp = server.post("/v1/rerank", {**body, "truncate_prompt_tokens": 72})
    _refused(resp, "truncate_prompt_tokens", "or more")
    message = resp.json()["error"]["message"]
    assert "around a pair with this instruction (its prompt, the instruction and special tokens)" in message, message
    need = int(message.rsplit("so cut at ", 1)[1].split()[0])
    assert need > 72, message
    # One short is refused alike; at what it asks for, ranked.
    _refused(server.post("/v1/rerank", {**body, "truncate_prompt_tokens": need - 1}), "truncate_prompt_tokens",
             f"so cut at {need} or more")
    resp = server.post("/v1/rerank", {**body, "truncate_prompt_tokens": need})
    assert resp.status_code == 200, resp.text[:300]
    assert len(resp.json()["results"]) == 2
    # An instruction too long for the model's own length is still its own fault.
    resp = server.post("/v1/rerank", {**body, "instruction": "word " * 5000, "truncate_prompt_tokens": 72})
    assert resp.status_code == 400, resp.text[:300]
    assert "the instruction leaves the documents no room" in resp.json()["error"]["message"], resp.text[:300]


def test_a_cut_too_short_for_a_flagembedding_instruction_names_the_cut(tmp_path):
    """FlagEmbedding's LLM reranker's instruction ends the input and counts
    twice: a cut it leaves no room (where the model's own length would) is
    the cut's fault, with the cut that fits. Before: cuts 57 (what the
    message without an instruction asks) to 80 were the input's fault for a
    3 x 3-word instruction, naming no cut."""
    srv = start_server(tmp_path, "--model", str(FIXTURES / "tiny-bge-reranker-v2-gemma"), "--no-warmup")
    try:
        instruction = " ".join(f"alpha{i} beta{i} gamma{i}" for i in range(3))
        body = {"query": "what is the capital of France", "documents": ["Paris"], "instruction": instruction}
        resp = srv.post("/v1/rerank", {**body, "truncate_prompt_tokens": 57})
        _refused(resp, "truncate_prompt_tokens", "or more")
        message = resp.json()["error"]["message"]
        assert "around a pair with this instruction" in message, message
        need = int(message.rsplit("so cut at ", 1)[1].split()[0])
        _refused(srv.post("/v1/rerank", {**body, "truncate_prompt_tokens": need - 1}), "truncate_prompt_tokens",
                 f"so cut at {need} or more")
        resp = srv.post("/v1/rerank", {**body, "truncate_prompt_tokens": need})
        assert resp.status_code == 200, resp.text[:300]
    finally:
        srv.stop()
