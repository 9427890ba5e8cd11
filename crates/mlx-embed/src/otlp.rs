//! `--otlp-endpoint` (TEI's flag): the server's spans exported over OTLP to
//! a collector, as the OpenTelemetry exporter spec configures it: gRPC or
//! HTTP/protobuf, TLS for an `https` endpoint (the system's roots, or the CA
//! `OTEL_EXPORTER_OTLP_CERTIFICATE` names, with the client certificate of
//! `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`/`_CLIENT_KEY` for mutual TLS),
//! `OTEL_EXPORTER_OTLP_HEADERS` on every export, gzip when
//! `OTEL_EXPORTER_OTLP_COMPRESSION` asks, each export bounded by
//! `OTEL_EXPORTER_OTLP_TIMEOUT`. The one place that knows OpenTelemetry: the server makes
//! `request` spans (and says, through
//! [`mlx_embed_server::middleware::export_spans`], that they are exported),
//! the core its `tokenize`/`queue`/`inference` phase spans at debug level,
//! and this module turns those into OTLP, continuing a caller's W3C
//! `traceparent`.
//!
//! The export never holds a request or the exit: spans go into the SDK's
//! bounded queue (dropped when it is full) and a thread of its own sends
//! them, with each send bounded by the timeout ([`DEFAULT_TIMEOUT`] unless
//! set); at exit what is left is flushed within that same timeout.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// `service.name` without `--otlp-service-name`: this server's own name, not
/// TEI's `text-embeddings-inference.server`, so a trace says which server
/// answered; a TEI command line that names one keeps it.
pub const DEFAULT_SERVICE_NAME: &str = "mlx-embed";

/// The export timeout without `OTEL_EXPORTER_OTLP_TIMEOUT`: the spec's 10 s.
/// It bounds an attempt's connect and its request (the gRPC channel's connect
/// and request timeouts; the HTTP client's, over both) and the time in which
/// the exporter starts retries, so one export (one batch) takes three times
/// it at worst; the exit waits this long at most for the spans still queued,
/// so an unreachable collector delays a stop by this much at most.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The variables that ask for compression, the signal's first: read by
/// [`Settings::resolve`], and by the exporter library itself.
const COMPRESSION_VARS: &[&str] = &[
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
];

/// The most the start's reachability check waits for the collector.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The path OTLP/HTTP's spans go to under a base endpoint (the spec's).
const TRACES_PATH: &str = "/v1/traces";

/// How spans travel to the collector (`OTEL_EXPORTER_OTLP_PROTOCOL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `grpc`: the `TraceService/Export` call (port 4317 by custom).
    Grpc,
    /// `http/protobuf`: a POST of the protobuf request to `/v1/traces`
    /// (port 4318 by custom).
    HttpProtobuf,
}

impl Protocol {
    /// The protocol a setting names; `source` (the flag or variable it came
    /// from) is for the error.
    pub fn parse(value: &str, source: &str) -> Result<Self, String> {
        match value.trim() {
            "grpc" => Ok(Self::Grpc),
            "http/protobuf" => Ok(Self::HttpProtobuf),
            "http/json" => Err(format!(
                "{source} http/json: OTLP/HTTP with JSON is not supported; give grpc or \
                 http/protobuf (OTLP/HTTP receivers all take protobuf)"
            )),
            other => Err(format!(
                "{source} {other:?}: not an OTLP protocol; give grpc or http/protobuf"
            )),
        }
    }

    /// The spec's name of it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Grpc => "grpc",
            Self::HttpProtobuf => "http/protobuf",
        }
    }
}

/// Where and how the spans are exported: the flags and the standard
/// `OTEL_*` variables, checked at start so that a wrong one is an error
/// there, not a silent loss of every span later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The URL spans are sent to: the collector's address for gRPC, the
    /// full `.../v1/traces` URL for OTLP/HTTP.
    pub endpoint: String,
    /// How they travel.
    pub protocol: Protocol,
    /// Sent with every export (gRPC metadata or HTTP headers), in order.
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// The PEM CA certificates an `https` collector's certificate must chain
    /// to, in place of the system's roots; `None`: the system's roots.
    pub ca: Option<Vec<u8>>,
    /// The client certificate and key shown to an `https` collector that
    /// asks for one (mutual TLS); `None`: none.
    pub client: Option<ClientIdentity>,
    /// Whether each export's body is gzipped (`grpc-encoding: gzip`,
    /// `Content-Encoding: gzip`).
    pub gzip: bool,
    /// The most one export may take; the most the exit waits for the rest.
    pub timeout: Duration,
    /// The resource's `service.name`.
    pub service_name: String,
}

/// A client certificate chain and its private key, both PEM, checked to
/// match; `Debug` prints neither.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The PEM certificate chain, the client's own certificate first.
    pub cert: Vec<u8>,
    /// The PEM private key of the first certificate.
    key: Vec<u8>,
}

impl std::fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentity").finish_non_exhaustive()
    }
}

