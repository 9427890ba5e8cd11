//! A deterministic fake model and a real server on a free 127.0.0.1 port.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mlx_embed_core::{
    l2_normalize, BatchOutput, Batcher, BatcherConfig, DeviceKind, DeviceMemory, EmbedInput,
    EmbedOptions, Embedder, EmbedderError, Encoded, LiveStats, ModelInfo, ModelKind, Output,
    Prompt, Tokenize, TruncationDirection,
};
use mlx_embed_server::{serve_on, ServerArgs, ServerError};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const DIM: usize = 8;
pub const MAX_TOKENS: usize = 64;
pub const VOCAB: u32 = 1000;
/// First id of a text input (its bytes follow, as ids `byte + 3`).
const TEXT: u32 = 1;
/// First id of a token-id input.
const TOKENS: u32 = 2;
/// Last id of every input.
const END: u32 = 0;

/// The fake's named prompts, as `/info` shows them.
pub fn prompts() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("query".into(), "query: ".into()),
        ("passage".into(), "passage: ".into()),
    ])
}

/// The fake's tokenizer: a marker, one id per byte of prompt + text (or the
/// given ids), an end marker; the content cut to fit `MAX_TOKENS` (or the
/// request's shorter `truncate_to`).
pub struct FakeTokenizer;

impl Tokenize for FakeTokenizer {
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let (start, content): (u32, Vec<u32>) = match input {
            EmbedInput::Text(t) => {
                let prompt = match &options.prompt {
                    Prompt::Default => String::new(),
                    Prompt::Raw(p) => p.clone(),
                    Prompt::Named(name) => prompts().get(name).cloned().ok_or_else(|| {
                        EmbedderError::invalid_input(format!("unknown prompt name {name:?}"))
                    })?,
                };
                (
                    TEXT,
                    format!("{prompt}{t}")
                        .bytes()
                        .map(|b| u32::from(b) + 3)
                        .collect(),
                )
            }
            EmbedInput::Tokens(ids) => {
                if let Some((j, id)) = ids.iter().enumerate().find(|(_, &id)| id >= VOCAB) {
                    return Err(EmbedderError::invalid_input(format!(
                        "token id {id} at position {j} is outside the vocabulary \
                         (ids must be below {VOCAB})"
                    )));
                }
                (TOKENS, ids.clone())
            }
            // A pair is read as one text: query, a unit separator, document.
            EmbedInput::Pair { query, document } => (
                TEXT,
                format!("{query}\u{1f}{document}")
                    .bytes()
                    .map(|b| u32::from(b) + 3)
                    .collect(),
            ),
        };
        let untruncated_len = content.len() as u32 + 2;
        let max = options.input_limit(MAX_TOKENS);
        if max < 3 {
            return Err(EmbedderError::cut_too_short(format!(
                "a cut at {max} tokens leaves no room for text"
            )));
        }
        let keep = content.len().min(max - 2);
        let content = match options.truncation_direction.unwrap_or_default() {
            TruncationDirection::Right => &content[..keep],
            TruncationDirection::Left => &content[content.len() - keep..],
        };
        let mut ids = vec![start];
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

/// Vector = hash of the input's ids; texts starting with "slow" take 600 ms;
/// "boom" fails the batch; "invalid" is refused as invalid input by the
/// model; "panic" kills the model thread. Its live memory is
/// [`FAKE_BYTES_PER_TOKEN`] per padded token of the last batch.
#[derive(Default)]
pub struct Fake {
    memory: Arc<FakeMemory>,
}

/// "Active" bytes per padded token of the fake's last batch.
pub const FAKE_BYTES_PER_TOKEN: u64 = 100;
/// The fake's constant "cache" bytes and cache limit.
pub const FAKE_CACHE_BYTES: u64 = 4096;
pub const FAKE_CACHE_LIMIT: u64 = 1 << 20;

/// The fake's live figures, moved by each batch it runs.
#[derive(Default)]
pub struct FakeMemory {
    active: AtomicU64,
    peak: AtomicU64,
    batches: AtomicU64,
}

impl LiveStats for FakeMemory {
    fn memory(&self) -> Result<DeviceMemory, EmbedderError> {
        Ok(DeviceMemory {
            active_bytes: self.active.load(Ordering::SeqCst),
            cache_bytes: FAKE_CACHE_BYTES,
            peak_bytes: self.peak.load(Ordering::SeqCst),
            cache_limit_bytes: Some(FAKE_CACHE_LIMIT),
        })
    }

