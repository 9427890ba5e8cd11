//! `POST /`: the Hugging Face Inference API's one URL, as
//! `huggingface_hub.InferenceClient(model="http://host:port")` calls it.
//! The body says what is wanted:
//!
//! * `{"inputs": {"source_sentence", "sentences"}}`: sentence similarity;
//! * `{"query", "texts"}` (or `/rerank`'s `documents` form): reranking, as
//!   TEI serves a reranker's `/rerank` here (and as `/invocations` answers it);
//! * `{"inputs": ..., "parameters": {"function_to_apply", "top_k"}}`: text
//!   classification (the client always sends `parameters` for it; other
//!   tasks' parameters, `candidate_labels` and the like, are refused);
//! * otherwise (`feature_extraction`'s root-level `normalize`, `truncate`,
//!   ...): the model's job, as TEI and `/invocations` pick it: embeddings
//!   for an embedding model, `/embed_sparse`'s entries for a SPLADE model,
//!   predictions for a classifier or reranker.
//!
//! Each case goes through the same path as its own route.

use std::borrow::Cow;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{activate, sigmoid_each, EmbedOptions, Priority};
use serde::Deserialize;
use serde_json::Value;
use utoipa::openapi::schema::{AnyOfBuilder, ArrayBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::platforms::{answer, is_rerank_body, job_of, model_field, Job};
use super::predict::{parse_inputs, predictions, Prediction};
use super::rerank::rerank_body;
use super::similarity::{similarities, SimilarityRequest};
use super::tei::SparseValue;
use crate::errors::{ApiError, ErrorKind, Shaped, Tei, TeiOrOpenAiErrorBody};
use crate::extract::{ApiJson, PriorityHeader};
use crate::models::Task;
use crate::score::{score, ScoreRequest};
use crate::state::AppState;

/// Text-classification parameters of the Inference API.
#[derive(Debug, Default, Deserialize)]
struct ClassifyParameters {
    /// `sigmoid`, `softmax` or `none`; default: sigmoid for one label or a multi-label classifier, softmax for several.
    function_to_apply: Option<String>,
    /// Keep the best k labels per input.
    top_k: Option<i64>,
}

/// What `POST /` answers (documentation only): the answer of the job the
/// body and the model pick, as its own route gives it.
pub struct InferenceAnswer;

impl PartialSchema for InferenceAnswer {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            // Feature extraction, as `/embed` answers.
            .item(Vec::<Vec<f32>>::schema())
            // Text classification: the labels best first, per input.
            .item(
                ArrayBuilder::new()
                    .items(ArrayBuilder::new().items(Ref::from_schema_name(Prediction::name()))),
            )
            // Sentence similarity, as `/similarity` answers.
            .item(Vec::<f32>::schema())
            // A SPLADE model's feature extraction, as `/embed_sparse` answers.
            .item(Vec::<Vec<SparseValue>>::schema())
            // A rerank body, as `/rerank` answers each of its forms.
            .item(ArrayBuilder::new().items(Ref::from_schema_name("TeiRank")))
            .item(Ref::from_schema_name("CohereRerankResponse"))
            .description(Some(
                "Feature extraction: one vector per input (as /embed answers; a SPLADE \
                 model: each input's non-zero entries, as /embed_sparse answers); text \
                 classification: per input, `[{label, score}]` best first; sentence \
                 similarity: one similarity per sentence, in order (as /similarity answers); \
                 a rerank body: as /rerank answers it",
            ))
            .into()
    }
}

impl ToSchema for InferenceAnswer {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("InferenceAnswer")
    }

    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        schemas.push((Prediction::name().into_owned(), Prediction::schema()));
        <Prediction as ToSchema>::schemas(schemas);
    }
}