/// The flags that configure the export (each `None` when not given); the
/// standard variables fill in the rest.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flags<'a> {
    /// `--otlp-endpoint`: the collector, a base URL as
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` is.
    pub endpoint: Option<&'a str>,
    /// `--otlp-protocol`.
    pub protocol: Option<&'a str>,
    /// `--otlp-compression`.
    pub compression: Option<&'a str>,
    /// `--otlp-service-name`.
    pub service_name: Option<&'a str>,
}

/// The first of `names` set (and not blank) in `env`, with its name.
fn first_set(
    env: &impl Fn(&str) -> Option<String>,
    names: &[&'static str],
) -> Option<(&'static str, String)> {
    names.iter().find_map(|&name| {
        env(name)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (name, v))
    })
}

impl Settings {
    /// The export `flags` and `env` (the process's variables, read by name)
    /// ask for, checked; `None` when neither names a collector. A flag wins
    /// over its variable, a `TRACES_` variable over the generic one, as the
    /// spec orders them; `read` reads the certificate file.
    pub fn resolve(
        flags: Flags<'_>,
        env: impl Fn(&str) -> Option<String>,
        read: impl Fn(&str) -> std::io::Result<Vec<u8>>,
    ) -> Result<Option<Self>, String> {
        // (source, URL, what OTLP/HTTP makes of its path)
        let endpoint = match flags.endpoint.filter(|e| !e.trim().is_empty()) {
            Some(endpoint) => ("--otlp-endpoint", endpoint.trim().to_owned(), Path::Flag),
            None => match first_set(
                &env,
                &[
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "OTEL_EXPORTER_OTLP_ENDPOINT",
                ],
            ) {
                Some((name, endpoint)) => (
                    name,
                    endpoint.trim().to_owned(),
                    if name == "OTEL_EXPORTER_OTLP_ENDPOINT" {
                        Path::Base
                    } else {
                        Path::AsIs
                    },
                ),
                None => return Ok(None),
            },
        };
        let protocol = match flags.protocol {
            Some(protocol) => Protocol::parse(protocol, "--otlp-protocol")?,
            None => match first_set(
                &env,
                &[
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                    "OTEL_EXPORTER_OTLP_PROTOCOL",
                ],
            ) {
                Some((name, protocol)) => Protocol::parse(&protocol, name)?,
                None => Protocol::Grpc,
            },
        };
        let (source, url, path) = endpoint;
        let endpoint = check_endpoint(&url, source, protocol, path)?;
        let headers = match first_set(
            &env,
            &[
                "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                "OTEL_EXPORTER_OTLP_HEADERS",
            ],
        ) {
            Some((name, list)) => {
                let headers = parse_headers(&list).map_err(|why| format!("{name}: {why}"))?;
                if protocol == Protocol::Grpc {
                    check_binary_metadata(&headers).map_err(|why| format!("{name}: {why}"))?;
                }
                headers
            }
            None => Vec::new(),
        };
        let gzip = match flags.compression {
            Some(value) => parse_compression(value, "--otlp-compression")?,
            None => match first_set(&env, COMPRESSION_VARS) {
                Some((name, value)) => parse_compression(&value, name)?,
                None => false,
            },
        };
        let timeout = match first_set(
            &env,
            &[
                "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
                "OTEL_EXPORTER_OTLP_TIMEOUT",
            ],
        ) {
            Some((name, value)) => parse_timeout(&value, name)?,
            None => DEFAULT_TIMEOUT,
        };
        let tls = endpoint.starts_with("https://");
        if !tls {
            check_no_client_files(&env, source, &endpoint)?;
        }
        let client = client_identity(&env, &read)?;
        // Over http a CA file is not read: [`unapplied`] says it is ignored.
        let ca = match first_set(&env, CA_VARS).filter(|_| tls) {
            Some((name, path)) => Some(read_ca(name, path.trim(), &read)?),
            None => None,
        };
        let service_name = flags
            .service_name
            .map(str::to_owned)
            .or_else(|| env("OTEL_SERVICE_NAME"))
            .filter(|name| !name.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned());
        Ok(Some(Self {
            endpoint,
            protocol,
            headers,
            ca,
            client,
            gzip,
            timeout,
            service_name,
        }))
    }

    /// The value `OTEL_EXPORTER_OTLP_TRACES_COMPRESSION` must be given in
    /// the process's environment before [`start`] for the export to compress
    /// as these settings say, if any. The exporter library reads the
    /// compression variables itself when not told gzip, and has no way to be
    /// told none: `--otlp-compression none` would lose to a `gzip` there.
    pub fn compression_for_exporter(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Option<&'static str> {
        let asked = first_set(&env, COMPRESSION_VARS);
        (!self.gzip && asked.is_some()).then_some("none")
    }

    fn tls(&self) -> bool {
        self.endpoint.starts_with("https://")
    }

    /// How the start's log line says where spans go.
    pub fn describe(&self) -> String {
        let how = match self.protocol {
            Protocol::Grpc => "OTLP gRPC",
            Protocol::HttpProtobuf => "OTLP/HTTP protobuf",
        };
        let tls = match (self.tls(), &self.ca) {
            (false, _) => "",
            (true, None) => " with TLS (the system's CA certificates)",
            (true, Some(_)) => " with TLS (the CA certificates of the given file)",
        };
        let client = match self.client {
            Some(_) => " and a client certificate",
            None => "",
        };
        let headers = match self.headers.len() {
            0 => String::new(),
            n => format!(", {n} header(s) on each export"),
        };
        let gzip = if self.gzip { ", gzipped" } else { "" };
        // Some hosted collectors take a key in the query string: never log it.
        let endpoint = match self.endpoint.split_once('?') {
            Some((path, _)) => format!("{path}?<query not shown>"),
            None => self.endpoint.clone(),
        };
        format!(
            "{endpoint} over {how}{tls}{client} as {}{headers}{gzip}, {} ms at most per export",
            self.service_name,
            self.timeout.as_millis()
        )
    }
}

/// What OTLP/HTTP makes of an endpoint's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`: a base, to which `/v1/traces` is
    /// always added, as the spec says (`.../v1/traces` becomes
    /// `.../v1/traces/v1/traces`).
    Base,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: the full URL, used as is.
    AsIs,
    /// `--otlp-endpoint` (TEI's flag, a gRPC address there): a base, to
    /// which `/v1/traces` is added unless its path ends so already (a
    /// trailing `/` dropped), so that both the base and the full URL work.
    Flag,
}

