//! The gRPC listener: HTTP/2 connections served until the shutdown begins,
//! then drained with the HTTP server's; each call's API key checked (but
//! the health service's, as `/health` needs none), and counted and logged
//! as the HTTP routes' requests are.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use http_body::Frame;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::{Code, Status};
use tonic_health::pb::health_server::HealthServer;
use tracing::Instrument as _;

use super::health::Probe;
use super::methods::Tei;
use super::pb::{
    embed_server::EmbedServer, info_server::InfoServer, predict_server::PredictServer,
    rerank_server::RerankServer, tokenize_server::TokenizeServer,
};
use super::status::{code_name, size_status, CLIENT_FAULT};
use crate::config::ServerArgs;
use crate::errors::{LogSafe, ServerError};
use crate::middleware::{carries_api_key, exported_spans, UNEXPORTED_TARGET};
use crate::serve::accept_until;
use crate::state::AppState;

/// Binds `--host:--grpc-port` when `--grpc-port` is set.
pub(crate) async fn bind(args: &ServerArgs) -> Result<Option<TcpListener>, ServerError> {
    let Some(port) = args.grpc_port else {
        return Ok(None);
    };
    let listener = crate::serve::bind(&args.host, port, "grpc").await?;
    if let Ok(bound) = listener.local_addr() {
        tracing::info!("serving TEI's gRPC API on grpc://{bound}");
    }
    Ok(Some(listener))
}

/// `proto/tei.proto`'s descriptors, encoded by build.rs.
const TEI_DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tei_descriptor.bin"));

/// The services, each message capped at `--max-body-bytes`, the standard
/// health service ([`Probe`]) and server reflection, behind [`observe`];
/// `stopping`: true once the shutdown begins.
fn app(state: &AppState, stopping: watch::Receiver<bool>) -> Router {
    let probe = Probe {
        state: state.clone(),
        stopping: stopping.clone(),
    };
    let stopping_for_observe = stopping.clone();
    let tei = Tei {
        state: state.clone(),
        stopping,
    };
    let max = state.args().max_body_bytes;
    // Both reflection versions list every service served, each other's too
    // (older grpcurl releases ask v1alpha only).
    let described = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(TEI_DESCRIPTORS)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection = described()
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the descriptors compiled into the binary are valid");
    let reflection_v1alpha = described()
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .expect("the descriptors compiled into the binary are valid");
    tonic::service::Routes::new(InfoServer::new(tei.clone()).max_decoding_message_size(max))
        .add_service(EmbedServer::new(tei.clone()).max_decoding_message_size(max))
        .add_service(PredictServer::new(tei.clone()).max_decoding_message_size(max))
        .add_service(RerankServer::new(tei.clone()).max_decoding_message_size(max))
        .add_service(TokenizeServer::new(tei).max_decoding_message_size(max))
        .add_service(HealthServer::new(probe))
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .into_axum_router()
        .layer(axum::middleware::from_fn_with_state(
            Observed {
                state: state.clone(),
                stopping: stopping_for_observe,
            },
            observe,
        ))
}

/// What [`observe`] needs: the state, and the shutdown's start.
#[derive(Clone)]
struct Observed {
    state: AppState,
    stopping: watch::Receiver<bool>,
}

/// Serves gRPC on every connection `listener` accepts until `stop`
/// completes; then closes the listener, tells each connection to take no
/// new calls (HTTP/2 GOAWAY) and waits for the calls in progress.
pub(crate) async fn serve(listener: TcpListener, state: AppState, stop: impl Future<Output = ()>) {
    let (stopping, stopping_rx) = watch::channel(false);
    let app = app(&state, stopping_rx);
    let mut http = http2::Builder::new(TokioExecutor::new());
    // A gRPC channel stays open between calls, so an idle connection is no
    // fault; one whose peer is gone (no answer to a ping within
    // --client-timeout-secs) is closed rather than held forever.
    let patience = state.args().client_timeout();
    http.timer(TokioTimer::new())
        .keep_alive_interval(patience)
        .keep_alive_timeout(patience);
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop);
    while let Some(stream) = accept_until(&listener, &mut stop).await {
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!("gRPC connection ended: {}", LogSafe(&err));
            }
        });
    }
    drop(listener);
    // Open streams stop reading and end once their answers are out.
    stopping.send_replace(true);
    graceful.shutdown().await;
}

