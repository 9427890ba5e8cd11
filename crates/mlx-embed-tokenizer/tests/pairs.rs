//! Pair encoding against the `tokenizers` crate's own pair encoding with
//! `longest_first` truncation, on every pair of the cross-encoder fixtures.

use std::path::PathBuf;

use mlx_embed_core::{EmbedInput, EmbedOptions, Prompt, Tokenize, TruncationDirection};
use mlx_embed_tokenizer::{HfTokenizer, PairSpec, TokenizerSpec, MAX_TEMPLATE_PAIR_BYTES};
use tokenizers::{
    Tokenizer, TruncationDirection as HfDirection, TruncationParams, TruncationStrategy,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn pairs(folder: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(fixture(folder).join("pairs.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn options(direction: TruncationDirection) -> EmbedOptions {
    EmbedOptions {
        truncation_direction: Some(direction),
        ..EmbedOptions::default()
    }
}

/// The tokenizer's pair template, as the Python engine probes it.
fn segments_spec(folder: &str, max_length: usize, types: (u32, u32)) -> TokenizerSpec {
    let path = fixture(folder).join("tokenizer.json");
    let mut tok = Tokenizer::from_file(&path).unwrap();
    // MiniLM's file pads to 128 and truncates: neither belongs in a probe.
    tok.with_padding(None);
    tok.with_truncation(None).unwrap();
    let probe = tok.encode(("hello", "world"), true).unwrap();
    let seq = probe.get_sequence_ids();
    let ids = probe.get_ids();
    let a0 = seq.iter().position(|s| *s == Some(0)).unwrap();
    let a1 = seq.iter().rposition(|s| *s == Some(0)).unwrap() + 1;
    let b0 = seq.iter().position(|s| *s == Some(1)).unwrap();
    let b1 = seq.iter().rposition(|s| *s == Some(1)).unwrap() + 1;
    let single = HfTokenizer::probe_spec(&path, max_length).unwrap();
    TokenizerSpec {
        pair: Some(PairSpec {
            prefix_ids: ids[..a0].to_vec(),
            middle_ids: ids[a1..b0].to_vec(),
            suffix_ids: ids[b1..].to_vec(),
            first_type_id: types.0,
            second_type_id: types.1,
            ..PairSpec::default()
        }),
        ..single
    }
}

/// `types`: the pair's token types as the engine sends them; `None` for a
/// model that reads none (a decoder), whose spec is `(0, 0)`: no types are
/// sent, and only the ids are compared.
fn check_segments(folder: &str, types: Option<(u32, u32)>) {
    let ours = HfTokenizer::from_spec(segments_spec(folder, 128, types.unwrap_or((0, 0)))).unwrap();
    for (direction, hf_direction) in [
        (TruncationDirection::Right, HfDirection::Right),
        (TruncationDirection::Left, HfDirection::Left),
    ] {
        let mut reference = Tokenizer::from_file(fixture(folder).join("tokenizer.json")).unwrap();
        reference
            .with_truncation(Some(TruncationParams {
                max_length: 128,
                strategy: TruncationStrategy::LongestFirst,
                direction: hf_direction,
                stride: 0,
            }))
            .unwrap();
        reference.with_padding(None);
        let mut truncated = 0;
        for (i, (q, d)) in pairs(folder).into_iter().enumerate() {
            let want = reference.encode((q.as_str(), d.as_str()), true).unwrap();
            let got = ours
                .encode(
                    &EmbedInput::Pair {
                        query: q,
                        document: d,
                    },
                    &options(direction),
                )
                .unwrap();
            assert_eq!(got.ids, want.get_ids(), "{folder} pair {i} {direction:?}");
            match (&got.type_ids, types) {
                (Some(t), _) => assert_eq!(t, want.get_type_ids(), "{folder} pair {i}"),
                (None, Some(_)) => assert!(want.get_type_ids().iter().all(|&t| t == 0)),
                (None, None) => {}
            }
            truncated += usize::from(got.untruncated_len > 128);
        }
        assert!(truncated >= 5, "{folder}: the fixture exercises truncation");
    }
}

#[test]
fn a_per_request_cut_cuts_pairs_as_a_shorter_model() {
    let folder = "tiny-bert-reranker";
    let wide = HfTokenizer::from_spec(segments_spec(folder, 128, (0, 1))).unwrap();
    let short = HfTokenizer::from_spec(segments_spec(folder, 12, (0, 1))).unwrap();
    for (query, document) in pairs(folder) {
        let input = EmbedInput::Pair { query, document };
        let cut = EmbedOptions {
            truncate_to: Some(12),
            ..options(TruncationDirection::Right)
        };
        let got = wide.encode(&input, &cut).unwrap();
        assert!(got.ids.len() <= 12);
        assert_eq!(
            got,
            short
                .encode(&input, &options(TruncationDirection::Right))
                .unwrap()
        );
    }
}

#[test]
fn bert_pairs_match_tokenizers() {
    check_segments("tiny-bert-reranker", Some((0, 1)));
}

#[test]
fn xlmr_pairs_match_tokenizers() {
    check_segments("tiny-xlmr-reranker", Some((0, 0)));
}

#[test]
fn qwen3_seq_cls_pairs_match_tokenizers() {
    // Qwen's byte-level post-processor adds no special token and no EOS to a
    // pair: the query's ids, then the document's (typed 1, which Qwen3 never reads).
    check_segments("tiny-qwen3-seq-cls", Some((0, 1)));
}

#[test]
fn decoder_seq_cls_pairs_match_tokenizers() {
    // Qwen2.5's byte-level post-processor adds nothing; Mistral-7B's,
    // Gemma's and Llama 3's templates put a BOS before each text (`<s> A <s> B`,
    // `<|begin_of_text|> A <|begin_of_text|> B` after a ByteLevel step), no EOS.
    // The second BOS is typed 1 there, not as the query's side: the decoders
    // read no token types, so the engine sends none.
    for folder in [
        "tiny-qwen2-seq-cls",
        "tiny-mistral-seq-cls",
        "tiny-gemma2-seq-cls",
        "tiny-llama-seq-cls",
    ] {
        check_segments(folder, None);
    }
}

#[test]
fn template_pairs_wrap_the_prompt() {
    let folder = "tiny-qwen3-reranker";
    let path = fixture(folder).join("tokenizer.json");
    let tok = Tokenizer::from_file(&path).unwrap();
    let enc = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
    let prefix = enc("<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\n");
    let suffix = enc("<|im_end|>\n<|im_start|>assistant\n");
    let spec = TokenizerSpec {
        pair: Some(PairSpec {
            prefix_ids: prefix.clone(),
            suffix_ids: suffix.clone(),
            template: Some(
                "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}".into(),
            ),
            default_instruction: Some("Find".into()),
            ..PairSpec::default()
        }),
        ..HfTokenizer::probe_spec(&path, 64).unwrap()
    };
    let ours = HfTokenizer::from_spec(spec).unwrap();
    let pair = EmbedInput::Pair {
        query: "q {document}".into(),
        document: "the document".into(),
    };
    let got = ours.encode(&pair, &EmbedOptions::default()).unwrap();
    let want = [
        prefix.clone(),
        enc("<Instruct>: Find\n<Query>: q {document}\n<Document>: the document"),
        suffix.clone(),
    ]
    .concat();
    assert_eq!(got.ids, want);
    assert_eq!(got.type_ids, None);
    // A raw prompt is the instruction.
    let raw = EmbedOptions {
        prompt: Prompt::Raw("Other".into()),
        ..EmbedOptions::default()
    };
    let got = ours.encode(&pair, &raw).unwrap();
    let text = enc("<Instruct>: Other\n<Query>: q {document}\n<Document>: the document");
    assert_eq!(got.ids, [prefix.clone(), text, suffix.clone()].concat());
    // Over the limit the pair text is cut, the prompt's ends kept.
    let long = EmbedInput::Pair {
        query: "q".into(),
        document: "word ".repeat(200),
    };
    let got = ours.encode(&long, &EmbedOptions::default()).unwrap();
    assert_eq!(got.ids.len(), 64);
    assert!(got.untruncated_len > 64);
    assert_eq!(&got.ids[..prefix.len()], prefix.as_slice());
    assert_eq!(&got.ids[64 - suffix.len()..], suffix.as_slice());
    // Cut from the left, the document gives up its start: the instruction
    // and the query stay, so two queries still differ.
    let left = options(TruncationDirection::Left);
    let got = ours.encode(&long, &left).unwrap();
    assert_eq!(got.ids.len(), 64);
    let frame = enc("<Instruct>: Find\n<Query>: q\n<Document>: ");
    let head = frame.len() - 1; // the last frame token merges into the document's first
    assert_eq!(
        &got.ids[..prefix.len() + head],
        [&prefix[..], &frame[..head]].concat()
    );
    let whole = enc(&format!(
        "<Instruct>: Find\n<Query>: q\n<Document>: {}",
        "word ".repeat(200)
    ));
    let kept = 64 - prefix.len() - suffix.len() - head;
    assert_eq!(
        &got.ids[prefix.len() + head..64 - suffix.len()],
        &whole[whole.len() - kept..]
    );
    let other = EmbedInput::Pair {
        query: "another query".into(),
        document: "word ".repeat(200),
    };
    assert_ne!(ours.encode(&other, &left).unwrap().ids, got.ids);
    let named = EmbedOptions {
        prompt: Prompt::Named("query".into()),
        ..EmbedOptions::default()
    };
    assert!(ours.encode(&pair, &named).is_err());
}

/// A request's instruction on a template reranker that leaves the pair
/// text no token for a document is refused (every document would be cut
/// away whole and score alike); one a token short of that still reaches
/// the document, whichever end is cut.
#[test]
fn an_instruction_must_leave_a_template_pair_a_document() {
    let folder = "tiny-qwen3-reranker";
    let path = fixture(folder).join("tokenizer.json");
    let tok = Tokenizer::from_file(&path).unwrap();
    let enc = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
    let prefix = enc("<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\n");
    let suffix = enc("<|im_end|>\n<|im_start|>assistant\n");
    let template = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}";
    let spec = TokenizerSpec {
        pair: Some(PairSpec {
            prefix_ids: prefix.clone(),
            suffix_ids: suffix.clone(),
            template: Some(template.into()),
            default_instruction: Some("Find".into()),
            ..PairSpec::default()
        }),
        ..HfTokenizer::probe_spec(&path, 64).unwrap()
    };
    let ours = HfTokenizer::from_spec(spec).unwrap();
    let room = 64 - prefix.len() - suffix.len();
    let frame = |instruction: &str| {
        enc(&format!(
            "<Instruct>: {instruction}\n<Query>: \n<Document>: "
        ))
        .len()
    };
    // Instructions whose frame is exactly one token short of the room, and
    // exactly the room.
    let sized = |n: usize| {
        (0..100)
            .flat_map(|k| ["", "a", "ab", "x y"].map(|t| "find ".repeat(k) + t))
            .find(|instruction| frame(instruction) == n)
            .unwrap()
    };
    let (fits, over) = (sized(room - 1), sized(room));
    let pair = |query: &str, document: &str| EmbedInput::Pair {
        query: query.into(),
        document: document.into(),
    };
    let long = "word ".repeat(100);
    for direction in [TruncationDirection::Right, TruncationDirection::Left] {
        let with = |instruction: String| EmbedOptions {
            prompt: Prompt::Raw(instruction),
            ..options(direction)
        };
        // One token short: the documents still differ.
        let a = ours.encode(&pair("", &long), &with(fits.clone())).unwrap();
        let b = ours
            .encode(&pair("", "Bread"), &with(fits.clone()))
            .unwrap();
        assert_eq!(a.ids.len(), 64);
        assert_ne!(a.ids, b.ids, "{direction:?}");
        // No room: refused on any pair, the empty one (the route's probe) too.
        for (query, document) in [("", ""), ("q", "d"), ("q", long.as_str())] {
            let err = ours
                .encode(&pair(query, document), &with(over.clone()))
                .unwrap_err();
            assert!(
                err.message.starts_with(&format!(
                    "the instruction leaves the documents no room within max_length 64 \
                     (with the reranker's prompt it takes {} of the {room} tokens",
                    frame(&over.clone())
                )),
                "{}",
                err.message
            );
        }
        // The model's own instruction is never refused; a long query is
        // the query's matter.
        assert!(ours.encode(&pair("", ""), &options(direction)).is_ok());
        let query = "query ".repeat(100);
        assert!(ours.encode(&pair(&query, "d"), &with(fits.clone())).is_ok());
    }
}

#[test]
fn single_text_models_refuse_pairs() {
    let path = fixture("tiny-bert-reranker").join("tokenizer.json");
    let ours = HfTokenizer::from_spec(HfTokenizer::probe_spec(&path, 128).unwrap()).unwrap();
    let err = ours
        .encode(
            &EmbedInput::Pair {
                query: "q".into(),
                document: "d".into(),
            },
            &EmbedOptions::default(),
        )
        .unwrap_err();
    assert!(
        err.message.contains("not query/document pairs"),
        "{}",
        err.message
    );
}

/// One request's pairs, encoded together (each query tokenized once), are
/// exactly the pairs encoded one at a time, in both directions, with queries
/// repeated, interleaved, and long enough to be cut.
#[test]
fn a_request_shares_its_queries_and_encodes_each_pair_alike() {
    for (folder, types) in [
        ("tiny-bert-reranker", (0, 1)),
        ("tiny-xlmr-reranker", (0, 0)),
    ] {
        let ours = HfTokenizer::from_spec(segments_spec(folder, 128, types)).unwrap();
        let fixture_pairs = pairs(folder);
        let long_query = "a query long enough to be cut ".repeat(40);
        let mut inputs = Vec::new();
        for (i, (q, d)) in fixture_pairs.iter().enumerate() {
            inputs.push(EmbedInput::Pair {
                query: q.clone(),
                document: d.clone(),
            });
            let query = if i % 2 == 0 {
                &long_query
            } else {
                &fixture_pairs[0].0
            };
            inputs.push(EmbedInput::Pair {
                query: query.clone(),
                document: d.clone(),
            });
        }
        for direction in [TruncationDirection::Right, TruncationDirection::Left] {
            let opts = options(direction);
            let together = ours.encode_request(&inputs, &opts).unwrap();
            let alone: Vec<_> = inputs
                .iter()
                .map(|i| ours.encode(i, &opts).unwrap())
                .collect();
            assert_eq!(together, alone, "{folder} {direction:?}");
        }
        // The first input that fails stops the request, with its index.
        let mut bad = inputs[..3].to_vec();
        bad.insert(1, EmbedInput::Text("a lone text".into()));
        let plain = HfTokenizer::from_spec(
            HfTokenizer::probe_spec(&fixture(folder).join("tokenizer.json"), 128).unwrap(),
        )
        .unwrap();
        let (index, err) = plain
            .encode_request(&bad, &EmbedOptions::default())
            .unwrap_err();
        assert_eq!(index, 0, "a single-text model refuses the first pair");
        assert!(
            err.message.contains("not query/document pairs"),
            "{}",
            err.message
        );
    }
}

/// A template reranker reads the query again in every pair: a request may
/// make it read at most MAX_TEMPLATE_PAIR_BYTES, and the pair that goes
/// over is named.
#[test]
fn template_pairs_bound_what_a_request_makes_the_tokenizer_read() {
    let path = fixture("tiny-qwen3-reranker").join("tokenizer.json");
    let spec = TokenizerSpec {
        pair: Some(PairSpec {
            template: Some("<Query>: {query}\n<Document>: {document}".into()),
            ..PairSpec::default()
        }),
        ..HfTokenizer::probe_spec(&path, 64).unwrap()
    };
    let ours = HfTokenizer::from_spec(spec).unwrap();
    let query = "q".repeat(1 << 20);
    let pair = |document: &str| EmbedInput::Pair {
        query: query.clone(),
        document: document.into(),
    };
    // Sixteen pairs of a 1 MiB query and a one-byte document: over by the 16th.
    let inputs: Vec<_> = (0..16).map(|_| pair("d")).collect();
    let (index, err) = ours
        .encode_request(&inputs, &EmbedOptions::default())
        .unwrap_err();
    assert_eq!(index, 15);
    assert!(
        err.message
            .contains("reads the query again with each document")
            && err.message.contains("16 MiB"),
        "{}",
        err.message
    );
    assert_eq!(MAX_TEMPLATE_PAIR_BYTES, 16 << 20);
    // Under the bound, the same as one at a time.
    let short: Vec<_> = (0..3)
        .map(|i| EmbedInput::Pair {
            query: "what is it".into(),
            document: format!("document {i}"),
        })
        .collect();
    let together = ours
        .encode_request(&short, &EmbedOptions::default())
        .unwrap();
    let alone: Vec<_> = short
        .iter()
        .map(|i| ours.encode(i, &EmbedOptions::default()).unwrap())
        .collect();
    assert_eq!(together, alone);
}

/// mxbai-rerank v2's task prompt, which `tiny-qwen2-reranker-st6`'s chat
/// template writes after the document.
const MXBAI_TASK: &str = "You are a search relevance expert who evaluates how well documents \
match search queries. For each query-document pair, carefully analyze the semantic relationship \
between them, then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\
\nRelevance:";

/// A chat template's pair, as sentence-transformers 6's CrossEncoder makes
/// it (`tiny-qwen2-reranker-st6/reference_input_ids.json`, from its
/// `preprocess`): the render tokenized as one text, so a document ending in
/// ")" merges with the "\n" that starts the template's tail; at or over the
/// limit the render is cut and the tail's ids written back over its end.
/// Encoding the tail apart (`suffix_text` None) gives other ids for the
/// uncut pairs among those. The same folder pinned to the text modality is the tokenizer's
/// pair (`longest_first`, no prompt).
#[test]
fn chat_template_pairs_are_sentence_transformers_ids() {
    let folder = "tiny-qwen2-reranker-st6";
    let path = fixture(folder).join("tokenizer.json");
    let tok = Tokenizer::from_file(&path).unwrap();
    let enc = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
    let prefix = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
                  assistant.<|im_end|>\n<|im_start|>";
    let template = "user\nquery: {query}\ndocument: {document}";
    let tail = format!("\n{MXBAI_TASK}<|im_end|>\n<|im_start|>assistant\n");
    // sentence-transformers' tail: the common end of two renders with
    // different texts in both roles.
    let render = |filler: &str| {
        enc(&format!(
            "{prefix}{}{tail}",
            template
                .replace("{query}", filler)
                .replace("{document}", filler)
        ))
    };
    let (a, b) = (render("0"), render("1 2 3 4"));
    let common = a
        .iter()
        .rev()
        .zip(b.iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let whole = PairSpec {
        prefix_ids: enc(prefix),
        suffix_ids: a[a.len() - common..].to_vec(),
        template: Some(template.into()),
        suffix_text: Some(tail.clone()),
        ..PairSpec::default()
    };
    let apart = PairSpec {
        suffix_ids: enc(&tail),
        suffix_text: None,
        ..whole.clone()
    };
    let with = |pair: PairSpec| {
        HfTokenizer::from_spec(TokenizerSpec {
            pair: Some(pair),
            ..HfTokenizer::probe_spec(&path, 320).unwrap()
        })
        .unwrap()
    };
    let (whole, apart) = (with(whole), with(apart));
    let text = std::fs::read_to_string(fixture(folder).join("reference_input_ids.json")).unwrap();
    let refs: std::collections::HashMap<String, Vec<Vec<u32>>> =
        serde_json::from_str(&text).unwrap();
    let mut text_only = segments_spec(folder, 320, (0, 0));
    text_only.pair.as_mut().unwrap().pairs_only = true;
    let plain = HfTokenizer::from_spec(text_only).unwrap();
    // A reranker of pairs: a lone text has no encoding.
    let err = plain
        .encode(
            &EmbedInput::Text("a lone text".into()),
            &EmbedOptions::default(),
        )
        .unwrap_err();
    assert!(err.message.contains("not single texts"), "{}", err.message);
    let right = options(TruncationDirection::Right);
    let (mut differ, mut cut) = (Vec::new(), 0);
    for (i, (query, document)) in pairs(folder).into_iter().enumerate() {
        let input = EmbedInput::Pair { query, document };
        let got = whole.encode(&input, &right).unwrap();
        assert_eq!(got.ids, refs["message"][i], "pair {i}");
        cut += usize::from(got.untruncated_len as usize >= 320);
        if apart.encode(&input, &right).unwrap().ids != got.ids {
            differ.push(i);
        }
        assert_eq!(
            plain.encode(&input, &right).unwrap().ids,
            refs["text"][i],
            "text modality, pair {i}"
        );
    }
    assert_eq!(cut, 10);
    // The two uncut pairs whose document ends in ")" (a cut one loses that
    // end, and the tail is written back whole).
    assert_eq!(differ, [24, 45]);
}
