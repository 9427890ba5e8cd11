//! Prometheus text exposition, written by hand: the server's own per-route
//! request counts and latencies, plus the core's [`MetricsSnapshot`].
//!
//! Metric names (all prefixed `mlx_embed_`):
//! `http_requests_total{route,code}` (code 499: the client left before the
//! answer), `http_answers_dropped_total` (answers made but dropped unwritten,
//! their clients not reading: each is also in `http_requests_total`),
//! `http_unreadable_requests_total{reason}` (refused by the HTTP/1 parser
//! before any route: `malformed`, `too_large`),
//! `grpc_requests_total{method,code}` (TEI's gRPC API, `--grpc-port`: the
//! method's path and the status code's name, e.g. `INVALID_ARGUMENT`),
//! `http_unsent_answer_bytes` and `http_requests_waiting_for_answer_room`
//! (gauges: `--max-unsent-answers-mb`), `http_request_duration_seconds{route}` (histogram of answers;
//! with several models served, both also carry `model`: the model the request
//! named or was given, `""` where it got none, as a 404 for an unknown one),
//! `waiting_inputs`, `queued_inputs`, `in_flight_inputs` (gauges),
//! `batcher_requests_total{outcome}`, `inputs_cancelled_total`, `batches_total`, `query_thread_batches_total`,
//! `batch_size`, `batch_tokens`, `queue_wait_seconds`, `gil_wait_seconds`,
//! `model_seconds` (histograms), `real_tokens_total`, `padded_tokens_total`,
//! `padding_ratio` (real / padded tokens), `healthy`, `shutting_down`, `info{model,kind,version}`;
//! per priority lane (`{priority="high|normal|low"}`): `lane_waiting_inputs`,
//! `lane_queued_inputs` (gauges), `lane_requests_overloaded_total`,
//! `lane_queue_wait_seconds` (histogram); the embedding cache:
//! `cache_hits_total`, `cache_misses_total`, `cache_entries`, `cache_bytes`,
//! `cache_capacity_bytes`. A server with several models labels every core
//! metric with `model="name"`. MLX's memory, when the model reports it:
//! `mlx_memory_bytes{kind="active|cache|peak|cache_limit"}`, read at scrape
//! time; MLX counts it per process, so it carries no model label.
//!
//! TEI's names beside ours, from the same counts: `te_request_count{method}`,
//! `te_request_success{method}`, `te_request_failure{err}` and the
//! `te_request_*duration` histograms (requests that reached the model path,
//! from the figures of their `x-*` headers: [`crate::timing`]; each
//! `/vertex` instance a request of its own, as TEI counts them), and, per
//! model like the core's own, `te_queue_size`, `te_batch_next_size`,
//! `te_batch_next_tokens` and `te_request_input_length`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use mlx_embed_core::{DeviceMemory, Histogram, LaneMetrics, MetricsSnapshot};

use crate::state::AppState;
use crate::timing::{Measured, Method, Op};

/// Upper bounds (seconds) of the request latency histogram.
const LATENCY_BOUNDS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Default)]
struct RouteStats {
    by_code: BTreeMap<u16, u64>,
    latency: Option<Histogram>,
}

/// Which series a request counts in: its route, and its model where the
/// samples carry one (a server with several models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Series<'a> {
    /// The matched path, or `unmatched`.
    pub route: &'a str,
    /// `None`: no `model` label; `Some("")`: the request reached no model.
    pub model: Option<&'a str>,
}

/// Why hyper refused a request before any route saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// Not HTTP/1 as hyper reads it (400).
    Malformed,
    /// A head past hyper's limits (414, 431).
    TooLarge,
}

/// TEI's duration buckets (its exporter's: 35 steps of x1.5 from 15 us,
/// up to about 15 s), so its dashboards' quantiles read the same. Each is
/// rounded to 5 significant digits: computed, they print as
/// `0.000015000000000000002`, a `le` label no one can read or type.
fn tei_seconds_bounds() -> Vec<f64> {
    (1..=35)
        .map(|k| {
            let bound = 1e-5 * 1.5f64.powi(k);
            // The shortest decimal of the rounded value is what prints.
            format!("{bound:.4e}").parse().unwrap_or(bound)
        })
        .collect()
}

/// TEI's `te_request_*`: the requests that reached the model path (HTTP
/// and gRPC alike), counted once each from the same figures as their
/// `x-*` headers and gRPC `Metadata`; and its per-input `te_embed_*` and
/// `te_predict_*` ([`OpStats`]).
#[derive(Default)]
struct TeiRequests {
    /// By method, `single` and `batch` as the client shaped the request
    /// ([`crate::timing::Method`]): all, and answered. A gRPC stream's
    /// messages are in neither, as in TEI's.
    count: [u64; 2],
    success: [u64; 2],
    /// Failures by TEI's `err` label ([`tei_error`]).
    failure: BTreeMap<&'static str, u64>,
    /// One observation per answered request.
    phases: Phases,
    /// `te_embed_*` and `te_predict_*`, by [`Op`].
    ops: [OpStats; 2],
}

/// A TEI family's four time histograms, in [`PHASES`]' order: the total,
/// tokenization, queue and inference, on TEI's buckets.
struct Phases([Histogram; 4]);

