//! The batcher's lifecycle in one place: the state callers and the model
//! thread share, every transition, and every wake-up.
//!
//! Two small state machines live behind one mutex, next to the lanes:
//!
//! ```text
//! Phase (does the batcher take new work?)
//!   Open ──close()──> Closed ──last handle dropped──> Stopped
//!   Open ─────────────last handle dropped───────────> Stopped
//!
//! ModelState (what the model thread is doing)
//!   Loading ──loaded, no work──> Waiting { window_ends } ──work due──> Busy
//!                                       ^                               │
//!                                       └────────────no work────────────┘
//!   Busy ──model panicked──> Dead   (terminal)
//! ```
//!
//! (A model that fails to load never gets a batcher: `Batcher::start`
//! returns the error.)
//!
//! - `Open`: callers are admitted. `Closed`: new callers are refused with
//!   `ShuttingDown` (admission is closed, so waiting callers are refused
//!   too); admitted work still runs. `Stopped`: no handle is left, so no
//!   caller is either; the model thread exits after its current batch.
//! - `Busy`: the model thread is cutting or running a batch; arrivals just
//!   queue. `Waiting`: it sleeps on the one condition variable until there is
//!   work; with a batch window, `window_ends` is when it stops waiting for
//!   company. `Dead`: every queued request was failed and nothing enters
//!   again; why is in [`Shared::dead_reason`].
//!
//! Wake-ups: only the model thread ever sleeps, and only in
//! [`Shared::next_batch`]. It is woken when [`State::model_should_wake`]
//! says so after an arrival, and on `Stopped`. Every check and every
//! transition happens under the mutex, so no wake-up can be lost.

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

/// What the model thread is doing (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModelState {
    Loading,
    Busy,
    /// Asleep for work; `Some(t)`: work is queued and it waits for company until `t`.
    Waiting {
        window_ends: Option<Instant>,
    },
    Dead,
}

/// Everything behind the one state mutex. Critical sections are short and
/// run no user code.
pub(crate) struct State {
    pub phase: Phase,
    pub model: ModelState,
    /// Admitted requests not yet (fully) in a batch.
    pub lanes: Lanes,
}

impl State {
    /// The one wake-up rule for arrivals: wake a sleeping model thread when it
    /// has work to start now. While it waits out a batch window, only a full
    /// batch or a high-priority input ends the wait early.
    fn model_should_wake(&self, limits: &Limits) -> bool {
        match self.model {
            ModelState::Waiting { window_ends: None } => !self.lanes.is_empty(),
            ModelState::Waiting {
                window_ends: Some(_),
            } => {
                self.lanes.inputs() >= limits.max_batch_size
                    || self.lanes.has_waiting(Priority::High)
            }
            ModelState::Loading | ModelState::Busy | ModelState::Dead => false,
        }
    }
}

pub(crate) struct Shared {
    pub config: BatcherConfig,
    pub limits: Limits,
    state: Mutex<State>,
    /// Wakes the model thread (the only thread that sleeps on the state).
    model_cv: Condvar,
    /// Admission per lane, in `Priority::index` order.
    admission: [Admission; 3],
    pub recorder: Arc<Recorder>,
    /// `None` when `cache_bytes` is zero.
    pub cache: Option<Arc<Cache>>,
    /// Why the model is dead; set once, just before the state turns `Dead`,
    /// so `Batcher::model_failure` can lend it out without the lock.
    dead_reason: OnceLock<String>,
}

