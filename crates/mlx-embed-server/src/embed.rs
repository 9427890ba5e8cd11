//! The one embed path every API adapter calls:
//! validate -> `batcher.embed` (tokenize, admit, batch, compute) -> `dimensions` -> normalize.
//! Per-token output (`options.output`, TEI's `/embed_all`) takes the same
//! path and comes back as raw rows: neither cut nor normalized. The sparse
//! form ([`embed_sparse`], TEI's `/embed_sparse`) is a SPLADE model's raw
//! vectors with their zeros left out, or a BGE-M3 model's lexical weights.

use mlx_embed_core::{
    l2_normalize, lexical_entries, sparse_entries, EmbedInput, EmbedOptions, ModelInfo, Output,
    Prompt,
};

use crate::answer_room::{make_room, JSON_FLOAT_BYTES, SPARSE_ENTRY_BYTES};
use crate::errors::{ApiError, ErrorKind};
use crate::models::{ServedModel, Task};
use crate::state::AppState;
use crate::timing;

/// What every API's request boils down to.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedRequest {
    /// The request's `model` field: which served model answers (none: the
    /// first embedding model; an unknown name: [`crate::models::resolve`]).
    pub model: Option<String>,
    pub inputs: Vec<EmbedInput>,
    /// Priority, truncation (`truncate: false` refuses over-long inputs with
    /// 422 before any compute), truncation side, prompt and output kind.
    pub options: EmbedOptions,
    /// Scale each vector to unit length (after `dimensions`); pooled output only.
    pub normalize: bool,
    /// Keep only the first N components (1..=dim); re-normalized when
    /// `normalize`; pooled output only.
    pub dimensions: Option<i64>,
    /// An empty text is embedded (the model's vector of no words), as
    /// Ollama embeds one in a list; elsewhere it is a 400, as OpenAI's, TEI's
    /// and Cohere's answer it.
    pub empty_texts: bool,
}

/// The cosine of two unit vectors: their dot product, kept inside [-1, 1]
/// (float32 rounding can put a vector's cosine with itself at 1.0000004).
pub(crate) fn unit_cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| x * y)
        .sum::<f32>()
        .clamp(-1.0, 1.0)
}

impl EmbedRequest {
    /// Defaults shared by the APIs: normalize, truncate on the right, the
    /// model's default prompt, normal priority, full dimension.
    pub fn new(inputs: Vec<EmbedInput>) -> Self {
        Self {
            empty_texts: false,
            model: None,
            inputs,
            options: EmbedOptions::default(),
            normalize: true,
            dimensions: None,
        }
    }
}

/// What every API's response is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbedOutput {
    /// The served name of the model that answered.
    pub model: String,
    /// One entry per input, in input order: its vector, or (per-token
    /// output) its `rows` token rows, row-major.
    pub vectors: Vec<Vec<f32>>,
    /// Rows in each entry of `vectors` (1 for pooled output).
    pub rows: Vec<u32>,
    /// Length of each vector (of each row).
    pub dimension: usize,
    /// Exact tokens the model ran over all inputs (after truncation, specials included).
    pub prompt_tokens: u64,
    /// Inputs answered from the embedding cache.
    pub cache_hits: u32,
    /// What `vectors` hold: pooled vectors, token rows, or lexical weights'
    /// `[id, weight]` rows.
    pub output: Output,
}

/// Embeds `req`; errors carry their status (see [`crate::errors`]).
pub async fn embed(state: &AppState, req: EmbedRequest) -> Result<EmbedOutput, ApiError> {
    run(state, req, Task::Embed, JSON_FLOAT_BYTES).await
}

/// [`embed`], for a route whose answer takes about `bytes_per_value` bytes
/// for each value of the vectors (Cohere's, which can answer each vector in
/// several forms at once): what the answer room keeps for it.
pub(crate) async fn embed_answering(
    state: &AppState,
    req: EmbedRequest,
    bytes_per_value: usize,
) -> Result<EmbedOutput, ApiError> {
    run(state, req, Task::Embed, bytes_per_value).await
}

