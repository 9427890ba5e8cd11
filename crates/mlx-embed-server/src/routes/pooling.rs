//! vLLM's pooling APIs besides `/score`: `POST /pooling` (for an embedding
//! model, vLLM's `embed` task: one pooled vector per input, through the one
//! embed path, as `/v1/embeddings` answers) and `POST /classify` (a
//! classifier's label probabilities, through the one scoring path, as TEI's
//! `/predict` scores them; in vLLM's shape, or Infinity's for Infinity's body).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{EmbedOptions, Priority};
use serde::{Deserialize, Deserializer, Serialize};
use std::borrow::Cow;
use utoipa::openapi::schema::{OneOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::openai::VllmOptions;
use super::openai::{embed_request, EmbeddingValue, OpenAiEmbeddingRequest};
use super::{response_id, unix_now, Usage};
use crate::errors::{ApiError, OpenAi, OpenAiErrorBody, Shaped};
use crate::extract::{ApiJson, PriorityHeader, TextsOrTokens, TruncationSide};
use crate::models::Task;
use crate::score::{ranking, score, ScoreOutput, ScoreRequest};
use crate::state::AppState;

/// vLLM pooling request (its completion form; the chat form's `messages` is
/// not read): `/v1/embeddings`' fields, and vLLM's `task`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct PoolingRequest {
    /// vLLM's pooling task: `embed` (the default and only one: an embedding
    /// model's pooled vectors); any other is a 400.
    pub task: Option<String>,
    /// Everything `/v1/embeddings` takes (prompts, truncation, `dimensions`,
    /// which vLLM answers 400 to here, encoding and vLLM's options), read as
    /// it reads them.
    #[serde(flatten)]
    pub embedding: OpenAiEmbeddingRequest,
}

/// One input's pooled output.
#[derive(Debug, Serialize, ToSchema)]
pub struct PoolingData {
    pub index: usize,
    /// Always `pooling`.
    pub object: &'static str,
    /// The input's vector: floats, or base64 of their float32 bytes (little-endian
    /// unless `endianness: big`).
    pub data: EmbeddingValue,
}

/// vLLM pooling response.
#[derive(Debug, Serialize, ToSchema)]
pub struct PoolingResponse {
    pub id: String,
    /// Always `list`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// One per input, in input order.
    pub data: Vec<PoolingData>,
    pub usage: Usage,
}

/// Pool inputs (vLLM's pooling API): for an embedding model, each input's
/// vector, as `/v1/embeddings` computes it (unit length unless `use_activation: false`).
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/pooling", tag = "vllm", operation_id = "vllm_pooling",
    request_body = PoolingRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "One vector per input, in order", body = PoolingResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a wrong shape, `truncate_prompt_tokens` below 1 or too short for the special tokens, a `task` other than `embed`, no embedding model served; 401, 404 unknown model (below), 413, 415, 429)", Task::Embed), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn pooling(
    State(state): State<AppState>,
    PriorityHeader(header, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<PoolingRequest, OpenAi>,
) -> Result<Json<PoolingResponse>, Shaped<OpenAi>> {
    if let Some(task) = req.task.as_deref().filter(|t| *t != "embed") {
        return Err(ApiError::invalid(format!(
            "task {task:?} is not supported: /pooling answers an embedding model's `embed` \
             task (classify with /classify, score pairs with /score)"
        ))
        .param("task")
        .into());
    }
    let format = req.embedding.vector_encoding()?;
    let out = embed_request(&state, header, req.embedding).await?;
    Ok(Json(PoolingResponse {
        id: response_id("pooling"),
        object: "list",
        created: unix_now(),
        model: out.model,
        data: out
            .vectors
            .into_iter()
            .enumerate()
            .map(|(index, v)| PoolingData {
                index,
                object: "pooling",
                data: EmbeddingValue::encode(v, &format),
            })
            .collect(),
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
    }))
}

