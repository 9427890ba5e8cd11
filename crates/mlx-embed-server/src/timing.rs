//! TEI's per-request figures: characters, tokens and phase times of the
//! model work a request did, as TEI's `x-compute-*` / `x-*-time` response
//! headers, its gRPC `Metadata` and its `te_request_*` metrics report them.
//!
//! The core measures the phases ([`mlx_embed_core::Timings`]); the two
//! places that call the model ([`crate::embed`] and [`crate::score`])
//! `record` each call's figures into the request's `measured` scope,
//! which the HTTP layer ([`crate::middleware::observe`]) and each gRPC method
//! open once per request. So every route that runs the model carries the
//! figures, none adds them itself, and a request that runs none (`/info`,
//! `/tokenize`, an error before the model) carries none.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use mlx_embed_core::{EmbedInput, Embeddings, ModelInfo, Timings};

/// What the model work of one request came to over the model calls it
/// made: one for almost every route. A request that makes several at once
/// (`/vertex`'s instances, a gRPC rerank stream's queries) gets each phase averaged
/// over its inputs, as TEI averages a batch request's: summed, overlapping
/// calls' phases would add up to more than the request's own time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Characters of the inputs as sent (a pair's two texts, a token-id
    /// input's ids; prompts the server adds not counted), as TEI counts them.
    pub chars: u64,
    /// Tokens the model ran, special tokens included: the request's usage count.
    pub tokens: u64,
    /// Its model calls' phase times (averaged over their inputs when it made
    /// several).
    pub timings: Timings,
    /// Inputs of its model calls (the weights of `timings`' average).
    pub inputs: u64,
    /// Each of those inputs' own phases, in the order its calls were
    /// answered ([`Embeddings::input_timings`]): what TEI's per-input
    /// families charge each input.
    pub per_input: Vec<Timings>,
    /// What ran it, as `/info`'s device names it: `cpu`, `cuda`, `metal`.
    pub compute_type: String,
}

/// TEI's `te_request_count` `method` of a request: the shape its client
/// sent, not how many inputs it holds (`{"inputs": ["a"]}` is a batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// One input sent bare: a string, a token list, a `/predict` pair;
    /// every unary gRPC call but `Rerank`.
    Single,
    /// A list of inputs; every rerank (TEI's `/rerank` and `Rerank*`).
    Batch,
    /// One message of a gRPC stream: TEI counts it in no
    /// `te_request_count`/`te_request_success`, only in the histograms,
    /// `te_request_failure` and its operation's family.
    Stream,
}

/// Which of TEI's per-input families a model path counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Op {
    /// `te_embed_*`: embeddings of every kind (dense, sparse, per token).
    #[default]
    Embed,
    /// `te_predict_*`: a classifier's or reranker's scores.
    Predict,
}

/// What a `measured` scope saw of the model path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measured {
    /// Inputs the request asked the model path for (`begin`); 0: it never
    /// got there (not a model route, or refused before).
    pub sent: u64,
    /// The figures of its successful model calls (`None`: none succeeded).
    pub usage: Option<Usage>,
    /// Its shape, where its route told it (`shape`); `None`: by its
    /// inputs, one or more.
    pub method: Option<Method>,
    /// The path it took (`begin`'s).
    pub op: Op,
    /// Inputs that reached the model call (`reach`): past every check the
    /// server makes of the request, so tokenized next. TEI's `te_embed_count`
    /// and `te_predict_count` count these, not what was refused before.
    pub reached: u64,
    /// Refused for the model's kind (a rerank of an embedder): TEI's
    /// `err="model_type"`.
    pub model_type: bool,
    /// The model path took it (`begin`), even with no input (`[]`, which
    /// TEI counts, refused).
    pub began: bool,
}

impl Measured {
    /// `method`, else one input is `Single` and more a `Batch`.
    pub fn method(&self) -> Method {
        self.method.unwrap_or(if self.sent > 1 {
            Method::Batch
        } else {
            Method::Single
        })
    }
}

tokio::task_local! {
    static MEASURED: Tally;
}