/// Embeds `req` with a multi-vector (ColBERT) model (any other is a 400),
/// `req.options.output` an [`Output::MultiVector`]: per input its token rows
/// (`rows`), each scaled to unit length when `req.normalize` (PyLate's
/// default). `req.dimensions` must be off. With
/// `req.options.token_pooling` the engine answers a document's pooled rows,
/// the means of its unit rows (PyLate's), left as they are: `req.normalize`
/// must be on, as the pooling normalizes first.
pub async fn embed_multi_vector(
    state: &AppState,
    req: EmbedRequest,
) -> Result<EmbedOutput, ApiError> {
    if !matches!(req.options.output, Output::MultiVector(_)) || req.dimensions.is_some() {
        return Err(ApiError::invalid(
            "multi-vector output is one row per token, at the model's width",
        ));
    }
    if req.options.token_pooling.is_some() && !req.normalize {
        return Err(ApiError::invalid(
            "pooled multi-vector rows are means of unit rows: normalize must be on",
        ));
    }
    run(state, req, Task::MultiVector, JSON_FLOAT_BYTES).await
}

/// What [`embed_sparse`] answers: each input's non-zero entries.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseOutput {
    /// The served name of the model that answered.
    pub model: String,
    /// Per input, in input order: `(vocabulary index, weight)` of every
    /// non-zero entry, in index order; unnormalized.
    pub entries: Vec<Vec<(u32, f32)>>,
    /// Exact tokens the model ran over all inputs.
    pub prompt_tokens: u64,
}

/// Embeds `req` with a sparse model (one that is not is a 400): a SPLADE
/// model's vectors as their non-zero entries, or a BGE-M3 model's lexical
/// weights ([`Output::Sparse`]). The weights are raw: `req.normalize` and
/// `req.dimensions` must be off (no route asks otherwise).
pub async fn embed_sparse(state: &AppState, req: EmbedRequest) -> Result<SparseOutput, ApiError> {
    if req.normalize || req.dimensions.is_some() || req.options.output != Output::Pooled {
        return Err(ApiError::invalid(
            "sparse output is the model's raw weights: not normalized, not cut",
        ));
    }
    // A sparse answer's size is known only once computed: an entry per
    // non-zero weight, from a few dozen to one per vocabulary word. Room is
    // kept for it then, for what it is; kept before, for the worst case, a
    // one-word query on a 30k vocabulary was told at 1.1 MB and waited
    // behind (and was refused 429 by) a large call still computing.
    let out = run(state, req, Task::EmbedSparse, 0).await?;
    let entries: Vec<Vec<(u32, f32)>> = if out.output == Output::Sparse {
        out.vectors.iter().map(|v| lexical_entries(v)).collect()
    } else {
        out.vectors.iter().map(|v| sparse_entries(v)).collect()
    };
    drop(out.vectors);
    let answer_entries: usize = entries.iter().map(Vec::len).sum();
    make_room(state, answer_entries.saturating_mul(SPARSE_ENTRY_BYTES)).await?;
    Ok(SparseOutput {
        model: out.model,
        entries,
        prompt_tokens: out.prompt_tokens,
    })
}

/// Most floats one per-token answer may hold: TEI's own worst case (its
/// 32-input client batch of 512-token inputs of a 1024-wide model), about
/// 180 MB of JSON. Without it a 300 KB request asked for 600 MB of answer,
/// built whole in memory.
pub const MAX_TOKEN_OUTPUT_FLOATS: usize = 1 << 24;

/// `bytes_per_value`: about the bytes of answer each value of the vectors
/// (or rows) becomes, which the answer room keeps before the call (0: the
/// caller keeps room once it knows the answer's size).
async fn run(
    state: &AppState,
    req: EmbedRequest,
    task: Task,
    bytes_per_value: usize,
) -> Result<EmbedOutput, ApiError> {
    run_as(state, req, task, bytes_per_value, None).await
}

/// What a request's client sent, where the model runs it as other inputs
/// (late chunking: its chunks as one text): what its figures count.
struct AsSent {
    /// The inputs the client sent (begun in the request's figures already).
    inputs: usize,
    /// Their characters, as [`timing::chars`] counts them.
    chars: u64,
}

