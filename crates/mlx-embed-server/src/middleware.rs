//! Cross-cutting layers: request ids, per-request log line and metrics,
//! `Host` and API-key checks, refusal of compressed bodies.

use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{
    ACCEPT_ENCODING, AUTHORIZATION, CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, HOST,
    TRANSFER_ENCODING,
};
use axum::http::{HeaderName, HeaderValue, Version};
use axum::middleware::Next;
use axum::response::Response;
use futures_util::FutureExt;
use http_body::{Frame, SizeHint};
use tracing::Instrument;

use crate::errors::{Api, ApiError, ErrorKind, ErrorReason, LogSafe};
use crate::metrics::Series;
use crate::state::AppState;
use crate::timing;

/// Header carrying the request id, accepted from the client and echoed back.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request's id, as a request extension for handlers that want it.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// A client-supplied id is kept when it is short printable ASCII; otherwise we make one.
fn request_id(req: &Request) -> String {
    if let Some(v) = req.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()) {
        if !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()) {
            return v.to_owned();
        }
    }
    static PREFIX: OnceLock<u32> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let prefix = PREFIX.get_or_init(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        (t.as_nanos() as u32) ^ std::process::id().rotate_left(16)
    });
    format!("{prefix:08x}-{:06x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Outermost layer: request id (echoed as `x-request-id`), a tracing span
/// carrying it, one info line per request (id, route, status, time; never the
/// request text), and HTTP metrics. A failed request's reason follows: a
/// server error's at warn; a refusal's at debug only, since it may quote what
/// the client sent (serde names the value it could not read). Both have
/// their control characters escaped, for that same reason.
pub async fn observe(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let start = Instant::now();
    let id = request_id(&req);
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = req.method().clone();
    let api = Api::for_path(req.uri().path());
    req.extensions_mut().insert(RequestId(id.clone()));

    // A probe or a scrape, polled every few seconds, is no trace anyone
    // looks for: its span is in the log lines, not exported. But while the
    // server is not ready (shutting down, a model down), when a probe is
    // answered 503, it is the trace worth having: exported then.
    let polled = is_polled(&route) && state.is_ready();
    macro_rules! request_span {
        ($target:expr) => {
            tracing::info_span!(
                target: $target,
                "request",
                id = %id,
                method = %method,
                route = %route,
                otel.name = tracing::field::Empty,
                otel.kind = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
                http.request.method = tracing::field::Empty,
                http.route = tracing::field::Empty,
                http.response.status_code = tracing::field::Empty,
                inputs = tracing::field::Empty,
            )
        };
    }
    let span = if polled {
        request_span!(UNEXPORTED_TARGET)
    } else {
        request_span!("mlx_embed_server::middleware")
    };
    let exported = exported_spans().filter(|_| !polled);
    if let Some(continue_trace) = exported {
        // Before the span starts (its first child or enter starts it): an
        // exported span's kind and name are fixed then.
        span.record("otel.kind", "server");
        span.record("otel.name", format!("{method} {route}"));
        span.record("http.request.method", method.as_str());
        span.record("http.route", route.as_str());
        continue_trace(&span, req.headers());
    }
    let model = AnsweringModel::default();
    let tally = timing::Tally::default();
    let left = ClientLeft {
        state: &state,
        route: &route,
        model: &model,
        tally: &tally,
        span: &span,
        start,
    };
    let handled = timing::measured(
        &tally,
        ANSWERING_MODEL.scope(
            model.clone(),
            AssertUnwindSafe(next.run(req).instrument(span.clone())).catch_unwind(),
        ),
    );
    let (handled, measured) = handled.await;
    // A bug in a handler answers its own request 500, in the route's shape,
    // instead of dropping the connection unanswered; the server goes on.
    let mut response = handled.unwrap_or_else(|_| {
        span.in_scope(|| tracing::error!("the handler panicked (see stderr)"));
        api.render(ApiError::new(
            ErrorKind::Model,
            "internal server error: the server failed on this request",
        ))
    });
    std::mem::forget(left);

    let elapsed = start.elapsed();
    let status = response.status().as_u16();
    // TEI's figures on every answer the model worked for; not on a refusal
    // (a call can succeed before a later one fails the request).
    if let (Some(usage), true) = (&measured.usage, response.status().is_success()) {
        response
            .headers_mut()
            .extend(timing::headers(usage, elapsed));
    }
    state.http_metrics().record_tei(&measured, status, elapsed);
    let series = model.series(&state, &route);
    if status == CLIENT_CLOSED_REQUEST {
        // Closed in the middle of its body: counted as a client that left
        // before its answer is, out of the answers' latency.
        state.http_metrics().record_client_left(series, status);
    } else {
        state
            .http_metrics()
            .record(series, status, elapsed.as_secs_f64());
    }
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID.clone(), v);
    }
    // Info level so an id a client reports can be found in the log; the body
    // stays out of it, since texts may be private.
    let ms = millis(elapsed);
    span.in_scope(|| {
        tracing::info!(status, ms, "request done");
        match response.extensions().get::<ErrorReason>() {
            Some(ErrorReason(reason)) if status >= 500 => {
                tracing::warn!("request failed: {}", LogSafe(reason))
            }
            Some(ErrorReason(reason)) => tracing::debug!("request refused: {}", LogSafe(reason)),
            None => {}
        }
    });
    if exported.is_some() {
        // After the log lines: they carry the span as they always did.
        // As i64: OpenTelemetry has no unsigned integer (a u64 would go as text).
        span.record("http.response.status_code", i64::from(status));
        if measured.sent > 0 {
            span.record("inputs", i64::try_from(measured.sent).unwrap_or(i64::MAX));
        }
        if status >= 500 {
            // A server span fails on a server error only (OpenTelemetry's
            // HTTP conventions): a 4xx is the client's.
            span.record("otel.status_code", "ERROR");
        }
    }
    response
}

