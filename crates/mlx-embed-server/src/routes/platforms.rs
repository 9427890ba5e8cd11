//! Cloud platforms' routes, as Hugging Face TEI serves them: `POST
//! /invocations` and `GET /ping` (the container contract of AWS SageMaker),
//! and `POST /vertex` (Google Vertex AI's `{"instances": [...]}` in,
//! `{"predictions": [...]}` out).
//!
//! A request is answered by the route TEI picks for the model's kind: an
//! embedding model's `/embed` (a SPLADE model's `/embed_sparse`), a
//! classifier's `/predict`, a reranker's `/rerank`, each through its own
//! path. TEI serves one model and picks at start; here the request's `model`
//! field (else the default model) is the one.

use std::borrow::Cow;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::join_all;
use mlx_embed_core::{EmbedInput, ModelKind, Priority};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::openapi::schema::{AnyOfBuilder, OneOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::predict::{predict_body, PredictResponse};
use super::rerank::{parse, rerank_body, tei_rank, TeiRank, TeiRerankRequest};
use super::tei::{sparse_values, SparseValue, TeiEmbedRequest, TeiRawRequest};
use crate::embed::{check_inputs, embed as run_embed, finish_pooled, validate, EmbedRequest};
use crate::errors::{ApiError, ErrorKind, Shaped, Tei, TeiErrorBody, TeiOrOpenAiErrorBody};
use crate::extract::{ApiJson, PriorityHeader};
use crate::models::Task;
use crate::state::AppState;
use crate::timing::{self, Measured};

/// The route that answers a platform request, by the model's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Job {
    Embed,
    EmbedSparse,
    Predict,
    Rerank,
}

/// The job of the model `requested` names (none: the default model).
pub(crate) fn job_of(state: &AppState, requested: Option<&str>) -> Result<Job, ApiError> {
    let info = state.model_for(requested, Task::Describe)?.info();
    Ok(match info.kind {
        ModelKind::Embedding if info.sparse => Job::EmbedSparse,
        ModelKind::Embedding => Job::Embed,
        ModelKind::Classifier { .. } => Job::Predict,
        ModelKind::Reranker { .. } => Job::Rerank,
    })
}

/// Whether `body` is a `/rerank` body: a `query` with TEI's `texts`, or
/// with the `documents` of the other form where the route takes it too.
/// Read from the keys alone: the body is parsed once, by the route that
/// answers it, whose error then says what is wrong with it.
pub(crate) fn is_rerank_body(body: &Value, documents_too: bool) -> bool {
    body.get("query").is_some()
        && (body.get("texts").is_some() || (documents_too && body.get("documents").is_some()))
}

/// A body's `model` field, when it is a string.
pub(crate) fn model_field(body: &Value) -> Option<&str> {
    body.get("model").and_then(Value::as_str)
}

/// A platform request's answer: that of the route that answered it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum RouteAnswer {
    /// `/embed`'s: one vector per input.
    Embed(Vec<Vec<f32>>),
    /// `/embed_sparse`'s: each input's non-zero entries.
    EmbedSparse(Vec<Vec<SparseValue>>),
    /// `/predict`'s: labels best first, per input.
    Predict(PredictResponse),
    /// `/rerank`'s (TEI's `texts` form): documents best first.
    Rerank(Vec<TeiRank>),
}

/// `body` answered by `job`'s route, in TEI's shapes (`/rerank`'s `texts` form).
pub(crate) async fn answer(
    state: &AppState,
    job: Job,
    body: Value,
    priority: Option<Priority>,
) -> Result<RouteAnswer, ApiError> {
    Ok(match job {
        Job::Embed => {
            let req: TeiEmbedRequest = parse(body)?;
            RouteAnswer::Embed(
                run_embed(state, req.into_request(state, priority)?)
                    .await?
                    .vectors,
            )
        }
        Job::EmbedSparse => {
            let req: TeiRawRequest = parse(body)?;
            RouteAnswer::EmbedSparse(sparse_values(state, req, priority).await?)
        }
        Job::Predict => RouteAnswer::Predict(predict_body(state, parse(body)?, priority).await?),
        Job::Rerank => {
            let req: TeiRerankRequest = parse(body)?;
            RouteAnswer::Rerank(tei_rank(state, req, priority).await?)
        }
    })
}

