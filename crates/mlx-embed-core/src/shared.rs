//! The batcher's lifecycle in one place: the state callers and the model
//! thread share, every transition, and every wake-up.
//!
//! Behind one mutex, next to the lanes: whether the batcher takes new work
//! (`Phase`), whether the model is dead, and how many model threads sleep.
//! Each model thread keeps its own [`Activity`].
//!
//! ```text
//! Phase (does the batcher take new work?)
//!   Open ──close()──> Closed ──last handle dropped──> Stopped
//!   Open ─────────────last handle dropped───────────> Stopped
//!
//! Activity (what one model thread is doing; there are `model_threads`,
//! and `query_threads` that take query-sized calls only: `Role`)
//!   Starting ──no work──> Waiting { window_ends } ──work due──> Busy
//!                                ^                               │
//!                                └────────────no work────────────┘
//! A model thread whose model panics marks the model dead (terminal).
//! ```
//!
//! (A model that fails to load never gets a batcher: `Batcher::start`
//! returns the error.)
//!
//! - `Open`: callers are admitted. `Closed`: new callers are refused with
//!   `ShuttingDown` (admission is closed, so waiting callers are refused
//!   too); admitted work still runs. `Stopped`: no handle is left, so no
//!   caller is either; the model threads exit after their current batch.
//! - `Busy`: the thread is cutting or running a batch; arrivals just queue.
//!   `Waiting`: it sleeps on the one condition variable until there is work;
//!   with a batch window, `window_ends` is when it stops waiting for company.
//!   A dead model: every queued request was failed and nothing enters again; why is
//!   in [`Shared::dead_reason`].
//!
//! Wake-ups: only model threads ever sleep, and only in
//! [`Shared::next_batch`]. They are woken when [`State::model_should_wake`]
//! says so after an arrival, and on `Stopped` or death. Every check and
//! every transition happens under the mutex, so no wake-up can be lost.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::admission::Admission;
use crate::cache::Cache;
use crate::queue::{Batch, Lanes, Limits, Pending};
use crate::recorder::{lock, Recorder};
use crate::request::Request;
use crate::{BatcherConfig, CoreError, MetricsSnapshot, Priority};

/// Whether the batcher takes new work (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Open,
    Closed,
    Stopped,
}

/// What one model thread is doing (see the module doc); each thread keeps its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activity {
    /// Loaded, before its first batch: as idle as a waiting thread.
    Starting,
    Busy,
    /// Asleep for work; `Some(t)`: work is queued and it waits for company until `t`.
    Waiting {
        window_ends: Option<Instant>,
    },
}

/// What a model thread takes from the lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Every batch the lanes cut ([`Lanes::cut`]).
    All,
    /// Query-sized calls only ([`Lanes::cut_queries`]), and only while
    /// every model thread is busy: a free one (idle, or waiting out a batch
    /// or regroup window for company) takes them itself, at full speed and
    /// in the company its windows were set for. Never waits for a window.
    Queries,
}

/// Everything behind the one state mutex. Critical sections are short and
/// run no user code.
pub(crate) struct State {
    pub phase: Phase,
    /// The model panicked or said it is gone (terminal).
    pub dead: bool,
    /// Model threads asleep with nothing queued.
    idle: usize,
    /// Query threads asleep with no query-sized call queued.
    query_idle: usize,
    /// Model threads asleep with work queued, waiting out a batch window.
    in_window: usize,
    /// Admitted requests not yet (fully) in a batch.
    pub lanes: Lanes,
    /// Inputs of the batches answered lately whose callers have not come
    /// back yet, as far as arrivals tell (see `BatcherConfig::regroup_window`).
    returning: usize,
    /// Until when a cut waits for them.
    returning_until: Option<Instant>,
}

impl State {
    /// The one wake-up rule for arrivals: wake the sleeping model threads
    /// when one of them has work to start now. While a thread waits out a
    /// batch window, only a full batch or a high-priority input ends the
    /// wait early.
    fn model_should_wake(&self, limits: &Limits) -> bool {
        if self.dead || self.lanes.is_empty() {
            return false;
        }
        self.idle > 0
            || (self.query_idle > 0 && self.lanes.has_queries())
            || (self.in_window > 0 && self.company_or_urgent(limits))
    }

    /// A full batch waits (by inputs or by tokens), or a high-priority
    /// input: no wait is worth more.
    fn company_or_urgent(&self, limits: &Limits) -> bool {
        self.lanes.inputs() >= limits.max_batch_size
            || self.lanes.tokens() >= limits.max_batch_tokens
            || self.lanes.has_waiting(Priority::High)
    }

