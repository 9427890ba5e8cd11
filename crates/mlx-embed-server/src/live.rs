//! The model's live figures ([`mlx_embed_core::LiveStats`]: device memory,
//! display facts that change) for `/info` and `/metrics`, read at request time.
//!
//! A Python model answers only once it holds the interpreter, which a running
//! batch may keep for a while, so the reads run on tokio's blocking pool and
//! never stall the runtime's workers. A failed read is logged and left out:
//! the ops routes still answer.

use std::collections::BTreeMap;

use mlx_embed_core::{DeviceMemory, LiveStats};

use crate::state::AppState;

/// What the model reported now; empty when it has no live figures.
#[derive(Debug, Default)]
pub(crate) struct LiveReading {
    pub memory: Option<DeviceMemory>,
    pub details: BTreeMap<String, String>,
}

/// Device memory only (what `/metrics` needs: the cheap read).
pub(crate) async fn memory(state: &AppState) -> Option<DeviceMemory> {
    read(state, false).await.memory
}

/// Device memory and the live display details (`/info`).
pub(crate) async fn reading(state: &AppState) -> LiveReading {
    read(state, true).await
}

async fn read(state: &AppState, with_details: bool) -> LiveReading {
    let Some(stats) = state.batcher().live_stats().cloned() else {
        return LiveReading::default();
    };
    tokio::task::spawn_blocking(move || read_blocking(&*stats, with_details))
        .await
        .unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading the model's live figures panicked");
            LiveReading::default()
        })
}

fn read_blocking(stats: &dyn LiveStats, with_details: bool) -> LiveReading {
    let memory = stats
        .memory()
        .map_err(|e| tracing::warn!(error = %e, "cannot read the model's device memory"))
        .ok();
    let details = if with_details {
        stats
            .details()
            .map_err(|e| tracing::warn!(error = %e, "cannot read the model's live details"))
            .unwrap_or_default()
    } else {
        BTreeMap::new()
    };
    LiveReading { memory, details }
}
