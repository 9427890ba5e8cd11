//! `PythonEmbedder`: the Python model's typed `spec()` read once, its
//! `embed_ids` called once per batch with token ids the Rust tokenizer made.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx_embed_core::{
    BatchOutput, Embedder, EmbedderError, Encoded, LiveStats, ModelInfo, Output, Replica,
    Submitted, Ticket, Tokenize, TruncationDirection,
};
use mlx_embed_tokenizer::HfTokenizer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::interpreter::ensure_python;
use crate::live::PythonLiveStats;
use crate::spec::{read_spec, ModelSpec};
use crate::thread_state::keep_thread_state;
use crate::{error, BridgeError};

/// What to load; mirrors `mlx_embed.load(path, dtype=, quantize=, instruction=, pooling=,
/// max_length=, kind=)` and, in [`EngineOptions`], its engine settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonModelOptions {
    /// A local Hugging Face folder, or a Hugging Face repo id that
    /// `mlx_embed.load` resolves (see [`crate::interpreter::resolve_model`]);
    /// `None` is the default all-MiniLM-L6-v2.
    pub model: Option<String>,
    /// "float32" (the only fast choice on x86 CPUs), "float16" or "bfloat16".
    pub dtype: String,
    /// Quantize weights on load to this many bits: 2, 3, 4, 5, 6 or 8 (MLX's
    /// affine widths; the server's `--quantize` offers 4 and 8, the ones measured).
    pub quantize: Option<u8>,
    /// Query instruction for instruction-tuned decoder models (Qwen3-Embedding).
    pub instruction: Option<String>,
    /// `load(pooling=)`: overrides the folder's pooling ("splade": SPLADE
    /// sparse vectors from a masked-LM checkpoint); `None` keeps the folder's.
    pub pooling: Option<String>,
    /// `load(max_length=)`: the tokens each input is cut to, as
    /// sentence-transformers' `max_seq_length` (up to the positions the
    /// model has); `None` keeps the folder's own.
    pub max_length: Option<usize>,
    /// `load(truncation_side=)`: the end an over-long input loses when a
    /// request names none, over the folder's own `truncation_side`;
    /// `None` keeps the folder's.
    pub truncation_side: Option<TruncationDirection>,
    /// Engine settings passed to `load()` as keyword arguments; `None` keeps the engine's default.
    pub engine: EngineOptions,
    /// `load(kind=)`: "embedding", "classifier" or "reranker"; `None` lets
    /// the folder decide (a *ForSequenceClassification head is a scorer).
    pub kind: Option<String>,
}

/// The Python engine's per-model settings (`mlx_embed.load(cache_limit_mb=, fast_ops=, workers=,
/// batch_tokens=, pipeline=, streams=, packed_rows=, eval_chunk_mb=, fused_attention=,
/// shape_buckets=, joined_linears=)`), each passed as that keyword argument where set.
///
/// The engine checks them as it loads, as it checks a Python caller's: one
/// it cannot take fails the load with
/// [`EmbedderErrorKind::InvalidOption`](mlx_embed_core::EmbedderErrorKind::InvalidOption),
/// its message naming the argument. What each setting came to shows among
/// the model's details ([`ModelInfo::details`](mlx_embed_core::ModelInfo::details)):
/// `attention` (`fused` or `matmul`), `shape_buckets` (`true` or `false`),
/// `joined_linears` (the groups joined, where any were), `workers`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineOptions {
    /// MLX buffer cache limit in MiB (engine default: 2048 on a GPU, 0 on the CPU).
    pub cache_limit_mb: Option<u64>,
    /// CPU element-wise path: "native", "mlx" or "exact".
    pub fast_ops: Option<String>,
    /// MLX worker threads on the CPU: at most 4 per core this process may
    /// run on (fewer where a container's CPU quota grants fewer cores) and
    /// 256, as the engine's `mlx_embed.workers` counts them (see
    /// [`crate::interpreter::workers_refusal`]); `None` reads the
    /// `MLX_EMBED_WORKERS` environment variable, bounded alike, else the
    /// engine's default (2 with 2+ cores; 1 on a GPU).
    pub workers: Option<usize>,
    /// Padded tokens per device pass (how the engine cuts one model call).
    pub batch_tokens: Option<usize>,
    /// Queue calls on the device and collect them later, so consecutive
    /// batches overlap (engine default: on a GPU only).
    pub pipeline: Option<bool>,
    /// Device streams the pipelined path rotates over, call after call (engine default: 1).
    pub streams: Option<usize>,
    /// An encoder's layers, and a decoder's feed-forward, on a pass's real tokens alone (engine default: off).
    pub packed_rows: Option<bool>,
    /// With MLX's CUDA graphs off, MB of layer outputs between a pass's
    /// evaluation points, which bound its device memory; 0 turns them off
    /// (engine default: 64 there, 0 elsewhere).
    pub eval_chunk_mb: Option<u32>,
    /// Attention through MLX's fused `scaled_dot_product_attention` kernel
    /// (cuDNN on CUDA) rather than matmuls and a softmax; the same vectors
    /// either way, to float rounding. It runs on the engine's exact path
    /// only: on the CPU with `fast_ops` other than "exact" the setting is
    /// taken and attention stays matmuls (the `attention` detail says
    /// which ran). Engine default: on a GPU in float16 and bfloat16.
    pub fused_attention: Option<bool>,
    /// Pad each device pass to a bounded set of shapes (rows to a power of
    /// two, lengths to steps), as every new shape costs a GPU a compile or
    /// a kernel plan; the vectors are the same. Engine default: on a GPU.
    pub shape_buckets: Option<bool>,
    /// Run a decoder's sibling projections (q/k/v, gate/up) as one matmul
    /// each, joined once at load; the same vectors, to float rounding. An
    /// architecture without such siblings is unchanged. Engine default: off.
    pub joined_linears: Option<bool>,
}

