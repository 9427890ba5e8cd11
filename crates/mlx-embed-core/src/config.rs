//! Batching and admission settings.

use std::time::Duration;

/// How the batcher admits and groups work. `Default` serves well out of the box.
#[derive(Debug, Clone, PartialEq)]
pub struct BatcherConfig {
    /// Most inputs in one model call. 64 by default: the MLX engine on a CPU
    /// still gains from 32 to 64 inputs per call (short texts, 2 cores: 246
    /// to 286 texts/s, docs/benchmarks.md), and the engine cuts a call into
    /// its own cache-sized passes anyway. 256 for a model on an accelerator
    /// ([`BatcherConfig::for_device`]).
    pub max_batch_size: usize,
    /// Most padded tokens (longest estimate x count) in one model call.
    /// 8192 by default, 32768 on an accelerator.
    pub max_batch_tokens: usize,
    /// How long an idle model waits for company before running a lone request.
    /// Zero by default: on an idle model waiting only adds latency. A year at
    /// most: a longer one (`Duration::MAX` too) runs as a year.
    pub batch_window: Duration,
    /// How long a batch may wait, after a batch is answered, for that
    /// batch's callers to come back. Zero (the default) turns it off.
    ///
    /// Callers that wait for their answer before they send again (a client
    /// with N connections, a pipeline awaiting its embeddings) come back
    /// together shortly after their batch is answered. On a device where
    /// every pass has a fixed cost, running whatever is queued at once
    /// splits them for good into groups that alternate on the device, each
    /// paying the fixed cost; waiting up to this long for the ones answered
    /// lately folds them back into one pass. Only requests a batch completes
    /// count as answered. The wait ends early once as many inputs have
    /// arrived (or been answered from the cache) as those requests held, at a
    /// batch full by inputs or by tokens, or for a high-priority input, so a
    /// lone caller that comes straight back with as many inputs never waits
    /// for it. Nothing waits without batching or once the batcher is closed.
    /// With several model threads each answer restarts the window. 4 ms on
    /// an accelerator ([`BatcherConfig::for_device`]), zero on the CPU, where
    /// a pass costs what its inputs cost and waiting gains nothing. A year at
    /// most, as `batch_window`.
    pub regroup_window: Duration,
    /// Inputs (not requests) admitted at once, per priority lane and line;
    /// more wait their turn in FIFO order. Each lane has its own room, so
    /// bulk traffic in one lane cannot take the room queries need in
    /// another; inside a lane, query-sized requests (at most
    /// `max_priority_batch_size` inputs and a sixteenth of `max_batch_tokens`)
    /// and those of at most `max_batch_size` inputs have a line (and a room)
    /// of their own each, so a short call never waits for room behind larger
    /// requests that are themselves waiting for it.
    pub max_concurrent_requests: usize,
    /// Inputs allowed to wait for admission, per lane, before new callers of
    /// that lane get `Overloaded`.
    pub max_waiting: usize,
    /// Longest a caller waits for admission before getting `Overloaded`.
    pub max_queue_wait: Duration,
    /// Most inputs in a batch cut while high-priority inputs wait: normal and
    /// low inputs top such a batch up only this far, and only to a sixteenth
    /// of `max_batch_tokens` padded tokens, so a query waits for the running
    /// batch plus one short one (high inputs keep the full budgets). 16 by
    /// default on every device (a quarter of the CPU's `max_batch_size`);
    /// capped at `max_batch_size`.
    /// Also the most inputs of a query-sized request, which goes before
    /// requests of several turns in its lane.
    pub max_priority_batch_size: usize,
    /// Aging: a high or normal lane with inputs waiting that got no place in
    /// this many consecutive batches goes first in the next one; the low lane
    /// after twice as many, so normal keeps more turns than low when queries
    /// pass both over. 8 by default; zero is taken as one.
    pub aging_batches: u32,
    /// `false`: strictly one request per model call (the old serial behaviour).
    pub enable_batching: bool,
    /// Bytes of the embedding cache (raw vectors keyed by exact token ids);
    /// 0 turns it off. 128 MiB by default: about 50,000 entries of a 384-wide
    /// model, 25,000 of a 1024-wide one, small next to the model itself.
    pub cache_bytes: usize,
    /// Model threads, each running its own batches on the one loaded model
    /// (through [`crate::Embedder::replica`]), so the host work of one batch
    /// overlaps the device work of others. 1 by default: on the CPU the
    /// engine's own workers already use every core, and on an H200 two or
    /// four threads cut single-text requests into smaller, costlier passes
    /// and gained nothing over bigger batches (docs/benchmarks.md). Zero is
    /// taken as one.
    pub model_threads: usize,
    /// Query threads: model threads beside the `model_threads`, each on its
    /// own replica of the model ([`crate::Embedder::query_replica`]), that
    /// take only query-sized calls ([`BatcherConfig::max_priority_batch_size`]
    /// inputs and a sixteenth of `max_batch_tokens`) of the high and normal
    /// lanes, in batches of at most that size, so such a call never waits
    /// behind a long batch another thread is running. The model threads
    /// still take queries too when they are free; the low lane is bulk by
    /// its name and stays theirs. A model that serves from one thread only
    /// runs none (the batcher starts all the same:
    /// [`crate::Batcher::query_threads`] says how many run).
    /// 0 by default, in the library; [`BatcherConfig::for_device`] gives the
    /// CPU one. On a 2-core CPU, beside bulk calls of 64 MiniLM texts of 256
    /// tokens, one-text queries took ~17 ms with it and 1.8 s (high) to 3.7 s
    /// (normal) without (medians, docs/benchmarks.md, "A query thread"); idle, it
    /// sleeps and costs the bulk calls nothing.
    pub query_threads: usize,
}

