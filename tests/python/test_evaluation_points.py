"""``load(eval_chunk_mb=...)``: a pass evaluated in pieces, at most two queued
ahead of the device (``ops.EvaluationPoints``), which bounds device memory
where MLX's CUDA graphs are off. The pieces must not change a single bit of
the output, every architecture's layers must offer the point, and the host
must never queue more than two."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES

import mlx_embed
from mlx_embed import device, ops, scheduler

TEXTS = [
    "hi",
    "a sentence of a dozen or so words about how embeddings are computed here",
    "a long text " * 30,
    "x",
] * 6
# What a GPU runs: pipelined passes, shape buckets, one pass of every length.
GPU_SETTINGS = dict(fast_ops="exact", batch_tokens=16384, workers=1, pipeline=True, shape_buckets=True)


@pytest.fixture
def points(monkeypatch):
    """Every EvaluationPoints a call makes, and the most it ever queued.
    ``tiny`` makes every layer output reach a chunk (the fixtures' layers
    output a few KB)."""
    made = []
    state = {"tiny": False, "most_queued": 0, "layer_points": 0, "waits": 0}

    class Recording(ops.EvaluationPoints):
        def __init__(self, chunk_bytes, depth=2):
            super().__init__(1 if state["tiny"] else chunk_bytes, depth)
            made.append(self)

        def after_layer(self, out):
            before = self.points
            super().after_layer(out)
            state["layer_points"] += self.points - before

        def mark(self, out):
            queued = len(self._queued)
            super().mark(out)
            state["waits"] += queued + 1 - len(self._queued)
            state["most_queued"] = max(state["most_queued"], len(self._queued))

    monkeypatch.setattr(ops, "EvaluationPoints", Recording)
    state["made"] = made
    return state


def test_a_pass_evaluated_after_every_layer_keeps_its_bits(points):
    whole = mlx_embed.load(eval_chunk_mb=0, **GPU_SETTINGS)
    pieces = mlx_embed.load(eval_chunk_mb=1, **GPU_SETTINGS)
    want = whole.embed(TEXTS)
    assert points["made"] == []
    got = pieces.embed(TEXTS)
    # One pass of 24 texts padded to ~128 tokens: each of MiniLM's 6 layers
    # outputs 24 x 128 x 384 x 4 bytes (4.7 MB), over the 1 MB chunk, so a
    # point after every layer and one for the pass's pooled vectors.
    (call,) = points["made"]
    assert call.points == 7 and points["layer_points"] == 6
    assert points["most_queued"] == 2
    assert np.array_equal(got, want)
    assert pieces.info()["eval_chunk_mb"] == 1 and pieces.spec().details["eval_chunk_mb"] == "1"
    assert whole.info()["eval_chunk_mb"] == 0 and "eval_chunk_mb" not in whole.spec().details


def test_a_chunk_spans_layers_until_their_outputs_reach_it(points):
    """A 64 MB chunk: the 4.7 MB layers of a 24-text pass never reach it, so
    the pass is evaluated whole, as a server-sized pass is."""
    model = mlx_embed.load(eval_chunk_mb=64, **GPU_SETTINGS)
    model.embed(TEXTS)
    (call,) = points["made"]
    assert call.points == 1 and points["layer_points"] == 0


def test_the_host_waits_for_the_oldest_piece_beyond_two(points):
    """Many passes in one call (a small token budget): each is marked, and
    while more than two are queued the host waits for the oldest."""
    model = mlx_embed.load(eval_chunk_mb=64, **{**GPU_SETTINGS, "batch_tokens": 256})
    reference = mlx_embed.load(eval_chunk_mb=0, **{**GPU_SETTINGS, "batch_tokens": 256})
    got = model.embed(TEXTS)
    (call,) = points["made"]
    passes = call.points
    assert passes >= 4
    assert points["most_queued"] == 2
    assert points["waits"] == passes - 2
    assert np.array_equal(got, reference.embed(TEXTS))


def test_the_sequential_path_takes_points_too(points):
    """pipeline=False (each pass evaluated before the next is built) still
    evaluates a big pass in pieces: its temporaries are what the points bound."""
    settings = {**GPU_SETTINGS, "pipeline": False}
    whole = mlx_embed.load(eval_chunk_mb=0, **settings)
    pieces = mlx_embed.load(eval_chunk_mb=1, **settings)
    want = whole.embed(TEXTS)
    got = pieces.embed(TEXTS)
    assert points["layer_points"] == 6
    assert np.array_equal(got, want)


def test_the_cpu_workers_take_points_too(points):
    """workers=2 (the CPU's default): each worker thread evaluates its
    passes in pieces when asked, so /info's eval_chunk_mb is what runs."""
    settings = dict(fast_ops="exact", batch_tokens=256, workers=2, pipeline=False)
    whole = mlx_embed.load(eval_chunk_mb=0, **settings)
    pieces = mlx_embed.load(eval_chunk_mb=1, **settings)
    want = whole.embed(TEXTS)
    points["tiny"] = True
    got = pieces.embed(TEXTS)
    # Two threads (the caller and one worker), each with its own points,
    # nothing left held after the call, and a point after every layer of
    # every pass: 6 layers, plus no pass mark on this path.
    assert len(points["made"]) == 2
    assert all(p._built == 0 and p._queued == [] for p in points["made"])
    passes = sum(p.points for p in points["made"]) // 6
    assert passes >= 2 and points["layer_points"] == 6 * passes
    assert np.array_equal(got, want)
    assert pieces.info()["eval_chunk_mb"] == 1


def _layers(fixture: str) -> int:
    config = json.loads((FIXTURES / fixture / "config.json").read_text())
    return int(config.get("num_hidden_layers") or config.get("n_layers") or config.get("n_layer"))


EMBEDDERS = ["tiny-distilbert", "tiny-xlm-roberta", "tiny-camembert", "tiny-nomic-bert", "tiny-nomic-moe", "tiny-gte-en",
             "tiny-gte-multilingual", "tiny-jina-bert", "tiny-jina-v2", "tiny-modernbert", "tiny-mpnet",
             "tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama", "tiny-gemma3", "tiny-splade",
             "tiny-eurobert", "tiny-jina-v3"]
SCORERS = ["tiny-bert-reranker", "tiny-deberta-v3-reranker", "tiny-gte-reranker", "tiny-jina-reranker",
           "tiny-jina-reranker-v1", "tiny-modernbert-reranker", "tiny-qwen3-reranker", "tiny-xlmr-reranker",
           "tiny-electra-reranker", "tiny-eurobert-seq-cls"]


@pytest.mark.parametrize("fixture", EMBEDDERS)
def test_every_embedding_architecture_offers_a_point_after_each_layer(fixture, points):
    """Each architecture's layer class (ours, mlx-lm's decoder blocks) is
    patched: with a chunk every layer reaches, one point per layer per pass,
    and the vectors equal the whole pass's bit for bit."""
    whole = mlx_embed.load(FIXTURES / fixture, eval_chunk_mb=0, **GPU_SETTINGS)
    pieces = mlx_embed.load(FIXTURES / fixture, eval_chunk_mb=1, **GPU_SETTINGS)
    want = whole.embed(TEXTS)
    points["tiny"] = True
    got = pieces.embed(TEXTS)
    (call,) = points["made"]
    passes = call.points - points["layer_points"]
    assert passes >= 1
    assert points["layer_points"] == _layers(fixture) * passes
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fixture", SCORERS)
def test_every_scoring_architecture_offers_a_point_after_each_layer(fixture, points):
    whole = mlx_embed.load(FIXTURES / fixture, eval_chunk_mb=0, **GPU_SETTINGS)
    pieces = mlx_embed.load(FIXTURES / fixture, eval_chunk_mb=1, **GPU_SETTINGS)
    pairs = [(q, d) for q in TEXTS[:3] for d in ("short doc", "a long text " * 20, "y")]
    want = whole.score(pairs, raw_scores=True)
    points["tiny"] = True
    got = pieces.score(pairs, raw_scores=True)
    assert points["made"]
    passes = sum(c.points for c in points["made"]) - points["layer_points"]
    assert passes >= 1
    assert points["layer_points"] == _layers(fixture) * passes
    assert np.array_equal(got, want)


def test_packed_rows_and_points_together(points):
    """Packed rows make a layer's output [rows, width]: the points count
    those bytes, and the vectors still equal the padded, whole pass's."""
    whole = mlx_embed.load(eval_chunk_mb=0, **GPU_SETTINGS)
    both = mlx_embed.load(eval_chunk_mb=1, packed_rows=True, **GPU_SETTINGS)
    want = whole.embed(TEXTS)
    points["tiny"] = True
    got = both.embed(TEXTS)
    assert points["layer_points"] == 6
    assert float(np.abs(got - want).max()) <= 1e-5


def test_outside_a_pass_a_patched_layer_is_its_own_call(points, monkeypatch):
    """mlx-lm's decoder block is patched for the process: called outside the
    engine's passes (another mlx-lm user) it evaluates nothing and returns
    what mlx-lm's own call returns; inside a pass's points, it evaluates."""
    from mlx_lm.models import qwen3 as lm

    assert lm.TransformerBlock.__dict__.get("_mlx_embed_boundary") is True
    model = mlx_embed.load(FIXTURES / "tiny-qwen3", **GPU_SETTINGS)
    block = model.model.model.layers[0]
    x = mx.random.normal((2, 5, 64))  # the fixture's hidden size
    evaluated = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: evaluated.append(a) or real_async_eval(*a))
    out = block(x, mask=None, cache=None)
    assert evaluated == []
    own = lm.TransformerBlock._mlx_embed_layer_call(block, x, mask=None, cache=None)
    assert mx.array_equal(out, own).item()
    with ops.bounded_evaluation(ops.EvaluationPoints(1)) as pts:
        again = block(x, mask=None, cache=None)
    assert len(evaluated) == 1 and pts.points == 1
    assert mx.array_equal(again, own).item()
    assert points["layer_points"] == 1


