//! Reading the Python model's typed `spec()` (`mlx_embed.ModelSpec`) into
//! the core's [`ModelInfo`] and the tokenizer's [`TokenizerSpec`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlx_embed_core::{ModelInfo, ModelKind, MultiVectorLengths, TruncationDirection, WeightsInfo};
use mlx_embed_tokenizer::{InputMode, PairSpec, TokenizerSpec};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::BridgeError;

/// What `model.spec()` says, split by who needs it.
pub(crate) struct ModelSpec {
    pub info: ModelInfo,
    pub tokenizer: TokenizerSpec,
    /// The engine queues a call on the device and returns (`submit_ids`),
    /// so consecutive calls can overlap: its `details["pipeline"]`.
    pub pipelines: bool,
}

pub(crate) fn read_spec(spec: &Bound<'_, PyAny>) -> Result<ModelSpec, BridgeError> {
    let max_length: usize = field(spec, "max_length")?;
    let kind = match field::<String>(spec, "kind")?.as_str() {
        "embedding" => ModelKind::Embedding,
        "reranker" => ModelKind::Reranker {
            labels: optional(spec, "labels")?.unwrap_or_default(),
        },
        "classifier" => ModelKind::Classifier {
            labels: optional(spec, "labels")?.unwrap_or_default(),
            multi_label: optional(spec, "multi_label")?.unwrap_or_default(),
        },
        other => {
            return Err(BridgeError::Protocol(format!(
                "model.spec().kind is {other:?}; expected embedding, classifier or reranker"
            )))
        }
    };
    let tok = spec.getattr("tokenizer")?;
    let prompts: BTreeMap<String, String> = optional(&tok, "prompts")?.unwrap_or_default();
    let default_prompt_name: Option<String> = optional(&tok, "default_prompt_name")?;
    // Decided on the Python side (tokenization.truncation_side); read once
    // here for both the tokenizer and the model's facts (/info).
    let truncation_side = match optional::<String>(&tok, "truncation_side")? {
        None => TruncationDirection::Right,
        Some(name) => TruncationDirection::from_name(&name).ok_or_else(|| {
            BridgeError::Protocol(format!(
                "model.spec().tokenizer.truncation_side is {name:?}; expected right or left"
            ))
        })?,
    };
    let tokenizer = TokenizerSpec {
        path: PathBuf::from(field::<String>(&tok, "path")?),
        max_length,
        prefix_ids: field(&tok, "prefix_ids")?,
        suffix_ids: field(&tok, "suffix_ids")?,
        prompts: prompts.clone(),
        default_prompt_name: default_prompt_name.clone(),
        pair: read_pair(&tok)?,
        drop_ids: optional(&tok, "drop_ids")?.unwrap_or_default(),
        char_limit: optional(&tok, "char_limit")?,
        lowercase: optional(&tok, "lowercase")?.unwrap_or_default(),
        truncation_side,
        pool_without_prompt: !optional(&tok, "include_prompt")?.unwrap_or(true),
        query: read_mode(&tok, "query")?,
        document: read_mode(&tok, "document")?,
    };
    let mut details = BTreeMap::new();
    if let Some(d) = optional::<Bound<'_, PyAny>>(spec, "details")? {
        let d = d
            .cast::<PyDict>()
            .map_err(|_| BridgeError::Protocol("model.spec().details is not a dict".into()))?;
        for (key, value) in d.iter() {
            if !value.is_none() {
                details.insert(key.str()?.to_string(), value.str()?.to_string());
            }
        }
    }
    for key in ["pooling", "device"] {
        if let Some(value) = optional::<String>(spec, key)? {
            details.insert(key.to_string(), value);
        }
    }
    let pipelines = match details.get("pipeline").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(BridgeError::Protocol(format!(
                "model.spec().details[\"pipeline\"] is {other:?}; expected true or false"
            )))
        }
    };
    // A multi-vector model's lengths are its tokenizer's two modes'.
    let multi_vector =
        match (
            optional(spec, "multi_vector")?.unwrap_or(false),
            &tokenizer.query,
            &tokenizer.document,
        ) {
            (false, ..) => None,
            (true, Some(query), Some(document)) => Some(MultiVectorLengths {
                query: query.max_length,
                document: document.max_length,
            }),
            (true, ..) => return Err(BridgeError::Protocol(
                "model.spec() says multi_vector but its tokenizer has no query and document modes"
                    .into(),
            )),
        };
    let (dense_layers, truncate_dim) = read_head(spec, field(spec, "dim")?)?;
    let info = ModelInfo {
        name: field(spec, "name")?,
        kind,
        dim: field(spec, "dim")?,
        sparse: optional(spec, "sparse")?.unwrap_or(false),
        lexical_weights: optional(spec, "lexical_weights")?.unwrap_or(false),
        empty_inputs: optional(spec, "empty_inputs")?.unwrap_or(false),
        multi_vector,
        max_input_tokens: max_length,
        vocab_size: field(spec, "vocab_size")?,
        device_batch_tokens: optional(spec, "batch_tokens")?,
        prompts,
        default_prompt_name,
        truncation_side,
        tasks: optional(spec, "tasks")?.unwrap_or_default(),
        dense_layers,
        truncate_dim,
        details,
        weights: read_weights(spec)?,
    };
    Ok(ModelSpec {
        info,
        tokenizer,
        pipelines,
    })
}

