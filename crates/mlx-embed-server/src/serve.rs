//! Start-up (warm-up, bind, summary), serving, and graceful shutdown.

use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::Router;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use mlx_embed_core::{Batcher, CoreError, EmbedInput, EmbedOptions, ModelKind, Output, Side};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;

use crate::config::ServerArgs;
use crate::errors::{LogSafe, ServerError};
use crate::routes::router;
use crate::shutdown::Trigger;
use crate::state::AppState;

/// Warms up, binds `--host:--port` (and `--grpc-port`, TEI's gRPC API, when
/// set), logs the start-up summary, serves until
/// SIGINT/SIGTERM/SIGHUP, then drains: `/health` turns 503, no new connections are
/// accepted, accepted requests are answered, the batcher is closed and drained,
/// all within `--drain-timeout-secs` (requests still waiting for a model then
/// are answered 503; a second signal stops waiting). Returns
/// `Ok(())` after a shutdown in which every connection was done, and
/// [`ServerError::Forced`] when connections still open were dropped (a
/// second signal, or connections that outlasted the drain timeout).
pub async fn serve(
    args: ServerArgs,
    batcher: Batcher,
    load_duration: Duration,
) -> Result<(), ServerError> {
    serve_models(args, vec![batcher], load_duration).await
}

/// [`serve`] for several models, each with its own batcher (queue and model
/// thread); requests pick one by name ([`crate::models`]), the first is the
/// default. `load_duration` is how long loading them all took.
pub async fn serve_models(
    args: ServerArgs,
    batchers: Vec<Batcher>,
    load_duration: Duration,
) -> Result<(), ServerError> {
    let trigger = Trigger::from_signals().map_err(ServerError::Signal)?;
    serve_models_with(args, batchers, load_duration, trigger).await
}

/// [`serve_models`] shutting down on `trigger`'s requests: a launcher's
/// [`Trigger::from_signals`], made before its models loaded, so a signal
/// then already counts (the server drains at once, having nothing to answer).
pub async fn serve_models_with(
    args: ServerArgs,
    batchers: Vec<Batcher>,
    load_duration: Duration,
    trigger: Trigger,
) -> Result<(), ServerError> {
    check(&args, &batchers)?;
    warm_up_if_enabled(&args, &batchers, load_duration).await?;
    let listener = bind(&args.host, args.port, "http").await?;
    let grpc = crate::grpc::bind(&args).await?;
    run(listener, grpc, args, batchers, load_duration, trigger).await
}

/// Binds `host:port`, the HTTP listener's or the gRPC one's (`scheme`).
/// With port 0 the port picked is known nowhere else when the log filter
/// hides the start-up line, so `listening on {scheme}://{addr}` goes to
/// stdout whatever the filter.
pub(crate) async fn bind(host: &str, port: u16, scheme: &str) -> Result<TcpListener, ServerError> {
    let addr = format!("{host}:{port}");
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    if port == 0 {
        if let Ok(bound) = listener.local_addr() {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "listening on {scheme}://{bound}");
            let _ = out.flush();
        }
    }
    Ok(listener)
}

/// Like [`serve`] on an already bound `listener` (its address wins over
/// `--host/--port`), shutting down when `shutdown` completes instead of on signals.
/// For tests and embedders.
pub async fn serve_on(
    listener: TcpListener,
    args: ServerArgs,
    batcher: Batcher,
    load_duration: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let batchers = vec![batcher];
    check(&args, &batchers)?;
    warm_up_if_enabled(&args, &batchers, load_duration).await?;
    let grpc = crate::grpc::bind(&args).await?;
    run(
        listener,
        grpc,
        args,
        batchers,
        load_duration,
        Trigger::from_future(shutdown),
    )
    .await
}

fn check(args: &ServerArgs, batchers: &[Batcher]) -> Result<(), ServerError> {
    args.check().map_err(ServerError::Config)?;
    let max_batch_size = batchers
        .iter()
        .map(|b| b.config().max_batch_size)
        .min()
        .unwrap_or(usize::MAX);
    for warning in args.warnings(max_batch_size) {
        tracing::warn!("{warning}");
    }
    // Named in every request that says nothing, a prompt a model lacks
    // would make each of them a 400: refused once, here.
    if let Some(name) = &args.default_prompt_name {
        for batcher in batchers {
            let info = batcher.model_info();
            if info.kind == mlx_embed_core::ModelKind::Embedding && !info.prompts.contains_key(name)
            {
                let known: Vec<&str> = info.prompts.keys().map(String::as_str).collect();
                return Err(ServerError::Config(format!(
                    "--default-prompt-name {name:?}: {} has no prompt of that name (its prompts: \
                     {})",
                    info.name,
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                )));
            }
        }
    }
    Ok(())
}

async fn warm_up_if_enabled(
    args: &ServerArgs,
    batchers: &[Batcher],
    load: Duration,
) -> Result<(), ServerError> {
    if args.no_warmup {
        tracing::info!(
            load_ms = load.as_millis() as u64,
            "warm-up skipped (--no-warmup)"
        );
        return Ok(());
    }
    let mut warm = Duration::ZERO;
    for batcher in batchers {
        warm += warm_up(batcher).await.map_err(ServerError::Warmup)?;
        // /metrics counts clients' work: the warm-up call is the server's,
        // and so is its vector, which no client asked the cache to keep.
        batcher.reset_metrics();
        batcher.clear_cache();
    }
    tracing::info!(
        load_ms = load.as_millis() as u64,
        warmup_ms = warm.as_millis() as u64,
        cold_start_ms = (load + warm).as_millis() as u64,
        "model warm: cold start {:.2}s (load {:.2}s + warm-up {:.2}s)",
        (load + warm).as_secs_f64(),
        load.as_secs_f64(),
        warm.as_secs_f64(),
    );
    Ok(())
}

/// The warm-up input's length in words: the model's maximum in tokens, up
/// to this many. A maximum-length input of a long-context model costs
/// minutes on a CPU (jina-embeddings-v2-base at 8,192 tokens: 251 s on 2
/// cores; Qwen3-Embedding allows 32,768) and proves nothing a 512-token one
/// does not.
const WARMUP_MAX_WORDS: usize = 512;

/// After the drain timeout, how long the requests it answered 503 get to
/// have their answers written before their connections are dropped.
const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// Embeds (or, for a cross-encoder, scores as a query/document pair) one
/// input of the model's maximum length, up to [`WARMUP_MAX_WORDS`]: proof
/// that the model runs end to end before `/health` says so (a ColBERT
/// model's as a document). A full batch
/// (64 x 256 tokens) cost most of a 3.15 s cold start on a 2-core CPU and
/// proved nothing more: the engine cuts every call into device passes of a
/// bounded token budget anyway.
async fn warm_up(batcher: &Batcher) -> Result<Duration, CoreError> {
    let info = batcher.model_info();
    let text = warm_up_text(info.max_input_tokens);
    let input = match info.kind {
        ModelKind::Embedding => EmbedInput::Text(text),
        ModelKind::Classifier { .. } | ModelKind::Reranker { .. } => EmbedInput::Pair {
            query: "warmup".into(),
            document: text,
        },
    };
    // A ColBERT model refuses a pooled vector: it is warmed up on its
    // document rows, as /v1/multi-vector runs it.
    let options = EmbedOptions {
        output: match info.multi_vector {
            Some(_) => Output::MultiVector(Side::Document),
            None => Output::Pooled,
        },
        ..EmbedOptions::default()
    };
    let start = Instant::now();
    batcher.embed(vec![input], options).await?;
    Ok(start.elapsed())
}

