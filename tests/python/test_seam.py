"""The typed seam the Rust bridge calls: spec(), embed_ids(), InvalidInput,
and per-model engine settings (forward context, cache limit, pipelining)."""

import dataclasses
import json
import os
import threading

import mlx_embed
import numpy as np
import pytest
from conftest import FIXTURES, TINY_QWEN3
from mlx_embed import device, ops
from mlx_embed.errors import InvalidInput
from mlx_embed.spec import EmbedResult, ModelSpec, TokenizerSpec


def _vectors(result: EmbedResult, dim: int) -> np.ndarray:
    assert isinstance(result, EmbedResult)
    return np.frombuffer(result.vectors, dtype="<f4").reshape(-1, dim)


def test_spec_describes_the_model(minilm, qwen):
    s = minilm.spec()
    assert isinstance(s, ModelSpec) and isinstance(s.tokenizer, TokenizerSpec)
    assert (s.name, s.model_type, s.kind, s.dim, s.max_length) == (
        "all-MiniLM-L6-v2", "bert", "embedding", 384, 256)
    assert (s.vocab_size, s.pad_id, s.pooling, s.dtype, s.quantization) == (
        30522, 0, "mean", "float32", None)
    assert s.device.startswith("cpu") and s.batch_tokens == 256 and s.workers == minilm.workers
    assert s.elementwise_ops.startswith("native")
    t = s.tokenizer
    assert os.path.basename(t.path) == "tokenizer.json" and os.path.isfile(t.path)
    assert (t.prefix_ids, t.suffix_ids) == ([101], [102])
    assert (t.prompts, t.default_prompt_name) == ({}, None)
    # No pair spec: an embedding model embeds single texts (the Rust
    # tokenizer refuses a pair without one, as `score` does here).
    assert t.pair is None
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in s.details.items())
    assert s.details["device_batch_tokens"] == "256"
    json.dumps(dataclasses.asdict(s))  # plain data all the way down
    q = qwen.spec()
    assert (q.model_type, q.pooling, q.dim) == ("qwen3", "last", 64)


def test_the_instruction_is_the_query_prompt_and_documents_go_without_it(golden_texts):
    """A model loaded with an instruction has it, in its template, as its
    `query` prompt and its default; `document` is no prompt, so a caller
    that says it sends documents (Cohere's search_document) can skip it."""
    from conftest import TINY_QWEN3

    m = mlx_embed.load(TINY_QWEN3, max_length=128, instruction="find it")
    t = m.spec().tokenizer
    assert (t.prompts, t.default_prompt_name) == (
        {"query": "Instruct: find it\nQuery:", "document": ""}, "query")
    texts = golden_texts[:8]
    plain = mlx_embed.load(TINY_QWEN3, max_length=128)
    instructed = plain.embed(texts, prompt="Instruct: find it\nQuery:")
    assert np.abs(m.embed(texts) - instructed).max() == 0
    assert np.abs(m.embed(texts, prompt_name="query") - instructed).max() == 0
    assert np.abs(m.embed(texts, prompt_name="document") - plain.embed(texts)).max() == 0
    assert m.encode(texts, prompt_name="document") == plain.encode(texts)


def test_embed_ids_equals_embed(minilm, qwen, golden_texts):
    for model in (minilm, qwen):
        ids, _ = model.encode(golden_texts)
        got = _vectors(model.embed_ids(ids), model.dim)
        ref = model.embed(golden_texts, normalize=False)
        assert got.shape == (len(golden_texts), model.dim)
        assert np.abs(got - ref).max() <= 1e-6


def test_embed_ids_reports_padded_tokens(minilm):
    ids = [[101] + [1000] * n + [102] for n in (3, 10, 1)]
    r = minilm.embed_ids(ids)
    real = sum(len(x) for x in ids)
    # One sub-batch (38 tokens < 256): three rows padded to the longest (12).
    assert r.padded_tokens == 3 * 12 and r.padded_tokens >= real
    assert minilm.embed_ids([]) == EmbedResult(vectors=b"", padded_tokens=0)