/// [`run`]; with `as_sent`, the request's figures count the client's
/// inputs, not `req`'s (and begin where the caller began them).
async fn run_as(
    state: &AppState,
    mut req: EmbedRequest,
    task: Task,
    bytes_per_value: usize,
    as_sent: Option<AsSent>,
) -> Result<EmbedOutput, ApiError> {
    if as_sent.is_none() {
        timing::begin(req.inputs.len(), timing::Op::Embed);
    }
    refuse_inputs(state, &req.inputs, req.empty_texts)
        .inspect_err(|_| state.count_under_requested(req.model.as_deref(), task))?;
    let model = state.model_for(req.model.as_deref(), task)?;
    server_prompt(state, &mut req.options);
    // A SPLADE model's pooled vectors are sparse already; a BGE-M3 model
    // answers sparse requests with its lexical weights.
    if task == Task::EmbedSparse && !model.info().sparse {
        req.options.output = Output::Sparse;
    }
    let output = req.options.output;
    let dimension = validate(&req, model)?;
    if output.per_token() {
        req.options.max_token_rows = Some(MAX_TOKEN_OUTPUT_FLOATS / dimension.max(1));
    }

    // Pooled rows come from the engine normalized as PyLate pools them;
    // scaled again they would not be PyLate's means.
    let pooled_rows = req.options.token_pooling.is_some();
    let n_inputs = req.inputs.len();
    let rows = match output {
        Output::Pooled => n_inputs,
        // Room for sparse answers is kept once they are computed.
        Output::Sparse => 0,
        Output::Tokens | Output::MultiVector(_) => {
            // 0 would be a model that states no cut.
            let per_input = match model.info().max_input_tokens {
                0 => usize::MAX,
                n => n,
            };
            let prompt = prompt_bytes(&req.options.prompt, model.info());
            token_rows_at_most(&req.inputs, per_input, prompt, &req.options)
        }
    };
    let values = rows.saturating_mul(dimension);
    make_room(state, values.saturating_mul(bytes_per_value)).await?;
    let (chars, counted) = match &as_sent {
        Some(sent) => {
            timing::reached(sent.inputs);
            (sent.chars, sent.inputs)
        }
        None => (timing::reach(&req.inputs), n_inputs),
    };
    let out = state
        .unless_drain_ends(model.batcher.embed(req.inputs, req.options))
        .await?;
    timing::record_as(model.info(), chars, counted as u64, &out);
    if out.vectors.len() != n_inputs || out.row_counts.len() != n_inputs {
        // The core promises one entry per input; never answer with misaligned data.
        return Err(ApiError::new(
            ErrorKind::Model,
            format!(
                "model returned {} vectors for {n_inputs} inputs",
                out.vectors.len()
            ),
        ));
    }

    let mut vectors = out.vectors;
    let dimension = match output {
        Output::Pooled => {
            for v in &mut vectors {
                finish_pooled(v, dimension, req.normalize);
            }
            dimension
        }
        Output::Tokens => row_width(&vectors, &out.row_counts)?,
        Output::MultiVector(_) => {
            if req.normalize && !pooled_rows {
                for v in &mut vectors {
                    v.chunks_exact_mut(dimension.max(1)).for_each(l2_normalize);
                }
            }
            dimension
        }
        Output::Sparse => 2,
    };
    let prompt_tokens = out.token_counts.iter().map(|&n| u64::from(n)).sum();
    Ok(EmbedOutput {
        model: model.name.clone(),
        vectors,
        rows: out.row_counts,
        dimension,
        prompt_tokens,
        cache_hits: out.cache_hits,
        output,
    })
}

/// The server's default prompt (TEI's --default-prompt-name/--default-prompt)
/// stands in for the folder's where a request says nothing: here, where
/// every embedding route's request passes. A task's own prompt is the
/// task's (its adapter was trained with it).
fn server_prompt(state: &AppState, options: &mut EmbedOptions) {
    if options.prompt == Prompt::Default && options.task.is_none() {
        if let Some(prompt) = server_default_prompt(state.args()) {
            options.prompt = prompt;
        }
    }
}

