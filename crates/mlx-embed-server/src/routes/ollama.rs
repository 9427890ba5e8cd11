//! Ollama compatible: `POST /api/embed`, the legacy `POST /api/embeddings`,
//! and what Ollama clients read before they embed (`GET /api/version`, the
//! model listings `GET /api/tags`, `GET /api/ps`, `POST /api/show`, and
//! `POST /api/pull`, which answers success for a served model).
//!
//! As Ollama's server does, the routes read a body as JSON whatever its
//! `Content-Type` (the curl lines in Ollama's docs send curl's default,
//! `application/x-www-form-urlencoded`).
//!
//! Ollama names a model `name:tag`, the tag `latest` when none is given, so
//! the listings call a served model `<name>:latest` and the routes take a
//! model named with or without `:latest`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, ModelKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::embed::{embed as run_embed, output_dimension, EmbedRequest};
use crate::errors::{ApiError, Ollama, OllamaErrorBody, Shaped};
use crate::extract::{ApiJson, PriorityHeader, TextInputs};
use crate::models::{ServedModel, Task};
use crate::state::AppState;

/// The tag Ollama assumes when a model name has none.
const DEFAULT_TAG: &str = ":latest";

/// A request's model name as our served names spell it (`:latest` dropped).
fn served_name(requested: Option<String>) -> Option<String> {
    requested.map(|name| match name.strip_suffix(DEFAULT_TAG) {
        Some(bare) => bare.to_owned(),
        None => name,
    })
}

/// A served model's name as Ollama lists it: `name:tag`.
fn tagged_name(model: &ServedModel) -> String {
    if model.name.contains(':') {
        model.name.clone()
    } else {
        format!("{}{DEFAULT_TAG}", model.name)
    }
}

/// Ollama's model `options`: `num_ctx` is read, the others (sampling
/// settings, which an embedding has none of) are accepted and ignored.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct OllamaOptions {
    /// Context length: inputs are cut (or with `truncate: false` refused, 400) at this many
    /// tokens, special tokens included, as Ollama cuts at its context; at most the
    /// model's maximum. Unset: the model's maximum. A fraction is cut to its whole part,
    /// as Ollama reads JSON numbers.
    #[schema(minimum = 1)]
    pub num_ctx: Option<f64>,
}

impl OllamaOptions {
    fn truncate_to(options: Option<&Self>) -> Result<Option<usize>, ApiError> {
        // Ollama decodes options as JSON numbers (float64) and sets an int
        // option to the number's whole part: `20.0` is 20, as there.
        let n = options.and_then(|o| o.num_ctx).map(|n| n as i64);
        super::cut_at("num_ctx", n)
    }
}

/// Ollama embed request (`keep_alive` is accepted and ignored).
#[derive(Debug, Deserialize, ToSchema)]
pub struct OllamaEmbedRequest {
    /// Which served model answers (with or without `:latest`); default: the first embedding model.
    pub model: Option<String>,
    /// A text or a list of texts. None, an empty string or an empty list answers no
    /// embeddings, as Ollama does (clients send that to load a model).
    #[serde(default)]
    pub input: Option<TextInputs>,
    /// Truncate inputs longer than the model's maximum (or `options.num_ctx`; default true);
    /// false answers 400 instead, as Ollama refuses an input over its context length.
    pub truncate: Option<bool>,
    /// Keep the first N components (1..=dimension), re-normalized; 0 is none, as in Ollama,
    /// whose Go clients send a field's zero value for one not set.
    #[schema(minimum = 0)]
    pub dimensions: Option<i64>,
    pub options: Option<OllamaOptions>,
    /// Jina AI's (not an Ollama field): the task adapter to run with, one of
    /// the model's `tasks` (`/info` lists them: jina-embeddings-v3's), with
    /// its prompt of that name. A model without task adapters, or an unknown
    /// task, is a 400.
    pub task: Option<String>,
}