def test_a_sequential_pass_starts_with_nothing_held(points):
    """pipeline=False: each pass is evaluated before the next is built, so
    the next starts with no bytes counted and no layer output held."""
    model = mlx_embed.load(eval_chunk_mb=64, **{**GPU_SETTINGS, "pipeline": False, "batch_tokens": 256})
    model.embed(TEXTS)
    (call,) = points["made"]
    assert call._built == 0 and call._queued == []


def test_points_are_on_by_default_only_where_cuda_graphs_are_off(monkeypatch):
    assert scheduler.default_eval_chunk_mb() == 0  # this CPU
    for graphs, want in (("off", scheduler.GRAPHS_OFF_EVAL_CHUNK_MB), ("on", 0), (None, 0)):
        monkeypatch.setattr(device, "cuda_graphs", lambda g=graphs: g)
        assert scheduler.default_eval_chunk_mb() == want
    monkeypatch.setattr(device, "cuda_graphs", lambda: "off")
    assert mlx_embed.load(**GPU_SETTINGS).info()["eval_chunk_mb"] == 64
    assert mlx_embed.load(eval_chunk_mb=0, **GPU_SETTINGS).info()["eval_chunk_mb"] == 0


@pytest.mark.parametrize("value,error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)])
def test_bad_eval_chunk_mb_is_refused(value, error):
    with pytest.raises(error, match="eval_chunk_mb"):
        mlx_embed.load(eval_chunk_mb=value)
