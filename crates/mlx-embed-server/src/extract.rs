//! Request parsing shared by the API adapters: a JSON extractor whose
//! rejections come out in the route's error shape, and the input unions the
//! APIs accept (string or list of strings; OpenAI's and TEI's token-id forms).

use std::fmt;
use std::marker::PhantomData;

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, EXPECT};
use axum::http::request::Parts;
use axum::http::HeaderMap;
use axum::Json;
use mlx_embed_core::{EmbedInput, Priority, TruncationDirection};
use serde::de::{self, DeserializeOwned, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::errors::{ApiError, ErrorKind, Flavor, Shaped};
use crate::state::AppState;
use crate::timing::{self, Method};

/// An optional integer field read as JSON Schema and pydantic's lax `int`
/// (vLLM's and Infinity's request models) read one: an integer, or a number
/// with no fractional part (`3.0`, which Python clients send from a float);
/// `3.5` is a wrong shape, in serde's words. serde's `i64` refused `3.0` with a 400.
pub(crate) fn whole_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    let Some(n) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    if let Some(i) = n.as_i64() {
        return Ok(Some(i));
    }
    match n.as_f64() {
        // The bounds: an f64 at or past 2^63 does not fit an i64.
        Some(f) if f.fract() == 0.0 && f >= -(2f64.powi(63)) && f < 2f64.powi(63) => {
            Ok(Some(f as i64))
        }
        // serde's own words for a float where an i64 is wanted, as every
        // other integer field answers.
        Some(f) => Err(de::Error::invalid_type(de::Unexpected::Float(f), &"i64")),
        None => Err(de::Error::invalid_type(
            de::Unexpected::Other("a number"),
            &"i64",
        )),
    }
}

/// `Json<T>` whose rejections (400 malformed, 408 body too slow, 413 too
/// large, 415 content type, 422 wrong shape) render in `F`'s error shape. The
/// one place request bodies are read and parsed:
/// - a `Content-Length` over `--max-body-bytes` is refused on the header (no
///   `100 Continue` invites the body; one sent anyway is read away first);
/// - the whole body must arrive within `--client-timeout-secs`, and when
///   the drain timeout ends first the request is answered 503;
/// - a leading UTF-8 byte order mark is skipped (RFC 8259 section 8.1 lets a
///   parser ignore one; Windows tools write it);
/// - the `Content-Type` must be JSON unless `F` reads any body as JSON
///   ([`Flavor::ANY_CONTENT_TYPE`]).
pub struct ApiJson<T, F>(pub T, pub PhantomData<F>);

impl<T, F> FromRequest<AppState> for ApiJson<T, F>
where
    T: DeserializeOwned + Send,
    F: Flavor,
{
    type Rejection = Shaped<F>;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let ApiBody(body, _) = ApiBody::<F>::from_request(req, state).await?;
        Ok(ApiJson(body.parse()?, PhantomData))
    }
}

/// The body [`ApiJson`] reads, checked as it checks it but not yet parsed:
/// for a route that picks the request's type by the keys it holds, and
/// parses it as that type with [`JsonBody::parse`] (whose errors are
/// [`ApiJson`]'s).
pub struct ApiBody<F>(pub JsonBody, pub PhantomData<F>);

/// A request's JSON body, as sent (less a leading byte order mark).
pub struct JsonBody {
    bytes: Bytes,
    max_body: usize,
}

impl JsonBody {
    /// The body as `T`, with [`ApiJson`]'s errors.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        let json = self.bytes.strip_prefix(UTF8_BOM).unwrap_or(&self.bytes);
        match Json::<JsonObject<T>>::from_bytes(json) {
            Ok(Json(JsonObject(value))) => Ok(value),
            Err(rejection) => Err(ApiError::from_json_rejection(rejection, self.max_body)),
        }
    }

    /// The keys of the body's top-level object (even those set to `null`),
    /// read in one pass that builds no values; none for a body that does not parse.
    pub fn keys(&self) -> std::collections::HashSet<String> {
        self.parse::<std::collections::HashMap<String, de::IgnoredAny>>()
            .map(|map| map.into_keys().collect())
            .unwrap_or_default()
    }
}

