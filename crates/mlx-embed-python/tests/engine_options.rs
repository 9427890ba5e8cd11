//! The engine settings a Rust program sets in `EngineOptions` reach
//! `mlx_embed.load()` and take effect: what each came to shows among the
//! model's details (what a server's /info shows), and the vectors are the
//! ones the other setting gives, to float rounding.

mod common;

use mlx_embed_core::{Embedder, EmbedderErrorKind};
use mlx_embed_python::{EngineOptions, PythonEmbedder, PythonModelOptions};
use pyo3::prelude::*;

const TEXTS: [&str; 4] = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Embeddings map text to vectors; similar meanings land close together, which a vector \
     database searches by.",
    "Paris is the capital of France.",
];

fn load(model: Option<String>, engine: EngineOptions) -> PythonEmbedder {
    PythonEmbedder::load(&PythonModelOptions {
        model,
        engine,
        ..Default::default()
    })
    .expect("model loads")
}

/// Each text's pooled vector.
fn vectors(model: &mut PythonEmbedder) -> Vec<Vec<f32>> {
    let inputs = common::encode(model, &TEXTS);
    let flat = common::embed(model, &inputs);
    let dim = flat.len() / TEXTS.len();
    flat.chunks_exact(dim).map(<[f32]>::to_vec).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// The two settings' vectors agree, text by text, to cosine >= 0.99999.
fn assert_same_vectors(a: &[Vec<f32>], b: &[Vec<f32>]) {
    assert_eq!(a.len(), TEXTS.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let c = cosine(x, y);
        assert!(c >= 0.99999, "text {i}: cosine {c}");
    }
}

fn detail(model: &PythonEmbedder, key: &str) -> Option<String> {
    model.info().details.get(key).cloned()
}

#[test]
fn fused_attention_is_set_and_embeds_as_matmul_attention() {
    // The fused kernel runs on the engine's exact path only (the CPU's
    // native one keeps its own attention), so both take that path.
    let exact = |fused| EngineOptions {
        fast_ops: Some("exact".into()),
        fused_attention: Some(fused),
        ..Default::default()
    };
    let mut fused = load(None, exact(true));
    let mut matmul = load(None, exact(false));
    assert_eq!(detail(&fused, "attention").as_deref(), Some("fused"));
    assert_eq!(detail(&matmul, "attention").as_deref(), Some("matmul"));
    assert_same_vectors(&vectors(&mut fused), &vectors(&mut matmul));
}

#[test]
fn shape_buckets_are_set_and_embed_as_exact_shapes() {
    let buckets = |on| EngineOptions {
        shape_buckets: Some(on),
        ..Default::default()
    };
    let mut bucketed = load(None, buckets(true));
    let mut exact = load(None, buckets(false));
    assert_eq!(detail(&bucketed, "shape_buckets").as_deref(), Some("true"));
    assert_eq!(detail(&exact, "shape_buckets").as_deref(), Some("false"));
    assert_same_vectors(&vectors(&mut bucketed), &vectors(&mut exact));
}

#[test]
fn joined_linears_join_a_decoders_projections_and_embed_as_separate_ones() {
    let folder = common::fixture("tiny-qwen3");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{folder}/config.json")).unwrap())
            .unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap();
    let joined_linears = |on| EngineOptions {
        joined_linears: Some(on),
        ..Default::default()
    };
    let mut joined = load(Some(folder.clone()), joined_linears(true));
    let mut separate = load(Some(folder), joined_linears(false));
    // q/k/v and gate/up: two groups a layer.
    assert_eq!(
        detail(&joined, "joined_linears"),
        Some((2 * layers).to_string())
    );
    assert_eq!(detail(&separate, "joined_linears"), None);
    assert_same_vectors(&vectors(&mut joined), &vectors(&mut separate));
}

#[test]
fn workers_past_the_engines_bound_are_an_invalid_option() {
    mlx_embed_python::interpreter::ensure_python().unwrap();
    let most: usize = Python::attach(|py| {
        py.import("mlx_embed.workers")
            .and_then(|m| m.getattr("most_workers"))
            .and_then(|f| f.call0())
            .and_then(|t| t.get_item(0))
            .and_then(|n| n.extract())
            .unwrap()
    });
    // The bridge asks the same owner a server's --workers is checked by.
    assert_eq!(
        mlx_embed_python::interpreter::workers_refusal("workers", most).unwrap(),
        None
    );
    let why = mlx_embed_python::interpreter::workers_refusal("workers", most + 1)
        .unwrap()
        .expect("one past the bound is refused");
    let err = match PythonEmbedder::load_for_batcher(&PythonModelOptions {
        engine: EngineOptions {
            workers: Some(most + 1),
            ..Default::default()
        },
        ..Default::default()
    }) {
        Err(err) => err,
        Ok(_) => panic!("{} workers loaded", most + 1),
    };
    assert_eq!(err.kind, EmbedderErrorKind::InvalidOption, "{err}");
    assert_eq!(err.message, format!("InvalidOption: {why}"));
    // The most itself loads, and says so (1 off the CPU).
    let model = load(
        None,
        EngineOptions {
            workers: Some(most),
            ..Default::default()
        },
    );
    let workers = detail(&model, "workers").unwrap();
    assert!(workers == most.to_string() || workers == "1", "{workers}");
}
