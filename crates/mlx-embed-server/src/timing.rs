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

use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use mlx_embed_core::{EmbedInput, Embeddings, ModelInfo, Timings};

/// What the model work of one request came to: the sums over the model
/// calls it made (one for almost every route; a request that makes several
/// at once, as `/invocations`' groups, counts each call's times in full).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Characters of the inputs as sent (a pair's two texts, a token-id
    /// input's ids; prompts the server adds not counted), as TEI counts them.
    pub chars: u64,
    /// Tokens the model ran, special tokens included: the request's usage count.
    pub tokens: u64,
    /// Summed phase times of its model calls.
    pub timings: Timings,
    /// What ran it, as `/info`'s device names it: `cpu`, `cuda`, `metal`.
    pub compute_type: String,
}

/// What a `measured` scope saw of the model path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Measured {
    /// Inputs the request asked the model path for (`begin`); 0: it never
    /// got there (not a model route, or refused before).
    pub sent: u64,
    /// The figures of its successful model calls (`None`: none succeeded).
    pub usage: Option<Usage>,
}

tokio::task_local! {
    static MEASURED: RefCell<Measured>;
}

/// Runs `work` in a scope that `begin` and `record` add to; returns its
/// output and what they recorded.
pub(crate) async fn measured<F: Future>(work: F) -> (F::Output, Measured) {
    MEASURED
        .scope(RefCell::new(Measured::default()), async move {
            let out = work.await;
            (out, MEASURED.with(|m| std::mem::take(&mut *m.borrow_mut())))
        })
        .await
}

/// The model path takes a request of `inputs` inputs (before any check):
/// from here it counts in TEI's `te_request_count`, as a success or a failure.
pub(crate) fn begin(inputs: usize) {
    let _ = MEASURED.try_with(|m| m.borrow_mut().sent += inputs as u64);
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
    let _ = MEASURED.try_with(|m| {
        let mut m = m.borrow_mut();
        let usage = m.usage.get_or_insert_with(|| Usage {
            compute_type: compute_type(model).to_owned(),
            ..Usage::default()
        });
        usage.chars += chars;
        usage.tokens += out.token_counts.iter().map(|&n| u64::from(n)).sum::<u64>();
        let t = &mut usage.timings;
        t.tokenization += out.timings.tokenization;
        t.queue += out.timings.queue;
        t.inference += out.timings.inference;
    });
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
    let values = [
        ("x-compute-type", usage.compute_type.clone()),
        ("x-compute-time", ms(total)),
        ("x-compute-characters", usage.chars.to_string()),
        ("x-compute-tokens", usage.tokens.to_string()),
        ("x-total-time", ms(total)),
        ("x-tokenization-time", ms(t.tokenization)),
        ("x-queue-time", ms(t.queue)),
        ("x-inference-time", ms(t.inference)),
    ];
    let mut headers = HeaderMap::with_capacity(values.len());
    for (name, value) in values {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    headers
}

/// The names `headers` writes, for CORS to expose to a page's script.
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
    async fn a_scope_sums_its_calls_and_nothing_outside_it_counts() {
        // The warm-up's call, in no scope: dropped.
        begin(1);
        record(&on("cpu"), 5, &call(vec![9], [1, 1, 1]));
        let ((), m) = measured(async {
            begin(2);
            record(&on("cuda (NVIDIA H200)"), 3, &call(vec![4, 6], [1, 2, 3]));
            begin(1);
            record(&on("cpu"), 2, &call(vec![5], [10, 20, 30]));
        })
        .await;
        assert_eq!(m.sent, 3);
        let usage = m.usage.expect("two calls recorded");
        assert_eq!((usage.chars, usage.tokens), (5, 15));
        assert_eq!(usage.compute_type, "cuda", "the first call's model's");
        assert_eq!(usage.timings.tokenization, Duration::from_millis(11));
        assert_eq!(usage.timings.queue, Duration::from_millis(22));
        assert_eq!(usage.timings.inference, Duration::from_millis(33));
        let ((), none) = measured(async {}).await;
        assert_eq!(none, Measured::default());
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
    fn headers_are_tei_s_names_in_milliseconds() {
        let usage = Usage {
            chars: 12,
            tokens: 7,
            timings: Timings {
                tokenization: Duration::from_micros(1_999),
                queue: Duration::from_millis(3),
                inference: Duration::from_millis(40),
            },
            compute_type: "metal".into(),
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
