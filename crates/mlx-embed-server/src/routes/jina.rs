//! `POST /v1/multi-vector` (Jina AI's API for its ColBERT models): per input
//! one unit vector per token of a multi-vector (ColBERT) model, a thin
//! adapter into the one embed path ([`Output::MultiVector`]).

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Output, Side};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::embed::{embed_multi_vector, EmbedRequest};
use crate::errors::{ApiError, OpenAi, OpenAiErrorBody, Shaped};
use crate::extract::{ApiJson, PriorityHeader};
use crate::models::Task;
use crate::state::AppState;

/// One input: a text, or Jina's object form `{"text": ...}`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MultiVectorInput {
    Text(String),
    Object { text: String },
}

/// What the inputs are: each has its own tokenization (a query is cut to
/// the model's query length and padded with expansion tokens; a document
/// is cut to its document length and keeps no punctuation rows).
#[derive(Debug, Default, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum InputType {
    Query,
    #[default]
    Document,
}

/// Jina multi-vector request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct MultiVectorRequest {
    /// Which served multi-vector model answers; default: the first one.
    pub model: Option<String>,
    /// Texts (at least one), as strings or `{"text": ...}` objects.
    #[schema(min_items = 1)]
    pub input: Vec<MultiVectorInput>,
    /// `document` (default) or `query`.
    #[serde(default)]
    pub input_type: InputType,
    /// `float` only (Jina's `binary` / `ubinary` / `base64` are refused).
    pub embedding_type: Option<String>,
    /// The model's own width only: a ColBERT model's projection is not
    /// trained to be cut (jina-colbert-v2's Matryoshka widths are its own).
    pub dimensions: Option<i64>,
    /// `true` (default): a text is cut to the model's query or document
    /// length, as PyLate cuts it. `false`: a text over that length (special
    /// tokens and the query/document marker counted; a query's expansion
    /// not) is refused instead (400 `context_length_exceeded`, as the other
    /// `/v1` routes answer an over-long input), naming the length.
    pub truncate: Option<bool>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MultiVectorData {
    /// Always `embeddings`.
    pub object: &'static str,
    pub index: usize,
    /// One unit vector per kept token, in token order.
    pub embeddings: Vec<Vec<f32>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MultiVectorUsage {
    pub total_tokens: u64,
    pub prompt_tokens: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MultiVectorResponse {
    pub model: String,
    /// Always `list`.
    pub object: &'static str,
    pub usage: MultiVectorUsage,
    pub data: Vec<MultiVectorData>,
}

/// Per-token vectors of a multi-vector (ColBERT) model, as PyLate's
/// `encode(is_query=...)` gives them: a query's rows for its
/// `query_length` tokens (its `[MASK]` expansion included), a document's
/// rows less its punctuation (the skiplist); each row unit length. Another
/// model is a 400; so are `embedding_type` other than `float` and
/// `dimensions` other than the model's width. With `truncate: false` a text
/// longer than the model's query (or document) length is a 400 too.
///
/// Errors use OpenAI's `{"error": {...}}` shape.
#[utoipa::path(
    post, path = "/v1/multi-vector", tag = "jina", operation_id = "jina_multi_vector",
    request_body = MultiVectorRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Per input, in order: its token vectors", body = MultiVectorResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a model that is not a multi-vector model, an embedding_type other than float, dimensions other than the model's, a text over the query or document length with `truncate: false`; 401, 404 unknown model (below), 413, 415, 429)", Task::MultiVector), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn multi_vector(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<MultiVectorRequest, OpenAi>,
) -> Result<Json<MultiVectorResponse>, Shaped<OpenAi>> {
    Ok(Json(answer(&state, req, priority).await?))
}

async fn answer(
    state: &AppState,
    req: MultiVectorRequest,
    priority: Option<mlx_embed_core::Priority>,
) -> Result<MultiVectorResponse, ApiError> {
    if let Some(kind) = req.embedding_type.as_deref().filter(|k| *k != "float") {
        return Err(ApiError::invalid(format!(
            "embedding_type {kind:?} is not supported: only \"float\""
        ))
        .param("embedding_type"));
    }
    if let Some(n) = req.dimensions {
        let dim = state
            .model_for(req.model.as_deref(), Task::MultiVector)?
            .info()
            .dim;
        if usize::try_from(n).ok() != Some(dim) {
            return Err(ApiError::invalid(format!(
                "dimensions {n}: this model's vectors are {dim} wide and are not cut"
            ))
            .param("dimensions"));
        }
    }
    let side = match req.input_type {
        InputType::Query => Side::Query,
        InputType::Document => Side::Document,
    };
    let inputs = req
        .input
        .into_iter()
        .map(|i| match i {
            MultiVectorInput::Text(text) | MultiVectorInput::Object { text } => {
                EmbedInput::Text(text)
            }
        })
        .collect();
    let out = embed_multi_vector(
        state,
        EmbedRequest {
            model: req.model,
            inputs,
            options: EmbedOptions {
                priority: priority.unwrap_or_default(),
                output: Output::MultiVector(side),
                truncate: req.truncate.unwrap_or(true),
                ..EmbedOptions::default()
            },
            normalize: true,
            dimensions: None,
            empty_texts: false,
        },
    )
    .await?;
    let width = out.dimension.max(1);
    let data = out
        .vectors
        .iter()
        .enumerate()
        .map(|(index, rows)| MultiVectorData {
            object: "embeddings",
            index,
            embeddings: rows.chunks_exact(width).map(<[f32]>::to_vec).collect(),
        })
        .collect();
    Ok(MultiVectorResponse {
        model: out.model,
        object: "list",
        usage: MultiVectorUsage {
            total_tokens: out.prompt_tokens,
            prompt_tokens: out.prompt_tokens,
        },
        data,
    })
}
