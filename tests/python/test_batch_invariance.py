"""A text's outputs do not depend on what shares its call, on the CPU's
native path (the default), for every tiny fixture the library loads: the
golden texts each alone, in one batch, and in a shuffled batch give the same
bits (``np.array_equal``) as raw vectors, per-token rows, ColBERT rows,
rerank and classifier scores. The linears run in the native kernel
(``ops.EngineLinear``), attention per text on its real tokens (the streaming
kernel, ``ops.decoder_attention``, or ``ops.per_text``); docs/architecture.md,
"Same bits"."""

from __future__ import annotations

import numpy as np
import pytest

import mlx_embed
from conftest import FIXTURES

# Every tiny fixture folder (a model's; the other fixture folders hold
# references and cases), and None: the bundled default model.
FOLDERS = [None, *sorted(p.name for p in FIXTURES.iterdir() if p.name.startswith("tiny-"))]
# Folders the library loads that are not invariant, with the reason: none.
NOT_INVARIANT: dict = {}


def test_every_fixture_is_here():
    # 57 tiny folders with a config.json, tiny-static (a StaticEmbedding)
    # and the default model.
    assert len(FOLDERS) == 59 and "tiny-static" in FOLDERS


def _same_rows(run, texts):
    batch = run(texts)
    order = np.random.default_rng(0).permutation(len(texts))
    shuffled = run([texts[i] for i in order])
    alone = [run([t])[0] for t in texts]
    differing = []
    for i in range(len(texts)):
        j = int(np.flatnonzero(order == i)[0])
        if not (np.array_equal(alone[i], batch[i]) and np.array_equal(shuffled[j], batch[i])):
            differing.append(i)
    return differing


@pytest.mark.parametrize("folder", FOLDERS)
def test_same_bits_alone_and_batched(folder, golden_texts):
    if folder in NOT_INVARIANT:
        pytest.xfail(NOT_INVARIANT[folder])
    model = mlx_embed.load(str(FIXTURES / folder)) if folder else mlx_embed.load()
    assert model.scheduler.context.path == "native" or folder == "tiny-static"
    texts = [t for t in golden_texts if t]
    if model.kind == "embedding" and model.multi_vector is not None:
        checks = {
            "query rows": lambda ts: model.embed_multi_vector(ts, is_query=True),
            "document rows": lambda ts: model.embed_multi_vector(ts, is_query=False),
        }
    elif model.kind == "embedding":
        checks = {
            "raw vectors": lambda ts: list(model.embed(ts, normalize=False)),
            "token rows": model.embed_tokens,
        }
    elif model.kind == "reranker":
        checks = {"scores": lambda ts: list(model.score([("what is this about", t) for t in ts], raw_scores=True))}
    else:
        checks = {"label scores": lambda ts: list(model.predict(ts, raw_scores=True))}
    failures = {name: rows for name, run in checks.items() if (rows := _same_rows(run, texts))}
    assert not failures, f"rows differing alone/batched/shuffled: {failures}"


def test_a_solo_call_runs_the_blas_threads_of_every_other_call(golden_texts):
    """The server's query replica calls solo (scheduler.call_solo), which
    leaves OpenBLAS's thread count as it finds it. On the native path that
    must still be one thread: an encoder's per-text attention products' sums
    follow OpenBLAS's threads, so a first solo call in a fresh process
    (OpenBLAS on every core) gave other bits than the same text later (seen
    on tiny-qwen3 when the decoders' attention ran there too)."""
    from mlx_embed import _blas, scheduler

    own = _blas.own_num_threads()
    if not own or own < 2:
        pytest.skip("needs an OpenBLAS with at least two threads")
    model = mlx_embed.load(str(FIXTURES / "tiny-modernbert"))
    # The golden texts of 400+ tokens (tiny-qwen3's: 4 of them differed, 1 vs 2 threads).
    texts = [t for t in golden_texts if t]
    batched = model.embed(texts, normalize=False)
    _blas.set_num_threads(own)  # what a fresh process starts with
    solo = scheduler.call_solo(model, "embed", texts, normalize=False)
    assert np.array_equal(solo, batched)


@pytest.mark.parametrize("folder", ["tiny-qwen3", "tiny-modernbert", "tiny-jina-v2"])
def test_a_long_text_in_the_streaming_kernel_keeps_its_bits_among_short_ones(folder, golden_texts, monkeypatch):
    """A long text's attention in the streaming kernel (ops.decoder_attention:
    tiny-qwen3's causal layers, tiny-modernbert's local windows and global
    layers, tiny-jina-v2's ALiBi; cut at 512 tokens) keeps its bits among
    short texts: its keys in several 64-key tiles, the short texts' in one,
    on the kernel's threads; its bits follow its own length alone."""
    from mlx_embed import _native

    model = mlx_embed.load(str(FIXTURES / folder), max_length=512)
    texts = [t for t in golden_texts if t]
    counts = model.count_tokens(texts)
    long = max(range(len(texts)), key=lambda i: counts[i])
    batch = [texts[long], *sorted(texts, key=len)[:5], texts[long][: len(texts[long]) // 3]]
    kernel_calls = []
    real = _native.decoder_attention_
    monkeypatch.setattr(
        _native, "decoder_attention_", lambda *a, **k: kernel_calls.append((max(a[3]), k)) or real(*a, **k)
    )
    together = model.embed(batch, normalize=False)
    assert kernel_calls, "the long text did not reach the kernel"
    assert max(n for n, _ in kernel_calls) >= 3 * 64  # several of the kernel's key tiles
    if folder == "tiny-modernbert":
        windows = {k["window"] for _, k in kernel_calls}
        assert None in windows and len(windows) == 2, windows
    if folder == "tiny-jina-v2":
        assert all(k["slopes"] is not None for _, k in kernel_calls)
    for i, text in enumerate(batch):
        assert np.array_equal(model.embed([text], normalize=False)[0], together[i]), i
