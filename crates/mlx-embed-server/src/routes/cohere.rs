//! `POST /v1/embed` and `POST /v2/embed`: Cohere compatible (the `cohere`
//! Python client's `Client.embed` and `ClientV2.embed` with `base_url`).
//!
//! Text only. `input_type` picks the model's prompt of that role where it
//! has one (`search_query` -> `query`, `search_document` -> `document` or
//! `passage`, `classification`, `clustering`), else its default prompt; on a
//! model with task adapters (jina-embeddings-v3) it picks the task
//! (`retrieval.query`, `retrieval.passage`, `classification`, `separation`)
//! as Jina AI's `task` would (`role_pick` in the routes module); Jina's
//! `task` itself is taken too (an `input_type` picking another is a 400).
//! Vectors are unit length; `embedding_types` also answers them as bytes:
//! `int8` is `round(127 x)` per component, `uint8` that plus 128, `binary`
//! and `ubinary` one sign bit per component (`x > 0`), eight to a byte,
//! first component in the high bit (`binary` is `ubinary` - 128), and
//! `base64` the little-endian float32 bytes.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedInput, EmbedOptions, Priority, TruncationDirection};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::openai::encode_base64;
use super::{pick_task, Role, Said};
use crate::embed::{embed_answering, output_dimension, EmbedRequest};
use crate::errors::{ApiError, OpenAi, OpenAiErrorBody, Shaped};
use crate::extract::{wire_names, ApiJson, PriorityHeader, WireName};
use crate::models::Task;
use crate::state::AppState;

/// What the texts are for; picks the model's prompt of that role, or its
/// task adapter of that role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CohereInputType {
    SearchDocument,
    SearchQuery,
    Classification,
    Clustering,
    /// Refused: this server embeds text.
    Image,
}

wire_names!(CohereInputType {
    SearchDocument => "search_document",
    SearchQuery => "search_query",
    Classification => "classification",
    Clustering => "clustering",
    Image => "image",
});

/// A form the vectors are answered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CohereEmbeddingType {
    Float,
    Int8,
    Uint8,
    Binary,
    Ubinary,
    Base64,
}

wire_names!(CohereEmbeddingType {
    Float => "float",
    Int8 => "int8",
    Uint8 => "uint8",
    Binary => "binary",
    Ubinary => "ubinary",
    Base64 => "base64",
});

impl CohereEmbeddingType {
    /// At most the bytes of JSON one value of a vector takes in this form:
    /// a float, a signed or unsigned byte, an eighth of a packed byte, a
    /// third of base64's four characters per three bytes of float32.
    fn answer_bytes(self) -> usize {
        match self {
            Self::Float => crate::answer_room::JSON_FLOAT_BYTES,
            Self::Int8 => 5,
            Self::Uint8 => 4,
            Self::Binary | Self::Ubinary => 1,
            Self::Base64 => 6,
        }
    }
}

/// Which end of an over-long text is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ToSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum CohereTruncate {
    /// Refuse an over-long text (400, as Cohere answers).
    None,
    /// Cut its start (keep the end).
    Start,
    /// Cut its end (left out: the model folder's `truncation_side`, else the end).
    End,
}

wire_names!(CohereTruncate {
    None => "NONE",
    Start => "START",
    End => "END",
});

impl CohereTruncate {
    /// Whether an over-long text is cut (`NONE` refuses it).
    pub(crate) fn truncates(self) -> bool {
        self != CohereTruncate::None
    }

    /// The end it cuts; `NONE` says none (the model's own applies to a cut
    /// made by another field, such as `max_tokens`).
    pub(crate) fn direction(self) -> Option<TruncationDirection> {
        match self {
            CohereTruncate::Start => Some(TruncationDirection::Left),
            CohereTruncate::End => Some(TruncationDirection::Right),
            CohereTruncate::None => None,
        }
    }
}

