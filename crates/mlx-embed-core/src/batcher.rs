//! The public handle: tokenize, the cache, admission into a lane, hand-off
//! to the model thread, and the answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::admission::Refusal;
use crate::cache::{Cache, CacheKey, Lead, Lookup};
use crate::model_thread::{self, Handles};
use crate::queue::Pending;
use crate::recorder::Recorder;
use crate::request::{ActiveGuard, CallerGuard, Computed, Request, Ticket};
use crate::shared::Shared;
use crate::tokenize;
use crate::{
    BatcherConfig, CoreError, EmbedInput, EmbedOptions, Embedder, EmbedderError, Encoded,
    LiveStats, MetricsSnapshot, ModelInfo, Output, Priority, Side, Tokenize,
};

/// What one caller gets back: its own inputs' vectors, in its order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embeddings {
    /// Not normalized, one entry per input in input order: the pooled vector
    /// ([`Output::Pooled`]), the input's token rows, row-major
    /// ([`Output::Tokens`]; see [`Embeddings::rows`]), or its `[id, weight]`
    /// rows ([`Output::Sparse`]; see [`crate::lexical_entries`]).
    pub vectors: Vec<Vec<f32>>,
    /// Rows in each entry of `vectors`: 1 for pooled output, the input's
    /// token count for token output, its entries for sparse output.
    pub row_counts: Vec<u32>,
    /// Exact tokens the model ran per input (after truncation, special tokens included).
    pub token_counts: Vec<u32>,
    /// How many of the inputs were answered from the embedding cache.
    pub cache_hits: u32,
    /// Where the call's time went, phase by phase.
    pub timings: Timings,
    /// Where each input's time went, in input order, as TEI charges an
    /// input (its own batch's, not the call's): the call's tokenization
    /// (its inputs are tokenized together), its queue wait from ready to
    /// queue until its batch started, and its batch's model time (a batch
    /// retried after a failure: the failed one's and the retry's). Zero
    /// queue and inference for an input the cache answered.
    pub input_timings: Vec<Timings>,
}

/// Where one [`Batcher::embed`] call's time went (TEI's per-request phases).
/// The phases follow one another, so their sum is at most the call's time;
/// what is left is the cache, the hand-offs, and waiting on another call
/// that computes the same input (a cache follower's wait is in none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timings {
    /// Tokenizing the call's inputs (on tokio's blocking pool).
    pub tokenization: Duration,
    /// From the inputs' being ready to queue (admission included) until the
    /// first of them entered a batch; zero when the cache answered them all.
    pub queue: Duration,
    /// Model time of the batches that computed the call's inputs, from each
    /// one's start to its answer (at most the time from the first one's
    /// start to the call's answer: pipelined batches overlap); zero when the
    /// cache answered them all.
    pub inference: Duration,
}

impl Timings {
    fn add(&mut self, computed: &Computed) {
        self.queue += computed.queue;
        self.inference += computed.inference;
    }

    /// An input's phases: its batch's `(queue, inference)`.
    fn of_input(&(queue, inference): &(Duration, Duration)) -> Self {
        Self {
            queue,
            inference,
            ..Self::default()
        }
    }
}

impl Embeddings {
    /// The rows of input `i`: one pooled vector, or one per token.
    ///
    /// # Panics
    /// If `i` is not an input index.
    pub fn rows(&self, i: usize) -> std::slice::ChunksExact<'_, f32> {
        let v = &self.vectors[i];
        let width = v.len() / (self.row_counts[i].max(1) as usize);
        v.chunks_exact(width.max(1))
    }
}

/// Handle to a running batcher; cheap to clone, shareable across tasks.
///
/// Callers are admitted by a fair semaphore per priority lane, counted in
/// inputs; a free model thread cuts each batch from the lanes and computes it.
/// When the last clone is dropped each model thread finishes its batch and exits.
#[derive(Clone)]
pub struct Batcher {
    inner: Arc<Inner>,
}