/// The target of the spans of requests whose spans are not exported
/// (probes: `/health`, `/ping`, `/.well-known/*`, the gRPC health service;
/// the scrape of `/metrics`: each while the server is ready, so a failing
/// probe is exported; reflection, always); the launcher's export leaves it out.
pub const UNEXPORTED_TARGET: &str = "mlx_embed_server::unexported";

/// Whether requests to `route` are a machine's polling: liveness and
/// readiness probes (`/health`, SageMaker's `/ping`, `/.well-known/*`) and
/// the Prometheus scrape of `/metrics`, every few seconds each. TEI exports
/// them like any request; a trace backend would then hold mostly probes.
fn is_polled(route: &str) -> bool {
    !needs_api_key(route) || route == "/metrics"
}

/// How an exported request span continues the caller's trace: given the
/// span just made and the request's headers, it makes the span a child of
/// the trace they name (a W3C `traceparent`), if any.
pub type ContinueTrace = fn(&tracing::Span, &axum::http::HeaderMap);

static EXPORTED_SPANS: OnceLock<ContinueTrace> = OnceLock::new();

/// Says the process exports its spans (the launcher's `--otlp-endpoint`),
/// once, before serving: from then on each request span carries
/// OpenTelemetry's HTTP attributes (`otel.name` "POST /embed", `otel.kind`
/// server, `http.request.method`, `http.route`, `http.response.status_code`,
/// `inputs`: the inputs it sent the model path) and continues its caller's
/// trace through `continue_trace`. The exporter is the launcher's: this
/// layer knows nothing of OpenTelemetry. Off (never called), requests
/// record none of these, and a JSON log line's span is as it always was.
/// False when it was said already.
pub fn export_spans(continue_trace: ContinueTrace) -> bool {
    EXPORTED_SPANS.set(continue_trace).is_ok()
}

pub(crate) fn exported_spans() -> Option<ContinueTrace> {
    EXPORTED_SPANS.get().copied()
}

tokio::task_local! {
    /// The model the request in hand resolved first, set by
    /// [`note_answering_model`] from the one place that resolves models.
    static ANSWERING_MODEL: AnsweringModel;
}

/// The model a request named or was given, for its metrics' `model` label.
#[derive(Clone, Default)]
struct AnsweringModel(Arc<OnceLock<String>>);

