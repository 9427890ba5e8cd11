//! The HTTP layer over real HTTP against a deterministic fake model.

mod common;

use std::time::Duration;

use base64::Engine as _;
use common::*;
use mlx_embed_core::EmbedInput;
use mlx_embed_server::ServerArgs;
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Shape {
    Native,
    OpenAi,
    Tei,
    Ollama,
}

impl Shape {
    /// The status for a body of the wrong shape, or an input refused as too
    /// long: 422, but 400 on Ollama's and OpenAI's routes, as those services answer.
    fn unprocessable(self) -> u16 {
        match self {
            Shape::Ollama | Shape::OpenAi => 400,
            Shape::Native | Shape::Tei => 422,
        }
    }
}

/// The embed routes: path, error shape, request body for a list of inputs.
const ROUTES: [(&str, Shape); 5] = [
    ("/api/v1/embed", Shape::Native),
    ("/v1/embeddings", Shape::OpenAi),
    // OpenAI's route without the version prefix (Infinity's path).
    ("/embeddings", Shape::OpenAi),
    ("/embed", Shape::Tei),
    ("/api/embed", Shape::Ollama),
];

fn body(shape: Shape, inputs: Value) -> Value {
    match shape {
        Shape::Native => json!({ "texts": inputs }),
        Shape::OpenAi => json!({ "input": inputs, "model": "fake-model" }),
        Shape::Tei => json!({ "inputs": inputs }),
        Shape::Ollama => json!({ "model": "fake-model", "input": inputs }),
    }
}

fn vectors(shape: Shape, resp: &Value) -> Vec<Vec<f32>> {
    let list = match shape {
        Shape::Native | Shape::Ollama => resp["embeddings"].as_array().unwrap().clone(),
        Shape::Tei => resp.as_array().unwrap().clone(),
        Shape::OpenAi => resp["data"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, d)| {
                assert_eq!(d["index"], i);
                assert_eq!(d["object"], "embedding");
                d["embedding"].clone()
            })
            .collect(),
    };
    list.iter().map(floats).collect()
}

/// Checks the route's error shape and returns the message.
fn error_message(shape: Shape, v: &Value) -> String {
    match shape {
        Shape::Native => {
            assert!(v["error"]["type"].is_string(), "{v}");
            assert!(v["error"]["code"].is_u64(), "{v}");
            v["error"]["message"]
                .as_str()
                .expect("native error.message")
                .to_owned()
        }
        Shape::OpenAi => {
            let e = v["error"].as_object().expect("openai error object");
            assert!(e["type"].is_string(), "{v}");
            assert!(e.contains_key("param") && e.contains_key("code"), "{v}");
            // FastAPI's `detail`, where Voyage AI's client reads the message.
            assert_eq!(v["detail"], e["message"], "{v}");
            assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
            e["message"].as_str().unwrap().to_owned()
        }
        Shape::Tei => {
            assert!(v["error_type"].is_string(), "{v}");
            v["error"].as_str().expect("tei error string").to_owned()
        }
        Shape::Ollama => {
            assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
            v["error"].as_str().expect("ollama error string").to_owned()
        }
    }
}

async fn post(s: &Server, path: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = client().post(s.url(path)).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let text = r.text().await.unwrap();
    let v =
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path} {status}: not JSON: {text}"));
    (status, headers, v)
}

async fn post_raw(
    s: &Server,
    path: &str,
    content_type: &str,
    raw: impl Into<reqwest::Body>,
) -> (u16, Value) {
    let r = client()
        .post(s.url(path))
        .header("content-type", content_type)
        .body(raw)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("{path} {status}: not JSON: {text}")),
    )
}

/// Posts and asserts status + error shape; returns the message.
async fn expect_error(s: &Server, path: &str, shape: Shape, body: &Value, status: u16) -> String {
    let (got, _, v) = post(s, path, body).await;
    assert_eq!(got, status, "{path} {body} -> {v}");
    error_message(shape, &v)
}

#[tokio::test]
async fn all_routes_return_the_same_vectors() {
    let s = Server::default().await;
    let inputs = ["hello world", "the quick brown fox", "z"];
    let expected: Vec<Vec<f32>> = inputs.iter().map(|t| unit_vector(&text(t))).collect();
    for (path, shape) in ROUTES {
        let (status, headers, v) = post(&s, path, &body(shape, json!(inputs))).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert!(headers.contains_key("x-request-id"));
        let got = vectors(shape, &v);
        assert_eq!(got.len(), 3);
        for (g, e) in got.iter().zip(&expected) {
            assert_close(g, e);
        }
        // A single string where the API allows it.
        if shape != Shape::Native {
            let (status, _, v) = post(&s, path, &body(shape, json!("hello world"))).await;
            assert_eq!(status, 200);
            let got = vectors(shape, &v);
            assert_eq!(got.len(), 1);
            assert_close(&got[0], &expected[0]);
        }
    }
    // Response envelopes.
    let tokens: u64 = inputs
        .iter()
        .map(|t| u64::from(untruncated_tokens(&text(t))))
        .sum();
    let (_, _, v) = post(&s, "/api/v1/embed", &json!({ "texts": inputs })).await;
    assert_eq!(v["model"], "fake-model");
    assert_eq!(v["dimension"], DIM);
    assert_eq!(v["usage"]["prompt_tokens"], tokens);
    assert_eq!(v["usage"]["total_tokens"], tokens);
    let (_, _, v) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": inputs, "model": "fake-model", "user": "u" }),
    )
    .await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "fake-model");
    assert_eq!(v["usage"]["prompt_tokens"], tokens);
    let (_, _, v) = post(
        &s,
        "/api/embed",
        &json!({ "model": "fake-model", "input": inputs }),
    )
    .await;
    assert_eq!(v["model"], "fake-model");
    assert_eq!(v["prompt_eval_count"], tokens);
    assert!(v["total_duration"].as_u64().unwrap() > 0);
    assert!(v["load_duration"].is_u64());
    // A server of one model answers whatever name a client sends (LangChain
    // and LlamaIndex default to text-embedding-ada-002); several models are
    // picked by name, with 404 for others (tests/e2e/test_rerank.py).
    let (status, _, v) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": "x", "model": "text-embedding-ada-002" }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn normalize_false_returns_raw_vectors() {
    let s = Server::default().await;
    for (path, shape) in [("/api/v1/embed", Shape::Native), ("/embed", Shape::Tei)] {
        let mut b = body(shape, json!(["abc"]));
        b["normalize"] = json!(false);
        let (status, _, v) = post(&s, path, &b).await;
        assert_eq!(status, 200);
        assert_close(&vectors(shape, &v)[0], &raw_vector(&text("abc")));
    }
    // vLLM's words for it on the OpenAI route; `true` and absent normalize.
    for (field, value, raw) in [
        ("use_activation", false, true),
        ("normalize", false, true),
        ("use_activation", true, false),
    ] {
        let b = json!({ "input": ["abc"], field: value });
        let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
        assert_eq!(status, 200, "{v}");
        let want = if raw {
            raw_vector(&text("abc"))
        } else {
            unit_vector(&text("abc"))
        };
        assert_close(&vectors(Shape::OpenAi, &v)[0], &want);
    }
    s.stop().await.unwrap();
}

/// vLLM's embedding options this server cannot honour are refused, not
/// ignored: the client would get other vectors than it asked for with a 200.
/// `truncate_prompt_tokens` cuts inputs there, special tokens included.
#[tokio::test]
async fn vllm_options_it_cannot_honour_are_refused() {
    let s = Server::default().await;
    for (extra, param) in [
        (
            json!({ "truncate_prompt_tokens": 0 }),
            "truncate_prompt_tokens",
        ),
        (json!({ "add_special_tokens": false }), "add_special_tokens"),
        (json!({ "embed_dtype": "float16" }), "embed_dtype"),
    ] {
        let mut b = json!({ "input": ["abc"] });
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
        assert_eq!((status, &v["error"]["param"]), (400, &json!(param)), "{v}");
    }
    // What it does anyway is accepted.
    for extra in [
        json!({ "truncate_prompt_tokens": -1 }),
        json!({ "truncate_prompt_tokens": MAX_TOKENS }),
        json!({ "add_special_tokens": true }),
        json!({ "embed_dtype": "float32" }),
    ] {
        let mut b = json!({ "input": ["abc"] });
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
        assert_eq!(status, 200, "{extra}: {v}");
        assert_close(&vectors(Shape::OpenAi, &v)[0], &unit_vector(&text("abc")));
    }
    // Cut at 4 tokens: the two specials and "ab".
    let b = json!({ "input": ["abc"], "truncate_prompt_tokens": 4 });
    let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(
        (status, &v["usage"]["prompt_tokens"]),
        (200, &json!(4)),
        "{v}"
    );
    assert_close(&vectors(Shape::OpenAi, &v)[0], &unit_vector(&text("ab")));
    // Too short for the specials: a 400 that says so.
    let b = json!({ "input": ["abc"], "truncate_prompt_tokens": 2 });
    let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("truncate_prompt_tokens")),
        "{v}"
    );
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("truncate_prompt_tokens: a cut at 2 tokens leaves no room for text"),
        "{v}"
    );
    s.stop().await.unwrap();
}

/// The ids the fake model runs for token ids `ids` cut at `k` by the core
/// (its encoder wraps ids in its own markers, inside the cut).
fn fake_ids(ids: Vec<u32>, truncate_to: Option<usize>) -> Vec<u32> {
    use mlx_embed_core::{EmbedOptions, Tokenize as _};
    let options = EmbedOptions {
        truncate_to,
        ..EmbedOptions::default()
    };
    FakeTokenizer
        .encode(&EmbedInput::Tokens(ids), &options)
        .unwrap()
        .ids
}

/// The fake's ids for `ids` cut to `truncate_to` on `direction`'s side.
fn fake_ids_cut(
    ids: Vec<u32>,
    truncate_to: Option<usize>,
    direction: mlx_embed_core::TruncationDirection,
) -> Vec<u32> {
    use mlx_embed_core::{EmbedOptions, Tokenize as _};
    let options = EmbedOptions {
        truncate_to,
        truncation_direction: Some(direction),
        ..EmbedOptions::default()
    };
    FakeTokenizer
        .encode(&EmbedInput::Tokens(ids), &options)
        .unwrap()
        .ids
}

fn unit_of_ids(ids: &[u32]) -> Vec<f32> {
    let mut v = raw_vector_of_ids(ids);
    mlx_embed_core::l2_normalize(&mut v);
    v
}

