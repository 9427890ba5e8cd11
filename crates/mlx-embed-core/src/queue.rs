//! The queue and the one place that cuts a model call from it.
//!
//! Admitted requests wait in three lanes, one per [`Priority`]. Inside a lane
//! requests are served FIFO with round-robin turns of at most a batch of
//! inputs and a sixteenth of a batch's tokens, so neither one huge request nor
//! many requests of long texts make a short one behind them wait for all of
//! their work. A query-sized request (one its first turn finishes, see
//! [`CallSize`]) goes before requests that need several turns, so it waits for
//! the running batch, not for a turn of each of them. A longer request that
//! queries passed over takes its turn first in the next batch, so under a
//! flood of small calls it still gets a turn in every other batch. Across lanes a batch
//! takes high first, then normal, then low, under these rules:
//!
//! - **One kind per call.** A batch holds requests of one [`Output`] only
//!   (pooled vectors or per-token rows): it takes the kind of its first
//!   input, and a lane whose front request wants the other kind adds nothing
//!   to it (FIFO is kept; that lane goes first in a later batch, by aging if
//!   need be).
//! - **Budgets.** A batch holds at most `max_batch_size` inputs and
//!   `max_batch_tokens` padded tokens (longest x count, exact: inputs arrive
//!   tokenized); a lone input always fits, however long.
//! - **Short batches for queries.** When high-priority inputs are waiting,
//!   lower lanes top the batch up only to `max_priority_batch_size` inputs
//!   and [`Limits::turn_tokens`] padded tokens (the high lane's own inputs
//!   keep the full budgets), so a query waits for the running batch plus one
//!   short one. With an input cap alone, 15 bulk inputs of 256 tokens made
//!   the query's batch about half a full one (3840 padded tokens).
//! - **Aging.** A lane that had inputs waiting but got none in its aging
//!   limit of consecutive batches goes first in the next one (one turn of its
//!   front request). The limit is `aging_batches` for high and normal and
//!   twice that for low, so under a flood of queries that passes both over,
//!   normal still gets more turns than low (1.5x with a limit of 2; with one
//!   limit for both they aged together and low got as many). No lane is
//!   passed over more than its limit in a row, whatever the lanes above it do.
//! - **Query threads.** A query thread ([`Lanes::cut_queries`]) takes only
//!   query-sized requests of the high and normal lanes, within a query's
//!   batch; the other threads cut by the rules above, queries included.
//! - **Drain.** Once a drain begins ([`Lanes::finish_whole`]) turns end: each
//!   lane finishes its requests whole, oldest first (query-sized ones still
//!   first), so the most callers are answered by the drain's deadline.
//!
//! Invariants (checked by `debug_assert!`s):
//! - a [`FairQueue`]'s `inputs` is the sum of its entries' remaining inputs,
//!   and no entry is empty;
//! - a [`Batch`]'s parts cover its inputs contiguously, in order, and all
//!   want the batch's [`Output`];
//! - a batch never exceeds `max_batch_size` inputs, nor `max_batch_tokens`
//!   padded tokens unless it holds a single input.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::recorder::Recorder;
use crate::request::Request;
use crate::{Encoded, Output, Priority};

/// The lanes a query thread serves ([`Lanes::cut_queries`]): low is bulk by its name.
const QUERY_LANES: [Priority; 2] = [Priority::High, Priority::Normal];

/// Requests that share a full batch's token budget when each takes one turn
/// (see [`Limits::turn_tokens`]).
const TURNS_PER_BATCH: usize = 16;

/// Budgets and lane rules for cutting batches.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_batch_size: usize,
    pub max_batch_tokens: usize,
    /// Most inputs in a batch cut while high-priority inputs wait: lower
    /// lanes stop topping it up there, or at [`Limits::turn_tokens`] padded
    /// tokens, whichever comes first (the high lane's own inputs are bounded
    /// by the full budgets only); at most `max_batch_size`.
    pub max_priority_batch_size: usize,
    /// Consecutive batches a high or normal lane with waiting inputs may be
    /// passed over before it goes first (low: twice as many); at least 1.
    pub aging_batches: u32,
    /// False: a batch never mixes requests.
    pub batching: bool,
}

impl Limits {
    /// Most tokens one request takes in one turn at its lane's front (at
    /// least one input, and never more than `max_batch_size` inputs): a
    /// sixteenth of a batch's token budget. A turn of a full batch of inputs
    /// let a request of long texts hold the front for several batches (the
    /// token budget fits fewer of them), so a one-text call behind 16 calls
    /// of 64 long texts waited for all of them (12.3x the first call's time);
    /// with turns of a quarter batch of tokens it waited 3.4x, with a
    /// sixteenth 1.6x, and the bulk calls' own work took as long
    /// (docs/benchmarks.md). A request of short texts (16 tokens) takes 32
    /// of them a turn on the CPU's budget, 128 on a GPU's.
    ///
    /// Also the padded tokens lower lanes may top a batch up to while
    /// high-priority inputs wait (see [`Lanes::cut`]).
    fn turn_tokens(&self) -> usize {
        (self.max_batch_tokens / TURNS_PER_BATCH).max(1)
    }

    /// Which kind of call `inputs` inputs of `tokens` tokens in all make:
    /// the one owner of both the admission line a call waits in and whether
    /// it goes before calls of several turns in its lane.
    pub fn size_of(&self, inputs: usize, tokens: usize) -> CallSize {
        if inputs <= self.max_priority_batch_size && tokens <= self.turn_tokens() {
            CallSize::Query
        } else if inputs <= self.max_batch_size {
            CallSize::Batch
        } else {
            CallSize::Larger
        }
    }

    /// Consecutive batches lane `i` may be passed over before it goes first:
    /// low's is twice the others', so it yields to normal when both wait.
    fn aging_limit(&self, i: usize) -> u32 {
        if i == Priority::Low.index() {
            self.aging_batches.saturating_mul(2)
        } else {
            self.aging_batches
        }
    }
}

