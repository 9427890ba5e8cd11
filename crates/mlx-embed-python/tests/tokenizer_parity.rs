//! The Rust tokenizer the server uses and the Python engine's own tokenization
//! (what `mlx_embed.load().embed(texts)` runs) give identical ids: on the
//! golden texts, the bad-input edge cases, texts long enough to truncate, and
//! token-id input, for the default model and every model fixture under
//! tests/fixtures (new fixtures are picked up as they appear).

use std::path::{Path, PathBuf};

use mlx_embed_core::{EmbedInput, EmbedOptions, Prompt, Tokenize, TruncationDirection};
use mlx_embed_python::{interpreter::ensure_python, PythonEmbedder, PythonModelOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every fixture folder that holds a loadable model (config + tokenizer).
fn model_fixtures() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .expect("tests/fixtures")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.join("config.json").is_file() && p.join("tokenizer.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// Texts that exercise the tokenizer: the golden set, the edge cases of
/// tests/e2e/test_bad_input.py, and awkward ones of our own.
fn texts() -> Vec<String> {
    let golden: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("golden/minilm_texts.json")).unwrap(),
    )
    .unwrap();
    let edge = [
        "a\u{0}b\u{7}\u{200b}\u{200d}\u{feff}c",
        "zero\u{200b}width\u{2060}joiner",
        "bell\u{7}\u{1b}escape",
        "abc",
        "zerowidthjoiner",
        "ok",
        "hi",
        "hello",
        " ",
        "\n\t \r\n",
        "ok \u{fffd}\u{fffd} bytes",
        "e\u{301}t\u{e9} na\u{ef}ve caf\u{e9} \u{c5}ngstr\u{f6}m",
        "日本語のテキストと漢字",
        "مرحبا بالعالم",
        "emoji 🙂👍🏽 and flags 🇫🇷",
        "[CLS] [SEP] [MASK] [PAD] [UNK] <|endoftext|> <|im_start|>",
        "https://example.com/path?q=1&r=2#frag user@example.com",
        "   leading and trailing spaces   ",
        "UPPER lower MiXeD 12345 3.14159 -42",
        // Lower-casing where Unicode's mapping is not one letter for one:
        // final sigma, dotted capital I, the titlecase digraph, sharp s.
        "ΟΔΟΣ ΣΟΦΟΣ İstanbul ǅungla STRASSE Maß",
        // Texts that begin with a model's prompt keep no default prompt
        // (nomic's `search_query: `, e5's `query: `).
        "search_query: where do rivers flow",
        "search_document: rivers flow into the sea",
        "query: rivers",
    ];
    let long_words = "word ".repeat(600);
    let long_mixed = (0..400)
        .map(|i| format!("token{i} ünïcödé {}", i * 7))
        .collect::<Vec<_>>()
        .join(" ");
    golden
        .into_iter()
        .chain(edge.iter().map(|s| s.to_string()))
        .chain([long_words, long_mixed])
        .collect()
}

/// The option sets both sides are compared under, as Rust options and as
/// the Python engine's `encode` keyword arguments.
/// Both sides named, as most checks compare them.
const BOTH_SIDES: [Option<TruncationDirection>; 2] = [
    Some(TruncationDirection::Right),
    Some(TruncationDirection::Left),
];

/// A request's truncation side as the Python keyword's value (`None`: the
/// model's own).
fn py_direction(direction: Option<TruncationDirection>) -> &'static str {
    match direction {
        Some(TruncationDirection::Right) => "'right'",
        Some(TruncationDirection::Left) => "'left'",
        None => "None",
    }
}

fn cases(
    named_prompt: Option<&str>,
    directions: &[Option<TruncationDirection>],
) -> Vec<(EmbedOptions, String)> {
    let mut out: Vec<(EmbedOptions, String)> = Vec::new();
    for &direction in directions {
        let py_direction = py_direction(direction);
        let base = EmbedOptions {
            truncation_direction: direction,
            ..EmbedOptions::default()
        };
        out.push((
            base.clone(),
            format!("dict(truncation_direction={py_direction})"),
        ));
        out.push((
            EmbedOptions {
                prompt: Prompt::Raw("topic: rivers. ".into()),
                ..base.clone()
            },
            format!("dict(truncation_direction={py_direction}, prompt='topic: rivers. ')"),
        ));
        if let Some(name) = named_prompt {
            out.push((
                EmbedOptions {
                    prompt: Prompt::Named(name.into()),
                    ..base.clone()
                },
                format!("dict(truncation_direction={py_direction}, prompt_name={name:?})"),
            ));
        }
    }
    out
}

