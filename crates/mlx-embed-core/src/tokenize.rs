//! Step 1 of every request: its inputs as exact token ids, before it is
//! admitted or queued, so every budget after this counts real tokens and an
//! over-long input with `truncate: false` is refused before any compute.

use std::sync::Arc;

use crate::{
    CoreError, EmbedInput, EmbedOptions, EmbedderErrorKind, Encoded, InputLimit, ModelInfo, Output,
    Prompt, Tokenize, TruncationDirection,
};

/// Requests with at most this many bytes of text are tokenized on the
/// calling task. Encoding that little takes a few microseconds, less than the
/// hop to the blocking pool and back (measured with the batcher bench: 64
/// callers of one short text each went from 185k to 51k requests/s with every
/// request sent through `spawn_blocking`); anything longer could stall an
/// async worker, so it goes to the pool.
const INLINE_TEXT_BYTES: usize = 256;

/// Encodes `inputs` with the model's tokenizer (or as bare token ids when it
/// has none), checking the options and every input's length.
///
/// Runs the tokenizer on tokio's blocking pool unless the request is tiny
/// (see [`INLINE_TEXT_BYTES`]): tokenizing a long text takes long enough to
/// stall the async workers, and there it overlaps the model running other
/// requests' batches.
pub(crate) async fn encode_all(
    tokenizer: Option<Arc<dyn Tokenize>>,
    info: &ModelInfo,
    inputs: Vec<EmbedInput>,
    options: &EmbedOptions,
) -> Result<Vec<Encoded>, CoreError> {
    let (adapter, tasked) = task_adapter(info, options)?;
    // The request's own prompt: a task's is the texts' (token ids beside
    // them run as given), not one asked for with the ids.
    check_prompt(info, &options.prompt, &inputs)?;
    let options = tasked.as_ref().unwrap_or(options);
    if options.truncate_to == Some(0) {
        return Err(CoreError::InvalidInput(
            "truncate_to must be at least 1 token".into(),
        ));
    }
    let model_max = info.input_max(options.output);
    let max = options.input_limit(model_max);
    let mut encoded = match tokenizer {
        Some(tokenizer) if text_bytes(&inputs) <= INLINE_TEXT_BYTES => {
            encode_with(&*tokenizer, &inputs, options)?
        }
        Some(tokenizer) => {
            let reading = reading_room(text_bytes(&inputs)).await;
            let options = options.clone();
            tokio::task::spawn_blocking(move || {
                // Held until the tokenizer is done, even when the caller
                // has left: the memory is in use until then.
                let _reading = reading;
                encode_with(&*tokenizer, &inputs, &options)
            })
            .await
            .map_err(|e| CoreError::Model(format!("tokenizer panicked: {e}")))??
        }
        None => inputs
            .iter()
            .enumerate()
            .map(|(i, input)| {
                ids_only(
                    i,
                    input,
                    max,
                    options.truncation_direction.unwrap_or(info.truncation_side),
                )
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    for e in encoded.iter_mut() {
        e.adapter = adapter;
    }
    for (index, e) in encoded.iter().enumerate() {
        if e.is_empty() && !info.empty_inputs {
            return Err(CoreError::InvalidInput(format!(
                "input {index} has no tokens"
            )));
        }
        if !options.truncate && e.untruncated_len as usize > max {
            return Err(CoreError::InputTooLong {
                index,
                tokens: e.untruncated_len as usize,
                max,
                limit: match options.output {
                    _ if max != model_max => InputLimit::Request,
                    Output::MultiVector(side) if info.multi_vector.is_some() => {
                        InputLimit::Mode(side)
                    }
                    _ => InputLimit::Model,
                },
            });
        }
        debug_assert!(
            max == 0 || e.len() <= max,
            "the tokenizer returned {} tokens, over the model's {max}",
            e.len()
        );
    }
    Ok(encoded)
}

/// Text being tokenized at once, in the whole process, in KiB. A tokenizer
/// holds a few hundred bytes per token until it is done (a text is read
/// whole before the model's cut): one 2 MB text of punctuation took 1.1 GB,
/// and requests are tokenized before admission, so four at once took 2.4 GB
/// even with this room at 4 MiB. At 2 MiB, the largest body the server
/// takes by default tokenizes alone (about a second), and texts of
/// ordinary requests side by side; more wait their turn (still cancellable).
const TOKENIZING_KIB: u32 = 2 << 10;

/// Requests of at most this much text are tokenized in a room of their own
/// ([`small_room_kib`]). One room, first come first served, kept a 10 KB
/// request waiting behind every queued 2 MB text (a median of 1.23 s with
/// four clients sending them, against 0.024 s idle); in their own room they
/// wait only for each other, and a large text cannot starve either.
const SMALL_REQUEST_BYTES: usize = 64 << 10;

/// The small requests' room, in KiB: the largest of them one per core (at
/// least two, at most sixteen), as many as the cores tokenize side by side.
/// It adds at most that much text to what the large room bounds: with room
/// for eight, eleven clients sending 60 KB texts beside four sending 2 MB
/// ones took the peak from 1.9 to 3.3 GB on two cores.
fn small_room_kib() -> u32 {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cores.clamp(2, 16) * (SMALL_REQUEST_BYTES >> 10)) as u32
}

static TOKENIZING: tokio::sync::Semaphore =
    tokio::sync::Semaphore::const_new(TOKENIZING_KIB as usize);

static TOKENIZING_SMALL: std::sync::LazyLock<(tokio::sync::Semaphore, u32)> =
    std::sync::LazyLock::new(|| {
        let kib = small_room_kib();
        (tokio::sync::Semaphore::new(kib as usize), kib)
    });

/// Waits for room to tokenize `bytes` of text (a text larger than the whole
/// room waits for all of it); the room is given back when the permit is
/// dropped. The batcher takes it for every request it tokenizes; a caller
/// that tokenizes beside it (a server's `/tokenize`) takes it too. Requests
/// of at most 64 KiB have a room of their own, so they never queue behind
/// large texts.
pub async fn reading_room(bytes: usize) -> tokio::sync::SemaphorePermit<'static> {
    let (room, room_kib) = if bytes <= SMALL_REQUEST_BYTES {
        let (room, kib) = &*TOKENIZING_SMALL;
        (room, *kib)
    } else {
        (&TOKENIZING, TOKENIZING_KIB)
    };
    let kib = u32::try_from(bytes.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .clamp(1, room_kib);
    room.acquire_many(kib)
        .await
        .expect("the tokenizing rooms are never closed")
}

/// Bytes of text the tokenizer will have to read (token ids cost nothing).
fn text_bytes(inputs: &[EmbedInput]) -> usize {
    inputs
        .iter()
        .map(|input| match input {
            EmbedInput::Text(t) => t.len(),
            EmbedInput::Tokens(_) => 0,
            EmbedInput::Pair { query, document } => query.len() + document.len(),
        })
        .sum()
}

/// The adapter index a request runs with, and the options with the task's
/// prompt put in where it selects one: `task` (which must be one of the
/// model's), or a named prompt that is a task's name (a folder names its
/// prompts after its tasks, as jina-embeddings-v3's does: the prompt alone,
/// without its adapter, is never what the model's library runs).
/// Pooled and per-token output run the adapter (it changes the hidden
/// states both are read from; late chunking's chunk means too).
pub fn task_adapter(
    info: &ModelInfo,
    options: &EmbedOptions,
) -> Result<(Option<u32>, Option<EmbedOptions>), CoreError> {
    let index = |name: &str| info.tasks.iter().position(|t| t == name).map(|i| i as u32);
    let Some(task) = &options.task else {
        return Ok(match &options.prompt {
            Prompt::Named(name) if runs_adapter(options.output) => (index(name), None),
            _ => (None, None),
        });
    };
    if info.tasks.is_empty() {
        return Err(CoreError::InvalidInput(format!(
            "task {task:?}: {} has no task adapters (task selects a LoRA adapter of a \
             model that has them, such as jina-embeddings-v3)",
            info.name
        )));
    }
    if !runs_adapter(options.output) {
        return Err(CoreError::InvalidInput(format!(
            "task {task:?} applies to pooled or per-token embeddings only (a task adapter is \
             not run for sparse or multi-vector output)"
        )));
    }
    let Some(i) = index(task) else {
        return Err(CoreError::InvalidInput(format!(
            "unknown task {task:?}: valid tasks are {}",
            info.tasks.join(", ")
        )));
    };
    // Token ids run as given: the adapter applies, no prompt is added (the
    // tokenizer adds none to them); texts beside them still take the task's.
    let tasked =
        (options.prompt == Prompt::Default && info.prompts.contains_key(task)).then(|| {
            EmbedOptions {
                prompt: Prompt::Named(task.clone()),
                ..options.clone()
            }
        });
    Ok((Some(i), tasked))
}

fn runs_adapter(output: Output) -> bool {
    matches!(output, Output::Pooled | Output::Tokens)
}

fn encode_with(
    tokenizer: &dyn Tokenize,
    inputs: &[EmbedInput],
    options: &EmbedOptions,
) -> Result<Vec<Encoded>, CoreError> {
    tokenizer
        .encode_request(inputs, options)
        .map_err(|(i, e)| match e.kind {
            EmbedderErrorKind::InvalidInput => {
                CoreError::InvalidInput(format!("input {i}: {}", e.message))
            }
            EmbedderErrorKind::CutTooShort => CoreError::CutTooShort(e.message),
            // A load's kinds, from a tokenizer at work, are its failure.
            EmbedderErrorKind::ModelFailure
            | EmbedderErrorKind::ModelGone
            | EmbedderErrorKind::EngineUnavailable
            | EmbedderErrorKind::InvalidModel
            | EmbedderErrorKind::InvalidOption => {
                CoreError::Model(format!("tokenizer failed on input {i}: {}", e.message))
            }
        })
}

/// A named prompt must be one the model has; checked once per request rather
/// than reported against its first input. An asked-for prompt cannot go with
/// token ids, which run as given: ignoring it would answer the unprompted
/// vector to a caller who has every reason to think the prompt was applied.
fn check_prompt(info: &ModelInfo, prompt: &Prompt, inputs: &[EmbedInput]) -> Result<(), CoreError> {
    let asked = match prompt {
        Prompt::Default => return Ok(()),
        Prompt::Raw(text) => !text.is_empty(),
        Prompt::Named(_) => true,
    };
    if asked {
        if let Some(index) = inputs
            .iter()
            .position(|input| matches!(input, EmbedInput::Tokens(_)))
        {
            return Err(CoreError::InvalidInput(format!(
                "input {index}: token ids run as given, so a prompt cannot be added to them; \
                 send text, or put the prompt's tokens in the ids (/tokenize shows them)"
            )));
        }
    }
    let Prompt::Named(name) = prompt else {
        return Ok(());
    };
    if info.prompts.contains_key(name) {
        return Ok(());
    }
    let known: Vec<&str> = info.prompts.keys().map(String::as_str).collect();
    Err(CoreError::InvalidInput(if known.is_empty() {
        format!("unknown prompt name {name:?}: this model has no named prompts")
    } else {
        format!(
            "unknown prompt name {name:?}: this model has {}",
            known.join(", ")
        )
    }))
}

/// A model without a tokenizer runs token ids as given, cut to its maximum.
fn ids_only(
    index: usize,
    input: &EmbedInput,
    max: usize,
    direction: TruncationDirection,
) -> Result<Encoded, CoreError> {
    let EmbedInput::Tokens(ids) = input else {
        return Err(CoreError::InvalidInput(format!(
            "input {index}: this model takes token ids only"
        )));
    };
    let untruncated_len = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    let keep = if max == 0 {
        ids.len()
    } else {
        ids.len().min(max)
    };
    let ids = match direction {
        TruncationDirection::Right => ids[..keep].to_vec(),
        TruncationDirection::Left => ids[ids.len() - keep..].to_vec(),
    };
    Ok(Encoded {
        ids,
        type_ids: None,
        untruncated_len,
        pool_start: 0,
        token_pooling: None,
        adapter: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EmbedderError, MultiVectorLengths, Side};

    /// One id per byte between two specials, cut to the model's maximum or
    /// a multi-vector mode's length (16 for a query, 24 for a document).
    struct ByteTokens;

    impl Tokenize for ByteTokens {
        fn encode(
            &self,
            input: &EmbedInput,
            options: &EmbedOptions,
        ) -> Result<Encoded, EmbedderError> {
            let EmbedInput::Text(text) = input else {
                unreachable!("texts only")
            };
            let max = options.input_limit(match options.output {
                Output::MultiVector(Side::Query) => 16,
                Output::MultiVector(Side::Document) => 24,
                _ => 40,
            });
            let ids: Vec<u32> = std::iter::once(1)
                .chain(text.bytes().map(u32::from).take(max - 2))
                .chain(std::iter::once(2))
                .collect();
            Ok(Encoded {
                ids,
                untruncated_len: text.len() as u32 + 2,
                ..Encoded::default()
            })
        }
    }

    /// The prompt the options ask for, as one marker id before the text's
    /// one id: 100 + the named prompt's length, 99 for a raw one, none for
    /// the default.
    struct PromptMarker;

    impl Tokenize for PromptMarker {
        fn encode(
            &self,
            input: &EmbedInput,
            options: &EmbedOptions,
        ) -> Result<Encoded, EmbedderError> {
            if let EmbedInput::Tokens(ids) = input {
                // As the real tokenizer: token ids run as given.
                return Ok(Encoded {
                    untruncated_len: ids.len() as u32,
                    ids: ids.clone(),
                    ..Encoded::default()
                });
            }
            let mut ids = match &options.prompt {
                Prompt::Named(name) => vec![100 + name.len() as u32],
                Prompt::Raw(_) => vec![99],
                Prompt::Default => vec![],
            };
            ids.push(7);
            Ok(Encoded {
                untruncated_len: ids.len() as u32,
                ids,
                ..Encoded::default()
            })
        }
    }

    fn jina_info() -> ModelInfo {
        let tasks = ["retrieval.query", "retrieval.passage", "separation"];
        ModelInfo {
            name: "jina".into(),
            max_input_tokens: 40,
            tasks: tasks.iter().map(|t| t.to_string()).collect(),
            prompts: [
                ("retrieval.query", "Q: "),
                ("retrieval.passage", "P: "),
                ("separation", ""),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
            ..ModelInfo::default()
        }
    }

    async fn encode_one(info: &ModelInfo, options: EmbedOptions) -> Result<Encoded, CoreError> {
        let input = vec![EmbedInput::Text("x".into())];
        encode_all(Some(Arc::new(PromptMarker)), info, input, &options)
            .await
            .map(|mut e| e.remove(0))
    }

    #[tokio::test]
    async fn token_ids_of_a_model_without_a_tokenizer_are_cut_on_its_own_side() {
        // ModelInfo::truncation_side is the cut of a request that names none.
        let info = |side| ModelInfo {
            max_input_tokens: 4,
            truncation_side: side,
            ..ModelInfo::default()
        };
        let cut = |info: ModelInfo, direction| async move {
            let options = EmbedOptions {
                truncation_direction: direction,
                ..EmbedOptions::default()
            };
            let input = vec![EmbedInput::Tokens((1..=7).collect())];
            encode_all(None, &info, input, &options).await.unwrap()[0]
                .ids
                .clone()
        };
        use TruncationDirection::{Left, Right};
        assert_eq!(cut(info(Left), None).await, [4, 5, 6, 7]);
        assert_eq!(cut(info(Right), None).await, [1, 2, 3, 4]);
        assert_eq!(cut(info(Left), Some(Right)).await, [1, 2, 3, 4]);
        assert_eq!(cut(info(Right), Some(Left)).await, [4, 5, 6, 7]);
    }

    #[tokio::test]
    async fn a_task_selects_its_adapter_and_its_prompt() {
        let info = jina_info();
        let task = |t: &str| EmbedOptions {
            task: Some(t.into()),
            ..EmbedOptions::default()
        };
        let query = encode_one(&info, task("retrieval.query")).await.unwrap();
        assert_eq!((query.adapter, query.ids), (Some(0), vec![115, 7]));
        let separation = encode_one(&info, task("separation")).await.unwrap();
        assert_eq!(
            (separation.adapter, separation.ids),
            (Some(2), vec![110, 7])
        );
        // An explicit prompt wins over the task's; the adapter stays.
        let raw = EmbedOptions {
            prompt: Prompt::Raw("mine".into()),
            ..task("retrieval.query")
        };
        let raw = encode_one(&info, raw).await.unwrap();
        assert_eq!((raw.adapter, raw.ids), (Some(0), vec![99, 7]));
        // A prompt name that is a task's name selects its adapter too
        // (TEI's prompt_name); no task: the base weights.
        let named = EmbedOptions {
            prompt: Prompt::Named("retrieval.passage".into()),
            ..EmbedOptions::default()
        };
        assert_eq!(encode_one(&info, named).await.unwrap().adapter, Some(1));
        let plain = encode_one(&info, EmbedOptions::default()).await.unwrap();
        assert_eq!((plain.adapter, plain.ids), (None, vec![7]));
    }

    #[tokio::test]
    async fn a_task_prompts_the_texts_beside_token_ids() {
        // TEI's inputs may mix texts with token-id lists: the ids run as
        // given, but the texts are still the task's texts and take its
        // prompt, as they do alone.
        let options = EmbedOptions {
            task: Some("retrieval.query".into()),
            ..EmbedOptions::default()
        };
        let inputs = vec![EmbedInput::Text("x".into()), EmbedInput::Tokens(vec![5, 6])];
        let encoded = encode_all(Some(Arc::new(PromptMarker)), &jina_info(), inputs, &options)
            .await
            .unwrap();
        let got: Vec<_> = encoded.iter().map(|e| (e.adapter, e.ids.clone())).collect();
        assert_eq!(got, [(Some(0), vec![115, 7]), (Some(0), vec![5, 6])]);
        // A prompt the request asks for itself still cannot go with ids.
        let named = EmbedOptions {
            prompt: Prompt::Named("retrieval.query".into()),
            ..EmbedOptions::default()
        };
        let inputs = vec![EmbedInput::Text("x".into()), EmbedInput::Tokens(vec![5, 6])];
        let err = encode_all(Some(Arc::new(PromptMarker)), &jina_info(), inputs, &named)
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("input 1: token ids run as given"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_task_the_model_lacks_is_invalid_input() {
        let task = |t: &str| EmbedOptions {
            task: Some(t.into()),
            ..EmbedOptions::default()
        };
        let err = encode_one(&jina_info(), task("retrieval"))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            CoreError::InvalidInput(
                "unknown task \"retrieval\": valid tasks are retrieval.query, \
                 retrieval.passage, separation"
                    .into()
            )
            .to_string()
        );
        let plain = ModelInfo {
            name: "minilm".into(),
            ..ModelInfo::default()
        };
        let err = encode_one(&plain, task("retrieval.query"))
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("minilm has no task adapters"),
            "{err}"
        );
        let tokens = EmbedOptions {
            output: Output::Tokens,
            ..task("separation")
        };
        // Per-token output runs the adapter (TEI's /embed_all, late chunking).
        assert_eq!(
            encode_one(&jina_info(), tokens).await.unwrap().adapter,
            Some(2)
        );
        let sparse = EmbedOptions {
            output: Output::Sparse,
            ..task("separation")
        };
        let err = encode_one(&jina_info(), sparse).await.unwrap_err();
        assert!(err.to_string().contains("pooled or per-token"), "{err}");
    }

    #[tokio::test]
    async fn truncate_false_holds_a_multi_vector_input_to_its_modes_length() {
        let info = ModelInfo {
            max_input_tokens: 40,
            multi_vector: Some(MultiVectorLengths {
                query: 16,
                document: 24,
            }),
            ..ModelInfo::default()
        };
        let refuse = |output| EmbedOptions {
            truncate: false,
            output,
            ..EmbedOptions::default()
        };
        let encode = |text: usize, options: EmbedOptions| {
            let info = info.clone();
            async move {
                let input = vec![EmbedInput::Text("x".repeat(text))];
                encode_all(Some(Arc::new(ByteTokens)), &info, input, &options).await
            }
        };
        let query = Output::MultiVector(Side::Query);
        let document = Output::MultiVector(Side::Document);
        // 20 tokens: within the model's 40, over the query's 16.
        let err = encode(18, refuse(query)).await.unwrap_err();
        assert_eq!(
            err,
            CoreError::InputTooLong {
                index: 0,
                tokens: 20,
                max: 16,
                limit: InputLimit::Mode(Side::Query),
            }
        );
        assert_eq!(
            err.to_string(),
            "input 0 has 20 tokens, more than the model's query length of 16"
        );
        assert!(encode(14, refuse(query)).await.is_ok());
        assert!(encode(18, refuse(document)).await.is_ok());
        let err = encode(23, refuse(document)).await.unwrap_err();
        assert!(matches!(
            err,
            CoreError::InputTooLong {
                tokens: 25,
                max: 24,
                limit: InputLimit::Mode(Side::Document),
                ..
            }
        ));
        // A request's cut below the mode's length is the request's.
        let cut = EmbedOptions {
            truncate_to: Some(8),
            ..refuse(query)
        };
        let err = encode(10, cut).await.unwrap_err();
        assert!(matches!(
            err,
            CoreError::InputTooLong {
                max: 8,
                limit: InputLimit::Request,
                ..
            }
        ));
        // The default truncates at the mode's length.
        let got = encode(
            100,
            EmbedOptions {
                output: query,
                ..EmbedOptions::default()
            },
        )
        .await
        .unwrap();
        assert_eq!(got[0].len(), 16);
    }

    #[tokio::test]
    async fn text_waits_for_room_to_be_tokenized() {
        // The whole room taken (as by a text larger than it): the next
        // large text waits until it is given back.
        let all = reading_room(usize::MAX).await;
        assert_eq!(all.num_permits(), TOKENIZING_KIB as usize);
        let next =
            tokio::spawn(async { reading_room(SMALL_REQUEST_BYTES + 1).await.num_permits() });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!next.is_finished(), "tokenized beside a full room");
        // A small request does not queue behind it: it has its own room.
        let small = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            reading_room(SMALL_REQUEST_BYTES),
        )
        .await
        .expect("a small request waited behind large texts");
        assert_eq!(small.num_permits(), 64);
        drop(small);
        drop(all);
        assert_eq!(next.await.unwrap(), 65);
        // A text is charged by the KiB, at least one.
        assert_eq!(reading_room(0).await.num_permits(), 1);
        assert_eq!(reading_room(3 << 10).await.num_permits(), 3);
        // The small room fills too: a small request waits for small ones.
        let mut held = Vec::new();
        for _ in 0..small_room_kib() / 64 {
            held.push(reading_room(SMALL_REQUEST_BYTES).await);
        }
        let waiting = tokio::spawn(async { reading_room(1).await.num_permits() });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "tokenized beside a full small room");
        held.pop();
        assert_eq!(waiting.await.unwrap(), 1);
    }
}
