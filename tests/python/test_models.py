"""Every architecture against its transformers / sentence-transformers
references (tests/fixtures/tiny-*/README.md says how each was made), through
the public loading path: ``mlx_embed.load(folder)``, fp32 on the CPU."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import mlx_embed
from conftest import FIXTURES, assert_parity, copy_fixture, load_fixture

MAX_LEN = 128

# folder -> (reference of the folder as it is, model_type, pooling, dim)
ARCHITECTURES = {
    "tiny-xlm-roberta": ("reference_mean_normalized.npy", "xlm-roberta", "mean", 64),
    "tiny-camembert": ("reference_mean_normalized.npy", "camembert", "mean", 64),
    "tiny-distilbert": ("reference_mean_normalized.npy", "distilbert", "mean", 64),
    "tiny-mpnet": ("reference_mean_normalized.npy", "mpnet", "mean", 64),
    "tiny-modernbert": ("reference_cls_normalized.npy", "modernbert", "cls", 64),
    "tiny-nomic-bert": ("reference_document_normalized.npy", "nomic_bert", "mean", 64),
    "tiny-qwen2": ("reference_last_token_normalized.npy", "qwen2", "last", 64),
    "tiny-mistral": ("reference_last_token_normalized.npy", "mistral", "last", 64),
    "tiny-llama": ("reference_last_token_normalized.npy", "llama", "last", 64),
    "tiny-gemma3": ("reference_normalized.npy", "gemma3_text", "mean", 48),
    "tiny-gemma2": ("reference_last_token_normalized.npy", "gemma2", "last", 48),
    "tiny-eurobert": ("reference_mean_normalized.npy", "eurobert", "mean", 64),
    "tiny-embedding-gemma2": ("reference_normalized.npy", "embedding_gemma2", "mean", 48),
}


def _ref(folder: str, name: str) -> np.ndarray:
    return np.load(FIXTURES / folder / name)


@pytest.mark.parametrize("folder", sorted(ARCHITECTURES))
def test_matches_reference(folder, golden_texts):
    ref_name, model_type, pooling, dim = ARCHITECTURES[folder]
    model = load_fixture(folder)
    assert (model.model_type, model.pooling, model.dim, model.max_length) == (
        model_type, pooling, dim, MAX_LEN)
    assert_parity(model.embed(golden_texts), _ref(folder, ref_name))


@pytest.mark.parametrize("folder", sorted(ARCHITECTURES))
def test_batch_equals_single_and_max_length(folder, golden_texts):
    model = load_fixture(folder)
    got = model.embed(golden_texts)
    # Mixed lengths, from specials only to inputs cut at max length.
    counts = model.count_tokens(golden_texts, prompt="")
    assert min(counts) <= 3 and counts.count(MAX_LEN) >= 4 and max(counts) == MAX_LEN
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.abs(got - single).max() <= 1e-6


@pytest.mark.parametrize("folder", ["tiny-modernbert", "tiny-nomic-bert"])
def test_attention_in_query_blocks_matches_reference(folder, golden_texts, monkeypatch, query_block_counts):
    """The long-input attention off the native path (query rows in blocks,
    ModernBERT's local band made per block) on ordinary inputs: blocks of 16
    query rows give the reference vectors. The native path's streaming
    kernel takes each text whole (its keys in tiles, the band cut inside
    them), no query blocks, with the same vectors."""
    from mlx_embed import ops

    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", 16 * 4 * 4 * MAX_LEN)
    for fast_ops in ("native", "mlx"):
        model = mlx_embed.load(FIXTURES / folder, fast_ops=fast_ops)
        assert_parity(model.embed(golden_texts), _ref(folder, ARCHITECTURES[folder][0]))
        assert (max(query_block_counts, default=0) >= 8) == (fast_ops == "mlx")
        query_block_counts.clear()


@pytest.mark.parametrize("folder", ["tiny-qwen2", "tiny-mistral", "tiny-llama", "tiny-qwen3"])
def test_decoder_attention_in_query_blocks_matches_reference(folder, golden_texts, monkeypatch, query_block_counts):
    """The decoders' long-input attention off the native path (mlx-lm's
    causal attention in query blocks, each against the keys up to its last
    row: ops.engine_attention) on ordinary inputs: blocks of 8 query rows
    give the reference vectors. The native path's kernel takes each text
    whole (its keys in tiles), no query blocks, with the same vectors;
    mlx-lm's own function runs again outside the engine's passes."""
    from mlx_embed import ops

    heads = 4
    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", heads * 8 * MAX_LEN * 4)
    ref = _ref(folder, "reference_last_token_normalized.npy")
    for fast_ops in ("native", "mlx"):
        model = mlx_embed.load(FIXTURES / folder, max_length=MAX_LEN, fast_ops=fast_ops)
        assert model.model.args.num_attention_heads == heads
        assert_parity(model.embed(golden_texts), ref)
        assert (max(query_block_counts, default=0) >= 8) == (fast_ops == "mlx")
        query_block_counts.clear()
    ids = mx.array([model.encode(golden_texts[:1])[0][0]])
    model.model.model(ids)  # mlx-lm's model, outside a forward pass of the engine
    assert query_block_counts == []


@pytest.mark.parametrize("fast_ops", ["native", "mlx", "exact"])
@pytest.mark.parametrize("folder", ["tiny-eurobert", "tiny-gemma3"])
def test_bidirectional_decoder_attention_in_query_blocks_matches_reference(
        folder, fast_ops, golden_texts, monkeypatch, query_block_counts):
    """The bidirectional decoders' long-input attention (ops.engine_attention
    with a BandMask) off the native path: query rows in blocks, each against
    every key, a sliding layer's window cut per block, on ordinary inputs:
    blocks of at most 8 query rows give the reference vectors. The native
    path's kernel takes each text whole, with the same vectors."""
    from mlx_embed import ops

    ref_name, _, _, _ = ARCHITECTURES[folder]
    model = mlx_embed.load(FIXTURES / folder, fast_ops=fast_ops)
    heads = model.model.args.num_attention_heads
    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", heads * 8 * MAX_LEN * 4)
    assert_parity(model.embed(golden_texts), _ref(folder, ref_name))
    assert (max(query_block_counts, default=0) >= 16) == (fast_ops != "native")


