//! `--otlp-endpoint` (TEI's flag): the server's spans exported over OTLP
//! gRPC to a collector. The one place that knows OpenTelemetry: the server
//! makes `request` spans (and says, through
//! [`mlx_embed_server::middleware::export_spans`], that they are exported),
//! the core its `tokenize`/`queue`/`inference` phase spans at debug level,
//! and this module turns those into OTLP, continuing a caller's W3C
//! `traceparent`.
//!
//! The export never holds a request or the exit: spans go into the SDK's
//! bounded queue (dropped when it is full) and a thread of its own sends
//! them, with each send bounded by [`EXPORT_TIMEOUT`]; at exit what is left
//! is flushed within [`FLUSH_AT_EXIT`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// `service.name` without `--otlp-service-name`: this server's own name, not
/// TEI's `text-embeddings-inference.server`, so a trace says which server
/// answered; a TEI command line that names one keeps it.
pub const DEFAULT_SERVICE_NAME: &str = "mlx-embed";

/// The most one export (one batch, with the exporter's retries) may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// The most the exit waits for the spans still queued to go out: an
/// unreachable collector delays a stop by this much at most.
pub const FLUSH_AT_EXIT: Duration = Duration::from_secs(4);

/// The most the start's reachability check waits for the collector.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// `url` if it can name a collector: `http://host:port` (OTLP gRPC's usual
/// port is 4317). `https` is refused: this build has no TLS client (export
/// to a collector or agent beside the server).
pub fn check_endpoint(url: &str) -> Result<String, String> {
    let url = url.trim();
    let bad = |why: &str| {
        Err(format!(
            "--otlp-endpoint {url}: {why}; give the collector's OTLP gRPC address, \
             e.g. http://localhost:4317"
        ))
    };
    let Ok(uri) = url.parse::<http::Uri>() else {
        return bad("not a URL");
    };
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return bad(
                "https is not supported (no TLS client in this build): send to a \
                 collector or agent beside the server over http",
            )
        }
        Some(other) => return bad(&format!("the scheme {other} is not http")),
        None => return bad("no scheme (http://)"),
    }
    if uri.host().is_none_or(str::is_empty) {
        return bad("no host");
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        // gRPC calls its own path; a `/v1/traces` is OTLP over HTTP's.
        return bad("a path (OTLP over HTTP's /v1/traces?) is not an OTLP gRPC address");
    }
    Ok(url.to_owned())
}

/// The export's parts the process keeps until its end.
pub struct Export {
    provider: SdkTracerProvider,
    /// The runtime the gRPC channel runs on: the server's own runtime is
    /// made later and ends before the final flush, and a second `serve` in
    /// one Python process keeps the first's subscriber.
    runtime: tokio::runtime::Runtime,
}

/// The tracer the subscriber's OpenTelemetry layer writes to, and the
/// export behind it. Starts nothing that could fail later than here, bar
/// the collector being away (a warning, once [`Export::probe`] runs).
pub fn start(
    endpoint: &str,
    service_name: &str,
) -> Result<(Export, opentelemetry_sdk::trace::Tracer), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("mlx-embed-otlp")
        .enable_all()
        .build()
        .map_err(|err| format!("could not start the OTLP export's runtime: {err}"))?;
    // tonic's channel starts its connection task on the runtime it is made in.
    let exporter = {
        let _in_runtime = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|err| format!("--otlp-endpoint {endpoint}: {err}"))?
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(Reporting {
            inner: exporter,
            endpoint: endpoint.to_owned(),
            failing: AtomicBool::new(false),
        })
        .with_resource(
            opentelemetry_sdk::Resource::builder_empty()
                .with_service_name(service_name.to_owned())
                .build(),
        )
        .build();
    let tracer = provider.tracer("mlx-embed");
    Ok((Export { provider, runtime }, tracer))
}

impl Export {
    /// Checks, in the background, that something answers at `endpoint`,
    /// and warns if not. Called once the subscriber is installed: a refusal
    /// comes back at once, and its warning said before would be lost.
    pub fn probe(&self, endpoint: &str) {
        self.runtime.spawn(probe(endpoint.to_owned()));
    }

    /// Sends the spans still queued, waiting [`FLUSH_AT_EXIT`] at most.
    pub fn finish(self) {
        if let Err(err) = self.provider.shutdown_with_timeout(FLUSH_AT_EXIT) {
            tracing::warn!("OTLP export: the last spans were not all sent: {err}");
        }
        self.runtime.shutdown_timeout(Duration::from_millis(200));
    }
}

/// Warns at start when nothing answers at the collector's address: the
/// server serves on and its spans are dropped until one does.
async fn probe(endpoint: String) {
    let Ok(uri) = endpoint.parse::<http::Uri>() else {
        return;
    };
    let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
    let port = uri.port_u16().unwrap_or(80);
    let reached =
        tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect((host, port))).await;
    let why = match reached {
        Ok(Ok(_)) => return,
        Ok(Err(err)) => err.to_string(),
        Err(_) => format!("no answer within {PROBE_TIMEOUT:?}"),
    };
    tracing::warn!(
        "OTLP export: the collector at {endpoint} cannot be reached ({why}); serving on, \
         spans are dropped until it answers"
    );
}

/// The OTLP exporter, saying in the log when its exports start failing and
/// when they work again (once each, not per batch).
#[derive(Debug)]
struct Reporting {
    inner: opentelemetry_otlp::SpanExporter,
    endpoint: String,
    failing: AtomicBool,
}

impl opentelemetry_sdk::trace::SpanExporter for Reporting {
    async fn export(&self, batch: Vec<SpanData>) -> opentelemetry_sdk::error::OTelSdkResult {
        let n = batch.len();
        let sent = self.inner.export(batch).await;
        match &sent {
            Err(err) if !self.failing.swap(true, Ordering::Relaxed) => tracing::warn!(
                "OTLP export to {} failed, {n} spans dropped (said once until it works \
                 again): {err}",
                self.endpoint
            ),
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!("OTLP export to {} works again", self.endpoint)
            }
            _ => {}
        }
        sent
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The server's [`mlx_embed_server::middleware::ContinueTrace`]: a request
/// whose headers carry a valid W3C `traceparent` gets its span made a
/// child of that caller's span; any other starts a trace of its own.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    let caller = TraceContextPropagator::new().extract(&Headers(headers));
    if caller.span().span_context().is_valid() {
        let _ = span.set_parent(caller);
    }
}

struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_http_addresses() {
        assert_eq!(
            check_endpoint("http://127.0.0.1:4317").unwrap(),
            "http://127.0.0.1:4317"
        );
        assert!(check_endpoint("http://collector:4317/").is_ok());
        assert!(check_endpoint("http://[::1]:4317").is_ok());
        for (bad, why) in [
            ("localhost:4317", "no scheme"),
            ("collector", "no scheme"),
            ("https://collector:4317", "https is not supported"),
            ("http://collector:4318/v1/traces", "a path"),
            ("http://", "not a URL"),
            ("not a url", "not a URL"),
            ("ftp://collector", "the scheme ftp is not http"),
        ] {
            let err = check_endpoint(bad).unwrap_err();
            assert!(
                err.starts_with(&format!("--otlp-endpoint {bad}: {why}")),
                "{bad}: {err}"
            );
        }
    }
}