/// Each phase's metric name suffix, in [`Phases`]' order.
const PHASES: [&str; 4] = [
    "duration",
    "tokenization_duration",
    "queue_duration",
    "inference_duration",
];

impl Default for Phases {
    fn default() -> Self {
        Self(std::array::from_fn(|_| {
            Histogram::with_bounds(&tei_seconds_bounds())
        }))
    }
}

impl Phases {
    /// `n` observations of each phase's `seconds`.
    fn observe(&mut self, seconds: [f64; 4], n: u64) {
        for (h, v) in self.0.iter_mut().zip(seconds) {
            observe(h, v, n);
        }
    }
}

/// One of TEI's per-input families (`te_embed_*`, `te_predict_*`): TEI
/// counts each input of a request as its own call of the operation, from
/// its tokenization on. Ours runs a request's inputs as one call, so each
/// input counts with its request's total, and, as TEI charges it, its own
/// phases ([`crate::timing::Usage::per_input`]): its call's tokenization
/// (inputs tokenized together), its queue until its batch started, and its
/// batch's model time.
#[derive(Default)]
struct OpStats {
    count: u64,
    success: u64,
    /// One observation per answered input.
    phases: Phases,
}

/// TEI's `te_request_failure` `err` label for a refused request's status.
fn tei_error(status: u16) -> &'static str {
    match status {
        413 => "batch_size",
        422 => "tokenization",
        424 => "model_type",
        429 => "overloaded",
        499 => "dropped",
        500.. => "inference",
        _ => "validation",
    }
}

/// Per-route (and per-model) request counts by status code and latency histograms.
#[derive(Default)]
pub struct HttpMetrics {
    tei: Mutex<TeiRequests>,
    routes: Mutex<BTreeMap<(String, Option<String>), RouteStats>>,
    answers_dropped: AtomicU64,
    /// gRPC calls (`--grpc-port`) by method and status code name.
    grpc: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    unreadable_malformed: AtomicU64,
    unreadable_too_large: AtomicU64,
}

impl HttpMetrics {
    /// Records one finished request.
    pub fn record(&self, series: Series<'_>, status: u16, seconds: f64) {
        self.count(series, status, Some(seconds));
    }

    /// Counts a request whose client left before the answer (`status` 499);
    /// its time stays out of the latency histogram, which is answers' time.
    pub fn record_client_left(&self, series: Series<'_>, status: u16) {
        self.count(series, status, None);
    }