    /// Until when a cut waits for the callers answered lately to come back;
    /// `None`: cut now. Only while the batcher takes new work: once it is
    /// closed, nobody can come back.
    fn regroup_until(&self, limits: &Limits, now: Instant) -> Option<Instant> {
        let until = self.returning_until?;
        (self.phase == Phase::Open
            && self.returning > 0
            && now < until
            && !self.company_or_urgent(limits))
        .then_some(until)
    }

    /// Counts `n` arriving inputs against those expected back; true when
    /// they were the last expected and a thread waits for them: it must be
    /// woken.
    fn arrive(&mut self, n: usize) -> bool {
        let was = self.returning;
        // Any arrival counts: callers cannot be told apart, and under open
        // traffic the arrivals end the wait as returns would.
        self.returning = was.saturating_sub(n);
        was > 0 && self.returning == 0 && self.in_window > 0
    }
}

pub(crate) struct Shared {
    pub config: BatcherConfig,
    pub limits: Limits,
    state: Mutex<State>,
    /// Wakes the model threads (the only threads that sleep on the state).
    model_cv: Condvar,
    /// Admission per lane, in `Priority::index` order.
    admission: [Admission; 3],
    pub recorder: Arc<Recorder>,
    /// `None` when `cache_bytes` is zero.
    pub cache: Option<Arc<Cache>>,
    /// Query threads started (`config.query_threads`, or none for a model
    /// without query replicas); set once they all are.
    query_threads_running: AtomicUsize,
    /// Why the model is dead; set once, just before the state turns dead,
    /// so `Batcher::model_failure` can lend it out without the lock.
    dead_reason: OnceLock<String>,
}

/// The longest batch or regroup window run ([`BatcherConfig::batch_window`]):
/// a year, as long as forever to any caller, and an `Instant` that far ahead
/// is one every platform's clock holds.
pub(crate) const LONGEST_WINDOW: std::time::Duration =
    std::time::Duration::from_secs(365 * 24 * 60 * 60);

