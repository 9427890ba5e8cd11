//! Test-only fault injection around the real model, compiled only with the
//! `test-hooks` feature (the `mlx-embed-server-test` binary): the end-to-end
//! tests prove that a model error fails only its own request and that a dead
//! model thread is noticed, against the real server and model.
//!
//! * `MLX_EMBED_TEST_FAULT=<marker>`: a batch holding an input whose text
//!   contains the marker fails with a model error naming that input's index
//!   in the batch (`RuntimeError: injected test fault on input N`).
//! * `MLX_EMBED_TEST_KILL=<marker>`: such a batch panics the model thread.
//! * `MLX_EMBED_TEST_HOLD=<marker>`: such a batch holds the model thread until
//!   the file named by `MLX_EMBED_TEST_RELEASE` exists (at most
//!   [`HOLD_LIMIT`]), so a test can queue, cancel or kill requests behind a
//!   busy model without racing a batch that merely takes long.
//!
//! * `MLX_EMBED_TEST_PASS_MS=<ms>`: every batch also pays this fixed cost
//!   on a simulated device, one batch after another, as a GPU's passes do
//!   (the real model still computes the vectors): the batching policies for
//!   such a device meet real HTTP clients on a machine without one.
//!
//! The marker is seen where the text still exists, at tokenization; the ids
//! it became are remembered and recognised when their batch runs.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use mlx_embed_core::{
    BatchOutput, EmbedInput, EmbedOptions, Embedder, EmbedderError, Encoded, LiveStats, ModelInfo,
    Output, Submitted, Ticket, Tokenize,
};
use mlx_embed_python::PythonEmbedder;

/// Runs the server with the hooks the environment asks for.
pub fn run(argv: Vec<String>) -> i32 {
    let markers = Markers {
        fault: marker("MLX_EMBED_TEST_FAULT"),
        kill: marker("MLX_EMBED_TEST_KILL"),
        hold: marker("MLX_EMBED_TEST_HOLD"),
    };
    let release = std::env::var_os("MLX_EMBED_TEST_RELEASE").map(PathBuf::from);
    let pass_cost = std::env::var("MLX_EMBED_TEST_PASS_MS")
        .ok()
        .and_then(|ms| ms.parse::<f64>().ok())
        .filter(|ms| *ms > 0.0)
        .map(|ms| Duration::from_secs_f64(ms / 1e3));
    // Cloned per model: a server with several models wraps each.
    crate::launch::run_with(argv, move |model| {
        Faulty::new(model, markers.clone(), release.clone(), pass_cost)
    })
}

/// A held batch goes on by itself after this long, so a failed test cannot
/// leave the server hanging.
pub const HOLD_LIMIT: Duration = Duration::from_secs(120);

fn marker(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|m| !m.is_empty())
}

/// The markers the environment set, each optional.
#[derive(Debug, Clone, Default)]
struct Markers {
    fault: Option<String>,
    kill: Option<String>,
    hold: Option<String>,
}

/// What a marked input does to its batch; one input may carry several.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Hooks {
    fault: bool,
    kill: bool,
    hold: bool,
}

impl Hooks {
    fn of(text: &str, markers: &Markers) -> Self {
        let carries = |m: &Option<String>| m.as_deref().is_some_and(|m| text.contains(m));
        Self {
            fault: carries(&markers.fault),
            kill: carries(&markers.kill),
            hold: carries(&markers.hold),
        }
    }

    fn any(self) -> bool {
        self.fault || self.kill || self.hold
    }
}

/// Ids of the inputs that carried a marker, and what they do.
#[derive(Default)]
struct Marked(Mutex<HashMap<Vec<u32>, Hooks>>);

impl Marked {
    fn add(&self, ids: &[u32], hooks: Hooks) {
        let mut marked = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = marked.entry(ids.to_vec()).or_default();
        entry.fault |= hooks.fault;
        entry.kill |= hooks.kill;
        entry.hold |= hooks.hold;
    }

    fn hooks(&self, ids: &[u32]) -> Hooks {
        let marked = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        marked.get(ids).copied().unwrap_or_default()
    }
}

/// The model's tokenizer, remembering the ids of marked texts.
struct MarkingTokenizer {
    inner: Arc<dyn Tokenize>,
    markers: Markers,
    marked: Arc<Marked>,
}

impl MarkingTokenizer {
    fn mark(&self, input: &EmbedInput, encoded: &Encoded) {
        if let EmbedInput::Text(text) = input {
            let hooks = Hooks::of(text, &self.markers);
            if hooks.any() {
                self.marked.add(&encoded.ids, hooks);
            }
        }
    }
}

impl Tokenize for MarkingTokenizer {
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let encoded = self.inner.encode(input, options)?;
        self.mark(input, &encoded);
        Ok(encoded)
    }

    fn encode_request(
        &self,
        inputs: &[EmbedInput],
        options: &EmbedOptions,
    ) -> Result<Vec<Encoded>, (usize, EmbedderError)> {
        let encoded = self.inner.encode_request(inputs, options)?;
        for (input, e) in inputs.iter().zip(&encoded) {
            self.mark(input, e);
        }
        Ok(encoded)
    }
}

/// The real model behind the hooks.
pub struct Faulty {
    model: PythonEmbedder,
    tokenizer: Option<Arc<dyn Tokenize>>,
    marked: Arc<Marked>,
    release: Option<PathBuf>,
    device: Option<SimulatedDevice>,
}

