//! The router and its thin API adapters. Each embed route parses its own
//! request shape into one [`crate::embed::EmbedRequest`], calls
//! [`crate::embed::embed`], and formats its own response.

pub mod cohere;
pub mod jina;
pub mod native;
pub mod ollama;
pub mod openai;
pub mod ops;
pub mod platforms;
pub mod pooling;
pub mod predict;
pub mod rerank;
pub mod root;
pub mod similarity;
pub mod tei;
pub mod tokens;
pub mod vllm;
pub mod weaviate;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{get, post};
use axum::Router;
use mlx_embed_core::Prompt;
use serde::Serialize;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};
use utoipa::ToSchema;

use crate::answer_room::count_unsent_answers;
use crate::errors::ApiError;
use crate::middleware::{
    check_host, finish_unread_bodies, observe, refuse_encoded_bodies, require_api_key, REQUEST_ID,
};
use crate::state::AppState;

/// Every route, with body limit, refusal of compressed bodies, API-key check,
/// CORS (`--cors-allow-origin`), request ids, logs and metrics.
pub fn router(state: AppState) -> Router {
    let max_body = state.args().max_body_bytes;
    let routes = Router::new()
        .route("/api/v1/embed", post(native::embed))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*model}", get(openai::model))
        // Without the version prefix, as Infinity serves them and as an
        // OpenAI client configured with a bare `base_url` calls them.
        .route("/embeddings", post(openai::embeddings))
        .route("/models", get(openai::models))
        .route("/models/{*model}", get(openai::model))
        .route("/embed", post(tei::embed))
        .route("/embed_all", post(tei::embed_all))
        .route("/embed_sparse", post(tei::embed_sparse))
        .route("/v1/multi-vector", post(jina::multi_vector))
        .route("/api/embed", post(ollama::embed))
        .route("/api/embeddings", post(ollama::embeddings))
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/pull", post(ollama::pull))
        .route("/api/version", get(ollama::version))
        .route("/rerank", post(rerank::tei_rerank))
        .route("/v1/embed", post(cohere::embed_v1))
        .route("/v2/embed", post(cohere::embed_v2))
        .route("/v1/rerank", post(rerank::cohere_rerank_v1))
        .route("/v2/rerank", post(rerank::cohere_rerank_v2))
        .route("/v1/ranking", post(rerank::nim_ranking))
        .route("/score", post(vllm::score_pairs))
        .route("/v1/score", post(vllm::score_pairs))
        .route("/pooling", post(pooling::pooling))
        .route("/classify", post(pooling::classify))
        .route("/version", get(vllm::version))
        .route("/invocations", post(platforms::invocations))
        .route("/ping", get(ops::health))
        .route("/vertex", post(platforms::vertex))
        .route("/predict", post(predict::predict))
        .route("/similarity", post(similarity::similarity))
        .route("/tokenize", post(tokens::tokenize))
        .route("/decode", post(tokens::decode))
        .route("/", post(root::inference).get(ollama::running))
        .route("/vectors", post(weaviate::vectors))
        .route("/vectors/", post(weaviate::vectors))
        .route("/meta", get(weaviate::meta))
        .route("/.well-known/live", get(weaviate::live))
        .route("/.well-known/ready", get(weaviate::ready))
        .route("/health", get(ops::health))
        .route("/metrics", get(ops::metrics))
        .route("/info", get(ops::info))
        .route("/openapi.json", get(ops::openapi))
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(from_fn_with_state(state.clone(), count_unsent_answers))
        // Inside the key check: a client without the key learns nothing more.
        .layer(from_fn(refuse_encoded_bodies))
        .layer(from_fn_with_state(state.clone(), require_api_key));
    // Outside the key check: a browser's preflight carries no credentials,
    // and a 401 needs the CORS headers for the page to read it.
    let routes = match cors(&state.args().cors_allow_origin) {
        Some(layer) => routes.layer(layer),
        None => routes,
    };
    routes
        // Outside the key check and CORS: a page that rebinds a name has no
        // key to send, and is told no whatever it sends, preflight included.
        .layer(from_fn_with_state(state.clone(), check_host))
        // Outside every refusal that comes before the body is read.
        .layer(from_fn_with_state(state.clone(), finish_unread_bodies))
        .layer(from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// `--prometheus-port`'s routes: GET /metrics alone, behind the same key
/// and host checks as the main port's (its text tells a model's traffic).
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(ops::metrics))
        .fallback(ops::not_found)
        .method_not_allowed_fallback(ops::method_not_allowed)
        .layer(from_fn_with_state(state.clone(), require_api_key))
        .layer(from_fn_with_state(state.clone(), check_host))
        .with_state(state)
}

