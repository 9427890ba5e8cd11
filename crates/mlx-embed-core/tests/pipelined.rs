//! The pipelined model thread (`Embedder::pipelines`): batch k+1 is
//! submitted before batch k is collected; answers stay exact, in order,
//! and a failure stays with the request that caused it.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, CoreError, EmbedOptions, Embedder, EmbedderError, Encoded,
    ModelInfo, Output, Submitted, Ticket, Tokenize,
};
use tokio::time::timeout;

/// The fake refuses these inputs when they are submitted (as the engine's
/// validation does before anything is queued).
const REFUSE: &str = "REFUSE";

/// The shared fake, pipelined: `submit` only queues (after passing its own
/// gate, so tests can line batches up behind it); the work happens at collect.
struct Pipelined {
    fake: Fake,
    submit_gate: Arc<Gate>,
    /// `submit` calls begun (counted before the gate).
    entered: Arc<AtomicUsize>,
    events: Arc<Mutex<Vec<String>>>,
}

fn names(inputs: &[Encoded]) -> String {
    let texts: Vec<String> = inputs.iter().map(|e| text_of_ids(&e.ids)).collect();
    texts.join(",")
}

fn refused(inputs: &[Encoded]) -> Option<EmbedderError> {
    inputs
        .iter()
        .map(|e| text_of_ids(&e.ids))
        .find(|t| t.contains(REFUSE))
        .map(|t| EmbedderError::invalid_input(format!("refused {t}")))
}

impl Embedder for Pipelined {
    fn info(&self) -> ModelInfo {
        self.fake.info()
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.fake.tokenizer()
    }
    /// The one-shot path, which failed batches are retried on.
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        match refused(inputs) {
            Some(error) => Err(error),
            None => self.fake.embed_batch(inputs, output),
        }
    }
    fn pipelines(&self) -> bool {
        true
    }
    fn submit(&mut self, next: &[Encoded], output: Output, running: Option<Ticket>) -> Submitted {
        self.entered.fetch_add(1, Ordering::SeqCst);
        self.submit_gate.pass();
        self.events
            .lock()
            .unwrap()
            .push(format!("submit {}", names(next)));
        let running = running.map(|ticket| self.collect(ticket));
        let next = match refused(next) {
            Some(error) => Err(error),
            None => Ok(Ticket::new((next.to_vec(), output))),
        };
        Submitted { next, running }
    }
    fn collect(&mut self, ticket: Ticket) -> Result<BatchOutput, EmbedderError> {
        let (inputs, output): (Vec<Encoded>, Output) =
            ticket.into_inner().expect("a ticket of this fake");
        self.events
            .lock()
            .unwrap()
            .push(format!("collect {}", names(&inputs)));
        self.fake.embed_batch(&inputs, output)
    }
}

struct Started {
    batcher: Batcher,
    record: Arc<Record>,
    submit_gate: Arc<Gate>,
    entered: Arc<AtomicUsize>,
    events: Arc<Mutex<Vec<String>>>,
}

fn start_pipelined(config: BatcherConfig) -> Started {
    let record = Arc::new(Record::default());
    let submit_gate = Gate::closed();
    let events = Arc::new(Mutex::new(Vec::new()));
    let entered = Arc::new(AtomicUsize::new(0));
    let batcher = Batcher::start(config, {
        let (record, submit_gate, events, entered) = (
            record.clone(),
            submit_gate.clone(),
            events.clone(),
            entered.clone(),
        );
        move || {
            Ok(Pipelined {
                fake: Fake {
                    record,
                    delay: Duration::ZERO,
                    gate: None,
                },
                submit_gate,
                entered,
                events,
            })
        }
    })
    .expect("fake loads");
    Started {
        batcher,
        record,
        submit_gate,
        entered,
        events,
    }
}

impl Started {
    /// Waits until the model thread is inside its first `submit` (held at the gate).
    async fn first_submit_entered(&self) {
        eventually("first batch in submit", || {
            self.entered.load(Ordering::SeqCst) == 1
        })
        .await;
    }
}

type Answer = tokio::task::JoinHandle<Result<mlx_embed_core::Embeddings, CoreError>>;

fn send(batcher: &Batcher, texts: &[String]) -> Answer {
    let (b, texts) = (batcher.clone(), texts.to_vec());
    tokio::spawn(async move { b.embed(owned_texts(&texts), EmbedOptions::default()).await })
}

