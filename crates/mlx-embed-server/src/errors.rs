//! Errors: the server's own [`ServerError`], and [`ApiError`], one request's
//! failure with its HTTP status, rendered in the shape of the API that was called.
//!
//! # Status codes (every embed route)
//!
//! | status | when |
//! | --- | --- |
//! | 400 | malformed JSON; empty input list; an empty string (but in an Ollama `/api/embed` list) or empty token list; a token id outside the vocabulary (names the input index); `dimensions` < 1 or > the model's dimension, or any `dimensions` on a sparse (SPLADE) model; an unknown `prompt_name`; input the model rejects as invalid (`mlx_embed.errors.InvalidInput` in the Python engine) |
//! | 401 | `--api-key` is set and `Authorization: Bearer <key>` is missing or wrong (every route but `/health`, `/ping` and `/.well-known/*`) |
//! | 408 | the body did not arrive within `--client-timeout-secs` (75 s) |
//! | 404 / 405 | unknown route / wrong method |
//! | 413 | body larger than `--max-body-bytes` (2 MiB; refused on its `Content-Length`, without a `100 Continue`); more inputs than `--max-inputs-per-request` (2048) |
//! | 415 | `Content-Type` is not `application/json` (Weaviate's `/vectors` and Ollama's `/api/*` read any body as JSON); a compressed body (any `Content-Encoding` but `identity`, on every route) |
//! | 422 | well-formed JSON of the wrong shape (missing, null or wrong-typed field, non-string item, arrays nested too deep, `truncation_direction` not left/right); an input longer than the model's maximum with `truncate: false` (names the index and its token count; refused before any compute) |
//! | 429 | the server is overloaded (admission queue full or waited too long); `Retry-After` says when to retry, in whole seconds (>= 1) |
//! | 499 | the client closed the connection in the middle of its body: nobody reads the answer, and the request log and `/metrics` count it with the clients that left before their answer |
//! | 500 | the model failed on this request (the model's message) |
//! | 503 | the model is unavailable, or the server is shutting down (the drain timeout passed while the request waited for a model or its body) |
//!
//! # Error bodies
//!
//! * native `/api/v1/*` and operational routes: `{"error": {"message": str, "type": str, "code": int}}`
//! * OpenAI `/v1/*` (Cohere's `/v1/embed`, `/v1/rerank` too), Cohere's `/v2/embed`, `/v2/rerank`, vLLM's `/score`, `/pooling`, `/classify`, `/version`: `{"error": {"message": str, "type": str, "param": str|null, "code": str|null}, "detail": str}` (`detail` repeats the message, where Voyage AI's client reads it; a wrong shape's `param` is its field, `code` what is wrong), and 400 where the table says 422, as those services answer
//! * TEI `/embed` etc. (and `/invocations`, `/vertex`, TEI's routes for SageMaker and Vertex AI): `{"error": str, "error_type": str}`
//! * Ollama `/api/*` (but `/api/v1/*`): `{"error": str}`, and 400 where the table says 422, as Ollama answers
//! * Weaviate `/vectors`, `/meta`: `{"error": str}`

use std::borrow::Cow;
use std::marker::PhantomData;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use mlx_embed_core::{CoreError, OverloadReason};
use serde::Serialize;
use utoipa::ToSchema;