/// How far one lane may fill a batch: inputs and padded tokens (longest x
/// count), each at most the batch's budget. Set by [`Lanes::cut`], the one
/// owner of that decision; a lone input always fits, whatever the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cap {
    inputs: usize,
    tokens: usize,
}

impl Cap {
    /// The batch's full budgets.
    fn full(limits: &Limits) -> Self {
        Self {
            inputs: limits.max_batch_size,
            tokens: limits.max_batch_tokens,
        }
    }
}

/// How much work a call is, as admission and the lanes tell calls apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallSize {
    /// At most a query's batch of inputs (`max_priority_batch_size`) and one
    /// turn of tokens: its first turn finishes it. Behind 40 calls of 16 long
    /// texts (each a query's count of inputs, but four turns of tokens) a
    /// one-text call waited for room and a turn of each: 1.02 s, 8.7x the
    /// first call's time, on the CPU.
    Query,
    /// More than that, but at most one batch of inputs.
    Batch,
    /// More than one batch of inputs.
    Larger,
}

impl CallSize {
    /// Every size, smallest first.
    pub const ALL: [CallSize; 3] = [CallSize::Query, CallSize::Batch, CallSize::Larger];

    /// Position in [`CallSize::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The not-yet-batched rest of a request.
pub(crate) struct Pending {
    pub req: Arc<Request>,
    inputs: std::vec::IntoIter<Encoded>,
    /// Index (in the request) of the next input to batch.
    next_index: usize,
    /// Inputs batched during this request's current turn at the front.
    turn_used: usize,
    /// Their tokens.
    turn_tokens: usize,
    /// A query-sized request ([`CallSize::Query`]), set when it is queued.
    query_sized: bool,
}

/// What one [`Pending::move_into`] moved.
struct Moved {
    inputs: usize,
    tokens: usize,
    /// The request's turn ended (it has inputs left for a later turn).
    turn_over: bool,
}

impl Pending {
    pub fn new(req: Arc<Request>, inputs: Vec<Encoded>) -> Self {
        Self {
            req,
            inputs: inputs.into_iter(),
            next_index: 0,
            turn_used: 0,
            turn_tokens: 0,
            query_sized: false,
        }
    }

    /// Moves this request's next inputs into `batch` while they fit `cap`
    /// and its turn lasts (a turn: at most a batch of inputs and
    /// [`Limits::turn_tokens`] tokens, at least one input; no end when
    /// `whole`).
    fn move_into(&mut self, batch: &mut Batch, cap: Cap, limits: &Limits, whole: bool) -> Moved {
        let mut moved = Moved {
            inputs: 0,
            tokens: 0,
            turn_over: false,
        };
        while let Some(next) = self.inputs.as_slice().first() {
            if !whole
                && (self.turn_used >= limits.max_batch_size
                    || (self.turn_used > 0 && self.turn_tokens + next.len() > limits.turn_tokens()))
            {
                moved.turn_over = true;
                break;
            }
            if !batch.fits(next.len(), cap) {
                break;
            }
            let input = self.inputs.next().expect("peeked above");
            moved.inputs += 1;
            moved.tokens += input.len();
            self.turn_tokens += input.len();
            self.turn_used += 1;
            batch.push(&self.req, self.next_index, input);
            self.next_index += 1;
        }
        moved
    }

    pub fn remaining(&self) -> usize {
        self.inputs.len()
    }

    /// Tokens of the inputs not yet batched.
    fn remaining_tokens(&self) -> usize {
        self.inputs.as_slice().iter().map(Encoded::len).sum()
    }
}

/// A contiguous run of one request's inputs inside a batch.
pub(crate) struct Part {
    pub req: Arc<Request>,
    /// Index of the first input in the request.
    pub offset: usize,
    /// Index of the first input in the batch.
    pub start: usize,
    pub len: usize,
}

/// Inputs for one model call and which request each belongs to.
#[derive(Default)]
pub(crate) struct Batch {
    pub inputs: Vec<Encoded>,
    pub parts: Vec<Part>,
    /// Tokens of the longest input in the batch (the padded length).
    max_tokens: usize,
    /// What the model computes for every input (the first input's kind).
    pub output: Output,
}

impl Batch {
    /// Whether inputs of `req` may join: the batch is empty or of its kind.
    fn takes(&self, req: &Request) -> bool {
        self.inputs.is_empty() || self.output == req.output
    }

    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Padded tokens: longest input x count.
    pub fn padded_tokens(&self) -> usize {
        self.max_tokens * self.inputs.len()
    }

    /// Tokens of all inputs, unpadded.
    pub fn real_tokens(&self) -> usize {
        self.inputs.iter().map(Encoded::len).sum()
    }

    /// Inputs of the requests whose last inputs are in this batch: the
    /// callers answered by it, who may come back.
    pub fn completed_inputs(&self) -> usize {
        self.parts
            .iter()
            .filter(|p| p.offset + p.len == p.req.len)
            .map(|p| p.req.len)
            .sum()
    }

    /// Whether one more input of `tokens` tokens keeps the batch within
    /// `cap`'s inputs and padded tokens. A lone input always fits.
    fn fits(&self, tokens: usize, cap: Cap) -> bool {
        let n = self.inputs.len();
        n == 0
            || (n < cap.inputs && self.max_tokens.max(tokens).saturating_mul(n + 1) <= cap.tokens)
    }

    fn push(&mut self, req: &Arc<Request>, index: usize, input: Encoded) {
        if self.inputs.is_empty() {
            self.output = req.output;
        }
        self.max_tokens = self.max_tokens.max(input.len());
        let start = self.inputs.len();
        self.inputs.push(input);
        if let Some(last) = self.parts.last_mut() {
            if Arc::ptr_eq(&last.req, req) && last.offset + last.len == index {
                last.len += 1;
                return;
            }
        }
        self.parts.push(Part {
            req: req.clone(),
            offset: index,
            start,
            len: 1,
        });
    }

