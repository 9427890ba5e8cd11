//! The one scoring path the cross-encoder routes call (`/rerank`,
//! `/v1/rerank`, `/v2/rerank`, `/v1/ranking`, `/predict`, `POST /`): validate -> pick the
//! model -> `batcher.embed` (each pair or text one input: the same admission,
//! batching and model thread as embeddings) -> activation.
//!
//! The model returns raw logits, one per label; the activation is TEI's:
//! sigmoid for one label, softmax over several, none with `raw_scores`; a
//! multi-label classifier's labels get a sigmoid each (transformers' rule),
//! the core's [`mlx_embed_core::ModelKind::activate`].

use mlx_embed_core::{EmbedInput, EmbedOptions};

use crate::embed::check_inputs;
use crate::errors::{ApiError, ErrorKind};
use crate::models::Task;
use crate::state::AppState;
use crate::timing;

/// What every scoring route's request boils down to.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreRequest {
    /// The request's `model` field (none: the first model that can do `task`).
    pub model: Option<String>,
    /// [`Task::Rerank`] or [`Task::Predict`].
    pub task: Task,
    /// Query/document pairs, or single texts for a classifier.
    pub inputs: Vec<EmbedInput>,
    pub options: EmbedOptions,
    /// Raw logits instead of sigmoid/softmax scores.
    pub raw_scores: bool,
}

/// Scores per input, in input order.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreOutput {
    /// The served name of the model that answered.
    pub model: String,
    /// One row per input, one score per label.
    pub scores: Vec<Vec<f32>>,
    /// The same rows before the activation: what rankings order by, since a
    /// float32 sigmoid is 1.0 for every logit over about 17 (ties a
    /// reranker's clearly different best documents) and a softmax 0.0 for
    /// every label far enough below the best.
    pub logits: Vec<Vec<f32>>,
    /// The model's label names, in score order.
    pub labels: Vec<String>,
    /// Exact tokens the model ran over all inputs.
    pub prompt_tokens: u64,
    /// Inputs answered from the cache.
    pub cache_hits: u32,
}

/// Scores `req`; errors carry their status (see [`crate::errors`]).
pub async fn score(state: &AppState, req: ScoreRequest) -> Result<ScoreOutput, ApiError> {
    begin(&req);
    check_inputs(state, &req.inputs, req.model.as_deref(), req.task)?;
    run(state, req).await
}

/// [`score`] for inputs the route checked itself: pieces the server made
/// of what the client sent (Cohere's chunks), which count as the client's
/// documents, not one input each.
pub async fn score_checked(state: &AppState, req: ScoreRequest) -> Result<ScoreOutput, ApiError> {
    begin(&req);
    run(state, req).await
}

/// [`timing::begin`] of a scoring request: TEI's `te_predict_*`, and a
/// rerank is a batch whatever its documents (TEI's `/rerank` counts so).
fn begin(req: &ScoreRequest) {
    if req.task == Task::Rerank {
        timing::shape(timing::Method::Batch);
    }
    timing::begin(req.inputs.len(), timing::Op::Predict);
}

async fn run(state: &AppState, req: ScoreRequest) -> Result<ScoreOutput, ApiError> {
    let model = state.model_for(req.model.as_deref(), req.task)?;
    let labels = model.info().kind.labels().to_vec();
    let width = model.info().dim;
    if labels.len() != width {
        return Err(ApiError::new(
            ErrorKind::Model,
            format!("model has {} labels but {width} outputs", labels.len()),
        ));
    }
    // One row of `width` (= `dim`) scores per input: the model thread checks
    // every output's shape before it answers.
    let chars = timing::reach(&req.inputs);
    let out = state
        .unless_drain_ends(model.batcher.embed(req.inputs, req.options))
        .await?;
    timing::record(model.info(), chars, &out);
    let logits = out.vectors;
    if logits.iter().flatten().any(|s| s.is_nan()) {
        return Err(ApiError::new(
            ErrorKind::Model,
            "model returned a NaN score",
        ));
    }
    let mut scores = logits.clone();
    if !req.raw_scores {
        let kind = &model.info().kind;
        for row in &mut scores {
            kind.activate(row);
        }
    }
    Ok(ScoreOutput {
        model: model.name.clone(),
        scores,
        logits,
        labels,
        prompt_tokens: out.token_counts.iter().map(|&n| u64::from(n)).sum(),
        cache_hits: out.cache_hits,
    })
}

/// Indices of `scores` best first; equal scores keep input order. Rank on
/// [`ScoreOutput::logits`], not on the activated scores, which can tie.
pub fn ranking(scores: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranking_is_stable_and_descending() {
        assert_eq!(ranking(&[0.1, 0.9, 0.5, 0.9]), vec![1, 3, 2, 0]);
        assert_eq!(ranking(&[]), Vec::<usize>::new());
    }
}
