"""Late chunking (``EmbeddingModel.embed_late_chunks``, the server's
``late_chunking: true``) against an independent computation: the library's
per-token rows of the joined text (``embed_tokens``, validated against
sentence-transformers elsewhere), each chunk's token span from the
``tokenizers`` library's own offsets, and a NumPy mean and normalization."""

from pathlib import Path

import mlx_embed
import numpy as np
import pytest
from conftest import load_fixture
from mlx_embed.errors import InputTooLong, InvalidInput
from tokenizers import Tokenizer


def _documents(texts: list[str]) -> list[list[str]]:
    """The non-empty golden texts as documents of four chunks each, every
    other text also split in two at a space (a boundary inside a sentence,
    never inside a word)."""
    # Short texts, so four of them fit MiniLM's 256 tokens as one text.
    texts = [t for t in texts if t.strip() and len(t) < 200]
    docs = []
    for start in range(0, len(texts), 4):
        chunks = []
        for j, text in enumerate(texts[start : start + 4]):
            words = text.split(" ")
            if j % 2 and len(words) > 3:
                half = len(words) // 2
                chunks += [" ".join(words[:half]), " ".join(words[half:])]
            else:
                chunks.append(text)
        docs.append(chunks)
    return docs


def _last_overlapped(chunks, starts, start: int, stop: int) -> int:
    """The last chunk whose characters [start, stop) reaches into, -1 for
    none (a token of the separator alone)."""
    hit = [i for i, (s, c) in enumerate(zip(starts, chunks)) if s < stop and start < s + len(c)]
    return hit[-1] if hit else -1


