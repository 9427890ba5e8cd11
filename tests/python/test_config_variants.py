"""config.json values real checkpoints may carry that the fixtures' defaults
do not: each is run as transformers runs it, or refused at load, never run
silently otherwise (a probe built tiny transformers models with them)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import FIXTURES

import mlx_embed
from mlx_embed.models import checked_decoder_params
from mlx_embed.models import nomic_bert

TEXTS = ["rivers flow to the sea", "a much longer text about mountains, rivers and the sea " * 4]


def _variant(tmp_path, fixture: str, **changes):
    folder = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes,says", [
    ({"hidden_act": "gelu"}, "qwen3: hidden_act='gelu' is not supported (only 'silu')"),
    ({"attention_bias": True}, "qwen3: attention_bias=true is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "qwen3: rope_scaling type 'longrope' is not supported"),
])
def test_qwen3_refuses_what_mlx_lm_would_run_otherwise(tmp_path, changes, says):
    with pytest.raises(ValueError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        mlx_embed.load(_variant(tmp_path, "tiny-qwen3", **changes))


def test_qwen2_refuses_another_activation(tmp_path):
    with pytest.raises(ValueError, match=r"^qwen2: hidden_act='gelu' is not supported"):
        mlx_embed.load(_variant(tmp_path, "tiny-qwen2", hidden_act="gelu"))


def test_yarn_without_its_original_length_takes_max_position_embeddings():
    params = {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    got = checked_decoder_params(params, "qwen3")
    assert got["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert "original_max_position_embeddings" not in params["rope_scaling"]
    stated = {**params, "rope_scaling": {**params["rope_scaling"], "original_max_position_embeddings": 4096}}
    assert checked_decoder_params(stated, "qwen3")["rope_scaling"]["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_a_scaled_rope_runs_on_the_worker_threads(tmp_path, scaling):
    """mlx-lm's scaled RoPEs keep their frequencies outside the parameters:
    left lazy, the first embed on a worker thread failed with "There is no
    Stream(cpu, 0) in current thread" (most runs). The loader evaluates them."""
    folder = _variant(tmp_path, "tiny-qwen3", rope_scaling=scaling)
    for _ in range(3):
        model = mlx_embed.load(folder, workers=2, batch_tokens=16)
        vecs = np.asarray(model.embed(TEXTS * 4))
        assert vecs.shape == (8, 64) and np.isfinite(vecs).all()
        freqs = [m["_freqs"] for m in model.model.modules() if "_freqs" in m]
        assert freqs, "the variant has a scaled RoPE"


def test_modernbert_null_local_theta_is_the_global_one(tmp_path):
    plain = mlx_embed.load(FIXTURES / "tiny-modernbert")
    theta = json.loads((FIXTURES / "tiny-modernbert" / "config.json").read_text())["global_rope_theta"]
    same = mlx_embed.load(_variant(tmp_path / "a", "tiny-modernbert", local_rope_theta=theta))
    null = mlx_embed.load(_variant(tmp_path / "b", "tiny-modernbert", local_rope_theta=None))
    assert np.array_equal(np.asarray(null.embed(TEXTS)), np.asarray(same.embed(TEXTS)))
    assert not np.array_equal(np.asarray(null.embed(TEXTS)), np.asarray(plain.embed(TEXTS)))


def test_nomic_defaults_are_nomics_config_class():
    """A key config.json leaves out takes NomicBertConfig's default: a
    fraction of 0 (no rotary) and gelu_new are refused; the rest run as set."""
    base = {"n_embd": 64, "n_head": 4, "n_layer": 2, "activation_function": "swiglu",
            "rotary_emb_fraction": 1.0}
    args = nomic_bert.ModelArgs.from_dict(base)
    assert (args.layer_norm_epsilon, args.rotary_emb_base) == (1e-5, 10000.0)
    assert args.qkv_proj_bias and args.mlp_fc1_bias and args.mlp_fc2_bias
    with pytest.raises(ValueError, match="rotary_emb_fraction"):
        nomic_bert.ModelArgs.from_dict({k: v for k, v in base.items() if k != "rotary_emb_fraction"})
    with pytest.raises(ValueError, match="activation_function"):
        nomic_bert.ModelArgs.from_dict({k: v for k, v in base.items() if k != "activation_function"})



@pytest.mark.parametrize("fixture,arch", [("tiny-gemma2", "gemma2"), ("tiny-bge-reranker-v2-gemma", "gemma")])
def test_gemma_decoders_run_plain_rope_only(tmp_path, fixture, arch):
    """mlx-lm's Gemma and Gemma 2 files run plain RoPE whatever the config
    says: a scaling is refused, and transformers 5's rope_parameters (no
    rope_theta beside them) give the theta."""
    for changes, says in (({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
                          ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "rope_type='yarn'")):
        with pytest.raises(ValueError, match=f"^{arch}: {says}.*only plain RoPE"):
            mlx_embed.load(_variant(tmp_path / says, fixture, **changes), kind="embedding")
    base = mlx_embed.load(FIXTURES / fixture, kind="embedding").embed(TEXTS)
    theta = json.loads((FIXTURES / fixture / "config.json").read_text()).get("rope_theta", 10000.0)

    def with_rope_parameters(name, rope_theta):
        folder = _variant(tmp_path / name, fixture, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
        config = json.loads((folder / "config.json").read_text())
        config.pop("rope_theta", None)
        (folder / "config.json").write_text(json.dumps(config))
        return mlx_embed.load(folder, kind="embedding").embed(TEXTS)

    np.testing.assert_allclose(with_rope_parameters("same", theta), base, rtol=0, atol=1e-6)
    assert np.abs(with_rope_parameters("other", theta * 7) - base).max() > 1e-3
