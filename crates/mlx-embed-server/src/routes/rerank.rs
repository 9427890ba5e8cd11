//! Reranking: `POST /rerank` (Hugging Face TEI's shape, or the Cohere/Jina
//! shape Infinity and vLLM serve there) and `POST /v1/rerank`,
//! `POST /v2/rerank` (Cohere / Jina; the `cohere` Python client works with
//! `base_url`), and NVIDIA NIM's `POST /v1/ranking`. Each document becomes
//! one query/document pair input of the one scoring path ([`crate::score`]).

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{
    EmbedInput, EmbedOptions, Priority, Prompt, TruncationDirection, MAX_PAIR_TEXT_BYTES,
};
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::borrow::Cow;
use utoipa::openapi::schema::{AnyOfBuilder, ArrayBuilder, OneOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::Usage;
use crate::embed::check_inputs;
use crate::errors::{
    ApiError, ErrorKind, OpenAi, OpenAiErrorBody, Shaped, Tei, TeiOrOpenAiErrorBody, TRUNCATE_FIX,
};
use crate::extract::{ApiBody, ApiJson, JsonBody, PriorityHeader, TruncationSide};
use crate::models::Task;
use crate::score::{ranking, score, score_checked, ScoreRequest};
use crate::state::AppState;

/// TEI rerank request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TeiRerankRequest {
    /// Which served reranker answers (not a TEI field); default: the first reranker.
    pub model: Option<String>,
    pub query: String,
    /// Documents to score against the query (at least one).
    #[schema(min_items = 1)]
    pub texts: Vec<String>,
    /// Raw logits instead of sigmoid scores (default false).
    #[serde(default)]
    pub raw_scores: bool,
    /// Echo each document in its result (default false).
    #[serde(default)]
    pub return_text: bool,
    /// Cut pairs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` keeps the start of each side, `Left` its end (any case);
    /// unsaid: the model folder's `truncation_side`, else right.
    pub truncation_direction: Option<TruncationSide>,
    /// A decoder reranker's task instruction in place of its default (not
    /// a TEI field): Qwen3-Reranker's `<Instruct>`, mxbai-rerank v2's
    /// `instruction: ` line, bge-reranker-v2-gemma's prompt after the pair
    /// (FlagEmbedding's `prompt=`; `""` is a prompt of no tokens). A model
    /// without one (a BERT cross-encoder) refuses it.
    #[serde(default)]
    pub instruction: Option<String>,
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
    request_body = RerankBody,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Documents best first (a `documents` body: the /v1/rerank response)", body = RerankAnswer),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 also: no reranker served; 401, 404 unknown model (below), 413, 415, 422, 429). A Cohere-shaped body (`documents`) is answered in the OpenAI error shape, with 400 where this says 422, as /v1/rerank", Task::Rerank), body = TeiOrOpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiOrOpenAiErrorBody),
    )
)]
pub async fn tei_rerank(
    State(state): State<AppState>,
    priority: Result<PriorityHeader<Tei>, Shaped<Tei>>,
    ApiJson(body, _): ApiJson<Value, Tei>,
) -> Response {
    let priority = priority.map(|header| header.0).map_err(|shaped| shaped.0);
    rerank_body(&state, priority, body).await
}

/// `/rerank`'s answer to a JSON body: TEI's (`texts`) in TEI's shapes, or
/// the `documents` form in `/v1/rerank`'s. `priority` is the `X-Priority`
/// header's lane, or why it is bad: answered in the shape of the body's
/// API, known only once the body is read.
pub(crate) async fn rerank_body(
    state: &AppState,
    priority: Result<Option<Priority>, ApiError>,
    body: Value,
) -> Response {
    if body.get("documents").is_some() && body.get("texts").is_none() {
        if is_voyage(|key| body.get(key).is_some()) {
            let answer = match (priority, parse::<VoyageRerankRequest>(body)) {
                (Ok(priority), Ok(req)) => voyage_rerank(state, req, priority).await.map(Json),
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            return answer.map_err(Shaped::<OpenAi>::from).into_response();
        }
        let answer = match (priority, parse::<CohereRerankRequest>(body)) {
            (Ok(priority), Ok(req)) => cohere_rerank(state, req, RerankRoute::Bare, priority).await,
            (Err(e), _) | (_, Err(e)) => Err(e.into()),
        };
        return answer.into_response();
    }
    let answer = match (priority, parse::<TeiRerankRequest>(body)) {
        (Ok(priority), Ok(req)) => tei_rank(state, req, priority).await.map(Json),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    answer.map_err(Shaped::<Tei>::from).into_response()
}

/// A JSON body already read, as `T`; a wrong shape is an error of the route's
/// shape (422, 400 in the OpenAI shape) as for any route.
pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: Value) -> Result<T, ApiError> {
    ApiError::parse_value(body)
}

/// What `/rerank` takes (documentation only): TEI's body (`texts`), or the
/// `documents` form of Infinity, vLLM and Jina (Cohere's body).
pub struct RerankBody;

impl PartialSchema for RerankBody {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(Ref::from_schema_name("TeiRerankRequest"))
            .item(Ref::from_schema_name("CohereRerankRequest"))
            .item(Ref::from_schema_name("VoyageRerankRequest"))
            .into()
    }
}

impl ToSchema for RerankBody {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("RerankBody")
    }
}

/// What `/rerank` answers (documentation only): TEI's list for a `texts`
/// body, `/v1/rerank`'s answer for a `documents` body (Voyage's for Voyage's).
pub struct RerankAnswer;

impl PartialSchema for RerankAnswer {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(ArrayBuilder::new().items(Ref::from_schema_name("TeiRank")))
            .item(Ref::from_schema_name("CohereRerankResponse"))
            .item(Ref::from_schema_name("VoyageRerankResponse"))
            .into()
    }
}

impl ToSchema for RerankAnswer {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("RerankAnswer")
    }
}

/// TEI's ranking for `req`, best first.
pub(crate) async fn tei_rank(
    state: &AppState,
    req: TeiRerankRequest,
    priority: Option<Priority>,
) -> Result<Vec<TeiRank>, ApiError> {
    check_instruction(state, req.model.as_deref(), req.instruction.as_deref()).await?;
    let words = RankWords::TEI;
    let out = score(
        state,
        pairs_request(
            state,
            req.model,
            &req.query,
            &req.texts,
            EmbedOptions {
                truncate: req.truncate.unwrap_or(true),
                truncation_direction: req.truncation_direction.map(Into::into),
                priority: priority.unwrap_or_default(),
                prompt: instruction_prompt(req.instruction),
                ..EmbedOptions::default()
            },
            req.raw_scores,
            words,
        )?,
    )
    .await
    .map_err(|e| words.too_long(e))?;
    let scores = first_label(&out.scores);
    let mut texts: Vec<Option<String>> = req.texts.into_iter().map(Some).collect();
    let ranks = ranking(&first_label(&out.logits))
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
        .collect();
    Ok(ranks)
}

/// A Cohere/Jina document: a string, or a JSON object whose `text` (or
/// `rank_fields`) is ranked. (Serialize only for the schema's shape.)
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum RerankDocument {
    Text(String),
    #[schema(value_type = Object)]
    Object(serde_json::Map<String, Value>),
}