def test_embed_ids_accepts_numpy_rows(minilm):
    ids = [[101, 7592, 2088, 102]]
    a = _vectors(minilm.embed_ids(ids), 384)
    b = _vectors(minilm.embed_ids([np.array(ids[0], dtype=np.uint32)]), 384)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("ids, match", [
    ([[101, 30522]], r"input 0: token id 30522 out of range \[0, 30522\)"),
    ([[101], [-1]], r"input 1: token id -1 out of range"),
    ([[101], [1.5]], r"input 1: token ids must be int, got float"),
    ([[True, False]], r"input 0: token ids must be int, got bool"),
    ([[101], []], r"input 1: empty sequence"),
    ([[101] * 257], r"input 0 has 257 tokens, more than max_length=256"),
    ([[101], "text"], r"input 1: expected a list of token ids, got str"),
    ("text", r"ids must be a list"),
    ([[101, 2**70, 102]], r"a token id is out of range \[0, 30522\)"),
    ([[[101]]], r"token ids must be a list of lists of int \(one list per input\)"),
    ([[101, [1, 2], 102]], r"token ids must be a list of lists of int"),
])
def test_embed_ids_rejects_bad_input(minilm, ids, match):
    with pytest.raises(InvalidInput, match=match) as e:
        minilm.embed_ids(ids)
    assert isinstance(e.value, ValueError)  # plain Python callers may catch that


def test_type_ids(minilm):
    ids = [[101, 7592, 102, 2088, 102]]
    base = _vectors(minilm.embed_ids(ids), 384)
    zeros = _vectors(minilm.embed_ids(ids, [[0] * 5]), 384)
    assert np.array_equal(base, zeros)
    with pytest.raises(InvalidInput, match="4 type ids for 5 tokens"):
        minilm.embed_ids(ids, [[0] * 4])
    with pytest.raises(InvalidInput, match=r"type ids must be ints in \[0, 2\)"):
        minilm.embed_ids(ids, [[0, 0, 0, 2, 2]])
    with pytest.raises(InvalidInput, match="2 type id lists for 1 inputs"):
        minilm.embed_ids(ids, [[0] * 5, [0] * 5])


@pytest.fixture(scope="module")
def minilm_with_prompts(tmp_path_factory, minilm_dir):
    """The bundled model with sentence-transformers prompts and a default."""
    d = tmp_path_factory.mktemp("minilm-prompts")
    for item in minilm_dir.iterdir():
        if item.name != "config_sentence_transformers.json":
            os.symlink(item, d / item.name)
    (d / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "query: ", "passage": "passage: "},
        "default_prompt_name": "query",
    }))
    return mlx_embed.load(d)


def test_prompts_from_the_folder(minilm_with_prompts, minilm):
    m = minilm_with_prompts
    t = m.spec().tokenizer
    assert t.prompts == {"query": "query: ", "passage": "passage: "}
    assert t.default_prompt_name == "query"
    text = "what is mlx"
    default = m.embed([text])
    assert np.abs(default - minilm.embed(["query: " + text])).max() <= 1e-6
    passage = m.embed([text], prompt_name="passage")
    assert np.abs(passage - minilm.embed(["passage: " + text])).max() <= 1e-6
    raw = m.embed([text], prompt="")
    assert np.abs(raw - minilm.embed([text])).max() <= 1e-6
    assert m.count_tokens([text]) == [len(minilm.encode(["query: " + text])[0][0])]
    with pytest.raises(InvalidInput, match="unknown prompt name 'nope'.*passage, query"):
        m.embed([text], prompt_name="nope")
    with pytest.raises(InvalidInput, match="not both"):
        m.embed([text], prompt_name="query", prompt="x")


def test_a_prompt_is_written_only_where_it_ends_a_word():
    """The default prompt is left off a text that begins with one of the
    model's prompts, all of it, ending where a word ends; the server's
    tokenizer follows the same rule (crates/mlx-embed-tokenizer/tests/rules.rs)."""
    from mlx_embed.tokenization import begins_with_prompt, prompt_in_effect, with_prompt

    prompts = {"query": "query: ", "short": "quer"}
    assert with_prompt("query: ", "query: rivers", prompts) == "query: rivers"
    assert with_prompt("query: ", "query rivers", prompts) == "query: query rivers"
    assert with_prompt("query: ", "quer rivers", prompts) == "quer rivers"
    assert with_prompt("query: ", "quer", prompts) == "quer"
    assert with_prompt("query: ", "quer, rivers", prompts) == "quer, rivers"
    assert prompt_in_effect("query: ", "query rivers", prompts) == "query: "
    assert prompt_in_effect("query: ", "quer rivers", prompts) == "quer"
    assert not begins_with_prompt("rivers", "")
    assert begins_with_prompt("query:rivers", "query:")


