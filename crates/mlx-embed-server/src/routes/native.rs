//! `POST /api/v1/embed`: the native API.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Output};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{pick_task, prompt_of, Said, Usage};
use crate::embed::{embed as run_embed, EmbedRequest};
use crate::errors::{Native, NativeErrorBody, Shaped};
use crate::extract::{ApiJson, PriorityHeader, PriorityName, TruncationSide};
use crate::models::Task;
use crate::state::AppState;

/// Native embed request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct NativeEmbedRequest {
    /// Which served model answers (`/v1/models` lists them); default: the first embedding model.
    pub model: Option<String>,
    /// Texts to embed (1 to `--max-inputs-per-request`), none empty.
    #[schema(min_items = 1)]
    pub texts: Vec<String>,
    /// Unit-length vectors (default true).
    pub normalize: Option<bool>,
    /// Truncate inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// Which end of an over-long input to keep: `right` keeps the start, `left` the end;
    /// unsaid: the model folder's `truncation_side`, else right.
    pub truncation_direction: Option<TruncationSide>,
    /// Cut (or with `truncate: false` refuse) texts at this many tokens, special tokens
    /// included, instead of the model's maximum (a larger value is the maximum).
    #[schema(minimum = 1)]
    pub truncate_to: Option<i64>,
    /// One of the model's named prompts (`/info` lists them) prepended to every text;
    /// default: the model's default prompt, if it has one.
    pub prompt_name: Option<String>,
    /// Text prepended to every text instead of a named prompt (`""`: none at all).
    pub prompt: Option<String>,
    /// The task adapter to run with, one of the model's `tasks` (`/info`
    /// lists them: jina-embeddings-v3's), with its prompt of that name unless
    /// `prompt_name` or `prompt` says another; a model without task adapters,
    /// an unknown task, or a `prompt_name` that names another task, is a 400.
    pub task: Option<String>,
    /// `high`, `normal` (default) or `low`: higher lanes are served first. Wins over an
    /// `X-Priority` header.
    pub priority: Option<PriorityName>,
    /// Keep the first N components (1..=dimension), re-normalized when `normalize`.
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
}

/// Native embed response.
#[derive(Debug, Serialize, ToSchema)]
pub struct NativeEmbedResponse {
    /// One vector per text, in order.
    pub embeddings: Vec<Vec<f32>>,
    pub model: String,
    /// Length of each vector.
    pub dimension: usize,
    pub usage: Usage,
}

/// Embed texts.
///
/// Errors use `{"error": {"message", "type", "code"}}`; status codes as in the crate docs
/// (400, 401, 404 unknown model, 413, 415, 422, 429 with Retry-After, 500, 503).
#[utoipa::path(
    post, path = "/api/v1/embed", tag = "native", operation_id = "native_embed",
    request_body = NativeEmbedRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "Embeddings in input order", body = NativeEmbedResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400, 401, 404 unknown model (below), 413, 415, 422, 429)", Task::Embed), body = NativeErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = NativeErrorBody),
    )
)]
pub async fn embed(
    State(state): State<AppState>,
    PriorityHeader(header, _): PriorityHeader<Native>,
    ApiJson(req, _): ApiJson<NativeEmbedRequest, Native>,
) -> Result<Json<NativeEmbedResponse>, Shaped<Native>> {
    let pick = pick_task(
        &state,
        req.model.as_deref(),
        req.task,
        Said::Prompt(prompt_of(req.prompt_name, req.prompt)?),
    )?;
    let options = EmbedOptions {
        priority: req.priority.map(Into::into).or(header).unwrap_or_default(),
        truncate: req.truncate.unwrap_or(true),
        truncation_direction: req.truncation_direction.map(Into::into),
        truncate_to: super::cut_at("truncate_to", req.truncate_to)?,
        prompt: pick.prompt,
        output: Output::Pooled,
        max_token_rows: None,
        wrapped_token_ids: false,
        token_pooling: None,
        task: pick.task,
    };
    let out = run_embed(
        &state,
        EmbedRequest {
            empty_texts: false,
            model: req.model,
            inputs: req.texts.into_iter().map(EmbedInput::Text).collect(),
            options,
            normalize: req.normalize.unwrap_or(true),
            dimensions: req.dimensions,
        },
    )
    .await
    .map_err(|e| e.cut_by("truncate_to"))?;
    Ok(Json(NativeEmbedResponse {
        embeddings: out.vectors,
        model: out.model,
        dimension: out.dimension,
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
    }))
}