/// What joins late chunking's chunks into the one text the model reads.
/// Jina's API "concatenates" the inputs without naming a separator; a space
/// keeps the last word of a chunk and the first of the next two words for
/// every tokenizer (with none, "Germany." + "It" would be one word to a
/// byte-level BPE), and its own tokens belong to no chunk.
pub const LATE_CHUNK_SEPARATOR: &str = " ";

/// Late chunking (Jina's `late_chunking: true`; Günther et al., "Late
/// Chunking", 2024): `req.inputs`, the chunks of one text in order, are
/// joined by [`LATE_CHUNK_SEPARATOR`] and run as one input (the model's
/// per-token output, on the same path as TEI's `/embed_all`), and each chunk's
/// vector is the mean of its own tokens' last hidden states
/// ([`mlx_embed_core::span_means`]), then cut to `dimensions` and normalized
/// as any pooled vector. A token belongs to the last chunk it overlaps (the
/// tokenizer's offsets into the joined text; `chunk_spans`): the model's
/// special tokens, the prompt's and a separator's own belong to none. The joined
/// text must fit the model's length whole (Jina's 8192 tokens for its v3):
/// a chunk cut away would have no vector, so `truncate` does not apply.
/// Only a model that mean-pools with no Dense after it: its pooled vector
/// is then the same mean over all its tokens, and the chunks' means live in
/// its space; a folder's Matryoshka `truncate_dim` cuts each chunk's mean as
/// it cuts the model's.
///
/// Figures: the request counts the chunks as its inputs and their
/// characters (as the same chunks sent without late chunking count), and the
/// tokens the model ran: the joined text's, once (its special tokens and
/// prompt once, not per chunk, and any tokens of the separators).
/// Not cached: the embedding cache holds pooled vectors, one per input
/// (`mlx_embed_core`'s cache), and this path asks the model for token rows.
pub async fn embed_late_chunks(
    state: &AppState,
    req: EmbedRequest,
) -> Result<EmbedOutput, ApiError> {
    // The request counts as the chunks its client sent (TEI's te_embed_*
    // and te_request_count's method, the x-compute-characters header), as
    // the same chunks sent without late_chunking do; its tokens are those
    // the model ran, the joined text's (`AsSent`).
    timing::begin(req.inputs.len(), timing::Op::Embed);
    let refuse = |e: ApiError| {
        state.count_under_requested(req.model.as_deref(), Task::Embed);
        e
    };
    refuse_inputs(state, &req.inputs, false).map_err(refuse)?;
    let mut chunks = Vec::with_capacity(req.inputs.len());
    for input in &req.inputs {
        match input {
            EmbedInput::Text(t) => chunks.push(t.as_str()),
            _ => {
                return Err(refuse(
                    ApiError::invalid(
                        "late_chunking takes the chunks as texts: token ids have no text to \
                         join; send the chunks' texts",
                    )
                    .param("input"),
                ))
            }
        }
    }
    let model = state.model_for(req.model.as_deref(), Task::Embed)?;
    let info = model.info();
    let pooling = info.details.get("pooling").map(String::as_str);
    if pooling != Some("mean") {
        return Err(ApiError::invalid(format!(
            "late_chunking pools each chunk's tokens by their mean; {} pools by {} (its \
             vectors are not the mean of its token states), so chunk means would not be its \
             vectors: embed the chunks without late_chunking",
            model.name,
            pooling.unwrap_or("a method it does not state"),
        ))
        .param("late_chunking"));
    }
    if info.dense_layers > 0 {
        let layers = info.dense_layers;
        return Err(ApiError::invalid(format!(
            "late_chunking needs a model whose vector is the mean of its token states; {} has \
             {layers} Dense layer(s) after its pooling, which no chunk mean runs through: embed \
             the chunks without late_chunking",
            model.name,
        ))
        .param("late_chunking"));
    }
    let dimension = match req.dimensions {
        None => info.dim,
        Some(n) => output_dimension(n, model, "dimensions")?,
    };
    let tokenizer = model.batcher.tokenizer().cloned().ok_or_else(|| {
        ApiError::invalid(
            "late_chunking needs the model's tokenizer: this model takes token ids only",
        )
        .param("late_chunking")
    })?;
    let mut options = req.options.clone();
    server_prompt(state, &mut options);
    // A task (or a prompt named after one) runs its adapter over the whole
    // text, and its prompt leads it, as for pooled output: the core's rule.
    let (adapter, tasked) = mlx_embed_core::task_adapter(info, &options)?;
    let mut options = tasked.unwrap_or(options);
    options.task = adapter.map(|i| info.tasks[i as usize].clone());
    let mut joined = String::with_capacity(chunks.iter().map(|c| c.len() + 1).sum());
    let mut ranges = Vec::with_capacity(chunks.len());
    for (i, chunk) in chunks.iter().enumerate() {
        if i > 0 {
            joined.push_str(LATE_CHUNK_SEPARATOR);
        }
        ranges.push(joined.len()..joined.len() + chunk.len());
        joined.push_str(chunk);
    }
    let reading = mlx_embed_core::reading_room(joined.len()).await;
    let tokenized = {
        let options = options.clone();
        tokio::task::spawn_blocking(move || {
            let _reading = reading;
            let prompt = tokenizer.prompt_before(&joined, &options)?;
            let tokens = tokenizer.tokens(&joined, true, &options)?;
            Ok::<_, mlx_embed_core::EmbedderError>((prompt.len(), tokens))
        })
        .await
        .map_err(|e| ApiError::new(ErrorKind::Model, format!("tokenizer task failed: {e}")))?
    };
    let (prompt_len, tokens) =
        tokenized.map_err(|e| ApiError::invalid(e.message).param("input"))?;
    let limit = match options.input_limit(info.max_input_tokens) {
        0 => usize::MAX,
        n => n,
    };
    if tokens.len() > limit {
        return Err(ApiError::new(
            ErrorKind::Unprocessable,
            format!(
                "with late_chunking the chunks are one text, and these {} chunks are {} tokens \
                 (special tokens included), over the model's {limit}; late chunking needs the \
                 whole text in one context (truncate does not apply: a chunk cut away would \
                 have no vector): send fewer or shorter chunks, or the rest in another request",
                chunks.len(),
                tokens.len(),
            ),
        )
        .param("input")
        .code("context_length_exceeded"));
    }
    let spans = chunk_spans(&tokens, prompt_len, &ranges).map_err(|i| {
        ApiError::invalid(format!(
            "input {i} has no tokens of its own (only whitespace, or all its text in tokens \
             that end in the next input): late_chunking gives each chunk the mean of its tokens"
        ))
        .param("input")
    })?;
    let ids = tokens.iter().map(|t| t.id).collect();
    // The answer is one vector per chunk, not the token rows the run below
    // computes (8k rows of 1024 would keep ~100 MB of room for a 40 KB
    // answer), so the room is kept here and the run keeps none.
    make_room(
        state,
        chunks
            .len()
            .saturating_mul(dimension)
            .saturating_mul(JSON_FLOAT_BYTES),
    )
    .await?;
    let as_sent = AsSent {
        inputs: chunks.len(),
        chars: timing::chars(&req.inputs),
    };
    let rows = run_as(
        state,
        EmbedRequest {
            model: Some(model.name.clone()),
            inputs: vec![EmbedInput::Tokens(ids)],
            options: EmbedOptions {
                output: Output::Tokens,
                // The prompt is in the ids already: none is added (nor
                // refused, as one asked for with ids would be).
                prompt: Prompt::Raw(String::new()),
                // The ids are the tokenizer's own, made just now.
                wrapped_token_ids: false,
                truncate: false,
                ..options
            },
            normalize: false,
            dimensions: None,
            empty_texts: false,
        },
        Task::Embed,
        0,
        Some(as_sent),
    )
    .await?;
    // A Matryoshka cut (the folder's truncate_dim): the model's vector is
    // its mean's first `dim` values, so each chunk's mean is cut as well
    // (finish_pooled cuts to `dimension`, at most `dim`; the bridge
    // admits no truncate_dim but `dim`).
    let cut = info.truncate_dim.is_some() && rows.dimension > info.dim;
    if rows.dimension != info.dim && !cut {
        // Token states of another width than the vectors, for a reason the
        // model does not state: chunk means would be in another space.
        return Err(ApiError::invalid(format!(
            "late_chunking needs a model whose vector is the mean of its token states; {}'s \
             token states are {} wide and its vectors {}",
            model.name, rows.dimension, info.dim,
        ))
        .param("late_chunking"));
    }
    let mut vectors = mlx_embed_core::span_means(&rows.vectors[0], rows.dimension, &spans);
    for v in &mut vectors {
        finish_pooled(v, dimension, req.normalize);
    }
    Ok(EmbedOutput {
        model: rows.model,
        rows: vec![1; vectors.len()],
        vectors,
        dimension,
        prompt_tokens: rows.prompt_tokens,
        cache_hits: 0,
        output: Output::Pooled,
    })
}

