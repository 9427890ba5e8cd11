//! Reranking: `POST /rerank` (Hugging Face TEI's shape, or the Cohere/Jina
//! shape Infinity and vLLM serve there) and `POST /v1/rerank`,
//! `POST /v2/rerank` (Cohere / Jina; the `cohere` Python client works with
//! `base_url`). Each document becomes one query/document pair input of the
//! one scoring path ([`crate::score`]).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Priority};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::Usage;
use crate::errors::{ApiError, ErrorKind, OpenAi, OpenAiErrorBody, Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, PriorityHeader, TruncationSide};
use crate::models::Task;
use crate::score::{ranking, score, ScoreOutput, ScoreRequest};
use crate::state::AppState;

/// TEI rerank request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TeiRerankRequest {
    /// Which served reranker answers (not a TEI field); default: the first reranker.
    pub model: Option<String>,
    pub query: String,
    /// Documents to score against the query (at least one).
    pub texts: Vec<String>,
    /// Raw logits instead of sigmoid scores (default false).
    #[serde(default)]
    pub raw_scores: bool,
    /// Echo each document in its result (default false).
    #[serde(default)]
    pub return_text: bool,
    /// Cut pairs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` (default) keeps the start of each side, `Left` its end (any case).
    pub truncation_direction: Option<TruncationSide>,
}