/// vLLM classification request (its completion form), or Infinity's
/// (`input`, `model`, `raw_scores`).
#[derive(Debug, Deserialize, ToSchema)]
pub struct ClassifyRequest {
    /// Which served classifier answers; default: the first classifier or reranker.
    pub model: Option<String>,
    /// A string, strings, token ids, or lists of token ids (run as given).
    pub input: TextsOrTokens,
    /// Infinity's: true answers the raw logits instead of probabilities. A
    /// body with this field (Infinity's client always sends it) is answered
    /// in Infinity's shape (`InfinityClassifyResponse`).
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<bool>)]
    pub raw_scores: Option<Option<bool>>,
    /// false: the raw logits in `probs` instead of probabilities.
    pub use_activation: Option<bool>,
    /// vLLM's older name for `use_activation`.
    pub softmax: Option<bool>,
    /// vLLM's older name for `use_activation`.
    pub activation: Option<bool>,
    /// Cut every input at this many tokens (special tokens included), at most
    /// the model's maximum; -1 (or none): the model's maximum. Text and token
    /// ids are cut alike (inside the model's special tokens);
    /// `truncation_side` picks the end.
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: which end an over-long input loses: `right` keeps its first
    /// tokens, `left` its last; unsaid: the model folder's `truncation_side`, else right.
    pub truncation_side: Option<TruncationSide>,
    /// Cut over-long inputs (default true); false answers 400 instead.
    pub truncate: Option<bool>,
    /// true (the default); false is a 400.
    pub add_special_tokens: Option<bool>,
    /// Lower is served earlier, 0 is the default: below 0 the high lane, above it the low
    /// one. Wins over an `X-Priority` header.
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub priority: Option<i64>,
    /// Accepted and ignored.
    pub user: Option<String>,
}

/// One input's classification.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClassifyData {
    pub index: usize,
    /// The label of the highest probability.
    pub label: String,
    /// One per label, in the model's label order (`/info` lists it): softmax
    /// over the labels (a sigmoid each for a multi-label classifier or a
    /// one-label model), or the raw logits with `use_activation: false`.
    pub probs: Vec<f32>,
    pub num_classes: usize,
}

/// vLLM classification response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClassifyResponse {
    pub id: String,
    /// Always `list`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// One per input, in input order.
    pub data: Vec<ClassifyData>,
    pub usage: Usage,
}

/// A field that is in the body, even as `null`: `Some` of its value (a
/// missing one is `None` by `#[serde(default)]`).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Option<bool>>, D::Error> {
    Option::<bool>::deserialize(d).map(Some)
}

/// One label's score (Infinity's shape).
#[derive(Debug, Serialize, ToSchema)]
pub struct InfinityLabelScore {
    /// The label's probability (softmax over the labels, or a sigmoid each for
    /// a multi-label classifier or a one-label model), or its raw logit with
    /// `raw_scores: true`.
    pub score: f32,
    pub label: String,
}

/// Infinity's classification response.
#[derive(Debug, Serialize, ToSchema)]
pub struct InfinityClassifyResponse {
    /// Always `classify`.
    pub object: &'static str,
    /// One list per input, in input order: every label's score, best first
    /// (equal scores in the model's label order), as Infinity answers.
    pub data: Vec<Vec<InfinityLabelScore>>,
    pub model: String,
    pub usage: Usage,
    pub id: String,
    /// Unix seconds.
    pub created: u64,
}

/// What `/classify` answers (documentation only): vLLM's shape, or
/// Infinity's for a body with `raw_scores`.
pub struct ClassifyAnswer;

impl PartialSchema for ClassifyAnswer {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(Ref::from_schema_name("ClassifyResponse"))
            .item(Ref::from_schema_name("InfinityClassifyResponse"))
            .into()
    }
}

impl ToSchema for ClassifyAnswer {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ClassifyAnswer")
    }
}

