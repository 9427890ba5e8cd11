//! Admission: fair (FIFO) semaphores counted in inputs, plus a bounded,
//! time-limited waiting line in front of them.
//!
//! A lane has three lines, each with the lane's whole room: one per
//! [`CallSize`] (query-sized requests, at most a query's batch of inputs and
//! one turn of tokens; requests that fit one batch; larger ones). In a single FIFO
//! line a big request waiting at its head gathered every permit given back
//! until it had its room, so a one-text call behind two bulk calls waited for
//! the first of them to finish (behind four, 7.6 s against 0.25 s behind one,
//! black-box probe on the CPU); and behind more calls of one batch than the
//! room holds it waited for room behind all of them (16 calls of 64 long
//! texts: 5.5 s, against 0.4 s for the running batch; behind 40 calls of 16
//! long texts, sorted by inputs alone into the query's line, for room and a
//! turn of each). Requests still take
//! turns in FIFO order with those of their own size; a smaller one never
//! waits behind larger ones for room, only for its turn in the lane's
//! round-robin.

use std::future::{poll_fn, Future};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::queue::CallSize;
use crate::recorder::Recorder;
use crate::OverloadReason;

/// Why admission did not hand out permits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    Overloaded(OverloadReason),
    /// The semaphore was closed (`close()` or the model died).
    Closed,
}

pub(crate) struct Admission {
    /// The permits of each line, by [`CallSize::index`].
    lines: [Arc<Semaphore>; 3],
    /// Permits in each line; a request never asks for more than this.
    bound: usize,
    max_waiting: usize,
    max_queue_wait: Duration,
    /// Inputs currently waiting for permits (not those that already hold them).
    waiting: AtomicUsize,
}

/// Takes a caller's inputs out of the waiting count however its wait ends,
/// including the caller dropping its `embed` future.
struct WaitingSlot<'a> {
    waiting: &'a AtomicUsize,
    n: usize,
}

impl Drop for WaitingSlot<'_> {
    fn drop(&mut self) {
        self.waiting.fetch_sub(self.n, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(max_concurrent: usize, max_waiting: usize, max_queue_wait: Duration) -> Self {
        // Zero permits would admit nobody, ever; one is the smallest working bound.
        // tokio caps a semaphore at usize::MAX >> 3 permits and an acquire at u32::MAX.
        let bound = max_concurrent.clamp(1, u32::MAX as usize);
        Self {
            lines: CallSize::ALL.map(|_| Arc::new(Semaphore::new(bound))),
            bound,
            max_waiting,
            max_queue_wait,
            waiting: AtomicUsize::new(0),
        }
    }

    pub fn waiting_inputs(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Wakes every waiter with `Closed` and refuses every later caller.
    pub fn close(&self) {
        for line in &self.lines {
            line.close();
        }
    }

    /// Waits in `size`'s line for `n` inputs' worth of permits (at most the
    /// whole bound, so a request larger than the bound can still run: let in
    /// with the whole bound, it gives it back in proportion as its inputs are
    /// answered).
    pub async fn admit(
        &self,
        n: usize,
        size: CallSize,
        arrived: Instant,
    ) -> Result<OwnedSemaphorePermit, Refusal> {
        let permits = n.min(self.bound) as u32;
        let line = &self.lines[size.index()];
        let mut acquire = pin!(line.clone().acquire_many_owned(permits));

        // The first poll either gets the permits at once or puts us in the
        // semaphore's FIFO line; only in the second case do the waiting bounds apply,
        // so nobody is refused while there is room.
        let first = poll_fn(|cx| Poll::Ready(acquire.as_mut().poll(cx))).await;
        if let Poll::Ready(permit) = first {
            return permit.map_err(|_| Refusal::Closed);
        }

        let _slot = self.enter_waiting_line(n)?;
        let permit = match arrived.checked_add(self.max_queue_wait) {
            Some(deadline) => match tokio::time::timeout_at(deadline.into(), acquire).await {
                Ok(permit) => permit,
                Err(_) => return Err(Refusal::Overloaded(OverloadReason::QueueTimeout)),
            },
            // A wait bound too large to represent means "no bound".
            None => acquire.await,
        };
        permit.map_err(|_| Refusal::Closed)
    }

    fn enter_waiting_line(&self, n: usize) -> Result<WaitingSlot<'_>, Refusal> {
        // A compare-exchange loop rather than add-then-undo, so a refused caller
        // never makes the line look longer than it is to a concurrent one.
        let mut current = self.waiting.load(Ordering::Acquire);
        loop {
            if current.saturating_add(n) > self.max_waiting {
                return Err(Refusal::Overloaded(OverloadReason::QueueFull));
            }
            match self.waiting.compare_exchange_weak(
                current,
                current + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Ok(WaitingSlot {
                        waiting: &self.waiting,
                        n,
                    })
                }
                Err(seen) => current = seen,
            }
        }
    }

    /// When to come back: the time the model needs for the work ahead at its
    /// recent throughput, in whole seconds (HTTP `Retry-After` granularity), 1 to 60 s.
    pub fn retry_after(&self, recorder: &Recorder) -> Duration {
        let Some(per_second) = recorder.throughput() else {
            return Duration::from_secs(1);
        };
        let ahead =
            self.waiting_inputs() as f64 + recorder.in_flight_inputs.load(Ordering::Relaxed) as f64;
        Duration::from_secs((ahead / per_second).ceil().clamp(1.0, 60.0) as u64)
    }
}