    /// Checks the batch invariants (debug builds only).
    fn debug_check(&self, limits: &Limits) {
        if cfg!(debug_assertions) {
            let mut next = 0;
            for part in &self.parts {
                debug_assert_eq!(part.start, next, "parts cover the batch contiguously");
                debug_assert!(part.len > 0, "no empty part");
                debug_assert_eq!(part.req.output, self.output, "one output kind per batch");
                next += part.len;
            }
            debug_assert_eq!(next, self.inputs.len(), "parts cover every input");
            debug_assert!(self.inputs.len() <= limits.max_batch_size);
            debug_assert!(
                self.inputs.len() <= 1 || self.padded_tokens() <= limits.max_batch_tokens,
                "token budget"
            );
        }
    }
}

/// One lane: requests of one priority waiting for the model.
pub(crate) struct FairQueue {
    entries: VecDeque<Pending>,
    limits: Limits,
    priority: Priority,
    /// Inputs queued (not yet batched) across `entries`.
    inputs: usize,
    /// Their tokens.
    tokens: usize,
    /// Entries that are query-sized requests (what a query thread takes).
    query_entries: usize,
    /// The last fill moved query-sized requests ahead and a longer request
    /// got nothing: the next one starts with that request's turn.
    turn_owed: bool,
    /// Requests are finished whole, oldest first (query-sized ones still
    /// first), instead of in turns: set for a drain ([`Lanes::finish_whole`]).
    whole: bool,
}

impl FairQueue {
    pub fn new(limits: Limits, priority: Priority) -> Self {
        Self {
            entries: VecDeque::new(),
            limits,
            priority,
            inputs: 0,
            tokens: 0,
            query_entries: 0,
            turn_owed: false,
            whole: false,
        }
    }

    pub fn push(&mut self, mut pending: Pending) {
        debug_assert!(pending.remaining() > 0, "no empty entry");
        pending.query_sized = self
            .limits
            .size_of(pending.remaining(), pending.remaining_tokens())
            == CallSize::Query;
        self.inputs += pending.remaining();
        self.tokens += pending.remaining_tokens();
        self.query_entries += usize::from(pending.query_sized);
        self.entries.push_back(pending);
    }

    /// Takes entry `at` out of the lane (its inputs are the caller's to count).
    fn remove(&mut self, at: usize) -> Pending {
        let gone = self.entries.remove(at).expect("an entry of the lane");
        self.query_entries -= usize::from(gone.query_sized);
        gone
    }

