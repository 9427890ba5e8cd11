//! What the server does with clients that are slow, stall or stay idle, over
//! raw TCP: each gets `--client-timeout-secs` to send its headers and its
//! body, an oversized body is refused on its `Content-Length` before it is
//! read, and a stalled body does not hold a drain past its timeout.

mod common;

use std::time::{Duration, Instant};

use common::*;
use mlx_embed_server::ServerArgs;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn args(client_timeout_secs: u64) -> ServerArgs {
    ServerArgs {
        client_timeout_secs,
        ..test_args()
    }
}

async fn connect(server: &Server) -> TcpStream {
    TcpStream::connect(server.base.trim_start_matches("http://"))
        .await
        .unwrap()
}

/// Everything the server sends until it closes the connection (or `limit`
/// passes: then what came so far, and `false`).
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&got).into(), true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&got).into(), false),
        }
    }
}

/// Less than `secs` passed since `start`.
fn assert_within(start: Instant, secs: u64) {
    let passed = start.elapsed();
    assert!(passed < Duration::from_secs(secs), "{passed:?}");
}

const STALLED_BODY: &[u8] =
    b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
Content-Length: 100\r\n\r\n{";

#[tokio::test]
async fn a_body_that_stalls_is_answered_408_at_the_client_timeout() {
    let server = Server::start(args(1)).await;
    let mut stream = connect(&server).await;
    let start = Instant::now();
    stream.write_all(STALLED_BODY).await.unwrap();
    let (answer, closed) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    let waited = start.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert!(
        answer.contains(
            r#""error":"the request body did not arrive within 1 s (--client-timeout-secs)""#
        ) && answer.contains(r#""error_type":"Validation""#),
        "{answer}"
    );
    // Its unread body leaves the connection unusable: it is closed.
    assert!(closed, "{answer}");
    assert!(waited >= Duration::from_millis(950), "{waited:?}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    server.stop().await.unwrap();
}

/// A client that closes its connection in the middle of its body left, as one
/// that leaves while its answer is computed: `/metrics` counts it as 499, not
/// as a malformed request (400), which alerts on client errors would read.
#[tokio::test]
async fn a_body_cut_off_by_its_client_is_counted_as_the_client_leaving() {
    let server = Server::start(args(60)).await;
    // One closes its sending side alone and reads the answer, with the status
    // line nginx logs for it; the other is gone.
    let mut half_closed = connect(&server).await;
    half_closed.write_all(STALLED_BODY).await.unwrap();
    half_closed.shutdown().await.unwrap();
    let (answer, closed) = read_until_closed(&mut half_closed, Duration::from_secs(10)).await;
    assert!(closed, "{answer}");
    assert!(
        answer.starts_with("HTTP/1.1 499 Client Closed Request\r\n"),
        "{answer}"
    );
    let mut gone = connect(&server).await;
    gone.write_all(STALLED_BODY).await.unwrap();
    gone.shutdown().await.unwrap();
    drop(gone);
    let counted =
        |code: &str| format!("mlx_embed_http_requests_total{{route=\"/embed\",code=\"{code}\"}}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let text = client()
            .get(server.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if text.contains(&format!("{} 2", counted("499"))) || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        metrics.contains(&format!("{} 2", counted("499"))),
        "{metrics}"
    );
    assert!(!metrics.contains(&counted("400")), "{metrics}");
    // As for clients that leave while their answer is computed, their time
    // stays out of the answers' latency, so the two counts still add up.
    assert!(
        !metrics.contains("mlx_embed_http_request_duration_seconds_count{route=\"/embed\"}"),
        "{metrics}"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn stalled_headers_and_idle_connections_are_closed_at_the_client_timeout() {
    let server = Server::start(args(1)).await;
    // Half a request line and one header, then nothing.
    let mut partial = connect(&server).await;
    partial
        .write_all(b"POST /embed HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Connected, never a byte.
    let mut silent = connect(&server).await;
    // Half of HTTP/2's preface, then nothing.
    let mut half_preface = connect(&server).await;
    half_preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    // One answered request, then an idle keep-alive connection.
    let mut idle = connect(&server).await;
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 12];
    idle.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let start = Instant::now();
    for (name, stream) in [
        ("partial headers", &mut partial),
        ("silent", &mut silent),
        ("half a preface", &mut half_preface),
        ("idle", &mut idle),
    ] {
        let (_, closed) = read_until_closed(stream, Duration::from_secs(10)).await;
        assert!(closed, "{name} connection left open");
    }
    assert_within(start, 5);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_oversized_content_length_is_refused_before_the_body_is_sent() {
    let server = Server::start(args(60)).await;
    let mut stream = connect(&server).await;
    let start = Instant::now();
    stream
        .write_all(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
Content-Length: 999999999\r\nExpect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(2)).await;
    // No `100 Continue` invites the body: the refusal comes first.
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert!(
        answer
            .contains("request body is larger than the limit of 2097152 bytes (--max-body-bytes)"),
        "{answer}"
    );
    assert_within(start, 2);
    // A body within the limit still goes through on the same server.
    let ok = client()
        .post(server.url("/embed"))
        .json(&serde_json::json!({"inputs": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_oversized_body_sent_whole_is_read_away_so_its_client_reads_the_413() {
    let server = Server::start(args(60)).await;
    // As Python's http.client does: the whole body (24 MB, more than socket
    // buffers hold), then read.
    let mut stream = connect(&server).await;
    let body = vec![b' '; 24 << 20];
    let head = format!(
        "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
        .write_all(&body)
        .await
        .expect("the server reads the body away");
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    assert!(answer.contains(r#""error_type":"Validation""#), "{answer}");
    // A client that declares a size and sends nothing is answered after a
    // second's pause, not held for the client timeout.
    let mut silent = connect(&server).await;
    let start = Instant::now();
    silent
        .write_all(
            b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
Content-Length: 999999999\r\n\r\n",
        )
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut silent, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert_within(start, 3);
    // A chunked body (no size declared) is cut at the limit, the rest unread:
    // its answer says the connection closes too.
    let mut chunked = connect(&server).await;
    let limit = test_args().max_body_bytes;
    let chunk = vec![b' '; limit / 2 + 1];
    let mut request = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
Transfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    for _ in 0..2 {
        request.extend(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend(&chunk);
        request.extend(b"\r\n");
    }
    request.extend(b"0\r\n\r\n");
    chunked.write_all(&request).await.unwrap();
    let (answer, _) = read_until_closed(&mut chunked, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("connection: close"), "{answer}");
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_stalled_body_does_not_hold_the_drain_past_its_timeout() {
    let server = Server::start(ServerArgs {
        drain_timeout_secs: 1,
        ..args(60)
    })
    .await;
    let mut stream = connect(&server).await;
    stream.write_all(STALLED_BODY).await.unwrap();
    // Let the server take the request before the drain starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    let answer = tokio::spawn(async move {
        read_until_closed(&mut stream, Duration::from_secs(10))
            .await
            .0
    });
    server.stop().await.unwrap();
    let stopped = start.elapsed();
    let answer = answer.await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("server is shutting down"), "{answer}");
    // The drain timeout (1 s), then at most the grace to write the answers.
    assert!(stopped < Duration::from_secs(3), "{stopped:?}");
}

/// Part of a request's headers is no request in progress: at shutdown the
/// connection is closed after a second's grace, not held to the drain
/// timeout (and the stop is a clean one), while a request whose answer is
/// still being computed on another connection after that second is answered.
#[tokio::test]
async fn partial_headers_do_not_hold_the_drain() {
    let server = Server::start(ServerArgs {
        drain_timeout_secs: 10,
        // Three batches of 0.6 s each for the slow request.
        max_batch_size: Some(1),
        ..args(60)
    })
    .await;
    let mut partial = connect(&server).await;
    partial
        .write_all(b"POST /embed HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let slow_url = server.url("/embed");
    let slow = tokio::spawn(async move {
        let r = client()
            .post(slow_url)
            .json(&serde_json::json!({ "inputs": ["slow 1", "slow 2", "slow 3"] }))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    });
    server.wait_in_flight(1).await;
    let start = Instant::now();
    let closed = tokio::spawn(async move {
        let (got, closed) = read_until_closed(&mut partial, Duration::from_secs(15)).await;
        (got, closed, start.elapsed())
    });
    server
        .stop()
        .await
        .expect("a clean stop: no connection dropped open");
    let stopped = start.elapsed();
    let (got, closed, closed_after) = closed.await.unwrap();
    assert!(closed && got.is_empty(), "{got:?}");
    assert!(
        closed_after >= Duration::from_millis(900) && closed_after < Duration::from_secs(3),
        "{closed_after:?}"
    );
    assert!(stopped < Duration::from_secs(4), "{stopped:?}");
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        stopped >= Duration::from_millis(1500),
        "the slow request was waited for: {stopped:?}"
    );
}

#[tokio::test]
async fn a_handler_that_panics_answers_500_in_its_routes_shape_and_the_server_goes_on() {
    use axum::middleware::from_fn_with_state;
    use axum::routing::post;
    use mlx_embed_server::{middleware::observe, AppState};

    let batcher = tokio::task::spawn_blocking(|| start_batcher(Default::default()))
        .await
        .unwrap();
    let state = AppState::new(batcher, &test_args(), Duration::ZERO);
    let app = axum::Router::new()
        .route(
            "/v1/embeddings",
            post(|| async {
                if true {
                    panic!("a bug in a handler");
                }
                "unreachable"
            }),
        )
        .route("/embed", post(|| async { "fine" }))
        .layer(from_fn_with_state(state.clone(), observe))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let client = client();
    let panicked = client
        .post(format!("{base}/v1/embeddings"))
        .send()
        .await
        .unwrap();
    assert_eq!(panicked.status(), 500);
    let body: serde_json::Value = panicked.json().await.unwrap();
    assert_eq!(
        body,
        serde_json::json!({"error": {
            "message": "internal server error: the server failed on this request",
            "type": "server_error", "param": null, "code": null},
            "detail": "internal server error: the server failed on this request"})
    );
    let fine = client.post(format!("{base}/embed")).send().await.unwrap();
    assert_eq!(fine.text().await.unwrap(), "fine");
    let metrics = mlx_embed_server::metrics::render(&state, None);
    assert!(
        metrics.contains(r#"route="/v1/embeddings",code="500"} 1"#),
        "{metrics}"
    );
    server.abort();
}

/// One answer off a kept-alive connection: its head and body, read by its
/// `Content-Length`.
async fn read_answer(stream: &mut TcpStream) -> (String, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if got.len() >= end + 4 + length {
                let body = String::from_utf8_lossy(&got[end + 4..end + 4 + length]).into();
                return (head, body);
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("an answer within 10 s")
            .unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
}

/// A request refused on its headers alone, its body arriving a moment
/// later (as from a client that writes headers and body apart): the body is
/// read away, so the connection stays usable for the next request, as it is
/// after a refusal of the body itself. hyper closed it, unannounced, and a
/// pooled client's next request failed.
#[tokio::test]
async fn a_refusal_before_the_body_is_read_keeps_the_connection_usable() {
    let server = Server::start(ServerArgs {
        api_key: Some("k".into()),
        ..args(5)
    })
    .await;
    let body = r#"{"inputs":"x"}"#;
    let key = "Authorization: Bearer k\r\n";
    let refusals = [
        (
            format!("{key}Content-Type: application/json\r\nX-Priority: urgent\r\n"),
            "/embed",
            "400",
        ),
        (
            format!("{key}Content-Type: text/plain\r\n"),
            "/embed",
            "415",
        ),
        (
            format!("{key}Content-Type: application/json\r\nContent-Encoding: gzip\r\n"),
            "/embed",
            "415",
        ),
        (
            "Content-Type: application/json\r\n".to_owned(),
            "/embed",
            "401",
        ),
        (
            format!("{key}Content-Type: application/json\r\n"),
            "/no-such-route",
            "404",
        ),
    ];
    for (headers, path, status) in refusals {
        let mut stream = connect(&server).await;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stream.write_all(body.as_bytes()).await.unwrap();
        let (head, _) = read_answer(&mut stream).await;
        assert!(head.starts_with(&format!("http/1.1 {status}")), "{head}");
        assert!(!head.contains("connection: close"), "{head}");
        let next = format!(
            "POST /embed HTTP/1.1\r\nHost: x\r\n{key}Content-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(next.as_bytes()).await.unwrap();
        let (head, answer) = read_answer(&mut stream).await;
        assert!(
            head.starts_with("http/1.1 200"),
            "after a {status}: {head}\n{answer}"
        );
    }
    // A client waiting for `100 Continue` has sent nothing: the refusal
    // closes the connection, and says so.
    let mut stream = connect(&server).await;
    let head = format!(
        "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Expect: 100-continue\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let (answer, closed) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("connection: close") && closed, "{answer}");
    server.stop().await.unwrap();
}

/// A body in a transfer coding other than `chunked` once: 501 in the
/// route's shape, the connection closed (where such a body ends is not
/// something to rely on). hyper decodes the chunks alone: it answered 200
/// to `gzip, chunked` over plain JSON, and a misleading 400 over gzip.
#[tokio::test]
async fn a_body_in_another_transfer_coding_is_refused_501() {
    let server = Server::start(args(5)).await;
    let body = r#"{"inputs":"x"}"#;
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let codings = [
        "Transfer-Encoding: gzip, chunked\r\n",
        "Transfer-Encoding: chunked, chunked\r\n",
        "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
    ];
    for coding in codings {
        let mut stream = connect(&server).await;
        let request = format!(
            "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{coding}\r\n{chunked}"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let (head, answer) = read_answer(&mut stream).await;
        assert!(head.starts_with("http/1.1 501"), "{coding}: {head}");
        assert!(head.contains("connection: close"), "{coding}: {head}");
        let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert!(
            answer["error"]
                .as_str()
                .unwrap()
                .starts_with("request bodies must be sent whole or chunked"),
            "{answer}"
        );
    }
    // Chunked alone, in any case, is read as ever.
    let mut stream = connect(&server).await;
    let request = format!(
        "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: Chunked\r\n\r\n{chunked}"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let (head, answer) = read_answer(&mut stream).await;
    assert!(head.starts_with("http/1.1 200"), "{head}\n{answer}");
    server.stop().await.unwrap();
}

/// Requests hyper cannot read are refused before any route sees them
/// (tests/e2e/test_http1_heads_e2e.py checks the answers): they are counted
/// apart, so a proxy sending them shows.
#[tokio::test]
async fn requests_hyper_cannot_read_are_counted() {
    let server = Server::start(args(5)).await;
    let malformed = [
        "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\n{}}",
        "GET /health HTTP/1.1\r\nHost : x\r\n\r\n",
        // Not quite HTTP/2's preface: an HTTP/1 request with a wrong version.
        "PRI * HTTP/2.0\r\n\r\nXY\r\n\r\n",
    ];
    for request in malformed {
        let mut stream = connect(&server).await;
        stream.write_all(request.as_bytes()).await.unwrap();
        let (_, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
        assert!(closed, "{request:?}");
    }
    let mut stream = connect(&server).await;
    let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
    stream.write_all(long_uri.as_bytes()).await.unwrap();
    let (answer, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(closed && answer.starts_with("HTTP/1.1 414"), "{answer}");

    let metrics = get_text(&server, "/metrics").await;
    for counted in [
        "mlx_embed_http_unreadable_requests_total{reason=\"malformed\"} 3\n",
        "mlx_embed_http_unreadable_requests_total{reason=\"too_large\"} 1\n",
    ] {
        assert!(metrics.contains(counted), "{counted} in {metrics}");
    }
    server.stop().await.unwrap();
}

/// An HTTP/2 connection (prior knowledge) with no stream open is sent a
/// GOAWAY and closed at the client timeout, as an idle HTTP/1 one is
/// closed; its pings are answered, so it is its idleness that closes it.
#[tokio::test]
async fn an_idle_http2_connection_is_sent_a_goaway_at_the_client_timeout() {
    const PING: u8 = 6;
    const GOAWAY: u8 = 7;
    let server = Server::start(args(1)).await;
    let mut stream = connect(&server).await;
    // The preface, then an empty SETTINGS frame.
    stream
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (mut got, mut frame_types) = (Vec::new(), Vec::new());
    let mut buf = [0u8; 4096];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => n,
            Ok(_) => break,
            Err(_) => panic!("still open after 10 s: frames {frame_types:?}"),
        };
        got.extend_from_slice(&buf[..n]);
        // Whole frames: a 9-byte header (24-bit length, type, flags, stream).
        while got.len() >= 9 {
            let len = usize::from(got[0]) << 16 | usize::from(got[1]) << 8 | usize::from(got[2]);
            if got.len() < 9 + len {
                break;
            }
            let frame: Vec<u8> = got.drain(..9 + len).collect();
            frame_types.push(frame[3]);
            if frame[3] == PING && frame[4] & 1 == 0 {
                let mut ack = frame.clone();
                ack[4] = 1;
                let _ = stream.write_all(&ack).await;
            }
        }
    }
    assert!(frame_types.contains(&GOAWAY), "frames {frame_types:?}");
    assert_within(start, 5);
    server.stop().await.unwrap();
}

/// A keep-alive connection answered once, its answer read, its client then
/// silent (a pool that notices a close only when it next uses the
/// connection).
async fn idle_connection(server: &Server) -> TcpStream {
    let mut stream = connect(server).await;
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_answer(&mut stream).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    stream
}

/// At a shutdown idle connections whose clients stay silent are closed
/// after their quarter second's wait for a next request (all at once, not
/// one after another), and read a quarter second more for one crossing the
/// close: the exit is not held the second a client's paused upload gets.
/// Each client sees its connection end (EOF).
#[tokio::test]
async fn silent_idle_connections_do_not_hold_the_exit_a_second() {
    let server = Server::start(args(60)).await;
    let mut streams = Vec::new();
    for _ in 0..20 {
        streams.push(idle_connection(&server).await);
    }
    let start = Instant::now();
    server.stop().await.expect("a clean stop");
    let stopped = start.elapsed();
    assert!(
        stopped >= Duration::from_millis(250) && stopped < Duration::from_millis(1000),
        "{stopped:?}"
    );
    for stream in &mut streams {
        let mut buf = [0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("closed")
            .expect("an end, not a reset");
        assert_eq!(n, 0);
    }
}

/// A client that, once its idle connection is closed at a shutdown, sends a
/// byte every 100 ms (never the pause that ends a linger) is read away for
/// a few seconds, not until the drain timeout: the exit waits for every
/// connection's task, and the stop is a clean one.
#[tokio::test]
async fn a_client_trickling_into_a_closed_connection_does_not_hold_the_exit() {
    let server = Server::start(ServerArgs {
        drain_timeout_secs: 12,
        ..args(60)
    })
    .await;
    let stream = idle_connection(&server).await;
    let (mut rd, mut wr) = stream.into_split();
    let trickle = tokio::spawn(async move {
        let mut buf = [0u8; 16];
        // The server's close (its FIN) first: only then is it a linger.
        let n = tokio::time::timeout(Duration::from_secs(5), rd.read(&mut buf))
            .await
            .expect("closed")
            .expect("an end, not a reset");
        assert_eq!(n, 0);
        let mut sent = 0;
        for _ in 0..300 {
            if wr.write_all(b"x").await.is_err() {
                break;
            }
            sent += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        sent
    });
    let start = Instant::now();
    server.stop().await.expect("a clean stop");
    let stopped = start.elapsed();
    // Five seconds of linger after the quarter second's wait.
    assert!(
        stopped >= Duration::from_secs(5) && stopped < Duration::from_secs(8),
        "{stopped:?}"
    );
    let sent = tokio::time::timeout(Duration::from_secs(60), trickle)
        .await
        .expect("the trickle ends once the server has gone")
        .unwrap();
    assert!(sent < 300, "{sent}");
}
