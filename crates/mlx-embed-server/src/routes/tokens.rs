//! `POST /tokenize` and `POST /decode` (Hugging Face TEI): the served model's
//! own tokenizer, as the embed and score paths use it.

use axum::extract::State;
use axum::Json;
use mlx_embed_core::{EmbedOptions, Prompt, Tokenize};
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;
use utoipa::ToSchema;

use crate::answer_room::make_room;
use crate::errors::{ApiError, ErrorKind, Shaped, Tei, TeiErrorBody};
use crate::extract::{ApiJson, TextInputs};
use crate::models::Task;
use crate::state::AppState;

/// TEI tokenize request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    /// Whose tokenizer (not a TEI field); default: the first served model.
    pub model: Option<String>,
    /// A text or a list of texts.
    pub inputs: TextInputs,
    /// Include the model's special tokens (default true).
    pub add_special_tokens: Option<bool>,
    /// One of the model's named prompts, tokenized with the text.
    pub prompt_name: Option<String>,
}

/// One token.
#[derive(Debug, Serialize, ToSchema)]
pub struct SimpleToken {
    pub id: u32,
    pub text: String,
    /// Added by the model, not from the input.
    pub special: bool,
    /// Byte offsets into the text (with its prompt); none for special tokens.
    pub start: Option<usize>,
    pub stop: Option<usize>,
}

fn tokenizer(state: &AppState, model: Option<&str>) -> Result<Arc<dyn Tokenize>, ApiError> {
    Ok(tokenizer_and_kind(state, model)?.0)
}

/// The tokenizer of the model `model` names, and whether it embeds (the
/// server's default prompt is an embedding model's).
fn tokenizer_and_kind(
    state: &AppState,
    model: Option<&str>,
) -> Result<(Arc<dyn Tokenize>, bool), ApiError> {
    let served = state.model_for(model, Task::Tokenize)?;
    let tokenizer =
        served.batcher.tokenizer().cloned().ok_or_else(|| {
            ApiError::invalid("this model takes token ids only: it has no tokenizer")
        })?;
    let embeds = served.info().kind == mlx_embed_core::ModelKind::Embedding;
    Ok((tokenizer, embeds))
}

/// Most tokens one `/tokenize` answer lists: about 70 MB of JSON. A 2 MB
/// text of punctuation was a 142 MB answer, built whole in memory.
pub const MAX_LISTED_TOKENS: usize = 1 << 20;

/// Split texts into the model's tokens; one list per text.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/tokenize", tag = "tei", operation_id = "tei_tokenize",
    request_body = TokenizeRequest,
    responses(
        (status = 200, description = "Tokens per text", body = Vec<Vec<SimpleToken>>),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400, 401, 404 unknown model (below), 413, 415, 422, 429 while the room for large answers is full)", Task::Tokenize), body = TeiErrorBody),
    )
)]
pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(req, _): ApiJson<TokenizeRequest, Tei>,
) -> Result<Json<Vec<Vec<SimpleToken>>>, Shaped<Tei>> {
    Ok(Json(tokenize_texts(&state, req).await?))
}

/// `/tokenize`'s answer for `req` (TEI's gRPC `Tokenize` too): per text its tokens.
pub(crate) async fn tokenize_texts(
    state: &AppState,
    req: TokenizeRequest,
) -> Result<Vec<Vec<SimpleToken>>, ApiError> {
    let (tok, embeds) = tokenizer_and_kind(state, req.model.as_deref())?;
    let texts = match req.inputs {
        TextInputs::One(t) => vec![t],
        TextInputs::Many(v) => v,
    };
    check_count(state, texts.len())?;
    let specials = req.add_special_tokens.unwrap_or(true);
    let options = EmbedOptions {
        // The tokens an embedding of these texts runs, the server's
        // default prompt included, as TEI lists them.
        prompt: match req.prompt_name {
            Some(name) => Prompt::Named(name),
            None if embeds => {
                crate::embed::server_default_prompt(state.args()).unwrap_or(Prompt::Default)
            }
            None => Prompt::Default,
        },
        ..EmbedOptions::default()
    };
    // At most a token per byte, each listed in about this many bytes of JSON.
    const TOKEN_ENTRY_BYTES: usize = 56;
    let text_bytes: usize = texts.iter().map(String::len).sum();
    make_room(state, text_bytes.saturating_mul(TOKEN_ENTRY_BYTES)).await?;
    // Tokenizing is CPU work: off the async threads, as the core does, and
    // within the room the core keeps for text being tokenized.
    let reading = mlx_embed_core::reading_room(text_bytes).await;
    let out = tokio::task::spawn_blocking(move || {
        let _reading = reading;
        let mut listed = 0usize;
        let mut out = Vec::with_capacity(texts.len());
        for text in &texts {
            let spans = tok
                .tokens(text, specials, &options)
                .map_err(|e| ApiError::invalid(e.message).param("inputs"))?;
            listed += spans.len();
            if listed > MAX_LISTED_TOKENS {
                return Err(ApiError::new(
                    ErrorKind::TooLarge,
                    format!(
                        "these texts have more than {MAX_LISTED_TOKENS} tokens in all, the most \
                         one answer lists; send fewer or shorter texts per request"
                    ),
                ));
            }
            out.push(spans);
        }
        Ok(out)
    })
    .await
    .map_err(|e| ApiError::new(ErrorKind::Model, format!("tokenizer task failed: {e}")))??;
    Ok(out
        .into_iter()
        .map(|spans| {
            spans
                .into_iter()
                .map(|s| SimpleToken {
                    id: s.id,
                    text: s.text,
                    special: s.special,
                    start: (!s.special).then_some(s.start),
                    stop: (!s.special).then_some(s.stop),
                })
                .collect()
        })
        .collect())
}