impl AnsweringModel {
    /// The request's metric series: with a `model` label where several
    /// models are served (`""`: the request reached none), as the core's
    /// metrics carry one.
    fn series<'a>(&'a self, state: &AppState, route: &'a str) -> Series<'a> {
        let several = state.models().len() > 1;
        Series {
            route,
            model: several.then(|| self.0.get().map_or("", String::as_str)),
        }
    }
}

/// Records `name` as the model answering the request being handled, unless
/// one already was (a request that resolves several counts under its first).
pub(crate) fn note_answering_model(name: &str) {
    let _ = ANSWERING_MODEL.try_with(|model| {
        model.0.get_or_init(|| name.to_owned());
    });
}

/// `elapsed` in milliseconds to the microsecond, as the log lines show it
/// (not `0.11078500000000001`).
fn millis(elapsed: std::time::Duration) -> f64 {
    (elapsed.as_secs_f64() * 1e6).round() / 1e3
}

/// Status recorded for a request whose client closed the connection before
/// the answer (nginx's 499, "client closed request"); nothing is sent.
pub const CLIENT_CLOSED_REQUEST: u16 = 499;

/// Alive while [`observe`] waits for the answer: dropped with it when the
/// client goes away, it counts and logs the request, which otherwise would
/// leave no trace in `/metrics` or the log.
struct ClientLeft<'a> {
    state: &'a AppState,
    route: &'a str,
    model: &'a AnsweringModel,
    /// What the request's model work came to before it was dropped: TEI
    /// counts a request whose client left as `te_request_failure{err="dropped"}`.
    tally: &'a timing::Tally,
    span: &'a tracing::Span,
    start: Instant,
}

impl Drop for ClientLeft<'_> {
    fn drop(&mut self) {
        let elapsed = self.start.elapsed();
        if self.state.is_abandoning() {
            // The server is exiting without this answer: its client did not leave.
            self.span.in_scope(|| {
                tracing::warn!(
                    ms = millis(elapsed),
                    "request dropped unanswered: the server stopped without waiting for it"
                );
            });
            return;
        }
        self.state.http_metrics().record_client_left(
            self.model.series(self.state, self.route),
            CLIENT_CLOSED_REQUEST,
        );
        self.state
            .http_metrics()
            .record_tei(&self.tally.take(), CLIENT_CLOSED_REQUEST, elapsed);
        self.span.in_scope(|| {
            tracing::info!(
                status = CLIENT_CLOSED_REQUEST,
                ms = millis(elapsed),
                "request cancelled: the client went away"
            );
        });
    }
}

/// Whether a path needs `Authorization: Bearer <key>` when the server runs
/// with `--api-key`: every one but the probes (the OpenAPI document says the same).
pub(crate) fn needs_api_key(path: &str) -> bool {
    !(path == "/health" || path == "/ping" || path.starts_with("/.well-known/"))
}

/// With `--api-key`, every route but the probes (`/health`, SageMaker's `/ping`, `/.well-known/*`)
/// needs `Authorization: Bearer <key>`; otherwise 401 in the path's API error shape.
pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = state.args().api_key.as_deref() else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    if !needs_api_key(path) {
        return next.run(req).await;
    }
    if carries_api_key(req.headers(), key) {
        return next.run(req).await;
    }
    tracing::debug!("rejected: missing or wrong API key");
    Api::for_path(path).render(ApiError::unauthorized())
}

/// Whether `headers` carry `key` as `Authorization: Bearer <key>` (the
/// scheme in any case): the one reading of the key, HTTP's and gRPC's.
pub(crate) fn carries_api_key(headers: &axum::http::HeaderMap, key: &str) -> bool {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .is_some_and(|(_, token)| constant_time_eq(token.trim().as_bytes(), key.as_bytes()))
}