/// Why [`crate::serve`] could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid server settings: {0}")]
    Config(String),
    #[error("warm-up failed (the model could not embed a full batch): {0}")]
    Warmup(#[source] CoreError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot install signal handlers: {0}")]
    Signal(#[source] std::io::Error),
    /// The drain ended with connections still open, which were dropped: a
    /// second signal, or connections that outlasted the drain timeout.
    #[error("stopped before every open connection was done ({0}): their requests got no answer")]
    Forced(&'static str),
}

/// What went wrong, independent of the API shape it is reported in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: the request is well-formed but its values are not acceptable.
    InvalidRequest,
    /// 401.
    Unauthorized,
    /// 403: a `Host` that `--allowed-hosts` does not list.
    Forbidden,
    /// 408: the body did not arrive within `--client-timeout-secs`.
    Timeout,
    /// 404 / 405.
    NotFound,
    MethodNotAllowed,
    /// 413.
    TooLarge,
    /// 415.
    UnsupportedMediaType,
    /// 422: wrong JSON shape or input too long without truncation.
    Unprocessable,
    /// 429.
    Overloaded,
    /// 501: a transfer coding the server does not decode (RFC 9112 section 6.1).
    NotImplemented,
    /// 500.
    Model,
    /// 503.
    Unavailable,
    /// 499 (nginx's "client closed request"): the client closed the
    /// connection before its body was all sent. Nobody reads the answer; the
    /// status is for the request log and `/metrics`, which count it with
    /// the other requests whose clients left, not as a client error.
    ClientClosed,
}

impl ErrorKind {
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::Timeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::Unprocessable => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorKind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            ErrorKind::Model => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::ClientClosed => {
                StatusCode::from_u16(crate::middleware::CLIENT_CLOSED_REQUEST)
                    .expect("499 is a valid status code")
            }
        }
    }

    /// Machine-readable type for the native and OpenAI shapes.
    fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            // As OpenAI answers an unknown model or URL (the status and `code` tell them apart).
            ErrorKind::NotFound => "invalid_request_error",
            ErrorKind::Overloaded => "rate_limit_error",
            ErrorKind::Model => "server_error",
            ErrorKind::Unavailable => "service_unavailable",
            _ => "invalid_request_error",
        }
    }

    /// TEI's `error_type` vocabulary.
    fn tei_type(self) -> &'static str {
        match self {
            ErrorKind::Unauthorized => "Unauthorized",
            ErrorKind::Forbidden => "Forbidden",
            ErrorKind::NotFound => "NotFound",
            ErrorKind::Overloaded => "Overloaded",
            ErrorKind::Model => "Backend",
            ErrorKind::Unavailable => "Unhealthy",
            _ => "Validation",
        }
    }
}

/// Why a request failed (the error body's message), carried on the response
/// for the request log ([`crate::middleware::observe`]).
#[derive(Debug, Clone)]
pub struct ErrorReason(pub String);

/// `T` as its `Display` writes it, control characters escaped (`\n`,
/// `\u{1b}`), for a log line: messages quote what clients sent (a model
/// name, a path, serde's "unknown variant"), and a newline in one would
/// start a line of its own that reads as the server's; an escape sequence
/// would drive the terminal showing the log.
pub(crate) struct LogSafe<T>(pub T);

impl<T: std::fmt::Display> std::fmt::Display for LogSafe<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        struct Escaping<'a, 'b>(&'a mut std::fmt::Formatter<'b>);
        impl Write for Escaping<'_, '_> {
            fn write_str(&mut self, mut s: &str) -> std::fmt::Result {
                // Unicode's line and paragraph separators end lines too in
                // some viewers.
                let escaped = |c: char| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}');
                while let Some((at, c)) = s.char_indices().find(|&(_, c)| escaped(c)) {
                    self.0.write_str(&s[..at])?;
                    write!(self.0, "{}", c.escape_default())?;
                    s = &s[at + c.len_utf8()..];
                }
                self.0.write_str(s)
            }
        }
        write!(Escaping(f), "{}", self.0)
    }
}

/// One request's failure, before it is shaped for an API.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault (OpenAI's `param`): a name the route
    /// gives, or the top-level field a body's wrong shape is found in.
    pub param: Option<Cow<'static, str>>,
    /// OpenAI's `code`, e.g. `invalid_api_key`.
    pub code: Option<&'static str>,
    /// Seconds for `Retry-After` (429 only).
    pub retry_after: Option<u64>,
    /// The request's body was left unread: the answer says `Connection:
    /// close`, as the connection cannot carry another request.
    pub closes_connection: bool,
    /// The request's per-request cut is too short for the model's own
    /// tokens (the core's [`CoreError::CutTooShort`]): each route names
    /// its own field for that cut.
    pub cut_too_short: bool,
    /// An input over the model's maximum (the core's
    /// [`CoreError::InputTooLong`]), in parts: the message is made of them,
    /// so a route can name the input and the fix in its API's words.
    /// (Boxed: every `Result` of the server carries an `ApiError`.)
    too_long: Option<Box<TooLong>>,
}

