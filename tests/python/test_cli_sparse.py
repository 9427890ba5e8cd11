"""``mlx-embed embed --sparse``: each text's sparse weights as JSONL, from a
SPLADE model or a BGE-M3 folder's lexical weights, the same the library's
``embed_sparse`` gives."""

from __future__ import annotations

import json

import mlx_embed
import numpy as np
import pytest
from conftest import FIXTURES
from mlx_embed import cli

TEXTS = ["the cat sat on the mat", "hybrid search with sparse weights", "x"]


@pytest.mark.parametrize("folder", ["tiny-bge-m3", "tiny-splade"])
def test_sparse_jsonl_is_what_embed_sparse_gives(folder, tmp_path):
    path = FIXTURES / folder
    out = tmp_path / "out.jsonl"
    argv = ["embed", *TEXTS, "-m", str(path), "--sparse", "-o", str(out), "--progress", "never"]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    model = mlx_embed.load(path)
    want = model.embed_sparse(TEXTS)
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["tokens"] for r in records] == model.count_tokens(TEXTS)
    for r, (idx, values) in zip(records, want):
        assert set(r) == {"index", "tokens", "indices", "values"}
        assert r["indices"] == idx.tolist()
        assert np.array_equal(np.array(r["values"], dtype=np.float32), values)
    assert sum(len(r["indices"]) for r in records) >= 5


def test_sparse_refuses_npy_and_dense_models(tmp_path, capsys):
    bge = str(FIXTURES / "tiny-bge-m3")
    assert cli.main(["embed", "x", "-m", bge, "--sparse", "-o", str(tmp_path / "o.npy")]) == 2
    assert capsys.readouterr().err == (
        "mlx-embed embed: --sparse writes JSONL (indices and values per text), not .npy\n"
    )
    dense = str(FIXTURES / "tiny-xlm-roberta")
    assert cli.main(["embed", "x", "-m", dense, "--sparse", "--progress", "never"]) == 1
    assert capsys.readouterr().err == (
        "mlx-embed embed: tiny-xlm-roberta has no sparse output: --sparse needs a SPLADE model "
        "or a BGE-M3 folder (its sparse_linear.pt)\n"
    )
    assert not (tmp_path / "o.npy").exists()


def test_sparse_with_no_truncate_names_the_long_text(capsys):
    bge = str(FIXTURES / "tiny-bge-m3")
    argv = ["embed", "short", "word " * 400, "-m", bge, "--sparse", "--no-truncate", "--progress", "never"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlx-embed embed: text 1 has "), err
    assert "more than the model's 128" in err, err