/// What the Python engine makes of `texts` and `token_inputs`.
struct PythonIds {
    ids: Vec<Vec<u32>>,
    before: Vec<usize>,
    /// Each text's leading positions left out of the pool (all 0 for a
    /// model that pools its prompt).
    pool_starts: Vec<u32>,
    token_ids: Vec<Vec<u32>>,
}

/// The Python engine's ids, pre-truncation lengths and pool starts for
/// `texts` under `kwargs` (a Python dict expression), and `token_inputs` as
/// the model runs them as given: cut to its maximum, its dropped ids left out.
fn python_ids(
    folder: Option<&Path>,
    kwargs: &str,
    texts: &[String],
    token_inputs: &[Vec<u32>],
) -> PythonIds {
    Python::attach(|py| {
        let locals = PyDict::new(py);
        locals
            .set_item("folder", folder.map(|f| f.to_string_lossy().into_owned()))
            .unwrap();
        locals.set_item("texts", texts.to_vec()).unwrap();
        locals
            .set_item("token_inputs", token_inputs.to_vec())
            .unwrap();
        let code = format!(
            "import mlx_embed
model = MODELS.get(folder) or MODELS.setdefault(folder, mlx_embed.load(folder))
kwargs = {kwargs}
every = dict(truncate=True, prompt_name=None, prompt=None, instruction=None, truncate_to=None)
ids, before, starts = model._encode(texts, **{{**every, **kwargs}})
starts = starts or [0] * len(ids)
tok, n, side = model.tokenizer, model.max_length, kwargs['truncation_direction'] or model.truncation_side
p, s = len(tok.prefix), len(tok.suffix)
def as_given(t):
    if len(t) > n and len(t) >= p + s and t[:p] == tok.prefix and t[len(t) - s:] == tok.suffix:
        return tok.finish(t[p:len(t) - s], side)[0]
    t = t[len(t) - n:] if side == 'left' and len(t) > n else t[:n]
    return [x for x in t if x not in tok.drop_ids]
token_ids = [as_given(list(t)) for t in token_inputs]
"
        );
        let globals = py.import("__main__").unwrap().dict();
        if globals.get_item("MODELS").unwrap().is_none() {
            globals.set_item("MODELS", PyDict::new(py)).unwrap();
        }
        locals
            .set_item("MODELS", globals.get_item("MODELS").unwrap().unwrap())
            .unwrap();
        let code = std::ffi::CString::new(code).unwrap();
        py.run(&code, Some(&locals), None).unwrap();
        let get = |name: &str| locals.get_item(name).unwrap().unwrap();
        PythonIds {
            ids: get("ids").extract().unwrap(),
            before: get("before").extract().unwrap(),
            pool_starts: get("starts").extract().unwrap(),
            token_ids: get("token_ids").extract().unwrap(),
        }
    })
}

fn check(folder: Option<&Path>) -> usize {
    check_counting(folder).0
}

/// `check`'s count of inputs compared, and of texts with positions left
/// out of the pool.
fn check_counting(folder: Option<&Path>) -> (usize, usize) {
    check_counting_with(folder, &BOTH_SIDES)
}

