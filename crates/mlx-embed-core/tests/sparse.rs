//! Sparse output (`Output::Sparse`, a BGE-M3 model's lexical weights): each
//! input gets its own `[id, weight]` rows, never from the cache; a model
//! whose rows break the contract is a model error, and a model without
//! lexical weights refuses the output.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mlx_embed_core::{
    lexical_entries, BatchOutput, Batcher, BatcherConfig, CoreError, EmbedOptions, Embedder,
    EmbedderError, Encoded, ModelInfo, Output, Tokenize,
};

const VOCAB: usize = 1003;
/// Texts with these markers make the fake's sparse rows break the contract.
const UNSORTED: &str = "UNSORTED";
const OUTSIDE: &str = "OUTSIDE";
const FRACTION: &str = "FRACTION";
const TOO_MANY: &str = "TOOMANY";

/// A model with lexical weights: each distinct byte of a text's content is
/// weighed `byte / 100`, ids increasing; pooled output is one zero per input.
struct Lexical {
    kinds: Arc<Mutex<Vec<Output>>>,
}

impl Embedder for Lexical {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "lexical".into(),
            dim: 1,
            lexical_weights: true,
            max_input_tokens: 64,
            vocab_size: VOCAB,
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
        self.kinds.lock().unwrap().push(output);
        if output == Output::Pooled {
            return Ok(BatchOutput {
                vectors: vec![0.0; inputs.len()],
                rows: vec![1; inputs.len()],
                ..BatchOutput::default()
            });
        }
        let (mut vectors, mut rows) = (Vec::new(), Vec::new());
        for e in inputs {
            let text = text_of_ids(&e.ids);
            let mut ids: Vec<u32> = e.ids[1..e.ids.len() - 1].to_vec();
            ids.sort_unstable();
            ids.dedup();
            let mut pairs: Vec<[f32; 2]> = ids
                .iter()
                .map(|&id| [id as f32, id as f32 / 100.0])
                .collect();
            if text.contains(UNSORTED) {
                pairs.reverse();
            }
            if text.contains(OUTSIDE) {
                pairs[0][0] = VOCAB as f32;
            }
            if text.contains(FRACTION) {
                pairs[0][0] += 0.5;
            }
            if text.contains(TOO_MANY) {
                let extra: Vec<[f32; 2]> = (0..e.len() as u32).map(|i| [i as f32, 1.0]).collect();
                pairs = extra.into_iter().chain(pairs).collect();
            }
            rows.push(pairs.len() as u32);
            vectors.extend(pairs.into_iter().flatten());
        }
        Ok(BatchOutput {
            vectors,
            rows,
            ..BatchOutput::default()
        })
    }
}

fn lexical_batcher(config: BatcherConfig) -> (Batcher, Arc<Mutex<Vec<Output>>>) {
    let kinds = Arc::new(Mutex::new(Vec::new()));
    let k = kinds.clone();
    let batcher = Batcher::start(config, move || Ok(Lexical { kinds: k })).unwrap();
    (batcher, kinds)
}

fn sparse() -> EmbedOptions {
    EmbedOptions {
        output: Output::Sparse,
        ..EmbedOptions::default()
    }
}

/// The fake's entries for `text`: its distinct bytes, increasing, each `b / 100`.
fn expected(text: &str) -> Vec<(u32, f32)> {
    let mut ids: Vec<u32> = text.bytes().map(u32::from).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter().map(|id| (id, id as f32 / 100.0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_input_gets_its_own_entries() {
    let (batcher, kinds) = lexical_batcher(BatcherConfig::default());
    let inputs = ["banana", "a", "", "zebra crossing"];
    let got = batcher
        .embed(texts(&["banana", "a", "zebra crossing"]), sparse())
        .await
        .unwrap();
    for (i, text) in [inputs[0], inputs[1], inputs[3]].iter().enumerate() {
        let want = expected(text);
        assert_eq!(lexical_entries(&got.vectors[i]), want, "{text}");
        assert_eq!(got.row_counts[i] as usize, want.len(), "{text}");
        assert_eq!(got.token_counts[i] as usize, text.len() + 2, "{text}");
    }
    // "banana": b, n, a once each, whatever the repeats.
    assert_eq!(got.row_counts[0], 3);
    assert_eq!(*kinds.lock().unwrap(), vec![Output::Sparse]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sparse_and_pooled_callers_each_get_their_own_answer() {
    let (batcher, kinds) = lexical_batcher(BatcherConfig::default());
    let mut handles = Vec::new();
    for i in 0..24usize {
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            let text = format!("caller {i} says {}", "xyz".repeat(i % 5));
            let options = if i % 2 == 0 {
                sparse()
            } else {
                EmbedOptions::default()
            };
            let got = b.embed(texts(&[&text]), options).await.unwrap();
            (i, text, got)
        }));
    }
    for h in handles {
        let (i, text, got) = tokio::time::timeout(LIMIT, h).await.unwrap().unwrap();
        if i % 2 == 0 {
            assert_eq!(lexical_entries(&got.vectors[0]), expected(&text), "{text}");
        } else {
            assert_eq!(got.vectors[0], vec![0.0], "{text}");
            assert_eq!(got.row_counts, vec![1]);
        }
    }
    let kinds = kinds.lock().unwrap();
    assert!(kinds.contains(&Output::Sparse) && kinds.contains(&Output::Pooled));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_output_is_never_cached() {
    let config = BatcherConfig {
        cache_bytes: 1 << 20,
        ..BatcherConfig::default()
    };
    let (batcher, kinds) = lexical_batcher(config);
    for _ in 0..2 {
        let got = batcher
            .embed(texts(&["same text"]), sparse())
            .await
            .unwrap();
        assert_eq!(got.cache_hits, 0);
        assert_eq!(lexical_entries(&got.vectors[0]), expected("same text"));
    }
    assert_eq!(*kinds.lock().unwrap(), vec![Output::Sparse, Output::Sparse]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_rows_that_break_the_contract_are_a_model_error() {
    let (batcher, _kinds) = lexical_batcher(BatcherConfig::default());
    for (marker, says) in [
        (UNSORTED, "sparse row id"),
        (OUTSIDE, "sparse row id 1003"),
        (FRACTION, "sparse row id"),
        (TOO_MANY, "row counts"),
    ] {
        let err = batcher
            .embed(texts(&["fine", &format!("{marker} text")]), sparse())
            .await
            .unwrap_err();
        match &err {
            CoreError::Model(message) => assert!(message.contains(says), "{marker}: {message}"),
            other => panic!("{marker}: {other:?}"),
        }
    }
    // The model is fine: the next request is answered.
    let ok = batcher.embed(texts(&["fine"]), sparse()).await.unwrap();
    assert_eq!(lexical_entries(&ok.vectors[0]), expected("fine"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_lexical_weights_refuses_sparse_output() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let err = batcher.embed(texts(&["a"]), sparse()).await.unwrap_err();
    match &err {
        CoreError::InvalidInput(message) => {
            assert_eq!(
                message,
                "fake has no lexical weights (sparse output is a BGE-M3 model's)"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(record.batches().is_empty());
}
