//! An engine that cannot be imported fails `Batcher::start` as its own
//! kind, `EngineUnavailable`, apart from a bad model folder or option
//! (`InvalidModel`, `InvalidOption`: tests/real_model.rs) and from a package
//! only some models need (`InvalidModel`, naming it). Its own test binary:
//! it makes `mlx_lm`, then `mlx_embed`, unimportable in this process for good.

use mlx_embed_core::{Batcher, BatcherConfig, CoreError, EmbedderErrorKind};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};
use pyo3::prelude::*;

fn refusal() -> (EmbedderErrorKind, String) {
    refusal_of(PythonModelOptions::default())
}

fn refusal_of(options: PythonModelOptions) -> (EmbedderErrorKind, String) {
    match Batcher::start(BatcherConfig::default(), move || {
        PythonEmbedder::load_for_batcher(&options)
    }) {
        Err(CoreError::LoadFailed(err)) => (err.kind, err.message),
        other => panic!("expected LoadFailed, got {other:?}"),
    }
}

fn run(code: &std::ffi::CStr) {
    Python::attach(|py| py.run(code, None, None)).expect("the snippet runs");
}

#[test]
fn an_engine_that_cannot_be_imported_is_its_own_kind() {
    mlx_embed_python::interpreter::ensure_python().expect("python");
    // A package a decoder model needs (mlx_lm's layers), not the engine's:
    // the model cannot run here, the engine can, and says which package.
    run(c"import sys\nsys.modules['mlx_lm'] = None\n");
    let qwen3 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-qwen3"
    );
    let (kind, message) = refusal_of(PythonModelOptions {
        model: Some(qwen3.into()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert_eq!(
        message,
        format!(
            "MissingDependency: {qwen3} needs the Python package 'mlx_lm', which cannot be \
             imported here (pip install mlx-lm): No module named 'mlx_lm.models'; 'mlx_lm' is \
             not a package"
        )
    );
    // An encoder needs none: it loads.
    PythonEmbedder::load(&PythonModelOptions::default()).expect("the default model loads");
    // The package imports, the engine behind load() does not (as when
    // MLX's backend is missing: engine.py's ImportError).
    run(c"import sys\nsys.modules['mlx_embed.engine'] = None\n");
    let (kind, message) = refusal();
    assert_eq!(kind, EmbedderErrorKind::EngineUnavailable, "{message}");
    assert!(
        message == "ModuleNotFoundError: import of mlx_embed.engine halted; None in sys.modules",
        "{message}"
    );
    // The package itself cannot be imported.
    run(c"import sys
for name in [n for n in sys.modules if n == 'mlx_embed' or n.startswith('mlx_embed.')]:
    del sys.modules[name]
sys.modules['mlx_embed'] = None
");
    let (kind, message) = refusal();
    assert_eq!(kind, EmbedderErrorKind::EngineUnavailable, "{message}");
    assert!(
        message.starts_with("cannot import the Python package `mlx_embed`: "),
        "{message}"
    );
}