impl<'de> Deserialize<'de> for RerankDocument {
    /// By hand: serde's untagged enums fail with a message that names the
    /// Rust type, not what the client should send.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) => Ok(RerankDocument::Text(s)),
            Value::Object(o) => Ok(RerankDocument::Object(o)),
            _ => Err(de::Error::custom(
                "each document must be a string or a JSON object",
            )),
        }
    }
}

impl RerankDocument {
    /// The text the reranker scores: a string as it is; an object's `text`
    /// field, or with `rank_fields`, Cohere's structured form: one
    /// `field: value` line per field, in the order named (a string value as
    /// it is, any other as compact JSON). `index` names the document in
    /// errors, in the route's `words`.
    fn rank_text(
        &self,
        index: usize,
        rank_fields: Option<&[String]>,
        words: RankWords,
    ) -> Result<String, ApiError> {
        let RankWords {
            field: documents,
            noun,
            ..
        } = words;
        let fields = match self {
            RerankDocument::Text(text) => return Ok(text.clone()),
            RerankDocument::Object(fields) => fields,
        };
        let field = |name: &str| {
            fields.get(name).map(plain).ok_or_else(|| {
                ApiError::invalid(match rank_fields {
                    Some(_) => {
                        format!("{noun} {index} has no field `{name}` (named in rank_fields)")
                    }
                    None => format!(
                        "{noun} {index} has no `text` field: send `text`, or name the fields \
                         to rank on in rank_fields"
                    ),
                })
                .param(documents)
            })
        };
        match rank_fields {
            // The default field is the document's text itself: a number or
            // null there is a client's mistake, not text to rank.
            None => match fields.get("text") {
                Some(Value::String(text)) => Ok(text.clone()),
                Some(_) => Err(ApiError::invalid(format!(
                    "{noun} {index}'s `text` must be a string; to rank on other values, \
                     name their fields in rank_fields"
                ))
                .param(documents)),
                None => field("text"),
            },
            Some(names) => names
                .iter()
                .map(|name| Ok(format!("{name}: {}", field(name)?)))
                .collect::<Result<Vec<_>, ApiError>>()
                .map(|lines| lines.join("\n")),
        }
    }

    /// What `return_documents` answers: an object as it was sent, a string
    /// as Cohere answers it, `{"text": ...}`.
    fn into_returned(self) -> Value {
        match self {
            RerankDocument::Text(text) => serde_json::json!({ "text": text }),
            RerankDocument::Object(fields) => Value::Object(fields),
        }
    }
}

/// A field's value as text: a string as it is, anything else as compact JSON.
fn plain(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `rank_fields` as field names: a non-empty list of strings.
fn rank_field_names(rank_fields: Option<Vec<Value>>) -> Result<Option<Vec<String>>, ApiError> {
    let Some(list) = rank_fields else {
        return Ok(None);
    };
    let invalid = || {
        ApiError::invalid("rank_fields must be a non-empty list of field names (strings)")
            .param("rank_fields")
    };
    if list.is_empty() {
        return Err(invalid());
    }
    list.into_iter()
        .map(|v| match v {
            Value::String(s) => Ok(s),
            _ => Err(invalid()),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// Cohere (v1 and v2) / Jina rerank request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CohereRerankRequest {
    /// Which served reranker answers; default: the first reranker.
    pub model: Option<String>,
    pub query: String,
    /// Documents to score (at least one): strings, or JSON objects ranked on
    /// their `text` field (or on `rank_fields`).
    #[schema(min_items = 1)]
    pub documents: Vec<RerankDocument>,
    /// How many results to return, best first (default all; 0 also means all, as vLLM's
    /// protocol sends it by default); below 0 is a 400.
    #[schema(minimum = 0)]
    pub top_n: Option<i64>,
    /// Include each document in its result, as sent (a string as `{"text": ...}`)
    /// (v1 and Jina default: true; v2: false).
    pub return_documents: Option<bool>,
    /// Cohere v1: split each document into up to this many chunks that each
    /// fit beside the query, and score the document by its best chunk.
    /// Unset: one chunk, cut to the model's maximum (as Jina answers here).
    /// Below 1 is a 400.
    #[schema(minimum = 1)]
    pub max_chunks_per_doc: Option<i64>,
    /// Cohere v2: cut each document to this many tokens first (unset: the
    /// model's maximum cuts the pair). Below 1 is a 400.
    #[schema(minimum = 1)]
    pub max_tokens_per_doc: Option<i64>,
    /// The fields of an object document to rank on, in this order, as one
    /// `field: value` line each (default: the `text` field alone, its value as is).
    /// String documents are ranked as they are.
    #[schema(value_type = Option<Vec<String>>)]
    pub rank_fields: Option<Vec<Value>>,
    /// Infinity's: true answers the model's raw logits instead of sigmoid scores.
    pub raw_scores: Option<bool>,
    /// vLLM's: false answers the model's raw logits instead of sigmoid scores.
    pub use_activation: Option<bool>,
    /// vLLM's: cut every query/document pair at this many tokens, special
    /// tokens included, at most the model's maximum; -1 (or none): the model's
    /// maximum. Not with `max_chunks_per_doc` or `max_tokens_per_doc`.
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub truncate_prompt_tokens: Option<i64>,
    /// A decoder reranker's task instruction in place of its default: Qwen3-Reranker's `<Instruct>`, mxbai-rerank v2's
    /// `instruction: ` line, bge-reranker-v2-gemma's prompt after the pair
    /// (FlagEmbedding's `prompt=`; `""` is a prompt of no tokens). A model
    /// without one (a BERT cross-encoder) refuses it.
    #[serde(default)]
    pub instruction: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereResult {
    /// Position of the document in the request's `documents`.
    pub index: usize,
    /// Sigmoid score in [0, 1] (the raw logit with `raw_scores: true` or `use_activation: false`).
    pub relevance_score: f32,
    /// The document as sent: a string document as `{"text": ...}` (Cohere,
    /// Jina, vLLM), or as the string itself where `/rerank`'s `documents` form
    /// asked with `return_documents: true` (Infinity).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<RerankDocument>)]
    pub document: Option<Value>,
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

/// Cohere/Jina rerank response: Cohere's `id`, `results`, `meta`; Jina's
/// `model`, `usage`; on `/rerank`'s `documents` form, Infinity's `object` and `created` too.
#[derive(Debug, Serialize, ToSchema)]
pub struct CohereRerankResponse {
    /// Infinity's `rerank` (`/rerank`'s `documents` form only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub object: Option<String>,
    pub id: String,
    /// Infinity's: Unix seconds (`/rerank`'s `documents` form only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created: Option<u64>,
    pub model: String,
    /// Best first.
    pub results: Vec<CohereResult>,
    pub meta: CohereMeta,
    pub usage: Usage,
}

/// Rank documents (Cohere v1 / Jina shape); best first.
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/v1/rerank", tag = "cohere", operation_id = "cohere_rerank_v1",
    request_body = V1RerankBody,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Documents best first (a Voyage AI body: Voyage's answer)", body = V1RerankAnswer),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 also: top_n < 0, top_k < 1, an over-long pair with Voyage's `truncation: false`, no reranker served, and a wrong shape, as Cohere answers; 401, 404 unknown model (below), 413, 415, 429)", Task::Rerank), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn cohere_rerank_v1(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiBody(body, _): ApiBody<OpenAi>,
) -> Result<Response, Shaped<OpenAi>> {
    cohere_or_voyage(&state, body, RerankRoute::V1, priority).await
}

/// A Cohere route's answer to `body`: Voyage AI's, for Voyage's body, which
/// would otherwise pass as Cohere's with its `top_k` unread; else `route`'s.
async fn cohere_or_voyage(
    state: &AppState,
    body: JsonBody,
    route: RerankRoute,
    priority: Option<Priority>,
) -> Result<Response, Shaped<OpenAi>> {
    let keys = body.keys();
    if keys.contains("documents") && is_voyage(|key| keys.contains(key)) {
        let req = body.parse::<VoyageRerankRequest>()?;
        return Ok(Json(voyage_rerank(state, req, priority).await?).into_response());
    }
    let req = body.parse::<CohereRerankRequest>()?;
    Ok(cohere_rerank(state, req, route, priority)
        .await?
        .into_response())
}

/// Whether a rerank body (its keys, by `has`) is Voyage AI's: it has a key
/// only Voyage's client sends (always, `null` or not): `top_k` or `truncation`.
fn is_voyage(has: impl Fn(&str) -> bool) -> bool {
    has("top_k") || has("truncation")
}

/// What `/v1/rerank` takes (documentation only): Cohere's (and Jina's) body,
/// or Voyage AI's (a body with `top_k` or `truncation`).
pub struct V1RerankBody;

impl PartialSchema for V1RerankBody {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(Ref::from_schema_name("CohereRerankRequest"))
            .item(Ref::from_schema_name("VoyageRerankRequest"))
            .into()
    }
}

impl ToSchema for V1RerankBody {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("V1RerankBody")
    }
}

/// What `/v1/rerank` answers (documentation only): Cohere's answer, or
/// Voyage AI's for its body.
pub struct V1RerankAnswer;

impl PartialSchema for V1RerankAnswer {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(Ref::from_schema_name("CohereRerankResponse"))
            .item(Ref::from_schema_name("VoyageRerankResponse"))
            .into()
    }
}

impl ToSchema for V1RerankAnswer {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("V1RerankAnswer")
    }
}