@pytest.mark.parametrize(
    "mode", ["cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", "mean_max"]
)
def test_pooling_modes(mode, golden_texts):
    """Each sentence-transformers pooling mode on the same transformer output
    (tiny-mpnet), unnormalized: mean_sqrt_len_tokens differs from mean only
    in scale."""
    pooling = ("mean", "max") if mode == "mean_max" else mode
    model = mlx_embed.load(FIXTURES / "tiny-mpnet", pooling=pooling)
    ref = _ref("tiny-mpnet", f"reference_{mode}.npy")
    assert model.dim == ref.shape[1]
    assert_parity(model.embed(golden_texts, normalize=False), ref, normalized=False)


@pytest.mark.parametrize("modes", [("cls",), ("max",), ("mean",), ("mean_sqrt_len_tokens",),
                                   ("weightedmean",), ("lasttoken",), ("mean", "max", "cls")])
def test_pooling_in_numpy_matches_mlx(modes):
    """One pooling implementation for both libraries: on the CPU a head that
    only pools runs it in NumPy on the host buffer, on a GPU in MLX; rows of
    every length, padding included."""
    from mlx_embed import pooling

    rng = np.random.default_rng(1)
    h = rng.standard_normal((4, 7, 16)).astype(np.float32)
    lengths = np.array([7, 1, 4, 6])
    mask = (np.arange(7)[None] < lengths[:, None]).astype(np.int32)
    got = pooling.pool(h, mask, modes, xp=np)
    want = np.array(pooling.pool(mx.array(h), mx.array(mask), modes))
    assert got.dtype == np.float32 and got.shape == want.shape == (4, 16 * len(modes))
    assert np.abs(got - want).max() < 1e-6
    assert np.array_equal(pooling.unit_rows(got), pooling.unit_rows(mx.array(got)))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_pooling_sums_in_float32(dtype):
    """The sums of mean, mean_sqrt_len_tokens and weightedmean run in
    float32 and the vector is cast back, as sentence-transformers pools: in
    float16 weightedmean's weights (L(L+1)/2) overflowed from L = 362 and
    a 2,000-token mean's count rounded."""
    from mlx_embed import pooling

    rng = np.random.default_rng(2)
    h = (3 * rng.standard_normal((2, 2000, 8))).astype(np.float32)
    mask = np.ones((2, 2000), dtype=np.int32)
    mask[1, 1500:] = 0
    half = mx.array(h).astype(dtype)
    exact = np.array(half.astype(mx.float32))  # the same inputs, summed in float32 here
    for mode in ("mean", "mean_sqrt_len_tokens", "weightedmean"):
        got = pooling.pool(half, mx.array(mask), (mode,))
        assert got.dtype == dtype
        want = pooling.pool(exact, mask, (mode,), xp=np)
        got = np.array(got.astype(mx.float32))
        assert np.isfinite(got).all(), mode
        # What is left is the cast of the result back to half precision.
        assert np.abs(got - want).max() <= 2 * np.abs(want).max() * (2**-10 if dtype == mx.float16 else 2**-7), mode


def test_only_heads_that_only_pool_run_on_the_host(minilm, golden_texts, golden_mean, monkeypatch):
    """Dense layers (Gemma's), SPLADE and scorers keep MLX; a plain pooling
    head on the CPU takes the host path, and its vectors are the reference's."""
    assert minilm.scheduler._pools_on_host
    calls = []
    real = type(minilm.scheduler)._pool_on_host

    def counting(self, *args):
        calls.append(args[2])  # the real rows of the pass
        return real(self, *args)

    monkeypatch.setattr(type(minilm.scheduler), "_pool_on_host", counting)
    assert_parity(minilm.embed(golden_texts), golden_mean)
    assert sum(calls) == len(golden_texts)
    # Passes padded to bucketed shapes: the pad rows are dropped before pooling.
    bucketed = mlx_embed.load(shape_buckets=True)
    calls.clear()
    got = bucketed.embed(golden_texts[:3])
    assert calls == [3] and bucketed.scheduler._pools_on_host
    assert np.abs(got - minilm.embed(golden_texts[:3])).max() < 1e-6
    # Off the native path, or pipelined, MLX pools.
    assert not mlx_embed.load(fast_ops="mlx").scheduler._pools_on_host
    assert not mlx_embed.load(pipeline=True).scheduler._pools_on_host
    gemma = load_fixture("tiny-gemma3")
    assert gemma.scheduler.head.dense and not gemma.scheduler._pools_on_host
    for folder in ("tiny-splade", "tiny-bert-reranker"):
        assert not load_fixture(folder).scheduler._pools_on_host, folder
    with pytest.raises(ValueError, match="does more than pool"):
        gemma.scheduler.head.pool_on_host(np.zeros((1, 2, 8), np.float32), np.ones((1, 2), np.int32))


def test_modernbert_mean_pooling_override(golden_texts):
    model = load_fixture("tiny-modernbert", pooling="mean")
    assert_parity(model.embed(golden_texts), _ref("tiny-modernbert", "reference_mean_normalized.npy"))