/// At least one token per word, so a model whose maximum is under
/// [`WARMUP_MAX_WORDS`] gets an input truncated to exactly its maximum.
fn warm_up_text(max_input_tokens: usize) -> String {
    "warmup ".repeat(max_input_tokens.clamp(1, WARMUP_MAX_WORDS))
}

fn log_summary(state: &AppState, addr: Option<SocketAddr>) {
    for served in &state.models()[1..] {
        let m = served.info();
        tracing::info!(
            model = served.name.as_str(),
            kind = m.kind.as_str(),
            dim = m.dim,
            max_input_tokens = m.max_input_tokens,
            "also serving {} ({}, max {} tokens): requests pick it with \"model\": {:?}",
            served.name,
            m.kind.as_str(),
            m.max_input_tokens,
            served.name,
        );
    }
    let m = state.model_info();
    let c = state.batcher().config();
    let mut details = String::new();
    for (k, v) in &m.shown_details() {
        let _ = write!(
            details,
            "{}{k}={v}",
            if details.is_empty() { "" } else { ", " }
        );
    }
    let a = state.args();
    tracing::info!(
        model = state.model_name(),
        dim = m.dim,
        max_input_tokens = m.max_input_tokens,
        details = %details,
        batching = c.enable_batching,
        max_batch_size = c.max_batch_size,
        max_batch_tokens = c.max_batch_tokens,
        device_batch_tokens = m.device_batch_tokens,
        batch_window_ms = c.batch_window.as_millis() as u64,
        regroup_window_ms = c.regroup_window.as_millis() as u64,
        max_concurrent_requests = c.max_concurrent_requests,
        max_waiting = c.max_waiting,
        max_queue_wait_ms = c.max_queue_wait.as_millis() as u64,
        model_threads = c.model_threads,
        query_threads = state.batcher().query_threads(),
        max_priority_batch_size = c.max_priority_batch_size,
        cache_bytes = c.cache_bytes,
        max_body_bytes = a.max_body_bytes,
        max_inputs_per_request = a.max_inputs_per_request,
        client_timeout_secs = a.client_timeout_secs,
        max_unsent_answers_mb = a.max_unsent_answers_mb,
        auth = a.api_key.is_some(),
        cors_allow_origin = ?a.cors_allow_origin,
        allowed_hosts = ?a.allowed_hosts,
        "serving {} (dim {}, max {} tokens) on http://{}",
        state.model_name(),
        m.dim,
        m.max_input_tokens,
        addr.map_or_else(|| "?".to_owned(), |a| a.to_string()),
    );
}

/// `grpc`: the `--grpc-port` listener, served beside the HTTP one and
/// drained with it.
async fn run(
    listener: TcpListener,
    grpc: Option<TcpListener>,
    args: ServerArgs,
    batchers: Vec<Batcher>,
    load_duration: Duration,
    trigger: Trigger,
) -> Result<(), ServerError> {
    let state = AppState::with_models(batchers.clone(), &args, load_duration)?;
    log_summary(&state, listener.local_addr().ok());

    let mut graceful = trigger.clone();
    let draining = state.clone();
    let http = serve_connections(
        listener,
        router(state.clone()),
        state.clone(),
        args.client_timeout(),
        async move {
            graceful.reached(1).await;
            draining.begin_shutdown();
        },
    );
    // Bound here, not before the warm-up: a scraper reaches it no earlier
    // than clients reach the main port.
    let prometheus = match args.prometheus_port {
        Some(port) => Some(bind(&args.host, port, "metrics").await?),
        None => None,
    };
    let mut metrics_stop = trigger.clone();
    let metrics = async {
        if let Some(listener) = prometheus {
            serve_connections(
                listener,
                crate::routes::metrics_router(state.clone()),
                state.clone(),
                args.client_timeout(),
                async move {
                    metrics_stop.reached(1).await;
                },
            )
            .await;
        }
    };
    let mut grpc_stop = trigger.clone();
    let grpc = async {
        if let Some(listener) = grpc {
            crate::grpc::serve(listener, state.clone(), async move {
                grpc_stop.reached(1).await;
            })
            .await;
        }
    };
    // Every listener closes on the first shutdown request and are done when
    // their last calls are.
    let server = async {
        tokio::join!(http, grpc, metrics);
    };
    let mut server = std::pin::pin!(server);
    let mut trigger = trigger;

    // Serve until the first shutdown request. The server also watches it, so it
    // may finish first: then it must not be polled again.
    let mut connections_closed = false;
    tokio::select! {
        () = &mut server => connections_closed = true,
        _ = trigger.reached(1) => {}
    }
    state.begin_shutdown();
    tracing::info!(
        drain_timeout_secs = args.drain_timeout_secs,
        "shutting down: no new connections; answering accepted requests"
    );
    let deadline = tokio::time::Instant::now() + args.drain_timeout();
    // Why connections were dropped open, if they were: the exit then says so.
    let mut forced = None;
    const SECOND_SIGNAL: &str = "second signal: not waiting for open connections";
    const OUTLASTED: &str = "connections still open after the drain timeout are dropped";
    if !connections_closed {
        tokio::select! {
            () = &mut server => {}
            _ = tokio::time::sleep_until(deadline) => {
                tracing::warn!(
                    "drain timeout: connections still open; requests still waiting for a model \
                     or a body are answered 503"
                );
                state.end_drain();
                tokio::select! {
                    () = &mut server => {}
                    _ = tokio::time::sleep(ANSWER_GRACE) => forced = Some(OUTLASTED),
                    _ = trigger.reached(2) => forced = Some(SECOND_SIGNAL),
                }
            }
            _ = trigger.reached(2) => forced = Some(SECOND_SIGNAL),
        }
    }
    if let Some(why) = forced {
        state.abandon_open_connections();
        tracing::warn!("{why}");
    }
    batchers.iter().for_each(Batcher::close);
    let drained = async {
        for batcher in &batchers {
            batcher.drained().await;
        }
    };
    tokio::select! {
        // The deadline may have passed already (open connections held the
        // drain): a batcher that is done still counts as done.
        biased;
        _ = drained => {}
        _ = tokio::time::sleep_until(deadline) => tracing::warn!("drain timeout: batcher still busy"),
        _ = trigger.reached(2) => tracing::warn!("second signal: not waiting for the batcher"),
    }
    match forced {
        Some(why) => Err(ServerError::Forced(why)),
        None => {
            tracing::info!("shut down");
            Ok(())
        }
    }
}

/// After a shutdown begins, how long a connection with no request in
/// progress is kept before it is closed: one that was sending a request's
/// headers has this long to finish them. hyper closes an idle connection at
/// once, but one with part of a request's headers only when they end or at
/// `--client-timeout-secs`, so one such connection held the drain to its
/// timeout and made the exit a forced one.
const HEADERS_GRACE: Duration = Duration::from_secs(1);