    /// Counts an answer dropped unwritten because its client did not read
    /// it within `--client-timeout-secs`. Its request was already counted
    /// under its status: the answer was made before it could not be sent.
    pub fn record_answer_dropped(&self) {
        self.answers_dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one finished gRPC call: its method's path and its status
    /// code's name (`OK`, `INVALID_ARGUMENT`, ...).
    pub fn record_grpc(&self, method: &'static str, code: &'static str) {
        let mut grpc = self.grpc.lock().unwrap_or_else(|e| e.into_inner());
        *grpc.entry((method, code)).or_default() += 1;
    }

    /// Counts a request that reached the model path (`measured.began`;
    /// others are ignored) in TEI's `te_request_*`, by its status: an
    /// answer's phase times and `total` in the histograms, a refusal by
    /// TEI's `err` (`model_type` for one refused for the model's kind); and
    /// the inputs that reached the model call (`measured.reached`, but on an
    /// overload, which TEI refuses before) in its operation's family.
    pub fn record_tei(&self, measured: &Measured, status: u16, total: Duration) {
        if !measured.began {
            return;
        }
        let method = match measured.method() {
            Method::Single => Some(0),
            Method::Batch => Some(1),
            Method::Stream => None,
        };
        let inputs = measured.sent;
        let mut tei = self.tei.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = method {
            tei.count[m] += 1;
        }
        let op = match measured.op {
            Op::Embed => 0,
            Op::Predict => 1,
        };
        // TEI counts an input in its operation's family once it is past the
        // request's checks and a permit (an overload is refused before):
        // those tokenized, whatever then becomes of them.
        if status != 429 {
            tei.ops[op].count += measured.reached;
        }
        match (&measured.usage, (200..300).contains(&status)) {
            (Some(usage), true) => {
                if let Some(m) = method {
                    tei.success[m] += 1;
                }
                let t = &usage.timings;
                let seconds = [
                    total.as_secs_f64(),
                    t.tokenization.as_secs_f64(),
                    t.queue.as_secs_f64(),
                    t.inference.as_secs_f64(),
                ];
                tei.phases.observe(seconds, 1);
                let stats = &mut tei.ops[op];
                stats.success += inputs;
                if usage.per_input.len() as u64 == inputs {
                    // Each input its own batch's phases, as TEI charges them.
                    for t in &usage.per_input {
                        let own = [
                            seconds[0],
                            t.tokenization.as_secs_f64(),
                            t.queue.as_secs_f64(),
                            t.inference.as_secs_f64(),
                        ];
                        stats.phases.observe(own, 1);
                    }
                } else {
                    stats.phases.observe(seconds, inputs);
                }
            }
            _ => {
                let err = match status {
                    400 | 424 if measured.model_type => "model_type",
                    _ => tei_error(status),
                };
                *tei.failure.entry(err).or_default() += 1;
            }
        }
    }

    /// Counts a request hyper refused before any route saw it.
    pub fn record_unreadable_request(&self, why: Unreadable) {
        let counter = match why {
            Unreadable::Malformed => &self.unreadable_malformed,
            Unreadable::TooLarge => &self.unreadable_too_large,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn count(&self, series: Series<'_>, status: u16, seconds: Option<f64>) {
        let mut routes = self.routes.lock().unwrap_or_else(|e| e.into_inner());
        let key = (series.route.to_owned(), series.model.map(str::to_owned));
        let stats = routes.entry(key).or_default();
        *stats.by_code.entry(status).or_default() += 1;
        let Some(seconds) = seconds else {
            return;
        };
        let h = stats.latency.get_or_insert_with(|| Histogram {
            bounds: LATENCY_BOUNDS.to_vec(),
            counts: vec![0; LATENCY_BOUNDS.len()],
            ..Histogram::default()
        });
        observe(h, seconds, 1);
    }
}

/// `n` observations of `value`.
fn observe(h: &mut Histogram, value: f64, n: u64) {
    match h.bounds.iter().position(|&b| value <= b) {
        Some(i) => h.counts[i] += n,
        None => h.overflow += n,
    }
    h.sum += value * n as f64;
    h.count += n;
}

/// The whole `/metrics` body; `memory` is the model's device memory, read
/// just before (`None`: the model reports none, and its gauges are left out).
pub fn render(state: &AppState, memory: Option<&DeviceMemory>) -> String {
    let mut out = String::with_capacity(8 * 1024);
    render_http(&mut out, state.http_metrics());
    render_tei(&mut out, state.http_metrics());
    let room = state.answer_room();
    gauge(
        &mut out,
        "mlx_embed_http_unsent_answer_bytes",
        "Bytes of large answers made but not yet taken by their clients (--max-unsent-answers-mb).",
        room.held() as u64,
    );
    gauge(
        &mut out,
        "mlx_embed_http_requests_waiting_for_answer_room",
        "Requests whose answer may be large waiting, before it is computed, for room under \
         --max-unsent-answers-mb.",
        room.waiting() as u64,
    );
    render_models(&mut out, state);
    if let Some(memory) = memory {
        render_memory(&mut out, memory);
    }
    head(
        &mut out,
        "mlx_embed_healthy",
        "1 while the model is up and the server is not draining.",
        "gauge",
    );
    let _ = writeln!(out, "mlx_embed_healthy {}", u8::from(state.is_ready()));
    head(
        &mut out,
        "mlx_embed_shutting_down",
        "1 once a shutdown signal arrived.",
        "gauge",
    );
    let _ = writeln!(
        out,
        "mlx_embed_shutting_down {}",
        u8::from(state.is_shutting_down())
    );
    head(
        &mut out,
        "mlx_embed_info",
        "The served model and server version.",
        "gauge",
    );
    for m in state.models() {
        let _ = writeln!(
            out,
            "mlx_embed_info{{model=\"{}\",kind=\"{}\",version=\"{}\"}} 1",
            escape(&m.name),
            m.info().kind.as_str(),
            env!("CARGO_PKG_VERSION")
        );
    }
    out
}

/// The core's metrics of every model. One model: as they are. Several: every
/// sample gets a `model="name"` label, each family's samples kept together
/// under one HELP/TYPE as the exposition format requires.
fn render_models(out: &mut String, state: &AppState) {
    let models = state.models();
    if let [only] = models {
        render_core(out, &only.batcher.metrics(), only.info().max_input_tokens);
        return;
    }
    // Family name -> (HELP/TYPE lines, samples), in first-seen order.
    let mut families: Vec<(String, String, Vec<String>)> = Vec::new();
    for m in models {
        let mut text = String::new();
        render_core(&mut text, &m.batcher.metrics(), m.info().max_input_tokens);
        let label = format!("model=\"{}\"", escape(&m.name));
        let mut current = usize::MAX;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default();
                current = match families.iter().position(|f| f.0 == name) {
                    Some(i) => i,
                    None => {
                        families.push((name.to_owned(), String::new(), Vec::new()));
                        families.len() - 1
                    }
                };
                if families[current].1.is_empty() {
                    families[current].1.push_str(line);
                }
            } else if line.starts_with("# TYPE ") {
                let head = &mut families[current].1;
                if !head.contains("\n# TYPE ") {
                    head.push('\n');
                    head.push_str(line);
                }
            } else if current != usize::MAX {
                families[current].2.push(with_label(line, &label));
            }
        }
    }
    for (_, head, samples) in families {
        let _ = writeln!(out, "{head}");
        for s in samples {
            let _ = writeln!(out, "{s}");
        }
    }
}

/// `name{a="b"} v` -> `name{label,a="b"} v`; `name v` -> `name{label} v`.
fn with_label(sample: &str, label: &str) -> String {
    match (sample.find('{'), sample.find(' ')) {
        (Some(brace), Some(space)) if brace < space => {
            let inner = &sample[brace + 1..];
            let sep = if inner.starts_with('}') { "" } else { "," };
            format!("{}{{{label}{sep}{inner}", &sample[..brace])
        }
        (_, Some(space)) => format!("{}{{{label}}}{}", &sample[..space], &sample[space..]),
        _ => sample.to_owned(),
    }
}

fn render_http(out: &mut String, http: &HttpMetrics) {
    let routes = http.routes.lock().unwrap_or_else(|e| e.into_inner());
    head(
        out,
        "mlx_embed_http_requests_total",
        "HTTP requests by route and status code.",
        "counter",
    );
    for (series, stats) in routes.iter() {
        let labels = series_labels(series);
        for (code, n) in &stats.by_code {
            let _ = writeln!(
                out,
                "mlx_embed_http_requests_total{{{labels},code=\"{code}\"}} {n}"
            );
        }
    }
    counter(
        out,
        "mlx_embed_http_answers_dropped_total",
        "Answers dropped unwritten, their clients not reading them within \
         --client-timeout-secs (each also counted in http_requests_total by its status).",
        http.answers_dropped.load(Ordering::Relaxed),
    );
    head(
        out,
        "mlx_embed_http_unreadable_requests_total",
        "Requests refused by the HTTP/1 parser before any route saw them (not in \
         http_requests_total): malformed (400), or a head past its limits (414, 431).",
        "counter",
    );
    for (reason, n) in [
        ("malformed", &http.unreadable_malformed),
        ("too_large", &http.unreadable_too_large),
    ] {
        let _ = writeln!(
            out,
            "mlx_embed_http_unreadable_requests_total{{reason=\"{reason}\"}} {}",
            n.load(Ordering::Relaxed)
        );
    }
    head(
        out,
        "mlx_embed_grpc_requests_total",
        "gRPC calls (TEI's gRPC API, --grpc-port) by method and status code.",
        "counter",
    );
    for ((method, code), n) in http.grpc.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = writeln!(
            out,
            "mlx_embed_grpc_requests_total{{method=\"{method}\",code=\"{code}\"}} {n}"
        );
    }
    head(
        out,
        "mlx_embed_http_request_duration_seconds",
        "HTTP request latency by route.",
        "histogram",
    );
    for (series, stats) in routes.iter() {
        if let Some(h) = &stats.latency {
            histogram_lines(
                out,
                "mlx_embed_http_request_duration_seconds",
                &series_labels(series),
                h,
            );
        }
    }
}

