//! `POST /v1/embeddings` and `GET /v1/models`: OpenAI compatible.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::Json;
use base64::Engine as _;
use mlx_embed_core::{EmbedOptions, MetricsSnapshot, ModelKind, Priority, TruncationDirection};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use std::borrow::Cow;

use utoipa::openapi::schema::{AnyOfBuilder, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema};
use utoipa::openapi::RefOr;
use utoipa::PartialSchema;

use super::cohere::{self, CohereTruncate};
use super::Usage;
use crate::embed::{
    embed as run_embed, embed_late_chunks, output_dimension, EmbedOutput, EmbedRequest,
};
use crate::errors::{ApiError, OpenAi, OpenAiErrorBody, Shaped};
use crate::extract::{
    wire_names, ApiJson, PriorityHeader, TextsOrTokens, TruncationSide, WireName,
};
use crate::models::{ServedModel, Task};
use crate::state::AppState;

/// How vectors are encoded in the response: OpenAI's `float` and `base64`,
/// and Mixedbread's other forms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    /// JSON array of floats.
    #[default]
    Float,
    /// Mixedbread's: JSON array of floats, each rounded to the nearest float16.
    Float16,
    /// Base64 (standard alphabet) of the vector's bytes: float32, little-endian
    /// (or `output_dtype`'s type).
    Base64,
    /// Mixedbread's: `output_dtype: int8`'s integers.
    Int8,
    /// Mixedbread's: `output_dtype: uint8`'s integers.
    Uint8,
    /// Mixedbread's: `output_dtype: binary`'s packed sign bits.
    Binary,
    /// Mixedbread's: `output_dtype: ubinary`'s packed sign bits.
    Ubinary,
}

wire_names!(EncodingFormat {
    Float => "float",
    Float16 => "float16",
    Base64 => "base64",
    Int8 => "int8",
    Uint8 => "uint8",
    Binary => "binary",
    Ubinary => "ubinary",
});

impl std::fmt::Display for EncodingFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl EncodingFormat {
    /// What it says of the answer: how the numbers are written (`float`,
    /// `float16` or `base64`) and, where it says so, their type. Mixedbread's
    /// integer names are `output_dtype`'s forms, written as JSON integers;
    /// `float16` is floats only.
    fn parts(self) -> (EncodingFormat, Option<OutputDtype>) {
        match self {
            EncodingFormat::Float | EncodingFormat::Base64 => (self, None),
            EncodingFormat::Float16 => (self, Some(OutputDtype::Float)),
            EncodingFormat::Int8 => (EncodingFormat::Float, Some(OutputDtype::Int8)),
            EncodingFormat::Uint8 => (EncodingFormat::Float, Some(OutputDtype::Uint8)),
            EncodingFormat::Binary => (EncodingFormat::Float, Some(OutputDtype::Binary)),
            EncodingFormat::Ubinary => (EncodingFormat::Float, Some(OutputDtype::Ubinary)),
        }
    }
}

/// `encoding_format`: one format, or Mixedbread's list of them, where each
/// vector is answered as an object with one key per format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodingFormats {
    One(EncodingFormat),
    Many(Vec<EncodingFormat>),
}

impl EncodingFormats {
    /// Whether Mixedbread's API asked for it (a list, or a format OpenAI
    /// does not have): its answer then carries Mixedbread's `normalized`,
    /// `encoding_format` and `dimensions`. OpenAI's answers stay OpenAI's.
    fn is_mixedbread(&self) -> bool {
        !matches!(
            self,
            EncodingFormats::One(EncodingFormat::Float | EncodingFormat::Base64)
        )
    }
}

impl<'de> Deserialize<'de> for EncodingFormats {
    /// By hand: a name or a list of names, each read as [`EncodingFormat`]
    /// (an unknown one's message lists the names).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = EncodingFormats;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Self::Value, E> {
                use serde::de::IntoDeserializer;
                crate::extract::by_name(name.into_deserializer()).map(EncodingFormats::One)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut formats = Vec::new();
                while let Some(format) = seq.next_element::<EncodingFormat>()? {
                    formats.push(format);
                }
                Ok(EncodingFormats::Many(formats))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl Serialize for EncodingFormats {
    /// As sent: a name, or the list of names.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            EncodingFormats::One(format) => s.serialize_str(format.name()),
            EncodingFormats::Many(formats) => {
                s.collect_seq(formats.iter().map(|format| format.name()))
            }
        }
    }
}

impl PartialSchema for EncodingFormats {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(EncodingFormat::schema())
            .item(
                ArrayBuilder::new()
                    .items(EncodingFormat::schema())
                    .min_items(Some(1)),
            )
            .description(Some(
                "A format, or (Mixedbread's) a list of formats: each vector is then an object \
                 with one key per format, each written as that format alone writes it",
            ))
            .into()
    }
}

impl ToSchema for EncodingFormats {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("EncodingFormats")
    }
}

/// What Infinity's `modality` says the inputs are: text is all this server embeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Modality {
    Text,
}

// Not derived, as `wire_names!` enums are not: another value is a wrong shape
// (400) that says why, not malformed JSON.
impl<'de> Deserialize<'de> for Modality {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        match name.as_str() {
            "text" => Ok(Modality::Text),
            other => Err(serde::de::Error::custom(format!(
                "modality `{other}` is not supported: this server embeds text (`text`)"
            ))),
        }
    }
}

/// Byte order of base64 vectors (vLLM's `endianness`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Endianness {
    /// The server's own: little-endian on every platform it is built for.
    #[default]
    Native,
    Little,
    Big,
}

wire_names!(Endianness {
    Native => "native",
    Little => "little",
    Big => "big",
});

impl Endianness {
    fn is_big(self) -> bool {
        match self {
            Endianness::Native => cfg!(target_endian = "big"),
            Endianness::Little => false,
            Endianness::Big => true,
        }
    }
}

/// Voyage AI's `input_type`: what the texts are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum InputType {
    Query,
    Document,
    /// NVIDIA NIM's name for a document.
    Passage,
}

wire_names!(InputType {
    Query => "query",
    Document => "document",
    Passage => "passage",
});

impl InputType {
    /// Its role: a passage is a model's `passage` prompt first, a
    /// document its `document` one.
    fn role(self) -> super::Role {
        match self {
            InputType::Query => super::Role::Query,
            InputType::Document => super::Role::Document,
            InputType::Passage => super::Role::Passage,
        }
    }
}

/// Voyage AI's `output_dtype`: the type of each vector's numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum OutputDtype {
    /// float32.
    #[default]
    Float,
    /// `round(127 x)` per component, as Cohere's `int8`.
    Int8,
    /// `int8` + 128.
    Uint8,
    /// One sign bit per component (`x > 0`), eight to a byte, first component
    /// in the high bit, minus 128 (offset binary).
    Binary,
    /// `binary` + 128: the sign bits as unsigned bytes.
    Ubinary,
}

wire_names!(OutputDtype {
    Float => "float",
    Int8 => "int8",
    Uint8 => "uint8",
    Binary => "binary",
    Ubinary => "ubinary",
});

/// Jina AI's `embedding_type`: one name for the pair `encoding_format` and
/// `output_dtype` name apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JinaEmbeddingType {
    Float,
    /// `encoding_format: base64`: the float32 bytes.
    Base64,
    /// `output_dtype: binary`.
    Binary,
    /// `output_dtype: ubinary`.
    Ubinary,
}

wire_names!(JinaEmbeddingType {
    Float => "float",
    Base64 => "base64",
    Binary => "binary",
    Ubinary => "ubinary",
});

