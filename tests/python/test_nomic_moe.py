"""NomicBERT v2-moe (nomic-embed-text-v2-moe) against the float64 reference
of tests/fixtures/tiny-nomic-moe (its README: how it was made, the
cross-checks, and what each wrong implementation scores)."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_embed
from conftest import FIXTURES, assert_parity, copy_fixture, load_fixture
from mlx_embed.models import nomic_bert

FOLDER = "tiny-nomic-moe"
MAX_LEN = 128


def _ref(name: str) -> np.ndarray:
    return np.load(FIXTURES / FOLDER / f"reference_{name}_normalized.npy")


def test_loads_as_the_published_folder_says():
    model = load_fixture(FOLDER)
    assert (model.model_type, model.pooling, model.dim, model.max_length) == ("nomic_bert", "mean", 64, MAX_LEN)
    assert (model.prompts["query"], model.prompts["passage"]) == ("search_query: ", "search_document: ")
    assert len(model.prompts) == 9 and model.default_prompt_name is None
    config = json.loads((FIXTURES / FOLDER / "config.json").read_text())
    net = nomic_bert.Model(nomic_bert.ModelArgs.from_dict(config))
    # The remote code's rule, i % moe_every_n_layers == 1: layer 0 is dense.
    assert [type(layer.mlp).__name__ for layer in net.layers] == [
        "GeluMLP", "MixtureOfExperts", "GeluMLP", "MixtureOfExperts"]


@pytest.mark.parametrize("prompt_name, ref", [("query", "query"), ("passage", "passage"), (None, "noprompt")])
def test_matches_reference(prompt_name, ref, golden_texts):
    model = load_fixture(FOLDER)
    assert_parity(model.embed(golden_texts, prompt_name=prompt_name), _ref(ref))


def test_prompt_written_by_the_client_equals_prompt_name(golden_texts):
    model = load_fixture(FOLDER)
    texts = golden_texts[:34]  # shorter than max length with the prompt too
    assert_parity(model.embed(["search_query: " + t for t in texts]), _ref("query")[:34])


def test_batch_equals_single_with_padding(golden_texts):
    """One padded pass of mixed lengths (specials only to cut at max length)
    gives each text's vector alone: routing is per token, and the padding's
    tokens, routed too, never reach a real one."""
    model = load_fixture(FOLDER)
    counts = model.count_tokens(golden_texts, prompt="")
    assert min(counts) <= 3 and counts.count(MAX_LEN) >= 4 and max(counts) == MAX_LEN
    got = model.embed(golden_texts, prompt_name="passage")
    single = np.concatenate([model.embed([t], prompt_name="passage") for t in golden_texts])
    assert np.abs(got - single).max() <= 1e-6
    # Reversed order: other batch-mates, other padding.
    back = model.embed(golden_texts[::-1], prompt_name="passage")[::-1]
    assert_parity(back, _ref("passage"))


def test_packed_rows_match_reference(golden_texts):
    model = mlx_embed.load(FIXTURES / FOLDER, packed_rows=True)
    assert_parity(model.embed(golden_texts, prompt_name="passage"), _ref("passage"))


def _moe_args(**kw) -> nomic_bert.ModelArgs:
    base = {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 24, "activation_function": "gelu",
            "rotary_emb_fraction": 1.0, "moe_every_n_layers": 2, "num_experts": 6, "moe_top_k": 2}
    return nomic_bert.ModelArgs.from_dict({**base, **kw})


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_experts_equal_a_per_token_loop(top_k):
    """The gather_mm mixture against the definition written as a loop over
    tokens and their chosen experts, in float64 NumPy, on [B, L, D] and on
    packed [rows, D] input."""
    args = _moe_args(moe_top_k=top_k)
    moe = nomic_bert.MixtureOfExperts(args)
    rng = np.random.default_rng(0)
    E, F, D = args.num_experts, args.n_inner, args.n_embd
    router = rng.normal(size=(E, D)) * 2 / math.sqrt(D)
    w1, w2 = rng.normal(size=(E, F, D)) / math.sqrt(D), rng.normal(size=(E, F, D)) / math.sqrt(F)
    bias = rng.normal(size=D) * 0.1
    moe.router.weight, moe.w1, moe.w2, moe.bias = (mx.array(a.astype(np.float32)) for a in (router, w1, w2, bias))
    x = rng.normal(size=(3, 7, D)).astype(np.float32)
    erf = np.vectorize(math.erf)
    want = np.empty((21, D))
    chosen = set()
    for t, row in enumerate(x.reshape(-1, D).astype(np.float64)):
        p = np.exp(router @ row - (router @ row).max())
        p /= p.sum()
        want[t] = bias
        for e in np.argsort(-p)[:top_k]:
            h = w1[e] @ row
            want[t] += p[e] * ((0.5 * h * (1 + erf(h / math.sqrt(2)))) @ w2[e])
            chosen.add(int(e))
    assert len(chosen) == E  # every expert ran for some token
    for shape in ((3, 7, D), (21, D)):
        got = np.array(moe(mx.array(x.reshape(shape)))).reshape(21, D)
        assert np.abs(got - want).max() <= 1e-5


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"moe_normalize_expert_weights": 1.0}, "moe_normalize_expert_weights"),
        ({"num_shared_experts": 1}, "num_shared_experts"),
        ({"expert_choice_router": True}, "expert_choice_router"),
        ({"moe_every_n_layers": 1}, "moe_every_n_layers"),
        ({"moe_top_k": 9}, "moe_top_k"),
        ({"activation_function": "swiglu"}, "activation_function"),
        ({"activation_function": "gelu_new"}, "activation_function"),
        ({"prenorm": True}, "prenorm"),
    ],
)
def test_unsupported_variants_are_named(edit, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        mlx_embed.load(copy_fixture(FOLDER, tmp_path / "m", **edit))


def test_experts_where_the_weights_are_not_do_not_load(tmp_path):
    """A rule that puts the experts elsewhere than the checkpoint (every 3rd
    layer: experts in layer 1 only, so layer 3's expert weights have no
    place and its fc1/fc2 are missing) fails at load instead of running."""
    with pytest.raises(ValueError, match=r"layers\.3\.mlp"):
        mlx_embed.load(copy_fixture(FOLDER, tmp_path / "m", moe_every_n_layers=3))


@pytest.mark.parametrize("kw, floor", [({"dtype": "float16"}, 0.9999), ({"dtype": "bfloat16"}, 0.999),
                                       ({"quantize": 8, "group_size": 32}, 0.999)])
def test_half_precision_and_quantized(kw, floor, golden_texts):
    """MLX's CPU gather_mm takes float32 only: in float16/bfloat16 the chosen
    experts run in float32 there. Quantized, the routers stay float (a few
    rows that decide discretely) while attention and dense layers quantize.
    Measured min cosine: float16 0.99998, bfloat16 0.9996, 8-bit 0.9995."""
    model = mlx_embed.load(FIXTURES / FOLDER, **kw)
    got = model.embed(golden_texts, prompt_name="passage")
    assert float((got * _ref("passage")).sum(axis=1).min()) >= floor
    if "quantize" in kw:
        layers = model.model.layers
        # (On the CPU's native path a float linear is ops.EngineLinear.)
        assert isinstance(layers[1].mlp.router, nn.Linear) and not isinstance(layers[1].mlp.router, nn.QuantizedLinear)
        assert isinstance(layers[0].mlp.fc1, nn.QuantizedLinear)