    /// Drops entry `at`, whose caller left, uncomputed.
    fn drop_abandoned(&mut self, at: usize, recorder: &Recorder) {
        let gone = self.remove(at);
        let n = gone.remaining();
        gone.req.skipped(n, recorder);
        self.inputs -= n;
        self.tokens -= gone.remaining_tokens();
        recorder.dequeued(self.priority, n);
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Inputs queued (not yet batched).
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Tokens of the inputs queued.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Empties the lane, returning every request in it.
    pub fn take_all(&mut self, recorder: &Recorder) -> Vec<Arc<Request>> {
        recorder.dequeued(self.priority, self.inputs);
        self.inputs = 0;
        self.tokens = 0;
        self.query_entries = 0;
        self.entries.drain(..).map(|p| p.req).collect()
    }

    /// Drops `req`'s queued inputs, uncomputed (its caller left): they stop
    /// counting as queued at once, instead of when a cut reaches them.
    pub fn withdraw(&mut self, req: &Arc<Request>, recorder: &Recorder) {
        if let Some(at) = self.entries.iter().position(|p| Arc::ptr_eq(&p.req, req)) {
            self.drop_abandoned(at, recorder);
        }
    }

    /// Moves queued inputs into `batch` until the next one would take it past
    /// `cap` (inputs or padded tokens) or the lane runs dry; returns how many
    /// it moved.
    ///
    /// Query-sized requests go first, oldest first, unless the last fill put
    /// them before a longer request that then got nothing: then that request
    /// takes its turn first, so under a flood of queries a longer request
    /// gets a turn in every other batch. Then requests are
    /// taken front to back; each gets a turn of at most one full batch of
    /// inputs and [`Limits::turn_tokens`] tokens, after which an unfinished
    /// request moves to the back, so huge requests, and requests of long
    /// texts, interleave with small ones. A request interrupted only
    /// because the batch filled keeps its place. Requests whose callers left
    /// are dropped on the way, uncomputed.
    pub fn fill(&mut self, batch: &mut Batch, cap: Cap, recorder: &Recorder) -> usize {
        let owed = std::mem::take(&mut self.turn_owed);
        let queries = if owed {
            // The longer request passed over last time takes its turn first.
            if let Some(at) = self.entries.iter().position(|p| !p.query_sized) {
                let owed = self.entries.remove(at).expect("found above");
                // Moved, not taken: its count stays.
                self.entries.push_front(owed);
            }
            0
        } else {
            self.fill_queries(batch, cap, recorder)
        };
        let (in_turn, longer) = self.fill_in_turn(batch, cap, recorder);
        // Whole requests owe no turns: the front one is finished first anyway.
        // An owed turn stays owed until the longer request gets inputs (a
        // batch of the other output kind may have kept it out).
        self.turn_owed = !self.whole
            && (queries > 0 || owed)
            && longer == 0
            && self.entries.iter().any(|p| !p.query_sized);
        self.debug_check();
        queries + in_turn
    }

    /// The lane's counts match its entries (debug builds only).
    fn debug_check(&self) {
        debug_assert_eq!(
            self.inputs,
            self.entries.iter().map(Pending::remaining).sum::<usize>(),
            "lane input count"
        );
        debug_assert_eq!(
            self.query_entries,
            self.entries.iter().filter(|p| p.query_sized).count(),
            "lane query count"
        );
        debug_assert_eq!(
            self.tokens,
            self.entries
                .iter()
                .map(Pending::remaining_tokens)
                .sum::<usize>(),
            "lane token count"
        );
    }

    /// Query-sized requests queued.
    pub fn query_entries(&self) -> usize {
        self.query_entries
    }

    /// Moves query-sized requests into `batch`, oldest first, skipping
    /// longer ones, until one of the other output kind; returns the inputs
    /// moved. Query-sized requests whose callers left are dropped on the way.
    fn fill_queries(&mut self, batch: &mut Batch, cap: Cap, recorder: &Recorder) -> usize {
        let limits = self.limits;
        let mut moved = 0;
        let mut i = 0;
        while i < self.entries.len() {
            let entry = &mut self.entries[i];
            if !entry.query_sized {
                i += 1;
                continue;
            }
            if entry.req.abandoned() {
                self.drop_abandoned(i, recorder);
                continue;
            }
            // Query-sized requests keep their order among themselves, so one
            // of the other kind is not passed over by a stream of this one's.
            if !batch.takes(&entry.req) || (!limits.batching && !batch.is_empty()) {
                break;
            }
            let step = entry.move_into(batch, cap, &limits, false);
            let done = entry.remaining() == 0;
            self.count_moved(&step, recorder);
            moved += step.inputs;
            if done {
                self.remove(i);
            } else {
                // The batch is full (a query-sized request never ends its turn).
                break;
            }
        }
        moved
    }

    /// Serves the lane in turn from its front (see [`FairQueue::fill`]);
    /// returns the inputs moved, and how many of them are of longer requests.
    fn fill_in_turn(&mut self, batch: &mut Batch, cap: Cap, recorder: &Recorder) -> (usize, usize) {
        let (limits, whole) = (self.limits, self.whole);
        let (mut moved, mut longer) = (0, 0);
        while let Some(front) = self.entries.front_mut() {
            if front.req.abandoned() {
                self.drop_abandoned(0, recorder);
                continue;
            }
            if !batch.takes(&front.req) {
                break;
            }
            if !limits.batching
                && batch
                    .parts
                    .last()
                    .is_some_and(|p| !Arc::ptr_eq(&p.req, &front.req))
            {
                break;
            }
            let step = front.move_into(batch, cap, &limits, whole);
            let (remaining, query_sized) = (front.remaining(), front.query_sized);
            self.count_moved(&step, recorder);
            moved += step.inputs;
            if !query_sized {
                longer += step.inputs;
            }
            if remaining == 0 {
                self.remove(0);
            } else if step.turn_over {
                let mut rotated = self.entries.pop_front().expect("front exists");
                rotated.turn_used = 0;
                rotated.turn_tokens = 0;
                self.entries.push_back(rotated);
            } else {
                break;
            }
        }
        (moved, longer)
    }

    /// Takes what `step` moved into a batch off the lane's counts.
    fn count_moved(&mut self, step: &Moved, recorder: &Recorder) {
        self.inputs -= step.inputs;
        self.tokens -= step.tokens;
        recorder.dequeued(self.priority, step.inputs);
    }
}

/// The three lanes and the aging state; cuts every batch the model runs.
pub(crate) struct Lanes {
    lanes: [FairQueue; 3],
    /// Per lane: consecutive batches cut while it had inputs waiting and got none.
    passed_over: [u32; 3],
    limits: Limits,
}

impl Lanes {
    pub fn new(limits: Limits) -> Self {
        Self {
            lanes: Priority::ALL.map(|p| FairQueue::new(limits, p)),
            passed_over: [0; 3],
            limits,
        }
    }

    pub fn push(&mut self, pending: Pending) {
        self.lanes[pending.req.priority.index()].push(pending);
    }

    pub fn is_empty(&self) -> bool {
        self.lanes.iter().all(FairQueue::is_empty)
    }

    /// Inputs queued in every lane.
    pub fn inputs(&self) -> usize {
        self.lanes.iter().map(FairQueue::inputs).sum()
    }

    /// Tokens queued in every lane.
    pub fn tokens(&self) -> usize {
        self.lanes.iter().map(FairQueue::tokens).sum()
    }

    /// Whether a query thread has work: a query-sized request waits in the
    /// high or normal lane (see [`Lanes::cut_queries`]).
    pub fn has_queries(&self) -> bool {
        QUERY_LANES
            .iter()
            .any(|p| self.lanes[p.index()].query_entries() > 0)
    }

    /// Whether `priority`'s lane holds any request.
    pub fn has_waiting(&self, priority: Priority) -> bool {
        !self.lanes[priority.index()].is_empty()
    }

    /// From now on every lane finishes its requests whole, oldest first
    /// (query-sized ones still first), instead of in turns. For a drain with
    /// a deadline: in turns every request progresses together and most are
    /// unfinished when it passes (48 calls of 16 texts, 2 s drain: 1 of 48
    /// answered); whole, the oldest are answered and the rest never computed.
    pub fn finish_whole(&mut self) {
        for lane in &mut self.lanes {
            lane.whole = true;
            lane.turn_owed = false;
        }
    }

    /// Drops what is queued of `req` (see [`FairQueue::withdraw`]).
    pub fn withdraw(&mut self, req: &Arc<Request>, recorder: &Recorder) {
        self.lanes[req.priority.index()].withdraw(req, recorder);
    }

    /// Empties every lane, returning every request in them.
    pub fn take_all(&mut self, recorder: &Recorder) -> Vec<Arc<Request>> {
        self.passed_over = [0; 3];
        self.lanes
            .iter_mut()
            .flat_map(|lane| lane.take_all(recorder))
            .collect()
    }