def _reference(model, chunks: list[str]) -> np.ndarray:
    joined = " ".join(chunks)
    tok = Tokenizer.from_file(str(Path(model.path) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    enc = tok.encode(joined)
    starts = np.cumsum([0] + [len(c) + 1 for c in chunks[:-1]])
    owner = [
        -1 if special or stop == start else _last_overlapped(chunks, starts, start, stop)
        for special, (start, stop) in zip(enc.special_tokens_mask, enc.offsets)
    ]
    rows = model.embed_tokens([joined])[0]
    assert rows.shape[0] == len(enc.ids)
    owner = np.array(owner)
    means = np.stack([rows[owner == i].astype(np.float64).mean(axis=0) for i in range(len(chunks))])
    return means / np.linalg.norm(means, axis=1, keepdims=True)


def test_chunks_are_the_means_of_their_own_tokens(minilm, golden_texts, cos):
    docs = _documents(golden_texts)
    assert len(docs) >= 6 and sum(map(len, docs)) >= 30, [len(d) for d in docs]
    worst_cos, worst_diff = 1.0, 0.0
    for chunks in docs:
        got = minilm.embed_late_chunks(chunks)
        ref = _reference(minilm, chunks)
        assert got.shape == (len(chunks), minilm.dim) and got.dtype == np.float32
        worst_cos = min(worst_cos, float(cos(got, ref).min()))
        worst_diff = max(worst_diff, float(np.abs(got - ref).max()))
        raw = minilm.embed_late_chunks(chunks, normalize=False)
        assert np.array_equal(mlx_embed.pooling.unit_rows(raw), got)
    print(f"late chunking vs reference: min cosine {worst_cos:.9f}, max |diff| {worst_diff:.2e}")
    assert worst_cos >= 0.99999 and worst_diff <= 1e-6


def test_a_chunk_takes_context_from_the_others(minilm):
    chunks = ["Berlin is in Germany.", "It is the capital."]
    query = minilm.embed(["Berlin"])[0]
    late = minilm.embed_late_chunks(chunks) @ query
    plain = minilm.embed(chunks) @ query
    print(f"cosine to 'Berlin': late {late}, plain {plain}")
    # Measured: 0.587 late against 0.316 alone for "It is the capital.".
    assert late[1] > plain[1] + 0.2


def test_refusals(minilm):
    with pytest.raises(InvalidInput, match="at least one chunk"):
        minilm.embed_late_chunks([])
    with pytest.raises(InvalidInput, match="chunk 1 is an empty string"):
        minilm.embed_late_chunks(["a text", ""])
    with pytest.raises(InvalidInput, match="chunk 1 has no tokens"):
        minilm.embed_late_chunks(["a text", "  "])
    with pytest.raises(InputTooLong, match="whole text in one context"):
        minilm.embed_late_chunks(["word " * 200, "word " * 200])
    cls = load_fixture("tiny-modernbert")
    assert cls.pooling != "mean"
    with pytest.raises(InvalidInput, match="pools each chunk's tokens by their mean"):
        cls.embed_late_chunks(["a", "b"])


JINA_TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")


def _task_rows(model, texts: list[str], task: str) -> list[np.ndarray]:
    """Per-token rows under a task's adapter, each text led by the task's
    prompt (what ``embed(task=)`` runs before it pools)."""
    ids, _ = model.encode(texts, prompt_name=task)
    res = model.embed_ids(ids, output="tokens", adapter=[model.tasks.index(task)] * len(ids))
    flat = np.frombuffer(res.vectors, dtype="<f4").reshape(-1, model.dim)
    assert res.rows == [len(x) for x in ids]
    return np.split(flat, np.cumsum(res.rows)[:-1])


@pytest.mark.parametrize("task", JINA_TASKS)
def test_task_adapter_runs_for_per_token_output(task, golden_texts, cos):
    """jina-embeddings-v3 (mean pooling, prompt pooled): the mean of every
    per-token row under a task is the float64 sentence-transformers
    reference of that task, so the per-token path runs the adapter."""
    model = load_fixture("tiny-jina-v3")
    ref = np.load(Path(model.path) / f"reference_{task}_normalized.npy")
    means = np.stack([rows.astype(np.float64).mean(axis=0) for rows in _task_rows(model, golden_texts, task)])
    got = means / np.linalg.norm(means, axis=1, keepdims=True)
    print(
        f"{task}: token means vs reference: min cosine {cos(got, ref).min():.9f}, max |diff| "
        f"{np.abs(got - ref).max():.2e}"
    )
    assert cos(got, ref).min() >= 0.99999 and np.abs(got - ref).max() <= 1e-5
    base = np.load(Path(model.path) / "reference_none_normalized.npy")
    assert cos(got, base).min() < 0.999, "the adapter changed nothing: the test would not see it missing"


@pytest.mark.parametrize("task", ["retrieval.passage", "separation"])
def test_late_chunking_with_a_task(task, cos):
    """Each chunk the mean of its own rows of the task's per-token output
    (prompt included in the run, pooled by no chunk); spans from the
    ``tokenizers`` library's offsets; multilingual chunks."""
    model = load_fixture("tiny-jina-v3")
    chunks = ["Berlin ist die Hauptstadt.", "Café crème à Paris", "東京は日本の首都です。", "emoji 🙂 ok 🚀", "x"]
    prompt = model.prompts[task]
    joined = " ".join(chunks)
    tok = Tokenizer.from_file(str(Path(model.path) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    enc = tok.encode(prompt + joined)
    rows = _task_rows(model, [joined], task)[0]
    assert rows.shape[0] == len(enc.ids)
    starts = len(prompt) + np.cumsum([0] + [len(c) + 1 for c in chunks[:-1]])
    ranges = [range(s, s + len(c)) for s, c in zip(starts, chunks)]
    # XLM-R's SentencePiece makes the separator a token of its own ("▁"):
    # a token whose last character is no chunk's belongs to none.
    owner = np.array(
        [
            _last_overlapped(chunks, starts, start, stop) if stop > start and not special else -1
            for special, (start, stop) in zip(enc.special_tokens_mask, enc.offsets)
        ]
    )
    # Three separators are tokens of no chunk; the one before "Café" is in
    # "▁Ca" (offsets from the space), whose last character is the chunk's.
    assert sum(enc.offsets[k] == (r.start - 1, r.start) for k in range(len(owner)) for r in ranges[1:]) == 3
    means = np.stack([rows[owner == i].astype(np.float64).mean(axis=0) for i in range(len(chunks))])
    ref = means / np.linalg.norm(means, axis=1, keepdims=True)
    got = model.embed_late_chunks(chunks, task=task)
    print(f"late chunking {task}: min cosine {cos(got, ref).min():.9f}, max |diff| {np.abs(got - ref).max():.2e}")
    assert cos(got, ref).min() >= 0.99999 and np.abs(got - ref).max() <= 1e-6
    plain = model.embed_late_chunks(chunks)
    assert cos(got, plain).min() < 0.999
    # A one-chunk list is the task's pooled vector less the specials' and
    # the prompt's rows: with those rows back it is embed(task=) itself.
    one = model.embed_late_chunks([joined], task=task, normalize=False)[0]
    other = np.array(
        [bool(special) or stop - 1 < len(prompt) for special, (_, stop) in zip(enc.special_tokens_mask, enc.offsets)]
    )
    whole = one.astype(np.float64) * (~other).sum() + rows[other].astype(np.float64).sum(axis=0)
    pooled = model.embed([joined], task=task, normalize=False)[0]
    print(f"one chunk plus the other rows vs embed(task=): max |diff| {np.abs(whole / len(other) - pooled).max():.2e}")
    assert np.abs(whole / len(other) - pooled).max() <= 1e-5


def test_a_piece_that_ends_in_the_separator_is_its_chunk_s(cos):
    """A SentencePiece BPE (the EmbeddingGemma fixture's) merges across the
    joining space: "Germany. It is." reads "G", "er", "man", "y", ".▁I",
    "t▁", "i", "s", ".", so "It"'s "t" is in a piece that ends in the
    separator. It belongs to "It" (the last chunk it overlaps), not to none;
    a chunk whose text is all in a piece that ends in the next one ("." in
    ".▁I" of "Germany. . It") is refused."""
    model = load_fixture("tiny-embedding-gemma2")
    tok = Tokenizer.from_file(str(Path(model.path) / "tokenizer.json"))
    chunks = ["Germany.", "It", "is."]
    enc = tok.encode(" ".join(chunks), add_special_tokens=False)
    assert ("t▁", (10, 12)) in list(zip(enc.tokens, enc.offsets)), list(zip(enc.tokens, enc.offsets))
    got = model.embed_late_chunks(chunks, normalize=False)
    ids, _ = model.encode([" ".join(chunks)])
    rows = model.embed_ids(ids, output="tokens")
    flat = np.frombuffer(rows.vectors, dtype="<f4").reshape(-1, model.dim).astype(np.float64)
    lead = len(ids[0]) - len(enc.ids) - len(model.tokenizer.suffix)
    k = lead + [o for o in enc.offsets].index((10, 12))
    # "It" is ".▁I" and "t▁": the mean of those two rows.
    assert enc.offsets[k - lead - 1] == (7, 10)
    assert np.abs(got[1] - flat[k - 1 : k + 1].mean(axis=0)).max() <= 1e-6
    with pytest.raises(InvalidInput, match="chunk 1 has no tokens of its own"):
        model.embed_late_chunks(["Germany.", ".", "It"])


@pytest.mark.parametrize("task", JINA_TASKS)
def test_a_prompt_name_naming_a_task_runs_its_adapter(task, golden_texts, cos):
    """jina-embeddings-v3 names its prompts after its tasks, and its own
    documented call passes both (``encode(task=t, prompt_name=t)``): a
    ``prompt_name`` that names a task runs that task's adapter too, as the
    server's does, in ``embed``, ``embed_tokens`` and ``embed_late_chunks``.
    Held to the float64 sentence-transformers reference of the task."""
    model = load_fixture("tiny-jina-v3")
    ref = np.load(Path(model.path) / f"reference_{task}_normalized.npy")
    got = model.embed(golden_texts, prompt_name=task)
    print(f"embed(prompt_name={task!r}) vs reference: min cosine {cos(got, ref).min():.9f}")
    assert cos(got, ref).min() >= 0.99999 and np.abs(got - ref).max() <= 1e-5
    assert np.array_equal(got, model.embed(golden_texts, task=task))
    assert np.array_equal(got, model.embed(golden_texts, task=task, prompt_name=task))
    rows = model.embed_tokens(golden_texts[:3], prompt_name=task)
    for mine, theirs in zip(rows, _task_rows(model, golden_texts[:3], task)):
        assert np.array_equal(mine, theirs)
    chunks = ["Berlin ist die Hauptstadt.", "Café crème à Paris", "x"]
    assert np.array_equal(model.embed_late_chunks(chunks, prompt_name=task), model.embed_late_chunks(chunks, task=task))
    # The prompt as raw text is no task's name: no adapter (the base weights).
    raw = model.embed(golden_texts, prompt=model.prompts[task])
    assert cos(raw, ref).min() < 0.999


def test_a_prompt_name_of_another_task_than_task_is_refused():
    model = load_fixture("tiny-jina-v3")
    want = (
        "prompt_name 'retrieval.query' picks task 'retrieval.query' on this model, but task is 'separation': "
        "give one of them (or both the same)"
    )
    for call in (model.embed, model.embed_tokens, model.embed_late_chunks):
        with pytest.raises(InvalidInput) as err:
            call(["a text", "another"], task="separation", prompt_name="retrieval.query")
        assert str(err.value) == want, call.__name__


def _jina_cut_folder(tmp_path, truncate_dim):
    """tiny-jina-v3 as the remote code's encode() reads it (no
    sentence-transformers files), config.json's truncate_dim set."""
    import json
    import shutil

    from conftest import FIXTURES

    folder = tmp_path / f"cut{truncate_dim}"
    shutil.copytree(FIXTURES / "tiny-jina-v3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["truncate_dim"] = truncate_dim
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in ("modules.json", "config_sentence_transformers.json"):
        (folder / f).unlink()
    shutil.rmtree(folder / "1_Pooling")
    return folder


def test_a_model_s_truncate_dim_cuts_each_chunk_mean(tmp_path, cos):
    """A model whose vectors are its mean cut to truncate_dim (Matryoshka,
    jina-embeddings-v3's config.json) is served: each chunk's mean of its
    token rows (the full width), its first truncate_dim values, normalized,
    as the model cuts its pooled mean. Reference: the full-width model's
    per-token rows, spans from the ``tokenizers`` library's offsets, NumPy."""
    cut = mlx_embed.load(_jina_cut_folder(tmp_path, 32))
    whole = load_fixture("tiny-jina-v3")
    assert (cut.dim, whole.dim) == (32, 64)
    # Typed on the spec (the server's late chunking reads these, not details).
    assert (cut.spec().truncate_dim, whole.spec().truncate_dim) == (32, None)
    assert "truncate_dim" not in cut.spec().details
    chunks = ["Berlin ist die Hauptstadt.", "Café crème à Paris", "東京は日本の首都です。", "x"]
    for task in (None, "retrieval.passage"):
        prompt = whole.prompts[task] if task else ""
        joined = " ".join(chunks)
        tok = Tokenizer.from_file(str(Path(whole.path) / "tokenizer.json"))
        tok.no_truncation()
        tok.no_padding()
        enc = tok.encode(prompt + joined)
        rows = (_task_rows(whole, [joined], task) if task else whole.embed_tokens([joined]))[0]
        assert rows.shape == (len(enc.ids), 64)
        starts = len(prompt) + np.cumsum([0] + [len(c) + 1 for c in chunks[:-1]])
        owner = np.array(
            [
                _last_overlapped(chunks, starts, start, stop) if stop > start and not special else -1
                for special, (start, stop) in zip(enc.special_tokens_mask, enc.offsets)
            ]
        )
        means = np.stack([rows[owner == i].astype(np.float64).mean(axis=0) for i in range(len(chunks))])[:, :32]
        ref = means / np.linalg.norm(means, axis=1, keepdims=True)
        got = cut.embed_late_chunks(chunks, task=task)
        assert got.shape == (len(chunks), 32) and got.dtype == np.float32
        print(f"truncate_dim 32, task {task}: min cosine {cos(got, ref).min():.9f}, max |diff| {np.abs(got - ref).max():.2e}")
        assert cos(got, ref).min() >= 0.99999 and np.abs(got - ref).max() <= 1e-6
        raw = cut.embed_late_chunks(chunks, task=task, normalize=False)
        assert np.array_equal(raw, whole.embed_late_chunks(chunks, task=task, normalize=False)[:, :32])


def test_a_dense_projection_after_the_pooling_is_refused():
    """sentence-t5's layout (mean pooling, then a Dense): a chunk's mean
    never runs through the Dense, so its vector would not be in the model's
    space, even where the Dense keeps the width (64 -> 64 here)."""
    model = load_fixture("tiny-t5")
    spec = model.spec()
    assert (model.pooling, model.dim, spec.dense_layers, spec.truncate_dim) == ("mean", 64, 1, None)
    assert "dense_layers" not in spec.details
    with pytest.raises(InvalidInput) as err:
        model.embed_late_chunks(["a text", "another"])
    assert str(err.value) == (
        f"late chunking needs a model whose vector is the mean of its token states; {model.name} has a "
        "Dense projection after its pooling, which no chunk mean runs through"
    )
