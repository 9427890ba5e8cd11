//! The OpenAPI document, generated from the handlers' types.

use std::sync::OnceLock;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, ResponseBuilder};
use utoipa::{Modify, OpenApi, PartialSchema, ToSchema};

use crate::errors::{
    Api, NativeErrorBody, OllamaErrorBody, OpenAiErrorBody, TeiErrorBody, WeaviateErrorBody,
};
use crate::middleware::needs_api_key;
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

/// The name of the security scheme `--api-key` is: HTTP bearer.
const BEARER: &str = "bearer";

/// The optional API key (`--api-key`): a bearer security scheme; the document
/// asks for it or nothing (`security: [{}, {"bearer": []}]`: a server runs
/// with a key or without), the probes for nothing (`security: []`); and every
/// other operation declares the 401 a missing or wrong key gets, in its
/// path's error shape (the shape the key check answers in: [`Api::for_path`]).
/// Every operation, probes too, declares the 403 a `Host` that
/// `--allowed-hosts` does not list gets, in the same shape.
///
/// Applied by [`document`] after the aliases, so each alias gets its own
/// path's shape.
struct AccessChecks;

impl Modify for AccessChecks {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .description(Some(
                "The server's `--api-key`, when it runs with one: every route but `/health`, \
                 `/ping` and `/.well-known/*` then needs `Authorization: Bearer <key>` and \
                 answers 401 without it. A server started without `--api-key` needs no key.",
            ))
            .build();
        doc.components
            .get_or_insert_with(Default::default)
            .add_security_scheme(BEARER, SecurityScheme::Http(scheme));
        doc.security = Some(vec![
            SecurityRequirement::default(),
            SecurityRequirement::new(BEARER, Vec::<String>::new()),
        ]);
        for (path, item) in doc.paths.paths.iter_mut() {
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.options,
                &mut item.head,
                &mut item.patch,
                &mut item.trace,
            ];
            for operation in operations.into_iter().flatten() {
                let shape = match Api::for_path(path) {
                    Api::Native => NativeErrorBody::name(),
                    Api::OpenAi => OpenAiErrorBody::name(),
                    Api::Tei => TeiErrorBody::name(),
                    Api::Ollama => OllamaErrorBody::name(),
                    Api::Weaviate => WeaviateErrorBody::name(),
                };
                // An error answer of this path's shape.
                let error_answer = |description: &str| {
                    ResponseBuilder::new().description(description).content(
                        "application/json",
                        ContentBuilder::new()
                            .schema(Some(Ref::from_schema_name(shape.clone())))
                            .build(),
                    )
                };
                let forbidden = error_answer(
                    "A `Host` the server does not answer to (only when it runs with \
                     `--allowed-hosts`)",
                );
                operation
                    .responses
                    .responses
                    .insert("403".to_owned(), forbidden.build().into());
                if !needs_api_key(path) {
                    operation.security = Some(Vec::new());
                    continue;
                }
                let unauthorized = error_answer(
                    "Missing or wrong API key (only when the server runs with `--api-key`)",
                )
                .header(
                    "WWW-Authenticate",
                    HeaderBuilder::new()
                        .schema(String::schema())
                        .description(Some("`Bearer`"))
                        .build(),
                )
                .build();
                operation
                    .responses
                    .responses
                    .insert("401".to_owned(), unauthorized.into());
            }
        }
    }
}

