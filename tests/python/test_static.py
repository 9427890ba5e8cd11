"""Static embeddings (models/static.py) against their own libraries' output:
a sentence-transformers StaticEmbedding folder (tiny-static) and Model2Vec
folders (tiny-model2vec, tiny-model2vec-vq); each fixture's README says how
its references were made and what each rule is worth."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

import mlx_embed
from conftest import FIXTURES, MAX_DIFF, MIN_COS, ROOT, load_fixture

# The stray-file copy make_static.py makes its reference from (torch-free).
sys.path.insert(0, str(ROOT / "scripts" / "fixtures"))
from static_stray import BAKED, with_stray_tokenizer_files  # noqa: E402

# folder -> (reference, normalized, model_type, max_length)
FOLDERS = {
    "tiny-static": ("reference_normalized.npy", True, "static_embedding", 8192),
    "tiny-model2vec": ("reference_normalized.npy", True, "model2vec", 512),
    "tiny-model2vec-vq": ("reference.npy", False, "model2vec", 256),
}


def _ref(folder: str, name: str) -> np.ndarray:
    return np.load(FIXTURES / folder / name)


def _check(got: np.ndarray, ref: np.ndarray) -> None:
    """Rows the reference has at zero (no tokens) must be exactly zero; the
    others match by cosine and by value (relative to the reference's scale)."""
    assert got.shape == ref.shape and got.dtype == np.float32
    zero = np.abs(ref).max(axis=1) == 0
    assert np.array_equal(got[zero], ref[zero])
    a, b = got[~zero], ref[~zero]
    cos = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    diff = np.abs(got - ref).max()
    print(f"min cosine {cos.min():.8f}, max |diff| {diff:.2e}, {int(zero.sum())} zero rows")
    assert cos.min() >= MIN_COS
    assert diff <= MAX_DIFF * max(1.0, float(np.abs(ref).max()))


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_matches_reference(folder, golden_texts):
    ref_name, normalized, model_type, max_length = FOLDERS[folder]
    model = load_fixture(folder)
    assert (model.model_type, model.pooling, model.dim, model.max_length) == (
        model_type, "mean", 64, max_length)
    _check(model.embed(golden_texts, normalize=normalized), _ref(folder, ref_name))


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_batched_equals_single(folder, golden_texts):
    model = load_fixture(folder)
    got = model.embed(golden_texts)
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.abs(got - single).max() <= 1e-6


def test_sentence_transformers_unnormalized_and_matryoshka(golden_texts):
    model = load_fixture("tiny-static")
    _check(model.embed(golden_texts, normalize=False), _ref("tiny-static", "reference_unnormalized.npy"))
    # sentence-transformers' truncate_dim + normalize_embeddings: the first
    # components of the unnormalized vector, renormalized.
    raw = model.embed(golden_texts, normalize=False)[:, :32]
    norms = np.linalg.norm(raw, axis=1, keepdims=True)
    cut = np.where(norms > 0, raw / np.maximum(norms, 1e-12), 0).astype(np.float32)
    _check(cut, _ref("tiny-static", "reference_dim32_normalized.npy"))


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_no_special_tokens_and_empty_texts(folder):
    from tokenizers import Tokenizer

    model = load_fixture(folder)
    tok = Tokenizer.from_file(model.spec().tokenizer.path)
    text = "the quick brown fox"
    with_specials = tok.encode(text).ids
    # The file's template would add [CLS] ... [SEP]; the model runs without.
    assert len(with_specials) == len(tok.encode(text, add_special_tokens=False).ids) + 2
    ids, _ = model.encode([text])
    assert ids[0] == tok.encode(text, add_special_tokens=False).ids
    spec = model.spec()
    assert (spec.tokenizer.prefix_ids, spec.tokenizer.suffix_ids, spec.empty_inputs) == ([], [], True)
    # Empty and whitespace-only texts have no tokens: the zero vector,
    # normalized or not, as both libraries give it.
    assert model.count_tokens(["", " \t\n"]) == [0, 0]
    vecs = model.embed(["", "the quick brown fox", " \t\n"])
    assert not vecs[0].any() and not vecs[2].any()
    assert abs(float(np.linalg.norm(vecs[1])) - 1.0) < 1e-6
    # Token-id input with no ids: the same zeros (an all-empty pass).
    raw = model.embed_ids([[], []]).vectors
    assert len(raw) == 2 * 64 * 4 and not np.frombuffer(raw, dtype="<f4").any()


def test_model2vec_drops_unknown_words_sentence_transformers_keeps_them():
    text = "東京 hello"
    m2v, st = load_fixture("tiny-model2vec"), load_fixture("tiny-static")
    assert m2v.spec().tokenizer.drop_ids == [1] and st.spec().tokenizer.drop_ids == []
    assert m2v.count_tokens([text]) == [1]
    assert st.count_tokens([text]) == [3]
    # Only unknown words: nothing left, the zero vector (model2vec's too:
    # tiny-model2vec's reference row 19, the Hindi text, is zeros).
    assert not m2v.embed(["東京"]).any()
    assert st.embed(["東京"]).any()


def test_model2vec_truncation(golden_texts):
    """512 tokens and 512 x 4 characters (the fixture's median token length
    is 4); truncate=False runs the whole text, or refuses it when it has
    more than 512 tokens."""
    model = load_fixture("tiny-model2vec")
    spec = model.spec().tokenizer
    assert spec.char_limit == 512 * 4
    long_code = golden_texts[38]  # 2254 characters, 648 tokens
    ids, before = model.encode([long_code])
    assert len(ids[0]) == 512 and before[0] > 512
    with pytest.raises(mlx_embed.InvalidInput, match="more than max_length=512"):
        model.embed([long_code], truncate=False)
    # 2059 characters and fewer than 512 tokens: the character cut alone
    # shortens it; truncate=False embeds it whole.
    text = golden_texts[34]
    assert len(text) > spec.char_limit
    cut, whole = model.count_tokens([text]), model.count_tokens([text], truncate=False)
    assert cut[0] < whole[0] <= 512
    assert np.allclose(model.embed([text[: spec.char_limit]]), model.embed([text]), atol=1e-6)
    assert (model.embed([text], truncate=False) * model.embed([text])).sum() < 0.9999
    # Left truncation keeps the end: the last characters, then the last tokens.
    left = model.embed([text], truncation_direction="left")
    assert np.allclose(left, model.embed([text[-spec.char_limit:]]), atol=1e-6)


def test_model2vec_cuts_the_end_whatever_the_folder_says(tmp_path, golden_texts):
    """model2vec 0.10's StaticModel.encode keeps a text's first characters and
    calls enable_truncation(max_length) (right) over the tokenizer.json's own
    truncation, so a folder's left side (baked or in tokenizer_config.json) is
    not its cut; load(truncation_side=) still is. (Before, such a folder cut
    on the left: cosine 0.99975 to model2vec's own vectors.)"""
    folder = shutil.copytree(FIXTURES / "tiny-model2vec", tmp_path / "left-m2v")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["truncation"] = {"direction": "Left", "max_length": 512, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({"truncation_side": "left"}))
    text = golden_texts[38]  # 648 tokens
    plain = load_fixture("tiny-model2vec")
    model = mlx_embed.load(folder)
    assert (model.truncation_side, model.spec().tokenizer.truncation_side) == ("right", "right")
    assert model.encode([text])[0] == plain.encode([text])[0]
    assert np.array_equal(model.embed([text]), plain.embed([text]))
    asked = mlx_embed.load(folder, truncation_side="left")
    assert asked.truncation_side == "left"
    assert np.array_equal(asked.embed([text]), plain.embed([text], truncation_direction="left"))


def test_sentence_transformers_does_not_truncate(golden_texts):
    model = load_fixture("tiny-static")
    assert model.spec().tokenizer.char_limit is None
    counts = model.count_tokens(golden_texts)
    assert max(counts) == 648 and counts.count(0) == 2
    # The server's bound: a longer input is cut at max_length (8192 by default).
    small = mlx_embed.load(FIXTURES / "tiny-static", max_length=100)
    assert small.count_tokens([golden_texts[38]]) == [100]
    with pytest.raises(mlx_embed.InvalidInput, match="more than max_length=100"):
        small.embed([golden_texts[38]], truncate=False)


def test_static_embedding_files_at_the_root(tmp_path, golden_texts):
    """sentence-transformers 6 saves the StaticEmbedding at the folder's root
    (path ""), 3-5 in 0_StaticEmbedding/: both load the same."""
    src = FIXTURES / "tiny-static"
    dst = tmp_path / "root-static"
    shutil.copytree(src, dst)
    for name in ("model.safetensors", "tokenizer.json"):
        (dst / "0_StaticEmbedding" / name).rename(dst / name)
    (dst / "0_StaticEmbedding").rmdir()
    mods = json.loads((dst / "modules.json").read_text())
    mods[0]["path"] = ""
    (dst / "modules.json").write_text(json.dumps(mods))
    model = mlx_embed.load(dst)
    _check(model.embed(golden_texts), _ref("tiny-static", "reference_normalized.npy"))


def test_tokenizer_truncation_bounds_a_static_embedding(tmp_path, golden_texts):
    """sentence-transformers leaves a StaticEmbedding's tokenizer.json
    truncation on: it is then the folder's maximum length."""
    dst = tmp_path / "truncating-static"
    shutil.copytree(FIXTURES / "tiny-static", dst)
    path = dst / "0_StaticEmbedding" / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["truncation"] = {"direction": "Right", "max_length": 20, "strategy": "LongestFirst", "stride": 0}
    path.write_text(json.dumps(tok))
    model = mlx_embed.load(dst)
    assert model.max_length == 20
    assert max(model.count_tokens(golden_texts)) == 20


@pytest.mark.parametrize(
    ("baked", "reference", "max_length", "side"),
    [
        (BAKED, "reference_baked_left20_normalized.npy", 20, "left"),
        (None, "reference_normalized.npy", 8192, "right"),
    ],
)
def test_static_embedding_reads_its_tokenizer_json_alone(tmp_path, golden_texts, baked, reference, max_length, side):
    """sentence-transformers 6.2's StaticEmbedding loads its tokenizer.json
    alone and encodes with the truncation baked there (its length and side;
    none: no cut): tokenizer_config.json's model_max_length and
    truncation_side and sentence_bert_config.json's max_seq_length and
    do_lower_case (a Transformer's) change nothing (before: cut at 10, or
    from the right, cosine 0.098 to 0.67 against its vectors)."""
    dst = with_stray_tokenizer_files(FIXTURES / "tiny-static", baked, tmp_path / "stray")
    model = mlx_embed.load(dst)
    assert (model.max_length, model.truncation_side) == (max_length, side)
    _check(model.embed(golden_texts), _ref("tiny-static", reference))
    # load()'s own settings still win.
    assert mlx_embed.load(dst, truncation_side="right").truncation_side == "right"


def test_vocabulary_quantized_rows_are_folded():
    """embeddings[mapping[id]] * weights[id]: two token ids on the same
    cluster row differ only by their weights."""
    from safetensors.numpy import load_file

    model = load_fixture("tiny-model2vec-vq")
    w = load_file(str(FIXTURES / "tiny-model2vec-vq" / "model.safetensors"))
    mapping, weights = w["mapping"], w["weights"]
    ids = np.flatnonzero(mapping == mapping[10])[:2]
    a, b = model.embed_ids([[int(ids[0])], [int(ids[1])]]).vectors, None
    vecs = np.frombuffer(a, dtype="<f4").reshape(2, -1)
    b = w["embeddings"][mapping[10]]
    assert np.allclose(vecs[0], b * weights[ids[0]], atol=1e-6)
    assert np.allclose(vecs[1], b * weights[ids[1]], atol=1e-6)
    assert model.parameter_count == len(mapping) * 64


def test_without_modules_json_a_model2vec_folder_still_loads(tmp_path, golden_texts):
    dst = tmp_path / "bare-model2vec"
    shutil.copytree(FIXTURES / "tiny-model2vec", dst)
    (dst / "modules.json").unlink()
    model = mlx_embed.load(dst)
    _check(model.embed(golden_texts), _ref("tiny-model2vec", "reference_normalized.npy"))


def test_a_folder_without_weights_key_is_refused(tmp_path):
    from safetensors.numpy import save_file

    dst = tmp_path / "bad-static"
    shutil.copytree(FIXTURES / "tiny-model2vec", dst)
    save_file({"emb": np.zeros((4, 4), dtype=np.float32)}, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="'embeddings' \\(Model2Vec\\)"):
        mlx_embed.load(dst)


def test_static_models_take_big_device_passes_unless_told(golden_texts):
    # A static pass is one gather: the architecture's 8192-token budget
    # replaces the CPU's 256 (a 1.6x throughput difference), an explicit
    # batch_tokens still wins, and the cut does not change a vector.
    default = load_fixture("tiny-model2vec")
    small = load_fixture("tiny-model2vec", batch_tokens=16)
    assert default.batch_tokens == 8192 and small.batch_tokens == 16
    assert default.spec().batch_tokens == 8192
    np.testing.assert_array_equal(default.embed(golden_texts), small.embed(golden_texts))


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_a_quantized_table_keeps_the_width_and_the_vectors(folder, golden_texts):
    """load(quantize=) packs the table's rows into uint32 words; the width
    was read off the packed table (16 for 64 at 8 bits) and every embed
    failed on a shape mismatch."""
    ref_name, normalized, _, _ = FOLDERS[folder]
    ref = _ref(folder, ref_name)
    zero = np.abs(ref).max(axis=1) == 0
    for bits, floor in ((8, 0.9999), (4, 0.99)):
        model = mlx_embed.load(FIXTURES / folder, quantize=bits)
        assert (model.dim, model.info()["quantization"]) == (64, bits)
        got = model.embed(golden_texts, normalize=normalized)
        assert got.shape == ref.shape and np.isfinite(got).all()
        assert np.array_equal(got[zero], ref[zero])
        a, b = got[~zero], ref[~zero]
        cos = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        print(f"{folder} {bits}-bit: min cosine {cos.min():.6f}")
        assert cos.min() >= floor
