//! A Rust program scores with a reranker or classifier without the HTTP
//! crate: a `Batcher` gives each pair's (or text's) logits, and the core's
//! activation, picked by the model's kind, turns them into the scores the
//! Python library's `score()` and `predict()` give, to the bit. Before, the
//! activation lived in mlx-embed-server only (axum, hyper, tonic...).

mod common;

use std::path::{Path, PathBuf};

use mlx_embed_core::{Batcher, BatcherConfig, EmbedInput, EmbedOptions, ModelKind};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

const QUERY: &str = "what is the capital of france";
const DOCUMENTS: [&str; 4] = [
    "Paris is the capital of France.",
    "Berlin is in Germany.",
    "bananas",
    "The capital of France has been Paris since the tenth century.",
];

fn start(folder: &Path) -> Batcher {
    let options = PythonModelOptions {
        model: Some(folder.display().to_string()),
        ..PythonModelOptions::default()
    };
    Batcher::start(BatcherConfig::default(), move || {
        PythonEmbedder::load_for_batcher(&options)
    })
    .expect("model loads")
}

/// Each input's scores: the batcher's logits through `ModelKind::activate`.
fn rust_scores(batcher: &Batcher, inputs: Vec<EmbedInput>) -> Vec<Vec<f32>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut out = runtime
        .block_on(batcher.embed(inputs, EmbedOptions::default()))
        .expect("scores");
    let kind = &batcher.model_info().kind;
    for row in &mut out.vectors {
        kind.activate(row);
    }
    out.vectors
}

/// `mlx_embed.load(folder).<call>` run in this process, as float32 rows.
fn python_scores(folder: &Path, call: &std::ffi::CStr) -> Vec<Vec<f32>> {
    Python::attach(|py| {
        let globals = PyDict::new(py);
        globals
            .set_item("folder", folder.display().to_string())
            .unwrap();
        globals.set_item("query", QUERY).unwrap();
        globals.set_item("documents", DOCUMENTS.to_vec()).unwrap();
        py.run(
            c"import mlx_embed, numpy\nmodel = mlx_embed.load(folder)",
            Some(&globals),
            None,
        )
        .unwrap();
        let scores = py.eval(call, Some(&globals), None).unwrap();
        scores
            .call_method1("astype", ("float32",))
            .unwrap()
            .call_method0("tolist")
            .unwrap()
            .extract()
            .unwrap()
    })
}

/// `folder`'s files, with config.json's `problem_type` set to
/// multi-label classification, in a fresh temp folder.
fn multi_label_copy(folder: &Path) -> PathBuf {
    let copy = std::env::temp_dir().join(format!("mlx-embed-multi-label-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(folder).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
    }
    let config = copy.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["problem_type"] = "multi_label_classification".into();
    std::fs::write(&config, json.to_string()).unwrap();
    copy
}

#[test]
fn reranker_and_classifier_scores_are_the_python_librarys_bits() {
    let pairs = || {
        DOCUMENTS
            .iter()
            .map(|d| EmbedInput::Pair {
                query: QUERY.into(),
                document: (*d).into(),
            })
            .collect::<Vec<_>>()
    };
    let texts = || {
        DOCUMENTS
            .iter()
            .map(|d| EmbedInput::Text((*d).into()))
            .collect::<Vec<_>>()
    };

    let reranker = PathBuf::from(common::fixture("tiny-bert-reranker"));
    let batcher = start(&reranker);
    assert!(matches!(
        batcher.model_info().kind,
        ModelKind::Reranker { .. }
    ));
    let rust = rust_scores(&batcher, pairs());
    let python = python_scores(&reranker, c"model.score([(query, d) for d in documents])");
    assert_eq!(rust.len(), DOCUMENTS.len());
    assert!(rust
        .iter()
        .all(|row| row.len() == 1 && row[0] > 0.0 && row[0] < 1.0));
    assert_eq!(rust, python, "a reranker's sigmoid");

    let classifier = PathBuf::from(common::fixture("tiny-bert-classifier"));
    let batcher = start(&classifier);
    let rust = rust_scores(&batcher, texts());
    let python = python_scores(&classifier, c"model.predict(documents)");
    for row in &rust {
        assert_eq!(row.len(), 3);
        let sum: f32 = row.iter().sum();
        assert!((sum - 1.0).abs() < 1e-6, "a softmax sums to 1: {row:?}");
    }
    assert_eq!(rust, python, "a classifier's softmax");

    let multi = multi_label_copy(&classifier);
    let batcher = start(&multi);
    assert!(batcher.model_info().kind.multi_label());
    let rust = rust_scores(&batcher, texts());
    let python = python_scores(&multi, c"model.predict(documents)");
    assert!(
        rust.iter()
            .any(|row| (row.iter().sum::<f32>() - 1.0).abs() > 1e-3),
        "independent sigmoids, not a softmax: {rust:?}"
    );
    assert_eq!(rust, python, "a multi-label classifier's sigmoids");
    drop(batcher);
    std::fs::remove_dir_all(&multi).unwrap();
}