/// TEI's request metrics, under TEI's names and labels.
fn render_tei(out: &mut String, http: &HttpMetrics) {
    let tei = http.tei.lock().unwrap_or_else(|e| e.into_inner());
    let methods = ["single", "batch"];
    for (name, help, counts) in [
        (
            "te_request_count",
            "Requests that reached the model path, by method as the client shaped them \
             (single: one input sent bare; batch: a list, or a rerank).",
            &tei.count,
        ),
        (
            "te_request_success",
            "Of te_request_count, those answered.",
            &tei.success,
        ),
    ] {
        head(out, name, help, "counter");
        for (method, n) in methods.iter().zip(counts) {
            let _ = writeln!(out, "{name}{{method=\"{method}\"}} {n}");
        }
    }
    head(
        out,
        "te_request_failure",
        "Of te_request_count, those refused, by TEI's err (validation, tokenization, \
         batch_size, model_type, overloaded, inference, dropped).",
        "counter",
    );
    for (err, n) in &tei.failure {
        let _ = writeln!(out, "te_request_failure{{err=\"{err}\"}} {n}");
    }
    let request_help = [
        "Seconds of an answered te_request_count request (x-total-time).",
        "Seconds its inputs were tokenized (x-tokenization-time).",
        "Seconds it waited for admission and its first batch (x-queue-time).",
        "Seconds of model time its batches took (x-inference-time).",
    ];
    for ((suffix, help), h) in PHASES.iter().zip(request_help).zip(&tei.phases.0) {
        histogram(out, &format!("te_request_{suffix}"), help, h);
    }
    for (op, what, stats) in [
        ("embed", "inputs embedded", &tei.ops[0]),
        (
            "predict",
            "inputs scored (classified or reranked)",
            &tei.ops[1],
        ),
    ] {
        let name = |suffix: &str| format!("te_{op}_{suffix}");
        counter(
            out,
            &name("count"),
            &format!(
                "Of te_request_count's requests (and gRPC stream messages), {what}: those \
                 that reached the model call (tokenized; not those refused before, nor an \
                 overload's)."
            ),
            stats.count,
        );
        counter(
            out,
            &name("success"),
            &format!("Of te_{op}_count, those answered."),
            stats.success,
        );
        let input_help = [
            "Seconds of each answered input: its request's total.",
            "Seconds each answered input was tokenized: its model call's (inputs tokenized together).",
            "Seconds each answered input queued, until its batch started.",
            "Seconds of model time of each answered input: its batch's.",
        ];
        for ((suffix, help), h) in PHASES.iter().zip(input_help).zip(&stats.phases.0) {
            histogram(out, &name(suffix), help, h);
        }
    }
}

/// `route="..."`, and `,model="..."` where the series has one.
fn series_labels((route, model): &(String, Option<String>)) -> String {
    match model {
        Some(model) => format!("route=\"{}\",model=\"{}\"", escape(route), escape(model)),
        None => format!("route=\"{}\"", escape(route)),
    }
}