/// Cohere embed request (v1 and v2).
#[derive(Debug, Deserialize, ToSchema)]
pub struct CohereEmbedRequest {
    /// Which served model answers; default: the first embedding model.
    pub model: Option<String>,
    /// The texts to embed (at least one). This or v2's `inputs` is required
    /// (a 400 without either, or with both).
    #[schema(min_items = 1)]
    pub texts: Option<Vec<String>>,
    /// Refused: this server embeds text.
    #[schema(value_type = Option<Vec<Object>>)]
    pub images: Option<Vec<Value>>,
    /// v2's inputs, instead of `texts`: each `{"content": [{"type": "text", "text": "..."}]}`,
    /// one text each (image content is refused: this server embeds text); at least one.
    #[schema(value_type = Option<Vec<Object>>, min_items = 1)]
    pub inputs: Option<Vec<Value>>,
    pub input_type: Option<CohereInputType>,
    /// Forms to answer in (default: float); an empty list is a 400.
    #[schema(min_items = 1)]
    pub embedding_types: Option<Vec<CohereEmbeddingType>>,
    /// `END`, `START` or `NONE`; left out, the model folder's `truncation_side`, else `END`.
    pub truncate: Option<CohereTruncate>,
    /// v2: keep the first N components (1..=dimension), re-normalized.
    #[schema(minimum = 1)]
    pub output_dimension: Option<i64>,
    /// v2: cut every text at this many tokens (special tokens included), at
    /// most the model's maximum; with `truncate: NONE` a longer text is refused
    /// (400) instead.
    #[schema(minimum = 1)]
    pub max_tokens: Option<i64>,
    /// v2: lower is served earlier; 0 (default) normal, below 0 high, above 0 low.
    pub priority: Option<i64>,
    /// Jina AI's (not a Cohere field): the task adapter to run with, one of
    /// the model's `tasks` (`/info` lists them: jina-embeddings-v3's), with
    /// its prompt of that name. A model without task adapters, an unknown
    /// task, or an `input_type` that picks another task, is a 400.
    pub task: Option<String>,
}

/// Vectors by form; only the forms asked for are present.
#[derive(Debug, Default, Serialize, ToSchema)]
pub struct CohereEmbeddingsByType {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub float: Option<Vec<Vec<f32>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub int8: Option<Vec<Vec<i8>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uint8: Option<Vec<Vec<u8>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub binary: Option<Vec<Vec<i8>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ubinary: Option<Vec<Vec<u8>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base64: Option<Vec<String>>,
}

/// The vectors: a plain list (v1 without `embedding_types`) or by form.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum CohereEmbeddings {
    Floats(Vec<Vec<f32>>),
    ByType(CohereEmbeddingsByType),
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereEmbedApiVersion {
    pub version: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereEmbedBilledUnits {
    /// Exact tokens of all texts (after truncation, specials included).
    pub input_tokens: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CohereEmbedMeta {
    pub api_version: CohereEmbedApiVersion,
    pub billed_units: CohereEmbedBilledUnits,
}

/// Cohere embed response.
#[derive(Debug, Serialize, ToSchema)]
pub struct CohereEmbedResponse {
    pub id: String,
    /// `embeddings_floats` (a plain list) or `embeddings_by_type`.
    pub response_type: String,
    pub embeddings: CohereEmbeddings,
    /// The texts, as sent.
    pub texts: Vec<String>,
    pub meta: CohereEmbedMeta,
}

/// Embed texts (Cohere v1: a plain float list unless `embedding_types` is given).
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/v1/embed", tag = "cohere", operation_id = "cohere_embed_v1",
    request_body = CohereEmbedRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "Embeddings in input order", body = CohereEmbedResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 incl. a wrong shape and an over-long text with `truncate: NONE`, as Cohere answers; 401, 404 unknown model (below), 413, 415, 429)", Task::Embed), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn embed_v1(
    State(state): State<AppState>,
    PriorityHeader(header, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<CohereEmbedRequest, OpenAi>,
) -> Result<Json<CohereEmbedResponse>, Shaped<OpenAi>> {
    Ok(Json(embed(&state, req, "1", header).await?))
}

/// Embed texts (Cohere v2, `cohere.ClientV2`: always by form, float by default).
///
/// Errors use `{"error": {"message", "type", "param", "code"}, "detail"}` (`detail`: the message again, for Voyage AI's client).
#[utoipa::path(
    post, path = "/v2/embed", tag = "cohere", operation_id = "cohere_embed_v2",
    request_body = CohereEmbedRequest,
    params(("X-Priority" = Option<String>, Header, description = "`high`, `normal` (default) or `low`: the priority lane (a body `priority` wins)")),
    responses(
        (status = 200, description = "Embeddings in input order", body = CohereEmbedResponse),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (as /v1/embed)", Task::Embed), body = OpenAiErrorBody),
        (status = "5XX", description = "Model failed (500) or unavailable (503)", body = OpenAiErrorBody),
    )
)]
pub async fn embed_v2(
    State(state): State<AppState>,
    PriorityHeader(header, _): PriorityHeader<OpenAi>,
    ApiJson(req, _): ApiJson<CohereEmbedRequest, OpenAi>,
) -> Result<Json<CohereEmbedResponse>, Shaped<OpenAi>> {
    Ok(Json(embed(&state, req, "2", header).await?))
}

