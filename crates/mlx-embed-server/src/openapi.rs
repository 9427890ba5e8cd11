//! The OpenAPI document, generated from the handlers' types.

use std::sync::OnceLock;

use utoipa::OpenApi;

use crate::errors::{
    NativeErrorBody, OllamaErrorBody, OpenAiErrorBody, TeiErrorBody, WeaviateErrorBody,
};
use crate::routes::{
    cohere, native, ollama, openai, ops, platforms, pooling, predict, rerank, root, similarity,
    tei, tokens, vllm, weaviate,
};

#[derive(OpenApi)]
#[openapi(
    info(title = "mlx-embed", description = "Text embeddings and cross-encoders: native, OpenAI, TEI, Cohere/Jina, Voyage AI, Ollama, Weaviate, vLLM (score, pooling, classify), SageMaker and Vertex AI compatible APIs."),
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
        ollama::pull,
        ollama::running,
        ollama::version,
        cohere::embed_v1,
        cohere::embed_v2,
        rerank::tei_rerank,
        rerank::cohere_rerank_v1,
        rerank::cohere_rerank_v2,
        vllm::score_pairs,
        vllm::version,
        pooling::pooling,
        pooling::classify,
        platforms::invocations,
        platforms::vertex,
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
    // The error bodies, and the schemas the documentation-only unions of /rerank and /classify
    // name (schemas a route names by reference only are not collected).
    components(schemas(
        NativeErrorBody, OpenAiErrorBody, TeiErrorBody, OllamaErrorBody, WeaviateErrorBody,
        rerank::TeiRerankRequest, rerank::TeiRank, rerank::CohereRerankRequest,
        rerank::CohereRerankResponse, rerank::VoyageRerankRequest, rerank::VoyageRerankResponse,
        pooling::ClassifyResponse, pooling::InfinityClassifyResponse,
    )),
    tags(
        (name = "native", description = "The native API"),
        (name = "openai", description = "OpenAI compatible"),
        (name = "tei", description = "text-embeddings-inference compatible"),
        (name = "ollama", description = "Ollama compatible"),
        (name = "cohere", description = "Cohere embed and Cohere / Jina / Voyage AI rerank compatible"),
        (name = "vllm", description = "vLLM's score, pooling, classify and version APIs"),
        (name = "platforms", description = "AWS SageMaker (/invocations, /ping) and Google Vertex AI (/vertex), as TEI serves them"),
        (name = "weaviate", description = "Weaviate text2vec-transformers inference API compatible"),
        (name = "ops", description = "Health, metrics, info"),
    )
)]
pub struct ApiDoc;

/// Paths served by the handler of a documented one, as (alias, documented):
/// the OpenAI routes without their version prefix (as Infinity serves them),
/// vLLM's unversioned score, Weaviate's trailing slash, SageMaker's health
/// check. The document lists each as a copy of its original, so a client
/// generated from it knows them.
const ALIASES: [(&str, &str); 6] = [
    ("/embeddings", "/v1/embeddings"),
    ("/models", "/v1/models"),
    ("/models/{model}", "/v1/models/{model}"),
    ("/score", "/v1/score"),
    ("/vectors/", "/vectors"),
    ("/ping", "/health"),
];

/// The document: every handler's path, then its aliases.
fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    for (alias, original) in ALIASES {
        let mut item = doc.paths.paths[original].clone();
        // Operation ids are unique in a document.
        for operation in [&mut item.get, &mut item.post].into_iter().flatten() {
            if let Some(id) = &mut operation.operation_id {
                id.push_str("_alias");
            }
        }
        doc.paths.paths.insert(alias.to_owned(), item);
    }
    doc
}

/// The document as JSON, built once.
pub fn json() -> &'static str {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| document().to_json().expect("OpenAPI document serializes"))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    /// Every path the router serves, as the OpenAPI document spells it
    /// (axum's `{*model}` catch-all is a `{model}` parameter there).
    fn routed_paths() -> BTreeSet<String> {
        include_str!("routes/mod.rs")
            .split(".route(\"")
            .skip(1)
            .map(|rest| rest[..rest.find('"').unwrap()].replace("{*", "{"))
            .collect()
    }

    #[test]
    fn the_document_lists_exactly_the_routed_paths() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let documented: BTreeSet<String> =
            doc["paths"].as_object().unwrap().keys().cloned().collect();
        let routed = routed_paths();
        assert!(routed.len() > 30, "{routed:?}");
        assert_eq!(documented, routed);
    }

    /// Every `$ref` in `v`, recursively.
    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(map) => {
                if let Some(Value::String(r)) = map.get("$ref") {
                    out.push(r);
                }
                map.values().for_each(|v| refs(v, out));
            }
            Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn every_reference_names_a_schema_of_the_document() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let mut found = Vec::new();
        refs(&doc, &mut found);
        assert!(found.len() > 50, "{}", found.len());
        for r in found {
            let name = r.strip_prefix("#/components/schemas/").unwrap_or(r);
            assert!(
                doc["components"]["schemas"].get(name).is_some(),
                "{r} names no schema"
            );
        }
        // The platform routes' unions point at the routes' own schemas.
        let schemas = &doc["components"]["schemas"];
        assert_eq!(
            schemas["InvocationsBody"]["anyOf"]
                .as_array()
                .unwrap()
                .len(),
            5
        );
        assert_eq!(
            schemas["InvocationsAnswer"]["oneOf"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        assert_eq!(
            schemas["ClassifyAnswer"]["oneOf"].as_array().unwrap().len(),
            2
        );
        assert!(schemas["ClassifyRequest"]["properties"]["raw_scores"].is_object());
        // Voyage AI's fields and shapes.
        for field in [
            "input_type",
            "output_dimension",
            "truncation",
            "output_dtype",
        ] {
            assert!(
                schemas["OpenAiEmbeddingRequest"]["properties"][field].is_object(),
                "{field}"
            );
        }
        assert_eq!(
            schemas["EmbeddingValue"]["anyOf"].as_array().unwrap().len(),
            4
        );
        assert_eq!(
            schemas["V1RerankBody"]["anyOf"].as_array().unwrap().len(),
            2
        );
        assert_eq!(
            schemas["V1RerankAnswer"]["oneOf"].as_array().unwrap().len(),
            2
        );
        assert_eq!(
            schemas["RerankAnswer"]["oneOf"].as_array().unwrap().len(),
            3
        );
    }

    #[test]
    fn an_alias_is_its_originals_operation_under_its_own_id() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let paths = &doc["paths"];
        let original = &paths["/v1/embeddings"]["post"];
        let alias = &paths["/embeddings"]["post"];
        assert_eq!(alias["requestBody"], original["requestBody"]);
        assert_eq!(alias["responses"], original["responses"]);
        assert_eq!(alias["operationId"], "openai_embeddings_alias");
        let mut ids = BTreeSet::new();
        for item in paths.as_object().unwrap().values() {
            for operation in item.as_object().unwrap().values() {
                let id = operation["operationId"].as_str().unwrap();
                assert!(ids.insert(id.to_owned()), "operation id {id} twice");
            }
        }
    }
}
