//! The batcher in front of a device whose every pass has a fixed cost, as a
//! GPU's does (about 3 ms for a MiniLM pass on an H200, whatever its size),
//! with closed-loop callers: each sends one request, waits for its answer,
//! and comes back after a short turnaround (the HTTP round trip and the
//! client's own work). What matters there is how many passes a round of
//! callers is cut into, since every pass pays the fixed cost again.
//!
//! The device is simulated (a clock, no model): a pass of `n` inputs takes
//! `fixed + n x per_input` once the device is free, so the figures isolate
//! the batching policy from any model or machine.
//!
//! Two ways of grouping are compared with the accelerator's defaults: the
//! batch window (an idle model waits for company) and the regroup window
//! (after a batch is answered, the next cut waits for its callers to come
//! back); and, with independent users who do not wait for answers, what the
//! regroup window costs them.
//!
//! `cargo bench -p mlx-embed-core --bench fixed_cost_device`
//! (optional arguments: seconds per scenario, default 3; rounds, default 3).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx_embed_core::{
    BatchOutput, Batcher, BatcherConfig, DeviceKind, EmbedInput, EmbedOptions, Embedder,
    EmbedderError, Encoded, ModelInfo, Output, Submitted, Ticket, Tokenize,
};

const DIM: usize = 8;

/// The simulated device's cost model.
#[derive(Debug, Clone, Copy)]
struct Device {
    /// What every pass costs, whatever its size.
    fixed: Duration,
    /// What each input adds.
    per_input: Duration,
    /// The host's work to queue a pass (padding, building the graph), done
    /// on the model thread before the pass can start.
    host: Duration,
}

/// A pipelined model on the simulated device: `submit` queues a pass behind
/// the running one, `collect` sleeps until its pass is done.
struct Simulated {
    device: Device,
    /// When the device finishes the last pass queued.
    free_at: Instant,
    passes: Arc<AtomicU64>,
}

struct Pass {
    done_at: Instant,
    inputs: usize,
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// Holds the thread for `d` (a sleep would give the core away; the host's
/// work does not).
fn spin(d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

impl Simulated {
    fn queue(&mut self, inputs: usize) -> Pass {
        spin(self.device.host);
        let start = self.free_at.max(Instant::now());
        self.free_at = start + self.device.fixed + self.device.per_input * inputs as u32;
        self.passes.fetch_add(1, Ordering::Relaxed);
        Pass {
            done_at: self.free_at,
            inputs,
        }
    }

    fn output(pass: Pass) -> BatchOutput {
        sleep_until(pass.done_at);
        BatchOutput {
            vectors: vec![0.0; pass.inputs * DIM],
            rows: vec![1; pass.inputs],
            padded_tokens: 4 * pass.inputs as u64,
            gil_wait: Duration::ZERO,
        }
    }
}

struct FourIds;

impl Tokenize for FourIds {
    fn encode(&self, input: &EmbedInput, _: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let EmbedInput::Text(text) = input else {
            return Err(EmbedderError::invalid_input("text only"));
        };
        Ok(Encoded {
            ids: vec![1, text.len() as u32, 2],
            type_ids: None,
            untruncated_len: 3,
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }
}

impl Embedder for Simulated {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            name: "simulated-device".into(),
            dim: DIM,
            max_input_tokens: 512,
            ..ModelInfo::default()
        }
    }
    fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
        Some(Arc::new(FourIds))
    }
    fn embed_batch(&mut self, inputs: &[Encoded], _: Output) -> Result<BatchOutput, EmbedderError> {
        let pass = self.queue(inputs.len());
        Ok(Self::output(pass))
    }
    fn pipelines(&self) -> bool {
        true
    }
    fn submit(&mut self, next: &[Encoded], _: Output, running: Option<Ticket>) -> Submitted {
        let pass = self.queue(next.len());
        let running = running.map(|t| self.collect(t));
        Submitted {
            next: Ok(Ticket::new(pass)),
            running,
        }
    }
    fn collect(&mut self, ticket: Ticket) -> Result<BatchOutput, EmbedderError> {
        let pass = ticket
            .into_inner::<Pass>()
            .map_err(|_| EmbedderError::model_failure("not a pass"))?;
        Ok(Self::output(pass))
    }
}

/// The clients.
#[derive(Debug, Clone, Copy)]
enum Load {
    /// `callers` of them, each sending `per_request` texts at a time and
    /// coming back after a turnaround spread evenly over `turnaround` (the
    /// slowest client's HTTP round trip and parsing).
    Closed {
        callers: usize,
        per_request: usize,
        turnaround: Duration,
    },
    /// `per_ms` one-text requests every millisecond, whatever the answers do
    /// (independent users): what the regroup window may cost.
    Open { per_ms: usize },
}

impl Load {
    fn per_request(&self) -> usize {
        match *self {
            Load::Closed { per_request, .. } => per_request,
            Load::Open { .. } => 1,
        }
    }

