//! The model threads: the first builds the model (and, with
//! `model_threads` above one, the others get their handles from
//! [`Embedder::replica`]); then each, for the model's whole life, takes the
//! next batch from the lanes (`Shared::next_batch`), runs one `embed_batch`
//! call on it and slices the output back to the requests it came from.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use crate::queue::{Batch, Part};
use crate::shared::{Activity, Role, Shared};
use crate::threads;
use crate::{
    BatchOutput, CoreError, Embedder, EmbedderError, EmbedderErrorKind, Encoded, LiveStats,
    ModelInfo, Output, Replica, Ticket, Tokenize,
};

/// The model threads' name, visible in debuggers and panic messages (one
/// name for all: a thread serves one batcher's model, then another's).
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

/// What a loaded model hands the callers' side, taken once on the model thread.
pub(crate) struct Handles {
    pub info: ModelInfo,
    pub tokenizer: Option<Arc<dyn Tokenize>>,
    pub live_stats: Option<Arc<dyn LiveStats>>,
}

/// What the model thread reports once `load` has run: the model's handles,
/// or why it failed.
pub(crate) type Loaded = Result<Handles, EmbedderError>;

/// Spawns the first model thread, runs `load` there, starts the other
/// `model_threads - 1` on replicas of the model, and reports the result once
/// all are ready. The threads are detached: each leaves the model once
/// stopped or dead, and waits for the next batcher's (see [`threads`]).
pub(crate) fn spawn<E, F>(shared: Arc<Shared>, load: F) -> std::io::Result<mpsc::Receiver<Loaded>>
where
    E: Embedder + 'static,
    F: FnOnce() -> Result<E, EmbedderError> + Send + 'static,
{
    let (loaded_tx, loaded_rx) = mpsc::sync_channel(1);
    threads::run(
        THREAD_NAME,
        Box::new(move || {
            let loaded = build_model("model load", || {
                let model = load()?;
                let handles = Handles {
                    info: model.info(),
                    tokenizer: model.tokenizer(),
                    live_stats: model.live_stats(),
                };
                Ok((model, handles))
            });
            let (model, handles) = match loaded {
                Ok(loaded) => loaded,
                Err(message) => {
                    let _ = loaded_tx.send(Err(message));
                    return;
                }
            };
            let shape = OutputShape {
                dim: handles.info.dim,
                vocab_size: handles.info.vocab_size,
            };
            if let Err(message) = start_replicas(&shared, &model, shape) {
                // The replicas already running exit on `Stopped`.
                shared.stop();
                let _ = loaded_tx.send(Err(message));
                return;
            }
            let _ = loaded_tx.send(Ok(handles));
            drop(loaded_tx);
            ModelThread::new(&shared, model, shape, Role::All).run();
        }),
    )?;
    Ok(loaded_rx)
}

/// Starts model threads 1..`model_threads`, each on its own replica of
/// `model` built on that thread, then the `query_threads` on query replicas,
/// and returns once every one is ready to take batches, or with why one is
/// not. A model with no query replica runs no query thread: that is said
/// (`Shared::query_threads_running` stays zero), never an error.
fn start_replicas<E: Embedder + 'static>(
    shared: &Arc<Shared>,
    model: &E,
    shape: OutputShape,
) -> Result<(), EmbedderError> {
    let threads = shared.config.model_threads;
    let mut builds: Vec<(Replica<E>, Role)> = Vec::new();
    for _ in 1..threads {
        let build = model.replica().ok_or_else(|| {
            EmbedderError::invalid_input(format!(
                "model_threads = {threads}, but this model serves from one thread only"
            ))
        })?;
        builds.push((build, Role::All));
    }
    let query_threads = shared.config.query_threads;
    for _ in 0..query_threads {
        match model.query_replica() {
            Some(build) => builds.push((build, Role::Queries)),
            None => {
                tracing::info!(
                    query_threads,
                    "this model serves from its model threads only: no query thread"
                );
                builds.retain(|(_, role)| *role == Role::All);
                break;
            }
        }
    }
    let started = builds.len();
    let running_queries = builds.iter().filter(|(_, r)| *r == Role::Queries).count();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), EmbedderError>>();
    for (n, (build, role)) in (1..).zip(builds) {
        let shared = shared.clone();
        let ready_tx = ready_tx.clone();
        threads::run(
            THREAD_NAME,
            Box::new(move || {
                let what = format!("model thread {n}'s start");
                let built = build_model(&what, || {
                    build().map_err(|e| {
                        EmbedderError::new(e.kind, format!("{what} failed: {}", e.message))
                    })
                });
                let model = match built {
                    Ok(model) => model,
                    Err(message) => {
                        let _ = ready_tx.send(Err(message));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                drop(ready_tx);
                ModelThread::new(&shared, model, shape, role).run();
            }),
        )
        .map_err(|e| EmbedderError::model_failure(format!("cannot spawn model thread {n}: {e}")))?;
    }
    drop(ready_tx);
    for _ in 0..started {
        ready_rx
            .recv()
            .map_err(|_| EmbedderError::model_gone("a model thread exited while starting"))??;
    }
    shared.set_query_threads_running(running_queries);
    if started > 0 {
        tracing::info!(
            threads,
            query_threads = running_queries,
            "model threads started"
        );
    }
    Ok(())
}

/// Runs `build` (the model's load, or a replica's), a panic caught: its
/// result as it is (the loader's error reaches [`crate::CoreError::LoadFailed`]
/// unchanged), or for a panic `ModelGone` saying "`what` panicked: ...".
fn build_model<T>(
    what: &str,
    build: impl FnOnce() -> Result<T, EmbedderError>,
) -> Result<T, EmbedderError> {
    match catch_unwind(AssertUnwindSafe(build)) {
        Ok(built) => built,
        Err(payload) => Err(EmbedderError::model_gone(format!(
            "{what} panicked: {}",
            panic_message(&*payload)
        ))),
    }
}

/// A batch submitted to the model and not yet collected.
struct InFlight {
    batch: Batch,
    ticket: Ticket,
    submitted: Instant,
}

/// What `info()` promised of a model's output, which its batches are checked against.
#[derive(Debug, Clone, Copy)]
struct OutputShape {
    /// Embedding dimension; zero means "whatever the model returns".
    dim: usize,
    /// Token ids of [`Output::Sparse`] rows are below it (zero: unchecked).
    vocab_size: usize,
}

struct ModelThread<'a, E> {
    shared: &'a Shared,
    model: E,
    shape: OutputShape,
    /// This thread's part in the shared state machine (see `shared.rs`).
    activity: Activity,
    /// What it takes from the lanes.
    role: Role,
}