/// The parts of an over-long input's message: `{input}{detail}; shorten it
/// or {fix}`, e.g. "input 3 has 600 tokens, more than the model's 512;
/// shorten it or set truncate to true".
#[derive(Debug, Clone, PartialEq)]
struct TooLong {
    /// How the input is named: "input 3" until a route names it its own way.
    input: String,
    /// The core's account of the tokens, after the input's name.
    detail: String,
    /// How the request allows the cut, in its API's words.
    fix: Cow<'static, str>,
}

impl TooLong {
    fn message(&self) -> String {
        format!("{}{}; shorten it or {}", self.input, self.detail, self.fix)
    }
}

/// How an over-long input's message says to allow the cut where the route
/// gives no words of its own (the boolean `truncate` of TEI, OpenAI's
/// extension and most others).
pub(crate) const TRUNCATE_FIX: &str = "set truncate to true";

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            closes_connection: false,
            cut_too_short: false,
            too_long: None,
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }
    pub fn param(mut self, param: impl Into<Cow<'static, str>>) -> Self {
        self.param = Some(param.into());
        self
    }
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    /// See [`ApiError::closes_connection`].
    pub fn closing_connection(mut self) -> Self {
        self.closes_connection = true;
        self
    }
    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// The input an error about one input names ("input 3 ..."): its index,
    /// and the message after it. None for any other error.
    pub(crate) fn input_index(&self) -> Option<(usize, &str)> {
        if self.param.as_deref() != Some("input") && self.code != Some("context_length_exceeded") {
            return None;
        }
        let rest = self.message.strip_prefix("input ")?;
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let i = rest[..digits].parse::<usize>().ok()?;
        Some((i, &rest[digits..]))
    }

    /// The error with the input it names told as the request names it:
    /// `name(i)` replaces "input i" (a route whose inputs come from several
    /// fields: vLLM's text_1 and text_2, TEI's source_sentence and sentences).
    pub(crate) fn renaming_input(mut self, name: impl FnOnce(usize) -> String) -> Self {
        let Some((i, rest)) = self.input_index() else {
            return self;
        };
        let (name, rest) = (name(i), rest.to_owned());
        self.message = match &mut self.too_long {
            Some(too_long) => {
                too_long.input = name;
                too_long.message()
            }
            None => format!("{name}{rest}"),
        };
        self
    }

    /// An over-long input's error ([`CoreError::InputTooLong`]) with `fix`,
    /// the route's own words for allowing the cut, in place of
    /// [`TRUNCATE_FIX`] (Cohere's `set truncate to END or START`). Any
    /// other error is left as it is.
    pub(crate) fn advising(mut self, fix: &'static str) -> Self {
        if let Some(too_long) = &mut self.too_long {
            too_long.fix = Cow::Borrowed(fix);
            self.message = too_long.message();
        }
        self
    }

    /// A per-request cut too short for the model's own tokens
    /// ([`cut_too_short`](Self::cut_too_short)) as the fault of `field`, the
    /// route's name for that cut (`truncate_prompt_tokens`, `max_tokens`,
    /// ...): the value the client can change. Any other error is left as it is.
    pub(crate) fn cut_by(mut self, field: &'static str) -> Self {
        if !self.cut_too_short {
            return self;
        }
        self.message = format!("{field}: {}", self.message);
        self.param(field)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            ErrorKind::Unauthorized,
            "missing or invalid API key: send `Authorization: Bearer <key>`",
        )
        .code("invalid_api_key")
    }

    /// 403: a request whose `Host` is `host`, which `--allowed-hosts` does not list.
    pub fn host_not_allowed(host: &str) -> Self {
        Self::new(
            ErrorKind::Forbidden,
            format!(
                "the Host {:?} is not one this server answers to (--allowed-hosts)",
                host.chars().take(256).collect::<String>()
            ),
        )
        .code("host_not_allowed")
    }

    /// 413: a request of `n` inputs, over `--max-inputs-per-request`.
    pub fn too_many_inputs(n: usize, max_inputs: usize) -> Self {
        Self::new(
            ErrorKind::TooLarge,
            format!(
                "{n} inputs is more than the limit of {max_inputs} per request \
                 (--max-inputs-per-request); split the request"
            ),
        )
    }

    /// 413: the body is over `--max-body-bytes`.
    pub fn body_too_large(max_body_bytes: usize) -> Self {
        Self::new(
            ErrorKind::TooLarge,
            format!("request body is larger than the limit of {max_body_bytes} bytes (--max-body-bytes)"),
        )
    }

    /// 429: the answer room (`--max-unsent-answers-mb`) stayed too full for
    /// this request's answer for `--max-queue-wait-ms`.
    pub fn answers_unsent() -> Self {
        let mut e = Self::new(
            ErrorKind::Overloaded,
            "server is overloaded: the room for large answers (--max-unsent-answers-mb) is \
             held by answers waiting for their clients to read them, or being computed, \
             longer than the queue allows (--max-queue-wait-ms); retry later",
        );
        e.retry_after = Some(1);
        e
    }

    /// 503: the server is draining and will not answer this request.
    pub fn shutting_down() -> Self {
        Self::new(
            ErrorKind::Unavailable,
            "server is shutting down; retry elsewhere",
        )
    }

    /// 415: the body is not labelled as JSON.
    pub fn json_content_type_expected() -> Self {
        Self::new(
            ErrorKind::UnsupportedMediaType,
            "expected a request with `Content-Type: application/json`",
        )
    }

    /// The client closed the connection in the middle of its body (499).
    pub fn client_closed() -> Self {
        Self::new(
            ErrorKind::ClientClosed,
            "the client closed the connection before its body was all sent",
        )
        .closing_connection()
    }

    /// 422 (400 in the OpenAI and Ollama shapes): a body of the wrong
    /// shape, `message` as told; `param` and `code` from serde's error where
    /// there is one ([`wrong_shape_fault`]).
    fn wrong_shape(message: String, serde: Option<&WrongShape>) -> Self {
        let mut err = Self::new(ErrorKind::Unprocessable, message);
        if let Some((param, code)) = serde.map(wrong_shape_fault) {
            err.param = param.map(Cow::Owned);
            err.code = code;
        }
        err
    }

    /// A body already read as a JSON value, as `T`, with the errors of a
    /// body read as `T` ([`ApiError::from_json_rejection`]).
    pub(crate) fn parse_value<T: serde::de::DeserializeOwned>(
        body: serde_json::Value,
    ) -> Result<T, Self> {
        serde_path_to_error::deserialize(body).map_err(|e| {
            Self::wrong_shape(
                format!("Failed to deserialize the JSON body into the target type: {e}"),
                Some(&e),
            )
        })
    }

    /// Maps axum's JSON and body rejections: 400 malformed JSON, 422 wrong
    /// shape, 413 body over `max_body_bytes`. (The content type is checked
    /// before the body is read: [`crate::extract::ApiJson`].)
    pub fn from_json_rejection(rejection: JsonRejection, max_body_bytes: usize) -> Self {
        match rejection {
            JsonRejection::JsonDataError(e) => {
                let mut link: Option<&(dyn std::error::Error + 'static)> = Some(&e);
                let serde = std::iter::from_fn(|| {
                    let this = link?;
                    link = this.source();
                    Some(this)
                })
                .find_map(|e| e.downcast_ref::<WrongShape>());
                Self::wrong_shape(e.body_text(), serde)
            }
            JsonRejection::JsonSyntaxError(e) => {
                let mut message = e.body_text();
                // serde_json's words for a lone `\ud800`-style escape ("unexpected
                // end of hex escape") do not say what is wrong with the text.
                if message.contains("surrogate") || message.contains("hex escape") {
                    message.push_str(
                        " (a \\uXXXX escape needs four hex digits, and one in \\uD800-\\uDFFF \
                         must be followed by the other half of its surrogate pair: \
                         lone surrogates are not text)",
                    );
                }
                Self::new(ErrorKind::InvalidRequest, message).code("invalid_json")
            }
            // Cut at the limit with the rest unread (a chunked body declares
            // no size): the connection cannot carry another request.
            other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::body_too_large(max_body_bytes).closing_connection()
            }
            other => Self::new(ErrorKind::InvalidRequest, other.body_text()),
        }
    }
}