def test_bad_prompt_config_is_a_load_error(tmp_path, minilm_dir):
    for item in minilm_dir.iterdir():
        if item.name != "config_sentence_transformers.json":
            os.symlink(item, tmp_path / item.name)
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "q: "}, "default_prompt_name": "document"}))
    with pytest.raises(ValueError, match="default_prompt_name 'document'"):
        mlx_embed.load(tmp_path)


class _CountingNative:
    """Wraps the native extension, counting kernel calls (not ``unit_rows_``,
    the normalization every path shares with the server)."""

    def __init__(self, real):
        self._real, self.calls = real, 0

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if not name.endswith("_") or name == "unit_rows_" or not callable(fn):
            return fn

        def counted(*a, **k):
            self.calls += 1
            return fn(*a, **k)

        return counted


def test_two_models_keep_their_own_elementwise_path(minilm, golden_texts, golden_mean, monkeypatch):
    exact = mlx_embed.load(fast_ops="exact")
    assert exact.context.path == "exact" and minilm.context.path == "native"
    counting = _CountingNative(ops._native)
    monkeypatch.setattr(ops, "_native", counting)
    a = exact.embed(golden_texts)
    assert counting.calls == 0
    b = minilm.embed(golden_texts)
    assert counting.calls > 0
    for got in (a, b):
        assert np.abs(got - golden_mean).max() <= 1e-5
    # Outside any forward pass nothing stays active.
    assert ops.current() is ops.default_context()


@pytest.mark.parametrize("value", ["fastest", "NATIVE", "1", "true", ""])
def test_fast_ops_argument_is_checked(value):
    """The keyword takes the three names; the environment variable's older
    spellings (1/0, true/false) stay the environment's."""
    with pytest.raises(ValueError, match="fast_ops must be 'native', 'mlx' or 'exact'"):
        mlx_embed.load(fast_ops=value)


@pytest.mark.parametrize("fast_ops", ["native", "exact"])
def test_pipelined_equals_synchronous(golden_texts, fast_ops):
    # A small budget makes many sub-batches, submitted out of input order.
    sync = mlx_embed.load(fast_ops=fast_ops, pipeline=False, workers=1, batch_tokens=300)
    piped = mlx_embed.load(fast_ops=fast_ops, pipeline=True, batch_tokens=300)
    assert piped.scheduler.pipeline and not sync.scheduler.pipeline
    ids, _ = sync.encode(golden_texts)
    assert len(piped.scheduler.plan(np.array([len(x) for x in ids]))) > 5
    a = _vectors(sync.embed_ids(ids), 384)
    r = piped.embed_ids(ids)
    assert np.abs(_vectors(r, 384) - a).max() <= 1e-6
    assert r.padded_tokens == sync.embed_ids(ids).padded_tokens


def test_cache_limit_applied_and_reported(golden_texts):
    try:
        m = mlx_embed.load(cache_limit_mb=64)
        assert m.memory()["cache_limit_bytes"] == 64 * 1024 * 1024
        assert m.spec().details["cache_limit_mb"] == "64"
        assert m.info()["cache_limit_mb"] == 64
        for n in range(1, 30):
            m.embed(golden_texts[:n])
            assert m.memory()["cache_bytes"] <= 64 * 1024 * 1024
        with pytest.raises(ValueError, match="cache_limit_mb must be 0 or more"):
            mlx_embed.load(cache_limit_mb=-1)
    finally:
        device.apply_cache_limit(None)
    # The CPU default: no cache at all (MLX frees it at exit, which aborted).
    assert device.memory()["cache_limit_bytes"] == 0


def test_memory_bounded_over_500_varied_calls(qwen):
    rng = np.random.default_rng(0)
    base = None
    for call in range(500):
        rows = int(rng.integers(1, 9))
        ids = [[101] + rng.integers(1000, 29000, int(rng.integers(1, 120))).tolist() + [102]
               for _ in range(rows)]
        qwen.embed_ids(ids)
        mem = qwen.memory()
        assert mem["cache_bytes"] == 0  # the CPU keeps no cache
        if call == 49:
            base = mem["active_bytes"]
    end = qwen.memory()["active_bytes"]
    print(f"\nactive after 50 calls {base} B, after 500 {end} B")
    assert end <= base * 1.1 + 1024 * 1024