/// What a request's `measured` scope has added up so far. Shared, not
/// owned by the scope: a request dropped before its end (its client left)
/// loses its scope with it, and whoever counts it as dropped reads this.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tally(Arc<Mutex<Measured>>);

impl Tally {
    /// What was recorded, leaving it empty (a request is counted once).
    pub(crate) fn take(&self) -> Measured {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Measured> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `work` in a scope that `begin` and `record` add to, in `tally`;
/// returns its output and what they recorded.
pub(crate) async fn measured<F: Future>(tally: &Tally, work: F) -> (F::Output, Measured) {
    let out = MEASURED.scope(tally.clone(), work).await;
    (out, tally.take())
}

/// The model path (`op`'s) takes a request of `inputs` inputs (before any
/// check): from here it counts in TEI's `te_request_count`, as a success or
/// a failure.
pub(crate) fn begin(inputs: usize, op: Op) {
    let _ = MEASURED.try_with(|m| {
        let mut m = m.lock();
        m.sent += inputs as u64;
        m.op = op;
        m.began = true;
    });
}

/// The inputs go to the model call (nothing is checked between here and
/// it): counted in TEI's per-input families from here. Returns their
/// characters ([`chars`]), which the call's [`record`] takes.
pub(crate) fn reach(inputs: &[EmbedInput]) -> u64 {
    reached(inputs.len());
    chars(inputs)
}

/// [`reach`] for a call whose client sent `inputs` inputs other than the
/// call's own (late chunking's chunks, run as one text).
pub(crate) fn reached(inputs: usize) {
    let _ = MEASURED.try_with(|m| m.lock().reached += inputs as u64);
}

/// The request was refused for the kind of model it named or got (TEI's
/// `err="model_type"`).
pub(crate) fn note_model_type() {
    let _ = MEASURED.try_with(|m| m.lock().model_type = true);
}

/// Runs `f` in a scope of its own and returns, with its output, what it
/// said there: the shape and checks of one of several requests carried in
/// one (a `/vertex` instance), as its body said it.
pub(crate) fn scoped<T>(f: impl FnOnce() -> T) -> (T, Measured) {
    let tally = Tally::default();
    let out = MEASURED.sync_scope(tally.clone(), f);
    (out, tally.take())
}

/// One TEI request that a route carries inside its own HTTP request (a
/// `/vertex` instance): counted on its own, as TEI counts each instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    /// Its inputs; `None`: those its work sends the model path (`begin`).
    pub inputs: Option<u64>,
    /// Its shape; `None`: what its work says (`shape`), else by its inputs.
    pub method: Option<Method>,
}

/// Runs `work`, the model work of `parts` (one call may answer several),
/// in a scope of its own, and counts each part in TEI's metrics as its own
/// request when `work` ends (by its outcome, `total` from `start`) or as
/// dropped when it is dropped before. Its figures add to the enclosing
/// scope's (the request's headers), its count does not: the carrying
/// request is in no `te_request_count` of its own, as in TEI.
pub(crate) async fn apart<T>(
    state: &crate::state::AppState,
    start: std::time::Instant,
    parts: Vec<Part>,
    work: impl Future<Output = Result<T, crate::errors::ApiError>>,
) -> Result<T, crate::errors::ApiError> {
    let tally = Tally::default();
    let counting = Apart {
        state,
        start,
        parts: &parts,
        tally: &tally,
    };
    let (out, measured) = measured(&tally, work).await;
    std::mem::forget(counting);
    let status = match &out {
        Ok(_) => 200,
        Err(e) => e.kind.status().as_u16(),
    };
    count_parts(state, &parts, &measured, status, start.elapsed());
    if let Some(usage) = &measured.usage {
        absorb(usage);
    }
    out
}

/// Each of `parts` counted with what their shared `measured` saw.
fn count_parts(
    state: &crate::state::AppState,
    parts: &[Part],
    measured: &Measured,
    status: u16,
    total: Duration,
) {
    let usages = part_usages(measured.usage.as_ref(), parts);
    for (part, usage) in parts.iter().zip(usages) {
        let sent = part.inputs.unwrap_or(measured.sent);
        let one = Measured {
            sent,
            usage,
            method: part.method.or(measured.method),
            op: measured.op,
            reached: if measured.reached > 0 { sent } else { 0 },
            model_type: measured.model_type,
            // A part whose body its work could not read is in no count.
            began: part.inputs.is_some() || measured.began,
        };
        state.http_metrics().record_tei(&one, status, total);
    }
}

/// `usage` as each of `parts` has it: the whole, but each input's own
/// phases (`per_input`), which are the parts' inputs in their order, cut
/// to the part's (left whole where they are not one per input: a part then
/// counts with the average).
fn part_usages(usage: Option<&Usage>, parts: &[Part]) -> Vec<Option<Usage>> {
    let all: u64 = parts.iter().filter_map(|p| p.inputs).sum();
    let mut rest = usage
        .map(|u| u.per_input.as_slice())
        .filter(|p| parts.len() > 1 && p.len() as u64 == all);
    parts
        .iter()
        .map(|part| {
            let mut u = usage?.clone();
            if let (Some(per_input), Some(n)) = (rest.as_mut(), part.inputs) {
                let (mine, after) = per_input.split_at(n as usize);
                u.per_input = mine.to_vec();
                *per_input = after;
            }
            Some(u)
        })
        .collect()
}

/// Alive while [`apart`] waits: dropped with it (the client left), it
/// counts its parts as TEI's `dropped`, as the HTTP layer counts a request.
struct Apart<'a> {
    state: &'a crate::state::AppState,
    start: std::time::Instant,
    parts: &'a [Part],
    tally: &'a Tally,
}