/// serde's error on a request body, with the path to where it went wrong
/// (axum reads bodies through `serde_path_to_error`; so does
/// [`ApiError::parse_value`]).
pub(crate) type WrongShape = serde_path_to_error::Error<serde_json::Error>;

/// The field a body of the wrong shape is wrong in, and what is wrong with
/// it in OpenAI's codes, from serde's path and words: the path's first key
/// (`dimensions`; `input` for `input[1]`, as an error about one input names
/// `input` and says its index in the message), or for a top-level field
/// missing or unknown, the field serde names. None where serde names no
/// field (a body that is not an object) or says something else (a field's
/// own check, e.g. "the array mixes strings, token ids ...": no code).
fn wrong_shape_fault(err: &WrongShape) -> (Option<String>, Option<&'static str>) {
    let words = err.inner().to_string();
    let code = [
        ("invalid type", "invalid_type"),
        ("invalid value", "invalid_value"),
        ("invalid length", "invalid_value"),
        ("unknown variant", "invalid_value"),
        ("missing field", "missing_required_parameter"),
        ("unknown field", "unknown_parameter"),
    ]
    .into_iter()
    .find_map(|(start, code)| words.starts_with(start).then_some(code));
    let param = match err.path().iter().next() {
        Some(serde_path_to_error::Segment::Map { key }) => Some(key.clone()),
        Some(_) => None,
        // At the top level serde names the field in backticks.
        None => ["missing field `", "unknown field `"]
            .iter()
            .find_map(|start| {
                let rest = words.strip_prefix(start)?;
                Some(rest[..rest.find('`')?].to_owned())
            }),
    };
    (param, code)
}