    /// Cuts a query thread's next model call: query-sized requests only, of
    /// the high lane and then the normal one, oldest first in each, within a
    /// query's batch (`max_priority_batch_size` inputs, [`Limits::turn_tokens`]
    /// padded tokens), so the thread is never held long by anything. Longer
    /// requests and the low lane are left to the model threads, and so is
    /// every lane's aging: a call the query thread takes passes no lane over.
    /// Empty only when every query-sized request it met had been abandoned
    /// (they are dropped: [`Lanes::has_queries`] is then false).
    pub fn cut_queries(&mut self, recorder: &Recorder) -> Batch {
        let cap = self.query_cap();
        let mut batch = Batch::default();
        for p in QUERY_LANES {
            self.lanes[p.index()].fill_queries(&mut batch, cap, recorder);
            self.lanes[p.index()].debug_check();
        }
        batch.debug_check(&self.limits);
        debug_assert!(!batch.is_empty() || !self.has_queries());
        batch
    }

    /// A query's batch: what lower lanes top a batch up to while high inputs
    /// wait, and all a query thread's batch holds.
    fn query_cap(&self) -> Cap {
        let full = Cap::full(&self.limits);
        Cap {
            inputs: self.limits.max_priority_batch_size.min(full.inputs),
            tokens: self.limits.turn_tokens().min(full.tokens),
        }
    }