/// Ollama embed response. Vectors are unit length.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaEmbedResponse {
    /// The model as the request named it (Ollama echoes it), else the served name.
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
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (the only way to set it here: Ollama's body has no `priority`)")),
    responses(
        (status = 200, description = "Embeddings in input order", body = OllamaEmbedResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400, 401, 404 unknown model (below), 413, 415, 429)", Task::Embed), body = OllamaErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OllamaErrorBody),
    )
)]
pub async fn embed(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Ollama>,
    ApiJson(req, _): ApiJson<OllamaEmbedRequest, Ollama>,
) -> Result<Json<OllamaEmbedResponse>, Shaped<Ollama>> {
    let start = Instant::now();
    let inputs = match req.input {
        None => Vec::new(),
        Some(TextInputs::One(text)) if text.is_empty() => Vec::new(),
        Some(input) => input.into_inputs(),
    };
    let echoed = req.model.clone().filter(|name| !name.is_empty());
    // Checked before the empty-input answer: a bad `num_ctx` or
    // `dimensions` is a 400 either way.
    let truncate_to = OllamaOptions::truncate_to(req.options.as_ref())?;
    let task = super::task_of(&state, served_name(req.model.clone()).as_deref(), req.task)?;
    let dimensions = req.dimensions.filter(|&n| n != 0);
    if inputs.is_empty() {
        let model = state.model_for(served_name(req.model).as_deref(), Task::Embed)?;
        if let Some(n) = dimensions {
            output_dimension(n, model, "dimensions")?;
        }
        return Ok(Json(OllamaEmbedResponse {
            model: echoed.unwrap_or_else(|| model.name.clone()),
            embeddings: Vec::new(),
            total_duration: start.elapsed().as_nanos() as u64,
            load_duration: 0,
            prompt_eval_count: 0,
        }));
    }
    let out = run_embed(
        &state,
        EmbedRequest {
            // Ollama embeds an empty text in a list (chromadb and
            // langchain-ollama send a collection's empty chunks).
            empty_texts: true,
            model: served_name(req.model),
            inputs,
            options: EmbedOptions {
                truncate: req.truncate.unwrap_or(true),
                truncate_to,
                task,
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            normalize: true,
            dimensions,
        },
    )
    .await
    .map_err(|e| e.cut_by("num_ctx"))?;
    Ok(Json(OllamaEmbedResponse {
        model: echoed.unwrap_or(out.model),
        embeddings: out.vectors,
        total_duration: start.elapsed().as_nanos() as u64,
        load_duration: 0,
        prompt_eval_count: out.prompt_tokens,
    }))
}

/// Ollama's legacy embedding request (`keep_alive` is accepted and ignored).
#[derive(Debug, Deserialize, ToSchema)]
pub struct OllamaEmbeddingsRequest {
    /// Which served model answers (with or without `:latest`); default: the first embedding model.
    pub model: Option<String>,
    /// One text. Missing, null or empty answers an empty embedding, as Ollama does.
    #[serde(default)]
    pub prompt: Option<String>,
    pub options: Option<OllamaOptions>,
    /// Jina AI's (not an Ollama field): the task adapter to run with, one of
    /// the model's `tasks` (`/info` lists them: jina-embeddings-v3's), with
    /// its prompt of that name. A model without task adapters, or an unknown
    /// task, is a 400.
    pub task: Option<String>,
}

/// Ollama's legacy embedding response: the model's vector *before*
/// normalization, as Ollama answers on this route (`/api/embed` normalizes).
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaEmbeddingsResponse {
    pub embedding: Vec<f32>,
}

/// Embed one text (Ollama's legacy route, superseded there by `/api/embed`).
///
/// Inputs longer than the model's maximum (or `options.num_ctx`) are truncated. Errors use `{"error": str}`.
#[utoipa::path(
    post, path = "/api/embeddings", tag = "ollama", operation_id = "ollama_embeddings",
    request_body = OllamaEmbeddingsRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (the only way to set it here: Ollama's body has no `priority`)")),
    responses(
        (status = 200, description = "The unnormalized embedding", body = OllamaEmbeddingsResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400, 401, 404 unknown model (below), 413, 415, 429)", Task::Embed), body = OllamaErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OllamaErrorBody),
    )
)]
pub async fn embeddings(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Ollama>,
    ApiJson(req, _): ApiJson<OllamaEmbeddingsRequest, Ollama>,
) -> Result<Json<OllamaEmbeddingsResponse>, Shaped<Ollama>> {
    let prompt = req.prompt.unwrap_or_default();
    let truncate_to = OllamaOptions::truncate_to(req.options.as_ref())?;
    let task = super::task_of(&state, served_name(req.model.clone()).as_deref(), req.task)?;
    if prompt.is_empty() {
        state.model_for(served_name(req.model).as_deref(), Task::Embed)?;
        return Ok(Json(OllamaEmbeddingsResponse {
            embedding: Vec::new(),
        }));
    }
    let out = run_embed(
        &state,
        EmbedRequest {
            empty_texts: false,
            model: served_name(req.model),
            inputs: vec![EmbedInput::Text(prompt)],
            options: EmbedOptions {
                truncate_to,
                task,
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            normalize: false,
            dimensions: None,
        },
    )
    .await
    .map_err(|e| e.cut_by("num_ctx"))?;
    let embedding = out.vectors.into_iter().next().unwrap_or_default();
    Ok(Json(OllamaEmbeddingsResponse { embedding }))
}

/// What Ollama calls a model's details.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaModelDetails {
    pub parent_model: String,
    /// The weights' files as the model read them: `safetensors`, or
    /// `pytorch` for `pytorch_model.bin` (empty where the model does not say).
    pub format: String,
    /// The architecture (`config.json`'s `model_type`).
    pub family: String,
    pub families: Vec<String>,
    /// Parameters, rounded as Ollama prints them (`23M`, `1.5B`); a quantized layer counts the values it packs.
    pub parameter_size: String,
    /// `Q4`/`Q8` for quantized weights, else the float type (`F32`, `BF16`, `F16`).
    pub quantization_level: String,
}