def test_streams_and_overlapping_calls_equal_synchronous(golden_texts):
    """Sub-batches spread over two streams, and two calls in flight at once
    (submit k+1 before collecting k, as a model thread would), give the
    synchronous vectors."""
    sync = mlx_embed.load(fast_ops="exact", pipeline=False, workers=1, batch_tokens=300)
    piped = mlx_embed.load(fast_ops="exact", pipeline=True, streams=2, batch_tokens=300)
    assert piped.spec().details["streams"] == "2"
    ids, _ = sync.encode(golden_texts)
    first, second = ids[:25], ids[25:]
    pending_first = piped.submit_ids(first)
    pending_second = piped.submit_ids(second)
    got = np.concatenate([_vectors(pending_first.result(), 384),
                          _vectors(pending_second.result(), 384)])
    # The same two calls synchronously: the same passes, so the same
    # vectors. (One call of all 40 plans other passes, whose padding and
    # shapes move float32 sums by ~1e-6 with some BLAS builds.)
    want = np.concatenate([_vectors(sync.embed_ids(first), 384), _vectors(sync.embed_ids(second), 384)])
    assert np.abs(got - want).max() <= 1e-6
    with pytest.raises(ValueError, match="streams must be at least 1, got 0"):
        mlx_embed.load(streams=0)


@pytest.mark.parametrize(("setting", "error", "message"), [
    ({"workers": 0}, ValueError, "workers must be at least 1, got 0"),
    ({"batch_tokens": 0}, ValueError, "batch_tokens must be at least 1, got 0"),
    ({"max_length": -1}, ValueError, "max_length must be at least 1"),
    ({"max_length": 2.5}, TypeError, "max_length must be a whole number, got 2.5"),
    ({"max_length": "64"}, TypeError, "max_length must be a whole number"),
    ({"quantize": 4.0}, TypeError, "quantize must be a whole number, got 4.0"),
    ({"pipeline": "no"}, TypeError, "pipeline must be True, False or None, got 'no'"),
    ({"joined_linears": 1}, TypeError, "joined_linears must be True, False or None"),
    ({"name": 5}, TypeError, "name must be a string, got 5"),
    # Found by a probe of the library (they were coerced or failed elsewhere).
    ({"cache_limit_mb": "10"}, TypeError, "cache_limit_mb must be a whole number, got '10'"),
    ({"cache_limit_mb": 1.5}, TypeError, "cache_limit_mb must be a whole number, got 1.5"),
    ({"cache_limit_mb": True}, TypeError, "cache_limit_mb must be a whole number, got True"),
    ({"cache_limit_mb": -1}, ValueError, "cache_limit_mb must be 0 or more, got -1"),
    # A library probe: the server's bounds were its flags' alone (2000 workers started 2000 threads).
    ({"workers": 257}, ValueError, r"workers must be at most \d+ \(4 per core on \d+ cores?, 256 at most\), got 257"),
    ({"cache_limit_mb": (1 << 24) + 1}, ValueError, r"cache_limit_mb must be at most 16777216 \(16 TiB\)"),
    ({"pooling": 5}, TypeError, "pooling must be a string or a list of strings, got 5"),
    ({"instruction": 5}, TypeError, "instruction must be a string, got 5"),
    ({"kind": 1}, TypeError, "kind must be a string, got 1"),
    ({"fast_ops": 1}, TypeError, "fast_ops must be a string, got 1"),
    ({"truncation_side": 1}, TypeError, "truncation_side must be a string, got 1"),
    ({"truncation_side": "Left"}, ValueError, "truncation_side must be 'right' or 'left', got 'Left'"),
])
def test_load_refuses_a_setting_of_the_wrong_type_or_range_naming_it(setting, error, message):
    """Each of these was once coerced quietly: pipeline="no" switched
    pipelining on, workers=0 became 1, max_length=2.5 became 2."""
    with pytest.raises(error, match=message):
        mlx_embed.load(TINY_QWEN3, **setting)


def test_load_takes_up_to_4_workers_per_core_and_refuses_more():
    """The bound is the cores this process may run on: 4 each load, one more
    is refused before any thread starts."""
    cores = len(os.sched_getaffinity(0))
    most = min(256, 4 * cores)
    assert mlx_embed.load(TINY_QWEN3, workers=most).scheduler.workers in (most, 1)
    with pytest.raises(ValueError, match=f"workers must be at most {most} "):
        mlx_embed.load(TINY_QWEN3, workers=most + 1)