impl From<CoreError> for ApiError {
    fn from(err: CoreError) -> Self {
        match err {
            CoreError::Overloaded {
                reason,
                retry_after,
            } => {
                // Which bound was hit, so an operator knows which flag to look at.
                let why = match reason {
                    OverloadReason::QueueFull => "too many inputs waiting (--max-waiting)",
                    OverloadReason::QueueTimeout => {
                        "waited longer than the queue allows (--max-queue-wait-ms)"
                    }
                };
                let mut e = Self::new(
                    ErrorKind::Overloaded,
                    format!("server is overloaded: {why}; retry later"),
                );
                e.retry_after = Some(retry_after_secs(retry_after));
                e
            }
            CoreError::Model(msg) => Self::new(ErrorKind::Model, format!("model error: {msg}")),
            CoreError::ModelUnavailable(msg) => {
                Self::new(ErrorKind::Unavailable, format!("model unavailable: {msg}"))
            }
            CoreError::LoadFailed(err) => Self::new(
                ErrorKind::Unavailable,
                format!("model unavailable: {}", err.message),
            ),
            CoreError::ShuttingDown => Self::shutting_down(),
            // The server always embeds on its own runtime: a bug if reached.
            err @ CoreError::NoRuntime => Self::new(ErrorKind::Model, err.to_string()),
            // The core's message starts `input N:` when one input is at fault,
            // otherwise it names the option (an unknown prompt name).
            CoreError::InvalidInput(msg) => {
                let param = if msg.starts_with("input ") {
                    "input"
                } else {
                    "prompt_name"
                };
                Self::invalid(msg).param(param)
            }
            // The core's own name for the cut, until the route names its field.
            CoreError::CutTooShort(msg) => Self {
                cut_too_short: true,
                ..Self::invalid(msg).param("truncate_to")
            },
            e @ CoreError::InputTooLong { index, .. } => {
                // The core's message starts with the input's name, which a
                // route may give in its own words ([`ApiError::renaming_input`]).
                let text = e.to_string();
                let input = format!("input {index}");
                let too_long = match text.strip_prefix(&input) {
                    Some(detail) => TooLong {
                        detail: detail.to_owned(),
                        input,
                        fix: Cow::Borrowed(TRUNCATE_FIX),
                    },
                    None => TooLong {
                        input: String::new(),
                        detail: text,
                        fix: Cow::Borrowed(TRUNCATE_FIX),
                    },
                };
                Self {
                    message: too_long.message(),
                    too_long: Some(Box::new(too_long)),
                    ..Self::new(ErrorKind::Unprocessable, String::new())
                }
                .code("context_length_exceeded")
            }
            e @ CoreError::TooManyTokenRows { .. } => Self::new(
                ErrorKind::TooLarge,
                format!("{e} (every token's vector is answered); send fewer or shorter inputs per request"),
            ),
        }
    }
}

