//! Live counters behind [`crate::MetricsSnapshot`]: atomics for counts, one
//! small mutex for the histograms (written by the model thread once per batch).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::metrics::{
    BATCH_REAL_TOKENS_BOUNDS, BATCH_SIZE_BOUNDS, BATCH_TOKENS_BOUNDS, INPUT_TOKENS_BOUNDS,
    SECONDS_BOUNDS,
};
use crate::{
    CacheMetrics, CoreError, Embeddings, Histogram, LaneMetrics, MetricsSnapshot, Priority,
};

/// Locks a mutex, ignoring poisoning: our critical sections never run user
/// code, so a poisoned lock still guards consistent data.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

struct Histograms {
    batch_size: Histogram,
    batch_tokens: Histogram,
    batch_real_tokens: Histogram,
    queue_wait: Histogram,
    /// Queue wait per lane, in `Priority::index` order.
    lane_queue_wait: [Histogram; 3],
    gil_wait: Histogram,
    model: Histogram,
    input_tokens: Histogram,
}

/// Counters shared by callers and the model thread.
pub(crate) struct Recorder {
    pub in_flight_inputs: AtomicU64,
    /// Inputs in the lanes, not yet in a batch, per lane.
    queued_inputs: [AtomicU64; 3],
    requests_ok: AtomicU64,
    /// Refused requests per lane.
    requests_overloaded: [AtomicU64; 3],
    requests_model_error: AtomicU64,
    requests_unavailable: AtomicU64,
    requests_cancelled: AtomicU64,
    inputs_cancelled: AtomicU64,
    batches: AtomicU64,
    /// Of them, those a query thread cut.
    query_thread_batches: AtomicU64,
    real_tokens: AtomicU64,
    padded_tokens: AtomicU64,
    /// Inputs the model computed and the time it took: the throughput behind `retry_after`.
    inputs_computed: AtomicU64,
    model_nanos: AtomicU64,
    /// Requests between the start of `embed` and their answer, for `drained()`.
    active_requests: AtomicUsize,
    idle: Notify,
    hist: Mutex<Histograms>,
}

impl Histograms {
    fn new() -> Self {
        Self {
            batch_size: Histogram::with_bounds(BATCH_SIZE_BOUNDS),
            batch_tokens: Histogram::with_bounds(BATCH_TOKENS_BOUNDS),
            batch_real_tokens: Histogram::with_bounds(BATCH_REAL_TOKENS_BOUNDS),
            queue_wait: Histogram::with_bounds(SECONDS_BOUNDS),
            lane_queue_wait: std::array::from_fn(|_| Histogram::with_bounds(SECONDS_BOUNDS)),
            gil_wait: Histogram::with_bounds(SECONDS_BOUNDS),
            model: Histogram::with_bounds(SECONDS_BOUNDS),
            input_tokens: Histogram::with_bounds(INPUT_TOKENS_BOUNDS),
        }
    }
}

impl Recorder {
    pub fn new() -> Self {
        Self {
            in_flight_inputs: AtomicU64::new(0),
            queued_inputs: Default::default(),
            requests_ok: AtomicU64::new(0),
            requests_overloaded: Default::default(),
            requests_model_error: AtomicU64::new(0),
            requests_unavailable: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            inputs_cancelled: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            query_thread_batches: AtomicU64::new(0),
            real_tokens: AtomicU64::new(0),
            padded_tokens: AtomicU64::new(0),
            inputs_computed: AtomicU64::new(0),
            model_nanos: AtomicU64::new(0),
            active_requests: AtomicUsize::new(0),
            idle: Notify::new(),
            hist: Mutex::new(Histograms::new()),
        }
    }

    /// Zeroes the counters and histograms; the gauges (inputs in flight or
    /// queued, requests under way) keep counting what is live.
    pub fn reset_counts(&self) {
        let counters = [
            &self.requests_ok,
            &self.requests_model_error,
            &self.requests_unavailable,
            &self.requests_cancelled,
            &self.inputs_cancelled,
            &self.batches,
            &self.query_thread_batches,
            &self.real_tokens,
            &self.padded_tokens,
            &self.inputs_computed,
            &self.model_nanos,
        ];
        for counter in counters.into_iter().chain(&self.requests_overloaded) {
            counter.store(0, Relaxed);
        }
        *lock(&self.hist) = Histograms::new();
    }

    /// Counts a finished `embed` call by its outcome. Refusals that are not
    /// about capacity or the model (shutdown, invalid input) are not counted.
    pub fn count_outcome(&self, priority: Priority, result: &Result<Embeddings, CoreError>) {
        let counter = match result {
            Ok(_) => &self.requests_ok,
            Err(CoreError::Overloaded { .. }) => &self.requests_overloaded[priority.index()],
            Err(CoreError::Model(_)) => &self.requests_model_error,
            Err(CoreError::ModelUnavailable(_) | CoreError::LoadFailed(_)) => {
                &self.requests_unavailable
            }
            Err(
                CoreError::ShuttingDown
                | CoreError::InvalidInput(_)
                | CoreError::CutTooShort(_)
                | CoreError::InputTooLong { .. }
                | CoreError::TooManyTokenRows { .. }
                | CoreError::NoRuntime,
            ) => return,
        };
        counter.fetch_add(1, Relaxed);
    }

