"""The three element-wise paths (native kernels, compiled MLX, exact MLX):
each kernel against MLX's exact op, and golden parity of the whole model on
every path (picked per model with ``load(fast_ops=...)``, or by the
environment variable when no argument is given)."""

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import ROOT
from mlx_embed import _native, ops


def test_the_native_path_is_the_default_on_cpu(minilm):
    # A silent fallback would leave every other test green and the engine
    # several times slower.
    assert mx.default_device() == mx.cpu
    assert minilm.context.path == "native"
    assert ops.default_context().path == "native"
    assert _native.kernel_simd == _simd_level_of_this_cpu()


def _simd_level_of_this_cpu() -> str:
    """The kernel build this CPU should get, from its own feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    if {"avx2", "fma"} <= set(flags):
        return "avx512f" if "avx512f" in flags else "avx2+fma"
    return "generic"


def _evaluated(*arrays):
    mx.eval(*arrays)
    return arrays


def test_masked_softmax_matches_mlx_softmax_with_an_additive_mask():
    mx.random.seed(3)
    scores = mx.random.normal((3, 4, 37, 37)) * 6
    lengths = [37, 1, 20]
    keep = mx.arange(37)[None, :] < mx.array(lengths)[:, None]
    additive = mx.where(keep, 0.0, -1e9)[:, None, None, :]
    (want,) = _evaluated(mx.softmax(scores * 0.125 + additive, axis=-1, precise=True))
    for threads in (1, 2):
        out = mx.array(scores)  # a copy the kernel may overwrite
        _native.masked_softmax_(ops._native_buffer(out), lengths, 0.125, threads)
        assert np.abs(np.array(out) - np.array(want)).max() < 1e-6
        assert (np.array(out)[2, :, :, 20:] == 0).all()


def test_gelu_matches_mlx_erf_gelu():
    x = mx.linspace(-12, 12, 300_003).reshape(3, -1)
    (want,) = _evaluated(nn.gelu(x))
    out = mx.array(x)
    _native.gelu_(ops._native_buffer(out), 2)
    # Float32 rounding scales with |x|: ~2 ulp of 12 is 2e-6.
    assert np.abs(np.array(out) - np.array(want)).max() <= 3e-6


def test_add_layer_norm_matches_mlx_layer_norm():
    mx.random.seed(5)
    norm = nn.LayerNorm(389, eps=1e-12)
    norm.weight = mx.random.uniform(0.5, 1.5, (389,))
    norm.bias = mx.random.normal((389,)) * 0.1
    x = mx.random.normal((2, 50, 389)) * 3 + 10
    res = mx.random.normal((2, 50, 389))
    (want,) = _evaluated(norm(x + res))
    got = ops.add_layer_norm(mx.array(x), res, norm, overwrite_input=True)
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-5
    # Without permission to overwrite, the input stays untouched.
    x_before = np.array(x)
    ops.add_layer_norm(x, res, norm)
    assert (np.array(x) == x_before).all()


def test_kernels_reject_what_they_cannot_handle():
    ro = np.zeros((2, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _native.gelu_(ro)
    with pytest.raises(ValueError, match="contiguous"):
        _native.gelu_(np.zeros((8, 8), np.float32)[:, ::2])
    with pytest.raises(BufferError):
        _native.gelu_(np.zeros(8, np.float64))
    scores = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="key length 9"):
        _native.masked_softmax_(scores, [8, 9], 1.0)
    with pytest.raises(ValueError, match="1 key lengths for 2"):
        _native.masked_softmax_(scores, [8], 1.0)
    x = np.zeros((4, 8), np.float32)
    w = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="share memory"):
        _native.add_layer_norm_(x, x, w, w * 0, 1e-5)


@pytest.mark.parametrize("fast_ops", ["mlx", "exact"])
def test_golden_parity_on_the_other_paths(fast_ops, golden_texts, golden_mean, cos):
    import mlx_embed

    model = mlx_embed.load(fast_ops=fast_ops)
    assert model.context.path == fast_ops
    got = model.embed(golden_texts)
    c, d = cos(got, golden_mean).min(), np.abs(got - golden_mean).max()
    print(f"\n{fast_ops}: min cosine {c:.8f}, max |diff| {d:.2e}")
    assert c >= 0.99999
    assert d <= 1e-5


_ENV_PATH = """
import json, mlx_embed
m = mlx_embed.load()
print(json.dumps({"env": m.context.path, "arg": mlx_embed.load(fast_ops="native").context.path}))
"""


def test_environment_is_only_the_fallback():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "MLX_EMBED_FAST_OPS": "0"}
    r = subprocess.run([sys.executable, "-c", _ENV_PATH], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"env": "exact", "arg": "native"}


_SIMD_CAPPED = """
import json, sys
import numpy as np
import mlx_embed
from mlx_embed import _native
texts = json.loads(open(sys.argv[1], encoding="utf-8").read())
got = mlx_embed.load().embed(texts)
want = np.load(sys.argv[2])
print(json.dumps({"simd": _native.kernel_simd,
                  "cos": float((got * want).sum(axis=1).min()),
                  "diff": float(np.abs(got - want).max())}))
