//! The tokenization rules on a real BERT tokenizer.json (the tiny-qwen3
//! fixture carries MiniLM's WordPiece file, baked-in truncation and padding
//! included): specials, both truncation sides, prompts,
//! token-id input and the vocabulary check.

use std::collections::BTreeMap;
use std::path::PathBuf;

use mlx_embed_core::{
    EmbedInput, EmbedOptions, EmbedderErrorKind, Prompt, Tokenize, TruncationDirection,
};
use mlx_embed_tokenizer::{HfTokenizer, TokenizerError, TokenizerSpec};

const CLS: u32 = 101;
const SEP: u32 = 102;

fn tokenizer_json() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-qwen3/tokenizer.json")
}

fn spec(max_length: usize) -> TokenizerSpec {
    HfTokenizer::probe_spec(&tokenizer_json(), max_length).expect("probe")
}

fn tokenizer(spec: TokenizerSpec) -> HfTokenizer {
    HfTokenizer::from_spec(spec).expect("tokenizer")
}

fn text(t: &str) -> EmbedInput {
    EmbedInput::Text(t.into())
}

fn ids(tok: &HfTokenizer, input: &EmbedInput, options: &EmbedOptions) -> Vec<u32> {
    tok.encode(input, options).expect("encodes").ids
}

/// Content ids of `t` with no specials, as the tokenizer itself gives them.
fn content(t: &str) -> Vec<u32> {
    let full = ids(&tokenizer(spec(4096)), &text(t), &EmbedOptions::default());
    full[1..full.len() - 1].to_vec()
}

#[test]
fn probe_finds_bert_specials_and_the_file_truncation_is_ignored() {
    let s = spec(512);
    assert_eq!(
        (s.prefix_ids.clone(), s.suffix_ids.clone()),
        (vec![CLS], vec![SEP])
    );
    let tok = tokenizer(s);
    assert_eq!(tok.vocab_size(), 30522);
    // 300 words: past the file's own truncation (128) and fixed padding (128).
    let long = "hello ".repeat(300);
    let e = tok.encode(&text(&long), &EmbedOptions::default()).unwrap();
    assert_eq!(e.ids.len(), 302);
    assert_eq!(e.untruncated_len, 302);
    assert_eq!((e.ids[0], e.ids[301]), (CLS, SEP));
}

#[test]
fn truncation_keeps_the_start_or_the_end_inside_the_specials() {
    let tok = tokenizer(spec(6));
    let words = "one two three four five six seven";
    let all = content(words);
    assert_eq!(all.len(), 7);
    let right = tok.encode(&text(words), &EmbedOptions::default()).unwrap();
    assert_eq!(
        right.ids,
        [vec![CLS], all[..4].to_vec(), vec![SEP]].concat()
    );
    assert_eq!(right.untruncated_len, 9);
    let left = EmbedOptions {
        truncation_direction: Some(TruncationDirection::Left),
        ..EmbedOptions::default()
    };
    assert_eq!(
        ids(&tok, &text(words), &left),
        [vec![CLS], all[3..].to_vec(), vec![SEP]].concat()
    );
    // Short inputs are untouched either way.
    assert_eq!(
        ids(&tok, &text("one"), &left),
        ids(&tok, &text("one"), &EmbedOptions::default())
    );
}

#[test]
fn a_folder_that_cuts_on_the_left_does_so_unless_the_request_says_otherwise() {
    // tokenizer_config.json's truncation_side "left" (TokenizerSpec::truncation_side)
    // is the cut of a request that names no direction, text and token ids alike.
    let left = tokenizer(TokenizerSpec {
        truncation_side: TruncationDirection::Left,
        ..spec(6)
    });
    let plain = tokenizer(spec(6));
    let asked = |direction| EmbedOptions {
        truncation_direction: Some(direction),
        ..EmbedOptions::default()
    };
    let words = "one two three four five six seven";
    let token_ids = [vec![CLS], content(words), vec![SEP]].concat();
    for input in [text(words), EmbedInput::Tokens(token_ids)] {
        assert_eq!(
            ids(&left, &input, &EmbedOptions::default()),
            ids(&plain, &input, &asked(TruncationDirection::Left))
        );
        assert_eq!(
            ids(&left, &input, &asked(TruncationDirection::Right)),
            ids(&plain, &input, &EmbedOptions::default())
        );
        assert_ne!(
            ids(&left, &input, &EmbedOptions::default()),
            ids(&plain, &input, &EmbedOptions::default())
        );
    }
}

