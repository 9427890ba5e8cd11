"""A load's deliberate refusals are typed by whose fault they are (the
bridge maps each class to its kind, crates/mlx-embed-python/src/error.rs):
``InvalidOption`` for a keyword argument the engine cannot take,
``InvalidModel`` for a folder whose files make no model. Each is still the
``ValueError`` Python callers caught before; an unexpected exception inside
the load stays what it was, so a bug is never reported as the model's
fault."""

import json
import shutil

import pytest

import mlx_embed
from mlx_embed import errors, loading

FIXTURE = "tests/fixtures/tiny-mpnet"


@pytest.mark.parametrize("kwargs, message", [
    ({"fast_ops": "fastest"}, "fast_ops must be 'native', 'mlx' or 'exact', got 'fastest'"),
    ({"kind": "summarizer"}, "kind must be one of embedding, classifier, reranker, got 'summarizer'"),
    ({"kind": "classifier"}, "has no classifier head"),
    ({"pooling": "median"}, "unsupported pooling 'median'"),
])
def test_an_option_the_engine_refuses_is_invalid_option(kwargs, message):
    with pytest.raises(errors.InvalidOption, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        mlx_embed.load(FIXTURE, **kwargs)
    assert isinstance(refused.value, ValueError)
    assert not isinstance(refused.value, errors.InvalidModel)


def _copy(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURE, folder)
    return folder


def test_a_config_that_is_not_json_is_invalid_model(tmp_path):
    folder = _copy(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(errors.InvalidModel, match=r"config.json is not valid JSON") as refused:
        mlx_embed.load(str(folder))
    assert isinstance(refused.value, ValueError)


def test_a_sentence_transformers_file_the_engine_cannot_run_is_invalid_model(tmp_path):
    folder = _copy(tmp_path)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Other", "type": "my_package.Other"},
    ]))
    with pytest.raises(errors.InvalidModel, match=r"modules.json: module 1 \('my_package.Other'\) is not supported"):
        mlx_embed.load(str(folder))


def test_a_config_setting_the_architecture_does_not_run_is_invalid_model(tmp_path):
    folder = _copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    with pytest.raises(errors.InvalidModel, match=r"mpnet: hidden_act='relu' is not supported \(only 'gelu'\) "
                       r"\(in .*/model/config.json\)"):
        mlx_embed.load(str(folder))


def test_an_unreadable_tokenizer_is_invalid_model(tmp_path):
    folder = _copy(tmp_path)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(errors.InvalidModel, match=r"tokenizer.json cannot be read as a tokenizer"):
        mlx_embed.load(str(folder))


def test_a_bug_inside_the_load_is_not_blamed_on_the_model(monkeypatch):
    def broken(*_args, **_kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(loading, "load_weights", broken)
    with pytest.raises(KeyError, match="a bug") as raised:
        mlx_embed.load(FIXTURE)
    assert not isinstance(raised.value, errors.MlxEmbedError)
