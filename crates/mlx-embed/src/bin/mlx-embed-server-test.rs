//! `mlx-embed-server-test`: the server with the test hooks of
//! [`_native::test_hooks`] (model faults and model-thread death on marked
//! inputs), for the end-to-end fault tests. Built only with the `test-hooks`
//! feature; never shipped.

fn main() {
    _native::exit_now(_native::test_hooks::run(std::env::args().collect()))
}
