//! The model thread: builds the model, then, for the model's whole life,
//! takes the next batch from the lanes (`Shared::next_batch`), runs one
//! `embed_batch` call on it and slices the output back to the requests it
//! came from.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use crate::queue::{Batch, Part};
use crate::shared::Shared;
use crate::{
    BatchOutput, CoreError, Embedder, EmbedderError, EmbedderErrorKind, Encoded, ModelInfo, Output,
    Tokenize,
};

/// The thread's name, visible in debuggers and panic messages.
pub(crate) const THREAD_NAME: &str = "mlx-embed-model";

/// The model panicked or reported itself gone: the thread ends and the batcher is unhealthy.
struct Died(String);

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// Marks the model dead if the thread unwinds for any reason we did not
/// catch ourselves, so callers never wait on a thread that is gone.
struct DeathGuard<'a>(&'a Shared);

impl Drop for DeathGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.kill("model thread died: unexpected panic".into());
        }
    }
}

/// What the model thread reports once `load` has run: the model's facts and
/// tokenizer, or why it failed.
pub(crate) type Loaded = Result<(ModelInfo, Option<Arc<dyn Tokenize>>), String>;

/// Spawns the model thread, runs `load` there and reports its result. The
/// thread is detached: it exits by itself once stopped or dead.
pub(crate) fn spawn<E, F>(shared: Arc<Shared>, load: F) -> std::io::Result<mpsc::Receiver<Loaded>>
where
    E: Embedder + 'static,
    F: FnOnce() -> Result<E, EmbedderError> + Send + 'static,
{
    let (loaded_tx, loaded_rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(THREAD_NAME.into())
        .spawn(move || {
            let loaded = catch_unwind(AssertUnwindSafe(|| {
                let model = load()?;
                let info = model.info();
                let tokenizer = model.tokenizer();
                Ok::<_, EmbedderError>((model, info, tokenizer))
            }));
            let (model, info, tokenizer) = match loaded {
                Ok(Ok(loaded)) => loaded,
                Ok(Err(e)) => {
                    let _ = loaded_tx.send(Err(format!("model failed to load: {}", e.message)));
                    return;
                }
                Err(payload) => {
                    let _ = loaded_tx.send(Err(format!(
                        "model load panicked: {}",
                        panic_message(&*payload)
                    )));
                    return;
                }
            };
            let dim = info.dim;
            let _ = loaded_tx.send(Ok((info, tokenizer)));
            drop(loaded_tx);
            ModelThread {
                shared: &shared,
                model,
                dim,
            }
            .run();
        })?;
    Ok(loaded_rx)
}

struct ModelThread<'a, E> {
    shared: &'a Shared,
    model: E,
    /// Embedding dimension promised by `info()`; zero means "whatever the model returns".
    dim: usize,
}

