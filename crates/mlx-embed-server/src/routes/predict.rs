//! `POST /predict` (Hugging Face TEI): label scores from a sequence
//! classifier (or reranker), for texts or text pairs, through the one
//! scoring path ([`crate::score`]).

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::errors::{ApiError, ErrorKind, Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, PriorityHeader, TruncationSide};
use crate::models::Task;
use crate::score::{ranking, score, ScoreOutput, ScoreRequest};
use crate::state::AppState;

/// TEI predict request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct PredictRequest {
    /// Which served classifier answers (not a TEI field); default: the first classifier or reranker.
    pub model: Option<String>,
    /// As TEI: a text; a `[text, text]` pair; or a list of texts and pairs (a batch).
    #[schema(value_type = PredictInputs)]
    pub inputs: Value,
    /// Raw logits instead of sigmoid (one label) / softmax (several) scores.
    #[serde(default)]
    pub raw_scores: bool,
    /// Cut inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` (default) keeps the start of an over-long input, `Left` its end (any case).
    pub truncation_direction: Option<TruncationSide>,
}

/// The shapes `inputs` takes (documentation only: parsed by `parse_inputs`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum PredictInputs {
    /// One text.
    Text(String),
    /// A `[text, text]` pair, or a batch of texts and pairs.
    Sequence(Vec<PredictItem>),
}

/// One input of a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum PredictItem {
    Text(String),
    Pair(Vec<String>),
}

/// One label's score.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Prediction {
    pub score: f32,
    pub label: String,
}

/// A single input's predictions, or one list per input of a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PredictResponse {
    Single(Vec<Prediction>),
    Batch(Vec<Vec<Prediction>>),
}

/// TEI's predict inputs: whether they were one input or a batch, and the inputs.
pub(crate) fn parse_inputs(value: Value) -> Result<(bool, Vec<EmbedInput>), ApiError> {
    let shape = || {
        ApiError::new(
            ErrorKind::Unprocessable,
            "inputs must be a text, a [text, text] pair, or a list of texts and pairs",
        )
        .param("inputs")
    };
    let pair = |items: &[Value]| match items {
        [Value::String(a), Value::String(b)] => Some(EmbedInput::Pair {
            query: a.clone(),
            document: b.clone(),
        }),
        _ => None,
    };
    match value {
        Value::String(s) => Ok((false, vec![EmbedInput::Text(s)])),
        // TEI reads a list of exactly two texts as one pair, not a batch of two.
        Value::Array(items) if pair(&items).is_some() => Ok((false, vec![pair(&items).unwrap()])),
        Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => Ok(EmbedInput::Text(s)),
                Value::Array(p) => pair(&p).ok_or_else(shape),
                _ => Err(shape()),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|inputs| (true, inputs)),
        _ => Err(shape()),
    }
}

/// Each input's predictions, best label first.
pub(crate) fn predictions(out: &ScoreOutput) -> Vec<Vec<Prediction>> {
    out.scores
        .iter()
        .map(|row| {
            ranking(row)
                .into_iter()
                .map(|i| Prediction {
                    score: row[i],
                    label: out.labels[i].clone(),
                })
                .collect()
        })
        .collect()
}

/// Classify texts or text pairs.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/predict", tag = "tei", operation_id = "tei_predict",
    request_body = PredictRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Labels best first, per input", body = PredictResponse),
        (status = "4XX", description = "Invalid request (400 also: no classifier served; 401, 404 unknown model, 413, 415, 422, 429)", body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn predict(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<PredictRequest, Tei>,
) -> Result<Json<PredictResponse>, Shaped<Tei>> {
    let (batch, inputs) = parse_inputs(req.inputs)?;
    let out = score(
        &state,
        ScoreRequest {
            model: req.model,
            task: Task::Predict,
            inputs,
            options: EmbedOptions {
                truncate: req.truncate.unwrap_or(true),
                truncation_direction: req.truncation_direction.map(Into::into).unwrap_or_default(),
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            raw_scores: req.raw_scores,
        },
    )
    .await?;
    let mut all = predictions(&out);
    Ok(Json(if batch {
        PredictResponse::Batch(all)
    } else {
        PredictResponse::Single(all.remove(0))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tei_input_shapes() {
        let (batch, inputs) = parse_inputs(json!("a")).unwrap();
        assert!(!batch);
        assert_eq!(inputs, vec![EmbedInput::Text("a".into())]);
        let (batch, inputs) = parse_inputs(json!(["q", "d"])).unwrap();
        assert!(!batch);
        assert_eq!(
            inputs,
            vec![EmbedInput::Pair {
                query: "q".into(),
                document: "d".into()
            }]
        );
        let (batch, inputs) = parse_inputs(json!(["a", "b", "c"])).unwrap();
        assert!(batch);
        assert_eq!(inputs.len(), 3);
        let (batch, inputs) = parse_inputs(json!([["q", "d"], "t"])).unwrap();
        assert!(batch);
        assert_eq!(inputs[1], EmbedInput::Text("t".into()));
        let (batch, inputs) = parse_inputs(json!([])).unwrap();
        assert!(batch && inputs.is_empty());
        for bad in [
            json!(1),
            json!([["a"]]),
            json!([1, 2]),
            json!({"a": 1}),
            json!(null),
        ] {
            let e = parse_inputs(bad.clone()).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unprocessable, "{bad}");
        }
    }
}
