"""``load(packed_rows=True)``: an encoder's layers on a pass's real tokens
alone (``ops.PackedRows``), attention alone on the padded layout. Every output
must equal the padded path's: pooled vectors, per-token states, pair scores,
SPLADE weights, on every architecture that packs (bert.py's layers, NomicBERT,
GTE)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

import mlx_embed
from mlx_embed import ops

# Mixed lengths, so a pass of them is mostly padding; repeated so that the
# engine's passes hold several of each.
TEXTS = [
    "hi",
    "a sentence of a dozen or so words about how embeddings are computed here",
    "short one",
    "a long text " * 30,
    "x",
    "medium: the quick brown fox jumps over the lazy dog, twice over",
] * 4
# The MLX paths a GPU runs (the native CPU encoder never packs), with one
# worker and a budget that make one pass of every length, as a GPU's does.
SETTINGS = [dict(fast_ops=path, batch_tokens=8192, workers=1) for path in ("exact", "mlx")] + [
    # What a GPU runs: pipelined passes, shape buckets, fused attention.
    dict(fast_ops="exact", batch_tokens=16384, workers=1, pipeline=True, shape_buckets=True, fused_attention=True)
]


@pytest.fixture
def packs(monkeypatch):
    """How many passes ran packed, and the rows they dropped."""
    seen = {"passes": 0, "rows": 0, "padded": 0}
    init = ops.PackedRows.__init__

    def spy(self, mask):
        init(self, mask)
        seen["passes"] += 1
        seen["rows"] += self.rows
        seen["padded"] += mask.size

    monkeypatch.setattr(ops.PackedRows, "__init__", spy)
    return seen


@pytest.mark.parametrize("settings", SETTINGS, ids=["exact", "mlx", "gpu-settings"])
def test_packed_rows_embed_as_the_padded_path(settings, packs):
    padded = mlx_embed.load(**settings)
    packed = mlx_embed.load(packed_rows=True, **settings)
    want = padded.embed(TEXTS)
    assert packs["passes"] == 0
    got = packed.embed(TEXTS)
    # One pass of 24 texts: the longest is ~100 tokens, most are under 20.
    assert packs["passes"] == 1 and packs["rows"] * 2 < packs["padded"], packs
    assert got.shape == want.shape == (len(TEXTS), 384)
    assert float((got * want).sum(axis=1).min()) >= 0.99999
    assert float(np.abs(got - want).max()) <= 1e-5
    assert packed.spec().details["packed_rows"] == "true" and packed.info()["packed_rows"] is True
    assert "packed_rows" not in padded.spec().details and padded.info()["packed_rows"] is False


def test_packed_rows_per_token_states_and_cls_pooling(packs):
    settings = SETTINGS[0]
    padded = mlx_embed.load(**settings)
    packed = mlx_embed.load(packed_rows=True, **settings)
    want, got = padded.embed_tokens(TEXTS), packed.embed_tokens(TEXTS)
    assert packs["passes"] == 1
    assert [w.shape for w in want] == [g.shape for g in got]
    assert max(float(np.abs(w - g).max()) for w, g in zip(want, got)) <= 1e-5
    cls_padded = mlx_embed.load(pooling="cls", **settings)
    cls_packed = mlx_embed.load(pooling="cls", packed_rows=True, **settings)
    assert float(np.abs(cls_padded.embed(TEXTS) - cls_packed.embed(TEXTS)).max()) <= 1e-5


@pytest.mark.parametrize("fixture", ["tiny-distilbert", "tiny-xlm-roberta", "tiny-camembert", "tiny-nomic-bert", "tiny-nomic-moe",
                                     "tiny-gte-en", "tiny-gte-multilingual", "tiny-qwen3", "tiny-qwen2",
                                     "tiny-mistral", "tiny-llama", "tiny-gemma3", "tiny-gemma2", "tiny-eurobert",
                                     "tiny-embedding-gemma2"])
def test_packed_rows_on_every_architecture_that_packs(fixture, packs):
    """bert.py's layers (DistilBERT, XLM-R, CamemBERT reuse them), NomicBERT's
    (rotary positions inside attention) and GTE's (rotary, log-n scaling)
    pack whole layers; the decoders, whose layer loop is mlx-lm's, pack their
    feed-forward (causal attention never lets a real token see the padding's
    values), and EmbeddingGemma's and EuroBERT's bidirectional ones too."""
    settings = SETTINGS[0]
    padded = mlx_embed.load(FIXTURES / fixture, **settings)
    packed = mlx_embed.load(FIXTURES / fixture, packed_rows=True, **settings)
    want, got = padded.embed(TEXTS), packed.embed(TEXTS)
    assert packs["passes"] >= 1
    assert float((got * want).sum(axis=1).min()) >= 0.99999


@pytest.mark.parametrize("fixture", ["tiny-bert-reranker", "tiny-gte-reranker", "tiny-qwen3-reranker",
                                     "tiny-electra-reranker"])
def test_packed_rows_score_pairs_with_token_types(fixture, packs):
    """A cross-encoder reads token types (the second segment 1): packed, the
    scores equal the padded path's."""
    settings = SETTINGS[0]
    path = FIXTURES / fixture
    padded = mlx_embed.load(path, **settings)
    packed = mlx_embed.load(path, packed_rows=True, **settings)
    # Mostly short documents and a few at the maximum: the Qwen3 reranker's
    # template makes every pair ~120 tokens, so it packs only with such a mix.
    docs = ["x", "y", "short doc", "w", "v", "u", "t", "a long text " * 80]
    pairs = [(q, d) for q in TEXTS[:3] for d in docs]
    want, got = padded.score(pairs, raw_scores=True), packed.score(pairs, raw_scores=True)
    assert packs["passes"] >= 1
    assert want.shape == got.shape == (24, 1)
    assert float(np.abs(want - got).max()) <= 1e-4 * (1 + float(np.abs(want).max()))