impl Default for PythonModelOptions {
    fn default() -> Self {
        Self {
            model: None,
            dtype: "float32".into(),
            quantize: None,
            instruction: None,
            pooling: None,
            max_length: None,
            truncation_side: None,
            engine: EngineOptions::default(),
            kind: None,
        }
    }
}

/// The Python `mlx_embed` model, called once per batch with the interpreter
/// attached once; its tokenizer runs in Rust ([`HfTokenizer`]).
pub struct PythonEmbedder {
    model: Py<PyAny>,
    info: ModelInfo,
    tokenizer: Arc<HfTokenizer>,
    pipelines: bool,
    /// A query thread's handle: its calls run through the engine's
    /// `scheduler.call_solo`, beside a running call on the CPU instead of
    /// after it.
    solo: bool,
}

/// A call the engine has queued: its `PendingResult`.
struct PendingCall(Py<PyAny>);

impl PythonEmbedder {
    /// Starts or joins the interpreter, loads the model on the calling
    /// thread, reads its spec and builds the Rust tokenizer from it.
    ///
    /// Any thread may load and call a model, threads that come and go too
    /// (a thread per load, rayon, tokio's blocking pool): a Rust thread
    /// borrows the engine's MLX streams on its first call and gives them
    /// back when it ends, as Python's threads do, so the process keeps as
    /// many MLX stream threads as calls ran at once. (The process's main
    /// thread, unless it started the interpreter, keeps MLX's own streams
    /// instead; so does the thread that started it.) Such a thread takes
    /// the GIL as it ends, to give its streams back, and MLX's per-thread
    /// compile cache takes it too as it is destroyed: join it outside
    /// `Python::attach`, or the join waits forever. Loading inside
    /// `Batcher::start`'s closure ([`Self::load_for_batcher`]) runs the
    /// model on a model thread the next batcher reuses.
    pub fn load(options: &PythonModelOptions) -> Result<Self, BridgeError> {
        ensure_python()?;
        keep_thread_state();
        let (model, spec) = Python::attach(|py| -> Result<_, BridgeError> {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", &options.dtype)?;
            kwargs.set_item("quantize", options.quantize)?;
            kwargs.set_item("instruction", options.instruction.as_deref())?;
            if let Some(pooling) = &options.pooling {
                kwargs.set_item("pooling", pooling)?;
            }
            if let Some(n) = options.max_length {
                kwargs.set_item("max_length", n)?;
            }
            if let Some(side) = options.truncation_side {
                kwargs.set_item("truncation_side", side.name())?;
            }
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
            if let Some(on) = engine.pipeline {
                kwargs.set_item("pipeline", on)?;
            }
            if let Some(n) = engine.streams {
                kwargs.set_item("streams", n)?;
            }
            if let Some(on) = engine.packed_rows {
                kwargs.set_item("packed_rows", on)?;
            }
            if let Some(mb) = engine.eval_chunk_mb {
                kwargs.set_item("eval_chunk_mb", mb)?;
            }
            if let Some(on) = engine.fused_attention {
                kwargs.set_item("fused_attention", on)?;
            }
            if let Some(on) = engine.shape_buckets {
                kwargs.set_item("shape_buckets", on)?;
            }
            if let Some(on) = engine.joined_linears {
                kwargs.set_item("joined_linears", on)?;
            }
            if let Some(kind) = &options.kind {
                kwargs.set_item("kind", kind)?;
            }
            let model = py.import("mlx_embed")?.call_method(
                "load",
                (options.model.as_deref(),),
                Some(&kwargs),
            )?;
            let spec = read_spec(&model.call_method0("spec")?)?;
            Ok((model.unbind(), spec))
        })?;
        let ModelSpec {
            info,
            tokenizer,
            pipelines,
        } = spec;
        let tokenizer = HfTokenizer::from_spec(tokenizer)?;
        if tokenizer.vocab_size() > info.vocab_size {
            // The tokenizer's added tokens past the embedding table would
            // index out of it: refuse the model rather than crash on them.
            return Err(BridgeError::Protocol(format!(
                "the tokenizer has {} ids but the model only {}",
                tokenizer.vocab_size(),
                info.vocab_size
            )));
        }
        tracing::info!(
            model = %info.name,
            dim = info.dim,
            max_input_tokens = info.max_input_tokens,
            vocab_size = info.vocab_size,
            pipelines,
            "python model loaded; tokenizing in Rust"
        );
        Ok(Self {
            model,
            info,
            tokenizer: Arc::new(tokenizer),
            pipelines,
            solo: false,
        })
    }

