//! The real embedded Python model through the Rust core: golden parity and
//! 200 concurrent callers. Needs the project's virtualenv (`make test` builds it).

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use mlx_embed_core::{l2_normalize, Batcher, BatcherConfig, EmbedInput, EmbedOptions};
use mlx_embed_python::{PythonEmbedder, PythonModelOptions};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden")
}

/// Reads a little-endian float32 2-D .npy file (version 1 header).
fn read_npy_f32(path: &PathBuf) -> (Vec<f32>, usize, usize) {
    let bytes = std::fs::read(path).expect("read npy");
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(
        header.contains("'<f4'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let shape = &header[header.find("'shape': (").unwrap() + 10..];
    let dims: Vec<usize> = shape[..shape.find(')').unwrap()]
        .split(',')
        .filter_map(|d| d.trim().parse().ok())
        .collect();
    let data = bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (data, dims[0], dims[1])
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb)
}

fn start() -> Batcher {
    let options = PythonModelOptions::default();
    Batcher::start(BatcherConfig::default(), move || {
        PythonEmbedder::load_for_batcher(&options)
    })
    .expect("model loads")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_texts_match_reference_and_concurrent_callers_get_their_own() {
    let batcher = start();
    assert_eq!(batcher.model_info().dim, 384);
    assert_eq!(batcher.model_info().max_input_tokens, 256);

    let texts: Vec<String> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("minilm_texts.json")).unwrap(),
    )
    .unwrap();
    let (reference, rows, dim) = read_npy_f32(&fixtures().join("minilm_mean_normalized.npy"));
    assert_eq!((rows, dim), (texts.len(), 384));

    let out = batcher
        .embed(
            texts.iter().cloned().map(EmbedInput::Text).collect(),
            EmbedOptions::default(),
        )
        .await
        .expect("embed golden");
    let mut worst = 1.0f32;
    for (i, mut vector) in out.vectors.into_iter().enumerate() {
        l2_normalize(&mut vector);
        worst = worst.min(cosine(&vector, &reference[i * dim..(i + 1) * dim]));
    }
    assert!(worst >= 0.99999, "min cosine to golden {worst}");

    // 200 concurrent callers with distinct texts, each compared with its single-call vector.
    let callers: Vec<String> = (0..200)
        .map(|i| format!("caller {i} asks about subject {} in detail", i * 31 % 97))
        .collect();
    let batcher = Arc::new(batcher);
    let handles: Vec<_> = callers
        .iter()
        .cloned()
        .map(|text| {
            let batcher = batcher.clone();
            tokio::spawn(async move {
                batcher
                    .embed(vec![EmbedInput::Text(text)], EmbedOptions::default())
                    .await
            })
        })
        .collect();
    let mut concurrent = Vec::new();
    for handle in handles {
        concurrent.push(
            handle
                .await
                .unwrap()
                .expect("concurrent embed")
                .vectors
                .remove(0),
        );
    }
    for (text, vector) in callers.iter().zip(&concurrent) {
        let single = batcher
            .embed(
                vec![EmbedInput::Text(text.clone())],
                EmbedOptions::default(),
            )
            .await
            .unwrap()
            .vectors
            .remove(0);
        let max_diff = single
            .iter()
            .zip(vector)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            max_diff <= 1e-5,
            "{text}: batched differs from single by {max_diff}"
        );
    }
}