    pub fn inputs_cancelled(&self, n: usize) {
        self.inputs_cancelled.fetch_add(n as u64, Relaxed);
    }

    pub fn request_cancelled(&self) {
        self.requests_cancelled.fetch_add(1, Relaxed);
    }

    pub fn queued(&self, lane: Priority, n: usize) {
        self.queued_inputs[lane.index()].fetch_add(n as u64, Relaxed);
    }

    pub fn dequeued(&self, lane: Priority, n: usize) {
        self.queued_inputs[lane.index()].fetch_sub(n as u64, Relaxed);
    }

    /// Inputs in all lanes.
    #[cfg(test)]
    pub fn queued_total(&self) -> u64 {
        self.queued_inputs.iter().map(|q| q.load(Relaxed)).sum()
    }

    pub fn queue_wait(&self, lane: Priority, wait: Duration) {
        let mut h = lock(&self.hist);
        h.queue_wait.observe(wait.as_secs_f64());
        h.lane_queue_wait[lane.index()].observe(wait.as_secs_f64());
    }

    /// A query thread cut a batch (its model call is counted as any other's).
    pub fn query_thread_batch(&self) {
        self.query_thread_batches.fetch_add(1, Relaxed);
    }

    /// One model call: its size, real and padded tokens (longest x count)
    /// and timings.
    pub fn model_call(
        &self,
        inputs: usize,
        [real, padded]: [usize; 2],
        model: Duration,
        gil_wait: Duration,
    ) {
        self.batches.fetch_add(1, Relaxed);
        self.inputs_computed.fetch_add(inputs as u64, Relaxed);
        self.model_nanos
            .fetch_add(model.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
        let mut h = lock(&self.hist);
        h.batch_size.observe(inputs as f64);
        h.batch_tokens.observe(padded as f64);
        h.batch_real_tokens.observe(real as f64);
        h.model.observe(model.as_secs_f64());
        h.gil_wait.observe(gil_wait.as_secs_f64());
    }

    /// A call's inputs are tokenized: each one's tokens.
    pub fn input_tokens(&self, counts: &[u32]) {
        let mut h = lock(&self.hist);
        for &n in counts {
            h.input_tokens.observe(f64::from(n));
        }
    }

    pub fn tokens(&self, real: u64, padded: u64) {
        self.real_tokens.fetch_add(real, Relaxed);
        self.padded_tokens.fetch_add(padded, Relaxed);
    }

    /// Inputs per second of model time, once the model has run at all.
    pub fn throughput(&self) -> Option<f64> {
        let nanos = self.model_nanos.load(Relaxed);
        let inputs = self.inputs_computed.load(Relaxed);
        (nanos > 0 && inputs > 0).then(|| inputs as f64 / (nanos as f64 * 1e-9))
    }

    pub fn request_started(&self) {
        self.active_requests.fetch_add(1, Relaxed);
    }

    pub fn request_finished(&self) {
        if self.active_requests.fetch_sub(1, Relaxed) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Resolves once no request is between `embed` and its answer.
    pub async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            let mut notified = std::pin::pin!(notified);
            // Registering before the check means a finish in between still wakes us.
            notified.as_mut().enable();
            if self.active_requests.load(Relaxed) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Every counter; `waiting_inputs` per lane comes from admission.
    pub fn snapshot(&self, waiting_inputs: [u64; 3], cache: CacheMetrics) -> MetricsSnapshot {
        let h = lock(&self.hist);
        let lanes = Priority::ALL
            .iter()
            .map(|&priority| {
                let i = priority.index();
                LaneMetrics {
                    priority,
                    waiting_inputs: waiting_inputs[i],
                    queued_inputs: self.queued_inputs[i].load(Relaxed),
                    requests_overloaded: self.requests_overloaded[i].load(Relaxed),
                    queue_wait_seconds: h.lane_queue_wait[i].clone(),
                }
            })
            .collect::<Vec<_>>();
        MetricsSnapshot {
            waiting_inputs: waiting_inputs.iter().sum(),
            in_flight_inputs: self.in_flight_inputs.load(Relaxed),
            queued_inputs: lanes.iter().map(|l| l.queued_inputs).sum(),
            requests_ok: self.requests_ok.load(Relaxed),
            requests_overloaded: lanes.iter().map(|l| l.requests_overloaded).sum(),
            requests_model_error: self.requests_model_error.load(Relaxed),
            requests_unavailable: self.requests_unavailable.load(Relaxed),
            requests_cancelled: self.requests_cancelled.load(Relaxed),
            inputs_cancelled_before_compute: self.inputs_cancelled.load(Relaxed),
            batches: self.batches.load(Relaxed),
            query_thread_batches: self.query_thread_batches.load(Relaxed),
            batch_size: h.batch_size.clone(),
            batch_tokens: h.batch_tokens.clone(),
            batch_real_tokens: h.batch_real_tokens.clone(),
            real_tokens: self.real_tokens.load(Relaxed),
            padded_tokens: self.padded_tokens.load(Relaxed),
            queue_wait_seconds: h.queue_wait.clone(),
            gil_wait_seconds: h.gil_wait.clone(),
            model_seconds: h.model.clone(),
            input_tokens: h.input_tokens.clone(),
            lanes,
            cache,
        }
    }
}
