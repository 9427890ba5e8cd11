//! Which requests' spans the OTLP export may take (own test binary: it
//! installs the process's global subscriber). A probe's or a scrape's span
//! has the target the export leaves out while the server is ready; once a
//! model is down (the probe answered 503), the same probe's is exported.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use mlx_embed_server::middleware::UNEXPORTED_TARGET;
use serde_json::json;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Every `request` span made: its target and its `route` field.
#[derive(Clone, Default)]
struct Spans {
    made: Arc<Mutex<Vec<(String, String)>>>,
    next_id: Arc<AtomicU64>,
}

struct Route(String);

impl Visit for Route {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "route" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        if span.metadata().name() == "request" {
            let mut route = Route(String::new());
            span.record(&mut route);
            let target = span.metadata().target().to_owned();
            self.made.lock().unwrap().push((target, route.0));
        }
        Id::from_u64(self.next_id.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Spans {
    /// The targets of the spans made for `route` since the last call.
    fn take(&self, route: &str) -> Vec<String> {
        let mut made = self.made.lock().unwrap();
        let (of, rest): (Vec<_>, Vec<_>) = made.drain(..).partition(|(_, r)| r == route);
        *made = rest;
        of.into_iter().map(|(t, _)| t).collect()
    }
}

#[tokio::test]
async fn a_probe_s_span_is_unexported_while_ready_and_exported_once_it_fails() {
    let spans = Spans::default();
    tracing::subscriber::set_global_default(spans.clone()).unwrap();
    let s = Server::default().await;
    spans.made.lock().unwrap().clear();
    let client = client();
    let exported = "mlx_embed_server::middleware";
    let unexported = UNEXPORTED_TARGET;

    for path in ["/health", "/ping", "/.well-known/ready", "/metrics"] {
        let r = client.get(s.url(path)).send().await.unwrap();
        assert!(r.status().is_success(), "{path}: {}", r.status());
        assert_eq!(spans.take(path), vec![unexported], "{path} while ready");
    }
    let r = client
        .post(s.url("/embed"))
        .json(&json!({ "inputs": "fine" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(spans.take("/embed"), vec![exported]);

    // The model dies: the probes fail, and their spans are exported.
    let r = client
        .post(s.url("/embed"))
        .json(&json!({ "inputs": "panic" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(spans.take("/embed"), vec![exported]);
    for path in ["/health", "/ping", "/.well-known/ready"] {
        let r = client.get(s.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 503, "{path}");
        assert_eq!(spans.take(path), vec![exported], "{path} failing");
    }
    // The scrape that shows the server down is in the trace too.
    let r = client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("mlx_embed_healthy 0"));
    assert_eq!(spans.take("/metrics"), vec![exported]);
    s.stop().await.unwrap();
}
