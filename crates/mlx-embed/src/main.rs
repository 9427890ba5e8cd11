//! `mlx-embed-server`: the HTTP server as a plain Rust program embedding Python.

fn main() {
    std::process::exit(_native::run(std::env::args().collect()));
}