impl std::fmt::Display for JinaEmbeddingType {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl JinaEmbeddingType {
    /// The `encoding_format` and `output_dtype` it stands for.
    fn parts(self) -> (EncodingFormat, OutputDtype) {
        match self {
            JinaEmbeddingType::Float => (EncodingFormat::Float, OutputDtype::Float),
            JinaEmbeddingType::Base64 => (EncodingFormat::Base64, OutputDtype::Float),
            JinaEmbeddingType::Binary => (EncodingFormat::Float, OutputDtype::Binary),
            JinaEmbeddingType::Ubinary => (EncodingFormat::Float, OutputDtype::Ubinary),
        }
    }
}

/// How a request wants its vectors written: the format, for base64 the byte
/// order, and the numbers' type; or Mixedbread's several formats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VectorEncoding {
    /// `float`, `float16` or `base64` (Mixedbread's integer names are read
    /// as their `dtype`).
    pub format: EncodingFormat,
    pub endianness: Endianness,
    pub dtype: OutputDtype,
    /// Mixedbread's list of formats: each vector is an object keyed by
    /// these (each once, in the order sent), each written as that format
    /// alone writes it.
    pub keyed: Option<Vec<EncodingFormat>>,
    /// The field that asked for integers, which quantize a unit vector (a
    /// 400 where the vectors are not normalized).
    quantized_by: Option<&'static str>,
}

/// `truncate` on `/v1/embeddings`: this server's boolean, or NVIDIA NIM's
/// `NONE`, `START` or `END` (Cohere's names, and meaning), which NIM's
/// clients send with every call (`NONE` by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenAiTruncate {
    /// `true` cuts an over-long input (at the model's own end), `false` refuses it.
    Bool(bool),
    /// NIM's: `END` cuts an over-long input's end, `START` its start, `NONE` refuses it.
    Nim(CohereTruncate),
}

impl<'de> Deserialize<'de> for OpenAiTruncate {
    /// By hand: a boolean or one of NIM's names, and a message that says so
    /// for anything else (serde's untagged enums name the Rust type).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = OpenAiTruncate;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false, or NVIDIA NIM's `NONE`, `START` or `END`")
            }
            fn visit_bool<E: serde::de::Error>(self, cut: bool) -> Result<Self::Value, E> {
                Ok(OpenAiTruncate::Bool(cut))
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<Self::Value, E> {
                use serde::de::IntoDeserializer;
                crate::extract::by_name::<_, CohereTruncate>(name.into_deserializer())
                    .map(OpenAiTruncate::Nim)
                    .map_err(|_: E| E::invalid_value(serde::de::Unexpected::Str(name), &self))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl PartialSchema for OpenAiTruncate {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(bool::schema())
            .item(CohereTruncate::schema())
            .description(Some(
                "true (default) cuts an over-long input, false refuses it (400); or NVIDIA NIM's \
                 `END` (cut its end), `START` (cut its start) or `NONE` (refuse it)",
            ))
            .into()
    }
}

impl ToSchema for OpenAiTruncate {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("OpenAiTruncate")
    }
}

/// Mixedbread's `truncation_strategy`: NIM's and Cohere's `truncate` names, in
/// lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TruncationStrategy {
    /// Cut an over-long input's start (keep its end).
    Start,
    /// Cut its end (Mixedbread's default).
    End,
    /// Refuse it (400).
    None,
}

wire_names!(TruncationStrategy {
    Start => "start",
    End => "end",
    None => "none",
});

impl TruncationStrategy {
    /// Cohere's (and NIM's) name for the same.
    fn cohere(self) -> CohereTruncate {
        match self {
            TruncationStrategy::Start => CohereTruncate::Start,
            TruncationStrategy::End => CohereTruncate::End,
            TruncationStrategy::None => CohereTruncate::None,
        }
    }
}

/// What one field of `/v1/embeddings` says about an over-long input: whether
/// it is cut, and which end.
struct CutSaid {
    field: &'static str,
    /// The value as sent, for a message.
    shown: &'static str,
    truncates: Option<bool>,
    direction: Option<TruncationDirection>,
}

impl CutSaid {
    fn names(name: &'static str, field: &'static str, nim: CohereTruncate) -> Self {
        CutSaid {
            field,
            shown: name,
            truncates: Some(nim.truncates()),
            direction: nim.direction(),
        }
    }
}

/// Whether an over-long input is cut (default true) and at which end (unsaid:
/// the model's), from every field that says so: `truncate` (a boolean or NIM's
/// names), Voyage's `truncation`, vLLM's `truncation_side` and Mixedbread's
/// `truncation_strategy`. Two that disagree are a 400 naming both; the second
/// return is the field that refused an over-long input, for the 400's advice.
fn agreed_cut(
    said: &[CutSaid],
) -> Result<(bool, Option<TruncationDirection>, Option<&CutSaid>), ApiError> {
    let cut = first_agreeing(
        said,
        |s| s.truncates,
        |c, s| {
            format!(
                "{} ({}) and {} ({}) are the same setting and disagree: send one",
                c.field, c.shown, s.field, s.shown
            )
        },
    )?;
    let end = first_agreeing(
        said,
        |s| s.direction,
        |e, s| {
            format!(
                "{} {} and {} {} name different ends to cut: send one",
                e.field, e.shown, s.field, s.shown
            )
        },
    )?;
    let truncates = cut.is_none_or(|c| c.truncates == Some(true));
    Ok((
        truncates,
        end.and_then(|e| e.direction),
        cut.filter(|_| !truncates),
    ))
}

/// The first of `said` that says `what` (`Some`), once every other that
/// says it agrees; two that differ are a 400 (`disagree`'s words) naming the
/// later field.
fn first_agreeing<T: PartialEq>(
    said: &[CutSaid],
    what: impl Fn(&CutSaid) -> Option<T>,
    disagree: impl Fn(&CutSaid, &CutSaid) -> String,
) -> Result<Option<&CutSaid>, ApiError> {
    let mut first: Option<&CutSaid> = None;
    for s in said.iter().filter(|s| what(s).is_some()) {
        match first {
            Some(f) if what(f) != what(s) => {
                return Err(ApiError::invalid(disagree(f, s)).param(s.field))
            }
            Some(_) => {}
            None => first = Some(s),
        }
    }
    Ok(first)
}