/// After a shutdown begins, how long an idle HTTP/1 connection waits for
/// its client's next request to start coming before it is closed: a
/// request sent right behind the last answer arrives within a round trip.
/// Past it the connection is closed in stages ([`close_http1`]): a request
/// that crosses the close is read away and its client sees the connection
/// end (EOF), not a reset.
const IDLE_GRACE: Duration = Duration::from_millis(250);

/// The longest a connection closed with the client still sending is read
/// away before it is dropped ([`WriteWatched::linger`]); within it, a pause
/// of [`HEADERS_GRACE`] ends it too. (nginx's `lingering_time` is 30 s.)
const LINGER_LIMIT: Duration = Duration::from_secs(30);

/// [`LINGER_LIMIT`] once a shutdown has begun: every connection's task is
/// waited for before the exit, so a client that trickles a byte a second
/// into a closed connection would otherwise hold the exit to the drain
/// timeout (and make it one). (nginx's `lingering_timeout` is 5 s.)
const SHUTDOWN_LINGER_LIMIT: Duration = Duration::from_secs(5);

/// The most a request's head may take: over HTTP/1 its request line and
/// header lines, their line ends and the blank line after them included
/// (hyper's default buffer, named so HTTP/2 gets the same; past it 431),
/// over HTTP/2 its header list as decoded (`SETTINGS_MAX_HEADER_LIST_SIZE`).
/// Held exactly: hyper's buffer bound alone let a head that arrived in one
/// piece run past it by one read (a 500 KB header was answered 200).
const MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;

/// The most header lines an HTTP/1 request may have (hyper's default, named
/// so the 431 that refuses more can say it).
const MAX_HEADERS: usize = 100;

/// The longest HTTP/1 request target hyper takes (its `MAX_URI_LEN`, which
/// has no setting); past it 414.
const MAX_URI_BYTES: usize = u16::MAX as usize - 1;

/// Streams one HTTP/2 connection may have open at once (hyper's default,
/// named so it cannot change under us). Admission is per server, not per
/// connection (`--max-concurrent-requests`, `--max-waiting`, the answer
/// room): a stream is admitted as a request on an HTTP/1 connection of its
/// own would be, so this bounds what one client holds in hyper, not how
/// much it gets computed.
const H2_MAX_STREAMS: u32 = 200;

/// Streams an HTTP/2 client may reset before hyper has taken them, after
/// which its connection gets a GOAWAY `ENHANCE_YOUR_CALM`: the "rapid
/// reset" flood (CVE-2023-44487), thousands of streams opened and reset at
/// once, each costing the server its setup and the client nothing. h2's
/// default, named so it cannot change under us (tests/e2e/test_http2.py).
const H2_MAX_PENDING_RESETS: usize = 20;

/// Streams of one connection that the server may reset for the client's
/// protocol errors before the connection is closed: the "MadeYouReset"
/// variant of the flood (CVE-2025-8671). hyper's default, named likewise.
const H2_MAX_ERROR_RESETS: usize = 1024;

/// What an HTTP/2 client with prior knowledge opens with (RFC 9113, 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The protocol a connection's first bytes name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// Reads a connection's first bytes, until they are the HTTP/2 preface or
/// differ from it (at once for HTTP/1: its first byte differs unless it is
/// a `P`): the protocol. The bytes read are left in `first` (as they come,
/// so a caller that stops waiting knows whether any did), for its parser to
/// read again. hyper_util's `auto` builder tells the two the same way but
/// sets no deadline on it, so a client that connected and sent nothing was
/// held forever: the caller sets one.
async fn sniff(stream: &tokio::net::TcpStream, first: &mut Vec<u8>) -> std::io::Result<Protocol> {
    let mut buf = [0u8; H2_PREFACE.len()];
    while first.len() < H2_PREFACE.len() {
        stream.readable().await?;
        let n = match stream.try_read(&mut buf[..H2_PREFACE.len() - first.len()]) {
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(err) => return Err(err),
        };
        first.extend_from_slice(&buf[..n]);
        if n == 0 || !H2_PREFACE.starts_with(first) {
            return Ok(Protocol::Http1);
        }
    }
    Ok(Protocol::Http2)
}

/// Both protocols' settings, made once.
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

impl Protocols {
    /// HTTP/2 gets HTTP/1's bounds: the head limit, and `client_timeout`
    /// for a peer that stops answering pings as for one that stops sending
    /// headers. Its windows stay hyper's (1 MiB a stream and a connection):
    /// they bound what a client may send unread, and `--max-body-bytes` is
    /// held by the body's reader whatever the protocol.
    fn new(client_timeout: Duration) -> Self {
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(client_timeout)
            .max_buf_size(MAX_HEAD_BYTES)
            .max_header_size(MAX_HEAD_BYTES)
            .max_headers(MAX_HEADERS);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .max_concurrent_streams(H2_MAX_STREAMS)
            .max_pending_accept_reset_streams(H2_MAX_PENDING_RESETS)
            .max_local_error_reset_streams(H2_MAX_ERROR_RESETS)
            .max_header_list_size(u32::try_from(MAX_HEAD_BYTES).unwrap_or(u32::MAX))
            .keep_alive_interval(client_timeout)
            .keep_alive_timeout(client_timeout);
        Self { http1, http2 }
    }
}

/// Serves `app` on every connection `listener` accepts until `stop`
/// completes, then closes the listener and waits for the open connections to
/// finish their requests (idle ones close within [`IDLE_GRACE`], and ones with no request
/// in progress after [`HEADERS_GRACE`]: part of a request's headers). A
/// connection speaks HTTP/1.1, or HTTP/2 when it opens with its preface
/// (prior knowledge, as gRPC clients and h2c proxies do; `Upgrade: h2c` is
/// not taken: the request is answered over HTTP/1.1). Each connection gets
/// `client_timeout` to send a request's headers, counted from when it
/// connects or its last response was sent: a client that stalls, or keeps an
/// idle connection open, is dropped rather than held forever (an idle HTTP/2
/// one is sent a GOAWAY; bodies have their own deadline, in
/// [`crate::extract`]); so is one whose answer could not be written for
/// `client_timeout`, its client not reading ([`WriteWatched`]).
async fn serve_connections(
    listener: TcpListener,
    app: Router,
    state: AppState,
    client_timeout: Duration,
    stop: impl Future<Output = ()>,
) {
    let protocols = Arc::new(Protocols::new(client_timeout));
    // Each connection holds a receiver until it ends: the sender's
    // `closed` is when the last one has.
    let (stopped_tx, stopped) = tokio::sync::watch::channel(false);
    let mut stop = std::pin::pin!(stop);
    while let Some(stream) = accept_until(&listener, &mut stop).await {
        let tracked = Tracked::new(app.clone(), state.clone());
        let mut stopped = stopped.clone();
        let state = state.clone();
        let protocols = protocols.clone();
        tokio::spawn(async move {
            let mut first = Vec::new();
            let sniffed = tokio::select! {
                sniffed = tokio::time::timeout(client_timeout, sniff(&stream, &mut first)) => Some(sniffed),
                () = stopping(&mut stopped) => None,
            };
            let sniffed = match sniffed {
                Some(sniffed) => sniffed,
                // A connection that has sent nothing is idle: closed at
                // once, as hyper closes an idle one; part of a preface, or
                // a request already in the socket's buffer, gets what part
                // of a request's headers gets.
                None if first.is_empty() && !received(&stream) => return,
                None => tokio::time::timeout(HEADERS_GRACE, sniff(&stream, &mut first)).await,
            };
            let Ok(Ok(protocol)) = sniffed else {
                tracing::debug!("closed a connection that sent no request");
                return;
            };
            let activity = tracked.activity.clone();
            #[cfg(unix)]
            let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
            activity.taken.store(first.len(), Ordering::Release);
            let stream = WriteWatched::new(stream, client_timeout, state.clone(), activity.clone())
                .replaying(first)
                .holding_unowed(protocol == Protocol::Http1);
            let blocked = stream.blocked.clone();
            let io = TokioIo::new(stream);
            let service = TowerToHyperService::new(tracked);
            let watched = Watched {
                state: &state,
                activity: &activity,
                blocked: &blocked,
                #[cfg(unix)]
                fd,
            };
            match protocol {
                Protocol::Http1 => {
                    let mut connection = Http1(protocols.http1.serve_connection(io, service));
                    let ended = watched
                        .drive(Pin::new(&mut connection), None, &mut stopped)
                        .await;
                    if let Some(ended) = ended {
                        close_http1(connection, ended, &state, &activity).await;
                    }
                }
                Protocol::Http2 => {
                    let connection = std::pin::pin!(protocols.http2.serve_connection(io, service));
                    let ended = watched
                        .drive(connection, Some(client_timeout), &mut stopped)
                        .await;
                    if let Some(Err(err)) = ended {
                        connection_failed(&state, &err);
                    }
                }
            }
        });
    }
    drop(listener);
    drop(stopped);
    let _ = stopped_tx.send(true);
    stopped_tx.closed().await;
}