/// Voyage AI's rerank request (`voyageai.Client(base_url=...).rerank`),
/// told from Cohere's by `top_k` or `truncation`, which its client always sends.
#[derive(Debug, Deserialize, ToSchema)]
pub struct VoyageRerankRequest {
    /// Which served reranker answers; default: the first reranker.
    pub model: Option<String>,
    pub query: String,
    /// Documents to score (at least one).
    #[schema(min_items = 1)]
    pub documents: Vec<String>,
    /// How many results to return, best first (at least 1; null: all).
    #[schema(minimum = 1)]
    pub top_k: Option<i64>,
    /// Not a Voyage field: Cohere's and Jina's name for `top_k`, which a body
    /// that mixes the two APIs may send; with `top_k` too they must be equal.
    pub top_n: Option<i64>,
    /// Include each document, as sent, in its result (default false).
    pub return_documents: Option<bool>,
    /// Cut a query/document pair longer than the model's maximum (default
    /// true); false answers 400 instead.
    pub truncation: Option<bool>,
    /// Not a Voyage field: `/v1/rerank`'s `instruction`, which this body
    /// takes too (a decoder reranker's task instruction; a cross-encoder
    /// refuses it).
    #[serde(default)]
    pub instruction: Option<String>,
}

/// One ranked document (Voyage AI's shape).
#[derive(Debug, Serialize, ToSchema)]
pub struct VoyageRerankResult {
    /// Position of the document in the request's `documents`.
    pub index: usize,
    /// Sigmoid score in [0, 1].
    pub relevance_score: f32,
    /// The document as sent (`return_documents: true` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<String>,
}

/// Voyage AI's rerank response.
#[derive(Debug, Serialize, ToSchema)]
pub struct VoyageRerankResponse {
    /// Always `list`.
    pub object: String,
    /// Best first.
    pub data: Vec<VoyageRerankResult>,
    pub model: String,
    pub usage: Usage,
}

/// Voyage AI's ranking for `req`, by the one Cohere/Jina path: `top_k` is
/// `top_n`, `truncation` the pairs' truncation.
async fn voyage_rerank(
    state: &AppState,
    req: VoyageRerankRequest,
    priority: Option<Priority>,
) -> Result<VoyageRerankResponse, ApiError> {
    if let Some(n) = req.top_k.filter(|&n| n < 1) {
        return Err(
            ApiError::invalid(format!("top_k must be at least 1 (or null: all), got {n}"))
                .param("top_k"),
        );
    }
    // Read silently, the other would be dropped: a different number of results, with a 200.
    if let (Some(k), Some(n)) = (req.top_k, req.top_n) {
        if k != n {
            return Err(ApiError::invalid(format!(
                "top_k ({k}) and top_n ({n}) are the same setting and disagree: send one"
            ))
            .param("top_n"));
        }
    }
    let ranked = rank(
        state,
        CohereRerankRequest {
            model: req.model,
            query: req.query,
            documents: req
                .documents
                .into_iter()
                .map(RerankDocument::Text)
                .collect(),
            top_n: req.top_k.or(req.top_n),
            return_documents: req.return_documents,
            max_chunks_per_doc: None,
            max_tokens_per_doc: None,
            rank_fields: None,
            raw_scores: None,
            use_activation: None,
            truncate_prompt_tokens: None,
            instruction: req.instruction,
        },
        RerankRoute::Voyage,
        priority,
        req.truncation.unwrap_or(true),
        None,
    )
    .await?;
    Ok(VoyageRerankResponse {
        object: "list".into(),
        data: ranked
            .results
            .into_iter()
            .map(|r| VoyageRerankResult {
                index: r.index,
                relevance_score: r.relevance_score,
                document: r.document.and_then(|d| match d {
                    Value::String(text) => Some(text),
                    _ => None,
                }),
            })
            .collect(),
        model: ranked.model,
        usage: ranked.usage,
    })
}

/// Rank documents (Cohere v2 shape, `cohere.ClientV2`; Voyage AI's body gets
/// Voyage's answer, as on `/v1/rerank`); best first.
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/v2/rerank", tag = "cohere", operation_id = "cohere_rerank_v2",
    request_body = V1RerankBody,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Documents best first (a Voyage AI body: Voyage's answer)", body = V1RerankAnswer),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (as /v1/rerank)", Task::Rerank), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn cohere_rerank_v2(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiBody(body, _): ApiBody<OpenAi>,
) -> Result<Response, Shaped<OpenAi>> {
    cohere_or_voyage(&state, body, RerankRoute::V2, priority).await
}