/// The CORS policy for `--cors-allow-origin` (none when it is empty).
fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            // Whatever headers the page's request carries: the official SDKs
            // add their own (OpenAI's `x-stainless-*`, Cohere's `x-fern-*`),
            // and a preflight that leaves one out blocks the call. The
            // origin is what CORS restricts; the API key still guards the
            // request itself.
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers(
                [REQUEST_ID.clone(), header::RETRY_AFTER]
                    .into_iter()
                    .chain(crate::timing::HEADER_NAMES.map(HeaderName::from_static))
                    .collect::<Vec<_>>(),
            )
            .max_age(Duration::from_secs(3600)),
    )
}

/// The prompt a request asked for: a named one of the model's, raw text, or
/// (neither) the model's default.
pub(crate) fn prompt_of(
    prompt_name: Option<String>,
    raw: Option<String>,
) -> Result<Prompt, ApiError> {
    match (prompt_name, raw) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid("give either prompt_name or prompt, not both").param("prompt"))
        }
        (Some(name), None) => Ok(Prompt::Named(name)),
        (None, Some(text)) => Ok(Prompt::Raw(text)),
        (None, None) => Ok(Prompt::Default),
    }
}

/// Jina AI's `task` (jina-embeddings-v3's task adapters): one of the
/// served model's `tasks`, checked here so the 400 names the field; the core
/// runs its adapter and, unless the request names another prompt, the
/// model's prompt of that name.
pub(crate) fn task_of(
    state: &AppState,
    model: Option<&str>,
    task: Option<String>,
) -> Result<Option<String>, ApiError> {
    let Some(task) = task else {
        return Ok(None);
    };
    let served = state.model_for(model, crate::models::Task::Embed)?;
    let info = served.info();
    if info.tasks.is_empty() {
        return Err(ApiError::invalid(format!(
            "task {task:?}: {} has no task adapters (task selects a LoRA adapter of a model \
             that has them, such as jina-embeddings-v3)",
            info.name
        ))
        .param("task"));
    }
    if !info.tasks.contains(&task) {
        return Err(ApiError::invalid(format!(
            "unknown task {task:?}: valid tasks are {}",
            info.tasks.join(", ")
        ))
        .param("task"));
    }
    Ok(Some(task))
}

/// What a text is for, as the APIs that say so name it (Cohere's and
/// Voyage's `input_type`, Weaviate's `task_type`): the one owner of how
/// such a role becomes a prompt or a task adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Query,
    /// A document called a document (Cohere's `search_document`, Voyage's `document`).
    Document,
    /// A document called a passage (NIM's and Weaviate's `passage`).
    Passage,
    Classification,
    Clustering,
}

impl Role {
    /// Prompt names for the role, in the order tried: a document's own name
    /// first, then the other one models use.
    fn prompt_names(self) -> &'static [&'static str] {
        match self {
            Role::Query => &["query"],
            Role::Document => &["document", "passage"],
            Role::Passage => &["passage", "document"],
            Role::Classification => &["classification"],
            Role::Clustering => &["clustering"],
        }
    }

    /// The task adapter for the role, by jina-embeddings-v3's names (its
    /// model card: `separation` is its task for clustering).
    fn task(self) -> &'static str {
        match self {
            Role::Query => "retrieval.query",
            Role::Document | Role::Passage => "retrieval.passage",
            Role::Classification => "classification",
            Role::Clustering => "separation",
        }
    }
}

/// The prompt and the task adapter a role picks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RolePick {
    pub prompt: Prompt,
    pub task: Option<String>,
}

