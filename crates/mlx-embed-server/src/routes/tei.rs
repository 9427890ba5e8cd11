//! `POST /embed`, `/embed_all` and `/embed_sparse`: Hugging Face
//! text-embeddings-inference compatible.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedOptions, Output, Priority, Prompt};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{pick_task, Said};
use crate::embed::{embed as run_embed, embed_sparse as run_embed_sparse, EmbedRequest};
use crate::errors::{ApiError, Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, PriorityHeader, TeiInputs, TruncationSide};
use crate::models::Task;
use crate::state::AppState;

/// TEI embed request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TeiEmbedRequest {
    /// Which served model answers (not a TEI field: TEI serves one); default: the first embedding model.
    pub model: Option<String>,
    /// A text or token ids, or a list of texts and lists of token ids (run as
    /// given, special tokens included, as `/tokenize` lists them).
    pub inputs: TeiInputs,
    /// Unit-length vectors (default true).
    pub normalize: Option<bool>,
    /// Truncate inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` keeps the start of an over-long input, `Left` its end (any case);
    /// unsaid: the model folder's `truncation_side`, else right.
    pub truncation_direction: Option<TruncationSide>,
    /// One of the model's named prompts (`/info` lists them); default: the model's default
    /// prompt. One named after a task (jina-embeddings-v3's) runs that task's adapter too.
    pub prompt_name: Option<String>,
    /// Jina AI's (not a TEI field): the task adapter to run with, one of the
    /// model's `tasks` (`/info` lists them: jina-embeddings-v3's), with its
    /// prompt of that name unless `prompt_name` says another. A model
    /// without task adapters, an unknown task, or a `prompt_name` that names
    /// another task, is a 400.
    pub task: Option<String>,
    /// Keep the first N components (1..=dimension), re-normalized when `normalize`.
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
}

/// TEI's request options as the core's, with TEI's defaults: truncate (on the
/// model folder's side, else the right), the model's default prompt, normal priority.
#[allow(clippy::too_many_arguments)]
fn tei_options(
    state: &AppState,
    model: Option<&str>,
    truncate: Option<bool>,
    truncation_direction: Option<TruncationSide>,
    prompt_name: Option<String>,
    task: Option<String>,
    priority: Option<Priority>,
    output: Output,
) -> Result<EmbedOptions, ApiError> {
    let pick = pick_task(
        state,
        model,
        task,
        Said::Prompt(prompt_name.map_or(Prompt::Default, Prompt::Named)),
    )?;
    Ok(EmbedOptions {
        truncate: truncate.unwrap_or(true),
        truncation_direction: truncation_direction.map(Into::into),
        truncate_to: None,
        prompt: pick.prompt,
        priority: priority.unwrap_or_default(),
        output,
        max_token_rows: None,
        // TEI runs ids as given: the route for exact ids without specials.
        wrapped_token_ids: false,
        token_pooling: None,
        // A prompt_name that names a task selects its adapter too (the core's).
        task: pick.task,
    })
}

impl TeiEmbedRequest {
    /// The one embed path's request for this TEI request.
    /// `priority`: the `X-Priority` header's lane, if any.
    pub(crate) fn into_request(
        self,
        state: &AppState,
        priority: Option<Priority>,
    ) -> Result<EmbedRequest, ApiError> {
        Ok(EmbedRequest {
            empty_texts: false,
            options: tei_options(
                state,
                self.model.as_deref(),
                self.truncate,
                self.truncation_direction,
                self.prompt_name,
                self.task,
                priority,
                Output::Pooled,
            )?,
            model: self.model,
            inputs: self.inputs.into_inputs(),
            normalize: self.normalize.unwrap_or(true),
            dimensions: self.dimensions,
        })
    }
}

/// Embed texts; answers a bare list of vectors.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/embed", tag = "tei", operation_id = "tei_embed",
    request_body = TeiEmbedRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "One vector per input, in order", body = Vec<Vec<f32>>),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400, 401, 404 unknown model (below), 413, 415, 422, 429)", Task::Embed), body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn embed(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<TeiEmbedRequest, Tei>,
) -> Result<Json<Vec<Vec<f32>>>, Shaped<Tei>> {
    let out = run_embed(&state, req.into_request(&state, priority)?).await?;
    Ok(Json(out.vectors))
}

