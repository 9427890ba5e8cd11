//! The collector thread: sole owner of the queue. It moves admitted requests
//! from the inbox into its fair queue and keeps the model's next batch
//! prepared (and topped up) while the model runs the current one.

use std::sync::Arc;
use std::time::Instant;

use crate::queue::{Batch, FairQueue};
use crate::shared::Shared;

/// If the collector itself panics (a bug), nobody would ever batch again:
/// fail everything rather than let callers hang.
struct PanicGuard<'a>(&'a Shared);

impl Drop for PanicGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .kill("model thread died: batch collector panicked".into());
        }
    }
}

pub(crate) fn run(shared: Arc<Shared>) {
    let _guard = PanicGuard(&shared);
    let window = shared.config.batch_window;
    let mut queue = FairQueue::new(shared.limits);
    // While an idle model waits for company: when the wait ends.
    let mut window_ends: Option<Instant> = None;

    let mut st = shared.state();
    loop {
        if st.stop {
            break;
        }
        if !st.accepting {
            // The model died; `kill` already failed the inbox and the slot.
            let error = shared.unavailable();
            drop(st);
            for req in queue.take_all(&shared.recorder) {
                req.fail(error.clone());
            }
            tracing::debug!("batch collector exiting: model gone");
            return;
        }
        for pending in st.inbox.drain(..) {
            queue.push(pending);
        }

        let mut sleep_until = None;
        if !queue.is_empty() {
            let model_idle = st.next.is_none() && !st.model_busy;
            if model_idle && !window.is_zero() && queue.inputs() < shared.limits.max_batch_size {
                let ends = *window_ends.get_or_insert_with(|| Instant::now() + window);
                if Instant::now() < ends {
                    sleep_until = Some(ends);
                }
            }
            if sleep_until.is_none() {
                window_ends = None;
                let batch = st.next.get_or_insert_with(Batch::default);
                st.next_full = queue.fill(batch, &shared.recorder);
                if st.next.as_ref().is_some_and(Batch::is_empty) {
                    // Everything it could take had been cancelled.
                    st.next = None;
                    st.next_full = false;
                } else if st.model_waiting {
                    shared.model_cv.notify_one();
                }
            }
        }

        // After a fill, either the queue is empty or the slot is full; either
        // way only a new arrival, the model taking the slot, the end of the
        // batch window, stop or death changes anything.
        st.collector_queued = queue.inputs();
        let more_now = !st.inbox.is_empty()
            || (st.next.is_none() && !queue.is_empty() && sleep_until.is_none());
        if more_now {
            continue;
        }
        st.collector_waiting = true;
        st = match sleep_until {
            Some(until) => {
                let timeout = until.saturating_duration_since(Instant::now());
                shared
                    .collector_cv
                    .wait_timeout(st, timeout)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => shared
                .collector_cv
                .wait(st)
                .unwrap_or_else(|e| e.into_inner()),
        };
        st.collector_waiting = false;
    }
    drop(st);
    // Only requests whose callers are gone can be left here (every handle is
    // dropped, so no `embed` future is alive); dropping them is enough.
    queue.take_all(&shared.recorder);
    tracing::debug!("batch collector exiting");
}