/// `url` checked as the collector `source` names for `protocol`, as spans
/// will be sent to it: `http(s)://host[:port]` for gRPC (gRPC calls its own
/// path); for OTLP/HTTP, the full URL `path` says.
pub fn check_endpoint(
    url: &str,
    source: &str,
    protocol: Protocol,
    path: Path,
) -> Result<String, String> {
    let url = url.trim();
    let example = match protocol {
        Protocol::Grpc => "the collector's OTLP gRPC address, e.g. http://localhost:4317",
        Protocol::HttpProtobuf => "the collector's OTLP/HTTP address, e.g. http://localhost:4318",
    };
    let bad = |why: &str| Err(format!("{source} {url}: {why}; give {example}"));
    let Ok(uri) = url.parse::<http::Uri>() else {
        return bad("not a URL");
    };
    // A password in the URL would be printed wherever the endpoint is (the
    // start's line, each failed export's warning): not even this error says it.
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(format!(
            "{source}: credentials in the URL (user@host) are not supported; give them as a header, \
             e.g. OTEL_EXPORTER_OTLP_HEADERS=authorization=Basic%20..."
        ));
    }
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => return bad(&format!("the scheme {other} is not http or https")),
        None => return bad("no scheme (http:// or https://)"),
    }
    if uri.host().is_none_or(str::is_empty) {
        return bad("no host");
    }
    // `http::Uri` drops a fragment: `/otlp#x` + `/v1/traces` would POST to `/otlp`.
    if url.contains('#') {
        return bad("a fragment (#...) is not part of an endpoint");
    }
    // The scheme is case-insensitive (`HTTPS://`), and whether TLS is used is
    // read from this string later: lower-cased, as `http::Uri` reads it.
    let url = match url.split_once("://") {
        Some((scheme, rest)) => format!("{}://{rest}", scheme.to_ascii_lowercase()),
        None => url.to_owned(),
    };
    match protocol {
        Protocol::Grpc => {
            if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
                return bad(
                    "a path is not part of an OTLP gRPC address (for OTLP over HTTP's \
                     /v1/traces, set --otlp-protocol http/protobuf)",
                );
            }
            Ok(url)
        }
        Protocol::HttpProtobuf
            if path == Path::Base
                || (path == Path::Flag
                    && !uri.path().trim_end_matches('/').ends_with(TRACES_PATH)) =>
        {
            if uri.query().is_some() {
                return bad("a base endpoint with a query cannot take /v1/traces");
            }
            Ok(format!("{}{TRACES_PATH}", url.trim_end_matches('/')))
        }
        // The flag's full URL: a receiver routes `/v1/traces` exactly (the
        // collector's answers `/v1/traces/` 404), so a trailing `/` goes.
        Protocol::HttpProtobuf if path == Path::Flag && uri.query().is_none() => {
            Ok(url.trim_end_matches('/').to_owned())
        }
        Protocol::HttpProtobuf => Ok(url),
    }
}

/// The standard variables set in `env` that the export to `settings` does
/// not apply, each as the start says it: `INSECURE`, which the spec applies
/// to a gRPC endpoint without a scheme only, and such an endpoint is refused
/// (the spec has every exporter take `http://`/`https://`, whose scheme wins
/// over it); a CA file with an `http` endpoint, which has no TLS.
pub fn unapplied(settings: &Settings, env: impl Fn(&str) -> Option<String>) -> Vec<String> {
    let mut said = Vec::new();
    if !settings.endpoint.starts_with("https://") {
        for name in CA_VARS {
            if env(name).is_some_and(|v| !v.trim().is_empty()) {
                said.push(format!(
                    "{name} is ignored: the endpoint {} is http, which has no TLS, so the spans \
                     go in plain text to a collector no certificate is checked for; give an \
                     https endpoint for the CA file to apply",
                    settings.endpoint
                ));
            }
        }
    }
    for signal in ["OTEL_EXPORTER_OTLP_TRACES_", "OTEL_EXPORTER_OTLP_"] {
        let var = |suffix: &str| {
            let name = format!("{signal}{suffix}");
            env(&name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .map(|v| (name, v))
        };
        if let Some((name, value)) = var("INSECURE") {
            said.push(format!(
                "{name} {value} is ignored: the endpoint's scheme says whether TLS is used \
                 (https) or not (http)"
            ));
        }
    }
    said
}

/// `OTEL_EXPORTER_OTLP_HEADERS`' `key=value,key2=value2`, values
/// percent-decoded, as the spec writes it (the W3C baggage format, without
/// properties); a list with an entry that is not one is an error.
pub fn parse_headers(list: &str) -> Result<Vec<(http::HeaderName, http::HeaderValue)>, String> {
    let mut headers = Vec::new();
    let entries = list.split(',').map(str::trim).filter(|e| !e.is_empty());
    // A malformed entry is named by its place, never its text: it may be a
    // credential written wrong (`authorization: Bearer ...`).
    for (n, entry) in (1..).zip(entries) {
        let Some((key, value)) = entry.split_once('=') else {
            return Err(format!("entry {n} is not key=value"));
        };
        let (key, value) = (key.trim(), value.trim());
        let name = http::HeaderName::from_bytes(key.as_bytes())
            .map_err(|_| format!("entry {n}: the text before = is not a header name"))?;
        let decoded = percent_decode(value)
            .ok_or_else(|| format!("the value of {key} is not percent-encoded UTF-8"))?;
        let mut value = http::HeaderValue::from_str(&decoded)
            .map_err(|_| format!("the value of {key} has a character a header cannot carry"))?;
        // Likely a credential: `Debug` (of `Settings` too) prints no value.
        value.set_sensitive(true);
        headers.push((name, value));
    }
    Ok(headers)
}

/// Whether the compression `value` (from `source`) asks for gzip: `gzip` or
/// `none`, the two the spec names; any other is an error, not a silent
/// `none`.
pub fn parse_compression(value: &str, source: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "gzip" => Ok(true),
        "none" => Ok(false),
        _ => Err(format!(
            "{source} {:?}: not an OTLP compression; give gzip or none",
            value.trim()
        )),
    }
}