/// The route a Cohere-shaped rerank request came in on, which sets its
/// defaults and the answer's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RerankRoute {
    /// `/v1/rerank`: Cohere v1 and Jina; documents come back unless
    /// `return_documents: false`.
    V1,
    /// `/v2/rerank`: Cohere v2; documents come back with `return_documents: true`.
    V2,
    /// `/rerank` with `documents`, as vLLM and Infinity serve it: `/v1/rerank`'s
    /// answer, plus Infinity's `object` and `created`. Infinity answers a
    /// returned document as the string it was sent, where vLLM (which has no
    /// `return_documents` and always returns documents) answers `{"text": ...}`;
    /// so an explicit `return_documents: true`, Infinity's opt-in, gets strings
    /// back as strings, and vLLM's requests keep vLLM's objects.
    Bare,
    /// Voyage AI's body (on `/v1/rerank` or `/rerank`): documents, strings,
    /// come back as sent with `return_documents: true`.
    Voyage,
    /// NVIDIA NIM's `/v1/ranking`: indices and logits, never documents.
    Nim,
}

impl RerankRoute {
    /// The words of the route's API for the shared path's messages.
    fn words(self) -> RankWords {
        match self {
            RerankRoute::V1 | RerankRoute::V2 | RerankRoute::Bare => RankWords::COHERE,
            RerankRoute::Voyage => RankWords::VOYAGE,
            RerankRoute::Nim => RankWords::NIM,
        }
    }
}

/// How a rank route's API names what the shared rank path's messages speak
/// of. Each route passes its own, and the shared checks build their
/// messages from it: a message is written once, in the client's words,
/// never rewritten after (a rewrite of "documents" would reach a model name
/// or a text the message quotes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RankWords {
    /// The request's field of documents (Cohere's `documents`, TEI's
    /// `texts`, NIM's `passages`): the `param` of errors about them.
    field: &'static str,
    /// One document in messages ("document 3", "no documents to rank").
    noun: &'static str,
    /// How the request allows an over-long pair to be cut, the advice of
    /// its refusal.
    fix: &'static str,
    /// The `param` of the 413 for more pairs than `--max-inputs-per-request`.
    limit_param: &'static str,
    /// Whether a refused over-long pair is named as the API's document
    /// ("passage 3"): otherwise "input 3", as these routes have always named it.
    names_pairs: bool,
}

impl RankWords {
    /// TEI's `/rerank`: its documents are `texts`.
    const TEI: Self = Self {
        field: "texts",
        ..Self::COHERE
    };
    /// Cohere's, Jina's, Infinity's and vLLM's.
    const COHERE: Self = Self {
        field: "documents",
        noun: "document",
        fix: TRUNCATE_FIX,
        limit_param: "input",
        names_pairs: false,
    };
    /// Voyage AI's: its boolean is `truncation`.
    const VOYAGE: Self = Self {
        fix: "set truncation to true",
        ..Self::COHERE
    };
    /// NVIDIA NIM's: passages, and `truncate` is `NONE` or `END`.
    const NIM: Self = Self {
        field: "passages",
        noun: "passage",
        fix: "set truncate to END",
        limit_param: "passages",
        names_pairs: true,
    };

    /// A scoring error in these words: an over-long pair's refusal names
    /// the pair and the fix as the API does. Any other error is left as it is.
    fn too_long(self, err: ApiError) -> ApiError {
        let err = err.advising(self.fix);
        if self.names_pairs {
            err.renaming_input(|i| format!("{} {i}", self.noun))
        } else {
            err
        }
    }
}

/// NVIDIA NIM's text object: `{"text": ...}`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct NimText {
    pub text: String,
    /// Refused (400): NIM's vision rerankers take an image beside the text;
    /// this server ranks text, and a passage ranked on its text alone would
    /// get another score with a 200.
    #[schema(value_type = Option<String>)]
    pub image: Option<Value>,
}

/// NVIDIA NIM's ranking request (LangChain's `NVIDIARerank` with `base_url`).
#[derive(Debug, Deserialize, ToSchema)]
pub struct NimRankingRequest {
    /// Which served reranker answers; default: the first reranker.
    pub model: Option<String>,
    pub query: NimText,
    /// Passages to rank against the query (at least one).
    #[schema(min_items = 1)]
    pub passages: Vec<NimText>,
    /// `NONE` (default, as NIM's): a query/passage pair longer than the
    /// model's maximum is a 400; `END` cuts it (each side's end). Any other
    /// value (Cohere's `START` too, which NIM does not take) is a 400.
    pub truncate: Option<NimTruncate>,
}

/// NVIDIA NIM's `truncate` on `/v1/ranking`: the two values NIM documents.
/// (Cohere's `START` is refused, not read as a cut NIM never makes: a
/// client that sends it would get an answer no NIM gives.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum NimTruncate {
    /// Refuse a pair over the model's maximum (400, as NIM answers).
    None,
    /// Cut a pair over the model's maximum at its end.
    End,
}

crate::extract::wire_names!(NimTruncate {
    None => "NONE",
    End => "END",
});

/// One ranked passage.
#[derive(Debug, Serialize, ToSchema)]
pub struct NimRanking {
    /// Position of the passage in the request's `passages`.
    pub index: usize,
    /// The model's raw score (no sigmoid), as `/rerank` answers with `raw_scores: true`.
    pub logit: f32,
}

/// NVIDIA NIM's ranking response.
#[derive(Debug, Serialize, ToSchema)]
pub struct NimRankingResponse {
    /// Every passage, highest logit first.
    pub rankings: Vec<NimRanking>,
    pub usage: Usage,
}

