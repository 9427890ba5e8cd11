"""Reranker variants end to end: the real server binary, pairs tokenized in
Rust from the spec the Python model hands over.

- a Qwen3 reranker as sentence-transformers 6 saves it (`LogitScore` with
  its own score tokens, `chat_template.jinja` with its own prompt), under a
  folder name that does not say "reranker";
- CamemBERT and MPNet cross-encoders (RoBERTa's head), an ELECTRA one
  (GELU head, narrower embeddings projected up) and a Qwen3 sequence
  classifier (Qwen3-Reranker-*-seq-cls: the tokenizer's pair encoding, the
  score at the last token) as `--model`s;
- Qwen2, Mistral (no pad id; cut at its sliding window) and Gemma 2
  sequence classifiers (transformers' generic decoder head) on /predict,
  /rerank and /v1/rerank, and a 3-label Gemma 2 classifier on /predict;
- a 3-label EuroBERT classifier (late pooling) on /predict, pairs and texts;
- an mxbai-rerank v2 model (Qwen2, "1"/"0"), in a folder named as
  mixedbread-ai/mxbai-rerank-base-v2 is, as a `--model`: the query and the
  document encoded apart with their prompts, the query kept to 3/4 of the
  room, as its library does;
- a bge-reranker-v2-gemma model (Gemma, logit "Yes"), in a folder named as
  BAAI/bge-reranker-v2-gemma is, as a `--model`: `A: q` and `B: d` encoded
  apart after `<bos>`, FlagEmbedding's cut and prompt;
- a Qwen2 "1"/"0" reranker as sentence-transformers 6 saves it (its chat
  template writes mxbai's prompt), as `CrossEncoder` encodes it: the render
  tokenized as one text, cut with its tail written back; and the same folder
  pinned to the text modality: the tokenizer's pair, no prompt.

References: tests/fixtures/tiny-qwen3-reranker-st6, tiny-camembert-reranker,
tiny-mpnet-reranker, tiny-electra-reranker, tiny-qwen3-seq-cls,
tiny-qwen2-reranker-st6, tiny-{qwen2,mistral,gemma2,eurobert}-seq-cls (their READMEs; transformers in
float64); tiny-mxbai-rerank-v2 (the mxbai-rerank library's ids and scores, float64);
tiny-bge-reranker-v2-gemma (FlagEmbedding's ids, float64 transformers logits)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import mlx_embed

from harness import FIXTURES, assert_logits_close, assert_template_instruction_limit, start_server

ST6 = FIXTURES / "tiny-qwen3-reranker-st6"
# transformers' generic decoder head on Qwen2, Mistral, Gemma 2 and Llama.
DECODER_SEQ_CLS = ("tiny-qwen2-seq-cls", "tiny-mistral-seq-cls", "tiny-gemma2-seq-cls", "tiny-llama-seq-cls")
ENCODERS = ("tiny-camembert-reranker", "tiny-mpnet-reranker", "tiny-electra-reranker",
            "tiny-qwen3-seq-cls", *DECODER_SEQ_CLS)
GEMMA2_LABELS = ["negative", "neutral", "positive"]
MXBAI = FIXTURES / "tiny-mxbai-rerank-v2"
BGE_GEMMA = FIXTURES / "tiny-bge-reranker-v2-gemma"
QWEN2_ST6 = FIXTURES / "tiny-qwen2-reranker-st6"
EUROBERT = FIXTURES / "tiny-eurobert-seq-cls"
EUROBERT_LABELS = ["contradiction", "entailment", "neutral"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    finetune = root / "my-finetune"
    shutil.copytree(ST6, finetune)
    mxbai = root / "mxbai-rerank-base-v2"
    shutil.copytree(MXBAI, mxbai)
    gemma = root / "bge-reranker-v2-gemma"
    shutil.copytree(BGE_GEMMA, gemma)
    qwen2 = root / "qwen2-finetune"
    shutil.copytree(QWEN2_ST6, qwen2)
    text_only = root / "qwen2-text-only"
    shutil.copytree(QWEN2_ST6, text_only)
    cfg = json.loads((text_only / "sentence_bert_config.json").read_text())
    cfg["modality_config"] = {"text": cfg["modality_config"]["text"]}
    (text_only / "sentence_bert_config.json").write_text(json.dumps(cfg))
    gemma2_classifier = _three_label_copy(FIXTURES / "tiny-gemma2-seq-cls", root / "gemma2-classifier")
    srv = start_server(
        root, "--model", ",".join([*(str(FIXTURES / name) for name in ENCODERS), str(mxbai), str(gemma),
                                   str(qwen2), str(text_only), str(gemma2_classifier), str(EUROBERT)]),
        "--rerank-model", str(finetune), "--no-warmup",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


def _three_label_copy(src, dst):
    """The fixture as a 3-label classifier: its classifier_score.npy rows as
    the score, num_labels 3 and id2label in config.json (README)."""
    import mlx.core as mx

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(num_labels=3, id2label={str(i): v for i, v in enumerate(GEMMA2_LABELS)},
               label2id={v: i for i, v in enumerate(GEMMA2_LABELS)})
    (dst / "config.json").write_text(json.dumps(cfg))
    weights = mx.load(str(dst / "model.safetensors"))
    weights["score.weight"] = mx.array(np.load(src / "classifier_score.npy"))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


def _raw(srv, model: str, pairs: list) -> np.ndarray:
    r = srv.post("/predict", {"model": model, "inputs": [list(p) for p in pairs], "raw_scores": True})
    assert r.status_code == 200, r.text
    return np.array([row[0]["score"] for row in r.json()])


def test_st6_qwen3_reranker_scores_with_its_tokens_and_prompt(server):
    pairs = json.loads((ST6 / "pairs.json").read_text())
    logits = np.load(ST6 / "reference_pair_logits.npy")[:, 0]
    np.testing.assert_allclose(_raw(server, "my-finetune", pairs), logits, rtol=1e-5, atol=1e-5)
    # /rerank orders one query's documents by those logits.
    query = pairs[0][0]
    idx = [i for i, (q, _) in enumerate(pairs) if q == query]
    assert len(idx) >= 4
    r = server.post("/rerank", {"model": "my-finetune", "query": query,
                                "texts": [pairs[i][1] for i in idx], "raw_scores": True})
    assert r.status_code == 200, r.text
    want = sorted(range(len(idx)), key=lambda k: -float(logits[idx[k]]))
    assert [x["index"] for x in r.json()] == want
    models = {m["model_id"]: m for m in server.get("/info").json()["models"]}
    assert (models["my-finetune"]["kind"], models["my-finetune"]["labels"]) == ("reranker", ["score"])


@pytest.mark.parametrize("name", ENCODERS)
def test_sequence_classification_cross_encoders(server, name):
    pairs = json.loads((FIXTURES / name / "pairs.json").read_text())
    logits = np.load(FIXTURES / name / "reference_pair_logits.npy")[:, 0]
    assert_logits_close(_raw(server, name, pairs), logits)
    scores = np.load(FIXTURES / name / "reference_pair_scores.npy")
    # Cohere's route on one query's documents: the sigmoid of the logits, best first.
    query = pairs[0][0]
    idx = [i for i, (q, _) in enumerate(pairs) if q == query]
    assert len(idx) >= 4
    r = server.post("/v1/rerank", {"model": name, "query": query, "documents": [pairs[i][1] for i in idx]})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(idx)), key=lambda k: -float(scores[idx[k]]))
    for x in results:
        assert abs(x["relevance_score"] - float(scores[idx[x["index"]]])) <= 1e-5


def test_mxbai_rerank_v2_scores_and_ranks_as_its_library(server):
    pairs = json.loads((MXBAI / "pairs.json").read_text())
    logits = np.load(MXBAI / "reference_pair_logits.npy")[:, 0]
    # float32 against the library's float64 (tests/python/test_mxbai_rerank.py).
    np.testing.assert_allclose(_raw(server, "mxbai-rerank-base-v2", pairs), logits, rtol=0, atol=5e-5)
    scores = np.load(MXBAI / "reference_pair_scores.npy")
    for query in {q for q, _ in pairs}:
        idx = [i for i, (q, _) in enumerate(pairs) if q == query]
        if len(idx) < 4:
            continue
        r = server.post("/v1/rerank", {"model": "mxbai-rerank-base-v2", "query": query,
                                       "documents": [pairs[i][1] for i in idx]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(idx)), key=lambda k: -float(logits[idx[k]]))
        for x in results:
            assert abs(x["relevance_score"] - float(scores[idx[x["index"]]])) <= 1.25e-5
    # The token count includes the prompt: the library's 128 + its 192 fixed tokens.
    info = {m["model_id"]: m for m in server.get("/info").json()["models"]}["mxbai-rerank-base-v2"]
    assert (info["kind"], info["max_input_tokens"]) == ("reranker", 320)
    # A lone text has no meaning for it.
    r = server.post("/predict", {"model": "mxbai-rerank-base-v2", "inputs": ["just a text"]})
    assert r.status_code in (400, 422), r.text


def test_bge_reranker_v2_gemma_scores_and_ranks_as_flagembedding(server):
    model = "bge-reranker-v2-gemma"
    pairs = json.loads((BGE_GEMMA / "pairs.json").read_text())
    logits = np.load(BGE_GEMMA / "reference_pair_logits.npy")[:, 0]
    # float32 against float64 (tests/python/test_bge_reranker_gemma.py: 2.2e-5 seen).
    np.testing.assert_allclose(_raw(server, model, pairs), logits, rtol=0, atol=1e-4)
    scores = np.load(BGE_GEMMA / "reference_pair_scores.npy")
    ranked = 0
    for query in {q for q, _ in pairs}:
        idx = [i for i, (q, _) in enumerate(pairs) if q == query]
        if len(idx) < 4:
            continue
        want = sorted(range(len(idx)), key=lambda k: -float(logits[idx[k]]))
        # TEI's route, raw (FlagEmbedding's compute_score) and sigmoid
        # (its normalize=True); Cohere's route.
        r = server.post("/rerank", {"model": model, "query": query, "texts": [pairs[i][1] for i in idx],
                                    "raw_scores": True})
        assert r.status_code == 200, r.text
        assert [x["index"] for x in r.json()] == want
        for x in r.json():
            assert abs(x["score"] - float(logits[idx[x["index"]]])) <= 1e-4
        r = server.post("/v1/rerank", {"model": model, "query": query, "documents": [pairs[i][1] for i in idx]})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == want
        for x in results:
            assert abs(x["relevance_score"] - float(scores[idx[x["index"]]])) <= 2.5e-5
        ranked += 1
    assert ranked == 6
    # The token count includes [bos] and twice the separator and prompt:
    # FlagEmbedding's max_length 128 + 2 x 54.
    info = {m["model_id"]: m for m in server.get("/info").json()["models"]}[model]
    assert (info["kind"], info["max_input_tokens"]) == ("reranker", 236)
    # A pair over it with truncate: false, and a lone text: refused.
    long_pair = pairs[-1]
    r = server.post("/rerank", {"model": model, "query": long_pair[0], "texts": [long_pair[1]],
                                "truncate": False})
    assert r.status_code == 422 and "more than the model's maximum of 236" in r.text, r.text
    # A pair within 236 whose passage is over FlagEmbedding's 128: its own
    # cut shortens it; with truncate: false it runs whole (222 tokens), as
    # the Python engine's truncate=False scores it (it was cut, silently).
    words = ["alpha", "river", "stone", "quick", "zebra", "moon", "paper", "light", "green", "table"]
    document = " ".join(words[(7 * i) % 10] + words[(3 * i) % 10] for i in range(30))
    scores = {}
    for truncate in (True, False):
        r = server.post("/rerank", {"model": model, "query": "what is it", "texts": [document],
                                    "raw_scores": True, "truncate": truncate})
        assert r.status_code == 200, r.text
        scores[truncate] = r.json()[0]["score"]
    engine = mlx_embed.load(str(BGE_GEMMA))
    assert abs(scores[False] - float(engine.score([("what is it", document)], raw_scores=True,
                                                   truncate=False)[0, 0])) <= 1e-5
    assert abs(scores[True] - float(engine.score([("what is it", document)], raw_scores=True)[0, 0])) <= 1e-5
    assert abs(scores[True] - scores[False]) > 1e-3
    r = server.post("/predict", {"model": model, "inputs": ["just a text"]})
    assert r.status_code == 400 and "pairs, not single texts" in r.text, r.text


def test_bge_reranker_v2_gemma_instruction_is_flagembeddings_prompt(server):
    """A request's `instruction` is FlagEmbedding's compute_score(prompt=):
    every pair under each fixture prompt (short, long enough to move the
    cut, empty) within the float64 references of FlagEmbedding's own ids, on
    TEI's and Cohere's routes; the long prompt's tokens count against the
    236-token maximum with truncate: false."""
    model = "bge-reranker-v2-gemma"
    pairs = json.loads((BGE_GEMMA / "pairs.json").read_text())
    meta = json.loads((BGE_GEMMA / "prompts.json").read_text())
    refs = np.load(BGE_GEMMA / "reference_prompt_logits.npy")
    assert meta["engine_max_lengths"][0] == 236
    for a, (name, prompt) in enumerate(meta["prompts"].items()):
        got = np.full(len(pairs), np.nan)
        for query in {q for q, _ in pairs if q}:
            idx = [i for i, (q, _) in enumerate(pairs) if q == query]
            docs = [pairs[i][1] for i in idx]
            r = server.post("/rerank", {"model": model, "query": query, "texts": docs, "raw_scores": True,
                                        "instruction": prompt})
            assert r.status_code == 200, r.text
            for x in r.json():
                got[idx[x["index"]]] = x["score"]
            r = server.post("/v1/rerank", {"model": model, "query": query, "documents": docs,
                                           "raw_scores": True, "instruction": prompt})
            assert r.status_code == 200, r.text
            cohere = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            np.testing.assert_allclose([cohere[k] for k in range(len(idx))], got[idx], rtol=0, atol=1e-6)
        seen = ~np.isnan(got)
        assert seen.sum() == len(pairs) - 1, name  # all but the empty query
        # Voyage AI's body on /v1/rerank (told by its top_k / truncation)
        # runs the instruction too (it was dropped: the default prompt's scores).
        r = server.post("/v1/rerank", {"model": model, "query": query, "documents": docs, "top_k": None,
                                       "truncation": True, "instruction": prompt})
        assert r.status_code == 200 and "data" in r.json(), r.text
        voyage = {x["index"]: x["relevance_score"] for x in r.json()["data"]}
        want = 1 / (1 + np.exp(-got[idx]))
        np.testing.assert_allclose([voyage[k] for k in range(len(idx))], want, rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(got[seen], refs[a, 0][seen], rtol=0, atol=1e-4, err_msg=name)
    # truncate: false counts the prompt's tokens: a pair of exactly 236
    # tokens beside the long prompt runs, one more token is a 422.
    long = meta["prompts"]["long"]
    engine = mlx_embed.load(str(BGE_GEMMA))
    sizes = {}
    for k in range(300):
        for tail in ("", " a", " b c", "x", " rivers"):
            document = " ".join("abcdefghij"[i % 10] for i in range(k)) + tail
            (_, _, (n,)) = engine.encode_pairs([("q", document)], instruction=long, truncate=True)
            sizes.setdefault(n, document)
        if 236 in sizes and 237 in sizes:
            break
    assert 236 in sizes and 237 in sizes
    r = server.post("/rerank", {"model": model, "query": "q", "texts": [sizes[236]], "raw_scores": True,
                                "instruction": long, "truncate": False})
    assert r.status_code == 200, r.text
    want = engine.score([("q", sizes[236])], raw_scores=True, instruction=long, truncate=False)[0, 0]
    assert abs(r.json()[0]["score"] - float(want)) <= 1e-5
    r = server.post("/rerank", {"model": model, "query": "q", "texts": [sizes[237]], "instruction": long,
                                "truncate": False})
    assert r.status_code == 422 and "more than the model's maximum of 236" in r.text, r.text
    # Cohere's chunks fit beside the query and the long prompt.
    r = server.post("/v1/rerank", {"model": model, "query": "q", "documents": [pairs[-1][1]],
                                   "instruction": long, "max_chunks_per_doc": 3})
    assert r.status_code == 200, r.text
    # A prompt that leaves the pair nothing is refused by name.
    r = server.post("/rerank", {"model": model, "query": "q", "texts": ["d"], "instruction": "Yes " * 200})
    assert r.status_code == 400 and r.json()["error"].startswith("the instruction leaves the pair no room"), r.text
    # Named as the instruction, not as the first input (which is not at
    # fault), with or without Cohere's chunks.
    for extra in ({}, {"max_chunks_per_doc": 2}):
        r = server.post("/v1/rerank", {"model": model, "query": "q", "documents": ["d", "e"],
                                       "instruction": "Yes " * 200, **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "instruction", r.text
        assert error["message"].startswith("the instruction leaves the pair no room"), r.text


def test_instruction_on_the_other_rerankers(server):
    """The same field is Qwen3-Reranker's <Instruct> and mxbai-rerank v2's
    instruction line (the Python engine's score(instruction=)); a
    cross-encoder without an instruction refuses it."""
    query, docs = "where do rivers flow", ["Rivers flow into the sea.", "Bread is baked in ovens."]
    for model, folder in (("my-finetune", ST6), ("mxbai-rerank-base-v2", MXBAI)):
        r = server.post("/v1/rerank", {"model": model, "query": query, "documents": docs, "raw_scores": True,
                                       "instruction": "Find geography facts"})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        plain = {x["index"]: x["relevance_score"] for x in server.post(
            "/v1/rerank", {"model": model, "query": query, "documents": docs, "raw_scores": True}).json()["results"]}
        engine = mlx_embed.load(str(folder)) if model == "my-finetune" else None
        if engine is not None:
            want = engine.score([(query, d) for d in docs], raw_scores=True, instruction="Find geography facts")
            np.testing.assert_allclose([got[0], got[1]], want[:, 0], rtol=0, atol=1e-5)
        assert abs(got[0] - plain[0]) > 1e-6, model
    r = server.post("/rerank", {"model": "tiny-camembert-reranker", "query": query, "texts": docs,
                                "instruction": "Find geography facts"})
    assert r.status_code == 400 and r.json()["error"].startswith("prompts do not apply"), r.text
    r = server.post("/v1/rerank", {"model": "tiny-camembert-reranker", "query": query, "documents": docs,
                                   "instruction": "Find geography facts"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "instruction", r.text


def test_an_instruction_that_leaves_no_document_is_refused(server):
    """A sentence-transformers 6 Qwen3 reranker (its chat template's tail
    written back over a cut) refuses an instruction that leaves a document
    no room, naming it; mxbai-rerank v2 cuts the query (instruction
    included) to 3/4 of its room, as its library does, so a document always
    keeps the rest and any instruction answers its library's scores."""
    assert_template_instruction_limit(server, "my-finetune", mlx_embed.load(str(ST6)))
    docs = ["Rivers flow into the sea.", "Bread is baked in ovens."]
    engine = mlx_embed.load(str(MXBAI))
    for instruction in ("find " * 50, "find " * 1000):
        r = server.post("/rerank", {"model": "mxbai-rerank-base-v2", "query": "q", "texts": docs, "raw_scores": True,
                                    "instruction": instruction})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["score"] for x in r.json()}
        want = engine.score([("q", d) for d in docs], raw_scores=True, instruction=instruction)[:, 0]
        np.testing.assert_allclose([got[0], got[1]], want, rtol=0, atol=1e-5)
        assert abs(got[0] - got[1]) > 1e-4, got


