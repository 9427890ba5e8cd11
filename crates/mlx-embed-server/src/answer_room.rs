//! A bound on the memory held by answers made but not yet taken by their
//! clients (`--max-unsent-answers-mb`).
//!
//! One answer is bounded (2^24 floats, about 200 MB of JSON for
//! `/embed_all`), and one that its client does not read is dropped after
//! `--client-timeout-secs`; the number of connections is not bounded. So a
//! few clients that ask for large answers and never read them could hold
//! gigabytes until then. A request whose answer may be large keeps room for
//! it, told from its inputs, before anything is computed (a sparse one, whose
//! size its inputs do not tell, once it is), and waits for that room while
//! the answers not yet taken fill it; the answer's body then
//! counts in its place until it is all handed to the socket. Requests that
//! wait get room in the order they came, so one whose answer needs an empty
//! room is not passed by a stream of smaller ones. Small answers, which the
//! socket takes whole at once, are not counted, and requests for them
//! (queries) never wait.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use tokio::sync::{oneshot, Notify};

use crate::errors::ApiError;
use crate::state::AppState;

/// Answers at least this large are counted: a smaller one goes into the
/// socket's send buffer at once, so it holds no memory of ours for long.
const COUNTED_FROM: u64 = 256 << 10;

/// How much of a counted answer is handed to hyper at a time. hyper asks
/// for the next piece only once its write buffer has room, so the rest of
/// the answer stays here, counted, until the client reads.
const PIECE: usize = 256 << 10;

/// About the bytes one float takes in a JSON answer (`-0.012345678,`, a
/// little over 12 on average): how an answer's size is told before it is
/// computed.
pub const JSON_FLOAT_BYTES: usize = 13;

/// At most the bytes one entry of a sparse answer takes
/// (`{"index":30521,"value":0.12345678},`). Room for a sparse answer is kept
/// once it is computed, for its entries, since how many an input has is not
/// known before.
pub const SPARSE_ENTRY_BYTES: usize = 36;

/// Keeps room for a request's answer of about `answer_bytes`, before it is
/// computed (a sparse answer's: once computed, when its size is known),
/// waiting while the room has not that much free (and is not empty), or
/// others came first: up to `--max-queue-wait-ms`, then 429; 503 once the
/// drain is over. An answer too small to be counted goes at once. What is kept goes
/// over to the answer's body in [`count_unsent_answers`], or back to the
/// room if the request ends without one.
pub(crate) async fn make_room(state: &AppState, answer_bytes: usize) -> Result<(), ApiError> {
    // A gRPC stream's answers wait in the stream unread, small ones too.
    let turn = KEPT.try_with(|kept| kept.turn.clone()).ok().flatten();
    if answer_bytes == 0 || (turn.is_none() && (answer_bytes as u64) < COUNTED_FROM) {
        return Ok(());
    }
    let patience = state.batcher().config().max_queue_wait;
    let room = state.answer_room();
    match state
        .until_drain_ends(in_turn(turn, room.reserve(answer_bytes, patience)))
        .await
    {
        Some(Ok(reserved)) => {
            // Outside the layer (a handler called on its own) nothing is kept.
            let _ = KEPT.try_with(|kept| kept.put(reserved));
            Ok(())
        }
        // A draining server's "retry later" would send the client back to it.
        Some(Err(NoRoom)) if state.is_shutting_down() => Err(ApiError::shutting_down()),
        Some(Err(NoRoom)) => Err(ApiError::answers_unsent()),
        None => Err(ApiError::shutting_down()),
    }
}

tokio::task_local! {
    /// Where [`make_room`] leaves what it kept for the request in hand.
    static KEPT: Kept;
}

#[derive(Clone, Default)]
struct Kept {
    slot: Arc<Mutex<Option<Reserved>>>,
    /// A gRPC stream message's place among its stream's: room for any
    /// answer, however small, kept in the stream's order
    /// ([`kept_for_stream_message`]).
    turn: Option<Arc<Mutex<Turn>>>,
}