/// Rank passages (NVIDIA NIM's reranking API); highest logit first.
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}`.
#[utoipa::path(
    post, path = "/v1/ranking", tag = "nim", operation_id = "nim_ranking",
    request_body = NimRankingRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Passages by logit, highest first", body = NimRankingResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 also: an over-long pair with `truncate: NONE`, the default, as NIM answers; an `image`; no reranker served; a wrong shape; 401, 404 unknown model (below), 413, 415, 429)", Task::Rerank), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn nim_ranking(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<NimRankingRequest, OpenAi>,
) -> Result<Json<NimRankingResponse>, Shaped<OpenAi>> {
    Ok(Json(nim_rank(&state, req, priority).await?))
}

/// NIM's ranking for `req`, by the one Cohere/Jina path: every passage,
/// ranked by raw score.
async fn nim_rank(
    state: &AppState,
    req: NimRankingRequest,
    priority: Option<Priority>,
) -> Result<NimRankingResponse, ApiError> {
    let image = |param: &'static str| {
        ApiError::invalid(format!(
            "an `image` in {param} is not supported: this server ranks text (send `text` alone)"
        ))
        .param(param)
    };
    if req.query.image.is_some() {
        return Err(image("query"));
    }
    if req.passages.iter().any(|p| p.image.is_some()) {
        return Err(image("passages"));
    }
    let truncate = req.truncate.unwrap_or(NimTruncate::None);
    let ranked = rank(
        state,
        CohereRerankRequest {
            model: req.model,
            query: req.query.text,
            documents: req
                .passages
                .into_iter()
                .map(|p| RerankDocument::Text(p.text))
                .collect(),
            top_n: None,
            return_documents: Some(false),
            max_chunks_per_doc: None,
            max_tokens_per_doc: None,
            rank_fields: None,
            raw_scores: Some(true),
            use_activation: None,
            truncate_prompt_tokens: None,
            instruction: None,
        },
        RerankRoute::Nim,
        priority,
        truncate == NimTruncate::End,
        // END cuts each side's end, whatever the model folder's side.
        (truncate == NimTruncate::End).then_some(TruncationDirection::Right),
    )
    .await?;
    Ok(NimRankingResponse {
        rankings: ranked
            .results
            .into_iter()
            .map(|r| NimRanking {
                index: r.index,
                logit: r.relevance_score,
            })
            .collect(),
        usage: ranked.usage,
    })
}

/// A ranking, before its API's shape.
struct Ranked {
    model: String,
    /// Best first.
    results: Vec<CohereResult>,
    usage: Usage,
}

async fn cohere_rerank(
    state: &AppState,
    req: CohereRerankRequest,
    route: RerankRoute,
    priority: Option<Priority>,
) -> Result<Json<CohereRerankResponse>, Shaped<OpenAi>> {
    let ranked = rank(state, req, route, priority, true, None).await?;
    let bare = route == RerankRoute::Bare;
    Ok(Json(CohereRerankResponse {
        object: bare.then(|| "rerank".to_owned()),
        id: super::response_id("rerank"),
        created: bare.then(super::unix_now),
        model: ranked.model,
        results: ranked.results,
        meta: CohereMeta {
            api_version: CohereApiVersion {
                version: if route == RerankRoute::V2 { "2" } else { "1" }.into(),
            },
            billed_units: CohereBilledUnits { search_units: 1 },
        },
        usage: ranked.usage,
    }))
}

/// The one ranking path of the Cohere, Jina, Infinity, vLLM, Voyage and NIM
/// shapes; `truncate`: cut over-long pairs (false: refuse them), at
/// `direction`'s end of each side (unsaid: the model's).
async fn rank(
    state: &AppState,
    req: CohereRerankRequest,
    route: RerankRoute,
    priority: Option<Priority>,
    truncate: bool,
    direction: Option<TruncationDirection>,
) -> Result<Ranked, ApiError> {
    let words = route.words();
    let strings_as_sent = (route == RerankRoute::Bare && req.return_documents == Some(true))
        || route == RerankRoute::Voyage;
    let top_n = match req.top_n {
        None | Some(0) => None,
        Some(n) if n >= 1 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        Some(n) => {
            return Err(
                ApiError::invalid(format!("top_n must be at least 1 (or 0: all), got {n}"))
                    .param("top_n"),
            )
        }
    };
    let rank_fields = rank_field_names(req.rank_fields)?;
    let texts = req
        .documents
        .iter()
        .enumerate()
        .map(|(i, doc)| doc.rank_text(i, rank_fields.as_deref(), words))
        .collect::<Result<Vec<String>, ApiError>>()?;
    let limits = DocumentLimits {
        max_tokens: at_least_one(req.max_tokens_per_doc, "max_tokens_per_doc")?,
        max_chunks: at_least_one(req.max_chunks_per_doc, "max_chunks_per_doc")?,
    };
    let truncate_to = super::openai::vllm_cut(req.truncate_prompt_tokens)?;
    if truncate_to.is_some() && (limits.max_tokens.is_some() || limits.max_chunks.is_some()) {
        // Chunks are made to fit beside the query in the model's maximum: a
        // cut below it would cut them again, and no API asks for both.
        return Err(ApiError::invalid(
            "truncate_prompt_tokens (vLLM's) does not go with max_chunks_per_doc or \
             max_tokens_per_doc (Cohere's): give one or the other",
        )
        .param("truncate_prompt_tokens"));
    }
    check_instruction(state, req.model.as_deref(), req.instruction.as_deref()).await?;
    let options = EmbedOptions {
        priority: priority.unwrap_or_default(),
        truncate,
        truncation_direction: direction,
        truncate_to,
        prompt: instruction_prompt(req.instruction.clone()),
        ..EmbedOptions::default()
    };
    // Raw logits where the client asks for them in its API's words; both keep
    // the ranking (a sigmoid is monotonic, so a document's best chunk too).
    let raw = req.raw_scores == Some(true) || req.use_activation == Some(false);
    // The input limits apply to the documents sent, and to the chunks made of them.
    let sent = pairs_request(
        state,
        req.model.clone(),
        &req.query,
        &texts,
        options.clone(),
        raw,
        words,
    )?;
    // The pairs are the documents sent, one each: past the limit, the
    // field at fault is the route's (a non-empty list of pairs has no other
    // refusal here).
    check_inputs(state, &sent.inputs, req.model.as_deref(), Task::Rerank)
        .map_err(|e| e.param(words.limit_param))?;
    // Which document each scored input belongs to: one each, or its chunks.
    let (owners, request) = if limits.max_tokens.is_some() || limits.max_chunks.is_some() {
        let model = state.model_for(req.model.as_deref(), Task::Rerank)?;
        let max_pieces = state.args().max_inputs_per_request;
        let pieces =
            document_pieces(model, &req.query, texts, limits, max_pieces, &options).await?;
        let query = pieces.query.as_deref().unwrap_or(&req.query);
        let (owners, texts): (Vec<usize>, Vec<String>) = pieces.pieces.into_iter().unzip();
        let request = pairs_request(state, req.model, query, &texts, options, raw, words)?;
        (owners, request)
    } else {
        ((0..texts.len()).collect(), sent)
    };
    let out = score_checked(state, request)
        .await
        .map_err(|e| words.too_long(e.cut_by("truncate_prompt_tokens")))?;
    // A document scores as its best piece (best by logit is best by score).
    let mut scores = vec![f32::NEG_INFINITY; req.documents.len()];
    let mut logits = scores.clone();
    let pieces = first_label(&out.scores)
        .into_iter()
        .zip(first_label(&out.logits));
    for (&doc, (score, logit)) in owners.iter().zip(pieces) {
        scores[doc] = scores[doc].max(score);
        logits[doc] = logits[doc].max(logit);
    }
    let with_documents = req.return_documents.unwrap_or(!matches!(
        route,
        RerankRoute::V2 | RerankRoute::Voyage | RerankRoute::Nim
    ));
    let mut documents: Vec<Option<RerankDocument>> = req.documents.into_iter().map(Some).collect();
    let mut order = ranking(&logits);
    order.truncate(top_n.unwrap_or(order.len()));
    let results = order
        .into_iter()
        .map(|index| CohereResult {
            index,
            relevance_score: scores[index],
            document: if with_documents {
                documents[index].take().map(|doc| match doc {
                    RerankDocument::Text(text) if strings_as_sent => Value::String(text),
                    doc => doc.into_returned(),
                })
            } else {
                None
            },
        })
        .collect();
    Ok(Ranked {
        model: out.model,
        results,
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
    })
}

/// Cohere's per-document limits, as sent.
#[derive(Debug, Clone, Copy, Default)]
struct DocumentLimits {
    max_tokens: Option<usize>,
    max_chunks: Option<usize>,
}

fn at_least_one(value: Option<i64>, name: &'static str) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => {
            Err(ApiError::invalid(format!("{name} must be at least 1, got {n}")).param(name))
        }
    }
}

/// What [`document_pieces`] makes of a request's documents.
struct Pieces {
    /// The query every piece goes with, where the query as sent would leave
    /// a chunk less than half of the model's input: its first tokens, as
    /// many as leave that half. `None`: the query as sent.
    query: Option<String>,
    /// One model input each: the document's index and a slice of its text.
    pieces: Vec<(usize, String)>,
}

/// Each document cut to `max_tokens` tokens, then split into up to
/// `max_chunks` pieces of as many tokens as fit beside the query in one
/// model input (Cohere's chunking); one piece per document without
/// `max_chunks`. Pieces are slices of the document's text at its tokens'
/// offsets, so no text is rewritten.
///
/// Chunks get at least half of the model's input, as Cohere's do: a query
/// that would leave them less is cut to its first tokens that leave half
/// (with `truncate` false, refused instead: 400), for every document, one
/// that fits a single chunk too. (A chunk's size beside the query as sent
/// made a long query's documents into one-token chunks; and a short
/// document beside the query as sent was cut away whole by a template
/// reranker's truncation, which keeps the prompt's start, so every short
/// document scored the same.)
async fn document_pieces(
    model: &crate::models::ServedModel,
    query: &str,
    texts: Vec<String>,
    limits: DocumentLimits,
    max_pieces: usize,
    request: &EmbedOptions,
) -> Result<Pieces, ApiError> {
    let truncate = request.truncate;
    let Some(tok) = model.batcher.tokenizer().cloned() else {
        return Err(ApiError::invalid(
            "max_tokens_per_doc and max_chunks_per_doc need the model's tokenizer",
        ));
    };
    let max_input = model.info().max_input_tokens;
    // One document alone may not make more chunks than a request may have.
    let limits = DocumentLimits {
        max_chunks: limits.max_chunks.map(|n| n.min(max_pieces + 1)),
        ..limits
    };
    let query = query.to_owned();
    let prompt = request.prompt.clone();
    tokio::task::spawn_blocking(move || {
        let options = EmbedOptions::default();
        // The pair's frame is counted with the request's instruction (it
        // may end the input: bge-reranker-v2-gemma's prompt).
        let pair_options = EmbedOptions {
            prompt: prompt.clone(),
            ..EmbedOptions::default()
        };
        let invalid = |e: mlx_embed_core::EmbedderError| ApiError::invalid(e.message);
        // What a pair costs besides its document, uncut: specials, the
        // query, a template's frame.
        let frame = |query: &str| {
            tok.encode(
                &EmbedInput::Pair {
                    query: query.to_owned(),
                    document: String::new(),
                },
                &pair_options,
            )
            .map(|e| e.untruncated_len as usize)
            .map_err(invalid)
        };
        let full = frame(&query)?;
        let mut chunk_query = None;
        let mut per_chunk = max_input.saturating_sub(full);
        if limits.max_chunks.is_some() {
            let spans = tok.tokens(&query, false, &options).map_err(invalid)?;
            let query_tokens: Vec<usize> = spans
                .iter()
                .filter(|s| !s.special)
                .map(|s| s.stop)
                .collect();
            if let Some(keep) = chunk_query_tokens(max_input, full, query_tokens.len(), truncate)? {
                let cut = cut_at(&query, query_tokens[keep - 1]).to_owned();
                per_chunk = max_input.saturating_sub(frame(&cut)?);
                chunk_query = Some(cut);
            }
        }
        let per_chunk = per_chunk.max(1);
        let mut pieces = Vec::new();
        for (index, text) in texts.into_iter().enumerate() {
            let spans = tok.tokens(&text, false, &options).map_err(invalid)?;
            let offsets: Vec<(usize, usize)> = spans
                .iter()
                .filter(|s| !s.special)
                .map(|s| (s.start, s.stop))
                .collect();
            for piece in split_at_tokens(&text, &offsets, limits, per_chunk) {
                pieces.push((index, piece));
            }
            // Each piece is a model input: chunks count against the input
            // limit as documents do (small chunks made a small request many
            // times its documents' work).
            if pieces.len() > max_pieces {
                return Err(ApiError::new(
                    ErrorKind::TooLarge,
                    format!(
                        "max_chunks_per_doc splits these documents into more than {max_pieces} \
                         chunks, the inputs one request may have (--max-inputs-per-request); \
                         lower max_chunks_per_doc or send fewer documents"
                    ),
                )
                .param("max_chunks_per_doc"));
            }
        }
        Ok(Pieces {
            query: chunk_query,
            pieces,
        })
    })
    .await
    .map_err(|e| ApiError::new(ErrorKind::Model, format!("tokenizer task failed: {e}")))?
}

/// How many of the query's first tokens go with a split document's chunks,
/// in a model input of `window` tokens where the pair without its document
/// (`frame`: specials, template and the query's `query_tokens`) takes
/// `frame` tokens: `None`, all of them, where the frame leaves each chunk at
/// least half the window (Cohere's rule: a query takes at most half); else as
/// many as leave that half (at least one, fewer than all), or, where
/// truncation is off, 400.
fn chunk_query_tokens(
    window: usize,
    frame: usize,
    query_tokens: usize,
    truncate: bool,
) -> Result<Option<usize>, ApiError> {
    let half = window / 2;
    if frame <= half || query_tokens == 0 {
        return Ok(None);
    }
    let others = frame.saturating_sub(query_tokens);
    let limit = half.saturating_sub(others);
    if !truncate {
        return Err(ApiError::invalid(format!(
            "the query has {query_tokens} tokens, over the {limit} that leave each chunk of a \
             document half of the model's {window}-token input (max_chunks_per_doc); send a \
             shorter query or allow truncation"
        ))
        .param("query"));
    }
    Ok(Some(limit.clamp(1, query_tokens)))
}

/// `text` up to byte `end`, or to the last character boundary before it.
fn cut_at(text: &str, end: usize) -> &str {
    let mut end = end.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text` cut after `limits.max_tokens` of its tokens (byte `offsets`), then