/// Where the model computes, as far as batching cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The host's cores: a call's cost grows with its size from the first input.
    Cpu,
    /// A GPU (CUDA, Metal): a call has a fixed cost that bigger calls share.
    Accelerator,
}

impl BatcherConfig {
    /// The defaults for a model on `device`. On an accelerator a call costs
    /// milliseconds whatever its size (about 3 ms for 32 MiniLM texts on an
    /// H200, where one call of 8,192 runs 31,000-42,000 texts/s), so the
    /// collector may put more of what is waiting into one call: with 256
    /// inputs and 32768 tokens, 32-text requests from 4 connections ran
    /// 1.16x-1.66x (MiniLM shape) and 1.56x-1.98x (BERT-base) the 64 / 8192
    /// caps' texts/s in three runs each (docs/benchmarks.md, third lease).
    ///
    /// The regroup window is 4 ms there. On an H200 (docs/benchmarks.md,
    /// fourth lease) it kept 64 single-text connections in one pass of
    /// ~63 inputs instead of two of 32, for 1.90x the texts/s of no window
    /// on the MiniLM shape and 1.23x on Qwen3-0.6B; 2 ms gained less
    /// (1.44x, 1.21x) and 8 ms no more. It costs a lone caller nothing; in
    /// the core's simulation it cost independent (open-loop) users more
    /// than 2 ms did (docs/benchmarks.md, "Regrouping callers").
    ///
    /// The CPU gets a query thread ([`BatcherConfig::query_threads`]); an
    /// accelerator none until one is measured there: a full batch takes
    /// milliseconds on an H200, more model threads lost there, and every
    /// thread's passes queue under one process lock (two threads evaluating
    /// on CUDA at once aborted an H200 run).
    pub fn for_device(device: DeviceKind) -> Self {
        match device {
            DeviceKind::Cpu => Self {
                query_threads: 1,
                ..Self::default()
            },
            DeviceKind::Accelerator => Self {
                max_batch_size: 256,
                max_batch_tokens: 32_768,
                regroup_window: Duration::from_millis(4),
                ..Self::default()
            },
        }
    }
}

impl Default for BatcherConfig {
    /// The CPU's defaults ([`DeviceKind::Cpu`]), without its query thread:
    /// a library's embedder is one model thread unless asked for more.
    fn default() -> Self {
        Self {
            max_batch_size: 64,
            max_batch_tokens: 8192,
            batch_window: Duration::ZERO,
            regroup_window: Duration::ZERO,
            max_concurrent_requests: 512,
            max_waiting: 65_536,
            max_queue_wait: Duration::from_secs(60),
            max_priority_batch_size: 16,
            aging_batches: 8,
            enable_batching: true,
            cache_bytes: 128 << 20,
            model_threads: 1,
            query_threads: 0,
        }
    }
}