async fn embed(
    state: &AppState,
    req: CohereEmbedRequest,
    version: &str,
    header: Option<Priority>,
) -> Result<CohereEmbedResponse, ApiError> {
    if req.images.is_some() {
        return Err(ApiError::invalid(
            "this server embeds text: send `texts` (images are not supported)",
        )
        .param("images"));
    }
    if req.input_type == Some(CohereInputType::Image) {
        // Texts sent as `image` would get a text's vector under an image's name.
        let image = CohereInputType::Image.name();
        let texts: Vec<_> = CohereInputType::NAMES
            .iter()
            .filter(|n| **n != image)
            .map(|n| format!("`{n}`"))
            .collect();
        let (last, rest) = texts.split_last().expect("text input types");
        return Err(ApiError::invalid(format!(
            "input_type `{image}` is for images, which this server does not embed: send the \
             texts with {} or {last}",
            rest.join(", ")
        ))
        .param("input_type"));
    }
    let texts = match (req.texts, req.inputs) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("send `texts` or `inputs`, not both").param("inputs"))
        }
        (Some(texts), None) => texts,
        (None, Some(inputs)) => texts_of_inputs(inputs)?,
        (None, None) => {
            return Err(
                ApiError::invalid("texts is required: send at least one text").param("texts"),
            )
        }
    };
    if req.embedding_types.as_ref().is_some_and(Vec::is_empty) {
        // An answer with no embeddings in it at all would be a 200 for nothing.
        return Err(ApiError::invalid(
            "embedding_types is empty: name at least one of float, int8, uint8, binary, ubinary \
             (or leave it out for float)",
        )
        .param("embedding_types"));
    }
    let model = state.model_for(req.model.as_deref(), Task::Embed)?;
    let truncate_to = super::cut_at("max_tokens", req.max_tokens)?;
    if let Some(n) = req.output_dimension {
        output_dimension(n, model, "output_dimension")?;
    }
    let pick = pick_task(
        state,
        Some(&model.name),
        req.task,
        Said::role("input_type", role_of(req.input_type)),
    )?;
    // Every form asked for answers every value again.
    let bytes_per_value = match req.embedding_types.as_deref() {
        Some(types) => types.iter().map(|t| t.answer_bytes()).sum(),
        None => CohereEmbeddingType::Float.answer_bytes(),
    };
    let out = embed_answering(
        state,
        EmbedRequest {
            empty_texts: false,
            model: Some(model.name.clone()),
            inputs: texts.iter().cloned().map(EmbedInput::Text).collect(),
            options: EmbedOptions {
                truncate: req.truncate.is_none_or(CohereTruncate::truncates),
                // Unsaid, the model's own side (Cohere's END where the folder says none).
                truncation_direction: req.truncate.and_then(CohereTruncate::direction),
                truncate_to,
                prompt: pick.prompt,
                task: pick.task,
                priority: req
                    .priority
                    .map(Priority::from_vllm)
                    .or(header)
                    .unwrap_or_default(),
                ..EmbedOptions::default()
            },
            normalize: true,
            dimensions: req.output_dimension,
        },
        bytes_per_value,
    )
    .await
    .map_err(|err| {
        // Cohere's truncate is not a boolean: the advice names its values.
        err.cut_by("max_tokens")
            .advising("set truncate to END or START")
    })?;
    let (response_type, embeddings) = match (version, req.embedding_types) {
        ("1", None) => ("embeddings_floats", CohereEmbeddings::Floats(out.vectors)),
        (_, types) => (
            "embeddings_by_type",
            CohereEmbeddings::ByType(by_type(
                out.vectors,
                types.as_deref().unwrap_or(&[CohereEmbeddingType::Float]),
            )),
        ),
    };
    Ok(CohereEmbedResponse {
        id: super::response_id("embed"),
        response_type: response_type.into(),
        embeddings,
        texts,
        meta: CohereEmbedMeta {
            api_version: CohereEmbedApiVersion {
                version: version.into(),
            },
            billed_units: CohereEmbedBilledUnits {
                input_tokens: out.prompt_tokens,
            },
        },
    })
}

