//! An answer its client does not read: a connection whose answer could not
//! be written for `--client-timeout-secs` is dropped, with the buffer it
//! held, while a client that reads with pauses shorter than that gets its
//! answer whole, however long it takes over it.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mlx_embed_server::ServerArgs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const CLIENT_TIMEOUT_SECS: u64 = 3;

fn args() -> ServerArgs {
    ServerArgs {
        client_timeout_secs: CLIENT_TIMEOUT_SECS,
        ..test_args()
    }
}

/// Inputs of the request below: each is cut to the fake's 64 tokens, and
/// `/embed_all` answers a row per token.
const INPUTS: usize = 2048;

/// A connection that can take little at a time (a 4 KiB receive buffer)
/// with a `/embed_all` request sent on it whose answer (about 6 MB) is far
/// more than the sockets' buffers hold.
async fn ask_for_a_large_answer(server: &Server) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket
        .connect(server.base.trim_start_matches("http://").parse().unwrap())
        .await
        .unwrap();
    let long = "a text longer than the sixty-four tokens the fake model keeps of it, cut there";
    let texts: Vec<String> = (0..INPUTS).map(|i| format!("{i} {long}")).collect();
    let body = serde_json::to_vec(&serde_json::json!({ "inputs": texts })).unwrap();
    let head = format!(
        "POST /embed_all HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&body).await.unwrap();
    stream
}

/// Reads until the server closes the connection or `limit` passes: what
/// came, and whether it closed.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (got, false),
        }
    }
}

/// The answer's `Content-Length` and where its body starts, once `got` holds its head.
fn content_length(got: &[u8]) -> (usize, usize) {
    let end = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("the head came")
        + 4;
    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("a Content-Length")
        .trim()
        .parse()
        .unwrap();
    (length, end)
}

/// An answer read off its connection a piece at a time.
#[derive(Default)]
struct Answer {
    got: Vec<u8>,
    /// Its whole length, head included, once its head is in.
    expected: Option<usize>,
}

impl Answer {
    /// One read of up to `buf.len()` bytes; the server must go on writing.
    async fn read_some(&mut self, stream: &mut TcpStream, buf: &mut [u8]) {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(buf))
            .await
            .expect("the server goes on writing")
            .unwrap();
        assert!(
            n > 0,
            "the connection was dropped after {} bytes",
            self.got.len()
        );
        self.got.extend_from_slice(&buf[..n]);
        if self.expected.is_none() && self.got.windows(4).any(|w| w == b"\r\n\r\n") {
            let (length, start) = content_length(&self.got);
            self.expected = Some(start + length);
        }
    }

    fn complete(&self) -> bool {
        matches!(self.expected, Some(whole) if self.got.len() >= whole)
    }
}

async fn metrics_text(server: &Server) -> String {
    get_text(server, "/metrics").await
}

