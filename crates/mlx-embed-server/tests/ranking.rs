//! Rankings order by the model's logits, not by the activated scores: a
//! float32 sigmoid is 1.0 for every logit over about 17, which tied a
//! reranker's clearly different best documents and left them in input order.

mod common;

use std::sync::Arc;

use common::*;
use mlx_embed_core::{
    BatchOutput, Batcher, Embedder, EmbedderError, Encoded, ModelInfo, ModelKind, Output, Tokenize,
};
use serde_json::{json, Value};

/// A reranker whose logit for a pair is 17 plus its token count: every one
/// of them a sigmoid of 1.0 in float32, and longer pairs rank higher.
struct Confident;

impl Embedder for Confident {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "confident".into(),
            kind: ModelKind::Reranker {
                labels: vec!["score".into()],
            },
            dim: 1,
            max_input_tokens: MAX_TOKENS,
            vocab_size: VOCAB as usize,
            ..ModelInfo::default()
        }
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(Arc::new(FakeTokenizer))
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        _output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        Ok(BatchOutput {
            vectors: inputs.iter().map(|e| 17.0 + e.len() as f32).collect(),
            rows: vec![1; inputs.len()],
            ..BatchOutput::default()
        })
    }
}

async fn post(server: &Server, path: &str, body: Value) -> Value {
    let r = client()
        .post(server.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{path}: {body}");
    body
}

/// The `index` of each ranked result, best first.
fn indices(results: &[Value]) -> Vec<u64> {
    results
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn saturated_scores_still_rank_by_logit() {
    let server = Server::start_with(test_args(), |config| {
        Batcher::start(config, || Ok(Confident)).unwrap()
    })
    .await;
    let documents = ["a", "a longer one", "mid doc"];
    let cohere = post(
        &server,
        "/v1/rerank",
        json!({"query": "q", "documents": documents}),
    )
    .await;
    let results = cohere["results"].as_array().unwrap();
    assert_eq!(indices(results), vec![1, 2, 0]);
    assert!(results.iter().all(|r| r["relevance_score"] == json!(1.0)));
    let tei = post(
        &server,
        "/rerank",
        json!({"query": "q", "texts": documents}),
    )
    .await;
    assert_eq!(indices(tei.as_array().unwrap()), vec![1, 2, 0]);
    server.stop().await.unwrap();
}