/// Each chunk's token positions in `tokens` (the joined text's, specials
/// included; offsets count `prompt_len` bytes of prompt first): the tokens
/// whose last byte lies in the chunk's byte range of the joined text, and
/// those that end in the separator after it with bytes of the chunk. A
/// chunk with none is an error naming it.
fn chunk_spans(
    tokens: &[mlx_embed_core::TokenSpan],
    prompt_len: usize,
    ranges: &[std::ops::Range<usize>],
) -> Result<Vec<std::ops::Range<usize>>, usize> {
    let mut spans: Vec<Option<std::ops::Range<usize>>> = vec![None; ranges.len()];
    for (pos, token) in tokens.iter().enumerate() {
        if token.special || token.stop <= token.start || token.stop <= prompt_len {
            continue;
        }
        let (start, stop) = (
            token.start.saturating_sub(prompt_len),
            token.stop - prompt_len,
        );
        // The last chunk the token overlaps: the one holding its last byte,
        // or, for a token that ends in the separator (a SentencePiece BPE
        // piece such as "t▁"), the chunk its text is from. Ranges are in
        // order and disjoint: the last that starts before `stop`.
        let i = ranges.partition_point(|r| r.start < stop);
        if i > 0 && ranges[i - 1].end > start {
            let i = i - 1;
            let span = spans[i].get_or_insert(pos..pos);
            span.end = pos + 1;
        }
    }
    spans
        .into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or(i))
        .collect()
}

