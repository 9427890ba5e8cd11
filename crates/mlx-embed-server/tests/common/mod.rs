//! A deterministic fake model and a real server on a free 127.0.0.1 port.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::time::Duration;

use mlx_embed_core::{
    l2_normalize, BatchOutput, Batcher, BatcherConfig, EmbedInput, Embedder, EmbedderError,
    ModelInfo,
};
use mlx_embed_server::{serve_on, ServerArgs, ServerError};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const DIM: usize = 8;
pub const MAX_TOKENS: usize = 64;
pub const VOCAB: u32 = 1000;

/// Vector = hash of the input; texts starting with "slow" take 600 ms; "boom"
/// fails the batch; "panic" kills the model thread.
pub struct Fake;

pub fn untruncated_tokens(input: &EmbedInput) -> u32 {
    match input {
        EmbedInput::Text(t) => (t.len() / 4 + 2) as u32,
        EmbedInput::Tokens(ids) => (ids.len() + 2) as u32,
    }
}

/// The fake's raw (unnormalized) vector.
pub fn raw_vector(input: &EmbedInput) -> Vec<f32> {
    (0..DIM)
        .map(|i| {
            let mut h = DefaultHasher::new();
            match input {
                EmbedInput::Text(t) => (0u8, t).hash(&mut h),
                EmbedInput::Tokens(ids) => (1u8, ids).hash(&mut h),
            }
            i.hash(&mut h);
            (h.finish() % 20_001) as f32 / 1000.0 - 10.0
        })
        .collect()
}

pub fn unit_vector(input: &EmbedInput) -> Vec<f32> {
    let mut v = raw_vector(input);
    l2_normalize(&mut v);
    v
}

pub fn text(s: &str) -> EmbedInput {
    EmbedInput::Text(s.to_owned())
}

impl Embedder for Fake {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "fake-model".into(),
            dim: DIM,
            max_input_tokens: MAX_TOKENS,
            preferred_batch_tokens: None,
            details: BTreeMap::from([
                ("dtype".into(), "float32".into()),
                ("blas".into(), "none".into()),
                ("vocab_size".into(), VOCAB.to_string()),
            ]),
        }
    }

    fn embed_batch(&mut self, inputs: &[EmbedInput]) -> Result<BatchOutput, EmbedderError> {
        let is = |p: &str| {
            inputs
                .iter()
                .any(|i| matches!(i, EmbedInput::Text(t) if t.starts_with(p)))
        };
        if is("panic") {
            panic!("fake model panicked");
        }
        if is("boom") {
            return Err(EmbedderError::new("fake model exploded"));
        }
        if is("slow") {
            std::thread::sleep(Duration::from_millis(600));
        }
        let untruncated: Vec<u32> = inputs.iter().map(untruncated_tokens).collect();
        let counts: Vec<u32> = untruncated
            .iter()
            .map(|&n| n.min(MAX_TOKENS as u32))
            .collect();
        let padded = u64::from(*counts.iter().max().unwrap_or(&0)) * inputs.len() as u64;
        Ok(BatchOutput {
            vectors: inputs.iter().flat_map(raw_vector).collect(),
            token_counts: counts,
            untruncated_token_counts: untruncated,
            padded_tokens: padded,
            gil_wait: Duration::ZERO,
        })
    }
}

pub fn start_batcher(config: BatcherConfig) -> Batcher {
    Batcher::start(config, || Ok(Fake)).expect("fake model loads")
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
        let batcher = tokio::task::spawn_blocking({
            let config = args.batcher_config();
            move || start_batcher(config)
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
