//! Weaviate's `text2vec-transformers` inference API, so Weaviate can use this
//! server as its `TRANSFORMERS_INFERENCE_API`: `POST /vectors` (one `text`,
//! or a batch of `texts`), `GET /meta`, and the probes Weaviate waits on,
//! `GET /.well-known/live` and `GET /.well-known/ready`.
//!
//! Weaviate posts a single text without a content type, so `/vectors` reads
//! any body as JSON ([`crate::errors::Flavor::ANY_CONTENT_TYPE`]). Vectors are unit length; `config.pooling_strategy` is
//! accepted and ignored (the model's own pooling applies, as in Weaviate's
//! sentence-transformers images), `config.task_type` picks the model's
//! `query` or `passage`/`document` prompt where it has one (on a model with
//! task adapters, its `retrieval.query` or `retrieval.passage` task), and
//! Jina AI's `task` (top level, as on the other routes) picks a task.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{pick_task, Role, Said};
use crate::embed::{embed as run_embed, EmbedRequest};
use crate::errors::{ApiError, Shaped, Weaviate, WeaviateErrorBody};
use crate::extract::{wire_names, ApiJson, PriorityHeader, WireName};
use crate::models::Task;
use crate::state::AppState;

/// Which side of a search the text is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskType {
    Query,
    Passage,
    /// What Weaviate's 2024 releases sent for an object (later ones send
    /// `passage`): the model's `document` prompt first, then `passage`.
    Document,
}

wire_names!(TaskType {
    Query => "query",
    Passage => "passage",
    Document => "document",
});

/// Weaviate's per-request settings.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct VectorsConfig {
    /// Accepted and ignored: the model's own pooling applies.
    pub pooling_strategy: Option<String>,
    /// `query`, `passage` or `document`: the model's prompt of that role, if it has one.
    pub task_type: Option<TaskType>,
    /// Keep the first N components (1..=dimension), re-normalized.
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
}

/// One `text`, or a batch of `texts`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct VectorsRequest {
    pub text: Option<String>,
    pub texts: Option<Vec<String>>,
    #[serde(default)]
    pub config: VectorsConfig,
    /// Jina AI's (not a Weaviate field): the task adapter to run with, one
    /// of the model's `tasks` (`/info` lists them: jina-embeddings-v3's),
    /// with its prompt of that name. A model without task adapters, an
    /// unknown task, or a `config.task_type` that picks another task, is a 400.
    pub task: Option<String>,
}

/// The answer to one `text`.
#[derive(Debug, Serialize, ToSchema)]
pub struct VectorResponse {
    pub text: String,
    pub dims: usize,
    pub vector: Vec<f32>,
}

/// The answer to a batch of `texts`, in order.
#[derive(Debug, Serialize, ToSchema)]
pub struct VectorsBatchResponse {
    pub dims: usize,
    pub vectors: Vec<Vec<f32>>,
}

/// `/vectors` answers in the form it was asked in.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum VectorsResponse {
    One(VectorResponse),
    Batch(VectorsBatchResponse),
}

/// Embed one text or a batch (Weaviate `text2vec-transformers`).
///
/// Errors use `{"error": str}`.
#[utoipa::path(
    post, path = "/vectors", tag = "weaviate", operation_id = "weaviate_vectors",
    request_body = VectorsRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "The vector, or the vectors in input order", body = VectorsResponse),
        (status = "4XX", description = "Invalid request (400 incl. no embedding model served, 401, 413, 415 a compressed body, 422, 429)", body = WeaviateErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = WeaviateErrorBody),
    )
)]
pub async fn vectors(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Weaviate>,
    ApiJson(req, _): ApiJson<VectorsRequest, Weaviate>,
) -> Result<Json<VectorsResponse>, Shaped<Weaviate>> {
    let (texts, one) = match (req.text, req.texts) {
        (Some(text), None) => (vec![text], true),
        (None, Some(texts)) => (texts, false),
        _ => {
            return Err(
                ApiError::invalid("send either `text` (one) or `texts` (a batch)")
                    .param("text")
                    .into(),
            )
        }
    };
    let model = state.model_for(None, Task::Embed)?;
    let pick = pick_task(
        &state,
        Some(&model.name),
        req.task,
        Said::role(
            "task_type",
            req.config.task_type.map(|t| {
                let role = match t {
                    TaskType::Query => Role::Query,
                    TaskType::Passage => Role::Passage,
                    TaskType::Document => Role::Document,
                };
                (t.name(), role)
            }),
        ),
    )?;
    let out = run_embed(
        &state,
        EmbedRequest {
            empty_texts: false,
            model: Some(model.name.clone()),
            inputs: texts.iter().cloned().map(EmbedInput::Text).collect(),
            options: EmbedOptions {
                prompt: pick.prompt,
                task: pick.task,
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            normalize: true,
            dimensions: req.config.dimensions,
        },
    )
    .await?;
    let dims = out.dimension;
    Ok(Json(if one {
        VectorsResponse::One(VectorResponse {
            text: texts.into_iter().next().unwrap_or_default(),
            dims,
            vector: out.vectors.into_iter().next().unwrap_or_default(),
        })
    } else {
        VectorsResponse::Batch(VectorsBatchResponse {
            dims,
            vectors: out.vectors,
        })
    }))
}

/// What Weaviate shows of the model.
#[derive(Debug, Serialize, ToSchema)]
pub struct MetaModel {
    /// The served name.
    pub name: String,
    /// The architecture (`config.json`'s `model_type`), if the model says.
    pub model_type: Option<String>,
    pub dimension: usize,
    pub max_input_tokens: usize,
    pub pooling: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MetaResponse {
    pub model: MetaModel,
}

/// The embedding model (Weaviate's `/v1/meta` shows it).
#[utoipa::path(
    get, path = "/meta", tag = "weaviate", operation_id = "weaviate_meta",
    responses(
        (status = 200, description = "The default embedding model", body = MetaResponse),
        (status = 400, description = "No embedding model is served", body = WeaviateErrorBody),
    )
)]
pub async fn meta(State(state): State<AppState>) -> Result<Json<MetaResponse>, Shaped<Weaviate>> {
    let model = state.model_for(None, Task::Embed)?;
    let info = model.info();
    Ok(Json(MetaResponse {
        model: MetaModel {
            name: model.name.clone(),
            model_type: info.weights.as_ref().map(|w| w.architecture.clone()),
            dimension: info.dim,
            max_input_tokens: info.max_input_tokens,
            pooling: info.details.get("pooling").cloned(),
        },
    }))
}

/// Liveness: 204 while the process serves HTTP (no API key needed).
#[utoipa::path(
    get, path = "/.well-known/live", tag = "weaviate", operation_id = "weaviate_live",
    responses((status = 204, description = "Alive"))
)]
pub async fn live() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// Readiness: 204 while every model can answer, else 503, like `/health` (no API key needed).
#[utoipa::path(
    get, path = "/.well-known/ready", tag = "weaviate", operation_id = "weaviate_ready",
    responses((status = 204, description = "Ready"), (status = 503, description = "A model thread is gone, or shutting down"))
)]
pub async fn ready(State(state): State<AppState>) -> StatusCode {
    if state.is_ready() {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}