impl<F: Flavor> FromRequest<AppState> for ApiBody<F> {
    type Rejection = Shaped<F>;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let max_body = state.args().max_body_bytes;
        if !F::ANY_CONTENT_TYPE && !json_content_type(req.headers()) {
            return Err(ApiError::json_content_type_expected().into());
        }
        let limit = state.args().client_timeout();
        if content_length(req.headers()).is_some_and(|n| n > max_body as u64) {
            if !expects_continue(req.headers()) {
                discard_body(req.into_body(), max_body.saturating_mul(16), limit).await;
            }
            return Err(ApiError::body_too_large(max_body)
                .closing_connection()
                .into());
        }
        let read = tokio::time::timeout(limit, Bytes::from_request(req, state));
        let body = match state.until_drain_ends(read).await {
            Some(Ok(Err(rejection))) if client_went_away(&rejection) => {
                return Err(ApiError::client_closed().into())
            }
            Some(Ok(body)) => {
                body.map_err(|e| ApiError::from_json_rejection(e.into(), max_body))?
            }
            Some(Err(_elapsed)) => {
                return Err(ApiError::new(
                    ErrorKind::Timeout,
                    format!(
                        "the request body did not arrive within {} s (--client-timeout-secs)",
                        limit.as_secs()
                    ),
                )
                .closing_connection()
                .into())
            }
            None => return Err(ApiError::shutting_down().into()),
        };
        Ok(ApiBody(
            JsonBody {
                bytes: body,
                max_body,
            },
            PhantomData,
        ))
    }
}

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The body stopped because the client closed the connection (hyper's
/// incomplete message, or the socket reset), not because it was malformed.
fn client_went_away(err: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    std::iter::successors(Some(err), |e| e.source()).any(|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_incomplete_message() || h.is_canceled())
            || e.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof
                )
            })
    })
}

/// The client waits for a `100 Continue` before it sends the body.
pub(crate) fn expects_continue(headers: &HeaderMap) -> bool {
    headers
        .get(EXPECT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("100-continue"))
}

/// Reads an oversized body to nowhere, so a client that sends it whole
/// before it reads (Python's `http.client`) can read the 413 after it: a
/// connection closed on unread data is reset, and the client sees a broken
/// pipe instead of the answer. Bounded: up to `cap` bytes, within
/// `deadline`, and no more than a second's wait for the next piece (a
/// client that declared a size and sends nothing is answered after it).
/// Whether the body was read to its end.
pub(crate) async fn discard_body(body: Body, cap: usize, deadline: std::time::Duration) -> bool {
    use futures_util::StreamExt;
    const PAUSE: std::time::Duration = std::time::Duration::from_secs(1);
    let end = tokio::time::Instant::now() + deadline;
    let mut stream = body.into_data_stream();
    let mut read = 0usize;
    while read <= cap {
        let next =
            tokio::time::timeout_at(end.min(tokio::time::Instant::now() + PAUSE), stream.next());
        match next.await {
            Ok(Some(Ok(chunk))) => read += chunk.len(),
            Ok(None) => return true,
            _ => return false,
        }
    }
    false
}

/// The body's declared size (absent, or chunked: none).
fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `application/json` or any `application/*+json`: what axum's `Json` accepts.
fn json_content_type(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<mime::Mime>().ok())
        .is_some_and(|m| {
            m.type_() == "application"
                && (m.subtype() == "json" || m.suffix().is_some_and(|s| s == "json"))
        })
}

/// A request body that must be a JSON object. serde fills a struct from an
/// array too, field by field in declaration order, which would make the
/// order of a request's fields part of the API; an array is a 422 instead.
struct JsonObject<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for JsonObject<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = JsonObject<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<JsonObject<T>, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(JsonObject)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// The `X-Priority: high|normal|low` header (any case), which every route
/// that runs a model takes; `None` when absent. Any other value is refused with 400 in
/// the route's error shape. A `priority` in the body, where an API has one,
/// wins over the header.
pub struct PriorityHeader<F>(pub Option<Priority>, pub PhantomData<F>);

/// The header's name.
pub const PRIORITY_HEADER: &str = "x-priority";