impl Drop for Apart<'_> {
    fn drop(&mut self) {
        if self.state.is_abandoning() {
            return;
        }
        let measured = self.tally.take();
        count_parts(
            self.state,
            self.parts,
            &measured,
            crate::middleware::CLIENT_CLOSED_REQUEST,
            self.start.elapsed(),
        );
    }
}

/// Adds `usage`, another scope's figures, to the enclosing scope's, as
/// [`record`] adds a call's.
fn absorb(usage: &Usage) {
    let _ = MEASURED.try_with(|m| {
        let mut m = m.lock();
        let mine = m.usage.get_or_insert_with(|| Usage {
            compute_type: usage.compute_type.clone(),
            ..Usage::default()
        });
        blend(
            mine,
            usage.chars,
            usage.tokens,
            &usage.timings,
            usage.inputs,
        );
        mine.per_input.extend_from_slice(&usage.per_input);
    });
}

/// The request's shape as its client sent it, for TEI's `method` label.
/// The first said stands: a gRPC method says it before the HTTP request
/// it makes of its message reads its inputs.
pub(crate) fn shape(method: Method) {
    let _ = MEASURED.try_with(|m| {
        m.lock().method.get_or_insert(method);
    });
}

/// Characters of `inputs` as TEI counts them: Unicode scalar values of
/// each text (both of a pair), one per id of a token-id input.
pub(crate) fn chars(inputs: &[EmbedInput]) -> u64 {
    let n: usize = inputs
        .iter()
        .map(|input| match input {
            EmbedInput::Text(t) => t.chars().count(),
            EmbedInput::Tokens(ids) => ids.len(),
            EmbedInput::Pair { query, document } => {
                query.chars().count() + document.chars().count()
            }
        })
        .sum();
    n as u64
}

/// Adds one successful model call (`chars` from `chars` of its inputs,
/// `out` its answer, `model` the model that ran it) to the request's
/// figures; outside a `measured` scope (the warm-up call) it does nothing.
pub(crate) fn record(model: &ModelInfo, chars: u64, out: &Embeddings) {
    record_as(model, chars, out.token_counts.len() as u64, out);
}

