//! The models one server serves, each behind its own [`Batcher`] (its own
//! queue and model thread), and which one a request gets.
//!
//! A request's `model` field picks a model by its served name; without one,
//! the first served model that can do the task answers. A name nobody
//! serves is a 404 (OpenAI's `model_not_found`) where two or more served
//! models could do the task; where only one could (one model, or one
//! embedder beside rerankers), it answers whatever name a client sends
//! (logged once per name): OpenAI-style clients default to names like
//! `text-embedding-ada-002` (LangChain, LlamaIndex) or
//! `text-embedding-3-small` (graphiti), Ollama's to `nomic-embed-text`, and
//! TEI ignores the field, so they keep working unchanged. A model that
//! cannot do the task (reranking with an embedding model) is a 400.

use std::path::Path;
use std::sync::Arc;

use mlx_embed_core::{Batcher, ModelInfo, ModelKind};
use tokio::sync::OnceCell;

use crate::errors::{ApiError, ErrorKind};

/// One served model.
pub struct ServedModel {
    /// The name the APIs report and requests pick it by.
    pub name: String,
    pub batcher: Batcher,
    /// [`ServedModel::digest`], worked out on first use.
    digest: Arc<OnceCell<String>>,
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

    /// A served model under `name`.
    pub fn new(name: String, batcher: Batcher) -> Self {
        Self {
            name,
            batcher,
            digest: Arc::default(),
        }
    }

    /// The model's digest, as Ollama's listings carry one (`/api/tags`,
    /// `/api/ps`): the hex SHA-256 of what the model is, so clients notice
    /// a changed model. It covers every file of the model's folder (path,
    /// size and bytes; not hidden files, nor the `onnx` and `openvino`
    /// folders of other runtimes) and how it was loaded: kind and labels, width,
    /// token limits, prompts, pooling, float type and quantization. The
    /// same files under another folder or served name have the same digest,
    /// as Ollama's copies of one model do. Hashing a folder reads it (about
    /// 0.1 s for MiniLM's 90 MB), so it is done once, on first use, off the
    /// async threads.
    pub async fn digest(&self) -> String {
        self.digest
            .get_or_init(|| async {
                let info = self.info().clone();
                tokio::task::spawn_blocking(move || digest_of(&info))
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "the model's digest could not be worked out");
                        String::new()
                    })
            })
            .await
            .clone()
    }
}

/// [`ServedModel::digest`]'s hex SHA-256. A folder that cannot be read
/// counts as no folder (logged): the digest then covers the load facts only.
fn digest_of(info: &ModelInfo) -> String {
    use sha2::{Digest as _, Sha256};
    use std::fmt::Write as _;
    let mut hasher = Sha256::new();
    let mut fact = |key: &str, value: &dyn std::fmt::Display| {
        hasher.update(format!("{key}={value}\n").as_bytes());
    };
    fact("kind", &info.kind.as_str());
    fact("labels", &info.kind.labels().join("\u{1f}"));
    fact("dim", &info.dim);
    fact("sparse", &info.sparse);
    if info.lexical_weights {
        // Only where set: the digests of every other model stay as they were.
        fact("lexical_weights", &true);
    }
    fact("max_input_tokens", &info.max_input_tokens);
    fact("vocab_size", &info.vocab_size);
    for (name, prompt) in &info.prompts {
        fact("prompt", &format_args!("{name:?}={prompt:?}"));
    }
    fact(
        "default_prompt",
        &info.default_prompt_name.as_deref().unwrap_or_default(),
    );
    fact(
        "pooling",
        &info.details.get("pooling").map_or("", String::as_str),
    );
    if let Some(w) = &info.weights {
        fact("architecture", &w.architecture);
        fact("dtype", &w.dtype);
        fact("quantization_bits", &w.quantization_bits.unwrap_or(0));
        fact("parameters", &w.parameters);
        fact("bytes", &w.bytes);
        if let Some(folder) = &w.folder {
            if let Err(e) = hash_folder(folder, &mut hasher) {
                tracing::warn!(folder = %folder.display(), error = %e,
                    "cannot read the model's folder: its digest covers how it was loaded only");
            }
        }
    }
    hasher
        .finalize()
        .iter()
        .fold(String::with_capacity(64), |mut hex, b| {
            let _ = write!(hex, "{b:02x}");
            hex
        })
}