    /// [`PythonEmbedder::load`] with the error type `Batcher::start` wants.
    pub fn load_for_batcher(options: &PythonModelOptions) -> Result<Self, EmbedderError> {
        Self::load(options).map_err(EmbedderError::from)
    }

    /// The Rust tokenizer built from the model's spec.
    pub fn hf_tokenizer(&self) -> &Arc<HfTokenizer> {
        &self.tokenizer
    }
}

impl Embedder for PythonEmbedder {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(self.tokenizer.clone())
    }

    fn live_stats(&self) -> Option<Arc<dyn LiveStats>> {
        let model = Python::attach(|py| self.model.clone_ref(py));
        Some(Arc::new(PythonLiveStats::new(model)))
    }

    /// The same Python model object: the engine takes calls from any
    /// thread, each on that thread's own MLX streams.
    fn replica(&self) -> Option<Replica<Self>> {
        Some(self.handle(false))
    }

    /// The same model, its calls run solo (`scheduler.call_solo`): on the
    /// CPU a query no longer waits for the engine's lock, which a long
    /// call holds for all its passes.
    fn query_replica(&self) -> Option<Replica<Self>> {
        Some(self.handle(true))
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        keep_thread_state();
        let before_attach = Instant::now();
        Python::attach(|py| -> Result<BatchOutput, EmbedderError> {
            let gil_wait = before_attach.elapsed();
            let result = self
                .call_ids(py, "embed_ids", inputs, output)
                .map_err(|err| error::classify(py, &err))?;
            read_result(&result, gil_wait)
        })
    }

    fn pipelines(&self) -> bool {
        self.pipelines
    }

    /// `submit_ids` for `next`, then `result()` for `running`, in one
    /// interpreter crossing.
    fn submit(&mut self, next: &[Encoded], output: Output, running: Option<Ticket>) -> Submitted {
        keep_thread_state();
        let before_attach = Instant::now();
        Python::attach(|py| {
            let gil_wait = before_attach.elapsed();
            let queued = self
                .call_ids(py, "submit_ids", next, output)
                .map(|pending| Ticket::new(PendingCall(pending.unbind())))
                .map_err(|err| error::classify(py, &err));
            let running = running.map(|ticket| collect_in(py, ticket, gil_wait));
            Submitted {
                next: queued,
                running,
            }
        })
    }

    fn collect(&mut self, ticket: Ticket) -> Result<BatchOutput, EmbedderError> {
        keep_thread_state();
        let before_attach = Instant::now();
        Python::attach(|py| collect_in(py, ticket, before_attach.elapsed()))
    }
}

impl PythonEmbedder {
    /// Another handle on the same Python model object.
    fn handle(&self, solo: bool) -> Replica<Self> {
        let model = Python::attach(|py| self.model.clone_ref(py));
        let (info, tokenizer, pipelines) =
            (self.info.clone(), self.tokenizer.clone(), self.pipelines);
        Box::new(move || {
            Ok(Self {
                model,
                info,
                tokenizer,
                pipelines,
                solo,
            })
        })
    }