def test_the_workers_variable_is_bounded_as_load_workers(monkeypatch):
    """MLX_EMBED_WORKERS, load()'s fallback, had no most: 2000 there started
    2000 threads on 2 cores, which load(workers=2000) refuses."""
    most = min(256, 4 * len(os.sched_getaffinity(0)))
    monkeypatch.setenv("MLX_EMBED_WORKERS", str(most + 1))
    with pytest.raises(ValueError, match=rf"MLX_EMBED_WORKERS must be at most {most} \(4 per core on \d+ cores?, 256 at most\), got '{most + 1}'"):
        mlx_embed.load(TINY_QWEN3)
    monkeypatch.setenv("MLX_EMBED_WORKERS", str(most))
    assert mlx_embed.load(TINY_QWEN3).scheduler.workers in (most, 1)


def test_quantizing_no_layer_is_an_error_not_a_report(monkeypatch):
    """A group size that divides no layer's input width quantized nothing,
    yet the model reported 4-bit weights."""
    monkeypatch.setenv("MLX_EMBED_WORKERS", "1")
    with pytest.raises(ValueError, match="group_size=7 quantizes no layer"):
        mlx_embed.load(TINY_QWEN3, quantize=4, group_size=7)
    monkeypatch.setenv("MLX_EMBED_WORKERS", "two")
    with pytest.raises(ValueError, match="MLX_EMBED_WORKERS must be a whole number of at least 1, got 'two'"):
        mlx_embed.load(TINY_QWEN3)


def test_normalization_on_the_device_matches_numpy(minilm, golden_texts):
    raw = minilm.embed(golden_texts, normalize=False)
    ref = raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)
    got = minilm.embed(golden_texts)
    assert np.abs(got - ref).max() <= 1e-6
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_live_details_for_info(minilm):
    d = minilm.live_details()
    assert set(d) == {"active_mb", "cache_mb", "peak_mb", "cache_limit_mb", "blas_gflops"}
    assert float(d["active_mb"]) > 10  # MiniLM's fp32 weights alone are ~87 MB
    assert float(d["cache_mb"]) == 0.0
    assert float(d["blas_gflops"]) > 1.0
    assert all(isinstance(v, str) for v in d.values())


# ---------------------------------------------------------------- GPU shapes
# The GPU defaults (bounded pass shapes, fused attention in half precision)
# are forced on here: the CPU runs the same graphs.


def test_length_and_row_buckets():
    from mlx_embed.scheduler import bucket_length, bucket_rows

    assert [bucket_length(n) for n in (1, 16, 17, 20, 21, 33, 64, 65, 100, 129, 300, 512, 513)] == [
        16, 16, 20, 20, 24, 40, 64, 80, 112, 160, 320, 512, 640]
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 32, 33, 64, 65)] == [1, 2, 4, 8, 32, 64, 64, 128]
    for n in range(17, 40000):
        assert n <= bucket_length(n) <= n * 1.25
    # Every shape a 16384-token budget can form stays within MLX's 256 cached
    # cuDNN attention plans, even for a 32k-token model.
    lengths = sorted({bucket_length(n) for n in range(1, 32769)})
    shapes = [(n, 1 << k) for n in lengths for k in range(15) if n << k <= 16384 or k == 0]
    assert len(shapes) == 235


def test_bucketed_plan_respects_the_budget_after_padding():
    m = mlx_embed.load(fast_ops="exact", pipeline=True, shape_buckets=True, batch_tokens=2048)
    rng = np.random.default_rng(3)
    lengths = rng.integers(3, 257, 500)
    plan = m.scheduler.plan(lengths)
    assert sorted(np.concatenate(plan).tolist()) == list(range(500))
    shapes = set()
    for idx in plan:
        longest = int(lengths[idx].max())
        size = m.scheduler.padded_size(longest, len(idx))
        assert size <= 2048 or len(idx) == 1
        shapes.add((m.scheduler.bucket(longest), len(idx)))
    # Rows fill their power of two: only the last pass of a length is short.
    assert sum(1 for idx in plan if len(idx) & (len(idx) - 1)) <= len({s[0] for s in shapes})