impl<F: Flavor> FromRequestParts<AppState> for PriorityHeader<F> {
    type Rejection = Shaped<F>;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, Self::Rejection> {
        let values: Vec<_> = parts.headers.get_all(PRIORITY_HEADER).iter().collect();
        if values.is_empty() {
            return Ok(PriorityHeader(None, PhantomData));
        }
        // Two header lines mean what one line of both values does (RFC 9110
        // 5.3), which names two priorities: refused, not the first one taken.
        let text = values
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()))
            .collect::<Vec<_>>()
            .join(", ");
        match text.parse::<Priority>() {
            Ok(p) => Ok(PriorityHeader(Some(p), PhantomData)),
            Err(_) => Err(ApiError::invalid(format!(
                "X-Priority must be high, normal or low, not {text:?}"
            ))
            .into()),
        }
    }
}

/// A string or a list of strings.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum TextInputs {
    One(String),
    Many(Vec<String>),
}

impl TextInputs {
    pub fn into_inputs(self) -> Vec<EmbedInput> {
        timing::shape(match self {
            TextInputs::One(_) => Method::Single,
            TextInputs::Many(_) => Method::Batch,
        });
        match self {
            TextInputs::One(s) => vec![EmbedInput::Text(s)],
            TextInputs::Many(v) => v.into_iter().map(EmbedInput::Text).collect(),
        }
    }
}