/// `max_input`: the model's longest input in tokens (`/info`'s
/// `max_input_length`), where TEI's input-length buckets stop.
fn render_core(out: &mut String, m: &MetricsSnapshot, max_input: usize) {
    gauge(
        out,
        "mlx_embed_waiting_inputs",
        "Inputs waiting for admission.",
        m.waiting_inputs,
    );
    gauge(
        out,
        "mlx_embed_queued_inputs",
        "Inputs admitted and queued for the model, not yet in a batch.",
        m.queued_inputs,
    );
    gauge(
        out,
        "mlx_embed_in_flight_inputs",
        "Inputs admitted and not yet answered.",
        m.in_flight_inputs,
    );

    head(
        out,
        "mlx_embed_batcher_requests_total",
        "Batcher requests by outcome.",
        "counter",
    );
    for (outcome, n) in [
        ("ok", m.requests_ok),
        ("overloaded", m.requests_overloaded),
        ("model_error", m.requests_model_error),
        ("unavailable", m.requests_unavailable),
        ("cancelled", m.requests_cancelled),
    ] {
        let _ = writeln!(
            out,
            "mlx_embed_batcher_requests_total{{outcome=\"{outcome}\"}} {n}"
        );
    }
    counter(
        out,
        "mlx_embed_inputs_cancelled_total",
        "Inputs never computed because their caller left first (tokenizing, waiting, queued, or waiting on another caller's computation of the same input).",
        m.inputs_cancelled_before_compute,
    );
    counter(out, "mlx_embed_batches_total", "Model calls.", m.batches);
    counter(
        out,
        "mlx_embed_query_thread_batches_total",
        "Model calls a query thread ran (query-sized calls only, beside the model threads' batches).",
        m.query_thread_batches,
    );
    histogram(
        out,
        "mlx_embed_batch_size",
        "Inputs per model call.",
        &m.batch_size,
    );
    histogram(
        out,
        "mlx_embed_batch_tokens",
        "Estimated padded tokens per model call.",
        &m.batch_tokens,
    );
    counter(
        out,
        "mlx_embed_real_tokens_total",
        "Real tokens the model ran.",
        m.real_tokens,
    );
    counter(
        out,
        "mlx_embed_padded_tokens_total",
        "Padded tokens the model processed.",
        m.padded_tokens,
    );
    head(
        out,
        "mlx_embed_padding_ratio",
        "Real tokens / padded tokens (1 = no padding waste).",
        "gauge",
    );
    let ratio = if m.padded_tokens == 0 {
        1.0
    } else {
        m.real_tokens as f64 / m.padded_tokens as f64
    };
    let _ = writeln!(out, "mlx_embed_padding_ratio {ratio}");
    histogram(
        out,
        "mlx_embed_queue_wait_seconds",
        "Seconds from submission to the start of the batch.",
        &m.queue_wait_seconds,
    );
    histogram(
        out,
        "mlx_embed_gil_wait_seconds",
        "Seconds waiting to enter the Python interpreter per batch.",
        &m.gil_wait_seconds,
    );
    histogram(
        out,
        "mlx_embed_model_seconds",
        "Seconds per model call.",
        &m.model_seconds,
    );
    render_lanes(out, m);
    render_cache(out, m);
    render_tei_core(out, m, max_input);
}

/// TEI's names for the core's own figures: the same counts as the
/// `mlx_embed_*` ones above, in TEI's buckets (powers of two).
fn render_tei_core(out: &mut String, m: &MetricsSnapshot, max_input: usize) {
    gauge(
        out,
        "te_queue_size",
        "Inputs queued for the model, not yet in a batch (mlx_embed_queued_inputs).",
        m.queued_inputs,
    );
    histogram(
        out,
        "te_batch_next_size",
        "Inputs per model call (mlx_embed_batch_size).",
        &m.batch_size,
    );
    histogram(
        out,
        "te_batch_next_tokens",
        "Real tokens per model call, padding not counted (as TEI's).",
        &m.batch_real_tokens,
    );
    histogram(
        out,
        "te_request_input_length",
        "Tokens of each input, after truncation, special tokens included.",
        &cut_at(&m.input_tokens, max_input as f64),
    );
}

/// Per priority lane, labelled `priority="high|normal|low"`.
fn render_lanes(out: &mut String, m: &MetricsSnapshot) {
    type Field = fn(&LaneMetrics) -> u64;
    let gauges: [(&str, &str, &str, Field); 3] = [
        (
            "mlx_embed_lane_waiting_inputs",
            "Inputs waiting for admission, per priority lane.",
            "gauge",
            |l| l.waiting_inputs,
        ),
        (
            "mlx_embed_lane_queued_inputs",
            "Inputs admitted and queued for the model, per priority lane.",
            "gauge",
            |l| l.queued_inputs,
        ),
        (
            "mlx_embed_lane_requests_overloaded_total",
            "Requests a priority lane's queue refused with 429 (full, or past --max-queue-wait-ms); \
             a 429 for answer room is in mlx_embed_http_requests_total only.",
            "counter",
            |l| l.requests_overloaded,
        ),
    ];
    for (name, help, kind, field) in gauges {
        head(out, name, help, kind);
        for lane in &m.lanes {
            let _ = writeln!(
                out,
                "{name}{{priority=\"{}\"}} {}",
                lane.priority,
                field(lane)
            );
        }
    }
    let name = "mlx_embed_lane_queue_wait_seconds";
    head(
        out,
        name,
        "Seconds from submission to the start of the batch, per priority lane.",
        "histogram",
    );
    for lane in &m.lanes {
        let labels = format!("priority=\"{}\"", lane.priority);
        histogram_lines(out, name, &labels, &lane.queue_wait_seconds);
    }
}