/// What the model does after its pooling (`dense_layers`, `truncate_dim`),
/// which late chunking repeats or refuses. Both are required: a spec without
/// them (a Python side older than the fields) would read as "no Dense, no
/// cut", and a width-keeping Dense would then let chunk means through that
/// are not in the vectors' space; the package and its extension ship
/// together, so such a spec is a broken install, refused at load.
fn read_head(spec: &Bound<'_, PyAny>, dim: usize) -> Result<(usize, Option<usize>), BridgeError> {
    let dense_layers: usize = field(spec, "dense_layers")?;
    let truncate_dim: Option<usize> = field(spec, "truncate_dim")?;
    if let Some(width) = truncate_dim.filter(|&w| w != dim) {
        return Err(BridgeError::Protocol(format!(
            "model.spec().truncate_dim is {width}, not the model's dim {dim}: it names the cut \
             that makes the vectors, or is None"
        )));
    }
    Ok((dense_layers, truncate_dim))
}

/// The weights' facts, where `spec()` counts them (`parameters`).
fn read_weights(spec: &Bound<'_, PyAny>) -> Result<Option<WeightsInfo>, BridgeError> {
    let Some(parameters) = optional::<u64>(spec, "parameters")? else {
        return Ok(None);
    };
    Ok(Some(WeightsInfo {
        architecture: field(spec, "model_type")?,
        dtype: field(spec, "dtype")?,
        quantization_bits: optional(spec, "quantization")?,
        parameters,
        bytes: optional(spec, "weights_bytes")?.unwrap_or(0),
        format: optional(spec, "weights_format")?.unwrap_or_else(|| "safetensors".into()),
        folder: optional::<String>(spec, "path")?.map(PathBuf::from),
        revision: optional(spec, "revision")?,
    }))
}

/// `spec().tokenizer.query` / `.document` (an `InputModeSpec` dataclass or None).
fn read_mode(tok: &Bound<'_, PyAny>, name: &str) -> Result<Option<InputMode>, BridgeError> {
    let Some(mode) = optional::<Bound<'_, PyAny>>(tok, name)? else {
        return Ok(None);
    };
    Ok(Some(InputMode {
        insert_ids: field(&mode, "insert_ids")?,
        max_length: field(&mode, "max_length")?,
        expand_id: optional(&mode, "expand_id")?,
    }))
}

/// `spec().tokenizer.pair` (a `PairSpec` dataclass or None).
fn read_pair(tok: &Bound<'_, PyAny>) -> Result<Option<PairSpec>, BridgeError> {
    let Some(pair) = optional::<Bound<'_, PyAny>>(tok, "pair")? else {
        return Ok(None);
    };
    Ok(Some(PairSpec {
        prefix_ids: field(&pair, "prefix_ids")?,
        middle_ids: field(&pair, "middle_ids")?,
        suffix_ids: field(&pair, "suffix_ids")?,
        first_type_id: optional(&pair, "first_type_id")?.unwrap_or(0),
        second_type_id: optional(&pair, "second_type_id")?.unwrap_or(0),
        template: optional(&pair, "template")?,
        default_instruction: optional(&pair, "default_instruction")?,
        suffix_text: optional(&pair, "suffix_text")?,
        query_prompt: optional(&pair, "query_prompt")?,
        document_prompt: optional(&pair, "document_prompt")?,
        instruction_prompt: optional(&pair, "instruction_prompt")?,
        query_share: optional(&pair, "query_share")?,
        uncounted: optional(&pair, "uncounted")?.unwrap_or(0),
        instruction_suffix_ids: optional(&pair, "instruction_suffix_ids")?,
        suffix_uncounted: optional(&pair, "suffix_uncounted")?.unwrap_or(0),
        pairs_only: optional(&pair, "pairs_only")?.unwrap_or(false),
    }))
}