def test_st6_qwen2_reranker_scores_as_cross_encoder(server):
    """Every pair, 10 of them at or over the 320-token limit, within the
    float64 references of sentence-transformers' own ids (the ids themselves:
    tests/python/test_mxbai_rerank.py, crates/mlx-embed-tokenizer/tests/pairs.rs)."""
    pairs = json.loads((QWEN2_ST6 / "pairs.json").read_text())
    for model, refs in (("qwen2-finetune", "reference_pair_logits.npy"),
                        ("qwen2-text-only", "reference_text_pair_logits.npy")):
        np.testing.assert_allclose(_raw(server, model, pairs), np.load(QWEN2_ST6 / refs)[:, 0],
                                   rtol=0, atol=5e-5, err_msg=model)
    # The text-only folder still scores pairs only.
    r = server.post("/predict", {"model": "qwen2-text-only", "inputs": ["just a text"]})
    assert r.status_code == 400 and "not single texts" in r.json()["error"], r.text


@pytest.mark.parametrize("name", DECODER_SEQ_CLS)
def test_decoder_seq_cls_on_tei_rerank(server, name):
    """TEI's /rerank on each decoder classifier: every fixture pair's sigmoid
    score (raw logit on request) within 1e-4 of transformers' float64, best
    first; /info names it a one-label reranker at its limit (Mistral's
    sliding window, 128)."""
    pairs = json.loads((FIXTURES / name / "pairs.json").read_text())
    scores = np.load(FIXTURES / name / "reference_pair_scores.npy")
    logits = np.load(FIXTURES / name / "reference_pair_logits.npy")[:, 0]
    checked = 0
    for query in dict.fromkeys(q for q, _ in pairs):
        idx = [i for i, (q, _) in enumerate(pairs) if q == query]
        r = server.post("/rerank", {"model": name, "query": query, "texts": [pairs[i][1] for i in idx]})
        assert r.status_code == 200, r.text
        ranks = r.json()
        assert [x["index"] for x in ranks] == sorted(range(len(idx)), key=lambda k: -float(logits[idx[k]]))
        for x in ranks:
            assert abs(x["score"] - float(scores[idx[x["index"]]])) <= 1e-4
        raw = server.post("/rerank", {"model": name, "query": query, "texts": [pairs[i][1] for i in idx],
                                      "raw_scores": True})
        assert raw.status_code == 200, raw.text
        for x in raw.json():
            assert abs(x["score"] - float(logits[idx[x["index"]]])) <= 1e-4
            checked += 1
    assert checked == len(pairs)
    info = {m["model_id"]: m for m in server.get("/info").json()["models"]}[name]
    assert (info["kind"], info["labels"], info["max_input_tokens"]) == (
        "reranker", ["LABEL_0"], 128 if name == "tiny-mistral-seq-cls" else 256)


