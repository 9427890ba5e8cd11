"""sentence-transformers folder layouts beyond the one it writes today."""

import json
import shutil

import mlx_embed
import numpy as np
from conftest import FIXTURES

# What sentence-transformers before 2.0 kept in the Transformer module's own
# subfolder; the pipeline's files stay at the root.
TRANSFORMER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "sentence_bert_config.json")


def test_a_transformer_in_its_own_subfolder_loads_as_at_the_root(tmp_path, golden_texts):
    """modules.json naming "0_Transformer" (sentence-transformers < 2.0) was
    refused with "has no config.json", though every file was one level down.
    Its sentence_bert_config.json is the one read: its max_seq_length of 24
    (the root folder's is 128) cuts the long texts."""
    old = tmp_path / "old-layout"
    shutil.copytree(FIXTURES / "tiny-mpnet", old)
    sub = old / "0_Transformer"
    sub.mkdir()
    for name in TRANSFORMER_FILES:
        (old / name).rename(sub / name)
    cfg = json.loads((sub / "sentence_bert_config.json").read_text())
    (sub / "sentence_bert_config.json").write_text(json.dumps({**cfg, "max_seq_length": 24}))
    modules = json.loads((old / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (old / "modules.json").write_text(json.dumps(modules))

    model = mlx_embed.load(old)
    flat = mlx_embed.load(FIXTURES / "tiny-mpnet", max_length=24)
    assert model.max_length == 24
    assert model.name == "old-layout"
    got = model.embed(golden_texts)
    assert np.array_equal(got, flat.embed(golden_texts))
    # Normalized, as its 2_Normalize at the root says.
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
