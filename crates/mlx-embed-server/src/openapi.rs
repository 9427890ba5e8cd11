//! The OpenAPI document, generated from the handlers' types.

use std::sync::OnceLock;

use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi, PartialSchema, ToSchema};

use crate::errors::{
    Api, NativeErrorBody, OllamaErrorBody, OpenAiErrorBody, TeiErrorBody, WeaviateErrorBody,
};
use crate::extract::PRIORITY_HEADER;
use crate::middleware::needs_api_key;
use crate::models::Task;
use crate::routes::{
    cohere, jina, native, ollama, openai, ops, platforms, pooling, predict, rerank, root,
    similarity, tei, tokens, vllm, weaviate,
};

#[derive(OpenApi)]
#[openapi(
    info(title = "mlx-embed", description = "Text embeddings and cross-encoders: native, OpenAI, TEI, Cohere/Jina, Voyage AI, NVIDIA NIM (rerank), Mixedbread, Ollama, Weaviate, vLLM (score, pooling, classify), SageMaker and Vertex AI compatible APIs. Not listed per operation: a path answers a method it does not serve with 405 and an unknown path is a 404, each in the error shape of the API the path belongs to; every GET route also answers HEAD (its headers, no body)."),
    paths(
        native::embed,
        openai::embeddings,
        openai::models,
        openai::model,
        tei::embed,
        tei::embed_all,
        tei::embed_sparse,
        jina::multi_vector,
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
        rerank::nim_ranking,
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
        pooling::ClassifyResponse, pooling::InfinityClassifyResponse, platforms::VertexInstance,
    )),
    tags(
        (name = "native", description = "The native API"),
        (name = "openai", description = "OpenAI compatible"),
        (name = "tei", description = "text-embeddings-inference compatible"),
        (name = "ollama", description = "Ollama compatible"),
        (name = "jina", description = "Jina AI's multi-vector (ColBERT) API"),
        (name = "cohere", description = "Cohere embed and Cohere / Jina / Voyage AI rerank compatible"),
        (name = "nim", description = "NVIDIA NIM's reranking API (/v1/ranking)"),
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

/// A route's 4XX description: its own refusals, then what its handler
/// does with a `model` no served model has ([`Task::unknown_name_rule`],
/// for the task the handler picks its model for), so every route states
/// the one rule [`crate::models::resolve`] applies.
pub(crate) fn refusals(list: &str, task: Task) -> String {
    format!("{list}. {}", task.unknown_name_rule())
}

/// [`refusals`] for a route whose body decides the task: each case
/// (`"A rerank instance"`) with the rule of its task.
pub(crate) fn refusals_by_case(list: &str, cases: &[(&str, Task)]) -> String {
    let rules: Vec<String> = cases
        .iter()
        .map(|(case, task)| format!("{case}: {}", task.unknown_name_rule()))
        .collect();
    format!("{list}. {}", rules.join(" "))
}

/// The request schemas with a `model` field, and the task each route
/// that takes the schema picks its model for (the `Task` its handler
/// passes to [`crate::state::AppState::model_for`]), with the route where
/// routes differ. Field descriptions are doc comments, which cannot hold
/// [`Task::unknown_name_rule`]: [`ModelRules`] adds it. A schema in several
/// unions (`/invocations`, `/vertex`) keeps its own routes' rule: those
/// routes state theirs in their 4XX answer.
const MODEL_FIELDS: [(&str, &[(&str, Task)]); 20] = [
    ("NativeEmbedRequest", &[("", Task::Embed)]),
    // `/v1/embeddings` and vLLM's `/pooling` (its `allOf`).
    ("OpenAiEmbeddingRequest", &[("", Task::Embed)]),
    ("TeiEmbedRequest", &[("", Task::Embed)]),
    (
        "TeiRawRequest",
        &[
            ("/embed_all", Task::Embed),
            ("/embed_sparse", Task::EmbedSparse),
        ],
    ),
    ("OllamaEmbedRequest", &[("", Task::Embed)]),
    ("OllamaEmbeddingsRequest", &[("", Task::Embed)]),
    ("OllamaShowRequest", &[("", Task::Describe)]),
    ("OllamaPullRequest", &[("", Task::Describe)]),
    ("CohereEmbedRequest", &[("", Task::Embed)]),
    ("MultiVectorRequest", &[("", Task::MultiVector)]),
    ("CohereRerankRequest", &[("", Task::Rerank)]),
    ("VoyageRerankRequest", &[("", Task::Rerank)]),
    ("NimRankingRequest", &[("", Task::Rerank)]),
    ("TeiRerankRequest", &[("", Task::Rerank)]),
    ("ScoreBody", &[("", Task::Score)]),
    ("ClassifyRequest", &[("", Task::Predict)]),
    ("PredictRequest", &[("", Task::Predict)]),
    ("SimilarityRequest", &[("", Task::Embed)]),
    ("TokenizeRequest", &[("", Task::Tokenize)]),
    ("DecodeRequest", &[("", Task::Tokenize)]),
];

/// Appends [`Task::unknown_name_rule`] to the `model` field of every
/// schema of [`MODEL_FIELDS`].
struct ModelRules;

impl Modify for ModelRules {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let Some(components) = doc.components.as_mut() else {
            return;
        };
        for (name, cases) in MODEL_FIELDS {
            let Some(RefOr::T(Schema::Object(object))) = components.schemas.get_mut(name) else {
                panic!("{name} is no object schema of the document");
            };
            let Some(RefOr::T(Schema::Object(model))) = object.properties.get_mut("model") else {
                panic!("{name} has no `model` field");
            };
            let rule = match cases {
                [("", task)] => task.unknown_name_rule(),
                _ => cases
                    .iter()
                    .map(|(route, task)| format!("On {route}: {}", task.unknown_name_rule()))
                    .collect::<Vec<_>>()
                    .join(" "),
            };
            let described = model.description.get_or_insert_with(String::new);
            if !described.contains(&rule) {
                described.push_str(if described.is_empty() { "" } else { " " });
                described.push_str(&rule);
            }
        }
    }
}

