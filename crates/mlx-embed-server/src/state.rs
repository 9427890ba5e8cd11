//! Shared state every handler sees.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use mlx_embed_core::{Batcher, ModelInfo};

use crate::config::ServerArgs;
use crate::metrics::HttpMetrics;

/// Cheap to clone: one `Arc` inside.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

struct Inner {
    batcher: Batcher,
    args: ServerArgs,
    model_name: String,
    load_duration: Duration,
    started_unix: u64,
    shutting_down: AtomicBool,
    http: HttpMetrics,
}

impl AppState {
    /// State for `batcher` served with `args`; `load_duration` is how long the model took to load.
    pub fn new(batcher: Batcher, args: &ServerArgs, load_duration: Duration) -> Self {
        let info = batcher.model_info();
        let model_name = args
            .served_model_name
            .clone()
            .unwrap_or_else(|| info.name.clone());
        Self(Arc::new(Inner {
            batcher,
            args: args.clone(),
            model_name,
            load_duration,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            shutting_down: AtomicBool::new(false),
            http: HttpMetrics::default(),
        }))
    }

    pub fn batcher(&self) -> &Batcher {
        &self.0.batcher
    }
    pub fn model_info(&self) -> &ModelInfo {
        self.0.batcher.model_info()
    }
    pub fn args(&self) -> &ServerArgs {
        &self.0.args
    }
    /// The name the APIs report: `--served-model-name` or the model's own.
    pub fn model_name(&self) -> &str {
        &self.0.model_name
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

    /// Marks the server as draining: `/health` answers 503 from now on.
    pub fn begin_shutdown(&self) {
        self.0.shutting_down.store(true, Ordering::SeqCst);
    }
    pub fn is_shutting_down(&self) -> bool {
        self.0.shutting_down.load(Ordering::SeqCst)
    }
    /// Healthy batcher and not shutting down.
    pub fn is_ready(&self) -> bool {
        !self.is_shutting_down() && self.0.batcher.is_healthy()
    }
}