    /// Inputs one pass would take if each round of callers shared one.
    fn round_inputs(&self) -> usize {
        match *self {
            Load::Closed {
                callers,
                per_request,
                ..
            } => callers * per_request,
            Load::Open { per_ms } => per_ms,
        }
    }

    fn describe(&self) -> String {
        match *self {
            Load::Closed {
                callers,
                per_request,
                turnaround,
            } => format!("{callers} x {per_request} texts, turnaround up to {turnaround:?}"),
            Load::Open { per_ms } => format!("open: {per_ms} one-text requests every ms"),
        }
    }
}

struct Outcome {
    texts_per_s: f64,
    passes: u64,
    requests: u64,
    p50: Duration,
    p99: Duration,
}

fn run(
    runtime: &tokio::runtime::Runtime,
    config: BatcherConfig,
    device: Device,
    load: Load,
    seconds: f64,
) -> Outcome {
    let passes = Arc::new(AtomicU64::new(0));
    let counter = passes.clone();
    let batcher = Batcher::start(config, move || {
        Ok(Simulated {
            device,
            free_at: Instant::now(),
            passes: counter,
        })
    })
    .expect("start");
    let (elapsed, mut latencies) = runtime.block_on(async {
        let until = Instant::now() + Duration::from_secs_f64(seconds);
        let started = Instant::now();
        let tasks: Vec<_> = match load {
            Load::Closed {
                callers,
                per_request,
                turnaround,
            } => (0..callers)
                .map(|c| {
                    let b = batcher.clone();
                    // Caller c always takes the same share of the spread, as a
                    // client process serving several connections in turn does.
                    let turnaround = turnaround.mul_f64((c + 1) as f64 / callers as f64);
                    tokio::spawn(async move {
                        let mut lat = Vec::new();
                        let mut i = 0usize;
                        // Bounded by time and by count.
                        while Instant::now() < until && i < 1_000_000 {
                            let inputs = (0..per_request)
                                .map(|k| EmbedInput::Text(format!("c{c} r{i} t{k}")))
                                .collect();
                            let t = Instant::now();
                            b.embed(inputs, EmbedOptions::default()).await.unwrap();
                            lat.push(t.elapsed());
                            // tokio's timer rounds up to whole milliseconds.
                            tokio::task::spawn_blocking(move || std::thread::sleep(turnaround))
                                .await
                                .unwrap();
                            i += 1;
                        }
                        lat
                    })
                })
                .collect(),
            Load::Open { per_ms } => {
                let mut tick = tokio::time::interval(Duration::from_millis(1));
                let mut sent = Vec::new();
                let mut i = 0usize;
                while Instant::now() < until && i < 1_000_000 {
                    tick.tick().await;
                    for _ in 0..per_ms {
                        let b = batcher.clone();
                        let text = format!("open r{i}");
                        i += 1;
                        sent.push(tokio::spawn(async move {
                            let t = Instant::now();
                            b.embed(vec![EmbedInput::Text(text)], EmbedOptions::default())
                                .await
                                .unwrap();
                            vec![t.elapsed()]
                        }));
                    }
                }
                sent
            }
        };
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        (started.elapsed(), all)
    });
    latencies.sort();
    let requests = latencies.len() as u64;
    Outcome {
        texts_per_s: (requests as usize * load.per_request()) as f64 / elapsed.as_secs_f64(),
        passes: passes.load(Ordering::Relaxed),
        requests,
        p50: latencies[latencies.len() / 2],
        p99: latencies[latencies.len() * 99 / 100],
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| !a.starts_with('-'));
    let seconds: f64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The H200's MiniLM figures: ~3 ms a pass, one call of 8,192 texts at
    // ~31,000 texts/s (so ~30 us a text), ~1 ms of host work a pass.
    let device = Device {
        fixed: Duration::from_micros(3000),
        per_input: Duration::from_micros(30),
        host: Duration::from_micros(500),
    };
    let loads = [
        Load::Closed {
            callers: 64,
            per_request: 1,
            turnaround: Duration::from_micros(1500),
        },
        Load::Closed {
            callers: 4,
            per_request: 32,
            turnaround: Duration::from_micros(1500),
        },
        Load::Closed {
            callers: 1,
            per_request: 1,
            turnaround: Duration::from_micros(200),
        },
        Load::Open { per_ms: 2 },
        Load::Open { per_ms: 8 },
    ];
    // No embedding cache: every text must reach the device. No window: the
    // accelerator's defaults before the regroup window.
    let gpu = BatcherConfig {
        cache_bytes: 0,
        regroup_window: Duration::ZERO,
        ..BatcherConfig::for_device(DeviceKind::Accelerator)
    };
    let configs: Vec<(&str, BatcherConfig)> = vec![
        ("no window", gpu.clone()),
        (
            "batch window 2 ms",
            BatcherConfig {
                batch_window: Duration::from_millis(2),
                ..gpu.clone()
            },
        ),
        (
            "regroup window 2 ms",
            BatcherConfig {
                regroup_window: Duration::from_millis(2),
                ..gpu.clone()
            },
        ),
        (
            "regroup window 4 ms (the default)",
            BatcherConfig {
                cache_bytes: 0,
                ..BatcherConfig::for_device(DeviceKind::Accelerator)
            },
        ),
    ];
    println!(
        "simulated device: {:?} a pass + {:?} an input, {:?} of host work a pass; {seconds} s a scenario, medians of {rounds}",
        device.fixed, device.per_input, device.host
    );
    println!(
        "| load | config | texts/s | of one pass a round | inputs per pass | p50 ms | p99 ms |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|");
    for load in loads {
        let round_inputs = load.round_inputs();
        // One pass per round of callers, and no turnaround: more than any
        // policy can reach with callers that wait for their answers.
        let ideal = round_inputs as f64
            / (device.fixed + device.per_input * round_inputs as u32 + device.host).as_secs_f64();
        for (name, config) in &configs {
            let mut rate = Vec::new();
            let mut per_pass = Vec::new();
            let mut p50 = Vec::new();
            let mut p99 = Vec::new();
            for _ in 0..rounds {
                let o = run(&runtime, config.clone(), device, load, seconds);
                rate.push(o.texts_per_s);
                per_pass.push((o.requests as usize * load.per_request()) as f64 / o.passes as f64);
                p50.push(o.p50.as_secs_f64() * 1e3);
                p99.push(o.p99.as_secs_f64() * 1e3);
            }
            let rate = median(rate);
            let of_ideal = match load {
                Load::Closed { .. } => format!("{:.2}", rate / ideal),
                Load::Open { .. } => "-".into(),
            };
            println!(
                "| {} | {name} | {rate:.0} | {of_ideal} | {:.1} | {:.2} | {:.2} |",
                load.describe(),
                median(per_pass),
                median(p50),
                median(p99)
            );
        }
    }
}