fn field<'py, T: FromPyObjectOwned<'py>>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> Result<T, BridgeError> {
    let value = obj
        .getattr(name)
        .map_err(|e| BridgeError::Protocol(format!("model.spec() lacks {name:?}: {e}")))?;
    value.extract::<T>().map_err(|e| wrong_type(name, e.into()))
}

/// A field that may be missing or `None`.
fn optional<'py, T: FromPyObjectOwned<'py>>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> Result<Option<T>, BridgeError> {
    match obj.getattr(name) {
        Ok(value) if value.is_none() => Ok(None),
        Ok(value) => value
            .extract::<T>()
            .map(Some)
            .map_err(|e| wrong_type(name, e.into())),
        Err(_) => Ok(None),
    }
}

fn wrong_type(name: &str, err: PyErr) -> BridgeError {
    BridgeError::Protocol(format!("model.spec().{name} has the wrong type: {err}"))
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;

    use pyo3::types::PyDict;

    use super::*;

    /// `read_spec` of a spec made in Python with `head` as its extra
    /// attributes (a namespace with the fields `spec()` gives; the
    /// tokenizer's file is only named, never opened).
    fn read(head: &str) -> Result<ModelSpec, BridgeError> {
        crate::interpreter::ensure_python().expect("python");
        let code = CString::new(format!(
            "from types import SimpleNamespace as N\n\
             tok = N(path='/nowhere/tokenizer.json', prefix_ids=[101], suffix_ids=[102])\n\
             spec = N(name='m', model_type='bert', kind='embedding', dim=32, max_length=16, \
             vocab_size=100, tokenizer=tok{head})\n"
        ))
        .unwrap();
        Python::attach(|py| {
            let globals = PyDict::new(py);
            py.run(&code, Some(&globals), None)
                .expect("the snippet runs");
            read_spec(&globals.get_item("spec").unwrap().unwrap())
        })
    }

    fn protocol_message(got: Result<ModelSpec, BridgeError>) -> String {
        match got {
            Err(BridgeError::Protocol(message)) => message,
            Err(other) => panic!("not a protocol error: {other}"),
            Ok(_) => panic!("the spec was read"),
        }
    }

    #[test]
    fn the_head_after_the_pooling_is_read_typed() {
        let info = read(", dense_layers=2, truncate_dim=None").unwrap().info;
        assert_eq!((info.dense_layers, info.truncate_dim), (2, None));
        // Shown among the details, derived from the typed fields only.
        assert!(info.details.is_empty());
        assert_eq!(info.shown_details()["dense_layers"], "2");
        assert!(!info.shown_details().contains_key("truncate_dim"));

        let info = read(", dense_layers=0, truncate_dim=32").unwrap().info;
        assert_eq!((info.dense_layers, info.truncate_dim), (0, Some(32)));
        assert_eq!(info.shown_details()["truncate_dim"], "32");
        assert!(!info.shown_details().contains_key("dense_layers"));
    }

    #[test]
    fn a_spec_without_the_head_or_with_a_stray_cut_is_refused() {
        // An older Python side: "no Dense" read from a missing field would
        // let late chunking serve means outside the vectors' space.
        let message = protocol_message(read(", truncate_dim=None"));
        assert!(
            message.starts_with("model.spec() lacks \"dense_layers\""),
            "{message}"
        );
        let message = protocol_message(read(", dense_layers=0"));
        assert!(
            message.starts_with("model.spec() lacks \"truncate_dim\""),
            "{message}"
        );
        assert_eq!(
            protocol_message(read(", dense_layers=0, truncate_dim=16")),
            "model.spec().truncate_dim is 16, not the model's dim 32: it names the cut that \
             makes the vectors, or is None"
        );
        // A detail of the same name is display only, never read back.
        let info = read(", dense_layers=0, truncate_dim=None, details={'dense_layers': '3'}")
            .unwrap()
            .info;
        assert_eq!(info.dense_layers, 0);
        assert!(!info.shown_details().contains_key("dense_layers"));
        let message = protocol_message(read(", dense_layers=-1, truncate_dim=None"));
        assert!(message.contains("dense_layers"), "{message}");
    }
}