/// The fixed cost of `MLX_EMBED_TEST_PASS_MS`: each batch holds the
/// simulated device for `pass` after the one before it.
struct SimulatedDevice {
    pass: Duration,
    free_at: Instant,
}

impl SimulatedDevice {
    /// Queues a pass; returns when it will be done.
    fn queue(&mut self) -> Instant {
        self.free_at = self.free_at.max(Instant::now()) + self.pass;
        self.free_at
    }
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

impl Faulty {
    fn new(
        model: PythonEmbedder,
        markers: Markers,
        release: Option<PathBuf>,
        pass_cost: Option<Duration>,
    ) -> Self {
        let marked = Arc::new(Marked::default());
        let tokenizer = model.tokenizer().map(|inner| {
            Arc::new(MarkingTokenizer {
                inner,
                markers,
                marked: marked.clone(),
            }) as Arc<dyn Tokenize>
        });
        Self {
            model,
            tokenizer,
            marked,
            release,
            device: pass_cost.map(|pass| SimulatedDevice {
                pass,
                free_at: Instant::now(),
            }),
        }
    }

    /// The model's output for a queued batch, once the simulated device is
    /// done with it too.
    fn collect_queued(&mut self, queued: Queued) -> Result<BatchOutput, EmbedderError> {
        let output = self.model.collect(queued.ticket);
        sleep_until(queued.done_at);
        output
    }

    /// When the simulated device finishes a batch queued now (now without one).
    fn queue_pass(&mut self) -> Instant {
        self.device
            .as_mut()
            .map_or_else(Instant::now, SimulatedDevice::queue)
    }
}

impl Embedder for Faulty {
    fn info(&self) -> ModelInfo {
        self.model.info()
    }

    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        self.tokenizer.clone()
    }

    fn live_stats(&self) -> Option<Arc<dyn LiveStats>> {
        self.model.live_stats()
    }

    fn embed_batch(
        &mut self,
        inputs: &[Encoded],
        output: Output,
    ) -> Result<BatchOutput, EmbedderError> {
        self.injected(inputs)?;
        let done_at = self.queue_pass();
        let output = self.model.embed_batch(inputs, output);
        sleep_until(done_at);
        output
    }

    fn pipelines(&self) -> bool {
        self.model.pipelines()
    }

    /// A hooked batch is never queued: its ticket carries the injected fault,
    /// which it answers when collected, as a failure on the device would.
    fn submit(&mut self, next: &[Encoded], output: Output, running: Option<Ticket>) -> Submitted {
        let (failed, inner_running) = match running.map(Hooked::from_ticket) {
            Some(Hooked::Failed(error)) => (Some(Err(error)), None),
            Some(Hooked::Queued(queued)) => (None, Some(queued)),
            None => (None, None),
        };
        let running_done_at = inner_running.as_ref().map(|q| q.done_at);
        match self.injected(next) {
            Err(error) => Submitted {
                next: Ok(Ticket::new(Hooked::Failed(error))),
                running: failed.or_else(|| inner_running.map(|q| self.collect_queued(q))),
            },
            Ok(()) => {
                let done_at = self.queue_pass();
                let step = self
                    .model
                    .submit(next, output, inner_running.map(|q| q.ticket));
                if let Some(running) = running_done_at {
                    sleep_until(running);
                }
                Submitted {
                    next: step
                        .next
                        .map(|ticket| Ticket::new(Hooked::Queued(Queued { ticket, done_at }))),
                    running: failed.or(step.running),
                }
            }
        }
    }

    fn collect(&mut self, ticket: Ticket) -> Result<BatchOutput, EmbedderError> {
        match Hooked::from_ticket(ticket) {
            Hooked::Failed(error) => Err(error),
            Hooked::Queued(queued) => self.collect_queued(queued),
        }
    }
}

/// A batch [`Faulty`] submitted: failed by a hook, or queued on the model.
enum Hooked {
    Failed(EmbedderError),
    Queued(Queued),
}

/// A batch on the model, and when the simulated device is done with it.
struct Queued {
    ticket: Ticket,
    done_at: Instant,
}

impl Hooked {
    fn from_ticket(ticket: Ticket) -> Self {
        ticket
            .into_inner()
            .unwrap_or_else(|_| panic!("a ticket Faulty did not issue"))
    }
}

impl Faulty {
    /// Holds a batch with a hold marker until released, then panics for one
    /// with a kill marker, or fails one with a fault marker.
    fn injected(&self, inputs: &[Encoded]) -> Result<(), EmbedderError> {
        let hooks: Vec<Hooks> = inputs.iter().map(|e| self.marked.hooks(&e.ids)).collect();
        if hooks.iter().any(|h| h.hold) {
            self.hold();
        }
        if hooks.iter().any(|h| h.kill) {
            panic!("test hook MLX_EMBED_TEST_KILL: killing the model thread");
        }
        if let Some(i) = hooks.iter().position(|h| h.fault) {
            return Err(EmbedderError::model_failure(format!(
                "RuntimeError: injected test fault on input {i}"
            )));
        }
        Ok(())
    }

    /// Blocks the model thread until the release file exists, or [`HOLD_LIMIT`].
    fn hold(&self) {
        let Some(release) = &self.release else {
            tracing::warn!("MLX_EMBED_TEST_HOLD without MLX_EMBED_TEST_RELEASE: not holding");
            return;
        };
        tracing::info!(release = %release.display(), "test hook: holding the model thread");
        let started = Instant::now();
        while !release.exists() {
            if started.elapsed() > HOLD_LIMIT {
                tracing::warn!("test hook: never released; going on");
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        tracing::info!("test hook: released");
    }
}