/// One ranked document.
#[derive(Debug, Serialize, ToSchema)]
pub struct TeiRank {
    /// Position of the document in the request's `texts`.
    pub index: usize,
    pub score: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Rank documents by relevance to a query; best first.
///
/// TEI's shape (`texts`). A body with `documents` instead, the shape
/// Infinity, vLLM and Jina serve on this path, is answered as `/v1/rerank`
/// answers it (Cohere/Jina response and errors).
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/rerank", tag = "tei", operation_id = "tei_rerank",
    request_body = TeiRerankRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Documents best first (a `documents` body: the /v1/rerank response)", body = Vec<TeiRank>),
        (status = "4XX", description = "Invalid request (400 also: no reranker served; 401, 404 unknown model, 413, 415, 422, 429)", body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn tei_rerank(
    State(state): State<AppState>,
    priority: Result<PriorityHeader<Tei>, Shaped<Tei>>,
    ApiJson(body, _): ApiJson<serde_json::Value, Tei>,
) -> Response {
    // A bad X-Priority is answered in the shape of the body's API, known only now.
    let priority = priority.map(|header| header.0).map_err(|shaped| shaped.0);
    if body.get("documents").is_some() && body.get("texts").is_none() {
        let answer = match (priority, parse::<CohereRerankRequest>(body)) {
            (Ok(priority), Ok(req)) => cohere_rerank(&state, req, "1", true, priority).await,
            (Err(e), _) | (_, Err(e)) => Err(e.into()),
        };
        return answer.into_response();
    }
    match (priority, parse::<TeiRerankRequest>(body)) {
        (Ok(priority), Ok(req)) => tei_rank(&state, req, priority).await.into_response(),
        (Err(e), _) | (_, Err(e)) => Shaped::<Tei>::from(e).into_response(),
    }
}

/// A JSON body already read, as `T`; a wrong shape is a 422 as for any route.
fn parse<T: serde::de::DeserializeOwned>(body: serde_json::Value) -> Result<T, ApiError> {
    serde_json::from_value(body).map_err(|e| {
        ApiError::new(
            ErrorKind::Unprocessable,
            format!("Failed to deserialize the JSON body into the target type: {e}"),
        )
    })
}

async fn tei_rank(
    state: &AppState,
    req: TeiRerankRequest,
    priority: Option<Priority>,
) -> Result<Json<Vec<TeiRank>>, Shaped<Tei>> {
    let out = score(
        state,
        pairs_request(
            req.model,
            &req.query,
            &req.texts,
            EmbedOptions {
                truncate: req.truncate.unwrap_or(true),
                truncation_direction: req.truncation_direction.map(Into::into).unwrap_or_default(),
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            req.raw_scores,
        )
        .map_err(|e| e.param("texts"))?,
    )
    .await?;
    let scores = first_label(&out);
    let mut texts: Vec<Option<String>> = req.texts.into_iter().map(Some).collect();
    Ok(Json(
        ranking(&scores)
            .into_iter()
            .map(|index| TeiRank {
                index,
                score: scores[index],
                text: if req.return_text {
                    texts[index].take()
                } else {
                    None
                },
            })
            .collect(),
    ))
}

/// A Cohere/Jina document: a string, or an object with `text`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum RerankDocument {
    Text(String),
    Object { text: String },
}

impl RerankDocument {
    fn into_text(self) -> String {
        match self {
            RerankDocument::Text(t) | RerankDocument::Object { text: t } => t,
        }
    }
}

/// Cohere (v1 and v2) / Jina rerank request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CohereRerankRequest {
    /// Which served reranker answers; default: the first reranker. Unknown: 404.
    pub model: Option<String>,
    pub query: String,
    /// Documents to score (at least one): strings or `{"text": ...}` objects.
    pub documents: Vec<RerankDocument>,
    /// How many results to return, best first (>= 1; default all).
    pub top_n: Option<i64>,
    /// Include each document's text in its result (v1 and Jina default: true; v2: false).
    pub return_documents: Option<bool>,
    /// Accepted and ignored (Cohere's chunking options).
    pub max_chunks_per_doc: Option<i64>,
    /// Accepted and ignored: documents are cut to the model's maximum.
    pub max_tokens_per_doc: Option<i64>,
    /// Accepted and ignored.
    pub rank_fields: Option<Vec<String>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereDocument {
    pub text: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereResult {
    /// Position of the document in the request's `documents`.
    pub index: usize,
    /// Sigmoid score in [0, 1].
    pub relevance_score: f32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<CohereDocument>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereApiVersion {
    pub version: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereBilledUnits {
    pub search_units: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereMeta {
    pub api_version: CohereApiVersion,
    pub billed_units: CohereBilledUnits,
}

/// Cohere/Jina rerank response: Cohere's `id`, `results`, `meta`; Jina's `model`, `usage`.
#[derive(Debug, Serialize, ToSchema)]
pub struct CohereRerankResponse {
    pub id: String,
    pub model: String,
    /// Best first.
    pub results: Vec<CohereResult>,
    pub meta: CohereMeta,
    pub usage: Usage,
}

/// Rank documents (Cohere v1 / Jina shape); best first.
///
/// Errors use `{"error": {"message", "type", "param", "code"}}`.
#[utoipa::path(
    post, path = "/v1/rerank", tag = "cohere", operation_id = "cohere_rerank_v1",
    request_body = CohereRerankRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Documents best first", body = CohereRerankResponse),
        (status = "4XX", description = "Invalid request (400 also: top_n < 1, no reranker served; 401, 404 unknown model, 413, 415, 422, 429)", body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn cohere_rerank_v1(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<CohereRerankRequest, OpenAi>,
) -> Result<Json<CohereRerankResponse>, Shaped<OpenAi>> {
    cohere_rerank(&state, req, "1", true, priority).await
}

/// Rank documents (Cohere v2 shape, `cohere.ClientV2`); best first.
///
/// Errors use `{"error": {"message", "type", "param", "code"}}`.
#[utoipa::path(
    post, path = "/v2/rerank", tag = "cohere", operation_id = "cohere_rerank_v2",
    request_body = CohereRerankRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Documents best first", body = CohereRerankResponse),
        (status = "4XX", description = "Invalid request (as /v1/rerank)", body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn cohere_rerank_v2(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<CohereRerankRequest, OpenAi>,
) -> Result<Json<CohereRerankResponse>, Shaped<OpenAi>> {
    cohere_rerank(&state, req, "2", false, priority).await
}

async fn cohere_rerank(
    state: &AppState,
    req: CohereRerankRequest,
    version: &str,
    documents_by_default: bool,
    priority: Option<Priority>,
) -> Result<Json<CohereRerankResponse>, Shaped<OpenAi>> {
    let top_n = match req.top_n {
        None => None,
        Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(
                ApiError::invalid(format!("top_n must be at least 1, got {n}"))
                    .param("top_n")
                    .into(),
            )
        }
    };
    let texts: Vec<String> = req
        .documents
        .into_iter()
        .map(RerankDocument::into_text)
        .collect();
    let out = score(
        state,
        pairs_request(
            req.model,
            &req.query,
            &texts,
            EmbedOptions {
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            false,
        )
        .map_err(|e| e.param("documents"))?,
    )
    .await?;
    let scores = first_label(&out);
    let with_documents = req.return_documents.unwrap_or(documents_by_default);
    let mut texts: Vec<Option<String>> = texts.into_iter().map(Some).collect();
    let mut order = ranking(&scores);
    order.truncate(top_n.unwrap_or(order.len()));
    let results = order
        .into_iter()
        .map(|index| CohereResult {
            index,
            relevance_score: scores[index],
            document: if with_documents {
                texts[index].take().map(|text| CohereDocument { text })
            } else {
                None
            },
        })
        .collect();
    Ok(Json(CohereRerankResponse {
        id: super::response_id("rerank"),
        model: out.model,
        results,
        meta: CohereMeta {
            api_version: CohereApiVersion {
                version: version.into(),
            },
            billed_units: CohereBilledUnits { search_units: 1 },
        },
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
    }))
}

/// One pair input per document.
fn pairs_request(
    model: Option<String>,
    query: &str,
    texts: &[String],
    options: EmbedOptions,
    raw_scores: bool,
) -> Result<ScoreRequest, ApiError> {
    if texts.is_empty() {
        return Err(ApiError::invalid("no documents to rank: send at least one"));
    }
    Ok(ScoreRequest {
        model,
        task: Task::Rerank,
        inputs: texts
            .iter()
            .map(|d| EmbedInput::Pair {
                query: query.to_owned(),
                document: d.clone(),
            })
            .collect(),
        options,
        raw_scores,
    })
}

/// A reranker has one label: its scores as a flat list.
fn first_label(out: &ScoreOutput) -> Vec<f32> {
    out.scores.iter().map(|row| row[0]).collect()
}
