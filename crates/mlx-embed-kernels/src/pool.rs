//! Long-lived helper threads for splitting one kernel call.
//!
//! A small pass calls [`crate::linear`] two dozen times, each worth ~100 µs
//! of work; spawning a scoped thread per call (~20 µs) ate a good part of
//! what the second core gained. The helpers here are started once and wait
//! on a condition variable between calls (after a short spin, since the next
//! call of a forward pass usually follows within microseconds).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper spins for the next job, and a caller for its last
/// pieces, before sleeping. The calls of one forward pass come tens of
/// microseconds apart, and a futex wake-up on this VM costs about as much as
/// a whole small kernel call: with the caller sleeping until the helper's
/// piece was done, 2 threads ran a 14-row [384 -> 1536] linear in 134 us
/// against 167 us on one (docs/benchmarks.md).
const SPIN: Duration = Duration::from_micros(200);

/// Spins until `ready()` or [`SPIN`] has passed (the caller re-checks under
/// its lock either way).
fn spin_until(ready: impl Fn() -> bool) {
    let start = Instant::now();
    while start.elapsed() < SPIN {
        for _ in 0..64 {
            if ready() {
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// One call's work: run piece `i` for every `i` in `1..pieces` (the caller
/// runs piece 0). The reference is only valid until the call returns, which
/// waits for every piece; it is stored with its lifetime erased.
type Piece = dyn Fn(usize) + Sync;

struct Job {
    work: *const Piece,
    pieces: usize,
    next: usize,
    unfinished: usize,
    panicked: bool,
}

// SAFETY: `work` points at a `Sync` closure that outlives the job (the
// submitting call waits until `unfinished` is 0 before returning).
unsafe impl Send for Job {}

struct Shared {
    job: Mutex<Option<Job>>,
    wake: Condvar,
    done: Condvar,
    /// Bumped per job, read without the lock by spinning helpers.
    generation: AtomicU64,
    /// The current job's pieces not yet finished, read without the lock by
    /// its spinning caller (the job's `unfinished` is the locked truth).
    outstanding: AtomicUsize,
}

struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
    /// One job at a time; a second caller meanwhile runs its pieces itself.
    submit: Mutex<()>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let helpers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .saturating_sub(1);
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            wake: Condvar::new(),
            done: Condvar::new(),
            generation: AtomicU64::new(0),
            outstanding: AtomicUsize::new(0),
        });
        for i in 0..helpers {
            let shared = Arc::clone(&shared);
            // Detached: the helpers block in `wait` between jobs and are
            // dropped with the process.
            let _ = std::thread::Builder::new()
                .name(format!("mlx-embed-kernel-{i}"))
                .spawn(move || helper(&shared));
        }
        Pool {
            shared,
            helpers,
            submit: Mutex::new(()),
        }
    })
}

/// Runs `work(i)` for `i` in `0..pieces`, piece 0 on the caller's thread and
/// the rest on the helper threads where they are free; returns when all are
/// done. `pieces` beyond the machine's threads run on whoever is free first.
pub(crate) fn run(pieces: usize, work: &(dyn Fn(usize) + Sync)) {
    if pieces <= 1 {
        if pieces == 1 {
            work(0);
        }
        return;
    }
    let pool = pool();
    let guard = match pool.submit.try_lock() {
        Ok(guard) if pool.helpers > 0 => guard,
        _ => {
            (0..pieces).for_each(work);
            return;
        }
    };
    let shared = &pool.shared;
    {
        // SAFETY (lifetime erasure): this function does not return before
        // `unfinished` reaches 0, i.e. before every helper is done with `work`.
        let work: *const Piece =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Piece>(work) };
        let mut slot = shared.job.lock().unwrap_or_else(|e| e.into_inner());
        shared.outstanding.store(pieces - 1, Ordering::Relaxed);
        *slot = Some(Job {
            work,
            pieces,
            next: 1,
            unfinished: pieces - 1,
            panicked: false,
        });
        shared.generation.fetch_add(1, Ordering::Release);
        shared.wake.notify_all();
    }
    // The caller's pieces may not unwind past this frame while helpers
    // still run `work`: caught here, re-raised once all pieces are done.
    let caught =
        |i: usize| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(i))).is_ok();
    let mut ok = caught(0);
    // Take back what no helper has started, then wait for the rest.
    let mut slot = shared.job.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let job = slot
            .as_mut()
            .expect("the job stays until its caller clears it");
        if job.next < job.pieces {
            let i = job.next;
            job.next += 1;
            drop(slot);
            ok &= caught(i);
            shared.outstanding.fetch_sub(1, Ordering::Release);
            slot = shared.job.lock().unwrap_or_else(|e| e.into_inner());
            slot.as_mut().expect("job present").unfinished -= 1;
            continue;
        }
        if job.unfinished == 0 {
            break;
        }
        // A helper is finishing its piece: spin for it before sleeping.
        drop(slot);
        spin_until(|| shared.outstanding.load(Ordering::Acquire) == 0);
        slot = shared.job.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().expect("job present").unfinished == 0 {
            break;
        }
        slot = shared.done.wait(slot).unwrap_or_else(|e| e.into_inner());
    }
    let job = slot.take().expect("job present");
    drop(slot);
    drop(guard);
    assert!(ok && !job.panicked, "a kernel piece panicked");
}

fn helper(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        // Spin first: the next kernel call of a forward pass usually comes
        // sooner than a futex wake-up would.
        spin_until(|| shared.generation.load(Ordering::Acquire) != seen);
        let mut slot = shared.job.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let gen = shared.generation.load(Ordering::Acquire);
            match slot.as_mut() {
                Some(job) if job.next < job.pieces => {
                    seen = gen;
                    let (i, work) = (job.next, job.work);
                    job.next += 1;
                    drop(slot);
                    // SAFETY: the job's caller waits for this piece before
                    // its closure goes out of scope.
                    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                        (*work)(i)
                    }))
                    .is_ok();
                    slot = shared.job.lock().unwrap_or_else(|e| e.into_inner());
                    let job = slot.as_mut().expect("the caller waits for this piece");
                    job.unfinished -= 1;
                    // After `unfinished`, so a caller that saw 0 finds it done.
                    shared.outstanding.fetch_sub(1, Ordering::Release);
                    job.panicked |= !ok;
                    if job.unfinished == 0 {
                        shared.done.notify_all();
                    }
                }
                _ if gen != seen => {
                    // A job came and was taken in full by others.
                    seen = gen;
                }
                _ => break,
            }
        }
        // Nothing to start: sleep until the next job.
        while shared.generation.load(Ordering::Acquire) == seen {
            slot = shared.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
        drop(slot);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_piece_runs_exactly_once() {
        for pieces in [0, 1, 2, 3, 17] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..pieces).map(|_| AtomicUsize::new(0)).collect();
                super::run(pieces, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "{pieces} pieces"
                );
            }
        }
    }

    #[test]
    fn concurrent_callers_each_get_their_own_pieces_done() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        super::run(3, &|i| {
                            sum.fetch_add(i + t, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 3 + 3 * t);
                    }
                });
            }
        });
    }
}