/// `check_counting` with requests that name these sides.
fn check_counting_with(
    folder: Option<&Path>,
    directions: &[Option<TruncationDirection>],
) -> (usize, usize) {
    let name = folder.map_or("all-MiniLM-L6-v2".to_string(), |f| f.display().to_string());
    let embedder = PythonEmbedder::load(&PythonModelOptions {
        model: folder.map(|f| f.to_string_lossy().into_owned()),
        ..PythonModelOptions::default()
    })
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let tokenizer = embedder.hf_tokenizer().clone();
    let named = tokenizer.spec().prompts.keys().next().cloned();
    let texts = texts();
    let (mut compared, mut left_out) = (0, 0);
    if let Some(pair) = &tokenizer.spec().pair {
        compared += check_pairs(folder, &name, &tokenizer, &texts, directions);
        if pair.pairs_only() {
            // A decoder reranker scores pairs only: a lone text has no encoding.
            return (compared, left_out);
        }
    }
    // Over the maximum, ids wrapped in the model's own specials keep them.
    let spec = tokenizer.spec();
    let long_wrapped: Vec<u32> = spec
        .prefix_ids
        .iter()
        .copied()
        .chain((0..2000).map(|i| i % 97))
        .chain(spec.suffix_ids.iter().copied())
        .collect();
    let token_inputs = vec![
        vec![5u32],
        vec![1, 2, 3, 4, 5, 6, 7],
        (0..2000).map(|i| i % 97).collect(),
        long_wrapped,
    ];
    for (options, kwargs) in cases(named.as_deref(), directions) {
        let py = python_ids(folder, &kwargs, &texts, &token_inputs);
        let mut truncated = 0;
        for (i, text) in texts.iter().enumerate() {
            let got = tokenizer
                .encode(&EmbedInput::Text(text.clone()), &options)
                .unwrap_or_else(|e| panic!("{name} {kwargs}: text {i}: {e}"));
            assert_eq!(
                got.ids, py.ids[i],
                "{name} {kwargs}: ids of text {i} {text:?}"
            );
            assert_eq!(
                got.untruncated_len as usize, py.before[i],
                "{name} {kwargs}: length of text {i} {text:?}"
            );
            assert_eq!(
                got.pool_start, py.pool_starts[i],
                "{name} {kwargs}: pool start of text {i} {text:?}"
            );
            left_out += usize::from(got.pool_start > 0);
            truncated += usize::from(got.untruncated_len as usize > got.ids.len());
            compared += 1;
        }
        assert!(
            truncated >= 2,
            "{name} {kwargs}: the long texts must truncate ({truncated} did)"
        );
        for (i, ids) in token_inputs.iter().enumerate() {
            let got = tokenizer
                .encode(&EmbedInput::Tokens(ids.clone()), &options)
                .unwrap();
            assert_eq!(got.ids, py.token_ids[i], "{name} {kwargs}: token input {i}");
            assert_eq!(got.pool_start, 0, "{name} {kwargs}: token input {i}");
            compared += 1;
        }
    }
    (compared, left_out)
}

/// Query/document pairs of a cross-encoder: Rust's `EmbedInput::Pair` against
/// Python's `encode_pairs`, ids and segment ids, both truncation sides.
fn check_pairs(
    folder: Option<&Path>,
    name: &str,
    tokenizer: &mlx_embed_tokenizer::HfTokenizer,
    texts: &[String],
    directions: &[Option<TruncationDirection>],
) -> usize {
    let pairs: Vec<(String, String)> = texts
        .iter()
        .zip(texts.iter().rev())
        .map(|(q, d)| (q.clone(), d.clone()))
        .collect();
    let mut compared = 0;
    for &direction in directions {
        let py_direction = py_direction(direction);
        let (py_ids, py_types, py_before) = Python::attach(|py| {
            let locals = PyDict::new(py);
            locals
                .set_item("folder", folder.map(|f| f.to_string_lossy().into_owned()))
                .unwrap();
            locals.set_item("pairs", pairs.clone()).unwrap();
            locals
                .set_item(
                    "direction",
                    direction.map(|_| py_direction.trim_matches('\'')),
                )
                .unwrap();
            let globals = py.import("__main__").unwrap().dict();
            if globals.get_item("MODELS").unwrap().is_none() {
                globals.set_item("MODELS", PyDict::new(py)).unwrap();
            }
            locals
                .set_item("MODELS", globals.get_item("MODELS").unwrap().unwrap())
                .unwrap();
            py.run(
                c"import mlx_embed
model = MODELS.get(folder) or MODELS.setdefault(folder, mlx_embed.load(folder))
ids, types, before = model.encode_pairs(pairs, truncation_direction=direction)
",
                Some(&locals),
                None,
            )
            .unwrap();
            let get = |key: &str| locals.get_item(key).unwrap().unwrap();
            let ids: Vec<Vec<u32>> = get("ids").extract().unwrap();
            let types: Option<Vec<Vec<u32>>> = get("types").extract().unwrap();
            let before: Vec<usize> = get("before").extract().unwrap();
            (ids, types, before)
        });
        let options = EmbedOptions {
            truncation_direction: direction,
            ..EmbedOptions::default()
        };
        let mut truncated = 0;
        for (i, (query, document)) in pairs.iter().enumerate() {
            let got = tokenizer
                .encode(
                    &EmbedInput::Pair {
                        query: query.clone(),
                        document: document.clone(),
                    },
                    &options,
                )
                .unwrap_or_else(|e| panic!("{name} {py_direction}: pair {i}: {e}"));
            assert_eq!(got.ids, py_ids[i], "{name} {py_direction}: ids of pair {i}");
            assert_eq!(
                got.type_ids,
                py_types.as_ref().map(|t| t[i].clone()),
                "{name} {py_direction}: segment ids of pair {i}"
            );
            assert_eq!(
                got.untruncated_len as usize, py_before[i],
                "{name} {py_direction}: length of pair {i}"
            );
            truncated += usize::from(got.untruncated_len as usize > got.ids.len());
            compared += 1;
        }
        assert!(
            truncated >= 2,
            "{name} {py_direction}: the long pairs must truncate ({truncated} did)"
        );
    }
    compared
}