/// The texts of v2's `inputs`, one each: `{"content": [{"type": "text", "text": "..."}]}`.
/// Cohere fuses an input's several items into one vector; a text model has
/// no such fusion, so an input of more than one item is refused rather than
/// guessed at (each text can be an input of its own).
fn texts_of_inputs(inputs: Vec<Value>) -> Result<Vec<String>, ApiError> {
    let refuse = |message: String| ApiError::invalid(message).param("inputs");
    inputs
        .into_iter()
        .enumerate()
        .map(|(i, input)| {
            let items = input
                .get("content")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    refuse(format!(
                        "input {i} must be an object with a `content` list, \
                         {{\"content\": [{{\"type\": \"text\", \"text\": \"...\"}}]}}"
                    ))
                })?;
            if items
                .iter()
                .any(|item| item.get("type").and_then(Value::as_str) == Some("image_url"))
            {
                return Err(refuse(format!(
                    "input {i} holds an image: this server embeds text"
                )));
            }
            match items.as_slice() {
                [item] => match (item.get("type").and_then(Value::as_str), item.get("text")) {
                    (Some("text"), Some(Value::String(text))) => Ok(text.clone()),
                    _ => Err(refuse(format!(
                        "input {i}'s content must be {{\"type\": \"text\", \"text\": <string>}}"
                    ))),
                },
                items => Err(refuse(format!(
                    "input {i} has {} content items; this server embeds one text per input \
                     (send each text as an input of its own)",
                    items.len()
                ))),
            }
        })
        .collect()
}

/// The role `input_type` names, with its name as sent (`image` is refused before).
fn role_of(input_type: Option<CohereInputType>) -> Option<(&'static str, Role)> {
    let input_type = input_type?;
    let role = match input_type {
        CohereInputType::SearchQuery => Role::Query,
        CohereInputType::SearchDocument => Role::Document,
        CohereInputType::Classification => Role::Classification,
        CohereInputType::Clustering => Role::Clustering,
        CohereInputType::Image => return None,
    };
    Some((input_type.name(), role))
}

fn by_type(vectors: Vec<Vec<f32>>, types: &[CohereEmbeddingType]) -> CohereEmbeddingsByType {
    let wants = |t| types.contains(&t);
    CohereEmbeddingsByType {
        int8: wants(CohereEmbeddingType::Int8).then(|| rows(&vectors, int8)),
        uint8: wants(CohereEmbeddingType::Uint8).then(|| rows(&vectors, uint8)),
        binary: wants(CohereEmbeddingType::Binary).then(|| rows(&vectors, binary)),
        ubinary: wants(CohereEmbeddingType::Ubinary).then(|| rows(&vectors, sign_bits)),
        base64: wants(CohereEmbeddingType::Base64).then(|| rows(&vectors, encode_base64)),
        // Last: the float form takes the vectors the others are made from.
        float: wants(CohereEmbeddingType::Float).then_some(vectors),
    }
}

fn rows<T>(vectors: &[Vec<f32>], form: impl Fn(&[f32]) -> T) -> Vec<T> {
    vectors.iter().map(|v| form(v)).collect()
}

/// Each component rounded to the nearest float16 (ties to even), kept as
/// f32, which holds every float16 exactly: what a client reading the numbers
/// as float16 gets, with none of float32's extra digits in the JSON. Past
/// float16's range a component is infinite, below its smallest subnormal 0.
pub(crate) fn float16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| to_float16(x)).collect()
}

fn to_float16(x: f32) -> f32 {
    // Largest float16 (65504) plus half its step (32): from there it rounds up to infinity.
    const OVERFLOW: f32 = 65520.0;
    if !x.is_finite() {
        return x;
    }
    if x.abs() >= OVERFLOW {
        return f32::INFINITY.copysign(x);
    }
    // float16's step where x lies: 2^(e - 10) for x in [2^e, 2^(e+1)), and
    // the subnormals' 2^-24 below 2^-14 (x is a normal f32 there or zero).
    let exponent = ((x.to_bits() >> 23) & 0xff) as i32 - 127;
    let step = f32::from_bits(((exponent.max(-14) - 10 + 127) as u32) << 23);
    // Dividing and multiplying by a power of two are exact: one rounding.
    (x / step).round_ties_even() * step
}

/// `round(127 x)` per component of a unit vector (each in [-1, 1]).
pub(crate) fn int8(v: &[f32]) -> Vec<i8> {
    v.iter()
        .map(|x| (x.clamp(-1.0, 1.0) * 127.0).round() as i8)
        .collect()
}