/// The methods of `proto/tei.proto`: the metric's `method` label is one of
/// these or `unmatched`, so made-up paths cannot grow the series without bound.
const METHODS: [&str; 21] = [
    "/tei.v1.Info/Info",
    "/tei.v1.Embed/Embed",
    "/tei.v1.Embed/EmbedStream",
    "/tei.v1.Embed/EmbedSparse",
    "/tei.v1.Embed/EmbedSparseStream",
    "/tei.v1.Embed/EmbedAll",
    "/tei.v1.Embed/EmbedAllStream",
    "/tei.v1.Predict/Predict",
    "/tei.v1.Predict/PredictPair",
    "/tei.v1.Predict/PredictStream",
    "/tei.v1.Predict/PredictPairStream",
    "/tei.v1.Rerank/Rerank",
    "/tei.v1.Rerank/RerankStream",
    "/tei.v1.Tokenize/Tokenize",
    "/tei.v1.Tokenize/TokenizeStream",
    "/tei.v1.Tokenize/Decode",
    "/tei.v1.Tokenize/DecodeStream",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// The health service's path prefix: its calls need no API key, as
/// `/health` needs none (a probe carries none).
const HEALTH: &str = "/grpc.health.v1.Health/";

/// Server reflection's path prefix: its stream is tonic's, which ends only
/// when its client ends it, so [`observe`] ends it at a shutdown
/// ([`UntilShutdown`]) as the `tei.v1` streams and `Watch` end themselves.
const REFLECTION: &str = "/grpc.reflection.";

/// Around every call: with `--api-key`, a call without it is refused
/// `UNAUTHENTICATED` (but a health check: [`HEALTH`]); each call's status is counted in `/metrics`
/// (`mlx_embed_grpc_requests_total{method,code}`) and logged, a failure's
/// message after it (at warn for the server's failures, at debug for
/// refusals, which may quote what the client sent), as the HTTP routes'.
async fn observe(State(observed): State<Observed>, req: Request, next: Next) -> Response {
    let Observed { state, stopping } = observed;
    let start = Instant::now();
    let path = req.uri().path();
    let reflection = path.starts_with(REFLECTION);
    let method = METHODS
        .iter()
        .find(|m| **m == path)
        .copied()
        .unwrap_or("unmatched");
    // The health service's checks are probes, reflection a client's tool:
    // their spans are in the log lines, not exported; but a check while the
    // server is not ready (answered NOT_SERVING) is, as an HTTP probe's.
    let serving = state.is_ready() && !*stopping.borrow();
    let unexported = (path.starts_with(HEALTH) && serving) || reflection;
    macro_rules! call_span {
        ($target:expr) => {
            tracing::info_span!(
                target: $target,
                "grpc",
                method = %method,
                otel.name = tracing::field::Empty,
                otel.kind = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
                rpc.system = tracing::field::Empty,
                rpc.service = tracing::field::Empty,
                rpc.method = tracing::field::Empty,
                rpc.grpc.status_code = tracing::field::Empty,
                inputs = tracing::field::Empty,
            )
        };
    }
    let span = if unexported {
        call_span!(UNEXPORTED_TARGET)
    } else {
        call_span!("mlx_embed_server::grpc")
    };
    let exported = exported_spans().filter(|_| !unexported);
    if let Some(continue_trace) = exported {
        // OpenTelemetry's RPC conventions: named `tei.v1.Embed/Embed`.
        let name = method.trim_start_matches('/');
        let (service, rpc) = name.split_once('/').unwrap_or((name, ""));
        span.record("otel.kind", "server");
        span.record("otel.name", name);
        span.record("rpc.system", "grpc");
        // A path no method has (answered UNIMPLEMENTED) names none: a
        // client's arbitrary path is no service of ours.
        if method != "unmatched" {
            span.record("rpc.service", service);
            span.record("rpc.method", rpc);
        }
        // gRPC metadata are the call's HTTP/2 headers: a `traceparent` too.
        continue_trace(&span, req.headers());
    }
    let done = Done {
        state: state.clone(),
        method,
        start,
        span: span.clone(),
        exported: exported.is_some(),
    };
    if let Some(key) = state.args().api_key.as_deref() {
        if !path.starts_with(HEALTH) && !carries_api_key(req.headers(), key) {
            let refusal = Status::unauthenticated(
                "missing or invalid API key: send `authorization: Bearer <key>` metadata",
            );
            done.finish(Some(&refusal));
            return refusal.into_http();
        }
    }
    let response = next.run(req).instrument(span.clone()).await;
    // A trailers-only answer (the call failed before any message, or a
    // unary call's message could not be read) has its status in its headers.
    if let Some(status) = Status::from_header_map(response.headers()) {
        let mut status = size_status(status);
        done.finish((status.code() != Code::Ok).then_some(&status));
        status.metadata_mut().remove(CLIENT_FAULT);
        return status.into_http();
    }
    let (parts, mut body) = response.into_parts();
    if reflection {
        body = Body::new(UntilShutdown::new(body, stopping));
    }
    Response::from_parts(
        parts,
        Body::new(Watched {
            body,
            done: Some(done),
            span,
        }),
    )
}

/// A stream's answer that ends `UNAVAILABLE` ("server is shutting down")
/// once the shutdown begins: an idle client holding it open would hold the
/// drain until `--drain-timeout-secs`, and then be dropped unanswered.
struct UntilShutdown {
    body: Body,
    /// Done once the shutdown begins (or its sender is gone); `None` once
    /// the answer has ended.
    stop: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl UntilShutdown {
    fn new(body: Body, mut stopping: watch::Receiver<bool>) -> Self {
        let stop = async move {
            let _ = stopping.wait_for(|&stop| stop).await;
        };
        Self {
            body,
            stop: Some(Box::pin(stop)),
        }
    }
}

impl http_body::Body for UntilShutdown {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let Some(stop) = self.stop.as_mut() else {
            return Poll::Ready(None);
        };
        if stop.as_mut().poll(cx).is_ready() {
            self.stop = None;
            // A trailers-only answer's headers are the status's trailers.
            let mut trailers = Status::unavailable("server is shutting down")
                .into_http::<Body>()
                .into_parts()
                .0
                .headers;
            trailers.remove(axum::http::header::CONTENT_TYPE);
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(&polled, Poll::Ready(None)) {
            self.stop = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.stop.is_none() || self.body.is_end_stream()
    }
}

/// What a call's end is recorded with.
struct Done {
    state: AppState,
    method: &'static str,
    start: Instant,
    /// The call's span: its log lines', and, `exported`, an OTLP span.
    span: tracing::Span,
    exported: bool,
}

impl Done {
    /// Counts and logs the call; `failure`: its status, unless it ended OK.
    fn finish(self, failure: Option<&Status>) {
        let code = failure.map_or(Code::Ok, Status::code);
        let name = code_name(code);
        self.state.http_metrics().record_grpc(self.method, name);
        let ms = (self.start.elapsed().as_secs_f64() * 1e6).round() / 1e3;
        let _in_span = self.span.enter();
        tracing::info!(method = %self.method, code = %name, ms, "gRPC call done");
        if self.exported {
            self.span.record("rpc.grpc.status_code", code as i64);
        }
        let Some(status) = failure else {
            return;
        };
        // A method the model cannot answer is FAILED_PRECONDITION too, but
        // the client's mistake (HTTP's 400): marked so by `status::status`.
        let server_side = matches!(
            code,
            Code::Internal
                | Code::Unavailable
                | Code::FailedPrecondition
                | Code::Unknown
                | Code::DataLoss
        ) && !status.metadata().contains_key(CLIENT_FAULT);
        // OpenTelemetry's gRPC conventions: a server span fails on the
        // server's errors, and on a deadline it missed or a method it lacks.
        let span_error =
            server_side || matches!(code, Code::DeadlineExceeded | Code::Unimplemented);
        if self.exported && span_error {
            self.span.record("otel.status_code", "ERROR");
        }
        if server_side {
            tracing::warn!("gRPC call failed: {}", LogSafe(status.message()));
        } else {
            tracing::debug!("gRPC call refused: {}", LogSafe(status.message()));
        }
    }
}

/// A call's answer, recording the call when its trailers (its status) go
/// out, or as `CANCELLED` when it is dropped before: the client left.
struct Watched {
    body: Body,
    done: Option<Done>,
    /// The call's span, entered while the answer is made (a stream's
    /// messages are read and answered as it is polled).
    span: tracing::Span,
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let span = self.span.clone();
        let _in_span = span.enter();
        let mut polled = Pin::new(&mut self.body).poll_frame(cx);
        match &mut polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_mut() {
                    let status = Status::from_header_map(trailers)
                        .unwrap_or_else(|| Status::unknown("the answer ended without a status"));
                    trailers.remove(CLIENT_FAULT);
                    if let Some(done) = self.done.take() {
                        done.finish((status.code() != Code::Ok).then_some(&status));
                    }
                }
            }
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => {
                if let Some(done) = self.done.take() {
                    let status = Status::unknown("the answer ended without a status");
                    done.finish(Some(&status));
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done.finish(Some(&Status::cancelled(
                "the client left before the answer",
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    #[test]
    fn the_key_is_a_bearer_token() {
        let headers = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("authorization", HeaderValue::from_str(v).unwrap());
            h
        };
        assert!(carries_api_key(&headers("Bearer k1"), "k1"));
        assert!(carries_api_key(&headers("bearer k1"), "k1"));
        assert!(!carries_api_key(&headers("Bearer k2"), "k1"));
        assert!(!carries_api_key(&headers("k1"), "k1"));
        assert!(!carries_api_key(&HeaderMap::new(), "k1"));
    }

    #[test]
    fn every_method_of_the_proto_is_listed() {
        assert_eq!(METHODS.len(), 21);
    }
}