impl<'de> Deserialize<'de> for TextInputs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TextInputs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<TextInputs, E> {
                Ok(TextInputs::One(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<TextInputs, E> {
                Ok(TextInputs::One(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextInputs, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(TextInputs::Many(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// OpenAI's `input` and TEI's `inputs`: a string, strings (each may be Jina
/// AI's `{"text": ...}` object), token ids, or lists of token ids (run as
/// given, specials included: see [`EmbedInput::Tokens`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TextsOrTokens {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
    /// Texts and token-id lists in one list: TEI's only ([`TeiInputs`]).
    Mixed(Vec<TextOrIds>),
}

/// One input of TEI's list that mixes forms: a text or a list of token ids.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TextOrIds {
    Text(String),
    Ids(Vec<u32>),
}

/// By hand, for the bounds every route that reads it enforces (400): no
/// empty list, string or token list (`embed::check_inputs`).
impl utoipa::PartialSchema for TextsOrTokens {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder};
        let list_item = OneOfBuilder::new().item(text_schema()).item(text_object());
        OneOfBuilder::new()
            .item(text_schema())
            .item(ArrayBuilder::new().items(list_item).min_items(Some(1)))
            .item(ids_schema())
            .item(ArrayBuilder::new().items(ids_schema()).min_items(Some(1)))
            .description(Some(
                "A string, strings (or Jina AI's {\"text\": string} objects), token ids, or \
                 lists of token ids (run as given, special tokens included); no list, string \
                 or token list empty (a 400)",
            ))
            .into()
    }
}

impl ToSchema for TextsOrTokens {}

impl TextsOrTokens {
    pub fn into_inputs(self) -> Vec<EmbedInput> {
        // TEI's `method`: one input sent bare, or a list (of one too).
        timing::shape(match self {
            TextsOrTokens::Text(_) | TextsOrTokens::Tokens(_) => Method::Single,
            _ => Method::Batch,
        });
        match self {
            TextsOrTokens::Text(s) => vec![EmbedInput::Text(s)],
            TextsOrTokens::Texts(v) => v.into_iter().map(EmbedInput::Text).collect(),
            TextsOrTokens::Tokens(ids) => vec![EmbedInput::Tokens(ids)],
            TextsOrTokens::TokenLists(v) => v.into_iter().map(EmbedInput::Tokens).collect(),
            TextsOrTokens::Mixed(v) => v
                .into_iter()
                .map(|item| match item {
                    TextOrIds::Text(s) => EmbedInput::Text(s),
                    TextOrIds::Ids(ids) => EmbedInput::Tokens(ids),
                })
                .collect(),
        }
    }
}

/// One item of an `input` array before we know which form the array is.
enum Item {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Item;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(
                    "a string, a {\"text\": string} object, a token id, or an array of token ids",
                )
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Item, E> {
                Ok(Item::Text(s.to_owned()))
            }
            // Jina AI's object form of a text (its API's `input` items, which
            // LlamaIndex's and Jina's own clients send); its `image` and
            // `pdf` items are another modality, refused by name.
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
                let mut text = None;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "text" if text.is_none() => text = Some(map.next_value::<String>()?),
                        "text" => return Err(de::Error::duplicate_field("text")),
                        "image" | "pdf" | "url" | "bytes" => {
                            return Err(de::Error::custom(format!(
                                "an `{key}` input is not supported: this server embeds text \
                                 ({{\"text\": \"...\"}} or a string)"
                            )))
                        }
                        other => {
                            return Err(de::Error::custom(format!(
                                "unknown field `{other}` in an input object: send \
                                 {{\"text\": \"...\"}} or a string"
                            )))
                        }
                    }
                }
                text.map(Item::Text)
                    .ok_or_else(|| de::Error::missing_field("text"))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Item, E> {
                Ok(Item::Text(s))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
                u32::try_from(v)
                    .map(Item::Id)
                    .map_err(|_| E::custom(format!("token id {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("token id {v} is negative")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(65_536));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(Item::Ids(ids))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for TextsOrTokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(InputsVisitor { mixed_ok: false })
    }
}

/// TEI's `inputs`: what [`TextsOrTokens`] takes, and also a list that mixes
/// texts with lists of token ids, which TEI's `Input` (a text or ids, or a
/// list of either) allows and OpenAI's `input` does not. Bare ids beside
/// texts stay refused: TEI refuses them too, and they say nothing of where
/// one input ends.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct TeiInputs(pub TextsOrTokens);

impl<'de> Deserialize<'de> for TeiInputs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(InputsVisitor { mixed_ok: true })
            .map(TeiInputs)
    }
}

/// One text input: not empty.
fn text_schema() -> utoipa::openapi::schema::ObjectBuilder {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
}

/// One input's token ids: not an empty list.
fn ids_schema() -> utoipa::openapi::schema::ArrayBuilder {
    utoipa::openapi::schema::ArrayBuilder::new()
        .items(<u32 as utoipa::PartialSchema>::schema())
        .min_items(Some(1))
}

/// Jina AI's object form of one text, `{"text": string}` (not empty, nothing else),
/// as [`Item`] reads it in a list of inputs.
fn text_object() -> utoipa::openapi::schema::ObjectBuilder {
    use utoipa::openapi::schema::{AdditionalProperties, ObjectBuilder};
    ObjectBuilder::new()
        .property("text", text_schema())
        .required("text")
        .additional_properties(Some(AdditionalProperties::FreeForm(false)))
}

impl utoipa::PartialSchema for TeiInputs {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder};
        // A list item is read by [`Item`], as OpenAI's are: Jina AI's text objects too.
        let either = OneOfBuilder::new()
            .item(text_schema())
            .item(ids_schema())
            .item(text_object());
        OneOfBuilder::new()
            .item(text_schema())
            .item(ids_schema())
            .item(ArrayBuilder::new().items(either).min_items(Some(1)))
            .description(Some(
                "A string or token ids, or a list of strings (or Jina AI's {\"text\": string} \
                 objects) and lists of token ids (run as given, special tokens included); no \
                 list, string or token list empty (a 400)",
            ))
            .into()
    }
}

impl ToSchema for TeiInputs {}

impl TeiInputs {
    pub fn into_inputs(self) -> Vec<EmbedInput> {
        self.0.into_inputs()
    }
}

/// Reads [`TextsOrTokens`]; `mixed_ok`: a list may mix texts and token-id
/// lists ([`TeiInputs`]).
struct InputsVisitor {
    mixed_ok: bool,
}

impl<'de> Visitor<'de> for InputsVisitor {
    type Value = TextsOrTokens;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(if self.mixed_ok {
            "a string, an array of token ids, or an array of strings and arrays of token ids"
        } else {
            "a string, an array of strings, an array of token ids, \
             or an array of arrays of token ids"
        })
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<TextsOrTokens, E> {
        Ok(TextsOrTokens::Text(s.to_owned()))
    }
    fn visit_string<E: de::Error>(self, s: String) -> Result<TextsOrTokens, E> {
        Ok(TextsOrTokens::Text(s))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TextsOrTokens, A::Error> {
        let mut out: Option<TextsOrTokens> = None;
        let mixed = || {
            de::Error::custom(if self.mixed_ok {
                "the array mixes token ids with strings or token-id arrays; put each input's \
                 ids in an array of their own"
            } else {
                "the array mixes strings, token ids and token-id arrays; use one form"
            })
        };
        while let Some(item) = seq.next_element::<Item>()? {
            match (&mut out, item) {
                (None, Item::Text(s)) => out = Some(TextsOrTokens::Texts(vec![s])),
                (None, Item::Id(i)) => out = Some(TextsOrTokens::Tokens(vec![i])),
                (None, Item::Ids(v)) => out = Some(TextsOrTokens::TokenLists(vec![v])),
                (Some(TextsOrTokens::Texts(all)), Item::Text(s)) => all.push(s),
                (Some(TextsOrTokens::Tokens(all)), Item::Id(i)) => all.push(i),
                (Some(TextsOrTokens::TokenLists(all)), Item::Ids(v)) => all.push(v),
                (Some(TextsOrTokens::Mixed(all)), Item::Text(s)) => all.push(TextOrIds::Text(s)),
                (Some(TextsOrTokens::Mixed(all)), Item::Ids(v)) => all.push(TextOrIds::Ids(v)),
                (Some(TextsOrTokens::Texts(all)), Item::Ids(v)) if self.mixed_ok => {
                    let mut items: Vec<TextOrIds> = std::mem::take(all)
                        .into_iter()
                        .map(TextOrIds::Text)
                        .collect();
                    items.push(TextOrIds::Ids(v));
                    out = Some(TextsOrTokens::Mixed(items));
                }
                (Some(TextsOrTokens::TokenLists(all)), Item::Text(s)) if self.mixed_ok => {
                    let mut items: Vec<TextOrIds> = std::mem::take(all)
                        .into_iter()
                        .map(TextOrIds::Ids)
                        .collect();
                    items.push(TextOrIds::Text(s));
                    out = Some(TextsOrTokens::Mixed(items));
                }
                _ => return Err(mixed()),
            }
        }
        Ok(out.unwrap_or(TextsOrTokens::Texts(Vec::new())))
    }
}

/// A unit enum read, and named in messages, by its wire names: implemented
/// by [`wire_names!`] from the one table that writes them.
pub(crate) trait WireName: Copy + 'static {
    /// The names, in the order an unknown name's error lists them.
    const NAMES: &'static [&'static str];
    /// `VALUES[i]` is the value named `NAMES[i]`.
    const VALUES: &'static [Self];
    /// Whether a name is read in any case (lowercased, then looked up).
    const ANY_CASE: bool;
    /// The value's name, as sent.
    fn name(self) -> &'static str;
}