/// What one connection's task watches while hyper serves it.
struct Watched<'a> {
    state: &'a AppState,
    activity: &'a Activity,
    blocked: &'a AtomicBool,
    /// The connection's socket, open while `drive` holds the connection.
    #[cfg(unix)]
    fd: std::os::fd::RawFd,
}

impl Watched<'_> {
    /// Serves `connection` until it ends, or until the server stops or it
    /// has been idle for `idle_after` (HTTP/2's: hyper closes an idle
    /// HTTP/1 connection itself): then it is shut down gracefully (HTTP/2:
    /// a GOAWAY, its open streams answered) and dropped once it has no
    /// request in progress after [`HEADERS_GRACE`]. With `idle_after`, it
    /// is dropped too once an answer has waited that long for hyper to take
    /// it ([`Activity::stalled`]). Returns how the connection ended, or
    /// `None` where it was dropped.
    async fn drive<C: Served>(
        &self,
        mut connection: Pin<&mut C>,
        idle_after: Option<Duration>,
        stopped: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Option<Result<(), hyper::Error>> {
        let why = tokio::select! {
            ended = connection.as_mut() => return Some(ended),
            () = stopping(stopped) => "shutdown",
            () = self.activity.idle(idle_after) => "idle",
            () = self.activity.stalled(idle_after) => {
                self.stalled();
                return None;
            }
        };
        // hyper closes an HTTP/1 connection between requests at once on a
        // graceful shutdown, even one whose next request has arrived (in
        // the socket's buffer, or partly read): that request would be lost
        // unanswered. It is let in first, for up to [`HEADERS_GRACE`]; the
        // shutdown then makes its answer the last (`Connection: close`).
        // An HTTP/2 client is told by the GOAWAY which streams were taken.
        // A request pipelined behind one in progress is not let in: the
        // one in progress is answered `Connection: close` (its client then
        // knows the next was not taken, RFC 9112 9.3.2), and the
        // connection is closed in stages ([`close_http1`]) so the client
        // reads that answer. Letting the next in would need that answer to
        // keep the connection exactly when a next request has come, which
        // cannot be told when its head is written: hyper reads ahead into a
        // buffer of its own, and no answer may keep the connection on a
        // guess (a keep-alive client whose next request crosses the close
        // would lose it unanswered). Nor can the next be refused (a 503):
        // after an answer that says `close`, no further request may be
        // processed (9.6), and its client reads nothing more.
        // An idle connection whose last answer went out just before the
        // signal may have its client's next request on the way (a pipelining
        // client, or a pool that reuses the connection at once): closed at
        // once, that request would meet a reset. It gets [`IDLE_GRACE`] for
        // its first bytes to come; one that begins is let in as above.
        let begun = self.activity.started.load(Ordering::Acquire);
        if why == "shutdown"
            && idle_after.is_none()
            && self.activity.busy.load(Ordering::Acquire) == 0
            && !self.holds_unread_request()
        {
            tokio::select! {
                ended = connection.as_mut() => return Some(ended),
                () = self.next_request_within(begun, IDLE_GRACE) => {}
            }
        }
        if why == "shutdown"
            && idle_after.is_none()
            && self.activity.started.load(Ordering::Acquire) == begun
            && self.holds_unread_request()
        {
            tokio::select! {
                ended = connection.as_mut() => return Some(ended),
                () = self.activity.begun_after(begun) => {}
                () = tokio::time::sleep(HEADERS_GRACE) => {}
            }
        }
        connection.as_mut().graceful_shutdown();
        tokio::select! {
            ended = connection => Some(ended),
            () = unused(self.activity, self.blocked) => {
                tracing::debug!("closed a connection with no request in progress ({why})");
                None
            }
            () = self.activity.stalled(idle_after) => {
                self.stalled();
                None
            }
        }
    }

    /// Completes once a request has begun after `begun` had, bytes of a
    /// next one have come ([`Self::holds_unread_request`]), or `within` has
    /// passed.
    async fn next_request_within(&self, begun: usize, within: Duration) {
        let until = tokio::time::Instant::now() + within;
        while self.activity.started.load(Ordering::Acquire) == begun
            && !self.holds_unread_request()
            && tokio::time::Instant::now() < until
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Whether, with no request in progress, bytes have come that no
    /// request has begun with yet: taken by hyper since its last request
    /// began or ended, or waiting in the socket's buffer.
    fn holds_unread_request(&self) -> bool {
        if self.activity.busy.load(Ordering::Acquire) > 0 {
            return false;
        }
        if self.activity.taken.load(Ordering::Acquire) > 0 {
            return true;
        }
        #[cfg(unix)]
        {
            fd_received(self.fd)
        }
        #[cfg(not(unix))]
        false
    }

    fn stalled(&self) {
        tracing::debug!(
            "dropping an HTTP/2 connection: an answer could not be sent for the client timeout, \
             the client not reading it (--client-timeout-secs)"
        );
        self.state.http_metrics().record_answer_dropped();
    }
}

/// A connection hyper serves, as [`Watched::drive`] drives it.
trait Served: Future<Output = Result<(), hyper::Error>> {
    /// Lets it finish the requests it has begun and take no more.
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<C: GracefulConnection<Error = hyper::Error>> Served for C {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        GracefulConnection::graceful_shutdown(self);
    }
}

/// An HTTP/1 connection that leaves its socket open when it ends, for
/// [`close_http1`] to answer on and close.
struct Http1(http1::Connection<TokioIo<WriteWatched>, TowerToHyperService<Tracked>>);

impl Future for Http1 {
    type Output = Result<(), hyper::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().0.poll_without_shutdown(cx)
    }
}

impl Served for Http1 {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        Pin::new(&mut self.get_mut().0).graceful_shutdown();
    }
}