/// Owned only by `Batcher` handles (the model threads hold `Shared`), so its
/// drop means "no handle left".
struct Inner {
    shared: Arc<Shared>,
    info: ModelInfo,
    tokenizer: Option<Arc<dyn Tokenize>>,
    live_stats: Option<Arc<dyn LiveStats>>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("model", &self.inner.info.name)
            .field("healthy", &self.is_healthy())
            .field("config", &self.inner.shared.config)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.stop();
    }
}

impl Batcher {
    /// Spawns the model thread, builds the model there with `load`, starts
    /// any further model threads (`config.model_threads`) on its replicas,
    /// and returns once all are ready, or with [`CoreError::LoadFailed`]
    /// (loading failed, or the model cannot serve from that many threads).
    /// Blocking: call it before or outside async code (or in `spawn_blocking`).
    ///
    /// `embed` uses tokio's timer for `max_queue_wait`: the runtime it is
    /// polled on needs the time driver (`enable_time`/`enable_all`, as
    /// `#[tokio::main]` and `#[tokio::test]` have). `max_concurrent_requests`
    /// of zero is taken as one, and `max_batch_size` of zero as one.
    pub fn start<E, F>(config: BatcherConfig, load: F) -> Result<Self, CoreError>
    where
        E: Embedder + 'static,
        F: FnOnce() -> Result<E, EmbedderError> + Send + 'static,
    {
        let shared = Arc::new(Shared::new(config));
        let loaded = model_thread::spawn(shared.clone(), load).map_err(|e| {
            CoreError::LoadFailed(EmbedderError::model_failure(format!(
                "cannot spawn the model thread: {e}"
            )))
        })?;
        let Handles {
            info,
            tokenizer,
            live_stats,
        } = match loaded.recv() {
            Ok(Ok(loaded)) => loaded,
            Ok(Err(err)) => return Err(CoreError::LoadFailed(err)),
            Err(_) => {
                return Err(CoreError::LoadFailed(EmbedderError::model_gone(
                    "model thread exited while loading",
                )))
            }
        };
        tracing::info!(model = %info.name, dim = info.dim, config = ?shared.config, "batcher started");
        // The model thread is detached: it exits on its own after `stop`, and
        // joining it mid-batch from a drop could block an async runtime.
        Ok(Self {
            inner: Arc::new(Inner {
                shared,
                info,
                tokenizer,
                live_stats,
            }),
        })
    }

