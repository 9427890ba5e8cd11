"""A sequence-classification checkpoint used as an embedding model, as
sentence-transformers uses one: its encoder, without the head."""

import json
import shutil

import mlx_embed
import numpy as np
import pytest
from conftest import FIXTURES, assert_parity

REFERENCES = np.load(FIXTURES / "classifier-encoders" / "reference_mean_normalized.npz")


@pytest.mark.parametrize("folder", sorted(REFERENCES.files))
def test_kind_embedding_is_the_encoder_without_its_head(folder, golden_texts):
    """`kind="embedding"` on a classifier folder was refused ("not an
    embedding model"); sentence-transformers' SentenceTransformer(folder)
    embeds with its encoder."""
    model = mlx_embed.load(FIXTURES / folder, kind="embedding", max_length=128)
    assert model.kind == "embedding"
    assert_parity(model.embed(golden_texts), REFERENCES[folder])


@pytest.mark.parametrize("folder", ["tiny-gte-reranker", "tiny-jina-reranker", "tiny-jina-reranker-v1"])
def test_remote_code_rerankers_load_as_encoders_too(folder, golden_texts):
    model = mlx_embed.load(FIXTURES / folder, kind="embedding")
    hidden = json.loads((FIXTURES / folder / "config.json").read_text())["hidden_size"]
    vectors = model.embed(golden_texts[:4])
    assert vectors.shape == (4, hidden)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def _with_modules(tmp_path, modules: list, pooling: dict | None = None):
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / "tiny-bert-reranker", folder)
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}


def test_a_folder_that_pools_its_classifier_is_an_embedding_model(tmp_path, golden_texts):
    """A sentence-transformers pipeline (Transformer -> Pooling) over a
    config naming BertForSequenceClassification embeds in
    sentence-transformers; it was loaded as a reranker, and embed() refused."""
    folder = _with_modules(
        tmp_path,
        [TRANSFORMER, {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}],
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True},
    )
    model = mlx_embed.load(folder, max_length=128)
    assert model.kind == "embedding"
    assert_parity(model.embed(golden_texts), REFERENCES["tiny-bert-reranker"])


def test_a_sentence_transformers_6_cross_encoder_folder_stays_a_reranker(tmp_path):
    """sentence-transformers 6 saves a CrossEncoder with a modules.json of one
    Transformer (no Pooling): still a reranker."""
    folder = _with_modules(tmp_path, [{**TRANSFORMER, "type": "sentence_transformers.base.modules.transformer.Transformer"}])
    model = mlx_embed.load(folder)
    assert model.kind == "reranker"
    reference = mlx_embed.load(FIXTURES / "tiny-bert-reranker")
    pairs = [("what is a cross-encoder", "it reads both texts at once"), ("q", "an unrelated answer")]
    assert np.array_equal(model.predict(pairs), reference.predict(pairs))


def test_a_sentence_transformers_6_cross_encoder_folder_embeds_when_asked(tmp_path, golden_texts):
    """kind="embedding" on it was refused ("modules.json has no Pooling
    module"); SentenceTransformer(folder) pools its Transformer the default
    way (mean)."""
    folder = _with_modules(tmp_path, [{**TRANSFORMER, "type": "sentence_transformers.base.modules.transformer.Transformer"}])
    model = mlx_embed.load(folder, kind="embedding", max_length=128)
    assert_parity(model.embed(golden_texts), REFERENCES["tiny-bert-reranker"])


@pytest.mark.parametrize("arch", ["ElectraModel", "ElectraForPreTraining"])
def test_a_bare_electra_model_folder_embeds(arch, tmp_path, golden_texts):
    """model_type "electra" without a classifier (an ElectraModel folder, or
    a discriminator as google/electra-*-discriminator saves it: the encoder
    under "electra." beside discriminator_predictions) is an embedding model
    on the same encoder: the reranker fixture's weights without its head
    embed as SentenceTransformer embeds the reranker folder."""
    import mlx.core as mx

    src = FIXTURES / "tiny-electra-reranker"
    folder = tmp_path / "electra"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = [arch]
    for key in ("id2label", "label2id"):
        config.pop(key)
    (folder / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(src / "model.safetensors"))
    encoder = {k: w for k, w in weights.items() if k.startswith("electra.")}
    assert "electra.embeddings_project.weight" in encoder
    if arch == "ElectraModel":
        encoder = {k[len("electra."):]: w for k, w in encoder.items()}
    else:
        encoder.update({
            "discriminator_predictions.dense.weight": mx.zeros((32, 32)),
            "discriminator_predictions.dense.bias": mx.zeros((32,)),
            "discriminator_predictions.dense_prediction.weight": mx.zeros((1, 32)),
            "discriminator_predictions.dense_prediction.bias": mx.zeros((1,)),
        })
    mx.save_safetensors(str(folder / "model.safetensors"), encoder)
    model = mlx_embed.load(folder, max_length=128)
    assert (model.kind, model.dim) == ("embedding", 32)
    assert_parity(model.embed(golden_texts), REFERENCES["tiny-electra-reranker"])