/// The document: every handler's path, then its aliases, then the access checks.
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
    AccessChecks.modify(&mut doc);
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

    use serde_json::{json, Value};

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

    /// Every operation of the document, as (path, method, operation).
    fn operations(doc: &Value) -> Vec<(&str, &str, &Value)> {
        let mut all = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                all.push((path.as_str(), method.as_str(), operation));
            }
        }
        all
    }

    /// The schema `v` names by `$ref`, else `v`.
    fn resolved<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
        match v["$ref"].as_str() {
            Some(r) => &doc["components"]["schemas"][r.rsplit('/').next().unwrap()],
            None => v,
        }
    }

    #[test]
    fn the_api_key_is_an_optional_bearer_token_the_probes_never_need() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["type"],
            "http"
        );
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        // A server runs with `--api-key` or without: the key, or nothing.
        assert_eq!(doc["security"], json!([{}, { "bearer": [] }]));
        let probes = [
            "/health",
            "/ping",
            "/.well-known/live",
            "/.well-known/ready",
        ];
        let mut guarded = 0;
        for (path, method, operation) in operations(&doc) {
            let unauthorized = &operation["responses"]["401"];
            if probes.contains(&path) {
                assert_eq!(operation["security"], json!([]), "{method} {path}");
                assert!(unauthorized.is_null(), "{method} {path}");
                continue;
            }
            guarded += 1;
            assert!(operation.get("security").is_none(), "{method} {path}");
            assert!(
                unauthorized["headers"]["WWW-Authenticate"].is_object(),
                "{method} {path}"
            );
            // In the shape the key check answers the path in (the HTTP
            // tests check each against a keyed server).
            let schema = unauthorized["content"]["application/json"]["schema"]["$ref"]
                .as_str()
                .unwrap();
            assert!(
                schema.starts_with("#/components/schemas/") && schema.ends_with("ErrorBody"),
                "{method} {path}: {schema}"
            );
        }
        assert!(guarded > 40, "{guarded}");
        // The routes that answered nothing but 200 before.
        for (path, shape) in [
            ("/", "TeiErrorBody"),
            ("/api/ps", "OllamaErrorBody"),
            ("/api/tags", "OllamaErrorBody"),
            ("/api/version", "OllamaErrorBody"),
            ("/meta", "WeaviateErrorBody"),
            ("/metrics", "NativeErrorBody"),
            ("/openapi.json", "NativeErrorBody"),
        ] {
            assert_eq!(
                doc["paths"][path]["get"]["responses"]["401"]["content"]["application/json"]
                    ["schema"]["$ref"],
                format!("#/components/schemas/{shape}"),
                "{path}"
            );
        }
    }

    #[test]
    fn the_document_says_what_the_routes_do() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let schemas = &doc["components"]["schemas"];
        // Ollama answers an over-long input with `truncate: false` 400, not 422.
        let truncate = schemas["OllamaEmbedRequest"]["properties"]["truncate"]["description"]
            .as_str()
            .unwrap();
        assert!(
            truncate.contains("400") && !truncate.contains("422"),
            "{truncate}"
        );
        // The header's lane loses to a body `priority` only where the body has one.
        for (path, method, operation) in operations(&doc) {
            let Some(header) = operation["parameters"]
                .as_array()
                .and_then(|ps| ps.iter().find(|p| p["name"] == "X-Priority"))
            else {
                continue;
            };
            let body = resolved(
                &doc,
                &operation["requestBody"]["content"]["application/json"]["schema"],
            );
            // A flattened body is the `allOf` of its parts.
            let parts: Vec<&Value> = match body["allOf"].as_array() {
                Some(parts) => parts.iter().map(|p| resolved(&doc, p)).collect(),
                None => vec![body],
            };
            let has_priority = parts
                .iter()
                .any(|p| p["properties"]["priority"].is_object());
            let says_body_wins = header["description"]
                .as_str()
                .unwrap()
                .contains("body `priority` wins");
            assert_eq!(says_body_wins, has_priority, "{method} {path}");
        }
        // An unknown model is a 404 where several are served.
        for path in ["/api/v1/embed", "/embed", "/"] {
            let errors = doc["paths"][path]["post"]["responses"]["4XX"]["description"]
                .as_str()
                .unwrap();
            assert!(errors.contains("404"), "{path}: {errors}");
        }
        // `POST /` answers JSON.
        assert_eq!(
            doc["paths"]["/"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
                ["$ref"],
            "#/components/schemas/InferenceAnswer"
        );
        assert_eq!(
            schemas["InferenceAnswer"]["anyOf"]
                .as_array()
                .unwrap()
                .len(),
            3
        );
        // vLLM's other names for the score lists validate: no name is required.
        let score = &schemas["ScoreBody"];
        assert!(score.get("required").is_none(), "{score}");
        assert!(score["properties"]["text_1"].is_object());
        let described = score["description"].as_str().unwrap();
        for name in ["queries", "documents", "items", "data_1", "data_2"] {
            assert!(described.contains(name), "{name}: {described}");
        }
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