    /// Cuts the next model call (see the module doc for the rules). Empty
    /// only when every request it met had been abandoned; the lanes are then
    /// empty too.
    pub fn cut(&mut self, recorder: &Recorder) -> Batch {
        let limits = self.limits;
        let waiting = Priority::ALL.map(|p| self.has_waiting(p));
        let aged = |i: usize| waiting[i] && self.passed_over[i] >= limits.aging_limit(i);
        // Aged lanes first (lowest first: it has been passed over longest
        // relative to its rank), then the rest by priority.
        let mut order = [2, 1, 0]
            .into_iter()
            .filter(|&i| aged(i))
            .collect::<Vec<_>>();
        order.extend((0..3).filter(|&i| !aged(i)));
        // The high lane fills to the full budgets; while it has inputs
        // waiting, lower lanes top the batch up only to a query's batch of
        // inputs and a turn of padded tokens, so the query's own batch is short.
        let full = Cap::full(&limits);
        let top_up = if waiting[Priority::High.index()] {
            self.query_cap()
        } else {
            full
        };
        let mut batch = Batch::default();
        let mut moved = [0; 3];
        for i in order {
            let cap = if i == Priority::High.index() {
                full
            } else {
                top_up
            };
            moved[i] = self.lanes[i].fill(&mut batch, cap, recorder);
        }
        for i in 0..3 {
            self.passed_over[i] = if waiting[i] && moved[i] == 0 && !self.lanes[i].is_empty() {
                self.passed_over[i] + 1
            } else {
                0
            };
        }
        batch.debug_check(&limits);
        debug_assert!(
            !batch.is_empty() || self.is_empty(),
            "an empty cut drains every lane"
        );
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{ActiveGuard, Ticket};
    use std::time::Instant;

    /// A request of `n` inputs of `tokens` tokens each.
    fn request(
        n: usize,
        tokens: usize,
        priority: Priority,
        output: Output,
        recorder: &Arc<Recorder>,
    ) -> (Arc<Request>, Vec<Encoded>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let permit = runtime
            .block_on(Arc::new(tokio::sync::Semaphore::new(1)).acquire_owned())
            .unwrap();
        let (reply, _answer) = tokio::sync::oneshot::channel();
        let ticket = Ticket::new(permit, n, recorder.clone());
        let req = Arc::new(Request::new(
            n,
            priority,
            output,
            Instant::now(),
            reply,
            ticket,
            ActiveGuard::new(recorder.clone()),
        ));
        (
            req,
            (0..n)
                .map(|i| Encoded {
                    ids: vec![i as u32; tokens],
                    type_ids: None,
                    untruncated_len: tokens as u32,
                    pool_start: 0,
                    token_pooling: None,
                    adapter: None,
                })
                .collect(),
        )
    }

    fn limits(batching: bool) -> Limits {
        Limits {
            max_batch_size: 4,
            max_batch_tokens: 1000,
            max_priority_batch_size: 4,
            aging_batches: 1000,
            batching,
        }
    }

    /// Queues requests of these (size, priority) in order, drains the lanes
    /// and returns each batch as (request index, inputs) runs.
    fn batches_with(requests: &[(usize, Priority)], limits: Limits) -> Vec<Vec<(usize, usize)>> {
        let requests: Vec<_> = requests
            .iter()
            .map(|&(n, p)| (n, p, Output::Pooled))
            .collect();
        batches_of_kinds(&requests, limits)
            .into_iter()
            .map(|(_, runs)| runs)
            .collect()
    }

    /// [`batches_with`] for requests of either output kind; each batch also
    /// says its kind.
    fn batches_of_kinds(
        requests: &[(usize, Priority, Output)],
        limits: Limits,
    ) -> Vec<(Output, Vec<(usize, usize)>)> {
        let requests: Vec<_> = requests
            .iter()
            .map(|&(n, priority, output)| (n, 1, priority, output))
            .collect();
        batches_of_lengths(&requests, limits)
    }

    /// [`batches_of_kinds`] for requests of (inputs, tokens per input,
    /// priority, kind).
    fn batches_of_lengths(
        requests: &[(usize, usize, Priority, Output)],
        limits: Limits,
    ) -> Vec<(Output, Vec<(usize, usize)>)> {
        let recorder = Arc::new(Recorder::new());
        let mut lanes = Lanes::new(limits);
        let mut ids = Vec::new();
        for &(n, tokens, priority, output) in requests {
            let (req, inputs) = request(n, tokens, priority, output, &recorder);
            ids.push(req.clone());
            recorder.queued(priority, n);
            lanes.push(Pending::new(req, inputs));
        }
        let mut out = Vec::new();
        while !lanes.is_empty() {
            let batch = lanes.cut(&recorder);
            for part in &batch.parts {
                assert_eq!(part.req.output, batch.output, "a batch mixed output kinds");
            }
            out.push((
                batch.output,
                batch
                    .parts
                    .iter()
                    .map(|p| {
                        (
                            ids.iter().position(|r| Arc::ptr_eq(r, &p.req)).unwrap(),
                            p.len,
                        )
                    })
                    .collect(),
            ));
        }
        assert_eq!(recorder.queued_total(), 0, "queued count back to zero");
        out
    }

    fn batches_for(sizes: &[usize], batching: bool) -> Vec<Vec<(usize, usize)>> {
        let requests: Vec<_> = sizes.iter().map(|&n| (n, Priority::Normal)).collect();
        batches_with(&requests, limits(batching))
    }

    #[test]
    fn huge_request_takes_turns_with_small_ones() {
        // Query-sized ones (at most 4 inputs here) go first, then the big
        // one gets a batch each turn.
        assert_eq!(
            batches_for(&[10, 1, 2, 1], true),
            vec![
                vec![(1, 1), (2, 2), (3, 1)],
                vec![(0, 4)],
                vec![(0, 4)],
                vec![(0, 2)]
            ]
        );
        // Requests larger than a query take turns in order: the big one gets
        // one batch, then everyone else, then the big one again.
        let no_queries = Limits {
            max_priority_batch_size: 1,
            ..limits(true)
        };
        let requests: Vec<_> = [10, 2, 2, 2].map(|n| (n, Normal)).to_vec();
        assert_eq!(
            batches_with(&requests, no_queries),
            vec![
                vec![(0, 4)],
                vec![(1, 2), (2, 2)],
                vec![(3, 2), (0, 2)],
                vec![(0, 4)],
            ]
        );
    }

    #[test]
    fn a_query_goes_before_longer_requests_but_never_starves_them() {
        // Behind three calls of 16 inputs a one-input call is in the first
        // batch (in turn it came after a turn of each of them).
        let limits = Limits {
            max_batch_size: 8,
            max_priority_batch_size: 4,
            ..limits(true)
        };
        let requests: Vec<_> = [16, 16, 16, 1].map(|n| (n, Normal)).to_vec();
        assert_eq!(batches_with(&requests, limits)[0], vec![(3, 1), (0, 7)]);
        // Under a flood of queries that fills every batch (two more arrive
        // before each cut), a longer request still gets a turn in every
        // other batch.
        let recorder = Arc::new(Recorder::new());
        let mut lanes = Lanes::new(limits);
        let send = |lanes: &mut Lanes, n: usize| {
            let (req, inputs) = request(n, 1, Normal, Pooled, &recorder);
            recorder.queued(Normal, n);
            lanes.push(Pending::new(req.clone(), inputs));
            req
        };
        let long = send(&mut lanes, 40);
        let mut long_turns = Vec::new();
        for cut in 0..8 {
            send(&mut lanes, 4);
            send(&mut lanes, 4);
            let batch = lanes.cut(&recorder);
            assert_eq!(batch.inputs.len(), 8, "full batches");
            if batch.parts.iter().any(|p| Arc::ptr_eq(&p.req, &long)) {
                long_turns.push(cut);
            }
        }
        assert_eq!(long_turns, vec![1, 3, 5, 7]);
        lanes.take_all(&recorder);
    }

    #[test]
    fn long_inputs_take_turns_of_a_sixteenth_of_a_batch_of_tokens() {
        // 4000 tokens a batch: turns of 250, so two 100-token inputs each.
        // The one-text call behind three calls of long texts goes first (a
        // query-sized request); the long ones share each batch in turns.
        let limits = Limits {
            max_batch_size: 8,
            max_batch_tokens: 4000,
            ..limits(true)
        };
        let batches: Vec<_> = batches_of_lengths(
            &[
                (8, 100, Normal, Pooled),
                (8, 100, Normal, Pooled),
                (8, 100, Normal, Pooled),
                (1, 10, Normal, Pooled),
            ],
            limits,
        )
        .into_iter()
        .map(|(_, runs)| runs)
        .collect();
        assert_eq!(
            batches,
            vec![
                vec![(3, 1), (0, 2), (1, 2), (2, 2), (0, 1)],
                vec![(0, 1), (1, 2), (2, 2), (0, 2), (1, 1)],
                vec![(1, 1), (2, 2), (0, 2), (1, 2), (2, 1)],
                vec![(2, 1)],
            ]
        );
        // Short inputs take turns of a full batch of inputs while it fits.
        assert_eq!(
            batches_of_lengths(&[(8, 10, Normal, Pooled), (8, 10, Normal, Pooled)], limits)[0].1,
            vec![(0, 8)]
        );
    }

    #[test]
    fn a_request_cut_by_a_full_batch_keeps_its_place() {
        assert_eq!(
            batches_for(&[3, 3, 1], true),
            vec![vec![(0, 3), (1, 1)], vec![(1, 2), (2, 1)]]
        );
    }

    #[test]
    fn serial_limits_never_mix_requests() {
        assert_eq!(
            batches_for(&[1, 6, 2], false),
            vec![vec![(0, 1)], vec![(1, 4)], vec![(2, 2)], vec![(1, 2)]]
        );
    }

    use Priority::{High, Low, Normal};

    #[test]
    fn lanes_go_high_then_normal_then_low_fifo_inside_each() {
        assert_eq!(
            batches_with(
                &[
                    (2, Low),
                    (2, Normal),
                    (1, High),
                    (1, Normal),
                    (2, High),
                    (1, Low)
                ],
                limits(true)
            ),
            vec![
                vec![(2, 1), (4, 2), (1, 1)],
                vec![(1, 1), (3, 1), (0, 2)],
                vec![(5, 1)]
            ]
        );
    }

    #[test]
    fn lower_lanes_top_up_a_query_batch_only_to_the_priority_size() {
        let limits = Limits {
            max_priority_batch_size: 2,
            ..limits(true)
        };
        // With the high request waiting the normal one adds one input; then full batches.
        assert_eq!(
            batches_with(&[(6, Normal), (1, High)], limits),
            vec![vec![(1, 1), (0, 1)], vec![(0, 4)], vec![(0, 1)]]
        );
    }

    #[test]
    fn lower_lanes_top_up_a_query_batch_only_to_a_turn_of_padded_tokens() {
        // The CPU's budgets: a turn is 8192 / 16 = 512 padded tokens.
        let limits = Limits {
            max_batch_size: 64,
            max_batch_tokens: 8192,
            max_priority_batch_size: 16,
            ..limits(true)
        };
        // A one-text query beside a bulk low request of 256-token inputs: its
        // batch holds one bulk input (2 x 256 = 512 padded tokens), not 15
        // (3840); then the bulk request fills full batches (32 x 256 = 8192).
        let batches = batches_of_lengths(&[(64, 256, Low, Pooled), (1, 8, High, Pooled)], limits);
        let runs: Vec<_> = batches.into_iter().map(|(_, runs)| runs).collect();
        assert_eq!(
            runs,
            vec![vec![(1, 1), (0, 1)], vec![(0, 32)], vec![(0, 31)]]
        );
        // Short bulk inputs: the input cap binds first (16 x 16 = 256 tokens).
        let batches = batches_of_lengths(&[(64, 16, Low, Pooled), (1, 8, High, Pooled)], limits);
        assert_eq!(batches[0].1, vec![(1, 1), (0, 15)]);
        // The high lane's own inputs keep the full budgets (20 x 256 = 5120
        // padded tokens), and lower lanes add nothing past the turn's tokens.
        let batches = batches_of_lengths(
            &[(64, 256, Normal, Pooled), (20, 256, High, Pooled)],
            limits,
        );
        assert_eq!(batches[0].1, vec![(1, 20)]);
        assert_eq!(batches[1].1, vec![(0, 32)]);
        // With no high-priority input waiting, a lower lane fills the full
        // budgets as before.
        let batches = batches_of_lengths(&[(64, 256, Low, Pooled)], limits);
        assert_eq!(batches[0].1, vec![(0, 32)]);
    }

    #[test]
    fn a_lane_passed_over_aging_batches_times_goes_first() {
        let limits = Limits {
            aging_batches: 2,
            ..limits(true)
        };
        // Five full high batches queued ahead of one low and one normal input:
        // normal goes first once passed over twice, low once passed over four
        // times.
        let mut requests = vec![(1, Low), (1, Normal)];
        requests.extend([(4, High); 5]);
        assert_eq!(
            batches_with(&requests, limits),
            vec![
                vec![(2, 4)],
                vec![(3, 4)],
                vec![(1, 1), (4, 3)],
                vec![(4, 1), (5, 3)],
                vec![(0, 1), (5, 1), (6, 2)],
                vec![(6, 2)],
            ]
        );
    }

    #[test]
    fn under_a_flood_of_queries_normal_gets_more_turns_than_low() {
        let limits = Limits {
            aging_batches: 2,
            max_priority_batch_size: 1,
            ..limits(true)
        };
        // 60 full high batches, a normal and a low request longer than the
        // flood lets through: each aged turn is one input (the priority cap).
        let mut requests = vec![(100, Low), (100, Normal)];
        requests.extend([(4, High); 60]);
        let batches = batches_with(&requests, limits);
        let served = |lane: usize| {
            batches[..60]
                .iter()
                .flatten()
                .filter(|&&(req, _)| req == lane)
                .map(|&(_, n)| n)
                .sum::<usize>()
        };
        // Normal goes in every third batch at most, low every fifth, and one
        // aged turn delays the other's: 18 and 12 (one limit for both lanes
        // gave normal 19 and low 20).
        assert_eq!((served(1), served(0)), (18, 12));
    }

    use Output::{Pooled, Tokens};

    #[test]
    fn a_query_cut_takes_query_sized_calls_of_high_then_normal_only() {
        let limits = Limits {
            max_batch_size: 8,
            max_batch_tokens: 1600,
            max_priority_batch_size: 4,
            ..limits(true)
        };
        let recorder = Arc::new(Recorder::new());
        let mut lanes = Lanes::new(limits);
        let mut send = |n: usize, tokens: usize, priority: Priority| {
            let (req, inputs) = request(n, tokens, priority, Pooled, &recorder);
            recorder.queued(priority, n);
            lanes.push(Pending::new(req.clone(), inputs));
            req
        };
        // A turn is 100 tokens: query-sized means at most 4 inputs and 100 tokens.
        let longer = send(6, 10, Normal);
        let low_query = send(1, 10, Low);
        let long_text = send(1, 200, High);
        let normal_query = send(2, 10, Normal);
        let high_query = send(3, 10, High);
        let gone = send(1, 10, High);
        gone.fail(crate::CoreError::ShuttingDown);
        assert!(lanes.has_queries());
        // Within a query's batch (4 inputs): the high query, then one input of
        // the normal one; the abandoned one is dropped, uncomputed.
        let batch = lanes.cut_queries(&recorder);
        let parts: Vec<_> = batch.parts.iter().map(|p| (p.req.clone(), p.len)).collect();
        assert_eq!(parts.len(), 2);
        assert!(Arc::ptr_eq(&parts[0].0, &high_query) && parts[0].1 == 3);
        assert!(Arc::ptr_eq(&parts[1].0, &normal_query) && parts[1].1 == 1);
        let batch = lanes.cut_queries(&recorder);
        assert_eq!(batch.parts.len(), 1);
        assert!(Arc::ptr_eq(&batch.parts[0].req, &normal_query) && batch.parts[0].len == 1);
        // What is left is no query thread's: a longer call, a long text, the low lane.
        assert!(!lanes.has_queries());
        assert!(lanes.cut_queries(&recorder).is_empty());
        assert_eq!(lanes.inputs(), 6 + 1 + 1);
        let rest: Vec<_> = std::iter::from_fn(|| (!lanes.is_empty()).then(|| lanes.cut(&recorder)))
            .flat_map(|b| {
                b.parts
                    .into_iter()
                    .map(|p| (p.req, p.len))
                    .collect::<Vec<_>>()
            })
            .collect();
        for req in [&longer, &low_query, &long_text] {
            let n: usize = rest
                .iter()
                .filter(|(r, _)| Arc::ptr_eq(r, req))
                .map(|p| p.1)
                .sum();
            assert_eq!(n, req.len);
        }
        assert_eq!(recorder.queued_total(), 0);
    }

    #[test]
    fn pooled_and_token_requests_never_share_a_batch() {
        // One lane, kinds interleaved: each run of one kind is its own batch, in FIFO order.
        assert_eq!(
            batches_of_kinds(
                &[
                    (2, Normal, Pooled),
                    (1, Normal, Tokens),
                    (1, Normal, Tokens),
                    (1, Normal, Pooled),
                ],
                limits(true)
            ),
            vec![
                (Pooled, vec![(0, 2)]),
                (Tokens, vec![(1, 1), (2, 1)]),
                (Pooled, vec![(3, 1)]),
            ]
        );
    }

    #[test]
    fn a_lane_of_the_other_kind_waits_then_ages_in() {
        let limits = Limits {
            aging_batches: 2,
            ..limits(true)
        };
        // High pooled work keeps coming; the normal token request cannot
        // join it, and goes first once passed over twice.
        let mut requests = vec![(1, Normal, Tokens), (1, Normal, Pooled)];
        requests.extend([(4, High, Pooled); 4]);
        assert_eq!(
            batches_of_kinds(&requests, limits),
            vec![
                (Pooled, vec![(2, 4)]),
                (Pooled, vec![(3, 4)]),
                (Tokens, vec![(0, 1)]),
                (Pooled, vec![(4, 4)]),
                (Pooled, vec![(5, 4),]),
                (Pooled, vec![(1, 1)]),
            ]
        );
    }

    /// xorshift64*: a seeded stream for the randomized test (no dependency).
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
        }
    }

