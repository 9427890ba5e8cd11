//! Shared state every handler sees.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mlx_embed_core::{Batcher, CoreError, ModelInfo};
use tokio::sync::watch;

use crate::answer_room::AnswerRoom;
use crate::config::ServerArgs;
use crate::errors::{ApiError, ServerError};
use crate::metrics::HttpMetrics;
use crate::models::{resolve, ServedModel, Task};

/// Cheap to clone: one `Arc` inside.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

struct Inner {
    /// At least one; the first is the default model of the routes that need
    /// no particular kind, and the one `--served-model-name` renames.
    models: Vec<ServedModel>,
    args: ServerArgs,
    load_duration: Duration,
    started_unix: u64,
    shutting_down: AtomicBool,
    /// Set when the server gives up on the connections still open (a second
    /// signal, or past the drain): their requests end unanswered by it.
    abandoning: AtomicBool,
    /// True once the drain timeout has passed ([`AppState::end_drain`]).
    drain_over: watch::Sender<bool>,
    http: HttpMetrics,
    answers: Arc<AnswerRoom>,
}

/// The names models are served under, in serving order, given the names
/// they load with: `--served-model-name` renames the first. They must be
/// unique, since they are how requests pick a model; a launcher checks them
/// before loading any model.
pub fn served_names(
    loaded_as: impl IntoIterator<Item = String>,
    args: &ServerArgs,
) -> Result<Vec<String>, ServerError> {
    let mut names: Vec<String> = Vec::new();
    for (i, name) in loaded_as.into_iter().enumerate() {
        let name = match (&args.served_model_name, i) {
            (Some(name), 0) => name.clone(),
            _ => name,
        };
        if names.contains(&name) {
            return Err(ServerError::Config(format!(
                "two models are named {name:?}: requests could not tell them apart \
                 (rename the folder, or the first model with --served-model-name)"
            )));
        }
        names.push(name);
    }
    Ok(names)
}

impl AppState {
    /// State for `batcher` served with `args`; `load_duration` is how long the model took to load.
    pub fn new(batcher: Batcher, args: &ServerArgs, load_duration: Duration) -> Self {
        Self::with_models(vec![batcher], args, load_duration)
            .expect("one model always has a unique name")
    }

    /// State for several models, each with its own batcher; the first is the
    /// default. Names must be unique (they are how requests pick a model).
    pub fn with_models(
        batchers: Vec<Batcher>,
        args: &ServerArgs,
        load_duration: Duration,
    ) -> Result<Self, ServerError> {
        if batchers.is_empty() {
            return Err(ServerError::Config("no model to serve".into()));
        }
        let names = served_names(batchers.iter().map(|b| b.model_info().name.clone()), args)?;
        let models: Vec<ServedModel> = names
            .into_iter()
            .zip(batchers)
            .map(|(name, batcher)| ServedModel::new(name, batcher))
            .collect();
        Ok(Self(Arc::new(Inner {
            models,
            args: args.clone(),
            load_duration,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            shutting_down: AtomicBool::new(false),
            abandoning: AtomicBool::new(false),
            drain_over: watch::Sender::new(false),
            http: HttpMetrics::default(),
            answers: Arc::new(AnswerRoom::new(
                args.max_unsent_answers_mb.saturating_mul(1 << 20),
            )),
        })))
    }