/// What `/invocations` takes: the body of the route it answers with
/// (documentation only: a union of existing schemas, any of which may match).
pub struct InvocationsBody;

/// The schemas of the bodies both `/invocations` and `/vertex` take: the
/// route bodies of each kind of model.
const ROUTE_BODIES: [&str; 4] = [
    "TeiEmbedRequest",
    "TeiRawRequest",
    "PredictRequest",
    "TeiRerankRequest",
];

/// Any of the schemas `names`, described.
fn any_of(names: &[&str], description: &str) -> RefOr<Schema> {
    names
        .iter()
        .fold(AnyOfBuilder::new(), |any, name| {
            any.item(Ref::from_schema_name(*name))
        })
        .description(Some(description))
        .into()
}

impl PartialSchema for InvocationsBody {
    fn schema() -> RefOr<Schema> {
        let mut names = ROUTE_BODIES.to_vec();
        names.push("CohereRerankRequest");
        any_of(
            &names,
            "The body of the route that answers: /embed (an embedding model), /embed_sparse \
             (SPLADE), /predict (a classifier), /rerank (a reranker)",
        )
    }
}

impl ToSchema for InvocationsBody {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("InvocationsBody")
    }
}

/// A `/vertex` instance (documentation only): [`InvocationsBody`] but
/// `/rerank`'s `documents` form, which `plan` refuses (422) there.
pub struct VertexInstance;

impl PartialSchema for VertexInstance {
    fn schema() -> RefOr<Schema> {
        any_of(
            &ROUTE_BODIES,
            "The body of the route that answers: /rerank's `query` and `texts` form (a \
             reranker; its `documents` form is a 422 here), else the model's route: /embed \
             (an embedding model), /embed_sparse (SPLADE), /predict (a classifier or reranker)",
        )
    }
}

impl ToSchema for VertexInstance {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("VertexInstance")
    }
}

/// What `/invocations` answers (documentation only): the answering route's
/// answer, `/rerank`'s `documents` form included.
pub struct InvocationsAnswer;

impl PartialSchema for InvocationsAnswer {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(Ref::from_schema_name("RouteAnswer"))
            .item(Ref::from_schema_name("CohereRerankResponse"))
            .into()
    }
}

impl ToSchema for InvocationsAnswer {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("InvocationsAnswer")
    }
}

/// SageMaker's inference route: answered by `/embed` for an embedding model
/// (`/embed_sparse` for SPLADE), `/predict` for a classifier, `/rerank` for a
/// reranker, as TEI answers it. The model is the body's `model`, else the
/// default model; a rerank body (`query` with `texts` or `documents`) is
/// reranked.
///
/// Errors use `{"error": str, "error_type": str}` (a `/rerank` `documents`
/// body: `/v1/rerank`'s shape, as on `/rerank`).
#[utoipa::path(
    post, path = "/invocations", tag = "platforms", operation_id = "sagemaker_invocations",
    request_body = InvocationsBody,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "The answering route's answer", body = InvocationsAnswer),
        (status = "4XX", description = crate::openapi::refusals("Invalid request, as the answering route's (400, 401, 404 unknown model (below), 413, 415, 422, 429)", Task::Describe), body = TeiOrOpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiOrOpenAiErrorBody),
    )
)]
pub async fn invocations(
    State(state): State<AppState>,
    priority: Result<PriorityHeader<Tei>, Shaped<Tei>>,
    ApiJson(body, _): ApiJson<Value, Tei>,
) -> Response {
    let priority = priority.map(|header| header.0).map_err(|shaped| shaped.0);
    // A rerank body (either of /rerank's forms) is reranked whatever the
    // default model is, as on /vertex: beside an embedder, the reranker answers it.
    let job = match job_of(&state, model_field(&body)) {
        Ok(_) if is_rerank_body(&body, true) => Job::Rerank,
        Ok(job) => job,
        Err(e) => return Shaped::<Tei>::from(e).into_response(),
    };
    if job == Job::Rerank {
        // Both of /rerank's forms, each answered in its own shape.
        return rerank_body(&state, priority, body).await;
    }
    let answered = match priority {
        Ok(priority) => answer(&state, job, body, priority).await,
        Err(e) => Err(e),
    };
    answered
        .map(Json)
        .map_err(Shaped::<Tei>::from)
        .into_response()
}