/// Whole seconds, rounded up, at least 1.
pub fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    secs.max(1)
}

// ---- per-API error shapes -------------------------------------------------

/// Native and operational routes' error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct NativeErrorBody {
    pub error: NativeErrorDetail,
}
#[derive(Debug, Serialize, ToSchema)]
pub struct NativeErrorDetail {
    pub message: String,
    /// e.g. `invalid_request_error`, `rate_limit_error`.
    #[serde(rename = "type")]
    #[schema(rename = "type")]
    pub kind: String,
    /// The HTTP status.
    pub code: u16,
}

/// A route that answers in TEI's error body, or in OpenAI's for a Cohere-
/// shaped body (`/rerank`'s `documents` form, `/invocations` with it):
/// documentation only.
pub struct TeiOrOpenAiErrorBody;

impl utoipa::PartialSchema for TeiOrOpenAiErrorBody {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::OneOfBuilder;
        use utoipa::openapi::Ref;
        OneOfBuilder::new()
            .item(Ref::from_schema_name("TeiErrorBody"))
            .item(Ref::from_schema_name("OpenAiErrorBody"))
            .into()
    }
}

impl ToSchema for TeiOrOpenAiErrorBody {
    fn name() -> std::borrow::Cow<'static, str> {
        std::borrow::Cow::Borrowed("TeiOrOpenAiErrorBody")
    }
}

/// OpenAI's error body, with the message again as FastAPI's top-level
/// `detail`: Voyage AI's client reads only that key, and without it turns
/// every refusal into an untyped `APIError` (a 429 is then not retried).
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorBody {
    pub error: OpenAiErrorDetail,
    pub detail: String,
}
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    #[schema(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// TEI's error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct TeiErrorBody {
    pub error: String,
    pub error_type: String,
}

/// Ollama's error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct OllamaErrorBody {
    pub error: String,
}

/// Weaviate `text2vec-transformers`' error body.
#[derive(Debug, Serialize, ToSchema)]
pub struct WeaviateErrorBody {
    pub error: String,
}

/// Which API's error shape to answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Native,
    OpenAi,
    Tei,
    Ollama,
    Weaviate,
}

impl Api {
    /// The API a path belongs to (for errors raised before routing, e.g. 401/404).
    pub fn for_path(path: &str) -> Api {
        if path == "/v1"
            || path.starts_with("/v1/")
            || path.starts_with("/models/")
            || matches!(
                path,
                "/embeddings" | "/models" | "/score" | "/pooling" | "/classify" | "/version"
            )
            // Cohere's v2 API, the routes served and the others alike.
            || path.starts_with("/v2/")
        {
            Api::OpenAi
        } else if matches!(
            path,
            "/" | "/embed"
                | "/embed_all"
                | "/embed_sparse"
                | "/rerank"
                | "/predict"
                | "/similarity"
                | "/tokenize"
                | "/decode"
                | "/invocations"
                | "/vertex"
        ) {
            Api::Tei
        } else if path.starts_with("/api/") && !path.starts_with("/api/v1/") {
            // Ollama's routes, and its others this server does not serve
            // (`/api/generate`, `/api/chat`): an Ollama client reads their
            // errors in its own shape.
            Api::Ollama
        } else if matches!(path, "/vectors" | "/vectors/" | "/meta") {
            Api::Weaviate
        } else {
            Api::Native
        }
    }

