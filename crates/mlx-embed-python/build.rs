// Binaries, tests and examples that embed Python must find libpython at run
// time without LD_LIBRARY_PATH (pyenv and venv pythons live outside ld.so's paths).
fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
    // `Py_3_13` and the like: how to ask whether the interpreter finalizes.
    pyo3_build_config::use_pyo3_cfgs();
}