    fn details(&self) -> Result<BTreeMap<String, String>, EmbedderError> {
        Ok(BTreeMap::from([
            (
                "batches_run".into(),
                self.batches.load(Ordering::SeqCst).to_string(),
            ),
            // Said at load too: `/info` keeps the load-time wording.
            ("dtype".into(), "fp32 (live)".into()),
        ]))
    }
}

/// The fake's ids for `input` with default options.
pub fn encode(input: &EmbedInput) -> Encoded {
    FakeTokenizer
        .encode(input, &EmbedOptions::default())
        .expect("the fake encodes it")
}

pub fn untruncated_tokens(input: &EmbedInput) -> u32 {
    encode(input).untruncated_len
}

/// The fake's raw (unnormalized) vector for these ids.
pub fn raw_vector_of_ids(ids: &[u32]) -> Vec<f32> {
    (0..DIM)
        .map(|i| {
            let mut h = DefaultHasher::new();
            ids.hash(&mut h);
            i.hash(&mut h);
            (h.finish() % 20_001) as f32 / 1000.0 - 10.0
        })
        .collect()
}

/// Width of the fake's per-token rows: not `DIM`, as a model whose Dense
/// head changes the width has hidden states of another size.
pub const TOKEN_WIDTH: usize = 6;

/// The fake's per-token rows for these ids: row `j` hashes `ids[..=j]`.
pub fn token_rows_of_ids(ids: &[u32]) -> Vec<Vec<f32>> {
    (0..ids.len())
        .map(|j| {
            let mut row = raw_vector_of_ids(&ids[..=j]);
            row.truncate(TOKEN_WIDTH);
            row
        })
        .collect()
}

/// The fake's raw (unnormalized) vector for `input` with default options.
pub fn raw_vector(input: &EmbedInput) -> Vec<f32> {
    raw_vector_of_ids(&encode(input).ids)
}

pub fn unit_vector(input: &EmbedInput) -> Vec<f32> {
    let mut v = raw_vector(input);
    l2_normalize(&mut v);
    v
}

pub fn text(s: &str) -> EmbedInput {
    EmbedInput::Text(s.to_owned())
}

/// The text a text input's ids spell (empty for token-id inputs).
fn text_of_ids(ids: &[u32]) -> String {
    if ids[0] != TEXT {
        return String::new();
    }
    let bytes: Vec<u8> = ids[1..ids.len() - 1]
        .iter()
        .map(|&b| (b - 3) as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Embedder for Fake {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "fake-model".into(),
            dim: DIM,
            max_input_tokens: MAX_TOKENS,
            vocab_size: VOCAB as usize,
            device_batch_tokens: Some(256),
            prompts: prompts(),
            details: BTreeMap::from([
                ("dtype".into(), "float32".into()),
                ("blas".into(), "none".into()),
            ]),
            ..ModelInfo::default()
        }
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(Arc::new(FakeTokenizer))
    }

    fn live_stats(&self) -> Option<Arc<dyn LiveStats>> {
        Some(self.memory.clone())
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        let texts: Vec<String> = inputs.iter().map(|e| text_of_ids(&e.ids)).collect();
        let is = |p: &str| texts.iter().any(|t| t.starts_with(p));
        if is("panic") {
            panic!("fake model panicked");
        }
        if is("boom") {
            return Err(EmbedderError::model_failure("fake model exploded"));
        }
        if is("invalid") {
            return Err(EmbedderError::invalid_input(
                "ValueError: the fake refuses this input",
            ));
        }
        if is("slow") {
            std::thread::sleep(Duration::from_millis(600));
        }
        let padded = inputs.iter().map(Encoded::len).max().unwrap_or(0) * inputs.len();
        let active = padded as u64 * FAKE_BYTES_PER_TOKEN;
        self.memory.active.store(active, Ordering::SeqCst);
        self.memory.peak.fetch_max(active, Ordering::SeqCst);
        self.memory.batches.fetch_add(1, Ordering::SeqCst);
        let (vectors, rows) = match output {
            Output::Pooled => (
                inputs
                    .iter()
                    .flat_map(|e| raw_vector_of_ids(&e.ids))
                    .collect(),
                vec![1; inputs.len()],
            ),
            Output::Tokens => (
                inputs
                    .iter()
                    .flat_map(|e| token_rows_of_ids(&e.ids).concat())
                    .collect(),
                inputs.iter().map(|e| e.len() as u32).collect(),
            ),
            Output::Sparse | Output::MultiVector(_) => {
                unreachable!("the batcher refuses sparse and multi-vector output of this fake")
            }
        };
        Ok(BatchOutput {
            vectors,
            rows,
            padded_tokens: padded as u64,
            gil_wait: Duration::ZERO,
        })
    }
}

pub fn start_batcher(config: BatcherConfig) -> Batcher {
    Batcher::start(config, || Ok(Fake::default())).expect("fake model loads")
}

/// A fake cross-encoder: a classifier (several labels) or a reranker (one),
/// whose logits for an input are the first label-count components of the
/// embedding fake's raw vector of its ids ([`scorer_logits`]).
pub struct FakeScorer {
    pub kind: ModelKind,
}

/// The fake classifier's labels, in logit order.
pub const CLASSIFIER_LABELS: [&str; 3] = ["negative", "neutral", "positive"];

impl FakeScorer {
    pub fn classifier() -> Self {
        Self {
            kind: ModelKind::Classifier {
                labels: CLASSIFIER_LABELS.iter().map(|l| l.to_string()).collect(),
                multi_label: false,
            },
        }
    }
    pub fn reranker() -> Self {
        Self {
            kind: ModelKind::Reranker {
                labels: vec!["LABEL_0".into()],
            },
        }
    }
}

/// The fake scorer's raw logits for `input`: `n` of them.
pub fn scorer_logits(input: &EmbedInput, n: usize) -> Vec<f32> {
    let mut v = raw_vector(input);
    v.truncate(n);
    v
}

impl Embedder for FakeScorer {
    fn info(&self) -> ModelInfo {
        let name = match self.kind {
            ModelKind::Reranker { .. } => "fake-reranker",
            _ => "fake-classifier",
        };
        ModelInfo {
            name: name.into(),
            dim: self.kind.labels().len(),
            kind: self.kind.clone(),
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
        let n = self.kind.labels().len();
        Ok(BatchOutput {
            vectors: inputs
                .iter()
                .flat_map(|e| raw_vector_of_ids(&e.ids)[..n].to_vec())
                .collect(),
            rows: vec![1; inputs.len()],
            padded_tokens: (inputs.iter().map(Encoded::len).max().unwrap_or(0) * inputs.len())
                as u64,
            gil_wait: Duration::ZERO,
        })
    }
}

/// A server with one fake scorer (a [`FakeScorer`]).
pub async fn scorer_server(scorer: fn() -> FakeScorer) -> Server {
    Server::start_with(test_args(), move |config| {
        Batcher::start(config, move || Ok(scorer())).expect("fake scorer loads")
    })
    .await
}

/// A running server; dropping it without `stop` leaves the task to the runtime.
pub struct Server {
    pub base: String,
    pub batcher: Batcher,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServerError>>,
}

impl Server {
    pub async fn start(args: ServerArgs) -> Server {
        Self::start_with(args, start_batcher).await
    }

