//! The OS threads model threads run on, kept for the next batcher once a
//! batcher is done with them.
//!
//! MLX keeps a stream thread (and its buffers) for every OS thread that ever
//! evaluated on it, and never frees them: a program that started and dropped
//! a batcher fifty times (a vector database swapping its embedder) had fifty
//! stream threads and 1 GB more memory. Run on a thread that already knows
//! MLX, a new model adds nothing, so a finished model thread waits here for
//! the next model instead of exiting.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Sender};
use std::sync::Mutex;

/// Work for one model thread: a model's whole life on it.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// Idle threads, each waiting on its own channel for a job.
static IDLE: Mutex<Vec<Sender<Job>>> = Mutex::new(Vec::new());

/// Runs `job` on an idle model thread, or on a new one named `name`. A job
/// that panics ends its thread (its interpreter or device state may be
/// broken); one that returns leaves the thread idle for the next.
pub(crate) fn run(name: &str, job: Job) -> std::io::Result<()> {
    let mut job = job;
    loop {
        let idle = IDLE.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let Some(idle) = idle else { break };
        match idle.send(job) {
            Ok(()) => return Ok(()),
            // That thread has ended since it said it was idle: try another.
            Err(mpsc::SendError(back)) => job = back,
        }
    }
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let (tx, rx) = mpsc::channel::<Job>();
            let mut next = Some(job);
            while let Some(job) = next.take() {
                if catch_unwind(AssertUnwindSafe(job)).is_err() {
                    return;
                }
                IDLE.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(tx.clone());
                next = rx.recv().ok();
            }
        })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::ThreadId;
    use std::time::Duration;

    fn idle_threads() -> usize {
        IDLE.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Runs `job` on a model thread and returns that thread once it is idle
    /// again (the job answers before its thread goes back to the idle list:
    /// a next job sent at once could find the list empty and start another).
    fn on_model_thread(job: impl FnOnce() + Send + 'static) -> ThreadId {
        let (tx, rx) = mpsc::channel();
        let idle_before = idle_threads();
        run(
            "test-model",
            Box::new(move || {
                job();
                tx.send(std::thread::current().id()).unwrap();
            }),
        )
        .unwrap();
        let id = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        // An idle thread was taken, or a new one started: either way the list
        // is back to its size once this one is idle.
        while idle_threads() < idle_before.max(1) {
            assert!(
                std::time::Instant::now() < deadline,
                "the thread never went idle"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        id
    }

    #[test]
    fn a_finished_thread_takes_the_next_job_and_a_panicked_one_does_not() {
        // No other test of this binary runs model threads: one after another,
        // every job runs on the first one's thread.
        let first = on_model_thread(|| {});
        let mut seen = vec![first];
        for _ in 0..3 {
            seen.push(on_model_thread(|| {}));
        }
        assert!(
            seen.iter().all(|&t| t == first),
            "one after another, jobs reuse a thread: {seen:?}"
        );
        // A job that panics takes its thread with it.
        let (tx, rx) = mpsc::channel();
        run(
            "test-model",
            Box::new(move || {
                tx.send(std::thread::current().id()).unwrap();
                panic!("model died");
            }),
        )
        .unwrap();
        let dead = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        for _ in 0..4 {
            assert_ne!(on_model_thread(|| {}), dead);
        }
    }
}