/// The export timeout `value` (from `source`) gives: a whole number of
/// milliseconds, as the spec writes it, above 0.
pub fn parse_timeout(value: &str, source: &str) -> Result<Duration, String> {
    match value.trim().parse::<u64>() {
        Ok(0) => Err(format!(
            "{source} 0: an export given no time never succeeds; give the most one export \
             may take, in milliseconds (the spec's default is 10000)"
        )),
        Ok(ms) => Ok(Duration::from_millis(ms)),
        Err(_) => Err(format!(
            "{source} {:?}: not a whole number of milliseconds; give e.g. 10000 (the spec's \
             default)",
            value.trim()
        )),
    }
}

/// gRPC sends a `-bin` metadata value base64-encoded, and tonic sends the
/// value given as that encoding: one that is not base64 would reach the
/// collector as bytes it cannot decode (an export it refuses), so it is
/// refused here, by the header's name (its value may be a credential).
fn check_binary_metadata(headers: &[(http::HeaderName, http::HeaderValue)]) -> Result<(), String> {
    use base64::Engine as _;
    // The gRPC spec has receivers accept base64 with or without padding.
    const BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    for (name, value) in headers {
        if name.as_str().ends_with("-bin") && BASE64.decode(value.as_bytes()).is_err() {
            return Err(format!(
                "the value of {name} is not base64: gRPC metadata whose key ends in -bin is \
                 binary, sent base64-encoded; give the bytes base64-encoded, or a key without -bin"
            ));
        }
    }
    Ok(())
}

/// The variables naming the CA certificates a collector's TLS certificate
/// must chain to, the signal's first.
const CA_VARS: &[&str] = &[
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
];

/// The variables naming the client certificate and key (mutual TLS), the
/// signal's first.
const CLIENT_VARS: &[&str] = &[
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
];

/// Refuses, for `endpoint` (an `http` one: no TLS), a client certificate
/// or key `env` names, before either is read: whoever gives one expects the
/// collector to see it, and over `http` it sees none. (A CA file is only
/// said to be ignored, [`unapplied`]: the spec applies it to secure
/// connections only, every SDK ignores it over `http`, and it is often set
/// for all of a host's exporters, so refusing it would stop a server whose
/// traces go to a local `http` agent.)
fn check_no_client_files(
    env: &impl Fn(&str) -> Option<String>,
    source: &str,
    endpoint: &str,
) -> Result<(), String> {
    if let Some((name, _)) = first_set(env, CLIENT_VARS) {
        return Err(format!(
            "{source} {endpoint}: {name} is for mutual TLS (the client certificate and key shown \
             to the collector), and an http endpoint has no TLS; give an https endpoint, or \
             leave the client certificate and key unset"
        ));
    }
    Ok(())
}

/// The client certificate and key (mutual TLS) the standard variables in
/// `env` name, read with `read` and checked: both or neither, each a PEM
/// file of its kind, the key the certificate's. Errors name the variable
/// and the file, never what the key holds.
fn client_identity(
    env: &impl Fn(&str) -> Option<String>,
    read: &impl Fn(&str) -> std::io::Result<Vec<u8>>,
) -> Result<Option<ClientIdentity>, String> {
    let cert = first_set(env, &CLIENT_VARS[..2]);
    let key = first_set(env, &CLIENT_VARS[2..]);
    let ((cert_var, cert_path), (key_var, key_path)) = match (cert, key) {
        (None, None) => return Ok(None),
        (Some(cert), Some(key)) => (cert, key),
        (Some((name, _)), None) => {
            return Err(format!(
                "{name} is set without OTEL_EXPORTER_OTLP_CLIENT_KEY (or \
                 OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY): mutual TLS takes the client certificate \
                 and its private key; set both or neither"
            ))
        }
        (None, Some((name, _))) => {
            return Err(format!(
                "{name} is set without OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE (or \
                 OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE): mutual TLS takes the client \
                 certificate and its private key; set both or neither"
            ))
        }
    };
    let (cert_path, key_path) = (cert_path.trim(), key_path.trim());
    let cert =
        read(cert_path).map_err(|err| format!("{cert_var} {cert_path}: cannot be read: {err}"))?;
    let key =
        read(key_path).map_err(|err| format!("{key_var} {key_path}: cannot be read: {err}"))?;
    let chain = CertificateDer::pem_slice_iter(&cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("{cert_var} {cert_path}: not a PEM certificate file: {err}"))?;
    if chain.is_empty() {
        return Err(format!(
            "{cert_var} {cert_path}: no certificate in it (a PEM file, \
             -----BEGIN CERTIFICATE-----)"
        ));
    }
    // The key's parse error may quote a line of the file: not said.
    let der = PrivateKeyDer::from_pem_slice(&key).map_err(|_| {
        format!(
            "{key_var} {key_path}: no private key in it (a PEM file, -----BEGIN PRIVATE KEY-----, \
             RSA or EC)"
        )
    })?;
    let provider = rustls::crypto::ring::default_provider();
    let signing = provider.key_provider.load_private_key(der).map_err(|_| {
        format!("{key_var} {key_path}: the key cannot sign for TLS (RSA, ECDSA or Ed25519)")
    })?;
    match rustls::sign::CertifiedKey::new(chain, signing).keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(rustls::Error::InconsistentKeys(_)) => {
            return Err(format!(
                "{key_var} {key_path}: the key is not the one of the certificate in {cert_var} \
                 {cert_path}"
            ))
        }
        // (The HTTP client's TLS would refuse it the same way at start.)
        Err(err) => {
            return Err(format!(
                "{cert_var} {cert_path}: the first certificate cannot be used (an X.509 v3 \
                 certificate): {err}"
            ))
        }
    }
    Ok(Some(ClientIdentity { cert, key }))
}

