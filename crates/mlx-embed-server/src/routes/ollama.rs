//! `POST /api/embed`: Ollama compatible.

use std::time::Instant;

use axum::extract::State;
use axum::Json;
use mlx_embed_core::EmbedOptions;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::embed::{embed as run_embed, EmbedRequest};
use crate::errors::{Ollama, OllamaErrorBody, Shaped};
use crate::extract::{ApiJson, PriorityHeader, TextInputs};
use crate::state::AppState;

/// Ollama embed request (`options` and `keep_alive` are accepted and ignored).
#[derive(Debug, Deserialize, ToSchema)]
pub struct OllamaEmbedRequest {
    /// Which served model answers; default: the first embedding model. Unknown: 404.
    pub model: Option<String>,
    /// A text or a list of texts.
    pub input: TextInputs,
    /// Truncate inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// Keep the first N components (1..=dimension), re-normalized.
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
}

/// Ollama embed response. Vectors are unit length.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaEmbedResponse {
    pub model: String,
    pub embeddings: Vec<Vec<f32>>,
    /// Nanoseconds spent on this request.
    pub total_duration: u64,
    /// Nanoseconds spent loading the model for this request: 0, it is loaded at start-up.
    pub load_duration: u64,
    /// Tokens the model ran.
    pub prompt_eval_count: u64,
}

/// Embed texts.
///
/// Errors use `{"error": str}`.
#[utoipa::path(
    post, path = "/api/embed", tag = "ollama", operation_id = "ollama_embed",
    request_body = OllamaEmbedRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "Embeddings in input order", body = OllamaEmbedResponse),
        (status = "4XX", description = "Invalid request (400, 401, 413, 415, 422, 429)", body = OllamaErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OllamaErrorBody),
    )
)]
pub async fn embed(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Ollama>,
    ApiJson(req, _): ApiJson<OllamaEmbedRequest, Ollama>,
) -> Result<Json<OllamaEmbedResponse>, Shaped<Ollama>> {
    let start = Instant::now();
    let out = run_embed(
        &state,
        EmbedRequest {
            model: req.model,
            inputs: req.input.into_inputs(),
            options: EmbedOptions {
                truncate: req.truncate.unwrap_or(true),
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            normalize: true,
            dimensions: req.dimensions,
        },
    )
    .await?;
    Ok(Json(OllamaEmbedResponse {
        model: out.model,
        embeddings: out.vectors,
        total_duration: start.elapsed().as_nanos() as u64,
        load_duration: 0,
        prompt_eval_count: out.prompt_tokens,
    }))
}
