//! The collector's queue and how batches are cut from it: FIFO across
//! requests, size and padded-token budgets (exact: inputs arrive tokenized),
//! and round-robin at batch granularity so one huge request cannot starve the
//! small ones behind it.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::recorder::Recorder;
use crate::request::Request;
use crate::Encoded;

/// Budgets one batch must respect.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_batch_size: usize,
    pub max_batch_tokens: usize,
    /// False: a batch never mixes requests.
    pub batching: bool,
}

/// The not-yet-batched rest of a request.
pub(crate) struct Pending {
    pub req: Arc<Request>,
    inputs: std::vec::IntoIter<Encoded>,
    /// Index (in the request) of the next input to batch.
    next_index: usize,
    /// Inputs batched during this request's current turn at the front.
    turn_used: usize,
}

impl Pending {
    pub fn new(req: Arc<Request>, inputs: Vec<Encoded>) -> Self {
        Self {
            req,
            inputs: inputs.into_iter(),
            next_index: 0,
            turn_used: 0,
        }
    }

    pub fn remaining(&self) -> usize {
        self.inputs.len()
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
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Tokens of all inputs, unpadded.
    pub fn real_tokens(&self) -> usize {
        self.inputs.iter().map(Encoded::len).sum()
    }

    /// Whether one more input of `tokens` tokens stays within budget.
    /// A lone input always fits, however long: it has to run somehow.
    fn fits(&self, tokens: usize, limits: &Limits) -> bool {
        let n = self.inputs.len();
        n == 0
            || (n < limits.max_batch_size
                && self.max_tokens.max(tokens).saturating_mul(n + 1) <= limits.max_batch_tokens)
    }

    fn push(&mut self, req: &Arc<Request>, index: usize, input: Encoded) {
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

    /// A batch holding all of `pending`, if it fits in one batch; otherwise
    /// `pending` back untouched.
    pub fn whole(pending: Pending, limits: &Limits) -> Result<Batch, Pending> {
        let inputs = pending.inputs.as_slice();
        let longest = inputs.iter().map(Encoded::len).max().unwrap_or(0);
        let n = inputs.len();
        let fits = n <= limits.max_batch_size
            && (n == 1 || longest.saturating_mul(n) <= limits.max_batch_tokens);
        if !fits || pending.next_index != 0 {
            return Err(pending);
        }
        let Pending { req, inputs, .. } = pending;
        let len = inputs.len();
        Ok(Batch {
            inputs: inputs.collect(),
            parts: vec![Part {
                req,
                offset: 0,
                start: 0,
                len,
            }],
            max_tokens: longest,
        })
    }

    /// Drops the parts whose request no longer wants them (its caller went
    /// away, or it already failed), so they cost no compute.
    pub fn drop_abandoned(&mut self, recorder: &Recorder) {
        if !self.parts.iter().any(|p| p.req.abandoned()) {
            return;
        }
        let old_inputs = std::mem::take(&mut self.inputs);
        let old_parts = std::mem::take(&mut self.parts);
        let mut old_inputs = old_inputs.into_iter();
        self.max_tokens = 0;
        for mut part in old_parts {
            let inputs = old_inputs.by_ref().take(part.len);
            if part.req.abandoned() {
                part.req.skipped(part.len, recorder);
                inputs.for_each(drop);
                continue;
            }
            part.start = self.inputs.len();
            for input in inputs {
                self.max_tokens = self.max_tokens.max(input.len());
                self.inputs.push(input);
            }
            self.parts.push(part);
        }
    }
}

/// Requests waiting for the model, owned by the collector.
pub(crate) struct FairQueue {
    entries: VecDeque<Pending>,
    limits: Limits,
    inputs: usize,
}

impl FairQueue {
    pub fn new(limits: Limits) -> Self {
        Self {
            entries: VecDeque::new(),
            limits,
            inputs: 0,
        }
    }

    pub fn push(&mut self, pending: Pending) {
        self.inputs += pending.remaining();
        self.entries.push_back(pending);
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Inputs queued (not yet batched).
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Empties the queue, returning every request in it.
    pub fn take_all(&mut self, recorder: &Recorder) -> Vec<Arc<Request>> {
        recorder.dequeued(self.inputs);
        self.inputs = 0;
        self.entries.drain(..).map(|p| p.req).collect()
    }

    /// Moves queued inputs into `batch` until a budget stops it or the queue
    /// runs dry. Requests are taken front to back; each gets a turn of at most
    /// one full batch of inputs, after which an unfinished request moves to the
    /// back, so huge requests interleave with small ones instead of starving
    /// them. A request interrupted only because the batch filled keeps its place.
    /// Returns true if the queue still holds inputs that did not fit.
    pub fn fill(&mut self, batch: &mut Batch, recorder: &Recorder) -> bool {
        let limits = self.limits;
        while let Some(front) = self.entries.front_mut() {
            if front.req.abandoned() {
                let n = front.remaining();
                front.req.skipped(n, recorder);
                self.inputs -= n;
                recorder.dequeued(n);
                self.entries.pop_front();
                continue;
            }
            if !limits.batching
                && batch
                    .parts
                    .last()
                    .is_some_and(|p| !Arc::ptr_eq(&p.req, &front.req))
            {
                return true;
            }
            let mut taken = 0;
            while front.turn_used < limits.max_batch_size {
                let Some(next) = front.inputs.as_slice().first() else {
                    break;
                };
                if !batch.fits(next.len(), &limits) {
                    break;
                }
                let input = front.inputs.next().expect("peeked above");
                batch.push(&front.req, front.next_index, input);
                front.next_index += 1;
                front.turn_used += 1;
                taken += 1;
            }
            self.inputs -= taken;
            recorder.dequeued(taken);
            if front.remaining() == 0 {
                self.entries.pop_front();
            } else if front.turn_used >= limits.max_batch_size {
                let mut rotated = self.entries.pop_front().expect("front exists");
                rotated.turn_used = 0;
                self.entries.push_back(rotated);
            } else {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{ActiveGuard, Ticket};
    use std::time::Instant;

    fn request(n: usize, recorder: &Arc<Recorder>) -> (Arc<Request>, Vec<Encoded>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let permit = runtime
            .block_on(Arc::new(tokio::sync::Semaphore::new(1)).acquire_owned())
            .unwrap();
        let (reply, _answer) = tokio::sync::oneshot::channel();
        let ticket = Ticket::new(permit, n, recorder.clone());
        let req = Arc::new(Request::new(
            vec![1; n],
            Instant::now(),
            reply,
            ticket,
            ActiveGuard::new(recorder.clone()),
        ));
        (
            req,
            (0..n)
                .map(|i| Encoded {
                    ids: vec![i as u32],
                    type_ids: None,
                    untruncated_len: 1,
                })
                .collect(),
        )
    }

    /// Cuts batches until the queue is empty; each batch as (request id, inputs) runs.
    fn drain(
        queue: &mut FairQueue,
        ids: &[Arc<Request>],
        recorder: &Recorder,
    ) -> Vec<Vec<(usize, usize)>> {
        let mut out = Vec::new();
        while !queue.is_empty() {
            let mut batch = Batch::default();
            queue.fill(&mut batch, recorder);
            out.push(
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
            );
        }
        out
    }

    /// Queues requests of these sizes in order (4 inputs per batch at most)
    /// and drains it.
    fn batches_for(sizes: &[usize], batching: bool) -> Vec<Vec<(usize, usize)>> {
        let recorder = Arc::new(Recorder::new());
        let mut queue = FairQueue::new(Limits {
            max_batch_size: 4,
            max_batch_tokens: 1000,
            batching,
        });
        let mut ids = Vec::new();
        for &n in sizes {
            let (req, inputs) = request(n, &recorder);
            ids.push(req.clone());
            queue.push(Pending::new(req, inputs));
        }
        drain(&mut queue, &ids, &recorder)
    }

    #[test]
    fn huge_request_takes_turns_with_small_ones() {
        // The big one gets one batch, then everyone else, then the big one again.
        assert_eq!(
            batches_for(&[10, 1, 2, 1], true),
            vec![
                vec![(0, 4)],
                vec![(1, 1), (2, 2), (3, 1)],
                vec![(0, 4)],
                vec![(0, 2)]
            ]
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
}