/// split into chunks of `per_chunk` tokens, at most `limits.max_chunks` of
/// them (one, cut to `per_chunk` by the pair's own truncation, without it).
/// An offset that is not a character boundary leaves the text whole.
fn split_at_tokens(
    text: &str,
    offsets: &[(usize, usize)],
    limits: DocumentLimits,
    per_chunk: usize,
) -> Vec<String> {
    let kept = &offsets[..offsets.len().min(limits.max_tokens.unwrap_or(usize::MAX))];
    let slice = |from: usize, to: usize| text.get(from..to).map(str::to_owned);
    let whole = || vec![text.to_owned()];
    if kept.is_empty() {
        return whole();
    }
    let Some(max_chunks) = limits.max_chunks else {
        let end = kept.last().map_or(0, |&(_, stop)| stop);
        return slice(0, end).map_or_else(whole, |t| vec![t]);
    };
    let mut chunks = Vec::new();
    for (n, group) in kept.chunks(per_chunk).take(max_chunks).enumerate() {
        // The first chunk starts at the text's start, so leading space stays
        // as the document had it; the others start at their first token.
        let from = if n == 0 { 0 } else { group[0].0 };
        match slice(from, group[group.len() - 1].1) {
            Some(chunk) => chunks.push(chunk),
            None => return whole(),
        }
    }
    chunks
}

