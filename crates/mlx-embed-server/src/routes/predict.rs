//! `POST /predict` (Hugging Face TEI): label scores from a sequence
//! classifier (or reranker), for texts or text pairs, through the one
//! scoring path ([`crate::score`]).

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Priority};
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
    /// As TEI: a text, a `[text]` or `[text, text]` list (one input), or a batch: a list of such lists.
    #[schema(value_type = PredictInputs)]
    pub inputs: Value,
    /// Raw logits instead of sigmoid (one label, or each of a multi-label classifier's) / softmax (several) scores.
    #[serde(default)]
    pub raw_scores: bool,
    /// Cut inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` keeps the start of an over-long input, `Left` its end (any case);
    /// unsaid: the model folder's `truncation_side`, else right.
    pub truncation_direction: Option<TruncationSide>,
}

/// The shapes `inputs` takes (documentation only: parsed by `parse_inputs`).
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum PredictInputs {
    /// One text.
    Text(String),
    /// A `[text]` or `[text, text]` list (one input), or a batch of such lists.
    Sequence(Vec<PredictItem>),
}

/// One input of a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
pub enum PredictItem {
    /// A text (in a flat `[text]` / `[text, text]` list, or in a batch).
    Text(String),
    /// A `[text]` or `[text, text]` list: one input of a batch.
    Sequence(Vec<String>),
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

/// TEI's predict inputs: whether they were one input or a batch, and the
/// inputs. As TEI reads them: a text, or a flat `[text]` / `[text, text]`
/// list, is one input (a flat answer); a list of such lists is a batch (one
/// answer per input). A batch may also hold plain texts. A flat list of three
/// or more texts is refused: read as a batch, a chunk of exactly two would
/// silently become one pair.
pub(crate) fn parse_inputs(value: Value) -> Result<(bool, Vec<EmbedInput>), ApiError> {
    let shape = || {
        ApiError::new(
            ErrorKind::Unprocessable,
            "inputs must be a text, a [text] or [text, text] list (one input), or a batch: \
             a list of [text] and [text, text] lists",
        )
        .param("inputs")
    };
    let sequence = |items: Vec<Value>| {
        let mut texts = items.into_iter().map(|v| match v {
            Value::String(s) => Some(s),
            _ => None,
        });
        match (texts.next(), texts.next(), texts.next()) {
            (Some(Some(text)), None, None) => Some(EmbedInput::Text(text)),
            (Some(Some(query)), Some(Some(document)), None) => {
                Some(EmbedInput::Pair { query, document })
            }
            _ => None,
        }
    };
    match value {
        Value::String(s) => Ok((false, vec![EmbedInput::Text(s)])),
        Value::Array(items) if items.is_empty() => Ok((true, Vec::new())),
        Value::Array(items) if items.iter().all(Value::is_string) => match items.len() {
            1 | 2 => Ok((false, vec![sequence(items).ok_or_else(shape)?])),
            n => Err(ApiError::new(
                ErrorKind::Unprocessable,
                format!(
                    "inputs is a flat list of {n} texts: a flat list is one input, a [text] or \
                     [text, text] pair; send a batch as a list of lists, e.g. [[\"a\"], [\"b\"]]"
                ),
            )
            .param("inputs")),
        },
        Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => Ok(EmbedInput::Text(s)),
                Value::Array(p) => sequence(p).ok_or_else(shape),
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
        .zip(&out.logits)
        .map(|(row, logits)| {
            ranking(logits)
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
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 also: no classifier served; 401, 404 unknown model (below), 413, 415, 422, 429)", Task::Predict), body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn predict(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<PredictRequest, Tei>,
) -> Result<Json<PredictResponse>, Shaped<Tei>> {
    Ok(Json(predict_body(&state, req, priority).await?))
}

/// `/predict`'s answer for `req`; `priority`: the `X-Priority` header's lane.
pub(crate) async fn predict_body(
    state: &AppState,
    req: PredictRequest,
    priority: Option<Priority>,
) -> Result<PredictResponse, ApiError> {
    let (batch, inputs) = parse_inputs(req.inputs)?;
    crate::timing::shape(if batch {
        crate::timing::Method::Batch
    } else {
        crate::timing::Method::Single
    });
    let out = score(
        state,
        ScoreRequest {
            model: req.model,
            task: Task::Predict,
            inputs,
            options: EmbedOptions {
                truncate: req.truncate.unwrap_or(true),
                truncation_direction: req.truncation_direction.map(Into::into),
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            raw_scores: req.raw_scores,
        },
    )
    .await?;
    let mut all = predictions(&out);
    let answer = if batch {
        PredictResponse::Batch(all)
    } else {
        PredictResponse::Single(all.remove(0))
    };
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tei_input_shapes() {
        let text = |s: &str| EmbedInput::Text(s.into());
        let pair = |q: &str, d: &str| EmbedInput::Pair {
            query: q.into(),
            document: d.into(),
        };
        for (value, batch, inputs) in [
            (json!("a"), false, vec![text("a")]),
            (json!(["a"]), false, vec![text("a")]),
            (json!(["q", "d"]), false, vec![pair("q", "d")]),
            (json!([["a"]]), true, vec![text("a")]),
            (json!([["q", "d"]]), true, vec![pair("q", "d")]),
            (
                json!([["I love it"], ["no", "yes"]]),
                true,
                vec![text("I love it"), pair("no", "yes")],
            ),
            (json!([["a"], ["b"]]), true, vec![text("a"), text("b")]),
            (
                json!([["q", "d"], "t"]),
                true,
                vec![pair("q", "d"), text("t")],
            ),
            (json!([]), true, vec![]),
        ] {
            assert_eq!(
                parse_inputs(value.clone()).unwrap(),
                (batch, inputs),
                "{value}"
            );
        }
        for bad in [
            json!(1),
            json!(["a", "b", "c"]),
            json!([["a", "b", "c"]]),
            json!([[]]),
            json!([["a", 1]]),
            json!([1, 2]),
            json!([["a"], 2]),
            json!({"a": 1}),
            json!(null),
        ] {
            let e = parse_inputs(bad.clone()).unwrap_err();
            assert_eq!(e.kind, ErrorKind::Unprocessable, "{bad}");
        }
        let e = parse_inputs(json!(["a", "b", "c"])).unwrap_err();
        assert!(e.message.contains("flat list of 3 texts"), "{}", e.message);
    }
}
