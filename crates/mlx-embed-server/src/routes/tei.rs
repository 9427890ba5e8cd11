//! `POST /embed`: Hugging Face text-embeddings-inference compatible.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedOptions, Priority, Prompt};
use serde::Deserialize;
use utoipa::ToSchema;

use crate::embed::{embed as run_embed, EmbedRequest};
use crate::errors::{Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, PriorityHeader, TextInputs, TruncationSide};
use crate::state::AppState;

/// TEI embed request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TeiEmbedRequest {
    /// Which served model answers (not a TEI field: TEI serves one); default: the first embedding model.
    pub model: Option<String>,
    /// A text or a list of texts.
    pub inputs: TextInputs,
    /// Unit-length vectors (default true).
    pub normalize: Option<bool>,
    /// Truncate inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` (default) keeps the start of an over-long input, `Left` its end (any case).
    pub truncation_direction: Option<TruncationSide>,
    /// One of the model's named prompts (`/info` lists them); default: the model's default prompt.
    pub prompt_name: Option<String>,
    /// Keep the first N components (1..=dimension), re-normalized when `normalize`.
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
}

impl TeiEmbedRequest {
    /// The one embed path's request for this TEI request.
    /// `priority`: the `X-Priority` header's lane, if any.
    pub(crate) fn into_request(self, priority: Option<Priority>) -> EmbedRequest {
        EmbedRequest {
            model: self.model,
            inputs: self.inputs.into_inputs(),
            options: EmbedOptions {
                truncate: self.truncate.unwrap_or(true),
                truncation_direction: self
                    .truncation_direction
                    .map(Into::into)
                    .unwrap_or_default(),
                prompt: self.prompt_name.map_or(Prompt::Default, Prompt::Named),
                priority: priority.unwrap_or_default(),
            },
            normalize: self.normalize.unwrap_or(true),
            dimensions: self.dimensions,
        }
    }
}

/// Embed texts; answers a bare list of vectors.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/embed", tag = "tei", operation_id = "tei_embed",
    request_body = TeiEmbedRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "One vector per input, in order", body = Vec<Vec<f32>>),
        (status = "4XX", description = "Invalid request (400, 401, 413, 415, 422, 429)", body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn embed(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<TeiEmbedRequest, Tei>,
) -> Result<Json<Vec<Vec<f32>>>, Shaped<Tei>> {
    let out = run_embed(&state, req.into_request(priority)).await?;
    Ok(Json(out.vectors))
}
