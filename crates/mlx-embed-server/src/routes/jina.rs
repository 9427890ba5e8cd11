//! `POST /v1/multi-vector` (Jina AI's API for its ColBERT models): per input
//! one unit vector per token of a multi-vector (ColBERT) model, a thin
//! adapter into the one embed path ([`Output::MultiVector`]).

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Output, Side, TokenPooling};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::embed::{embed_multi_vector, EmbedRequest};
use crate::errors::{ApiError, OpenAi, OpenAiErrorBody, Shaped};
use crate::extract::{wire_names, ApiJson, PriorityHeader};
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
#[derive(Debug, Default, Clone, Copy, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum InputType {
    Query,
    #[default]
    Document,
}

wire_names!(InputType {
    Query => "query",
    Document => "document",
});

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
    /// PyLate's `pool_factor`, for documents only: each document's rows
    /// after its first `protected_tokens` are clustered (Ward on
    /// `1 - cosine` of the unit rows) into at most `rows / pool_factor`
    /// clusters, each answered as its members' mean, in scipy's cluster
    /// order; the means are not rescaled to unit length (PyLate's). 1 (the
    /// default) pools nothing. At most the model's document length (which
    /// already pools a document into one row). With `input_type: query` a
    /// value over 1 is a 400: PyLate pools no query (it ignores the factor).
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub pool_factor: Option<i64>,
    /// PyLate's `protected_tokens`: a document's leading rows left out of
    /// the pooling (default 1, its `[CLS]` row); documents only, at most
    /// the model's document length.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub protected_tokens: Option<i64>,
}

