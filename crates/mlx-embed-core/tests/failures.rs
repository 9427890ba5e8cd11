//! Failures: model errors, panics, cancellation, shutdown.

mod common;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use mlx_embed_core::{
    Batcher, BatcherConfig, CoreError, EmbedInput, EmbedOptions, EmbedderError, EmbedderErrorKind,
    InputLimit, Prompt, TruncationDirection,
};
use tokio::time::timeout;

#[tokio::test(flavor = "current_thread")]
async fn a_failing_text_fails_only_its_own_request() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    let mut handles = Vec::new();
    for (i, bad) in [false, true, false, false].into_iter().enumerate() {
        let b = batcher.clone();
        let texts: Vec<String> = (0..3)
            .map(|j| {
                if bad && j == 1 {
                    format!("r{i} {FAIL}")
                } else {
                    format!("r{i}-{j}")
                }
            })
            .collect();
        handles.push((
            texts.clone(),
            tokio::spawn(
                async move { b.embed(owned_texts(&texts), EmbedOptions::default()).await },
            ),
        ));
    }
    eventually("queued", || batcher.metrics().in_flight_inputs == 13).await;
    gate.open();
    assert!(timeout(LIMIT, holder).await.unwrap().unwrap().is_ok());
    for (texts, h) in handles {
        let result = timeout(LIMIT, h).await.unwrap().unwrap();
        if texts.iter().any(|t| t.contains(FAIL)) {
            assert_eq!(result, Err(CoreError::Model("cannot embed r1 FAIL".into())));
        } else {
            assert_answer(&texts, &result.expect("innocent request succeeds"));
        }
    }
    // The mixed batch was tried once, then each request alone.
    assert!(
        record.batches()[1].len() == 12,
        "the four requests shared a batch"
    );
    let m = batcher.metrics();
    assert_eq!((m.requests_ok, m.requests_model_error), (4, 1));
}

#[tokio::test(flavor = "current_thread")]
async fn wrong_output_size_is_a_model_error_not_a_panic() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let err = batcher
        .embed(texts(&["ok", BAD_SHAPE]), EmbedOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, CoreError::Model(m) if m.contains("floats")),
        "{err:?}"
    );
    assert!(batcher.is_healthy());
    assert!(batcher
        .embed(texts(&["fine"]), EmbedOptions::default())
        .await
        .is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_panic_makes_every_caller_unavailable_promptly() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 8,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, PANIC).await;
    // 7 more admitted (queued for the model) and 10 waiting for admission.
    let mut handles = Vec::new();
    for i in 0..17 {
        let b = batcher.clone();
        handles.push(tokio::spawn(async move {
            b.embed(
                owned_texts(&[format!("victim {i}")]),
                EmbedOptions::default(),
            )
            .await
        }));
    }
    eventually("line formed", || {
        let m = batcher.metrics();
        m.in_flight_inputs == 8 && m.waiting_inputs == 10
    })
    .await;
    let opened = Instant::now();
    gate.open();
    for h in std::iter::once(holder).chain(handles) {
        let err = timeout(Duration::from_secs(2), h)
            .await
            .expect("nobody hangs")
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(&err, CoreError::ModelUnavailable(m) if m.contains("model thread died")),
            "{err:?}"
        );
    }
    assert!(opened.elapsed() < Duration::from_secs(1));
    assert!(!batcher.is_healthy());
    assert!(batcher
        .model_failure()
        .unwrap()
        .contains("fake model exploded"));
    let err = timeout(
        LIMIT,
        batcher.embed(texts(&["after"]), EmbedOptions::default()),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(matches!(err, CoreError::ModelUnavailable(_)));
    assert!(record.computed().iter().all(|t| !t.starts_with("victim")));
    assert_eq!(batcher.metrics().requests_unavailable, 19);
    timeout(LIMIT, batcher.drained())
        .await
        .expect("nothing left pending");
}