/// RFC 9112 section 3.2: an HTTP/1.1 request without a `Host`, or any with
/// more than one, is a 400 (in the path's API error shape). With
/// `--allowed-hosts`, a request whose `Host` is a name it does not list
/// gets 403: a web page whose name an attacker points at this server (DNS
/// rebinding) sends its own name, never one the server answers to. IP
/// addresses and `localhost` name no such page, so they always pass; so
/// does an HTTP/1.0 request with no `Host` (no browser sends one).
pub async fn check_host(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let mut hosts = req.headers().get_all(HOST).iter();
    let (first, second) = (hosts.next(), hosts.next());
    if second.is_some() {
        // Checking only one of them would let the other through.
        tracing::debug!("rejected: more than one Host header");
        return Api::for_path(req.uri().path())
            .render(ApiError::invalid("more than one Host header: send one").code("invalid_host"));
    }
    if first.is_none() && req.version() == Version::HTTP_11 && req.uri().authority().is_none() {
        tracing::debug!("rejected: an HTTP/1.1 request without Host");
        return Api::for_path(req.uri().path()).render(
            ApiError::invalid("an HTTP/1.1 request needs a Host header (RFC 9112): send one")
                .code("invalid_host"),
        );
    }
    let allowed = &state.args().allowed_hosts;
    if allowed.is_empty() {
        return next.run(req).await;
    }
    let host = match req.uri().authority() {
        Some(authority) => Some(authority.host()),
        None => match first.map(HeaderValue::to_str) {
            Some(Ok(value)) => Some(host_of(value)),
            // Not text: no name a page could have.
            Some(Err(_)) => Some(""),
            None => None,
        },
    };
    match host {
        Some(host) if !host_allowed(host, allowed) => {
            tracing::debug!("rejected: Host {} not allowed", LogSafe(host));
            Api::for_path(req.uri().path()).render(ApiError::host_not_allowed(host))
        }
        _ => next.run(req).await,
    }
}

/// The host of a `Host` value, without its port (an IPv6 address keeps its brackets).
fn host_of(value: &str) -> &str {
    let value = value.trim();
    if value.starts_with('[') {
        return value.find(']').map_or(value, |end| &value[..=end]);
    }
    match value.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => value,
    }
}

/// Whether `host` is an IP address, `localhost` (or a name under it), or a
/// name `allowed` lists (an entry `.name` takes `name` and its subdomains).
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    // One final dot names the same host (a fully qualified name); two do not.
    let name = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
    let ip = name
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(&name);
    if ip.parse::<std::net::IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost")
    {
        return true;
    }
    allowed.iter().any(|entry| match entry.strip_prefix('.') {
        Some(domain) => {
            name == domain
                || name
                    .strip_suffix(entry.as_str())
                    .is_some_and(|sub| !sub.is_empty())
        }
        None => name == *entry,
    })
}

