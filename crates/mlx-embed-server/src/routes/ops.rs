//! Operational routes: `/health`, `/metrics`, `/info`, `/openapi.json`, and the
//! 404/405 fallbacks.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{DeviceMemory, ModelInfo, ModelKind};
use serde::Serialize;
use utoipa::ToSchema;

use crate::errors::{Api, ApiError, ErrorKind};
use crate::extract::TruncationSide;
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct HealthResponse {
    /// `ok`, `shutting_down` or `unhealthy`.
    pub status: String,
    /// Why the model is unavailable, when it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// 200 while the model is up and the server is not draining; 503 otherwise. Never needs the API key.
#[utoipa::path(
    get, path = "/health", tag = "ops",
    responses(
        (status = 200, description = "Ready", body = HealthResponse),
        (status = 503, description = "Model down or shutting down", body = HealthResponse),
    )
)]
pub async fn health(State(state): State<AppState>) -> (StatusCode, Json<HealthResponse>) {
    // One unhealthy model makes the server unhealthy: its routes would fail.
    let several = state.models().len() > 1;
    let reason = state.models().iter().find_map(|m| {
        m.batcher.model_failure().map(|r| {
            if several {
                format!("{}: {r}", m.name)
            } else {
                r.to_owned()
            }
        })
    });
    let (code, status) = if state.is_shutting_down() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else if !state.models().iter().all(|m| m.batcher.is_healthy()) {
        (StatusCode::SERVICE_UNAVAILABLE, "unhealthy")
    } else {
        (StatusCode::OK, "ok")
    };
    (
        code,
        Json(HealthResponse {
            status: status.into(),
            reason,
        }),
    )
}

/// Prometheus text exposition (see [`crate::metrics`] for the names).
#[utoipa::path(
    get, path = "/metrics", tag = "ops",
    responses((status = 200, description = "Prometheus text format 0.0.4", body = String, content_type = "text/plain"))
)]
pub async fn metrics(State(state): State<AppState>) -> Response {
    let memory = crate::live::memory(&state).await;
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(&state, memory.as_ref()),
    )
        .into_response()
}

/// The two batch budgets and the admission bounds. The core decides which
/// inputs share one model call (`max_batch_size` inputs, `max_batch_tokens`
/// padded tokens, exact); the model cuts each call into device passes of at
/// most `device_batch_tokens` padded tokens.
#[derive(Debug, Serialize, ToSchema)]
pub struct BatchingInfo {
    pub enabled: bool,
    /// Inputs per model call.
    pub max_batch_size: usize,
    /// Padded tokens (longest input x inputs) per model call, counted by the core.
    pub max_batch_tokens: usize,
    /// Padded tokens per device pass inside one model call, the engine's own budget.
    pub device_batch_tokens: Option<usize>,
    pub batch_window_ms: u64,
    /// How long a batch waits for the callers answered lately to come back (0: off).
    pub regroup_window_ms: u64,
    pub max_concurrent_requests: usize,
    pub max_waiting: usize,
    pub max_queue_wait_ms: u64,
    /// Model threads per model, each running its own batches.
    pub model_threads: usize,
    /// Query threads asked for: model threads beside those that take
    /// query-sized calls of the high and normal lanes only.
    pub query_threads: usize,
    /// Query threads running: `query_threads`, or 0 for a model that serves
    /// from one thread only.
    pub query_threads_running: usize,
    /// Inputs in a batch cut while high-priority inputs wait.
    pub max_priority_batch_size: usize,
    /// A priority lane passed over this many batches in a row goes first.
    pub aging_batches: u32,
    /// The embedding cache's size per model (0: off).
    pub cache_bytes: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LimitsInfo {
    pub max_body_bytes: usize,
    pub max_inputs_per_request: usize,
    pub auth_required: bool,
    /// A client's time to send a request's headers, or its body; and an idle
    /// connection's life.
    pub client_timeout_secs: u64,
    /// On SIGTERM, how long accepted requests get before the rest are answered 503.
    pub drain_timeout_secs: u64,
    /// Room for large answers not yet taken by their clients (MiB).
    pub max_unsent_answers_mb: usize,
    /// Origins whose web pages may call the API (`--cors-allow-origin`), as compared.
    pub cors_allow_origin: Vec<String>,
    /// Host names answered besides IP addresses and `localhost` (`--allowed-hosts`;
    /// empty: any).
    pub allowed_hosts: Vec<String>,
}

/// The model runtime's device memory (MLX), read when `/info` was asked.
#[derive(Debug, Serialize, ToSchema)]
pub struct MemoryInfo {
    /// Bytes held by live arrays.
    pub active_bytes: u64,
    /// Freed buffers kept for reuse.
    pub cache_bytes: u64,
    /// The highest `active_bytes` since the process started.
    pub peak_bytes: u64,
    /// The cap on `cache_bytes`, if one is set.
    pub cache_limit_bytes: Option<u64>,
}

impl From<DeviceMemory> for MemoryInfo {
    fn from(m: DeviceMemory) -> Self {
        Self {
            active_bytes: m.active_bytes,
            cache_bytes: m.cache_bytes,
            peak_bytes: m.peak_bytes,
            cache_limit_bytes: m.cache_limit_bytes,
        }
    }
}

/// One served model.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelSummary {
    /// The served name (what a request's `model` field picks).
    pub model: String,
    pub model_id: String,
    /// `embedding`, `classifier` or `reranker`.
    pub kind: String,
    /// Vector width, or the number of labels of a classifier/reranker.
    pub dimension: usize,
    /// SPLADE: vectors over the vocabulary, mostly zero (`/embed_sparse` answers).
    pub sparse: bool,
    /// BGE-M3: beside its dense vectors, the model's lexical weights
    /// (`/embed_sparse` answers with them).
    pub lexical_weights: bool,
    /// Label names of a classifier/reranker, in score order.
    pub labels: Vec<String>,
    /// A classifier whose labels are independent: each scored by its own sigmoid.
    pub multi_label: bool,
    pub max_input_tokens: usize,
    pub device_batch_tokens: Option<usize>,
    /// The model's named prompts (`prompt_name` picks one): name -> text prepended.
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when a request names none.
    pub default_prompt_name: Option<String>,
    /// The end an over-long input loses when a request names no
    /// `truncation_direction`: the folder's `truncation_side` (as
    /// transformers and sentence-transformers cut it), or `--truncation-side`.
    pub truncation_direction: TruncationSide,
    /// The model's task adapters (`task` picks one); absent for most models.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
    /// How token rows become one vector (`cls`, `mean`, `last_token`, ...);
    /// none for a scorer.
    pub pooling: Option<String>,
}

