"""sentence-transformers folder layouts beyond the one it writes today."""

import json
import shutil

import mlx_embed
import numpy as np
from conftest import FIXTURES

# What sentence-transformers before 2.0 kept in the Transformer module's own
# subfolder; the pipeline's files stay at the root.
TRANSFORMER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "sentence_bert_config.json")


def test_a_transformer_in_its_own_subfolder_loads_as_at_the_root(tmp_path, golden_texts):
    """modules.json naming "0_Transformer" (sentence-transformers < 2.0) was
    refused with "has no config.json", though every file was one level down.
    Its sentence_bert_config.json is the one read: its max_seq_length of 24
    (the root folder's is 128) cuts the long texts."""
    old = tmp_path / "old-layout"
    shutil.copytree(FIXTURES / "tiny-mpnet", old)
    sub = old / "0_Transformer"
    sub.mkdir()
    for name in TRANSFORMER_FILES:
        (old / name).rename(sub / name)
    cfg = json.loads((sub / "sentence_bert_config.json").read_text())
    (sub / "sentence_bert_config.json").write_text(json.dumps({**cfg, "max_seq_length": 24}))
    modules = json.loads((old / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (old / "modules.json").write_text(json.dumps(modules))

    model = mlx_embed.load(old)
    flat = mlx_embed.load(FIXTURES / "tiny-mpnet", max_length=24)
    assert model.max_length == 24
    assert model.name == "old-layout"
    got = model.embed(golden_texts)
    assert np.array_equal(got, flat.embed(golden_texts))
    # Normalized, as its 2_Normalize at the root says.
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_router_and_static_sparse_layouts_are_refused_by_name(tmp_path):
    """An inference-free SPLADE folder (a Router: a SparseStaticEmbedding
    for queries, the MLM for documents; the opensearch doc-v3 folders keep
    the MLM's files at the root too) loaded with pooling="splade" ran the
    root MLM with the default SPLADE head: the document side's activation
    and the query side's idf lookup were both lost, silently. Such folders
    are refused by the module's name, whatever the override."""
    import pytest

    router = tmp_path / "doc-v3-distill"
    shutil.copytree(FIXTURES / "tiny-splade", router)
    (router / "modules.json").write_text(json.dumps([{
        "idx": 0, "name": "0", "path": "",
        "type": "sentence_transformers.base.modules.router.Router"}]))
    for kwargs in ({}, {"pooling": "splade"}):
        with pytest.raises(ValueError, match=r"modules.json has a Router \(separate query and document "
                                             r"pipelines, as inference-free SPLADE's\), which is not supported"):
            mlx_embed.load(router, **kwargs)
    static = tmp_path / "static-sparse"
    static.mkdir()
    (static / "modules.json").write_text(json.dumps([{
        "idx": 0, "name": "0", "path": "",
        "type": "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding"}]))
    with pytest.raises(ValueError, match="has a SparseStaticEmbedding"):
        mlx_embed.load(static)


def test_a_chat_message_modality_is_refused(tmp_path):
    """sentence-transformers 6 builds a folder over a chat-templated LM with
    a 'message' modality and renders every text through the template
    (cosine -0.35 to the plain text's vector); such a folder is refused. The
    same folder with the text modality alone runs as plain text."""
    import pytest

    folder = tmp_path / "qwen3-chat"
    shutil.copytree(FIXTURES / "tiny-qwen3", folder)
    text = {"method": "forward", "method_output_name": "last_hidden_state"}
    cfg = {"max_seq_length": 64, "modality_config": {"text": text, "message": {**text, "format": "flat"}}}
    (folder / "sentence_bert_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="modality_config has 'message'"):
        mlx_embed.load(folder)
    cfg["modality_config"].pop("message")
    (folder / "sentence_bert_config.json").write_text(json.dumps(cfg))
    assert mlx_embed.load(folder).max_length == 64


def _with_json(src, dst, name, **keys):
    """The fixture `src` copied to `dst`, `keys` set in its JSON file `name`."""
    shutil.copytree(FIXTURES / src, dst)
    path = dst / name
    cfg = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**cfg, **keys}))
    return dst


def _with_st_config(src, dst, **keys):
    return _with_json(src, dst, "config_sentence_transformers.json", **keys)


def _with_bert_config(src, dst, **keys):
    return _with_json(src, dst, "sentence_bert_config.json", **keys)


def test_truncate_dim_is_the_models_width(tmp_path, golden_texts):
    """A Matryoshka folder's truncate_dim (config_sentence_transformers.json)
    is the width sentence-transformers encodes to; it was ignored (the full
    width came back). The vectors are the full ones' first values."""
    import pytest

    full = mlx_embed.load(FIXTURES / "tiny-mpnet")
    cut = mlx_embed.load(_with_st_config("tiny-mpnet", tmp_path / "mrl", truncate_dim=16))
    assert (full.dim, cut.dim) == (64, 16)
    raw = full.embed(golden_texts, normalize=False)[:, :16]
    assert np.array_equal(cut.embed(golden_texts, normalize=False), raw)
    unit = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    assert np.abs(cut.embed(golden_texts) - unit).max() <= 1e-6
    assert mlx_embed.load(_with_st_config("tiny-mpnet", tmp_path / "wide", truncate_dim=512)).dim == 64
    with pytest.raises(ValueError, match="truncate_dim must be a positive integer, got 0"):
        mlx_embed.load(_with_st_config("tiny-mpnet", tmp_path / "zero", truncate_dim=0))