/// vLLM's integer fields read a whole float as its integer, as pydantic and
/// JSON Schema do (Python clients send `3.0` from a float): `3.0` is 3,
/// `3.5` a 400; serde's `i64` refused `3.0` with a 400.
#[tokio::test]
async fn vllm_integer_fields_take_a_whole_float() {
    let s = Server::default().await;
    for (field, whole, int) in [
        ("truncate_prompt_tokens", json!(4.0), json!(4)),
        ("dimensions", json!(3.0), json!(3)),
        ("priority", json!(-1.0), json!(-1)),
    ] {
        let ask = |value: &Value| {
            let mut body = json!({ "input": ["abcdef"] });
            body[field] = value.clone();
            body
        };
        let (status, _, as_float) = post(&s, "/v1/embeddings", &ask(&whole)).await;
        assert_eq!(status, 200, "{field}: {as_float}");
        let (status, _, as_int) = post(&s, "/v1/embeddings", &ask(&int)).await;
        assert_eq!(status, 200, "{field}: {as_int}");
        assert_eq!(as_float["data"], as_int["data"], "{field}");
        assert_eq!(
            as_float["usage"]["prompt_tokens"], as_int["usage"]["prompt_tokens"],
            "{field}"
        );
        let (status, _, v) = post(&s, "/v1/embeddings", &ask(&json!(3.5))).await;
        assert_eq!(status, 400, "{field}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("invalid type: floating point `3.5`, expected i64"),
            "{field}: {v}"
        );
    }
    let (status, _, v) = post(
        &s,
        "/pooling",
        &json!({ "input": ["abcdef"], "truncate_prompt_tokens": 4.0 }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 4, "{v}");
    s.stop().await.unwrap();
}

/// vLLM's `truncate_prompt_tokens` cuts text and token ids alike (inside
/// the model's special tokens), on the end vLLM's `truncation_side` names,
/// the start kept by default: a text and its `/tokenize` ids give one
/// vector. Ids kept their last k as sent, where text kept its first.
#[tokio::test]
async fn vllm_truncate_prompt_tokens_cuts_text_and_ids_alike() {
    use mlx_embed_core::TruncationDirection::{Left, Right};
    let s = Server::default().await;
    let ids: Vec<u32> = (1..=20).collect();
    let first = unit_of_ids(&fake_ids_cut(ids.clone(), Some(5), Right));
    let last = unit_of_ids(&fake_ids_cut(ids.clone(), Some(5), Left));
    assert_ne!(first, last);
    for (side, expected, text_kept) in [
        (None, &first, "ab"),
        (Some("right"), &first, "ab"),
        (Some("left"), &last, "ef"),
    ] {
        let with_side = |mut body: Value| {
            if let Some(side) = side {
                body["truncation_side"] = json!(side);
            }
            body
        };
        for path in ["/v1/embeddings", "/embeddings", "/pooling"] {
            let body = with_side(json!({ "input": [ids.clone()], "truncate_prompt_tokens": 5 }));
            let (status, _, v) = post(&s, path, &body).await;
            assert_eq!(status, 200, "{path} {side:?}: {v}");
            assert_eq!(v["usage"]["prompt_tokens"], 5, "{v}");
            let got = if path == "/pooling" {
                floats(&v["data"][0]["data"])
            } else {
                vectors(Shape::OpenAi, &v)[0].clone()
            };
            assert_close(&got, expected);
        }
        let body = with_side(json!({ "input": "abcdef", "truncate_prompt_tokens": 4 }));
        let (status, _, v) = post(&s, "/v1/embeddings", &body).await;
        assert_eq!(status, 200, "{v}");
        assert_close(
            &vectors(Shape::OpenAi, &v)[0],
            &unit_vector(&text(text_kept)),
        );
    }
    // -1: the model's maximum.
    let long: Vec<u32> = (1..=70).collect();
    let (status, _, v) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": long.clone(), "truncate_prompt_tokens": -1 }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], MAX_TOKENS, "{v}");
    assert_close(
        &vectors(Shape::OpenAi, &v)[0],
        &unit_of_ids(&fake_ids(long, None)),
    );
    // truncate: false still refuses ids over the cut.
    let (status, _, v) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": ids.clone(), "truncate_prompt_tokens": 5, "truncate": false }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("input 0 has 22 tokens, more than the request's cut of 5"),
        "{v}"
    );
    let (status, _, v) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": "a", "truncation_side": "middle" }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    s.stop().await.unwrap();

    let s = scorer_server(FakeScorer::classifier).await;
    let (status, _, v) = post(
        &s,
        "/classify",
        &json!({ "input": [ids.clone()], "truncate_prompt_tokens": 5, "truncation_side": "left" }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let mut logits = raw_vector_of_ids(&fake_ids_cut(ids, Some(5), Left));
    logits.truncate(3);
    assert_close(&floats(&v["data"][0]["probs"]), &softmax(&logits));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn openai_token_inputs() {
    let s = Server::default().await;
    let (status, _, v) = post(&s, "/v1/embeddings", &json!({ "input": [1, 2, 3] })).await;
    assert_eq!(status, 200, "{v}");
    assert_close(
        &vectors(Shape::OpenAi, &v)[0],
        &unit_vector(&EmbedInput::Tokens(vec![1, 2, 3])),
    );
    let (status, _, v) = post(&s, "/v1/embeddings", &json!({ "input": [[1, 2], [999]] })).await;
    assert_eq!(status, 200, "{v}");
    let got = vectors(Shape::OpenAi, &v);
    assert_close(&got[0], &unit_vector(&EmbedInput::Tokens(vec![1, 2])));
    assert_close(&got[1], &unit_vector(&EmbedInput::Tokens(vec![999])));
    // Out of the vocabulary: 400 naming the input index.
    let msg = expect_error(
        &s,
        "/v1/embeddings",
        Shape::OpenAi,
        &json!({ "input": [[1], [2, 1000]] }),
        400,
    )
    .await;
    assert!(msg.contains("input 1") && msg.contains("1000"), "{msg}");
    // Deeper nesting, mixed forms, negative ids: a wrong shape (400, as OpenAI answers).
    for bad in [
        json!([[[1]]]),
        json!(["a", 1]),
        json!([-1]),
        json!([1.5]),
        json!(null),
        json!({"a": 1}),
    ] {
        expect_error(
            &s,
            "/v1/embeddings",
            Shape::OpenAi,
            &json!({ "input": bad }),
            Shape::OpenAi.unprocessable(),
        )
        .await;
    }
    // Empty token list: 400.
    expect_error(
        &s,
        "/v1/embeddings",
        Shape::OpenAi,
        &json!({ "input": [[1], []] }),
        400,
    )
    .await;
    // Ids sent with one of OpenAI's model names are tiktoken's (LangChain's
    // default): refused, not embedded as other text. The same ids with any
    // other name, and text with OpenAI's name, run.
    for (input, model) in [
        (json!([1, 2, 3]), "text-embedding-3-small"),
        (json!([[1, 2], [3]]), "text-embedding-3-small"),
        // As OpenAI reads a name: any case, spaces, its provider prefix.
        (json!([1, 2, 3]), "TEXT-Embedding-3-Large"),
        (json!([1, 2, 3]), " openai/text-embedding-ada-002 "),
    ] {
        let (status, _, v) = post(
            &s,
            "/v1/embeddings",
            &json!({ "input": input, "model": model }),
        )
        .await;
        assert_eq!(status, 400, "{model}: {v}");
        assert_eq!(v["error"]["param"], "input", "{v}");
        assert_eq!(v["error"]["code"], "token_ids_of_another_tokenizer", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!("`{model}`")) && msg.contains("check_embedding_ctx_length=False"),
            "{msg}"
        );
    }
    for body in [
        json!({ "input": [1, 2, 3], "model": "my-embedder" }),
        json!({ "input": "text", "model": "text-embedding-ada-002" }),
    ] {
        let (status, _, v) = post(&s, "/v1/embeddings", &body).await;
        assert_eq!(status, 200, "{body} -> {v}");
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn dimensions_keep_first_n_renormalized() {
    let s = Server::default().await;
    let mut expected = raw_vector(&text("dims"));
    expected.truncate(3);
    mlx_embed_core::l2_normalize(&mut expected);
    for (path, shape) in ROUTES {
        let mut b = body(shape, json!(["dims"]));
        b["dimensions"] = json!(3);
        let (status, _, v) = post(&s, path, &b).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_close(&vectors(shape, &v)[0], &expected);
        if shape == Shape::Native {
            assert_eq!(v["dimension"], 3);
        }
        // Ollama reads 0 as none (its own test below).
        let zero = (shape != Shape::Ollama).then_some(0);
        for bad in zero.into_iter().chain([-1, DIM as i64 + 1]) {
            b["dimensions"] = json!(bad);
            let msg = expect_error(&s, path, shape, &b, 400).await;
            assert!(msg.contains("dimensions"), "{msg}");
        }
    }
    // Full dimension is fine.
    let (status, _, _) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": "x", "dimensions": DIM }),
    )
    .await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn ollama_reads_dimensions_0_as_none_and_cuts_otherwise() {
    let s = Server::default().await;
    let expected = unit_vector(&text("hi"));
    // Ollama's Go clients send a field's zero value when it is not set.
    let (status, _, v) = post(&s, "/api/embed", &json!({ "input": "hi", "dimensions": 0 })).await;
    assert_eq!(status, 200, "{v}");
    let got = vectors(Shape::Ollama, &v);
    assert_eq!(got[0].len(), DIM);
    assert_close(&got[0], &expected);
    let (status, _, v) = post(&s, "/api/embed", &json!({ "input": "hi", "dimensions": 3 })).await;
    assert_eq!(status, 200, "{v}");
    let cut = &vectors(Shape::Ollama, &v)[0];
    let norm = expected[..3].iter().map(|x| x * x).sum::<f32>().sqrt();
    let renormalized: Vec<f32> = expected[..3].iter().map(|x| x / norm).collect();
    assert_close(cut, &renormalized);
    for refused in [-1, DIM as i64 + 1] {
        expect_error(
            &s,
            "/api/embed",
            Shape::Ollama,
            &json!({ "input": "hi", "dimensions": refused }),
            400,
        )
        .await;
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn infinity_clients_default_embeddings_body_gets_the_full_dimension() {
    let s = Server::default().await;
    let expected = unit_vector(&text("hi"));
    // What Infinity's client sends unless told otherwise: `dimensions: 0`
    // (Infinity's "not set") beside `modality: "text"` and its model name.
    for path in ["/embeddings", "/v1/embeddings"] {
        let (status, _, v) = post(
            &s,
            path,
            &json!({
                "input": ["hi"],
                "model": "default/not-specified",
                "dimensions": 0,
                "modality": "text",
            }),
        )
        .await;
        assert_eq!(status, 200, "{path}: {v}");
        let got = vectors(Shape::OpenAi, &v);
        assert_eq!(got[0].len(), DIM);
        assert_close(&got[0], &expected);
    }
    // A cut still cuts with `modality` set.
    let (status, _, v) = post(
        &s,
        "/embeddings",
        &json!({ "input": ["hi"], "dimensions": 3, "modality": "text" }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(vectors(Shape::OpenAi, &v)[0].len(), 3);
    // OpenAI's shape keeps OpenAI's 400 for 0.
    let msg = expect_error(
        &s,
        "/embeddings",
        Shape::OpenAi,
        &json!({ "input": ["hi"], "dimensions": 0 }),
        400,
    )
    .await;
    assert_eq!(
        msg,
        format!("dimensions must be between 1 and the model's dimension {DIM}, got 0")
    );
    // Images and audio are not embedded as if they were text.
    let msg = expect_error(
        &s,
        "/embeddings",
        Shape::OpenAi,
        &json!({ "input": ["http://x/cat.jpg"], "modality": "image" }),
        400,
    )
    .await;
    assert!(
        msg.contains("modality `image` is not supported: this server embeds text"),
        "{msg}"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn model_list_carries_infinitys_fields() {
    async fn listed(s: &Server, path: &str) -> Value {
        let r = client().get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        r.json().await.unwrap()
    }
    let s = Server::default().await;
    for path in ["/models", "/v1/models"] {
        let v = listed(&s, path).await;
        assert_eq!(v["object"], "list");
        let m = &v["data"][0];
        assert_eq!(m["id"], "fake-model");
        assert_eq!(m["object"], "model");
        assert!(m["created"].is_u64(), "{m}");
        // Infinity's client refuses any other owner, and requires `stats`.
        assert_eq!(m["owned_by"], "infinity");
        assert_eq!(
            m["stats"],
            json!({ "queue_absolute": 0, "results_pending": 0, "queue_fraction": 0.0, "batch_size": 64 })
        );
        assert_eq!(m["capabilities"], json!(["embed"]));
    }
    let one = listed(&s, "/v1/models/fake-model").await;
    assert_eq!(one["owned_by"], "infinity");
    assert_eq!(one["capabilities"], json!(["embed"]));
    s.stop().await.unwrap();

    for (scorer, capabilities) in [
        (
            FakeScorer::reranker as fn() -> FakeScorer,
            json!(["rerank", "classify"]),
        ),
        (FakeScorer::classifier, json!(["classify"])),
    ] {
        let s = scorer_server(scorer).await;
        let v = listed(&s, "/models").await;
        assert_eq!(v["data"][0]["capabilities"], capabilities, "{v}");
        assert_eq!(v["data"][0]["owned_by"], "infinity");
        s.stop().await.unwrap();
    }
}

#[tokio::test]
async fn openai_base64_decodes_to_the_floats() {
    let s = Server::default().await;
    let inputs = json!(["one", "two"]);
    let (_, _, floats_resp) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": inputs, "encoding_format": "float" }),
    )
    .await;
    let (status, _, b64_resp) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": inputs, "encoding_format": "base64" }),
    )
    .await;
    assert_eq!(status, 200);
    let want = vectors(Shape::OpenAi, &floats_resp);
    for (i, d) in b64_resp["data"].as_array().unwrap().iter().enumerate() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(d["embedding"].as_str().unwrap())
            .unwrap();
        let got: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, want[i]);
    }
    expect_error(
        &s,
        "/v1/embeddings",
        Shape::OpenAi,
        &json!({ "input": "x", "encoding_format": "hex" }),
        Shape::OpenAi.unprocessable(),
    )
    .await;
    s.stop().await.unwrap();
}

#[tokio::test]
async fn request_shape_errors() {
    let s = Server::default().await;
    for (path, shape) in ROUTES {
        // Empty list and empty string: 400; Ollama answers no input with no
        // embeddings, as Ollama does.
        if shape == Shape::Ollama {
            for empty in [
                body(shape, json!([])),
                json!({ "model": "m" }),
                body(shape, Value::Null),
            ] {
                let (status, _, v) = post(&s, path, &empty).await;
                assert_eq!(
                    (status, &v["embeddings"]),
                    (200, &json!([])),
                    "{empty} -> {v}"
                );
            }
        } else {
            expect_error(&s, path, shape, &body(shape, json!([])), 400).await;
            // Missing or null field: a wrong shape.
            let status = shape.unprocessable();
            expect_error(&s, path, shape, &json!({ "model": "m" }), status).await;
            expect_error(&s, path, shape, &body(shape, Value::Null), status).await;
        }
        if shape == Shape::Ollama {
            // Ollama embeds an empty text in a list (its handler keeps every item).
            let (status, _, v) = post(&s, path, &body(shape, json!(["ok", ""]))).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["embeddings"].as_array().map(Vec::len), Some(2), "{v}");
        } else {
            let msg = expect_error(&s, path, shape, &body(shape, json!(["ok", ""])), 400).await;
            assert!(msg.contains("input 1"), "{msg}");
        }
        // Wrong-typed field; non-string item; nested too deep: a wrong shape.
        expect_error(
            &s,
            path,
            shape,
            &body(shape, json!(42)),
            shape.unprocessable(),
        )
        .await;
        if shape != Shape::OpenAi {
            expect_error(
                &s,
                path,
                shape,
                &body(shape, json!(["a", 3])),
                shape.unprocessable(),
            )
            .await;
            expect_error(
                &s,
                path,
                shape,
                &body(shape, json!([["a"]])),
                shape.unprocessable(),
            )
            .await;
        }
        let mut wrong = body(shape, json!(["a"]));
        wrong["truncate"] = json!("yes");
        expect_error(&s, path, shape, &wrong, shape.unprocessable()).await;
        // An array is not a request, though serde could fill a struct from one
        // field by field.
        let msg = expect_error(
            &s,
            path,
            shape,
            &json!(["hi", null, null, 2]),
            shape.unprocessable(),
        )
        .await;
        assert!(msg.contains("expected a JSON object"), "{msg}");
        // Malformed JSON: 400. Wrong content type: 415, but Ollama reads any
        // body as JSON, so there it is malformed JSON.
        let (status, v) = post_raw(&s, path, "application/json", "{\"texts\": [").await;
        assert_eq!(status, 400, "{path}: {v}");
        error_message(shape, &v);
        let (status, v) = post_raw(&s, path, "text/plain", "hello").await;
        let want = if shape == Shape::Ollama { 400 } else { 415 };
        assert_eq!(status, want, "{path}: {v}");
        error_message(shape, &v);
    }
    // Native needs a list.
    expect_error(
        &s,
        "/api/v1/embed",
        Shape::Native,
        &json!({ "texts": "one" }),
        422,
    )
    .await;
    s.stop().await.unwrap();
}

/// A body of the wrong shape names the field at fault in OpenAI's `param`
/// (the path's first key: `input` for `input[1]`, as an error about one
/// input names `input`) and says what is wrong in `code`; the shapes without
/// a param keep theirs, the statuses stay (400 in OpenAI's shape, 422 in
/// TEI's and the native one).
#[tokio::test]
async fn a_wrong_shape_names_its_field() {
    let s = Server::default().await;
    let openai = |v: &Value| {
        let e = &v["error"];
        (
            e["param"].as_str().map(str::to_owned),
            e["code"].as_str().map(str::to_owned),
            e["message"].as_str().unwrap().to_owned(),
        )
    };
    let owned = |p: &str, c: &str| (Some(p.to_owned()), Some(c.to_owned()));
    for path in ["/v1/embeddings", "/embeddings"] {
        for (body, want, at) in [
            // A wrong-typed top-level field.
            (
                json!({ "input": ["a"], "dimensions": "x" }),
                owned("dimensions", "invalid_type"),
                "dimensions: invalid type: string \"x\"",
            ),
            // A wrong element of `input`, and one nested deeper.
            (
                json!({ "input": ["a", null] }),
                owned("input", "invalid_type"),
                "input[1]: invalid type: null",
            ),
            (
                json!({ "input": [[1, 2], [3, "x"]] }),
                owned("input", "invalid_type"),
                "input[1][1]: invalid type: string \"x\"",
            ),
            (
                json!({ "input": "a", "encoding_format": "hex" }),
                owned("encoding_format", "invalid_value"),
                "encoding_format: unknown variant `hex`",
            ),
            // Missing: the field serde names.
            (
                json!({ "model": "m" }),
                owned("input", "missing_required_parameter"),
                "missing field `input`",
            ),
        ] {
            let (status, _, v) = post(&s, path, &body).await;
            assert_eq!(status, 400, "{path} {body}: {v}");
            let (param, code, message) = openai(&v);
            assert_eq!((param, code), want, "{path} {body}: {v}");
            assert!(message.contains(at), "{path} {body}: {v}");
            error_message(Shape::OpenAi, &v);
        }
        // A field's own check names its field, with no code.
        let (status, _, v) = post(&s, path, &json!({ "input": ["a", 3] })).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(openai(&v).0.as_deref(), Some("input"), "{v}");
        assert!(v["error"]["code"].is_null(), "{v}");
        // No field to name: a body that is not an object.
        let (status, _, v) = post(&s, path, &json!(["a"])).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(openai(&v).0, None, "{v}");
    }
    // Cohere's v2 body (OpenAI's error shape): an element of a list that is
    // not the input.
    let (status, _, v) = post(
        &s,
        "/v2/embed",
        &json!({ "texts": ["a"], "input_type": "search_query", "embedding_types": ["float", "hex"] }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let (param, code, message) = openai(&v);
    assert_eq!(
        (param, code),
        owned("embedding_types", "invalid_value"),
        "{v}"
    );
    assert!(
        message.contains("embedding_types[1]: unknown variant `hex`"),
        "{v}"
    );
    // TEI's, Ollama's and the native shape have no param: theirs as before.
    for (path, shape, body) in [
        (
            "/embed",
            Shape::Tei,
            json!({ "inputs": ["a"], "truncate": "yes" }),
        ),
        (
            "/api/embed",
            Shape::Ollama,
            json!({ "input": ["a"], "truncate": "yes" }),
        ),
        (
            "/api/v1/embed",
            Shape::Native,
            json!({ "texts": ["a"], "truncate": "yes" }),
        ),
    ] {
        let (status, _, v) = post(&s, path, &body).await;
        assert_eq!(status, shape.unprocessable(), "{path}: {v}");
        let message = error_message(shape, &v);
        assert!(
            message.contains("truncate: invalid type: string \"yes\""),
            "{path}: {v}"
        );
        assert!(
            v.get("param").is_none() && v["error"].get("param").is_none(),
            "{path}: {v}"
        );
    }
    s.stop().await.unwrap();
    // A body read as a value first (`/rerank`'s Cohere form, in OpenAI's
    // shape; `/v1/rerank`): the same names.
    let s = scorer_server(FakeScorer::reranker).await;
    for (path, body, want, at) in [
        (
            "/rerank",
            json!({ "query": "q", "documents": ["a", 3] }),
            (Some("documents".to_owned()), None),
            "documents[1]: each document must be a string or a JSON object",
        ),
        (
            "/rerank",
            json!({ "query": "q", "documents": ["a"], "top_n": "x" }),
            owned("top_n", "invalid_type"),
            "top_n: invalid type: string \"x\"",
        ),
        (
            "/v1/rerank",
            json!({ "query": 3, "documents": ["a"] }),
            owned("query", "invalid_type"),
            "query: invalid type: integer `3`",
        ),
    ] {
        let (status, _, v) = post(&s, path, &body).await;
        assert_eq!(status, 400, "{path} {body}: {v}");
        let (param, code, message) = openai(&v);
        assert_eq!((param, code), want, "{path} {body}: {v}");
        assert!(message.contains(at), "{path} {body}: {v}");
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn truncation_is_default_and_refusal_names_the_input() {
    let s = Server::default().await;
    let long = "word ".repeat(100); // 500 chars -> 127 tokens > 64
    let long_tokens = untruncated_tokens(&text(&long));
    for (path, shape) in ROUTES {
        let (status, _, v) = post(&s, path, &body(shape, json!(["short", long]))).await;
        assert_eq!(status, 200, "{path}: {v}");
        let mut b = body(shape, json!(["short", long]));
        b["truncate"] = json!(false);
        let msg = expect_error(&s, path, shape, &b, shape.unprocessable()).await;
        assert!(
            msg.contains("input 1") && msg.contains(&long_tokens.to_string()),
            "{msg}"
        );
        b["truncate"] = json!(true);
        let (status, _, _) = post(&s, path, &b).await;
        assert_eq!(status, 200);
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn size_limits_return_413() {
    let args = ServerArgs {
        max_body_bytes: 4096,
        max_inputs_per_request: 4,
        ..test_args()
    };
    let s = Server::start(args).await;
    // Vertex's instances count together: 3 instances of 2 inputs are 6.
    let msg = expect_error(
        &s,
        "/vertex",
        Shape::Tei,
        &json!({ "instances": [{ "inputs": ["a", "b"] }, { "inputs": ["c", "d"] }, { "inputs": ["e", "f"] }] }),
        413,
    )
    .await;
    assert!(msg.contains("6 inputs in all"), "{msg}");
    for (path, shape) in ROUTES {
        let msg = expect_error(
            &s,
            path,
            shape,
            &body(shape, json!(["a", "b", "c", "d", "e"])),
            413,
        )
        .await;
        assert!(msg.contains('4') && msg.contains("limit"), "{msg}");
        let (status, _, _) = post(&s, path, &body(shape, json!(["a", "b", "c", "d"]))).await;
        assert_eq!(status, 200);
        let big = "x".repeat(8000);
        let msg = expect_error(&s, path, shape, &body(shape, json!([big])), 413).await;
        assert!(msg.contains("4096"), "{msg}");
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn default_body_limit_is_2_mib() {
    let s = Server::default().await;
    let big = "x".repeat(2 * 1024 * 1024 + 10);
    let msg = expect_error(
        &s,
        "/v1/embeddings",
        Shape::OpenAi,
        &json!({ "input": big }),
        413,
    )
    .await;
    assert!(msg.contains("2097152"), "{msg}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn model_failures_map_to_500_and_503() {
    let s = Server::default().await;
    for (path, shape) in ROUTES {
        let msg = expect_error(&s, path, shape, &body(shape, json!(["boom"])), 500).await;
        assert!(msg.contains("fake model exploded"), "{msg}");
    }
    // Other requests still work.
    let (status, _, _) = post(&s, "/embed", &json!({ "inputs": "fine" })).await;
    assert_eq!(status, 200);
    // A dead model: 503 everywhere, health 503.
    let (status, _, _) = post(&s, "/embed", &json!({ "inputs": "panic" })).await;
    assert_eq!(status, 503);
    for (path, shape) in ROUTES {
        expect_error(&s, path, shape, &body(shape, json!(["after"])), 503).await;
    }
    let r = client().get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["status"], "unhealthy");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn model_side_invalid_input_is_400_for_that_request_only() {
    let s = Server::default().await;
    for (path, shape) in ROUTES {
        let msg = expect_error(&s, path, shape, &body(shape, json!(["invalid one"])), 400).await;
        assert_eq!(msg, "ValueError: the fake refuses this input");
    }
    let (status, _, _) = post(&s, "/embed", &json!({ "inputs": "fine" })).await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

/// The fake's unit vector for `t` under `options`.
fn unit_with(t: &str, options: &mlx_embed_core::EmbedOptions) -> Vec<f32> {
    use mlx_embed_core::Tokenize;
    let ids = FakeTokenizer.encode(&text(t), options).unwrap().ids;
    let mut v = raw_vector_of_ids(&ids);
    mlx_embed_core::l2_normalize(&mut v);
    v
}

#[tokio::test]
async fn prompts_and_truncation_side_reach_the_tokenizer() {
    use mlx_embed_core::{EmbedOptions, Prompt, TruncationDirection};
    let s = Server::default().await;
    let named = |name: &str| EmbedOptions {
        prompt: Prompt::Named(name.into()),
        ..EmbedOptions::default()
    };
    // prompt_name on the native, TEI and OpenAI (top-level, as extra_body sends it) routes.
    for (path, shape) in ROUTES.iter().filter(|(_, shape)| *shape != Shape::Ollama) {
        let mut b = body(*shape, json!(["rivers"]));
        b["prompt_name"] = json!("query");
        let (status, _, v) = post(&s, path, &b).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_close(
            &vectors(*shape, &v)[0],
            &unit_with("rivers", &named("query")),
        );
        assert_ne!(
            unit_with("rivers", &named("query")),
            unit_vector(&text("rivers"))
        );

        b["prompt_name"] = json!("nope");
        let msg = expect_error(&s, path, *shape, &b, 400).await;
        assert_eq!(
            msg,
            "unknown prompt name \"nope\": this model has passage, query"
        );
    }
    // Token ids run as given: a prompt asked for with them is refused, not dropped.
    for (path, shape) in ROUTES
        .iter()
        .filter(|(_, shape)| matches!(shape, Shape::OpenAi | Shape::Tei))
    {
        let mut b = body(*shape, json!([[5, 6, 7]]));
        b["prompt_name"] = json!("query");
        let msg = expect_error(&s, path, *shape, &b, 400).await;
        assert!(
            msg.starts_with("input 0: token ids run as given, so a prompt cannot"),
            "{path}: {msg}"
        );
    }
    // A raw prompt (native only), and not both at once.
    let (status, _, v) = post(
        &s,
        "/api/v1/embed",
        &json!({ "texts": ["rivers"], "prompt": "passage: " }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_close(
        &vectors(Shape::Native, &v)[0],
        &unit_with("rivers", &named("passage")),
    );
    let both = json!({ "texts": ["rivers"], "prompt": "x", "prompt_name": "query" });
    let msg = expect_error(&s, "/api/v1/embed", Shape::Native, &both, 400).await;
    assert_eq!(msg, "give either prompt_name or prompt, not both");

    // truncation_direction: TEI's capitalised names and lowercase, native too.
    let long = format!("{}{}", "a".repeat(MAX_TOKENS), "b".repeat(MAX_TOKENS));
    let left = EmbedOptions {
        truncation_direction: Some(TruncationDirection::Left),
        ..EmbedOptions::default()
    };
    for (path, shape, side) in [
        ("/embed", Shape::Tei, "Left"),
        ("/api/v1/embed", Shape::Native, "left"),
    ] {
        let mut b = body(shape, json!([long]));
        b["truncation_direction"] = json!(side);
        let (status, _, v) = post(&s, path, &b).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_close(&vectors(shape, &v)[0], &unit_with(&long, &left));
        b["truncation_direction"] = json!("Right");
        let (_, _, v) = post(&s, path, &b).await;
        assert_close(&vectors(shape, &v)[0], &unit_vector(&text(&long)));
        b["truncation_direction"] = json!("middle");
        let msg = expect_error(&s, path, shape, &b, 422).await;
        assert!(
            msg.contains("unknown variant `middle`, expected `left` or `right`"),
            "{msg}"
        );
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn overload_returns_429_with_retry_after() {
    let args = ServerArgs {
        max_concurrent_requests: 1,
        max_waiting: 0,
        max_queue_wait_ms: 50,
        ..test_args()
    };
    let s = Server::start(args).await;
    let slow_url = s.url("/embed");
    let slow = tokio::spawn(async move {
        client()
            .post(slow_url)
            .json(&json!({ "inputs": "slow one" }))
            .send()
            .await
            .unwrap()
            .status()
    });
    s.wait_in_flight(1).await;
    for (path, shape) in ROUTES {
        let (status, headers, v) = post(&s, path, &body(shape, json!(["b"]))).await;
        assert_eq!(status, 429, "{path}: {v}");
        error_message(shape, &v);
        let retry: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        assert!(retry >= 1);
    }
    assert_eq!(slow.await.unwrap(), 200);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn infinitys_stats_count_the_queue_while_the_model_is_busy() {
    let args = ServerArgs {
        max_concurrent_requests: 1,
        max_waiting: 4,
        ..test_args()
    };
    let s = Server::start(args).await;
    let send = |text: &'static str| {
        let url = s.url("/embed");
        tokio::spawn(async move {
            let r = client()
                .post(url)
                .json(&json!({ "inputs": text }))
                .send()
                .await
                .unwrap();
            r.status()
        })
    };
    let slow = send("slow one");
    s.wait_in_flight(1).await;
    let waiting = [send("waits 1"), send("waits 2"), send("waits 3")];
    let mut stats = Value::Null;
    for _ in 0..200 {
        let v: Value = client()
            .get(s.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        stats = v["data"][0]["stats"].clone();
        if stats["queue_absolute"] == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Three of the lane's four waiting places taken; the slow one in the model.
    assert_eq!(
        stats,
        json!({ "queue_absolute": 3, "results_pending": 1, "queue_fraction": 0.75, "batch_size": 64 })
    );
    assert_eq!(slow.await.unwrap(), 200);
    for w in waiting {
        assert_eq!(w.await.unwrap(), 200);
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn api_key_guards_everything_but_health() {
    let args = ServerArgs {
        api_key: Some("sekret".into()),
        ..test_args()
    };
    let s = Server::start(args).await;
    let c = client();
    assert_eq!(c.get(s.url("/health")).send().await.unwrap().status(), 200);
    // SageMaker's health check sends no credentials.
    assert_eq!(c.get(s.url("/ping")).send().await.unwrap().status(), 200);
    for (path, shape) in ROUTES {
        for auth in [None, Some("Bearer wrong"), Some("Basic sekret")] {
            let mut req = c.post(s.url(path)).json(&body(shape, json!(["a"])));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{path}");
            assert!(r.headers().contains_key("www-authenticate"));
            error_message(shape, &r.json().await.unwrap());
        }
        let r = c
            .post(s.url(path))
            .header("authorization", "Bearer sekret")
            .json(&body(shape, json!(["a"])))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    for path in [
        "/metrics",
        "/info",
        "/v1/models",
        "/openapi.json",
        "/version",
    ] {
        assert_eq!(
            c.get(s.url(path)).send().await.unwrap().status(),
            401,
            "{path}"
        );
        let r = c
            .get(s.url(path))
            .bearer_auth("sekret")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
    }
    s.stop().await.unwrap();
}

/// With `--allowed-hosts`, a request naming another host (a page whose name
/// an attacker points at the server: DNS rebinding) gets 403 in its route's
/// error shape; listed names, IP addresses and `localhost` are answered.
/// Without the flag any `Host` is.
#[tokio::test]
async fn allowed_hosts_refuse_other_names() {
    let args = ServerArgs {
        allowed_hosts: vec!["embed.example.com".into(), ".corp.example".into()],
        cors_allow_origin: vec!["http://app.example".into()],
        ..test_args()
    };
    let s = Server::start(args).await;
    let open = Server::start(test_args()).await;
    let c = client();
    // What an operator set is what /info says.
    let info = get_json(&s, "/info").await;
    assert_eq!(
        info["limits"]["allowed_hosts"],
        json!(["embed.example.com", ".corp.example"])
    );
    assert_eq!(
        info["limits"]["cors_allow_origin"],
        json!(["http://app.example"])
    );
    let info = get_json(&open, "/info").await;
    assert_eq!(info["limits"]["allowed_hosts"], json!([]));
    for (path, shape) in ROUTES {
        let send = |server: &Server, host: Option<&str>| {
            let mut req = c.post(server.url(path)).json(&body(shape, json!(["a"])));
            if let Some(host) = host {
                req = req.header("host", host);
            }
            req.send()
        };
        for host in [
            "evil.example",
            "evil.example:8080",
            "embed.example.com.evil.example",
        ] {
            let r = send(&s, Some(host)).await.unwrap();
            assert_eq!(r.status(), 403, "{path} {host}");
            let message = error_message(shape, &r.json().await.unwrap());
            assert!(message.contains("--allowed-hosts"), "{message}");
            assert_eq!(
                send(&open, Some(host)).await.unwrap().status(),
                200,
                "{path}"
            );
        }
        for host in [
            None,
            Some("embed.example.com:8080"),
            Some("a.corp.example"),
            Some("localhost:1"),
        ] {
            assert_eq!(
                send(&s, host).await.unwrap().status(),
                200,
                "{path} {host:?}"
            );
        }
    }
    // A browser's preflight is refused too, before CORS answers it.
    let preflight = c
        .request(reqwest::Method::OPTIONS, s.url("/v1/embeddings"))
        .header("host", "evil.example")
        .header("origin", "http://app.example")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 403);
    // Two Host headers are a 400 (RFC 9112), in either order.
    for hosts in [["localhost", "evil.example"], ["evil.example", "localhost"]] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://"))
            .await
            .unwrap();
        let head = format!(
            "GET /health HTTP/1.1\r\nHost: {}\r\nHost: {}\r\nConnection: close\r\n\r\n",
            hosts[0], hosts[1]
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 400"), "{hosts:?}: {answer}");
        assert!(answer.contains("more than one Host header"), "{answer}");
    }
    // Without the flag too: two Host headers, or an HTTP/1.1 request with
    // none, are a 400 (RFC 9112 section 3.2); HTTP/1.0 needs none.
    for (head, status, says) in [
        (
            "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n",
            "400",
            "more than one Host header",
        ),
        (
            "GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
            "400",
            "needs a Host header",
        ),
        ("GET /health HTTP/1.0\r\n\r\n", "200", "ok"),
    ] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(open.base.trim_start_matches("http://"))
            .await
            .unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        assert!(
            answer.contains(&format!(" {status} ")) && answer.contains(says),
            "{head:?}: {answer}"
        );
    }
    // Every operation of the document declares the 403, probes too, and answers it.
    let doc: Value = c
        .get(s.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let operations = documented_operations(&doc);
    assert!(operations.len() > 40, "{}", operations.len());
    for (method, path, operation) in operations {
        assert!(
            operation["responses"]["403"]["content"]["application/json"].is_object(),
            "{method} {path}"
        );
        let req = bare_request(&c, &s, method, path);
        let r = req.header("host", "evil.example").send().await.unwrap();
        assert_eq!(r.status(), 403, "{method} {path}");
    }
    s.stop().await.unwrap();
    open.stop().await.unwrap();
}

/// Every operation of an OpenAPI document: (method, path, operation).
fn documented_operations(doc: &Value) -> Vec<(&str, &str, &Value)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            out.push((method.as_str(), path.as_str(), operation));
        }
    }
    out
}

/// A request for a documented operation: its path with the test model's
/// name, and an empty JSON body where it is a POST.
fn bare_request(
    c: &reqwest::Client,
    s: &Server,
    method: &str,
    path: &str,
) -> reqwest::RequestBuilder {
    let url = s.url(&path.replace("{model}", "fake-model"));
    match method {
        "get" => c.get(url),
        "post" => c.post(url).json(&json!({})),
        other => panic!("{other} {path}"),
    }
}

/// The document's security is the key check's: with `--api-key`, every
/// operation the document does not exempt (`security: []`) answers a request
/// without the key 401, with `WWW-Authenticate` and a body of the shape its
/// 401 names; the exempt probes answer without one.
#[tokio::test]
async fn the_documented_security_is_the_api_keys() {
    let args = ServerArgs {
        api_key: Some("sekret".into()),
        ..test_args()
    };
    let s = Server::start(args).await;
    let c = client();
    let doc: Value = c
        .get(s.url("/openapi.json"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let schemas = &doc["components"]["schemas"];
    let mut guarded = 0;
    for (method, path, operation) in documented_operations(&doc) {
        let r = bare_request(&c, &s, method, path).send().await.unwrap();
        let status = r.status().as_u16();
        if operation["security"] == json!([]) {
            assert_ne!(status, 401, "{method} {path}");
            continue;
        }
        guarded += 1;
        assert_eq!(status, 401, "{method} {path}");
        assert_eq!(r.headers()["www-authenticate"], "Bearer", "{method} {path}");
        let body: Value = r.json().await.unwrap();
        let declared = operation["responses"]["401"]["content"]["application/json"]["schema"]
            ["$ref"]
            .as_str()
            .unwrap();
        let schema = &schemas[declared.rsplit('/').next().unwrap()];
        // The body's fields are the schema's, each a string where the
        // schema says so and an object where it names another schema.
        let fields = body.as_object().unwrap();
        let mut required: Vec<&str> = schema["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        required.sort_unstable();
        let mut present: Vec<&str> = fields.keys().map(String::as_str).collect();
        present.sort_unstable();
        assert_eq!(present, required, "{method} {path}: {body} vs {declared}");
        for (name, value) in fields {
            let property = &schema["properties"][name];
            let is_string = property["type"] == "string";
            assert_eq!(
                value.is_string(),
                is_string,
                "{method} {path}: {name} of {body} vs {declared}"
            );
        }
    }
    assert!(guarded > 40, "{guarded}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn ops_routes() {
    let s = Server::default().await;
    let c = client();
    let r = c.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "ok");

    let v: Value = c
        .get(s.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "fake-model");
    assert_eq!(v["data"][0]["object"], "model");
    // The same list without the version prefix (Infinity's path).
    let bare: Value = c
        .get(s.url("/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(bare["data"], v["data"]);

    let v: Value = c
        .get(s.url("/info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["model"], "fake-model");
    assert_eq!(v["dimension"], DIM);
    assert_eq!(v["max_input_tokens"], MAX_TOKENS);
    assert_eq!(v["details"]["dtype"], "float32");
    assert_eq!(v["details"]["blas"], "none");
    assert_eq!(v["batching"]["max_batch_size"], 64);
    // Both budgets: the core's per model call, the engine's per device pass.
    assert_eq!(v["batching"]["max_batch_tokens"], 8192);
    assert_eq!(v["batching"]["device_batch_tokens"], 256);
    assert_eq!(v["kind"], "embedding");
    assert_eq!(v["vocab_size"], VOCAB);
    assert_eq!(v["prompts"]["query"], "query: ");
    assert_eq!(v["default_prompt_name"], Value::Null);
    // The fake model's side: ModelInfo's default, right.
    assert_eq!(v["truncation_direction"], "right");
    assert_eq!(v["models"][0]["truncation_direction"], "right");
    assert!(v["details"].get("vocab_size").is_none(), "{v}");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    // TEI's names for the same facts, and the ones only TEI has.
    assert_eq!(v["served_model_name"], "fake-model");
    let cpus = std::thread::available_parallelism().unwrap().get();
    assert_eq!(v["tokenization_workers"], cpus);
    assert_eq!(
        (&v["sha"], &v["docker_label"]),
        (&Value::Null, &Value::Null)
    );

    let r = c.get(s.url("/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let doc: Value = r.json().await.unwrap();
    for path in [
        "/api/v1/embed",
        "/v1/embeddings",
        "/embed",
        "/api/embed",
        "/api/embeddings",
        "/api/tags",
        "/api/ps",
        "/api/show",
        "/api/pull",
        "/health",
        "/metrics",
        "/info",
        "/v1/models",
        "/pooling",
        "/classify",
        "/version",
        "/invocations",
        "/ping",
        "/vertex",
    ] {
        assert!(doc["paths"].get(path).is_some(), "openapi lacks {path}");
    }
    assert!(doc["components"]["schemas"]
        .get("OpenAiEmbeddingRequest")
        .is_some());

    // Some traffic, then metrics.
    post(&s, "/embed", &json!({ "inputs": ["a", "b"] })).await;
    expect_error(&s, "/embed", Shape::Tei, &json!({ "inputs": [] }), 400).await;
    let r = c.get(s.url("/metrics")).send().await.unwrap();
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = r.text().await.unwrap();
    for name in [
        "mlx_embed_http_requests_total{route=\"/embed\",code=\"200\"} 1",
        "mlx_embed_http_requests_total{route=\"/embed\",code=\"400\"} 1",
        "mlx_embed_http_request_duration_seconds_bucket{route=\"/embed\",le=\"+Inf\"} 2",
        "mlx_embed_waiting_inputs ",
        "mlx_embed_queued_inputs ",
        "mlx_embed_in_flight_inputs ",
        "mlx_embed_batch_size_bucket{le=\"+Inf\"}",
        "mlx_embed_batch_tokens_count",
        "mlx_embed_queue_wait_seconds_sum",
        "mlx_embed_gil_wait_seconds_count",
        "mlx_embed_model_seconds_bucket",
        "mlx_embed_padding_ratio ",
        "mlx_embed_inputs_cancelled_total ",
        "mlx_embed_batcher_requests_total{outcome=\"ok\"} 1",
    ] {
        assert!(text.contains(name), "metrics lack {name}:\n{text}");
    }
    // Unknown route and wrong method: JSON errors.
    let r = c.get(s.url("/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    error_message(Shape::Native, &r.json().await.unwrap());
    let r = c.get(s.url("/v1/embeddings")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let body: Value = r.json().await.unwrap();
    error_message(Shape::OpenAi, &body);
    // The route exists: a wrong method is a bad request, not a missing thing.
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let r = c.get(s.url("/embed")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error_type"], "Validation", "{body}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn request_ids_are_echoed_or_generated() {
    let s = Server::default().await;
    let c = client();
    let r = c
        .get(s.url("/health"))
        .header("x-request-id", "my-id-42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "my-id-42");
    let a = c.get(s.url("/health")).send().await.unwrap().headers()["x-request-id"].clone();
    let b = c.get(s.url("/health")).send().await.unwrap().headers()["x-request-id"].clone();
    assert_ne!(a, b);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn served_model_name_overrides() {
    let s = Server::start(ServerArgs {
        served_model_name: Some("public-name".into()),
        ..test_args()
    })
    .await;
    let (_, _, v) = post(&s, "/v1/embeddings", &json!({ "input": "x" })).await;
    assert_eq!(v["model"], "public-name");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn warm_up_runs_one_max_length_text_before_serving() {
    // The test model allows 64 tokens, under the warm-up's cap of 512 words.
    let s = Server::start(ServerArgs {
        no_warmup: false,
        max_batch_size: Some(4),
        ..test_args()
    })
    .await;
    // One batch of one text of exactly the maximum length went through the
    // model (the fake's live figures: its batches, its padded tokens).
    let live = s.batcher.live_stats().expect("the fake reports");
    assert_eq!(live.details().unwrap()["batches_run"], "1");
    assert_eq!(
        live.memory().unwrap().peak_bytes,
        MAX_TOKENS as u64 * FAKE_BYTES_PER_TOKEN
    );
    // The metrics count clients' work: the warm-up is the server's, and so
    // is its vector, which is not left in the cache.
    let m = s.batcher.metrics();
    assert_eq!(
        (m.requests_ok, m.batches, m.real_tokens),
        (0, 0, 0),
        "{m:?}"
    );
    assert_eq!(
        (m.cache.entries, m.cache.bytes, m.cache.misses),
        (0, 0, 0),
        "{m:?}"
    );
    let (status, _, _) = post(&s, "/v1/embeddings", &json!({ "input": "x" })).await;
    assert_eq!(status, 200);
    let m = s.batcher.metrics();
    assert_eq!(
        (m.requests_ok, m.batches, m.cache.misses),
        (1, 1, 1),
        "{m:?}"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn graceful_shutdown_answers_accepted_requests() {
    let s = Server::default().await;
    let url = s.url("/embed");
    let in_flight = tokio::spawn(async move {
        let r = client()
            .post(url)
            .json(&json!({ "inputs": "slow request" }))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    s.wait_in_flight(1).await;
    let batcher = s.batcher.clone();
    let base = s.base.clone();
    let started = std::time::Instant::now();
    s.stop().await.expect("serve returns Ok after shutdown");
    assert!(started.elapsed() < Duration::from_secs(4));
    let (status, v) = in_flight.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_close(&floats(&v[0]), &unit_vector(&text("slow request")));
    // Batcher closed; no more connections accepted.
    assert!(!batcher.is_healthy());
    assert!(client().get(format!("{base}/health")).send().await.is_err());
}

#[tokio::test]
async fn drain_timeout_bounds_shutdown() {
    let s = Server::start(ServerArgs {
        drain_timeout_secs: 0,
        ..test_args()
    })
    .await;
    let url = s.url("/embed");
    let in_flight = tokio::spawn(async move {
        client()
            .post(url)
            .json(&json!({ "inputs": "slow" }))
            .send()
            .await
    });
    s.wait_in_flight(1).await;
    let started = std::time::Instant::now();
    s.stop()
        .await
        .expect("serve returns Ok after the drain timeout");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    let _ = in_flight.await;
}

/// Requests the high, normal and low lanes each saw (their queue-wait counts).
fn lane_counts(s: &Server) -> Vec<u64> {
    s.batcher
        .metrics()
        .lanes
        .iter()
        .map(|l| l.queue_wait_seconds.count)
        .collect()
}

#[tokio::test]
async fn priority_header_and_body_pick_the_lane_on_every_route() {
    let s = Server::start(ServerArgs {
        no_cache: true,
        ..test_args()
    })
    .await;
    let cases: [(&str, Value, Option<&str>, usize); 9] = [
        ("/api/v1/embed", json!({"texts": ["q"]}), Some("high"), 0),
        ("/v1/embeddings", json!({"input": "q"}), Some("LOW"), 2),
        ("/embed", json!({"inputs": "q"}), Some("High"), 0),
        ("/api/embed", json!({"input": "q"}), Some("normal"), 1),
        (
            "/v1/embeddings",
            json!({"input": "q", "priority": -3}),
            None,
            0,
        ),
        (
            "/v1/embeddings",
            json!({"input": "q", "priority": 0}),
            Some("high"),
            1,
        ),
        (
            "/v1/embeddings",
            json!({"input": "q", "priority": 7}),
            None,
            2,
        ),
        (
            "/api/v1/embed",
            json!({"texts": ["q"], "priority": "low"}),
            Some("high"),
            2,
        ),
        ("/api/v1/embed", json!({"texts": ["q"]}), None, 1),
    ];
    for (path, body, header, lane) in cases {
        let before = lane_counts(&s);
        let mut req = client().post(s.url(path)).json(&body);
        if let Some(h) = header {
            req = req.header("X-Priority", h);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{path} {body} {header:?}");
        let mut want = before.clone();
        want[lane] += 1;
        assert_eq!(lane_counts(&s), want, "{path} {body} {header:?}");
    }
    for path in ["/api/v1/embed", "/v1/embeddings", "/embed", "/api/embed"] {
        let body = json!({"texts": ["q"], "input": "q", "inputs": "q"});
        let r = client()
            .post(s.url(path))
            .header("X-Priority", "urgent")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{path}");
        let v: Value = r.json().await.unwrap();
        assert!(v.to_string().contains("X-Priority"), "{path}: {v}");
    }
    // Two header lines are one of both values (RFC 9110), so two priorities:
    // refused as the comma-joined line is, not the first one taken.
    for (lines, shown) in [
        (&["high", "low"][..], r#""high, low""#),
        (&["high", "high"][..], r#""high, high""#),
    ] {
        let mut req = client().post(s.url("/api/v1/embed"));
        for line in lines {
            req = req.header("X-Priority", *line);
        }
        let r = req.json(&json!({"texts": ["q"]})).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "{lines:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(
            v["error"]["message"],
            format!("X-Priority must be high, normal or low, not {shown}"),
            "{v}"
        );
    }
    // A body priority wins over a valid header only: a malformed one is a
    // client bug, refused whatever the body says.
    let r = client()
        .post(s.url("/v1/embeddings"))
        .header("X-Priority", "urgent")
        .json(&json!({"input": "q", "priority": -1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let (status, _, _) = post(
        &s,
        "/v1/embeddings",
        &json!({"input": "q", "priority": "high"}),
    )
    .await;
    assert_eq!(status, 400);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn usage_counts_cache_hits() {
    let s = Server::start(test_args()).await;
    let body = json!({"texts": ["cached once", "cached once", "other"]});
    let (_, _, first) = post(&s, "/api/v1/embed", &body).await;
    assert_eq!(first["usage"]["cache_hits"], 1, "{first}");
    let (_, _, second) = post(&s, "/api/v1/embed", &body).await;
    assert_eq!(second["usage"]["cache_hits"], 3, "{second}");
    assert_eq!(first["embeddings"], second["embeddings"]);
    assert_eq!(
        first["usage"]["prompt_tokens"],
        second["usage"]["prompt_tokens"]
    );
    let (_, _, openai) = post(&s, "/v1/embeddings", &json!({"input": ["other"]})).await;
    assert_eq!(openai["usage"]["cache_hits"], 1, "{openai}");
    let metrics = client()
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "mlx_embed_cache_hits_total 5",
        "mlx_embed_cache_misses_total 2",
        "mlx_embed_cache_entries 2",
        "mlx_embed_lane_queued_inputs{priority=\"high\"} 0",
        "mlx_embed_lane_queue_wait_seconds_count{priority=\"normal\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} missing");
    }
    s.stop().await.unwrap();
}

/// The model's live figures are read when asked: `/info` and `/metrics`
/// follow the fake's memory batch by batch (ids: marker, one per byte, end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_metrics_show_live_model_memory() {
    let s = Server::default().await;
    let c = client();
    let memory_of = |v: &Value| {
        let m = &v["memory"];
        (
            m["active_bytes"].as_u64().unwrap(),
            m["cache_bytes"].as_u64().unwrap(),
            m["peak_bytes"].as_u64().unwrap(),
            m["cache_limit_bytes"].as_u64().unwrap(),
        )
    };
    let info = || async {
        c.get(s.url("/info"))
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };

    let v = info().await;
    assert_eq!(
        memory_of(&v),
        (0, FAKE_CACHE_BYTES, 0, FAKE_CACHE_LIMIT),
        "{v}"
    );
    assert_eq!(v["details"]["batches_run"], "0");
    // The load-time details are still there beside the live ones, and win.
    assert_eq!(v["details"]["dtype"], "float32");

    // 5 tokens ("abc" + 2 markers), then 3 ("a" + 2): active follows the
    // last batch, peak keeps the highest.
    assert_eq!(
        post(&s, "/embed", &json!({ "inputs": ["abc"] })).await.0,
        200
    );
    assert_eq!(post(&s, "/embed", &json!({ "inputs": ["a"] })).await.0, 200);
    let v = info().await;
    let (active, peak) = (3 * FAKE_BYTES_PER_TOKEN, 5 * FAKE_BYTES_PER_TOKEN);
    assert_eq!(
        memory_of(&v),
        (active, FAKE_CACHE_BYTES, peak, FAKE_CACHE_LIMIT),
        "{v}"
    );
    assert_eq!(v["details"]["batches_run"], "2");

    let text = c
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "# TYPE mlx_embed_mlx_memory_bytes gauge".to_string(),
        format!("mlx_embed_mlx_memory_bytes{{kind=\"active\"}} {active}"),
        format!("mlx_embed_mlx_memory_bytes{{kind=\"cache\"}} {FAKE_CACHE_BYTES}"),
        format!("mlx_embed_mlx_memory_bytes{{kind=\"peak\"}} {peak}"),
        format!("mlx_embed_mlx_memory_bytes{{kind=\"cache_limit\"}} {FAKE_CACHE_LIMIT}"),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "/metrics lacks {line:?}:\n{text}"
        );
    }
    s.stop().await.unwrap();
}

/// `/embed_all`'s answer as floats: per input, per token, one row.
fn token_rows(v: &Value) -> Vec<Vec<Vec<f32>>> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list: {v}"))
        .iter()
        .map(|rows| rows.as_array().unwrap().iter().map(floats).collect())
        .collect()
}

#[tokio::test]
async fn embed_all_returns_every_token_row() {
    use mlx_embed_core::Tokenize;
    let s = Server::default().await;
    let inputs = ["hello world", "z"];
    let (status, _, v) = post(&s, "/embed_all", &json!({ "inputs": inputs })).await;
    assert_eq!(status, 200, "{v}");
    let got = token_rows(&v);
    assert_eq!(got.len(), 2);
    for (t, rows) in inputs.iter().zip(&got) {
        let ids = encode(&text(t)).ids;
        // One raw (unnormalized) row per token, markers included, of the
        // model's row width (not its pooled dimension).
        assert_eq!(rows.len(), ids.len(), "{t}");
        assert_eq!(rows, &token_rows_of_ids(&ids), "{t}");
        assert!(rows.iter().all(|r| r.len() == TOKEN_WIDTH));
    }

    // A single string is a list of one; prompt and truncation side reach the tokenizer.
    let long = "0123456789".repeat(10);
    let (status, _, v) = post(
        &s,
        "/embed_all",
        &json!({ "inputs": long, "prompt_name": "query", "truncation_direction": "Left" }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let want = mlx_embed_core::EmbedOptions {
        prompt: mlx_embed_core::Prompt::Named("query".into()),
        truncation_direction: Some(mlx_embed_core::TruncationDirection::Left),
        ..Default::default()
    };
    let ids = FakeTokenizer
        .encode(&text(&long), &want)
        .expect("the fake encodes it")
        .ids;
    assert_eq!(ids.len(), MAX_TOKENS);
    assert_eq!(token_rows(&v), vec![token_rows_of_ids(&ids)]);

    // Bad input: the same codes as /embed.
    let msg = expect_error(
        &s,
        "/embed_all",
        Shape::Tei,
        &json!({ "inputs": [long], "truncate": false }),
        422,
    )
    .await;
    assert!(msg.contains("input 0"), "{msg}");
    expect_error(&s, "/embed_all", Shape::Tei, &json!({ "inputs": [] }), 400).await;
    expect_error(
        &s,
        "/embed_all",
        Shape::Tei,
        &json!({ "inputs": [""] }),
        400,
    )
    .await;
    expect_error(
        &s,
        "/embed_all",
        Shape::Tei,
        &json!({ "inputs": [true] }),
        422,
    )
    .await;
    expect_error(&s, "/embed_all", Shape::Tei, &json!({ "text": "a" }), 422).await;
    let msg = expect_error(
        &s,
        "/embed_all",
        Shape::Tei,
        &json!({ "inputs": "a", "prompt_name": "nope" }),
        400,
    )
    .await;
    assert!(msg.contains("nope"), "{msg}");
    let r = client()
        .post(s.url("/embed_all"))
        .header("X-Priority", "urgent")
        .json(&json!({ "inputs": "a" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);

    // Per-token rows never touch the embedding cache (pooled vectors only).
    let metrics = client()
        .get(s.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "mlx_embed_cache_hits_total 0",
        "mlx_embed_cache_misses_total 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} missing");
    }
    let (_, _, again) = post(&s, "/embed_all", &json!({ "inputs": inputs })).await;
    assert_eq!(token_rows(&again), got);

    let doc: Value = client()
        .get(s.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        doc["paths"]["/embed_all"]["post"].is_object(),
        "openapi lacks /embed_all"
    );
    s.stop().await.unwrap();
}

/// `/embed_sparse` over a model that is not SPLADE (the fake): a 400 in TEI's
/// shape naming what it needs, after the request's own checks; listed in the
/// OpenAPI document. (Its answers are checked end to end against the real
/// engine's SPLADE fixture in tests/e2e/test_embed_sparse.py.)
#[tokio::test]
async fn embed_sparse_needs_a_splade_model() {
    let s = Server::default().await;
    let msg = expect_error(
        &s,
        "/embed_sparse",
        Shape::Tei,
        &json!({ "inputs": "a" }),
        400,
    )
    .await;
    assert!(msg.contains("a sparse model"), "{msg}");
    expect_error(
        &s,
        "/embed_sparse",
        Shape::Tei,
        &json!({ "inputs": [] }),
        400,
    )
    .await;
    expect_error(
        &s,
        "/embed_sparse",
        Shape::Tei,
        &json!({ "inputs": [""] }),
        400,
    )
    .await;
    expect_error(
        &s,
        "/embed_sparse",
        Shape::Tei,
        &json!({ "text": "a" }),
        422,
    )
    .await;
    let doc: Value = client()
        .get(s.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ok = &doc["paths"]["/embed_sparse"]["post"]["responses"]["200"];
    assert!(ok.is_object(), "openapi lacks /embed_sparse");
    s.stop().await.unwrap();
}

/// Ollama's listings and legacy route over a model that does not describe
/// its weights (the fake): listed under `:latest`, sizes 0, no family.
#[tokio::test]
async fn ollama_listings_and_legacy_embeddings() {
    let s = Server::default().await;
    let get = |path: &'static str| {
        let url = s.url(path);
        async move {
            let r = client().get(url).send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200, "{path}");
            r.json::<Value>().await.unwrap()
        }
    };
    let tags = get("/api/tags").await;
    let listed = &tags["models"].as_array().unwrap()[..];
    assert_eq!(listed.len(), 1, "{tags}");
    assert_eq!(listed[0]["name"], "fake-model:latest");
    assert_eq!(listed[0]["model"], "fake-model:latest");
    assert_eq!(listed[0]["size"], 0);
    assert_eq!(listed[0]["details"]["family"], "");
    assert_eq!(listed[0]["details"]["families"], json!([]));
    // The Ollama API version served, not this server's (0.1.0 would read
    // as too old an Ollama to clients that check a minimum).
    assert_eq!(get("/api/version").await, json!({ "version": "0.12.0" }));
    let ps = get("/api/ps").await;
    assert_eq!(ps["models"][0]["context_length"], MAX_TOKENS);
    assert_eq!(ps["models"][0]["size_vram"], 0);
    // Ollama's digest: hex SHA-256, the same in both listings.
    let digest = listed[0]["digest"].as_str().expect("a digest string");
    assert_eq!(digest.len(), 64, "{digest}");
    assert!(
        digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
        "{digest}"
    );
    assert_eq!(ps["models"][0]["digest"], digest);

    let (status, _, shown) = post(&s, "/api/show", &json!({ "name": "fake-model:latest" })).await;
    assert_eq!(status, 200, "{shown}");
    assert_eq!(
        shown["model_info"],
        json!({ "general.architecture": "", "general.context_length": MAX_TOKENS,
                "general.embedding_length": DIM })
    );
    assert_eq!(shown["capabilities"], json!(["embedding"]));

    // The legacy route answers the vector before normalization.
    let (status, _, legacy) = post(&s, "/api/embeddings", &json!({ "prompt": "abc" })).await;
    assert_eq!(status, 200, "{legacy}");
    let (_, _, raw) = post(
        &s,
        "/api/v1/embed",
        &json!({ "texts": ["abc"], "normalize": false }),
    )
    .await;
    assert_eq!(floats(&legacy["embedding"]), floats(&raw["embeddings"][0]));
    // No prompt, or an empty one, answers an empty embedding, as Ollama does.
    for empty in [
        json!({ "prompt": "" }),
        json!({ "model": "m" }),
        json!({ "prompt": null }),
    ] {
        let (status, _, v) = post(&s, "/api/embeddings", &empty).await;
        assert_eq!((status, &v), (200, &json!({ "embedding": [] })), "{empty}");
    }
    expect_error(
        &s,
        "/api/embeddings",
        Shape::Ollama,
        &json!({ "prompt": 3 }),
        400,
    )
    .await;
    expect_error(&s, "/api/show", Shape::Ollama, &json!({ "model": 3 }), 400).await;
    // As Ollama: the model is required, even where one is served.
    expect_error(&s, "/api/show", Shape::Ollama, &json!({}), 400).await;
    expect_error(&s, "/api/show", Shape::Ollama, &json!({ "model": "" }), 400).await;
    expect_error(
        &s,
        "/api/show",
        Shape::Ollama,
        &json!({ "model": "", "name": "" }),
        400,
    )
    .await;
    // Both set (a client filling the old field too): `model` is the one read.
    for both in [
        json!({ "model": "fake-model", "name": "fake-model" }),
        json!({ "model": "", "name": "fake-model:latest" }),
    ] {
        let (status, _, v) = post(&s, "/api/show", &both).await;
        assert_eq!(
            (status, &v["capabilities"]),
            (200, &json!(["embedding"])),
            "{both}"
        );
    }
    // Pull: the served model is there already, so the answer is Ollama's last
    // line, as one object (`stream: false`) or one JSON line (its default).
    let pulled = json!({ "status": "success" });
    let (status, headers, v) = post(
        &s,
        "/api/pull",
        &json!({ "model": "fake-model:latest", "stream": false }),
    )
    .await;
    assert_eq!((status, &v), (200, &pulled));
    assert_eq!(headers["content-type"], "application/json");
    for b in [
        json!({ "model": "fake-model" }),
        json!({ "name": "fake-model", "stream": true }),
    ] {
        let r = client()
            .post(s.url("/api/pull"))
            .json(&b)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{b}");
        assert_eq!(r.headers()["content-type"], "application/x-ndjson", "{b}");
        assert_eq!(r.text().await.unwrap(), "{\"status\":\"success\"}\n", "{b}");
    }
    // Ollama's liveness probe (its CLI's `HEAD /`, tools' `GET /`).
    let r = client().get(s.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "Ollama is running");
    let r = client().head(s.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "");
    expect_error(&s, "/api/pull", Shape::Ollama, &json!({}), 400).await;
    expect_error(&s, "/api/pull", Shape::Ollama, &json!({ "model": 3 }), 400).await;
    // A route of Ollama's this server does not serve answers in its shape.
    expect_error(
        &s,
        "/api/generate",
        Shape::Ollama,
        &json!({ "model": "m" }),
        404,
    )
    .await;
    s.stop().await.unwrap();
}

/// Ollama's clients tell models apart, and notice a changed one, by digest:
/// it is the same on every start and differs between models.
#[tokio::test]
async fn ollama_digest_is_stable_and_tells_models_apart() {
    async fn digest(s: &Server) -> String {
        let r = client().get(s.url("/api/tags")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let v: Value = r.json().await.unwrap();
        v["models"][0]["digest"].as_str().unwrap().to_owned()
    }
    let first = Server::default().await;
    let before = digest(&first).await;
    first.stop().await.unwrap();
    let again = Server::default().await;
    assert_eq!(digest(&again).await, before);
    again.stop().await.unwrap();
    let reranker = scorer_server(FakeScorer::reranker).await;
    let other = digest(&reranker).await;
    assert_eq!(other.len(), 64);
    assert_ne!(other, before);
    reranker.stop().await.unwrap();
}

/// `--cors-allow-origin`: a listed origin's preflight is answered without the
/// API key and its requests (a 401 too) carry the CORS headers; any other
/// origin, and every origin on a server without the flag, gets none.
#[tokio::test]
async fn cors_lets_only_listed_origins_read_answers() {
    const ORIGIN: &str = "http://app.example";
    async fn preflight(s: &Server, origin: &str) -> reqwest::Response {
        client()
            .request(reqwest::Method::OPTIONS, s.url("/v1/embeddings"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            // What the OpenAI and Cohere SDKs send from a browser: their own
            // headers besides the API's.
            .header(
                "access-control-request-headers",
                "content-type,authorization,x-stainless-os,x-fern-language",
            )
            .send()
            .await
            .unwrap()
    }
    let allow_origin = |r: &reqwest::Response| {
        r.headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let args = ServerArgs {
        api_key: Some("sekret".into()),
        cors_allow_origin: vec![ORIGIN.into()],
        ..test_args()
    };
    let s = Server::start(args).await;
    let r = preflight(&s, ORIGIN).await;
    assert_eq!(r.status(), 200);
    assert_eq!(allow_origin(&r).as_deref(), Some(ORIGIN));
    let allowed = r.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap();
    for header in [
        "content-type",
        "authorization",
        "x-stainless-os",
        "x-fern-language",
    ] {
        assert!(allowed.contains(header), "{header} not in {allowed}");
    }
    assert_eq!(
        allow_origin(&preflight(&s, "http://other.example").await),
        None
    );

    let send = |key: Option<&'static str>| {
        let mut req = client()
            .post(s.url("/v1/embeddings"))
            .header("origin", ORIGIN)
            .json(&json!({ "input": "abc" }));
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        req.send()
    };
    let denied = send(None).await.unwrap();
    assert_eq!(denied.status(), 401);
    assert_eq!(allow_origin(&denied).as_deref(), Some(ORIGIN));
    let ok = send(Some("sekret")).await.unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(allow_origin(&ok).as_deref(), Some(ORIGIN));
    let exposed = ok.headers()["access-control-expose-headers"]
        .to_str()
        .unwrap();
    assert!(exposed.contains("x-request-id"), "{exposed}");
    // TEI's timing headers too, so a page's script reads them.
    assert!(exposed.contains("x-compute-tokens"), "{exposed}");
    s.stop().await.unwrap();

    let plain = Server::default().await;
    let r = preflight(&plain, ORIGIN).await;
    assert_eq!(r.status(), 405);
    assert_eq!(allow_origin(&r), None);
    plain.stop().await.unwrap();
}

/// Weaviate's `text2vec-transformers` API: a single text posted without a
/// content type (as Weaviate sends it), a batch, `task_type` picking the
/// model's prompt, and the probes, which need no API key.
#[tokio::test]
async fn weaviate_vectors_meta_and_probes() {
    let args = ServerArgs {
        api_key: Some("sekret".into()),
        ..test_args()
    };
    let s = Server::start(args).await;
    let c = client();
    let send = |body: &'static str| {
        c.post(s.url("/vectors"))
            .header("authorization", "Bearer sekret")
            .body(body)
            .send()
    };
    let one = send(r#"{"text": "abc", "config": {"pooling_strategy": "masked_mean"}}"#)
        .await
        .unwrap();
    assert_eq!(one.status(), 200);
    let one: Value = one.json().await.unwrap();
    assert_eq!(one["text"], "abc");
    assert_eq!(one["dims"], DIM);
    let native = |body: Value| {
        let req = c
            .post(s.url("/api/v1/embed"))
            .header("authorization", "Bearer sekret")
            .json(&body)
            .send();
        async move { req.await.unwrap().json::<Value>().await.unwrap() }
    };
    let plain = native(json!({ "texts": ["abc", "de"] })).await;
    assert_eq!(floats(&one["vector"]), floats(&plain["embeddings"][0]));

    let batch: Value = send(r#"{"texts": ["abc", "de"], "config": {"task_type": "query"}}"#)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let query = native(json!({ "texts": ["abc", "de"], "prompt_name": "query" })).await;
    assert_eq!(batch["dims"], DIM);
    assert_eq!(
        vectors(Shape::Native, &json!({ "embeddings": batch["vectors"] })),
        vectors(Shape::Native, &query)
    );
    let passage: Value =
        send(r#"{"texts": ["abc"], "config": {"task_type": "passage", "dimensions": 4}}"#)
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    assert_eq!(passage["dims"], 4);

    for (body, status) in [
        (r#"{"config": {}}"#, 400),
        (r#"{"text": "a", "texts": ["b"]}"#, 400),
        (r#"{"text": ""}"#, 400),
        (r#"{"text": "a", "config": {"task_type": "both"}}"#, 422),
        (r#"{"text": "a""#, 400),
    ] {
        let r = send(body).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
        assert!(v["error"].is_string(), "{v}");
    }
    let denied = c
        .post(s.url("/vectors"))
        .body(r#"{"text": "a"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 401);

    for probe in ["/.well-known/live", "/.well-known/ready"] {
        assert_eq!(
            c.get(s.url(probe)).send().await.unwrap().status(),
            204,
            "{probe}"
        );
    }
    let meta: Value = c
        .get(s.url("/meta"))
        .header("authorization", "Bearer sekret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(meta["model"]["name"], "fake-model");
    assert_eq!(meta["model"]["dimension"], DIM);
    s.stop().await.unwrap();
}

/// Ollama's server reads a body as JSON whatever its `Content-Type`, and the
/// curl lines in its docs send curl's default form type: every Ollama route
/// that takes a body does the same. The other APIs keep their 415.
#[tokio::test]
async fn ollama_routes_read_any_body_as_json() {
    let s = Server::default().await;
    for (path, raw) in [
        (
            "/api/embed",
            r#"{"model":"all-minilm","input":"Why is the sky blue?"}"#,
        ),
        (
            "/api/embeddings",
            r#"{"model":"all-minilm","prompt":"Why is the sky blue?"}"#,
        ),
        ("/api/show", r#"{"model":"all-minilm"}"#),
    ] {
        for content_type in [
            Some("application/x-www-form-urlencoded"),
            Some("text/plain"),
            None,
        ] {
            let mut req = client().post(s.url(path)).body(raw);
            if let Some(t) = content_type {
                req = req.header("content-type", t);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status().as_u16(), 200, "{path} {content_type:?}");
        }
    }
    let (status, v) = post_raw(
        &s,
        "/api/embed",
        "application/x-www-form-urlencoded",
        r#"{"model":"m","input":"a"}"#,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(v["embeddings"].as_array().unwrap().len(), 1);
    for (path, body) in [
        ("/v1/embeddings", r#"{"input":"a"}"#),
        ("/embed", r#"{"inputs":"a"}"#),
        ("/api/v1/embed", r#"{"texts":["a"]}"#),
    ] {
        let (status, v) = post_raw(&s, path, "application/x-www-form-urlencoded", body).await;
        assert_eq!(status, 415, "{path}: {v}");
    }
    s.stop().await.unwrap();
}

/// A compressed body is refused on every route, before its JSON is read:
/// 415, `Accept-Encoding: identity`, a message naming the coding, in the
/// route's error shape. `identity` is no compression.
#[tokio::test]
async fn compressed_bodies_are_refused_with_415() {
    let s = Server::default().await;
    let message = "request bodies must not be compressed (Content-Encoding: gzip)";
    // Path, body, error shape, status of the same body uncompressed.
    let mut routes: Vec<(&str, Value, Shape, u16)> = ROUTES
        .iter()
        .map(|&(path, shape)| (path, body(shape, json!(["a"])), shape, 200))
        .collect();
    routes.extend([
        (
            "/v1/score",
            json!({"text_1": "a", "text_2": "b"}),
            Shape::OpenAi,
            200,
        ),
        // The fake's tokenizer cannot decode: 400, after the body was read.
        ("/decode", json!({"ids": [1, 2]}), Shape::Tei, 400),
        ("/api/show", json!({"model": "m"}), Shape::Ollama, 200),
    ]);
    for (path, b, shape, uncompressed) in &routes {
        let send = |coding: &'static str| {
            client()
                .post(s.url(path))
                .header("content-encoding", coding)
                .json(b)
                .send()
        };
        let r = send("gzip").await.unwrap();
        assert_eq!(r.status().as_u16(), 415, "{path}");
        assert_eq!(r.headers()["accept-encoding"], "identity", "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(error_message(*shape, &v), message, "{path}");
        let r = send("identity").await.unwrap();
        assert_eq!(r.status().as_u16(), *uncompressed, "{path}");
    }
    let r = client()
        .post(s.url("/vectors"))
        .header("content-encoding", "br")
        .body(r#"{"text": "a"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 415);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"error": "request bodies must not be compressed (Content-Encoding: br)"})
    );
    s.stop().await.unwrap();
}

/// RFC 8259 section 8.1 lets a JSON parser ignore a leading byte order mark;
/// Windows tools write one. Only one is skipped.
#[tokio::test]
async fn a_leading_byte_order_mark_is_skipped() {
    let s = Server::default().await;
    for (path, shape) in ROUTES {
        let plain = serde_json::to_vec(&body(shape, json!(["abc"]))).unwrap();
        let with_bom = [b"\xEF\xBB\xBF".as_slice(), &plain].concat();
        let (status, v) = post_raw(&s, path, "application/json", with_bom).await;
        assert_eq!(status, 200, "{path}: {v}");
        let (_, want) = post_raw(&s, path, "application/json", plain.clone()).await;
        assert_eq!(vectors(shape, &v), vectors(shape, &want), "{path}");
        let twice = [b"\xEF\xBB\xBF\xEF\xBB\xBF".as_slice(), &plain].concat();
        let (status, v) = post_raw(&s, path, "application/json", twice).await;
        assert_eq!(status, 400, "{path}: {v}");
    }
    let r = client()
        .post(s.url("/vectors"))
        .body(b"\xEF\xBB\xBF{\"text\": \"abc\"}".as_slice())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    s.stop().await.unwrap();
}

/// Token ids that are not ids get a message saying what to send, not the
/// name of a Rust type.
#[tokio::test]
async fn decode_refuses_bad_ids_readably() {
    let s = Server::default().await;
    for ids in [json!([-1]), json!([[1], 2]), json!("1 2")] {
        let msg = expect_error(&s, "/decode", Shape::Tei, &json!({ "ids": ids }), 422).await;
        assert!(
            msg.starts_with(
                "Failed to deserialize the JSON body into the target type: ids: ids must be a \
                 list of token ids (non-negative integers) or a list of such lists"
            ),
            "{ids}: {msg}"
        );
        assert!(!msg.contains("untagged"), "{msg}");
    }
    s.stop().await.unwrap();
}

/// vLLM's score route takes `truncate` as the embed routes do: false refuses
/// an over-long text with 400 (as vLLM answers), naming its list (`param`), its place there and
/// its token count.
#[tokio::test]
async fn score_honours_truncate_false() {
    let s = Server::default().await;
    let long = "word ".repeat(100); // 127 tokens > 64
    let long_tokens = untruncated_tokens(&text(&long));
    let pairs = json!({ "text_1": "short", "text_2": ["short", long] });
    let (status, _, v) = post(&s, "/v1/score", &pairs).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 2 * 7 + MAX_TOKENS, "{v}");
    for (b, param, index) in [
        (
            json!({ "text_1": "short", "text_2": ["short", long], "truncate": false }),
            "text_2",
            1,
        ),
        (
            json!({ "text_1": [long, "short"], "text_2": ["a", "b"], "truncate": false }),
            "text_1",
            0,
        ),
    ] {
        let (status, _, v) = post(&s, "/v1/score", &b).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(
            v["error"],
            json!({
                "message": format!(
                    "input {index} has {long_tokens} tokens, more than the model's maximum of \
                     {MAX_TOKENS}; shorten it or set truncate to true"
                ),
                "type": "invalid_request_error",
                "param": param,
                "code": "context_length_exceeded",
            })
        );
    }
    let (status, _, _) = post(
        &s,
        "/score",
        &json!({ "text_1": "a", "text_2": long, "truncate": true }),
    )
    .await;
    assert_eq!(status, 200);
    s.stop().await.unwrap();
}

/// vLLM's other names for the two lists, each as good as `text_1` and
/// `text_2` (which is why the document's `ScoreBody` requires neither).
#[tokio::test]
async fn score_takes_vllms_other_names_for_its_lists() {
    let s = Server::default().await;
    let (status, _, want) = post(
        &s,
        "/v1/score",
        &json!({ "text_1": "a", "text_2": ["b", "c"] }),
    )
    .await;
    assert_eq!(status, 200, "{want}");
    for b in [
        json!({ "queries": "a", "documents": ["b", "c"] }),
        json!({ "queries": "a", "items": ["b", "c"] }),
        json!({ "data_1": "a", "data_2": ["b", "c"] }),
    ] {
        let (status, _, v) = post(&s, "/v1/score", &b).await;
        assert_eq!(status, 200, "{b}: {v}");
        assert_eq!(v["data"], want["data"], "{b}");
    }
    // A list under two names, or a list missing: the schema cannot say it.
    for b in [
        json!({ "text_1": "a", "queries": "a", "text_2": "b" }),
        json!({ "queries": "a" }),
    ] {
        expect_error(&s, "/v1/score", Shape::OpenAi, &b, 400).await;
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn score_counts_both_lists_against_the_input_limit() {
    let s = Server::start(ServerArgs {
        max_inputs_per_request: 3,
        ..test_args()
    })
    .await;
    let (status, _, v) = post(
        &s,
        "/v1/score",
        &json!({ "text_1": "a", "text_2": ["b", "c"] }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    // Both lists went to the model as one request.
    assert_eq!(s.batcher.metrics().requests_ok, 1);
    let (status, _, v) = post(
        &s,
        "/v1/score",
        &json!({ "text_1": ["a", "b"], "text_2": ["c", "d"] }),
    )
    .await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(
        v["error"]["message"],
        "4 texts in text_1 and text_2 together is more than the limit of 3 per request \
         (--max-inputs-per-request); split the request"
    );
    assert_eq!(v["error"]["param"], "text_2");
    s.stop().await.unwrap();
}

/// Softmax of several `logits`: the scoring path's own function.
fn softmax(logits: &[f32]) -> Vec<f32> {
    assert!(logits.len() > 1, "one logit is a sigmoid");
    let mut v = logits.to_vec();
    mlx_embed_core::activate(&mut v);
    v
}

fn sigmoid(x: f32) -> f32 {
    let mut v = [x];
    mlx_embed_core::activate(&mut v);
    v[0]
}

#[tokio::test]
async fn vllm_version_and_pooling_answer_as_vllm() {
    let s = Server::default().await;
    let r = client().get(s.url("/version")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({ "version": env!("CARGO_PKG_VERSION") })
    );

    let (status, _, v) = post(&s, "/pooling", &json!({ "input": ["a", "bc"] })).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("pooling-"), "{v}");
    assert_eq!(v["object"], "list");
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000, "{v}");
    assert_eq!(v["model"], "fake-model");
    for (i, t) in ["a", "bc"].into_iter().enumerate() {
        assert_eq!(v["data"][i]["index"], i);
        assert_eq!(v["data"][i]["object"], "pooling");
        assert_close(&floats(&v["data"][i]["data"]), &unit_vector(&text(t)));
    }
    // Marker, bytes, end marker: 3 + 4 tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    assert_eq!(v["usage"]["total_tokens"], 7);

    // base64: little-endian float32 bytes; use_activation false: unnormalized;
    // token ids; dimensions as /v1/embeddings cuts them.
    let (status, _, v) = post(
        &s,
        "/pooling",
        &json!({ "input": "a", "encoding_format": "base64", "use_activation": false }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v["data"][0]["data"].as_str().unwrap())
        .unwrap();
    let got: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got, raw_vector(&text("a")));
    // vLLM's endianness: big-endian bytes on request, on both routes; an
    // unknown value is a 400.
    for path in ["/pooling", "/v1/embeddings"] {
        let (status, _, v) = post(
            &s,
            path,
            &json!({ "input": "a", "encoding_format": "base64", "endianness": "big" }),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        let field = if path == "/pooling" {
            "data"
        } else {
            "embedding"
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(v["data"][0][field].as_str().unwrap())
            .unwrap();
        let got: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_be_bytes(b.try_into().unwrap()))
            .collect();
        assert_close(&got, &unit_vector(&text("a")));
        let (status, _, v) = post(&s, path, &json!({ "input": "a", "endianness": "middle" })).await;
        assert_eq!(status, 400, "{v}");
    }
    // Everything /v1/embeddings reads: a named prompt, truncation off.
    let with_prompt = json!({ "input": "a", "prompt_name": "query" });
    let (_, _, pooled) = post(&s, "/pooling", &with_prompt).await;
    assert_close(
        &floats(&pooled["data"][0]["data"]),
        &unit_vector(&text("query: a")),
    );
    let (status, _, v) = post(
        &s,
        "/pooling",
        &json!({ "input": "a", "prompt_name": "bogus" }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let long = "x".repeat(MAX_TOKENS + 5);
    let (status, _, v) = post(&s, "/pooling", &json!({ "input": long, "truncate": false })).await;
    assert_eq!(status, 400, "{v}");
    let (status, _, v) = post(
        &s,
        "/pooling",
        &json!({ "input": [[5, 6]], "dimensions": 3 }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let mut want = raw_vector(&EmbedInput::Tokens(vec![5, 6]));
    want.truncate(3);
    mlx_embed_core::l2_normalize(&mut want);
    assert_close(&floats(&v["data"][0]["data"]), &want);

    // What it cannot answer: 400 in vLLM's (OpenAI's) shape.
    let e = expect_error(
        &s,
        "/pooling",
        Shape::OpenAi,
        &json!({ "input": "a", "task": "token_embed" }),
        400,
    )
    .await;
    assert!(e.contains("task \"token_embed\" is not supported"), "{e}");
    expect_error(
        &s,
        "/pooling",
        Shape::OpenAi,
        &json!({ "inputs": "a" }),
        400,
    )
    .await;
    let (_, _, v) = post(
        &s,
        "/pooling",
        &json!({ "input": "a", "truncate_prompt_tokens": -2 }),
    )
    .await;
    assert_eq!(v["error"]["param"], "truncate_prompt_tokens", "{v}");
    assert_eq!(
        v["error"]["message"],
        "truncate_prompt_tokens must be at least 1 token (special tokens included), not -2 \
         (or -1: the model's maximum)"
    );
    let (status, _, v) = post(
        &s,
        "/pooling",
        &json!({ "input": "abc", "truncate_prompt_tokens": 3, "use_activation": false }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let got: Vec<f32> = serde_json::from_value(v["data"][0]["data"].clone()).unwrap();
    assert_close(&got, &raw_vector(&text("a")));

    // No classifier served: a 400 that says what the route needs.
    let (status, _, v) = post(&s, "/classify", &json!({ "input": "good" })).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "model", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("needs a classifier or reranker"),
        "{message}"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn vllm_classify_answers_label_probabilities() {
    let s = scorer_server(FakeScorer::classifier).await;
    // truncate: false refuses an over-long input, at the request's cut too.
    let long = "x".repeat(MAX_TOKENS + 5);
    let (status, _, v) = post(
        &s,
        "/classify",
        &json!({ "input": long, "truncate": false }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let body = json!({ "input": "abcdef", "truncate": false, "truncate_prompt_tokens": 4 });
    let (status, _, v) = post(&s, "/classify", &body).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("input 0 has 8 tokens, more than the request's cut of 4"),
        "{v}"
    );
    let texts = ["good", "bad"];
    let (status, _, v) = post(&s, "/classify", &json!({ "input": texts })).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("classify-"), "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "fake-classifier");
    for (i, t) in texts.into_iter().enumerate() {
        let probs = softmax(&scorer_logits(&text(t), 3));
        let best = (0..3).fold(0, |b, j| if probs[j] > probs[b] { j } else { b });
        let d = &v["data"][i];
        assert_eq!(d["index"], i);
        assert_eq!(d["num_classes"], 3);
        assert_eq!(d["label"], CLASSIFIER_LABELS[best], "{d}");
        assert_close(&floats(&d["probs"]), &probs);
    }
    assert_eq!(v["usage"]["prompt_tokens"], 11);

    // use_activation false (and vLLM's older softmax false): raw logits.
    for off in ["use_activation", "softmax"] {
        let (status, _, v) = post(&s, "/classify", &json!({ "input": "good", off: false })).await;
        assert_eq!(status, 200, "{v}");
        assert_close(
            &floats(&v["data"][0]["probs"]),
            &scorer_logits(&text("good"), 3),
        );
    }
    // A classifier has no vectors to pool.
    let (status, _, v) = post(&s, "/pooling", &json!({ "input": "good" })).await;
    assert_eq!(status, 400, "{v}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn infinity_classify_body_gets_infinitys_shape() {
    let s = scorer_server(FakeScorer::classifier).await;
    let texts = ["good", "bad"];
    // vLLM's answer for the same inputs, to hold Infinity's scores against.
    let (status, _, vllm) = post(&s, "/classify", &json!({ "input": texts })).await;
    assert_eq!(status, 200, "{vllm}");
    // What Infinity's client sends: `raw_scores` always, its default model name.
    for raw in [false, true] {
        let body = json!({ "input": texts, "model": "default/not-specified", "raw_scores": raw });
        let (status, _, v) = post(&s, "/classify", &body).await;
        assert_eq!(status, 200, "{v}");
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["created", "data", "id", "model", "object", "usage"],
            "{v}"
        );
        assert_eq!(v["object"], "classify");
        assert_eq!(v["model"], "fake-classifier");
        assert!(v["id"].as_str().unwrap().starts_with("classify-"), "{v}");
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], 11);
        assert_eq!(v["usage"]["total_tokens"], 11);
        let data = v["data"].as_array().unwrap();
        assert_eq!(data.len(), texts.len(), "{v}");
        for (i, t) in texts.into_iter().enumerate() {
            let logits = scorer_logits(&text(t), 3);
            let expected = if raw {
                logits.clone()
            } else {
                softmax(&logits)
            };
            let entries = data[i].as_array().unwrap();
            assert_eq!(entries.len(), CLASSIFIER_LABELS.len(), "{v}");
            // Every label once, best first, each with its label's score.
            let mut order: Vec<usize> = (0..3).collect();
            order.sort_by(|&a, &b| expected[b].total_cmp(&expected[a]));
            for (entry, &label) in entries.iter().zip(&order) {
                let mut keys: Vec<&str> = entry
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(String::as_str)
                    .collect();
                keys.sort_unstable();
                assert_eq!(keys, ["label", "score"], "{entry}");
                assert_eq!(entry["label"], CLASSIFIER_LABELS[label], "{v}");
                assert_close(
                    &[entry["score"].as_f64().unwrap() as f32],
                    &[expected[label]],
                );
                if !raw {
                    // The very number vLLM's shape gives for that label.
                    assert_eq!(entry["score"], vllm["data"][i]["probs"][label], "{v}");
                }
            }
            let scores: Vec<f64> = entries
                .iter()
                .map(|e| e["score"].as_f64().unwrap())
                .collect();
            assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
        }
    }
    // A body without `raw_scores` keeps vLLM's shape.
    let (status, _, v) = post(&s, "/classify", &json!({ "input": "good", "model": "x" })).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["num_classes"], 3, "{v}");
    assert_close(
        &floats(&v["data"][0]["probs"]),
        &softmax(&scorer_logits(&text("good"), 3)),
    );
    // Errors keep the OpenAI shape: a wrong `raw_scores`, an empty input.
    let (status, _, v) = post(
        &s,
        "/classify",
        &json!({ "input": ["a"], "raw_scores": "yes" }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("raw_scores"),
        "{v}"
    );
    let (status, _, v) = post(
        &s,
        "/classify",
        &json!({ "input": [], "raw_scores": false }),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn sagemaker_and_vertex_answer_with_the_models_route() {
    // An embedding model: /embed's answer.
    let s = Server::default().await;
    let embed = json!({ "inputs": ["a", "b"] });
    let (status, _, v) = post(&s, "/invocations", &embed).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, post(&s, "/embed", &embed).await.2);
    assert_close(&vectors(Shape::Tei, &v)[1], &unit_vector(&text("b")));
    let r = client().get(s.url("/ping")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "ok");

    let (status, _, v) = post(
        &s,
        "/vertex",
        &json!({ "instances": [{ "inputs": "a" }, { "inputs": ["b", "c"], "normalize": false }] }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let predictions = v["predictions"].as_array().unwrap();
    assert_eq!(predictions.len(), 2, "{v}");
    assert_close(&floats(&predictions[0][0]), &unit_vector(&text("a")));
    assert_close(&floats(&predictions[1][1]), &raw_vector(&text("c")));
    let (status, _, v) = post(&s, "/vertex", &json!({ "instances": [] })).await;
    assert_eq!((status, v), (200, json!({ "predictions": [] })));
    // Instances of one model, truncation and prompt run as one request (its
    // turns in the lane are one caller's, not one per instance), whatever
    // their normalize and dimensions; another prompt runs beside it.
    let before = s.batcher.metrics().requests_ok;
    let instances: Vec<Value> = (0..6)
        .map(|i| json!({ "inputs": format!("t{i}") }))
        .chain([
            json!({ "inputs": ["u", "v"], "normalize": false, "dimensions": 4 }),
            json!({ "inputs": "w", "prompt_name": "query" }),
        ])
        .collect();
    let (status, _, v) = post(&s, "/vertex", &json!({ "instances": instances })).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(s.batcher.metrics().requests_ok - before, 2);
    for i in 0..6 {
        assert_close(
            &floats(&v["predictions"][i][0]),
            &unit_vector(&text(&format!("t{i}"))),
        );
    }
    assert_close(
        &floats(&v["predictions"][6][1]),
        &raw_vector(&text("v"))[..4],
    );
    assert_close(
        &floats(&v["predictions"][7][0]),
        &unit_vector(&text("query: w")),
    );
    // An empty instance is refused as /embed refuses it, merged or not.
    for instances in [
        json!([{ "inputs": "a" }, { "inputs": [] }]),
        json!([{ "inputs": [] }]),
    ] {
        let e = expect_error(
            &s,
            "/vertex",
            Shape::Tei,
            &json!({ "instances": instances }),
            400,
        )
        .await;
        assert!(e.contains("input is empty"), "{e}");
    }
    // An error names the instance it is about.
    let e = expect_error(
        &s,
        "/vertex",
        Shape::Tei,
        &json!({ "instances": [{ "inputs": "a" }, { "inputs": ["b", ""] }] }),
        400,
    )
    .await;
    assert!(e.starts_with("instance 1: input 1"), "{e}");
    // An instance of the wrong shape, or a rerank body for an embedding
    // model, fails the request in TEI's shape.
    expect_error(
        &s,
        "/vertex",
        Shape::Tei,
        &json!({ "instances": [{ "inputs": "a" }, { "text": "b" }] }),
        422,
    )
    .await;
    let e = expect_error(
        &s,
        "/vertex",
        Shape::Tei,
        &json!({ "instances": [{ "query": "q", "texts": ["d"] }] }),
        400,
    )
    .await;
    assert!(e.contains("needs a reranker"), "{e}");
    expect_error(&s, "/invocations", Shape::Tei, &json!({ "text": "a" }), 422).await;
    s.stop().await.unwrap();

    // A classifier: /predict's.
    let s = scorer_server(FakeScorer::classifier).await;
    let predict = json!({ "inputs": [["good"], ["bad"]] });
    let (status, _, v) = post(&s, "/invocations", &predict).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, post(&s, "/predict", &predict).await.2);
    let probs = softmax(&scorer_logits(&text("bad"), 3));
    let top = v[1][0]["score"].as_f64().unwrap() as f32;
    assert!(
        (top - probs.iter().copied().fold(0.0, f32::max)).abs() < 1e-6,
        "{v}"
    );
    let (status, _, v) = post(&s, "/vertex", &json!({ "instances": [predict] })).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["predictions"][0], post(&s, "/predict", &predict).await.2);
    s.stop().await.unwrap();

    // A reranker: /rerank's, in both of its forms; a Vertex instance that is
    // not a rerank body is /predict's.
    let s = scorer_server(FakeScorer::reranker).await;
    let pair = |q: &str, d: &str| EmbedInput::Pair {
        query: q.into(),
        document: d.into(),
    };
    let rerank = json!({ "query": "q", "texts": ["a", "b"], "return_text": true });
    let (status, _, v) = post(&s, "/invocations", &rerank).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, post(&s, "/rerank", &rerank).await.2);
    let ranked = v.as_array().unwrap();
    let index = ranked[0]["index"].as_u64().unwrap() as usize;
    let want = sigmoid(scorer_logits(&pair("q", ["a", "b"][index]), 1)[0]);
    assert!(
        (ranked[0]["score"].as_f64().unwrap() as f32 - want).abs() < 1e-6,
        "{v}"
    );
    assert_eq!(ranked[0]["text"], ["a", "b"][index]);
    let (status, _, v) = post(
        &s,
        "/invocations",
        &json!({ "query": "q", "documents": ["a"], "return_documents": true }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "rerank", "{v}");
    assert_eq!(v["results"][0]["document"], "a", "{v}");
    let (status, _, v) = post(
        &s,
        "/vertex",
        &json!({ "instances": [rerank, { "inputs": ["q", "a"] }] }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["predictions"][0], post(&s, "/rerank", &rerank).await.2);
    let score = v["predictions"][1][0]["score"].as_f64().unwrap() as f32;
    assert!(
        (score - sigmoid(scorer_logits(&pair("q", "a"), 1)[0])).abs() < 1e-6,
        "{v}"
    );
    assert_eq!(v["predictions"][1][0]["label"], "LABEL_0");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn rerank_documents_form_answers_infinitys_shape_when_it_asks() {
    let s = scorer_server(FakeScorer::reranker).await;
    // Infinity's opt-in: documents back as the strings sent, with its `object` and `created`.
    let (status, _, v) = post(
        &s,
        "/rerank",
        &json!({ "query": "q", "documents": ["a", "b"], "return_documents": true }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "rerank");
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("rerank-"), "{v}");
    let results = v["results"].as_array().unwrap();
    for r in results {
        let index = r["index"].as_u64().unwrap() as usize;
        assert_eq!(r["document"], ["a", "b"][index], "{v}");
    }
    assert_eq!(v["usage"]["total_tokens"], v["usage"]["prompt_tokens"]);
    // vLLM's requests (no return_documents): documents as `{"text": ...}`, as vLLM answers.
    let (_, _, v) = post(&s, "/rerank", &json!({ "query": "q", "documents": ["a"] })).await;
    assert_eq!(v["results"][0]["document"], json!({ "text": "a" }), "{v}");
    // An object document comes back as sent; false: none.
    let (_, _, v) = post(
        &s,
        "/rerank",
        &json!({ "query": "q", "documents": [{ "text": "a", "id": 7 }], "return_documents": true }),
    )
    .await;
    assert_eq!(
        v["results"][0]["document"],
        json!({ "text": "a", "id": 7 }),
        "{v}"
    );
    let (_, _, v) = post(
        &s,
        "/rerank",
        &json!({ "query": "q", "documents": ["a"], "return_documents": false }),
    )
    .await;
    assert!(v["results"][0].get("document").is_none(), "{v}");
    // /v1/rerank keeps Cohere's shape, and TEI's form TEI's.
    let (_, _, v) = post(
        &s,
        "/v1/rerank",
        &json!({ "query": "q", "documents": ["a"], "return_documents": true }),
    )
    .await;
    assert_eq!(v["results"][0]["document"], json!({ "text": "a" }), "{v}");
    assert!(
        v.get("object").is_none() && v.get("created").is_none(),
        "{v}"
    );
    let (_, _, v) = post(&s, "/rerank", &json!({ "query": "q", "texts": ["a"] })).await;
    assert_eq!(
        v.as_array().unwrap()[0].as_object().unwrap().len(),
        2,
        "{v}"
    );
    s.stop().await.unwrap();
}

/// The body Voyage AI's client (`voyageai.Client.embed`) posts: every field, nulls included.
fn voyage_body(inputs: Value) -> Value {
    json!({
        "input": inputs,
        "model": "voyage-3.5",
        "input_type": null,
        "truncation": true,
        "output_dtype": null,
        "output_dimension": null,
        "encoding_format": "base64",
    })
}

/// Little-endian float32 base64, as Voyage's client decodes it (numpy `float32`).
fn b64_floats(v: &Value) -> Vec<f32> {
    base64::engine::general_purpose::STANDARD
        .decode(v.as_str().unwrap())
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test]
async fn voyage_input_type_picks_the_prompt_prompt_name_picks() {
    use mlx_embed_core::{EmbedOptions, Prompt};
    let s = Server::default().await;
    let named = |name: &str| EmbedOptions {
        prompt: Prompt::Named(name.into()),
        ..EmbedOptions::default()
    };
    // The fake has `query` and `passage` prompts: Voyage's `document` (and
    // NIM's `passage`) is the passage prompt.
    for (input_type, prompt) in [
        ("query", "query"),
        ("document", "passage"),
        ("passage", "passage"),
    ] {
        for path in ["/v1/embeddings", "/embeddings"] {
            let mut b = voyage_body(json!(["rivers", "lakes"]));
            b["input_type"] = json!(input_type);
            let (status, _, v) = post(&s, path, &b).await;
            assert_eq!(status, 200, "{path}: {v}");
            let mut by_name = voyage_body(json!(["rivers", "lakes"]));
            by_name["prompt_name"] = json!(prompt);
            let (_, _, want) = post(&s, path, &by_name).await;
            for i in 0..2 {
                assert_eq!(v["data"][i]["embedding"], want["data"][i]["embedding"]);
            }
            assert_eq!(
                b64_floats(&v["data"][0]["embedding"]),
                unit_with("rivers", &named(prompt))
            );
            assert_eq!(v["usage"]["total_tokens"], want["usage"]["total_tokens"]);
        }
    }
    // null: the default prompt (none for the fake), as without the field.
    let (_, _, v) = post(&s, "/v1/embeddings", &voyage_body(json!(["rivers"]))).await;
    assert_eq!(
        b64_floats(&v["data"][0]["embedding"]),
        unit_vector(&text("rivers"))
    );
    let mut both = voyage_body(json!(["rivers"]));
    both["input_type"] = json!("query");
    both["prompt_name"] = json!("query");
    let msg = expect_error(&s, "/v1/embeddings", Shape::OpenAi, &both, 400).await;
    assert_eq!(msg, "give either prompt_name or input_type, not both");
    let mut bad = voyage_body(json!(["rivers"]));
    bad["input_type"] = json!("image");
    let msg = expect_error(&s, "/v1/embeddings", Shape::OpenAi, &bad, 400).await;
    assert!(
        msg.contains("unknown variant `image`, expected one of `query`, `document`, `passage`"),
        "{msg}"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn voyage_output_dimension_and_truncation_are_dimensions_and_truncate() {
    let s = Server::default().await;
    let mut expected = raw_vector(&text("dims"));
    expected.truncate(3);
    mlx_embed_core::l2_normalize(&mut expected);
    let mut b = voyage_body(json!(["dims"]));
    b["output_dimension"] = json!(3);
    let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(b64_floats(&v["data"][0]["embedding"]), expected);
    // Both names: equal is fine, different a 400.
    b["dimensions"] = json!(3);
    let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(b64_floats(&v["data"][0]["embedding"]), expected);
    b["dimensions"] = json!(4);
    let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(
        v["error"],
        json!({
            "message": "dimensions (4) and output_dimension (3) are the same setting and disagree: send one",
            "type": "invalid_request_error",
            "param": "output_dimension",
            "code": null,
        })
    );
    let mut zero = voyage_body(json!(["dims"]));
    zero["output_dimension"] = json!(0);
    let msg = expect_error(&s, "/v1/embeddings", Shape::OpenAi, &zero, 400).await;
    assert_eq!(
        msg,
        format!("output_dimension must be between 1 and the model's dimension {DIM}, got 0")
    );

    // truncation: false refuses an over-long input, as truncate: false does, in its own words.
    let long = "word ".repeat(100); // 127 tokens > 64
    let long_tokens = untruncated_tokens(&text(&long));
    let mut b = voyage_body(json!(["short", long]));
    let (status, _, cut) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(status, 200, "{cut}");
    assert_eq!(cut["usage"]["total_tokens"], 7 + MAX_TOKENS);
    b["truncation"] = json!(false);
    let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(
        v["error"],
        json!({
            "message": format!(
                "input 1 has {long_tokens} tokens, more than the model's maximum of \
                 {MAX_TOKENS}; shorten it or set truncation to true"
            ),
            "type": "invalid_request_error",
            "param": null,
            "code": "context_length_exceeded",
        })
    );
    b["truncate"] = json!(true);
    let msg = expect_error(&s, "/v1/embeddings", Shape::OpenAi, &b, 400).await;
    assert_eq!(
        msg,
        "truncate (true) and truncation (false) are the same setting and disagree: send one"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn voyage_output_dtypes_answer_the_quantized_unit_vector() {
    let s = Server::default().await;
    let unit = unit_vector(&text("quantize me"));
    let int8: Vec<i64> = unit.iter().map(|x| (x * 127.0).round() as i64).collect();
    let uint8: Vec<i64> = int8.iter().map(|x| x + 128).collect();
    // The fake's DIM is 8: one byte of sign bits, the first component highest.
    let bits = |v: &[f32]| -> i64 {
        v.iter()
            .enumerate()
            .filter(|(_, x)| **x > 0.0)
            .map(|(i, _)| 0x80 >> i)
            .sum()
    };
    let ubinary = vec![bits(&unit)];
    let binary = vec![ubinary[0] - 128];
    assert!(int8.iter().any(|&x| x < 0) && int8.iter().any(|&x| x > 0));
    for (dtype, want) in [
        ("int8", &int8),
        ("uint8", &uint8),
        ("binary", &binary),
        ("ubinary", &ubinary),
    ] {
        // JSON numbers without encoding_format.
        let b = json!({ "input": "quantize me", "output_dtype": dtype });
        let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
        assert_eq!(status, 200, "{dtype}: {v}");
        let got: Vec<i64> = v["data"][0]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        assert_eq!(&got, want, "{dtype}");
        // Base64 of the bytes, as Voyage's client decodes them (numpy int8 or uint8).
        let mut b = voyage_body(json!(["quantize me"]));
        b["output_dtype"] = json!(dtype);
        let (status, _, v) = post(&s, "/v1/embeddings", &b).await;
        assert_eq!(status, 200, "{dtype}: {v}");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(v["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        let decoded: Vec<i64> = if dtype == "int8" || dtype == "binary" {
            bytes.iter().map(|&b| b as i8 as i64).collect()
        } else {
            bytes.iter().map(|&b| b as i64).collect()
        };
        assert_eq!(&decoded, want, "{dtype} base64");
    }
    // float is the float vector, in either encoding.
    let mut b = voyage_body(json!(["quantize me"]));
    b["output_dtype"] = json!("float");
    let (_, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(b64_floats(&v["data"][0]["embedding"]), unit);
    // Bits of a cut vector: a byte per eight components, the last padded with zeros.
    let mut cut = raw_vector(&text("quantize me"));
    cut.truncate(5);
    let b = json!({ "input": "quantize me", "output_dtype": "ubinary", "output_dimension": 5 });
    let (_, _, v) = post(&s, "/v1/embeddings", &b).await;
    assert_eq!(v["data"][0]["embedding"], json!([bits(&cut)]));
    // Quantizing assumes a unit vector; another dtype is a 400 that names the ones served.
    for (b, want) in [
        (
            json!({ "input": "x", "output_dtype": "int8", "use_activation": false }),
            "output_dtype other than float quantizes the unit vector: it cannot be combined \
             with use_activation (or normalize, normalized) false",
        ),
        (
            json!({ "input": "x", "embedding_type": "binary", "normalized": false }),
            "embedding_type other than float quantizes the unit vector",
        ),
        (
            json!({ "input": "x", "output_dtype": "int4" }),
            "unknown variant `int4`, expected one of `float`, `int8`, `uint8`, `binary`, `ubinary`",
        ),
    ] {
        let msg = expect_error(&s, "/v1/embeddings", Shape::OpenAi, &b, 400).await;
        assert!(msg.contains(want), "{msg}");
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn voyage_client_defaults_answer_as_the_openai_body_does() {
    let s = Server::default().await;
    // Voyage's fields, all null (truncation true), change nothing.
    let (status, _, voyage) = post(&s, "/v1/embeddings", &voyage_body(json!(["a", "b"]))).await;
    assert_eq!(status, 200, "{voyage}");
    let (_, _, openai) = post(
        &s,
        "/v1/embeddings",
        &json!({ "input": ["a", "b"], "model": "voyage-3.5", "encoding_format": "base64" }),
    )
    .await;
    assert_eq!(voyage["data"], openai["data"]);
    assert_eq!(
        voyage["usage"]["total_tokens"],
        openai["usage"]["total_tokens"]
    );
    // And an OpenAI body answers floats, as it always has.
    let (_, _, v) = post(&s, "/v1/embeddings", &json!({ "input": "a" })).await;
    assert_eq!(floats(&v["data"][0]["embedding"]), unit_vector(&text("a")));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn voyage_rerank_body_gets_voyages_shape() {
    let s = scorer_server(FakeScorer::reranker).await;
    let docs = ["alpha", "beta gamma", "delta", "epsilon zeta eta"];
    let scores: Vec<f32> = docs
        .iter()
        .map(|d| {
            let pair = EmbedInput::Pair {
                query: "q".into(),
                document: (*d).into(),
            };
            sigmoid(scorer_logits(&pair, 1)[0])
        })
        .collect();
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    // What `voyageai.Client.rerank` posts: top_k and truncation always, no return_documents.
    let voyage = json!({ "query": "q", "documents": docs, "model": "rerank-2.5", "top_k": 2, "truncation": true });
    let (_, _, cohere) = post(
        &s,
        "/v1/rerank",
        &json!({ "query": "q", "documents": docs }),
    )
    .await;
    for path in ["/v1/rerank", "/rerank"] {
        let (status, _, v) = post(&s, path, &voyage).await;
        assert_eq!(status, 200, "{path}: {v}");
        assert_eq!(v["object"], "list");
        assert_eq!(v["model"], "fake-reranker");
        assert!(v.get("results").is_none() && v.get("id").is_none(), "{v}");
        let data = v["data"].as_array().unwrap();
        assert_eq!(data.len(), 2, "{v}");
        for (r, &want) in data.iter().zip(&order) {
            assert_eq!(r.as_object().unwrap().len(), 2, "{v}");
            assert_eq!(r["index"], want);
            assert_eq!(r["relevance_score"].as_f64().unwrap() as f32, scores[want]);
        }
        assert_eq!(v["usage"]["total_tokens"], cohere["usage"]["total_tokens"]);
        // return_documents: the strings sent; top_k null: all.
        let mut b = voyage.clone();
        b["top_k"] = Value::Null;
        b["return_documents"] = json!(true);
        let (status, _, v) = post(&s, path, &b).await;
        assert_eq!(status, 200, "{path}: {v}");
        let got: Vec<(u64, &str)> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["index"].as_u64().unwrap(),
                    r["document"].as_str().unwrap(),
                )
            })
            .collect();
        let want: Vec<(u64, &str)> = order.iter().map(|&i| (i as u64, docs[i])).collect();
        assert_eq!(got, want);
        // truncation alone marks the body too.
        let (_, _, v) = post(
            &s,
            path,
            &json!({ "query": "q", "documents": docs, "truncation": null }),
        )
        .await;
        assert_eq!(v["data"].as_array().unwrap().len(), docs.len(), "{v}");
        let mut b = voyage.clone();
        b["top_k"] = json!(0);
        let msg = expect_error(&s, path, Shape::OpenAi, &b, 400).await;
        assert_eq!(msg, "top_k must be at least 1 (or null: all), got 0");
        // truncation: false refuses an over-long pair.
        let long = "word ".repeat(100);
        let b = json!({ "query": "q", "documents": ["a", long], "truncation": false });
        let (status, _, v) = post(&s, path, &b).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with("input 1 has ")
                && msg.ends_with("; shorten it or set truncation to true"),
            "{msg}"
        );
        let mut b = voyage.clone();
        b["truncation"] = json!(false);
        let (status, _, _) = post(&s, path, &b).await;
        assert_eq!(status, 200);
    }
    // Cohere's body is answered as before: its shape, and its parse errors with their position.
    let (_, _, v) = post(
        &s,
        "/v1/rerank",
        &json!({ "query": "q", "documents": ["a"] }),
    )
    .await;
    assert_eq!(v["results"][0]["document"], json!({ "text": "a" }), "{v}");
    assert!(v.get("data").is_none(), "{v}");
    let msg = expect_error(
        &s,
        "/v1/rerank",
        Shape::OpenAi,
        &json!({ "query": "q" }),
        400,
    )
    .await;
    assert_eq!(
        msg,
        "Failed to deserialize the JSON body into the target type: missing field `documents` at line 1 column 13"
    );
    s.stop().await.unwrap();
}

/// TEI's timing headers on every embed route's answer, from one place: the
/// request's exact tokens (its usage) and characters, phases within the
/// total; none on a refusal or a route that runs no model call.
#[tokio::test]
async fn every_embed_route_answers_with_teis_timing_headers() {
    let s = Server::default().await;
    let inputs = json!(["héllo", "a longer second text"]);
    let (status, _, openai) =
        post(&s, "/v1/embeddings", &body(Shape::OpenAi, inputs.clone())).await;
    assert_eq!(status, 200, "{openai}");
    let usage = openai["usage"]["prompt_tokens"].as_u64().unwrap();
    let number = |h: &reqwest::header::HeaderMap, name: &str| -> u64 {
        h[name].to_str().unwrap().parse().unwrap()
    };
    for (path, shape) in ROUTES {
        let (status, h, v) = post(&s, path, &body(shape, inputs.clone())).await;
        assert_eq!(status, 200, "{path}: {v}");
        // The fake model names no device.
        assert_eq!(h["x-compute-type"], "unknown", "{path}");
        assert_eq!(number(&h, "x-compute-tokens"), usage, "{path}");
        assert_eq!(number(&h, "x-compute-characters"), 5 + 20, "{path}");
        let total = number(&h, "x-total-time");
        assert_eq!(number(&h, "x-compute-time"), total, "{path}");
        let phases: u64 = ["x-tokenization-time", "x-queue-time", "x-inference-time"]
            .iter()
            .map(|n| number(&h, n))
            .sum();
        assert!(phases <= total, "{path}: {h:?}");
    }
    let (status, h, _) = post(&s, "/embed", &json!({"inputs": ""})).await;
    assert_eq!(status, 400);
    assert!(!h.contains_key("x-compute-tokens"), "{h:?}");
    // Whatever the fake's tokenizer answers, no model call ran.
    let (_, h, _) = post(&s, "/tokenize", &json!({"inputs": "abc"})).await;
    assert!(!h.contains_key("x-compute-tokens"), "{h:?}");
    s.stop().await.unwrap();
}

/// The cumulative count of `family`'s bucket with the largest bound at most
/// `seconds` (TEI's buckets: x1.5 steps from 15 us).
fn observed_at_most(metrics: &str, family: &str, seconds: f64) -> u64 {
    let prefix = format!("{family}_bucket{{le=\"");
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            Some((le.parse::<f64>().ok()?, count.parse::<u64>().ok()?))
        })
        .filter(|&(le, _)| le <= seconds)
        .map(|(_, count)| count)
        .max()
        .unwrap_or(0)
}

/// TEI charges each input its own batch's queue and model time, not its
/// request's average: a request split over two batches, one slow (the
/// fake's 600 ms) and one quick, shows one slow and one quick input.
#[tokio::test]
async fn each_input_is_charged_its_own_batch_s_queue_and_model_time() {
    let s = Server::start(ServerArgs {
        max_batch_size: Some(1),
        model_threads: 1,
        query_threads: Some(0),
        ..test_args()
    })
    .await;
    let (status, headers, _) = post(
        &s,
        "/embed",
        &json!({ "inputs": ["slow one", "quick two"] }),
    )
    .await;
    assert_eq!(status, 200);
    // The request's own figures: its first batch's queue, both batches' time.
    let ms = |h: &str| headers[h].to_str().unwrap().parse::<u64>().unwrap();
    assert!(ms("x-inference-time") >= 600, "{headers:?}");
    assert!(ms("x-queue-time") < 500, "{headers:?}");
    let metrics = get_text(&s, "/metrics").await;
    for family in ["te_embed_inference_duration", "te_embed_queue_duration"] {
        assert!(
            metrics.contains(&format!("\n{family}_count 2\n")),
            "{family}\n{metrics}"
        );
        // The slow input ran 600 ms and queued for none of it; the quick one
        // ran at once and queued while the slow one ran. A request's average
        // would put both near 300 ms.
        assert_eq!(
            observed_at_most(&metrics, family, 0.1),
            1,
            "{family}\n{metrics}"
        );
        assert_eq!(
            observed_at_most(&metrics, family, 0.5),
            1,
            "{family}\n{metrics}"
        );
    }
    // Both are charged the request's total, as before.
    assert_eq!(
        observed_at_most(&metrics, "te_embed_duration", 0.5),
        0,
        "{metrics}"
    );
    s.stop().await.unwrap();
}