#[tokio::test(flavor = "current_thread")]
async fn cancelled_callers_cost_no_compute() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_batch_size: 4,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let spawn = |name: &str, n: usize| {
        let b = batcher.clone();
        let texts: Vec<String> = (0..n).map(|j| format!("{name}-{j}")).collect();
        tokio::spawn(async move { b.embed(owned_texts(&texts), EmbedOptions::default()).await })
    };
    let a = spawn("a", 1);
    eventually("a running", || record.batches().len() == 1).await;
    // b and the start of c sit in the prepared batch, the rest of c and d in the queue.
    let b = spawn("b", 2);
    let c = spawn("c", 10);
    let d = spawn("d", 3);
    let e = spawn("e", 1);
    eventually("queued", || batcher.metrics().in_flight_inputs == 17).await;
    c.abort();
    d.abort();
    assert!(c.await.unwrap_err().is_cancelled());
    assert!(d.await.unwrap_err().is_cancelled());
    gate.open();
    for h in [a, b, e] {
        timeout(LIMIT, h)
            .await
            .unwrap()
            .unwrap()
            .expect("survivors succeed");
    }
    let computed = record.computed();
    assert!(
        computed
            .iter()
            .all(|t| !t.starts_with('c') && !t.starts_with('d')),
        "{computed:?}"
    );
    let m = batcher.metrics();
    assert_eq!(m.requests_cancelled, 2);
    assert_eq!(m.inputs_cancelled_before_compute, 13);
    timeout(LIMIT, batcher.drained()).await.unwrap();
    assert_eq!(
        (m.in_flight_inputs, batcher.metrics().queued_inputs),
        (0, 0)
    );
}

#[tokio::test(flavor = "current_thread")]
async fn close_refuses_new_work_and_drains_admitted_work() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let running = occupy_model(&batcher, &record, "running").await;
    let queued = {
        let b = batcher.clone();
        tokio::spawn(async move {
            b.embed(texts(&["queued 1", "queued 2"]), EmbedOptions::default())
                .await
        })
    };
    eventually("queued", || batcher.metrics().in_flight_inputs == 3).await;
    batcher.close();
    assert!(!batcher.is_healthy());
    assert_eq!(
        batcher
            .embed(texts(&["new"]), EmbedOptions::default())
            .await,
        Err(CoreError::ShuttingDown)
    );
    assert!(
        timeout(Duration::from_millis(50), batcher.drained())
            .await
            .is_err(),
        "work still pending"
    );
    gate.open();
    timeout(LIMIT, batcher.drained()).await.expect("drained");
    assert!(running.await.unwrap().is_ok());
    assert_answer(
        &["queued 1".into(), "queued 2".into()],
        &queued.await.unwrap().unwrap(),
    );
}

#[tokio::test(flavor = "current_thread")]
async fn close_refuses_callers_still_waiting_for_admission() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 1,
        ..BatcherConfig::default()
    };
    let (batcher, _record) = start(config, Duration::ZERO, Some(gate.clone()));
    let admitted = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["admitted"]), EmbedOptions::default()).await })
    };
    eventually("admitted", || batcher.metrics().in_flight_inputs == 1).await;
    let waiting = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["waiting"]), EmbedOptions::default()).await })
    };
    eventually("waiting", || batcher.metrics().waiting_inputs == 1).await;
    batcher.close();
    assert_eq!(
        timeout(LIMIT, waiting).await.unwrap().unwrap(),
        Err(CoreError::ShuttingDown)
    );
    gate.open();
    assert!(timeout(LIMIT, admitted).await.unwrap().unwrap().is_ok());
    timeout(LIMIT, batcher.drained()).await.unwrap();
}

#[test]
fn load_errors_keep_their_kind_and_panics_are_model_gone() {
    let refused = |kind: EmbedderErrorKind, message: &'static str| {
        Batcher::start(BatcherConfig::default(), move || {
            Err::<Fake, _>(EmbedderError::new(kind, message))
        })
        .err()
    };
    // A bad option stays the caller's to fix; a failed load may work on a retry.
    for kind in [
        EmbedderErrorKind::InvalidInput,
        EmbedderErrorKind::ModelFailure,
    ] {
        let err = refused(kind, "no weights");
        assert_eq!(
            err,
            Some(CoreError::LoadFailed(EmbedderError::new(
                kind,
                "no weights"
            )))
        );
    }
    let err = Batcher::start(
        BatcherConfig::default(),
        || -> Result<Fake, EmbedderError> { panic!("boom") },
    )
    .err();
    assert_eq!(
        err,
        Some(CoreError::LoadFailed(EmbedderError::model_gone(
            "model load panicked: boom"
        )))
    );
}

#[tokio::test(flavor = "current_thread")]
async fn empty_input_is_invalid() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    assert!(matches!(
        batcher.embed(vec![], EmbedOptions::default()).await,
        Err(CoreError::InvalidInput(_))
    ));
}