    /// `model.<method>(ids, type_ids, output=..., pool_start=...,
    /// pool_factor=..., protected_tokens=..., adapter=...)`: `embed_ids` or
    /// `submit_ids` (`pool_start` and `adapter` only when an input has one,
    /// so other models' calls are unchanged; the pooling lists, one entry
    /// per input, 1 for an input not pooled, only when an input is).
    fn call_ids<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        inputs: &[Encoded],
        output: Output,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (ids, type_ids) = id_lists(py, inputs)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("output", output.as_str())?;
        if inputs.iter().any(|e| e.pool_start > 0) {
            let starts: Vec<u32> = inputs.iter().map(|e| e.pool_start).collect();
            kwargs.set_item("pool_start", starts)?;
        }
        if inputs.iter().any(|e| e.token_pooling.is_some()) {
            let (factors, protected): (Vec<u32>, Vec<u32>) = inputs
                .iter()
                .map(|e| e.token_pooling.map_or((1, 1), |p| (p.factor, p.protected)))
                .unzip();
            kwargs.set_item("pool_factor", factors)?;
            kwargs.set_item("protected_tokens", protected)?;
        }
        if inputs.iter().any(|e| e.adapter.is_some()) {
            // -1: the base weights, for the batch's inputs without a task.
            let adapters: Vec<i64> = inputs
                .iter()
                .map(|e| e.adapter.map_or(-1, i64::from))
                .collect();
            kwargs.set_item("adapter", adapters)?;
        }
        let model = self.model.bind(py);
        if self.solo {
            py.import("mlx_embed.scheduler")?
                .getattr("call_solo")?
                .call((model, method, ids, type_ids), Some(&kwargs))
        } else {
            model.call_method(method, (ids, type_ids), Some(&kwargs))
        }
    }
}

/// Waits for a queued call (`PendingResult.result()`) and reads its answer.
fn collect_in(
    py: Python<'_>,
    ticket: Ticket,
    gil_wait: Duration,
) -> Result<BatchOutput, EmbedderError> {
    let PendingCall(pending) = ticket
        .into_inner()
        .map_err(|_| EmbedderError::model_failure("a ticket the Python model did not issue"))?;
    let result = pending
        .bind(py)
        .call_method0("result")
        .map_err(|err| error::classify(py, &err))?;
    read_result(&result, gil_wait)
}

/// An `EmbedResult` as the core's output.
fn read_result(
    result: &Bound<'_, PyAny>,
    gil_wait: Duration,
) -> Result<BatchOutput, EmbedderError> {
    let vectors = result
        .getattr("vectors")
        .map_err(|e| protocol("EmbedResult.vectors", &e))?;
    let vectors = vectors.cast::<PyBytes>().map_err(|_| {
        EmbedderError::model_failure("EmbedResult.vectors is not bytes".to_string())
    })?;
    let vectors = le_f32s(vectors.as_bytes())?;
    let padded_tokens: u64 = result
        .getattr("padded_tokens")
        .and_then(|v| v.extract())
        .map_err(|e| protocol("EmbedResult.padded_tokens", &e))?;
    // The model thread checks the counts against the inputs.
    let rows: Vec<u32> = result
        .getattr("rows")
        .and_then(|v| v.extract())
        .map_err(|e| protocol("EmbedResult.rows", &e))?;
    Ok(BatchOutput {
        vectors,
        rows,
        padded_tokens,
        gil_wait,
    })
}

/// The batch as Python lists: ids per input, and segment ids if any input has them.
fn id_lists<'py>(
    py: Python<'py>,
    inputs: &[Encoded],
) -> PyResult<(Bound<'py, PyList>, Option<Bound<'py, PyList>>)> {
    let ids = PyList::empty(py);
    for input in inputs {
        ids.append(&input.ids)?;
    }
    if inputs.iter().all(|e| e.type_ids.is_none()) {
        return Ok((ids, None));
    }
    let type_ids = PyList::empty(py);
    for input in inputs {
        match &input.type_ids {
            Some(t) => type_ids.append(t)?,
            None => type_ids.append(vec![0u32; input.ids.len()])?,
        }
    }
    Ok((ids, Some(type_ids)))
}

fn protocol(what: &str, err: &PyErr) -> EmbedderError {
    EmbedderError::model_failure(format!(
        "unexpected answer from the model: cannot read {what}: {err}"
    ))
}

/// Bulk conversion: one pass over the bytes, no per-element Python calls.
fn le_f32s(bytes: &[u8]) -> Result<Vec<f32>, EmbedderError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(EmbedderError::model_failure(format!(
            "unexpected answer from the model: {} vector bytes is not a whole number of float32",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}