impl Shared {
    pub fn new(config: BatcherConfig) -> Self {
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
                model: ModelState::Loading,
                lanes: Lanes::new(limits),
            }),
            model_cv: Condvar::new(),
            admission,
            recorder: Arc::new(Recorder::new()),
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

    /// Inputs waiting for admission, per lane.
    pub fn waiting_inputs(&self) -> [u64; 3] {
        self.admission.each_ref().map(|a| a.waiting_inputs() as u64)
    }

    /// Why the model is dead, once it is.
    pub fn dead_reason(&self) -> Option<&str> {
        self.dead_reason.get().map(String::as_str)
    }

    /// True while the batcher is `Open` and the model not `Dead`.
    pub fn is_healthy(&self) -> bool {
        let st = self.state();
        st.phase == Phase::Open && st.model != ModelState::Dead
    }

    /// `Ok` while a new caller may start; otherwise the error it gets.
    pub fn check_open(&self) -> Result<(), CoreError> {
        let st = self.state();
        match (st.phase, st.model) {
            (_, ModelState::Dead) => Err(self.unavailable()),
            (Phase::Open, _) => Ok(()),
            (Phase::Closed | Phase::Stopped, _) => Err(CoreError::ShuttingDown),
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
        if st.model == ModelState::Dead || st.phase == Phase::Stopped {
            return Err(self.unavailable());
        }
        self.recorder.queued(lane, n);
        st.lanes.push(pending);
        let wake = st.model_should_wake(&self.limits);
        drop(st);
        if wake {
            self.model_cv.notify_one();
        }
        Ok(())
    }

    /// The model thread's only way to get work: blocks until a batch is
    /// due and returns it (`Busy`), or `None` once `Stopped` or `Dead`.
    ///
    /// A batch is due when work is queued, except that a model coming out of
    /// `Waiting` with a non-zero batch window first waits up to the window
    /// for company (a full batch or a high-priority input ends it early).
    /// Work that queued while the model was `Busy` has waited already: no
    /// window for it. A model just out of `Loading` counts as idle.
    pub fn next_batch(&self) -> Option<Batch> {
        let window = self.config.batch_window;
        let mut st = self.state();
        loop {
            if st.phase == Phase::Stopped || st.model == ModelState::Dead {
                return None;
            }
            if st.lanes.is_empty() {
                st.model = ModelState::Waiting { window_ends: None };
                st = self.model_cv.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            // A freshly loaded model is as idle as a waiting one.
            let window_ends = match st.model {
                _ if window.is_zero() => None,
                ModelState::Waiting { window_ends } => {
                    Some(window_ends.unwrap_or_else(|| Instant::now() + window))
                }
                ModelState::Loading => Some(Instant::now() + window),
                ModelState::Busy | ModelState::Dead => None,
            };
            let company_or_urgent = st.lanes.inputs() >= self.limits.max_batch_size
                || st.lanes.has_waiting(Priority::High);
            match window_ends {
                Some(until) if !company_or_urgent && Instant::now() < until => {
                    st.model = ModelState::Waiting {
                        window_ends: Some(until),
                    };
                    let timeout = until.saturating_duration_since(Instant::now());
                    st = self
                        .model_cv
                        .wait_timeout(st, timeout)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                _ => {
                    st.model = ModelState::Busy;
                    let batch = st.lanes.cut(&self.recorder);
                    if !batch.is_empty() {
                        return Some(batch);
                    }
                    // Everything it met had been cancelled; the lanes are empty now.
                }
            }
        }
    }

    /// `Open` -> `Closed`: refuse new callers and those waiting for admission.
    pub fn close(&self) {
        let mut st = self.state();
        if st.phase == Phase::Open {
            st.phase = Phase::Closed;
            tracing::info!("batcher closed to new work");
        }
        drop(st);
        self.admission.iter().for_each(Admission::close);
    }

    /// -> `Stopped`: every handle is gone; the model thread finishes its
    /// current batch and exits.
    pub fn stop(&self) {
        self.state().phase = Phase::Stopped;
        self.model_cv.notify_all();
    }

    /// -> `Dead`: refuse everything from now on and fail every queued
    /// request. The caller fails the requests of the batch it was running.
    pub fn kill(&self, reason: String) {
        let _ = self.dead_reason.set(reason);
        tracing::error!(reason = %self.dead_reason().unwrap_or(""), "embedding model unavailable");
        self.admission.iter().for_each(Admission::close);
        let queued: Vec<Arc<Request>> = {
            let mut st = self.state();
            st.model = ModelState::Dead;
            st.lanes.take_all(&self.recorder)
        };
        self.model_cv.notify_all();
        let error = self.unavailable();
        for req in queued {
            req.fail(error.clone());
        }
    }

    /// The model thread is exiting after `Stopped`: drops what is left
    /// (only requests whose callers are gone can be, as no handle is left).
    pub fn drain_after_stop(&self) {
        let left = self.state().lanes.take_all(&self.recorder);
        drop(left);
    }
}