#[test]
fn rust_and_python_tokenize_identically_for_every_model() {
    ensure_python().expect("python");
    let folders = model_fixtures();
    assert!(
        !folders.is_empty(),
        "no model fixtures found under tests/fixtures"
    );
    let mut compared = check(None);
    for folder in &folders {
        compared += check(Some(folder));
    }
    eprintln!(
        "{compared} inputs tokenized identically over {} models",
        folders.len() + 1
    );
}

/// A copy of the fixture `name` in a fresh temporary folder.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mlx-embed-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let source = fixtures().join(name);
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        } else {
            let sub = dir.join(path.file_name().unwrap());
            std::fs::create_dir_all(&sub).unwrap();
            for file in std::fs::read_dir(&path).unwrap() {
                let file = file.unwrap().path();
                std::fs::copy(&file, sub.join(file.file_name().unwrap())).unwrap();
            }
        }
    }
    dir
}

/// Models that pool without their prompt (Pooling `include_prompt: false`,
/// with a default prompt, so texts that carry one of the prompts are in the
/// mix; INSTRUCTOR's T5): both sides mark the same positions, both
/// truncation sides, named and raw prompts.
#[test]
fn a_model_that_pools_without_its_prompt_marks_the_same_positions() {
    ensure_python().expect("python");
    let xlmr = copy_fixture("tiny-xlm-roberta", "prompt-out");
    let pooling = xlmr.join("1_Pooling/config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&pooling).unwrap()).unwrap();
    cfg["include_prompt"] = false.into();
    std::fs::write(&pooling, cfg.to_string()).unwrap();
    let st = xlmr.join("config_sentence_transformers.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&st).unwrap()).unwrap();
    cfg["default_prompt_name"] = "query".into();
    std::fs::write(&st, cfg.to_string()).unwrap();
    let instructor = copy_fixture("tiny-t5", "instructor");
    let modules = instructor.join("modules.json");
    let text = std::fs::read_to_string(&modules).unwrap();
    std::fs::write(
        &modules,
        text.replacen(
            "sentence_transformers.models.Transformer",
            "InstructorEmbedding.INSTRUCTOR_Transformer",
            1,
        ),
    )
    .unwrap();
    for dir in [&xlmr, &instructor] {
        let (compared, left_out) = check_counting(Some(dir));
        assert!(
            compared > 100 && left_out > 50,
            "{dir:?}: {compared} {left_out}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A model whose `sentence_bert_config.json` says `do_lower_case`: both
/// sides lower-case alike (prompt included), where Unicode's lower-casing is
/// context-dependent too, and the flag changes the ids (the XLM-R fixture's
/// tokenizer is cased).
#[test]
fn a_lowercasing_model_tokenizes_identically_and_lowercased() {
    ensure_python().expect("python");
    let dir = copy_fixture("tiny-xlm-roberta", "lowercase");
    let source = fixtures().join("tiny-xlm-roberta");
    std::fs::write(
        dir.join("sentence_bert_config.json"),
        r#"{"max_seq_length": 128, "do_lower_case": true}"#,
    )
    .unwrap();
    let compared = check(Some(&dir));
    assert!(compared > 100, "{compared}");
    let load = |folder: &Path| {
        PythonEmbedder::load(&PythonModelOptions {
            model: Some(folder.to_string_lossy().into_owned()),
            ..PythonModelOptions::default()
        })
        .unwrap()
        .hf_tokenizer()
        .clone()
    };
    let (lower, cased) = (load(&dir), load(&source));
    assert!(lower.spec().lowercase && !cased.spec().lowercase);
    let ids = |tokenizer: &mlx_embed_tokenizer::HfTokenizer, text: &str| {
        tokenizer
            .encode(&EmbedInput::Text(text.into()), &EmbedOptions::default())
            .unwrap()
            .ids
    };
    let text = "UPPER Case MiXeD";
    assert_eq!(ids(&lower, text), ids(&cased, &text.to_lowercase()));
    assert_ne!(ids(&lower, text), ids(&cased, text));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// bge-reranker-v2-gemma's pairs as the server tokenizes them: the Rust
/// tokenizer builds FlagEmbedding's own ids (the fixture's references, made
/// by its `FlagLLMReranker`) for every pair, at its max_length 128 (the
/// fixture's default) and 512 (the library's default; here max_length counts
/// every token, so 512 + twice the separator and prompt).
#[test]
fn the_bge_gemma_reranker_pairs_are_flagembeddings_ids() {
    ensure_python().expect("python");
    let folder = fixtures().join("tiny-bge-reranker-v2-gemma");
    let pairs: Vec<(String, String)> =
        serde_json::from_str(&std::fs::read_to_string(folder.join("pairs.json")).unwrap()).unwrap();
    let refs: std::collections::HashMap<String, Vec<Vec<u32>>> = serde_json::from_str(
        &std::fs::read_to_string(folder.join("reference_input_ids.json")).unwrap(),
    )
    .unwrap();
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(folder.join(name)).unwrap()).unwrap()
    };
    let (prompts, prompt_refs) = (
        read("prompts.json"),
        read("reference_prompt_input_ids.json"),
    );
    for (library_max_length, max_length) in [(128, None), (512, Some(512 + 2 * 54))] {
        let embedder = PythonEmbedder::load(&PythonModelOptions {
            model: Some(folder.to_string_lossy().into_owned()),
            max_length,
            ..PythonModelOptions::default()
        })
        .unwrap();
        let tokenizer = embedder.hf_tokenizer();
        let want = &refs[&library_max_length.to_string()];
        assert_eq!(want.len(), pairs.len());
        let mut cut = 0;
        for (i, (query, document)) in pairs.iter().enumerate() {
            let got = tokenizer
                .encode(
                    &EmbedInput::Pair {
                        query: query.clone(),
                        document: document.clone(),
                    },
                    &EmbedOptions::default(),
                )
                .unwrap();
            assert_eq!(
                got.ids, want[i],
                "max_length {library_max_length}: pair {i}"
            );
            cut += usize::from(got.untruncated_len as usize > got.ids.len());
        }
        assert_eq!(
            cut, 8,
            "max_length {library_max_length}: the fixture's cut pairs"
        );
        // A request's instruction is FlagEmbedding's prompt=: its ids for
        // each of the fixture's prompts (short, long, empty), at the engine's
        // same max_length.
        let engine_max = tokenizer.spec().max_length;
        for (name, prompt) in prompts["prompts"].as_object().unwrap() {
            let want: Vec<Vec<u32>> =
                serde_json::from_value(prompt_refs[name][engine_max.to_string()].clone()).unwrap();
            let options = EmbedOptions {
                prompt: Prompt::Raw(prompt.as_str().unwrap().to_owned()),
                ..EmbedOptions::default()
            };
            let mut cut = Vec::new();
            for (i, (query, document)) in pairs.iter().enumerate() {
                let got = tokenizer
                    .encode(
                        &EmbedInput::Pair {
                            query: query.clone(),
                            document: document.clone(),
                        },
                        &options,
                    )
                    .unwrap();
                assert_eq!(got.ids, want[i], "{name} at {engine_max}: pair {i}");
                if got.untruncated_len as usize > got.ids.len() {
                    cut.push(i);
                }
            }
            let want_cut: Vec<usize> =
                serde_json::from_value(prompts["truncated"][name][engine_max.to_string()].clone())
                    .unwrap();
            assert_eq!(cut, want_cut, "{name} at {engine_max}: the cut pairs");
        }
        // One that leaves the pair nothing is refused, as in Python.
        let err = tokenizer
            .encode(
                &EmbedInput::Pair {
                    query: "q".into(),
                    document: "d".into(),
                },
                &EmbedOptions {
                    prompt: Prompt::Raw(vec!["Yes"; 400].join(" ")),
                    ..EmbedOptions::default()
                },
            )
            .unwrap_err();
        assert!(
            err.message.contains("instruction leaves the pair no room"),
            "{err:?}"
        );
    }
}

/// Rewrites the JSON file at `path` with `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// Folders that cut on the left (tokenizer_config.json's `truncation_side`;
/// the direction of the truncation baked into tokenizer.json, which
/// transformers takes when the config says none; a cross-encoder's pairs):
/// a request that names no side is cut on the left by both, texts, token
/// ids and pairs alike, and the model's facts say so; `load(truncation_side=)`
/// is over the folder.
#[test]
fn a_left_folder_is_cut_on_the_left_by_both_when_a_request_names_no_side() {
    use mlx_embed_core::Embedder;
    use TruncationDirection::{Left, Right};

    ensure_python().expect("python");
    let stated = copy_fixture("tiny-mpnet", "left-stated");
    edit_json(&stated.join("tokenizer_config.json"), |c| {
        c["truncation_side"] = "left".into();
    });
    let baked = copy_fixture("tiny-xlm-roberta", "left-baked");
    edit_json(&baked.join("tokenizer.json"), |t| {
        t["truncation"] = serde_json::json!(
            {"direction": "Left", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
        );
    });
    let pairs = copy_fixture("tiny-bert-reranker", "left-pairs");
    edit_json(&pairs.join("tokenizer_config.json"), |c| {
        c["truncation_side"] = "left".into();
    });
    let load = |folder: &Path, side: Option<TruncationDirection>| {
        PythonEmbedder::load(&PythonModelOptions {
            model: Some(folder.to_string_lossy().into_owned()),
            truncation_side: side,
            ..PythonModelOptions::default()
        })
        .unwrap()
    };
    let long = EmbedInput::Text("the start ".repeat(300) + "and the end");
    let side = |direction| EmbedOptions {
        truncation_direction: direction,
        ..EmbedOptions::default()
    };
    for dir in [&stated, &baked, &pairs] {
        let (compared, _) = check_counting_with(Some(dir), &[None]);
        assert!(compared > 50, "{dir:?}: {compared}");
        let embedder = load(dir, None);
        let tokenizer = embedder.hf_tokenizer();
        assert_eq!(embedder.info().truncation_side, Left, "{dir:?}");
        assert_eq!(tokenizer.spec().truncation_side, Left, "{dir:?}");
        let ids = |direction| tokenizer.encode(&long, &side(direction)).unwrap().ids;
        assert_eq!(ids(None), ids(Some(Left)), "{dir:?}");
        assert_ne!(ids(None), ids(Some(Right)), "{dir:?}");

        let over = load(dir, Some(Right));
        assert_eq!(over.info().truncation_side, Right, "{dir:?}");
        let ids = |direction| {
            over.hf_tokenizer()
                .encode(&long, &side(direction))
                .unwrap()
                .ids
        };
        assert_eq!(ids(None), ids(Some(Right)), "{dir:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