/// Classify inputs with a served classifier (vLLM's classification API;
/// TEI's `/predict` scores the same way).
///
/// vLLM's shape; a body with `raw_scores`, Infinity's request (its client
/// always sends the field), is answered in Infinity's shape: per input, every
/// label's score, best first.
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/classify", tag = "vllm", operation_id = "vllm_classify",
    request_body = ClassifyRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "One classification per input, in order (vLLM's shape; Infinity's for a body with `raw_scores`)", body = ClassifyAnswer),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a wrong shape, no classifier served, `truncate_prompt_tokens` below 1 or too short for the special tokens; 401, 404 unknown model (below), 413, 415, 429)", Task::Predict), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn classify(
    State(state): State<AppState>,
    PriorityHeader(header, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<ClassifyRequest, OpenAi>,
) -> Result<Response, Shaped<OpenAi>> {
    let infinity = req.raw_scores.is_some();
    let out = classify_scores(&state, header, req).await?;
    Ok(if infinity {
        Json(infinity_answer(out)).into_response()
    } else {
        Json(vllm_answer(out)).into_response()
    })
}

/// Every input's label scores through the one scoring path: probabilities,
/// or the raw logits where the request asks for them in its API's words
/// (vLLM's `use_activation: false` or older names, Infinity's `raw_scores: true`).
async fn classify_scores(
    state: &AppState,
    header: Option<Priority>,
    req: ClassifyRequest,
) -> Result<ScoreOutput, ApiError> {
    let truncate_to = VllmOptions {
        truncate_prompt_tokens: req.truncate_prompt_tokens,
        add_special_tokens: req.add_special_tokens,
        embed_dtype: None,
    }
    .truncate_to()?;
    let activate = req
        .use_activation
        .or(req.softmax)
        .or(req.activation)
        .unwrap_or(true);
    let raw = !activate || req.raw_scores == Some(Some(true));
    let truncate = req.truncate.unwrap_or(true);
    let inputs = req.input.into_inputs();
    score(
        state,
        ScoreRequest {
            model: req.model,
            task: Task::Predict,
            inputs,
            options: EmbedOptions {
                truncate,
                truncation_direction: req.truncation_side.map(Into::into),
                truncate_to,
                priority: req
                    .priority
                    .map(Priority::from_vllm)
                    .or(header)
                    .unwrap_or_default(),
                ..EmbedOptions::default()
            },
            raw_scores: raw,
        },
    )
    .await
    .map_err(|e| e.cut_by("truncate_prompt_tokens"))
}

/// vLLM's answer: per input, the best label and every label's score in the
/// model's order.
fn vllm_answer(out: ScoreOutput) -> ClassifyResponse {
    let data = out
        .scores
        .into_iter()
        .enumerate()
        .map(|(index, probs)| ClassifyData {
            index,
            label: out.labels[best(&probs)].clone(),
            num_classes: probs.len(),
            probs,
        })
        .collect();
    ClassifyResponse {
        id: response_id("classify"),
        object: "list",
        created: unix_now(),
        model: out.model,
        data,
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
    }
}

/// Infinity's answer: per input, every label's score, best first (as the
/// Hugging Face pipeline Infinity runs, `top_k=None`, sorts them).
fn infinity_answer(out: ScoreOutput) -> InfinityClassifyResponse {
    let data = out
        .scores
        .iter()
        .zip(&out.logits)
        .map(|(scores, logits)| {
            ranking(logits)
                .into_iter()
                .map(|i| InfinityLabelScore {
                    score: scores[i],
                    label: out.labels[i].clone(),
                })
                .collect()
        })
        .collect();
    InfinityClassifyResponse {
        object: "classify",
        data,
        model: out.model,
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
        id: response_id("classify"),
        created: unix_now(),
    }
}

/// The index of the highest score (the first of equals), as vLLM's argmax picks it.
fn best(scores: &[f32]) -> usize {
    scores
        .iter()
        .enumerate()
        .fold(0, |best, (i, s)| if *s > scores[best] { i } else { best })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_is_the_first_highest() {
        assert_eq!(best(&[0.1, 0.7, 0.2]), 1);
        assert_eq!(best(&[0.5, 0.5]), 0);
        assert_eq!(best(&[-3.0]), 0);
    }
}
