//! A multi-vector (ColBERT) model's query and document modes ([`InputMode`])
//! on the tiny-colbert fixture's WordPiece tokenizer: the insert after
//! `[CLS]`, the per-mode cut, the query's expansion, and that other outputs
//! keep the plain rules. The ids are PyLate's (tests/fixtures/tiny-colbert's
//! references; tests/python/test_colbert.py checks the Python side).

use std::path::PathBuf;

use mlx_embed_core::{EmbedInput, EmbedOptions, Output, Side, Tokenize};
use mlx_embed_tokenizer::{HfTokenizer, InputMode, TokenizerSpec};

const CLS: u32 = 4;
const SEP: u32 = 5;
const MASK: u32 = 6;
const Q: u32 = 1;
const D: u32 = 2;

fn spec() -> TokenizerSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-colbert/tokenizer.json");
    TokenizerSpec {
        query: Some(InputMode {
            insert_ids: vec![Q],
            max_length: 16,
            expand_id: Some(MASK),
        }),
        document: Some(InputMode {
            insert_ids: vec![D],
            max_length: 40,
            expand_id: None,
        }),
        ..HfTokenizer::probe_spec(&path, 40).expect("probe")
    }
}

fn ids(tok: &HfTokenizer, text: &str, output: Output) -> Vec<u32> {
    let options = EmbedOptions {
        output,
        ..EmbedOptions::default()
    };
    tok.encode(&EmbedInput::Text(text.into()), &options)
        .expect("encodes")
        .ids
}

#[test]
fn query_gets_the_insert_and_is_expanded_with_mask() {
    let tok = HfTokenizer::from_spec(spec()).unwrap();
    let plain = ids(&tok, "how do I reset my password", Output::Pooled);
    let query = ids(
        &tok,
        "how do I reset my password",
        Output::MultiVector(Side::Query),
    );
    assert_eq!(query.len(), 16);
    assert_eq!(&query[..2], &[CLS, Q]);
    assert_eq!(&query[2..plain.len() + 1], &plain[1..]);
    assert!(query[plain.len() + 1..].iter().all(|&id| id == MASK));
    // PyLate's ids for that query (reference.npz).
    assert_eq!(
        query,
        [4, 1, 557, 481, 560, 713, 126, 632, 668, 289, 219, 77, 5, 6, 6, 6]
    );
}

#[test]
fn long_query_is_cut_with_no_expansion_left() {
    let tok = HfTokenizer::from_spec(spec()).unwrap();
    let long = "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat";
    let query = ids(&tok, long, Output::MultiVector(Side::Query));
    assert_eq!(query.len(), 16);
    assert_eq!((query[0], query[1], query[15]), (CLS, Q, SEP));
    assert!(!query.contains(&MASK));
}

#[test]
fn document_is_cut_at_its_length_and_not_padded() {
    let tok = HfTokenizer::from_spec(spec()).unwrap();
    let short = ids(&tok, "short", Output::MultiVector(Side::Document));
    assert_eq!(short.first().copied(), Some(CLS));
    assert_eq!(short[1], D);
    assert_eq!(short.last().copied(), Some(SEP));
    assert_eq!(short.len(), ids(&tok, "short", Output::Pooled).len() + 1);
    let long = "a ".repeat(100);
    let doc = ids(&tok, &long, Output::MultiVector(Side::Document));
    assert_eq!(doc.len(), 40);
    assert_eq!((doc[0], doc[1], doc[39]), (CLS, D, SEP));
    // untruncated_len counts the insert too.
    let options = EmbedOptions {
        output: Output::MultiVector(Side::Document),
        ..EmbedOptions::default()
    };
    let enc = tok.encode(&EmbedInput::Text(long), &options).unwrap();
    assert_eq!(enc.untruncated_len as usize, 100 + 3);
}

#[test]
fn other_outputs_and_models_without_modes_keep_the_plain_rules() {
    let tok = HfTokenizer::from_spec(spec()).unwrap();
    assert_eq!(
        ids(&tok, "hello", Output::Tokens),
        ids(&tok, "hello", Output::Pooled)
    );
    let plain = HfTokenizer::from_spec(TokenizerSpec {
        query: None,
        document: None,
        ..spec()
    })
    .unwrap();
    assert_eq!(
        ids(&plain, "hello", Output::MultiVector(Side::Query)),
        ids(&plain, "hello", Output::Pooled)
    );
}

/// tiny-modern-colbert (GTE-ModernColBERT-v1's layout): byte-level BPE, the
/// prefixes the tokens PyLate added to it ("[Q] " 705, "[D] " 706), the
/// expansion `[MASK]` (704), lengths 32 / 300.
fn modern_spec() -> TokenizerSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-modern-colbert/tokenizer.json");
    TokenizerSpec {
        query: Some(InputMode {
            insert_ids: vec![705],
            max_length: 32,
            expand_id: Some(704),
        }),
        document: Some(InputMode {
            insert_ids: vec![706],
            max_length: 300,
            expand_id: None,
        }),
        ..HfTokenizer::probe_spec(&path, 300).expect("probe")
    }
}

#[test]
fn modern_colbert_ids_are_pylates() {
    let tok = HfTokenizer::from_spec(modern_spec()).unwrap();
    // PyLate's ids (tests/fixtures/tiny-modern-colbert/reference.npz).
    let query = ids(
        &tok,
        "how do I reset my password",
        Output::MultiVector(Side::Query),
    );
    let mut want = vec![
        701, 705, 71, 507, 315, 78, 414, 520, 627, 283, 88, 525, 86, 256, 67, 702,
    ];
    want.resize(32, 704);
    assert_eq!(query, want);
    // A literal "[Q] " in the text is the added token, after the insert.
    let literal = ids(
        &tok,
        "[Q] a literal prefix in the text",
        Output::MultiVector(Side::Query),
    );
    assert_eq!(&literal[..3], &[701, 705, 705]);
    assert_eq!(literal.iter().filter(|&&id| id == 704).count(), 15);
    let doc = ids(&tok, "short", Output::MultiVector(Side::Document));
    assert_eq!(doc, [701, 706, 82, 71, 565, 702]);
}