/// On a model whose task adapters include the role's task
/// (jina-embeddings-v3), that task, exactly as an explicit `task` runs it
/// (its adapter with its prompt): its prompts alone, without the adapter,
/// are not what its library runs, and its prompt names are not the roles'.
/// Otherwise the first of the role's prompt names the model has a prompt
/// for, else its default prompt (as for no role).
pub(crate) fn role_pick(role: Option<Role>, info: &mlx_embed_core::ModelInfo) -> RolePick {
    let Some(role) = role else {
        return RolePick {
            prompt: Prompt::Default,
            task: None,
        };
    };
    if info.tasks.iter().any(|t| t == role.task()) {
        return RolePick {
            prompt: Prompt::Default,
            task: Some(role.task().to_owned()),
        };
    }
    RolePick {
        prompt: role_prompt(role.prompt_names(), &info.prompts),
        task: None,
    }
}

/// What a request says its texts are for in its own API's words, beside
/// Jina AI's `task`.
pub(crate) enum Said {
    /// A prompt: named (`prompt_name`, which on a model with task adapters
    /// runs the adapter of a task of that name: the core's rule), raw, or
    /// the model's default (nothing said).
    Prompt(Prompt),
    /// A role field (`input_type`, `task_type`): its name, its value as
    /// sent, and the role it names.
    Role {
        field: &'static str,
        value: &'static str,
        role: Role,
    },
}

impl Said {
    /// A role field that may be unset (unset: nothing said).
    pub(crate) fn role(field: &'static str, role: Option<(&'static str, Role)>) -> Self {
        match role {
            Some((value, role)) => Said::Role { field, value, role },
            None => Said::Prompt(Prompt::Default),
        }
    }
}

/// The prompt and task adapter of an embedding request that may give Jina
/// AI's `task` (checked by [`task_of`]) beside its own API's way of saying
/// what its texts are for: the one owner of how the two combine, on every
/// route that takes both. Both picking the same task is the same request;
/// picking two different ones is a 400 naming the route's own field
/// (neither silently wins). A `task` with a prompt that names no task (or a
/// raw one) runs that prompt under the task's adapter, as the core does.
pub(crate) fn pick_task(
    state: &AppState,
    model: Option<&str>,
    task: Option<String>,
    said: Said,
) -> Result<RolePick, ApiError> {
    let task = task_of(state, model, task)?;
    let info = || {
        state
            .model_for(model, crate::models::Task::Embed)
            .map(|m| m.info())
    };
    let (field, value, pick, picked) = match said {
        Said::Role { field, value, role } => {
            let pick = role_pick(Some(role), info()?);
            let picked = pick.task.clone();
            (field, value.to_owned(), pick, picked)
        }
        Said::Prompt(Prompt::Named(name)) if task.is_some() => {
            let picked = info()?.tasks.contains(&name).then(|| name.clone());
            let pick = RolePick {
                prompt: Prompt::Named(name.clone()),
                task: None,
            };
            ("prompt_name", format!("{name:?}"), pick, picked)
        }
        Said::Prompt(prompt) => return Ok(RolePick { prompt, task }),
    };
    match (task, picked) {
        (Some(asked), Some(picked)) if asked != picked => Err(ApiError::invalid(format!(
            "{field} {value} picks task {picked:?} on this model, but task is {asked:?}: send \
             one of them (or both the same)"
        ))
        .param(field)),
        (asked, _) => Ok(RolePick {
            prompt: pick.prompt,
            task: asked.or(pick.task),
        }),
    }
}

/// The first of `roles` the model has a prompt named for, else its default prompt.
fn role_prompt(roles: &[&str], prompts: &BTreeMap<String, String>) -> Prompt {
    roles
        .iter()
        .find(|name| prompts.contains_key(**name))
        .map_or(Prompt::Default, |name| Prompt::Named((*name).to_owned()))
}

/// A per-request cut (Cohere's `max_tokens`, vLLM's `truncate_prompt_tokens`,
/// Ollama's `num_ctx`, the native `truncate_to`) as the core's
/// [`EmbedOptions::truncate_to`](mlx_embed_core::EmbedOptions::truncate_to):
/// at least one token; one over the model's maximum is the maximum, and
/// one too short for the model's special tokens is refused by the tokenizer.
pub(crate) fn cut_at(param: &'static str, n: Option<i64>) -> Result<Option<usize>, ApiError> {
    match n {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => Err(ApiError::invalid(format!(
            "{param} must be at least 1 token (special tokens included), not {n}"
        ))
        .param(param)),
    }
}