/// POST routes that never answer 429: they run no model, queue for
/// nothing and keep no room for their answer (`/tokenize` does keep room,
/// and can: `--max-unsent-answers-mb`).
const NEVER_OVERLOADED: [&str; 3] = ["/decode", "/api/show", "/api/pull"];

/// Every 429 carries `Retry-After` (whole seconds, at least 1:
/// [`crate::errors::retry_after_secs`]). Every POST route but
/// [`NEVER_OVERLOADED`] declares its 429 as a reference to one shared
/// answer per error shape (`components.responses.Overloaded<Shape>`): the
/// shape of the route's 4XX answer, with the header.
struct Overloaded;

impl Modify for Overloaded {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let mut shapes = std::collections::BTreeSet::new();
        for (path, item) in doc.paths.paths.iter_mut() {
            let Some(operation) = item.post.as_mut() else {
                continue;
            };
            if NEVER_OVERLOADED.contains(&path.as_str()) {
                continue;
            }
            let responses = &mut operation.responses.responses;
            let Some(RefOr::T(invalid)) = responses.get("4XX") else {
                panic!("POST {path} declares no 4XX answer");
            };
            let shape = invalid.content["application/json"]
                .schema
                .as_ref()
                .and_then(|schema| match schema {
                    RefOr::Ref(r) => r.ref_location.rsplit('/').next().map(str::to_owned),
                    RefOr::T(_) => None,
                })
                .unwrap_or_else(|| panic!("POST {path}: its 4XX answer names no error shape"));
            responses.insert(
                "429".to_owned(),
                RefOr::Ref(Ref::new(format!(
                    "#/components/responses/{}",
                    overloaded(&shape)
                ))),
            );
            shapes.insert(shape);
        }
        let components = doc.components.get_or_insert_with(Default::default);
        for shape in shapes {
            let retry_after = HeaderBuilder::new()
                .schema(
                    ObjectBuilder::new()
                        .schema_type(Type::Integer)
                        .minimum(Some(1)),
                )
                .description(Some("Seconds to wait before retrying (whole, at least 1)"))
                .build();
            let answer = ResponseBuilder::new()
                .description(
                    "Overloaded: the priority lane's queue is full or the request waited past \
                     `--max-queue-wait-ms` (for the model, or for room for its answer: \
                     `--max-unsent-answers-mb`); retry after `Retry-After` seconds",
                )
                .header("Retry-After", retry_after)
                .content(
                    "application/json",
                    ContentBuilder::new()
                        .schema(Some(Ref::from_schema_name(shape.clone())))
                        .build(),
                )
                .build();
            components
                .responses
                .insert(overloaded(&shape), RefOr::T(answer));
        }
    }
}