/// One served model as `GET /api/tags` lists it.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaModel {
    /// `<served name>:latest`.
    pub name: String,
    pub model: String,
    /// When the server started (RFC 3339): models are loaded then and never change.
    pub modified_at: String,
    /// Bytes the weights take in memory.
    pub size: u64,
    /// Hex SHA-256 of what the model is: its folder's files and how it was
    /// loaded (kind, width, token limits, prompts, pooling, float type,
    /// quantization). The same on every start and under any name.
    pub digest: String,
    pub details: OllamaModelDetails,
}

/// Every served model.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaModelList {
    pub models: Vec<OllamaModel>,
}

/// One served model as `GET /api/ps` lists it: all are loaded while the server runs.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaRunningModel {
    pub name: String,
    pub model: String,
    pub size: u64,
    /// The model's digest, as `/api/tags` lists it.
    pub digest: String,
    /// Bytes of weights in accelerator memory: `size` on a GPU, 0 on the CPU.
    pub size_vram: u64,
    pub details: OllamaModelDetails,
    /// Longest input in tokens.
    pub context_length: usize,
    /// When Ollama would unload it (RFC 3339): here never while the server
    /// runs, so as far ahead as Ollama reports a model loaded with
    /// `keep_alive: -1` (the start plus Go's longest duration, about 292
    /// years; `ollama ps` shows it as `Forever`). Ollama always sends it.
    pub expires_at: String,
}

/// The loaded models.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaRunningList {
    pub models: Vec<OllamaRunningModel>,
}

/// Ollama show request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct OllamaShowRequest {
    /// The model (with or without `:latest`): this or `name` is required, a 400 without either.
    pub model: Option<String>,
    /// What older clients send instead of `model`; `model` wins when both are set, as in Ollama.
    pub name: Option<String>,
}

/// What Ollama shows of a model.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaShowResponse {
    pub details: OllamaModelDetails,
    /// `general.architecture`, `general.parameter_count`, and
    /// `<architecture>.context_length` / `.embedding_length` (the vector width).
    #[schema(value_type = Object)]
    pub model_info: BTreeMap<String, Value>,
    /// `["embedding"]` for an embedding model; empty for a classifier or reranker.
    pub capabilities: Vec<String>,
    pub modified_at: String,
}

/// The Ollama release whose API the Ollama routes answer as: what
/// `/api/version` reports. Clients compare it with a minimum and refuse an
/// older server (VS Code Copilot Chat's Ollama provider needs 0.6.4; Open
/// WebUI's constant is 0.1.16), and this server's own version, 0.1.0, reads
/// as an Ollama far older than the API it serves: `/api/embed` (Ollama
/// 0.3.0) with `truncate` and `dimensions` (ollama/ollama#12242, September
/// 2025, in the 0.12 releases), and `/api/show`'s `capabilities`.
pub const OLLAMA_API_VERSION: &str = "0.12.0";

/// Ollama's version answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaVersion {
    /// [`OLLAMA_API_VERSION`].
    pub version: String,
}

/// Ollama's liveness answer: its CLI sends `HEAD /` before it lists or pulls,
/// and tools and health checks probe `GET /` for this text.
#[utoipa::path(
    get, path = "/", tag = "ollama", operation_id = "ollama_running",
    responses((status = 200, description = "`Ollama is running`, as Ollama answers (HEAD: the same, without the body)", body = String, content_type = "text/plain"))
)]
pub async fn running() -> &'static str {
    "Ollama is running"
}

/// The Ollama release whose API this server answers as (clients check it
/// against their minimum before they list models; `/info` has this
/// server's own version).
#[utoipa::path(
    get, path = "/api/version", tag = "ollama", operation_id = "ollama_version",
    responses((status = 200, description = "The Ollama API version served", body = OllamaVersion))
)]
pub async fn version() -> Json<OllamaVersion> {
    Json(OllamaVersion {
        version: OLLAMA_API_VERSION.into(),
    })
}