def test_packed_rows_splade_weights(packs):
    settings = SETTINGS[0]
    path = FIXTURES / "tiny-splade"
    padded = mlx_embed.load(path, **settings)
    packed = mlx_embed.load(path, packed_rows=True, **settings)
    want, got = padded.embed_sparse(TEXTS), packed.embed_sparse(TEXTS)
    assert packs["passes"] >= 1
    for (wi, wv), (gi, gv) in zip(want, got):
        assert np.array_equal(wi, gi)
        assert float(np.abs(wv - gv).max()) <= 1e-4 * (1 + float(wv.max()))


def test_a_pass_that_packing_would_not_shrink_runs_padded(packs):
    """One text, or texts of one length, leave nothing to drop: no packing,
    so no extra gathers for a pass that cannot gain."""
    packed = mlx_embed.load(packed_rows=True, **SETTINGS[0])
    packed.embed(["one text alone"])
    packed.embed(["same length a", "same length b", "same length c"])
    assert packs["passes"] == 0


def test_the_native_cpu_encoder_ignores_packed_rows(packs):
    """The CPU's native encoder takes each text's length itself; packed_rows
    leaves it alone, with the same vectors."""
    padded = mlx_embed.load(fast_ops="native")
    packed = mlx_embed.load(fast_ops="native", packed_rows=True)
    assert float(np.abs(padded.embed(TEXTS) - packed.embed(TEXTS)).max()) <= 1e-6
    assert packs["passes"] == 0


def test_packed_rows_must_be_a_bool():
    with pytest.raises(TypeError, match="packed_rows"):
        mlx_embed.load(packed_rows="yes")


def test_packed_rows_round_trip():
    """pack then unpack puts every real token back in its slot; a padding
    slot gets the first token's row; the packed rows are a bucket length."""
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=np.int32)
    rows = ops.PackedRows(mask)
    assert rows.real == 9 and rows.rows == ops.bucket_length(9) == 16
    import mlx.core as mx

    x = mx.arange(15 * 2, dtype=mx.float32).reshape(3, 5, 2)
    packed = rows.pack(x)
    assert packed.shape == (16, 2)
    flat = np.array(x).reshape(15, 2)
    real = np.flatnonzero(mask.reshape(-1))
    assert np.array_equal(np.array(packed)[:9], flat[real])
    assert np.array_equal(np.array(packed)[9:], np.repeat(flat[:1], 7, axis=0))
    back = np.array(rows.unpack(packed)).reshape(15, 2)
    assert np.array_equal(back[real], flat[real])
    assert np.array_equal(back[mask.reshape(-1) == 0], np.repeat(flat[:1], 6, axis=0))


def test_packed_feed_forward_with_joined_projections(packs):
    """A decoder's gate and up joined into one matmul (``joined_linears``) run
    packed too, with the same vectors."""
    settings = SETTINGS[0]
    path = FIXTURES / "tiny-qwen3"
    want = mlx_embed.load(path, joined_linears=True, **settings).embed(TEXTS)
    got = mlx_embed.load(path, joined_linears=True, packed_rows=True, **settings).embed(TEXTS)
    assert packs["passes"] == 1
    assert float(np.abs(want - got).max()) <= 1e-5


def test_a_patched_feed_forward_outside_a_pass_runs_as_mlx_lm_wrote_it():
    """mlx-lm's MLP class is patched process-wide; outside the engine's
    passes (another mlx-lm user, no packing context) it is unchanged."""
    import mlx.core as mx
    from mlx_lm.models import qwen3 as lm

    import mlx_embed.models.qwen3  # noqa: F401 - patches lm.MLP

    assert lm.MLP._mlx_embed_packs
    mlp = lm.MLP(8, 16)
    x = mx.random.normal((2, 3, 8))
    want = mlp.down_proj(lm.swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    assert float(mx.abs(mlp(x) - want).max()) == 0.0