/// The pairs of `query` with each of `documents` hold at most
/// [`MAX_PAIR_TEXT_BYTES`] of text, the query counted in each: checked
/// before they are built, since each pair holds its own copy. `noun` names
/// a document in the message.
fn check_pair_text(query: &str, documents: &[String], noun: &str) -> Result<(), ApiError> {
    let bytes = query
        .len()
        .saturating_mul(documents.len())
        .saturating_add(documents.iter().map(String::len).sum());
    check_pair_bytes(bytes, documents.len(), noun)
}

/// `pairs` pairs of `bytes` of text in all (each pair's query counted),
/// their second texts called `noun` in the message.
pub(crate) fn check_pair_bytes(bytes: usize, pairs: usize, noun: &str) -> Result<(), ApiError> {
    if bytes <= MAX_PAIR_TEXT_BYTES {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorKind::TooLarge,
        format!(
            "these {pairs} query/{noun} pairs hold {bytes} bytes of text, each pair's query \
             counted, more than the {} MiB one request may have; send a shorter query or fewer \
             {noun}s per request",
            MAX_PAIR_TEXT_BYTES >> 20
        ),
    ))
}

/// One pair input per document. A refusal, in the route's `words`, still
/// counts in `/metrics` under the reranker the request names (or gets), as
/// refusals after the model is picked do.
fn pairs_request(
    state: &AppState,
    model: Option<String>,
    query: &str,
    texts: &[String],
    options: EmbedOptions,
    raw_scores: bool,
    words: RankWords,
) -> Result<ScoreRequest, ApiError> {
    let refusal = if texts.is_empty() {
        Some(ApiError::invalid(format!(
            "no {}s to rank: send at least one",
            words.noun
        )))
    } else {
        check_pair_text(query, texts, words.noun).err()
    };
    if let Some(err) = refusal {
        state.count_under_requested(model.as_deref(), Task::Rerank);
        return Err(err.param(words.field));
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

/// A request's `instruction` as the tokenizer takes it: a pair's raw
/// prompt is the reranker's instruction.
fn instruction_prompt(instruction: Option<String>) -> Prompt {
    instruction.map_or(Prompt::Default, Prompt::Raw)
}

/// A request's `instruction`, tried once on the served reranker's pair
/// frame: one the model cannot take (a cross-encoder without a prompt, a
/// FlagEmbedding prompt leaving the pair no room) is refused naming
/// `instruction`. Left to the batcher, every pair failed alike and the first
/// was blamed ("input 0", `param: "input"`), an input not at fault. A frame
/// that fails without the instruction too is left for the batcher to tell.
async fn check_instruction(
    state: &AppState,
    model: Option<&str>,
    instruction: Option<&str>,
) -> Result<(), ApiError> {
    let Some(instruction) = instruction else {
        return Ok(());
    };
    let served = state.model_for(model, Task::Rerank)?;
    let Some(tok) = served.batcher.tokenizer().cloned() else {
        return Ok(());
    };
    let instruction = instruction.to_owned();
    let refusal = tokio::task::spawn_blocking(move || {
        let frame = |prompt| {
            let pair = EmbedInput::Pair {
                query: String::new(),
                document: String::new(),
            };
            tok.encode(
                &pair,
                &EmbedOptions {
                    prompt,
                    ..EmbedOptions::default()
                },
            )
        };
        match frame(Prompt::Raw(instruction)) {
            Err(e) if frame(Prompt::Default).is_ok() => Some(e.message),
            _ => None,
        }
    })
    .await
    .map_err(|e| ApiError::new(ErrorKind::Model, format!("tokenizer task failed: {e}")))?;
    match refusal {
        Some(message) => Err(ApiError::invalid(message).param("instruction")),
        None => Ok(()),
    }
}

/// A reranker has one label: its scores as a flat list.
fn first_label(rows: &[Vec<f32>]) -> Vec<f32> {
    rows.iter().map(|row| row[0]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc(v: Value) -> RerankDocument {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn nim_ranking_bodies() {
        let read = |v: Value| serde_json::from_value::<NimRankingRequest>(v);
        let req = read(json!({
            "model": "nvidia/llama-3.2-nv-rerankqa-1b-v2",
            "query": {"text": "which way?"},
            "passages": [{"text": "left"}, {"text": "right"}],
            "truncate": "END",
        }))
        .unwrap();
        assert_eq!(req.query.text, "which way?");
        let texts: Vec<&str> = req.passages.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(texts, ["left", "right"]);
        assert_eq!(req.truncate, Some(NimTruncate::End));
        assert!(req.query.image.is_none() && req.passages.iter().all(|p| p.image.is_none()));
        // NIM's default, NONE, is left out by LangChain's client.
        let bare = read(json!({"query": {"text": "q"}, "passages": [{"text": "p"}]})).unwrap();
        assert_eq!((bare.model, bare.truncate), (None, None));
        let with_image = read(json!({
            "query": {"text": "q"}, "passages": [{"text": "p", "image": "data:image/png;base64,AA=="}],
        }))
        .unwrap();
        assert!(with_image.passages[0].image.is_some());
        for bad in [
            json!({"query": "q", "passages": [{"text": "p"}]}),
            json!({"query": {"text": "q"}, "passages": ["p"]}),
            json!({"query": {"text": "q"}, "passages": [{"text": "p"}], "truncate": "end"}),
            json!({"query": {"text": "q"}, "passages": [{}]}),
        ] {
            assert!(read(bad.clone()).is_err(), "{bad}");
        }
        // Cohere's START is not NIM's: refused, naming the two NIM takes.
        let start =
            json!({"query": {"text": "q"}, "passages": [{"text": "p"}], "truncate": "START"});
        assert_eq!(
            read(start).unwrap_err().to_string(),
            "unknown variant `START`, expected `NONE` or `END`"
        );
    }

    #[test]
    fn each_route_words_the_shared_messages() {
        // A document's own text is never part of a message's words.
        let texts = vec!["documents about documents".to_owned(); 2];
        assert!(check_pair_text("q", &texts, "passage").is_ok());
        // The query counts in each pair: three of half the limit are over it.
        let query = "q".repeat(MAX_PAIR_TEXT_BYTES / 2);
        let three = vec!["p".to_owned(); 3];
        let e = check_pair_text(&query, &three, RankWords::NIM.noun).unwrap_err();
        assert_eq!(e.status().as_u16(), 413);
        assert!(
            e.message.starts_with("these 3 query/passage pairs hold ")
                && e.message
                    .ends_with("; send a shorter query or fewer passages per request"),
            "{}",
            e.message
        );
        let e = check_pair_text(&query, &three, RankWords::COHERE.noun).unwrap_err();
        assert!(
            e.message.starts_with("these 3 query/document pairs hold ")
                && e.message
                    .ends_with("; send a shorter query or fewer documents per request"),
            "{}",
            e.message
        );
        let e = doc(json!({"title": "documents"}))
            .rank_text(4, None, RankWords::NIM)
            .unwrap_err();
        assert_eq!(
            (e.message.as_str(), e.param.as_deref()),
            (
                "passage 4 has no `text` field: send `text`, or name the fields to rank on in \
                 rank_fields",
                Some("passages")
            )
        );
        // Each route's words: its field, its fix, its 413's field.
        let words = |r: RerankRoute| {
            let w = r.words();
            (w.field, w.noun, w.fix, w.limit_param, w.names_pairs)
        };
        for route in [RerankRoute::V1, RerankRoute::V2, RerankRoute::Bare] {
            assert_eq!(
                words(route),
                (
                    "documents",
                    "document",
                    "set truncate to true",
                    "input",
                    false
                )
            );
        }
        assert_eq!(
            words(RerankRoute::Voyage),
            (
                "documents",
                "document",
                "set truncation to true",
                "input",
                false
            )
        );
        assert_eq!(
            words(RerankRoute::Nim),
            (
                "passages",
                "passage",
                "set truncate to END",
                "passages",
                true
            )
        );
        assert_eq!(RankWords::TEI.field, "texts");
        let too_long = || {
            ApiError::from(mlx_embed_core::CoreError::InputTooLong {
                index: 1,
                tokens: 3003,
                max: 512,
                limit: mlx_embed_core::InputLimit::Model,
            })
        };
        assert_eq!(
            RankWords::NIM.too_long(too_long()).message,
            "passage 1 has 3003 tokens, more than the model's maximum of 512; shorten it or set \
             truncate to END"
        );
        assert_eq!(
            RankWords::VOYAGE.too_long(too_long()).message,
            "input 1 has 3003 tokens, more than the model's maximum of 512; shorten it or set \
             truncation to true"
        );
        assert_eq!(RankWords::COHERE.too_long(too_long()), too_long());
    }

    #[test]
    fn documents_split_at_their_tokens() {
        let text = "aa bb cc dd ee";
        let offsets = [(0, 2), (3, 5), (6, 8), (9, 11), (12, 14)];
        let limits = |max_tokens, max_chunks| DocumentLimits {
            max_tokens,
            max_chunks,
        };
        let split = |l, per| split_at_tokens(text, &offsets, l, per);
        assert_eq!(split(limits(Some(2), None), 9), ["aa bb"]);
        assert_eq!(split(limits(Some(9), None), 9), [text]);
        assert_eq!(split(limits(None, Some(10)), 2), ["aa bb", "cc dd", "ee"]);
        assert_eq!(split(limits(None, Some(2)), 2), ["aa bb", "cc dd"]);
        assert_eq!(split(limits(Some(3), Some(10)), 2), ["aa bb", "cc"]);
        assert_eq!(split(limits(None, Some(1)), 9), [text]);
        // No tokens, or offsets off the text's character boundaries: whole.
        assert_eq!(split_at_tokens("", &[], limits(Some(1), Some(1)), 1), [""]);
        assert_eq!(
            split_at_tokens("é", &[(0, 1)], limits(None, Some(3)), 1),
            ["é"]
        );
    }

    #[test]
    fn a_long_query_leaves_chunks_half_the_window() {
        // A query whose pair leaves a chunk half the window goes whole.
        assert_eq!(chunk_query_tokens(128, 23, 20, true).unwrap(), None);
        assert_eq!(chunk_query_tokens(128, 64, 61, false).unwrap(), None);
        // Over it: cut to the tokens that leave half (3 specials here).
        assert_eq!(chunk_query_tokens(128, 65, 62, true).unwrap(), Some(61));
        assert_eq!(chunk_query_tokens(128, 303, 300, true).unwrap(), Some(61));
        assert_eq!(
            chunk_query_tokens(512, 1003, 1000, true).unwrap(),
            Some(253)
        );
        // A frame that alone takes half keeps one query token.
        assert_eq!(chunk_query_tokens(128, 90, 10, true).unwrap(), Some(1));
        assert_eq!(chunk_query_tokens(128, 90, 0, true).unwrap(), None);
        // Truncation off: a 400 that names the query's tokens and the limit.
        let e = chunk_query_tokens(128, 303, 300, false).unwrap_err();
        assert_eq!(
            (e.status().as_u16(), e.message.as_str(), e.param.as_deref()),
            (
                400,
                "the query has 300 tokens, over the 61 that leave each chunk of a document half \
                 of the model's 128-token input (max_chunks_per_doc); send a shorter query or \
                 allow truncation",
                Some("query")
            )
        );
        assert_eq!(cut_at("alpha beta", 5), "alpha");
        assert_eq!(cut_at("aé", 2), "a");
        assert_eq!(cut_at("ab", 9), "ab");
    }

    #[test]
    fn rank_fields_make_one_line_per_field_in_order() {
        let d = doc(json!({"title": "Paris", "text": "France", "year": 1900, "tags": ["a", "b"]}));
        assert_eq!(d.rank_text(0, None, RankWords::COHERE).unwrap(), "France");
        let fields = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            d.rank_text(0, Some(&fields(&["title"])), RankWords::COHERE)
                .unwrap(),
            "title: Paris"
        );
        assert_eq!(
            d.rank_text(
                0,
                Some(&fields(&["year", "title", "tags"])),
                RankWords::COHERE
            )
            .unwrap(),
            "year: 1900\ntitle: Paris\ntags: [\"a\",\"b\"]"
        );
        // A string document is ranked as it is, whatever rank_fields names.
        assert_eq!(
            doc(json!("plain"))
                .rank_text(0, Some(&fields(&["title"])), RankWords::COHERE)
                .unwrap(),
            "plain"
        );
        let e = d
            .rank_text(3, Some(&fields(&["title", "author"])), RankWords::COHERE)
            .unwrap_err();
        assert_eq!(
            (e.status().as_u16(), e.message.as_str(), e.param.as_deref()),
            (
                400,
                "document 3 has no field `author` (named in rank_fields)",
                Some("documents")
            )
        );
        let e = doc(json!({"title": "x"}))
            .rank_text(1, None, RankWords::COHERE)
            .unwrap_err();
        assert_eq!(
            e.message,
            "document 1 has no `text` field: send `text`, or name the fields to rank on in rank_fields"
        );
        assert_eq!(
            doc(json!({"title": "x"})).into_returned(),
            json!({"title": "x"})
        );
        assert_eq!(doc(json!("y")).into_returned(), json!({"text": "y"}));
    }

    #[test]
    fn rank_fields_must_be_names_and_documents_strings_or_objects() {
        assert_eq!(rank_field_names(None).unwrap(), None);
        assert_eq!(
            rank_field_names(Some(vec![json!("a"), json!("b")])).unwrap(),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        for bad in [vec![], vec![json!("a"), json!(1)]] {
            let e = rank_field_names(Some(bad)).unwrap_err();
            assert_eq!(e.status().as_u16(), 400);
            assert_eq!(e.param.as_deref(), Some("rank_fields"));
        }
        let e = serde_json::from_value::<RerankDocument>(json!(3)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "each document must be a string or a JSON object"
        );
    }
}
