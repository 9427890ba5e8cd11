//! A deterministic fake embedder for the batcher tests: its tokenizer turns
//! a text into one id per byte between two markers (so the fake can read the
//! text back from the ids), the vector of a text is a hash of the text, and
//! every batch the fake sees is recorded.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, EmbedInput, EmbedOptions, Embedder, EmbedderError,
    Encoded, ModelInfo, Output, Replica, Tokenize, TruncationDirection,
};

pub const DIM: usize = 8;
/// The fake model's longest input, markers included.
pub const MAX_TOKENS: usize = 2048;
/// First id of a text input; a byte `b` of the text is id `b`.
const TEXT_START: u32 = 1000;
/// First id of a token-id input.
const TOKENS_START: u32 = 1001;
/// Last id of every input.
const END: u32 = 1002;

/// Upper bound for any single wait in a test: nothing should take this long.
pub const LIMIT: Duration = Duration::from_secs(10);

/// Text of an input as the fake sees it.
pub fn text_of(input: &EmbedInput) -> String {
    match input {
        EmbedInput::Text(t) => t.clone(),
        EmbedInput::Tokens(ids) => format!("tokens:{ids:?}"),
        EmbedInput::Pair { query, document } => format!("pair:{query}|{document}"),
    }
}

/// The text an encoded input came from (what `text_of` gave for its input).
pub fn text_of_ids(ids: &[u32]) -> String {
    let body = &ids[1..ids.len() - 1];
    if ids[0] == TOKENS_START {
        format!("tokens:{body:?}")
    } else {
        String::from_utf8_lossy(&body.iter().map(|&b| b as u8).collect::<Vec<u8>>()).into_owned()
    }
}

/// The fake's tokenizer: markers around one id per byte (or around the given
/// ids), the content cut to `MAX_TOKENS` on the side the options ask for.
pub struct FakeTokenizer;

impl Tokenize for FakeTokenizer {
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let (start, content): (u32, Vec<u32>) = match input {
            EmbedInput::Text(t) => {
                if t.contains(SLOW_TOKENIZE) {
                    std::thread::sleep(SLOW_TOKENIZE_TIME);
                }
                (TEXT_START, t.bytes().map(u32::from).collect())
            }
            EmbedInput::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&id| id >= TEXT_START) {
                    return Err(EmbedderError::invalid_input(format!(
                        "token id {bad} is outside the vocabulary"
                    )));
                }
                (TOKENS_START, ids.clone())
            }
            EmbedInput::Pair { .. } => {
                return Err(EmbedderError::invalid_input("the fake embeds no pairs"))
            }
        };
        let untruncated_len = content.len() as u32 + 2;
        let keep = content.len().min(MAX_TOKENS - 2);
        let content = match options.truncation_direction.unwrap_or_default() {
            TruncationDirection::Right => &content[..keep],
            TruncationDirection::Left => &content[content.len() - keep..],
        };
        let mut ids = Vec::with_capacity(keep + 2);
        ids.push(start);
        ids.extend_from_slice(content);
        ids.push(END);
        Ok(Encoded {
            ids,
            type_ids: None,
            untruncated_len,
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }
}

