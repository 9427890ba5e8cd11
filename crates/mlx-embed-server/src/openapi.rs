//! The OpenAPI document, generated from the handlers' types.

use std::sync::OnceLock;

use utoipa::OpenApi;

use crate::errors::{
    NativeErrorBody, OllamaErrorBody, OpenAiErrorBody, TeiErrorBody, WeaviateErrorBody,
};
use crate::routes::{
    cohere, native, ollama, openai, ops, predict, rerank, root, similarity, tei, tokens, vllm,
    weaviate,
};

#[derive(OpenApi)]
#[openapi(
    info(title = "mlx-embed", description = "Text embeddings and cross-encoders: native, OpenAI, TEI, Cohere/Jina, Ollama, Weaviate and vLLM-score compatible APIs."),
    paths(
        native::embed,
        openai::embeddings,
        openai::models,
        openai::model,
        tei::embed,
        tei::embed_all,
        tei::embed_sparse,
        ollama::embed,
        ollama::embeddings,
        ollama::tags,
        ollama::ps,
        ollama::show,
        ollama::version,
        cohere::embed_v1,
        cohere::embed_v2,
        rerank::tei_rerank,
        rerank::cohere_rerank_v1,
        rerank::cohere_rerank_v2,
        vllm::score_pairs,
        predict::predict,
        similarity::similarity,
        tokens::tokenize,
        tokens::decode,
        root::inference,
        weaviate::vectors,
        weaviate::meta,
        weaviate::live,
        weaviate::ready,
        ops::health,
        ops::metrics,
        ops::info,
        ops::openapi,
    ),
    components(schemas(NativeErrorBody, OpenAiErrorBody, TeiErrorBody, OllamaErrorBody, WeaviateErrorBody)),
    tags(
        (name = "native", description = "The native API"),
        (name = "openai", description = "OpenAI compatible"),
        (name = "tei", description = "text-embeddings-inference compatible"),
        (name = "ollama", description = "Ollama compatible"),
        (name = "cohere", description = "Cohere embed and Cohere / Jina rerank compatible"),
        (name = "vllm", description = "vLLM's score API"),
        (name = "weaviate", description = "Weaviate text2vec-transformers inference API compatible"),
        (name = "ops", description = "Health, metrics, info"),
    )
)]
pub struct ApiDoc;

/// The document as JSON, built once.
pub fn json() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        ApiDoc::openapi()
            .to_json()
            .expect("OpenAPI document serializes")
    })
}
