//! The `mlx-embed serve` launcher: parse flags, load the Python model on the
//! batcher's model thread, serve HTTP until a signal.
//!
//! The same code runs from the Rust binary `mlx-embed-server` (which starts
//! its own interpreter) and from Python as `mlx_embed._native.serve(argv)`,
//! the route `pip install .` gives the `mlx-embed serve` command.
//!
//! The extension also carries the engine's SIMD CPU kernels (`kernels`)
//! and the server's vector normalization for the library (`vectors`).

mod kernels;
mod launch;
mod otlp;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
mod vectors;

pub use launch::{exit_now, run, ServeCli};

use pyo3::prelude::*;

/// Tokenizing holds a few hundred bytes per token until a text is done, on
/// whichever blocking-pool thread runs it: glibc kept what each thread's
/// arena freed, and a flood of 60 KB and 2 MB texts of punctuation peaked
/// at 4.4 GB where the texts tokenized at once need about 1.5
/// (docs/benchmarks.md). The binaries and the extension own their
/// allocator; the library crates leave it to the program that links them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mlx_embed._native.serve(argv) -> exit code`. Detaches from the interpreter
/// for the server's whole life so the model thread can attach per batch.
#[pyfunction]
fn serve(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| run(argv))
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(serve, module)?)?;
    kernels::register(module)?;
    vectors::register(module)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