/// The prompt `--default-prompt-name` or `--default-prompt` gives a
/// request that names none (clap lets at most one be set).
pub(crate) fn server_default_prompt(args: &crate::ServerArgs) -> Option<Prompt> {
    match (&args.default_prompt_name, &args.default_prompt) {
        (Some(name), _) => Some(Prompt::Named(name.clone())),
        (None, Some(text)) => Some(Prompt::Raw(text.clone())),
        (None, None) => None,
    }
}

/// The bytes of the prompt `prompt` puts before a text of `model` (a name
/// it lacks is refused later; counted as none here).
fn prompt_bytes(prompt: &Prompt, model: &ModelInfo) -> usize {
    let named = |name: &str| model.prompts.get(name).map_or(0, String::len);
    match prompt {
        Prompt::Raw(text) => text.len(),
        Prompt::Named(name) => named(name),
        Prompt::Default => model.default_prompt_name.as_deref().map_or(0, named),
    }
}

/// At most the token rows a per-token answer to `inputs` has, told before
/// they are tokenized: a token per byte of text and of its prompt
/// (`prompt_bytes`), or per id, and a few for the specials, at most
/// `per_input` each (the model's cut), and at most the answer's cap in all.
/// (A slack of 64 for specials and prompt together told one short text at
/// 369 KB of answer.)
fn token_rows_at_most(
    inputs: &[EmbedInput],
    per_input: usize,
    prompt_bytes: usize,
    options: &EmbedOptions,
) -> usize {
    // More than any model's tokenizer puts around a text or a pair.
    const SPECIALS: usize = 8;
    let rows: usize = inputs
        .iter()
        .map(|input| {
            let length = match input {
                EmbedInput::Text(text) => text.len() + prompt_bytes,
                EmbedInput::Tokens(ids) => ids.len(),
                EmbedInput::Pair { query, document } => query.len() + document.len(),
            };
            length.saturating_add(SPECIALS).min(per_input)
        })
        .sum();
    rows.min(options.max_token_rows.unwrap_or(usize::MAX))
}