/// The shared 429 answer in the error shape `shape`.
fn overloaded(shape: &str) -> String {
    format!("Overloaded{}", shape.trim_end_matches("ErrorBody"))
}

/// The `X-Priority` header's values, any case ([`mlx_embed_core::Priority`]'s
/// `FromStr`; hyper trims the spaces around a header value), as every
/// operation that takes it declares them.
const PRIORITY_PATTERN: &str = "^([Hh][Ii][Gg][Hh]|[Nn][Oo][Rr][Mm][Aa][Ll]|[Ll][Oo][Ww])$";

/// Gives every `X-Priority` parameter its values ([`PRIORITY_PATTERN`]):
/// any other is a 400.
struct PriorityValues;

impl Modify for PriorityValues {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        for item in doc.paths.paths.values_mut() {
            let parameters = item
                .post
                .iter_mut()
                .chain(item.get.iter_mut())
                .flat_map(|operation| operation.parameters.iter_mut().flatten());
            for parameter in parameters {
                if parameter.name.eq_ignore_ascii_case(PRIORITY_HEADER) {
                    parameter.schema = Some(
                        ObjectBuilder::new()
                            .schema_type(Type::String)
                            .pattern(Some(PRIORITY_PATTERN))
                            .into(),
                    );
                }
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
    ModelRules.modify(&mut doc);
    PriorityValues.modify(&mut doc);
    Overloaded.modify(&mut doc);
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

    use crate::models::{Task, UNKNOWN_NAME};

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
            // A shared answer (the 429s), else a schema.
            let target = match r.strip_prefix("#/components/responses/") {
                Some(name) => doc["components"]["responses"].get(name),
                None => {
                    let name = r.strip_prefix("#/components/schemas/").unwrap_or(r);
                    doc["components"]["schemas"].get(name)
                }
            };
            assert!(target.is_some(), "{r} names nothing of the document");
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
        // `/vertex` refuses `/rerank`'s `documents` form: its instances are
        // the other four.
        let vertex: Vec<&Value> = schemas["VertexInstance"]["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .collect();
        assert_eq!(vertex.len(), 4);
        assert!(!vertex.contains(&&json!({ "$ref": "#/components/schemas/CohereRerankRequest" })));
        assert_eq!(
            schemas["VertexRequest"]["properties"]["instances"]["items"]["$ref"],
            "#/components/schemas/VertexInstance"
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
            5
        );
        // Mixedbread's keyed answer: arrays, and base64's string.
        let keyed = &schemas["EmbeddingValue"]["anyOf"][4]["additionalProperties"]["anyOf"];
        assert_eq!(keyed[1]["type"], "string", "{keyed}");
        // Mixedbread's: one format or a list of them.
        let formats = &schemas["OpenAiEmbeddingRequest"]["properties"]["encoding_format"];
        assert_eq!(formats["oneOf"].as_array().unwrap().len(), 2, "{formats}");
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
            6
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

    /// The schemas a request body of `v` may be, by name: through `$ref`,
    /// unions, `allOf`, and `/vertex`'s instances.
    fn request_schemas<'a>(doc: &'a Value, v: &'a Value, out: &mut BTreeSet<&'a str>) {
        if let Some(r) = v["$ref"].as_str() {
            let name = r.rsplit('/').next().unwrap();
            if out.insert(name) {
                request_schemas(doc, &doc["components"]["schemas"][name], out);
            }
        }
        for union in ["allOf", "anyOf", "oneOf"] {
            for part in v[union].as_array().into_iter().flatten() {
                request_schemas(doc, part, out);
            }
        }
        let instances = &v["properties"]["instances"]["items"];
        if !instances.is_null() {
            request_schemas(doc, instances, out);
        }
    }

    #[test]
    fn every_model_field_and_route_states_the_one_unknown_name_rule() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let schemas = &doc["components"]["schemas"];
        let mut with_model = 0;
        for (path, method, operation) in operations(&doc) {
            let Some(body) = operation["requestBody"]["content"]["application/json"].get("schema")
            else {
                continue;
            };
            let mut names = BTreeSet::new();
            request_schemas(&doc, body, &mut names);
            let takes_model = names
                .iter()
                .any(|name| schemas[*name]["properties"]["model"].is_object());
            for name in &names {
                if let Some(model) = schemas[*name]["properties"].get("model") {
                    let described = model["description"].as_str().unwrap();
                    assert!(described.contains(UNKNOWN_NAME), "{name}: {described}");
                    // No other wording of it left in a doc comment.
                    assert_eq!(
                        described.matches("404").count(),
                        described.matches(UNKNOWN_NAME).count(),
                        "{name}: {described}"
                    );
                }
            }
            let errors = operation["responses"]["4XX"]["description"]
                .as_str()
                .unwrap_or_default();
            // Weaviate's `/vectors` names no model; `POST /` reads the
            // body's `model` without a schema.
            if takes_model || path == "/" {
                with_model += 1;
                assert!(errors.contains(UNKNOWN_NAME), "{method} {path}: {errors}");
            } else {
                assert!(!errors.contains("404"), "{method} {path}: {errors}");
            }
        }
        assert!(with_model > 25, "{with_model}");
        // Each route's rule is its handler's task's.
        let errors = |path: &str| {
            doc["paths"][path]["post"]["responses"]["4XX"]["description"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        for (path, tasks) in [
            ("/v1/embeddings", &[Task::Embed][..]),
            ("/api/embed", &[Task::Embed]),
            ("/embed_sparse", &[Task::EmbedSparse]),
            ("/v1/rerank", &[Task::Rerank]),
            ("/v1/ranking", &[Task::Rerank]),
            ("/rerank", &[Task::Rerank]),
            ("/v1/score", &[Task::Score]),
            ("/classify", &[Task::Predict]),
            ("/predict", &[Task::Predict]),
            ("/tokenize", &[Task::Tokenize]),
            ("/decode", &[Task::Tokenize]),
            ("/api/show", &[Task::Describe]),
            ("/invocations", &[Task::Describe]),
            ("/vertex", &[Task::Rerank, Task::Describe]),
            ("/", &[Task::Embed, Task::Rerank, Task::Tokenize]),
        ] {
            let errors = errors(path);
            assert_eq!(
                errors.matches(UNKNOWN_NAME).count(),
                tasks.len(),
                "{path}: {errors}"
            );
            for task in tasks {
                assert!(
                    errors.contains(&task.unknown_name_rule()),
                    "{path}: {errors}"
                );
            }
        }
        assert!(
            doc["paths"]["/v1/models/{model}"]["get"]["responses"]["404"]["description"]
                .as_str()
                .unwrap()
                .contains(&Task::Describe.unknown_name_rule())
        );
        let raw = schemas["TeiRawRequest"]["properties"]["model"]["description"]
            .as_str()
            .unwrap();
        assert!(
            raw.contains(&Task::EmbedSparse.unknown_name_rule()),
            "{raw}"
        );
    }

    #[test]
    fn every_429_declares_its_retry_after() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let mut overloadable = 0;
        for (path, method, operation) in operations(&doc) {
            let responses = &operation["responses"];
            if method != "post" || super::NEVER_OVERLOADED.contains(&path) {
                assert!(responses["429"].is_null(), "{method} {path}");
                continue;
            }
            overloadable += 1;
            let r = responses["429"]["$ref"].as_str().unwrap();
            let name = r.strip_prefix("#/components/responses/").unwrap();
            let answer = &doc["components"]["responses"][name];
            let header = &answer["headers"]["Retry-After"];
            assert_eq!(
                header["schema"],
                json!({ "type": "integer", "minimum": 1 }),
                "{path}"
            );
            // In the shape of the route's other refusals.
            assert_eq!(
                answer["content"]["application/json"]["schema"],
                responses["4XX"]["content"]["application/json"]["schema"],
                "{path}"
            );
        }
        assert!(overloadable > 20, "{overloadable}");
    }

    #[test]
    fn nims_truncate_and_mixedbreads_answer_fields_are_documented_as_served() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let schemas = &doc["components"]["schemas"];
        // /v1/ranking takes NIM's two values; START (Cohere's) is a 400.
        let truncate = &schemas["NimRankingRequest"]["properties"]["truncate"];
        let target = truncate["oneOf"]
            .as_array()
            .into_iter()
            .flatten()
            .chain([truncate])
            .find_map(|s| s["$ref"].as_str())
            .expect("truncate names its schema");
        assert_eq!(target, "#/components/schemas/NimTruncate");
        assert_eq!(schemas["NimTruncate"]["enum"], json!(["NONE", "END"]));
        // The answer's Mixedbread fields say when they come: not only for
        // Mixedbread's encoding_format, and never for another API's request.
        let answer = &schemas["OpenAiEmbeddingResponse"]["properties"];
        let said = answer["normalized"]["description"]
            .as_str()
            .unwrap()
            .replace('\n', " ");
        assert!(
            said.contains(
                "`normalized`, `prompt` or `truncation_strategy` with no other API's field"
            ),
            "{said}"
        );
        let said = answer["encoding_format"]["oneOf"][1]["description"]
            .as_str()
            .unwrap()
            .replace('\n', " ");
        assert!(said.contains("(`float` where unsaid)"), "{said}");
    }