/// OpenAI embeddings request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct OpenAiEmbeddingRequest {
    /// A string, strings, token ids, or lists of token ids (the model's own tokenizer's,
    /// run as given, special tokens included, as `/tokenize` lists them: ids that do not
    /// begin and end with the model's special tokens are a 400, being likely another
    /// tokenizer's; TEI's `/embed` runs them). Token ids with `model` naming one of
    /// OpenAI's models (`text-embedding-*`, in any case) are tiktoken's: a 400, even
    /// where the served model is named so.
    pub input: TextsOrTokens,
    /// Which served model answers (`/v1/models` lists them); default: the first
    /// embedding model.
    pub model: Option<String>,
    /// `float` (default) or `base64`: base64 of the vector's bytes, in
    /// `output_dtype`'s type (float32: four bytes each, little-endian unless
    /// `endianness: big`; the others one byte each), as Voyage's client decodes it.
    /// Mixedbread's too: `float16` (floats rounded to the nearest float16),
    /// `int8`, `uint8`, `binary`, `ubinary` (`output_dtype`'s integers, as
    /// JSON), or a list of formats: each `embedding` is then an object with a
    /// key per format (`object: embedding_dict`). A Mixedbread form's answer
    /// also carries `normalized`, `encoding_format` and `dimensions`; so does
    /// a `float` or `base64` request with Mixedbread's `normalized`, `prompt`
    /// or `truncation_strategy` and no field of another API's.
    pub encoding_format: Option<EncodingFormats>,
    /// vLLM's: the byte order of `base64` vectors, `native` (default: little-endian
    /// here), `little` or `big`.
    pub endianness: Option<Endianness>,
    /// Keep the first N components (1..=dimension), re-normalized. 0 is a
    /// 400, as OpenAI answers, except with Infinity's `modality` set: there it
    /// is the full dimension, as Infinity reads it (its client sends
    /// `dimensions: 0` and `modality: "text"` unless told otherwise).
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub dimensions: Option<i64>,
    /// Infinity's: `text`, the only modality served (`image` and `audio`
    /// are a 400). Infinity's client sends it. Not an OpenAI field.
    pub modality: Option<Modality>,
    /// Accepted and ignored.
    pub user: Option<String>,
    /// One of the model's named prompts (`/info` lists them); default: the model's default
    /// prompt. Not an OpenAI field: the official client sends it with `extra_body`.
    pub prompt_name: Option<String>,
    /// Mixedbread's: text put before every input instead of a named prompt (`""`: none
    /// at all), as the native route's `prompt`. Not with `prompt_name` or `input_type`.
    pub prompt: Option<String>,
    /// vLLM's request priority: lower is served earlier, 0 is the default. Below 0 is the high
    /// lane, 0 normal, above 0 low. Wins over an `X-Priority` header. The official client
    /// sends it with `extra_body`.
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub priority: Option<i64>,
    /// Truncate inputs longer than the model's maximum (default true, as the other routes do);
    /// false answers 400 instead, as OpenAI refuses an over-long input. Not an OpenAI field:
    /// the official client sends it with `extra_body`. NVIDIA NIM's `END`, `START` and
    /// `NONE` say the same with the end to cut (`START` keeps the input's end); with
    /// `truncation_side` too, the two must name the same end.
    pub truncate: Option<OpenAiTruncate>,
    /// vLLM's: false answers the vectors before normalization (so does its older
    /// `normalize: false`).
    pub use_activation: Option<bool>,
    /// vLLM's older name for `use_activation`.
    pub normalize: Option<bool>,
    /// vLLM's: cut every input at this many tokens (special tokens included), at
    /// most the model's maximum; -1 (or none): the model's maximum. Text and
    /// token ids are cut alike (inside the model's special tokens), so a text
    /// and its `/tokenize` ids give one vector; `truncation_side` picks the end.
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: which end an over-long input loses: `right` keeps its first
    /// tokens, `left` its last; unsaid: the model folder's `truncation_side`, else right.
    pub truncation_side: Option<TruncationSide>,
    /// vLLM's: true (the default); false is refused (400): inputs are tokenized
    /// with the model's special tokens, which its pooling reads.
    pub add_special_tokens: Option<bool>,
    /// vLLM's: `float32` (the default); others are refused (400) rather than
    /// answered in float32 bytes a client would decode as another type.
    pub embed_dtype: Option<String>,
    /// Voyage AI's: `query` or `document` (NVIDIA NIM's `passage` too) picks the
    /// model's prompt of that role where it has one (as Cohere's `input_type`;
    /// `document` tries a prompt named `document`, then `passage`, and
    /// `passage` the other way round), else its default prompt; null: the
    /// default prompt. On a model with task adapters (jina-embeddings-v3) it
    /// picks the task instead, as `task` would: `query` is `retrieval.query`,
    /// `document` and `passage` are `retrieval.passage` (with `task` too, the
    /// two must agree). Not with `prompt_name`.
    pub input_type: Option<InputType>,
    /// Voyage AI's name for `dimensions` (both set: they must be equal).
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "crate::extract::whole_number")]
    pub output_dimension: Option<i64>,
    /// Voyage AI's name for `truncate` (both set: they must be equal): false
    /// answers 400 for an over-long input.
    pub truncation: Option<bool>,
    /// Mixedbread's: `end` (default) cuts an over-long input's end, `start` its
    /// start, `none` refuses it (400). With `truncate`, `truncation` or
    /// `truncation_side` too, they must agree.
    pub truncation_strategy: Option<TruncationStrategy>,
    /// Voyage AI's: `float` (default), or quantized forms of the unit vector:
    /// `int8` (`round(127 x)`), `uint8` (that + 128), `binary` (sign bits,
    /// `x > 0`, eight to a byte, first component in the high bit, minus 128)
    /// or `ubinary` (the sign bits unsigned); the bit forms have a byte per
    /// eight components (the last padded with zeros). Not with `use_activation: false`.
    pub output_dtype: Option<OutputDtype>,
    /// Jina AI's: the task adapter to run with, one of the model's `tasks`
    /// (`/info` lists them; jina-embeddings-v3: `retrieval.query`,
    /// `retrieval.passage`, `separation`, `classification`, `text-matching`),
    /// with the model's prompt of that name unless `prompt_name` picks
    /// another. A model without task adapters, or an unknown task, is a 400;
    /// so is an `input_type` or a `prompt_name` that picks another task. Not
    /// an OpenAI field.
    pub task: Option<String>,
    /// Jina AI's name for `normalize`: false answers the vectors before
    /// normalization.
    pub normalized: Option<bool>,
    /// Jina AI's: `float` (default), `base64` (the float32 bytes, as
    /// `encoding_format: base64`), `binary` or `ubinary` (as `output_dtype`'s).
    /// With `encoding_format` or `output_dtype` too, they must say the same
    /// (else a 400), so that neither is silently left out.
    pub embedding_type: Option<JinaEmbeddingType>,
    /// `embedding_type`'s other name, which LangChain's and LlamaIndex's Jina
    /// clients send (they unpack the bits they ask for); with both, they must
    /// be equal (else a 400).
    pub encoding_type: Option<JinaEmbeddingType>,
    /// Jina AI's: true reads the inputs as the chunks of one text, in order:
    /// joined by a space and run as one input, each chunk's vector is the mean
    /// of its own tokens' last hidden states (late chunking), then
    /// `dimensions` and normalization as usual. Texts only; a mean-pooling
    /// model with no Dense after its pooling only (a folder's `truncate_dim`
    /// cuts each chunk's mean); the joined text must fit the model's maximum
    /// length (else a 400 `context_length_exceeded`, `truncate`
    /// notwithstanding); `task` runs its adapter over the joined text. Counted
    /// as the chunks sent; `usage` is the joined text's tokens. False or
    /// unsaid: each input on its own.
    pub late_chunking: Option<bool>,
}

/// A float array, an integer array (`output_dtype` other than `float`),
/// base64 of the vector's bytes, or (Mixedbread's list of formats) an object
/// of these keyed by format.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum EmbeddingValue {
    Float(Vec<f32>),
    /// float16 values, written as f64 so that each number in the JSON is
    /// the float16's exact value (f32's shortest digits read as another
    /// number by a client parsing float64), as Mixedbread writes them.
    Half(Vec<f64>),
    Int8(Vec<i8>),
    Uint8(Vec<u8>),
    Base64(String),
    ByFormat(ByFormat),
}

/// One vector in several formats: a JSON object, a key per format, in the
/// order asked.
#[derive(Debug)]
pub struct ByFormat(Vec<(&'static str, EmbeddingValue)>);

impl Serialize for ByFormat {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(name, value)| (name, value)))
    }
}

// By hand: any of the forms (a float vector such as `[1.0]` is also an
// integer array, which `oneOf` would refuse).
impl PartialSchema for EmbeddingValue {
    fn schema() -> RefOr<Schema> {
        AnyOfBuilder::new()
            .item(Vec::<f32>::schema())
            .item(Vec::<i8>::schema())
            .item(Vec::<u8>::schema())
            .item(String::schema())
            .item(
                ObjectBuilder::new()
                    .additional_properties(Some(RefOr::<Schema>::from(
                        AnyOfBuilder::new()
                            .item(ArrayBuilder::new())
                            .item(String::schema()),
                    )))
                    .description(Some(
                        "Mixedbread's list of formats: a key per format asked, each value as \
                         that format alone writes it (an array, or base64's string)",
                    )),
            )
            .description(Some(
                "Floats, integers (`output_dtype` int8, uint8, binary, ubinary), base64 of the \
                 vector's bytes, or an object of these keyed by format",
            ))
            .into()
    }
}

impl ToSchema for EmbeddingValue {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("EmbeddingValue")
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiEmbedding {
    /// `embedding`; `embedding_dict` for Mixedbread's list of formats (an
    /// object keyed by format).
    pub object: String,
    pub index: usize,
    pub embedding: EmbeddingValue,
}

/// OpenAI embeddings response. Vectors are unit length.
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiEmbeddingResponse {
    /// Always `list`.
    pub object: String,
    pub data: Vec<OpenAiEmbedding>,
    pub model: String,
    pub usage: Usage,
    /// Mixedbread's (only for Mixedbread's request: an `encoding_format`
    /// OpenAI lacks, or `normalized`, `prompt` or `truncation_strategy` with
    /// no other API's field): whether the vectors are unit length.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub normalized: Option<bool>,
    /// Mixedbread's: `encoding_format` as sent (`float` where unsaid).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<EncodingFormats>)]
    pub encoding_format: Option<EncodingFormats>,
    /// Mixedbread's: the vectors' dimension (before any packing into bits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<usize>,
}

impl EmbeddingValue {
    /// `v` as `encoding` asks.
    pub fn encode(v: Vec<f32>, encoding: &VectorEncoding) -> Self {
        let big = encoding.endianness.is_big();
        let Some(formats) = &encoding.keyed else {
            return Self::write(Cow::Owned(v), encoding.format, encoding.dtype, big);
        };
        // Every form is written from the vector borrowed, except `float`,
        // which is the vector itself: it takes it once the others are
        // written (the list holds each format once).
        let written: Vec<(EncodingFormat, Option<Self>)> = formats
            .iter()
            .map(|&format| {
                let value = (format != EncodingFormat::Float)
                    .then(|| Self::write(Cow::Borrowed(&v), format, OutputDtype::Float, big));
                (format, value)
            })
            .collect();
        let mut float = Some(v);
        EmbeddingValue::ByFormat(ByFormat(
            written
                .into_iter()
                .map(|(format, value)| {
                    let value = value
                        .unwrap_or_else(|| EmbeddingValue::Float(float.take().unwrap_or_default()));
                    (format.name(), value)
                })
                .collect(),
        ))
    }

