//! One admitted `embed` call as the lanes and the model thread see it: where
//! its answer is assembled and how the caller is told.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, OwnedSemaphorePermit};

use crate::cache::Lead;
use crate::recorder::{lock, Recorder};
use crate::shared::Shared;
use crate::{CoreError, Output, Priority};

/// A request's vectors and where its time went, or why not.
pub(crate) type Answered = Result<Computed, CoreError>;

/// What a request's caller is answered with.
pub(crate) struct Computed {
    /// Not normalized, in input order; per input one pooled vector, or its
    /// rows flattened.
    pub vectors: Vec<Vec<f32>>,
    /// From ready to queue (admission included) until its first input
    /// entered a batch.
    pub queue: Duration,
    /// The model time of the batches that computed it, at most the time from
    /// its first batch's start to its answer (pipelined batches overlap).
    pub inference: Duration,
    /// Each input's own `(queue, inference)`: from ready to queue until its
    /// batch started, and that batch's model time (TEI's per-input phases).
    pub per_input: Vec<(Duration, Duration)>,
}

/// `Request::queued_for` before the request's first batch starts.
const NOT_STARTED: u64 = u64::MAX;

pub(crate) type Reply = oneshot::Sender<Answered>;

/// The admission permits and in-flight count of a request. Given back as
/// its batches are answered, so the next caller in its lane gets in while a
/// big request is still running (and from there its turn in the lane's
/// round-robin): held to the end, one request of the lane's whole room kept
/// every later caller out until it was done, however small. A request
/// holds permits in proportion to its inputs not yet answered: all of them
/// when it fits the room, `room * remaining / inputs` when it is larger (it
/// was let in with the whole room), so a line's admitted inputs stay within
/// its room, or one maximal request's size (a lane has three lines, for
/// requests of a query's size, of one batch and larger: [`crate::admission`]). The
/// rest goes the moment the answer is ready, before the caller is woken (so
/// a caller that immediately calls again finds its room free), or when its
/// caller leaves.
pub(crate) struct Ticket {
    permit: OwnedSemaphorePermit,
    /// Permits the request was admitted with.
    admitted: usize,
    /// Its inputs.
    total: usize,
    /// Inputs not yet answered.
    inputs: usize,
    recorder: Arc<Recorder>,
}

impl Ticket {
    pub fn new(permit: OwnedSemaphorePermit, inputs: usize, recorder: Arc<Recorder>) -> Self {
        recorder
            .in_flight_inputs
            .fetch_add(inputs as u64, Ordering::Relaxed);
        Self {
            admitted: permit.num_permits(),
            permit,
            total: inputs,
            inputs,
            recorder,
        }
    }