/// A body in any content coding but `identity` is refused on every route
/// with 415 and `Accept-Encoding: identity` (RFC 9110 section 15.5.16), in
/// the path's API error shape: bodies are read as they arrive, never
/// decompressed, and a gzip body would otherwise fail as malformed JSON.
/// So is one sent in a transfer coding other than `chunked` once (501, RFC
/// 9112 section 6.1): hyper takes the chunks and would pass the rest on
/// undecoded.
pub async fn refuse_encoded_bodies(req: Request, next: Next) -> Response {
    if let Some(transfer) = unread_transfer_codings(req.headers()) {
        let err = ApiError::new(
            ErrorKind::NotImplemented,
            format!(
                "request bodies must be sent whole or chunked, with no other transfer coding \
                 (Transfer-Encoding: {})",
                transfer.chars().take(256).collect::<String>()
            ),
        )
        // Where such a body ends is not something to rely on.
        .closing_connection();
        return Api::for_path(req.uri().path()).render(err);
    }
    let codings = listed_codings(req.headers(), &CONTENT_ENCODING);
    if codings.iter().all(|c| c.eq_ignore_ascii_case("identity")) {
        return next.run(req).await;
    }
    let err = ApiError::new(
        ErrorKind::UnsupportedMediaType,
        format!(
            "request bodies must not be compressed (Content-Encoding: {})",
            codings.join(", ")
        ),
    );
    let mut response = Api::for_path(req.uri().path()).render(err);
    response
        .headers_mut()
        .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    response
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A request refused before its body was read (a bad `X-Priority`, a wrong
/// content type, a missing key, an unknown route) leaves the body unread.
/// hyper, finding it so after the answer, closes the connection without
/// saying so when the body had not all arrived yet, and a pooled client's
/// next request on it fails. The rest is read away here (up to the body
/// limit, within `--client-timeout-secs`), so the connection stays usable;
/// where it cannot be (a client waiting for `100 Continue`, or one that sends
/// too much or too slowly), the answer says `Connection: close`.
pub async fn finish_unread_bodies(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    if !declares_body(req.headers()) {
        return next.run(req).await;
    }
    let waits_for_continue = crate::extract::expects_continue(req.headers());
    let (parts, body) = req.into_parts();
    let slot = Arc::new(Mutex::new(BodySlot {
        body: Some(body),
        ended: false,
    }));
    let shared = SharedBody(slot.clone());
    let mut response = next
        .run(Request::from_parts(parts, Body::new(shared)))
        .await;
    let rest = {
        let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.ended {
            None
        } else {
            slot.body.take()
        }
    };
    let Some(rest) = rest else {
        return response;
    };
    let closing = response
        .headers()
        .get(CONNECTION)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    if closing {
        return response;
    }
    let args = state.args();
    // Shutting down, the connection ends after this answer anyway.
    let read_away = !waits_for_continue
        && !state.is_shutting_down()
        && state
            .until_drain_ends(crate::extract::discard_body(
                rest,
                args.max_body_bytes,
                args.client_timeout(),
            ))
            .await
            .unwrap_or(false);
    if !read_away {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The request's `Transfer-Encoding`, joined, unless it is none or
/// `chunked` once: the one coding hyper decodes.
fn unread_transfer_codings(headers: &axum::http::HeaderMap) -> Option<String> {
    let codings = listed_codings(headers, &TRANSFER_ENCODING);
    match codings.as_slice() {
        [] => None,
        [only] if only.eq_ignore_ascii_case("chunked") => None,
        _ => Some(codings.join(", ")),
    }
}

/// The codings a `Content-Encoding` or `Transfer-Encoding` header lists,
/// over all its lines, trimmed, empty ones left out (none: no allocation).
fn listed_codings(headers: &axum::http::HeaderMap, name: &HeaderName) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .flat_map(|v| {
            String::from_utf8_lossy(v.as_bytes())
                .split(',')
                .map(|c| c.trim().to_owned())
                .filter(|c| !c.is_empty())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A `Content-Length` above 0, or any `Transfer-Encoding` (chunked).
fn declares_body(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key(TRANSFER_ENCODING)
        || headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 0)
}

struct BodySlot {
    body: Option<Body>,
    /// The handler read the body to its end.
    ended: bool,
}

/// The request's body as the handler reads it, left behind in a slot the
/// layer can take it back from once the handler is done.
struct SharedBody(Arc<Mutex<BodySlot>>);

impl HttpBody for SharedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(body) = slot.body.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            slot.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        slot.ended || slot.body.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        slot.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ct_eq() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn hosts_are_allowed_by_name_address_or_localhost() {
        let allowed = ["embed.example.com".to_owned(), ".corp.example".to_owned()];
        let ok = |value: &str| host_allowed(host_of(value), &allowed);
        for pass in [
            "embed.example.com",
            "EMBED.example.com.:8080",
            "corp.example",
            "a.b.corp.example:443",
            "127.0.0.1:8080",
            "10.1.2.3",
            "[::1]:8080",
            "[fe80::1]",
            "localhost:8080",
            "app.localhost",
        ] {
            assert!(ok(pass), "{pass}");
        }
        for refuse in [
            "evil.example",
            "embed.example.com.evil.example",
            "xcorp.example",
            "notlocalhost",
            "localhost.evil.example",
            "embed.example.com:80:80",
            "",
            "[::1",
            "127.0.0.1.evil.example",
            "embed.example.com..",
        ] {
            assert!(!ok(refuse), "{refuse}");
        }
    }

    #[test]
    fn ids_are_kept_or_made() {
        let req = Request::builder()
            .header("x-request-id", "abc-1")
            .body(axum::body::Body::empty())
            .unwrap();
        assert_eq!(request_id(&req), "abc-1");
        let req = Request::builder().body(axum::body::Body::empty()).unwrap();
        let (a, b) = (request_id(&req), request_id(&req));
        assert_ne!(a, b);
    }
}