/// Embed, classify, compare or rerank, depending on the body and the model.
///
/// Errors use `{"error": str, "error_type": str}` (a rerank body's
/// `documents` form: `/v1/rerank`'s shape, as on `/rerank`).
#[utoipa::path(
    post, path = "/", tag = "tei", operation_id = "inference_api",
    request_body(content = Object, description = "A feature-extraction, text-classification or sentence-similarity payload of the Hugging Face Inference API, or a /rerank body (`query` and `texts`, or `documents`)"),
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Vectors (a SPLADE model: sparse entries), [[{label, score}]] per input, similarities, or ranks", body = InferenceAnswer),
        (status = "4XX", description = crate::openapi::refusals_by_case("Invalid request (400 incl. a text-classification body (`parameters`) that no served classifier answers, or `parameters` of another task (zero-shot, fill-mask, token classification), 401, 404 unknown model (below), 413, 415, 422 incl. a wrong shape, 429). A rerank body's `documents` form is answered in the OpenAI error shape, as on /rerank", &[("A sentence-similarity body (`inputs.source_sentence`)", Task::Embed), ("A rerank body (`query` with `texts` or `documents`)", Task::Rerank), ("Any other body", Task::Tokenize)]), body = TeiOrOpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiOrOpenAiErrorBody),
    )
)]
pub async fn inference(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(body, _): ApiJson<Value, Tei>,
) -> Result<Response, Shaped<Tei>> {
    let is_similarity = body
        .get("inputs")
        .and_then(Value::as_object)
        .is_some_and(|o| o.contains_key("source_sentence"));
    if is_similarity {
        let req: SimilarityRequest = ApiError::parse_value(body)?;
        return Ok(Json(similarities(&state, req, priority).await?).into_response());
    }
    // TEI serves a reranker's /rerank here: a `query` + `texts` body is
    // reranked, as /invocations reranks it (no Inference API body has them).
    if is_rerank_body(&body, true) {
        return Ok(rerank_body(&state, Ok(priority), body).await);
    }
    let model = model_field(&body).map(str::to_owned);
    match job_of(&state, model.as_deref())? {
        // The model's own route, as TEI picks it: a SPLADE model's is
        // /embed_sparse, as /invocations answers it.
        job @ (Job::Embed | Job::EmbedSparse) if body.get("parameters").is_none() => {
            Ok(Json(answer(&state, job, body, priority).await?).into_response())
        }
        _ => Ok(Json(classify(&state, model, body, priority).await?).into_response()),
    }
}

/// The Inference API's other tasks post to the same URL with their own
/// `parameters` (`InferenceClient.zero_shot_classification` sends
/// `candidate_labels`, `fill_mask` `targets`, ...): read as text
/// classification they got a classifier's labels with a 200, the task's own
/// parameters ignored. A parameter text classification does not take is
/// refused, naming the task it belongs to where it is one of those.
fn refuse_other_tasks(given: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    const TASKS: [(&str, &str); 7] = [
        ("candidate_labels", "zero-shot classification"),
        ("hypothesis_template", "zero-shot classification"),
        ("multi_label", "zero-shot classification"),
        ("targets", "fill-mask"),
        ("aggregation_strategy", "token classification"),
        ("ignore_labels", "token classification"),
        ("stride", "token classification"),
    ];
    let Some(key) = given
        .keys()
        .find(|k| !matches!(k.as_str(), "function_to_apply" | "top_k"))
    else {
        return Ok(());
    };
    let task = TASKS
        .iter()
        .find(|(name, _)| name == key)
        .map_or(String::new(), |(_, task)| format!(" (a {task} parameter)"));
    Err(ApiError::invalid(format!(
        "parameters.{key}{task} is not served: POST / answers feature extraction, sentence \
         similarity and text classification, whose parameters are function_to_apply and top_k"
    ))
    .param("parameters"))
}

/// Predictions per input, best first, as the Inference API nests them.
async fn classify(
    state: &AppState,
    model: Option<String>,
    mut body: Value,
    priority: Option<Priority>,
) -> Result<Vec<Vec<Prediction>>, ApiError> {
    let inputs = body
        .get_mut("inputs")
        .map(Value::take)
        .ok_or_else(|| ApiError::new(ErrorKind::Unprocessable, "missing field `inputs`"))?;
    if let Some(Value::Object(given)) = body.get("parameters") {
        refuse_other_tasks(given)?;
    }
    let params: ClassifyParameters = match body.get_mut("parameters").map(Value::take) {
        None | Some(Value::Null) => ClassifyParameters::default(),
        Some(p) => serde_json::from_value(p).map_err(|e| {
            ApiError::new(ErrorKind::Unprocessable, format!("invalid parameters: {e}"))
        })?,
    };
    let function = params.function_to_apply.as_deref();
    if !matches!(function, None | Some("sigmoid" | "softmax" | "none")) {
        return Err(ApiError::invalid(format!(
            "function_to_apply must be sigmoid, softmax or none, got {:?}",
            function.unwrap_or_default()
        ))
        .param("parameters"));
    }
    let top_k = match params.top_k {
        None => None,
        Some(k) if k >= 1 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(
                ApiError::invalid(format!("top_k must be at least 1, got {k}")).param("parameters"),
            )
        }
    };
    let (_, inputs) = parse_inputs(inputs)?;
    let mut out = score(
        state,
        ScoreRequest {
            model,
            task: Task::Predict,
            inputs,
            options: EmbedOptions {
                priority: priority.unwrap_or_default(),
                ..EmbedOptions::default()
            },
            raw_scores: function.is_some(),
        },
    )
    .await?;
    for row in &mut out.scores {
        match function {
            Some("sigmoid") => sigmoid_each(row),
            Some("softmax") if row.len() == 1 => row[0] = 1.0,
            Some("softmax") => activate(row),
            _ => {}
        }
    }
    let mut all = predictions(&out);
    if let Some(k) = top_k {
        all.iter_mut().for_each(|p| p.truncate(k));
    }
    Ok(all)
}
