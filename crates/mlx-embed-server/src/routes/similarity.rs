//! `POST /similarity` (Hugging Face TEI, `InferenceClient.sentence_similarity`):
//! cosine similarity of a source sentence to others, from the one embed path.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Priority, Prompt};
use serde::Deserialize;
use utoipa::ToSchema;

use crate::embed::{embed as run_embed, unit_cosine, EmbedRequest};
use crate::errors::{ApiError, Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, PriorityHeader, TruncationSide};
use crate::models::Task;
use crate::state::AppState;

#[derive(Debug, Deserialize, ToSchema)]
pub struct SimilarityInputs {
    pub source_sentence: String,
    /// Sentences to compare with the source (at least one).
    #[schema(min_items = 1)]
    pub sentences: Vec<String>,
}

#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct SimilarityParameters {
    pub truncate: Option<bool>,
    pub truncation_direction: Option<TruncationSide>,
    pub prompt_name: Option<String>,
}

/// TEI similarity request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct SimilarityRequest {
    /// Which served embedding model answers (not a TEI field); default: the first one.
    pub model: Option<String>,
    pub inputs: SimilarityInputs,
    pub parameters: Option<SimilarityParameters>,
    /// Jina AI's (not a TEI field): the task adapter to run with, one of the
    /// model's `tasks` (`/info` lists them: jina-embeddings-v3's), as on
    /// `/embed`. A model without task adapters, an unknown task, or a
    /// `prompt_name` that names another task, is a 400.
    pub task: Option<String>,
}

/// Cosine similarity of each sentence to the source, in order.
pub(crate) async fn similarities(
    state: &AppState,
    req: SimilarityRequest,
    priority: Option<Priority>,
) -> Result<Vec<f32>, ApiError> {
    if req.inputs.sentences.is_empty() {
        return Err(
            ApiError::invalid("inputs.sentences is empty: send at least one").param("inputs"),
        );
    }
    let p = req.parameters.unwrap_or_default();
    let pick = super::pick_task(
        state,
        req.model.as_deref(),
        req.task,
        super::Said::Prompt(p.prompt_name.map_or(Prompt::Default, Prompt::Named)),
    )?;
    let mut inputs = Vec::with_capacity(req.inputs.sentences.len() + 1);
    inputs.push(EmbedInput::Text(req.inputs.source_sentence));
    inputs.extend(req.inputs.sentences.into_iter().map(EmbedInput::Text));
    let out = run_embed(
        state,
        EmbedRequest {
            empty_texts: false,
            model: req.model,
            inputs,
            options: EmbedOptions {
                truncate: p.truncate.unwrap_or(true),
                truncation_direction: p.truncation_direction.map(Into::into),
                prompt: pick.prompt,
                priority: priority.unwrap_or_default(),
                task: pick.task,
                ..EmbedOptions::default()
            },
            // Unit vectors: the dot product is the cosine.
            normalize: true,
            dimensions: None,
        },
    )
    .await
    // Input 0 is the source sentence; input k is sentences[k - 1].
    .map_err(|e| {
        e.renaming_input(|i| match i {
            0 => "inputs.source_sentence".to_string(),
            k => format!("inputs.sentences[{}]", k - 1),
        })
    })?;
    let (source, others) = out.vectors.split_first().expect("one vector per input");
    Ok(others.iter().map(|v| unit_cosine(source, v)).collect())
}

/// Cosine similarity of sentences to a source sentence.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/similarity", tag = "tei", operation_id = "tei_similarity",
    request_body = SimilarityRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "One similarity per sentence, in order", body = Vec<f32>),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400, 401, 404 unknown model (below), 413, 415, 422, 429)", Task::Embed), body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn similarity(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<SimilarityRequest, Tei>,
) -> Result<Json<Vec<f32>>, Shaped<Tei>> {
    Ok(Json(similarities(&state, req, priority).await?))
}