    #[test]
    fn the_schemas_carry_the_bounds_the_routes_enforce() {
        let doc: Value = serde_json::from_str(super::json()).unwrap();
        let schemas = &doc["components"]["schemas"];
        for (schema, field) in [
            ("NativeEmbedRequest", "texts"),
            ("TeiRerankRequest", "texts"),
            ("CohereRerankRequest", "documents"),
            ("VoyageRerankRequest", "documents"),
            ("NimRankingRequest", "passages"),
            ("CohereEmbedRequest", "texts"),
            ("CohereEmbedRequest", "inputs"),
            ("SimilarityInputs", "sentences"),
        ] {
            assert_eq!(
                schemas[schema]["properties"][field]["minItems"], 1,
                "{schema}.{field}"
            );
        }
        for (schema, field, least) in [
            ("CohereRerankRequest", "top_n", 0),
            ("CohereRerankRequest", "max_chunks_per_doc", 1),
            ("CohereRerankRequest", "max_tokens_per_doc", 1),
            ("VoyageRerankRequest", "top_k", 1),
            ("MultiVectorRequest", "pool_factor", 1),
            ("MultiVectorRequest", "protected_tokens", 0),
        ] {
            assert_eq!(
                schemas[schema]["properties"][field]["minimum"], least,
                "{schema}.{field}"
            );
        }
        // No empty list, string or token list, in any of the four forms.
        let forms = schemas["TextsOrTokens"]["oneOf"].as_array().unwrap();
        assert_eq!(forms.len(), 4);
        assert_eq!(forms[0]["minLength"], 1);
        for form in &forms[1..] {
            assert_eq!(form["minItems"], 1, "{form}");
        }
        // A list's texts: strings, or Jina AI's {"text": ...} objects, neither empty.
        let items = forms[1]["items"]["oneOf"].as_array().unwrap();
        assert_eq!(items[0]["minLength"], 1);
        assert_eq!(items[1]["properties"]["text"]["minLength"], 1);
        assert_eq!(items[1]["required"], serde_json::json!(["text"]));
        assert_eq!(forms[3]["items"]["minItems"], 1);
        // TEI's: a text, ids, or a list of texts and id lists, none empty.
        let forms = schemas["TeiInputs"]["oneOf"].as_array().unwrap();
        assert_eq!(forms.len(), 3);
        assert_eq!(forms[0]["minLength"], 1);
        assert_eq!(
            (&forms[1]["minItems"], &forms[2]["minItems"]),
            (&1.into(), &1.into())
        );
        let items = forms[2]["items"]["oneOf"].as_array().unwrap();
        assert_eq!(
            (&items[0]["minLength"], &items[1]["minItems"]),
            (&1.into(), &1.into())
        );
        // The same reader takes Jina AI's {"text": ...} objects there too.
        assert_eq!(items.len(), 3);
        assert_eq!(items[2]["properties"]["text"]["minLength"], 1);
        assert_eq!(items[2]["required"], serde_json::json!(["text"]));
        // Every X-Priority header: high, normal or low, in any case.
        let mut headers = 0;
        for (path, method, operation) in operations(&doc) {
            for p in operation["parameters"].as_array().into_iter().flatten() {
                if p["name"] == "X-Priority" {
                    headers += 1;
                    assert_eq!(
                        p["schema"]["pattern"],
                        super::PRIORITY_PATTERN,
                        "{method} {path}"
                    );
                }
            }
        }
        assert!(headers > 20, "{headers}");
        // 405 and HEAD, which no operation lists.
        let about = doc["info"]["description"].as_str().unwrap();
        assert!(about.contains("405") && about.contains("HEAD"), "{about}");
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
