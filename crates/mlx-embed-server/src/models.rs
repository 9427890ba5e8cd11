//! The models one server serves, each behind its own [`Batcher`] (its own
//! queue and model thread), and which one a request gets.
//!
//! A request's `model` field picks a model by its served name; without one,
//! the first served model that can do the task answers. A name nobody serves
//! is a 404 (OpenAI's `model_not_found`); a model that cannot do the task
//! (reranking with an embedding model) is a 400.

use mlx_embed_core::{Batcher, ModelInfo, ModelKind};

use crate::errors::{ApiError, ErrorKind};

/// One served model.
pub struct ServedModel {
    /// The name the APIs report and requests pick it by.
    pub name: String,
    pub batcher: Batcher,
}

impl std::fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedModel")
            .field("name", &self.name)
            .field("kind", &self.info().kind)
            .finish()
    }
}

impl ServedModel {
    /// The model's facts (kind, labels, limits).
    pub fn info(&self) -> &ModelInfo {
        self.batcher.model_info()
    }
}

/// What a request wants done, which decides which models qualify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Vectors (every embed route, `/similarity`).
    Embed,
    /// Query/document relevance (`/rerank`, `/v1/rerank`, `/v2/rerank`).
    Rerank,
    /// Label scores (`/predict`): classifiers and rerankers.
    Predict,
    /// Tokenization only (`/tokenize`, `/decode`): any model.
    Tokenize,
}

impl Task {
    fn accepts(self, kind: &ModelKind) -> bool {
        match self {
            Task::Embed => matches!(kind, ModelKind::Embedding),
            Task::Rerank => matches!(kind, ModelKind::Reranker { .. }),
            Task::Predict => !matches!(kind, ModelKind::Embedding),
            Task::Tokenize => true,
        }
    }

    fn wants(self) -> &'static str {
        match self {
            Task::Embed => "an embedding model",
            Task::Rerank => "a reranker (a cross-encoder: serve one with --rerank-model)",
            Task::Predict => "a classifier or reranker (a sequence-classification model)",
            Task::Tokenize => "a model",
        }
    }
}

/// Picks the model for a request. `requested` is the request's `model`
/// field (empty means none).
pub fn resolve<'a>(
    models: &'a [ServedModel],
    requested: Option<&str>,
    task: Task,
) -> Result<&'a ServedModel, ApiError> {
    match requested.filter(|r| !r.is_empty()) {
        Some(name) => {
            let model = models.iter().find(|m| m.name == name).ok_or_else(|| {
                let served: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
                ApiError::new(
                    ErrorKind::NotFound,
                    format!(
                        "The model `{name}` does not exist; this server serves: {}",
                        served.join(", ")
                    ),
                )
                .param("model")
                .code("model_not_found")
            })?;
            if !task.accepts(&model.info().kind) {
                return Err(ApiError::invalid(format!(
                    "model `{name}` is {} model; this route needs {}",
                    article(model.info().kind.as_str()),
                    task.wants()
                ))
                .param("model"));
            }
            Ok(model)
        }
        None => models
            .iter()
            .find(|m| task.accepts(&m.info().kind))
            .ok_or_else(|| {
                let kinds: Vec<String> = models
                    .iter()
                    .map(|m| format!("{} ({})", m.name, m.info().kind.as_str()))
                    .collect();
                ApiError::invalid(format!(
                    "this route needs {}; this server serves {}",
                    task.wants(),
                    kinds.join(", ")
                ))
                .param("model")
            }),
    }
}

fn article(kind: &str) -> String {
    if kind.starts_with(['a', 'e', 'i', 'o', 'u']) {
        format!("an {kind}")
    } else {
        format!("a {kind}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_embed_core::{BatchOutput, BatcherConfig, Embedder, EmbedderError, Encoded, Tokenize};
    use std::sync::Arc;

    struct Fake(ModelKind);
    impl Embedder for Fake {
        fn info(&self) -> ModelInfo {
            ModelInfo {
                name: "fake".into(),
                kind: self.0.clone(),
                dim: 1,
                max_input_tokens: 8,
                vocab_size: 10,
                ..ModelInfo::default()
            }
        }
        fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
            None
        }
        fn embed_batch(&mut self, inputs: &[Encoded]) -> Result<BatchOutput, EmbedderError> {
            Ok(BatchOutput {
                vectors: vec![0.0; inputs.len()],
                ..BatchOutput::default()
            })
        }
    }

    fn served(name: &str, kind: ModelKind) -> ServedModel {
        ServedModel {
            name: name.into(),
            batcher: Batcher::start(BatcherConfig::default(), move || Ok(Fake(kind))).unwrap(),
        }
    }

    #[test]
    fn picks_by_name_and_task() {
        let models = vec![
            served("emb", ModelKind::Embedding),
            served(
                "rr",
                ModelKind::Reranker {
                    labels: vec!["LABEL_0".into()],
                },
            ),
        ];
        assert_eq!(resolve(&models, None, Task::Embed).unwrap().name, "emb");
        assert_eq!(resolve(&models, Some(""), Task::Rerank).unwrap().name, "rr");
        assert_eq!(resolve(&models, None, Task::Predict).unwrap().name, "rr");
        assert_eq!(
            resolve(&models, Some("rr"), Task::Tokenize).unwrap().name,
            "rr"
        );
        let e = resolve(&models, Some("nope"), Task::Embed).unwrap_err();
        assert_eq!(
            (e.kind, e.code),
            (ErrorKind::NotFound, Some("model_not_found"))
        );
        assert!(e.message.contains("emb, rr"), "{}", e.message);
        let e = resolve(&models, Some("emb"), Task::Rerank).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("an embedding model"), "{}", e.message);
        let only = vec![served("emb", ModelKind::Embedding)];
        let e = resolve(&only, None, Task::Rerank).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("--rerank-model"), "{}", e.message);
    }
}
