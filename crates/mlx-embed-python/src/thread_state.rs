//! A Rust thread's own Python thread state, kept from its first model call
//! to its end, so the engine lends it MLX streams and gets them back.
//!
//! MLX gives every OS thread that runs an op its own default stream, with a
//! scheduler thread and buffers it never frees. Python threads borrow
//! streams from the engine instead (`mlx_embed.device.claim_thread_streams`)
//! and give them back when their Python thread state is cleared at their
//! end. A Rust thread's `Python::attach` makes a thread state and deletes it
//! again on every call, so the engine could not keep a lease (nor the
//! thread's extra streams) from one call to the next, and left such threads
//! MLX's own streams: a load or a call on each of many short-lived threads
//! (a thread per load, rayon, tokio's blocking pool) held one more stream
//! thread and tens of MB for each. Here a Rust thread keeps one thread state
//! until it ends, when a thread-local destructor clears it on the thread
//! itself, with the GIL, as Python's own threads end.
//!
//! So such a thread takes the GIL as it ends: a caller that joins it while
//! attached (inside `Python::attach`) waits forever; join it detached.
//! Deferring this clear to the next call does not lift that: MLX 0.32's
//! per-thread compile cache also frees Python objects, under the GIL, in its
//! own thread-local destructor (seen in gdb on a hung join). Its
//! destructor is registered on its first model call, before MLX makes its
//! own thread-locals on it, so it runs after they are destroyed (glibc runs
//! `__cxa_thread_atexit_impl` destructors, Rust's and C++'s alike, last
//! registered first) and the lease goes back without `mx.clear_streams`,
//! which would reach MLX's destroyed thread-locals (`device.py`). A thread
//! that ran MLX before its first model call (in a `Python::attach` of its
//! own) has MLX's thread-locals outlive its lease.

use std::cell::OnceCell;
use std::ptr::NonNull;

use pyo3::ffi;
use pyo3::prelude::*;

thread_local! {
    /// Decided on the thread's first model call; `None` inside: a thread that
    /// keeps no state of ours.
    static KEPT: OnceCell<Option<KeptState>> = const { OnceCell::new() };
}

/// The thread state this thread keeps, released (not attached) between calls.
struct KeptState(NonNull<ffi::PyThreadState>);

/// Keeps a Python thread state on the calling thread from now to its end, if
/// it has none: call on a thread's way into a model call (a load, a batch),
/// after the interpreter is up and before attaching. A no-op after the
/// thread's first call, and on threads that have a thread state already
/// (Python's own, the thread that started the interpreter, one inside a
/// caller's own `Python::attach`) and on the process's main thread, whose
/// thread-local destructors run inside `exit()` while other threads may
/// hold the GIL (it keeps MLX's own streams, as Python's main thread does).
pub(crate) fn keep_thread_state() {
    // Only fails while the thread itself is ending: nothing to keep then.
    let _ = KEPT.try_with(|kept| {
        kept.get_or_init(KeptState::new);
    });
}

impl KeptState {
    fn new() -> Option<Self> {
        // SAFETY: these three only read the runtime's state; the last one
        // is this thread's entry in CPython's thread-state key.
        let free = unsafe {
            ffi::Py_IsInitialized() != 0
                && !finalizing()
                && ffi::PyGILState_GetThisThreadState().is_null()
        };
        if !free || is_main_thread() {
            return None;
        }
        // SAFETY: the interpreter runs and this thread has no thread state:
        // `PyGILState_Ensure` makes one (its count at 1) and takes the GIL.
        unsafe { ffi::PyGILState_Ensure() };
        // Attaching again only counts up on the thread state made above.
        let asked = Python::attach(|py| -> PyResult<()> {
            py.import("mlx_embed.device")?
                .getattr("keep_thread_streams")?
                .call0()?;
            Ok(())
        });
        if let Err(err) = asked {
            // The thread keeps its state anyway, and MLX's own streams.
            tracing::warn!(%err, "mlx_embed.device.keep_thread_streams failed");
        }
        // SAFETY: this thread holds the GIL with the thread state made above;
        // saving it releases the GIL and leaves the state to this thread.
        let state = unsafe { ffi::PyEval_SaveThread() };
        NonNull::new(state).map(KeptState)
    }
}

impl Drop for KeptState {
    /// At the thread's end: the state is cleared on this thread (the
    /// engine's lease goes back), unless the interpreter is gone or going,
    /// which then clears it, or leaves it, itself. (A thread that ends while
    /// the interpreter finalizes would hang on the GIL, or be ended inside
    /// this destructor: it must not reach for it. The check is not atomic
    /// with taking the GIL, so a thread ending just as finalizing starts can
    /// still be; only a Python process that hosts Rust threads finalizes,
    /// `mlx-embed serve`, whose model threads never end and whose blocking
    /// pool, which calls no model, ends before `serve` returns.)
    fn drop(&mut self) {
        // SAFETY: as in `KeptState::new`; then this thread's own state,
        // saved by it, is restored (its count still at 1) and released:
        // `PyGILState_Release` at a count of 0 clears and deletes it and
        // lets the GIL go.
        unsafe {
            if ffi::Py_IsInitialized() == 0 || finalizing() {
                return;
            }
            ffi::PyEval_RestoreThread(self.0.as_ptr());
            ffi::PyGILState_Release(ffi::PyGILState_STATE::PyGILState_UNLOCKED);
        }
    }
}

/// Whether the interpreter is finalizing (best effort: it may start just
/// after the answer, as with pyo3's own check).
unsafe fn finalizing() -> bool {
    #[cfg(Py_3_13)]
    {
        unsafe { ffi::Py_IsFinalizing() != 0 }
    }
    #[cfg(not(Py_3_13))]
    {
        extern "C" {
            fn _Py_IsFinalizing() -> std::ffi::c_int;
        }
        unsafe { _Py_IsFinalizing() != 0 }
    }
}

fn is_main_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain system calls.
        unsafe { libc::gettid() == libc::getpid() }
    }
    #[cfg(target_os = "macos")]
    {
        // SAFETY: a plain libc call.
        unsafe { libc::pthread_main_np() != 0 }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        std::thread::current().name() == Some("main")
    }
}
