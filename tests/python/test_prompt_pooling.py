"""Models that pool without their prompt (sentence-transformers' Pooling
``include_prompt: false``; INSTRUCTOR) against sentence-transformers 6.2
(tests/fixtures/prompt-pooling): the prompt runs through the model, and the
pooling leaves its positions out."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import FIXTURES, assert_parity

import mlx_embed
from mlx_embed.errors import InvalidInput

CASES = FIXTURES / "prompt-pooling"
SPEC = json.loads((CASES / "cases.json").read_text())["cases"]
BY_NAME = {c["name"]: c for c in SPEC}
QUERY = BY_NAME["minilm-mean"]["prompts"]["query"]


def write_variant(case: dict, source, dest, **st_config) -> None:
    """The case's folder, as scripts/fixtures/make_prompt_pooling.py wrote
    it: the source's files (linked), its Pooling config and prompts; for
    INSTRUCTOR the first module renamed. ``st_config``: more
    config_sentence_transformers.json keys."""
    dest.mkdir()
    edited = {"1_Pooling", "config_sentence_transformers.json", "modules.json"}
    for item in source.iterdir():
        if item.name not in edited:
            os.symlink(item, dest / item.name)
    shutil.copytree(source / "1_Pooling", dest / "1_Pooling")
    if "pooling" in case:
        (dest / "1_Pooling" / "config.json").write_text(json.dumps(case["pooling"]))
    cfg_path = source / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update({"prompts": case.get("prompts", cfg.get("prompts", {})), **st_config})
    (dest / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    modules = json.loads((source / "modules.json").read_text())
    if case.get("instructor"):
        modules[0]["type"] = "InstructorEmbedding.INSTRUCTOR_Transformer"
    (dest / "modules.json").write_text(json.dumps(modules))


@pytest.fixture(scope="module")
def variant(tmp_path_factory, minilm_dir):
    """``variant(name, **load_kw)``: the case's model, loaded once per options."""
    sources = {"minilm": minilm_dir, "tiny-t5": FIXTURES / "tiny-t5"}
    loaded = {}

    def get(name: str, st_config: dict | None = None, **kw):
        key = (name, json.dumps(st_config, sort_keys=True), tuple(sorted(kw.items())))
        if key not in loaded:
            case = BY_NAME[name]
            dest = tmp_path_factory.mktemp(name) / "model"
            write_variant(case, sources[case["source"]], dest, **(st_config or {}))
            loaded[key] = mlx_embed.load(dest, **kw)
        return loaded[key]

    return get


def _calls():
    for case in SPEC:
        for call in case["calls"]:
            yield pytest.param(case["name"], call, id=call["reference"].removesuffix(".npy"))


def _kw(call: dict) -> dict:
    return {k: call[k] for k in ("prompt", "prompt_name") if k in call}


@pytest.mark.parametrize("name, call", list(_calls()))
def test_matches_sentence_transformers(variant, golden_texts, name, call):
    """Every pooling mode (cls reads the first position kept, as
    sentence-transformers 6 does; lasttoken the last), named and raw
    prompts, none, and INSTRUCTOR's T5 with a Dense head."""
    model = variant(name)
    assert model.include_prompt is False
    assert model.spec().tokenizer.include_prompt is False
    assert_parity(model.embed(golden_texts, **_kw(call)), np.load(CASES / call["reference"]))


def test_the_prompt_is_left_out(variant, minilm, golden_texts):
    """Against the same weights pooling with the prompt: different vectors
    with a prompt, the same without one."""
    left_out = variant("minilm-mean").embed(golden_texts[:6], prompt=QUERY)
    pooled_in = minilm.embed(golden_texts[:6], prompt=QUERY)
    assert np.abs(left_out - pooled_in).max() > 1e-2
    assert_parity(variant("minilm-mean").embed(golden_texts[:6]), minilm.embed(golden_texts[:6]))