fn strings(texts: &[&str]) -> Vec<String> {
    texts.iter().map(|t| (*t).to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_batch_is_submitted_before_the_running_one_is_collected() {
    let s = start_pipelined(BatcherConfig::default());
    // "a" sits in `submit` behind the closed gate; "b" and "c" queue meanwhile.
    let a = send(&s.batcher, &strings(&["a"]));
    s.first_submit_entered().await;
    let b = send(&s.batcher, &strings(&["b1", "b2"]));
    eventually("b queued", || s.batcher.metrics().queued_inputs == 2).await;
    let c = send(&s.batcher, &strings(&["c"]));
    eventually("c queued", || s.batcher.metrics().queued_inputs == 3).await;
    s.submit_gate.open();
    for (texts, answer) in [(vec!["a"], a), (vec!["b1", "b2"], b), (vec!["c"], c)] {
        let got = timeout(LIMIT, answer).await.unwrap().unwrap().unwrap();
        assert_answer(&strings(&texts), &got);
    }
    assert_eq!(
        *s.events.lock().unwrap(),
        ["submit a", "submit b1,b2,c", "collect a", "collect b1,b2,c"],
    );
    assert_eq!(
        s.record.batches(),
        [strings(&["a"]), strings(&["b1", "b2", "c"])]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_callers_get_their_own_vectors_in_order() {
    let s = start_pipelined(BatcherConfig {
        max_batch_size: 8,
        ..BatcherConfig::default()
    });
    s.submit_gate.open();
    let requests: Vec<Vec<String>> = (0..300)
        .map(|i| (0..1 + i % 4).map(|j| format!("req{i}-in{j}")).collect())
        .collect();
    let answers: Vec<Answer> = requests.iter().map(|t| send(&s.batcher, t)).collect();
    for (texts, answer) in requests.iter().zip(answers) {
        let got = timeout(LIMIT, answer).await.unwrap().unwrap().unwrap();
        assert_answer(texts, &got);
    }
    let events = s.events.lock().unwrap().clone();
    let submits = events.iter().filter(|e| e.starts_with("submit")).count();
    let collects = events.iter().filter(|e| e.starts_with("collect")).count();
    assert_eq!(submits, collects, "every submitted batch is collected once");
    let inputs: usize = requests.iter().map(Vec::len).sum();
    assert_eq!(
        s.record.computed().len(),
        inputs,
        "each input computed once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_stay_with_the_request_that_caused_them() {
    let s = start_pipelined(BatcherConfig::default());
    let holder = send(&s.batcher, &strings(&["holder"]));
    s.first_submit_entered().await;
    // One batch fails when collected (FAIL), one when submitted (REFUSE);
    // each shares its batch with innocent requests.
    let cases: Vec<(Vec<String>, Option<CoreError>)> = vec![
        (strings(&["x1", "x2"]), None),
        (
            strings(&["y1", &format!("y {FAIL}")]),
            Some(CoreError::Model(format!("cannot embed y {FAIL}"))),
        ),
        (strings(&["z1"]), None),
    ];
    let mut answers = Vec::new();
    for (texts, _) in &cases {
        let before = s.batcher.metrics().queued_inputs;
        answers.push(send(&s.batcher, texts));
        let want = before + texts.len() as u64;
        eventually("queued", || s.batcher.metrics().queued_inputs == want).await;
    }
    s.submit_gate.open();
    assert_answer(
        &strings(&["holder"]),
        &timeout(LIMIT, holder).await.unwrap().unwrap().unwrap(),
    );
    for ((texts, error), answer) in cases.iter().zip(answers) {
        let got = timeout(LIMIT, answer).await.unwrap().unwrap();
        match error {
            Some(error) => assert_eq!(got.as_ref().err(), Some(error)),
            None => assert_answer(texts, &got.expect("innocent request succeeds")),
        }
    }

    // Refused at submit: the batch is answered request by request too.
    let ok = send(&s.batcher, &strings(&["w1"]));
    let bad = send(&s.batcher, &strings(&[&format!("w {REFUSE}")]));
    assert_answer(
        &strings(&["w1"]),
        &timeout(LIMIT, ok).await.unwrap().unwrap().unwrap(),
    );
    assert_eq!(
        timeout(LIMIT, bad).await.unwrap().unwrap(),
        Err(CoreError::InvalidInput(format!("refused w {REFUSE}")))
    );
    assert!(s.batcher.is_healthy());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_at_collect_fails_the_running_and_the_queued_batch() {
    let s = start_pipelined(BatcherConfig::default());
    let first = send(&s.batcher, &strings(&[&format!("p {PANIC}")]));
    s.first_submit_entered().await;
    let second = send(&s.batcher, &strings(&["innocent"]));
    eventually("second queued", || s.batcher.metrics().queued_inputs == 1).await;
    s.submit_gate.open();
    for answer in [first, second] {
        let got = timeout(LIMIT, answer).await.unwrap().unwrap();
        assert!(
            matches!(got, Err(CoreError::ModelUnavailable(_))),
            "{got:?}"
        );
    }
    assert!(!s.batcher.is_healthy());
}
