//! Metrics as plain data; the server renders them as Prometheus text.

use crate::{CacheMetrics, Priority};

/// A fixed-bucket histogram: `counts[i]` observations were `<= bounds[i]` and
/// above `bounds[i-1]` (NOT cumulative); `overflow` counts those above the last bound.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Upper bounds of the buckets, increasing.
    pub bounds: Vec<f64>,
    /// Observations in each bucket (not cumulative).
    pub counts: Vec<u64>,
    /// Observations above the last bound.
    pub overflow: u64,
    /// Sum of every observation.
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

/// A consistent-enough copy of every counter, taken without stopping the batcher.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// Inputs waiting for admission right now.
    pub waiting_inputs: u64,
    /// Inputs admitted and not yet answered (queued for or in the model).
    pub in_flight_inputs: u64,
    /// Inputs queued for the model but not yet in a batch.
    pub queued_inputs: u64,
    /// Requests answered with their vectors.
    pub requests_ok: u64,
    /// Requests refused by admission ([`crate::CoreError::Overloaded`]).
    pub requests_overloaded: u64,
    /// Requests the model failed on ([`crate::CoreError::Model`]); refused
    /// input and closed batchers count in none of these.
    pub requests_model_error: u64,
    /// Requests refused because the model was gone
    /// ([`crate::CoreError::ModelUnavailable`]).
    pub requests_unavailable: u64,
    /// Requests whose caller went away before their answer, wherever they
    /// were (tokenizing, waiting for admission, queued, being computed).
    pub requests_cancelled: u64,
    /// Inputs never computed for their caller because it went away first:
    /// while they were tokenized, waited for admission, sat in the queue, or
    /// waited on another call computing the same input (cache single-flight).
    /// Sent inputs add up to computed + cache hits + these.
    pub inputs_cancelled_before_compute: u64,
    /// Model calls run.
    pub batches: u64,
    /// Of `batches`, those a query thread ran
    /// ([`crate::BatcherConfig::query_threads`]).
    pub query_thread_batches: u64,
    /// Inputs per batch.
    pub batch_size: Histogram,
    /// Estimated padded tokens per batch.
    pub batch_tokens: Histogram,
    /// Real tokens per batch (what TEI's `te_batch_next_tokens` counts).
    pub batch_real_tokens: Histogram,
    /// Real tokens the model ran, and padded tokens it processed (padding ratio).
    pub real_tokens: u64,
    /// Padded tokens the model's device passes processed.
    pub padded_tokens: u64,
    /// Seconds from submission to the start of the batch (admission + queue).
    pub queue_wait_seconds: Histogram,
    /// Seconds each batch waited to enter the Python interpreter.
    pub gil_wait_seconds: Histogram,
    /// Seconds of model time per batch.
    pub model_seconds: Histogram,
    /// Tokens of each input of the calls tokenized (after truncation,
    /// special tokens included), cache hits too.
    pub input_tokens: Histogram,
    /// The same queue figures per priority lane, high, normal, low.
    pub lanes: Vec<LaneMetrics>,
    /// The embedding cache (all zero when it is off).
    pub cache: CacheMetrics,
}

/// Queue figures of one priority lane.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaneMetrics {
    /// The lane.
    pub priority: Priority,
    /// Inputs waiting for this lane's admission.
    pub waiting_inputs: u64,
    /// Inputs admitted to this lane, not yet in a batch.
    pub queued_inputs: u64,
    /// Requests of this lane refused (`Overloaded`).
    pub requests_overloaded: u64,
    /// Seconds from arrival to the start of the request's first batch.
    pub queue_wait_seconds: Histogram,
}

/// Bucket bounds for durations in seconds: sub-millisecond queue hops up to
/// a minute of queueing (the default `max_queue_wait`).
pub const SECONDS_BOUNDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// Bucket bounds for inputs per batch: powers of two up to 2^12, as TEI's
/// `te_batch_next_size` (they cover every `max_batch_size`).
pub const BATCH_SIZE_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
];

/// Bucket bounds for an input's tokens: powers of two up to 2^19, as TEI's
/// `te_request_input_length`; the server renders those up to the model's
/// maximum length, as TEI's exporter does.
pub const INPUT_TOKENS_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0, 65536.0, 131072.0, 262144.0, 524288.0,
];

/// Bucket bounds for real tokens per batch: powers of two up to 2^20, as
/// TEI's `te_batch_next_tokens`.
pub const BATCH_REAL_TOKENS_BOUNDS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0, 65536.0, 131072.0, 262144.0, 524288.0, 1048576.0,
];

/// Bucket bounds for padded tokens per batch.
pub const BATCH_TOKENS_BOUNDS: &[f64] = &[
    16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0,
    65536.0,
];

impl Histogram {
    /// An empty histogram with the given ascending upper bounds.
    pub fn with_bounds(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            counts: vec![0; bounds.len()],
            overflow: 0,
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation in the first bucket whose bound is `>= value`.
    pub fn observe(&mut self, value: f64) {
        // Bounds are few (<= 20), so a partition point beats anything fancier.
        let i = self.bounds.partition_point(|&b| b < value);
        match self.counts.get_mut(i) {
            Some(c) => *c += 1,
            None => self.overflow += 1,
        }
        self.sum += value;
        self.count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observe_fills_the_first_bucket_at_or_above() {
        let mut h = Histogram::with_bounds(&[1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 2.0, 3.0] {
            h.observe(v);
        }
        assert_eq!(
            (h.counts.clone(), h.overflow, h.count, h.sum),
            (vec![2, 2], 1, 5, 8.0)
        );
    }
}