/// [`record`] for a call whose `inputs` (what its phases are averaged
/// over) are not its own: late chunking runs a request's chunks as one
/// input, and counts them as the chunks its client sent.
pub(crate) fn record_as(model: &ModelInfo, chars: u64, inputs: u64, out: &Embeddings) {
    let _ = MEASURED.try_with(|m| {
        let mut m = m.lock();
        let usage = m.usage.get_or_insert_with(|| Usage {
            compute_type: compute_type(model).to_owned(),
            ..Usage::default()
        });
        let tokens = out.token_counts.iter().map(|&n| u64::from(n)).sum::<u64>();
        blend(usage, chars, tokens, &out.timings, inputs);
        if out.input_timings.len() as u64 == inputs {
            usage.per_input.extend_from_slice(&out.input_timings);
        } else {
            // Late chunking's chunks ran as one input: each chunk is charged
            // the joined text's phases.
            let call = out.input_timings.first().unwrap_or(&out.timings);
            let n = usize::try_from(inputs).unwrap_or(usize::MAX);
            usage.per_input.extend(std::iter::repeat_n(*call, n));
        }
    });
}

/// Adds a call's (or another scope's) counts to `usage`, its phase times
/// averaged in, weighing `inputs`.
fn blend(usage: &mut Usage, chars: u64, tokens: u64, call: &Timings, inputs: u64) {
    usage.chars += chars;
    usage.tokens += tokens;
    let before = usage.inputs;
    let mix = |avg: Duration, call: Duration| average(avg, before, call, inputs);
    let t = &mut usage.timings;
    t.tokenization = mix(t.tokenization, call.tokenization);
    t.queue = mix(t.queue, call.queue);
    t.inference = mix(t.inference, call.inference);
    usage.inputs += inputs;
}