    /// `v` written as `format` of `dtype` numbers (a Mixedbread name's own
    /// type wins: the agreement is checked before). Only the float form
    /// keeps the vector: the others read it, so it may be borrowed.
    fn write(
        v: Cow<'_, [f32]>,
        format: EncodingFormat,
        dtype: OutputDtype,
        big_endian: bool,
    ) -> Self {
        let (format, said) = format.parts();
        let dtype = said.unwrap_or(dtype);
        let base64 = format == EncodingFormat::Base64;
        let bytes = |b: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(b);
        // Signed bytes as they lie in memory (two's complement), as numpy reads them.
        let signed = |b: Vec<i8>| bytes(b.into_iter().map(|x| x as u8).collect());
        match (dtype, base64) {
            (OutputDtype::Float, false) if format == EncodingFormat::Float16 => {
                EmbeddingValue::Half(cohere::float16(&v).into_iter().map(f64::from).collect())
            }
            (OutputDtype::Float, false) => EmbeddingValue::Float(v.into_owned()),
            (OutputDtype::Float, true) => EmbeddingValue::Base64(base64_bytes(&v, big_endian)),
            (OutputDtype::Int8, false) => EmbeddingValue::Int8(cohere::int8(&v)),
            (OutputDtype::Int8, true) => EmbeddingValue::Base64(signed(cohere::int8(&v))),
            (OutputDtype::Uint8, false) => EmbeddingValue::Uint8(cohere::uint8(&v)),
            (OutputDtype::Uint8, true) => EmbeddingValue::Base64(bytes(cohere::uint8(&v))),
            (OutputDtype::Binary, false) => EmbeddingValue::Int8(cohere::binary(&v)),
            (OutputDtype::Binary, true) => EmbeddingValue::Base64(signed(cohere::binary(&v))),
            (OutputDtype::Ubinary, false) => EmbeddingValue::Uint8(cohere::sign_bits(&v)),
            (OutputDtype::Ubinary, true) => EmbeddingValue::Base64(bytes(cohere::sign_bits(&v))),
        }
    }
}

impl OpenAiEmbeddingRequest {
    /// Whether an over-long input is cut, at which end (unsaid: the model's),
    /// and the advice for the 400 when it is refused (the refusing field's own terms).
    fn cut(&self) -> Result<(bool, Option<TruncationDirection>, Option<&'static str>), ApiError> {
        let shown = |cut: bool| if cut { "true" } else { "false" };
        let said: Vec<CutSaid> = [
            self.truncate.map(|t| match t {
                OpenAiTruncate::Bool(cut) => CutSaid {
                    field: "truncate",
                    shown: shown(cut),
                    truncates: Some(cut),
                    direction: None,
                },
                OpenAiTruncate::Nim(nim) => CutSaid::names(nim.name(), "truncate", nim),
            }),
            self.truncation.map(|cut| CutSaid {
                field: "truncation",
                shown: shown(cut),
                truncates: Some(cut),
                direction: None,
            }),
            self.truncation_side.map(|side| CutSaid {
                field: "truncation_side",
                shown: side.name(),
                truncates: None,
                direction: Some(side.into()),
            }),
            self.truncation_strategy
                .map(|s| CutSaid::names(s.name(), "truncation_strategy", s.cohere())),
        ]
        .into_iter()
        .flatten()
        .collect();
        let (truncate, direction, refused_by) = agreed_cut(&said)?;
        // The shared 400's advice names the field that refused, in its own terms.
        let fix = refused_by.map(|by| match (by.field, by.shown) {
            ("truncation", _) => "set truncation to true",
            ("truncation_strategy", _) => "set truncation_strategy to end or start",
            ("truncate", "NONE") => "set truncate to END or START",
            _ => "set truncate to true",
        });
        Ok((truncate, direction, fix))
    }

    /// Jina's answer form with the name it was sent under: `embedding_type`,
    /// or `encoding_type` (LangChain's and LlamaIndex's Jina clients); both
    /// are one setting, so both and different is a 400.
    fn jina_type(&self) -> Result<Option<(&'static str, JinaEmbeddingType)>, ApiError> {
        one_of(
            ("embedding_type", self.embedding_type),
            ("encoding_type", self.encoding_type),
        )?;
        let named = |name, value: Option<JinaEmbeddingType>| value.map(|t| (name, t));
        Ok(named("embedding_type", self.embedding_type)
            .or(named("encoding_type", self.encoding_type)))
    }

    /// How the answer writes the vectors: OpenAI's (or Mixedbread's)
    /// `encoding_format`, Voyage's `output_dtype`, or Jina's `embedding_type`
    /// for both (a 400 where it and one of them disagree). Mixedbread's
    /// integer names are `output_dtype`'s forms, and `float16` is floats: an
    /// `output_dtype` that says otherwise is a 400 naming both.
    pub fn vector_encoding(&self) -> Result<VectorEncoding, ApiError> {
        let endianness = self.endianness.unwrap_or_default();
        let jina = self.jina_type()?;
        let one = match &self.encoding_format {
            None => None,
            Some(EncodingFormats::One(format)) => Some(*format),
            Some(EncodingFormats::Many(formats)) => {
                return self.keyed_encoding(formats, jina.map(|(field, _)| field), endianness)
            }
        };
        let (format, said) = match one.map(EncodingFormat::parts) {
            Some((format, said)) => (Some(format), said),
            None => (None, None),
        };
        if let (Some(sent), Some(said), Some(dtype)) = (one, said, self.output_dtype) {
            if said != dtype {
                return Err(ApiError::invalid(format!(
                    "encoding_format {sent} is output_dtype {} and output_dtype is {}: they \
                     disagree, send one",
                    said.name(),
                    dtype.name(),
                ))
                .param("output_dtype"));
            }
        }
        let dtype = said.or(self.output_dtype);
        let (format, dtype) = match jina {
            None => (format, dtype),
            Some((field, jina)) => {
                let (jina_format, jina_dtype) = jina.parts();
                let disagrees = format.is_some_and(|f| f != jina_format)
                    || dtype.is_some_and(|t| t != jina_dtype);
                let (format, dtype) = (jina_format, jina_dtype);
                if disagrees {
                    return Err(ApiError::invalid(format!(
                        "{field} {} is encoding_format {} with output_dtype {}: \
                         send {field} alone, or encoding_format and output_dtype \
                         without it",
                        jina.name(),
                        format.name(),
                        dtype.name(),
                    ))
                    .param(field));
                }
                (Some(format), Some(dtype))
            }
        };
        let dtype = dtype.unwrap_or_default();
        let quantized_by = (dtype != OutputDtype::Float).then_some(match (jina, said) {
            (Some((field, _)), _) => field,
            (None, Some(_)) => "encoding_format",
            (None, None) => "output_dtype",
        });
        Ok(VectorEncoding {
            format: format.unwrap_or_default(),
            endianness,
            dtype,
            keyed: None,
            quantized_by,
        })
    }