/// Token ids: one list, or a list of lists. (Serialize only for the schema's
/// shape: serde's untagged form is what the docs should show.)
#[derive(Debug, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum DecodeIds {
    One(Vec<u32>),
    Many(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for DecodeIds {
    /// By hand: serde's untagged enums fail with a message that names the
    /// Rust type, not what the client should send.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let expected = || {
            de::Error::custom(
                "ids must be a list of token ids (non-negative integers) or a list of such lists",
            )
        };
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        let ids = |v: &Value| v.as_array()?.iter().map(id).collect::<Option<Vec<u32>>>();
        let value = Value::deserialize(d)?;
        let items = value.as_array().ok_or_else(expected)?;
        if items.first().is_some_and(Value::is_array) {
            items
                .iter()
                .map(ids)
                .collect::<Option<_>>()
                .map(DecodeIds::Many)
                .ok_or_else(expected)
        } else {
            ids(&value).map(DecodeIds::One).ok_or_else(expected)
        }
    }
}

/// TEI decode request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct DecodeRequest {
    /// Whose tokenizer (not a TEI field); default: the first served model.
    pub model: Option<String>,
    pub ids: DecodeIds,
    /// Leave special tokens out of the text (default true).
    pub skip_special_tokens: Option<bool>,
}

/// Token ids back to text; one string per id list.
///
/// Errors use `{"error": str, "error_type": str}`.
#[utoipa::path(
    post, path = "/decode", tag = "tei", operation_id = "tei_decode",
    request_body = DecodeRequest,
    responses(
        (status = 200, description = "One text per id list", body = Vec<String>),
        (status = "4XX", description = crate::openapi::refusals("Invalid request (400 id outside the vocabulary, 401, 404 unknown model (below), 413, 415, 422)", Task::Tokenize), body = TeiErrorBody),
    )
)]
pub async fn decode(
    State(state): State<AppState>,
    ApiJson(req, _): ApiJson<DecodeRequest, Tei>,
) -> Result<Json<Vec<String>>, Shaped<Tei>> {
    Ok(Json(decode_ids(&state, req)?))
}

/// `/decode`'s answer for `req` (TEI's gRPC `Decode` too): one text per id list.
pub(crate) fn decode_ids(state: &AppState, req: DecodeRequest) -> Result<Vec<String>, ApiError> {
    let tok = tokenizer(state, req.model.as_deref())?;
    let lists = match req.ids {
        DecodeIds::One(ids) => vec![ids],
        DecodeIds::Many(lists) => lists,
    };
    check_count(state, lists.len())?;
    let skip = req.skip_special_tokens.unwrap_or(true);
    lists
        .iter()
        .map(|ids| tok.decode(ids, skip))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ApiError::invalid(e.message).param("ids"))
}

fn check_count(state: &AppState, n: usize) -> Result<(), ApiError> {
    let max = state.args().max_inputs_per_request;
    if n == 0 {
        return Err(ApiError::invalid("nothing to do: send at least one input"));
    }
    if n > max {
        return Err(ApiError::too_many_inputs(n, max));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_ids_forms_and_a_readable_refusal() {
        let ids = |s: &str| serde_json::from_str::<DecodeIds>(s);
        assert_eq!(ids("[1, 2]").unwrap(), DecodeIds::One(vec![1, 2]));
        assert_eq!(ids("[]").unwrap(), DecodeIds::One(vec![]));
        assert_eq!(
            ids("[[1], []]").unwrap(),
            DecodeIds::Many(vec![vec![1], vec![]])
        );
        for bad in [
            "[-1]",
            "[[1], 2]",
            "[1, [2]]",
            "[1.5]",
            "[4294967296]",
            "1",
            "null",
            r#"["a"]"#,
        ] {
            let e = ids(bad).unwrap_err();
            assert!(e.is_data(), "{bad}");
            assert!(
                e.to_string().starts_with(
                    "ids must be a list of token ids (non-negative integers) or a list of such lists"
                ),
                "{bad}: {e}"
            );
        }
    }
}