/// A unique-enough id for the `id` field of Cohere's answers (embed and
/// rerank) and vLLM's (score, pooling, classify), e.g. `rerank-<time>-<n>`.
pub(crate) fn response_id(kind: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!(
        "{kind}-{nanos:x}-{:x}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Unix seconds now: the `created` field of vLLM's and Infinity's answers.
pub(crate) fn unix_now() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Token usage of one request.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    /// Exact tokens of all inputs (after truncation, specials included),
    /// cached or not.
    pub prompt_tokens: u64,
    pub total_tokens: u64,
    /// Inputs answered from the embedding cache instead of the model.
    pub cache_hits: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u64, cache_hits: u32) -> Self {
        Self {
            prompt_tokens,
            total_tokens: prompt_tokens,
            cache_hits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_embed_core::ModelInfo;

    fn info(prompts: &[(&str, &str)], tasks: &[&str]) -> ModelInfo {
        ModelInfo {
            prompts: prompts
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            tasks: tasks.iter().map(|&t| t.to_owned()).collect(),
            ..ModelInfo::default()
        }
    }

    #[test]
    fn roles_pick_a_task_where_the_model_has_its_adapter() {
        const JINA: &[&str] = &[
            "retrieval.query",
            "retrieval.passage",
            "separation",
            "classification",
            "text-matching",
        ];
        let jina = info(
            &[
                ("retrieval.query", "Represent the query: "),
                ("separation", ""),
            ],
            JINA,
        );
        let task = |t: &str| RolePick {
            prompt: Prompt::Default,
            task: Some(t.to_owned()),
        };
        assert_eq!(role_pick(Some(Role::Query), &jina), task("retrieval.query"));
        assert_eq!(
            role_pick(Some(Role::Document), &jina),
            task("retrieval.passage")
        );
        assert_eq!(
            role_pick(Some(Role::Passage), &jina),
            task("retrieval.passage")
        );
        assert_eq!(
            role_pick(Some(Role::Classification), &jina),
            task("classification")
        );
        assert_eq!(role_pick(Some(Role::Clustering), &jina), task("separation"));
        let none = RolePick {
            prompt: Prompt::Default,
            task: None,
        };
        assert_eq!(role_pick(None, &jina), none);
        // A model with adapters of other names: its prompts by role, as without.
        let other = info(&[("query", "q: ")], &["legal", "medical"]);
        let prompt = |p: &str| RolePick {
            prompt: Prompt::Named(p.to_owned()),
            task: None,
        };
        assert_eq!(role_pick(Some(Role::Query), &other), prompt("query"));
        assert_eq!(role_pick(Some(Role::Clustering), &other), none);
        // Without adapters, a prompt named like a task is only a prompt name.
        let e5 = info(&[("query", "query: "), ("passage", "passage: ")], &[]);
        assert_eq!(role_pick(Some(Role::Query), &e5), prompt("query"));
        assert_eq!(role_pick(Some(Role::Document), &e5), prompt("passage"));
        let plain = info(&[("retrieval.query", "r: ")], &[]);
        assert_eq!(role_pick(Some(Role::Query), &plain), none);
    }

    #[test]
    fn a_passage_takes_the_passage_prompt_and_a_document_the_document_one() {
        // A model with both names (an e5-style folder that also names a document prompt).
        let both = info(
            &[
                ("query", "query: "),
                ("passage", "passage: "),
                ("document", ""),
            ],
            &[],
        );
        let pick = |role, info: &ModelInfo| role_pick(Some(role), info).prompt;
        assert_eq!(pick(Role::Passage, &both), Prompt::Named("passage".into()));
        assert_eq!(
            pick(Role::Document, &both),
            Prompt::Named("document".into())
        );
        assert_eq!(pick(Role::Query, &both), Prompt::Named("query".into()));
        // With one of the two names, either role finds it.
        let only_passage = info(&[("passage", "passage: ")], &[]);
        assert_eq!(
            pick(Role::Document, &only_passage),
            Prompt::Named("passage".into())
        );
        assert_eq!(
            pick(Role::Passage, &only_passage),
            Prompt::Named("passage".into())
        );
        assert_eq!(pick(Role::Query, &ModelInfo::default()), Prompt::Default);
    }
}