    #[test]
    fn random_arrivals_are_each_batched_once_in_order_within_budgets() {
        // Requests of random sizes, lengths, lanes and kinds arrive between
        // cuts under random limits; whatever the lanes' order, every input is
        // batched exactly once, each request's in order, every batch within
        // its budgets and of one kind, and every cut makes progress. In a
        // third of the runs a drain begins part way (requests finished whole).
        // Some cuts are a query thread's (`Lanes::cut_queries`).
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let max_batch_size = 1 + rng.below(8);
            let limits = Limits {
                max_batch_size,
                max_batch_tokens: 16 + rng.below(400),
                max_priority_batch_size: 1 + rng.below(max_batch_size),
                aging_batches: 1 + rng.below(3) as u32,
                batching: rng.below(4) != 0,
            };
            let recorder = Arc::new(Recorder::new());
            let mut lanes = Lanes::new(limits);
            let mut sent: Vec<(Arc<Request>, Vec<usize>)> = Vec::new();
            let mut next_index: Vec<usize> = Vec::new();
            let mut cuts = 0;
            let arrivals = 1 + rng.below(24);
            let drain_at = (rng.below(3) == 0).then(|| rng.below(arrivals + 1));
            while sent.len() < arrivals || !lanes.is_empty() {
                if drain_at == Some(sent.len()) {
                    lanes.finish_whole();
                }
                if sent.len() < arrivals && (lanes.is_empty() || rng.below(3) == 0) {
                    let n = 1 + rng.below(20);
                    let priority = Priority::ALL[rng.below(3)];
                    let output = if rng.below(5) == 0 { Tokens } else { Pooled };
                    let lengths: Vec<usize> = (0..n).map(|_| 1 + rng.below(60)).collect();
                    let (req, mut inputs) = request(n, 1, priority, output, &recorder);
                    for (input, &len) in inputs.iter_mut().zip(&lengths) {
                        input.ids = vec![0; len];
                    }
                    recorder.queued(priority, n);
                    lanes.push(Pending::new(req.clone(), inputs));
                    sent.push((req, lengths));
                    next_index.push(0);
                    continue;
                }
                // A query thread's cut now and then, when it has work.
                let batch = if lanes.has_queries() && rng.below(3) == 0 {
                    lanes.cut_queries(&recorder)
                } else {
                    lanes.cut(&recorder)
                };
                cuts += 1;
                assert!(!batch.is_empty(), "a cut of waiting inputs took none");
                assert!(batch.inputs.len() <= limits.max_batch_size, "{limits:?}");
                assert!(
                    batch.inputs.len() == 1 || batch.padded_tokens() <= limits.max_batch_tokens,
                    "{limits:?}"
                );
                if !limits.batching {
                    assert_eq!(batch.parts.len(), 1, "a serial batch mixed requests");
                }
                let mut start = 0;
                for part in &batch.parts {
                    assert_eq!(part.start, start, "parts cover the batch in order");
                    assert_eq!(part.req.output, batch.output, "one kind per batch");
                    let k = sent
                        .iter()
                        .position(|(r, _)| Arc::ptr_eq(r, &part.req))
                        .unwrap();
                    assert_eq!(part.offset, next_index[k], "request {k}'s inputs in order");
                    for j in 0..part.len {
                        assert_eq!(batch.inputs[start + j].len(), sent[k].1[part.offset + j]);
                    }
                    next_index[k] += part.len;
                    start += part.len;
                }
                assert_eq!(start, batch.inputs.len());
            }
            let total: usize = sent.iter().map(|(_, l)| l.len()).sum();
            assert!(cuts <= total, "{cuts} cuts for {total} inputs");
            for (k, (_, lengths)) in sent.iter().enumerate() {
                assert_eq!(
                    next_index[k],
                    lengths.len(),
                    "request {k} fully batched once"
                );
            }
            assert_eq!(recorder.queued_total(), 0, "queued count back to zero");
        }
    }
}