/// `value` with each `%XX` replaced by its byte; `None` for a `%` not
/// followed by two hex digits or bytes that are not UTF-8.
fn percent_decode(value: &str) -> Option<String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            // (`from_str_radix` alone would take a sign: "%+1".)
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The PEM file `path` (named by the variable `name`), read and checked to
/// hold CA certificates, one at least, that TLS can trust.
fn read_ca(
    name: &str,
    path: &str,
    read: &impl Fn(&str) -> std::io::Result<Vec<u8>>,
) -> Result<Vec<u8>, String> {
    let pem = read(path).map_err(|err| format!("{name} {path}: cannot be read: {err}"))?;
    roots_of(&pem).map_err(|why| format!("{name} {path}: {why}"))?;
    Ok(pem)
}

/// The certificates of the PEM `pem` as TLS roots; an error when one is
/// not a certificate or there is none.
fn roots_of(pem: &[u8]) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|err| format!("not a PEM certificate file: {err}"))?;
        roots
            .add(cert)
            .map_err(|err| format!("a certificate in it cannot be a TLS root: {err}"))?;
    }
    if roots.is_empty() {
        return Err("no certificate in it (a PEM file of CA certificates, \
                    -----BEGIN CERTIFICATE-----)"
            .to_owned());
    }
    Ok(roots)
}

/// The export's parts the process keeps until its end.
pub struct Export {
    provider: SdkTracerProvider,
    /// The runtime the exporter's client runs on: the server's own runtime
    /// is made later and ends before the final flush, and a second `serve`
    /// in one Python process keeps the first's subscriber.
    runtime: tokio::runtime::Runtime,
    /// The export's timeout, which bounds the flush at exit too.
    timeout: Duration,
}

