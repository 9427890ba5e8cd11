//! `POST /score` and `POST /v1/score` (vLLM's score API): relevance of
//! `text_2` to `text_1`. A reranker scores each pair (sigmoid of its logit,
//! through the one scoring path); an embedding model answers the cosine of
//! the two texts' vectors (the one embed path), as vLLM does for both. And
//! vLLM's `GET /version`.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, ModelKind};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::openai::vllm_cut;
use super::{response_id, Usage};
use crate::embed::{embed as run_embed, unit_cosine, EmbedRequest};
use crate::errors::{ApiError, ErrorKind, OpenAi, OpenAiErrorBody, Shaped};
use crate::extract::{ApiJson, PriorityHeader, TextInputs};
use crate::models::Task;
use crate::score::{score, ScoreRequest};
use crate::state::AppState;

/// vLLM score request. Each of the two lists goes by several names, as in
/// vLLM: the first `text_1`, `queries` or `data_1`, the second `text_2`,
/// `documents`, `items` or `data_2` (`queries` with `documents` or `items`,
/// `data_1` with `data_2`, or any other pairing). A body names each list once;
/// one without both lists, or with a list under two names, is a 400. So the
/// schema requires neither `text_1` nor `text_2`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ScoreBody {
    /// Which served model answers; default: the first reranker, else the first embedding model.
    pub model: Option<String>,
    /// One text, or a list (one per `text_2` item). vLLM's other names for it,
    /// `queries` and `data_1`, are read as this.
    #[serde(alias = "queries", alias = "data_1")]
    #[schema(required = false)]
    pub text_1: TextInputs,
    /// A text or a list of texts to score against `text_1` (also read from
    /// vLLM's `documents`, `items` and `data_2`).
    #[serde(alias = "documents", alias = "items", alias = "data_2")]
    #[schema(required = false)]
    pub text_2: TextInputs,
    /// Cut texts (a reranker: pairs) longer than the model's maximum (default true);
    /// false answers 400 instead, as vLLM refuses an over-long input.
    pub truncate: Option<bool>,
    /// false: a reranker's raw logits instead of sigmoid scores (an embedding
    /// model's cosine has no activation).
    pub use_activation: Option<bool>,
    /// Cut every input (a reranker: every pair) at this many tokens, special tokens
    /// included, at most the model's maximum; -1 (or none): the model's maximum.
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub truncate_prompt_tokens: Option<i64>,
}

/// One pair's score.
#[derive(Debug, Serialize, ToSchema)]
pub struct ScoreData {
    /// Position of the pair (of the `text_2` item).
    pub index: usize,
    /// Always `score`.
    pub object: &'static str,
    /// Reranker: sigmoid of the logit; embedding model: cosine similarity.
    pub score: f32,
}

/// vLLM score response.
#[derive(Debug, Serialize, ToSchema)]
pub struct ScoreResponse {
    pub id: String,
    /// Always `list`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// One per pair, in pair order.
    pub data: Vec<ScoreData>,
    pub usage: Usage,
}

/// vLLM's pairing: one `text_1` against every `text_2`, or the two lists
/// side by side. Returns both lists, `firsts` one text or as many as
/// `seconds`: pair `i` is `(firsts[i % firsts.len()], seconds[i])`.
fn pair_lists(
    text_1: TextInputs,
    text_2: TextInputs,
) -> Result<(Vec<String>, Vec<String>), ApiError> {
    let firsts = match text_1 {
        TextInputs::One(t) => vec![t],
        TextInputs::Many(v) => v,
    };
    let seconds = match text_2 {
        TextInputs::One(t) => vec![t],
        TextInputs::Many(v) => v,
    };
    if firsts.is_empty() || seconds.is_empty() {
        return Err(ApiError::invalid(
            "text_1 and text_2 must each hold at least one text",
        ));
    }
    if firsts.len() != 1 && firsts.len() != seconds.len() {
        return Err(ApiError::invalid(format!(
            "text_1 has {} texts and text_2 {}: give one text_1, or as many as text_2",
            firsts.len(),
            seconds.len()
        ))
        .param("text_1"));
    }
    Ok((firsts, seconds))
}

/// An error about one input (its index is the pair's) names `list` as its `param`.
fn in_list(err: ApiError, list: &'static str) -> ApiError {
    if err.input_index().is_some() {
        err.param(list)
    } else {
        err
    }
}

/// An error about input `i` of `text_1` followed by `text_2` (the embedding
/// model's one request), told as its own list's: `param` names the list and
/// the message its place there ("input 3 ..." of 2 firsts is text_2's input 1).
fn in_lists(err: ApiError, n_firsts: usize) -> ApiError {
    match err.input_index() {
        None => err,
        Some((i, _)) if i < n_firsts => err.param("text_1"),
        Some(_) => err
            .renaming_input(|i| format!("input {}", i - n_firsts))
            .param("text_2"),
    }
}