def test_mistral_seq_cls_refuses_a_pair_past_its_window_without_truncation(server):
    """Past its sliding window a Mistral is not what transformers computes
    in full: with truncate false such a pair is refused (422), not cut."""
    long = "word " * 200
    r = server.post("/rerank", {"model": "tiny-mistral-seq-cls", "query": "q", "texts": ["short", long],
                                "truncate": False})
    assert r.status_code == 422, r.text
    r = server.post("/rerank", {"model": "tiny-mistral-seq-cls", "query": "q", "texts": ["short", long]})
    assert r.status_code == 200, r.text


def test_gemma2_three_label_classifier_on_predict(server):
    """/predict on a Gemma 2 classifier (three score rows): raw logits within
    1e-4 of transformers' float64 for every pair (the cut ones too), the
    softmax by default, best label first."""
    src = FIXTURES / "tiny-gemma2-seq-cls"
    pairs = json.loads((src / "pairs.json").read_text())
    ref = np.load(src / "reference_classifier_logits.npy")
    r = server.post("/predict", {"model": "gemma2-classifier", "inputs": [list(p) for p in pairs],
                                 "raw_scores": True})
    assert r.status_code == 200, r.text
    got = np.array([[{p["label"]: p["score"] for p in row}[lab] for lab in GEMMA2_LABELS] for row in r.json()])
    assert np.abs(got - ref).max() <= 1e-4
    one = server.post("/predict", {"model": "gemma2-classifier", "inputs": list(pairs[41])})
    assert one.status_code == 200, one.text
    e = np.exp(ref[41].astype(np.float64) - ref[41].max())
    probs = dict(zip(GEMMA2_LABELS, e / e.sum()))
    assert [p["label"] for p in one.json()] == sorted(GEMMA2_LABELS, key=lambda k: -probs[k])
    assert all(abs(p["score"] - probs[p["label"]]) <= 1e-4 for p in one.json())
    info = {m["model_id"]: m for m in server.get("/info").json()["models"]}["gemma2-classifier"]
    assert (info["kind"], info["labels"]) == ("classifier", GEMMA2_LABELS)
    # A classifier is no reranker.
    r = server.post("/v1/rerank", {"model": "gemma2-classifier", "query": "q", "documents": ["a", "b"]})
    assert r.status_code == 400, r.text


