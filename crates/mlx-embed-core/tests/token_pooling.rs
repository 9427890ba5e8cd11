//! Token pooling (`EmbedOptions::token_pooling`, PyLate's `pool_factor` on
//! a multi-vector model's documents): the batcher hands each input its own
//! request's pooling, so pooled and unpooled requests share a model call and
//! each gets its own rows; it refuses pooling anywhere but on documents.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, CoreError, EmbedOptions, Embedder, EmbedderError, Encoded,
    ModelInfo, MultiVectorLengths, Output, Side, TokenPooling, Tokenize,
};

/// Each call's inputs' pooling, in call order.
type Calls = Arc<Mutex<Vec<Vec<Option<TokenPooling>>>>>;

/// A ColBERT-like model one value wide: an input pooled by factor `f`
/// (protected `p`) answers `p + max((len - p) / f, 1)` rows of `f`, one not
/// pooled a row of 1 per token; each call's inputs' pooling is recorded.
struct Colbert {
    calls: Calls,
    gate: Arc<Gate>,
}

fn rows_for(len: usize, pooling: Option<TokenPooling>) -> (usize, f32) {
    match pooling {
        None => (len, 1.0),
        Some(TokenPooling { factor, protected }) => {
            let (f, p) = (factor as usize, (protected as usize).min(len));
            (p + ((len - p) / f).max(1).min(len - p), factor as f32)
        }
    }
}

impl Embedder for Colbert {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "colbert".into(),
            dim: 1,
            max_input_tokens: 64,
            vocab_size: 1003,
            multi_vector: Some(MultiVectorLengths {
                query: 64,
                document: 64,
            }),
            ..ModelInfo::default()
        }
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(Arc::new(FakeTokenizer))
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        assert!(matches!(output, Output::MultiVector(_)));
        self.calls
            .lock()
            .unwrap()
            .push(inputs.iter().map(|e| e.token_pooling).collect());
        self.gate.pass();
        let (mut vectors, mut rows) = (Vec::new(), Vec::new());
        for e in inputs {
            let (n, value) = rows_for(e.len(), e.token_pooling);
            rows.push(n as u32);
            vectors.extend(vec![value; n]);
        }
        Ok(BatchOutput {
            vectors,
            rows,
            ..BatchOutput::default()
        })
    }
}

fn start_colbert(gate: Arc<Gate>) -> (Batcher, Calls) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c = calls.clone();
    let batcher = Batcher::start(BatcherConfig::default(), move || {
        Ok(Colbert { calls: c, gate })
    })
    .unwrap();
    (batcher, calls)
}

fn documents(pooling: Option<TokenPooling>) -> EmbedOptions {
    EmbedOptions {
        output: Output::MultiVector(Side::Document),
        token_pooling: pooling,
        ..EmbedOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_and_unpooled_requests_share_a_call_each_with_its_own_rows() {
    let gate = Gate::closed();
    let (batcher, calls) = start_colbert(gate.clone());
    // The model holds a first call while the others queue behind it: they
    // then run as one call.
    let b = batcher.clone();
    let first = tokio::spawn(async move { b.embed(texts(&["first"]), documents(None)).await });
    eventually("first call on the model", || {
        calls.lock().unwrap().len() == 1
    })
    .await;
    let poolings = [
        None,
        Some(TokenPooling {
            factor: 2,
            protected: 1,
        }),
        Some(TokenPooling {
            factor: 3,
            protected: 0,
        }),
    ];
    let text = "a document of some thirty bytes";
    let mut handles = Vec::new();
    for pooling in poolings {
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            b.embed(texts(&[text, "short"]), documents(pooling)).await
        }));
    }
    eventually("all queued", || batcher.metrics().queued_inputs == 6).await;
    gate.open();
    first.await.unwrap().unwrap();
    for (h, pooling) in handles.into_iter().zip(poolings) {
        let got = tokio::time::timeout(LIMIT, h)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        for (i, t) in [text, "short"].iter().enumerate() {
            let (n, value) = rows_for(tokens_for(t) as usize, pooling);
            assert_eq!(got.row_counts[i] as usize, n, "{pooling:?} {t}");
            assert_eq!(got.vectors[i], vec![value; n], "{pooling:?} {t}");
            // The tokens run, as unpooled.
            assert_eq!(got.token_counts[i], tokens_for(t));
        }
    }
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 2, "{calls:?}");
    let mut second = calls[1].clone();
    second.sort_by_key(|p| p.map(|p| p.factor));
    assert_eq!(
        second,
        vec![
            None,
            None,
            poolings[1],
            poolings[1],
            poolings[2],
            poolings[2]
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooling_is_for_documents_only_and_pools_something() {
    let gate = Gate::closed();
    gate.open();
    let (batcher, calls) = start_colbert(gate);
    let two = Some(TokenPooling {
        factor: 2,
        protected: 1,
    });
    let query = EmbedOptions {
        output: Output::MultiVector(Side::Query),
        token_pooling: two,
        ..EmbedOptions::default()
    };
    let one = documents(Some(TokenPooling {
        factor: 1,
        protected: 1,
    }));
    for (options, words) in [
        (query, "documents only"),
        (one, "at least 2"),
        (
            EmbedOptions {
                output: Output::Tokens,
                token_pooling: two,
                ..EmbedOptions::default()
            },
            "documents only",
        ),
    ] {
        match batcher.embed(texts(&["a"]), options).await {
            Err(CoreError::InvalidInput(message)) => assert!(message.contains(words), "{message}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(calls.lock().unwrap().is_empty());
}
