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
    check_prompt(info, &options.prompt, &inputs)?;
    if options.truncate_to == Some(0) {
        return Err(CoreError::InvalidInput(
            "truncate_to must be at least 1 token".into(),
        ));
    }
    let model_max = info.input_max(options.output);
    let max = options.input_limit(model_max);
    let encoded = match tokenizer {
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
                    options.truncation_direction.unwrap_or_default(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
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
            EmbedderErrorKind::ModelFailure | EmbedderErrorKind::ModelGone => {
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