/// List the served models.
#[utoipa::path(
    get, path = "/api/tags", tag = "ollama", operation_id = "ollama_tags",
    responses((status = 200, description = "Every served model", body = OllamaModelList))
)]
pub async fn tags(State(state): State<AppState>) -> Json<OllamaModelList> {
    let modified_at = started_at(&state);
    let mut models = Vec::with_capacity(state.models().len());
    for m in state.models() {
        let name = tagged_name(m);
        models.push(OllamaModel {
            model: name.clone(),
            name,
            modified_at: modified_at.clone(),
            size: weights_bytes(m),
            digest: m.digest().await,
            details: details(m),
        });
    }
    Json(OllamaModelList { models })
}

/// List the loaded models (every served one).
#[utoipa::path(
    get, path = "/api/ps", tag = "ollama", operation_id = "ollama_ps",
    responses((status = 200, description = "Every served model", body = OllamaRunningList))
)]
pub async fn ps(State(state): State<AppState>) -> Json<OllamaRunningList> {
    let expires_at = rfc3339(started(&state) + Duration::from_nanos(i64::MAX as u64));
    let mut models = Vec::with_capacity(state.models().len());
    for m in state.models() {
        let on_cpu = m
            .info()
            .details
            .get("device")
            .is_none_or(|d| d.starts_with("cpu"));
        let (name, size) = (tagged_name(m), weights_bytes(m));
        models.push(OllamaRunningModel {
            model: name.clone(),
            name,
            size,
            digest: m.digest().await,
            size_vram: if on_cpu { 0 } else { size },
            details: details(m),
            context_length: m.info().max_input_tokens,
            expires_at: expires_at.clone(),
        });
    }
    Json(OllamaRunningList { models })
}

/// Show one model.
///
/// With several models served, an unknown name is a 404; a one-model server
/// answers for any name, as its other routes do.
#[utoipa::path(
    post, path = "/api/show", tag = "ollama", operation_id = "ollama_show",
    request_body = OllamaShowRequest,
    responses(
        (status = 200, description = "The model's facts", body = OllamaShowResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a wrong shape, as Ollama answers; 401, 404 unknown model (below), 413, 415)", Task::Describe), body = OllamaErrorBody),
    )
)]
pub async fn show(
    State(state): State<AppState>,
    ApiJson(req, _): ApiJson<OllamaShowRequest, Ollama>,
) -> Result<Json<OllamaShowResponse>, Shaped<Ollama>> {
    let model = required_model(&state, req.model, req.name)?;
    let info = model.info();
    let architecture = info
        .weights
        .as_ref()
        .map_or_else(String::new, |w| w.architecture.clone());
    let mut model_info = BTreeMap::from([(
        "general.architecture".to_owned(),
        Value::from(architecture.clone()),
    )]);
    if let Some(w) = &info.weights {
        model_info.insert("general.parameter_count".into(), w.parameters.into());
    }
    let key = if architecture.is_empty() {
        "general".to_owned()
    } else {
        architecture
    };
    model_info.insert(
        format!("{key}.context_length"),
        info.max_input_tokens.into(),
    );
    model_info.insert(format!("{key}.embedding_length"), info.dim.into());
    let capabilities = match info.kind {
        ModelKind::Embedding => vec!["embedding".to_owned()],
        _ => Vec::new(),
    };
    Ok(Json(OllamaShowResponse {
        details: details(model),
        model_info,
        capabilities,
        modified_at: started_at(&state),
    }))
}

/// Ollama pull request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct OllamaPullRequest {
    /// The model (with or without `:latest`): this or `name` is required, a 400 without either.
    pub model: Option<String>,
    /// What older clients send instead of `model`; `model` wins when both are set.
    pub name: Option<String>,
    /// Accepted and ignored: nothing is downloaded.
    pub insecure: Option<bool>,
    /// `false`: one JSON object; otherwise (Ollama's default) a stream of JSON lines, here one.
    pub stream: Option<bool>,
}

/// Where a pull stands: here always `success`, the model being served already.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaPullStatus {
    pub status: String,
}