/// The request's `pool_factor` / `protected_tokens` as the core takes them
/// (`None`: no pooling), checked against the model's `document` length.
fn token_pooling(
    pool_factor: Option<i64>,
    protected_tokens: Option<i64>,
    input_type: InputType,
    document: usize,
) -> Result<Option<TokenPooling>, ApiError> {
    let bound = |param: &'static str, n: i64, least: i64| {
        if n < least || usize::try_from(n).map_or(true, |n| n > document) {
            return Err(ApiError::invalid(format!(
                "{param} {n}: it must be a whole number from {least} to the model's document \
                 length of {document}"
            ))
            .param(param));
        }
        Ok(n as u32)
    };
    let factor = pool_factor
        .map(|n| bound("pool_factor", n, 1))
        .transpose()?;
    let protected = protected_tokens
        .map(|n| bound("protected_tokens", n, 0))
        .transpose()?;
    if let InputType::Query = input_type {
        // PyLate ignores both for a query; an answer that silently left
        // them out would look pooled to the client.
        if let Some(f) = factor.filter(|&f| f > 1) {
            return Err(ApiError::invalid(format!(
                "pool_factor {f} is for documents: a query is never pooled (PyLate's \
                 pool_factor pools documents only); leave it out or send 1"
            ))
            .param("pool_factor"));
        }
        if protected.is_some() {
            return Err(ApiError::invalid(
                "protected_tokens is for documents: a query is never pooled",
            )
            .param("protected_tokens"));
        }
    }
    Ok(match factor {
        Some(factor) if factor > 1 => Some(TokenPooling {
            factor,
            protected: protected.unwrap_or(1),
        }),
        _ => None,
    })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct MultiVectorData {
    /// Always `embeddings`.
    pub object: &'static str,
    pub index: usize,
    /// One unit vector per kept token, in token order; with `pool_factor`
    /// over 1, a document's pooled rows (the protected ones, then one mean
    /// per cluster: not unit length).
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
/// `pool_factor` pools a document's rows as PyLate's
/// `encode(pool_factor=...)` does (hierarchical clustering, each cluster's
/// mean); on a query it is a 400.
///
/// Errors use OpenAI's `{"error": {...}}` shape.
#[utoipa::path(
    post, path = "/v1/multi-vector", tag = "jina", operation_id = "jina_multi_vector",
    request_body = MultiVectorRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Per input, in order: its token vectors", body = MultiVectorResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a model that is not a multi-vector model, an embedding_type other than float, dimensions other than the model's, a text over the query or document length with `truncate: false`, a `pool_factor` below 1 or over the document length or over 1 on a query, `protected_tokens` below 0 or over the document length or on a query; 401, 404 unknown model (below), 413, 415, 429)", Task::MultiVector), body = OpenAiErrorBody),
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
    let pooling = match (req.pool_factor, req.protected_tokens) {
        (None, None) => None,
        (factor, protected) => {
            let model = state.model_for(req.model.as_deref(), Task::MultiVector)?;
            let document = model.info().multi_vector.map_or(0, |m| m.document);
            token_pooling(factor, protected, req.input_type, document)?
        }
    };
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
                token_pooling: pooling,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<MultiVectorRequest, serde_json::Error> {
        serde_json::from_str(body)
    }

    #[test]
    fn pool_factor_is_a_whole_number_or_a_wrong_shape() {
        let req = parse(r#"{"input": ["a"], "pool_factor": 2, "protected_tokens": 0}"#).unwrap();
        assert_eq!((req.pool_factor, req.protected_tokens), (Some(2), Some(0)));
        // A float with no fraction, as Python clients send one.
        assert_eq!(
            parse(r#"{"input": ["a"], "pool_factor": 3.0}"#)
                .unwrap()
                .pool_factor,
            Some(3)
        );
        let req = parse(r#"{"input": ["a"]}"#).unwrap();
        assert_eq!((req.pool_factor, req.protected_tokens), (None, None));
        for bad in ["1.5", "\"2\"", "true", "[2]", "1e30"] {
            let err = parse(&format!(r#"{{"input": ["a"], "pool_factor": {bad}}}"#)).unwrap_err();
            assert!(err.is_data(), "{bad}: {err}");
        }
    }

    #[test]
    fn pool_factor_pools_documents_only_within_the_document_length() {
        let doc = InputType::Document;
        let query = InputType::Query;
        let pooling = |factor, protected| Some(TokenPooling { factor, protected });
        assert_eq!(token_pooling(None, None, doc, 40).unwrap(), None);
        // 1 pools nothing, on either side; protected_tokens defaults to PyLate's 1.
        assert_eq!(token_pooling(Some(1), None, doc, 40).unwrap(), None);
        assert_eq!(token_pooling(Some(1), Some(3), doc, 40).unwrap(), None);
        assert_eq!(token_pooling(Some(1), None, query, 40).unwrap(), None);
        assert_eq!(
            token_pooling(Some(2), None, doc, 40).unwrap(),
            pooling(2, 1)
        );
        assert_eq!(
            token_pooling(Some(40), Some(0), doc, 40).unwrap(),
            pooling(40, 0)
        );
        assert_eq!(
            token_pooling(Some(3), Some(40), doc, 40).unwrap(),
            pooling(3, 40)
        );
        let refused = |factor, protected, side| {
            let err = token_pooling(factor, protected, side, 40).unwrap_err();
            assert_eq!(err.kind, crate::errors::ErrorKind::InvalidRequest);
            (err.param.unwrap(), err.message)
        };
        for n in [0, -1, 41, i64::MAX, i64::MIN] {
            let (param, message) = refused(Some(n), None, doc);
            assert_eq!(param, "pool_factor");
            assert_eq!(
                message,
                format!(
                    "pool_factor {n}: it must be a whole number from 1 to the model's \
                     document length of 40"
                )
            );
        }
        for n in [-1, 41] {
            assert_eq!(refused(Some(2), Some(n), doc).0, "protected_tokens");
        }
        let (param, message) = refused(Some(2), None, query);
        assert_eq!(param, "pool_factor");
        assert!(message.contains("a query is never pooled"), "{message}");
        assert_eq!(refused(None, Some(1), query).0, "protected_tokens");
    }
}
