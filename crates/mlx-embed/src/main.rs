//! `mlx-embed-server`: the HTTP server as a plain Rust program embedding Python.

use std::io::Write;

fn main() {
    let code = _native::run(std::env::args().collect());
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // Every accepted request has been answered by now. Skip C/C++ exit-time
    // destructors: MLX and OpenBLAS tear down global state there while the
    // detached model thread may still hold MLX objects, which aborted the
    // process (heap corruption) after heavy load.
    // SAFETY: _exit only ends the process; no Rust state is observed afterwards.
    unsafe { libc::_exit(code) }
}
