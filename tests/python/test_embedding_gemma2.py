"""EmbeddingGemma 2 (models/embedding_gemma2.py) against transformers'
EmbeddingGemma2Model: tests/fixtures/tiny-embedding-gemma2/README.md says how
the fixture and its references were made. The plain and prompted references
are in test_models.py with the other architectures; here, what is its own:
the multimodal checkpoint's layout, the text model's own layout, the
engine's paths (native softmax with the radius, MLX's, joined projections,
packed rows), half precision, and what is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlx_embed
from conftest import FIXTURES, assert_parity, load_fixture

FOLDER = FIXTURES / "tiny-embedding-gemma2"
REF = np.load(FOLDER / "reference_normalized.npy")


def _edited(tmp_path, **text_edit):
    """The fixture with text_config keys set (None: removed)."""
    d = tmp_path / "m"
    shutil.copytree(FOLDER, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in text_edit.items():
        if v is None:
            cfg["text_config"].pop(k, None)
        else:
            cfg["text_config"][k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_the_multimodal_checkpoint_serves_its_text_path(golden_texts):
    weights = load_file(str(FOLDER / "model.safetensors"))
    towers = {k.split(".", 1)[0] for k in weights if not k.startswith("language_model.")}
    assert towers == {"vision_tower", "audio_tower", "embed_vision", "embed_audio"}
    model = load_fixture("tiny-embedding-gemma2")
    assert (model.model_type, model.dim, model.pooling, model.max_length) == ("embedding_gemma2", 48, "mean", 128)
    assert model.default_prompt_name is None
    assert model.prompts["query"] == "task: search result | query: "
    assert model.prompts["document"] == "title: none | text: "
    assert_parity(model.embed(golden_texts), REF)


def test_the_text_models_own_save_loads_the_same(golden_texts, tmp_path):
    """EmbeddingGemma2TextModel.save_pretrained's folder: model_type
    embedding_gemma2_text, per_layer_config flat, weights without the
    language_model. prefix (text_model_config.json is the one transformers
    wrote)."""
    d = tmp_path / "text"
    shutil.copytree(FOLDER, d)
    shutil.copy(FOLDER / "text_model_config.json", d / "config.json")
    weights = load_file(str(FOLDER / "model.safetensors"))
    save_file(
        {k.removeprefix("language_model."): v for k, v in weights.items() if k.startswith("language_model.")},
        str(d / "model.safetensors"),
    )
    model = mlx_embed.load(d)
    assert model.model_type == "embedding_gemma2_text" and model.dim == 48
    assert_parity(model.embed(golden_texts), REF)


def test_batches_equal_one_text_per_call(golden_texts):
    """Padded passes of mixed lengths: padding queries far from every real
    token see no key in a sliding layer (transformers gives NaN there, see the
    README); here each row equals the same text alone."""
    model = load_fixture("tiny-embedding-gemma2")
    got = model.embed(golden_texts)
    single = np.concatenate([model.embed([t]) for t in golden_texts])
    assert np.isfinite(got).all()
    assert np.abs(got - single).max() <= 1e-6


@pytest.mark.parametrize("fast_ops", ["native", "exact", "mlx"])
def test_every_ops_path_matches_the_reference(fast_ops, golden_texts):
    assert_parity(mlx_embed.load(FOLDER, fast_ops=fast_ops).embed(golden_texts), REF)


def test_native_kernel_takes_the_radius(golden_texts, monkeypatch):
    """The native attention kernel runs the full layers over the real keys
    and the sliding layers with the config's window as the radius
    (window=sliding_window, not v1's halving), never causal."""
    from mlx_embed import _native

    calls = []
    real = _native.decoder_attention_

    def spy(*args, **kw):
        assert kw["causal"] is False and kw["softcap"] is None
        calls.append(kw["window"])
        real(*args, **kw)

    monkeypatch.setattr(_native, "decoder_attention_", spy)
    model = mlx_embed.load(FOLDER, fast_ops="native")
    assert_parity(model.embed(golden_texts), REF)
    passes = calls.count(None)
    assert passes > 0 and set(calls) == {None, 4} and calls.count(4) == 2 * passes


def test_joined_projections_and_packed_rows(golden_texts):
    joined = mlx_embed.load(FOLDER, joined_linears=True)
    assert joined.joined_groups == 2 * 3
    assert_parity(joined.embed(golden_texts), REF)
    packed = mlx_embed.load(FOLDER, packed_rows=True)
    assert_parity(packed.embed(golden_texts), REF)


@pytest.mark.parametrize("dtype, floor", [("float16", 0.999), ("bfloat16", 0.99)])
def test_half_precision_stays_near(dtype, floor, golden_texts):
    got = mlx_embed.load(FOLDER, dtype=dtype).embed(golden_texts)
    assert np.isfinite(got).all()
    assert float((got * REF).sum(axis=1).min()) >= floor


def test_placeholder_ids_read_as_padding():
    """EmbeddingGemma2Model swaps the image/video/audio placeholder ids for
    the pad id before the lookup; a text-only request carrying one gets the
    same."""
    model = load_fixture("tiny-embedding-gemma2").scheduler.model
    assert sorted(model.args.placeholder_ids) == [258_880, 258_881, 258_884]
    swapped = type(model)(dataclasses.replace(model.args, placeholder_ids=[7]))
    swapped.update(model.parameters())
    ids = mx.array([[2, 40, 7, 41, 1]])
    mask = mx.ones(ids.shape, dtype=mx.int32)
    padded = mx.array([[2, 40, 0, 41, 1]])
    assert np.abs(np.array(swapped(ids, mask)) - np.array(swapped(padded, mask))).max() == 0
    assert np.abs(np.array(model(ids, mask)) - np.array(model(padded, mask))).max() > 1e-3


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"attention_bias": True}, "attention_bias"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "rope_type='linear'",
        ),
        (
            {"per_layer_config": {"2": {"head_dim": 32, "num_key_value_heads": 1, "skip": ["mlp"]}}},
            r"per_layer_config\[2\] sets skip",
        ),
        ({"hidden_size_per_layer_input": 0}, "hidden_size_per_layer_input"),
        ({"per_layer_config": {"2": {"head_dim": 32, "num_key_value_heads": 3}}}, "layer 2's num_key_value_heads"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must be 3"),
    ],
)
def test_unsupported_variants_are_named(edit, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        mlx_embed.load(_edited(tmp_path, **edit))


def test_config_without_per_layer_config_takes_transformers_defaults(golden_texts, tmp_path):
    """Where config.json has no per_layer_config, transformers gives full
    layers global_head_dim (512) and num_global_key_value_heads (1): the
    fixture's 32-wide full layer then no longer fits, and says so."""
    d = _edited(tmp_path, per_layer_config=None)
    with pytest.raises(ValueError, match="layers.2.self_attn"):
        mlx_embed.load(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
    (d / "config.json").write_text(json.dumps(cfg))
    assert_parity(mlx_embed.load(d).embed(golden_texts), REF)


def test_per_layer_config_keys_are_read_as_transformers_writes_them(golden_texts, tmp_path):
    """transformers writes per_layer_config's keys zero-padded to the widest
    layer index: google/embeddinggemma-2's 24 layers give "05", "11", "17",
    "23", and it reads them back with int(). The fixture's 3 layers write
    "2"; as "02" it is the same model (transformers 5.24 builds layer 2 with
    head_dim 32 and one key/value head from either). Before this was read
    with int(), "02" was no layer's key: layer 2 was built 16 wide and the
    weights did not fit, and the published checkpoint was refused."""
    assert_parity(mlx_embed.load(_edited(tmp_path / "a", per_layer_config={"02": _FULL})).embed(golden_texts), REF)
    with pytest.raises(ValueError, match=r"per_layer_config key '3' is not a layer index in \[0, 3\)"):
        mlx_embed.load(_edited(tmp_path / "b", per_layer_config={"2": _FULL, "3": _FULL}))
    with pytest.raises(ValueError, match="per_layer_config key 'full_attention' is not a layer index"):
        mlx_embed.load(_edited(tmp_path / "c", per_layer_config={"full_attention": _FULL}))


_FULL = {"head_dim": 32, "num_key_value_heads": 1}


def test_the_published_24_layer_config_builds_its_wide_full_layers():
    """EmbeddingGemma2TextConfig()'s defaults (the published shape) as
    transformers 5.24 writes them to config.json: per_layer_config keys
    "05", "11", "17", "23". transformers builds layers 5, 11, 17 and 23 with
    head_dim 512 and one key/value head, the others 256 and 2 (read from
    its per_layer_config[i] for this config); so does this."""
    from mlx_embed.models import embedding_gemma2

    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(24)]
    wide = {"head_dim": 512, "num_key_value_heads": 1}
    args = embedding_gemma2.ModelArgs.from_dict(
        {
            "model_type": "embedding_gemma2_text",
            "layer_types": kinds,
            "per_layer_config": {"05": wide, "11": wide, "17": wide, "23": wide},
        }
    )
    full = [i for i, k in enumerate(kinds) if k == "full_attention"]
    assert full == [5, 11, 17, 23]
    assert [(lc["head_dim"], lc["num_key_value_heads"]) for lc in args.layers] == [
        (512, 1) if i in full else (256, 2) for i in range(24)
    ]


@pytest.mark.parametrize("fast_ops", ["native", "exact"])
def test_long_inputs_match_the_reference(fast_ops, golden_texts):
    """Past the folder's 128 tokens (load(max_length=1024)): RoPE and the
    band at long positions, and on the native path the attention's native
    softmax, which takes passes of 256 keys or more."""
    texts = [" ".join(golden_texts[5:15]), " ".join(golden_texts[5:25]), " ".join(golden_texts) * 3]
    model = mlx_embed.load(FOLDER, max_length=1024, fast_ops=fast_ops)
    counts = model.count_tokens(texts, prompt="")
    assert counts == [192, 595, 1024]
    assert_parity(model.embed(texts), np.load(FOLDER / "reference_long_normalized.npy"))
