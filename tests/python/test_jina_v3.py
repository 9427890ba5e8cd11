"""jina-embeddings-v3 (Jina XLM-RoBERTa: rotary positions, task LoRA) in both
layouts: tiny-jina-v3 (the remote-code folder people download, adapters as
torch parametrizations for all 5 tasks) and tiny-jina-v3-hf (transformers'
native ``jina_embeddings_v3``, its adapters PEFT LoRA subfolders as
transformers' model doc loads them). References: float64 transformers +
sentence-transformers with each task's LoRA merged, cross-checked against a
hand-written float64 version of the remote code's per-row adapter math
(tests/fixtures/tiny-jina-v3/README.md, scripts/fixtures/make_jina_v3.py);
for -hf, float64 transformers + PEFT (tests/fixtures/tiny-jina-v3-hf/README.md,
scripts/fixtures/make_jina_v3_hf_adapters.py)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import FIXTURES, assert_parity, copy_fixture, load_fixture
from mlx_embed.errors import InvalidInput
from mlx_embed.models import jina_xlm_roberta

REMOTE = "tiny-jina-v3"
NATIVE = "tiny-jina-v3-hf"
TASKS = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")


def _ref(task, folder: str = REMOTE) -> np.ndarray:
    return np.load(FIXTURES / folder / f"reference_{task or 'none'}_normalized.npy")


def test_loads_both_layouts_as_one_network():
    remote, native = load_fixture(REMOTE), load_fixture(NATIVE)
    for model, model_type in ((remote, "xlm-roberta"), (native, "jina_embeddings_v3")):
        assert isinstance(model.model, jina_xlm_roberta.Model)
        assert (model.model_type, model.pooling, model.dim, model.max_length) == (model_type, "mean", 64, 128)
    assert remote.tasks == TASKS and native.tasks == TASKS
    # The adapters stay low rank: [tasks*rank, in] and [tasks*rank, out]
    # beside the one base weight, not five merged copies.
    qkv = remote.model.layers[0].mixer.Wqkv
    assert qkv.base.weight.shape == (192, 64) and qkv.lora_a.shape == (20, 64) and qkv.lora_b.shape == (20, 192)
    word = remote.model.embeddings.word_embeddings
    assert word.lora_a.shape == (word.base.weight.shape[0], 20) and word.lora_b.shape == (20, 64)
    # PEFT's adapters: each task's slot as wide as its widest fused
    # module (q, k and v of rank 4 side by side: 12), scaling in B.
    qkv = native.model.layers[0].mixer.Wqkv
    assert qkv.lora_a.shape == (60, 64) and qkv.lora_b.shape == (60, 192)
    assert native.model.args.lora_scaling == 1.0


def _without_adapters(tmp_path):
    """tiny-jina-v3-hf without its adapter subfolders."""
    dst = tmp_path / "hf-base"
    shutil.copytree(
        FIXTURES / NATIVE, dst, ignore=lambda d, names: [n for n in names if n in jina_xlm_roberta.PEFT_SUBFOLDERS]
    )
    return dst


@pytest.mark.parametrize("folder", [REMOTE, NATIVE])
def test_no_task_runs_the_base_weights(folder, golden_texts):
    assert_parity(load_fixture(folder).embed(golden_texts), _ref(None, folder))


@pytest.mark.parametrize("task", TASKS)
def test_each_task_matches_reference(task, golden_texts):
    model = load_fixture(REMOTE)
    ref = _ref(task)
    assert_parity(model.embed(golden_texts, task=task), ref)
    # One text per call (no padding) is the same.
    assert_parity(np.concatenate([model.embed([t], task=task) for t in golden_texts]), ref)


@pytest.mark.parametrize("task", TASKS)
def test_native_layout_tasks_match_reference(task, golden_texts):
    """-hf: each task's PEFT adapter (its subfolder) against float64
    transformers + PEFT with that adapter set; no prompt (the folder names
    none)."""
    model = load_fixture(NATIVE)
    ref = _ref(task, NATIVE)
    assert_parity(model.embed(golden_texts, task=task), ref)
    assert_parity(np.concatenate([model.embed([t], task=task) for t in golden_texts[:8]]), ref[:8])


def test_native_layout_rows_of_different_tasks_share_a_pass(golden_texts):
    model = load_fixture(NATIVE)
    cycle = [-1 if i % 6 == 5 else i % 6 for i in range(len(golden_texts))]
    ids = [model.encode([t])[0][0] for t in golden_texts]
    res = model.embed_ids(ids, adapter=cycle)
    got = np.frombuffer(res.vectors, dtype="<f4").reshape(len(ids), -1)
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    expect = np.stack([_ref(None if a < 0 else TASKS[a], NATIVE)[i] for i, a in enumerate(cycle)])
    assert_parity(got, expect)


def test_native_layout_without_adapter_folders(tmp_path, golden_texts):
    model = load_fixture(_without_adapters(tmp_path))
    assert model.tasks == () and "lora_a" not in model.model.layers[0].mixer.Wqkv
    assert_parity(model.embed(golden_texts), _ref(None, NATIVE))
    with pytest.raises(InvalidInput, match="has no task adapters"):
        model.embed(["x"], task="retrieval.query")


def _edit_adapter(folder, sub, **edit):
    path = folder / sub / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(edit)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"use_dora": True}, "use_dora=True is not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"modules_to_save": ["pooler"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type='IA3'"),
        ({"r": 8}, r"not of rank r=8"),
    ],
)
def test_native_layout_refuses_adapters_it_cannot_run(tmp_path, edit, message):
    dst = copy_fixture(NATIVE, tmp_path / "m")
    _edit_adapter(dst, "separation", **edit)
    with pytest.raises(ValueError, match=message):
        load_fixture(dst)


def test_native_layout_reads_the_scaling_settings(tmp_path, golden_texts):
    """rsLoRA (classification) and alpha_pattern (text_matching) are read:
    dropping them gives other vectors."""
    dst = copy_fixture(NATIVE, tmp_path / "m")
    _edit_adapter(dst, "classification", use_rslora=False)
    _edit_adapter(dst, "text_matching", alpha_pattern={})
    model = load_fixture(dst)
    for task in ("classification", "text-matching"):
        assert np.abs(model.embed(golden_texts, task=task) - _ref(task, NATIVE)).max() > 1e-2
    assert_parity(model.embed(golden_texts, task="separation"), _ref("separation", NATIVE))


def test_native_layout_other_adapter_names(tmp_path, golden_texts):
    """A subfolder of another name is served under its own name, after
    the documented five."""
    dst = copy_fixture(NATIVE, tmp_path / "m")
    (dst / "separation").rename(dst / "legal")
    model = load_fixture(dst)
    assert model.tasks == ("retrieval.query", "retrieval.passage", "classification", "text-matching", "legal")
    assert_parity(model.embed(golden_texts, task="legal"), _ref("separation", NATIVE))


@pytest.mark.parametrize("fast_ops", ["mlx", "exact"])
def test_other_op_paths_match_reference(fast_ops, golden_texts):
    model = load_fixture(REMOTE, fast_ops=fast_ops)
    for task in ("retrieval.query", "text-matching"):
        assert_parity(model.embed(golden_texts, task=task), _ref(task))


def test_task_selects_its_prompt(golden_texts):
    """A task runs the folder's prompt of the same name (retrieval.query's
    "Represent the query ..."); an explicit prompt wins over it. A
    prompt_name that names the task runs its adapter too (the server's rule);
    the prompt's text alone runs the base weights."""
    model = load_fixture(REMOTE)
    assert model.prompts["retrieval.query"] == "Represent the query for retrieving evidence documents: "
    ref = _ref("retrieval.query")
    assert_parity(model.embed(golden_texts, task="retrieval.query", prompt_name="retrieval.query"), ref)
    raw = model.embed(golden_texts, task="retrieval.query", prompt=model.prompts["retrieval.query"])
    assert_parity(raw, ref)
    assert_parity(model.embed(golden_texts, prompt_name="retrieval.query"), ref)
    # The prompt's text alone (base weights) is not the task.
    alone = model.embed(golden_texts, prompt=model.prompts["retrieval.query"])
    assert float((alone * ref).sum(1).min()) < 0.99


def test_task_prompts_from_config_without_st_files(tmp_path, golden_texts):
    """The remote code's encode(task=) puts config.json's task_instructions
    before the texts: a folder without config_sentence_transformers.json
    (a save_pretrained copy) still runs each task with its prompt."""
    folder = copy_fixture(REMOTE, tmp_path / "m")
    (folder / "config_sentence_transformers.json").unlink()
    model = load_fixture(folder)
    assert model.prompts["retrieval.query"] == "Represent the query for retrieving evidence documents: "
    for task in ("retrieval.query", "retrieval.passage", "text-matching"):
        assert_parity(model.embed(golden_texts, task=task), _ref(task))
    assert_parity(model.embed(golden_texts), _ref(None))


def _remote_code_folder(tmp_path, name, **edit):
    """tiny-jina-v3 without its sentence-transformers files (a
    save_pretrained copy, which the remote code's encode() runs), config.json
    keys set."""
    folder = copy_fixture(REMOTE, tmp_path / name, **edit)
    for f in ("modules.json", "config_sentence_transformers.json"):
        (folder / f).unlink()
    shutil.rmtree(folder / "1_Pooling")
    return folder


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_config_truncate_dim_is_the_default_cut(tmp_path, golden_texts):
    """The remote code's encode() cuts every vector to config.json's
    truncate_dim (one of matryoshka_dimensions) before normalizing: the
    float64 references' first 32 values renormalized, for no task and a
    task; null (the published config) is the whole vector."""
    model = load_fixture(_remote_code_folder(tmp_path, "cut", truncate_dim=32))
    assert model.dim == 32
    for task in (None, "retrieval.query"):
        assert_parity(model.embed(golden_texts, task=task), _unit(_ref(task)[:, :32]))
    whole = load_fixture(_remote_code_folder(tmp_path, "null"))
    assert whole.dim == 64
    assert_parity(whole.embed(golden_texts), _ref(None))
    # Not one of matryoshka_dimensions: refused by name, as encode() refuses it.
    with pytest.raises(ValueError, match=r"truncate_dim=24 is not one of matryoshka_dimensions \[16, 32, 64\]"):
        load_fixture(_remote_code_folder(tmp_path, "bad", truncate_dim=24))
    # No matryoshka_dimensions: encode() warns and leaves the vectors whole.
    uncut = load_fixture(_remote_code_folder(tmp_path, "nodims", truncate_dim=32, matryoshka_dimensions=None))
    assert uncut.dim == 64
    # A sentence-transformers folder's pipeline wins: its Pooling and its
    # own (absent) truncate_dim, which is what SentenceTransformer runs.
    st = load_fixture(copy_fixture(REMOTE, tmp_path / "st", truncate_dim=32, emb_pooler="cls"))
    assert (st.dim, st.pooling) == (64, "mean")
    assert_parity(st.embed(golden_texts), _ref(None))


def test_config_emb_pooler_cls(tmp_path, golden_texts):
    """emb_pooler "cls": the remote code's encode() takes the first token's
    hidden state (its cls_pooling) instead of the mean; "mean" (and any
    value but "cls") is the mean."""
    model = load_fixture(_remote_code_folder(tmp_path, "cls", emb_pooler="cls"))
    assert model.pooling == "cls"
    pooled = model.embed(golden_texts)
    ids, _ = model.encode(golden_texts)
    rows = model.embed_ids(ids, output="tokens")
    tokens = np.frombuffer(rows.vectors, "<f4").reshape(-1, 64)
    first = np.cumsum([0, *rows.rows[:-1]])
    assert_parity(pooled, _unit(tokens[first]))
    # Not the mean (the float64 references), with or without a task.
    assert float((pooled * _ref(None)).sum(1).min()) < 0.99
    tasked = model.embed(golden_texts, task="separation")
    assert float((tasked * _ref("separation")).sum(1).min()) < 0.99
    assert float((tasked * pooled).sum(1).min()) < 0.99
    mean = load_fixture(_remote_code_folder(tmp_path, "mean", emb_pooler="mean"))
    assert mean.pooling == "mean"
    assert_parity(mean.embed(golden_texts), _ref(None))


def test_rows_of_different_tasks_share_a_pass(golden_texts):
    """embed_ids with a per-input adapter index: one padded call whose rows
    cycle through the 5 tasks and no task (-1) gives each row its own
    task's vector (what the server's batches of mixed requests run)."""
    model = load_fixture(REMOTE)
    cycle = [-1 if i % 6 == 5 else i % 6 for i in range(len(golden_texts))]
    ids = [model.encode([t], prompt_name=None if a < 0 else TASKS[a])[0][0] for t, a in zip(golden_texts, cycle)]
    res = model.embed_ids(ids, adapter=cycle)
    got = np.frombuffer(res.vectors, dtype="<f4").reshape(len(ids), -1)
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    expect = np.stack([_ref(None if a < 0 else TASKS[a])[i] for i, a in enumerate(cycle)])
    assert_parity(got, expect)
    # All -1 is the base run.
    res = model.embed_ids(ids[:3], adapter=[-1, -1, -1])
    plain = model.embed_ids(ids[:3])
    assert res.vectors == plain.vectors


def test_refusals():
    remote, native = load_fixture(REMOTE), load_fixture(NATIVE)
    with pytest.raises(
        InvalidInput,
        match=r"unknown task 'retrieval'; valid tasks: retrieval\.query, "
        r"retrieval\.passage, separation, classification, text-matching",
    ):
        remote.embed(["x"], task="retrieval")
    with pytest.raises(InvalidInput, match="unknown task 'retrieval'"):
        native.embed(["x"], task="retrieval")
    with pytest.raises(InvalidInput, match="has no task adapters"):
        load_fixture("tiny-xlm-roberta").embed(["x"], task="retrieval.query")
    ids = remote.encode(["x"])[0]
    with pytest.raises(InvalidInput, match=r"adapter must be an int in \[-1, 5\)"):
        remote.embed_ids(ids, adapter=[5])
    with pytest.raises(InvalidInput, match="1 adapters for 2 inputs"):
        remote.embed_ids(ids * 2, adapter=[0])
    with pytest.raises(InvalidInput, match="has no task adapters"):
        load_fixture("tiny-xlm-roberta").embed_ids(ids, adapter=[0])
    # Per-token output runs the adapter (test_late_chunking.py checks its
    # rows against the references).
    tokens = remote.embed_ids(ids, adapter=[0], output="tokens")
    assert tokens.rows == [len(ids[0])] and tokens.vectors != remote.embed_ids(ids, output="tokens").vectors


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rotary_emb_interleaved": True}, "rotary_emb_interleaved=True"),
        ({"rotary_emb_scale_base": 512}, "rotary_emb_scale_base"),
        ({"hidden_act": "relu"}, "hidden_act='relu'"),
        ({"load_trained_adapters": False}, "load_trained_adapters=false"),
    ],
)
def test_unsupported_variants_are_refused(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_fixture(copy_fixture(REMOTE, tmp_path / "m", **edit))


def test_rotary_base_is_read(tmp_path, golden_texts):
    """rotary_emb_base (the remote config) and rope_parameters (the native
    one) set the base: another base gives other vectors."""
    for folder, edit in (
        (REMOTE, {"rotary_emb_base": 10000.0}),
        (NATIVE, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    ):
        got = load_fixture(copy_fixture(folder, tmp_path / folder, **edit)).embed(golden_texts)
        assert np.abs(got - _ref(None, folder)).max() > 1e-3


def test_remote_config_defaults(tmp_path, golden_texts):
    """A remote config that leaves a key out gets XLMRobertaFlashConfig's
    default, as the remote code runs it: rotary_emb_base 10000 (not the
    native model's 20000), and load_trained_adapters false (new, untrained
    adapters: refused, as an explicit false is)."""
    got = load_fixture(copy_fixture(REMOTE, tmp_path / "nobase", rotary_emb_base=None)).embed(golden_texts)
    stated = load_fixture(copy_fixture(REMOTE, tmp_path / "b10k", rotary_emb_base=10000.0)).embed(golden_texts)
    assert np.array_equal(got, stated)
    with pytest.raises(ValueError, match="load_trained_adapters=false"):
        load_fixture(copy_fixture(REMOTE, tmp_path / "noload", load_trained_adapters=None))


def test_config_says_what_the_fixture_is():
    cfg = json.loads((FIXTURES / REMOTE / "config.json").read_text())
    assert cfg["architectures"] == ["XLMRobertaLoRA"] and cfg["position_embedding_type"] == "rotary"
    assert tuple(cfg["lora_adaptations"]) == TASKS


def test_quantized_base_keeps_float_adapters(golden_texts):
    """quantize= turns the base linears and the word table into quantized
    ones; the adapters stay float and still apply per task."""
    model = load_fixture(REMOTE, quantize=8, group_size=32)
    qkv = model.model.layers[0].mixer.Wqkv
    assert isinstance(qkv.base, nn.QuantizedLinear) and qkv.lora_a.dtype == mx.float32
    for task in (None, "retrieval.query", "separation"):
        got, ref = model.embed(golden_texts, task=task), _ref(task)
        assert float((got * ref).sum(1).min()) > 0.999