async fn wait_answered(server: &Server) {
    for _ in 0..1000 {
        if server.batcher.metrics().requests_ok >= 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the request was never answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_its_client_never_reads_drops_the_connection_at_the_client_timeout() {
    let server = Server::start(args()).await;
    let mut stream = ask_for_a_large_answer(&server).await;
    wait_answered(&server).await;
    let answered = Instant::now();
    // Not a byte read until well past the timeout: by then the server has
    // dropped the connection, and what it had written into the sockets'
    // buffers before it stalled is all there is, then the end.
    tokio::time::sleep(Duration::from_secs(CLIENT_TIMEOUT_SECS + 3)).await;
    let (got, closed) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    assert!(closed, "the connection was kept: {} bytes read", got.len());
    let (length, body_start) = content_length(&got);
    assert!(
        got.len() - body_start < length,
        "the whole answer ({length} bytes) came: the server never stalled"
    );
    assert!(
        answered.elapsed() < Duration::from_secs(CLIENT_TIMEOUT_SECS + 5 + 10),
        "{:?}",
        answered.elapsed()
    );
    // The server goes on, and counts the answer as made (200) and dropped.
    let health = client().get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let metrics = metrics_text(&server).await;
    assert!(
        metrics.contains("mlx_embed_http_answers_dropped_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("mlx_embed_http_requests_total{route=\"/embed_all\",code=\"200\"} 1\n"),
        "{metrics}"
    );
    server
        .stop()
        .await
        .expect("a clean stop: the dropped connection holds nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_with_pauses_shorter_than_the_timeout_gets_its_whole_answer() {
    let server = Server::start(args()).await;
    let mut stream = ask_for_a_large_answer(&server).await;
    wait_answered(&server).await;
    // Pauses of a third of the timeout (slack for a loaded CI machine), each
    // followed by a burst of reading: the server waits on this client longer
    // than the timeout in all, but never that long at once.
    let pause = Duration::from_millis(CLIENT_TIMEOUT_SECS * 1000 / 3);
    let mut answer = Answer::default();
    let mut buf = vec![0u8; 1 << 16];
    let mut paused = Duration::ZERO;
    while !answer.complete() {
        tokio::time::sleep(pause).await;
        paused += pause;
        let burst = answer.got.len() + (1 << 20);
        while answer.got.len() < burst.min(answer.expected.unwrap_or(usize::MAX)) {
            answer.read_some(&mut stream, &mut buf).await;
        }
    }
    let got = answer.got;
    assert_eq!(Some(got.len()), answer.expected);
    assert!(
        paused > Duration::from_secs(CLIENT_TIMEOUT_SECS),
        "the answer never stalled for long in all: {paused:?}"
    );
    let (_, start) = content_length(&got);
    let rows: Vec<Vec<Vec<f32>>> = serde_json::from_slice(&got[start..]).unwrap();
    assert_eq!(rows.len(), INPUTS);
    assert!(
        rows.iter().all(|r| r.len() == MAX_TOKENS),
        "rows of 64 tokens"
    );
    assert!(rows.iter().flatten().all(|t| t.len() == TOKEN_WIDTH));
    let metrics = metrics_text(&server).await;
    assert!(
        metrics.contains("mlx_embed_http_answers_dropped_total 0\n"),
        "{metrics}"
    );
    server.stop().await.unwrap();
}

/// A client that reads steadily but slowly, never pausing: the kernel lets
/// the server's next write through only once a good part of a grown send
/// buffer has drained, which at this pace takes longer than the timeout;
/// what the client took meanwhile counts as progress, so it gets the whole
/// answer. It was dropped partway, at about 4 MB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_steady_reader_gets_its_whole_answer() {
    let server = Server::start(ServerArgs {
        client_timeout_secs: 1,
        ..test_args()
    })
    .await;
    let mut stream = ask_for_a_large_answer(&server).await;
    wait_answered(&server).await;
    let mut answer = Answer::default();
    let mut buf = vec![0u8; 8192];
    let start = Instant::now();
    while !answer.complete() {
        answer.read_some(&mut stream, &mut buf).await;
        // About 400 KB/s: 8 KB every 20 ms.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(Some(answer.got.len()), answer.expected);
    assert!(
        start.elapsed() > Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    server.stop().await.unwrap();
}

/// The room unread answers may hold, in MiB: far less than the answer
/// [`ask_for_a_large_answer`] asks for.
const ROOM_MB: usize = 1;

/// A request sent on its own; its status and JSON answer.
fn post_in_background(
    server: &Server,
    path: &str,
    body: serde_json::Value,
) -> tokio::task::JoinHandle<(u16, serde_json::Value)> {
    let url = server.url(path);
    tokio::spawn(async move {
        let answer = client().post(url).json(&body).send().await.unwrap();
        let status = answer.status().as_u16();
        (status, answer.json().await.unwrap())
    })
}

/// A `/embed_all` request whose answer may be large, told by its texts
/// before they are tokenized: 100 inputs of up to 64 token rows of 8 floats.
fn may_be_large() -> serde_json::Value {
    serde_json::json!({ "inputs": vec!["many words ".repeat(40); 100] })
}

async fn metric(server: &Server, name: &str) -> u64 {
    let text = metrics_text(server).await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

/// Waits until the large answer, made, is counted as it is written (its
/// request is counted answered before its JSON is written out).
async fn wait_counted(server: &Server) {
    wait_answered(server).await;
    for _ in 0..500 {
        if metric(server, "mlx_embed_http_unsent_answer_bytes").await > 5 << 20 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the unread answer was never counted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_wait_while_unread_answers_fill_the_room_and_go_once_the_reader_leaves() {
    let server = Server::start(ServerArgs {
        max_unsent_answers_mb: ROOM_MB,
        ..args()
    })
    .await;
    let stream = ask_for_a_large_answer(&server).await;
    wait_counted(&server).await;

    let waiting = post_in_background(&server, "/embed_all", may_be_large());
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!waiting.is_finished(), "computed while the room was full");
    assert_eq!(
        metric(&server, "mlx_embed_http_requests_waiting_for_answer_room").await,
        1
    );
    // A query's answer is small: it never waits, nor do probes.
    let started = Instant::now();
    let (status, body) =
        post_in_background(&server, "/embed", serde_json::json!({ "inputs": "q" }))
            .await
            .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_close(&floats(&body[0]), &unit_vector(&text("q")));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let health = client().get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    assert_eq!(
        server.batcher.metrics().requests_ok,
        2,
        "the large one waits before the model"
    );

    // The reader leaves without reading: its answer goes, and the waiting
    // request is answered, well before the client timeout would drop it.
    let left = Instant::now();
    drop(stream);
    let (status, body) = tokio::time::timeout(Duration::from_secs(CLIENT_TIMEOUT_SECS), waiting)
        .await
        .expect("answered once the room freed")
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0].as_array().unwrap().len(), MAX_TOKENS, "token rows");
    assert!(left.elapsed() < Duration::from_secs(CLIENT_TIMEOUT_SECS));
    assert_eq!(
        metric(&server, "mlx_embed_http_unsent_answer_bytes").await,
        0
    );
    assert_eq!(
        metric(&server, "mlx_embed_http_requests_waiting_for_answer_room").await,
        0
    );
    server.stop().await.unwrap();
}

/// A server whose answer room an unread answer fills, with a queue wait
/// of 300 ms; the connection that does not read.
async fn a_full_room() -> (Server, TcpStream) {
    let server = Server::start(ServerArgs {
        max_unsent_answers_mb: ROOM_MB,
        max_queue_wait_ms: 300,
        ..args()
    })
    .await;
    let unread = ask_for_a_large_answer(&server).await;
    wait_counted(&server).await;
    (server, unread)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_past_the_queue_wait_for_answer_room_gets_429() {
    let (server, _unread) = a_full_room().await;
    let started = Instant::now();
    let answer = client()
        .post(server.url("/embed_all"))
        .json(&may_be_large())
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 429);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(answer.headers()["retry-after"], "1");
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(body["error_type"], "Overloaded", "{body}");
    let message = body["error"].as_str().unwrap();
    assert!(message.contains("--max-unsent-answers-mb"), "{message}");
    // The client timeout drops the unread answer, and the room is free again.
    tokio::time::sleep(Duration::from_secs(CLIENT_TIMEOUT_SECS + 1)).await;
    assert_eq!(
        metric(&server, "mlx_embed_http_unsent_answer_bytes").await,
        0
    );
    let (status, body) = post_in_background(&server, "/embed_all", may_be_large())
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    server.stop().await.unwrap();
}

/// Cohere answers each vector in every form asked for: room is kept for
/// all of them. 2048 vectors of 8 floats are a small answer as floats
/// (213 KB told), a large one in all six forms (491 KB told).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cohere_keeps_room_for_every_form_it_answers_in() {
    let (server, _unread) = a_full_room().await;
    let texts = vec!["a text"; 2048];
    let floats = serde_json::json!({ "texts": texts, "input_type": "search_document" });
    let (status, body) = post_in_background(&server, "/v2/embed", floats)
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    let every_form = serde_json::json!({
        "texts": texts,
        "input_type": "search_document",
        "embedding_types": ["float", "int8", "uint8", "binary", "ubinary", "base64"],
    });
    let (status, body) = post_in_background(&server, "/v2/embed", every_form)
        .await
        .unwrap();
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["type"], "rate_limit_error", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("--max-unsent-answers-mb"), "{message}");
    server.stop().await.unwrap();
}