    /// Mixedbread's list of formats: each vector answered in each (once,
    /// in the order sent). The list says every form's numbers, so
    /// `output_dtype` or Jina's field beside it is a 400 naming both, as an
    /// empty list is (an answer of no vectors).
    fn keyed_encoding(
        &self,
        formats: &[EncodingFormat],
        jina: Option<&'static str>,
        endianness: Endianness,
    ) -> Result<VectorEncoding, ApiError> {
        if formats.is_empty() {
            return Err(ApiError::invalid(format!(
                "encoding_format is an empty list: name at least one of {} (or leave it out for \
                 float)",
                EncodingFormat::NAMES.join(", ")
            ))
            .param("encoding_format"));
        }
        if let Some(field) = jina.or(self.output_dtype.map(|_| "output_dtype")) {
            return Err(ApiError::invalid(format!(
                "encoding_format, a list, names each format's numbers itself, and {field} \
                 names one type for all: send encoding_format without {field}"
            ))
            .param(field));
        }
        let mut keyed: Vec<EncodingFormat> = Vec::with_capacity(formats.len());
        for &format in formats {
            if !keyed.contains(&format) {
                keyed.push(format);
            }
        }
        let quantized_by = keyed
            .iter()
            .any(|f| f.parts().1.is_some_and(|d| d != OutputDtype::Float))
            .then_some("encoding_format");
        Ok(VectorEncoding {
            endianness,
            keyed: Some(keyed),
            quantized_by,
            ..VectorEncoding::default()
        })
    }

    /// Whether the request is Mixedbread's, whose answer carries
    /// `normalized`, `encoding_format` and `dimensions` (its SDK's typed
    /// answer reads them: left out, they read as None). Mixedbread's: an
    /// `encoding_format` OpenAI does not have (a list, `float16`, the
    /// integer forms); or a field of Mixedbread's that OpenAI's API does
    /// not have (`normalized`, `prompt` or `truncation_strategy`) with no
    /// field Mixedbread's API lacks ([`Self::speaks_another_api`]). An
    /// OpenAI request sends none of Mixedbread's, and Jina's `normalized`
    /// comes with Jina's own `task`, `late_chunking` or `embedding_type`
    /// (as Jina's clients send them), so their answers stay as they were,
    /// byte for byte. (The SDK sending none of them, `embed(model=,
    /// input=)` alone, is an OpenAI request: its answer has no
    /// `normalized`.)
    fn is_mixedbread(&self) -> bool {
        self.encoding_format
            .as_ref()
            .is_some_and(EncodingFormats::is_mixedbread)
            || (!self.speaks_another_api()
                && (self.normalized.is_some()
                    || self.prompt.is_some()
                    || self.truncation_strategy.is_some()))
    }

    /// Whether the request sends a field Mixedbread's API does not have
    /// (OpenAI's own aside): Jina's (`task`, `late_chunking`, `truncate`,
    /// `embedding_type`, `encoding_type`: `normalized` is Jina's too),
    /// Voyage's, vLLM's, NIM's, Infinity's, or this server's extensions.
    /// Such a request is that API's, whatever else it sends.
    fn speaks_another_api(&self) -> bool {
        // Jina's.
        self.task.is_some()
            || self.late_chunking.is_some()
            || self.embedding_type.is_some()
            || self.encoding_type.is_some()
            // Voyage's.
            || self.output_dtype.is_some()
            || self.input_type.is_some()
            || self.output_dimension.is_some()
            || self.truncation.is_some()
            // vLLM's.
            || self.use_activation.is_some()
            || self.normalize.is_some()
            || self.truncate_prompt_tokens.is_some()
            || self.truncation_side.is_some()
            || self.add_special_tokens.is_some()
            || self.embed_dtype.is_some()
            || self.endianness.is_some()
            || self.priority.is_some()
            // Infinity's; this server's; Jina's and NIM's truncate.
            || self.modality.is_some()
            || self.prompt_name.is_some()
            || self.truncate.is_some()
    }

    /// Whether the vectors are normalized: vLLM's `use_activation` (or its
    /// older `normalize`), Jina's and Mixedbread's `normalized`; default true.
    fn normalizes(&self) -> bool {
        self.use_activation
            .or(self.normalize)
            .or(self.normalized)
            .unwrap_or(true)
    }
}

/// Little-endian f32 bytes, base64 (standard alphabet, padded).
pub fn encode_base64(v: &[f32]) -> String {
    base64_bytes(v, false)
}

/// `v`'s f32 bytes, big- or little-endian, base64 (standard alphabet, padded).
fn base64_bytes(v: &[f32], big_endian: bool) -> String {
    let bytes: Vec<u8> = if big_endian {
        v.iter().flat_map(|x| x.to_be_bytes()).collect()
    } else {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    };
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Create embeddings (also served at `/embeddings`).
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/v1/embeddings", tag = "openai", operation_id = "openai_embeddings",
    request_body = OpenAiEmbeddingRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "Embeddings in input order", body = OpenAiEmbeddingResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a wrong shape and an over-long input with `truncate: false`, as OpenAI answers; 401, 404 unknown model (below), 413, 415, 429)", Task::Embed), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn embeddings(
    State(state): State<AppState>,
    PriorityHeader(header, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<OpenAiEmbeddingRequest, OpenAi>,
) -> Result<Json<OpenAiEmbeddingResponse>, Shaped<OpenAi>> {
    let format = req.vector_encoding()?;
    // Mixedbread's answer carries its own fields; OpenAI's stays as it is.
    let mixedbread = req.is_mixedbread().then(|| {
        let sent = req.encoding_format.clone();
        (
            sent.unwrap_or(EncodingFormats::One(EncodingFormat::Float)),
            req.normalizes(),
        )
    });
    let out = embed_request(&state, header, req).await?;
    let dimensions = out.vectors.first().map(Vec::len);
    let object = if format.keyed.is_some() {
        "embedding_dict"
    } else {
        "embedding"
    };
    let data = out
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| OpenAiEmbedding {
            object: object.into(),
            index,
            embedding: EmbeddingValue::encode(v, &format),
        })
        .collect();
    let (encoding_format, normalized) = mixedbread.unzip();
    Ok(Json(OpenAiEmbeddingResponse {
        object: "list".into(),
        data,
        model: out.model,
        usage: Usage::new(out.prompt_tokens, out.cache_hits),
        dimensions: dimensions.filter(|_| normalized.is_some()),
        normalized,
        encoding_format,
    }))
}

/// The vectors `/v1/embeddings` answers `req` with (also vLLM's `/pooling`
/// for an embedding model); `header`: the `X-Priority` header's lane.
pub(crate) async fn embed_request(
    state: &AppState,
    header: Option<Priority>,
    req: OpenAiEmbeddingRequest,
) -> Result<EmbedOutput, ApiError> {
    refuse_tiktoken_ids(state, req.model.as_deref(), &req.input)?;
    let truncate_to = VllmOptions {
        truncate_prompt_tokens: req.truncate_prompt_tokens,
        add_special_tokens: req.add_special_tokens,
        embed_dtype: req.embed_dtype.as_deref(),
    }
    .truncate_to()?;
    let normalize = req.normalizes();
    if let Some(param) = req.vector_encoding()?.quantized_by.filter(|_| !normalize) {
        // Mixedbread documents no scale for an unnormalized vector's
        // integers: Cohere's round(127 x) would clip components past 1, so
        // the refusal says why and what answers instead.
        let message = if param == "encoding_format" {
            "encoding_format int8, uint8, binary or ubinary quantizes the unit vector, so it \
             cannot be combined with normalized (or use_activation, normalize) false: int8 is \
             round(127 x) of each component (uint8 that plus 128), a scale for components within \
             [-1, 1], which an unnormalized vector's need not be (Mixedbread documents none for \
             them), and binary and ubinary, the components' signs, are the same for either \
             vector. Leave normalized true (the default) for these forms, or ask float, float16 \
             or base64 with normalized false for the raw vector"
                .to_owned()
        } else {
            format!(
                "{param} other than float quantizes the unit vector: it cannot be combined \
                 with use_activation (or normalize, normalized) false"
            )
        };
        return Err(ApiError::invalid(message).param(param));
    }
    let dimensions = one_of(
        (
            "dimensions",
            infinity_dimensions(req.dimensions, req.modality),
        ),
        ("output_dimension", req.output_dimension),
    )?;
    if let Some(n) = req.output_dimension {
        // Its own name in the error, as Cohere's route answers it.
        output_dimension(
            n,
            state.model_for(req.model.as_deref(), Task::Embed)?,
            "output_dimension",
        )?;
    }
    let (truncate, truncation_direction, fix) = req.cut()?;
    let said = match (req.prompt_name, req.prompt, req.input_type) {
        (Some(_), None, Some(_)) => {
            return Err(
                ApiError::invalid("give either prompt_name or input_type, not both")
                    .param("input_type"),
            )
        }
        (_, Some(_), Some(_)) => {
            return Err(
                ApiError::invalid("give either prompt or input_type, not both").param("prompt"),
            )
        }
        (None, None, input_type) => {
            super::Said::role("input_type", input_type.map(|t| (t.name(), t.role())))
        }
        (name, raw, None) => super::Said::Prompt(super::prompt_of(name, raw)?),
    };
    let super::RolePick { prompt, task } =
        super::pick_task(state, req.model.as_deref(), req.task, said)?;
    let inputs = req.input.into_inputs();
    let late_chunking = req.late_chunking == Some(true);
    let embed_req = EmbedRequest {
        empty_texts: false,
        model: req.model,
        inputs,
        options: EmbedOptions {
            prompt,
            truncate,
            truncation_direction,
            truncate_to,
            priority: req
                .priority
                .map(Priority::from_vllm)
                .or(header)
                .unwrap_or_default(),
            wrapped_token_ids: true,
            task,
            ..EmbedOptions::default()
        },
        normalize,
        dimensions,
    };
    let embedded = if late_chunking {
        embed_late_chunks(state, embed_req).await
    } else {
        run_embed(state, embed_req).await
    };
    embedded.map_err(|err| {
        let err = err.cut_by("truncate_prompt_tokens");
        // The shared message's advice names the field that refused.
        match fix {
            Some(fix) => err.advising(fix),
            None => err,
        }
    })
}