/// A [`WireName`] enum from its name. Read as a string first, so that a
/// value that is not one (`5`, `true`) is a wrong shape naming the field
/// (400, or the route's 422), as another name is: serde's derived unit
/// enums report it as malformed JSON.
pub(crate) fn by_name<'de, D: Deserializer<'de>, T: WireName>(d: D) -> Result<T, D::Error> {
    let mut name = String::deserialize(d)?;
    if T::ANY_CASE {
        name = name.to_lowercase();
    }
    match T::NAMES.iter().position(|n| *n == name) {
        Some(i) => Ok(T::VALUES[i]),
        None => Err(de::Error::unknown_variant(&name, T::NAMES)),
    }
}

/// [`WireName`] and `Deserialize` (by [`by_name`]) for a unit enum, from
/// one table of `Variant => "name"` (led by `any case` for names read in
/// any case): the only place its names are written. `name` is a match, so a
/// variant left out of the table does not compile.
macro_rules! wire_names {
    (@impl $any_case:literal, $ty:ident { $($variant:ident => $name:literal),+ }) => {
        impl $crate::extract::WireName for $ty {
            const NAMES: &'static [&'static str] = &[$($name),+];
            const VALUES: &'static [Self] = &[$(Self::$variant),+];
            const ANY_CASE: bool = $any_case;
            fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $crate::extract::by_name(d)
            }
        }
    };
    (any case $ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        $crate::extract::wire_names!(@impl true, $ty { $($variant => $name),+ });
    };
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        $crate::extract::wire_names!(@impl false, $ty { $($variant => $name),+ });
    };
}
pub(crate) use wire_names;

/// `truncation_direction`: which end of an over-long input is kept.
/// `left` or `right` in any case (TEI sends `Left`/`Right`); `/info`
/// writes it in lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
#[schema(rename_all = "lowercase")]
pub enum TruncationSide {
    /// Cut the start, keep the last tokens.
    Left,
    /// Cut the end, keep the first tokens (default).
    Right,
}