/// The fake's vector for `text`: FNV-1a of the text, then of each index.
pub fn vector_for(text: &str) -> Vec<f32> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    (0..DIM)
        .map(|i| {
            let x =
                (h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0x0100_0000_01b3);
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// The fake's row for token `j` of the input read back as `text`
/// ([`Output::Tokens`]).
pub fn token_row_for(text: &str, j: usize) -> Vec<f32> {
    vector_for(&format!("{text}@{j}"))
}

/// Tokens the fake's tokenizer makes of a text (up to `MAX_TOKENS`).
pub fn tokens_for(text: &str) -> u32 {
    text.len() as u32 + 2
}

pub fn texts(inputs: &[&str]) -> Vec<EmbedInput> {
    inputs
        .iter()
        .map(|t| EmbedInput::Text((*t).to_string()))
        .collect()
}

pub fn owned_texts(inputs: &[String]) -> Vec<EmbedInput> {
    inputs.iter().map(|t| EmbedInput::Text(t.clone())).collect()
}

/// A door the fake waits at before every batch: closed, the model "runs"
/// forever; lets tests line requests up deterministically behind a busy model.
#[derive(Default)]
pub struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    pub fn closed() -> Arc<Self> {
        Arc::new(Self::default())
    }
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
    /// Batches that reach the gate from now on wait again.
    pub fn close(&self) {
        *self.open.lock().unwrap() = false;
    }
    pub fn pass(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
    }
}

/// What the fake saw and did; shared with the test.
#[derive(Default)]
pub struct Record {
    pub batches: Mutex<Vec<Vec<String>>>,
    /// The output kind of each batch, in the order of `batches`.
    pub kinds: Mutex<Vec<Output>>,
    pub dropped: AtomicBool,
    /// Fakes dropped (one per model thread, replicas included).
    pub drops: AtomicUsize,
    pub thread_name: Mutex<Option<String>>,
    /// The name and id of the thread that ran each batch, in the order of `batches`.
    pub batch_threads: Mutex<Vec<String>>,
}

impl Record {
    pub fn batches(&self) -> Vec<Vec<String>> {
        self.batches.lock().unwrap().clone()
    }
    pub fn kinds(&self) -> Vec<Output> {
        self.kinds.lock().unwrap().clone()
    }
    pub fn computed(&self) -> Vec<String> {
        self.batches().into_iter().flatten().collect()
    }
    /// The names of the threads that ran batches.
    pub fn threads_used(&self) -> std::collections::BTreeSet<String> {
        self.batch_threads.lock().unwrap().iter().cloned().collect()
    }
}

/// Texts containing these markers make the fake misbehave.
pub const FAIL: &str = "FAIL";
pub const PANIC: &str = "PANIC";
pub const BAD_SHAPE: &str = "BADSHAPE";
/// The fake calls these inputs invalid (as a model-side validation error would).
pub const INVALID: &str = "INVALID";
/// The fake reports itself gone for good.
pub const GONE: &str = "GONE";
/// The fake's tokenizer takes [`SLOW_TOKENIZE_TIME`] over texts with this marker.
pub const SLOW_TOKENIZE: &str = "SLOWTOKENIZE";
pub const SLOW_TOKENIZE_TIME: Duration = Duration::from_millis(400);

pub struct Fake {
    pub record: Arc<Record>,
    pub delay: Duration,
    pub gate: Option<Arc<Gate>>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.record.dropped.store(true, Ordering::SeqCst);
        self.record.drops.fetch_add(1, Ordering::SeqCst);
    }
}

impl Embedder for Fake {
    fn info(&self) -> ModelInfo {
        *self.record.thread_name.lock().unwrap() =
            std::thread::current().name().map(str::to_string);
        ModelInfo {
            name: "fake".into(),
            dim: DIM,
            max_input_tokens: MAX_TOKENS,
            vocab_size: TEXT_START as usize,
            ..ModelInfo::default()
        }
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(Arc::new(FakeTokenizer))
    }