def test_max_active_dims_keeps_each_vectors_largest_weights(tmp_path, golden_texts):
    """A SparseEncoder folder's max_active_dims: sentence-transformers keeps
    each vector's so many largest weights; all of them came back."""
    full = mlx_embed.load(FIXTURES / "tiny-splade")
    top = mlx_embed.load(_with_st_config("tiny-splade", tmp_path / "mad", max_active_dims=5))
    texts = [t for t in golden_texts if t.strip()]
    counted = 0
    for (idx, val), (kept, weights) in zip(full.embed_sparse(texts), top.embed_sparse(texts)):
        k = min(5, len(idx))
        order = np.argsort(-val, kind="stable")[:k]
        assert sorted(kept.tolist()) == sorted(idx[order].tolist())
        assert np.array_equal(weights, val[np.isin(idx, kept)])
        counted += len(idx) > 5
    assert counted >= 10
    # The dense route's vector is the same cut (as sentence-transformers' encode).
    assert int((top.embed(texts[:3], normalize=False) > 0).sum(axis=1).max()) == 5


def test_processing_kwargs_max_length_cuts_and_task_lengths_are_refused(tmp_path, golden_texts):
    """sentence-transformers 6's processing_kwargs max_length is what its
    tokenizer call cuts at (over max_seq_length): it was ignored (cosine
    0.68 on cut texts). Per-task lengths (query_length, document_length)
    cut encode_query and encode_document apart, which is refused rather than
    run at one length; so are processing kwargs other than a cut."""
    import pytest

    cut = mlx_embed.load(_with_bert_config("tiny-mpnet", tmp_path / "cut",
                                           processing_kwargs={"text": {"max_length": 20}}))
    assert cut.max_length == 20
    same = mlx_embed.load(FIXTURES / "tiny-mpnet", max_length=20)
    assert np.array_equal(cut.embed(golden_texts), same.embed(golden_texts))
    with pytest.raises(ValueError, match="query_length is set: sentence-transformers cuts or expands query"):
        mlx_embed.load(_with_bert_config("tiny-mpnet", tmp_path / "task", query_length=16))
    with pytest.raises(ValueError, match=r"processing_kwargs 'text' \{'add_special_tokens': False\} is "
                                         r"not supported here"):
        mlx_embed.load(_with_bert_config("tiny-mpnet", tmp_path / "specials",
                                         processing_kwargs={"text": {"add_special_tokens": False}}))
    # The tokenizer call takes the common kwargs over the text ones, whatever their order.
    both = mlx_embed.load(_with_bert_config("tiny-mpnet", tmp_path / "both", processing_kwargs={
        "common": {"max_length": 8}, "text": {"max_length": 16}}))
    assert both.max_length == 8
    with pytest.raises(ValueError, match="max_length must be a positive integer, got 0"):
        mlx_embed.load(_with_bert_config("tiny-mpnet", tmp_path / "zero",
                                         processing_kwargs={"common": {"max_length": 0}}))


def test_truncation_side_left_from_the_folder(tmp_path):
    """tokenizer_config.json's truncation_side: "left" is how transformers
    and sentence-transformers cut that folder's inputs; a call that names no
    direction cut on the right (cosine 0.77 to sentence-transformers' vector
    of a cut text). A call that names one still gets it."""
    import pytest

    folder = tmp_path / "left-cut"
    shutil.copytree(FIXTURES / "tiny-mpnet", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "truncation_side": "left"}))
    left, plain = mlx_embed.load(folder), mlx_embed.load(FIXTURES / "tiny-mpnet")
    assert (left.truncation_side, plain.truncation_side) == ("left", "right")
    assert left.spec().tokenizer.truncation_side == "left"
    texts = ["start " + "middle " * 300 + "the end", "short text"]
    ids, _ = left.encode(texts)
    assert ids == plain.encode(texts, truncation_direction="left")[0]
    assert ids != plain.encode(texts)[0]
    assert np.array_equal(left.embed(texts), plain.embed(texts, truncation_direction="left"))
    assert np.array_equal(left.embed(texts, truncation_direction="right"), plain.embed(texts))
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "truncation_side": "middle"}))
    with pytest.raises(ValueError, match="truncation_side must be 'right' or 'left', got 'middle'"):
        mlx_embed.load(folder)


def test_truncation_side_from_sentence_transformers_tokenizer_args(tmp_path):
    """sentence-transformers passes sentence_bert_config.json's tokenizer_args
    (or processor_kwargs) to the tokenizer, over tokenizer_config.json."""
    plain = mlx_embed.load(FIXTURES / "tiny-mpnet")
    texts = ["start " + "middle " * 300 + "the end"]
    for key in ("tokenizer_args", "processor_kwargs"):
        folder = _with_bert_config("tiny-mpnet", tmp_path / key, **{key: {"truncation_side": "left"}})
        model = mlx_embed.load(folder)
        assert model.truncation_side == "left", key
        assert model.encode(texts)[0] == plain.encode(texts, truncation_direction="left")[0]