impl From<TruncationSide> for TruncationDirection {
    fn from(side: TruncationSide) -> Self {
        match side {
            TruncationSide::Left => TruncationDirection::Left,
            TruncationSide::Right => TruncationDirection::Right,
        }
    }
}

impl From<TruncationDirection> for TruncationSide {
    fn from(direction: TruncationDirection) -> Self {
        match direction {
            TruncationDirection::Left => TruncationSide::Left,
            TruncationDirection::Right => TruncationSide::Right,
        }
    }
}

wire_names!(any case TruncationSide {
    Left => "left",
    Right => "right",
});

/// `priority`: `high`, `normal` (default) or `low`, any case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[schema(rename_all = "lowercase")]
pub enum PriorityName {
    High,
    Normal,
    Low,
}

impl From<PriorityName> for Priority {
    fn from(p: PriorityName) -> Self {
        match p {
            PriorityName::High => Priority::High,
            PriorityName::Normal => Priority::Normal,
            PriorityName::Low => Priority::Low,
        }
    }
}

wire_names!(any case PriorityName {
    High => "high",
    Normal => "normal",
    Low => "low",
});

#[cfg(test)]
mod tests {
    use super::*;

    fn oa(json: &str) -> Result<TextsOrTokens, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn openai_input_forms() {
        assert_eq!(oa(r#""a""#).unwrap(), TextsOrTokens::Text("a".into()));
        assert_eq!(
            oa(r#"["a","b"]"#).unwrap(),
            TextsOrTokens::Texts(vec!["a".into(), "b".into()])
        );
        assert_eq!(oa("[1,2]").unwrap(), TextsOrTokens::Tokens(vec![1, 2]));
        assert_eq!(
            oa("[[1],[2,3]]").unwrap(),
            TextsOrTokens::TokenLists(vec![vec![1], vec![2, 3]])
        );
        assert_eq!(oa("[]").unwrap(), TextsOrTokens::Texts(vec![]));
        for bad in [
            "[[[1]]]",
            r#"["a",1]"#,
            "[-1]",
            "[1.5]",
            "null",
            "3",
            r#"{"a":1}"#,
            "[null]",
        ] {
            assert!(oa(bad).is_err(), "{bad}");
        }
        // OpenAI's one form per list: texts beside token-id lists too.
        assert!(oa(r#"["a",[1]]"#).is_err());
    }

    #[test]
    fn tei_inputs_also_mix_texts_and_token_id_lists() {
        let tei = |json: &str| serde_json::from_str::<TeiInputs>(json).map(|t| t.0);
        for (json, want) in [
            (r#""a""#, TextsOrTokens::Text("a".into())),
            ("[1,2]", TextsOrTokens::Tokens(vec![1, 2])),
            (
                r#"["a","b"]"#,
                TextsOrTokens::Texts(vec!["a".into(), "b".into()]),
            ),
            (
                "[[1],[2,3]]",
                TextsOrTokens::TokenLists(vec![vec![1], vec![2, 3]]),
            ),
        ] {
            assert_eq!(tei(json).unwrap(), want, "{json}");
        }
        let (text, ids) = (|s: &str| TextOrIds::Text(s.into()), TextOrIds::Ids);
        assert_eq!(
            tei(r#"["a",[1,2],"b"]"#).unwrap(),
            TextsOrTokens::Mixed(vec![text("a"), ids(vec![1, 2]), text("b")])
        );
        assert_eq!(
            tei(r#"[[1],"a"]"#).unwrap(),
            TextsOrTokens::Mixed(vec![ids(vec![1]), text("a")])
        );
        assert_eq!(
            TeiInputs(TextsOrTokens::Mixed(vec![text("a"), ids(vec![7])])).into_inputs(),
            vec![EmbedInput::Text("a".into()), EmbedInput::Tokens(vec![7])]
        );
        // Bare ids say nothing of where one input ends: not beside other forms.
        for bad in [
            r#"["a",1]"#,
            r#"[1,"a"]"#,
            "[[1],2]",
            r#"["a",[1],2]"#,
            "[[[1]]]",
            "[null]",
        ] {
            let e = tei(bad).unwrap_err();
            assert!(e.is_data(), "{bad}");
        }
        assert!(tei(r#"["a",1]"#)
            .unwrap_err()
            .to_string()
            .starts_with("the array mixes token ids with strings or token-id arrays"));
    }

    #[test]
    fn jina_text_objects_are_texts_and_other_modalities_are_refused() {
        assert_eq!(
            oa(r#"[{"text":"a"},"b"]"#).unwrap(),
            TextsOrTokens::Texts(vec!["a".into(), "b".into()])
        );
        for (bad, says) in [
            (
                r#"[{"image":"https://x/y.png"}]"#,
                "an `image` input is not supported",
            ),
            (r#"[{"text":"a","image":"x"}]"#, "an `image` input"),
            (r#"[{"txt":"a"}]"#, "unknown field `txt`"),
            ("[{}]", "missing field `text`"),
            (r#"[{"text":1}]"#, "invalid type"),
            (r#"[{"text":"a"},1]"#, "mixes"),
        ] {
            let err = oa(bad).unwrap_err();
            assert!(err.is_data(), "{bad}: {err}");
            assert!(err.to_string().contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn option_names_ignore_case_and_refuse_others_as_data_errors() {
        let side = |s: &str| serde_json::from_str::<TruncationSide>(s);
        assert_eq!(side(r#""Left""#).unwrap(), TruncationSide::Left);
        assert_eq!(side(r#""right""#).unwrap(), TruncationSide::Right);
        assert_eq!(side(r#""RIGHT""#).unwrap(), TruncationSide::Right);
        for bad in [r#""middle""#, "1", "null", "[]"] {
            assert!(side(bad).unwrap_err().is_data(), "{bad}");
        }
        assert_eq!(
            side(r#""Middle""#).unwrap_err().to_string(),
            "unknown variant `middle`, expected `left` or `right`"
        );
        let prio = |s: &str| serde_json::from_str::<PriorityName>(s);
        assert_eq!(prio(r#""HIGH""#).unwrap(), PriorityName::High);
        assert_eq!(prio(r#""low""#).unwrap(), PriorityName::Low);
        assert!(prio(r#""urgent""#).unwrap_err().is_data());
    }

    /// Each name reads as the value that `name` writes back, and is the
    /// name the OpenAPI schema documents (its `rename_all`), in order.
    fn read_written_and_documented<T>()
    where
        T: WireName + DeserializeOwned + utoipa::PartialSchema,
    {
        for (name, value) in T::NAMES.iter().zip(T::VALUES) {
            let read: T = serde_json::from_value(name.to_string().into()).unwrap();
            assert_eq!((read.name(), value.name()), (*name, *name));
        }
        assert_eq!(T::NAMES.len(), T::VALUES.len());
        let schema = serde_json::to_value(T::schema()).unwrap();
        assert_eq!(schema["enum"], serde_json::json!(T::NAMES), "{schema}");
    }

    #[test]
    fn every_wire_name_is_read_written_and_documented_alike() {
        use crate::routes::{cohere, jina, openai, weaviate};
        read_written_and_documented::<TruncationSide>();
        read_written_and_documented::<PriorityName>();
        read_written_and_documented::<openai::EncodingFormat>();
        read_written_and_documented::<openai::Endianness>();
        read_written_and_documented::<openai::InputType>();
        read_written_and_documented::<openai::OutputDtype>();
        read_written_and_documented::<openai::JinaEmbeddingType>();
        read_written_and_documented::<cohere::CohereInputType>();
        read_written_and_documented::<cohere::CohereEmbeddingType>();
        read_written_and_documented::<cohere::CohereTruncate>();
        read_written_and_documented::<crate::routes::rerank::NimTruncate>();
        read_written_and_documented::<jina::InputType>();
        read_written_and_documented::<weaviate::TaskType>();
        // The lanes' own names (the core's, for the header and metrics).
        for (name, value) in PriorityName::NAMES.iter().zip(PriorityName::VALUES) {
            assert_eq!(Priority::from(*value).as_str(), *name);
        }
    }

    #[test]
    fn text_inputs_forms() {
        let one: TextInputs = serde_json::from_str(r#""x""#).unwrap();
        assert_eq!(one, TextInputs::One("x".into()));
        let many: TextInputs = serde_json::from_str(r#"["x","y"]"#).unwrap();
        assert_eq!(many.into_inputs().len(), 2);
        for bad in ["[1]", r#"[["x"]]"#, "null", "1", "[null]"] {
            assert!(serde_json::from_str::<TextInputs>(bad).is_err(), "{bad}");
        }
    }
}