    /// Another fake on the same record, gate and delay.
    fn replica(&self) -> Option<Replica<Self>> {
        let (record, delay, gate) = (self.record.clone(), self.delay, self.gate.clone());
        Some(Box::new(move || {
            Ok(Fake {
                record,
                delay,
                gate,
            })
        }))
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        assert!(
            !inputs.is_empty(),
            "the batcher must never send an empty batch"
        );
        let batch: Vec<String> = inputs.iter().map(|e| text_of_ids(&e.ids)).collect();
        {
            // Both under one lock order, so `kinds` always matches `batches`.
            let mut batches = self.record.batches.lock().unwrap();
            batches.push(batch.clone());
            self.record.kinds.lock().unwrap().push(output);
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("unnamed");
            let named = format!("{name} {:?}", thread.id());
            self.record.batch_threads.lock().unwrap().push(named);
        }
        if let Some(gate) = &self.gate {
            gate.pass();
        }
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        if batch.iter().any(|t| t.contains(PANIC)) {
            panic!("fake model exploded");
        }
        if let Some(bad) = batch.iter().find(|t| t.contains(FAIL)) {
            return Err(EmbedderError::model_failure(format!("cannot embed {bad}")));
        }
        if let Some(bad) = batch.iter().find(|t| t.contains(INVALID)) {
            return Err(EmbedderError::invalid_input(format!(
                "will not embed {bad}"
            )));
        }
        if batch.iter().any(|t| t.contains(GONE)) {
            return Err(EmbedderError::model_gone("fake model lost its interpreter"));
        }
        let (mut vectors, rows): (Vec<f32>, Vec<u32>) = match output {
            Output::Pooled => (
                batch.iter().flat_map(|t| vector_for(t)).collect(),
                vec![1; batch.len()],
            ),
            Output::Tokens => (
                batch
                    .iter()
                    .zip(inputs)
                    .flat_map(|(t, e)| (0..e.len()).flat_map(move |j| token_row_for(t, j)))
                    .collect(),
                inputs.iter().map(|e| e.len() as u32).collect(),
            ),
            Output::Sparse | Output::MultiVector(_) => {
                unreachable!("the batcher refuses sparse and multi-vector output of this fake")
            }
        };
        if batch.iter().any(|t| t.contains(BAD_SHAPE)) {
            vectors.pop();
        }
        let padded = inputs.iter().map(Encoded::len).max().unwrap() * inputs.len();
        Ok(BatchOutput {
            vectors,
            rows,
            padded_tokens: padded as u64,
            gil_wait: Duration::from_micros(10),
        })
    }
}

/// Starts a batcher over a fake; returns the handle and the fake's record.
pub fn start(
    config: BatcherConfig,
    delay: Duration,
    gate: Option<Arc<Gate>>,
) -> (Batcher, Arc<Record>) {
    let record = Arc::new(Record::default());
    let rec = record.clone();
    let batcher = Batcher::start(config, move || {
        Ok(Fake {
            record: rec,
            delay,
            gate,
        })
    })
    .expect("fake loads");
    (batcher, record)
}

/// Waits (bounded) until `cond` holds, polling.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + LIMIT;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Sends a one-text request and waits until its batch is on the model (held
/// there by a closed gate); returns the request's task.
pub async fn occupy_model(
    batcher: &Batcher,
    record: &Record,
    text: &'static str,
) -> tokio::task::JoinHandle<Result<mlx_embed_core::Embeddings, mlx_embed_core::CoreError>> {
    let b = batcher.clone();
    let task = tokio::spawn(async move { b.embed(texts(&[text]), EmbedOptions::default()).await });
    eventually(&format!("{text:?} running"), || record.batches().len() == 1).await;
    task
}

/// Checks a caller got exactly the fake's answer for its texts.
pub fn assert_answer(texts: &[String], got: &mlx_embed_core::Embeddings) {
    assert_eq!(got.vectors.len(), texts.len());
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(got.vectors[i], vector_for(t), "vector {i} ({t})");
        assert_eq!(got.token_counts[i], tokens_for(t));
    }
}

/// Sends `n` one-text requests one after another, each after the answer to
/// the one before (a lone caller), checks every answer, and returns how long
/// they took together.
pub async fn lone_requests(batcher: &mlx_embed_core::Batcher, n: usize) -> Duration {
    let started = std::time::Instant::now();
    for i in 0..n {
        let t = format!("lone {i}");
        let got = batcher
            .embed(
                owned_texts(std::slice::from_ref(&t)),
                mlx_embed_core::EmbedOptions::default(),
            )
            .await
            .unwrap();
        assert_answer(&[t], &got);
    }
    started.elapsed()
}

/// A fake that serves from one thread only: it offers no replicas, so
/// neither more model threads nor a query thread.
pub struct Single(pub Fake);

impl Embedder for Single {
    fn info(&self) -> ModelInfo {
        self.0.info()
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.0.tokenizer()
    }
    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        self.0.embed_batch(inputs, output)
    }
}