/// A gRPC stream message's turn to keep room ([`Turns`]).
pub(crate) struct Turn {
    /// Ends once the message before has kept its room, given up, or ended.
    after: Option<oneshot::Receiver<()>>,
    /// Dropped once this one has (ending the next one's `after`).
    done: Option<oneshot::Sender<()>>,
}

/// The turns of one stream's messages, in the order they came. A stream
/// answers in that order, and holds each answer until those before it are
/// sent, so a message that kept room before an earlier one could hold room
/// the earlier one waits for, and neither is sent: the earlier one waits
/// `--max-queue-wait-ms` and ends the stream though its client reads. Its
/// messages run on tasks that start in no set order (tokio runs the last
/// spawned first), so each waits for the one before to keep its room.
#[derive(Default)]
pub(crate) struct Turns {
    last: Option<oneshot::Receiver<()>>,
}

impl Turns {
    /// The next message's turn: after the one before's.
    pub(crate) fn next_turn(&mut self) -> Turn {
        let (done, after) = oneshot::channel();
        Turn {
            after: self.last.replace(after),
            done: Some(done),
        }
    }
}

/// `keep` once the message before (where `turn` is a stream message's)
/// has kept its room; then the message after may.
async fn in_turn<T>(
    turn: Option<Arc<Mutex<Turn>>>,
    keep: impl std::future::Future<Output = T>,
) -> T {
    let lock = |turn: &Arc<Mutex<Turn>>| {
        turn.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .after
            .take()
    };
    if let Some(after) = turn.as_ref().and_then(lock) {
        // Sent or dropped: either way the one before is done with the room.
        let _ = after.await;
    }
    let kept = keep.await;
    if let Some(turn) = turn {
        turn.lock().unwrap_or_else(PoisonError::into_inner).done = None;
    }
    kept
}

impl Kept {
    fn put(&self, reserved: Reserved) {
        *self.slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(reserved);
    }

    fn take(&self) -> Option<Reserved> {
        self.slot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// Runs one gRPC stream message's `work`, keeping room for its answer as
/// [`make_room`] keeps it for an HTTP request's, but for small answers too:
/// a stream's finished answers (up to its 64 at once) wait in it until its
/// client reads, and a client that opens many streams and reads none must
/// not hold more than the room. It keeps room in `turn` (its stream's
/// [`Turns`]), or once `work` ends without keeping any. Returns what was kept, for
/// [`AnswerRoom::settle`] once the answer's exact size is known.
pub(crate) async fn kept_for_stream_message<F: std::future::Future>(
    work: F,
    turn: Turn,
) -> (F::Output, Option<Reserved>) {
    let kept = Kept {
        turn: Some(Arc::new(Mutex::new(turn))),
        ..Kept::default()
    };
    let out = KEPT.scope(kept.clone(), work).await;
    (out, kept.take())
}

/// Innermost layer: every large answer counts in the room while it is
/// written, in place of what [`make_room`] kept for it.
pub async fn count_unsent_answers(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    let kept = Kept::default();
    let response = KEPT.scope(kept.clone(), next.run(req)).await;
    let reserved = kept.take();
    let room = state.answer_room().clone();
    response.map(|body| room.hold(body, reserved))
}

/// The bytes of answers not yet taken by their clients and of those kept
/// for answers being computed, and the requests waiting for room.
pub struct AnswerRoom {
    limit: usize,
    held: AtomicUsize,
    /// The requests waiting for room, first come first: only the first may
    /// take room, so later, smaller ones cannot keep it from ever fitting.
    line: Mutex<Line>,
    freed: Notify,
}

#[derive(Default)]
struct Line {
    next_ticket: u64,
    tickets: VecDeque<u64>,
}

/// Why [`AnswerRoom::reserve`] gave up.
#[derive(Debug, PartialEq, Eq)]
pub struct NoRoom;

/// Bytes kept in the room for an answer not yet written; given back when
/// dropped.
#[derive(Debug)]
pub struct Reserved {
    room: Arc<AnswerRoom>,
    bytes: usize,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.room.release(self.bytes);
    }
}

impl std::fmt::Debug for AnswerRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnswerRoom")
            .field("limit", &self.limit)
            .field("held", &self.held())
            .finish()
    }
}

