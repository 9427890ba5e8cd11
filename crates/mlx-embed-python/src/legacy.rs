//! Interim: the engine before `spec()`/`embed_ids` (issue 14 moves them into
//! `mlx_embed`, in a parallel change). Reads the same facts from the old
//! engine's attributes so the bridge works against either; delete this
//! module once the engine has `spec()`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlx_embed_core::{ModelInfo, ModelKind};
use mlx_embed_tokenizer::TokenizerSpec;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::spec::ModelSpec;
use crate::BridgeError;

/// True for an engine without `spec()`.
pub(crate) fn is_legacy(model: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(!model.hasattr("spec")?)
}

pub(crate) fn read_spec(model: &Bound<'_, PyAny>) -> Result<ModelSpec, BridgeError> {
    let info = model.call_method0("info")?;
    let info = info
        .cast::<PyDict>()
        .map_err(|_| BridgeError::Protocol("model.info() is not a dict".into()))?;
    let get = |key: &str| -> Result<Bound<'_, PyAny>, BridgeError> {
        info.get_item(key)?
            .ok_or_else(|| BridgeError::Protocol(format!("model.info() lacks {key:?}")))
    };
    let max_length: usize = get("max_length")?.extract()?;
    let tok = model.getattr("tokenizer")?;
    let path: String = model.getattr("path")?.extract()?;
    let instruction: String = model
        .call_method1("_prefix", (None::<String>,))?
        .extract()?;
    let tokenizer = TokenizerSpec {
        path: PathBuf::from(path).join("tokenizer.json"),
        max_length,
        prefix_ids: tok.getattr("prefix")?.extract()?,
        suffix_ids: tok.getattr("suffix")?.extract()?,
        prompts: BTreeMap::new(),
        default_prompt_name: None,
        instruction: (!instruction.is_empty()).then_some(instruction),
        pair: None,
    };
    let mut details = BTreeMap::new();
    for (key, value) in info.iter() {
        let key: String = key.extract()?;
        let shown_elsewhere = [
            "name",
            "dim",
            "max_length",
            "vocab_size",
            "preferred_batch_tokens",
        ];
        if !shown_elsewhere.contains(&key.as_str()) && !value.is_none() {
            details.insert(key, value.str()?.to_string());
        }
    }
    let info = ModelInfo {
        name: get("name")?.extract()?,
        kind: ModelKind::Embedding,
        dim: get("dim")?.extract()?,
        max_input_tokens: max_length,
        vocab_size: get("vocab_size")?.extract()?,
        device_batch_tokens: get("preferred_batch_tokens")?.extract()?,
        prompts: BTreeMap::new(),
        default_prompt_name: None,
        details,
    };
    Ok(ModelSpec { info, tokenizer })
}

/// `model._run(ids)`: (float32 [n, dim] array, padded tokens) -> (LE bytes, padded).
pub(crate) fn embed<'py>(
    model: &Bound<'py, PyAny>,
    ids: Bound<'py, PyList>,
) -> PyResult<(Bound<'py, PyBytes>, u64)> {
    let (vectors, padded): (Bound<'py, PyAny>, u64) =
        model.call_method1("_run", (ids,))?.extract()?;
    let bytes = vectors
        .call_method1("astype", ("<f4",))?
        .call_method0("tobytes")?
        .cast_into::<PyBytes>()?;
    Ok((bytes, padded))
}