"""


def _run_capped(cap: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "MLX_EMBED_SIMD": cap}
    golden = ROOT / "tests" / "fixtures" / "golden"
    return subprocess.run(
        [sys.executable, "-c", _SIMD_CAPPED, str(golden / "minilm_texts.json"),
         str(golden / "minilm_mean_normalized.npy")],
        capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("cap", ["avx2", "generic"])
def test_the_simd_cap_runs_the_narrower_build_with_golden_vectors(cap):
    # What a CPU without AVX-512 (or without AVX2) runs, checked on this one.
    r = _run_capped(cap)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    detected = _simd_level_of_this_cpu()
    if cap == "generic" or detected == "generic":
        want = "generic"
    else:
        want = "avx2+fma"
    assert got["simd"] == want
    assert got["cos"] >= 0.99999 and got["diff"] <= 1e-5, got


def test_an_unknown_simd_cap_fails_the_import_naming_the_values():
    r = _run_capped("avx1024")
    assert r.returncode != 0
    assert 'MLX_EMBED_SIMD="avx1024": expected avx512, avx2 or generic' in r.stderr, r.stderr[-2000:]
    # The server's command says it in one line, not a traceback.
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "MLX_EMBED_SIMD": "sse4"}
    r = subprocess.run([sys.executable, "-m", "mlx_embed", "serve", "--port", "1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert (r.returncode, r.stderr.strip()) == (
        1, 'mlx-embed: error: MLX_EMBED_SIMD="sse4": expected avx512, avx2 or generic'), r.stderr


def test_arrays_the_kernels_cannot_take_fall_back_to_mlx():
    # A broadcast (non-contiguous) input: no buffer to work in place on, so
    # the MLX path runs and gives the same values.
    x = mx.broadcast_to(mx.linspace(-3, 3, 16), (4, 16))
    assert ops._native_buffer(x) is None
    assert ops._native_buffer(mx.zeros((2, 2), dtype=mx.float16)) is None
    got = ops.gelu(x, overwrite_input=True)
    assert np.abs(np.array(got) - np.array(nn.gelu(x))).max() <= 3e-6


def test_native_linear_matches_mlx_linear_with_its_bias_and_fused_gelu():
    mx.random.seed(7)
    layer = nn.Linear(70, 45)
    x = mx.random.normal((3, 11, 70))
    (want,) = _evaluated(layer(x))
    (want_gelu,) = _evaluated(nn.gelu(want))
    for threads in (1, 2):
        with ops.forward_context(ops.ForwardContext(path="native", kernel_threads=threads)):
            got = ops.linear(layer, x)
            got_gelu = ops.linear(layer, x, activation="gelu")
        assert got.shape == (3, 11, 45)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5
        assert np.abs(np.array(got_gelu) - np.array(want_gelu)).max() < 1e-5
    with pytest.raises(ValueError, match="activation"):
        ops.linear(layer, x, activation="relu")


def test_native_attention_matches_the_mlx_path_with_padding():
    mx.random.seed(9)
    B, L, H, hd = 3, 13, 4, 8
    qkv = mx.random.normal((B, L, 3 * H * hd))
    lengths = [13, 5, 1]
    mask = mx.array((np.arange(L)[None, :] < np.array(lengths)[:, None]).astype(np.int32))
    with ops.forward_context(ops.ForwardContext(path="exact")):
        (want,) = _evaluated(ops.attention(qkv, ops.KeyMask(mask, mx.float32), H, hd**-0.5))
    for threads in (1, 2):
        with ops.forward_context(ops.ForwardContext(path="native", kernel_threads=threads)):
            got = ops.attention(qkv, ops.KeyMask(mask, mx.float32), H, hd**-0.5)
        assert got.shape == (B, L, H * hd)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5


def test_the_fused_encoder_equals_the_kernels_one_by_one(minilm, golden_texts, golden_mean, monkeypatch):
    """BERT's blocks run as one native call on the native path; it must give
    the per-kernel path's vectors to the bit (same kernels, same order)."""
    calls = []
    real = _native.post_ln_encoder_

    def counting(*args, **kwargs):
        calls.append(len(args[3]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_native, "post_ln_encoder_", counting)
    fused = minilm.embed(golden_texts)
    # One call per device pass, each with all 6 blocks.
    assert calls and set(calls) == {6}
    monkeypatch.setattr(ops, "post_ln_encoder", lambda *args, **kwargs: None)
    one_by_one = minilm.embed(golden_texts)
    assert np.array_equal(fused, one_by_one)
    cos = (fused * golden_mean).sum(axis=1)
    assert cos.min() >= 0.99999
    with pytest.raises(ValueError, match="a block is 16 items"):
        real(np.zeros((1, 2, 4), np.float32), [2], 2, [(1, 0.5)])


def test_the_fused_encoder_is_not_used_where_it_does_not_apply(minilm):
    block = minilm.model.layers[0]
    assert ops._post_ln_spec(block) is not None
    tanh = dataclasses.replace(minilm.model.args, hidden_act="gelu_new")
    from mlx_embed.models import bert

    tanh_block = bert.TransformerBlock(tanh)
    assert tanh_block.post_ln_parts() is None and ops._post_ln_spec(tanh_block) is None
    x = mx.zeros((1, 3, 384))
    mask = ops.KeyMask(mx.ones((1, 3), dtype=mx.int32), mx.float32)
    with ops.forward_context(ops.ForwardContext(path="exact")):
        assert ops.post_ln_encoder(minilm.model.layers, x, mask) is None
    with ops.forward_context(ops.ForwardContext(path="native")):
        assert ops.post_ln_encoder(minilm.model.layers, x.astype(mx.float16), mask) is None
        assert ops.post_ln_encoder([tanh_block], x, mask) is None
        assert ops.post_ln_encoder(minilm.model.layers, x, mask).shape == (1, 3, 384)


@pytest.mark.parametrize("fixture, linears", [
    ("tiny-xlm-roberta", 8), ("tiny-distilbert", 8), ("tiny-jina-v2", 10), ("tiny-gte-en", 10),
    # Heads (classifier, pooler), DeBERTa's embedding projection and the
    # decoders' mlx-lm layers too.
    ("tiny-bert-reranker", 10), ("tiny-deberta-v2-nli", 19), ("tiny-qwen3", 14), ("tiny-modernbert", 12),
])
def test_every_linear_is_packed_once_at_load_and_mlx_lets_go_of_its_weight(fixture, linears, golden_texts):
    """On the CPU's native path every float32 linear runs in the native
    kernel (ops.EngineLinear: a text's bits then do not follow its batch),
    packed at load, so a forward pass packs nothing more; the packed copy is
    as large as the weights, so MLX's is let go of (a stand-in of its shape
    that holds no memory)."""
    import mlx_embed

    model = mlx_embed.load(ROOT / "tests" / "fixtures" / fixture)
    found = {n: m for n, m in model.model.named_modules() if isinstance(m, nn.Linear)}
    assert len(found) == linears and {type(m) for m in found.values()} == {ops.EngineLinear}
    packed = {n: m.__dict__.get("_mlx_embed_packed") for n, m in found.items()}
    assert all(p is not None for p in packed.values()), sorted(n for n, p in packed.items() if p is None)
    assert all(m.dropped and p[1][2:] == tuple(m.weight.shape) for m, p in zip(found.values(), packed.values()))
    if model.kind == "embedding":
        model.embed(golden_texts[:4])
    else:
        model.score([(golden_texts[0], t) for t in golden_texts[1:5]])
    assert all(m.__dict__["_mlx_embed_packed"] is packed[n] for n, m in found.items())


def test_a_tied_weight_keeps_its_mlx_copy():
    """MLX's copy stays where something else in the model holds the array."""
    ops_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ops_model.layers[1].weight = ops_model.layers[0].weight
    ops.prepare(ops_model, ops.make_context("native"))
    assert [type(m) for m in ops_model.layers] == [ops.EngineLinear] * 2
    assert not any(m.dropped for m in ops_model.layers)


def _dropped_layer() -> tuple:
    layer = nn.Linear(8, 3)
    x = mx.random.normal((2, 8), key=mx.random.key(1))
    want = np.array(layer(x))
    ops.prepare(layer, ops.make_context("native"))
    assert layer.dropped
    return layer, x, want


def test_a_let_go_weight_survives_a_no_op_pass_over_the_parameters():
    """set_dtype(float32) and update(parameters()) hand the layer a new array
    of the stand-in; the packed weights are still the layer's (re-packing the
    stand-in once gave zeros: MiniLM's vector moved by 0.32)."""
    layer, x, want = _dropped_layer()
    layer.set_dtype(mx.float32)
    np.testing.assert_allclose(np.array(layer(x)), want, rtol=1e-5, atol=1e-6)
    layer.update(layer.parameters())
    np.testing.assert_allclose(np.array(layer(x)), want, rtol=1e-5, atol=1e-6)


def test_a_let_go_weight_takes_new_weights_and_refuses_another_dtype():
    layer, x, want = _dropped_layer()
    new = mx.random.normal((3, 8), key=mx.random.key(2))
    layer.weight = new
    np.testing.assert_allclose(np.array(layer(x)), np.array(x @ new.T + layer.bias), rtol=1e-5, atol=1e-6)
    layer, x, want = _dropped_layer()
    layer.set_dtype(mx.bfloat16)
    with pytest.raises(ValueError, match="let go of"):
        layer(x)


def test_a_let_go_weight_takes_inputs_of_another_dtype():
    """Not MLX's matmul on the stand-in (zeros): the packed weights, in float32."""
    layer, x, want = _dropped_layer()
    got = layer(x.astype(mx.float16))
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fixture", ["minilm", "tiny-xlm-roberta", "tiny-distilbert", "tiny-bert-reranker"])
def test_embeddings_on_the_host_match_the_mlx_graph(fixture, minilm):
    """The native path sums a BERT-style embedding layer on the host
    (``ops.embeddings_on_host``): the same rows in transformers' order and the
    same norm as the MLX graph, to float32 rounding of the norm; token types
    (pairs) included; the MLX graph elsewhere."""
    import mlx_embed

    model = minilm.model if fixture == "minilm" else mlx_embed.load(ROOT / "tests" / "fixtures" / fixture).model
    emb = getattr(model, "encoder", model).embeddings
    rng = np.random.default_rng(0)
    # 64 x 40 rows: two kernel threads split them (off a sequence boundary).
    ids = mx.array(rng.integers(0, emb.word_embeddings.weight.shape[0], (64, 40)).astype(np.int32))
    types = mx.array((np.arange(40) >= 5).astype(np.int32)[None].repeat(64, axis=0))
    pairs = fixture == "tiny-bert-reranker"
    args = (ids, types) if pairs else (ids,)
    with ops.forward_context(ops.ForwardContext(path="exact")):
        want = np.array(emb(*args))
        assert emb.on_host(*args) is None
    for threads in (1, 2):
        with ops.forward_context(ops.ForwardContext(path="native", kernel_threads=threads)):
            got = emb.on_host(*args)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.flags.writeable
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-5, (fixture, threads)
    if pairs:  # the second segment's type row is in it
        with ops.forward_context(ops.ForwardContext(path="native")):
            single = emb.on_host(ids)
        assert np.array_equal(single[:, :5], got[:, :5]) and np.abs(single[:, 5:] - got[:, 5:]).max() > 1e-3
    with ops.forward_context(ops.ForwardContext(path="native")), pytest.raises(ValueError, match="position rows"):
        emb.on_host(mx.zeros((1, emb.position_embeddings.weight.shape[0] + 1), dtype=mx.int32))
    half = emb.word_embeddings.weight
    emb.word_embeddings.weight = half.astype(mx.float16)
    try:
        with ops.forward_context(ops.ForwardContext(path="native")):
            assert emb.on_host(*args) is None
    finally:
        emb.word_embeddings.weight = half


@pytest.mark.parametrize("path", ["native", "mlx", "exact"])
@pytest.mark.parametrize("kind", ["mask", "additive", "fused"])
def test_blocked_attention_equals_one_block(path, kind, monkeypatch):
    """Query rows in blocks (what long inputs get) give the one-block
    result on every path, with the padding mask alone, with a position bias
    made per block of rows, and through MLX's fused attention."""
    mx.random.seed(5)
    B, H, L, hd = 2, 3, 45, 8
    q, k, v = (mx.random.normal((B, H, L, hd)) for _ in range(3))
    mask = ops.KeyMask(mx.array(np.arange(L)[None, :] < np.array([[L], [30]])), mx.float32)
    slopes = mx.array([0.5, 0.25, 0.125])
    seen = []

    def additive(start, end):
        seen.append((start, end))
        dist = mx.abs(mx.arange(start, end)[:, None] - mx.arange(L)[None, :]).astype(mx.float32)
        return -slopes[:, None, None] * dist[None] + mask.additive

    kw = {"mask": mask} if kind == "mask" else {"additive": additive, "fused": kind == "fused"}
    ctx = ops.make_context(path)
    with ops.forward_context(ctx):
        (whole,) = _evaluated(ops.blocked_attention(q, k, v, 0.35, **kw))
        # 7 query rows of scores per block: 45 rows in 7 blocks, the last short.
        monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", B * H * L * 4 * 7)
        assert ops.query_blocks(q, L) == [(i, min(i + 7, L)) for i in range(0, L, 7)]
        seen.clear()
        (blocked,) = _evaluated(ops.blocked_attention(q, k, v, 0.35, **kw))
    assert blocked.shape == (B, H, L, hd)
    assert np.abs(np.array(blocked) - np.array(whole)).max() <= 1e-6
    if kind != "mask":
        assert seen == ops.query_blocks(q, L)


def test_blocked_attention_bounds_memory(monkeypatch):
    """One 2048-token, 12-head layer: the scores of each block are gone
    before the next is built, so the peak is a fraction of holding them all
    (measured 1.03 GB at once, 0.07 GB in 16 blocks)."""
    mx.random.seed(6)
    B, H, L, hd = 1, 12, 2048, 16
    q, k, v = _evaluated(*(mx.random.normal((B, H, L, hd)) for _ in range(3)))
    mask = ops.KeyMask(mx.ones((B, L)), mx.float32)

    def additive(start, end):
        dist = mx.abs(mx.arange(start, end)[:, None] - mx.arange(L)[None, :]).astype(mx.float32)
        return -0.01 * dist[None, None] + mask.additive

    def peak(block_bytes):
        monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", block_bytes)
        with ops.forward_context(ops.make_context("mlx")):
            mx.eval(mask.additive)
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            _evaluated(ops.blocked_attention(q, k, v, 0.25, additive=additive))
        return mx.get_peak_memory() - base

    scores = B * H * L * L * 4
    whole, blocked = peak(1 << 40), peak(scores // 16)
    print(f"peak {whole / 1e9:.2f} GB whole, {blocked / 1e9:.2f} GB in 16 blocks")
    assert whole >= 2 * scores and blocked <= whole / 4


def _wrapped_mlx_lm_attention(seed: int, B: int, H: int, KV: int, L: int, hd: int):
    """Random grouped-query q, k, v (evaluated), and a module holding mlx-lm's
    attention as ops.engine_attention wraps it."""
    import types

    from mlx_lm.models import base

    mx.random.seed(seed)
    q = mx.random.normal((B, H, L, hd))
    k, v = (mx.random.normal((B, KV, L, hd)) for _ in range(2))
    _evaluated(q, k, v)
    module = types.SimpleNamespace(scaled_dot_product_attention=base.scaled_dot_product_attention)
    ops.engine_attention(module)
    return q, k, v, module


def test_long_causal_attention_in_blocks_bounds_memory(monkeypatch):
    """mlx-lm's causal attention for one 2048-token, 16-head input (8 key
    heads, as Qwen3's grouped queries) inside an engine pass: in query blocks,
    each against the keys up to its last row, the same output as mlx-lm's
    own call, at a fraction of its peak (measured 0.28 GB at once, 0.01 GB
    in blocks); with a KV cache, or outside the engine's passes, mlx-lm's
    function runs as it is."""
    import types

    from mlx_lm.models import base

    B, H, KV, L, hd = 1, 16, 8, 2048, 16
    q, k, v, module = _wrapped_mlx_lm_attention(9, B, H, KV, L, hd)
    ops.engine_attention(module)  # once is enough: no wrapper around the wrapper
    assert module.scaled_dot_product_attention.__wrapped_original__ is base.scaled_dot_product_attention
    scores = B * H * L * L * 4
    monkeypatch.setattr(ops, "SCORES_BLOCK_BYTES", scores // 32)

    def run(in_engine: bool, **kw):
        mx.reset_peak_memory()
        base_mem = mx.get_active_memory()
        ctx = ops.forward_context(ops.make_context("mlx")) if in_engine else contextlib.nullcontext()
        with ctx:
            (out,) = _evaluated(module.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", **kw))
        return np.array(out), mx.get_peak_memory() - base_mem

    whole, whole_peak = run(False)
    blocked, blocked_peak = run(True)
    print(f"peak {whole_peak / 1e9:.2f} GB at once, {blocked_peak / 1e9:.2f} GB in blocks")
    assert np.abs(blocked - whole).max() <= 1e-5
    assert whole_peak >= scores and blocked_peak <= whole_peak / 8
    # A KV cache (generation) keeps mlx-lm's call: its peak is the whole one.
    _, cached_peak = run(True, cache=types.SimpleNamespace())
    assert cached_peak >= scores


def _encoder_attention_inputs(kind: str, lengths: list[int], L: int, seed: int = 8):
    """Random q, k, v [B, 3, L, 24] (evaluated), the padding mask, the
    blocked_attention keywords of ``kind`` ("alibi", "window" or "mask")
    and a function of whether row i of text b sees a real key."""
    mx.random.seed(seed)
    B, H, hd, half = len(lengths), 3, 24, 40
    q, k, v = _evaluated(*(mx.random.normal((B, H, L, hd)) for _ in range(3)))
    mask = ops.KeyMask(mx.array(np.arange(L)[None, :] < np.array(lengths)[:, None]), mx.float32)
    slopes = [0.5, 0.0625, 0.25]

    def additive(start, end):
        dist = mx.abs(mx.arange(start, end)[:, None] - mx.arange(L)[None, :])
        if kind == "alibi":
            return -mx.array(slopes)[:, None, None] * dist.astype(mx.float32)[None] + mask.additive
        return mask.additive + mx.where(dist <= half, 0.0, -1e9)

    kw = {"mask": mask}
    if kind == "alibi":
        kw.update(additive=additive, alibi=slopes)
    elif kind == "window":
        kw.update(additive=additive, window=half)
    sees = (lambda b, i: i < lengths[b] + half) if kind == "window" else (lambda b, i: True)
    return q, k, v, kw, sees


@pytest.mark.parametrize("kind", ["alibi", "window", "mask"])
def test_encoder_attention_in_the_streaming_kernel_matches_exact(kind, monkeypatch):
    """On the native path an encoder's attention with ALiBi (JinaBERT), a
    symmetric window (ModernBERT's local layers) or the padding mask alone
    runs whole in the streaming kernel (``decoder_attention_``, slopes and
    window computed inside its key tiles), over texts of several 64-key
    tiles, and matches the exact path's MLX bias/band and softmax within
    1e-5, rows past a text's keys (a ColBERT query's expansion rows) too
    wherever they see a key."""
    L, lengths = 150, [150, 70, 1]
    q, k, v, kw, sees = _encoder_attention_inputs(kind, lengths, L)
    with ops.forward_context(ops.make_context("exact")):
        (want,) = _evaluated(ops.blocked_attention(q, k, v, 0.35, **kw))
    calls = []
    real = _native.decoder_attention_
    monkeypatch.setattr(_native, "decoder_attention_", lambda *a, **k: calls.append(k) or real(*a, **k))
    with ops.forward_context(ops.make_context("native")):
        (got,) = _evaluated(ops.blocked_attention(q, k, v, 0.35, **kw))
    assert len(calls) == 1
    assert calls[0]["causal"] is False and calls[0]["all_rows"] is True
    assert calls[0]["slopes"] == (kw.get("alibi") and [float(s) for s in kw["alibi"]])
    assert calls[0]["window"] == kw.get("window")
    got, want = np.array(got), np.array(want)
    checked = 0
    for b in range(len(lengths)):
        for i in range(L):
            if sees(b, i):
                assert np.abs(got[b, :, i] - want[b, :, i]).max() <= 1e-5, (b, i)
                checked += 1
            else:
                # No key in its window: 0 (ModernBERT zeroes such rows on every path).
                assert (got[b, :, i] == 0).all(), (b, i)
    assert checked >= sum(lengths)


@pytest.mark.parametrize("kind", ["alibi", "window", "mask"])
def test_encoder_attention_in_the_streaming_kernel_is_batch_invariant(kind):
    """A text's attention rows in the streaming kernel have the same bits
    alone at its own length as in a padded batch beside longer texts, on
    one kernel thread or two."""
    L, lengths = 197, [197, 65, 64, 63]
    q, k, v, kw, _ = _encoder_attention_inputs(kind, lengths, L, seed=9)
    for threads in (1, 2):
        with ops.forward_context(ops.make_context("native", kernel_threads=threads)):
            (together,) = _evaluated(ops.blocked_attention(q, k, v, 0.35, **kw))
            together = np.array(together)
            for b, n in enumerate(lengths):
                one = {**kw, "mask": ops.KeyMask(mx.ones((1, n), dtype=mx.int32), mx.float32)}
                qb, kb, vb = (mx.contiguous(t[b : b + 1, :, :n]) for t in (q, k, v))
                (alone,) = _evaluated(ops.blocked_attention(qb, kb, vb, 0.35, **one))
                assert np.array_equal(np.array(alone)[0], together[b, :, :n]), (kind, threads, b)


@pytest.mark.parametrize("activation, mlx_act", [("silu", nn.silu), ("gelu_tanh", nn.gelu_approx)])
def test_native_gated_linear_unit_matches_mlx(activation, mlx_act):
    mx.random.seed(5)
    # Over 2 x 32768 values: two kernel threads split them.
    gate, up = _evaluated(mx.random.normal((3, 170, 160)) * 8, mx.random.normal((3, 170, 160)))
    want = np.array(mlx_act(gate) * up)
    buf = np.array(gate)
    _native.gated_linear_unit_(buf, np.array(up), activation, 2)
    assert np.abs(buf - want).max() <= 1e-6 * np.abs(want).max()
    with pytest.raises(ValueError, match="must not share memory"):
        _native.gated_linear_unit_(buf, buf, activation)
    with pytest.raises(ValueError, match="activation must be"):
        _native.gated_linear_unit_(buf, np.array(up), "relu")


def _answers(model, texts):
    """What a decoder fixture answers for the golden texts: the vectors of an
    embedder, the scores of eight pairs for a reranker."""
    if model.kind == "embedding":
        return model.embed(texts)
    return np.array(model.score([(texts[1], t) for t in texts[2:10]]))


@pytest.mark.parametrize("fixture, activation", [
    ("tiny-qwen3", "silu"), ("tiny-qwen2", "silu"), ("tiny-mistral", "silu"), ("tiny-llama", "silu"), ("tiny-qwen3-reranker", "silu"),
    ("tiny-gemma3", "gelu_tanh"), ("tiny-eurobert", "silu"),
])
def test_the_decoders_feed_forward_runs_the_native_kernel_on_the_native_path(
        fixture, activation, golden_texts, monkeypatch):
    """The decoders' gated feed-forward (mlx-lm's ``swiglu``, Gemma 3's
    GeGLU) takes the native kernel inside the engine's passes on the native
    path (once a layer a pass, on the gate projection's own buffer), MLX's
    ops on the others, with the same vectors to float32 rounding."""
    import mlx_embed

    folder = ROOT / "tests" / "fixtures" / fixture
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    calls = []
    real = _native.gated_linear_unit_

    def counted(gate, up, act, threads=1):
        calls.append(act)
        real(gate, up, act, threads)

    monkeypatch.setattr(_native, "gated_linear_unit_", counted)
    native, exact = (mlx_embed.load(folder, fast_ops=path) for path in ("native", "exact"))
    run = functools.partial(_answers, texts=golden_texts)

    want = run(exact)
    assert calls == []
    got = run(native)
    assert calls and len(calls) % layers == 0 and set(calls) == {activation}, calls
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_an_extension_from_an_older_tree_is_not_offered(monkeypatch):
    """An extension built from an older tree (before the causal softmax:
    ``kernel_api`` 1, or none at all) leaves the native path unoffered
    rather than failing a long decoder pass: the default falls back to the
    compiled-MLX path and an explicit request says what is missing."""
    import types

    assert _native.kernel_api == ops.KERNEL_API and ops.native_available()
    monkeypatch.delenv("MLX_EMBED_FAST_OPS", raising=False)
    for api in (None, ops.KERNEL_API - 1):
        old = types.SimpleNamespace(**{name: getattr(_native, name) for name in dir(_native) if name.endswith("_")})
        if api is not None:
            old.kernel_api = api
        monkeypatch.setattr(ops, "_native", old)
        assert not ops.native_available()
        assert ops.resolve_path(None) == "mlx"
        with pytest.raises(ValueError, match="needs the built extension"):
            ops.resolve_path("native")


@pytest.mark.parametrize("kind", ["causal", "lengths", "window", "capped"])
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
def test_decoder_attention_matches_mlx_with_grouped_queries(kind, kv_heads):
    """The decoders' attention by the native kernel: 6 query heads over 6, 2
    or 1 key/value heads (query head h reads kv head h // group, as MLX's
    fused attention and transformers' repeat_kv do), k and v read as the
    transposes they are, 150 positions (past two of the kernel's 64-key
    tiles): causal with padding, bidirectional over padding keys, a window
    with padding keys, or Gemma 2's soft-capped causal window, against MLX's
    attention with the same mask (capped: ops.capped_causal_attention's MLX
    path) on each text's real rows, padding rows 0."""
    mx.random.seed(11)
    B, H, L, hd, half = 2, 6, 150, 8, 3
    q = mx.random.normal((B, H, L, hd))
    k, v = (mx.random.normal((B, L, kv_heads, hd)).transpose(0, 2, 1, 3) for _ in range(2))
    lengths = [L, 97]
    keys = ops.KeyMask(mx.array(np.arange(L)[None, :] < np.array(lengths)[:, None]), mx.float32)
    q, k, v = _evaluated(q, k, v)
    assert kv_heads == 1 or not np.array(k, copy=False).flags.c_contiguous  # read as it lies
    if kind == "capped":
        with ops.forward_context(ops.make_context("mlx")):
            (want,) = _evaluated(ops.capped_causal_attention(q, k, v, 0.3, softcap=2.0, window=70))
        want = np.array(want)
        term = {"causal": True, "window": 69, "softcap": 2.0}
    else:
        mask = {"causal": "causal", "lengths": keys.additive, "window": ops.BandMask(keys, half=half).additive}[kind]
        want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask))
        term = {"causal": kind == "causal", "window": half if kind == "window" else None}
    with ops.forward_context(ops.make_context("native")):
        (got,) = _evaluated(ops.decoder_attention(q, k, v, 0.3, keys, **term))
    assert got.shape == q.shape
    got = np.array(got)
    for b, n in enumerate(lengths):
        assert np.abs(got[b, :, :n] - want[b, :, :n]).max() <= 1e-5
        assert not got[b, :, n:].any()


def test_decoder_attention_reads_strided_arrays_in_place_and_copies_reversed_ones(monkeypatch):
    """q/k/v in the layouts MLX can hand over: a slice at an offset seen
    through a transpose and a broadcast over the batch (stride 0) go to the
    kernel as they lie; a reversed slice (a negative stride, which the
    kernel refuses) is copied first, not a failed pass. One text of the
    batch (B = 1) too, whose batch stride nobody reads."""
    mx.random.seed(13)
    H, KV, L, hd = 4, 2, 20, 8
    strides = []
    real = _native.decoder_attention_
    monkeypatch.setattr(
        _native, "decoder_attention_", lambda *a, **kw: strides.append([t.strides for t in a[:3]]) or real(*a, **kw)
    )
    for B in (2, 1):
        q = mx.random.normal((B, L + 3, H, hd))[:, 3:].transpose(0, 2, 1, 3)
        k = mx.random.normal((B, KV, L, hd))[:, :, ::-1]
        v = mx.broadcast_to(mx.random.normal((1, KV, L, hd)), (B, KV, L, hd))
        q, k, v = _evaluated(q, k, v)
        strides.clear()
        want = np.array(
            mx.fast.scaled_dot_product_attention(*(mx.contiguous(t) for t in (q, k, v)), scale=0.3, mask="causal")
        )
        with ops.forward_context(ops.make_context("native")):
            (got,) = _evaluated(ops.decoder_attention(q, k, v, 0.3, None, causal=True))
        assert np.abs(np.array(got) - want).max() <= 1e-5
        (qs, ks, vs), = strides
        assert qs == (4 * (L + 3) * H * hd, 4 * hd, 4 * H * hd, 4)  # the transposed slice, in place
        assert ks == (4 * KV * L * hd, 4 * L * hd, 4 * hd, 4)  # the reversed slice, copied
        assert vs == ((0 if B > 1 else 4 * KV * L * hd), 4 * L * hd, 4 * hd, 4)  # the broadcast, in place


def test_the_engine_attention_takes_the_kernel_on_the_native_path_only(monkeypatch):
    """mlx-lm's causal attention as ops.engine_attention wraps it: on the
    native path one kernel call for the whole batch (no query blocks), on
    the mlx path MLX's, both with MLX's whole causal attention's output."""
    B, H, KV, L, hd = 2, 4, 2, 70, 8
    q, k, v, module = _wrapped_mlx_lm_attention(12, B, H, KV, L, hd)
    want = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal"))
    calls = []
    real = _native.decoder_attention_
    monkeypatch.setattr(_native, "decoder_attention_", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    for path in ("native", "mlx"):
        calls.clear()
        with ops.forward_context(ops.make_context(path)):
            (got,) = _evaluated(module.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal"))
        assert np.abs(np.array(got) - want).max() <= 1e-5
        assert [(c["causal"], c["window"], c["softcap"]) for c in calls] == (
            [(True, None, None)] if path == "native" else []
        )


# Every decoder fixture that attends through ops.engine_attention or
# ops.capped_causal_attention.
DECODERS = ["tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama", "tiny-qwen3-reranker", "tiny-gemma3",
            "tiny-eurobert", "tiny-gemma2", "tiny-embedding-gemma2", "tiny-bge-reranker-v2-gemma"]


@pytest.mark.parametrize("fixture", DECODERS)
def test_the_decoders_attention_runs_the_native_kernel_on_the_native_path(fixture, golden_texts, monkeypatch):
    """The decoders' attention takes the native kernel inside the engine's
    passes on the native path, once a layer a pass: causal in Qwen3, Qwen2,
    Mistral, Llama, Gemma and the rerankers (Gemma 2 soft-capped, its sliding
    layers with their window), bidirectional in EuroBERT and EmbeddingGemma
    (its sliding layers with their window), on texts longer than one of
    the kernel's key tiles; the exact path (MLX's attention, what a GPU runs)
    gives the same answers within 1e-5, and never calls the kernel."""
    import mlx_embed

    folder = ROOT / "tests" / "fixtures" / fixture
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)  # EmbeddingGemma 2's folder nests it
    layers = config["num_hidden_layers"]
    calls, longest = [], []
    real = _native.decoder_attention_

    def spy(q, k, v, lengths, scale, out, **kw):
        calls.append((kw["causal"], kw["window"], kw["softcap"]))
        longest.append(max(lengths))
        real(q, k, v, lengths, scale, out, **kw)

    monkeypatch.setattr(_native, "decoder_attention_", spy)
    native, exact = (mlx_embed.load(folder, fast_ops=path) for path in ("native", "exact"))
    want = _answers(exact, golden_texts)
    assert calls == []
    got = _answers(native, golden_texts)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    assert calls and len(calls) % layers == 0, calls
    assert max(longest) > 64  # past the kernel's first key tile
    kinds = set(calls)
    if fixture == "tiny-eurobert":
        assert kinds == {(False, None, None)}
    elif fixture in ("tiny-gemma3", "tiny-embedding-gemma2"):
        half = config["sliding_window"] // (2 if fixture == "tiny-gemma3" else 1)
        assert kinds == {(False, None, None), (False, half, None)}
    elif fixture == "tiny-gemma2":
        cap = config["attn_logit_softcapping"]
        assert kinds == {(True, None, cap), (True, config["sliding_window"] - 1, cap)}
    else:
        assert kinds == {(True, None, None)}


def test_the_swiglu_wrapper_wraps_once_and_runs_mlx_lm_outside_the_engine(monkeypatch):
    """Another mlx-lm user in the process (outside the engine's passes)
    gets mlx-lm's own ``swiglu``; wrapping twice keeps one wrapper."""
    from mlx_lm.models import qwen3

    import mlx_embed.models.qwen3  # noqa: F401 - wraps qwen3.swiglu

    wrapper = qwen3.swiglu
    assert wrapper._mlx_embed_native and wrapper.__wrapped_original__ is not wrapper
    ops.native_swiglu(qwen3)
    assert qwen3.swiglu is wrapper
    monkeypatch.setattr(_native, "gated_linear_unit_", lambda *a: pytest.fail("native kernel outside a pass"))
    gate, up = _evaluated(mx.random.normal((2, 5, 32)), mx.random.normal((2, 5, 32)))
    assert np.array_equal(np.array(wrapper(gate, up)), np.array(wrapper.__wrapped_original__(gate, up)))