@pytest.mark.parametrize(
    "kw",
    [
        {"fast_ops": "mlx"},
        {"pipeline": True},
        {"workers": 1},
        {"packed_rows": True},
        {"shape_buckets": True},
        {"batch_tokens": 64},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_every_path_pools_without_the_prompt(variant, golden_texts, kw):
    """The host pooling, MLX's pooling, pipelined passes, one worker,
    packed rows, padded shapes and many small passes all read the pool mask."""
    ref = np.load(CASES / "minilm-mean-query.npy")
    assert_parity(variant("minilm-mean", **kw).embed(golden_texts, prompt_name="query"), ref)
    ref = np.load(CASES / "minilm-lasttoken-query.npy")
    assert_parity(variant("minilm-lasttoken", **kw).embed(golden_texts, prompt_name="query"), ref)


def test_default_prompt_and_a_text_that_carries_it(variant, golden_texts):
    """With a default prompt, a call naming none pools without it; a text
    that already begins with one of the prompts pools without that one (as
    the default is left off it)."""
    model = variant("minilm-mean", {"default_prompt_name": "query"})
    ref = np.load(CASES / "minilm-mean-query.npy")
    assert_parity(model.embed(golden_texts), ref)
    assert_parity(model.embed([QUERY + t for t in golden_texts]), ref)
    passage = BY_NAME["minilm-mean"]["prompts"]["passage"]
    assert_parity(model.embed([passage + t for t in golden_texts]), np.load(CASES / "minilm-mean-passage.npy"))


def test_pool_start_positions(variant):
    """The positions follow sentence-transformers' count (the prompt alone
    with [CLS] and [SEP], less the [SEP]); a left cut that takes some or all
    of the prompt leaves the same count out (sentence-transformers 6.2 masks
    the first positions by the prompt's length whatever the cut kept; this
    counted only what was left of the prompt, and none when the cut took it
    all: cosine 0.62 to sentence-transformers on a left folder)."""
    model = variant("minilm-mean")
    prompt_tokens = len(model.encode([""], prompt=QUERY)[0][0]) - 2
    text = "alpha beta gamma delta"
    ids, _, starts = model._encode(
        [text], truncate=True, truncation_direction="right", prompt_name=None, prompt=QUERY,
        instruction=None, truncate_to=None,
    )
    assert starts == [1 + prompt_tokens]
    _, _, starts = model._encode(
        [text], truncate=True, truncation_direction="right", prompt_name=None, prompt=None,
        instruction=None, truncate_to=None,
    )
    assert starts is None
    text_tokens = len(model.encode([text])[0][0]) - 2
    for cut in (3, prompt_tokens + 1):
        kept = prompt_tokens + text_tokens - cut
        ids, _, starts = model._encode(
            [text], truncate=True, truncation_direction="left", prompt_name=None, prompt=QUERY,
            instruction=None, truncate_to=2 + kept,
        )
        assert starts == [1 + min(prompt_tokens, kept)]
        # What embed() runs is embed_ids with those starts.
        got = model.embed([text], prompt=QUERY, truncation_direction="left",
                          truncate_to=2 + prompt_tokens + text_tokens - cut, normalize=False)
        by_ids = np.frombuffer(model.embed_ids(ids, pool_start=starts).vectors, dtype="<f4")
        assert np.array_equal(got[0], by_ids)


def test_embed_ids_pool_start(variant, golden_texts):
    """``embed_ids(..., pool_start=...)`` is the seam the server uses: the
    text's ids with its starts give the library's vector; bad starts are
    invalid input naming the input."""
    model = variant("minilm-mean")
    ids, _, starts = model._encode(
        golden_texts[:5], truncate=True, truncation_direction="right", prompt_name="query", prompt=None,
        instruction=None, truncate_to=None,
    )
    vec = np.frombuffer(model.embed_ids(ids, pool_start=starts).vectors, dtype="<f4").reshape(5, -1)
    want = model.embed(golden_texts[:5], prompt_name="query", normalize=False)
    assert np.array_equal(vec, want)
    plain = np.frombuffer(model.embed_ids(ids).vectors, dtype="<f4").reshape(5, -1)
    assert np.abs(plain - vec).max() > 1e-3
    for bad, message in (
        ([1, 2], "2 pool starts for 5 inputs"),
        ([-1, 0, 0, 0, 0], "input 0: pool_start must be an int"),
        ([0, len(ids[1]) + 1, 0, 0, 0], "input 1: pool_start must be an int"),
        ([0, 0, True, 0, 0], "input 2: pool_start must be an int"),
        ([0, 0, 0, 1.0, 0], "input 3: pool_start must be an int"),
    ):
        with pytest.raises(InvalidInput, match=message):
            model.embed_ids(ids, pool_start=bad)


def test_token_rows_keep_the_prompt(variant, golden_texts):
    """Per-token output is every token's row, the prompt's too."""
    model = variant("minilm-mean")
    rows = model.embed_tokens(golden_texts[:2], prompt_name="query")
    ids, _ = model.encode(golden_texts[:2], prompt_name="query")
    assert [r.shape[0] for r in rows] == [len(x) for x in ids]


def test_a_folder_that_pools_with_its_prompt_is_unchanged(minilm):
    assert minilm.include_prompt is True
    assert minilm.spec().tokenizer.include_prompt is True