/// Score text pairs (vLLM's score API, also at `/score`).
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/v1/score", tag = "vllm", operation_id = "vllm_score",
    request_body = ScoreBody,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "One score per pair, in order", body = ScoreResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 also: text_1 and text_2 lengths disagree, a classifier; 401, 404 unknown model (below), 413, 415, 429; a wrong shape or an over-long input with `truncate: false` is a 400, as vLLM answers)", Task::Score), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn score_pairs(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<ScoreBody, OpenAi>,
) -> Result<Json<ScoreResponse>, Shaped<OpenAi>> {
    let options = EmbedOptions {
        truncate: req.truncate.unwrap_or(true),
        truncate_to: vllm_cut(req.truncate_prompt_tokens)?,
        priority: priority.unwrap_or_default(),
        ..EmbedOptions::default()
    };
    let (firsts, seconds) = pair_lists(req.text_1, req.text_2)?;
    let model = state.model_for(req.model.as_deref(), Task::Score)?;
    let name = Some(model.name.clone());
    let (model, scores, usage) = if matches!(model.info().kind, ModelKind::Reranker { .. }) {
        let bytes = seconds
            .iter()
            .enumerate()
            .map(|(i, document)| firsts[i % firsts.len()].len() + document.len())
            .sum();
        super::rerank::check_pair_bytes(bytes, seconds.len(), "document")?;
        let out = score(
            &state,
            ScoreRequest {
                model: name,
                task: Task::Rerank,
                inputs: seconds
                    .into_iter()
                    .enumerate()
                    .map(|(i, document)| EmbedInput::Pair {
                        query: firsts[i % firsts.len()].clone(),
                        document,
                    })
                    .collect(),
                options,
                raw_scores: req.use_activation == Some(false),
            },
        )
        .await
        .map_err(|e| in_list(e, "text_2").cut_by("truncate_prompt_tokens"))?;
        let scores: Vec<f32> = out.scores.iter().map(|row| row[0]).collect();
        (
            out.model,
            scores,
            Usage::new(out.prompt_tokens, out.cache_hits),
        )
    } else {
        // Each text once (one text_1 is not embedded once per pair), both
        // lists in one request: one admission, one count in /metrics, one
        // batch. The per-request input limit holds for the two together.
        let max_inputs = state.args().max_inputs_per_request;
        if firsts.len() + seconds.len() > max_inputs {
            return Err(ApiError::new(
                ErrorKind::TooLarge,
                format!(
                    "{} texts in text_1 and text_2 together is more than the limit of \
                     {max_inputs} per request (--max-inputs-per-request); split the request",
                    firsts.len() + seconds.len()
                ),
            )
            .param("text_2")
            .into());
        }
        let n_firsts = firsts.len();
        let req = EmbedRequest {
            model: name,
            options,
            // Unit vectors: each pair's dot product is its cosine.
            ..EmbedRequest::new(
                firsts
                    .into_iter()
                    .chain(seconds)
                    .map(EmbedInput::Text)
                    .collect(),
            )
        };
        let out = run_embed(&state, req)
            .await
            .map_err(|e| in_lists(e, n_firsts).cut_by("truncate_prompt_tokens"))?;
        let (a, b) = out.vectors.split_at(n_firsts);
        let scores = b
            .iter()
            .enumerate()
            .map(|(i, y)| unit_cosine(&a[i % n_firsts], y))
            .collect();
        (
            out.model,
            scores,
            Usage::new(out.prompt_tokens, out.cache_hits),
        )
    };
    Ok(Json(ScoreResponse {
        id: response_id("score"),
        object: "list",
        created: super::unix_now(),
        model,
        data: scores
            .into_iter()
            .enumerate()
            .map(|(index, score)| ScoreData {
                index,
                object: "score",
                score,
            })
            .collect(),
        usage,
    }))
}

/// vLLM's version answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct VersionResponse {
    /// This server's version (mlx-embed's, not a vLLM release).
    pub version: String,
}

/// This server's version, where vLLM's server answers its own. vLLM added
/// the route for operators to check which build runs (vllm-project/vllm#3161);
/// no client reads it to decide what the server can do, so it tells the
/// truth rather than a vLLM release number.
#[utoipa::path(
    get, path = "/version", tag = "vllm", operation_id = "vllm_version",
    responses(
        (status = 200, description = "mlx-embed's version", body = VersionResponse),
    )
)]
pub async fn version() -> Json<VersionResponse> {
    Json(VersionResponse {
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_input_error_is_told_in_its_own_lists_words() {
        let too_long = |i: usize| {
            ApiError::new(
                ErrorKind::Unprocessable,
                format!("input {i} has 90 tokens, more than the model's maximum of 64"),
            )
            .code("context_length_exceeded")
        };
        let first = in_lists(too_long(1), 2);
        assert_eq!(
            (first.param.as_deref(), first.message.as_str()),
            (
                Some("text_1"),
                "input 1 has 90 tokens, more than the model's maximum of 64"
            )
        );
        let second = in_lists(too_long(12), 2);
        assert_eq!(
            (second.param.as_deref(), second.message.as_str()),
            (
                Some("text_2"),
                "input 10 has 90 tokens, more than the model's maximum of 64"
            )
        );
        let empty = in_lists(
            ApiError::invalid("input 3 is an empty string").param("input"),
            1,
        );
        assert_eq!(
            (empty.param.as_deref(), empty.message.as_str()),
            (Some("text_2"), "input 2 is an empty string")
        );
        // Not about one input: as it was.
        let other = in_lists(ApiError::invalid("unknown prompt name"), 1);
        assert_eq!(
            (other.param.as_deref(), other.message.as_str()),
            (None, "unknown prompt name")
        );
    }
}