/// The value of a field that has two names (OpenAI's and Voyage's): either,
/// or both where they are equal; both and different is a 400.
fn one_of<T: PartialEq + std::fmt::Display>(
    (name, value): (&'static str, Option<T>),
    (other_name, other): (&'static str, Option<T>),
) -> Result<Option<T>, ApiError> {
    match (value, other) {
        (Some(a), Some(b)) if a != b => Err(ApiError::invalid(format!(
            "{name} ({a}) and {other_name} ({b}) are the same setting and disagree: send one"
        ))
        .param(other_name)),
        (a, b) => Ok(a.or(b)),
    }
}

/// `dimensions` as the embed path takes it: Infinity reads 0 as "not set"
/// (the full dimension), and its client sends 0 with every request, beside
/// `modality`; without `modality` (OpenAI's shape) 0 stays OpenAI's 400.
fn infinity_dimensions(dimensions: Option<i64>, modality: Option<Modality>) -> Option<i64> {
    dimensions.filter(|&n| n != 0 || modality.is_none())
}

/// Token ids sent with one of OpenAI's own model names (`text-embedding-3-small`)
/// are tiktoken's: LangChain's `OpenAIEmbeddings` tokenizes with it by default.
/// Read as this model's ids they are other text, and would get a wrong vector
/// with a 200 (or, for an id past the vocabulary, a 400 that says nothing of
/// why), so they are refused with the cause and the fix. Also where the
/// served model is itself named so (a drop-in for OpenAI is where LangChain's
/// default is likeliest); the name is read as OpenAI reads names, whatever
/// its case, spaces or `openai/` prefix.
fn refuse_tiktoken_ids(
    state: &AppState,
    model: Option<&str>,
    input: &TextsOrTokens,
) -> Result<(), ApiError> {
    let token_ids = matches!(
        input,
        TextsOrTokens::Tokens(_) | TextsOrTokens::TokenLists(_) | TextsOrTokens::Mixed(_)
    );
    // Text is what almost every request sends: its model name is not read.
    let Some(name) = model.filter(|_| token_ids) else {
        return Ok(());
    };
    let bare = name.trim().to_ascii_lowercase();
    let bare = bare.strip_prefix("openai/").unwrap_or(&bare);
    if !bare.starts_with("text-embedding-") {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "`input` holds token ids and `model` names OpenAI's `{name}`, so they are OpenAI's \
         tokenizer's (tiktoken) ids, which mean other text to {served}: send the text instead \
         (LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False)), or ids from \
         this server's /tokenize",
        served = state.model_name(),
    ))
    .param("input")
    .code("token_ids_of_another_tokenizer"))
}

/// vLLM's request options shared by embeddings, pooling, classify and score.
pub(crate) struct VllmOptions<'a> {
    pub truncate_prompt_tokens: Option<i64>,
    pub add_special_tokens: Option<bool>,
    pub embed_dtype: Option<&'a str>,
}

impl VllmOptions<'_> {
    /// The cut `truncate_prompt_tokens` asks for (-1: the model's maximum),
    /// after refusing the options that cannot be honoured, since a client
    /// that set them would otherwise get other numbers (of inputs with the
    /// special tokens it asked to leave out, float32 bytes it decodes as
    /// float16) with a 200.
    pub(crate) fn truncate_to(&self) -> Result<Option<usize>, ApiError> {
        if self.add_special_tokens == Some(false) {
            return Err(ApiError::invalid(
                "add_special_tokens: false is not supported: inputs are tokenized with the \
                 model's special tokens, which it reads (send token ids to run exact ids)",
            )
            .param("add_special_tokens"));
        }
        if let Some(dtype) = self.embed_dtype.filter(|d| *d != "float32") {
            return Err(ApiError::invalid(format!(
                "embed_dtype {dtype:?} is not supported: vectors are float32"
            ))
            .param("embed_dtype"));
        }
        vllm_cut(self.truncate_prompt_tokens)
    }
}

/// vLLM's `truncate_prompt_tokens` as the core's cut: -1 (or none) is the
/// model's maximum.
pub(crate) fn vllm_cut(truncate_prompt_tokens: Option<i64>) -> Result<Option<usize>, ApiError> {
    super::cut_at(
        "truncate_prompt_tokens",
        truncate_prompt_tokens.filter(|&n| n != -1),
    )
    .map_err(|mut e| {
        e.message.push_str(" (or -1: the model's maximum)");
        e
    })
}

/// One served model: OpenAI's model object, with Infinity's `stats` and
/// `capabilities` (Infinity's client requires `stats`; OpenAI's clients
/// read past both).
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiModel {
    pub id: String,
    /// Always `model`.
    pub object: String,
    /// Unix seconds when the server started.
    pub created: u64,
    /// Always `infinity`: Infinity's client refuses any other value (an
    /// enum of that one), and OpenAI's clients take any string.
    pub owned_by: String,
    /// Infinity's: the model's queue, now.
    pub stats: OpenAiModelStats,
    /// Infinity's: what the model does, `embed` (an embedding model),
    /// `rerank` and `classify` (a reranker), or `classify` (a classifier).
    pub capabilities: Vec<String>,
}

/// One model's queue as Infinity's `/models` reports it.
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiModelStats {
    /// Inputs waiting: for admission, or admitted and not yet in a batch.
    pub queue_absolute: u64,
    /// Inputs admitted and not yet answered (queued for or in the model).
    pub results_pending: u64,
    /// How full the fullest lane's waiting room is (its inputs waiting for
    /// admission over `--max-waiting`, at most 1): at 1 that lane's next
    /// callers are refused with 429, as Infinity's full queue refuses them.
    pub queue_fraction: f64,
    /// Most inputs in one model call (`--max-batch-size`).
    pub batch_size: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiModelList {
    /// Always `list`.
    pub object: String,
    pub data: Vec<OpenAiModel>,
}

/// The served models, the default first (also served at `/models`).
#[utoipa::path(
    get, path = "/v1/models", tag = "openai",
    responses(
        (status = 200, description = "The served models", body = OpenAiModelList),
    )
)]
pub async fn models(State(state): State<AppState>) -> Json<OpenAiModelList> {
    Json(OpenAiModelList {
        object: "list".into(),
        data: state
            .models()
            .iter()
            .map(|m| model_object(&state, m))
            .collect(),
    })
}