@pytest.mark.parametrize("model", ["minilm", "qwen3"])
def test_bucketed_shapes_equal_exact_shapes(golden_texts, model):
    path = None if model == "minilm" else str(TINY_QWEN3)
    plain = mlx_embed.load(path, fast_ops="exact", pipeline=False, workers=1, batch_tokens=300)
    bucketed = mlx_embed.load(path, fast_ops="exact", pipeline=True, shape_buckets=True,
                              batch_tokens=300)
    assert bucketed.spec().details["shape_buckets"] == "true"
    assert plain.spec().details["shape_buckets"] == "false"  # the CPU default
    ids, _ = plain.encode(golden_texts)
    dim = plain.dim
    for sub in (ids, ids[:3], ids[5:6]):
        want = plain.embed_ids(sub)
        got = bucketed.embed_ids(sub)
        assert np.abs(_vectors(got, dim) - _vectors(want, dim)).max() <= 1e-5
        assert got.padded_tokens >= want.padded_tokens
    # The whole corpus really ran in padded shapes.
    assert bucketed.embed_ids(ids).padded_tokens > plain.embed_ids(ids).padded_tokens
    rows_plain = plain.embed_ids(ids[:7], output="tokens")
    rows_bucketed = bucketed.embed_ids(ids[:7], output="tokens")
    assert rows_bucketed.rows == rows_plain.rows == [len(x) for x in ids[:7]]
    a = np.frombuffer(rows_plain.vectors, "<f4")
    b = np.frombuffer(rows_bucketed.vectors, "<f4")
    assert a.shape == b.shape and np.abs(a - b).max() <= 1e-5


def test_bucketed_pair_scoring_equals_exact(golden_texts):
    path = str(FIXTURES / "tiny-bert-reranker")
    plain = mlx_embed.load(path, fast_ops="exact", pipeline=False, workers=1)
    bucketed = mlx_embed.load(path, fast_ops="exact", pipeline=True, shape_buckets=True)
    pairs = [("what is mlx", t) for t in golden_texts[:9]]
    assert np.abs(np.asarray(bucketed.score(pairs)) - np.asarray(plain.score(pairs))).max() <= 1e-5


@pytest.mark.parametrize("streams", [1, 2])
def test_pipelined_model_serves_any_thread(golden_texts, streams):
    """MLX streams belong to the thread that made them: a pipelined model
    (the GPU default) used on one thread, then from another (a Python thread
    pool), must not reuse the first thread's streams ("There is no Stream(cpu,
    0) in current thread" before the fix)."""
    m = mlx_embed.load(fast_ops="exact", pipeline=True, streams=streams, batch_tokens=128)
    want = m.embed(golden_texts)
    got = {}

    def other_thread():
        try:
            got["vectors"] = m.embed(golden_texts)
        except Exception as e:  # noqa: BLE001 - asserted below
            got["error"] = e

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert "error" not in got, got.get("error")
    assert np.array_equal(got["vectors"], want)
    assert np.array_equal(m.embed(golden_texts), want)


def test_engines_off_the_cpu_queue_passes_one_thread_at_a_time(golden_texts, monkeypatch):
    """On a GPU, two threads recording MLX graphs at once aborted the process
    (H200: "cudaStreamEndCapture(...) failed", two engine instances on two
    threads). Off the CPU every engine's passes are queued under one process
    lock: two engines called from two threads never build a pass graph at the
    same moment, and each gets the synchronous path's vectors. On the CPU each
    engine keeps its own lock, so separate engines still run side by side."""
    from mlx_embed import scheduler as scheduler_mod

    cpu = mlx_embed.load(fast_ops="exact", pipeline=True)
    assert cpu.scheduler._lock is not mlx_embed.load(fast_ops="exact").scheduler._lock
    gpu = {"is_cpu": staticmethod(lambda: False), "cuda_graphs": staticmethod(lambda: "on")}
    monkeypatch.setattr(scheduler_mod, "device", type("Gpu", (), gpu))
    engines = [mlx_embed.load(fast_ops="exact", batch_tokens=128) for _ in range(2)]
    monkeypatch.undo()
    assert engines[0].scheduler.pipeline and engines[0].scheduler.shape_buckets
    assert engines[0].scheduler._lock is engines[1].scheduler._lock is scheduler_mod._DEVICE_QUEUE_LOCK
    ref = mlx_embed.load(fast_ops="exact", pipeline=False, batch_tokens=128)
    want = ref.embed(golden_texts)
    inside, most = [0], [0]
    count = threading.Lock()

    def watched(graph):
        def run(*args, **kwargs):
            with count:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            try:
                threading.Event().wait(0.002)  # widen the window another thread could enter
                return graph(*args, **kwargs)
            finally:
                with count:
                    inside[0] -= 1

        return run

    for e in engines:
        e.scheduler._graph = watched(e.scheduler._graph)
    got, errors = {}, []

    def caller(k):
        try:
            got[k] = [engines[k].embed(golden_texts) for _ in range(3)]
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert most[0] == 1
    for k in range(2):
        for vectors in got[k]:
            assert np.abs(vectors - want).max() <= 1e-6