/// Pull a model: a served one is there already, so the answer is Ollama's
/// last line, `{"status": "success"}` (tools that pull a model before they
/// embed with it need no other setup). This server loads its models at
/// start-up and downloads nothing: with several models served, an unknown
/// name is a 404; a one-model server answers for any name, as its other
/// routes do.
#[utoipa::path(
    post, path = "/api/pull", tag = "ollama", operation_id = "ollama_pull",
    request_body = OllamaPullRequest,
    responses(
        (status = 200, description = "The model is served: one JSON object with `stream: false`, else one JSON line", content(
            (OllamaPullStatus = "application/json"),
            (OllamaPullStatus = "application/x-ndjson"),
        )),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 no model named, 401, 404 unknown model (below), 413, 415)", Task::Describe), body = OllamaErrorBody),
    )
)]
pub async fn pull(
    State(state): State<AppState>,
    ApiJson(req, _): ApiJson<OllamaPullRequest, Ollama>,
) -> Result<Response, Shaped<Ollama>> {
    required_model(&state, req.model, req.name)?;
    let done = OllamaPullStatus {
        status: "success".into(),
    };
    if req.stream == Some(false) {
        return Ok(Json(done).into_response());
    }
    let mut line = serde_json::to_vec(&done).unwrap_or_default();
    line.push(b'\n');
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], line).into_response())
}

/// The model `show` and `pull` name: required there, as in Ollama, even on a
/// one-model server; `model` wins over the older `name` when both are set.
fn required_model(
    state: &AppState,
    model: Option<String>,
    name: Option<String>,
) -> Result<&ServedModel, ApiError> {
    let requested = [model, name].into_iter().flatten().find(|m| !m.is_empty());
    let name = served_name(requested)
        .ok_or_else(|| ApiError::invalid("model is required").param("model"))?;
    state.model_for(Some(&name), Task::Describe)
}

fn details(model: &ServedModel) -> OllamaModelDetails {
    let weights = model.info().weights.as_ref();
    let family = weights.map_or_else(String::new, |w| w.architecture.clone());
    OllamaModelDetails {
        parent_model: String::new(),
        format: weights.map_or_else(String::new, |w| w.format.clone()),
        families: if family.is_empty() {
            Vec::new()
        } else {
            vec![family.clone()]
        },
        family,
        parameter_size: weights.map_or_else(String::new, |w| parameter_size(w.parameters)),
        quantization_level: weights.map_or_else(String::new, |w| match w.quantization_bits {
            Some(bits) => format!("Q{bits}"),
            None => float_level(&w.dtype),
        }),
    }
}

fn weights_bytes(model: &ServedModel) -> u64 {
    model.info().weights.as_ref().map_or(0, |w| w.bytes)
}

fn started(state: &AppState) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(state.started_unix())
}

fn started_at(state: &AppState) -> String {
    rfc3339(started(state))
}

fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

/// `float32` -> `F32`, `bfloat16` -> `BF16`, `float16` -> `F16`.
fn float_level(dtype: &str) -> String {
    match dtype {
        "float32" => "F32".into(),
        "float16" => "F16".into(),
        "bfloat16" => "BF16".into(),
        other => other.to_uppercase(),
    }
}

/// A parameter count the way Ollama prints it: whole millions below a
/// billion (`23M`), one decimal above (`1.5B`).
fn parameter_size(n: u64) -> String {
    const THOUSAND: f64 = 1e3;
    const MILLION: f64 = 1e6;
    const BILLION: f64 = 1e9;
    let x = n as f64;
    if x >= BILLION {
        format!("{:.1}B", x / BILLION)
    } else if x >= MILLION {
        format!("{:.0}M", x / MILLION)
    } else if x >= THOUSAND {
        format!("{:.0}K", x / THOUSAND)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes_read_like_ollamas() {
        assert_eq!(parameter_size(22_565_376), "23M");
        assert_eq!(parameter_size(137_000_000), "137M");
        assert_eq!(parameter_size(595_776_512), "596M");
        assert_eq!(parameter_size(1_543_714_304), "1.5B");
        assert_eq!(parameter_size(8_030_261_248), "8.0B");
        assert_eq!(parameter_size(4_096), "4K");
        assert_eq!(parameter_size(12), "12");
    }

    #[test]
    fn latest_is_the_default_tag() {
        assert_eq!(served_name(Some("m:latest".into())).as_deref(), Some("m"));
        assert_eq!(served_name(Some("m".into())).as_deref(), Some("m"));
        assert_eq!(served_name(Some("m:v2".into())).as_deref(), Some("m:v2"));
        assert_eq!(served_name(None), None);
    }

    #[test]
    fn float_types_name_like_ollamas() {
        assert_eq!(float_level("float32"), "F32");
        assert_eq!(float_level("bfloat16"), "BF16");
        assert_eq!(float_level("float16"), "F16");
    }
}
