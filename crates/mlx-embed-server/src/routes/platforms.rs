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
use futures_util::future::try_join_all;
use mlx_embed_core::{ModelKind, Priority};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::openapi::schema::{AnyOfBuilder, OneOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::predict::{predict_body, PredictResponse};
use super::rerank::{parse, rerank_body, tei_rank, TeiRank, TeiRerankRequest};
use super::tei::{sparse_values, SparseValue, TeiEmbedRequest, TeiRawRequest};
use crate::embed::embed as run_embed;
use crate::errors::{ApiError, ErrorKind, Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, PriorityHeader};
use crate::models::Task;
use crate::state::AppState;

/// The route that answers a platform request, by the model's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Job {
    Embed,
    EmbedSparse,
    Predict,
    Rerank,
}

/// The job of the model `requested` names (none: the default model).
fn job_of(state: &AppState, requested: Option<&str>) -> Result<Job, ApiError> {
    let info = state.model_for(requested, Task::Describe)?.info();
    Ok(match info.kind {
        ModelKind::Embedding if info.sparse => Job::EmbedSparse,
        ModelKind::Embedding => Job::Embed,
        ModelKind::Classifier { .. } => Job::Predict,
        ModelKind::Reranker { .. } => Job::Rerank,
    })
}

/// A body's `model` field, when it is a string.
fn model_field(body: &Value) -> Option<&str> {
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
async fn answer(
    state: &AppState,
    job: Job,
    body: Value,
    priority: Option<Priority>,
) -> Result<RouteAnswer, ApiError> {
    Ok(match job {
        Job::Embed => {
            let req: TeiEmbedRequest = parse(body)?;
            RouteAnswer::Embed(run_embed(state, req.into_request(priority)).await?.vectors)
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

impl PartialSchema for InvocationsBody {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(Ref::from_schema_name("TeiEmbedRequest"))
            .item(Ref::from_schema_name("TeiRawRequest"))
            .item(Ref::from_schema_name("PredictRequest"))
            .item(Ref::from_schema_name("TeiRerankRequest"))
            .item(Ref::from_schema_name("CohereRerankRequest"))
            .description(Some(
                "The body of the route that answers: /embed (an embedding model), \
                 /embed_sparse (SPLADE), /predict (a classifier), /rerank (a reranker)",
            ))
            .into()
    }
}

impl ToSchema for InvocationsBody {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("InvocationsBody")
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
/// default model.
///
/// Errors use `{"error": str, "error_type": str}` (a `/rerank` `documents`
/// body: `/v1/rerank`'s shape, as on `/rerank`).
#[utoipa::path(
    post, path = "/invocations", tag = "platforms", operation_id = "sagemaker_invocations",
    request_body = InvocationsBody,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "The answering route's answer", body = InvocationsAnswer),
        (status = "4XX", description = "Invalid request, as the answering route's (400, 401, 404 unknown model, 413, 415, 422, 429)", body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn invocations(
    State(state): State<AppState>,
    priority: Result<PriorityHeader<Tei>, Shaped<Tei>>,
    ApiJson(body, _): ApiJson<Value, Tei>,
) -> Response {
    let priority = priority.map(|header| header.0).map_err(|shaped| shaped.0);
    let job = match job_of(&state, model_field(&body)) {
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
    #[schema(value_type = Vec<InvocationsBody>)]
    pub instances: Vec<Value>,
}

/// Vertex AI's prediction response.
#[derive(Debug, Serialize, ToSchema)]
pub struct VertexResponse {
    /// One per instance, in order.
    pub predictions: Vec<RouteAnswer>,
}

/// Google Vertex AI's prediction route, as TEI serves it: every instance
/// answered by its route (all run at once; one failure fails the request).
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/vertex", tag = "platforms", operation_id = "vertex_predict",
    request_body = VertexRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "One prediction per instance, in order", body = VertexResponse),
        (status = "4XX", description = "Invalid request (400, 401, 404 unknown model, 413 incl. more instances than --max-inputs-per-request, 415, 422 incl. an instance of the wrong shape, 429)", body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn vertex(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<VertexRequest, Tei>,
) -> Result<Json<VertexResponse>, Shaped<Tei>> {
    let max_inputs = state.args().max_inputs_per_request;
    if req.instances.len() > max_inputs {
        return Err(ApiError::new(
            ErrorKind::TooLarge,
            format!(
                "{} instances is more than the limit of {max_inputs} per request \
                 (--max-inputs-per-request); split the request",
                req.instances.len()
            ),
        )
        .param("instances")
        .into());
    }
    let state = &state;
    let predictions = try_join_all(req.instances.into_iter().map(|instance| async move {
        // As TEI: a rerank body is reranked whatever the model (a reranker
        // that is not refuses it); the rest go to the model's route.
        let job = if serde_json::from_value::<TeiRerankRequest>(instance.clone()).is_ok() {
            Job::Rerank
        } else {
            match job_of(state, model_field(&instance))? {
                Job::Rerank => Job::Predict,
                job => job,
            }
        };
        answer(state, job, instance, priority).await
    }))
    .await?;
    Ok(Json(VertexResponse { predictions }))
}