def test_workers_run_as_one_off_the_cpu(golden_texts, monkeypatch):
    """Worker threads evaluate their passes outside the device lock: off the
    CPU (workers=2, pipelining off) two threads evaluated on the device at
    once, which aborted the process on an H200. There one thread runs them."""
    from mlx_embed import scheduler as scheduler_mod

    gpu = {"is_cpu": staticmethod(lambda: False), "cuda_graphs": staticmethod(lambda: "on")}
    monkeypatch.setattr(scheduler_mod, "device", type("Gpu", (), gpu))
    model = mlx_embed.load(fast_ops="exact", workers=2, pipeline=False, batch_tokens=128)
    monkeypatch.undo()
    assert (model.scheduler.workers, model.scheduler.pipeline) == (1, False)
    assert mlx_embed.load(fast_ops="exact", workers=2).scheduler.workers == 2  # the CPU keeps them
    threads = set()
    graph = model.scheduler._graph

    def watched(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return graph(*args, **kwargs)

    model.scheduler._graph = watched
    want = mlx_embed.load(fast_ops="exact", workers=1, pipeline=False, batch_tokens=128).embed(golden_texts)
    assert np.abs(model.embed(golden_texts) - want).max() <= 1e-6
    assert threads == {threading.current_thread().name}


def test_the_budget_counts_the_compiled_paths_rounded_lengths():
    """On the compiled-MLX path passes are padded to a rounded length; the
    plan counted the unrounded one, so passes ran up to 2x the budget."""
    model = mlx_embed.load(fast_ops="mlx", workers=1, batch_tokens=256)
    sched = model.scheduler
    assert sched.context.path == "mlx" and not sched.shape_buckets
    rng = np.random.default_rng(0)
    lengths = np.concatenate([np.full(64, 2), rng.integers(3, 130, 200), np.full(64, 65)])
    for batch in sched.plan(lengths):
        longest = int(lengths[batch].max())
        padded = sched.bucket(longest) * len(batch)
        assert padded <= sched.batch_tokens or len(batch) == 1, (longest, len(batch), padded)


def test_pipelined_calls_rotate_over_streams(golden_texts):
    """With ``streams=2`` consecutive one-pass calls take turns on the two
    streams (so a device runs call k+1 beside call k), a multi-pass call
    spreads its passes and the rotation carries on after it, and calls
    submitted before the previous one is collected give the vectors of the
    synchronous path."""
    m = mlx_embed.load(fast_ops="exact", pipeline=True, streams=2, batch_tokens=128)
    ref = mlx_embed.load(fast_ops="exact", pipeline=False, batch_tokens=128)
    used = []
    pick = m.scheduler._call_streams

    def recording(passes):
        streams = pick(passes)
        used.append(streams)
        return streams

    m.scheduler._call_streams = recording
    calls = [golden_texts[i : i + 3] for i in range(0, 12, 3)]
    ids = [m.encode(c)[0] for c in calls]
    pending = []
    for call in ids:
        pending.append(m.submit_ids(call))
    got = [np.frombuffer(p.result().vectors, dtype="<f4").reshape(len(c), -1) for p, c in zip(pending, ids)]
    for call, vectors in zip(ids, got):
        want = np.frombuffer(ref.embed_ids(call).vectors, dtype="<f4").reshape(len(call), -1)
        assert np.abs(vectors - want).max() <= 1e-6
    assert [len(s) for s in used] == [1, 1, 1, 1]
    first, second = used[0][0], used[1][0]
    assert first is None and second is not None
    assert [s[0] for s in used] == [first, second, first, second]
    # 30 texts of up to ~20 tokens at 128 padded tokens a pass: several
    # passes, alternating, and the next call continues the rotation.
    many = m.encode(golden_texts * 2)[0]
    m.submit_ids(many).result()
    passes = used[-1]
    assert len(passes) > 2
    assert passes == [[first, second][k % 2] for k in range(len(passes))]
    m.submit_ids(ids[0]).result()
    assert used[-1] == [[first, second][len(passes) % 2]]


def test_fused_attention_equals_matmul_attention(golden_texts):
    matmul = mlx_embed.load(fast_ops="exact", fused_attention=False)
    fused = mlx_embed.load(fast_ops="exact", fused_attention=True)
    assert (matmul.spec().details["attention"], fused.spec().details["attention"]) == ("matmul", "fused")
    assert np.abs(fused.embed(golden_texts) - matmul.embed(golden_texts)).max() <= 1e-6
    # The defaults: fused on a GPU in half precision only (measured there).
    gpu = mx_device("gpu")
    assert ops.default_fused_attention("bfloat16", gpu) and ops.default_fused_attention("float16", gpu)
    assert not ops.default_fused_attention("float32", gpu)
    assert not ops.default_fused_attention("bfloat16", mx_device("cpu"))
    assert mlx_embed.load(dtype="bfloat16").spec().details["attention"] == "matmul"  # CPU
    # The native path has its own fused kernel; the flag does not apply there.
    assert not mlx_embed.load(fused_attention=True).context.fused_attention


def mx_device(kind: str):
    import mlx.core as mx

    return mx.Device(mx.gpu if kind == "gpu" else mx.cpu)


@pytest.mark.parametrize(
    "given, want_env, want_matmul",
    [(None, "0", "exact"), ("1", "1", "tf32"), ("0", "0", "exact")],
)
def test_float32_stays_exact_unless_asked(given, want_env, want_matmul):
    """MLX runs float32 matmuls as TF32 on CUDA and M5 Metal by default; the
    package turns that off at import unless MLX_ENABLE_TF32 is set, and
    reports what runs: off the CPU the value it imported with (MLX reads the
    variable once, later changes do nothing), on the CPU always exact."""
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    env["PYTHONPATH"] = str(ROOT / "python")
    if given is not None:
        env["MLX_ENABLE_TF32"] = given
    code = (
        "import os, json, mlx_embed\n"
        "from mlx_embed import precision\n"
        "m = mlx_embed.load()\n"
        "seen = os.environ['MLX_ENABLE_TF32']\n"
        "os.environ['MLX_ENABLE_TF32'] = '0' if seen != '0' else '1'\n"
        "print(json.dumps([seen, m.spec().details['float32_matmul'], m.info()['float32_matmul'],"
        " precision.float32_matmul(on_cpu=False)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [want_env, "exact", "exact", want_matmul]


@pytest.mark.parametrize("value, want", [
    (None, True), ("0", False), (" 0 ", False), ("", False), ("no", False), ("1", True), (" 2x", True),
    ("-1", True), ("\t+3", True),
    # Not atoi's whitespace or digits: read as 0.
    ("\xa01", False), ("\u0661", False),
    # atoi is (int) strtol: 2**32 cuts to 0, a number past a long clamps to LONG_MAX (-1 as an int).
    ("4294967296", False), ("4294967297", True), ("99999999999999999999999", True),
])
def test_mlx_switches_read_the_variable_as_mlx_does(value, want):
    from mlx_embed import precision

    assert precision.mlx_switch_on(value) is want


@pytest.mark.parametrize("value, want", [(None, "on"), ("0", "off"), ("1", "on"), ("", "off"), (" 0", "off")])
def test_cuda_graphs_reports_what_mlx_reads(monkeypatch, value, want):
    """/info says whether MLX's CUDA backend records kernels into CUDA graphs
    (its default) or launches them one by one (MLX_USE_CUDA_GRAPHS=0), read as
    MLX reads the variable; off CUDA there is nothing to say."""
    from mlx_embed import device

    if value is None:
        monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", value)
    assert device.cuda_graphs() is None  # this machine's CPU
    monkeypatch.setattr(device, "backend", lambda: "cuda")
    assert device.cuda_graphs() == want
    monkeypatch.setattr(device, "backend", lambda: "metal")
    assert device.cuda_graphs() is None


def test_cuda_graphs_is_absent_from_a_cpu_models_details(minilm):
    assert "cuda_graphs" not in minilm.spec().details
    assert minilm.info()["cuda_graphs"] is None


@pytest.mark.parametrize("call", [
    lambda m: m.embed(["a"], normalize="no"),
    lambda m: m.embed(["a"], truncate=None),
    lambda m: m.embed_with_counts(["a"], normalize=1),
    lambda m: m.encode(["a"], truncate="no"),
])
def test_per_call_switches_must_be_bools(minilm, call):
    """``normalize="no"`` once normalized and ``truncate=None`` refused long
    texts (Python's truthiness); each is now refused, naming the switch."""
    with pytest.raises(TypeError, match=r"(normalize|truncate) must be True or False, got"):
        call(minilm)
    assert minilm.embed(["a"], normalize=np.bool_(False)).shape == (1, 384)