/// Checks the inputs against the request limits before any model work (and
/// before the model is picked: an empty request is a 400 whatever it names).
/// A refused request still counts in `/metrics` under the model it names
/// (`requested`, for `task`) when that model serves, as the refusals that
/// come after the model is picked do.
pub(crate) fn check_inputs(
    state: &AppState,
    inputs: &[EmbedInput],
    requested: Option<&str>,
    task: Task,
) -> Result<(), ApiError> {
    refuse_inputs(state, inputs, false)
        .inspect_err(|_| state.count_under_requested(requested, task))
}

/// `empty_texts`: an empty text is an input like any other (Ollama's lists).
fn refuse_inputs(
    state: &AppState,
    inputs: &[EmbedInput],
    empty_texts: bool,
) -> Result<(), ApiError> {
    let max_inputs = state.args().max_inputs_per_request;
    if inputs.is_empty() {
        return Err(ApiError::invalid("input is empty: send at least one text").param("input"));
    }
    if inputs.len() > max_inputs {
        return Err(ApiError::too_many_inputs(inputs.len(), max_inputs).param("input"));
    }
    // Token ids are checked against the vocabulary by the tokenizer, with the rest of the input.
    for (i, input) in inputs.iter().enumerate() {
        match input {
            EmbedInput::Text(t) if t.is_empty() && !empty_texts => {
                return Err(
                    ApiError::invalid(format!("input {i} is an empty string")).param("input")
                );
            }
            EmbedInput::Tokens(ids) if ids.is_empty() => {
                return Err(
                    ApiError::invalid(format!("input {i} is an empty token list")).param("input"),
                );
            }
            _ => {}
        }
    }
    Ok(())
}

/// The width every token row has (the model's hidden size, which need not
/// be the pooled `dim`); a model error if the rows disagree. Inputs of no
/// tokens (a static model's blank text) have no rows to read it from, and
/// when no input has any, the width is 0.
fn row_width(vectors: &[Vec<f32>], rows: &[u32]) -> Result<usize, ApiError> {
    let Some((first, &n)) = vectors.iter().zip(rows).find(|(_, &r)| r > 0) else {
        return if vectors.iter().all(Vec::is_empty) {
            Ok(0)
        } else {
            Err(ApiError::new(
                ErrorKind::Model,
                "model returned token rows for inputs of no tokens",
            ))
        };
    };
    let width = first.len() / n as usize;
    if width == 0
        || vectors
            .iter()
            .zip(rows)
            .any(|(v, &r)| v.len() != r as usize * width)
    {
        return Err(ApiError::new(
            ErrorKind::Model,
            "model returned token rows of different widths",
        ));
    }
    Ok(width)
}

/// The output dimension `req` asks for.
/// A pooled vector as a request asks for it: its first `dimension`
/// components, then unit length when `normalize`.
pub(crate) fn finish_pooled(v: &mut Vec<f32>, dimension: usize, normalize: bool) {
    v.truncate(dimension);
    if normalize {
        l2_normalize(v);
    }
}

/// The output width `req` asks of `model`, once its options are checked.
pub(crate) fn validate(req: &EmbedRequest, model: &ServedModel) -> Result<usize, ApiError> {
    if req.options.output == Output::Tokens && (req.normalize || req.dimensions.is_some()) {
        // Per-token rows are the raw hidden states (TEI's contract); no route asks otherwise.
        return Err(ApiError::invalid(
            "per-token output is neither normalized nor cut to dimensions",
        ));
    }
    match req.dimensions {
        None => Ok(model.info().dim),
        Some(n) => output_dimension(n, model, "dimensions"),
    }
}

