"""Sibling linears joined at load (``load(joined_linears=True)``,
``sibling_linears.py``): a decoder's q/k/v and gate/up projections run as one
matmul each, with the vectors and scores of the separate ones (the default),
and the fewer matmuls are in the graph."""

from __future__ import annotations

import io
import json
import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_embed
from conftest import FIXTURES
from mlx_embed import sibling_linears

DECODERS = ("tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama", "tiny-gemma3", "tiny-gemma2", "tiny-eurobert")


def _matmuls(model, ids: mx.array) -> int:
    """The matrix products in one forward pass's graph."""
    dot = io.StringIO()
    mx.export_to_dot(dot, model.model(ids, mx.ones(ids.shape, dtype=mx.int32)))
    return len(re.findall(r'label ="(Matmul|AddMM|QuantizedMatmul)"', dot.getvalue()))


@pytest.mark.parametrize("folder", DECODERS)
def test_joined_projections_embed_as_the_separate_ones(folder, golden_texts):
    layers = json.loads((FIXTURES / folder / "config.json").read_text())["num_hidden_layers"]
    joined = mlx_embed.load(FIXTURES / folder, joined_linears=True)
    separate = mlx_embed.load(FIXTURES / folder)
    assert (joined.joined_groups, separate.joined_groups) == (2 * layers, 0)
    assert (joined.info()["joined_linears"], separate.info()["joined_linears"]) == (2 * layers, 0)
    # What the server's /info shows under the model's details.
    assert joined.spec().details["joined_linears"] == str(2 * layers)
    assert "joined_linears" not in separate.spec().details
    # On the CPU's default path the separate gate takes the native SiLU
    # (ops.native_swiglu), the joined one's slice MLX's: float32 rounding.
    assert np.abs(joined.embed(golden_texts) - separate.embed(golden_texts)).max() <= 1e-6
    # MLX's own ops (as on a GPU): each output column is the same dot
    # product, but a BLAS may block a wider matrix otherwise (bit for bit on
    # the machine earlier sessions ran on, ~1e-7 apart on an AMD AVX2 one).
    exact = [mlx_embed.load(FIXTURES / folder, fast_ops="exact", joined_linears=j) for j in (True, False)]
    assert np.abs(exact[0].embed(golden_texts) - exact[1].embed(golden_texts)).max() <= 1e-6
    # Seven projections a layer become four (q/k/v, o, gate/up, down).
    # (Counted on MLX's own path: the CPU's native one runs every float32
    # linear in the native kernel, outside MLX's graph.)
    ids = mx.array([[5, 6, 7, 8]])
    assert _matmuls(exact[1], ids) - _matmuls(exact[0], ids) == 3 * layers
    linears = {n.rsplit(".", 1)[-1] for n, m in exact[0].model.named_modules() if type(m) is nn.Linear}
    assert {"qkv_proj", "gate_up_proj"} <= linears
    assert not linears & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}


def test_the_qwen3_reranker_scores_as_with_separate_projections(golden_texts):
    pairs = [(golden_texts[0], t) for t in golden_texts[1:9]]
    joined = mlx_embed.load(FIXTURES / "tiny-qwen3-reranker", joined_linears=True)
    separate = mlx_embed.load(FIXTURES / "tiny-qwen3-reranker")
    assert (joined.joined_groups, separate.joined_groups) == (4, 0)
    assert np.abs(np.array(joined.score(pairs)) - np.array(separate.score(pairs))).max() <= 1e-6