fn render_cache(out: &mut String, m: &MetricsSnapshot) {
    let c = &m.cache;
    counter(
        out,
        "mlx_embed_cache_hits_total",
        "Inputs answered from the embedding cache (or a concurrent computation of the same input).",
        c.hits,
    );
    counter(
        out,
        "mlx_embed_cache_misses_total",
        "Inputs the embedding cache did not have and the model computed (none with --no-cache, \
         which looks nothing up).",
        c.misses,
    );
    gauge(
        out,
        "mlx_embed_cache_entries",
        "Vectors in the embedding cache.",
        c.entries,
    );
    gauge(
        out,
        "mlx_embed_cache_bytes",
        "Bytes accounted to the embedding cache's entries.",
        c.bytes,
    );
    gauge(
        out,
        "mlx_embed_cache_capacity_bytes",
        "The embedding cache's size limit (0: off).",
        c.capacity_bytes,
    );
}

/// MLX's memory as one gauge labelled `kind="active|cache|peak"` (plus
/// `cache_limit` when one is set), so a dashboard stacks active and cache.
fn render_memory(out: &mut String, m: &DeviceMemory) {
    let name = "mlx_embed_mlx_memory_bytes";
    head(
        out,
        name,
        "MLX memory now: active (live arrays), cache (freed buffers kept for reuse), peak (highest active since start), cache_limit (the cap on cache).",
        "gauge",
    );
    let kinds = [
        ("active", Some(m.active_bytes)),
        ("cache", Some(m.cache_bytes)),
        ("peak", Some(m.peak_bytes)),
        ("cache_limit", m.cache_limit_bytes),
    ];
    for (kind, value) in kinds {
        if let Some(v) = value {
            let _ = writeln!(out, "{name}{{kind=\"{kind}\"}} {v}");
        }
    }
}

fn head(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    head(out, name, help, "gauge");
    let _ = writeln!(out, "{name} {v}");
}

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    head(out, name, help, "counter");
    let _ = writeln!(out, "{name} {v}");
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    head(out, name, help, "histogram");
    histogram_lines(out, name, "", h);
}

/// Converts a non-cumulative [`Histogram`] into cumulative `_bucket` lines,
/// `+Inf`, `_sum` and `_count` (`_count` equals the `+Inf` bucket).
fn histogram_lines(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let sep = if labels.is_empty() { "" } else { "," };
    let mut cumulative = 0u64;
    for (bound, n) in h.bounds.iter().zip(&h.counts) {
        cumulative += n;
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
        );
    }
    cumulative += h.overflow;
    let _ = writeln!(
        out,
        "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cumulative}"
    );
    let braces = if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    };
    let _ = writeln!(out, "{name}_sum{braces} {}", h.sum);
    let _ = writeln!(out, "{name}_count{braces} {cumulative}");
}