/// `n` as the output width of `model` (1..=its dimension); the error names
/// the request's `field` (OpenAI's `dimensions`, Cohere's `output_dimension`).
/// A SPLADE model has none to cut: its vector is one weight per vocabulary
/// entry, and its first `n` entries would be a meaningless (mostly zero) vector.
pub(crate) fn output_dimension(
    n: i64,
    model: &ServedModel,
    field: &'static str,
) -> Result<usize, ApiError> {
    let dim = model.info().dim;
    if model.info().sparse {
        return Err(ApiError::invalid(format!(
            "{} is a sparse (SPLADE) model: its vectors are vocabulary weights and {field} \
             cannot cut them; leave {field} out, or use /embed_sparse for the non-zero weights",
            model.name
        ))
        .param(field));
    }
    if n >= 1 && n as u64 <= dim as u64 {
        Ok(n as usize)
    } else {
        Err(ApiError::invalid(format!(
            "{field} must be between 1 and the model's dimension {dim}, got {n}"
        ))
        .param(field))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_rows_are_told_from_text_prompt_and_a_few_specials() {
        let text = |t: &str| EmbedInput::Text(t.into());
        let options = EmbedOptions::default();
        // One short text: its bytes and the specials, not a fixed slack of
        // 64 (369 KB of answer for "hi" at 384 floats a row).
        assert_eq!(token_rows_at_most(&[text("hi")], 512, 0, &options), 10);
        assert_eq!(token_rows_at_most(&[text("hi")], 512, 7, &options), 17);
        // Ids are rows as given; pairs both texts.
        let ids = EmbedInput::Tokens(vec![1; 20]);
        let pair = EmbedInput::Pair {
            query: "abc".into(),
            document: "de".into(),
        };
        assert_eq!(token_rows_at_most(&[ids, pair], 512, 7, &options), 28 + 13);
        // At most the model's cut each, and the answer's cap in all.
        let long = text(&"word ".repeat(1000));
        assert_eq!(
            token_rows_at_most(&[long.clone(), long.clone()], 256, 0, &options),
            512
        );
        let capped = EmbedOptions {
            max_token_rows: Some(300),
            ..EmbedOptions::default()
        };
        assert_eq!(
            token_rows_at_most(&[long.clone(), long], 256, 0, &capped),
            300
        );
    }

    #[test]
    fn a_token_is_the_last_chunk_s_it_overlaps() {
        use mlx_embed_core::TokenSpan;
        let token = |start: usize, stop: usize, special: bool| TokenSpan {
            id: 0,
            text: String::new(),
            special,
            start,
            stop,
        };
        // "q: " (3 bytes of prompt), then "ab cd" + " " + "ef": chunks at
        // 0..5 and 6..8 of the joined text.
        let ranges = [0..5, 6..8];
        let tokens = [
            token(0, 0, true),  // [CLS]
            token(0, 2, false), // the prompt's "q:"
            token(3, 5, false), // "ab"
            token(5, 8, false), // " cd" (a leading space, as a metaspace token has)
            token(8, 9, false), // the separator alone
            token(9, 11, false),
            token(0, 0, true), // [SEP]
        ];
        assert_eq!(chunk_spans(&tokens, 3, &ranges), Ok(vec![2..4, 5..6]));
        // A chunk no token ends in is named.
        assert_eq!(chunk_spans(&tokens[..5], 3, &ranges), Err(1));
        // A piece that ends in the separator ("cd▁", as a SentencePiece
        // BPE merges) is the chunk's its text is from; one that runs over
        // a chunk into the next ("d▁e") is the later chunk's.
        let merged = [token(3, 5, false), token(6, 9, false), token(9, 11, false)];
        assert_eq!(chunk_spans(&merged, 3, &ranges), Ok(vec![0..2, 2..3]));
        let over = [
            token(3, 7, false),
            token(7, 10, false),
            token(10, 11, false),
        ];
        assert_eq!(chunk_spans(&over, 3, &ranges), Ok(vec![0..1, 1..3]));
    }

    #[test]
    fn a_prompt_is_told_by_its_bytes() {
        let info = ModelInfo {
            prompts: [("query".to_string(), "query: ".to_string())].into(),
            default_prompt_name: Some("query".into()),
            ..ModelInfo::default()
        };
        assert_eq!(prompt_bytes(&Prompt::Default, &info), 7);
        assert_eq!(prompt_bytes(&Prompt::Named("query".into()), &info), 7);
        assert_eq!(prompt_bytes(&Prompt::Named("nope".into()), &info), 0);
        assert_eq!(prompt_bytes(&Prompt::Raw("abc".into()), &info), 3);
        let plain = ModelInfo::default();
        assert_eq!(prompt_bytes(&Prompt::Default, &plain), 0);
    }
}
