//! The static-embedding rules on the tiny-model2vec fixture's WordPiece
//! tokenizer.json (template `[CLS] $A [SEP]`, `[UNK]` = 1, a small alphabet
//! so that CJK words are unknown): no specials although the file has a
//! template, Model2Vec's unknown-token drop after the token cut, and its
//! character cut before encoding, only when truncating.

use std::path::PathBuf;

use mlx_embed_core::{EmbedInput, EmbedOptions, Tokenize, TruncationDirection};
use mlx_embed_tokenizer::{HfTokenizer, TokenizerSpec};
use tokenizers::Tokenizer;

const UNK: u32 = 1;
const CLS: u32 = 2;
const SEP: u32 = 3;

fn tokenizer_json() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny-model2vec/tokenizer.json")
}

/// What the Python engine sends for a static model: no prefix, no suffix.
fn static_spec(max_length: usize) -> TokenizerSpec {
    TokenizerSpec {
        path: tokenizer_json(),
        max_length,
        ..TokenizerSpec::default()
    }
}

fn tokenizer(spec: TokenizerSpec) -> HfTokenizer {
    HfTokenizer::from_spec(spec).expect("tokenizer")
}

fn text(t: &str) -> EmbedInput {
    EmbedInput::Text(t.into())
}

/// The file's own ids for `t`, without specials and without its truncation.
fn raw(t: &str) -> Vec<u32> {
    let mut tok = Tokenizer::from_file(tokenizer_json()).unwrap();
    tok.with_truncation(None).unwrap();
    tok.encode(t, false).unwrap().get_ids().to_vec()
}

#[test]
fn no_special_tokens_although_the_file_has_a_template() {
    // The file would add [CLS] ... [SEP]: the probe finds them.
    let probed = HfTokenizer::probe_spec(&tokenizer_json(), 512).unwrap();
    assert_eq!(
        (probed.prefix_ids, probed.suffix_ids),
        (vec![CLS], vec![SEP])
    );

    let tok = tokenizer(static_spec(512));
    let sentence = "the quick brown fox jumps over the lazy dog";
    let e = tok
        .encode(&text(sentence), &EmbedOptions::default())
        .unwrap();
    assert!(e.ids.len() > 5);
    assert_eq!(e.ids, raw(sentence));
    assert_eq!(e.untruncated_len as usize, e.ids.len());
    // TEI's /tokenize with add_special_tokens lists none either.
    let spans = tok
        .tokens(sentence, true, &EmbedOptions::default())
        .unwrap();
    assert!(spans.iter().all(|s| !s.special));
    assert_eq!(spans.iter().map(|s| s.id).collect::<Vec<_>>(), e.ids);
    // An empty or blank text has no tokens at all (the core decides
    // whether the model takes that).
    for blank in ["", "  \t\n "] {
        assert!(tok
            .encode(&text(blank), &EmbedOptions::default())
            .unwrap()
            .ids
            .is_empty());
    }
}

#[test]
fn unknown_ids_are_dropped_after_the_token_cut() {
    let sentence = "東 hello 京 world";
    let all = raw(sentence);
    assert_eq!(all.iter().filter(|&&id| id == UNK).count(), 2, "{all:?}");
    assert_eq!(all[0], UNK);
    let known: Vec<u32> = all.iter().copied().filter(|&id| id != UNK).collect();

    let spec = TokenizerSpec {
        drop_ids: vec![UNK],
        ..static_spec(512)
    };
    let tok = tokenizer(spec.clone());
    let e = tok
        .encode(&text(sentence), &EmbedOptions::default())
        .unwrap();
    assert_eq!(e.ids, known);
    // The count before truncation includes the dropped ids (truncation
    // counts them, as Model2Vec's tokenizer does).
    assert_eq!(e.untruncated_len as usize, all.len());

    // Cut to 2 tokens first ([UNK] hello), then the [UNK] goes: one token
    // is left, not the first two known ones.
    let short = tokenizer(TokenizerSpec {
        max_length: 2,
        ..spec.clone()
    });
    let cut = short
        .encode(&text(sentence), &EmbedOptions::default())
        .unwrap();
    assert_eq!(
        cut.ids,
        all[..2]
            .iter()
            .copied()
            .filter(|&id| id != UNK)
            .collect::<Vec<_>>()
    );
    assert_eq!(cut.ids.len(), 1);
    // Token-id input follows the same rule; only unknown words leave nothing.
    let tokens = short
        .encode(&EmbedInput::Tokens(all.clone()), &EmbedOptions::default())
        .unwrap();
    assert_eq!(tokens.ids, cut.ids);
    assert!(tok
        .encode(&text("東 京"), &EmbedOptions::default())
        .unwrap()
        .ids
        .is_empty());
    let spans = tok
        .tokens(sentence, false, &EmbedOptions::default())
        .unwrap();
    assert_eq!(spans.iter().map(|s| s.id).collect::<Vec<_>>(), known);
}

#[test]
fn the_character_cut_applies_only_when_truncating() {
    // Multi-byte characters: the limit counts characters, not bytes.
    let sentence = "héllo wörld the quick brown fox";
    let spec = TokenizerSpec {
        char_limit: Some(11),
        ..static_spec(512)
    };
    let tok = tokenizer(spec);
    let right = tok
        .encode(&text(sentence), &EmbedOptions::default())
        .unwrap();
    assert_eq!(right.ids, raw("héllo wörld"));
    let left = EmbedOptions {
        truncation_direction: Some(TruncationDirection::Left),
        ..EmbedOptions::default()
    };
    assert_eq!(
        tok.encode(&text(sentence), &left).unwrap().ids,
        raw("k brown fox")
    );
    // truncate: false runs the whole text (refused by the core only when it
    // has more tokens than max_length).
    let whole = EmbedOptions {
        truncate: false,
        ..EmbedOptions::default()
    };
    let e = tok.encode(&text(sentence), &whole).unwrap();
    assert_eq!(e.ids, raw(sentence));
    assert!(e.ids.len() > right.ids.len());
    // A raw prompt counts in the characters.
    let prompted = EmbedOptions {
        prompt: mlx_embed_core::Prompt::Raw("the ".into()),
        ..EmbedOptions::default()
    };
    assert_eq!(
        tok.encode(&text(sentence), &prompted).unwrap().ids,
        raw("the héllo w")
    );
    // Texts within the limit are untouched.
    assert_eq!(
        tok.encode(&text("héllo"), &EmbedOptions::default())
            .unwrap()
            .ids,
        raw("héllo")
    );
}