/// `h` with only its bounds up to `max`, as TEI's exporter buckets
/// `te_request_input_length` (powers of two up to the model's maximum
/// length): counts past it move to `+Inf`, the sum and count unchanged.
fn cut_at(h: &Histogram, max: f64) -> Histogram {
    let keep = h.bounds.partition_point(|&b| b <= max);
    Histogram {
        bounds: h.bounds[..keep].to_vec(),
        counts: h.counts[..keep].to_vec(),
        overflow: h.overflow + h.counts[keep..].iter().sum::<u64>(),
        sum: h.sum,
        count: h.count,
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let h = Histogram {
            bounds: vec![1.0, 2.0],
            counts: vec![3, 4],
            overflow: 5,
            sum: 20.5,
            count: 12,
        };
        let mut out = String::new();
        histogram_lines(&mut out, "x", "", &h);
        assert_eq!(
            out,
            "x_bucket{le=\"1\"} 3\nx_bucket{le=\"2\"} 7\nx_bucket{le=\"+Inf\"} 12\nx_sum 20.5\nx_count 12\n"
        );
        let mut out = String::new();
        histogram_lines(&mut out, "x", "route=\"/a\"", &h);
        assert!(out.contains("x_bucket{route=\"/a\",le=\"+Inf\"} 12\n"));
        assert!(out.contains("x_count{route=\"/a\"} 12\n"));
    }

    #[test]
    fn http_metrics_record() {
        let m = HttpMetrics::default();
        let series = |route| Series { route, model: None };
        m.record(series("/embed"), 200, 0.003);
        m.record(series("/embed"), 200, 7.0);
        m.record(series("/embed"), 429, 0.001);
        // A client that left: counted, its time not among the answers'.
        m.record_client_left(series("/embed"), 499);
        m.record_client_left(series("/rerank"), 499);
        let mut out = String::new();
        render_http(&mut out, &m);
        assert!(out.contains("mlx_embed_http_requests_total{route=\"/embed\",code=\"499\"} 1"));
        assert!(out.contains("mlx_embed_http_requests_total{route=\"/rerank\",code=\"499\"} 1"));
        assert!(!out.contains("mlx_embed_http_request_duration_seconds_count{route=\"/rerank\"}"));
        assert!(out.contains("mlx_embed_http_requests_total{route=\"/embed\",code=\"200\"} 2"));
        assert!(out.contains("mlx_embed_http_requests_total{route=\"/embed\",code=\"429\"} 1"));
        assert!(out.contains(
            "mlx_embed_http_request_duration_seconds_bucket{route=\"/embed\",le=\"0.005\"} 2"
        ));
        assert!(out.contains("mlx_embed_http_request_duration_seconds_count{route=\"/embed\"} 3"));
    }

    #[test]
    fn grpc_calls_are_counted_by_method_and_code() {
        let m = HttpMetrics::default();
        m.record_grpc("/tei.v1.Embed/Embed", "OK");
        m.record_grpc("/tei.v1.Embed/Embed", "OK");
        m.record_grpc("/tei.v1.Embed/Embed", "INVALID_ARGUMENT");
        let mut out = String::new();
        render_http(&mut out, &m);
        assert!(out.contains(
            "mlx_embed_grpc_requests_total{method=\"/tei.v1.Embed/Embed\",code=\"OK\"} 2"
        ));
        assert!(out.contains(
            "mlx_embed_grpc_requests_total{method=\"/tei.v1.Embed/Embed\",code=\"INVALID_ARGUMENT\"} 1"
        ));
    }

    #[test]
    fn http_metrics_of_several_models_carry_the_model() {
        let m = HttpMetrics::default();
        let series = |model| Series {
            route: "/embed",
            model: Some(model),
        };
        m.record(series("a"), 200, 0.003);
        m.record(series("b"), 200, 0.003);
        m.record(series("b"), 429, 0.001);
        m.record(series(""), 404, 0.001);
        m.record_client_left(series("a"), 499);
        let mut out = String::new();
        render_http(&mut out, &m);
        for line in [
            "mlx_embed_http_requests_total{route=\"/embed\",model=\"a\",code=\"200\"} 1",
            "mlx_embed_http_requests_total{route=\"/embed\",model=\"a\",code=\"499\"} 1",
            "mlx_embed_http_requests_total{route=\"/embed\",model=\"b\",code=\"200\"} 1",
            "mlx_embed_http_requests_total{route=\"/embed\",model=\"b\",code=\"429\"} 1",
            "mlx_embed_http_requests_total{route=\"/embed\",model=\"\",code=\"404\"} 1",
            "mlx_embed_http_request_duration_seconds_count{route=\"/embed\",model=\"b\"} 2",
            "mlx_embed_http_request_duration_seconds_count{route=\"/embed\",model=\"a\"} 1",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing from\n{out}");
        }
    }

    #[test]
    fn tei_requests_count_once_each_by_method_and_err() {
        use crate::timing::Usage;
        let m = HttpMetrics::default();
        let answered = |sent| Measured {
            sent,
            reached: sent,
            began: true,
            usage: Some(Usage {
                timings: mlx_embed_core::Timings {
                    queue: Duration::from_millis(2),
                    ..Default::default()
                },
                ..Usage::default()
            }),
            ..Measured::default()
        };
        let ms = Duration::from_millis;
        m.record_tei(&answered(1), 200, ms(5));
        m.record_tei(&answered(1), 200, ms(8));
        m.record_tei(&answered(3), 200, ms(9));
        // Refused before the model, or after a call succeeded: failures.
        m.record_tei(
            &Measured {
                sent: 1,
                began: true,
                ..Measured::default()
            },
            400,
            ms(1),
        );
        m.record_tei(&answered(2), 429, ms(1));
        m.record_tei(
            &Measured {
                sent: 1,
                began: true,
                ..Measured::default()
            },
            503,
            ms(1),
        );
        // Never reached the model path: not TEI's request at all.
        m.record_tei(&Measured::default(), 200, ms(1));
        let mut out = String::new();
        render_tei(&mut out, &m);
        for line in [
            "te_request_count{method=\"single\"} 4",
            "te_request_count{method=\"batch\"} 2",
            "te_request_success{method=\"single\"} 2",
            "te_request_success{method=\"batch\"} 1",
            "te_request_failure{err=\"validation\"} 1",
            "te_request_failure{err=\"overloaded\"} 1",
            "te_request_failure{err=\"inference\"} 1",
            "te_request_duration_count 3",
            "te_request_duration_sum 0.022",
            "te_request_queue_duration_sum 0.006",
            "te_request_inference_duration_count 3",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing from\n{out}");
        }
        assert_eq!(tei_error(413), "batch_size");
        assert_eq!(tei_error(422), "tokenization");
        assert_eq!(tei_error(499), "dropped");
    }

    #[test]
    fn tei_counts_the_client_s_shape_streams_apart_and_each_input_per_op() {
        use crate::timing::Usage;
        let m = HttpMetrics::default();
        let ms = Duration::from_millis;
        let answered = |sent, method, op| Measured {
            sent,
            reached: sent,
            began: true,
            model_type: false,
            usage: Some(Usage {
                timings: mlx_embed_core::Timings {
                    inference: ms(4),
                    ..Default::default()
                },
                ..Usage::default()
            }),
            method,
            op,
        };
        // `{"inputs": ["a"]}`: one input, sent as a batch.
        m.record_tei(&answered(1, Some(Method::Batch), Op::Embed), 200, ms(10));
        // A rerank of 3 documents, and 2 gRPC stream messages.
        m.record_tei(&answered(3, Some(Method::Batch), Op::Predict), 200, ms(10));
        m.record_tei(&answered(1, Some(Method::Stream), Op::Embed), 200, ms(10));
        m.record_tei(&answered(1, Some(Method::Stream), Op::Embed), 200, ms(10));
        // A stream message refused: a failure, in no te_request_count.
        let refused = Measured {
            sent: 1,
            reached: 1,
            began: true,
            method: Some(Method::Stream),
            ..Measured::default()
        };
        m.record_tei(&refused, 429, ms(1));
        let mut out = String::new();
        render_tei(&mut out, &m);
        for line in [
            "te_request_count{method=\"single\"} 0",
            "te_request_count{method=\"batch\"} 2",
            "te_request_success{method=\"batch\"} 2",
            "te_request_failure{err=\"overloaded\"} 1",
            "te_request_duration_count 4",
            // The overloaded message is not (TEI refuses it before).
            "te_embed_count 3",
            "te_embed_success 3",
            "te_embed_duration_count 3",
            "te_embed_inference_duration_sum 0.012",
            "te_predict_count 3",
            "te_predict_success 3",
            "te_predict_queue_duration_count 3",
            "te_predict_duration_bucket{le=\"+Inf\"} 3",
            "# TYPE te_predict_inference_duration histogram",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing from\n{out}");
        }
    }

    #[test]
    fn tei_counts_inputs_per_op_once_past_the_request_s_checks() {
        let m = HttpMetrics::default();
        let ms = Duration::from_millis;
        let refused = |sent, reached, model_type| Measured {
            sent,
            reached,
            began: true,
            model_type,
            method: Some(Method::Batch),
            ..Measured::default()
        };
        // Refused before the model call: a request, no input of the op.
        m.record_tei(&refused(40, 0, false), 413, ms(1));
        m.record_tei(&refused(2, 0, false), 400, ms(1));
        // `[]`: a request still, as TEI counts it.
        m.record_tei(&refused(0, 0, false), 400, ms(1));
        // Refused for the model's kind, which TEI labels so.
        m.record_tei(&refused(3, 0, true), 400, ms(1));
        // Tokenized and then refused: in the op's count, a failure.
        m.record_tei(&refused(2, 2, false), 422, ms(1));
        // Overloaded: TEI refuses before its op's count.
        m.record_tei(&refused(5, 5, false), 429, ms(1));
        // Never begun (a body that could not be read): nothing.
        m.record_tei(&Measured::default(), 422, ms(1));
        let mut out = String::new();
        render_tei(&mut out, &m);
        for line in [
            "te_request_count{method=\"batch\"} 6",
            "te_request_success{method=\"batch\"} 0",
            "te_request_failure{err=\"batch_size\"} 1",
            "te_request_failure{err=\"validation\"} 2",
            "te_request_failure{err=\"model_type\"} 1",
            "te_request_failure{err=\"tokenization\"} 1",
            "te_request_failure{err=\"overloaded\"} 1",
            "te_embed_count 2",
            "te_embed_success 0",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} missing from\n{out}");
        }
    }

    #[test]
    fn tei_duration_bounds_print_short() {
        let bounds = tei_seconds_bounds();
        let printed: Vec<String> = bounds.iter().map(f64::to_string).collect();
        assert_eq!(printed[..3], ["0.000015", "0.0000225", "0.00003375"]);
        for p in &printed {
            let digits = p.replace('.', "");
            assert!(digits.trim_start_matches('0').len() <= 5, "{p}");
        }
        // Still TEI's x1.5 steps, to the rounding.
        for w in bounds.windows(2) {
            assert!((w[1] / w[0] - 1.5).abs() < 1e-4, "{w:?}");
        }
        assert_eq!(bounds.len(), 35);
    }

    #[test]
    fn input_length_buckets_stop_at_the_model_s_maximum() {
        let mut h = Histogram::with_bounds(mlx_embed_core::metrics::INPUT_TOKENS_BOUNDS);
        for tokens in [3.0, 512.0, 600.0] {
            h.observe(tokens);
        }
        // TEI's bounds: 2^0..2^19, those <= the maximum (512 here).
        assert_eq!(h.bounds.len(), 20);
        assert_eq!(h.bounds.last(), Some(&524_288.0));
        let mut out = String::new();
        histogram_lines(&mut out, "x", "", &cut_at(&h, 512.0));
        assert!(
            out.contains("x_bucket{le=\"512\"} 2\nx_bucket{le=\"+Inf\"} 3\n"),
            "{out}"
        );
        assert!(!out.contains("le=\"1024\""), "{out}");
        assert!(
            out.contains("x_count 3\n") && out.contains("x_sum 1115\n"),
            "{out}"
        );
        // A maximum off the powers of two keeps the powers below it.
        assert_eq!(cut_at(&h, 8192.0 + 7.0).bounds.len(), 14);
    }

    #[test]
    fn adds_a_label_to_samples() {
        let l = "model=\"m\"";
        assert_eq!(with_label("x 3", l), "x{model=\"m\"} 3");
        assert_eq!(
            with_label("x_bucket{le=\"1\"} 3", l),
            "x_bucket{model=\"m\",le=\"1\"} 3"
        );
        assert_eq!(with_label("x{} 3", l), "x{model=\"m\"} 3");
    }

    #[test]
    fn escapes_labels() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