/// Vertex AI's prediction request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct VertexRequest {
    /// Each a body of the route that answers it: a `/rerank` body (`query`
    /// and `texts`) is reranked; any other goes to the model's route
    /// (`/embed`, `/embed_sparse`, or `/predict` for a classifier or reranker).
    #[schema(value_type = Vec<VertexInstance>)]
    pub instances: Vec<Value>,
}

/// Vertex AI's prediction response.
#[derive(Debug, Serialize, ToSchema)]
pub struct VertexResponse {
    /// One per instance, in order.
    pub predictions: Vec<RouteAnswer>,
}

/// Google Vertex AI's prediction route, as TEI serves it: every instance
/// answered by its route. Instances for `/embed` of one model, truncation and
/// prompt run as one call (`normalize` and `dimensions` are applied to each
/// instance's vectors after it), so a request of many one-text instances
/// takes its turns in its lane as one bulk call does, not as that many
/// callers ahead of a query; other instances run at once. All instances together hold at most
/// `--max-inputs-per-request` inputs; one failure fails the request, and its
/// message names the instance.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/vertex", tag = "platforms", operation_id = "vertex_predict",
    request_body = VertexRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "One prediction per instance, in order", body = VertexResponse),
        (status = "4XX", description = crate::openapi::refusals_by_case("Invalid request (400, 401, 404 unknown model (below), 413 incl. more inputs in all instances than --max-inputs-per-request, 415, 422 incl. an instance of the wrong shape, 429)", &[("A rerank instance (`query` and `texts`)", Task::Rerank), ("Any other instance", Task::Describe)]), body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn vertex(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<VertexRequest, Tei>,
) -> Result<Json<VertexResponse>, Shaped<Tei>> {
    // TEI answers each instance as its own request, and counts it so: each
    // is one in `te_request_*`, the `/vertex` request none of its own.
    let start = std::time::Instant::now();
    let mut planned = Vec::with_capacity(req.instances.len());
    for (i, instance) in req.instances.into_iter().enumerate() {
        let (plan, seen) = timing::scoped(|| plan(&state, instance, priority));
        match plan {
            Ok(plan) => planned.push((plan, seen.method)),
            Err(e) => {
                // Read but refused: counted as TEI counts an instance refused
                // (one that could not be read is in no count, nor in TEI's).
                if let Some(method) = seen.method {
                    let refused = Measured {
                        method: Some(method),
                        began: true,
                        ..seen
                    };
                    let status = e.kind.status().as_u16();
                    state
                        .http_metrics()
                        .record_tei(&refused, status, start.elapsed());
                }
                return Err(in_instance(e, i).into());
            }
        }
    }
    let max_inputs = state.args().max_inputs_per_request;
    let total: usize = planned.iter().map(|(p, _)| p.inputs()).sum();
    if total > max_inputs {
        return Err(ApiError::new(
            ErrorKind::TooLarge,
            format!(
                "the instances hold {total} inputs in all, more than the limit of {max_inputs} \
                 per request (--max-inputs-per-request); split the request"
            ),
        )
        .param("instances")
        .into());
    }
    let n = planned.len();
    let mut groups: Vec<EmbedGroup> = Vec::new();
    let mut others = Vec::new();
    for (i, (instance, method)) in planned.into_iter().enumerate() {
        match instance {
            Planned::Embed(req, dimension) => {
                let owner = Owner {
                    instance: i,
                    inputs: req.inputs.len(),
                    dimension,
                    normalize: req.normalize,
                    method,
                };
                match groups.iter_mut().find(|g| g.takes(&req)) {
                    Some(group) => group.add(owner, req.inputs),
                    None => groups.push(EmbedGroup::new(owner, req)),
                }
            }
            Planned::Other(job, body) => others.push((i, job, body)),
        }
    }
    let state = &state;
    // Every instance runs to its end, as TEI's do (each is counted by its
    // own outcome, none as dropped for another's failure); the first
    // instance's failure answers.
    let embedded = join_all(groups.into_iter().map(|group| {
        let first = group.owners.first().map_or(0, |o| o.instance);
        let parts = group.parts();
        async move {
            timing::apart(state, start, parts, group.run(state))
                .await
                .map_err(|e| (first, e))
        }
    }));
    let answered = join_all(others.into_iter().map(|(i, job, body)| async move {
        let whole = vec![timing::Part {
            inputs: None,
            method: None,
        }];
        timing::apart(state, start, whole, answer(state, job, body, priority))
            .await
            .map(|a| vec![(i, a)])
            .map_err(|e| (i, in_instance(e, i)))
    }));
    let (embedded, answered) = futures_util::future::join(embedded, answered).await;
    let mut predictions: Vec<Option<RouteAnswer>> = (0..n).map(|_| None).collect();
    let mut failed: Option<(usize, ApiError)> = None;
    for result in embedded.into_iter().chain(answered) {
        match result {
            Ok(answers) => {
                for (i, answer) in answers {
                    predictions[i] = Some(answer);
                }
            }
            Err((i, e)) if failed.as_ref().is_none_or(|(first, _)| i < *first) => {
                failed = Some((i, e));
            }
            Err(_) => {}
        }
    }
    if let Some((_, e)) = failed {
        return Err(e.into());
    }
    Ok(Json(VertexResponse {
        predictions: predictions
            .into_iter()
            .map(|p| p.expect("every instance answered"))
            .collect(),
    }))
}

/// One Vertex instance, parsed and routed before anything runs.
enum Planned {
    /// An `/embed` body, merged with others of the same model and options,
    /// and the width of its vectors.
    Embed(EmbedRequest, usize),
    /// Any other route's body, answered on its own.
    Other(Job, Value),
}

impl Planned {
    /// Inputs the instance sends to the model (a rerank: its documents).
    fn inputs(&self) -> usize {
        match self {
            Planned::Embed(req, _) => req.inputs.len(),
            Planned::Other(_, body) => match body.get("texts").or_else(|| body.get("inputs")) {
                Some(Value::Array(items)) => items.len(),
                _ => 1,
            },
        }
    }
}

/// Routes one instance as TEI does: a rerank body is reranked whatever the
/// model (a model that is no reranker refuses it); the rest go to the
/// model's route, a reranker's being `/predict`.
fn plan(
    state: &AppState,
    instance: Value,
    priority: Option<Priority>,
) -> Result<Planned, ApiError> {
    if is_rerank_body(&instance, false) {
        return Ok(Planned::Other(Job::Rerank, instance));
    }
    if is_rerank_body(&instance, true) {
        // Predictions are TEI's shapes, as TEI's /vertex answers them, and
        // the `documents` form's answer is another API's.
        return Err(ApiError::new(
            ErrorKind::Unprocessable,
            "a rerank instance takes TEI's `query` and `texts` (`documents` is the \
             /v1/rerank form, which /vertex does not take)",
        ));
    }
    Ok(match job_of(state, model_field(&instance))? {
        Job::Embed => {
            let req = parse::<TeiEmbedRequest>(instance)?.into_request(state, priority)?;
            // Checked here, as /embed checks them: merged with others they
            // would not be (an empty instance would answer `[]`).
            check_inputs(state, &req.inputs, req.model.as_deref(), Task::Embed)?;
            let dimension = validate(&req, state.model_for(req.model.as_deref(), Task::Embed)?)?;
            Planned::Embed(req, dimension)
        }
        Job::Rerank => Planned::Other(Job::Predict, instance),
        job => Planned::Other(job, instance),
    })
}

/// `/embed` instances of one model and options, run as one call whose raw
/// vectors each instance then cuts and normalizes as it asked.
struct EmbedGroup {
    req: EmbedRequest,
    owners: Vec<Owner>,
}

/// One instance of an [`EmbedGroup`].
struct Owner {
    /// Its index in the request.
    instance: usize,
    inputs: usize,
    dimension: usize,
    normalize: bool,
    /// Its shape, as its body said it (TEI's `method`).
    method: Option<timing::Method>,
}

impl EmbedGroup {
    fn new(owner: Owner, req: EmbedRequest) -> Self {
        Self {
            req: EmbedRequest {
                normalize: false,
                dimensions: None,
                ..req
            },
            owners: vec![owner],
        }
    }

    /// Whether `req` differs from the group's only in what is applied to
    /// each instance's vectors (inputs, `normalize`, `dimensions`).
    fn takes(&self, req: &EmbedRequest) -> bool {
        (&self.req.model, &self.req.options) == (&req.model, &req.options)
    }

    /// Its instances, each a request of its own in TEI's metrics.
    fn parts(&self) -> Vec<timing::Part> {
        self.owners
            .iter()
            .map(|o| timing::Part {
                inputs: Some(o.inputs as u64),
                method: o.method,
            })
            .collect()
    }

    fn add(&mut self, owner: Owner, inputs: Vec<EmbedInput>) {
        self.owners.push(owner);
        self.req.inputs.extend(inputs);
    }

    /// Each instance's vectors, by instance index; an error names the
    /// instance (and its input) it is about.
    async fn run(self, state: &AppState) -> Result<Vec<(usize, RouteAnswer)>, ApiError> {
        let owners = self.owners;
        let mut vectors = match run_embed(state, self.req).await {
            Ok(out) => out.vectors.into_iter(),
            Err(mut e) => {
                let spans: Vec<(usize, usize)> =
                    owners.iter().map(|o| (o.instance, o.inputs)).collect();
                e.message = locate_input(&e.message, &spans);
                return Err(e);
            }
        };
        Ok(owners
            .into_iter()
            .map(|owner| {
                let answer = vectors
                    .by_ref()
                    .take(owner.inputs)
                    .map(|mut v| {
                        finish_pooled(&mut v, owner.dimension, owner.normalize);
                        v
                    })
                    .collect();
                (owner.instance, RouteAnswer::Embed(answer))
            })
            .collect())
    }
}

/// `error` about instance `i`.
fn in_instance(mut error: ApiError, i: usize) -> ApiError {
    error.message = format!("instance {i}: {}", error.message);
    error
}

/// A merged call's error message told of the instance it is about: the
/// one input `k` is in when it begins `input <k>` (the core names an input
/// so), else the first instance (they share the options such an error is
/// about).
fn locate_input(message: &str, owners: &[(usize, usize)]) -> String {
    let first = owners.first().map_or(0, |&(instance, _)| instance);
    let Some(rest) = message.strip_prefix("input ") else {
        return format!("instance {first}: {message}");
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let Ok(mut k) = rest[..digits].parse::<usize>() else {
        return format!("instance {first}: {message}");
    };
    for &(instance, n) in owners {
        if k < n {
            return format!("instance {instance}: input {k}{}", &rest[digits..]);
        }
        k -= n;
    }
    format!("instance {first}: {message}")
}

#[cfg(test)]
mod tests {
    use super::locate_input;

    #[test]
    fn a_merged_inputs_error_names_its_instance() {
        let owners = [(0, 2), (3, 1), (5, 4)];
        assert_eq!(
            locate_input("input 4 is an empty string", &owners),
            "instance 5: input 1 is an empty string"
        );
        assert_eq!(
            locate_input("input 2: cannot tokenize", &owners),
            "instance 3: input 0: cannot tokenize"
        );
        assert_eq!(
            locate_input("unknown prompt name", &owners),
            "instance 0: unknown prompt name"
        );
    }
}