/// The bridge's two-step path on the real engine, forced on the CPU
/// (`pipeline: true`): batch 2 submitted while batch 1 is collected gives
/// exactly what one-shot `embed_batch` gives; a batch the engine refuses
/// fails alone; the live figures read MLX's memory.
#[test]
fn pipelined_submit_and_collect_match_the_one_shot_path() {
    use mlx_embed_core::{Embedder, EmbedderErrorKind, Encoded, Output};
    use mlx_embed_python::EngineOptions;

    let options = PythonModelOptions {
        engine: EngineOptions {
            pipeline: Some(true),
            ..EngineOptions::default()
        },
        ..PythonModelOptions::default()
    };
    let mut model = PythonEmbedder::load(&options).expect("model loads");
    assert!(model.pipelines());
    let first = common::encode(&model, &["a river runs through it", "short"]);
    let second = common::encode(
        &model,
        &[
            "the second batch",
            "has three texts",
            "of varied length here",
        ],
    );
    // The vocabulary is 30522 ids: this one is out of range.
    let bad = vec![Encoded {
        ids: vec![101, 999_999, 102],
        type_ids: None,
        untruncated_len: 3,
        pool_start: 0,
        token_pooling: None,
        adapter: None,
    }];

    let one_shot_first = model.embed_batch(&first, Output::Pooled).unwrap().vectors;
    let one_shot_second = model.embed_batch(&second, Output::Pooled).unwrap().vectors;

    let step = model.submit(&first, Output::Pooled, None);
    assert!(step.running.is_none());
    let step = model.submit(&second, Output::Pooled, Some(step.next.unwrap()));
    assert_eq!(step.running.unwrap().unwrap().vectors, one_shot_first);
    let step = model.submit(&bad, Output::Pooled, Some(step.next.unwrap()));
    assert_eq!(step.running.unwrap().unwrap().vectors, one_shot_second);
    let refused = match step.next {
        Ok(ticket) => model.collect(ticket).unwrap_err(),
        Err(error) => error,
    };
    assert_eq!(refused.kind, EmbedderErrorKind::InvalidInput, "{refused:?}");
    // The model still answers after the refusal.
    let ticket = model.submit(&first, Output::Pooled, None).next.unwrap();
    assert_eq!(model.collect(ticket).unwrap().vectors, one_shot_first);

    let live = model
        .live_stats()
        .expect("the Python model reports live stats");
    let memory = live.memory().unwrap();
    assert!(memory.active_bytes > 1 << 20, "{memory:?}");
    assert!(memory.peak_bytes >= memory.active_bytes, "{memory:?}");
    // The CPU default: MLX's cache off.
    assert_eq!(memory.cache_limit_bytes, Some(0), "{memory:?}");
    let details = live.details().unwrap();
    assert!(
        details["blas_gflops"].parse::<f64>().unwrap() > 0.0,
        "{details:?}"
    );
}

