//! `PythonEmbedder`: one Python call per batch.

use std::time::Instant;

use mlx_embed_core::{BatchOutput, EmbedInput, Embedder, EmbedderError, ModelInfo};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::interpreter::ensure_python;
use crate::BridgeError;

/// What to load; mirrors `mlx_embed.load(path, dtype=, quantize=, instruction=)`.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonModelOptions {
    /// Local Hugging Face folder; `None` is the default all-MiniLM-L6-v2.
    pub model: Option<String>,
    /// "float32" (the only fast choice on x86 CPUs), "float16" or "bfloat16".
    pub dtype: String,
    /// Quantize weights on load to this many bits (4 or 8).
    pub quantize: Option<u8>,
    /// Query instruction for instruction-tuned decoder models (Qwen3-Embedding).
    pub instruction: Option<String>,
    /// Engine settings passed to `load()` as keyword arguments; `None` keeps the engine's default.
    pub engine: EngineOptions,
}

/// The Python engine's per-model settings (`mlx_embed.load(cache_limit_mb=, fast_ops=, workers=, batch_tokens=)`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineOptions {
    /// MLX buffer cache limit in MiB (engine default: 2048 on a GPU, 0 on the CPU).
    pub cache_limit_mb: Option<u64>,
    /// CPU element-wise path: "native", "mlx" or "exact".
    pub fast_ops: Option<String>,
    /// MLX worker threads on the CPU.
    pub workers: Option<usize>,
    /// Padded tokens per device pass (how the engine cuts one model call).
    pub batch_tokens: Option<usize>,
}

impl Default for PythonModelOptions {
    fn default() -> Self {
        Self {
            model: None,
            dtype: "float32".into(),
            quantize: None,
            instruction: None,
            engine: EngineOptions::default(),
        }
    }
}

/// The Python `mlx_embed` model, called once per batch with the interpreter attached once.
pub struct PythonEmbedder {
    model: Py<PyAny>,
    info: ModelInfo,
    /// Test-only: an input containing this marker panics the model thread,
    /// so tests can prove a dead model thread is noticed (`MLX_EMBED_TEST_KILL`).
    kill_marker: Option<String>,
}

impl PythonEmbedder {
    /// Starts or joins the interpreter and loads the model on the calling thread.
    pub fn load(options: &PythonModelOptions) -> Result<Self, BridgeError> {
        ensure_python()?;
        Python::attach(|py| {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", &options.dtype)?;
            kwargs.set_item("quantize", options.quantize)?;
            kwargs.set_item("instruction", options.instruction.as_deref())?;
            let engine = &options.engine;
            if let Some(mb) = engine.cache_limit_mb {
                kwargs.set_item("cache_limit_mb", mb)?;
            }
            if let Some(path) = &engine.fast_ops {
                kwargs.set_item("fast_ops", path)?;
            }
            if let Some(n) = engine.workers {
                kwargs.set_item("workers", n)?;
            }
            if let Some(n) = engine.batch_tokens {
                kwargs.set_item("batch_tokens", n)?;
            }
            let model = py.import("mlx_embed")?.call_method("load", (options.model.as_deref(),), Some(&kwargs))?;
            let info = read_info(&model.call_method0("info")?)?;
            Ok(Self {
                model: model.unbind(),
                info,
                kill_marker: std::env::var("MLX_EMBED_TEST_KILL").ok().filter(|m| !m.is_empty()),
            })
        })
    }

    /// [`PythonEmbedder::load`] with the error type `Batcher::start` wants.
    pub fn load_for_batcher(options: &PythonModelOptions) -> Result<Self, EmbedderError> {
        Self::load(options).map_err(EmbedderError::from)
    }

    fn check_kill_hook(&self, inputs: &[EmbedInput]) {
        let Some(marker) = &self.kill_marker else { return };
        if inputs.iter().any(|input| matches!(input, EmbedInput::Text(t) if t.contains(marker.as_str()))) {
            panic!("test hook MLX_EMBED_TEST_KILL: killing the model thread");
        }
    }
}

impl Embedder for PythonEmbedder {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn embed_batch(&mut self, inputs: &[EmbedInput]) -> Result<BatchOutput, EmbedderError> {
        self.check_kill_hook(inputs);
        let before_attach = Instant::now();
        Python::attach(|py| {
            let gil_wait = before_attach.elapsed();
            let batch = PyList::empty(py);
            for input in inputs {
                match input {
                    EmbedInput::Text(text) => batch.append(text)?,
                    EmbedInput::Tokens(ids) => batch.append(ids)?,
                }
            }
            let answer = self.model.bind(py).call_method1("embed_raw", (batch,))?;
            let (vectors, token_counts, untruncated_token_counts, padded_tokens): (Bound<'_, PyBytes>, Vec<u32>, Vec<u32>, u64) =
                answer.extract()?;
            let vectors = le_f32s(vectors.as_bytes())?;
            Ok(BatchOutput { vectors, token_counts, untruncated_token_counts, padded_tokens, gil_wait })
        })
        .map_err(|err: BridgeError| err.into())
    }
}

/// Bulk conversion: one pass over the bytes, no per-element Python calls.
fn le_f32s(bytes: &[u8]) -> Result<Vec<f32>, BridgeError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(BridgeError::Protocol(format!("{} vector bytes is not a whole number of float32", bytes.len())));
    }
    Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

fn read_info(info: &Bound<'_, PyAny>) -> Result<ModelInfo, BridgeError> {
    let info = info.cast::<PyDict>().map_err(|_| BridgeError::Protocol("model.info() is not a dict".into()))?;
    let required = |key: &str| -> Result<Bound<'_, PyAny>, BridgeError> {
        info.get_item(key)?.ok_or_else(|| BridgeError::Protocol(format!("model.info() lacks {key:?}")))
    };
    let mut model_info = ModelInfo {
        name: required("name")?.extract()?,
        dim: required("dim")?.extract()?,
        max_input_tokens: required("max_length")?.extract()?,
        preferred_batch_tokens: info.get_item("preferred_batch_tokens")?.and_then(|v| v.extract().ok()),
        details: Default::default(),
    };
    for (key, value) in info.iter() {
        let key: String = key.extract()?;
        if !["name", "dim", "max_length"].contains(&key.as_str()) && !value.is_none() {
            model_info.details.insert(key, value.str()?.to_string());
        }
    }
    Ok(model_info)
}