#[test]
fn a_per_request_cut_is_the_models_cut_at_that_length() {
    // A request's truncate_to 6 on a model of 512 cuts text, token ids and
    // both sides exactly as a model of 6 does; a larger one is the model's.
    let (six, wide) = (tokenizer(spec(6)), tokenizer(spec(512)));
    let words = "one two three four five six seven";
    let long_ids = [vec![CLS], content(words), vec![SEP]].concat();
    for direction in [TruncationDirection::Right, TruncationDirection::Left] {
        let model = EmbedOptions {
            truncation_direction: Some(direction),
            ..EmbedOptions::default()
        };
        let cut = EmbedOptions {
            truncate_to: Some(6),
            ..model.clone()
        };
        for input in [text(words), EmbedInput::Tokens(long_ids.clone())] {
            let got = wide.encode(&input, &cut).unwrap();
            assert_eq!(got, six.encode(&input, &model).unwrap(), "{direction:?}");
            assert_eq!((got.ids.len(), got.untruncated_len), (6, 9));
        }
        let over = EmbedOptions {
            truncate_to: Some(100_000),
            ..model.clone()
        };
        assert_eq!(
            ids(&wide, &text(words), &over),
            ids(&wide, &text(words), &model)
        );
    }
    // Room for the specials and one token at least.
    let at = |n| EmbedOptions {
        truncate_to: Some(n),
        ..EmbedOptions::default()
    };
    assert_eq!(
        ids(&wide, &text(words), &at(3)),
        [CLS, content("one")[0], SEP]
    );
    let err = wide.encode(&text(words), &at(2)).unwrap_err();
    assert_eq!(err.kind, EmbedderErrorKind::CutTooShort);
    assert!(err.message.contains("leaves no room for text"), "{err:?}");
    // Ids without the specials are cut as they are.
    assert_eq!(
        ids(&wide, &EmbedInput::Tokens(vec![7, 8, 9]), &at(2)),
        [7, 8]
    );
}

#[test]
fn prompts_are_prepended_to_the_text() {
    let mut s = spec(512);
    s.prompts = BTreeMap::from([
        ("query".to_string(), "query: ".to_string()),
        ("passage".to_string(), "passage: ".to_string()),
    ]);
    s.default_prompt_name = Some("query".into());
    let tok = tokenizer(s.clone());
    let wrap = |t: &str| [vec![CLS], content(t), vec![SEP]].concat();
    let with = |prompt: Prompt| EmbedOptions {
        prompt,
        ..EmbedOptions::default()
    };
    assert_eq!(
        ids(&tok, &text("rivers"), &EmbedOptions::default()),
        wrap("query: rivers")
    );
    assert_eq!(
        ids(
            &tok,
            &text("rivers"),
            &with(Prompt::Named("passage".into()))
        ),
        wrap("passage: rivers")
    );
    assert_eq!(
        ids(&tok, &text("rivers"), &with(Prompt::Raw("topic: ".into()))),
        wrap("topic: rivers")
    );
    assert_eq!(
        ids(&tok, &text("rivers"), &with(Prompt::Raw(String::new()))),
        wrap("rivers")
    );
    let err = tok
        .encode(&text("rivers"), &with(Prompt::Named("nope".into())))
        .unwrap_err();
    assert_eq!(err.kind, EmbedderErrorKind::InvalidInput);
    assert_eq!(err.message, "unknown prompt name \"nope\"");
    // Token input never gets a prompt, nor specials: it runs as given.
    let tokens = EmbedInput::Tokens(vec![CLS, 7592, 2088, SEP]);
    assert_eq!(
        ids(&tok, &tokens, &EmbedOptions::default()),
        vec![CLS, 7592, 2088, SEP]
    );
    assert_eq!(
        ids(&tok, &tokens, &EmbedOptions::default()),
        ids(
            &tok,
            &text("hello world"),
            &with(Prompt::Raw(String::new()))
        )
    );

    // A text that already begins with one of the prompts gets no default
    // one (a client that writes `query: ` itself); a prompt asked for by
    // name or as raw text is always prepended.
    assert_eq!(
        ids(&tok, &text("passage: rivers"), &EmbedOptions::default()),
        wrap("passage: rivers")
    );
    assert_eq!(
        ids(&tok, &text("query: rivers"), &EmbedOptions::default()),
        wrap("query: rivers")
    );
    assert_eq!(
        ids(
            &tok,
            &text("query: rivers"),
            &with(Prompt::Named("query".into()))
        ),
        wrap("query: query: rivers")
    );
    assert_eq!(
        ids(&tok, &text("passage:rivers"), &EmbedOptions::default()),
        wrap("query: passage:rivers")
    );
    // A prompt counts as written only where it ends a word: one that ends
    // inside a word is not written at the start of a longer word.
    let mut short = s.clone();
    short.prompts.insert("passage".into(), "quer".into());
    let short = tokenizer(short);
    assert_eq!(
        ids(&short, &text("query rivers"), &EmbedOptions::default()),
        wrap("query: query rivers")
    );
    assert_eq!(
        ids(&short, &text("quer rivers"), &EmbedOptions::default()),
        wrap("quer rivers")
    );
    assert_eq!(
        ids(&short, &text("quer"), &EmbedOptions::default()),
        wrap("quer")
    );

    // No default prompt: the text as it is.
    s.default_prompt_name = None;
    let tok = tokenizer(s);
    assert_eq!(
        ids(&tok, &text("rivers"), &EmbedOptions::default()),
        wrap("rivers")
    );
}