/// [`int8`] + 128.
pub(crate) fn uint8(v: &[f32]) -> Vec<u8> {
    int8(v)
        .into_iter()
        .map(|x| (x as i16 + 128) as u8)
        .collect()
}

/// [`sign_bits`] - 128.
pub(crate) fn binary(v: &[f32]) -> Vec<i8> {
    sign_bits(v)
        .into_iter()
        .map(|b| (b as i16 - 128) as i8)
        .collect()
}

/// One bit per component, set where it is positive; eight to a byte, the
/// first component in the high bit, the last byte padded with zeros.
pub(crate) fn sign_bits(v: &[f32]) -> Vec<u8> {
    v.chunks(8)
        .map(|chunk| {
            chunk.iter().enumerate().fold(
                0u8,
                |byte, (i, x)| if *x > 0.0 { byte | (0x80 >> i) } else { byte },
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_forms() {
        assert_eq!(
            int8(&[1.0, -1.0, 0.5, -0.003, 2.0]),
            [127, -127, 64, 0, 127]
        );
        let v = [0.1, -0.1, 0.0, 0.3, -0.2, 0.2, 0.2, -0.5, 0.9, 0.0];
        // 1 0 0 1 0 1 1 0 | 1 (padded)
        assert_eq!(sign_bits(&v), [0b1001_0110, 0b1000_0000]);
        let t = by_type(
            vec![v.to_vec()],
            &[
                CohereEmbeddingType::Binary,
                CohereEmbeddingType::Ubinary,
                CohereEmbeddingType::Binary,
            ],
        );
        assert_eq!(t.ubinary.unwrap()[0], [150, 128]);
        assert_eq!(t.binary.unwrap()[0], [22, 0]);
        assert!(t.float.is_none() && t.int8.is_none());
        let u = by_type(vec![vec![1.0, -1.0, 0.0]], &[CohereEmbeddingType::Uint8]);
        assert_eq!(u.uint8.unwrap()[0], [255, 1, 128]);
    }

    #[test]
    fn float16_rounds_to_the_nearest_half_precision_value() {
        // Exactly representable: unchanged.
        for x in [
            0.0,
            -0.0,
            1.0,
            -0.5,
            1479.0 * 2f32.powi(-17),
            65504.0,
            2f32.powi(-24),
        ] {
            assert_eq!(to_float16(x).to_bits(), x.to_bits(), "{x}");
        }
        // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1).
        assert_eq!(to_float16(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(
            to_float16(1.0 + 3.0 * 2f32.powi(-11)),
            1.0 + 2.0 * 2f32.powi(-10)
        );
        // Nearest, below 1: the step is 2^-11 in [0.5, 1).
        assert_eq!(to_float16(0.1), 1638.0 * 2f32.powi(-14));
        assert_eq!(to_float16(-0.1), -1638.0 * 2f32.powi(-14));
        // Subnormals: a step of 2^-24; below half of it, zero.
        assert_eq!(to_float16(3.0 * 2f32.powi(-25)), 2f32.powi(-23));
        assert_eq!(to_float16(2f32.powi(-26)), 0.0);
        // Past the range: infinity, as a float16 cast gives.
        assert_eq!(to_float16(65519.0), 65504.0);
        assert_eq!(to_float16(-65520.0), f32::NEG_INFINITY);
        assert!(to_float16(f32::NAN).is_nan());
        // Every result is a float16: its low 13 mantissa bits are zero.
        for i in 0..10_000 {
            let x = (i as f32 * 0.37).sin();
            let r = to_float16(x);
            assert!(
                (r - x).abs() <= x.abs() * 2f32.powi(-11) + 2f32.powi(-25),
                "{x} {r}"
            );
            if r.abs() >= 2f32.powi(-14) {
                assert_eq!(r.to_bits() & 0x1fff, 0, "{x} {r}");
            }
        }
    }

    #[test]
    fn input_types_name_their_roles() {
        assert_eq!(
            role_of(Some(CohereInputType::SearchQuery)),
            Some(("search_query", Role::Query))
        );
        assert_eq!(
            role_of(Some(CohereInputType::SearchDocument)),
            Some(("search_document", Role::Document))
        );
        assert_eq!(
            role_of(Some(CohereInputType::Classification)),
            Some(("classification", Role::Classification))
        );
        assert_eq!(
            role_of(Some(CohereInputType::Clustering)),
            Some(("clustering", Role::Clustering))
        );
        assert_eq!(role_of(None), None);
    }
}