    /// A server whose one model `start` makes (e.g. a [`FakeScorer`]'s batcher).
    pub async fn start_with(
        args: ServerArgs,
        start: impl FnOnce(BatcherConfig) -> Batcher + Send + 'static,
    ) -> Server {
        let batcher = tokio::task::spawn_blocking({
            let config = args.batcher_config(DeviceKind::Cpu);
            move || start(config)
        })
        .await
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_on(
            listener,
            args,
            batcher.clone(),
            Duration::from_millis(5),
            async move {
                let _ = rx.await;
            },
        ));
        let server = Server {
            base: format!("http://{addr}"),
            batcher,
            stop: Some(tx),
            task,
        };
        server.wait_ready().await;
        server
    }

    /// Defaults, without the warm-up.
    pub async fn default() -> Server {
        Self::start(test_args()).await
    }

    async fn wait_ready(&self) {
        let client = client();
        for _ in 0..200 {
            if let Ok(r) = client.get(self.url("/health")).send().await {
                if r.status().is_success() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("server did not become ready");
    }

    /// Waits until the batcher holds at least `n` admitted inputs.
    pub async fn wait_in_flight(&self, n: u64) {
        for _ in 0..400 {
            if self.batcher.metrics().in_flight_inputs >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("inputs never reached the batcher");
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Triggers the graceful shutdown and waits for `serve_on` to return.
    pub async fn stop(mut self) -> Result<(), ServerError> {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(15), &mut self.task)
            .await
            .expect("server stops in time")
            .unwrap()
    }
}

pub fn test_args() -> ServerArgs {
    ServerArgs {
        no_warmup: true,
        drain_timeout_secs: 5,
        ..ServerArgs::default()
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// The body of a `GET` of `path`, which must answer 200.
pub async fn get_text(server: &Server, path: &str) -> String {
    let answer = client().get(server.url(path)).send().await.unwrap();
    assert_eq!(answer.status(), 200, "GET {path}");
    answer.text().await.unwrap()
}

/// The JSON answer to a `GET` of `path`, which must answer 200.
pub async fn get_json(server: &Server, path: &str) -> serde_json::Value {
    serde_json::from_str(&get_text(server, path).await).unwrap()
}

pub fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}