/// Closes an HTTP/1 connection that hyper is done with (`ended`), as hyper
/// would have, but for two things. A request whose head hyper could not
/// read gets our answer, a JSON error that says what was wrong
/// ([`unreadable_head`]), in place of hyper's own, which has no body
/// ([`Unowed`] kept it from the socket). hyper has no way to give its
/// answer a body, and no layer of ours sees such a request: a malformed
/// head is no request at all, nor is a URI past [`MAX_URI_BYTES`]. And a
/// connection closed with bytes of the client's unread (a request
/// pipelined behind its last answer) is closed in stages, so that answer
/// is not lost to a reset ([`WriteWatched::linger`]); so is one whose
/// last request's body was not read to its end (a 413 refuses an upload
/// while its client is still sending it).
async fn close_http1(
    connection: Http1,
    ended: Result<(), hyper::Error>,
    state: &AppState,
    activity: &Activity,
) {
    use tokio::io::AsyncWriteExt;
    let parts = connection.0.into_parts();
    // Bytes of requests that hyper read and will not answer: one pipelined
    // behind an answer that ended the connection (`Connection: close`).
    let unanswered = !parts.read_buf.is_empty();
    let mut io = parts.io.into_inner();
    let held = io.take_held();
    if let Err(err) = &ended {
        connection_failed(state, err);
    }
    let refusal = match &ended {
        Err(err) if !held.is_empty() => unreadable_head(err),
        _ => None,
    };
    // Anything else held (none is known) goes out as hyper wrote it.
    let answer = match &refusal {
        Some((status, message)) => refusal_bytes(*status, message),
        None => held,
    };
    if !answer.is_empty() && io.write_all(&answer).await.is_err() {
        return;
    }
    let _ = io.shutdown().await;
    // Closed with a client's bytes unread, the socket sends a reset, which
    // can reach the client before it has read the last answer and discard
    // it (RFC 9112 9.6: close in stages). A client that pipelined a
    // request behind the last answer loses nothing by it: that answer said
    // `close`, so it knows the request was not taken and sends it again
    // (9.3.2); it must be let read the answer that says so. Not past the
    // drain timeout: the exit then waits only [`ANSWER_GRACE`] for the
    // connections left, and one lingering for a client that keeps its
    // socket open would make it a forced one, every answer written.
    // Whether bytes are queued at this instant is not enough: a client
    // still sending a body it paused in (a refused upload) would have the
    // rest of it answered with a reset.
    // At a shutdown, a keep-alive client's next request may cross the
    // close: read away, not reset.
    // Such a request comes within a round trip of the close, so a silent
    // client (a pool that notices the close only when it next uses the
    // connection) is waited for [`IDLE_GRACE`], not [`HEADERS_GRACE`]: the
    // exit waits for every connection's task.
    let body_open = activity.body_open.load(Ordering::Acquire);
    let owed =
        refusal.is_some() || (ended.is_ok() && (unanswered || body_open || received(&io.stream)));
    let crossing = ended.is_ok() && state.is_shutting_down();
    if owed || crossing {
        let pause = if owed { HEADERS_GRACE } else { IDLE_GRACE };
        state.until_drain_ends(io.linger(pause)).await;
    }
}

/// The status and message for a head hyper could not read (`err`): hyper's
/// status for it (400, 414 or 431), told in words. `None` for an error
/// that is not about the head.
fn unreadable_head(err: &hyper::Error) -> Option<(StatusCode, String)> {
    if !err.is_parse() {
        return None;
    }
    // hyper's kinds of parse error are private: its words name them.
    let said = err.to_string();
    if err.is_parse_too_large() {
        return Some(if said == "URI too long" {
            (
                StatusCode::URI_TOO_LONG,
                format!("the request's URI is longer than the limit of {MAX_URI_BYTES} bytes"),
            )
        } else {
            (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                format!(
                    "the request's head (its request line and header lines) is over the limit \
                     of {MAX_HEAD_BYTES} bytes or of {MAX_HEADERS} header lines"
                ),
            )
        });
    }
    let what = match said.as_str() {
        "invalid HTTP method parsed" => {
            "the request line does not start with a method (a token: letters, digits and \
             !#$%&'*+-.^_`|~) and one space; a request line is `METHOD target HTTP/1.1`"
                .to_owned()
        }
        "invalid URI" => "the request line's target is not a valid URI".to_owned(),
        "invalid HTTP version parsed" => {
            "the request line's version is not HTTP/1.1 or HTTP/1.0 (HTTP/2 is spoken to a \
             client that opens the connection with its preface, prior knowledge)"
                .to_owned()
        }
        "invalid HTTP header parsed" => {
            "a header line is not `Name: value` (a name is a token: letters, digits and \
             !#$%&'*+-.^_`|~, with no space before the colon; a value has no control \
             characters), or a line does not end in CRLF"
                .to_owned()
        }
        "invalid content-length parsed" => {
            "Content-Length is not a decimal number, or two Content-Length headers differ"
                .to_owned()
        }
        "unexpected transfer-encoding parsed" => {
            "an HTTP/1.0 request has no Transfer-Encoding (chunked bodies are HTTP/1.1's)"
                .to_owned()
        }
        other => other.to_owned(),
    };
    Some((
        StatusCode::BAD_REQUEST,
        format!("malformed HTTP/1 request: {what}"),
    ))
}

/// A whole HTTP/1.1 answer that ends its connection: `status` and, in the
/// native error shape ([`crate::errors::NativeErrorBody`]), `message`.
fn refusal_bytes(status: StatusCode, message: &str) -> Vec<u8> {
    let body = serde_json::to_vec(&crate::errors::NativeErrorBody {
        error: crate::errors::NativeErrorDetail {
            message: message.to_owned(),
            kind: "invalid_request_error".into(),
            code: status.as_u16(),
        },
    })
    .expect("a string and a number serialize");
    let mut answer = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\ndate: {}\r\n\r\n",
        status.as_u16(),
        status.canonical_reason().unwrap_or(""),
        body.len(),
        httpdate::fmt_http_date(std::time::SystemTime::now()),
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    answer
}

/// A connection that ended in an error. A request hyper could not read
/// (malformed, or a head past its limits) was refused before any route saw
/// it (over HTTP/1, [`close_http1`] answers it): it is counted and logged
/// here, so a proxy that sends such requests shows in `/metrics` and the
/// log. The rest (a client gone, an idle connection timed out) is routine.
fn connection_failed(state: &AppState, err: &hyper::Error) {
    use crate::metrics::Unreadable;
    if err.is_parse_too_large() {
        state
            .http_metrics()
            .record_unreadable_request(Unreadable::TooLarge);
        tracing::info!(
            "refused a request whose head is past hyper's limits: {}",
            LogSafe(err)
        );
    } else if err.is_parse() {
        state
            .http_metrics()
            .record_unreadable_request(Unreadable::Malformed);
        tracing::info!("refused a malformed HTTP/1 request: {}", LogSafe(err));
    } else {
        tracing::debug!("connection ended: {}", LogSafe(err));
    }
}

/// Whether `stream`'s socket holds bytes received and not yet read.
fn received(stream: &tokio::net::TcpStream) -> bool {
    #[cfg(unix)]
    {
        fd_received(std::os::fd::AsRawFd::as_raw_fd(stream))
    }
    #[cfg(not(unix))]
    {
        let _ = stream;
        false
    }
}

