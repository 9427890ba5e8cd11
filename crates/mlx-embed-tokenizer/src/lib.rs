//! mlx-embed-tokenizer: a model's `tokenizer.json` run in Rust, behind
//! [`mlx_embed_core::Tokenize`], so the server tokenizes on tokio's blocking
//! pool before a request queues instead of inside the model's interpreter.
//!
//! The rules are the Python engine's (`mlx_embed.tokenization`), and a test
//! holds both to identical ids:
//!
//! * the content is encoded **without** special tokens and without the
//!   truncation or padding a `tokenizer.json` may carry;
//! * text first gets its prompt prepended: [`Prompt::Default`] is the
//!   model's default named prompt, else nothing (and nothing before a text
//!   that already begins with one of the model's prompts); [`Prompt::Named`] one of
//!   the model's prompts; [`Prompt::Raw`] the given text;
//! * the content is cut to `max_length - specials` tokens, keeping the start
//!   ([`TruncationDirection::Right`]) or the end ([`TruncationDirection::Left`]);
//! * then wrapped in the model's prefix and suffix ids (`[CLS]`/`[SEP]`, EOS;
//!   none for static embeddings, whose libraries encode without them).
//!
//! Model2Vec adds two rules (see [`TokenizerSpec`]): when truncating, a text
//! is first cut to `char_limit` characters, and `drop_ids` (its unknown
//! token) are left out of the content after the token truncation.
//!
//! Token-id input skips the prompt, is checked against the vocabulary, and
//! runs as given (nothing added), cut to `max_length`; ids over it that begin
//! and end with the model's specials are cut inside them, as text is.
//!
//! A query/document pair (cross-encoders) follows the model's [`PairSpec`]:
//! the tokenizer's pair template with `longest_first` truncation, or a
//! reranker's prompt template (see the `pair` module).
//!
//! [`Prompt::Default`]: mlx_embed_core::Prompt::Default
//! [`Prompt::Named`]: mlx_embed_core::Prompt::Named
//! [`Prompt::Raw`]: mlx_embed_core::Prompt::Raw
//! [`TruncationDirection::Right`]: mlx_embed_core::TruncationDirection::Right
//! [`TruncationDirection::Left`]: mlx_embed_core::TruncationDirection::Left

// Every public item is documented: clippy's -D warnings holds the line.
#![warn(missing_docs)]

mod encoder;
mod error;
mod pair;
mod spec;

pub use encoder::{HfTokenizer, MAX_TEMPLATE_PAIR_BYTES};
pub use error::TokenizerError;
pub use pair::{query_first_lengths, truncate_pair_lengths, PairSpec};
pub use spec::{InputMode, TokenizerSpec};