def test_eurobert_classifier_on_predict(server):
    """/predict on EuroBertForSequenceClassification (late pooling, pairs
    as BOS q EOS BOS d EOS from the Rust tokenizer): raw logits within 1e-4
    of transformers' float64 for every pair (the cut ones too) and every
    golden text alone (but the empty one), the softmax by default, best label first; /info
    names it a classifier with its labels; no reranker."""
    name = "tiny-eurobert-seq-cls"
    pairs = json.loads((EUROBERT / "pairs.json").read_text())
    ref = np.load(EUROBERT / "reference_pair_logits.npy")

    def logits(inputs):
        r = server.post("/predict", {"model": name, "inputs": inputs, "raw_scores": True})
        assert r.status_code == 200, r.text
        return np.array([[{p["label"]: p["score"] for p in row}[lab] for lab in EUROBERT_LABELS] for row in r.json()])

    assert np.abs(logits([list(p) for p in pairs]) - ref).max() <= 1e-4
    # The server refuses an empty string as a text (a 400), as TEI does.
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    keep = [i for i, t in enumerate(texts) if t]
    assert len(keep) >= 38
    text_ref = np.load(EUROBERT / "reference_text_logits.npy")[keep]
    assert np.abs(logits([[texts[i]] for i in keep]) - text_ref).max() <= 1e-4
    one = server.post("/predict", {"model": name, "inputs": list(pairs[40])})
    assert one.status_code == 200, one.text
    e = np.exp(ref[40].astype(np.float64) - ref[40].max())
    probs = dict(zip(EUROBERT_LABELS, e / e.sum()))
    assert [p["label"] for p in one.json()] == sorted(EUROBERT_LABELS, key=lambda k: -probs[k])
    assert all(abs(p["score"] - probs[p["label"]]) <= 1e-5 for p in one.json())
    info = {m["model_id"]: m for m in server.get("/info").json()["models"]}[name]
    assert (info["kind"], info["labels"], info["max_input_tokens"]) == ("classifier", EUROBERT_LABELS, 256)
    r = server.post("/rerank", {"model": name, "query": "q", "texts": ["a", "b"]})
    assert r.status_code == 400, r.text
