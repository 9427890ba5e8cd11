//! In-process semantic search, the vector-database use: no HTTP anywhere.
//!
//! `cargo run --release --example semantic_search` (with the project's .venv built by `make test`).

use mlx_embed_core::{l2_normalize, Batcher, BatcherConfig, EmbedInput, EmbedOptions};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};

const CORPUS: &[&str] = &[
    "Rust guarantees memory safety without a garbage collector.",
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "A vector database finds the nearest neighbours of an embedding.",
    "Tokio is an asynchronous runtime for the Rust programming language.",
    "The Pacific is the largest and deepest ocean on Earth.",
    "Sourdough bread rises thanks to wild yeast and lactic acid bacteria.",
    "Transformers use self-attention to relate every token to every other.",
];

const QUERIES: &[&str] = &[
    "How do plants make food?",
    "async programming in Rust",
    "Where is the Eiffel Tower?",
];

fn embed_all(
    batcher: &Batcher,
    runtime: &tokio::runtime::Runtime,
    texts: &[&str],
) -> Vec<Vec<f32>> {
    let inputs = texts
        .iter()
        .map(|t| EmbedInput::Text(t.to_string()))
        .collect();
    let mut vectors = runtime
        .block_on(batcher.embed(inputs, EmbedOptions::default()))
        .expect("embed")
        .vectors;
    vectors.iter_mut().for_each(|v| l2_normalize(v));
    vectors
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = PythonModelOptions::default();
    // Bigger model calls where MLX computes on a GPU, as the server makes them.
    let config = BatcherConfig::for_device(mlx_embed_python::interpreter::default_device()?);
    let batcher = Batcher::start(config, move || PythonEmbedder::load_for_batcher(&options))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!(
        "model {} ({} dims)",
        batcher.model_info().name,
        batcher.model_info().dim
    );

    let corpus = embed_all(&batcher, &runtime, CORPUS);
    for (query, q) in QUERIES.iter().zip(embed_all(&batcher, &runtime, QUERIES)) {
        // Unit vectors: the dot product is the cosine similarity.
        let mut scored: Vec<(f32, &str)> = corpus
            .iter()
            .zip(CORPUS)
            .map(|(d, text)| (d.iter().zip(&q).map(|(a, b)| a * b).sum(), *text))
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        println!("\n{query}");
        for (score, text) in scored.iter().take(3) {
            println!("  {score:.3}  {text}");
        }
    }
    Ok(())
}