#[test]
fn token_input_is_checked_against_the_vocabulary_then_truncated() {
    let tok = tokenizer(spec(4));
    let five = EmbedInput::Tokens(vec![1, 2, 3, 30521, 7]);
    let e = tok.encode(&five, &EmbedOptions::default()).unwrap();
    // The whole sequence is cut to the model's maximum; nothing is added.
    assert_eq!(e.ids, vec![1, 2, 3, 30521]);
    assert_eq!(e.untruncated_len, 5);
    let left = EmbedOptions {
        truncation_direction: Some(TruncationDirection::Left),
        ..EmbedOptions::default()
    };
    assert_eq!(tok.encode(&five, &left).unwrap().ids, vec![2, 3, 30521, 7]);
    // Wrapped in the model's own specials, the content is cut inside them, as
    // for text, so the pooled token survives either way.
    let wrapped = EmbedInput::Tokens(vec![CLS, 1, 2, 3, 30521, SEP]);
    let e = tok.encode(&wrapped, &EmbedOptions::default()).unwrap();
    assert_eq!((e.ids, e.untruncated_len), (vec![CLS, 1, 2, SEP], 6));
    assert_eq!(
        tok.encode(&wrapped, &left).unwrap().ids,
        vec![CLS, 3, 30521, SEP]
    );
    // Within the maximum, ids run exactly as sent, specials or not.
    let short = EmbedInput::Tokens(vec![SEP, 1, CLS]);
    assert_eq!(
        tok.encode(&short, &EmbedOptions::default()).unwrap().ids,
        vec![SEP, 1, CLS]
    );
    let err = tok
        .encode(
            &EmbedInput::Tokens(vec![1, 30522]),
            &EmbedOptions::default(),
        )
        .unwrap_err();
    assert_eq!(err.kind, EmbedderErrorKind::InvalidInput);
    assert_eq!(
        err.message,
        "token id 30522 at position 1 is outside the vocabulary (ids must be below 30522)"
    );
    let pair = EmbedInput::Pair {
        query: "q".into(),
        document: "d".into(),
    };
    assert_eq!(
        tok.encode(&pair, &EmbedOptions::default())
            .unwrap_err()
            .kind,
        EmbedderErrorKind::InvalidInput
    );
}