/// Whether socket `fd` holds bytes received and not yet read (`FIONREAD`;
/// a client's FIN alone is none).
#[cfg(unix)]
fn fd_received(fd: std::os::fd::RawFd) -> bool {
    let mut queued: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which points
    // at `queued`; the caller holds the socket open.
    let ok = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) };
    ok == 0 && queued > 0
}

/// Completes once the server is stopping (never if it was dropped).
async fn stopping(stopped: &mut tokio::sync::watch::Receiver<bool>) {
    if stopped.wait_for(|&s| s).await.is_err() {
        std::future::pending().await
    }
}

/// Completes once, after [`HEADERS_GRACE`], the connection has no request
/// in progress and nothing waiting to be written (an answer whose body
/// hyper has taken may still sit in its buffer while a slow client reads).
async fn unused(activity: &Activity, blocked: &AtomicBool) {
    tokio::time::sleep(HEADERS_GRACE).await;
    while activity.busy.load(Ordering::Acquire) > 0 || blocked.load(Ordering::Acquire) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A connection's socket that records whether its last write or flush is
/// waiting for the client to read, and fails a write that has waited
/// `timeout`: a client that asks for an answer and never reads it would
/// otherwise hold its connection, and the answer's buffer (megabytes for
/// `/embed_all`), for as long as it likes. Each write that goes through
/// starts the wait anew: the limit is on a stall, not on how long a slow
/// reader takes over a whole answer.
struct WriteWatched {
    stream: tokio::net::TcpStream,
    blocked: Arc<AtomicBool>,
    timeout: Duration,
    /// Made on the first wait and reset on each one after, so a connection
    /// that never waits allocates no timer.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether `deadline` is set for the wait in progress.
    waiting: bool,
    /// Bytes the kernel had not yet sent when the deadline was last set
    /// (`None` where that cannot be told).
    unsent_at_arming: Option<usize>,
    /// Where a dropped answer is counted: its request was counted under
    /// its status when the answer was made, before it was written.
    state: AppState,
    /// Bytes read before the protocol was known ([`sniff`]), read again
    /// first, from `replayed` on.
    replay: Vec<u8>,
    replayed: usize,
    /// Where the bytes read are counted ([`Activity::taken`]).
    activity: Arc<Activity>,
    /// HTTP/1's: what hyper writes while it owes no answer, held back.
    unowed: Option<Unowed>,
}

/// What an HTTP/1 connection's socket holds back: hyper writes nothing but
/// the answers to the requests it has handed the service, and its own
/// answer to a head it could not read (400, 414 or 431: a status line,
/// no body). So bytes written while no answer is owed (no request in
/// progress, and every answer's bytes written: hyper flushes the socket
/// only once its own buffer is empty) are that answer, kept from the
/// client for [`close_http1`] to replace. A head pipelined behind an answer
/// the client has not read is parsed only once that answer is flushed
/// whole: hyper reads ahead into its buffer, but takes the next head only
/// after its connection is idle again, which a write buffer that is empty
/// makes it (hyper 1.x: `Conn::poll_flush` calls `try_keep_alive`); that
/// flush settles it here first. (Only a request whose body hyper finished
/// reading after its answer was made, and while that answer could not be
/// written, could see its next head refused with hyper's answer.)
struct Unowed {
    /// How many requests had begun ([`Activity::started`]) when hyper last
    /// flushed the socket with none in progress.
    settled: usize,
    held: Vec<u8>,
}

impl WriteWatched {
    fn new(
        stream: tokio::net::TcpStream,
        timeout: Duration,
        state: AppState,
        activity: Arc<Activity>,
    ) -> Self {
        Self {
            stream,
            blocked: Arc::default(),
            timeout,
            deadline: None,
            waiting: false,
            unsent_at_arming: None,
            state,
            replay: Vec::new(),
            replayed: 0,
            activity,
            unowed: None,
        }
    }

    fn replaying(mut self, first: Vec<u8>) -> Self {
        self.replay = first;
        self
    }

    /// With `http1`, holds back what hyper writes while it owes no answer
    /// ([`Unowed`]); nothing owed yet.
    fn holding_unowed(mut self, http1: bool) -> Self {
        self.unowed = http1.then(|| Unowed {
            settled: 0,
            held: Vec::new(),
        });
        self
    }

    /// Whether what hyper writes now is held back ([`Unowed`]).
    fn holds(&self) -> bool {
        self.unowed.as_ref().is_some_and(|unowed| {
            self.activity.busy.load(Ordering::Acquire) == 0
                && unowed.settled == self.activity.started.load(Ordering::Acquire)
        })
    }

    /// What was held back; nothing is held from now on.
    fn take_held(&mut self) -> Vec<u8> {
        self.unowed
            .take()
            .map(|unowed| unowed.held)
            .unwrap_or_default()
    }

    /// Reads away what the client is still sending, until it closes, sends
    /// nothing for `pause`, or [`LINGER_LIMIT`] has passed
    /// ([`SHUTDOWN_LINGER_LIMIT`] once a shutdown has begun), after
    /// an answer that ends the connection before the client's bytes were
    /// all read (a head past its limit, a request pipelined behind an
    /// answer that said `close`, an upload refused with 413 while it is
    /// still being sent): closed with bytes unread, the socket would send a
    /// reset, which can reach the client before it reads the answer and
    /// discard it, and fails the write of a client that reads only once it
    /// has sent its body. Bounded by time, not bytes: a cap of 4 MiB reset
    /// an 8 MiB upload's client mid-body (nginx's `lingering_close` is
    /// bounded likewise: `lingering_timeout`, `lingering_time`).
    async fn linger(&mut self, pause: Duration) {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 64 << 10];
        let began = tokio::time::Instant::now();
        loop {
            // Asked on each read: a linger begun before a shutdown is cut
            // to the shorter limit once one begins.
            let limit = if self.state.is_shutting_down() {
                SHUTDOWN_LINGER_LIMIT
            } else {
                LINGER_LIMIT
            };
            let Some(left) = limit.checked_sub(began.elapsed()) else {
                return;
            };
            match tokio::time::timeout(pause.min(left), self.stream.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
        }
    }

    /// Bytes written to the socket that the client has not yet taken
    /// (Linux's `TIOCOUTQ`); `None` where that cannot be told.
    /// Starts the wait anew: the deadline `timeout` from now, the unsent
    /// bytes as they are now.
    fn rearm(&mut self) {
        let until = tokio::time::Instant::now() + self.timeout;
        self.unsent_at_arming = self.unsent();
        match &mut self.deadline {
            Some(deadline) => deadline.as_mut().reset(until),
            None => self.deadline = Some(Box::pin(tokio::time::sleep_until(until))),
        }
    }

    #[cfg(target_os = "linux")]
    fn unsent(&self) -> Option<usize> {
        use std::os::fd::AsRawFd;
        let mut queued: libc::c_int = 0;
        // SAFETY: TIOCOUTQ writes one c_int through the pointer, which
        // points at `queued`; the fd is this socket's, open while `self` is.
        let ok = unsafe { libc::ioctl(self.stream.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
        (ok == 0).then(|| usize::try_from(queued).unwrap_or(0))
    }

    #[cfg(not(target_os = "linux"))]
    fn unsent(&self) -> Option<usize> {
        None
    }

    fn note<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        self.blocked.store(poll.is_pending(), Ordering::Release);
        if poll.is_ready() {
            self.waiting = false;
            return poll;
        }
        if !self.waiting {
            self.waiting = true;
            self.rearm();
        }
        // The kernel lets a write through only once a third or so of a
        // grown send buffer (megabytes) has drained: a client reading
        // steadily but slowly takes longer than the timeout over that. What
        // it took since the deadline was set is progress too, from
        // `MIN_PROGRESS` on: a client that reads nothing still lets a few
        // KiB trickle in as its kernel compacts its receive buffer.
        const MIN_PROGRESS: usize = 64 << 10;
        loop {
            // Polled with the write's waker, so a client that never reads
            // wakes the connection at the deadline instead of leaving it parked.
            let deadline = self.deadline.as_mut().expect("armed when the wait began");
            if deadline.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            match (self.unsent_at_arming, self.unsent()) {
                (Some(before), Some(now)) if now + MIN_PROGRESS <= before => self.rearm(),
                _ => break,
            }
        }
        tracing::debug!(
            "dropping a connection: its answer could not be written for {} s, the client \
             not reading it (--client-timeout-secs)",
            self.timeout.as_secs()
        );
        self.state.http_metrics().record_answer_dropped();
        Poll::Ready(Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the answer could not be written within --client-timeout-secs",
        )))
    }
}