    /// `n` more inputs are answered: their share of the room goes back now.
    pub fn answered(&mut self, n: usize) {
        let n = n.min(self.inputs);
        self.inputs -= n;
        self.recorder
            .in_flight_inputs
            .fetch_sub(n as u64, Ordering::Relaxed);
        let keep =
            (self.admitted as u128 * self.inputs as u128).div_ceil(self.total.max(1) as u128);
        let give_back = self.permit.num_permits().saturating_sub(keep as usize);
        if give_back > 0 {
            drop(self.permit.split(give_back));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.recorder
            .in_flight_inputs
            .fetch_sub(self.inputs as u64, Ordering::Relaxed);
    }
}

/// Counts a request as active (for `drained()`) from the start of `embed`
/// until after its answer is sent.
pub(crate) struct ActiveGuard(Arc<Recorder>);

impl ActiveGuard {
    pub fn new(recorder: Arc<Recorder>) -> Self {
        recorder.request_started();
        Self(recorder)
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

struct Answer {
    /// One slot per input, filled as its batch is answered.
    vectors: Vec<Vec<f32>>,
    /// Slots filled so far.
    delivered: usize,
    /// Model time of the batches that delivered slots so far.
    model_time: Duration,
    /// Each slot's `(queue, inference)`, set with its vector.
    phases: Vec<(Duration, Duration)>,
    reply: Option<Reply>,
    ticket: Option<Ticket>,
    active: Option<ActiveGuard>,
    /// The cache flights this request computes, one per input (empty when
    /// it computes none). Published where the vectors are delivered, so a
    /// computed vector reaches the callers that joined the flight even when
    /// this request's own caller has left; dropped unpublished with an input
    /// left uncomputed, which wakes them to look up again.
    leads: Vec<Option<Lead>>,
}

pub(crate) struct Request {
    pub len: usize,
    /// The lane it waits in.
    pub priority: Priority,
    /// What the model computes for it; a batch holds one kind only.
    pub output: Output,
    pub arrived: Instant,
    caller_gone: AtomicBool,
    /// Set once the request got an error: its remaining inputs are pointless.
    failed: AtomicBool,
    /// Nanoseconds from `arrived` until its first input entered a running
    /// batch (`NOT_STARTED` until then): its queue wait.
    queued_for: AtomicU64,
    answer: Mutex<Answer>,
    /// Its `queue` and `inference` spans, where a subscriber wants them
    /// (`None` otherwise, which costs the model thread one branch).
    phases: Option<Box<Phases>>,
}

/// A request's phase spans, children of the span its caller was in: `queue`
/// from ready to queue until its first batch starts, then `inference` until
/// its answer. Never entered (a batch runs many requests' inputs), so no log
/// line is ever inside one: they only time their phase.
struct Phases {
    inputs: usize,
    open: Mutex<OpenPhase>,
}

/// The spans a request's phases hold while it is unanswered; both
/// `Span::none()` once it is answered: the model thread may keep the
/// request a while after, and a handle to the caller's span kept with it
/// would hold that span open (unexported, at an exit right after).
struct OpenPhase {
    /// The caller's span, each phase's parent.
    parent: tracing::Span,
    /// The span of the phase in progress.
    phase: tracing::Span,
}

impl Request {
    pub fn new(
        len: usize,
        priority: Priority,
        output: Output,
        arrived: Instant,
        reply: Reply,
        ticket: Ticket,
        active: ActiveGuard,
    ) -> Self {
        Self {
            len,
            priority,
            output,
            arrived,
            caller_gone: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            queued_for: AtomicU64::new(NOT_STARTED),
            answer: Mutex::new(Answer {
                vectors: vec![Vec::new(); len],
                delivered: 0,
                model_time: Duration::ZERO,
                phases: vec![(Duration::ZERO, Duration::ZERO); len],
                reply: Some(reply),
                ticket: Some(ticket),
                active: Some(active),
                leads: Vec::new(),
            }),
            phases: None,
        }
    }

    /// The request's phases are timed as spans from `queue` (opened when it
    /// was ready to queue, under the caller's span) on; a disabled span
    /// (no subscriber wants it) leaves them untimed.
    pub fn with_queue_span(mut self, queue: tracing::Span) -> Self {
        if !queue.is_disabled() {
            self.phases = Some(Box::new(Phases {
                inputs: self.len,
                open: Mutex::new(OpenPhase {
                    parent: tracing::Span::current(),
                    phase: queue,
                }),
            }));
        }
        self
    }

    /// Closes the span of the phase that is open, opening `next`'s (given
    /// the parent and the inputs), or, with `None`, none: answered, the
    /// caller's span is let go too.
    fn next_phase(&self, next: Option<fn(&tracing::Span, usize) -> tracing::Span>) {
        if let Some(phases) = &self.phases {
            let mut open = lock(&phases.open);
            // Closed before the next opens: one phase ends where the next begins.
            drop(std::mem::replace(&mut open.phase, tracing::Span::none()));
            match next {
                // A request failed (shutdown, another batch's error) while its
                // batch was being formed still gets `mark_started`: with the
                // caller's span let go, `parent: none` would make the phase a
                // root span, a trace of its own.
                Some(_) if open.parent.is_none() => {}
                Some(next) => open.phase = next(&open.parent, phases.inputs),
                None => drop(std::mem::replace(&mut open.parent, tracing::Span::none())),
            }
        }
    }

    /// The request computes the cache flights `leads`, one per input (see `Answer::leads`).
    pub fn with_leads(mut self, leads: Vec<Lead>) -> Self {
        debug_assert!(
            leads.is_empty() || leads.len() == self.len,
            "one lead per input"
        );
        let answer = self
            .answer
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        answer.leads = leads.into_iter().map(Some).collect();
        self
    }

    /// True when computing more of this request would be wasted.
    pub fn abandoned(&self) -> bool {
        self.caller_gone.load(Ordering::Acquire) || self.failed.load(Ordering::Acquire)
    }

    /// Its first batch starts at `now`: its queue wait the first time it is
    /// called, `None` after.
    pub fn mark_started(&self, now: Instant) -> Option<Duration> {
        let waited = now.saturating_duration_since(self.arrived);
        let nanos = u64::try_from(waited.as_nanos()).unwrap_or(NOT_STARTED - 1);
        let first = self
            .queued_for
            .compare_exchange(NOT_STARTED, nanos, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if first {
            self.next_phase(Some(|parent, inputs| {
                tracing::debug_span!(parent: parent, "inference", inputs = inputs as i64)
            }));
        }
        first.then_some(waited)
    }

    /// Its queue wait so far: until its first batch started, or until now.
    fn queue_wait(&self) -> Duration {
        match self.queued_for.load(Ordering::Acquire) {
            NOT_STARTED => self.arrived.elapsed(),
            nanos => Duration::from_nanos(nanos),
        }
    }

    /// Accounts for `n` of this request's inputs being dropped uncomputed.
    /// Only a caller that went away counts them as cancelled (the request
    /// itself is counted where its caller left, in `Batcher::embed`); a
    /// request that already failed simply stops.
    pub fn skipped(&self, n: usize, recorder: &Recorder) {
        if self.failed.load(Ordering::Acquire) || !self.caller_gone.load(Ordering::Acquire) {
            return;
        }
        recorder.inputs_cancelled(n);
    }

    /// Stores computed rows for inputs `offset..`, one entry per input, from
    /// a batch that started at `started` and took the model `model_time`;
    /// answers the caller when the last input is in. With more than one
    /// model thread a request's chunks can be answered in any order.
    pub fn deliver(
        &self,
        offset: usize,
        vectors: impl Iterator<Item = Vec<f32>>,
        started: Instant,
        model_time: Duration,
    ) {
        let mut answer = lock(&self.answer);
        if answer.reply.is_none() {
            return;
        }
        answer.model_time += model_time;
        let mut n = 0;
        {
            let Answer {
                vectors: slots,
                phases,
                leads,
                ..
            } = &mut *answer;
            let phase = (started.saturating_duration_since(self.arrived), model_time);
            for ((slot, v), p) in slots[offset..]
                .iter_mut()
                .zip(vectors)
                .zip(&mut phases[offset..])
            {
                if let Some(lead) = leads.get_mut(offset + n).and_then(Option::take) {
                    lead.publish(&v);
                }
                *slot = v;
                *p = phase;
                n += 1;
            }
        }
        answer.delivered += n;
        if answer.delivered == self.len {
            let queue = self.queue_wait();
            // Batches overlap when pipelined: their summed time can exceed
            // the time since the first one started.
            let since_start = self.arrived.elapsed().saturating_sub(queue);
            let computed = Computed {
                vectors: std::mem::take(&mut answer.vectors),
                queue,
                inference: answer.model_time.min(since_start),
                per_input: std::mem::take(&mut answer.phases),
            };
            // Closed before the caller is woken: its span may end right after.
            self.next_phase(None);
            Self::answer(answer, Ok(computed));
        } else if let Some(ticket) = answer.ticket.as_mut() {
            ticket.answered(n);
        }
    }

    /// Answers with an error; later chunks of this request are skipped.
    pub fn fail(&self, error: CoreError) {
        self.failed.store(true, Ordering::Release);
        let answer = lock(&self.answer);
        self.next_phase(None);
        if answer.reply.is_some() {
            Self::answer(answer, Err(error));
        }
    }

    fn answer(mut answer: std::sync::MutexGuard<'_, Answer>, result: Answered) {
        let reply = answer.reply.take();
        let ticket = answer.ticket.take();
        let active = answer.active.take();
        // A failed request's flights end now, so their followers try again at once.
        let leads = std::mem::take(&mut answer.leads);
        drop(answer);
        drop(leads);
        drop(ticket);
        if let Some(reply) = reply {
            // The caller may have gone; its loss.
            let _ = reply.send(result);
        }
        drop(active);
    }
}

/// Held by the `embed` future: if the future is dropped before the answer,
/// the request is marked so its remaining inputs are skipped, its admission
/// room is given back, and what of it is queued leaves its lane. Weak, so it
/// never keeps the reply sender alive (a dropped request must wake its caller).
pub(crate) struct CallerGuard<'a> {
    request: Option<Weak<Request>>,
    shared: &'a Shared,
}

impl<'a> CallerGuard<'a> {
    pub fn new(request: &Arc<Request>, shared: &'a Shared) -> Self {
        Self {
            request: Some(Arc::downgrade(request)),
            shared,
        }
    }

    pub fn disarm(mut self) {
        self.request = None;
    }
}

impl Drop for CallerGuard<'_> {
    fn drop(&mut self) {
        if let Some(request) = self.request.take().and_then(|w| w.upgrade()) {
            request.caller_gone.store(true, Ordering::Release);
            // Its admission room goes to the next caller now, not when the
            // next batch cut reaches (and skips) its leftover inputs.
            let ticket = lock(&request.answer).ticket.take();
            drop(ticket);
            self.shared.withdraw(&request);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    fn ticket(room: usize, inputs: usize) -> (Arc<Semaphore>, Ticket) {
        let semaphore = Arc::new(Semaphore::new(room));
        let permit = semaphore
            .clone()
            .try_acquire_many_owned(inputs.min(room) as u32)
            .unwrap();
        let ticket = Ticket::new(permit, inputs, Arc::new(Recorder::new()));
        (semaphore, ticket)
    }

    /// The spans made while it is the default: each one's name and whether
    /// it has a parent (explicit or the current span).
    #[derive(Default)]
    struct Spans {
        made: Mutex<Vec<(&'static str, bool)>>,
        next: AtomicU64,
    }

    impl tracing::Subscriber for Spans {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, attrs: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            lock(&self.made).push((attrs.metadata().name(), attrs.parent().is_some()));
            tracing::span::Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, _: &tracing::Event<'_>) {}
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    #[test]
    fn a_request_answered_before_its_batch_starts_opens_no_orphan_phase() {
        let spans = Arc::new(Spans::default());
        let recorder = Arc::new(Recorder::new());
        let (_room, ticket) = ticket(1, 1);
        let (reply, _answer) = oneshot::channel();
        let req = tracing::subscriber::with_default(spans.clone(), || {
            let caller = tracing::info_span!("request");
            let _in = caller.enter();
            let req = Request::new(
                1,
                Priority::Normal,
                Output::Pooled,
                Instant::now(),
                reply,
                ticket,
                ActiveGuard::new(recorder),
            )
            .with_queue_span(tracing::debug_span!(parent: &caller, "queue"));
            // Shutdown fails it while a model thread forms a batch with it.
            req.fail(CoreError::ShuttingDown);
            assert!(req.mark_started(Instant::now()).is_some());
            req
        });
        assert!(req.abandoned());
        // No `inference` span: under no parent it would be a trace of its own.
        assert_eq!(*lock(&spans.made), [("request", false), ("queue", true)]);
    }

    #[test]
    fn a_request_that_fits_gives_back_one_permit_per_answered_input() {
        let (room, mut t) = ticket(8, 6);
        assert_eq!(room.available_permits(), 2);
        t.answered(2);
        assert_eq!(room.available_permits(), 4);
        t.answered(3);
        assert_eq!(room.available_permits(), 7);
        drop(t);
        assert_eq!(room.available_permits(), 8);
    }

    #[test]
    fn a_request_larger_than_the_room_gives_it_back_in_proportion() {
        // 12 inputs in a room of 4: it holds ceil(4 * remaining / 12).
        let (room, mut t) = ticket(4, 12);
        let mut free = Vec::new();
        for _ in 0..6 {
            t.answered(2);
            free.push(room.available_permits());
        }
        // remaining 10, 8, 6, 4, 2, 0 -> held 4, 3, 2, 2, 1, 0.
        assert_eq!(free, [0, 1, 2, 2, 3, 4]);
        // So the room bounds the lane: what the request still holds, scaled
        // by its size over the room, is what it has left to answer.
        drop(t);
        assert_eq!(room.available_permits(), 4);
    }
}