#[test]
fn a_model_that_pools_without_its_prompt_marks_where_the_text_starts() {
    let mut s = spec(512);
    s.prompts = BTreeMap::from([
        ("query".to_string(), "query: ".to_string()),
        ("passage".to_string(), "passage of text: ".to_string()),
    ]);
    s.default_prompt_name = Some("query".into());
    s.pool_without_prompt = true;
    let tok = tokenizer(s.clone());
    let start = |t: &str, options: &EmbedOptions| tok.encode(&text(t), options).unwrap().pool_start;
    let with = |prompt: Prompt| EmbedOptions {
        prompt,
        ..EmbedOptions::default()
    };
    let (query, passage) = (content("query: ").len(), content("passage of text: ").len());
    assert_eq!((query, passage), (2, 4));
    // sentence-transformers' count: [CLS] and the prompt (the prompt alone
    // tokenized with the specials, less its closing [SEP]).
    assert_eq!(start("rivers", &EmbedOptions::default()), 1 + 2);
    assert_eq!(
        start("rivers", &with(Prompt::Named("passage".into()))),
        1 + 4
    );
    assert_eq!(start("rivers", &with(Prompt::Raw("topic: ".into()))), 1 + 2);
    assert_eq!(start("rivers", &with(Prompt::Raw(String::new()))), 0);
    // A prompt of no tokens still leaves [CLS] out, as sentence-transformers
    // counts it ([CLS] [SEP], less the [SEP]).
    assert_eq!(start("rivers", &with(Prompt::Raw(" ".into()))), 1);
    // The default left off a text that carries a prompt: that one is left out.
    assert_eq!(
        start("passage of text: rivers", &EmbedOptions::default()),
        1 + 4
    );
    // Token ids and a model that pools its prompt: nothing left out.
    let tokens = EmbedInput::Tokens(vec![CLS, 7592, 2088, SEP]);
    assert_eq!(
        tok.encode(&tokens, &EmbedOptions::default())
            .unwrap()
            .pool_start,
        0
    );
    s.pool_without_prompt = false;
    assert_eq!(
        tokenizer(s.clone())
            .encode(&text("rivers"), &EmbedOptions::default())
            .unwrap()
            .pool_start,
        0
    );
    // No default prompt: a text that begins with one pools all of it.
    s.pool_without_prompt = true;
    s.default_prompt_name = None;
    let plain = tokenizer(s);
    assert_eq!(
        plain
            .encode(&text("query: rivers"), &EmbedOptions::default())
            .unwrap()
            .pool_start,
        0
    );

    // A right cut keeps the prompt; one shorter than it leaves out all but
    // the closing [SEP] (the prompt alone is cut to the same room, as
    // sentence-transformers cuts it). A left cut that takes part or all of
    // the prompt leaves the same count out: sentence-transformers 6.2 masks
    // the first positions by the prompt's own length, whatever the cut kept.
    let words = "one two three four five six seven";
    let n = content(words).len();
    let cut = |to: usize, direction| EmbedOptions {
        truncate_to: Some(to),
        truncation_direction: Some(direction),
        prompt: Prompt::Named("passage".into()),
        ..EmbedOptions::default()
    };
    let encode = |t: &str, o: &EmbedOptions| tok.encode(&text(t), o).unwrap();
    assert_eq!(
        encode(words, &cut(2 + 4 + n - 3, TruncationDirection::Right)).pool_start,
        5
    );
    assert_eq!(
        encode(words, &cut(4, TruncationDirection::Right)).pool_start,
        3
    );
    assert_eq!(
        encode(words, &cut(3, TruncationDirection::Right)).pool_start,
        2
    );
    let left = encode(words, &cut(2 + 4 + n - 3, TruncationDirection::Left));
    assert_eq!(left.pool_start, 1 + 4);
    assert_eq!(
        encode(words, &cut(2 + n, TruncationDirection::Left)).pool_start,
        1 + 4
    );
    assert_eq!(left.ids.len(), 2 + 4 + n - 3);
}

#[test]
fn wrapped_token_ids_must_carry_the_specials() {
    let tok = tokenizer(spec(8));
    let wrapped = EmbedOptions {
        wrapped_token_ids: true,
        ..EmbedOptions::default()
    };
    let tokens = |ids: &[u32]| EmbedInput::Tokens(ids.to_vec());
    // tiktoken's "hello world", as LangChain sends it.
    for bare in [
        &[15339, 1917][..],
        &[CLS, 7592, 2088],
        &[7592, 2088, SEP],
        &[CLS],
    ] {
        let err = tok.encode(&tokens(bare), &wrapped).unwrap_err();
        assert_eq!(err.kind, EmbedderErrorKind::InvalidInput);
        assert!(
            err.message
                .contains("begin with [CLS] (101) and end with [SEP] (102)")
                && err.message.contains("check_embedding_ctx_length=False")
                && !err.message.contains("  "),
            "{}",
            err.message
        );
        // Run as given where the option is off (TEI's route).
        assert_eq!(
            ids(&tok, &tokens(bare), &EmbedOptions::default()),
            bare.to_vec()
        );
    }
    assert_eq!(
        ids(&tok, &tokens(&[CLS, 7592, 2088, SEP]), &wrapped),
        vec![CLS, 7592, 2088, SEP]
    );
    assert_eq!(ids(&tok, &tokens(&[CLS, SEP]), &wrapped), vec![CLS, SEP]);
    // Over the maximum: cut inside the specials, as before.
    let long: Vec<u32> = [vec![CLS], vec![7592; 20], vec![SEP]].concat();
    assert_eq!(
        ids(&tok, &tokens(&long), &wrapped),
        [vec![CLS], vec![7592; 6], vec![SEP]].concat()
    );
}

#[test]
fn inconsistent_specs_are_refused() {
    let too_short = spec(2);
    assert!(matches!(
        HfTokenizer::from_spec(too_short),
        Err(TokenizerError::Spec(_))
    ));
    let mut bad_default = spec(64);
    bad_default.default_prompt_name = Some("query".into());
    assert!(matches!(
        HfTokenizer::from_spec(bad_default),
        Err(TokenizerError::Spec(_))
    ));
    let mut bad_special = spec(64);
    bad_special.suffix_ids = vec![40_000];
    assert!(matches!(
        HfTokenizer::from_spec(bad_special),
        Err(TokenizerError::Spec(_))
    ));
    let missing = TokenizerSpec {
        path: "/nonexistent/tokenizer.json".into(),
        max_length: 64,
        ..TokenizerSpec::default()
    };
    assert!(matches!(
        HfTokenizer::from_spec(missing),
        Err(TokenizerError::Load { .. })
    ));
}