/// The tracer the subscriber's OpenTelemetry layer writes to, and the
/// export behind it. Starts nothing that could fail later than here, bar
/// the collector being away (a warning, once [`Export::probe`] runs).
pub fn start(settings: &Settings) -> Result<(Export, opentelemetry_sdk::trace::Tracer), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("mlx-embed-otlp")
        .enable_all()
        .build()
        .map_err(|err| format!("could not start the OTLP export's runtime: {err}"))?;
    let endpoint = &settings.endpoint;
    let failed = |err: &dyn std::fmt::Display| format!("OTLP export to {endpoint}: {err}");
    // tonic's channel starts its connection task on the runtime it is made in.
    let exporter = {
        let _in_runtime = runtime.enter();
        match settings.protocol {
            Protocol::Grpc => {
                use opentelemetry_otlp::tonic_types::{metadata::MetadataMap, transport};
                let mut metadata = http::HeaderMap::new();
                for (name, value) in &settings.headers {
                    metadata.append(name.clone(), value.clone());
                }
                // The channel is made here, not by the exporter, for its
                // connect timeout: tonic has none by default and its request
                // timeout starts once connected, so a collector whose address
                // drops SYNs held each export for the system's connect
                // timeout (minutes), not OTEL_EXPORTER_OTLP_TIMEOUT.
                let mut channel = tonic::transport::Endpoint::from_shared(endpoint.clone())
                    .map_err(|err| failed(&err))?
                    .timeout(settings.timeout)
                    .connect_timeout(settings.timeout);
                if settings.tls() {
                    // tonic's own TLS default trusts no root at all.
                    let tls = transport::ClientTlsConfig::new();
                    let mut tls = match &settings.ca {
                        Some(pem) => tls.ca_certificate(transport::Certificate::from_pem(pem)),
                        None => tls.with_native_roots(),
                    };
                    if let Some(client) = &settings.client {
                        tls =
                            tls.identity(transport::Identity::from_pem(&client.cert, &client.key));
                    }
                    channel = channel.tls_config(tls).map_err(|err| failed(&err))?;
                }
                let mut builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_channel(channel.connect_lazy())
                    .with_timeout(settings.timeout)
                    .with_metadata(MetadataMap::from_headers(metadata));
                if settings.gzip {
                    builder = builder.with_compression(opentelemetry_otlp::Compression::Gzip);
                }
                builder.build().map_err(|err| failed(&err))?
            }
            Protocol::HttpProtobuf => {
                let mut builder = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(endpoint)
                    .with_timeout(settings.timeout)
                    .with_http_client(HttpsClient::new(settings, runtime.handle().clone())?);
                if settings.gzip {
                    builder = builder.with_compression(opentelemetry_otlp::Compression::Gzip);
                }
                builder.build().map_err(|err| failed(&err))?
            }
        }
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(Reporting {
            inner: exporter,
            endpoint: endpoint.to_owned(),
            failing: AtomicBool::new(false),
        })
        .with_resource(
            opentelemetry_sdk::Resource::builder_empty()
                .with_service_name(settings.service_name.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer("mlx-embed");
    let timeout = settings.timeout;
    Ok((
        Export {
            provider,
            runtime,
            timeout,
        },
        tracer,
    ))
}

/// OTLP/HTTP's client: hyper's, over rustls for `https`, putting the
/// settings' headers on every request (over the SDK's own reading of the
/// variables, which decodes a value twice when given it), each request run
/// on the export's runtime: the SDK's batch thread polls the export outside
/// any, and hyper spawns its connections on the one it is called in.
struct HttpsClient {
    inner: opentelemetry_http::hyper::HyperClient<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    >,
    headers: Vec<(http::HeaderName, http::HeaderValue)>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for HttpsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsClient").finish_non_exhaustive()
    }
}

impl HttpsClient {
    fn new(settings: &Settings, runtime: tokio::runtime::Handle) -> Result<Self, String> {
        let roots = match &settings.ca {
            Some(pem) => roots_of(pem).map_err(|why| format!("the OTLP CA file: {why}"))?,
            None if settings.tls() => {
                // Unreadable ones are skipped, as tonic's native roots skip them.
                let mut roots = rustls::RootCertStore::empty();
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
                if roots.is_empty() {
                    return Err(format!(
                        "OTLP export to {}: no CA certificate found on this system to check \
                         the collector's with; name one with OTEL_EXPORTER_OTLP_CERTIFICATE",
                        settings.endpoint
                    ));
                }
                roots
            }
            None => rustls::RootCertStore::empty(),
        };
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|err| format!("OTLP export's TLS: {err}"))?
        .with_root_certificates(roots);
        let tls = match &settings.client {
            Some(client) => {
                let chain = CertificateDer::pem_slice_iter(&client.cert)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|err| format!("the OTLP client certificate: {err}"))?;
                let key = PrivateKeyDer::from_pem_slice(&client.key)
                    .map_err(|_| "the OTLP client key: not a PEM private key".to_owned())?;
                tls.with_client_auth_cert(chain, key)
                    .map_err(|err| format!("the OTLP client certificate: {err}"))?
            }
            None => tls.with_no_client_auth(),
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(Self {
            inner: opentelemetry_http::hyper::HyperClient::new(connector, settings.timeout, None),
            headers: settings.headers.clone(),
            runtime,
        })
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for HttpsClient {
    async fn send_bytes(
        &self,
        mut request: http::Request<opentelemetry_http::Bytes>,
    ) -> Result<http::Response<opentelemetry_http::Bytes>, opentelemetry_http::HttpError> {
        let headers = request.headers_mut();
        for (name, _) in &self.headers {
            headers.remove(name);
        }
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        let inner = self.inner.clone();
        let sent = self
            .runtime
            .spawn(async move { inner.send_bytes(request).await });
        sent.await?
    }
}

impl Export {
    /// Checks, in the background, that something answers at `endpoint`,
    /// and warns if not. Called once the subscriber is installed: a refusal
    /// comes back at once, and its warning said before would be lost.
    pub fn probe(&self, endpoint: &str) {
        self.runtime.spawn(probe(endpoint.to_owned()));
    }

    /// Sends the spans still queued, waiting the export's timeout at most.
    pub fn finish(self) {
        if let Err(err) = self.provider.shutdown_with_timeout(self.timeout) {
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
    let default_port = if uri.scheme_str() == Some("https") {
        443
    } else {
        80
    };
    let port = uri.port_u16().unwrap_or(default_port);
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
    fn endpoints_are_http_or_https_addresses() {
        let grpc = |url: &str| check_endpoint(url, "--otlp-endpoint", Protocol::Grpc, Path::Flag);
        assert_eq!(
            grpc("http://127.0.0.1:4317").unwrap(),
            "http://127.0.0.1:4317"
        );
        assert_eq!(
            grpc("https://api.honeycomb.io:443").unwrap(),
            "https://api.honeycomb.io:443"
        );
        assert!(grpc("http://collector:4317/").is_ok());
        assert!(grpc("http://[::1]:4317").is_ok());
        // The scheme's case is not the user's to get right: TLS is read from it.
        assert_eq!(grpc("HTTPS://c:4317").unwrap(), "https://c:4317");
        for (bad, why) in [
            ("localhost:4317", "no scheme"),
            ("collector", "no scheme"),
            (
                "http://collector:4318/v1/traces",
                "a path is not part of an OTLP gRPC address",
            ),
            ("http://", "not a URL"),
            ("not a url", "not a URL"),
            ("ftp://collector", "the scheme ftp is not http or https"),
            (
                "http://collector:4317#x",
                "a fragment (#...) is not part of an endpoint",
            ),
        ] {
            let err = grpc(bad).unwrap_err();
            assert!(
                err.starts_with(&format!("--otlp-endpoint {bad}: {why}")),
                "{bad}: {err}"
            );
        }
        // The password is said nowhere, this error included.
        let err = grpc("https://user:s3cret@collector:4317").unwrap_err();
        assert!(
            err.starts_with(
                "--otlp-endpoint: credentials in the URL (user@host) are not supported"
            ) && !err.contains("s3cret"),
            "{err}"
        );
        let http = |url: &str, path| {
            check_endpoint(
                url,
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                Protocol::HttpProtobuf,
                path,
            )
        };
        for path in [Path::Base, Path::Flag] {
            assert_eq!(
                http("http://c:4318", path).unwrap(),
                "http://c:4318/v1/traces"
            );
            assert_eq!(
                http("http://c:4318/", path).unwrap(),
                "http://c:4318/v1/traces"
            );
            assert_eq!(
                http("https://c/otlp", path).unwrap(),
                "https://c/otlp/v1/traces"
            );
            assert!(http("http://c:4318/?a=1", path)
                .unwrap_err()
                .contains("a base endpoint with a query cannot take /v1/traces"));
        }
        assert_eq!(
            http("Https://c/otlp", Path::Base).unwrap(),
            "https://c/otlp/v1/traces"
        );
        assert!(http("http://c:4318/otlp#x", Path::Base)
            .unwrap_err()
            .contains("a fragment (#...) is not part of an endpoint"));
        // The generic variable is a base whatever its path (the spec's rule);
        // the flag takes the full URL too; the signal's variable is as is.
        assert_eq!(
            http("http://c:4318/v1/traces", Path::Base).unwrap(),
            "http://c:4318/v1/traces/v1/traces"
        );
        assert_eq!(
            http("http://c:4318/v1/traces/", Path::Flag).unwrap(),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            http("http://c:4318/v1/traces?tenant=a", Path::Flag).unwrap(),
            "http://c:4318/v1/traces?tenant=a"
        );
        // The signal's variable keeps even its trailing `/`: as is.
        assert_eq!(
            http("http://c:4318/v1/traces/", Path::AsIs).unwrap(),
            "http://c:4318/v1/traces/"
        );
        assert_eq!(
            http("https://c/otlp", Path::AsIs).unwrap(),
            "https://c/otlp"
        );
    }

    #[test]
    fn variables_the_export_does_not_apply_are_said() {
        let vars = [
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "10000"),
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip"),
            ("OTEL_EXPORTER_OTLP_INSECURE", "true"),
        ];
        let env = |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        };
        let at = |endpoint: &str| {
            let flags = Flags {
                endpoint: Some(endpoint),
                ..Flags::default()
            };
            Settings::resolve(flags, |_| None, |_| Ok(Vec::new()))
                .unwrap()
                .unwrap()
        };
        let https = at("https://c:4317");
        assert_eq!(
            unapplied(&https, env),
            [
                "OTEL_EXPORTER_OTLP_INSECURE true is ignored: the endpoint's scheme says whether \
                 TLS is used (https) or not (http)",
            ]
        );
        assert!(unapplied(&https, |_| None).is_empty());
        // A CA file, only over http.
        let ca = |name: &str| (name == "OTEL_EXPORTER_OTLP_CERTIFICATE").then(|| "/ca.pem".into());
        assert!(unapplied(&https, ca).is_empty());
        assert_eq!(
            unapplied(&at("http://c:4317"), ca),
            [
                "OTEL_EXPORTER_OTLP_CERTIFICATE is ignored: the endpoint http://c:4317 is http, \
                 which has no TLS, so the spans go in plain text to a collector no certificate is \
                 checked for; give an https endpoint for the CA file to apply",
            ]
        );
    }

    #[test]
    fn compression_is_gzip_or_none() {
        assert_eq!(parse_compression("gzip", "X"), Ok(true));
        assert_eq!(parse_compression(" GZIP ", "X"), Ok(true));
        assert_eq!(parse_compression("none", "X"), Ok(false));
        for bad in ["zstd", "deflate", "true", ""] {
            assert_eq!(
                parse_compression(bad, "OTEL_EXPORTER_OTLP_COMPRESSION"),
                Err(format!(
                    "OTEL_EXPORTER_OTLP_COMPRESSION {bad:?}: not an OTLP compression; give gzip \
                     or none"
                ))
            );
        }
    }

    #[test]
    fn the_exporter_is_told_none_when_a_variable_would_say_gzip() {
        let resolve = |compression: Option<&str>, vars: &'static [(&str, &str)]| {
            let flags = Flags {
                endpoint: Some("http://c:4317"),
                compression,
                ..Flags::default()
            };
            let env = |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            };
            let settings = Settings::resolve(flags, env, |_| Ok(Vec::new()))
                .unwrap()
                .unwrap();
            settings.compression_for_exporter(env)
        };
        let gzip = &[("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")];
        assert_eq!(resolve(Some("none"), gzip), Some("none"));
        assert_eq!(resolve(Some("gzip"), gzip), None);
        assert_eq!(resolve(None, gzip), None);
        assert_eq!(resolve(Some("none"), &[]), None);
        let signal = &[("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")];
        assert_eq!(resolve(Some("none"), signal), Some("none"));
    }

    #[test]
    fn the_start_line_never_shows_a_query() {
        let describe = |endpoint: &'static str| {
            let flags = Flags {
                protocol: Some("http/protobuf"),
                endpoint: Some(endpoint),
                ..Flags::default()
            };
            Settings::resolve(flags, |_| None, |_| Ok(Vec::new()))
                .unwrap()
                .unwrap()
                .describe()
        };
        let line = describe("https://c/v1/traces?api_key=s3cret");
        assert!(
            line.starts_with("https://c/v1/traces?<query not shown> over OTLP/HTTP protobuf"),
            "{line}"
        );
        assert!(!line.contains("s3cret"), "{line}");
        let line = describe("http://c:4318");
        assert!(
            line.starts_with("http://c:4318/v1/traces over OTLP/HTTP protobuf"),
            "{line}"
        );
    }

    #[test]
    fn the_timeout_is_whole_milliseconds_above_zero() {
        assert_eq!(parse_timeout("10000", "X"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_timeout(" 250 ", "X"), Ok(Duration::from_millis(250)));
        for bad in ["10s", "1.5", "-1", "ten"] {
            let err = parse_timeout(bad, "OTEL_EXPORTER_OTLP_TIMEOUT").unwrap_err();
            assert!(
                err.starts_with(&format!(
                    "OTEL_EXPORTER_OTLP_TIMEOUT {bad:?}: not a whole number of milliseconds"
                )),
                "{err}"
            );
        }
        assert!(parse_timeout("0", "X")
            .unwrap_err()
            .starts_with("X 0: an export given no time never succeeds"));
    }

    #[test]
    fn binary_grpc_metadata_must_be_base64() {
        let headers = parse_headers("x-token-bin=aGVsbG8=,x-raw-bin=aGVsbG8,plain=a b").unwrap();
        assert_eq!(check_binary_metadata(&headers), Ok(()));
        let headers = parse_headers("x-token-bin=s3cret value!").unwrap();
        let err = check_binary_metadata(&headers).unwrap_err();
        assert!(
            err.starts_with("the value of x-token-bin is not base64") && !err.contains("s3cret"),
            "{err}"
        );
    }

    #[test]
    fn a_client_certificate_takes_its_key() {
        let read = |path: &str| -> std::io::Result<Vec<u8>> {
            Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no {path}"),
            ))
        };
        let only =
            |name: &'static str| move |n: &str| (n == name).then(|| "/etc/otel/x.pem".to_owned());
        let err =
            client_identity(&only("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"), &read).unwrap_err();
        assert!(
            err.starts_with(
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE is set without OTEL_EXPORTER_OTLP_CLIENT_KEY"
            ),
            "{err}"
        );
        let err =
            client_identity(&only("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"), &read).unwrap_err();
        assert!(
            err.starts_with(
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY is set without \
                 OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
            ),
            "{err}"
        );
        let both = |n: &str| match n {
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE" => Some("/c.pem".to_owned()),
            "OTEL_EXPORTER_OTLP_CLIENT_KEY" => Some("/k.pem".to_owned()),
            _ => None,
        };
        assert_eq!(
            client_identity(&both, &read).unwrap_err(),
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE /c.pem: cannot be read: no /c.pem"
        );
        let not_pem = |_: &str| Ok(b"hello".to_vec());
        assert_eq!(
            client_identity(&both, &not_pem).unwrap_err(),
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE /c.pem: no certificate in it (a PEM \
             file, -----BEGIN CERTIFICATE-----)"
        );
        assert_eq!(client_identity(&|_: &str| None, &read), Ok(None));
    }

    #[test]
    fn tls_files_with_an_http_endpoint_are_refused_or_ignored_unread() {
        let resolve = |endpoint: Option<&str>, vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let env =
                move |name: &str| vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
            let flags = Flags {
                endpoint,
                ..Flags::default()
            };
            Settings::resolve(flags, env, |path: &str| {
                Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("read {path}"),
                ))
            })
        };
        let ca = ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/otel/ca.pem");
        // A CA file over http is not read (the read would fail): the
        // start says it is ignored ([`unapplied`]).
        let settings = resolve(Some("http://c:4317"), &[ca]).unwrap().unwrap();
        assert!(settings.ca.is_none());
        let settings = resolve(
            None,
            &[
                (
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                    "http://c:4318/v1/traces",
                ),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", "/etc/otel/ca.pem"),
                ca,
            ],
        )
        .unwrap()
        .unwrap();
        assert!(settings.ca.is_none());
        // A key alone is refused for the endpoint, not for its missing certificate.
        assert_eq!(
            resolve(
                Some("http://c:4317"),
                &[("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/etc/otel/k.pem")]
            )
            .unwrap_err(),
            "--otlp-endpoint http://c:4317: OTEL_EXPORTER_OTLP_CLIENT_KEY is for mutual TLS (the \
             client certificate and key shown to the collector), and an http endpoint has no TLS; \
             give an https endpoint, or leave the client certificate and key unset"
        );
        // Over https (the scheme in any case) the file is read.
        for endpoint in ["https://c:4317", "HTTPS://c:4317"] {
            assert_eq!(
                resolve(Some(endpoint), &[ca]).unwrap_err(),
                "OTEL_EXPORTER_OTLP_CERTIFICATE /etc/otel/ca.pem: cannot be read: read \
                 /etc/otel/ca.pem"
            );
        }
    }

    #[test]
    fn percent_decoding_takes_two_hex_digits() {
        assert_eq!(percent_decode("a%20b%3d%C3%A9").as_deref(), Some("a b=é"));
        assert_eq!(percent_decode("plain+text").as_deref(), Some("plain+text"));
        for bad in ["%", "%2", "%g0", "%+1", "%C3"] {
            assert_eq!(percent_decode(bad), None, "{bad}");
        }
    }
}
