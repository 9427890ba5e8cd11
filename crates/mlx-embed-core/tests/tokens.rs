//! Per-token output (`Output::Tokens`, TEI's `/embed_all`): one row per
//! token, kinds never share a model call, never served from the cache.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mlx_embed_core::{BatcherConfig, CoreError, EmbedOptions, Embeddings, Output, Priority};
use tokio::time::timeout;

fn tokens() -> EmbedOptions {
    EmbedOptions {
        output: Output::Tokens,
        ..EmbedOptions::default()
    }
}

/// `got` holds, per text, one fake row per token, in token order.
fn assert_token_rows(texts: &[String], got: &Embeddings) {
    assert_eq!(got.vectors.len(), texts.len());
    assert_eq!(got.row_counts, got.token_counts);
    for (i, t) in texts.iter().enumerate() {
        let n = tokens_for(t) as usize;
        assert_eq!(got.token_counts[i] as usize, n, "tokens of {t}");
        assert_eq!(got.vectors[i].len(), n * DIM, "floats of {t}");
        let rows: Vec<&[f32]> = got.rows(i).collect();
        assert_eq!(rows.len(), n, "rows of {t}");
        for (j, row) in rows.iter().enumerate() {
            assert_eq!(*row, token_row_for(t, j).as_slice(), "row {j} of {t}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_output_has_one_row_per_token() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let texts: Vec<String> = ["a", "hello world", &"x".repeat(300)]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let got = batcher.embed(owned_texts(&texts), tokens()).await.unwrap();
    assert_token_rows(&texts, &got);
    assert_eq!(got.cache_hits, 0);
    assert_eq!(record.kinds(), vec![Output::Tokens]);

    // Pooled output of the same texts is still one vector each, rows of 1.
    let pooled = batcher
        .embed(owned_texts(&texts), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&texts, &pooled);
    assert_eq!(pooled.row_counts, vec![1, 1, 1]);
    assert_eq!(
        pooled.rows(1).collect::<Vec<_>>(),
        vec![&pooled.vectors[1][..]]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_and_token_requests_never_share_a_model_call() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    // A blocker holds the model so the rest line up in one lane, kinds interleaved.
    let blocker = {
        let b = batcher.clone();
        tokio::spawn(async move {
            b.embed(texts(&["blocker"]), EmbedOptions::default())
                .await
                .unwrap()
        })
    };
    eventually("blocker in the model", || record.batches().len() == 1).await;
    let mut handles = Vec::new();
    for i in 0..12usize {
        let output = if i % 3 == 1 {
            Output::Tokens
        } else {
            Output::Pooled
        };
        let texts: Vec<String> = (0..=i % 2).map(|j| format!("r{i}-{j}")).collect();
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            let got = b
                .embed(
                    owned_texts(&texts),
                    EmbedOptions {
                        output,
                        ..EmbedOptions::default()
                    },
                )
                .await
                .unwrap();
            match output {
                Output::Pooled => assert_answer(&texts, &got),
                Output::Tokens => assert_token_rows(&texts, &got),
                Output::Sparse | Output::MultiVector(_) => {
                    unreachable!("only pooled and token requests here")
                }
            }
            (texts, output)
        }));
        eventually("queued", || {
            batcher.metrics().queued_inputs as usize == {
                (0..=i).map(|k| k % 2 + 1).sum::<usize>()
            }
        })
        .await;
    }
    gate.open();
    let mut kind_of = std::collections::HashMap::new();
    for h in handles {
        let (texts, output) = timeout(LIMIT, h).await.unwrap().unwrap();
        for t in texts {
            kind_of.insert(t, output);
        }
    }
    timeout(LIMIT, blocker).await.unwrap().unwrap();
    let batches = record.batches();
    let kinds = record.kinds();
    assert_eq!(batches.len(), kinds.len());
    let mut seen = 0;
    for (batch, kind) in batches.iter().zip(&kinds).skip(1) {
        for t in batch {
            assert_eq!(kind_of[t], *kind, "{t} ran in a {kind:?} batch: {batch:?}");
            seen += 1;
        }
    }
    assert_eq!(seen, kind_of.len(), "every input computed once");
    // Queued as P T P P T P P T ..., FIFO in one lane: each run of one kind
    // is one call (runs of pooled requests share theirs).
    let want: Vec<Output> = [Output::Pooled, Output::Tokens]
        .into_iter()
        .cycle()
        .take(9)
        .collect();
    assert_eq!(kinds[1..], want[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_output_bypasses_the_cache() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let text = vec!["cached text".to_string()];
    let pooled = batcher
        .embed(owned_texts(&text), EmbedOptions::default())
        .await
        .unwrap();
    assert_answer(&text, &pooled);
    // The pooled vector is cached; token rows are not, and never come from it.
    for _ in 0..2 {
        let got = batcher.embed(owned_texts(&text), tokens()).await.unwrap();
        assert_token_rows(&text, &got);
        assert_eq!(got.cache_hits, 0);
    }
    let again = batcher
        .embed(owned_texts(&text), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(again.cache_hits, 1);
    assert_eq!(
        record.kinds(),
        vec![Output::Pooled, Output::Tokens, Output::Tokens]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_output_of_the_wrong_shape_is_a_model_error() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let err = batcher
        .embed(texts(&["fine", BAD_SHAPE]), tokens())
        .await
        .unwrap_err();
    assert!(matches!(err, CoreError::Model(_)), "{err:?}");
    // The model is fine: the next request is answered.
    let ok = batcher
        .embed(
            texts(&["fine"]),
            EmbedOptions {
                priority: Priority::High,
                ..tokens()
            },
        )
        .await
        .unwrap();
    assert_token_rows(&["fine".to_string()], &ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_on_token_rows_refuses_before_any_compute() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let texts: Vec<String> = ["hello world", "a"].iter().map(|s| s.to_string()).collect();
    let rows: usize = texts.iter().map(|t| tokens_for(t) as usize).sum();
    let bounded = |max| EmbedOptions {
        max_token_rows: Some(max),
        ..tokens()
    };
    let err = batcher
        .embed(owned_texts(&texts), bounded(rows - 1))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        CoreError::TooManyTokenRows {
            rows,
            max: rows - 1
        }
    );
    assert!(record.batches().is_empty(), "nothing was computed");
    // At the bound it runs; pooled output has no rows to bound.
    let got = batcher
        .embed(owned_texts(&texts), bounded(rows))
        .await
        .unwrap();
    assert_token_rows(&texts, &got);
    let pooled = EmbedOptions {
        max_token_rows: Some(1),
        ..EmbedOptions::default()
    };
    assert_eq!(
        batcher
            .embed(owned_texts(&texts), pooled)
            .await
            .unwrap()
            .vectors
            .len(),
        2
    );
}

/// A request of the other output kind behind its lane's pooled queries, while
/// the high lane keeps the model busy with pooled work: the turn its lane
/// owed it was spent on batches of the other kind, and with queries moving
/// its lane never aged, so it waited until the traffic stopped (a review
/// found it: 2.8 s, the whole flood). Now the turn stays owed until it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_request_is_not_starved_by_pooled_queries_in_its_lane() {
    let config = BatcherConfig {
        max_batch_size: 16,
        max_priority_batch_size: 4,
        aging_batches: 2,
        cache_bytes: 0,
        max_concurrent_requests: 1024,
        ..BatcherConfig::default()
    };
    let (batcher, _record) = start(config, Duration::from_millis(3), None);
    let flooding = Arc::new(AtomicBool::new(true));
    let mut flooders = Vec::new();
    for (callers, priority) in [(24, Priority::High), (8, Priority::Normal)] {
        for c in 0..callers {
            let (b, flooding) = (batcher.clone(), flooding.clone());
            flooders.push(tokio::spawn(async move {
                for k in 0..5000 {
                    if !flooding.load(Ordering::Acquire) {
                        break;
                    }
                    let options = EmbedOptions {
                        priority,
                        ..EmbedOptions::default()
                    };
                    let text = format!("q{priority:?}{c}-{k}");
                    b.embed(texts(&[&text]), options).await.unwrap();
                }
            }));
        }
    }
    // The flood ends on its own after 8 s at the latest.
    let stopper = {
        let flooding = flooding.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(8)).await;
            flooding.store(false, Ordering::Release);
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let owed: Vec<String> = (0..8).map(|i| format!("tokens {i}")).collect();
    let got = timeout(
        Duration::from_secs(20),
        batcher.embed(owned_texts(&owed), tokens()),
    )
    .await
    .expect("answered")
    .unwrap();
    let during_the_flood = flooding.swap(false, Ordering::AcqRel);
    assert_token_rows(&owed, &got);
    assert!(
        during_the_flood,
        "answered only once the pooled traffic had stopped"
    );
    stopper.abort();
    for f in flooders {
        timeout(LIMIT, f).await.unwrap().unwrap();
    }
}
