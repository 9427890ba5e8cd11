//! State shared by callers, the collector thread and the model thread: the
//! inbox callers hand requests to, the prepared-batch slot, and the death flag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use crate::admission::Admission;
use crate::queue::{Batch, Limits, Pending};
use crate::recorder::{lock, Recorder};
use crate::request::Request;
use crate::{BatcherConfig, CoreError};

/// Everything behind the one state mutex. Critical sections are short and run
/// no user code.
#[derive(Default)]
pub(crate) struct State {
    /// Admitted requests the collector has not yet taken into its queue.
    pub inbox: Vec<Pending>,
    /// The batch prepared for the model's next call; the collector fills and
    /// tops it up, the model thread takes it when free.
    pub next: Option<Batch>,
    /// The prepared batch could not take the queue's next input: arrivals
    /// need not wake the collector until the model takes it.
    pub next_full: bool,
    pub model_busy: bool,
    pub model_waiting: bool,
    pub collector_waiting: bool,
    /// Inputs in the collector's own queue, published by the collector so a
    /// caller can tell the queue is empty (see [`Shared::submit`]).
    pub collector_queued: usize,
    /// False once the model is dead: nothing more enters the inbox.
    pub accepting: bool,
    /// Every `Batcher` handle is gone: threads finish up and exit.
    pub stop: bool,
}

pub(crate) struct Shared {
    pub config: BatcherConfig,
    pub limits: Limits,
    pub state: Mutex<State>,
    /// Wakes the collector: a new request, the slot was taken, stop or death.
    pub collector_cv: Condvar,
    /// Wakes the model thread: a batch is ready, or stop.
    pub model_cv: Condvar,
    pub admission: Admission,
    pub recorder: Arc<Recorder>,
    pub closed: AtomicBool,
    /// Why the model is gone, once it is.
    pub dead: OnceLock<String>,
}

impl Shared {
    pub fn new(config: BatcherConfig) -> Self {
        let limits = Limits {
            max_batch_size: config.max_batch_size.max(1),
            max_batch_tokens: config.max_batch_tokens,
            batching: config.enable_batching,
        };
        let admission = Admission::new(
            config.max_concurrent_requests,
            config.max_waiting,
            config.max_queue_wait,
        );
        Self {
            config,
            limits,
            state: Mutex::new(State {
                accepting: true,
                ..State::default()
            }),
            collector_cv: Condvar::new(),
            model_cv: Condvar::new(),
            admission,
            recorder: Arc::new(Recorder::new()),
            closed: AtomicBool::new(false),
            dead: OnceLock::new(),
        }
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub fn unavailable(&self) -> CoreError {
        match self.dead.get() {
            Some(reason) => CoreError::ModelUnavailable(reason.clone()),
            None => CoreError::ModelUnavailable("batcher stopped".into()),
        }
    }

    /// The error for a caller refused at the door or by a closed semaphore.
    pub fn refusal(&self) -> CoreError {
        if self.dead.get().is_some() {
            self.unavailable()
        } else {
            CoreError::ShuttingDown
        }
    }

    /// Hands an admitted request to the collector, or, when the model sits
    /// idle with nothing queued ahead, straight to the model: the collector
    /// would form exactly this batch anyway, and skipping its thread hop
    /// saves a wake-up on the lone-request path (FIFO still holds: nothing
    /// is queued anywhere).
    pub fn submit(&self, pending: Pending) -> Result<(), CoreError> {
        let n = pending.remaining();
        let mut st = self.state();
        if !st.accepting || st.stop {
            return Err(self.unavailable());
        }
        let model_idle = st.model_waiting && st.next.is_none();
        let nothing_ahead = st.inbox.is_empty() && st.collector_queued == 0;
        let pending = if model_idle && nothing_ahead && self.config.batch_window.is_zero() {
            match Batch::whole(pending, &self.limits) {
                Ok(batch) => {
                    st.next = Some(batch);
                    drop(st);
                    self.model_cv.notify_one();
                    return Ok(());
                }
                Err(pending) => pending,
            }
        } else {
            pending
        };
        self.recorder
            .queued_inputs
            .fetch_add(n as u64, Ordering::Relaxed);
        st.inbox.push(pending);
        // A full prepared batch cannot take this request anyway; the collector
        // sees it when the model frees the slot.
        let wake = st.collector_waiting && !st.next_full;
        drop(st);
        if wake {
            self.collector_cv.notify_one();
        }
        Ok(())
    }

    /// The model is gone: refuse everything from now on and fail everything
    /// not yet answered that is not already on its way to a caller.
    pub fn kill(&self, reason: String) {
        let _ = self.dead.set(reason);
        tracing::error!(reason = %self.dead.get().map_or("", |s| s.as_str()), "embedding model unavailable");
        self.admission.close();
        let (next, inbox) = {
            let mut st = self.state();
            st.accepting = false;
            (st.next.take(), std::mem::take(&mut st.inbox))
        };
        self.collector_cv.notify_all();
        self.model_cv.notify_all();
        let error = self.unavailable();
        let mut requests: Vec<Arc<Request>> = Vec::new();
        if let Some(batch) = next {
            requests.extend(batch.parts.into_iter().map(|p| p.req));
        }
        for pending in inbox {
            self.recorder.dequeued(pending.remaining());
            requests.push(pending.req);
        }
        for req in requests {
            req.fail(error.clone());
        }
    }

    /// Every handle is gone: let both threads finish and exit.
    pub fn stop(&self) {
        self.state().stop = true;
        self.collector_cv.notify_all();
        self.model_cv.notify_all();
    }
}