    /// Embeds `inputs` (non-empty) and returns exactly their vectors, in order.
    ///
    /// The inputs are tokenized first (on tokio's blocking pool, with the
    /// model's [`Tokenize`]): an unknown prompt name or a bad token id is
    /// `InvalidInput`, and with `options.truncate == false` an input over the
    /// model's maximum (a multi-vector mode's length) is `InputTooLong`, before anything is queued. Inputs
    /// the embedding cache has are answered from it; the rest wait for
    /// admission in the lane of `options.priority` (`Overloaded` only past
    /// that lane's `max_waiting` or `max_queue_wait`), and high-priority
    /// inputs go into the next batch ahead of waiting normal and low ones.
    /// Dropping the future before its batch starts means its inputs are never
    /// computed.
    ///
    /// The future is `Send` and runs on any tokio runtime flavor; it needs
    /// the runtime's time driver (admission waits with tokio's timer) and
    /// its blocking pool. Both are checked when the call starts, whatever its
    /// inputs: polled outside a tokio runtime it returns
    /// [`CoreError::NoRuntime`]; on a runtime built without `enable_time` it
    /// panics with tokio's message (tokio has no way to ask).
    ///
    /// An empty string is an input like any other here (the model sees its
    /// special tokens alone); the server's routes refuse it as a client error.
    pub async fn embed(
        &self,
        inputs: Vec<EmbedInput>,
        options: EmbedOptions,
    ) -> Result<Embeddings, CoreError> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(CoreError::NoRuntime);
        }
        // A timer made and dropped: tokio panics here, on every call, where
        // the time driver is off, not only on the call that first has to
        // wait in line for admission.
        drop(tokio::time::sleep(std::time::Duration::ZERO));
        let shared = &*self.inner.shared;
        let priority = options.priority;
        let left = CallerLeft(&shared.recorder);
        let result = self.embed_inner(inputs, options).await;
        std::mem::forget(left);
        shared.recorder.count_outcome(priority, &result);
        result
    }

    async fn embed_inner(
        &self,
        inputs: Vec<EmbedInput>,
        options: EmbedOptions,
    ) -> Result<Embeddings, CoreError> {
        let shared = &*self.inner.shared;
        if inputs.is_empty() {
            return Err(CoreError::InvalidInput("no inputs to embed".into()));
        }
        if options.output == Output::Sparse && !self.inner.info.lexical_weights {
            return Err(CoreError::InvalidInput(format!(
                "{} has no lexical weights (sparse output is a BGE-M3 model's)",
                self.inner.info.name
            )));
        }
        match (options.output, self.inner.info.multi_vector.is_some()) {
            (Output::MultiVector(_), false) => {
                return Err(CoreError::InvalidInput(format!(
                    "{} is not a multi-vector (ColBERT) model",
                    self.inner.info.name
                )))
            }
            (Output::Pooled | Output::Sparse, true) => {
                return Err(CoreError::InvalidInput(format!(
                    "{} is a multi-vector (ColBERT) model: it gives one vector per token \
                     (Output::MultiVector), not a pooled vector",
                    self.inner.info.name
                )))
            }
            _ => {}
        }
        if let Some(pooling) = options.token_pooling {
            if options.output != Output::MultiVector(Side::Document) {
                return Err(CoreError::InvalidInput(
                    "token pooling is for a multi-vector model's documents only \
                     (PyLate pools no query)"
                        .into(),
                ));
            }
            if pooling.factor < 2 {
                return Err(CoreError::InvalidInput(format!(
                    "token pooling factor {}: it must be at least 2 (1 pools nothing: no token_pooling)",
                    pooling.factor
                )));
            }
        }
        shared.check_open()?;
        // Counts this call for `drained()` from here, tokenizing included.
        let _active = ActiveGuard::new(shared.recorder.clone());
        let inner = &*self.inner;
        // A caller that leaves while its texts are tokenized leaves them all
        // uncomputed (a refusal is not a cancellation: disarmed before `?`).
        let mut tokenizing = LeftUncounted::new(&shared.recorder, inputs.len());
        let tokenize_start = Instant::now();
        // Phase spans are debug level: no cost unless a subscriber wants
        // them (the launcher's OTLP export does). Held, never entered: no log
        // line of the request moves into them. Counts as i64: span exporters
        // (OTLP) have no unsigned integers, and send a u64 as text.
        let tokenize_span = tracing::debug_span!("tokenize", inputs = inputs.len() as i64);
        let encoded =
            tokenize::encode_all(inner.tokenizer.clone(), &inner.info, inputs, &options).await;
        drop(tokenize_span);
        let mut timings = Timings {
            tokenization: tokenize_start.elapsed(),
            ..Timings::default()
        };
        let mut input_timings = Vec::new();
        tokenizing.settle_all();
        let mut encoded = encoded?;
        // Each input carries its request's pooling to the engine: a batch
        // mixes requests, pooled or not.
        if options.token_pooling.is_some() {
            for e in &mut encoded {
                e.token_pooling = options.token_pooling;
            }
        }
        let token_counts: Vec<u32> = encoded.iter().map(|e| e.len() as u32).collect();
        shared.recorder.input_tokens(&token_counts);
        if let (true, Some(max)) = (options.output.per_token(), options.max_token_rows) {
            let rows = token_counts.iter().map(|&n| n as usize).sum();
            if rows > max {
                return Err(CoreError::TooManyTokenRows { rows, max });
            }
        }
        let (vectors, row_counts, cache_hits) = match (options.output, &shared.cache) {
            (Output::Pooled, Some(cache)) => {
                let (vectors, hits) = self
                    .compute_cached(
                        cache,
                        encoded,
                        options.priority,
                        &mut timings,
                        &mut input_timings,
                    )
                    .await?;
                (vectors, vec![1; token_counts.len()], hits)
            }
            (Output::Pooled, None) => (
                self.compute(
                    encoded,
                    options.priority,
                    Output::Pooled,
                    &mut timings,
                    &mut input_timings,
                )
                .await?,
                vec![1; token_counts.len()],
                0,
            ),
            // The cache holds pooled vectors only; token rows are computed
            // every time. The model thread has checked one row per token.
            (Output::Tokens, _) => (
                self.compute(
                    encoded,
                    options.priority,
                    Output::Tokens,
                    &mut timings,
                    &mut input_timings,
                )
                .await?,
                token_counts.clone(),
                0,
            ),
            // Checked by the model thread: at most one `dim`-wide row per
            // token, the ones the model keeps.
            (Output::MultiVector(side), _) => {
                let output = Output::MultiVector(side);
                let vectors = self
                    .compute(
                        encoded,
                        options.priority,
                        output,
                        &mut timings,
                        &mut input_timings,
                    )
                    .await?;
                let dim = inner.info.dim.max(1);
                let rows = vectors.iter().map(|v| (v.len() / dim) as u32).collect();
                (vectors, rows, 0)
            }
            // Checked by the model thread: `[id, weight]` rows.
            (Output::Sparse, _) => {
                let vectors = self
                    .compute(
                        encoded,
                        options.priority,
                        Output::Sparse,
                        &mut timings,
                        &mut input_timings,
                    )
                    .await?;
                let rows = vectors.iter().map(|v| (v.len() / 2) as u32).collect();
                (vectors, rows, 0)
            }
        };
        for t in &mut input_timings {
            t.tokenization = timings.tokenization;
        }
        Ok(Embeddings {
            vectors,
            row_counts,
            token_counts,
            cache_hits,
            timings,
            input_timings,
        })
    }

    /// The cache path: hits at once; misses this call leads are computed in
    /// one request; misses another call is computing are awaited. A leader
    /// that gives up (fails, or its caller left before its input ran) wakes
    /// its followers with nothing, and they look up again: one of them leads
    /// the next try.
    /// Leads are published before any follow is awaited, so two calls
    /// following each other's keys cannot wait on each other.
    async fn compute_cached(
        &self,
        cache: &Arc<Cache>,
        mut encoded: Vec<Encoded>,
        priority: Priority,
        timings: &mut Timings,
        input_timings: &mut Vec<Timings>,
    ) -> Result<(Vec<Vec<f32>>, u32), CoreError> {
        let mut out: Vec<Option<Vec<f32>>> = vec![None; encoded.len()];
        // A hit's or a follower's input stays at zero queue and inference.
        *input_timings = vec![Timings::default(); encoded.len()];
        let mut hits = 0u32;
        let mut todo: Vec<usize> = (0..encoded.len()).collect();
        // Inputs following another call's computation are neither computed
        // nor found by this call until their wait ends: a caller that leaves
        // meanwhile (or while its leads are computed) leaves them uncomputed.
        let mut following = LeftUncounted::new(&self.inner.shared.recorder, 0);
        while !todo.is_empty() {
            let mut leads = Vec::new();
            let mut follows = Vec::new();
            let n_looked_up = todo.len();
            for i in todo.drain(..) {
                let key = CacheKey {
                    ids: encoded[i].ids.clone(),
                    type_ids: encoded[i].type_ids.clone(),
                    pool_start: encoded[i].pool_start,
                    adapter: CacheKey::adapter_of(encoded[i].adapter),
                };
                match cache.lookup(key, priority) {
                    Lookup::Hit(vector) => {
                        out[i] = Some(vector.to_vec());
                        hits += 1;
                    }
                    Lookup::Lead(lead) => leads.push((i, lead)),
                    Lookup::Follow(follow) => follows.push((i, follow)),
                }
            }
            // The leads arrive in the queue; the rest came back all the same.
            let served = n_looked_up - leads.len();
            self.inner.shared.arrived_elsewhere(served);
            following.count = follows.len();
            if !leads.is_empty() {
                // A lead is answered below or the call fails: its input is not looked up again.
                let inputs = leads
                    .iter()
                    .map(|(i, _)| std::mem::take(&mut encoded[*i]))
                    .collect();
                let (slots, leads): (Vec<usize>, Vec<Lead>) = leads.into_iter().unzip();
                // The request publishes each lead as its vector is computed,
                // even if this caller has left by then; on error the leads
                // drop unpublished, which wakes their followers.
                let computed = self
                    .compute_publishing(inputs, priority, Output::Pooled, leads)
                    .await;
                if computed.is_err() {
                    following.settle_all();
                }
                let computed = computed?;
                timings.add(&computed);
                for ((i, vector), phases) in slots
                    .into_iter()
                    .zip(computed.vectors)
                    .zip(&computed.per_input)
                {
                    out[i] = Some(vector);
                    input_timings[i] = Timings::of_input(phases);
                }
            }
            for (i, follow) in follows {
                match follow.wait().await {
                    Some(vector) => {
                        out[i] = Some(vector.to_vec());
                        hits += 1;
                        following.count -= 1;
                    }
                    // Looked up again below, where it is counted afresh.
                    None => todo.push(i),
                }
            }
            following.settle_all();
        }
        let vectors = out
            .into_iter()
            .map(|v| v.expect("every input answered"))
            .collect();
        Ok((vectors, hits))
    }

    /// Admission into `priority`'s lane, then the model: the `output` of
    /// `encoded`, in order; its queue and model time added to `timings`,
    /// each input's to `input_timings`.
    async fn compute(
        &self,
        encoded: Vec<Encoded>,
        priority: Priority,
        output: Output,
        timings: &mut Timings,
        input_timings: &mut Vec<Timings>,
    ) -> Result<Vec<Vec<f32>>, CoreError> {
        let computed = self
            .compute_publishing(encoded, priority, output, Vec::new())
            .await?;
        timings.add(&computed);
        input_timings.extend(computed.per_input.iter().map(Timings::of_input));
        Ok(computed.vectors)
    }

    /// [`Batcher::compute`] for inputs that lead cache flights: `leads` (one
    /// per input, or none) travel with the request and are published as
    /// its vectors are delivered.
    async fn compute_publishing(
        &self,
        encoded: Vec<Encoded>,
        priority: Priority,
        output: Output,
        leads: Vec<Lead>,
    ) -> Result<Computed, CoreError> {
        let shared = &*self.inner.shared;
        let n = encoded.len();
        let size = shared
            .limits
            .size_of(n, encoded.iter().map(Encoded::len).sum());
        let active = ActiveGuard::new(shared.recorder.clone());
        // Queue wait (and its bound) starts once the request is ready to queue.
        let arrived = Instant::now();
        let queue_span = tracing::debug_span!("queue", inputs = n as i64);
        let admission = shared.admission(priority);
        // A caller that leaves while waiting for admission leaves its inputs
        // uncomputed too: counted with those skipped later, so what was sent
        // adds up to what was computed, found in the cache and cancelled.
        let mut waiting = LeftUncounted::new(&shared.recorder, n);
        let admitted = admission.admit(n, size, arrived).await;
        waiting.settle_all();
        let permit = match admitted {
            Ok(permit) => permit,
            Err(Refusal::Closed) => return Err(shared.refusal()),
            Err(Refusal::Overloaded(reason)) => {
                let retry_after = admission.retry_after(&shared.recorder);
                return Err(CoreError::Overloaded {
                    reason,
                    retry_after,
                });
            }
        };
        let ticket = Ticket::new(permit, n, shared.recorder.clone());
        let (reply, answer) = oneshot::channel();
        let request = Arc::new(
            Request::new(n, priority, output, arrived, reply, ticket, active)
                .with_leads(leads)
                .with_queue_span(queue_span),
        );
        let caller = CallerGuard::new(&request, shared);
        shared.submit(Pending::new(request, encoded))?;
        let result = answer.await;
        caller.disarm();
        // No answer means the request was dropped unanswered: the model is gone.
        result.unwrap_or_else(|_| Err(shared.unavailable()))
    }

    /// What the model reported about itself when it loaded.
    pub fn model_info(&self) -> &ModelInfo {
        &self.inner.info
    }

    /// The model's tokenizer (`None` for a model that takes token ids only):
    /// what `embed` runs, for callers that want the ids without embedding.
    pub fn tokenizer(&self) -> Option<&Arc<dyn Tokenize>> {
        self.inner.tokenizer.as_ref()
    }

    /// The model's live figures (device memory...), if it reports any. They
    /// are read without the model thread, so they answer while it is busy.
    pub fn live_stats(&self) -> Option<&Arc<dyn LiveStats>> {
        self.inner.live_stats.as_ref()
    }

    /// The configuration this batcher runs with.
    pub fn config(&self) -> &BatcherConfig {
        &self.inner.shared.config
    }

    /// Query threads running: [`BatcherConfig::query_threads`], or 0 for a
    /// model that serves from its model threads only
    /// ([`crate::Embedder::query_replica`] is `None`).
    pub fn query_threads(&self) -> usize {
        self.inner.shared.query_threads_running()
    }

    /// True while the model thread is alive and the batcher accepts work.
    pub fn is_healthy(&self) -> bool {
        self.inner.shared.is_healthy()
    }

    /// Why the model is unavailable, once it is (`None` while it is alive).
    pub fn model_failure(&self) -> Option<&str> {
        self.inner.shared.dead_reason()
    }

    /// A copy of every counter and histogram, taken without stopping anything.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.shared.metrics()
    }

    /// Zeroes the counters and histograms of [`Batcher::metrics`] (requests,
    /// batches, tokens, timings, cache hits and misses); the gauges keep
    /// counting live work. For a server's warm-up call, which is not a
    /// client's: its metrics then count clients' work alone.
    pub fn reset_metrics(&self) {
        self.inner.shared.reset_counts();
    }

    /// Empties the embedding cache (if it is on): later inputs are computed
    /// afresh. Computations in flight still answer their callers. For a
    /// server's warm-up call, whose vector no client asked for.
    pub fn clear_cache(&self) {
        if let Some(cache) = &self.inner.shared.cache {
            cache.clear();
        }
    }

    /// For a drain: from now on queued requests are finished whole, oldest
    /// first (query-sized ones still first), instead of taking turns, so
    /// that the most callers have their answers by a drain deadline. Taking
    /// turns, all progress together and most are unfinished when it passes.
    /// New work is still taken ([`Batcher::close`] stops that, and implies this).
    pub fn finish_requests_whole(&self) {
        self.inner.shared.finish_whole();
    }

    /// Stops accepting new work (`ShuttingDown`); admitted work still completes.
    /// Callers still waiting for admission are refused with `ShuttingDown`.
    pub fn close(&self) {
        self.inner.shared.close();
    }

    /// Waits until every admitted request has been answered.
    pub async fn drained(&self) {
        self.inner.shared.recorder.idle().await;
    }
}

/// Alive while `embed` runs: dropped with its future when the caller goes
/// away, it counts the request as cancelled, wherever it was (tokenizing,
/// waiting for admission or for the cache, queued, or being computed).
struct CallerLeft<'a>(&'a Recorder);

impl Drop for CallerLeft<'_> {
    fn drop(&mut self) {
        self.0.request_cancelled();
    }
}

/// Inputs no other count will take if the caller leaves now (while they are
/// tokenized, wait for admission, or wait on another call's computation):
/// dropped with the caller's future, it counts them as cancelled, so what was
/// sent adds up to what was computed, found in the cache and cancelled.
struct LeftUncounted<'a> {
    recorder: &'a Recorder,
    count: usize,
}

impl<'a> LeftUncounted<'a> {
    fn new(recorder: &'a Recorder, count: usize) -> Self {
        Self { recorder, count }
    }

    /// Another count has them now (or the call failed: not a cancellation).
    fn settle_all(&mut self) {
        self.count = 0;
    }
}

impl Drop for LeftUncounted<'_> {
    fn drop(&mut self) {
        if self.count > 0 {
            self.recorder.inputs_cancelled(self.count);
        }
    }
}