impl AnswerRoom {
    /// A room of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            held: AtomicUsize::new(0),
            line: Mutex::default(),
            freed: Notify::new(),
        }
    }

    /// Bytes of counted answers not yet all handed to their sockets, and
    /// kept for answers being computed.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// Requests waiting for room.
    pub fn waiting(&self) -> usize {
        self.line().tickets.len()
    }

    fn line(&self) -> MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `bytes` once they fit under the bound, or the room is empty
    /// (an answer larger than the whole room goes alone), and every request
    /// that came before has had its room; waits up to `patience` for that.
    pub async fn reserve(
        self: &Arc<Self>,
        bytes: usize,
        patience: Duration,
    ) -> Result<Reserved, NoRoom> {
        let ticket = {
            let mut line = self.line();
            if line.tickets.is_empty() {
                if let Some(reserved) = self.try_reserve(bytes) {
                    return Ok(reserved);
                }
            }
            let ticket = line.next_ticket;
            line.next_ticket += 1;
            line.tickets.push_back(ticket);
            ticket
        };
        let _in_line = InLine { room: self, ticket };
        let turn = async {
            loop {
                let notified = self.freed.notified();
                let mut notified = std::pin::pin!(notified);
                // Registered before the try, so a release between the try
                // and the wait is not missed.
                notified.as_mut().enable();
                {
                    let mut line = self.line();
                    if line.tickets.front() == Some(&ticket) {
                        if let Some(reserved) = self.try_reserve(bytes) {
                            line.tickets.pop_front();
                            drop(line);
                            // The next in line may fit in what is left.
                            self.freed.notify_waiters();
                            return reserved;
                        }
                    }
                }
                notified.await;
            }
        };
        tokio::time::timeout(patience, turn)
            .await
            .map_err(|_| NoRoom)
    }

    fn try_reserve(self: &Arc<Self>, bytes: usize) -> Option<Reserved> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                let after = held.saturating_add(bytes);
                (held == 0 || after <= self.limit).then_some(after)
            })
            .ok()
            .map(|_| Reserved {
                room: self.clone(),
                bytes,
            })
    }

    /// `body`, counted while it is being written when it is large; what was
    /// kept for it goes back once it is counted (at once, when it is small).
    pub fn hold(self: &Arc<Self>, body: Body, reserved: Option<Reserved>) -> Body {
        if body.size_hint().lower() < COUNTED_FROM {
            return body;
        }
        Body::new(Held {
            inner: body,
            piece: Bytes::new(),
            counted: 0,
            reserved,
            room: self.clone(),
        })
    }

    /// Counts an answer of `bytes` made (a gRPC stream's, encoded size),
    /// in place of what was `kept` for it before it was computed: counted
    /// as it is, without waiting (it exists already; what waits is the next
    /// message's computation, in [`make_room`]).
    pub fn settle(self: &Arc<Self>, kept: Option<Reserved>, bytes: usize) -> Reserved {
        self.held.fetch_add(bytes, Ordering::AcqRel);
        drop(kept);
        Reserved {
            room: self.clone(),
            bytes,
        }
    }

    fn release(&self, bytes: usize) {
        if bytes > 0 {
            self.held.fetch_sub(bytes, Ordering::AcqRel);
            self.freed.notify_waiters();
        }
    }
}

/// A request's place in the line, left when it gets room, gives up, or is
/// dropped (its client gone).
struct InLine<'a> {
    room: &'a AnswerRoom,
    ticket: u64,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        let mut line = self.room.line();
        if let Some(at) = line.tickets.iter().position(|t| *t == self.ticket) {
            line.tickets.remove(at);
            if at == 0 {
                drop(line);
                // The next one is first now, and may fit.
                self.room.freed.notify_waiters();
            }
        }
    }
}

/// A large answer's body: its bytes count in the room from when hyper
/// starts writing it until it is dropped (all handed over, or the
/// connection gone).
struct Held {
    inner: Body,
    /// What the inner body gave and hyper has not yet asked for.
    piece: Bytes,
    counted: usize,
    /// What was kept for this answer while it was computed: given back once
    /// the answer itself is counted, so the room never looks emptier than it is.
    reserved: Option<Reserved>,
    room: Arc<AnswerRoom>,
}