/// The mean of `avg` weighing `n` and `call` weighing `k`: a lone call's
/// own time, however many inputs it had.
fn average(avg: Duration, n: u64, call: Duration, k: u64) -> Duration {
    if n == 0 {
        return call;
    }
    let sum = avg.as_nanos() * u128::from(n) + call.as_nanos() * u128::from(k);
    let nanos = sum / u128::from((n + k).max(1));
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// The backend of the model's device as `/info` shows it (`cuda (NVIDIA
/// H200)` is `cuda`); `unknown` for a model that names none. TEI writes
/// `gpu+optimized` whatever it runs on; ours says what the work ran on.
fn compute_type(model: &ModelInfo) -> &str {
    model
        .details
        .get("device")
        .and_then(|d| d.split_whitespace().next())
        .unwrap_or("unknown")
}

/// TEI's response headers for `usage`, `total` the request's time so far:
/// counts as they are, times in whole milliseconds (rounded down, as TEI's).
/// `x-compute-time` is the total, as TEI's is.
pub(crate) fn headers(usage: &Usage, total: Duration) -> HeaderMap {
    let ms = |d: Duration| d.as_millis().to_string();
    let t = &usage.timings;
    // In `HEADER_NAMES`' order.
    let values = [
        usage.compute_type.clone(),
        ms(total),
        usage.chars.to_string(),
        usage.tokens.to_string(),
        ms(total),
        ms(t.tokenization),
        ms(t.queue),
        ms(t.inference),
    ];
    let mut headers = HeaderMap::with_capacity(values.len());
    for (name, value) in HEADER_NAMES.into_iter().zip(values) {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    headers
}

/// The names `headers` writes, in its order; CORS exposes them to a page's script.
pub(crate) const HEADER_NAMES: [&str; 8] = [
    "x-compute-type",
    "x-compute-time",
    "x-compute-characters",
    "x-compute-tokens",
    "x-total-time",
    "x-tokenization-time",
    "x-queue-time",
    "x-inference-time",
];

#[cfg(test)]
mod tests {
    use super::*;

    fn call(tokens: Vec<u32>, ms: [u64; 3]) -> Embeddings {
        Embeddings {
            token_counts: tokens,
            timings: Timings {
                tokenization: Duration::from_millis(ms[0]),
                queue: Duration::from_millis(ms[1]),
                inference: Duration::from_millis(ms[2]),
            },
            ..Embeddings::default()
        }
    }

    fn on(device: &str) -> ModelInfo {
        ModelInfo {
            details: [("device".to_string(), device.to_string())].into(),
            ..ModelInfo::default()
        }
    }

    #[tokio::test]
    async fn a_scope_sums_its_counts_averages_its_times_and_nothing_outside_it_counts() {
        // The warm-up's call, in no scope: dropped.
        begin(1, Op::Embed);
        record(&on("cpu"), 5, &call(vec![9], [1, 1, 1]));
        let ((), m) = measured(&Tally::default(), async {
            begin(2, Op::Embed);
            record(&on("cuda (NVIDIA H200)"), 3, &call(vec![4, 6], [1, 2, 3]));
            begin(1, Op::Embed);
            record(&on("cpu"), 2, &call(vec![5], [10, 20, 30]));
        })
        .await;
        assert_eq!(m.sent, 3);
        let usage = m.usage.expect("two calls recorded");
        assert_eq!((usage.chars, usage.tokens), (5, 15));
        assert_eq!(usage.compute_type, "cuda", "the first call's model's");
        // Weighted by inputs, 2 and 1: (2*1 + 10) / 3, ...; never their
        // sum, which overlapping calls would push past the request's time.
        assert_eq!(usage.timings.tokenization, Duration::from_millis(4));
        assert_eq!(usage.timings.queue, Duration::from_millis(8));
        assert_eq!(usage.timings.inference, Duration::from_millis(12));
        assert_eq!(usage.inputs, 3);
        // One call: its own times, whatever its size.
        let ((), one) = measured(&Tally::default(), async {
            begin(5, Op::Embed);
            record(&on("cpu"), 1, &call(vec![1; 5], [7, 0, 9]));
        })
        .await;
        let one = one.usage.expect("one call");
        assert_eq!(one.timings, call(vec![], [7, 0, 9]).timings);
        // A call the cache answered whole (no inputs computed, zero times)
        // still weighs its inputs.
        let ((), mixed) = measured(&Tally::default(), async {
            record(&on("cpu"), 1, &call(vec![1], [0, 0, 0]));
            record(&on("cpu"), 1, &call(vec![1], [0, 6, 8]));
        })
        .await;
        let mixed = mixed.usage.expect("two calls");
        assert_eq!(mixed.timings, call(vec![], [0, 3, 4]).timings);
        let ((), none) = measured(&Tally::default(), async {}).await;
        assert_eq!(none, Measured::default());
        // A scope dropped midway leaves what it saw in its tally.
        let tally = Tally::default();
        let mut work = Box::pin(measured(&tally, async {
            begin(4, Op::Predict);
            std::future::pending::<()>().await;
        }));
        assert!(futures_util::FutureExt::now_or_never(work.as_mut()).is_none());
        drop(work);
        assert_eq!(tally.take().sent, 4);
        assert_eq!(tally.take(), Measured::default(), "taken once");
    }

    #[tokio::test]
    async fn a_call_recorded_as_its_client_s_inputs_weighs_those() {
        // Late chunking: three chunks run as one input of 20 tokens.
        let ((), m) = measured(&Tally::default(), async {
            begin(3, Op::Embed);
            record_as(&on("cpu"), 40, 3, &call(vec![20], [3, 0, 6]));
            record(&on("cpu"), 4, &call(vec![5], [9, 0, 0]));
        })
        .await;
        assert_eq!(m.sent, 3);
        let usage = m.usage.expect("two calls recorded");
        assert_eq!((usage.chars, usage.tokens, usage.inputs), (44, 25, 4));
        // Weighted 3 to 1: (3 * 3 + 9) / 4 ms.
        assert_eq!(usage.timings.tokenization, Duration::from_micros(4500));
        assert_eq!(usage.timings.inference, Duration::from_micros(4500));
    }

    #[tokio::test]
    async fn the_first_shape_said_stands_else_the_input_count_tells() {
        let ((), m) = measured(&Tally::default(), async {
            // A gRPC stream's message, then the HTTP request made of it.
            shape(Method::Stream);
            shape(Method::Single);
            begin(1, Op::Predict);
        })
        .await;
        assert_eq!((m.method(), m.op), (Method::Stream, Op::Predict));
        let ((), m) = measured(&Tally::default(), async { begin(1, Op::Embed) }).await;
        assert_eq!(m.method(), Method::Single);
        let ((), m) = measured(&Tally::default(), async { begin(3, Op::Embed) }).await;
        assert_eq!(m.method(), Method::Batch);
        // Outside a scope (the warm-up): nothing, and no panic.
        shape(Method::Batch);
    }

    #[tokio::test]
    async fn inputs_reach_the_model_call_apart_from_those_begun() {
        let text = |t: &str| EmbedInput::Text(t.into());
        let ((), m) = measured(&Tally::default(), async {
            begin(3, Op::Embed);
            assert_eq!(reach(&[text("héllo"), text("ab")]), 7, "their characters");
        })
        .await;
        assert_eq!((m.sent, m.reached, m.began), (3, 2, true));
        // `[]` is begun all the same; a kind refusal is noted.
        let ((), m) = measured(&Tally::default(), async {
            begin(0, Op::Predict);
            note_model_type();
        })
        .await;
        assert_eq!((m.sent, m.began, m.model_type), (0, true, true));
        // A scope of its own inside another: what it says stays in it.
        let ((), outer) = measured(&Tally::default(), async {
            let ((), inner) = scoped(|| shape(Method::Single));
            assert_eq!(inner.method, Some(Method::Single));
            shape(Method::Batch);
        })
        .await;
        assert_eq!(outer.method, Some(Method::Batch));
    }

    #[test]
    fn characters_are_tei_s() {
        let inputs = [
            EmbedInput::Text("héllo".into()),
            EmbedInput::Pair {
                query: "ab".into(),
                document: "c".into(),
            },
            EmbedInput::Tokens(vec![1, 2, 3, 4]),
        ];
        assert_eq!(chars(&inputs), 5 + 3 + 4);
    }

    #[test]
    fn each_part_gets_its_own_inputs_phases() {
        let ms = Duration::from_millis;
        let phase = |q| Timings {
            queue: ms(q),
            ..Timings::default()
        };
        let usage = Usage {
            inputs: 3,
            per_input: vec![phase(1), phase(2), phase(3)],
            ..Usage::default()
        };
        let part = |n| Part {
            inputs: Some(n),
            method: None,
        };
        let cut = part_usages(Some(&usage), &[part(1), part(2)]);
        let per: Vec<_> = cut
            .iter()
            .map(|u| u.as_ref().unwrap().per_input.clone())
            .collect();
        assert_eq!(per, [vec![phase(1)], vec![phase(2), phase(3)]]);
        // Not one per input: each part has them all (and counts the average).
        let cut = part_usages(Some(&usage), &[part(1), part(1)]);
        assert!(cut.iter().all(|u| u.as_ref().unwrap().per_input.len() == 3));
        assert_eq!(part_usages(None, &[part(1)]), [None]);
    }

    #[test]
    fn headers_are_tei_s_names_in_milliseconds() {
        let usage = Usage {
            chars: 12,
            tokens: 7,
            timings: Timings {
                tokenization: Duration::from_micros(1_999),
                queue: Duration::from_millis(3),
                inference: Duration::from_millis(40),
            },
            inputs: 2,
            compute_type: "metal".into(),
            ..Usage::default()
        };
        let h = headers(&usage, Duration::from_micros(45_900));
        let get = |n: &str| h.get(n).unwrap().to_str().unwrap().to_owned();
        assert_eq!(get("x-compute-type"), "metal");
        assert_eq!(get("x-compute-time"), "45");
        assert_eq!(get("x-total-time"), "45");
        assert_eq!(get("x-compute-characters"), "12");
        assert_eq!(get("x-compute-tokens"), "7");
        assert_eq!(get("x-tokenization-time"), "1");
        assert_eq!(get("x-queue-time"), "3");
        assert_eq!(get("x-inference-time"), "40");
        assert_eq!(h.len(), HEADER_NAMES.len());
        assert!(HEADER_NAMES.iter().all(|n| h.contains_key(*n)));
        assert_eq!(compute_type(&ModelInfo::default()), "unknown");
    }
}