impl Shared {
    pub fn new(mut config: BatcherConfig) -> Self {
        // Stored as run, so every reader sees the count of threads started.
        config.model_threads = config.model_threads.max(1);
        // A window whose end an `Instant` cannot hold (`Duration::MAX`, "wait
        // for company however long") panicked the model thread where that end
        // was computed, and every caller got `ModelUnavailable`.
        config.batch_window = config.batch_window.min(LONGEST_WINDOW);
        config.regroup_window = config.regroup_window.min(LONGEST_WINDOW);
        let max_batch_size = config.max_batch_size.max(1);
        let limits = Limits {
            max_batch_size,
            max_batch_tokens: config.max_batch_tokens,
            max_priority_batch_size: config.max_priority_batch_size.clamp(1, max_batch_size),
            aging_batches: config.aging_batches.max(1),
            batching: config.enable_batching,
        };
        let admission = Priority::ALL.map(|_| {
            Admission::new(
                config.max_concurrent_requests,
                config.max_waiting,
                config.max_queue_wait,
            )
        });
        Self {
            cache: Cache::new(config.cache_bytes),
            config,
            limits,
            state: Mutex::new(State {
                phase: Phase::Open,
                dead: false,
                idle: 0,
                query_idle: 0,
                in_window: 0,
                lanes: Lanes::new(limits),
                returning: 0,
                returning_until: None,
            }),
            model_cv: Condvar::new(),
            admission,
            recorder: Arc::new(Recorder::new()),
            query_threads_running: AtomicUsize::new(0),
            dead_reason: OnceLock::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub fn admission(&self, priority: Priority) -> &Admission {
        &self.admission[priority.index()]
    }

    /// Every counter, gauge and histogram, the cache's included.
    pub fn metrics(&self) -> MetricsSnapshot {
        let cache = self.cache.as_ref().map(|c| c.metrics()).unwrap_or_default();
        self.recorder.snapshot(self.waiting_inputs(), cache)
    }

    /// Zeroes every counter and histogram, the cache's hits and misses too.
    pub fn reset_counts(&self) {
        self.recorder.reset_counts();
        if let Some(cache) = &self.cache {
            cache.reset_counts();
        }
    }

    /// Inputs waiting for admission, per lane.
    pub fn waiting_inputs(&self) -> [u64; 3] {
        self.admission.each_ref().map(|a| a.waiting_inputs() as u64)
    }

    /// Query threads running (see `BatcherConfig::query_threads`).
    pub fn query_threads_running(&self) -> usize {
        self.query_threads_running.load(Relaxed)
    }

    pub fn set_query_threads_running(&self, n: usize) {
        self.query_threads_running.store(n, Relaxed);
    }

    /// Why the model is dead, once it is.
    pub fn dead_reason(&self) -> Option<&str> {
        self.dead_reason.get().map(String::as_str)
    }

    /// True while the batcher is `Open` and the model not dead.
    pub fn is_healthy(&self) -> bool {
        let st = self.state();
        st.phase == Phase::Open && !st.dead
    }

    /// `Ok` while a new caller may start; otherwise the error it gets.
    pub fn check_open(&self) -> Result<(), CoreError> {
        let st = self.state();
        match (st.phase, st.dead) {
            (_, true) => Err(self.unavailable()),
            (Phase::Open, false) => Ok(()),
            (Phase::Closed | Phase::Stopped, false) => Err(CoreError::ShuttingDown),
        }
    }

    pub fn unavailable(&self) -> CoreError {
        match self.dead_reason() {
            Some(reason) => CoreError::ModelUnavailable(reason.to_string()),
            None => CoreError::ModelUnavailable("batcher stopped".into()),
        }
    }

    /// The error for a caller whose admission was closed under it.
    pub fn refusal(&self) -> CoreError {
        if self.dead_reason().is_some() {
            self.unavailable()
        } else {
            CoreError::ShuttingDown
        }
    }

    /// Queues an admitted request in its lane. Admitted work is taken even
    /// when `Closed` (it was admitted before the door shut); only a dead or
    /// stopped model refuses it.
    pub fn submit(&self, pending: Pending) -> Result<(), CoreError> {
        let lane = pending.req.priority;
        let n = pending.remaining();
        let mut st = self.state();
        if st.dead || st.phase == Phase::Stopped {
            return Err(self.unavailable());
        }
        self.recorder.queued(lane, n);
        let regrouped = st.arrive(n);
        st.lanes.push(pending);
        let wake = st.model_should_wake(&self.limits) || regrouped;
        drop(st);
        if wake {
            // All of them: one woken in its batch window may not take the
            // work, and then an idle one must. Each re-checks under the lock.
            self.model_cv.notify_all();
        }
        Ok(())
    }

    /// `req`'s caller left: what of it is still queued leaves the lane now,
    /// so the queue gauges and the lane's memory hold live work only.
    pub fn withdraw(&self, req: &Arc<Request>) {
        self.state().lanes.withdraw(req, &self.recorder);
    }

    /// A model thread's only way to get work: blocks until a batch is due
    /// and returns it (`me` turns `Busy`), or `None` once `Stopped` or dead.
    ///
    /// A batch is due when work is queued, except that a thread coming out
    /// of `Waiting` with a non-zero batch window first waits up to the
    /// window for company (a full batch or a high-priority input ends it
    /// early). Work that queued while the thread was `Busy` has waited
    /// already: no window for it. A thread just `Starting` counts as idle.
    /// With a regroup window, a cut also waits for the callers of the
    /// batches answered lately (see [`Shared::answered`]), from any state.
    ///
    /// A query thread ([`Role::Queries`]) sleeps until a query-sized call is
    /// queued while every model thread is busy, and cuts it at once.
    pub fn next_batch(&self, me: &mut Activity, role: Role) -> Option<Batch> {
        let window = self.config.batch_window;
        let mut st = self.state();
        loop {
            if st.phase == Phase::Stopped || st.dead {
                return None;
            }
            if role == Role::Queries {
                // A free model thread takes the query itself (see `Role::Queries`):
                // its call has the engine's workers, a query thread's one kernel thread.
                if !st.lanes.has_queries() || st.idle > 0 || st.in_window > 0 {
                    *me = Activity::Waiting { window_ends: None };
                    st.query_idle += 1;
                    st = self.model_cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    st.query_idle -= 1;
                    continue;
                }
                *me = Activity::Busy;
                let batch = st.lanes.cut_queries(&self.recorder);
                if !batch.is_empty() {
                    return Some(batch);
                }
                continue;
            }
            if st.lanes.is_empty() {
                *me = Activity::Waiting { window_ends: None };
                st.idle += 1;
                st = self.model_cv.wait(st).unwrap_or_else(|e| e.into_inner());
                st.idle -= 1;
                continue;
            }
            let window_ends = match *me {
                _ if window.is_zero() => None,
                Activity::Waiting { window_ends } => {
                    Some(window_ends.unwrap_or_else(|| Instant::now() + window))
                }
                Activity::Starting => Some(Instant::now() + window),
                Activity::Busy => None,
            };
            let now = Instant::now();
            let window_wait =
                window_ends.filter(|&until| now < until && !st.company_or_urgent(&self.limits));
            let wait_until = match (window_wait, st.regroup_until(&self.limits, now)) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            match wait_until {
                Some(until) => {
                    *me = Activity::Waiting {
                        // The batch window's end carries over the wake-up (an
                        // ended one for a thread that had none: it came from
                        // `Busy`); the regroup's end is in the state.
                        window_ends: Some(window_ends.unwrap_or(now)),
                    };
                    let timeout = until.saturating_duration_since(now);
                    st.in_window += 1;
                    st = self
                        .model_cv
                        .wait_timeout(st, timeout)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                    st.in_window -= 1;
                }
                _ => {
                    *me = Activity::Busy;
                    let batch = st.lanes.cut(&self.recorder);
                    self.wake_query_threads(&st);
                    if !batch.is_empty() {
                        return Some(batch);
                    }
                    // Everything it met had been cancelled; the lanes are empty now.
                }
            }
        }
    }

    /// A model thread turned busy: the query threads, which left the
    /// queries to it while it was free, take what its cut left. Each
    /// re-checks under the lock.
    fn wake_query_threads(&self, st: &State) {
        if st.query_idle > 0 && st.lanes.has_queries() {
            self.model_cv.notify_all();
        }
    }

    /// The next batch if any input waits now, without waiting for one: the
    /// thread has a batch in flight, so it is busy and no window applies.
    /// `None` when the lanes are empty or the batcher is stopped or dead.
    ///
    /// Also `None` while callers answered lately may still come back (see
    /// `BatcherConfig::regroup_window`): the thread then collects what is
    /// running and waits for them in [`Shared::next_batch`].
    pub fn try_next_batch(&self, me: &mut Activity, role: Role) -> Option<Batch> {
        let mut st = self.state();
        let due = match role {
            Role::All => {
                !st.lanes.is_empty() && st.regroup_until(&self.limits, Instant::now()).is_none()
            }
            Role::Queries => st.lanes.has_queries(),
        };
        if st.phase == Phase::Stopped || st.dead || !due {
            return None;
        }
        *me = Activity::Busy;
        let batch = match role {
            Role::All => st.lanes.cut(&self.recorder),
            Role::Queries => st.lanes.cut_queries(&self.recorder),
        };
        self.wake_query_threads(&st);
        (!batch.is_empty()).then_some(batch)
    }

    /// `n` inputs of a caller were answered without the model (the
    /// embedding cache): they count as callers come back, like queued ones.
    pub fn arrived_elsewhere(&self, n: usize) {
        if self.config.regroup_window.is_zero() || n == 0 {
            return;
        }
        let wake = self.state().arrive(n);
        if wake {
            self.model_cv.notify_all();
        }
    }

    /// A batch was answered, completing requests of `inputs` inputs in all
    /// ([`crate::queue::Batch::completed_inputs`]): with a regroup window
    /// their callers may come back together, and the next cut waits for
    /// them (see `BatcherConfig::regroup_window`). Without batching no cut
    /// could take them together, so nothing waits.
    pub fn answered(&self, inputs: usize) {
        let window = self.config.regroup_window;
        if window.is_zero() || !self.limits.batching || inputs == 0 {
            return;
        }
        let now = Instant::now();
        let mut st = self.state();
        if st.returning_until.is_some_and(|until| now >= until) {
            // Whoever did not come back within the window is not coming.
            st.returning = 0;
        }
        // More than a full batch is never waited for: a full batch ends the wait.
        st.returning = (st.returning + inputs).min(self.limits.max_batch_size);
        st.returning_until = Some(now + window);
    }

    /// The lanes finish requests whole from now on ([`crate::queue::Lanes::finish_whole`]).
    pub fn finish_whole(&self) {
        self.state().lanes.finish_whole();
    }

    /// `Open` -> `Closed`: refuse new callers and those waiting for admission.
    /// What is queued is finished whole, oldest first.
    pub fn close(&self) {
        let mut st = self.state();
        st.lanes.finish_whole();
        if st.phase == Phase::Open {
            st.phase = Phase::Closed;
            tracing::info!("batcher closed to new work");
        }
        drop(st);
        self.admission.iter().for_each(Admission::close);
    }

    /// -> `Stopped`: every handle is gone (or the model threads failed to
    /// start); each model thread finishes its current batch and exits.
    pub fn stop(&self) {
        self.state().phase = Phase::Stopped;
        self.model_cv.notify_all();
    }

    /// -> dead: refuse everything from now on and fail every queued
    /// request. The caller fails the requests of the batch it was running;
    /// the other model threads answer theirs and exit.
    pub fn kill(&self, reason: String) {
        let _ = self.dead_reason.set(reason);
        tracing::error!(reason = ?self.dead_reason().unwrap_or(""), "embedding model unavailable");
        self.admission.iter().for_each(Admission::close);
        let queued: Vec<Arc<Request>> = {
            let mut st = self.state();
            st.dead = true;
            st.lanes.take_all(&self.recorder)
        };
        self.model_cv.notify_all();
        let error = self.unavailable();
        for req in queued {
            req.fail(error.clone());
        }
    }

    /// A model thread is exiting after `Stopped`: drops what is left
    /// (only requests whose callers are gone can be, as no handle is left).
    pub fn drain_after_stop(&self) {
        let left = self.state().lanes.take_all(&self.recorder);
        drop(left);
    }
}