def test_quantized_siblings_join_only_where_their_settings_agree(tmp_path, golden_texts):
    """An mlx-lm mixed-precision folder (per-layer overrides in config
    "quantization") keeps q/k/v apart where v is quantized in other groups
    (the same packed width, scales of another); the rest join. Either way
    the vectors are those of the same folder loaded unjoined (MLX's ops, so
    the SiLU is the same in both)."""
    from mlx.utils import tree_flatten

    src = mlx_embed.load(FIXTURES / "tiny-qwen3")
    other = {"group_size": 64, "bits": 4}

    def settings(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        return other if path.endswith("layers.0.self_attn.v_proj") else True

    nn.quantize(src.model, 32, 4, class_predicate=settings)
    folder = tmp_path / "mixed"
    shutil.copytree(FIXTURES / "tiny-qwen3", folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(src.model.parameters())))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 4, "model.layers.0.self_attn.v_proj": other}
    (folder / "config.json").write_text(json.dumps(cfg))

    joined = mlx_embed.load(folder, dequantize=False, fast_ops="exact", joined_linears=True)
    separate = mlx_embed.load(folder, dequantize=False, fast_ops="exact")
    assert joined.quantization == 4
    # Layer 0's q/k/v stay three; its gate/up and all of layer 1 join.
    assert joined.joined_groups == 3
    attn0 = joined.model.model.layers[0].self_attn
    assert isinstance(attn0["v_proj"], nn.QuantizedLinear) and attn0["v_proj"].group_size == 64
    assert "qkv_proj" not in attn0 and "qkv_proj" in joined.model.model.layers[1].self_attn
    assert np.array_equal(joined.embed(golden_texts), separate.embed(golden_texts))
    # Dequantized at load (the CPU's default), every group joins as floats.
    assert mlx_embed.load(folder, joined_linears=True).joined_groups == 4


class _Siblings(nn.Module):
    def __init__(self, biased: bool):
        super().__init__()
        self.a = nn.Linear(6, 4, bias=biased)
        self.b = nn.Linear(6, 2, bias=biased)
        self.c = nn.Linear(6, 3, bias=biased)


@pytest.mark.parametrize("biased", [True, False])
def test_each_part_gets_its_own_columns_of_its_own_input(biased):
    """Whatever the order of the calls, and with inputs that change between
    the parts of one group (threads building two graphs at once), each part
    returns its own linear of its own input."""
    mx.random.seed(3)
    m = _Siblings(biased)
    want = {n: (m[n].weight, m[n].get("bias")) for n in "abc"}

    def expect(name, x):
        w, b = want[name]
        return x @ w.T + (b if b is not None else 0)

    assert sibling_linears.join(m, [(("a", "b", "c"), "abc")]) == 1
    assert m["abc"].weight.shape == (9, 6) and not any(n in m for n in "abc")
    x, y = mx.random.normal((2, 6)), mx.random.normal((2, 6))
    calls = [("c", x), ("a", x), ("a", y), ("b", x), ("b", y), ("c", y), ("a", x), ("a", x)]
    for name, inp in calls:
        assert mx.allclose(getattr(m, name)(inp), expect(name, inp), atol=1e-6).item(), (name, calls)
    # Nothing is held once every part of the last input has been taken.
    for name in "abc":
        getattr(m, name)(y)
    assert getattr(m, "a")._group._pending is None


def test_siblings_that_differ_stay_apart():
    m = _Siblings(True)
    m.b = nn.Linear(6, 2, bias=False)
    m.c = nn.Linear(5, 3)
    assert sibling_linears.join(m, [(("a", "b"), "ab"), (("a", "c"), "ac")]) == 0
    assert all(type(m[n]) is nn.Linear for n in "abc")


class _Stack(nn.Module):
    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = [_Siblings(False) for _ in range(layers)]
        for layer in self.layers:
            for n in "abc":
                layer[n] = nn.Linear(width, 2 * width, bias=False)


def test_joining_frees_each_group_as_it_goes_and_the_model_without_the_collector():
    """Loading a big decoder joined must not hold its separate and joined
    weights at once, and a dropped joined model frees its weights as soon as
    it is dropped (no reference cycle waiting for the cyclic collector)."""
    import gc

    group_bytes = 3 * 256 * 512 * 4
    model = _Stack(16, 256)
    mx.eval(model.parameters())
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    assert sibling_linears.join(model, [(("a", "b", "c"), "abc")]) == 16
    # All at once would peak 16 groups higher; one at a time, about one.
    assert mx.get_peak_memory() - before < 3 * group_bytes
    assert model.layers[0].a(mx.ones((1, 256))).shape == (1, 512)
    gc.disable()
    try:
        del model
        assert mx.get_active_memory() < before - 15 * group_bytes
    finally:
        gc.enable()
