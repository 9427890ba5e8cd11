//! What a model says about its tokenization (the Python `TokenizerSpec`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlx_embed_core::TruncationDirection;

use crate::PairSpec;

/// Everything needed to tokenize exactly as the model's Python side does.
/// The bridge fills it from the Python model's `spec().tokenizer`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerSpec {
    /// The model's `tokenizer.json`.
    pub path: PathBuf,
    /// Longest input in tokens, special tokens included.
    pub max_length: usize,
    /// Special ids before the content (BERT: `[CLS]`).
    pub prefix_ids: Vec<u32>,
    /// Special ids after the content (BERT: `[SEP]`; Qwen3: EOS).
    pub suffix_ids: Vec<u32>,
    /// Named prompts: name -> text prepended to the input text.
    pub prompts: BTreeMap<String, String>,
    /// The prompt used when a request names none (a model loaded with an
    /// instruction: `query`, which holds it in the model's template).
    pub default_prompt_name: Option<String>,
    /// How a query/document pair becomes one input (cross-encoders); `None`:
    /// the model takes single texts only.
    pub pair: Option<PairSpec>,
    /// Ids left out of the content after the token truncation (Model2Vec
    /// drops its unknown token: it truncates first, then filters).
    pub drop_ids: Vec<u32>,
    /// When truncating, a text (prompt included) longer than this many
    /// characters is cut to it before it is encoded, keeping its start
    /// (right) or end (left): Model2Vec's `max_length` x median token length.
    pub char_limit: Option<usize>,
    /// sentence-transformers' `do_lower_case`: a `Lowercase` normalizer goes in
    /// front of the tokenizer's own, so everything it encodes (prompt
    /// included) is lower-cased one character at a time, and offsets still
    /// point into the text as sent. (Scorers never set it.)
    pub lowercase: bool,
    /// The end an over-long input loses when a request names none: the
    /// model's `truncation_side` as the Python engine resolves it (the
    /// folder's, as transformers reads it, or the `load()` override; the
    /// same value as `ModelInfo::truncation_side`).
    pub truncation_side: TruncationDirection,
    /// sentence-transformers' Pooling `include_prompt: false` (INSTRUCTOR):
    /// a text's prompt runs through the model but the pooling leaves it
    /// out. Its [`Encoded::pool_start`](mlx_embed_core::Encoded) is then the
    /// prompt tokenized alone with the specials, less the closing special,
    /// as sentence-transformers counts it (after a left cut too).
    pub pool_without_prompt: bool,
    /// A multi-vector (ColBERT) model's query mode: how a text is tokenized
    /// for [`Output::MultiVector`](mlx_embed_core::Output)`(Side::Query)`.
    pub query: Option<InputMode>,
    /// Its document mode (`Side::Document`).
    pub document: Option<InputMode>,
}

/// How a multi-vector model's query or document text becomes ids, as
/// PyLate's `ColBERT.tokenize` makes them (the Python `InputModeSpec`): the
/// text is encoded as any input (prompt, specials), its content cut so that
/// the whole, `insert_ids` included, holds at most `max_length` tokens;
/// `insert_ids` (the `[Q]` / `[D]` marker) go in after the sequence's first
/// token (`[CLS]`); then, with `expand_id` set, the sequence is padded with
/// it to `max_length` (query expansion with `[MASK]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InputMode {
    /// The mode's marker ids, put in after the first token.
    pub insert_ids: Vec<u32>,
    /// Tokens of an input in this mode, specials and `insert_ids` included.
    pub max_length: usize,
    /// The id a sequence is padded with to `max_length` (a query's
    /// `[MASK]`); `None`: no padding.
    pub expand_id: Option<u32>,
}