impl<'a, E: Embedder> ModelThread<'a, E> {
    fn new(shared: &'a Shared, model: E, shape: OutputShape, role: Role) -> Self {
        Self {
            shared,
            model,
            shape,
            activity: Activity::Starting,
            role,
        }
    }

    fn run(mut self) {
        let _guard = DeathGuard(self.shared);
        let ended = if self.model.pipelines() {
            self.run_pipelined()
        } else {
            self.run_one_by_one()
        };
        if let Err(Died(message)) = ended {
            // `die` has already marked the model dead.
            tracing::error!(
                ?message,
                "embedding model gone (panicked or said so); model thread exiting"
            );
            return;
        }
        self.shared.drain_after_stop();
        tracing::debug!("model thread exiting");
    }

    /// One `embed_batch` per batch, each answered before the next is cut.
    fn run_one_by_one(&mut self) -> Result<(), Died> {
        while let Some(batch) = self.shared.next_batch(&mut self.activity, self.role) {
            self.mark_started(&batch);
            let started = Instant::now();
            match self.call(&batch.inputs, batch.output) {
                Ok(outcome) => self.settle(&batch, outcome, started)?,
                Err(died) => {
                    self.die(&died, &batch.parts);
                    return Err(died);
                }
            }
        }
        Ok(())
    }

    /// Batch k+1 is submitted before batch k is collected, so the device
    /// never waits for the host between batches. A batch cut while another
    /// is in flight goes in at once; with none waiting, the running one is
    /// collected, and only then does the thread wait for work.
    fn run_pipelined(&mut self) -> Result<(), Died> {
        let mut running: Option<InFlight> = None;
        loop {
            let next = match running {
                Some(_) => self.shared.try_next_batch(&mut self.activity, self.role),
                None => match self.shared.next_batch(&mut self.activity, self.role) {
                    Some(batch) => Some(batch),
                    None => return Ok(()),
                },
            };
            let Some(batch) = next else {
                // Nothing to overlap with: wait for the running batch itself.
                if let Some(prev) = running.take() {
                    let collected =
                        catch_unwind(AssertUnwindSafe(|| self.model.collect(prev.ticket)));
                    match collected {
                        Ok(result) => self.finish(&prev.batch, result, prev.submitted)?,
                        Err(payload) => {
                            let died = Died(panic_message(&*payload));
                            self.die(&died, &prev.batch.parts);
                            return Err(died);
                        }
                    }
                }
                continue;
            };
            self.mark_started(&batch);
            let submitted = Instant::now();
            let (prev, prev_ticket) = match running.take() {
                Some(InFlight {
                    batch,
                    ticket,
                    submitted,
                }) => (Some((batch, submitted)), Some(ticket)),
                None => (None, None),
            };
            let step = catch_unwind(AssertUnwindSafe(|| {
                self.model.submit(&batch.inputs, batch.output, prev_ticket)
            }));
            let step = match step {
                Ok(step) => step,
                Err(payload) => {
                    let died = Died(panic_message(&*payload));
                    match &prev {
                        Some((prev, _)) => {
                            self.die(&died, &prev.parts);
                            self.fail_unanswered(&batch.parts);
                        }
                        None => self.die(&died, &batch.parts),
                    }
                    return Err(died);
                }
            };
            // The older batch is answered first: its callers have waited longest.
            if let Some((prev, prev_submitted)) = prev {
                let result = step.running.unwrap_or_else(|| {
                    Err(EmbedderError::model_failure(
                        "the model did not collect the running batch",
                    ))
                });
                if let Err(died) = self.finish(&prev, result, prev_submitted) {
                    self.fail_unanswered(&batch.parts);
                    return Err(died);
                }
            }
            match step.next {
                Ok(ticket) => {
                    running = Some(InFlight {
                        batch,
                        ticket,
                        submitted,
                    })
                }
                Err(error) => self.finish(&batch, Err(error), submitted)?,
            }
        }
    }

