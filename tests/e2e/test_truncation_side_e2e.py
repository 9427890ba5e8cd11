"""A folder's truncation side through the real server: a request that names
no truncation_direction is cut as the folder says (tokenizer_config.json's
truncation_side, as sentence-transformers cuts), one that names one gets it,
/info reports each model's default, and --truncation-side
(MLX_EMBED_TRUNCATION_SIDE) is over the folders."""

from __future__ import annotations

import json
import shutil

import numpy as np

from harness import FIXTURES, start_server

LONG = "the start of it " + " ".join(f"word{i % 37} middle" for i in range(400)) + " and the very end"
TEXTS = [LONG, "a short one"]


def _copy(name: str, dest, side: str | None):
    shutil.copytree(FIXTURES / name, dest)
    if side:
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        (dest / "tokenizer_config.json").write_text(json.dumps({**cfg, "truncation_side": side}))
    return str(dest)


def _tei(srv, model: str, **extra) -> np.ndarray:
    resp = srv.post("/embed", {"model": model, "inputs": TEXTS, **extra})
    assert resp.status_code == 200, resp.text[:500]
    return np.asarray(resp.json(), dtype=np.float32)


def _scores(srv, **extra) -> np.ndarray:
    resp = srv.post("/rerank", {"model": "left-reranker", "query": "what is at the end", "texts": TEXTS,
                                "raw_scores": True, **extra})
    assert resp.status_code == 200, resp.text[:500]
    return np.asarray([r["score"] for r in sorted(resp.json(), key=lambda r: r["index"])])


def test_the_folders_side_is_each_models_default(tmp_path):
    import mlx_embed

    left = _copy("tiny-mpnet", tmp_path / "left-mpnet", "left")
    plain = _copy("tiny-mpnet", tmp_path / "plain-mpnet", None)
    reranker = _copy("tiny-bert-reranker", tmp_path / "left-reranker", "left")
    srv = start_server(tmp_path, "--model", left, "--model", plain, "--rerank-model", reranker, "--no-warmup")
    try:
        info = srv.get("/info").json()
        assert info["truncation_direction"] == "left"
        assert [(m["model"], m["truncation_direction"]) for m in info["models"]] == [
            ("left-mpnet", "left"), ("plain-mpnet", "right"), ("left-reranker", "left")]

        got = _tei(srv, "left-mpnet")
        asked_left = _tei(srv, "left-mpnet", truncation_direction="Left")
        asked_right = _tei(srv, "left-mpnet", truncation_direction="Right")
        assert np.abs(got - asked_left).max() <= 1e-6
        assert np.abs(got[0] - asked_right[0]).max() > 1e-2
        assert np.abs(got[1] - asked_right[1]).max() <= 1e-6  # short: nothing cut
        # The plain folder (same weights) cuts on the right unless asked.
        plain_default = _tei(srv, "plain-mpnet")
        assert np.abs(plain_default - _tei(srv, "plain-mpnet", truncation_direction="Right")).max() <= 1e-6
        assert np.abs(plain_default - asked_right).max() <= 1e-6
        assert np.abs(_tei(srv, "plain-mpnet", truncation_direction="left") - got).max() <= 1e-6
        # The library cuts the folder the same way.
        assert np.abs(got - mlx_embed.load(left).embed(TEXTS)).max() <= 1e-5
        native = srv.post("/api/v1/embed", {"model": "left-mpnet", "texts": TEXTS})
        assert native.status_code == 200, native.text[:300]
        assert np.abs(np.asarray(native.json()["embeddings"], dtype=np.float32) - got).max() <= 1e-6

        # Pairs: longest_first from the left by default, as the library scores them.
        scores = _scores(srv)
        assert np.abs(scores - _scores(srv, truncation_direction="Left")).max() <= 1e-5
        right = _scores(srv, truncation_direction="Right")
        assert abs(scores[0] - right[0]) > 1e-4 and abs(scores[1] - right[1]) <= 1e-5
        library = mlx_embed.load(reranker).score([("what is at the end", t) for t in TEXTS], raw_scores=True)
        assert np.abs(scores - library[:, 0]).max() <= 1e-5
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_truncation_side_flag_is_over_the_folder(tmp_path):
    left = _copy("tiny-mpnet", tmp_path / "left-mpnet", "left")
    srv = start_server(tmp_path, "--model", left, "--no-warmup", env={"MLX_EMBED_TRUNCATION_SIDE": "right"})
    try:
        assert srv.get("/info").json()["truncation_direction"] == "right"
        got = _tei(srv, "left-mpnet")
        assert np.abs(got - _tei(srv, "left-mpnet", truncation_direction="right")).max() <= 1e-6
        assert np.abs(got[0] - _tei(srv, "left-mpnet", truncation_direction="left")[0]).max() > 1e-2
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