@pytest.mark.parametrize(
    "folder, name, ref",
    [
        ("tiny-xlm-roberta", "query", "reference_query_normalized.npy"),
        ("tiny-xlm-roberta", "passage", "reference_passage_normalized.npy"),
        ("tiny-nomic-bert", "query", "reference_query_normalized.npy"),
        ("tiny-nomic-bert", "document", "reference_document_normalized.npy"),
        ("tiny-qwen2", "query", "reference_query_normalized.npy"),
        ("tiny-mistral", "query", "reference_query_normalized.npy"),
        ("tiny-llama", "query", "reference_query_normalized.npy"),
        ("tiny-gemma3", "query", "reference_query_normalized.npy"),
        ("tiny-gemma3", "document", "reference_document_normalized.npy"),
        ("tiny-gemma2", "query", "reference_query_normalized.npy"),
        ("tiny-embedding-gemma2", "query", "reference_query_normalized.npy"),
        ("tiny-embedding-gemma2", "document", "reference_document_normalized.npy"),
    ],
)
def test_prompt_name_selects_the_prompt(folder, name, ref, golden_texts):
    model = load_fixture(folder)
    assert_parity(model.embed(golden_texts, prompt_name=name), _ref(folder, ref))


def test_prompt_equals_raw_text(golden_texts):
    """e5 style: prompt_name="query" embeds exactly "query: x" as raw text,
    token counts included."""
    model = load_fixture("tiny-xlm-roberta")
    assert model.prompts["query"] == "query: " and model.default_prompt_name is None
    texts = golden_texts[:34]  # the ones shorter than max length
    a, ca = model.embed_with_counts(texts, prompt_name="query")
    b, cb = model.embed_with_counts(["query: " + t for t in texts])
    assert ca == cb
    assert np.array_equal(a, b)
    plain, cp = model.embed_with_counts(texts)
    assert all(x > y for x, y in zip(ca, cp))
    assert np.abs(plain - a).max() > 1e-2


def test_do_lower_case_lowercases_prompt_and_text(golden_texts, tmp_path):
    """sentence_bert_config.json's do_lower_case: sentence-transformers puts
    a Lowercase normalizer in front of the tokenizer's own, so each character
    (of prompt and text) is lower-cased alone: a word-final capital sigma
    becomes σ (str.lower would make it ς). The XLM-R fixture's tokenizer is
    cased, so the flag changes ids and vectors."""
    cased = load_fixture("tiny-xlm-roberta")
    d = tmp_path / "lower"
    shutil.copytree(FIXTURES / "tiny-xlm-roberta", d)
    cfg = json.loads((d / "sentence_bert_config.json").read_text())
    (d / "sentence_bert_config.json").write_text(json.dumps({**cfg, "do_lower_case": True}))
    lower = mlx_embed.load(str(d))
    assert lower.spec().tokenizer.lowercase and not cased.spec().tokenizer.lowercase
    texts = ["UPPER Case MiXeD", "ΟΔΟΣ ΣΟΦΟΣ İstanbul STRASSE", *golden_texts[:6]]
    got, counts = lower.embed_with_counts(texts, prompt_name="query")
    want, want_counts = cased.embed_with_counts(["".join(c.lower() for c in t) for t in texts], prompt="query: ")
    assert counts == want_counts
    assert np.array_equal(got, want)
    # The flag is what made the difference: the cased model reads capitals apart.
    assert cased.encode(texts[:1])[0] != lower.encode(texts[:1])[0]
    # Not a flag: refused with the file named.
    (d / "sentence_bert_config.json").write_text(json.dumps({**cfg, "do_lower_case": "yes"}))
    with pytest.raises(ValueError, match="sentence_bert_config.json: do_lower_case must be true or false"):
        mlx_embed.load(str(d))


def test_default_prompt_applies_unless_overridden(golden_texts):
    model = load_fixture("tiny-nomic-bert")
    assert model.default_prompt_name == "document"
    assert model.spec().tokenizer.default_prompt_name == "document"
    assert model.spec().tokenizer.prompts["query"] == "search_query: "
    assert_parity(model.embed(golden_texts, prompt=""), _ref("tiny-nomic-bert", "reference_noprompt_normalized.npy"))
    a = model.embed(golden_texts[:5])
    b = model.embed(["search_document: " + t for t in golden_texts[:5]], prompt="")
    assert np.array_equal(a, b)
    # A text the caller prefixed with one of the prompts (as nomic's users do
    # on Ollama) gets no default prompt before it: one prefix, not two.
    queries = ["search_query: " + t for t in golden_texts[:5]]
    assert_parity(model.embed(queries), _ref("tiny-nomic-bert", "reference_query_normalized.npy")[:5])
    assert np.array_equal(model.embed(queries), model.embed(golden_texts[:5], prompt_name="query"))
    # A prompt asked for is always prepended, even before another.
    assert np.array_equal(model.embed(queries, prompt_name="document"),
                          model.embed(["search_document: " + q for q in queries], prompt=""))