/// A load the caller can fix arrives typed by what to fix (the model, or a
/// load option), with Python's own words; a load that fails otherwise does
/// not. (The engine that cannot be imported: tests/engine_unavailable.rs.)
#[test]
fn a_failed_load_says_whose_fault_it_is() {
    use mlx_embed_core::{CoreError, EmbedderErrorKind};
    use mlx_embed_python::EngineOptions;
    let refusal =
        |options: PythonModelOptions| match Batcher::start(BatcherConfig::default(), move || {
            PythonEmbedder::load_for_batcher(&options)
        }) {
            Err(CoreError::LoadFailed(err)) => (err.kind, err.message),
            other => panic!("expected LoadFailed, got {other:?}"),
        };
    let missing = std::env::temp_dir().join("mlx-embed-no-such-model");
    let (kind, message) = refusal(PythonModelOptions {
        model: Some(missing.display().to_string()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert_eq!(
        message,
        format!("ModelFolderMissing: {} does not exist", missing.display())
    );
    // A folder with no config.json, and one of an architecture the engine
    // does not run, are the model's to fix too.
    let empty = tempfile_dir("mlx-embed-no-config");
    let (kind, message) = refusal(PythonModelOptions {
        model: Some(empty.display().to_string()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert_eq!(
        message,
        format!("ModelFolderMissing: {} has no config.json", empty.display())
    );
    std::fs::write(
        empty.join("config.json"),
        br#"{"model_type": "not-a-model"}"#,
    )
    .unwrap();
    let (kind, message) = refusal(PythonModelOptions {
        model: Some(empty.display().to_string()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert!(
        message.starts_with("InvalidModel: unsupported model_type 'not-a-model'"),
        "{message}"
    );
    std::fs::remove_dir_all(&empty).unwrap();
    // A load option the engine refuses, whether by itself or for this model.
    let (kind, message) = refusal(PythonModelOptions {
        dtype: "float64".into(),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidOption, "{message}");
    assert!(
        message.starts_with("InvalidOption: dtype must be one of"),
        "{message}"
    );
    let (kind, message) = refusal(PythonModelOptions {
        max_length: Some(100_000),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidOption, "{message}");
    assert_eq!(
        message,
        "InvalidOption: max_length 100000 > the 512 positions bert models have"
    );
    let (kind, message) = refusal(PythonModelOptions {
        engine: EngineOptions {
            workers: Some(0),
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidOption, "{message}");
    assert_eq!(message, "InvalidOption: workers must be at least 1, got 0");
    // A free-text setting the engine does not know, checked deep in the
    // engine rather than with the keyword arguments.
    let (kind, message) = refusal(PythonModelOptions {
        engine: EngineOptions {
            fast_ops: Some("fastest".into()),
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidOption, "{message}");
    assert_eq!(
        message,
        "InvalidOption: fast_ops must be 'native', 'mlx' or 'exact', got 'fastest'"
    );
    // The server's bound is the engine's: a library load of 100,000 workers
    // once started as many threads.
    let (kind, message) = refusal(PythonModelOptions {
        engine: EngineOptions {
            workers: Some(100_000),
            ..Default::default()
        },
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidOption, "{message}");
    // In the words of the bound's one owner, as a server's --workers is told.
    let why = mlx_embed_python::interpreter::workers_refusal("workers", 100_000)
        .unwrap()
        .expect("refused");
    assert!(why.contains("256 at most"), "{why}");
    assert_eq!(message, format!("InvalidOption: {why}"));

    // A folder whose weights cannot be read, or do not make the network its
    // config describes, is the model's to fix: never the caller's input.
    let broken = tempfile_dir("mlx-embed-broken-weights");
    let golden = common::fixture("tiny-qwen3");
    for entry in std::fs::read_dir(&golden).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json" || e == "txt") {
            std::fs::copy(&path, broken.join(path.file_name().unwrap())).unwrap();
        }
    }
    let weights = broken.join("model.safetensors");
    std::fs::write(&weights, b"not a safetensors file").unwrap();
    let (kind, message) = refusal(PythonModelOptions {
        model: Some(broken.display().to_string()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert_eq!(
        message,
        format!(
            "InvalidModel: {w} cannot be read as safetensors weights: \
             [load_safetensors] Invalid json header length file {w}",
            w = weights.display()
        )
    );
    // Cut short, as a download that stopped.
    let whole = std::fs::read(PathBuf::from(&golden).join("model.safetensors")).unwrap();
    std::fs::write(&weights, &whole[..whole.len() / 2]).unwrap();
    let (kind, message) = refusal(PythonModelOptions {
        model: Some(broken.display().to_string()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert!(
        message.contains("invalid data offsets")
            && message.contains("exceeding the size of the file"),
        "{message}"
    );
    // Whole, but for one layer more than config.json has: the tensors not
    // in the model are named.
    std::fs::write(&weights, &whole).unwrap();
    let config_path = broken.join("config.json");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let layers: serde_json::Value = serde_json::from_str(&config).unwrap();
    let n = layers["num_hidden_layers"].as_u64().unwrap();
    let mut fewer = layers.clone();
    fewer["num_hidden_layers"] = (n - 1).into();
    std::fs::write(&config_path, fewer.to_string()).unwrap();
    let (kind, message) = refusal(PythonModelOptions {
        model: Some(broken.display().to_string()),
        ..Default::default()
    });
    assert_eq!(kind, EmbedderErrorKind::InvalidModel, "{message}");
    assert!(
        message.starts_with(&format!(
            "InvalidModel: {}: the weights do not fit the qwen3 model config.json describes: \
             Received ",
            broken.display()
        )) && message.contains(&format!("layers.{}.", n - 1)),
        "{message}"
    );
    std::fs::remove_dir_all(&broken).unwrap();
}

/// A fresh, empty folder under the temp dir named for `what` and this process.
fn tempfile_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What the README tells a program that uses pyo3 itself: a wait for
/// `embed` inside `Python::attach` cannot end (the model thread needs the
/// GIL for the batch), one inside `py.detach` answers.
#[test]
fn a_wait_for_embed_holding_the_gil_never_ends_and_one_detached_answers() {
    use pyo3::prelude::*;
    let batcher = start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let text = |t: &str| vec![EmbedInput::Text(t.into())];
    Python::attach(|py| {
        let held = runtime.block_on(async {
            tokio::time::timeout(
                std::time::Duration::from_secs(2),
                batcher.embed(text("waited for under the GIL"), EmbedOptions::default()),
            )
            .await
        });
        assert!(held.is_err(), "answered while the GIL was held: {held:?}");
        let detached = py.detach(|| {
            runtime.block_on(batcher.embed(text("waited for detached"), EmbedOptions::default()))
        });
        assert_eq!(detached.expect("answers").vectors[0].len(), 384);
    });
}