/// What is served and how: the default model at the top level, every model in `models`.
#[derive(Debug, Serialize, ToSchema)]
pub struct InfoResponse {
    /// The served model name.
    pub model: String,
    /// The model's own name.
    pub model_id: String,
    pub dimension: usize,
    /// `embedding`, `classifier` or `reranker`.
    pub kind: String,
    /// SPLADE: vectors over the vocabulary, mostly zero (`/embed_sparse` answers).
    pub sparse: bool,
    /// BGE-M3: beside its dense vectors, the model's lexical weights
    /// (`/embed_sparse` answers with them).
    pub lexical_weights: bool,
    /// Longest input in tokens, special tokens included; longer inputs are
    /// truncated (or refused with `truncate: false`).
    pub max_input_tokens: usize,
    /// Token ids (the OpenAI and TEI routes' token input) must be below this.
    pub vocab_size: usize,
    /// The model's named prompts (`prompt_name` picks one): name -> text prepended.
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when a request names none.
    pub default_prompt_name: Option<String>,
    /// The end an over-long input loses when a request names no
    /// `truncation_direction`: the folder's `truncation_side` (as
    /// transformers and sentence-transformers cut it), or `--truncation-side`.
    pub truncation_direction: TruncationSide,
    /// The model's task adapters (`task` picks one: jina-embeddings-v3's);
    /// absent for most models.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
    /// Everything else the model reports, for display (dtype, BLAS library,
    /// pooling, ...), with the figures that change read now (memory in MB, ...)
    /// added.
    pub details: BTreeMap<String, String>,
    /// MLX's memory now (process-wide, so one figure for all models);
    /// absent for a model that does not report it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryInfo>,
    /// Label names of a classifier/reranker, in score order.
    pub labels: Vec<String>,
    /// A classifier whose labels are independent (`problem_type`
    /// `multi_label_classification`): each scored by its own sigmoid.
    pub multi_label: bool,
    /// Every served model, the default first (each has its own queue and model thread).
    pub models: Vec<ModelSummary>,
    pub batching: BatchingInfo,
    pub limits: LimitsInfo,
    pub version: String,
    // TEI's `/info` names for the same facts, which TEI clients read (Dify
    // checks `model_type` and sizes its calls by the two maxima).
    /// The default model's task, as TEI names it.
    pub model_type: TeiModelType,
    /// The float type the model runs in.
    pub model_dtype: String,
    /// The commit of the Hugging Face cache snapshot the model was read
    /// from (a model named by its repo id); null for another folder.
    pub model_sha: Option<String>,
    /// `max_input_tokens`.
    pub max_input_length: usize,
    /// `limits.max_inputs_per_request`.
    pub max_client_batch_size: usize,
    /// `batching.max_batch_size`.
    pub max_batch_requests: usize,
    /// `batching.max_batch_tokens`.
    pub max_batch_tokens: usize,
    /// `batching.max_concurrent_requests`.
    pub max_concurrent_requests: usize,
    /// Over-long inputs are cut unless a request says `truncate: false`.
    pub auto_truncate: bool,
    /// `model`.
    pub served_model_name: String,
    /// Threads that tokenize: the async runtime's workers, one per CPU
    /// (a long request goes to the blocking pool from there), where TEI
    /// runs its own pool of that many by default.
    pub tokenization_workers: usize,
    /// Always null (TEI's git commit of its build).
    pub sha: Option<String>,
    /// Always null (TEI's Docker image label).
    pub docker_label: Option<String>,
}