/// TEI's `/embed_all` and `/embed_sparse` request: the model's raw output,
/// so no `normalize` and no `dimensions`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TeiRawRequest {
    /// Which served model answers (not a TEI field: TEI serves one); default: the first that can.
    pub model: Option<String>,
    /// A text or token ids, or a list of texts and lists of token ids (run as given).
    pub inputs: TeiInputs,
    /// Truncate inputs longer than the model's maximum (default true); false answers 422 instead.
    pub truncate: Option<bool>,
    /// `Right` keeps the start of an over-long input, `Left` its end (any case);
    /// unsaid: the model folder's `truncation_side`, else right.
    pub truncation_direction: Option<TruncationSide>,
    /// One of the model's named prompts (`/info` lists them); default: the model's default prompt.
    pub prompt_name: Option<String>,
    /// Jina AI's (not a TEI field): a task adapter of the model's, as on
    /// `/embed`; a task adapter runs for pooled vectors only, so here it is
    /// a 400 (as on a model without task adapters, or an unknown task).
    pub task: Option<String>,
}

impl TeiRawRequest {
    /// The one embed path's request for `output`, raw (not normalized).
    pub(crate) fn into_request(
        self,
        state: &AppState,
        priority: Option<Priority>,
        output: Output,
    ) -> Result<EmbedRequest, ApiError> {
        Ok(EmbedRequest {
            empty_texts: false,
            options: tei_options(
                state,
                self.model.as_deref(),
                self.truncate,
                self.truncation_direction,
                self.prompt_name,
                self.task,
                priority,
                output,
            )?,
            model: self.model,
            inputs: self.inputs.into_inputs(),
            normalize: false,
            dimensions: None,
        })
    }
}

/// The last hidden state of every token of each input (special tokens
/// included, the prompt's too): no pooling, no normalization. Embedding
/// models only; never answered from the embedding cache.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/embed_all", tag = "tei", operation_id = "tei_embed_all",
    request_body = TeiRawRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Per input, in order: one vector per token, in token order (as many as /tokenize lists with special tokens)", body = Vec<Vec<Vec<f32>>>),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a model that is not an embedding model, 401, 404 unknown model (below), 413, 415, 422, 429)", Task::Embed), body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn embed_all(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<TeiRawRequest, Tei>,
) -> Result<Json<Vec<Vec<Vec<f32>>>>, Shaped<Tei>> {
    let out = run_embed(&state, req.into_request(&state, priority, Output::Tokens)?).await?;
    let width = out.dimension;
    Ok(Json(
        out.vectors
            .iter()
            // Width 0: no input had a token (a static model's blank texts).
            .map(|rows| match width {
                0 => Vec::new(),
                _ => rows.chunks_exact(width).map(<[f32]>::to_vec).collect(),
            })
            .collect(),
    ))
}

/// One non-zero entry of a sparse vector.
#[derive(Debug, Serialize, ToSchema)]
pub struct SparseValue {
    /// Vocabulary index (a token id of the model's tokenizer; `/decode` names it).
    pub index: u32,
    /// Its SPLADE weight (> 0).
    pub value: f32,
}

/// Sparse embeddings: per input, the non-zero entries of its vector over
/// the vocabulary, in index order, unnormalized. Needs a SPLADE model (a
/// sentence-transformers SparseEncoder folder, or a BertForMaskedLM folder
/// served with `--pooling splade`), whose vectors these are, or a BGE-M3
/// folder (its `sparse_linear.pt`), whose lexical weights these are: each
/// token id of the input weighed above 0 (special tokens left out), with its
/// largest weight. Any other model is a 400.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/embed_sparse", tag = "tei", operation_id = "tei_embed_sparse",
    request_body = TeiRawRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane")),
    responses(
        (status = 200, description = "Per input, in order: its non-zero entries, in index order", body = Vec<Vec<SparseValue>>),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a model with no sparse output, 401, 404 unknown model (below), 413, 415, 422, 429)", Task::EmbedSparse), body = TeiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = TeiErrorBody),
    )
)]
pub async fn embed_sparse(
    State(state): State<AppState>,
    PriorityHeader(priority, _): PriorityHeader<Tei>,
    ApiJson(req, _): ApiJson<TeiRawRequest, Tei>,
) -> Result<Json<Vec<Vec<SparseValue>>>, Shaped<Tei>> {
    Ok(Json(sparse_values(&state, req, priority).await?))
}

/// `/embed_sparse`'s answer for `req`: each input's non-zero entries.
pub(crate) async fn sparse_values(
    state: &AppState,
    req: TeiRawRequest,
    priority: Option<Priority>,
) -> Result<Vec<Vec<SparseValue>>, ApiError> {
    let out = run_embed_sparse(state, req.into_request(state, priority, Output::Pooled)?).await?;
    Ok(out
        .entries
        .into_iter()
        .map(|v| {
            v.into_iter()
                .map(|(index, value)| SparseValue { index, value })
                .collect()
        })
        .collect())
}