    pub fn render(self, err: ApiError) -> Response {
        let reason = ErrorReason(err.message.clone());
        let status = match (self, err.status()) {
            // Ollama, OpenAI, Cohere and vLLM answer every request they cannot
            // take as given with 400 (a body of the wrong shape, an input over
            // the context length): their clients check for that, not 422 (the
            // official OpenAI client raises `BadRequestError` for 400 only).
            (Api::Ollama | Api::OpenAi, StatusCode::UNPROCESSABLE_ENTITY) => {
                StatusCode::BAD_REQUEST
            }
            (_, status) => status,
        };
        let mut response = match self {
            Api::Native => Json(NativeErrorBody {
                error: NativeErrorDetail {
                    message: err.message,
                    kind: err.kind.openai_type().into(),
                    code: status.as_u16(),
                },
            })
            .into_response(),
            Api::OpenAi => Json(OpenAiErrorBody {
                detail: err.message.clone(),
                error: OpenAiErrorDetail {
                    message: err.message,
                    kind: err.kind.openai_type().into(),
                    param: err.param.map(Cow::into_owned),
                    code: err.code.map(Into::into),
                },
            })
            .into_response(),
            Api::Tei => Json(TeiErrorBody {
                error: err.message,
                error_type: err.kind.tei_type().into(),
            })
            .into_response(),
            Api::Ollama => Json(OllamaErrorBody { error: err.message }).into_response(),
            Api::Weaviate => Json(WeaviateErrorBody { error: err.message }).into_response(),
        };
        *response.status_mut() = status;
        response.extensions_mut().insert(reason);
        if err.kind == ErrorKind::ClientClosed {
            // No canonical phrase: hyper would write `499 <none>`.
            response
                .extensions_mut()
                .insert(hyper::ext::ReasonPhrase::from_static(
                    b"Client Closed Request",
                ));
        }
        let headers = response.headers_mut();
        if let Some(secs) = err.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if err.closes_connection {
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if err.kind == ErrorKind::Unauthorized {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Type-level [`Api`], so a handler's error type fixes its shape.
pub trait Flavor: Send + Sync + 'static {
    const API: Api;
    /// Read a body as JSON whatever its `Content-Type` (else 415 unless it
    /// says JSON): Ollama's server does, and the curl lines in its docs send
    /// curl's default form type; Weaviate posts a text with no type at all.
    const ANY_CONTENT_TYPE: bool = false;
}
pub struct Native;
pub struct OpenAi;
pub struct Tei;
pub struct Ollama;
pub struct Weaviate;
impl Flavor for Native {
    const API: Api = Api::Native;
}
impl Flavor for OpenAi {
    const API: Api = Api::OpenAi;
}
impl Flavor for Tei {
    const API: Api = Api::Tei;
}
impl Flavor for Ollama {
    const API: Api = Api::Ollama;
    const ANY_CONTENT_TYPE: bool = true;
}
impl Flavor for Weaviate {
    const API: Api = Api::Weaviate;
    const ANY_CONTENT_TYPE: bool = true;
}

/// An [`ApiError`] that renders in `F`'s shape; `?` converts into it.
pub struct Shaped<F: Flavor>(pub ApiError, PhantomData<F>);

impl<F: Flavor> From<ApiError> for Shaped<F> {
    fn from(err: ApiError) -> Self {
        Shaped(err, PhantomData)
    }
}

impl<F: Flavor> IntoResponse for Shaped<F> {
    fn into_response(self) -> Response {
        F::API.render(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_over_long_input_is_named_and_advised_in_the_routes_words() {
        let too_long = || {
            ApiError::from(CoreError::InputTooLong {
                index: 2,
                tokens: 600,
                max: 512,
                limit: mlx_embed_core::InputLimit::Model,
            })
        };
        let plain = too_long();
        assert_eq!(
            (plain.status().as_u16(), plain.code, plain.message.as_str()),
            (
                422,
                Some("context_length_exceeded"),
                "input 2 has 600 tokens, more than the model's maximum of 512; shorten it or \
                 set truncate to true"
            )
        );
        // The advice and the name are parts: either order gives one message.
        let want = "passage 2 has 600 tokens, more than the model's maximum of 512; shorten it \
                    or set truncate to END";
        let advised_first = too_long()
            .advising("set truncate to END")
            .renaming_input(|i| format!("passage {i}"));
        let named_first = too_long()
            .renaming_input(|i| format!("passage {i}"))
            .advising("set truncate to END");
        assert_eq!(advised_first.message, want);
        assert_eq!(named_first.message, want);
        assert_eq!(too_long().advising(TRUNCATE_FIX), too_long());
        // Any other error keeps its words, whatever they say.
        let other = ApiError::invalid("set truncate to true is in this text").param("input");
        assert_eq!(other.clone().advising("set truncate to END"), other);
    }

    #[test]
    fn a_cut_refusal_names_the_cut_field() {
        let refused = ApiError::from(CoreError::CutTooShort(
            "a cut at 2 tokens leaves no room for text: the model adds 2 special tokens, so \
             cut at 3 or more"
                .into(),
        ));
        assert_eq!(refused.param.as_deref(), Some("truncate_to"));
        let named = refused.cut_by("max_tokens");
        assert_eq!(named.param.as_deref(), Some("max_tokens"));
        assert_eq!(
            named.message,
            "max_tokens: a cut at 2 tokens leaves no room for text: the model adds 2 special \
             tokens, so cut at 3 or more"
        );
        // Another input's fault stays the input's, whatever its words.
        let other = ApiError::from(CoreError::InvalidInput(
            "input 1: a cut at 2 tokens leaves no room for text".into(),
        ));
        assert_eq!(other.clone().cut_by("max_tokens"), other);
    }

    #[test]
    fn log_lines_escape_what_would_break_them() {
        let safe = |s: &str| LogSafe(s).to_string();
        assert_eq!(safe("plain `model` é 字"), "plain `model` é 字");
        assert_eq!(
            safe("x\n2026-11-29T17:30:00Z  INFO forged\r\tend"),
            "x\\n2026-11-29T17:30:00Z  INFO forged\\r\\tend"
        );
        assert_eq!(
            safe("\u{1b}[31mred\u{85}\u{2028}\u{7f}"),
            "\\u{1b}[31mred\\u{85}\\u{2028}\\u{7f}"
        );
        // Any Display goes through, not only strings.
        assert_eq!(
            LogSafe(format_args!("{}: {}", 1, "a\nb")).to_string(),
            "1: a\\nb"
        );
    }

    #[test]
    fn an_overload_names_the_bound_it_hit() {
        let message = |reason| {
            ApiError::from(CoreError::Overloaded {
                reason,
                retry_after: Duration::from_secs(3),
            })
        };
        let full = message(OverloadReason::QueueFull);
        assert!(full.message.contains("(--max-waiting)"), "{}", full.message);
        let timeout = message(OverloadReason::QueueTimeout);
        assert!(
            timeout.message.contains("(--max-queue-wait-ms)"),
            "{}",
            timeout.message
        );
        assert_eq!(timeout.retry_after, Some(3));
    }

    #[test]
    fn retry_after_rounds_up_to_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
    }

    #[test]
    fn paths_map_to_apis() {
        assert_eq!(Api::for_path("/v1/embeddings"), Api::OpenAi);
        assert_eq!(Api::for_path("/v1/models"), Api::OpenAi);
        assert_eq!(Api::for_path("/embed"), Api::Tei);
        assert_eq!(Api::for_path("/rerank"), Api::Tei);
        assert_eq!(Api::for_path("/"), Api::Tei);
        assert_eq!(Api::for_path("/v2/rerank"), Api::OpenAi);
        assert_eq!(Api::for_path("/v2/embed"), Api::OpenAi);
        assert_eq!(Api::for_path("/v2/chat"), Api::OpenAi);
        assert_eq!(Api::for_path("/api/embed"), Api::Ollama);
        assert_eq!(Api::for_path("/api/embeddings"), Api::Ollama);
        assert_eq!(Api::for_path("/api/generate"), Api::Ollama);
        assert_eq!(Api::for_path("/api/v1/embed"), Api::Native);
        assert_eq!(Api::for_path("/api/tags"), Api::Ollama);
        assert_eq!(Api::for_path("/vectors"), Api::Weaviate);
        assert_eq!(Api::for_path("/api/v1/embed"), Api::Native);
        assert_eq!(Api::for_path("/metrics"), Api::Native);
        assert_eq!(Api::for_path("/pooling"), Api::OpenAi);
        assert_eq!(Api::for_path("/classify"), Api::OpenAi);
        assert_eq!(Api::for_path("/version"), Api::OpenAi);
        assert_eq!(Api::for_path("/invocations"), Api::Tei);
        assert_eq!(Api::for_path("/vertex"), Api::Tei);
        assert_eq!(Api::for_path("/ping"), Api::Native);
    }
}