/// A model's task in TEI's shape: `{"embedding": {"pooling": "mean"}}`,
/// `{"reranker": {"id2label": ..., "label2id": ...}}` or the same for `classifier`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TeiModelType {
    Embedding {
        /// `cls`, `mean`, `last_token`, ... (the engine's pooling).
        pooling: String,
    },
    Classifier(TeiLabels),
    Reranker(TeiLabels),
}

/// A scorer's labels both ways, keyed as in a Hugging Face `config.json`.
#[derive(Debug, Serialize, ToSchema)]
pub struct TeiLabels {
    pub id2label: BTreeMap<String, String>,
    pub label2id: BTreeMap<String, usize>,
}

impl TeiLabels {
    fn of(labels: &[String]) -> Self {
        Self {
            id2label: labels
                .iter()
                .enumerate()
                .map(|(i, l)| (i.to_string(), l.clone()))
                .collect(),
            label2id: labels
                .iter()
                .enumerate()
                .map(|(i, l)| (l.clone(), i))
                .collect(),
        }
    }
}

impl TeiModelType {
    fn of(info: &ModelInfo) -> Self {
        match &info.kind {
            ModelKind::Embedding => {
                let pooling = info.details.get("pooling").map_or("mean", String::as_str);
                TeiModelType::Embedding {
                    pooling: if pooling == "last" {
                        "last_token"
                    } else {
                        pooling
                    }
                    .to_owned(),
                }
            }
            ModelKind::Classifier { labels, .. } => TeiModelType::Classifier(TeiLabels::of(labels)),
            ModelKind::Reranker { labels } => TeiModelType::Reranker(TeiLabels::of(labels)),
        }
    }
}

