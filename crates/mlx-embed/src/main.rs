//! `mlx-embed-server`: the HTTP server as a plain Rust program embedding Python.

fn main() {
    _native::exit_now(_native::run(std::env::args().collect()))
}