def test_roberta_model_type_is_the_same_network(golden_texts, tmp_path):
    """RoBERTa checkpoints (model_type "roberta") run through the XLM-R file."""
    d = tmp_path / "roberta"
    shutil.copytree(FIXTURES / "tiny-xlm-roberta", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="roberta", architectures=["RobertaModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    model = mlx_embed.load(d)
    assert model.model_type == "roberta"
    assert_parity(model.embed(golden_texts), _ref("tiny-xlm-roberta", "reference_mean_normalized.npy"))


def _renamed_weights(src, dst, rename, extra=()):
    """src copied to dst with its weights renamed (and task-head tensors
    added) as the masked-LM / classifier checkpoints of the same encoder
    carry them."""
    import mlx.core as mx

    shutil.copytree(FIXTURES / src, dst)
    w = mx.load(str(dst / "model.safetensors"))
    out = {rename(k): v for k, v in w.items()}
    for name, shape in extra:
        out[name] = mx.ones(shape)
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    return dst


def test_distilbert_cls_pooling_tas_b_style(golden_texts, tmp_path):
    """msmarco-distilbert-base-tas-b: the folder's Pooling says cls and has
    no Normalize (scored by dot product), so unnormalized vectors match."""
    d = tmp_path / "tas-b"
    shutil.copytree(FIXTURES / "tiny-distilbert", d)
    pool = json.loads((d / "1_Pooling" / "config.json").read_text())
    pool.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    mods = [m for m in json.loads((d / "modules.json").read_text()) if m["path"] != "2_Normalize"]
    (d / "modules.json").write_text(json.dumps(mods))
    model = mlx_embed.load(d)
    assert (model.model_type, model.pooling, model.dim) == ("distilbert", "cls", 64)
    assert_parity(model.embed(golden_texts, normalize=False), _ref("tiny-distilbert", "reference_cls.npy"),
           normalized=False)


def test_distilbert_masked_lm_checkpoint_names(golden_texts, tmp_path):
    """DistilBertForMaskedLM / ...ForSequenceClassification keep the encoder
    under "distilbert." beside their heads: the same embeddings."""
    d = _renamed_weights(
        "tiny-distilbert", tmp_path / "mlm", lambda k: "distilbert." + k,
        [("vocab_transform.weight", (64, 64)), ("vocab_transform.bias", (64,)),
         ("vocab_layer_norm.weight", (64,)), ("vocab_layer_norm.bias", (64,)),
         ("vocab_projector.weight", (1200, 64)), ("vocab_projector.bias", (1200,)),
         ("pre_classifier.weight", (64, 64)), ("classifier.weight", (2, 64))])
    got = mlx_embed.load(d).embed(golden_texts)
    assert np.array_equal(got, load_fixture("tiny-distilbert").embed(golden_texts))


def test_distilbert_runs_the_native_fused_encoder(golden_texts, monkeypatch):
    """DistilBERT's blocks are BERT's: on the CPU's native path all of them
    run in one post_ln_encoder_ call per pass, to the bit what the blocks
    give one by one."""
    import mlx.core as mx
    from mlx_embed import _native, ops

    model = load_fixture("tiny-distilbert")
    assert model.context.path == "native"
    calls = []
    real = _native.post_ln_encoder_

    def counting(*args, **kwargs):
        calls.append(len(args[3]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_native, "post_ln_encoder_", counting)
    fused = model.embed(golden_texts)
    assert calls and set(calls) == {2}
    x = mx.zeros((1, 3, 64))
    mask = ops.KeyMask(mx.ones((1, 3), dtype=mx.int32), mx.float32)
    with ops.forward_context(ops.ForwardContext(path="native")):
        assert ops.post_ln_encoder(model.model.layers, x, mask) is not None
    monkeypatch.setattr(ops, "post_ln_encoder", lambda *args, **kwargs: None)
    assert np.array_equal(fused, model.embed(golden_texts))


def test_camembert_masked_lm_checkpoint_names(golden_texts, tmp_path):
    """CamembertForMaskedLM (camembert-base) keeps the encoder under
    "roberta." beside lm_head.*: the same embeddings."""
    d = _renamed_weights(
        "tiny-camembert", tmp_path / "mlm", lambda k: "roberta." + k,
        [("lm_head.dense.weight", (64, 64)), ("lm_head.dense.bias", (64,)),
         ("lm_head.layer_norm.weight", (64,)), ("lm_head.layer_norm.bias", (64,)),
         ("lm_head.decoder.weight", (935, 64)), ("lm_head.bias", (935,))])
    got = mlx_embed.load(d).embed(golden_texts)
    assert np.array_equal(got, load_fixture("tiny-camembert").embed(golden_texts))


def test_unknown_prompt_name_is_invalid_input():
    with pytest.raises(mlx_embed.errors.InvalidInput, match="nope"):
        load_fixture("tiny-xlm-roberta").embed(["x"], prompt_name="nope")


@pytest.mark.parametrize("folder", sorted(ARCHITECTURES))
def test_left_truncation_keeps_the_last_tokens(folder, golden_texts):
    model = load_fixture(folder)
    long = golden_texts[34]
    right, _ = model.encode([long], prompt="")
    left, before = model.encode([long], truncation_direction="left", prompt="")
    tok = model.tokenizer
    content = tok.encode_contents([long])[0]
    assert before[0] > MAX_LEN and len(left[0]) == MAX_LEN == len(right[0])
    n = tok.max_content
    assert left[0] == tok.prefix + content[-n:] + tok.suffix
    assert right[0] == tok.prefix + content[:n] + tok.suffix
    assert left[0] != right[0]
    v_left = model.embed([long], truncation_direction="left", prompt="")
    v_tail = model.embed_ids([left[0]])
    got = np.frombuffer(v_tail.vectors, dtype="<f4").reshape(1, -1)
    assert np.allclose(v_left, got / np.linalg.norm(got), atol=1e-6)


def test_dense_layers_change_the_width(tmp_path):
    """embeddinggemma-style Dense layers: 48 -> 96 -> 48, the spec reports
    the pipeline's output width."""
    model = load_fixture("tiny-gemma3")
    assert model.spec().dim == 48
    # A folder whose last Dense goes to 96: the output width follows.
    d = tmp_path / "wide"
    shutil.copytree(FIXTURES / "tiny-gemma3", d)
    mods = json.loads((d / "modules.json").read_text())
    mods = [m for m in mods if m["path"] != "3_Dense"]
    for i, m in enumerate(mods):
        m["idx"] = i
    (d / "modules.json").write_text(json.dumps(mods))
    wide = mlx_embed.load(d)
    assert wide.dim == 96 and wide.embed(["hello"]).shape == (1, 96)


@pytest.mark.parametrize("key,value", [("module_input_name", "token_embeddings"),
                                       ("module_output_name", "token_embeddings")])
def test_a_dense_over_token_embeddings_is_refused(tmp_path, key, value):
    """sentence-transformers 6 can point a Dense at the token embeddings,
    which leaves the sentence vector as it is: run over the sentence vector
    instead, it changed the output (a review: 32 dims for 64)."""
    d = tmp_path / "token-dense"
    shutil.copytree(FIXTURES / "tiny-gemma3", d)
    cfg = json.loads((d / "2_Dense" / "config.json").read_text())
    (d / "2_Dense" / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(ValueError, match=f"2_Dense/config.json: {key}='{value}' is not supported"):
        mlx_embed.load(d)
    # The sentence embedding, named as such, is what runs anyway.
    (d / "2_Dense" / "config.json").write_text(json.dumps({**cfg, key: "sentence_embedding"}))
    assert mlx_embed.load(d).dim == 48


@pytest.mark.parametrize("activation,expected", [
    ("LeakyReLU", lambda y: np.where(y > 0, y, 0.01 * y)),
    ("ELU", lambda y: np.where(y > 0, y, np.expm1(y))),
    ("Softplus", lambda y: np.log1p(np.exp(y))),
    ("Hardtanh", lambda y: np.clip(y, -1.0, 1.0)),
    ("Mish", lambda y: y * np.tanh(np.log1p(np.exp(y)))),
])
def test_dense_activations_with_torchs_defaults(tmp_path, activation, expected):
    """sentence-transformers saves a Dense activation as its class name alone,
    so it runs with torch's defaults (LeakyReLU 0.01, ELU 1.0, Hardtanh
    [-1, 1]); a Dropout module, which changes nothing at inference, is skipped."""
    d = tmp_path / activation
    shutil.copytree(FIXTURES / "tiny-gemma3", d)
    cfg = json.loads((d / "3_Dense" / "config.json").read_text())
    cfg["activation_function"] = f"torch.nn.modules.activation.{activation}"
    (d / "3_Dense" / "config.json").write_text(json.dumps(cfg))
    mods = json.loads((d / "modules.json").read_text())
    mods.insert(-1, {"idx": 99, "name": "drop", "path": "", "type": "sentence_transformers.models.Dropout"})
    (d / "modules.json").write_text(json.dumps(mods))
    model = mlx_embed.load(d)
    identity = tmp_path / "identity"
    if not identity.exists():
        shutil.copytree(FIXTURES / "tiny-gemma3", identity)
        cfg["activation_function"] = "torch.nn.modules.linear.Identity"
        (identity / "3_Dense" / "config.json").write_text(json.dumps(cfg))
    texts = ["rivers flow", "mountains and the sea"]
    pre = np.asarray(mlx_embed.load(identity).embed(texts, normalize=False))
    got = np.asarray(model.embed(texts, normalize=False))
    assert np.abs(got - expected(pre.astype(np.float64))).max() <= 1e-5


def test_dense_layers_saved_in_bfloat16_run_in_float32(tmp_path, golden_texts):
    """sentence-transformers loads Dense layers in float32 whatever they were
    saved in (EmbeddingGemma's are bfloat16); run in bfloat16 they moved the
    vectors by 1.6e-3. Saved as bfloat16 or as the same values in float32,
    the vectors are the same."""
    saved = {}
    for dtype in ("bfloat16", "float32"):
        d = tmp_path / dtype
        shutil.copytree(FIXTURES / "tiny-gemma3", d)
        for sub in ("2_Dense", "3_Dense"):
            path = str(d / sub / "model.safetensors")
            w = mx.load(path)
            w = {k: v.astype(mx.bfloat16) for k, v in w.items()}
            mx.save_safetensors(path, {k: v.astype(getattr(mx, dtype)) for k, v in w.items()})
        saved[dtype] = mlx_embed.load(d).embed(golden_texts[:8])
    assert np.array_equal(saved["bfloat16"], saved["float32"])


@pytest.mark.parametrize("folder", ["tiny-qwen3", "tiny-qwen3-reranker"])
def test_qwen3_sliding_window_attention_is_refused(folder, tmp_path):
    """mlx-lm's Qwen3 attends to every earlier token: a config with sliding
    layers loaded and ran them as full attention (cosine 0.63 to transformers
    at 42 tokens with an 8-token window)."""
    # As transformers reads it: layer_types when the config has them, else
    # the layers from max_window_layers on.
    sliding = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}
    with pytest.raises(ValueError, match=r"qwen3: sliding-window attention \(window 8, layers 1-1\)"):
        mlx_embed.load(copy_fixture(folder, tmp_path / "sliding", **sliding))
    types = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}
    with pytest.raises(ValueError, match="qwen3: sliding-window attention"):
        mlx_embed.load(copy_fixture(folder, tmp_path / "types", **types))
    # A window on no layer (Qwen3-Embedding's own configs) is full attention.
    full = mlx_embed.load(copy_fixture(folder, tmp_path / f"{folder}-full", **{**sliding, "max_window_layers": 2}))
    assert full.kind == ("reranker" if "reranker" in folder else "embedding")


def _mistral_copy(dst, drop=(), **edit):
    """tiny-mistral copied to dst with config.json keys dropped / set."""
    shutil.copytree(FIXTURES / "tiny-mistral", dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k in drop:
        cfg.pop(k)
    cfg.update(edit)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_mistral_instruction_is_the_query_prompt(golden_texts):
    """e5-mistral / SFR style: a raw instruction in the Instruct/Query
    template is the folder's query prompt."""
    model = load_fixture("tiny-mistral")
    task = "Given a web search query, retrieve relevant passages that answer the query"
    assert model.prompts["query"] == f"Instruct: {task}\nQuery: " and model.default_prompt_name is None
    assert_parity(model.embed(golden_texts, instruction=task), _ref("tiny-mistral", "reference_query_normalized.npy"))


def test_mistral_max_length_is_capped_at_the_sliding_window(golden_texts, tmp_path):
    """Inside the sliding window Mistral's attention is full causal attention,
    so the window caps max_length: the folder's 128 drops to a window of 64,
    texts that fit in it give the reference, an explicit max_length past it is
    refused, and no window (null) leaves the folder's 128."""
    ref = _ref("tiny-mistral", "reference_last_token_normalized.npy")
    counts = load_fixture("tiny-mistral").count_tokens(golden_texts, prompt="")
    fit = [i for i, n in enumerate(counts) if n <= 64]
    assert 10 <= len(fit) < len(golden_texts)
    d = _mistral_copy(tmp_path / "w64", sliding_window=64)
    capped = mlx_embed.load(d)
    assert capped.max_length == 64
    assert_parity(capped.embed([golden_texts[i] for i in fit]), ref[fit])
    assert max(capped.count_tokens(golden_texts, prompt="")) == 64
    with pytest.raises(ValueError, match="max_length 128 > the 64"):
        mlx_embed.load(d, max_length=128)
    full = mlx_embed.load(_mistral_copy(tmp_path / "none", sliding_window=None))
    assert full.max_length == MAX_LEN
    assert_parity(full.embed(golden_texts), ref)


def test_mistral_transformers5_config(golden_texts, tmp_path):
    """The config as transformers 5 writes it (rope_parameters, head_dim)
    is the same model as the published flat rope_theta."""
    d = _mistral_copy(tmp_path / "m", drop=("rope_theta",), head_dim=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert_parity(mlx_embed.load(d).embed(golden_texts), _ref("tiny-mistral", "reference_last_token_normalized.npy"))


def test_llama_config_forms_give_the_reference(golden_texts, tmp_path):
    """tiny-llama's config is Llama 3.1's (flat rope_theta, rope_scaling of
    type llama3, pretraining_tp 1): transformers 5's rope_parameters form,
    pretraining_tp 2 (transformers 4 split the matmuls, the same product;
    5 ignores it) and a stray sliding_window (LlamaConfig has none) give the
    same vectors; a bare LlamaModel checkpoint (no "model." prefix) too."""
    from safetensors.numpy import load_file, save_file

    ref = _ref("tiny-llama", "reference_last_token_normalized.npy")
    d = copy_fixture("tiny-llama", tmp_path / "t5")
    cfg = json.loads((d / "config.json").read_text())
    scaling = cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {**scaling, "rope_theta": cfg.pop("rope_theta")}
    cfg.update(pretraining_tp=2, sliding_window=8, architectures=["LlamaModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(d / "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in w.items()}, str(d / "model.safetensors"))
    model = mlx_embed.load(d)
    assert model.max_length == MAX_LEN
    assert_parity(model.embed(golden_texts), ref)


def test_llama_rope_scaling_is_read(golden_texts, tmp_path):
    """The llama3 scaling changes the vectors (the fixture's texts run past
    its 32-token original context): without it, or with a linear scaling
    of the same factor, the reference is missed by far, and a linear one
    is not refused (it is exact)."""
    ref = _ref("tiny-llama", "reference_last_token_normalized.npy")
    for scaling in (None, {"rope_type": "linear", "factor": 8.0}):
        d = copy_fixture("tiny-llama", tmp_path / str(bool(scaling)), rope_scaling=scaling)
        got = mlx_embed.load(d).embed(golden_texts)
        assert (got * ref).sum(axis=1).min() < 0.95


def test_llama_appends_no_eos(golden_texts):
    """Llama 3's tokenizer adds <|begin_of_text|> and no EOS, and
    sentence-transformers appends none: neither does the engine (an
    appended <|eot_id|> measured cosine -0.21 on the fixture)."""
    model = load_fixture("tiny-llama")
    assert (model.tokenizer.prefix, model.tokenizer.suffix) == ([800], [])
    assert model.count_tokens(["hello world"], prompt="") == [1 + len(model.tokenizer._tok.encode(
        "hello world", add_special_tokens=False).ids)]


def test_mistral_4bit(golden_texts, tmp_path):
    """What people run on a Mac: a Mistral embedder in 4-bit, quantized at
    load or as a pre-quantized mlx-lm style folder ("model." names, an LM
    head the embedder drops, config "quantization"), the same model either
    way. The tiny random weights have little redundancy: 4-bit measured min
    cosine 0.931, mean 0.977 to the fp32 reference (8-bit: 0.9998)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    fp = load_fixture("tiny-mistral")
    q = mlx_embed.load(FIXTURES / "tiny-mistral", quantize=4)
    assert q.quantization == 4 and q.parameter_count == fp.parameter_count
    assert q.weights_bytes < fp.weights_bytes / 4
    got = q.embed(golden_texts)
    cos = (got * _ref("tiny-mistral", "reference_last_token_normalized.npy")).sum(axis=1)
    assert cos.min() >= 0.9 and cos.mean() >= 0.95
    d = tmp_path / "m4"
    shutil.copytree(FIXTURES / "tiny-mistral", d)
    params = dict(tree_flatten(q.model.parameters()))
    params.update({f"lm_head.{k}": params[f"model.embed_tokens.{k}"] for k in ("weight", "scales", "biases")})
    mx.save_safetensors(str(d / "model.safetensors"), params)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    pre = mlx_embed.load(d, dequantize=False)
    assert pre.quantization == 4
    assert np.abs(pre.embed(golden_texts) - got).max() <= 1e-6


GEMMA2_WINDOW = 16  # tiny-gemma2's sliding_window


def test_gemma2_texts_past_the_sliding_window(golden_texts):
    """bge-multilingual-gemma2 style: the sliding layers' window is exact past
    its length (most golden texts run past tiny-gemma2's 16 tokens; the
    fixture's README: no window at all measures cosine 0.966, one token
    wider 0.995), each text alone and in one padded batch, with and without
    the query prompt."""
    model = load_fixture("tiny-gemma2")
    ref = _ref("tiny-gemma2", "reference_last_token_normalized.npy")
    counts = model.count_tokens(golden_texts, prompt="")
    past = [i for i, n in enumerate(counts) if n > GEMMA2_WINDOW]
    assert len(past) >= 25 and any(n <= GEMMA2_WINDOW for n in counts)
    assert_parity(model.embed([golden_texts[i] for i in past]), ref[past])
    alone = np.concatenate([model.embed([golden_texts[i]]) for i in past])
    assert_parity(alone, ref[past])
    ref_q = _ref("tiny-gemma2", "reference_query_normalized.npy")
    assert min(model.count_tokens(golden_texts, prompt_name="query")) > GEMMA2_WINDOW
    assert_parity(np.concatenate([model.embed([t], prompt_name="query") for t in golden_texts]), ref_q)


def test_gemma2_tokens_are_what_sentence_transformers_runs(golden_texts):
    """Gemma 2's tokenizer adds <bos> and no <eos>, and sentence-transformers
    appends none: the pooled token is the text's last (appending <eos>, as
    the Qwen3 and Mistral defaults do, measured cosine -0.25 to the
    reference)."""
    model = load_fixture("tiny-gemma2")
    ids, _ = model.encode(golden_texts)
    assert all(row[0] == 2 and 1 not in row for row in ids)
    assert model.tokenizer.token_id("<eos>") == 1


def test_gemma2_instruction_is_the_query_prompt(golden_texts):
    """A raw instruction in bge-multilingual-gemma2's `<instruct>{task}\n<query>`
    form is the folder's query prompt."""
    model = load_fixture("tiny-gemma2")
    task = "Given a web search query, retrieve relevant passages that answer the query."
    assert model.prompts["query"] == f"<instruct>{task}\n<query>" and model.default_prompt_name is None
    assert_parity(model.embed(golden_texts, instruction=task), _ref("tiny-gemma2", "reference_query_normalized.npy"))


@pytest.mark.parametrize("fast_ops", ["native", "mlx", "exact"])
def test_gemma2_attention_in_query_blocks_matches_reference(fast_ops, golden_texts, monkeypatch, query_block_counts):
    """Long inputs' attention in query blocks, each against only the keys it
    sees (a sliding layer's from its first row's window on): blocks of 8
    query rows give the reference vectors on the MLX paths; the native
    kernel's (no query blocks) too."""
    from mlx_embed import ops

    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", 4 * 8 * MAX_LEN * 4)
    model = mlx_embed.load(FIXTURES / "tiny-gemma2", fast_ops=fast_ops)
    assert model.model.args.num_attention_heads == 4
    assert_parity(model.embed(golden_texts), _ref("tiny-gemma2", "reference_last_token_normalized.npy"))
    # The native path's kernel takes each text whole, its keys in tiles.
    assert (max(query_block_counts, default=0) >= 8) == (fast_ops != "native")


def test_gemma2_transformers5_config(golden_texts, tmp_path):
    """The config as transformers 5 writes it (rope_parameters, layer_types)
    is the published one's model; other layer_types are read, not assumed."""
    ref = _ref("tiny-gemma2", "reference_last_token_normalized.npy")
    types = ["sliding_attention", "full_attention"] * 2
    d = copy_fixture("tiny-gemma2", tmp_path / "t5", rope_theta=None, layer_types=types,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert_parity(mlx_embed.load(d).embed(golden_texts), ref)
    other = copy_fixture("tiny-gemma2", tmp_path / "full-first", layer_types=types[::-1])
    got = mlx_embed.load(other).embed(golden_texts)
    assert float((got * ref).sum(axis=1).min()) < 0.99


def test_gemma2_half_precision_runs(golden_texts):
    """bfloat16 weights (how the 9B checkpoint is run): the soft-capped
    scores and softmax stay float32, the vectors near the reference."""
    model = mlx_embed.load(FIXTURES / "tiny-gemma2", dtype="bfloat16")
    got = model.embed(golden_texts)
    cos = (got * _ref("tiny-gemma2", "reference_last_token_normalized.npy")).sum(axis=1)
    assert np.isfinite(got).all() and cos.min() >= 0.99


@pytest.mark.parametrize(
    "folder, edit, match",
    [
        ("tiny-gemma3", {"use_bidirectional_attention": False}, "use_bidirectional_attention"),
        ("tiny-qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("tiny-mistral", {"hidden_act": "gelu"}, "hidden_act"),
        ("tiny-gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("tiny-gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("tiny-gemma2", {"sliding_window": None}, "sliding_window"),
        ("tiny-gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("tiny-gemma2", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ("tiny-mistral", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ("tiny-llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        ("tiny-llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
        ("tiny-llama", {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope'"),
        ("tiny-llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3' lacks low_freq_factor"),
        ("tiny-llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("tiny-llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("tiny-eurobert", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
        ("tiny-eurobert", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        ("tiny-eurobert", {"hidden_act": "gelu"}, "hidden_act"),
        ("tiny-nomic-bert", {"rotary_scaling_factor": 2.0}, "rotary_scaling_factor"),
        ("tiny-nomic-bert", {"activation_function": "gelu_new"}, "activation_function"),
        ("tiny-modernbert", {"hidden_activation": "relu"}, "hidden_activation"),
        ("tiny-mpnet", {"relative_attention_num_buckets": 64}, "relative_attention_num_buckets"),
        ("tiny-distilbert", {"sinusoidal_pos_embds": True}, "sinusoidal_pos_embds"),
        ("tiny-distilbert", {"activation": "relu"}, "activation"),
        ("tiny-mpnet", {"model_type": "deberta"}, "supported: bert, xlm-roberta"),
    ],
)
def test_unsupported_variants_are_named(folder, edit, match, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / folder, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        mlx_embed.load(d)


def test_unsupported_st_module_is_named(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "tiny-mpnet", d)
    mods = json.loads((d / "modules.json").read_text())
    mods.insert(2, {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
    (d / "modules.json").write_text(json.dumps(mods))
    with pytest.raises(ValueError, match="LayerNorm.*not supported"):
        mlx_embed.load(d)


@pytest.mark.parametrize("folder", ["tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama", "tiny-gemma3",
                                    "tiny-gemma2", "tiny-qwen3-reranker"])
def test_loading_a_decoder_leaves_the_open_file_limit_alone(folder):
    """mlx-lm's package sets the open-file limit to (2048, 4096) when
    imported: a server of a decoder model could hold no more than 2,048
    connections, and where the hard limit was under 4,096 the import failed.
    A fresh process, so nothing imported mlx-lm before."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1000), hard))\n"
        "before = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "import mlx_embed\n"
        f"m = mlx_embed.load({str(FIXTURES / folder)!r})\n"
        "after = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "assert after == before, (before, after)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_eurobert_checkpoint_layouts_and_config_forms(tmp_path, golden_texts):
    """tiny-eurobert's weights as EuroBertForMaskedLM saves them (the
    published checkpoints: the encoder under "model.", an LM head embeddings
    never read), its config in transformers 5's form (rope_parameters) and
    without rms_norm_eps (EuroBertConfig's 1e-5, not LlamaConfig's 1e-6:
    the fixture's small token table makes the two 0.93 apart in cosine):
    each gives the reference."""
    import mlx.core as mx

    ref = _ref("tiny-eurobert", "reference_mean_normalized.npy")
    mlm = tmp_path / "mlm"
    shutil.copytree(FIXTURES / "tiny-eurobert", mlm)
    weights = mx.load(str(mlm / "model.safetensors"))
    assert not any(k.startswith("model.") for k in weights)
    saved = {"model." + k: v for k, v in weights.items()}
    saved["lm_head.weight"] = mx.random.normal((804, 64))
    mx.save_safetensors(str(mlm / "model.safetensors"), saved)
    cfg = json.loads((mlm / "config.json").read_text())
    # As the published configs carry them: the remote code's auto_map and
    # clf_pooling (neither read by the encoder).
    cfg.update(architectures=["EuroBertForMaskedLM"], clf_pooling="late", auto_map={
        "AutoConfig": "configuration_eurobert.EuroBertConfig", "AutoModel": "modeling_eurobert.EuroBertModel",
        "AutoModelForMaskedLM": "modeling_eurobert.EuroBertForMaskedLM"})
    (mlm / "config.json").write_text(json.dumps(cfg))
    assert_parity(mlx_embed.load(mlm).embed(golden_texts), ref)
    rope = copy_fixture("tiny-eurobert", tmp_path / "rope", rope_theta=None, rope_scaling=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    assert_parity(mlx_embed.load(rope).embed(golden_texts), ref)
    no_eps = copy_fixture("tiny-eurobert", tmp_path / "eps", rms_norm_eps=None)
    assert mlx_embed.load(no_eps).model.args.rms_norm_eps == 1e-5
    assert_parity(mlx_embed.load(no_eps).embed(golden_texts), ref)


def test_eurobert_attends_both_ways_and_masks_the_padding(golden_texts):
    """Bidirectional: a token's state depends on the tokens after it (a
    causal mask would leave the first tokens of "a b" and "a c" equal), and
    padding is hidden as a key (a short text padded beside a long one gives
    its vector alone, also through mlx-lm's attention outside the engine's
    passes)."""
    model = load_fixture("tiny-eurobert")
    a, b = model.embed_tokens(["water boils", "water freezes"])
    assert np.abs(a[1] - b[1]).max() > 1e-2
    ids, _ = model.encode(golden_texts[:2] + [golden_texts[-1]])
    width = max(len(i) for i in ids)
    pad = 801
    batch = mx.array([i + [pad] * (width - len(i)) for i in ids])
    mask = mx.array([[1] * len(i) + [0] * (width - len(i)) for i in ids])
    padded = model.model(batch, mask)
    for row, i in enumerate(ids):
        alone = model.model(mx.array([i]), mx.ones((1, len(i)), dtype=mx.int32))
        assert np.abs(np.array(padded[row, : len(i)]) - np.array(alone[0])).max() <= 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_eurobert_half_precision_runs(dtype, golden_texts):
    model = mlx_embed.load(FIXTURES / "tiny-eurobert", dtype=dtype)
    got = model.embed(golden_texts)
    cos = (got * _ref("tiny-eurobert", "reference_mean_normalized.npy")).sum(axis=1)
    assert np.isfinite(got).all() and cos.min() >= 0.99