impl<E: Embedder> ModelThread<'_, E> {
    fn run(mut self) {
        let _guard = DeathGuard(self.shared);
        while let Some(batch) = self.shared.next_batch() {
            if let Err(Died(message)) = self.run_batch(batch) {
                // `die` has already marked the model dead.
                tracing::error!(%message, "embedding model gone (panicked or said so); model thread exiting");
                return;
            }
        }
        self.shared.drain_after_stop();
        tracing::debug!("model thread exiting");
    }

    fn run_batch(&mut self, batch: Batch) -> Result<(), Died> {
        let recorder = &*self.shared.recorder;
        let now = Instant::now();
        for part in &batch.parts {
            if part.req.mark_started() {
                recorder.queue_wait(
                    part.req.priority,
                    now.saturating_duration_since(part.req.arrived),
                );
            }
        }

        let started = Instant::now();
        let outcome = match self.call(&batch.inputs, batch.output) {
            Ok(outcome) => outcome,
            Err(died) => {
                self.die(&died, &batch.parts);
                return Err(died);
            }
        };
        match outcome {
            Ok(output) => {
                tracing::info!(
                    "batch of {} texts / {} tokens from {} requests in {:.1} ms",
                    batch.inputs.len(),
                    batch.real_tokens(),
                    batch.parts.len(),
                    started.elapsed().as_secs_f64() * 1e3
                );
                let starts = row_starts(&output.rows);
                for part in &batch.parts {
                    self.deliver(part, part.start, &output, &starts);
                }
            }
            Err(error) if batch.parts.len() == 1 => batch.parts[0].req.fail(failure(error)),
            Err(error) => {
                // Which request broke the batch? Re-run each part alone, so only
                // the offending request gets the error.
                tracing::warn!(message = %error.message, parts = batch.parts.len(), "batch failed; retrying each request alone");
                for (i, part) in batch.parts.iter().enumerate() {
                    let inputs = &batch.inputs[part.start..part.start + part.len];
                    match self.call(inputs, batch.output) {
                        Ok(Ok(output)) => self.deliver(part, 0, &output, &row_starts(&output.rows)),
                        Ok(Err(error)) => part.req.fail(failure(error)),
                        Err(died) => {
                            self.die(&died, &batch.parts[i..]);
                            return Err(died);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The model panicked: marks it dead, then fails `parts` (the batch's
    /// unanswered requests). In that order, so a caller told "model thread died"
    /// can never find the batcher still healthy, nor a request sneak in after it.
    fn die(&self, died: &Died, parts: &[Part]) {
        self.shared.kill(format!("model thread died: {}", died.0));
        let error = self.shared.unavailable();
        for part in parts {
            part.req.fail(error.clone());
        }
    }

    /// One model call with its metrics. The outer error means the model is
    /// gone (it panicked, or said so); the inner one is the model's own error
    /// on these inputs, or an output of the wrong shape.
    fn call(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<Result<BatchOutput, EmbedderError>, Died> {
        let started = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| self.model.embed_batch(inputs, output)));
        let elapsed = started.elapsed();
        let result = result.map_err(|payload| Died(panic_message(&*payload)))?;
        let recorder = &*self.shared.recorder;
        let gil_wait = result.as_ref().map(|o| o.gil_wait).unwrap_or_default();
        let longest = inputs.iter().map(Encoded::len).max().unwrap_or(0);
        recorder.model_call(inputs.len(), longest * inputs.len(), elapsed, gil_wait);
        let kind = output;
        let output = match result {
            Ok(output) => output,
            Err(e) if e.kind == EmbedderErrorKind::ModelGone => return Err(Died(e.message)),
            Err(e) => return Ok(Err(e)),
        };
        if let Err(message) = self.check_shape(&output, inputs, kind) {
            return Ok(Err(EmbedderError::model_failure(message)));
        }
        let real: u64 = inputs.iter().map(|e| e.len() as u64).sum();
        recorder.tokens(real, output.padded_tokens);
        Ok(Ok(output))
    }

    /// A model returning the wrong number of rows or floats is a model
    /// error, never a panic or a mis-sliced answer: pooled output is one
    /// `dim`-wide row per input; token output one row per token of each
    /// input, all of one width.
    fn check_shape(
        &self,
        output: &BatchOutput,
        inputs: &[Encoded],
        kind: Output,
    ) -> Result<(), String> {
        let n = inputs.len();
        let want_rows = |i: usize| match kind {
            Output::Pooled => 1,
            Output::Tokens => inputs[i].len(),
        };
        if output.rows.len() != n || (0..n).any(|i| output.rows[i] as usize != want_rows(i)) {
            return Err(format!(
                "model returned {} row counts {:?} for {n} inputs wanting {} output",
                output.rows.len(),
                &output.rows[..output.rows.len().min(8)],
                kind.as_str()
            ));
        }
        let rows: usize = output.rows.iter().map(|&r| r as usize).sum();
        let floats = output.vectors.len();
        let ok = match (kind, self.dim) {
            (Output::Pooled, dim) if dim > 0 => floats == rows * dim,
            // A hidden width need not be the pooled `dim` (Dense heads).
            _ => floats > 0 && floats.checked_rem(rows) == Some(0),
        };
        if !ok {
            return Err(format!(
                "model returned {floats} floats for {rows} {} rows (dimension {})",
                kind.as_str(),
                self.dim
            ));
        }
        Ok(())
    }

    /// Hands `part` its rows of `output`; the batch's input `first` is the
    /// part's first, and `starts` is each input's first row (plus the total).
    fn deliver(&self, part: &Part, first: usize, output: &BatchOutput, starts: &[usize]) {
        let width = output.vectors.len() / starts[starts.len() - 1];
        let vectors = (first..first + part.len)
            .map(|i| output.vectors[starts[i] * width..starts[i + 1] * width].to_vec());
        part.req.deliver(part.offset, vectors);
    }
}

/// Each input's first row in a checked output, and the total rows last.
fn row_starts(rows: &[u32]) -> Vec<usize> {
    let mut starts = Vec::with_capacity(rows.len() + 1);
    let mut next = 0;
    starts.push(0);
    for &r in rows {
        next += r as usize;
        starts.push(next);
    }
    starts
}

/// What a caller is told when the model failed on its inputs.
fn failure(error: EmbedderError) -> CoreError {
    match error.kind {
        EmbedderErrorKind::InvalidInput => CoreError::InvalidInput(error.message),
        EmbedderErrorKind::ModelFailure | EmbedderErrorKind::ModelGone => {
            CoreError::Model(error.message)
        }
    }
}