impl WriteWatched {
    /// Holds `bufs` back ([`Unowed`]): their length.
    fn hold(&mut self, bufs: &[std::io::IoSlice<'_>]) -> usize {
        let held = &mut self.unowed.as_mut().expect("held only over HTTP/1").held;
        let before = held.len();
        for buf in bufs {
            held.extend_from_slice(buf);
        }
        held.len() - before
    }
}

impl AsyncRead for WriteWatched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.replayed < this.replay.len() {
            let rest = &this.replay[this.replayed..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.replayed += n;
            if this.replayed == this.replay.len() {
                this.replay = Vec::new();
                this.replayed = 0;
            }
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.stream).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        if read > 0 {
            this.activity.taken.fetch_add(read, Ordering::AcqRel);
        }
        poll
    }
}

impl AsyncWrite for WriteWatched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.holds() {
            return Poll::Ready(Ok(self.hold(&[std::io::IoSlice::new(buf)])));
        }
        let poll = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.note(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.holds() {
            return Poll::Ready(Ok(self.hold(bufs)));
        }
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.note(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        let this = &mut *self;
        if let (Poll::Ready(Ok(())), Some(unowed)) = (&poll, &mut this.unowed) {
            // hyper's buffer is empty: every answer begun so far is written.
            if this.activity.busy.load(Ordering::Acquire) == 0 {
                unowed.settled = this.activity.started.load(Ordering::Acquire);
            }
        }
        self.note(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// `app` for one connection, counting its requests in progress: from the
/// moment their headers are in until their answers' bodies are written (or
/// dropped), so a connection whose answer is still being sent counts too.
/// Over HTTP/1, an answer made once a shutdown has been requested ends its
/// connection and says so ([`last_if_stopping`]).
#[derive(Clone)]
struct Tracked {
    app: Router,
    activity: Arc<Activity>,
    state: AppState,
}

impl Tracked {
    fn new(app: Router, state: AppState) -> Self {
        Self {
            app,
            activity: Arc::default(),
            state,
        }
    }
}

/// Marks an HTTP/1 answer `Connection: close` when the server is shutting
/// down (`stopping`), which makes hyper end the connection after it. The
/// connection's task turns the shutdown into hyper's own
/// ([`Watched::drive`]) only once it is woken, and an answer's head can be
/// written first on a loaded machine: it said keep-alive, and a pooled
/// client's next request then met the close. hyper writes the head in the
/// same poll of the connection's task that makes the answer, so the answer
/// says what the connection will do: every one made after the shutdown
/// was requested says `close`. (An HTTP/2 answer has no `Connection`
/// header: its client is told by the GOAWAY.)
fn last_if_stopping(response: &mut axum::response::Response, stopping: bool) {
    if stopping {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
}

/// Makes an answer to an HTTP/1.0 request that says `Connection: close` an
/// HTTP/1.0 answer, as hyper writes it to that client in any case. hyper
/// decides whether to add `keep-alive` for a 1.0 client that asked for it
/// by the answer's own version, before setting that to 1.0: a 1.1 answer
/// went out saying `Connection: close, keep-alive`. (hyper ends the
/// connection all the same; a client may read either word first.)
fn close_as_http10(response: &mut axum::response::Response) {
    let closes = response
        .headers()
        .get_all(axum::http::header::CONNECTION)
        .iter()
        .any(|value| value.as_bytes().eq_ignore_ascii_case(b"close"));
    if closes {
        *response.version_mut() = axum::http::Version::HTTP_10;
    }
}

/// A connection's requests: in progress, begun so far, and answers being
/// taken by hyper.
struct Activity {
    busy: AtomicUsize,
    started: AtomicUsize,
    /// Bytes taken from the socket (by [`sniff`] or hyper) since a request
    /// last began or ended: with none in progress, the start of the next.
    taken: AtomicUsize,
    /// Whether the last request's body has not been read to its end
    /// ([`BodyWatched`]; HTTP/1's, one request at a time).
    body_open: AtomicBool,
    /// For each answer made whose body hyper has not all taken, when hyper
    /// last took a piece of it (ms after `born`). Each its own: one
    /// stream's progress says nothing of another's over HTTP/2.
    answering: std::sync::Mutex<Vec<Arc<AtomicU64>>>,
    born: Instant,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            busy: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
            body_open: AtomicBool::new(false),
            answering: std::sync::Mutex::default(),
            born: Instant::now(),
        }
    }
}

impl Activity {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn answers(&self) -> std::sync::MutexGuard<'_, Vec<Arc<AtomicU64>>> {
        self.answering
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Completes once an answer has waited `after` for hyper to take its
    /// next piece; never without `after`. Over HTTP/2 a client can leave
    /// one stream's window shut while its connection, pings answered and
    /// other streams read, never blocks a write: [`WriteWatched`] would not
    /// see it, and the answer (and its room, [`crate::answer_room`]) would
    /// be held for as long as the client liked.
    async fn stalled(&self, after: Option<Duration>) {
        let Some(after) = after else {
            return std::future::pending().await;
        };
        let after_ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        loop {
            tokio::time::sleep((after / 4).max(Duration::from_millis(250))).await;
            let now = self.now_ms();
            let stalled = self
                .answers()
                .iter()
                .any(|taken| now.saturating_sub(taken.load(Ordering::Acquire)) >= after_ms);
            if stalled {
                return;
            }
        }
    }

    /// Completes once a request has begun after `begun` had.
    async fn begun_after(&self, begun: usize) {
        while self.started.load(Ordering::Acquire) == begun {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Completes once no request has been in progress or begun for a
    /// whole `after` (between one and two of them after the last one
    /// ended); never without one.
    async fn idle(&self, after: Option<Duration>) {
        let Some(after) = after else {
            return std::future::pending().await;
        };
        loop {
            let seen = self.started.load(Ordering::Acquire);
            tokio::time::sleep(after).await;
            if self.busy.load(Ordering::Acquire) == 0
                && self.started.load(Ordering::Acquire) == seen
            {
                return;
            }
        }
    }
}

/// One request in progress on its connection; dropped with its answer's body.
struct InProgress(Arc<Activity>);

impl InProgress {
    fn new(activity: &Arc<Activity>) -> Self {
        activity.started.fetch_add(1, Ordering::AcqRel);
        activity.busy.fetch_add(1, Ordering::AcqRel);
        activity.taken.store(0, Ordering::Release);
        Self(activity.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.taken.store(0, Ordering::Release);
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer made whose body hyper has not all taken; dropped with the body.
struct Answering {
    activity: Arc<Activity>,
    last_taken: Arc<AtomicU64>,
}

impl Answering {
    fn new(activity: &Arc<Activity>) -> Self {
        let last_taken = Arc::new(AtomicU64::new(activity.now_ms()));
        activity.answers().push(last_taken.clone());
        Self {
            activity: activity.clone(),
            last_taken,
        }
    }

    fn taken(&self) {
        self.last_taken
            .store(self.activity.now_ms(), Ordering::Release);
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.activity
            .answers()
            .retain(|taken| !Arc::ptr_eq(taken, &self.last_taken));
    }
}

/// Over HTTP/2, the most of an answer hyper is handed at once (its
/// default frame size). hyper takes a body's next piece whenever its
/// stream's window has a byte of room and queues it whole in h2: handed a
/// whole answer, a client that keeps the window at a byte would have it
/// queued, the body done and [`Activity::stalled`] blind. In pieces, the
/// next one waits for the window, so a stream that does not read stalls
/// where it is seen, with at most a piece queued.
const H2_PIECE: usize = 16 << 10;

/// An answer's body handed over in pieces of at most `piece` bytes.
struct InPieces {
    body: axum::body::Body,
    rest: axum::body::Bytes,
    piece: usize,
}

impl http_body::Body for InPieces {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if this.rest.is_empty() {
            match std::task::ready!(Pin::new(&mut this.body).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.rest = data,
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                other => return Poll::Ready(other),
            }
        }
        let n = this.rest.len().min(this.piece);
        Poll::Ready(Some(Ok(http_body::Frame::data(this.rest.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let rest = self.rest.len() as u64;
        let inner = self.body.size_hint();
        let mut hint = http_body::SizeHint::new();
        hint.set_lower(inner.lower() + rest);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + rest);
        }
        hint
    }
}

/// A request's body, noting on its connection's [`Activity`] when it has
/// been read to its end.
struct BodyWatched<B> {
    body: B,
    activity: Arc<Activity>,
}

impl<B: http_body::Body + Unpin> http_body::Body for BodyWatched<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let poll = Pin::new(&mut this.body).poll_frame(cx);
        let ended = match &poll {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.body.is_end_stream(),
            _ => false,
        };
        if ended {
            this.activity.body_open.store(false, Ordering::Release);
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl<B> tower_service::Service<axum::http::Request<B>> for Tracked
where
    B: http_body::Body + Unpin,
    Router: tower_service::Service<
        axum::http::Request<BodyWatched<B>>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
    >,
    <Router as tower_service::Service<axum::http::Request<BodyWatched<B>>>>::Future: Send + 'static,
{
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = futures_util::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower_service::Service::<axum::http::Request<BodyWatched<B>>>::poll_ready(&mut self.app, cx)
    }

    fn call(&mut self, request: axum::http::Request<B>) -> Self::Future {
        use http_body_util::BodyExt;
        let in_progress = InProgress::new(&self.activity);
        let activity = self.activity.clone();
        let version = request.version();
        let http2 = version == axum::http::Version::HTTP_2;
        activity
            .body_open
            .store(!request.body().is_end_stream(), Ordering::Release);
        let request = request.map(|body| BodyWatched {
            body,
            activity: activity.clone(),
        });
        let answer = self.app.call(request);
        let state = self.state.clone();
        Box::pin(async move {
            let mut response = answer.await?;
            if !http2 {
                last_if_stopping(&mut response, state.is_shutting_down());
            }
            if version == axum::http::Version::HTTP_10 {
                close_as_http10(&mut response);
            }
            // Only HTTP/2 watches for stalled answers ([`Activity::stalled`]):
            // over HTTP/1 a client not reading blocks the socket's writes,
            // which [`WriteWatched`] times.
            let answering = http2.then(|| Answering::new(&activity));
            Ok(response.map(|body| {
                let body = if http2 {
                    axum::body::Body::new(InPieces {
                        body,
                        rest: axum::body::Bytes::new(),
                        piece: H2_PIECE,
                    })
                } else {
                    body
                };
                axum::body::Body::new(body.map_frame(move |frame| {
                    let _ = &in_progress;
                    if let Some(answering) = &answering {
                        answering.taken();
                    }
                    frame
                }))
            }))
        })
    }
}

/// The next connection `listener` accepts, or `None` once `stop` has
/// completed (the HTTP listener's and the gRPC one's accept loop). Nagle
/// is off: answers are written whole, so nothing is held back for more.
pub(crate) async fn accept_until<F: Future<Output = ()>>(
    listener: &TcpListener,
    stop: &mut Pin<&mut F>,
) -> Option<tokio::net::TcpStream> {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    let _ = stream.set_nodelay(true);
                    return Some(stream);
                }
                Err(err) => accept_failed(err).await,
            },
            () = stop.as_mut() => return None,
        }
    }
}

/// A failed `accept`: one client's connection that went away before it was
/// taken is nothing; anything else (out of file descriptors) is logged and
/// the loop pauses, so it does not spin while the cause lasts.
async fn accept_failed(err: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        err.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    tracing::error!("cannot accept a connection: {err}; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An HTTP/2 answer goes to hyper a piece at a time, whole and in
    /// order, its size still known (hyper's `content-length`).
    #[tokio::test]
    async fn an_answer_in_pieces_is_the_answer() {
        use http_body::Body as _;
        use http_body_util::BodyExt;
        let answer: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let mut body = InPieces {
            body: axum::body::Body::from(answer.clone()),
            rest: axum::body::Bytes::new(),
            piece: H2_PIECE,
        };
        assert_eq!(body.size_hint().exact(), Some(40_000));
        let mut got = Vec::new();
        let mut pieces = Vec::new();
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            pieces.push(data.len());
            got.extend_from_slice(&data);
            assert_eq!(body.size_hint().exact(), Some((40_000 - got.len()) as u64));
        }
        assert_eq!(pieces, [H2_PIECE, H2_PIECE, 40_000 - 2 * H2_PIECE]);
        assert_eq!(got, answer);
        assert!(body.is_end_stream());
    }

    #[test]
    fn warm_up_text_is_the_maximum_up_to_the_cap() {
        let words = |max| warm_up_text(max).split_whitespace().count();
        assert_eq!(words(0), 1);
        assert_eq!(words(64), 64);
        assert_eq!(words(WARMUP_MAX_WORDS), WARMUP_MAX_WORDS);
        // jina-embeddings-v2 (8,192) and Qwen3-Embedding (32,768): capped.
        assert_eq!(words(8192), WARMUP_MAX_WORDS);
        assert_eq!(words(32768), WARMUP_MAX_WORDS);
    }
}