/// Feeds every file of `folder` to `hasher`: its path inside the folder,
/// its size and its bytes, in path order.
fn hash_folder(folder: &Path, hasher: &mut sha2::Sha256) -> std::io::Result<()> {
    use sha2::Digest as _;
    for relative in folder_files(folder)? {
        let mut file = std::fs::File::open(folder.join(&relative))?;
        let size = file.metadata()?.len();
        hasher.update(relative.to_string_lossy().as_bytes());
        hasher.update([0]);
        hasher.update(size.to_le_bytes());
        std::io::copy(&mut file, hasher)?;
    }
    Ok(())
}

/// The files of a model's folder, as paths inside it, sorted: every
/// regular file (links followed, as in the Hugging Face cache) at any
/// depth, except hidden ones and the `onnx` and `openvino` folders (other
/// runtimes' copies of the weights, which this server never reads).
fn folder_files(folder: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![std::path::PathBuf::new()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(folder.join(&dir))? {
            let entry = entry?;
            let name = entry.file_name();
            let name_str = name.to_string_lossy();
            if name_str.starts_with('.') {
                continue;
            }
            let relative = dir.join(&name);
            let meta = std::fs::metadata(entry.path())?;
            if meta.is_dir() {
                if dir.as_os_str().is_empty() && matches!(&*name_str, "onnx" | "openvino") {
                    continue;
                }
                pending.push(relative);
            } else if meta.is_file() {
                files.push(relative);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// What a request wants done, which decides which models qualify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Vectors (every embed route, `/similarity`).
    Embed,
    /// Sparse vectors as their non-zero entries (`/embed_sparse`): a SPLADE
    /// model's, or a BGE-M3 model's lexical weights.
    EmbedSparse,
    /// Query/document relevance (`/rerank`, `/v1/rerank`, `/v2/rerank`, `/v1/ranking`).
    Rerank,
    /// Pair scores (vLLM's `/score`): a reranker's, else an embedding
    /// model's cosine. Unnamed, the first reranker answers, else the first
    /// embedding model.
    Score,
    /// Label scores (`/predict`, `/classify`): classifiers and rerankers.
    /// Unnamed, the first classifier answers, else the first reranker: a
    /// caller of a classification route wants a classifier's labels, not a
    /// reranker's one relevance label.
    Predict,
    /// A multi-vector (ColBERT) model's per-token vectors (`/v1/multi-vector`).
    MultiVector,
    /// Tokenization only (`/tokenize`, `/decode`): any model.
    Tokenize,
    /// The model's facts (Ollama's `/api/show`): any model.
    Describe,
}

impl Task {
    fn accepts(self, info: &ModelInfo) -> bool {
        let kind = &info.kind;
        match self {
            // A ColBERT model has no pooled vector: /v1/multi-vector only.
            Task::Embed => matches!(kind, ModelKind::Embedding) && info.multi_vector.is_none(),
            Task::MultiVector => {
                matches!(kind, ModelKind::Embedding) && info.multi_vector.is_some()
            }
            Task::EmbedSparse => {
                matches!(kind, ModelKind::Embedding) && (info.sparse || info.lexical_weights)
            }
            Task::Rerank => matches!(kind, ModelKind::Reranker { .. }),
            Task::Score => {
                matches!(kind, ModelKind::Reranker { .. })
                    || (matches!(kind, ModelKind::Embedding) && info.multi_vector.is_none())
            }
            Task::Predict => !matches!(kind, ModelKind::Embedding),
            Task::Tokenize | Task::Describe => true,
        }
    }

    /// Whether `info`'s model goes before the others able to do this task
    /// when a request names none.
    fn prefers(self, info: &ModelInfo) -> bool {
        match self {
            Task::Score => matches!(info.kind, ModelKind::Reranker { .. }),
            Task::Predict => matches!(info.kind, ModelKind::Classifier { .. }),
            _ => false,
        }
    }

    fn wants(self) -> &'static str {
        match self {
            Task::Embed => {
                "an embedding model that pools (a multi-vector ColBERT model answers \
                 POST /v1/multi-vector only)"
            }
            Task::MultiVector => {
                "a multi-vector (ColBERT) model: a PyLate folder (Transformer -> Dense, \
                 ColBERT settings in config_sentence_transformers.json)"
            }
            Task::EmbedSparse => {
                "a sparse model (SPLADE: a SparseEncoder folder, or a BertForMaskedLM folder \
                 served with --pooling splade; or a BGE-M3 folder, with its sparse_linear.pt)"
            }
            Task::Rerank => "a reranker (a cross-encoder: serve one with --rerank-model)",
            Task::Score => "a reranker or an embedding model",
            Task::Predict => "a classifier or reranker (a sequence-classification model)",
            Task::Tokenize | Task::Describe => "a model",
        }
    }
}

/// How every `model` description of the API documents (the OpenAPI
/// document) begins its unknown-name rule, [`Task::unknown_name_rule`].
pub const UNKNOWN_NAME: &str = "Unknown `model` (no served model has the name): ";

impl Task {
    /// One model this task takes, in words (`a ...`).
    fn one(self) -> &'static str {
        match self {
            Task::Embed => "an embedding model",
            Task::MultiVector => "a multi-vector (ColBERT) model",
            Task::EmbedSparse => "a sparse model (SPLADE or BGE-M3)",
            Task::Rerank => "a reranker",
            Task::Score => "a reranker or an embedding model",
            Task::Predict => "a classifier or a reranker",
            Task::Tokenize | Task::Describe => "a model",
        }
    }

    /// What [`resolve`] does with a name no served model has, for a route
    /// of this task: the one wording every `model` field and route of the
    /// OpenAPI document states, kept here beside the code it describes.
    /// Exactly one served model able to do the task answers any name; else
    /// the name is a 404, except on a server of one model unable to do it,
    /// which refuses the route (400) whatever the name.
    pub fn unknown_name_rule(self) -> String {
        const DEFAULTS: &str =
            "(clients send their own defaults, such as `text-embedding-3-small`)";
        match self {
            Task::Tokenize | Task::Describe => format!(
                "{UNKNOWN_NAME}on a server of one model, that model answers {DEFAULTS}; \
                 with two or more served, 404 (`model_not_found`)."
            ),
            _ => {
                let one = self.one();
                format!(
                    "{UNKNOWN_NAME}where exactly one served model is {one}, it answers \
                     {DEFAULTS}; otherwise 404 (`model_not_found`), but 400 on a server of \
                     one model that is not {one}."
                )
            }
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
    let requested = requested.filter(|r| !r.is_empty());
    if let [only] = models {
        if let Some(name) = requested.filter(|name| *name != only.name) {
            note_other_name(name, &only.name);
        }
        return if task.accepts(only.info()) {
            Ok(only)
        } else {
            Err(ApiError::invalid(format!(
                "this route needs {}; this server serves {} ({})",
                task.wants(),
                only.name,
                only.info().kind.as_str()
            ))
            .param("model"))
        };
    }
    match requested.map(|name| (name, models.iter().find(|m| m.name == name))) {
        // Only one served model can do this route's job (an embedder beside
        // rerankers): any other name means it, as on a one-model server.
        // Clients send their own defaults (`text-embedding-3-small`,
        // `nomic-embed-text`), which worked until a reranker was added.
        Some((name, None)) => {
            let mut able = models.iter().filter(|m| task.accepts(m.info()));
            match (able.next(), able.next()) {
                (Some(only), None) => {
                    note_other_name(name, &only.name);
                    Ok(only)
                }
                _ => {
                    let served: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
                    Err(ApiError::new(
                        ErrorKind::NotFound,
                        format!(
                            "The model `{name}` does not exist; this server serves: {}",
                            served.join(", ")
                        ),
                    )
                    .param("model")
                    .code("model_not_found"))
                }
            }
        }
        Some((name, Some(model))) => {
            if !task.accepts(model.info()) {
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
            .find(|m| task.prefers(m.info()))
            .or_else(|| models.iter().find(|m| task.accepts(m.info())))
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

/// A warning the first time each other name is seen (up to 64 names of at
/// most 256 bytes: a client's names must not grow the server's memory or
/// its log lines past that), debug after.
fn note_other_name(requested: &str, served: &str) {
    static SEEN: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let first = requested.len() <= 256 && {
        let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
        seen.len() < 64 && seen.insert(requested.to_owned())
    };
    if first {
        tracing::warn!(
            requested,
            served,
            "request names another model; serving ours"
        );
    } else {
        tracing::debug!(
            requested,
            served,
            "request names another model; serving ours"
        );
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
    use mlx_embed_core::{
        BatchOutput, BatcherConfig, Embedder, EmbedderError, Encoded, Output, Tokenize, WeightsInfo,
    };
    use std::sync::Arc;

    /// A model of this kind; SPLADE (`.1`); with lexical weights (`.2`).
    struct Fake(ModelKind, bool, bool);
    impl Embedder for Fake {
        fn info(&self) -> ModelInfo {
            ModelInfo {
                name: "fake".into(),
                kind: self.0.clone(),
                sparse: self.1,
                lexical_weights: self.2,
                dim: 1,
                max_input_tokens: 8,
                vocab_size: 10,
                ..ModelInfo::default()
            }
        }
        fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
            None
        }
        fn embed_batch(
            &mut self,
            inputs: &[Encoded],
            _: Output,
        ) -> Result<BatchOutput, EmbedderError> {
            Ok(BatchOutput {
                vectors: vec![0.0; inputs.len()],
                rows: vec![1; inputs.len()],
                ..BatchOutput::default()
            })
        }
    }

    fn served(name: &str, kind: ModelKind) -> ServedModel {
        served_as(name, kind, false)
    }

    fn served_as(name: &str, kind: ModelKind, sparse: bool) -> ServedModel {
        ServedModel::new(
            name.into(),
            Batcher::start(BatcherConfig::default(), move || {
                Ok(Fake(kind, sparse, false))
            })
            .unwrap(),
        )
    }

    fn served_lexical(name: &str) -> ServedModel {
        ServedModel::new(
            name.into(),
            Batcher::start(BatcherConfig::default(), || {
                Ok(Fake(ModelKind::Embedding, false, true))
            })
            .unwrap(),
        )
    }

    #[test]
    fn the_digest_covers_the_models_files_and_how_it_was_loaded() {
        let facts = ModelInfo {
            name: "fake".into(),
            dim: 1,
            max_input_tokens: 8,
            vocab_size: 10,
            ..ModelInfo::default()
        };
        // sha256 of "kind=embedding\nlabels=\ndim=1\nsparse=false\nmax_input_tokens=8\n
        // vocab_size=10\ndefault_prompt=\npooling=\n" (Python's hashlib).
        assert_eq!(
            digest_of(&facts),
            "68a19e58f47c0e8e33c640f03faa71f69c0d53fa78627b7724b32057b86bc2eb"
        );
        // The name is no part of it: a copy of a model is the same model.
        let renamed = ModelInfo {
            name: "copy".into(),
            ..facts.clone()
        };
        assert_eq!(digest_of(&renamed), digest_of(&facts));

        let root = std::env::temp_dir().join(format!("mlx-embed-digest-{}", std::process::id()));
        let write = |folder: &str, file: &str, bytes: &[u8]| {
            let path = root.join(folder).join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        };
        for folder in ["a", "b"] {
            write(folder, "config.json", b"{}");
            write(folder, "model.safetensors", &[1, 2, 3, 4]);
            write(folder, "1_Pooling/config.json", b"{\"mean\": true}");
        }
        let loaded = |folder: &str, dtype: &str| ModelInfo {
            weights: Some(WeightsInfo {
                architecture: "bert".into(),
                dtype: dtype.into(),
                folder: Some(root.join(folder)),
                ..WeightsInfo::default()
            }),
            ..facts.clone()
        };
        let a = digest_of(&loaded("a", "float32"));
        assert_eq!(a.len(), 64);
        assert_eq!(
            digest_of(&loaded("b", "float32")),
            a,
            "the same files elsewhere"
        );
        assert_ne!(digest_of(&loaded("a", "bfloat16")), a, "another float type");
        // Hidden files and other runtimes' weights are not read.
        write("b", ".git/HEAD", b"ref");
        write("b", "onnx/model.onnx", b"other weights");
        assert_eq!(digest_of(&loaded("b", "float32")), a);
        // One byte of the weights, or of a nested file, is another model.
        write("b", "model.safetensors", &[1, 2, 3, 5]);
        assert_ne!(digest_of(&loaded("b", "float32")), a);
        write("b", "model.safetensors", &[1, 2, 3, 4]);
        write("b", "1_Pooling/config.json", b"{\"cls\": true}");
        assert_ne!(digest_of(&loaded("b", "float32")), a);
        // A folder that cannot be read leaves the load facts only.
        assert_eq!(
            digest_of(&loaded("gone", "float32")),
            digest_of(&ModelInfo {
                weights: Some(WeightsInfo {
                    architecture: "bert".into(),
                    dtype: "float32".into(),
                    ..WeightsInfo::default()
                }),
                ..facts.clone()
            })
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[tokio::test]
    async fn a_served_models_digest_is_worked_out_once() {
        let model = served("emb", ModelKind::Embedding);
        let first = model.digest().await;
        assert_eq!(first, digest_of(model.info()));
        assert_eq!(model.digest().await, first);
        assert_ne!(
            served(
                "rr",
                ModelKind::Reranker {
                    labels: vec!["LABEL_0".into()]
                }
            )
            .digest()
            .await,
            first
        );
    }

    /// [`Task::unknown_name_rule`] says what [`resolve`] does: an unknown
    /// name reaches the one served model able to do the task; else it is
    /// a 404, but a 400 on a one-model server unable to do it.
    #[test]
    fn the_documented_unknown_name_rule_is_resolves() {
        let reranker = || ModelKind::Reranker {
            labels: vec!["LABEL_0".into()],
        };
        let classifier = || ModelKind::Classifier {
            labels: vec!["a".into(), "b".into()],
            multi_label: false,
        };
        let servers: Vec<Vec<ServedModel>> = vec![
            vec![served("emb", ModelKind::Embedding)],
            vec![served("rr", reranker())],
            vec![served_as("splade", ModelKind::Embedding, true)],
            vec![
                served("emb", ModelKind::Embedding),
                served("rr", reranker()),
            ],
            vec![
                served("emb", ModelKind::Embedding),
                served("clf", classifier()),
            ],
            vec![
                served("emb", ModelKind::Embedding),
                served_as("splade", ModelKind::Embedding, true),
            ],
            vec![served("rr", reranker()), served("clf", classifier())],
        ];
        let tasks = [
            Task::Embed,
            Task::EmbedSparse,
            Task::Rerank,
            Task::Score,
            Task::Predict,
            Task::Tokenize,
            Task::Describe,
        ];
        for models in &servers {
            let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
            for task in tasks {
                let able: Vec<&ServedModel> =
                    models.iter().filter(|m| task.accepts(m.info())).collect();
                let got = resolve(models, Some("text-embedding-3-small"), task);
                match (able.as_slice(), models.len()) {
                    ([only], _) => assert_eq!(got.unwrap().name, only.name, "{task:?} {names:?}"),
                    (_, 1) => assert_eq!(
                        got.unwrap_err().kind,
                        ErrorKind::InvalidRequest,
                        "{task:?} {names:?}"
                    ),
                    _ => assert_eq!(
                        got.unwrap_err().kind,
                        ErrorKind::NotFound,
                        "{task:?} {names:?}"
                    ),
                }
                let rule = task.unknown_name_rule();
                assert!(rule.starts_with(UNKNOWN_NAME), "{rule}");
                // Tasks any model does have no 400 case.
                let universal = matches!(task, Task::Tokenize | Task::Describe);
                assert_eq!(rule.contains("400"), !universal, "{rule}");
            }
        }
    }

    #[test]
    fn scoring_prefers_a_reranker_unless_named() {
        let reranker = ModelKind::Reranker {
            labels: vec!["LABEL_0".into()],
        };
        let models = vec![
            served("emb", ModelKind::Embedding),
            served("rr", reranker),
            served(
                "clf",
                ModelKind::Classifier {
                    labels: vec!["a".into(), "b".into()],
                    multi_label: false,
                },
            ),
        ];
        assert_eq!(resolve(&models, None, Task::Score).unwrap().name, "rr");
        assert_eq!(
            resolve(&models, Some("emb"), Task::Score).unwrap().name,
            "emb"
        );
        let e = resolve(&models, Some("clf"), Task::Score).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        let only = vec![served("emb", ModelKind::Embedding)];
        assert_eq!(resolve(&only, None, Task::Score).unwrap().name, "emb");
    }

    #[test]
    fn sparse_routes_pick_the_splade_model() {
        let models = vec![
            served("dense", ModelKind::Embedding),
            served_as("splade", ModelKind::Embedding, true),
        ];
        // Unnamed: dense vectors from the first embedding model, sparse ones
        // from the first SPLADE model; a SPLADE model still answers dense routes.
        assert_eq!(resolve(&models, None, Task::Embed).unwrap().name, "dense");
        assert_eq!(
            resolve(&models, None, Task::EmbedSparse).unwrap().name,
            "splade"
        );
        assert_eq!(
            resolve(&models, Some("splade"), Task::Embed).unwrap().name,
            "splade"
        );
        let e = resolve(&models, Some("dense"), Task::EmbedSparse).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("a sparse model"), "{}", e.message);
        let only = vec![served("dense", ModelKind::Embedding)];
        let e = resolve(&only, None, Task::EmbedSparse).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("--pooling splade"), "{}", e.message);
        assert!(e.message.contains("sparse_linear.pt"), "{}", e.message);
    }

    #[test]
    fn a_model_with_lexical_weights_answers_sparse_and_dense_routes() {
        let models = vec![
            served("dense", ModelKind::Embedding),
            served_lexical("bge-m3"),
        ];
        assert_eq!(resolve(&models, None, Task::Embed).unwrap().name, "dense");
        assert_eq!(
            resolve(&models, None, Task::EmbedSparse).unwrap().name,
            "bge-m3"
        );
        assert_eq!(
            resolve(&models, Some("bge-m3"), Task::Embed).unwrap().name,
            "bge-m3"
        );
        // Alone, it answers both kinds of route under any name.
        let only = vec![served_lexical("bge-m3")];
        assert_eq!(
            resolve(&only, None, Task::EmbedSparse).unwrap().name,
            "bge-m3"
        );
        assert_eq!(resolve(&only, None, Task::Embed).unwrap().name, "bge-m3");
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
        // A classifier served after the reranker still answers the
        // classification routes when the request names no model.
        let with_classifier = vec![
            served("emb", ModelKind::Embedding),
            served(
                "rr",
                ModelKind::Reranker {
                    labels: vec!["LABEL_0".into()],
                },
            ),
            served(
                "cls",
                ModelKind::Classifier {
                    labels: vec!["neg".into(), "pos".into()],
                    multi_label: false,
                },
            ),
        ];
        assert_eq!(
            resolve(&with_classifier, None, Task::Predict).unwrap().name,
            "cls"
        );
        assert_eq!(
            resolve(&with_classifier, None, Task::Score).unwrap().name,
            "rr"
        );
        assert_eq!(
            resolve(&with_classifier, Some("rr"), Task::Predict)
                .unwrap()
                .name,
            "rr"
        );
        assert_eq!(
            resolve(&models, Some("rr"), Task::Tokenize).unwrap().name,
            "rr"
        );
        // An unknown name: the one model that can do the task, else a 404.
        assert_eq!(
            resolve(&models, Some("text-embedding-3-small"), Task::Embed)
                .unwrap()
                .name,
            "emb"
        );
        assert_eq!(
            resolve(&models, Some("nope"), Task::Rerank).unwrap().name,
            "rr"
        );
        let e = resolve(&models, Some("nope"), Task::Describe).unwrap_err();
        assert_eq!(
            (e.kind, e.code),
            (ErrorKind::NotFound, Some("model_not_found"))
        );
        assert!(e.message.contains("emb, rr"), "{}", e.message);
        let two = vec![
            served("dense", ModelKind::Embedding),
            served_as("splade", ModelKind::Embedding, true),
        ];
        let e = resolve(&two, Some("nope"), Task::Embed).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound);
        assert_eq!(
            resolve(&two, Some("nope"), Task::EmbedSparse).unwrap().name,
            "splade"
        );
        let e = resolve(&models, Some("emb"), Task::Rerank).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("an embedding model"), "{}", e.message);
        let only = vec![served("emb", ModelKind::Embedding)];
        let e = resolve(&only, None, Task::Rerank).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("--rerank-model"), "{}", e.message);
        // One model: any name reaches it (OpenAI-style clients send their own defaults).
        assert_eq!(
            resolve(&only, Some("text-embedding-ada-002"), Task::Embed)
                .unwrap()
                .name,
            "emb"
        );
        let e = resolve(&only, Some("other"), Task::Rerank).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
    }
}
