//! [`PythonLiveStats`]: the Python model's `memory()` and `live_details()`,
//! callable from any thread (HTTP handlers) while the model thread runs.

use std::collections::BTreeMap;

use mlx_embed_core::{DeviceMemory, EmbedderError, LiveStats};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error;

/// A second handle on the loaded Python model. Each read attaches to the
/// interpreter briefly, so it waits while a batch holds the GIL.
pub struct PythonLiveStats {
    model: Py<PyAny>,
}

impl PythonLiveStats {
    pub(crate) fn new(model: Py<PyAny>) -> Self {
        Self { model }
    }
}

impl LiveStats for PythonLiveStats {
    fn memory(&self) -> Result<DeviceMemory, EmbedderError> {
        Python::attach(|py| {
            let figures = self
                .model
                .bind(py)
                .call_method0("memory")
                .map_err(|e| error::classify(py, &e))?;
            let figures = figures.cast::<PyDict>().map_err(|_| {
                EmbedderError::model_failure("model.memory() did not return a dict")
            })?;
            let bytes = |key: &str| -> Result<i64, EmbedderError> {
                figures
                    .get_item(key)
                    .and_then(|v| match v {
                        Some(v) => v.extract::<i64>(),
                        None => Err(pyo3::exceptions::PyKeyError::new_err(key.to_string())),
                    })
                    .map_err(|e| {
                        EmbedderError::model_failure(format!("model.memory()[{key:?}]: {e}"))
                    })
            };
            // The engine says -1 for "no cache limit set"; a negative live
            // figure would be a bug, never a size.
            let size = |key: &str| -> Result<u64, EmbedderError> {
                let v = bytes(key)?;
                u64::try_from(v).map_err(|_| {
                    EmbedderError::model_failure(format!("model.memory()[{key:?}] is {v}"))
                })
            };
            Ok(DeviceMemory {
                active_bytes: size("active_bytes")?,
                cache_bytes: size("cache_bytes")?,
                peak_bytes: size("peak_bytes")?,
                cache_limit_bytes: u64::try_from(bytes("cache_limit_bytes")?).ok(),
            })
        })
    }

    fn details(&self) -> Result<BTreeMap<String, String>, EmbedderError> {
        Python::attach(|py| {
            self.model
                .bind(py)
                .call_method0("live_details")
                .and_then(|d| d.extract::<BTreeMap<String, String>>())
                .map_err(|e| error::classify(py, &e))
        })
    }
}