    /// The default (first) model's batcher.
    pub fn batcher(&self) -> &Batcher {
        &self.0.models[0].batcher
    }
    /// The default (first) model's facts.
    pub fn model_info(&self) -> &ModelInfo {
        self.0.models[0].batcher.model_info()
    }
    /// Every served model, the default first.
    pub fn models(&self) -> &[ServedModel] {
        &self.0.models
    }
    /// The model a request gets for `task` (see [`crate::models`]).
    /// The request counts under the model it gets, or, refused for naming a
    /// served model of another kind, under that one.
    pub fn model_for(&self, requested: Option<&str>, task: Task) -> Result<&ServedModel, ApiError> {
        let resolved = self.counted_under(requested, task);
        // Every `model` refusal but an unknown name's (404) is about the kind.
        if let Err(e) = &resolved {
            if e.kind == crate::errors::ErrorKind::InvalidRequest
                && e.param.as_deref() == Some("model")
            {
                crate::timing::note_model_type();
            }
        }
        resolved
    }
    /// [`Self::model_for`] without the note for TEI's `err`: the model the
    /// request gets, under which it counts (or the one it names, refused).
    fn counted_under(&self, requested: Option<&str>, task: Task) -> Result<&ServedModel, ApiError> {
        let resolved = resolve(&self.0.models, requested, task);
        let counted = match &resolved {
            Ok(model) => Some(*model),
            Err(_) => requested.and_then(|name| self.0.models.iter().find(|m| m.name == name)),
        };
        if let Some(model) = counted {
            crate::middleware::note_answering_model(&model.name);
        }
        resolved
    }
    /// Counts a request refused before its model was picked under the
    /// model it names (or would get), as refusals after the pick count.
    /// Its refusal stands: the model's kind is not why it was refused.
    pub(crate) fn count_under_requested(&self, requested: Option<&str>, task: Task) {
        let _ = self.counted_under(requested, task);
    }
    pub fn args(&self) -> &ServerArgs {
        &self.0.args
    }
    /// The default model's name: `--served-model-name` or the model's own.
    pub fn model_name(&self) -> &str {
        &self.0.models[0].name
    }
    pub fn load_duration(&self) -> Duration {
        self.0.load_duration
    }
    /// Unix seconds when this state was made (server start).
    pub fn started_unix(&self) -> u64 {
        self.0.started_unix
    }
    pub(crate) fn http_metrics(&self) -> &HttpMetrics {
        &self.0.http
    }
    /// The answers written but not yet taken (`--max-unsent-answers-mb`).
    pub(crate) fn answer_room(&self) -> &Arc<AnswerRoom> {
        &self.0.answers
    }

    /// Marks the server as draining: `/health` answers 503 from now on, and
    /// each model finishes its queued requests whole, oldest first, so the
    /// most are answered by the drain timeout ([`Batcher::finish_requests_whole`]).
    pub fn begin_shutdown(&self) {
        if !self.0.shutting_down.swap(true, Ordering::SeqCst) {
            for model in self.models() {
                model.batcher.finish_requests_whole();
            }
        }
    }
    /// The drain timeout has passed: every request still waiting for a
    /// model is answered now as shutting down (503) and its inputs are left
    /// uncomputed, rather than its connection being dropped unanswered.
    pub fn end_drain(&self) {
        self.0.drain_over.send_replace(true);
    }
    /// Runs a model call, unless the drain ends first ([`AppState::end_drain`]):
    /// then its caller gets `ShuttingDown`, and dropping `call` tells the
    /// batcher to skip what is left of it.
    pub(crate) async fn unless_drain_ends<T>(
        &self,
        call: impl Future<Output = Result<T, CoreError>>,
    ) -> Result<T, CoreError> {
        self.until_drain_ends(call)
            .await
            .unwrap_or(Err(CoreError::ShuttingDown))
    }
    /// `work`'s output, or `None` when the drain ends first ([`AppState::end_drain`]).
    pub(crate) async fn until_drain_ends<T>(&self, work: impl Future<Output = T>) -> Option<T> {
        let mut over = self.0.drain_over.subscribe();
        tokio::select! {
            biased;
            out = work => Some(out),
            // The sender lives as long as `self`: this never resolves early.
            _ = over.wait_for(|&over| over) => None,
        }
    }
    /// The server stops without waiting for the connections still open:
    /// their requests, dropped from now on, are logged as the server's
    /// doing, not as clients that went away.
    pub fn abandon_open_connections(&self) {
        self.0.abandoning.store(true, Ordering::SeqCst);
    }
    pub(crate) fn is_abandoning(&self) -> bool {
        self.0.abandoning.load(Ordering::SeqCst)
    }
    pub fn is_shutting_down(&self) -> bool {
        self.0.shutting_down.load(Ordering::SeqCst)
    }
    /// Every model's batcher healthy and not shutting down.
    pub fn is_ready(&self) -> bool {
        !self.is_shutting_down() && self.0.models.iter().all(|m| m.batcher.is_healthy())
    }
}