/// Model, batching and limits.
#[utoipa::path(
    get, path = "/info", tag = "ops",
    responses(
        (status = 200, description = "Server and model facts", body = InfoResponse),
    )
)]
pub async fn info(State(state): State<AppState>) -> Json<InfoResponse> {
    let live = crate::live::reading(&state).await;
    let m = state.model_info();
    let c = state.batcher().config();
    let mut details = m.shown_details();
    // Live figures come beside the load-time ones; a fact the model stated
    // at load keeps its wording (the engine repeats its cache limit live).
    for (key, value) in live.details {
        details.entry(key).or_insert(value);
    }
    let a = state.args();
    Json(InfoResponse {
        model: state.model_name().to_owned(),
        model_id: m.name.clone(),
        dimension: m.dim,
        kind: m.kind.as_str().into(),
        sparse: m.sparse,
        lexical_weights: m.lexical_weights,
        max_input_tokens: m.max_input_tokens,
        vocab_size: m.vocab_size,
        prompts: m.prompts.clone(),
        default_prompt_name: m.default_prompt_name.clone(),
        truncation_direction: m.truncation_side.into(),
        tasks: m.tasks.clone(),
        details,
        memory: live.memory.map(MemoryInfo::from),
        labels: m.kind.labels().to_vec(),
        multi_label: m.kind.multi_label(),
        models: state
            .models()
            .iter()
            .map(|s| {
                let i = s.info();
                ModelSummary {
                    model: s.name.clone(),
                    model_id: i.name.clone(),
                    kind: i.kind.as_str().into(),
                    dimension: i.dim,
                    sparse: i.sparse,
                    lexical_weights: i.lexical_weights,
                    labels: i.kind.labels().to_vec(),
                    multi_label: i.kind.multi_label(),
                    max_input_tokens: i.max_input_tokens,
                    device_batch_tokens: i.device_batch_tokens,
                    prompts: i.prompts.clone(),
                    default_prompt_name: i.default_prompt_name.clone(),
                    truncation_direction: i.truncation_side.into(),
                    tasks: i.tasks.clone(),
                    pooling: match TeiModelType::of(i) {
                        TeiModelType::Embedding { pooling } => Some(pooling),
                        _ => None,
                    },
                }
            })
            .collect(),
        batching: BatchingInfo {
            enabled: c.enable_batching,
            max_batch_size: c.max_batch_size,
            max_batch_tokens: c.max_batch_tokens,
            device_batch_tokens: m.device_batch_tokens,
            batch_window_ms: c.batch_window.as_millis() as u64,
            regroup_window_ms: c.regroup_window.as_millis() as u64,
            max_concurrent_requests: c.max_concurrent_requests,
            max_waiting: c.max_waiting,
            max_queue_wait_ms: c.max_queue_wait.as_millis() as u64,
            model_threads: c.model_threads,
            query_threads: c.query_threads,
            query_threads_running: state.batcher().query_threads(),
            max_priority_batch_size: c.max_priority_batch_size,
            aging_batches: c.aging_batches,
            cache_bytes: c.cache_bytes,
        },
        limits: LimitsInfo {
            max_body_bytes: a.max_body_bytes,
            max_inputs_per_request: a.max_inputs_per_request,
            auth_required: a.api_key.is_some(),
            client_timeout_secs: a.client_timeout_secs,
            drain_timeout_secs: a.drain_timeout_secs,
            max_unsent_answers_mb: a.max_unsent_answers_mb,
            cors_allow_origin: a.cors_allow_origin.clone(),
            allowed_hosts: a.allowed_hosts.clone(),
        },
        version: env!("CARGO_PKG_VERSION").into(),
        model_type: TeiModelType::of(m),
        model_dtype: m
            .weights
            .as_ref()
            .map(|w| w.dtype.clone())
            .or_else(|| m.details.get("dtype").cloned())
            .unwrap_or_else(|| "unknown".into()),
        model_sha: m.weights.as_ref().and_then(|w| w.revision.clone()),
        max_input_length: m.max_input_tokens,
        max_client_batch_size: a.max_inputs_per_request,
        max_batch_requests: c.max_batch_size,
        max_batch_tokens: c.max_batch_tokens,
        max_concurrent_requests: c.max_concurrent_requests,
        auto_truncate: true,
        served_model_name: state.model_name().to_owned(),
        tokenization_workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
        sha: None,
        docker_label: None,
    })
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(
    get, path = "/openapi.json", tag = "ops",
    responses((status = 200, description = "OpenAPI document", content_type = "application/json"))
)]
pub async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::json(),
    )
        .into_response()
}

pub async fn not_found(uri: Uri) -> Response {
    Api::for_path(uri.path()).render(ApiError::new(
        ErrorKind::NotFound,
        format!("no route for {}", uri.path()),
    ))
}

pub async fn method_not_allowed(uri: Uri) -> Response {
    Api::for_path(uri.path()).render(ApiError::new(
        ErrorKind::MethodNotAllowed,
        format!("method not allowed on {}", uri.path()),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tei_model_types() {
        let info = |kind, pooling: Option<&str>| ModelInfo {
            kind,
            details: pooling
                .map(|p| BTreeMap::from([("pooling".to_owned(), p.to_owned())]))
                .unwrap_or_default(),
            ..ModelInfo::default()
        };
        let as_json = |i: &ModelInfo| serde_json::to_value(TeiModelType::of(i)).unwrap();
        assert_eq!(
            as_json(&info(ModelKind::Embedding, Some("last"))),
            json!({ "embedding": { "pooling": "last_token" } })
        );
        assert_eq!(
            as_json(&info(ModelKind::Embedding, Some("cls"))),
            json!({ "embedding": { "pooling": "cls" } })
        );
        let reranker = ModelKind::Reranker {
            labels: vec!["LABEL_0".into()],
        };
        assert_eq!(
            as_json(&info(reranker, None)),
            json!({ "reranker": { "id2label": { "0": "LABEL_0" }, "label2id": { "LABEL_0": 0 } } })
        );
    }
}