    /// Checks, records and answers a batch whose result is in. `Err`: the
    /// model died, and the batch's unanswered requests are failed already.
    fn finish(
        &mut self,
        batch: &Batch,
        result: Result<BatchOutput, EmbedderError>,
        started: Instant,
    ) -> Result<(), Died> {
        match self.measure(&batch.inputs, batch.output, result, started) {
            Ok(outcome) => self.settle(batch, outcome, started),
            Err(died) => {
                self.die(&died, &batch.parts);
                Err(died)
            }
        }
    }

    /// Records the queue wait of the requests whose first inputs start now.
    fn mark_started(&self, batch: &Batch) {
        let recorder = &*self.shared.recorder;
        if self.role == Role::Queries {
            recorder.query_thread_batch();
        }
        let now = Instant::now();
        for part in &batch.parts {
            if let Some(waited) = part.req.mark_started(now) {
                recorder.queue_wait(part.req.priority, waited);
            }
        }
    }

    /// Answers a computed batch: its rows to each request, or, when it
    /// failed, the error to the request that caused it. `Err`: the model died
    /// on a retry (the batch's unanswered requests are failed already).
    fn settle(
        &mut self,
        batch: &Batch,
        outcome: Result<BatchOutput, EmbedderError>,
        started: Instant,
    ) -> Result<(), Died> {
        // Before any answer goes out: a caller may be back before this returns.
        self.shared.answered(batch.completed_inputs());
        match outcome {
            Ok(output) => {
                // Debug: under load a line per batch would cost the model
                // thread a write each time; each request keeps its info line.
                tracing::debug!(
                    "batch of {} texts / {} tokens from {} requests in {:.1} ms",
                    batch.inputs.len(),
                    batch.real_tokens(),
                    batch.parts.len(),
                    started.elapsed().as_secs_f64() * 1e3
                );
                let starts = row_starts(&output.rows);
                let model_time = started.elapsed();
                for part in &batch.parts {
                    self.deliver(part, part.start, &output, &starts, started, model_time);
                }
            }
            Err(error) if batch.parts.len() == 1 => batch.parts[0].req.fail(failure(error)),
            Err(error) => {
                // Which request broke the batch? Re-run each part alone, so only
                // the offending request gets the error.
                tracing::warn!(message = ?error.message, parts = batch.parts.len(), "batch failed; retrying each request alone");
                for (i, part) in batch.parts.iter().enumerate() {
                    let inputs = &batch.inputs[part.start..part.start + part.len];
                    match self.call(inputs, batch.output) {
                        // Its time: the failed batch's and the retries' so far.
                        Ok(Ok(output)) => self.deliver(
                            part,
                            0,
                            &output,
                            &row_starts(&output.rows),
                            started,
                            started.elapsed(),
                        ),
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
        self.fail_unanswered(parts);
    }

    /// Fails `parts` as unavailable, once the model is marked dead.
    fn fail_unanswered(&self, parts: &[Part]) {
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
        let result = result.map_err(|payload| Died(panic_message(&*payload)))?;
        self.measure(inputs, output, result, started)
    }

    /// A model call's metrics and checks, once its result is in (`started`:
    /// when it was called or submitted). Errors as for [`Self::call`].
    fn measure(
        &self,
        inputs: &[Encoded],
        output: Output,
        result: Result<BatchOutput, EmbedderError>,
        started: Instant,
    ) -> Result<Result<BatchOutput, EmbedderError>, Died> {
        let elapsed = started.elapsed();
        let recorder = &*self.shared.recorder;
        let gil_wait = result.as_ref().map(|o| o.gil_wait).unwrap_or_default();
        let longest = inputs.iter().map(Encoded::len).max().unwrap_or(0);
        let real: usize = inputs.iter().map(Encoded::len).sum();
        let tokens = [real, longest * inputs.len()];
        recorder.model_call(inputs.len(), tokens, elapsed, gil_wait);
        let kind = output;
        let output = match result {
            Ok(output) => output,
            Err(e) if e.kind == EmbedderErrorKind::ModelGone => return Err(Died(e.message)),
            Err(e) => return Ok(Err(e)),
        };
        if let Err(message) = self.check_shape(&output, inputs, kind) {
            return Ok(Err(EmbedderError::model_failure(message)));
        }
        recorder.tokens(real as u64, output.padded_tokens);
        Ok(Ok(output))
    }

    /// A model returning the wrong number of rows or floats is a model
    /// error, never a panic or a mis-sliced answer: pooled output is one
    /// `dim`-wide row per input; token output one row per token of each
    /// input, all of one width; sparse output at most one `[id, weight]` row
    /// per token of each input, ids whole, increasing and in the vocabulary.
    fn check_shape(
        &self,
        output: &BatchOutput,
        inputs: &[Encoded],
        kind: Output,
    ) -> Result<(), String> {
        let n = inputs.len();
        let rows_fit = |i: usize| {
            let got = output.rows[i] as usize;
            match kind {
                Output::Pooled => got == 1,
                Output::Tokens => got == inputs[i].len(),
                Output::Sparse | Output::MultiVector(_) => got <= inputs[i].len(),
            }
        };
        if output.rows.len() != n || !(0..n).all(rows_fit) {
            return Err(format!(
                "model returned {} row counts {:?} for {n} inputs wanting {} output",
                output.rows.len(),
                &output.rows[..output.rows.len().min(8)],
                kind.as_str()
            ));
        }
        let rows: usize = output.rows.iter().map(|&r| r as usize).sum();
        let floats = output.vectors.len();
        let dim = self.shape.dim;
        let ok = match kind {
            Output::Pooled if dim > 0 => floats == rows * dim,
            Output::Sparse => floats == rows * 2,
            Output::MultiVector(_) => floats == rows * dim,
            // Inputs of no tokens (a static model's blank text) have no rows:
            // a batch of only those has no floats either.
            Output::Tokens if rows == 0 => floats == 0,
            // A hidden width need not be the pooled `dim` (Dense heads).
            _ => floats > 0 && floats.checked_rem(rows) == Some(0),
        };
        if !ok {
            return Err(format!(
                "model returned {floats} floats for {rows} {} rows (dimension {dim})",
                kind.as_str(),
            ));
        }
        if kind == Output::Sparse {
            self.check_sparse_ids(output)?;
        }
        Ok(())
    }

    /// Each input's sparse rows name distinct vocabulary ids in increasing
    /// order, so [`crate::lexical_entries`] reads them as they are.
    fn check_sparse_ids(&self, output: &BatchOutput) -> Result<(), String> {
        let vocab = self.shape.vocab_size;
        let mut at = 0;
        for (i, &n) in output.rows.iter().enumerate() {
            let ids = output.vectors[at..at + 2 * n as usize].iter().step_by(2);
            at += 2 * n as usize;
            let mut last: Option<f32> = None;
            for &id in ids {
                let whole = id >= 0.0 && id.fract() == 0.0 && (vocab == 0 || (id as usize) < vocab);
                if !whole || last.is_some_and(|l| id <= l) {
                    return Err(format!(
                        "model returned sparse row id {id} for input {i}: ids are whole, \
                         increasing and below the vocabulary size {vocab}"
                    ));
                }
                last = Some(id);
            }
        }
        Ok(())
    }

    /// Hands `part` its rows of `output`, computed in `model_time` from
    /// `started`; the batch's input `first` is the part's first, and
    /// `starts` is each input's first row (plus the total).
    fn deliver(
        &self,
        part: &Part,
        first: usize,
        output: &BatchOutput,
        starts: &[usize],
        started: Instant,
        model_time: std::time::Duration,
    ) {
        let width = output.vectors.len() / starts[starts.len() - 1].max(1);
        let vectors = (first..first + part.len)
            .map(|i| output.vectors[starts[i] * width..starts[i + 1] * width].to_vec());
        part.req.deliver(part.offset, vectors, started, model_time);
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
        EmbedderErrorKind::CutTooShort => CoreError::CutTooShort(error.message),
        // A load's kinds, raised on a batch, are that batch's failure.
        EmbedderErrorKind::ModelFailure
        | EmbedderErrorKind::ModelGone
        | EmbedderErrorKind::EngineUnavailable
        | EmbedderErrorKind::InvalidModel
        | EmbedderErrorKind::InvalidOption => CoreError::Model(error.message),
    }
}