impl HttpBody for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if this.piece.is_empty() {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        this.room.held.fetch_add(data.len(), Ordering::AcqRel);
                        this.counted += data.len();
                        this.reserved = None;
                        this.piece = data;
                    }
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                other => return other,
            }
        }
        let n = this.piece.len().min(PIECE);
        Poll::Ready(Some(Ok(Frame::data(this.piece.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.piece.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        // Exact where the inner body's is, so hyper still sends a
        // Content-Length rather than chunks.
        let inner = self.inner.size_hint();
        let piece = self.piece.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + piece);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + piece);
        }
        hint
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.room.release(self.counted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    const PATIENT: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn a_large_answer_is_counted_until_dropped_and_handed_over_in_pieces() {
        let room = Arc::new(AnswerRoom::new(1 << 30));
        let kept = room.reserve(10 << 20, PATIENT).await.unwrap();
        assert_eq!(room.held(), 10 << 20);
        let bytes = Bytes::from(vec![7u8; 3 * PIECE + 5]);
        let mut body = room.hold(Body::from(bytes.clone()), Some(kept));
        assert_eq!(body.size_hint().exact(), Some(bytes.len() as u64));
        assert_eq!(room.held(), 10 << 20, "kept until the answer is counted");
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first.len(), PIECE);
        assert_eq!(
            room.held(),
            bytes.len(),
            "the answer, in place of what was kept"
        );
        assert_eq!(body.size_hint().exact(), Some((bytes.len() - PIECE) as u64));
        let mut got = first.to_vec();
        while let Some(frame) = body.frame().await {
            got.extend_from_slice(&frame.unwrap().into_data().unwrap());
        }
        assert_eq!(got, bytes.to_vec());
        assert_eq!(
            room.held(),
            bytes.len(),
            "counted until the body is dropped"
        );
        drop(body);
        assert_eq!(room.held(), 0);
    }

    #[tokio::test]
    async fn a_small_answer_is_not_counted_and_gives_back_what_was_kept() {
        let room = Arc::new(AnswerRoom::new(1 << 30));
        let kept = room.reserve(1 << 20, PATIENT).await.unwrap();
        let body = room.hold(Body::from(vec![1u8; 1000]), Some(kept));
        assert_eq!(room.held(), 0);
        let got = body.collect().await.unwrap().to_bytes();
        assert_eq!(got.len(), 1000);
        assert_eq!(room.held(), 0);
    }

    #[tokio::test]
    async fn requests_wait_until_their_answer_fits_and_go_when_room_frees() {
        let room = Arc::new(AnswerRoom::new(3 * PIECE));
        // Larger than the whole room: it goes alone.
        let alone = room.reserve(5 * PIECE, PATIENT).await.unwrap();
        assert_eq!(
            room.reserve(PIECE, Duration::from_millis(50))
                .await
                .unwrap_err(),
            NoRoom
        );
        drop(alone);
        let first = room.reserve(2 * PIECE, PATIENT).await.unwrap();
        let fits = room.reserve(PIECE, PATIENT).await.unwrap();
        assert_eq!(room.held(), 3 * PIECE);
        let waiter = {
            let room = room.clone();
            tokio::spawn(async move { room.reserve(2 * PIECE, PATIENT).await.map(|r| r.bytes) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(room.waiting(), 1);
        drop(fits);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "one piece free is not room for two");
        drop(first);
        assert_eq!(waiter.await.unwrap(), Ok(2 * PIECE));
        assert_eq!((room.held(), room.waiting()), (0, 0));
    }

    fn wait_for(
        room: &Arc<AnswerRoom>,
        bytes: usize,
    ) -> tokio::task::JoinHandle<Result<Reserved, NoRoom>> {
        let room = room.clone();
        tokio::spawn(async move { room.reserve(bytes, PATIENT).await })
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    #[tokio::test]
    async fn a_request_that_needs_the_whole_room_is_not_passed_by_later_smaller_ones() {
        let room = Arc::new(AnswerRoom::new(4 * PIECE));
        let small = room.reserve(PIECE, PATIENT).await.unwrap();
        // Needs an empty room: before, each later small one that fitted
        // kept the room from ever emptying.
        let whole = wait_for(&room, 8 * PIECE);
        settle().await;
        let later = wait_for(&room, PIECE);
        settle().await;
        assert_eq!(room.waiting(), 2);
        assert!(
            !later.is_finished(),
            "room is free, but the large one came first"
        );
        drop(small);
        let whole = whole.await.unwrap().unwrap();
        settle().await;
        assert!(!later.is_finished(), "the large one has the room");
        assert_eq!(room.held(), 8 * PIECE);
        drop(whole);
        let later = later.await.unwrap().unwrap();
        assert_eq!((room.held(), room.waiting()), (PIECE, 0));
        drop(later);
        assert_eq!(room.held(), 0);
    }

    #[tokio::test]
    async fn when_the_first_in_line_gives_up_or_leaves_the_next_goes() {
        let room = Arc::new(AnswerRoom::new(4 * PIECE));
        let held = room.reserve(3 * PIECE, PATIENT).await.unwrap();
        let impatient = {
            let room = room.clone();
            tokio::spawn(async move { room.reserve(2 * PIECE, Duration::from_millis(400)).await })
        };
        settle().await;
        let gone = wait_for(&room, 2 * PIECE);
        settle().await;
        let fits = wait_for(&room, PIECE);
        settle().await;
        assert_eq!(room.waiting(), 3);
        assert_eq!(impatient.await.unwrap().unwrap_err(), NoRoom);
        // Its client leaves: the one after it is first, and fits.
        gone.abort();
        let fits = fits.await.unwrap().unwrap();
        assert_eq!((room.held(), room.waiting()), (4 * PIECE, 0));
        drop((held, fits));
        assert_eq!(room.held(), 0);
    }

    #[tokio::test]
    async fn a_stream_s_messages_keep_room_in_their_order_whichever_starts_first() {
        let room = Arc::new(AnswerRoom::new(2 * PIECE));
        let mut turns = Turns::default();
        let turn = |t: Turn| Some(Arc::new(Mutex::new(t)));
        let (first, second, third) = (turns.next_turn(), turns.next_turn(), turns.next_turn());
        // The second starts first (tokio runs the last spawned first).
        let later = {
            let room = room.clone();
            tokio::spawn(
                async move { in_turn(turn(second), room.reserve(2 * PIECE, PATIENT)).await },
            )
        };
        settle().await;
        assert_eq!(
            (room.held(), room.waiting()),
            (0, 0),
            "not before the first"
        );
        let first = in_turn(turn(first), room.reserve(2 * PIECE, PATIENT))
            .await
            .unwrap();
        settle().await;
        assert_eq!(room.waiting(), 1, "the second waits for room now");
        drop(first);
        let later = later.await.unwrap().unwrap();
        assert_eq!(room.held(), 2 * PIECE);
        drop(later);
        // A message that ended without keeping room lets the next go.
        drop(third);
        let after = turns.next_turn();
        let alone = in_turn(turn(after), room.reserve(PIECE, PATIENT)).await;
        assert_eq!(alone.unwrap().bytes, PIECE);
        assert_eq!(room.held(), 0);
    }

    #[tokio::test]
    async fn several_in_line_that_fit_together_all_go_when_room_frees() {
        let room = Arc::new(AnswerRoom::new(4 * PIECE));
        let held = room.reserve(4 * PIECE, PATIENT).await.unwrap();
        let waiters: Vec<_> = (0..4).map(|_| wait_for(&room, PIECE)).collect();
        settle().await;
        assert_eq!(room.waiting(), 4);
        drop(held);
        let mut got = Vec::new();
        for waiter in waiters {
            got.push(waiter.await.unwrap().unwrap());
        }
        assert_eq!((room.held(), room.waiting()), (4 * PIECE, 0));
        drop(got);
        assert_eq!(room.held(), 0);
    }
}