#[tokio::test(flavor = "current_thread")]
async fn dropping_the_last_handle_ends_the_model_thread() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let clone = batcher.clone();
    clone
        .embed(texts(&["x"]), EmbedOptions::default())
        .await
        .unwrap();
    drop(batcher);
    assert!(
        !record.dropped.load(Ordering::SeqCst),
        "a clone still holds it"
    );
    drop(clone);
    eventually("model dropped on its thread", || {
        record.dropped.load(Ordering::SeqCst)
    })
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_cancelled_caller_gives_its_admission_room_back_at_once() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 2,
        max_waiting: 0,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let running = occupy_model(&batcher, &record, "running").await;
    let queued = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["queued"]), EmbedOptions::default()).await })
    };
    eventually("queued", || batcher.metrics().in_flight_inputs == 2).await;
    queued.abort();
    assert!(queued.await.unwrap_err().is_cancelled());
    // No waiting room at all: this only works if the cancelled caller's room is free.
    let next = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["next"]), EmbedOptions::default()).await })
    };
    eventually("next admitted", || batcher.metrics().in_flight_inputs == 2).await;
    gate.open();
    assert!(timeout(LIMIT, running).await.unwrap().unwrap().is_ok());
    assert!(timeout(LIMIT, next).await.unwrap().unwrap().is_ok());
    assert!(!record.computed().contains(&"queued".to_string()));
    assert_eq!(batcher.metrics().requests_overloaded, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_told_the_model_died_never_sees_it_healthy() {
    // The model is marked dead before the dying batch's callers are answered,
    // so health checks made on hearing the news agree with it. Repeated, since
    // the opposite order loses only a narrow race.
    for round in 0..20 {
        let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
        let err = timeout(
            LIMIT,
            batcher.embed(texts(&["fine", PANIC]), EmbedOptions::default()),
        )
        .await
        .expect("answered")
        .unwrap_err();
        assert!(
            matches!(&err, CoreError::ModelUnavailable(m) if m.contains("model thread died")),
            "{err:?}"
        );
        assert!(!batcher.is_healthy(), "round {round}: still healthy");
        assert!(batcher.model_failure().is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_long_without_truncation_is_refused_before_any_compute() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let long = "y".repeat(MAX_TOKENS);
    let refuse = EmbedOptions {
        truncate: false,
        ..EmbedOptions::default()
    };
    let err = batcher
        .embed(texts(&["short", &long]), refuse.clone())
        .await
        .unwrap_err();
    assert_eq!(
        err,
        CoreError::InputTooLong {
            index: 1,
            tokens: MAX_TOKENS + 2,
            max: MAX_TOKENS,
            limit: InputLimit::Model,
        }
    );
    assert!(record.batches().is_empty(), "nothing was computed");
    assert_eq!(batcher.metrics().in_flight_inputs, 0);
    // Exactly at the maximum is fine, and the default truncates.
    let fits = "y".repeat(MAX_TOKENS - 2);
    let got = batcher.embed(texts(&[&fits]), refuse).await.unwrap();
    assert_eq!(got.token_counts, vec![MAX_TOKENS as u32]);
    let got = batcher
        .embed(texts(&[&long]), EmbedOptions::default())
        .await
        .unwrap();
    assert_eq!(got.token_counts, vec![MAX_TOKENS as u32]);
    assert_eq!(got.vectors[0], vector_for(&long[..MAX_TOKENS - 2]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncation_side_reaches_the_tokenizer() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let long = format!("{}{}", "a".repeat(MAX_TOKENS), "b".repeat(MAX_TOKENS));
    let left = EmbedOptions {
        truncation_direction: Some(TruncationDirection::Left),
        ..EmbedOptions::default()
    };
    let got = batcher.embed(texts(&[&long]), left).await.unwrap();
    assert_eq!(
        got.vectors[0],
        vector_for(&long[long.len() - (MAX_TOKENS - 2)..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenizer_and_prompt_errors_are_invalid_input_naming_the_input() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let err = batcher
        .embed(
            vec![
                EmbedInput::Tokens(vec![1, 2]),
                EmbedInput::Tokens(vec![3, 5000]),
            ],
            EmbedOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err,
        CoreError::InvalidInput("input 1: token id 5000 is outside the vocabulary".into())
    );
    let err = batcher
        .embed(
            texts(&["x"]),
            EmbedOptions {
                prompt: Prompt::Named("query".into()),
                ..EmbedOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        err,
        CoreError::InvalidInput(
            "unknown prompt name \"query\": this model has no named prompts".into()
        )
    );
    // Ids run as given: an asked-for prompt (named or raw) is refused with
    // them, rather than left out of a vector the caller takes for prompted.
    for prompt in [Prompt::Named("query".into()), Prompt::Raw("q: ".into())] {
        let err = batcher
            .embed(
                vec![texts(&["x"]).remove(0), EmbedInput::Tokens(vec![1, 2])],
                EmbedOptions {
                    prompt,
                    ..EmbedOptions::default()
                },
            )
            .await
            .unwrap_err();
        assert_eq!(
            err,
            CoreError::InvalidInput(
                "input 1: token ids run as given, so a prompt cannot be added to them; send \
                 text, or put the prompt's tokens in the ids (/tokenize shows them)"
                    .into()
            )
        );
    }
    assert!(record.batches().is_empty());
    // An empty raw prompt is no prompt: ids are fine with it.
    let out = batcher
        .embed(
            vec![EmbedInput::Tokens(vec![1, 2])],
            EmbedOptions {
                prompt: Prompt::Raw(String::new()),
                ..EmbedOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(out.vectors.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_side_invalid_input_is_invalid_input_for_its_request_only() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let first = occupy_model(&batcher, &record, "first").await;
    let b = batcher.clone();
    let bad = tokio::spawn(async move {
        b.embed(
            texts(&["fine", &format!("an {INVALID} one")]),
            EmbedOptions::default(),
        )
        .await
    });
    let b = batcher.clone();
    let good = tokio::spawn(async move {
        b.embed(texts(&["neighbour"]), EmbedOptions::default())
            .await
    });
    eventually("both queued", || batcher.metrics().in_flight_inputs == 4).await;
    gate.open();
    assert_eq!(
        timeout(LIMIT, bad).await.unwrap().unwrap().unwrap_err(),
        CoreError::InvalidInput(format!("will not embed an {INVALID} one"))
    );
    assert_answer(
        &["neighbour".into()],
        &timeout(LIMIT, good).await.unwrap().unwrap().unwrap(),
    );
    first.await.unwrap().unwrap();
    assert!(batcher.is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_says_it_is_gone_makes_the_batcher_unavailable() {
    let (batcher, _record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let err = batcher
        .embed(texts(&[GONE]), EmbedOptions::default())
        .await
        .unwrap_err();
    assert_eq!(
        err,
        CoreError::ModelUnavailable("model thread died: fake model lost its interpreter".into())
    );
    assert!(!batcher.is_healthy());
    assert!(matches!(
        batcher
            .embed(texts(&["after"]), EmbedOptions::default())
            .await,
        Err(CoreError::ModelUnavailable(_))
    ));
}

#[tokio::test(flavor = "current_thread")]
async fn a_cancelled_caller_leaves_the_queue_at_once() {
    // Callers that leave while the model is busy: their inputs stop counting
    // as queued now (they stayed queued, over the lane's room, until the
    // next cut reached them), are counted as cancelled, and never computed.
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let running = occupy_model(&batcher, &record, "running").await;
    let spawn = |name: &str, n: usize| {
        let b = batcher.clone();
        let texts: Vec<String> = (0..n).map(|j| format!("{name}-{j}")).collect();
        tokio::spawn(async move { b.embed(owned_texts(&texts), EmbedOptions::default()).await })
    };
    let gone: Vec<_> = (0..5).map(|i| spawn(&format!("gone{i}"), 3)).collect();
    let kept = spawn("kept", 2);
    eventually("queued", || batcher.metrics().queued_inputs == 17).await;
    for h in gone {
        h.abort();
        assert!(h.await.unwrap_err().is_cancelled());
    }
    let m = batcher.metrics();
    assert_eq!((m.queued_inputs, m.in_flight_inputs), (2, 3));
    assert_eq!(
        (m.requests_cancelled, m.inputs_cancelled_before_compute),
        (5, 15)
    );
    gate.open();
    assert!(timeout(LIMIT, running).await.unwrap().unwrap().is_ok());
    assert!(timeout(LIMIT, kept).await.unwrap().unwrap().is_ok());
    assert!(record.computed().iter().all(|t| !t.starts_with("gone")));
    timeout(LIMIT, batcher.drained()).await.unwrap();
    let m = batcher.metrics();
    assert_eq!(
        (m.requests_cancelled, m.inputs_cancelled_before_compute),
        (5, 15)
    );
    assert_eq!((m.queued_inputs, m.in_flight_inputs), (0, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn a_caller_that_leaves_before_admission_is_counted_as_cancelled() {
    let gate = Gate::closed();
    let config = BatcherConfig {
        max_concurrent_requests: 1,
        ..BatcherConfig::default()
    };
    let (batcher, record) = start(config, Duration::ZERO, Some(gate.clone()));
    let running = occupy_model(&batcher, &record, "running").await;
    let waiting = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["waiting"]), EmbedOptions::default()).await })
    };
    eventually("waiting for admission", || {
        batcher.metrics().waiting_inputs == 1
    })
    .await;
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    let m = batcher.metrics();
    // Never admitted, its input still counts as cancelled: sent inputs add
    // up to computed + cached + cancelled.
    assert_eq!(
        (m.requests_cancelled, m.inputs_cancelled_before_compute),
        (1, 1)
    );
    assert_eq!(m.waiting_inputs, 0);
    gate.open();
    assert!(timeout(LIMIT, running).await.unwrap().unwrap().is_ok());
    let m = batcher.metrics();
    assert_eq!((m.requests_ok, m.requests_cancelled), (1, 1));
}

#[tokio::test(flavor = "current_thread")]
async fn a_caller_that_leaves_while_tokenizing_is_counted_as_cancelled() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    // Long enough to go to the blocking pool, where the fake tokenizer sleeps.
    let long = format!("{SLOW_TOKENIZE} {}", "x".repeat(400));
    let caller = {
        let b = batcher.clone();
        tokio::spawn(async move {
            b.embed(owned_texts(&[long.clone(), long]), EmbedOptions::default())
                .await
        })
    };
    tokio::time::sleep(SLOW_TOKENIZE_TIME / 4).await;
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    let m = batcher.metrics();
    assert_eq!(
        (m.requests_cancelled, m.inputs_cancelled_before_compute),
        (1, 2)
    );
    // Its tokenizing ends on the pool; nothing of it is computed.
    tokio::time::sleep(SLOW_TOKENIZE_TIME).await;
    assert!(record.computed().is_empty());
    assert_eq!(batcher.metrics().inputs_cancelled_before_compute, 2);
}

#[tokio::test(flavor = "current_thread")]
async fn a_caller_that_leaves_while_following_another_calls_input_is_counted_as_cancelled() {
    let gate = Gate::closed();
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, Some(gate.clone()));
    let holder = occupy_model(&batcher, &record, "holder").await;
    let leader = {
        let b = batcher.clone();
        tokio::spawn(async move { b.embed(texts(&["shared"]), EmbedOptions::default()).await })
    };
    eventually("leader queued", || batcher.metrics().in_flight_inputs == 2).await;
    // "own" is this caller's lead, "shared" follows the leader's computation.
    let follower = {
        let b = batcher.clone();
        tokio::spawn(async move {
            b.embed(texts(&["own", "shared"]), EmbedOptions::default())
                .await
        })
    };
    eventually("follower's lead queued", || {
        batcher.metrics().in_flight_inputs == 3
    })
    .await;
    follower.abort();
    assert!(follower.await.unwrap_err().is_cancelled());
    gate.open();
    timeout(LIMIT, holder).await.unwrap().unwrap().unwrap();
    let shared = timeout(LIMIT, leader).await.unwrap().unwrap().unwrap();
    assert_answer(&["shared".into()], &shared);
    // Sent 4 inputs: "holder" and "shared" computed, none found in the
    // cache, "own" withdrawn from the queue and "shared" left unfollowed.
    let m = batcher.metrics();
    assert_eq!(record.computed(), vec!["holder", "shared"]);
    assert_eq!(
        (
            m.requests_cancelled,
            m.inputs_cancelled_before_compute,
            m.cache.hits
        ),
        (1, 2, 0)
    );
}

/// Polled by another executor, the call says so at its first poll whatever its
/// inputs (a short text used to run and a long one, tokenized on tokio's
/// blocking pool, to panic: what worked in a test failed in production).
#[test]
fn embed_outside_a_tokio_runtime_is_no_runtime_for_any_input() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let long = "word ".repeat(200);
    for text in ["short", long.as_str()] {
        let mut call = std::pin::pin!(batcher.embed(texts(&[text]), EmbedOptions::default()));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match call.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Err(CoreError::NoRuntime)) => {}
            other => panic!("{text:.8}: {other:?}"),
        }
    }
    assert!(record.batches().is_empty());
    assert!(CoreError::NoRuntime.to_string().contains("enable_all"));
}

/// On a runtime without its time driver every call panics at once, with
/// tokio's message, not only a call that has to wait in line for admission.
#[test]
fn embed_on_a_runtime_without_timers_panics_on_its_first_call() {
    let (batcher, record) = start(BatcherConfig::default(), Duration::ZERO, None);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(batcher.embed(texts(&["short"]), EmbedOptions::default()))
    }))
    .expect_err("an uncontended short call still needs the timer");
    let message = panicked
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panicked.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    assert!(message.contains("timers are disabled"), "{message}");
    assert!(record.batches().is_empty());
}