/// One served model (`client.models.retrieve(name)`). The name may contain
/// `/` (`BAAI/bge-m3`). With several models served an unknown name is a 404
/// (`model_not_found`); a one-model server answers with its model for any
/// name, as its other routes do.
#[utoipa::path(
    get, path = "/v1/models/{model}", tag = "openai", operation_id = "retrieve_model",
    params(("model" = String, Path, description = "A served model's name")),
    responses(
        (status = 200, description = "The model", body = OpenAiModel),
        (status = 404, description = crate::openapi::refusals("No such model", Task::Describe), body = OpenAiErrorBody),
    )
)]
pub async fn model(
    State(state): State<AppState>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Json<OpenAiModel>, Shaped<OpenAi>> {
    let Path(name) = name.map_err(|e| ApiError::invalid(e.body_text()).param("model"))?;
    let served = state.model_for(Some(&name), Task::Describe)?;
    Ok(Json(model_object(&state, served)))
}

fn queue_fraction(queue: &MetricsSnapshot, max_waiting: usize) -> f64 {
    let fullest = queue
        .lanes
        .iter()
        .map(|l| l.waiting_inputs)
        .max()
        .unwrap_or(0);
    // No waiting room: any wait is a full one.
    (fullest as f64 / max_waiting.max(1) as f64).min(1.0)
}

fn model_object(state: &AppState, model: &ServedModel) -> OpenAiModel {
    let queue = model.batcher.metrics();
    let capabilities: &[&str] = match model.info().kind {
        ModelKind::Embedding => &["embed"],
        ModelKind::Reranker { .. } => &["rerank", "classify"],
        ModelKind::Classifier { .. } => &["classify"],
    };
    OpenAiModel {
        id: model.name.clone(),
        object: "model".into(),
        created: state.started_unix(),
        owned_by: "infinity".into(),
        stats: OpenAiModelStats {
            queue_absolute: queue.waiting_inputs + queue.queued_inputs,
            results_pending: queue.in_flight_inputs,
            queue_fraction: queue_fraction(&queue, model.batcher.config().max_waiting),
            batch_size: model.batcher.config().max_batch_size,
        },
        capabilities: capabilities.iter().map(|&c| c.to_owned()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_format_errors_are_data_errors() {
        use EncodingFormat::*;
        let parse = |s: &str| serde_json::from_str::<Option<EncodingFormats>>(s);
        assert_eq!(
            parse(r#""base64""#).unwrap(),
            Some(EncodingFormats::One(Base64))
        );
        assert_eq!(
            parse(r#""float""#).unwrap(),
            Some(EncodingFormats::One(Float))
        );
        assert_eq!(
            parse(r#""float16""#).unwrap(),
            Some(EncodingFormats::One(Float16))
        );
        assert_eq!(parse("null").unwrap(), None);
        assert_eq!(
            parse(r#"["ubinary", "float", "int8"]"#).unwrap(),
            Some(EncodingFormats::Many(vec![Ubinary, Float, Int8]))
        );
        assert_eq!(parse("[]").unwrap(), Some(EncodingFormats::Many(vec![])));
        for bad in [
            "1",
            r#""hex""#,
            "{}",
            "true",
            r#"["float", "hex"]"#,
            "[1]",
            "[[]]",
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.is_data(), "{bad}: {err}");
        }
        assert_eq!(
            parse(r#""hex""#).unwrap_err().to_string(),
            "unknown variant `hex`, expected one of `float`, `float16`, `base64`, `int8`, \
             `uint8`, `binary`, `ubinary` at line 1 column 5"
        );
        assert_eq!(
            parse("1").unwrap_err().to_string(),
            "invalid type: integer `1`, expected a string or a list of strings at line 1 column 1"
        );
        // Written back as sent.
        for sent in [r#""int8""#, r#"["float16","base64"]"#] {
            let read = parse(sent).unwrap().unwrap();
            assert_eq!(serde_json::to_string(&read).unwrap(), sent);
        }
        assert!(!EncodingFormats::One(Float).is_mixedbread());
        assert!(!EncodingFormats::One(Base64).is_mixedbread());
        assert!(EncodingFormats::One(Binary).is_mixedbread());
        assert!(EncodingFormats::Many(vec![Float]).is_mixedbread());
    }

    #[test]
    fn only_mixedbreads_requests_get_mixedbreads_answer_fields() {
        let mixedbread = |body: &str| {
            serde_json::from_str::<OpenAiEmbeddingRequest>(&format!(r#"{{"input": "x"{body}}}"#))
                .unwrap()
                .is_mixedbread()
        };
        // Mixedbread's SDK: its own fields, OpenAI's beside them.
        for body in [
            r#", "normalized": true"#,
            r#", "normalized": false, "encoding_format": "base64""#,
            r#", "prompt": "", "dimensions": 8, "encoding_format": "float""#,
            r#", "truncation_strategy": "end", "user": "u""#,
            r#", "encoding_format": "int8""#,
            // An encoding_format OpenAI lacks is Mixedbread's whatever comes beside it.
            r#", "encoding_format": ["float"], "task": "retrieval.query""#,
        ] {
            assert!(mixedbread(body), "{body}");
        }
        // OpenAI's, and Jina's normalized with Jina's own fields (its clients
        // and this project's jina-v3 test send it with task), Voyage's, vLLM's,
        // Infinity's and this server's: each answer stays as it was.
        for body in [
            "",
            r#", "encoding_format": "base64", "dimensions": 8, "user": "u""#,
            r#", "normalized": false, "task": "retrieval.query""#,
            r#", "normalized": true, "late_chunking": false"#,
            r#", "normalized": true, "embedding_type": "float""#,
            r#", "normalized": true, "encoding_type": "float""#,
            r#", "normalized": true, "output_dtype": "float""#,
            r#", "normalized": true, "input_type": "query""#,
            r#", "normalized": true, "use_activation": true"#,
            r#", "normalized": true, "truncate_prompt_tokens": 8"#,
            r#", "normalized": true, "modality": "text""#,
            r#", "prompt": "q: ", "truncate": false"#,
            r#", "truncation_strategy": "none", "priority": 1"#,
        ] {
            assert!(!mixedbread(body), "{body}");
        }
    }

    fn encoding(extra: &str) -> Result<VectorEncoding, ApiError> {
        serde_json::from_str::<OpenAiEmbeddingRequest>(&format!(r#"{{"input": "x"{extra}}}"#))
            .unwrap()
            .vector_encoding()
    }

    #[test]
    fn mixedbread_names_are_output_dtypes_forms_and_must_agree() {
        use EncodingFormat::{Base64, Float, Float16};
        let got = |extra: &str| {
            let e = encoding(extra).unwrap();
            (e.format, e.dtype, e.keyed, e.quantized_by)
        };
        let agreed = [
            ("", (Float, OutputDtype::Float, None, None)),
            (
                r#", "encoding_format": "base64", "output_dtype": "int8""#,
                (Base64, OutputDtype::Int8, None, Some("output_dtype")),
            ),
            (
                r#", "encoding_format": "int8""#,
                (Float, OutputDtype::Int8, None, Some("encoding_format")),
            ),
            (
                r#", "encoding_format": "ubinary", "output_dtype": "ubinary""#,
                (Float, OutputDtype::Ubinary, None, Some("encoding_format")),
            ),
            (
                r#", "encoding_format": "float16", "output_dtype": "float""#,
                (Float16, OutputDtype::Float, None, None),
            ),
            (
                r#", "encoding_format": "binary", "embedding_type": "binary""#,
                (Float, OutputDtype::Binary, None, Some("embedding_type")),
            ),
            (
                r#", "encoding_format": ["int8", "float16", "int8"]"#,
                (
                    Float,
                    OutputDtype::Float,
                    Some(vec![EncodingFormat::Int8, Float16]),
                    Some("encoding_format"),
                ),
            ),
            (
                r#", "encoding_format": ["base64", "float"]"#,
                (Float, OutputDtype::Float, Some(vec![Base64, Float]), None),
            ),
        ];
        for (extra, want) in agreed {
            assert_eq!(got(extra), want, "{extra}");
        }
        let refused = [
            (r#", "encoding_format": "int8", "output_dtype": "binary""#, "output_dtype",
             "encoding_format int8 is output_dtype int8 and output_dtype is binary: they disagree, send one"),
            (r#", "encoding_format": "float16", "output_dtype": "uint8""#, "output_dtype",
             "encoding_format float16 is output_dtype float and output_dtype is uint8: they disagree, send one"),
            (r#", "encoding_format": "float16", "embedding_type": "float""#, "embedding_type",
             "embedding_type float is encoding_format float with output_dtype float: send embedding_type alone, or encoding_format and output_dtype without it"),
            (r#", "encoding_format": "uint8", "embedding_type": "ubinary""#, "embedding_type",
             "embedding_type ubinary is encoding_format float with output_dtype ubinary: send embedding_type alone, or encoding_format and output_dtype without it"),
            (r#", "encoding_format": ["float"], "output_dtype": "float""#, "output_dtype",
             "encoding_format, a list, names each format's numbers itself, and output_dtype names one type for all: send encoding_format without output_dtype"),
            (r#", "encoding_format": ["binary"], "encoding_type": "binary""#, "encoding_type",
             "encoding_format, a list, names each format's numbers itself, and encoding_type names one type for all: send encoding_format without encoding_type"),
            (r#", "encoding_format": []"#, "encoding_format",
             "encoding_format is an empty list: name at least one of float, float16, base64, int8, uint8, binary, ubinary (or leave it out for float)"),
        ];
        for (extra, param, message) in refused {
            let err = encoding(extra).unwrap_err();
            assert_eq!(
                (err.param.as_deref(), err.message.as_str()),
                (Some(param), message),
                "{extra}"
            );
        }
    }

    #[test]
    fn each_form_is_what_the_one_quantizer_makes() {
        let v = vec![0.6, -0.8, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3];
        let json = |extra: &str| {
            let e = encoding(extra).unwrap();
            serde_json::to_value(EmbeddingValue::encode(v.clone(), &e)).unwrap()
        };
        assert_eq!(
            json(r#", "encoding_format": "int8""#),
            serde_json::json!(cohere::int8(&v))
        );
        assert_eq!(
            json(r#", "encoding_format": "uint8""#),
            serde_json::json!(cohere::uint8(&v))
        );
        assert_eq!(
            json(r#", "encoding_format": "binary""#),
            serde_json::json!(cohere::binary(&v))
        );
        assert_eq!(
            json(r#", "encoding_format": "ubinary""#),
            serde_json::json!(cohere::sign_bits(&v))
        );
        let half = json(r#", "encoding_format": "float16""#);
        assert_eq!(half, serde_json::json!(cohere::float16(&v)));
        // Written as the float16's exact value: 0.1 is 0.0999755859375 as float16.
        assert_eq!(half[2], serde_json::json!(0.0999755859375));
        assert_eq!(
            json(r#", "encoding_format": "base64""#),
            serde_json::json!(encode_base64(&v))
        );
        let keyed = json(r#", "encoding_format": ["ubinary", "float", "base64", "ubinary"]"#);
        assert_eq!(
            serde_json::to_string(&keyed).unwrap(),
            serde_json::to_string(&serde_json::json!({
                "ubinary": cohere::sign_bits(&v),
                "float": v,
                "base64": encode_base64(&v),
            }))
            .unwrap()
        );
        // Keys in the order asked, not sorted.
        let text = serde_json::to_string(&EmbeddingValue::encode(
            v.clone(),
            &encoding(r#", "encoding_format": ["uint8", "binary"]"#).unwrap(),
        ))
        .unwrap();
        assert!(text.starts_with(r#"{"uint8":["#), "{text}");
    }

    #[test]
    fn truncate_is_a_boolean_or_nims_names() {
        let parse = |s: &str| serde_json::from_str::<Option<OpenAiTruncate>>(s);
        assert_eq!(parse("true").unwrap(), Some(OpenAiTruncate::Bool(true)));
        assert_eq!(parse("null").unwrap(), None);
        for (name, nim) in [
            ("NONE", CohereTruncate::None),
            ("START", CohereTruncate::Start),
            ("END", CohereTruncate::End),
        ] {
            let read = parse(&format!("{name:?}")).unwrap().unwrap();
            assert_eq!(read, OpenAiTruncate::Nim(nim));
        }
        for bad in ["1", r#""end""#, r#""MIDDLE""#, "[]"] {
            let err = parse(bad).unwrap_err();
            assert!(err.is_data(), "{bad}: {err}");
        }
        assert_eq!(
            parse(r#""MIDDLE""#).unwrap_err().to_string(),
            "invalid value: string \"MIDDLE\", expected true, false, or NVIDIA NIM's `NONE`, \
             `START` or `END` at line 1 column 8"
        );
    }

    #[test]
    fn every_truncation_field_is_read_and_two_that_disagree_are_a_400() {
        use TruncationDirection::{Left, Right};
        let cut = |extra: &str| {
            serde_json::from_str::<OpenAiEmbeddingRequest>(&format!(r#"{{"input": "x"{extra}}}"#))
                .unwrap()
                .cut()
        };
        let agreed = [
            ("", (true, None, None)),
            (
                r#", "truncate": false"#,
                (false, None, Some("set truncate to true")),
            ),
            (r#", "truncate": "END""#, (true, Some(Right), None)),
            (
                r#", "truncate": "START", "truncation_side": "left""#,
                (true, Some(Left), None),
            ),
            (
                r#", "truncate": "NONE", "truncation_side": "left""#,
                (false, Some(Left), Some("set truncate to END or START")),
            ),
            (
                r#", "truncation": false"#,
                (false, None, Some("set truncation to true")),
            ),
            // Mixedbread's truncation_strategy: start keeps the end.
            (
                r#", "truncation_strategy": "start""#,
                (true, Some(Left), None),
            ),
            (
                r#", "truncation_strategy": "end", "truncate": true"#,
                (true, Some(Right), None),
            ),
            (
                r#", "truncation_strategy": "none""#,
                (false, None, Some("set truncation_strategy to end or start")),
            ),
        ];
        for (extra, want) in agreed {
            assert_eq!(cut(extra).unwrap(), want, "{extra}");
        }
        let refused = [
            (r#", "truncate": "END", "truncation_side": "left""#, "truncation_side", "truncate END and truncation_side left name different ends to cut: send one"),
            (r#", "truncate": "NONE", "truncation": true"#, "truncation", "truncate (NONE) and truncation (true) are the same setting and disagree: send one"),
            (r#", "truncate": true, "truncation_strategy": "none""#, "truncation_strategy", "truncate (true) and truncation_strategy (none) are the same setting and disagree: send one"),
            (r#", "truncation_side": "right", "truncation_strategy": "start""#, "truncation_strategy", "truncation_side right and truncation_strategy start name different ends to cut: send one"),
            (r#", "truncate": "START", "truncation_strategy": "end""#, "truncation_strategy", "truncate START and truncation_strategy end name different ends to cut: send one"),
        ];
        for (extra, param, message) in refused {
            let err = cut(extra).unwrap_err();
            assert_eq!(
                (err.param.as_deref(), err.message.as_str()),
                (Some(param), message),
                "{extra}"
            );
        }
        let wrong = serde_json::from_str::<OpenAiEmbeddingRequest>(
            r#"{"input": "x", "truncation_strategy": "END"}"#,
        );
        assert!(wrong.unwrap_err().is_data());
    }

    #[test]
    fn infinity_reads_dimensions_zero_as_the_full_dimension() {
        let text = Some(Modality::Text);
        assert_eq!(infinity_dimensions(Some(0), text), None);
        assert_eq!(infinity_dimensions(Some(16), text), Some(16));
        assert_eq!(infinity_dimensions(None, text), None);
        // OpenAI's shape: 0 is left for the embed path to refuse.
        assert_eq!(infinity_dimensions(Some(0), None), Some(0));
    }

    #[test]
    fn modality_is_text_or_a_data_error() {
        let parse = |s: &str| serde_json::from_str::<Option<Modality>>(s);
        assert_eq!(parse(r#""text""#).unwrap(), Some(Modality::Text));
        let err = parse(r#""image""#).unwrap_err();
        assert!(err.is_data(), "{err}");
        assert_eq!(
            err.to_string(),
            "modality `image` is not supported: this server embeds text (`text`)"
        );
    }

    #[test]
    fn base64_is_le_f32() {
        assert_eq!(encode_base64(&[1.0]), "AACAPw==");
    }
}
