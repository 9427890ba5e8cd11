//! [`HfTokenizer`]: the spec's rules over a Hugging Face `tokenizers::Tokenizer`.

use std::collections::hash_map::{Entry, HashMap};
use std::path::Path;

use mlx_embed_core::{
    EmbedInput, EmbedOptions, EmbedderError, Encoded, Output, Prompt, Side, TokenSpan, Tokenize,
    TruncationDirection,
};
use tokenizers::Tokenizer;

use crate::pair::{cut, cut_document_start, truncate_pair_lengths};
use crate::{InputMode, PairSpec, TokenizerError, TokenizerSpec};

/// A model's tokenizer with its prompts, specials and length limit.
pub struct HfTokenizer {
    tokenizer: Tokenizer,
    spec: TokenizerSpec,
    vocab_size: usize,
    /// Each named prompt's tokens alone, for a model that pools without its
    /// prompt (`pool_without_prompt`): counted once, not per input.
    prompt_tokens: HashMap<String, usize>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("spec", &self.spec)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads `spec.path` and checks the spec against it.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let mut tokenizer = load(&spec.path)?;
        if spec.lowercase {
            lowercase_first(&mut tokenizer);
        }
        Self::with_tokenizer(tokenizer, spec)
    }

    /// A spec for `path` as the Python engine derives one when a model file
    /// gives none: the prefix and suffix are whatever the tokenizer's own
    /// post-processor puts around a probe text, no prompts, cut on the right
    /// (a folder's `truncation_side` is the caller's to set).
    pub fn probe_spec(path: &Path, max_length: usize) -> Result<TokenizerSpec, TokenizerError> {
        let tokenizer = load(path)?;
        let probe = "hello world";
        let encode = |specials| {
            tokenizer
                .encode_fast(probe, specials)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Spec(format!("cannot encode a probe text: {e}")))
        };
        let content = encode(false)?;
        let full = encode(true)?;
        let (prefix_ids, suffix_ids) = match find(&full, &content) {
            Some(i) if !content.is_empty() => {
                (full[..i].to_vec(), full[i + content.len()..].to_vec())
            }
            // A post-processor we cannot split: treat it as adding nothing.
            _ => (Vec::new(), Vec::new()),
        };
        Ok(TokenizerSpec {
            path: path.to_path_buf(),
            max_length,
            prefix_ids,
            suffix_ids,
            ..TokenizerSpec::default()
        })
    }

    fn with_tokenizer(tokenizer: Tokenizer, spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let vocab_size = tokenizer.get_vocab_size(true);
        let specials = spec.prefix_ids.len() + spec.suffix_ids.len();
        if specials >= spec.max_length {
            return Err(TokenizerError::Spec(format!(
                "max_length {} leaves no room for content ({specials} special tokens)",
                spec.max_length
            )));
        }
        if let Some(id) = spec
            .prefix_ids
            .iter()
            .chain(&spec.suffix_ids)
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(TokenizerError::Spec(format!(
                "special token id {id} is outside the vocabulary of {vocab_size}"
            )));
        }
        if let Some(pair) = &spec.pair {
            if pair.specials() >= spec.max_length {
                return Err(TokenizerError::Spec(format!(
                    "max_length {} leaves no room for a pair ({} special tokens)",
                    spec.max_length,
                    pair.specials()
                )));
            }
            if let Some(id) = pair
                .prefix_ids
                .iter()
                .chain(&pair.middle_ids)
                .chain(&pair.suffix_ids)
                .find(|&&id| id as usize >= vocab_size)
            {
                return Err(TokenizerError::Spec(format!(
                    "pair special token id {id} is outside the vocabulary of {vocab_size}"
                )));
            }
        }
        if let Some(name) = &spec.default_prompt_name {
            if !spec.prompts.contains_key(name) {
                return Err(TokenizerError::Spec(format!(
                    "default prompt {name:?} is not one of the prompts"
                )));
            }
        }
        let mut this = Self {
            tokenizer,
            spec,
            vocab_size,
            prompt_tokens: HashMap::new(),
        };
        if this.spec.pool_without_prompt {
            for prompt in this.spec.prompts.values() {
                let tokens = this.encode_text(prompt, "").map_err(|e| {
                    TokenizerError::Spec(format!("cannot tokenize the prompt {prompt:?}: {e}"))
                })?;
                this.prompt_tokens.insert(prompt.clone(), tokens.len());
            }
        }
        Ok(this)
    }

    /// Ids are below this (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The spec this tokenizer follows.
    pub fn spec(&self) -> &TokenizerSpec {
        &self.spec
    }

    /// The text prepended to `text` under `prompt`. The model's default
    /// prompt is left off a text that already begins with one of its
    /// prompts: a client that writes `search_query: ` itself (as Ollama's
    /// users of nomic-embed-text do, and frameworks' `query_instruction`)
    /// would otherwise get `search_document: search_query: ...`.
    fn prompt_text<'a>(&'a self, prompt: &'a Prompt, text: &str) -> Result<&'a str, EmbedderError> {
        if matches!(prompt, Prompt::Default)
            && self
                .spec
                .prompts
                .values()
                .any(|p| begins_with_prompt(text, p))
        {
            return Ok("");
        }
        match prompt {
            Prompt::Raw(text) => Ok(text),
            Prompt::Named(name) => {
                self.spec
                    .prompts
                    .get(name)
                    .map(String::as_str)
                    .ok_or_else(|| {
                        EmbedderError::invalid_input(format!("unknown prompt name {name:?}"))
                    })
            }
            Prompt::Default => Ok(match &self.spec.default_prompt_name {
                Some(name) => &self.spec.prompts[name],
                None => "",
            }),
        }
    }

    /// The prompt `text` runs under: what [`Self::prompt_text`] put before
    /// it (`prepended`), or, where the model's default was left off, the
    /// longest of its prompts the text already begins with.
    fn prompt_in_effect<'a>(&'a self, prompt: &Prompt, text: &str, prepended: &'a str) -> &'a str {
        let has_default = matches!(prompt, Prompt::Default)
            && self
                .spec
                .default_prompt_name
                .as_ref()
                .is_some_and(|name| !self.spec.prompts[name].is_empty());
        if !prepended.is_empty() || !has_default {
            return prepended;
        }
        self.spec
            .prompts
            .values()
            .filter(|p| begins_with_prompt(text, p))
            .max_by_key(|p| p.len())
            .map_or("", String::as_str)
    }

    /// Leading positions of `encoded` the pooling leaves out when the
    /// model pools without its prompt, as sentence-transformers counts them:
    /// the prompt tokenized alone with the specials and cut to the input's
    /// room, less the closing special if there is one (so a prompt that
    /// fills the input still leaves that special pooled, and one of no
    /// tokens leaves out `[CLS]`); 0 without a prompt. The same count after
    /// a left cut, though it took some or all of the prompt:
    /// sentence-transformers 6.2 masks the input's first positions by the
    /// prompt's own length, whatever the cut kept there.
    fn prompt_positions(&self, prompt: &str, encoded: &Encoded) -> Result<u32, EmbedderError> {
        if prompt.is_empty() {
            return Ok(0);
        }
        let (prefix, suffix) = (self.spec.prefix_ids.len(), self.spec.suffix_ids.len());
        let kept = encoded.ids.len().saturating_sub(prefix + suffix);
        let whole = match self.prompt_tokens.get(prompt) {
            Some(&n) => n,
            None => self.encode_text(prompt, "")?.len(),
        };
        let positions =
            (prefix + whole.min(kept) + suffix.saturating_sub(1)).min(encoded.ids.len());
        Ok(u32::try_from(positions).unwrap_or(u32::MAX))
    }

    fn encode_text(&self, text: &str, prompt: &str) -> Result<Vec<u32>, EmbedderError> {
        let encoding = if prompt.is_empty() {
            self.tokenizer.encode_fast(text, false)
        } else {
            self.tokenizer.encode_fast(format!("{prompt}{text}"), false)
        };
        encoding
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EmbedderError::invalid_input(format!("cannot tokenize: {e}")))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), EmbedderError> {
        match ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.vocab_size)
        {
            Some((position, id)) => Err(EmbedderError::invalid_input(format!(
                "token id {id} at position {position} is outside the vocabulary \
                 (ids must be below {})",
                self.vocab_size
            ))),
            None => Ok(()),
        }
    }

    /// Encodes a query/document pair per the model's [`PairSpec`]. For a
    /// prompt-template reranker a raw prompt is the instruction; segment
    /// pairs take no prompt.
    fn encode_pair(
        &self,
        query: &str,
        document: &str,
        options: &EmbedOptions,
        max_length: usize,
        known_query: Option<&[u32]>,
    ) -> Result<Encoded, EmbedderError> {
        let pair = self.spec.pair.as_ref().ok_or_else(|| {
            EmbedderError::invalid_input("this model takes single texts, not query/document pairs")
        })?;
        let specials = pair.specials();
        // A decoder reranker's fixed tokens are mostly its prompt (its
        // instruction, the question it asks), which a client cutting at 30
        // would not count as special tokens.
        let what = if pair.pairs_only() {
            "tokens of its own around a pair (its prompt and special tokens)"
        } else {
            "special tokens around a pair"
        };
        let budget = content_room(max_length, specials, what)?;
        let direction = options
            .truncation_direction
            .unwrap_or(self.spec.truncation_side);
        if pair.template.is_some() {
            let with_instruction;
            let template = match &options.prompt {
                Prompt::Default => pair,
                Prompt::Raw(instruction) => {
                    with_instruction = PairSpec {
                        default_instruction: Some(instruction.clone()),
                        ..pair.clone()
                    };
                    &with_instruction
                }
                Prompt::Named(name) => {
                    return Err(EmbedderError::invalid_input(format!(
                        "unknown prompt name {name:?} (this reranker has no named prompts)"
                    )))
                }
            };
            let tail = pair.suffix_text.as_deref().unwrap_or("");
            let text = template.format(query, document).unwrap_or_default() + tail;
            let content = self.encode_text(&text, "")?;
            // With the tail in the content, sentence-transformers cuts the
            // whole render once it reaches the limit and writes the tail's
            // ids back over the cut's end; without, the tail always follows.
            let (room, restore, suffix) = match pair.suffix_text {
                Some(_) => (
                    max_length - pair.prefix_ids.len(),
                    Some(&pair.suffix_ids),
                    &[][..],
                ),
                None => (budget, None, &pair.suffix_ids[..]),
            };
            if let Prompt::Raw(instruction) = &options.prompt {
                if content.len() >= room {
                    self.check_instruction_room(template, instruction, tail, room, max_length)?;
                }
            }
            let untruncated_len =
                u32::try_from(pair.prefix_ids.len() + content.len() + suffix.len())
                    .unwrap_or(u32::MAX);
            let content = if content.len() > room && direction == TruncationDirection::Left {
                // Cut from the pair text's start, the instruction and the
                // query would go first and every document score alike.
                let frame = template.format(query, "").unwrap_or_default() + tail;
                cut_document_start(&content, &self.encode_text(&frame, "")?, room)
            } else {
                match restore {
                    Some(restore)
                        if direction == TruncationDirection::Right && content.len() >= room =>
                    {
                        [&content[..room - restore.len()], &restore[..]].concat()
                    }
                    _ => cut(&content, room, direction).to_vec(),
                }
            };
            let mut ids = Vec::with_capacity(pair.prefix_ids.len() + content.len() + suffix.len());
            ids.extend_from_slice(&pair.prefix_ids);
            ids.extend_from_slice(&content);
            ids.extend_from_slice(suffix);
            return Ok(Encoded {
                ids,
                type_ids: None,
                untruncated_len,
                pool_start: 0,
                token_pooling: None,
                adapter: None,
            });
        }
        let with_suffix;
        let (pair, budget, instruction) = match &options.prompt {
            Prompt::Default => (pair, budget, None),
            Prompt::Raw(text) if pair.instruction_suffix_ids.is_some() => {
                // FlagEmbedding's prompt=: the instruction ends the input.
                let ids = self.encode_text(text, "")?;
                with_suffix = pair.with_instruction_suffix(&ids).unwrap_or_default();
                let budget = max_length.saturating_sub(with_suffix.specials());
                let own = with_suffix.specials().max(with_suffix.uncounted);
                if max_length <= own
                    && max_length < self.spec.max_length
                    && own < self.spec.max_length
                {
                    // As for a template's instruction: the request's cut is short.
                    return Err(EmbedderError::cut_too_short(format!(
                        "a cut at {max_length} tokens leaves no room for text: the model counts \
                         {own} tokens of its own around a pair with this instruction (its \
                         prompt, special tokens and the instruction, which counts twice, as \
                         FlagEmbedding's prompt), so cut at {} or more",
                        own + 1
                    )));
                }
                if budget == 0 || max_length <= with_suffix.uncounted {
                    return Err(EmbedderError::invalid_input(format!(
                        "the instruction leaves the pair no room within max_length {max_length} \
                         (it ends the input and counts twice, as FlagEmbedding's prompt: {} tokens)",
                        ids.len()
                    )));
                }
                (&with_suffix, budget, None)
            }
            Prompt::Raw(instruction) if pair.instruction_prompt.is_some() => {
                (pair, budget, Some(instruction.as_str()))
            }
            _ => {
                return Err(EmbedderError::invalid_input(
                    "prompts do not apply to query/document pairs of this model",
                ))
            }
        };
        let query = match known_query {
            Some(ids) => ids,
            None => {
                let prefix = pair.query_prefix(instruction).unwrap_or_default();
                &self.encode_text(query, &prefix)?
            }
        };
        self.segment_pair(pair, query, document, direction, budget, options.truncate)
    }

    /// A request's instruction on a template reranker must leave a
    /// document at least one token: the pair text with an empty query and
    /// document (the instruction and the prompt's own text) below `room`.
    /// Whichever end is cut, that frame is kept before any of the document
    /// (see `cut_document_start`), so past it every document is cut away
    /// whole and all score alike. A long query is the query's own matter.
    fn check_instruction_room(
        &self,
        template: &PairSpec,
        instruction: &str,
        tail: &str,
        room: usize,
        max_length: usize,
    ) -> Result<(), EmbedderError> {
        let frame = template.format("", "").unwrap_or_default() + tail;
        let used = self.encode_text(&frame, "")?.len();
        if used < room {
            return Ok(());
        }
        // Within the model's own length the instruction fits: the request's
        // cut is what is short, and the client is owed the cut that fits.
        let own = max_length - room + used;
        if max_length < self.spec.max_length && own < self.spec.max_length {
            return Err(EmbedderError::cut_too_short(format!(
                "a cut at {max_length} tokens leaves no room for text: the model adds {own} tokens \
                 of its own around a pair with this instruction (its prompt, the instruction and \
                 special tokens), so cut at {} or more",
                own + 1
            )));
        }
        Err(EmbedderError::invalid_input(format!(
            "the instruction leaves the documents no room within max_length {max_length} \
             (with the reranker's prompt it takes {used} of the {room} tokens the pair text may use; \
             instruction: {} characters)",
            instruction.chars().count()
        )))
    }

    /// A segment pair (`[CLS] query [SEP] document [SEP]`, in the model's
    /// specials) from the query's ids: the query and the document are
    /// tokenized apart, so one query's ids serve every document. Without
    /// `truncate`, no library's query-first cut (the caller refuses a pair
    /// over the limit).
    fn segment_pair(
        &self,
        pair: &PairSpec,
        query: &[u32],
        document: &str,
        direction: TruncationDirection,
        budget: usize,
        truncate: bool,
    ) -> Result<Encoded, EmbedderError> {
        let specials = pair.specials();
        let b = self.encode_text(document, pair.document_prompt.as_deref().unwrap_or(""))?;
        let untruncated_len = u32::try_from(query.len() + b.len() + specials).unwrap_or(u32::MAX);
        // `truncate: false`: no library's own cut either (a query-first
        // cut can shorten a pair within the limit); a pair over the limit
        // is refused by the caller.
        let (n1, n2) = if truncate {
            pair.segment_lengths(query.len(), b.len(), budget)
        } else {
            truncate_pair_lengths(query.len(), b.len(), budget)
        };
        let (a, b) = (cut(query, n1, direction), cut(&b, n2, direction));
        let mut ids = Vec::with_capacity(a.len() + b.len() + specials);
        ids.extend_from_slice(&pair.prefix_ids);
        ids.extend_from_slice(a);
        ids.extend_from_slice(&pair.middle_ids);
        let first = ids.len();
        ids.extend_from_slice(b);
        ids.extend_from_slice(&pair.suffix_ids);
        let type_ids = pair.uses_type_ids().then(|| {
            let mut types = vec![pair.first_type_id; first];
            types.resize(ids.len(), pair.second_type_id);
            types
        });
        Ok(Encoded {
            ids,
            type_ids,
            untruncated_len,
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }

    /// A decoder reranker (a prompt template, or prompted segments) has no
    /// meaning for a lone text.
    fn takes_pairs_only(&self) -> bool {
        self.spec.pair.as_ref().is_some_and(PairSpec::pairs_only)
    }

    fn special(&self, id: u32) -> TokenSpan {
        TokenSpan {
            id,
            text: self.tokenizer.id_to_token(id).unwrap_or_default(),
            special: true,
            start: 0,
            stop: 0,
        }
    }

    /// Token-id input runs as given, as vLLM and TEI run it: the ids
    /// `/tokenize` lists, special tokens included, get the text's vector, and
    /// nothing is added. Only the cut to the model's maximum applies, and the
    /// ids the model leaves out (`drop_ids`). Over the maximum, ids that begin
    /// and end with the model's specials keep them, as text does, so the
    /// token a model pools (CLS, or the EOS of a last-token model) survives
    /// the cut; other ids are cut as they are.
    fn as_given(
        &self,
        ids: &[u32],
        direction: TruncationDirection,
        max_length: usize,
    ) -> Result<Encoded, EmbedderError> {
        let (prefix, suffix) = (&self.spec.prefix_ids, &self.spec.suffix_ids);
        if ids.len() > max_length && self.wrapped(ids) {
            return self.finish(
                &ids[prefix.len()..ids.len() - suffix.len()],
                direction,
                max_length,
            );
        }
        Ok(Encoded {
            ids: cut(ids, max_length, direction)
                .iter()
                .copied()
                .filter(|id| !self.spec.drop_ids.contains(id))
                .collect(),
            type_ids: None,
            untruncated_len: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }

    /// Ids that do not begin and end with the model's specials are refused
    /// ([`EmbedOptions::wrapped_token_ids`]), naming the specials and the
    /// likeliest cause.
    fn check_wrapped(&self, ids: &[u32]) -> Result<(), EmbedderError> {
        if self.wrapped(ids) {
            return Ok(());
        }
        let (prefix, suffix) = (&self.spec.prefix_ids, &self.spec.suffix_ids);
        let names = |ids: &[u32]| {
            ids.iter()
                .map(|&id| format!("{} ({id})", self.special(id).text))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let wrap = match (prefix.is_empty(), suffix.is_empty()) {
            (false, false) => format!(
                "begin with {} and end with {}",
                names(prefix),
                names(suffix)
            ),
            (false, true) => format!("begin with {}", names(prefix)),
            _ => format!("end with {}", names(suffix)),
        };
        Err(EmbedderError::invalid_input(format!(
            "token ids here must {wrap}, as this model's tokenizer wraps a text (/tokenize lists \
             them); without them they are likely another tokenizer's, which mean other text to \
             this model: LangChain's OpenAIEmbeddings sends tiktoken's unless \
             check_embedding_ctx_length=False. Send the text, or this model's ids"
        )))
    }

    /// Whether `ids` begin and end with the model's specials, as a text's do.
    fn wrapped(&self, ids: &[u32]) -> bool {
        let (prefix, suffix) = (&self.spec.prefix_ids, &self.spec.suffix_ids);
        ids.len() >= prefix.len() + suffix.len() && ids.starts_with(prefix) && ids.ends_with(suffix)
    }

    /// Cuts `content` to fit `max_length` with the specials and wraps it in them.
    fn finish(
        &self,
        content: &[u32],
        direction: TruncationDirection,
        max_length: usize,
    ) -> Result<Encoded, EmbedderError> {
        let specials = self.spec.prefix_ids.len() + self.spec.suffix_ids.len();
        let untruncated_len = u32::try_from(content.len() + specials).unwrap_or(u32::MAX);
        let content = cut(
            content,
            content_room(max_length, specials, "special tokens")?,
            direction,
        );
        let mut ids = Vec::with_capacity(content.len() + specials);
        ids.extend_from_slice(&self.spec.prefix_ids);
        ids.extend(content.iter().filter(|id| !self.spec.drop_ids.contains(id)));
        ids.extend_from_slice(&self.spec.suffix_ids);
        Ok(Encoded {
            ids,
            type_ids: None,
            untruncated_len,
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }
}

impl HfTokenizer {
    /// The tokenizer mode of a multi-vector output, where the model has one.
    fn mode(&self, output: Output) -> Option<&InputMode> {
        match output {
            Output::MultiVector(Side::Query) => self.spec.query.as_ref(),
            Output::MultiVector(Side::Document) => self.spec.document.as_ref(),
            _ => None,
        }
    }

    /// A multi-vector model's text in one of its modes ([`InputMode`]): the
    /// content cut to what the mode's length leaves beside the specials and
    /// the insert (or a request's `truncate_to` below it), wrapped in the
    /// specials, the insert after the first token, then the expansion.
    /// `untruncated_len` counts the insert, as the cut does.
    fn finish_mode(
        &self,
        content: &[u32],
        direction: TruncationDirection,
        mode: &InputMode,
        truncate_to: Option<usize>,
    ) -> Result<Encoded, EmbedderError> {
        let specials =
            self.spec.prefix_ids.len() + self.spec.suffix_ids.len() + mode.insert_ids.len();
        let max_length = truncate_to.map_or(mode.max_length, |n| n.min(mode.max_length));
        let untruncated_len = u32::try_from(content.len() + specials).unwrap_or(u32::MAX);
        let room = content_room(max_length, specials, "special tokens (its marker included)")?;
        let content = cut(content, room, direction);
        let mut ids = Vec::with_capacity(mode.max_length.max(content.len() + specials));
        ids.extend_from_slice(&self.spec.prefix_ids);
        ids.extend_from_slice(content);
        ids.extend_from_slice(&self.spec.suffix_ids);
        let at = ids.len().min(1);
        ids.splice(at..at, mode.insert_ids.iter().copied());
        if let Some(expand) = mode.expand_id {
            let short = mode.max_length.saturating_sub(ids.len());
            ids.extend(std::iter::repeat_n(expand, short));
        }
        Ok(Encoded {
            ids,
            type_ids: None,
            untruncated_len,
            pool_start: 0,
            token_pooling: None,
            adapter: None,
        })
    }
}

/// Content tokens that fit in `max_length` beside `specials` special tokens:
/// at least one, or a per-request cut (`truncate_to`) too short for the
/// model's specials is invalid input. (The model's own maximum always
/// leaves room: checked when the tokenizer is built.)
/// `what`: what those tokens are, for the message (a pair template's are
/// its instruction as well as its specials, and a client cutting at 30 who
/// reads "71 special tokens" would not know why).
fn content_room(max_length: usize, specials: usize, what: &str) -> Result<usize, EmbedderError> {
    if max_length <= specials {
        return Err(EmbedderError::cut_too_short(format!(
            "a cut at {max_length} tokens leaves no room for text: the model adds {specials} \
             {what}, so cut at {} or more",
            specials + 1
        )));
    }
    Ok(max_length - specials)
}

/// sentence-transformers' `do_lower_case`, done as it does it: a
/// `Lowercase` normalizer in front of the tokenizer's own (unless that
/// already lower-cases). Each character is lower-cased alone (a word-final
/// capital sigma becomes σ, as there, not ς), and offsets still point into
/// the text as sent.
fn lowercase_first(tokenizer: &mut Tokenizer) {
    use tokenizers::normalizers::{Lowercase, NormalizerWrapper, Sequence};
    let mut chain: Vec<NormalizerWrapper> = vec![Lowercase.into()];
    match tokenizer.get_normalizer().cloned() {
        Some(NormalizerWrapper::Lowercase(_)) => return,
        Some(NormalizerWrapper::Sequence(existing)) => {
            if existing
                .as_ref()
                .iter()
                .any(|n| matches!(n, NormalizerWrapper::Lowercase(_)))
            {
                return;
            }
            chain.extend(existing.as_ref().iter().cloned());
        }
        Some(other) => chain.push(other),
        None => {}
    }
    tokenizer.with_normalizer(Some(Sequence::new(chain)));
}

impl Tokenize for HfTokenizer {
    fn encode(&self, input: &EmbedInput, options: &EmbedOptions) -> Result<Encoded, EmbedderError> {
        let direction = options
            .truncation_direction
            .unwrap_or(self.spec.truncation_side);
        let max_length = options.input_limit(self.spec.max_length);
        match input {
            EmbedInput::Text(_) if self.takes_pairs_only() => Err(EmbedderError::invalid_input(
                "this reranker scores query/document pairs, not single texts",
            )),
            EmbedInput::Text(text) => {
                let prompt = self.prompt_text(&options.prompt, text)?;
                let content = match self.spec.char_limit {
                    Some(limit) if options.truncate => {
                        let full = format!("{prompt}{text}");
                        self.encode_text(cut_chars(&full, limit, direction), "")?
                    }
                    _ => self.encode_text(text, prompt)?,
                };
                if let Some(mode) = self.mode(options.output) {
                    return self.finish_mode(&content, direction, mode, options.truncate_to);
                }
                let mut encoded = self.finish(&content, direction, max_length)?;
                if self.spec.pool_without_prompt {
                    let pooled_out = self.prompt_in_effect(&options.prompt, text, prompt);
                    encoded.pool_start = self.prompt_positions(pooled_out, &encoded)?;
                }
                Ok(encoded)
            }
            EmbedInput::Tokens(ids) => {
                self.check_ids(ids)?;
                if options.wrapped_token_ids {
                    self.check_wrapped(ids)?;
                }
                self.as_given(ids, direction, max_length)
            }
            EmbedInput::Pair { query, document } => {
                self.encode_pair(query, document, options, max_length, None)
            }
        }
    }

    /// Segment pairs tokenize each distinct query once, not once per
    /// document: a long query with many documents cost its tokenizing times
    /// the documents (a 1 MB query beside 1,000 one-word documents kept a
    /// core busy for minutes after its client left). A template reranker
    /// formats each pair as one text, so its query is read again in every
    /// pair: what that makes the tokenizer read is bounded instead.
    fn encode_request(
        &self,
        inputs: &[EmbedInput],
        options: &EmbedOptions,
    ) -> Result<Vec<Encoded>, (usize, EmbedderError)> {
        let pair = self.spec.pair.as_ref();
        if pair.is_some_and(|p| p.template.is_some()) {
            check_template_reading(inputs)?;
        }
        let max_length = options.input_limit(self.spec.max_length);
        let shared =
            pair.is_some_and(|p| p.template.is_none()) && options.prompt == Prompt::Default;
        let mut queries: HashMap<&str, Vec<u32>> = HashMap::new();
        let mut out = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.iter().enumerate() {
            let encoded = match input {
                EmbedInput::Pair { query, document } if shared => {
                    let ids = match queries.entry(query.as_str()) {
                        Entry::Occupied(known) => known.into_mut(),
                        Entry::Vacant(slot) => slot.insert(
                            self.encode_text(
                                query,
                                pair.and_then(|p| p.query_prompt.as_deref()).unwrap_or(""),
                            )
                            .map_err(|e| (i, e))?,
                        ),
                    };
                    self.encode_pair(query, document, options, max_length, Some(ids))
                }
                other => self.encode(other, options),
            };
            out.push(encoded.map_err(|e| (i, e))?);
        }
        Ok(out)
    }

    fn tokens(
        &self,
        text: &str,
        add_special_tokens: bool,
        options: &EmbedOptions,
    ) -> Result<Vec<TokenSpan>, EmbedderError> {
        let prompt = self.prompt_text(&options.prompt, text)?;
        let full = format!("{prompt}{text}");
        // `encode`, not `encode_fast`: the offsets are the point here.
        let encoding = self
            .tokenizer
            .encode(full.as_str(), false)
            .map_err(|e| EmbedderError::invalid_input(format!("cannot tokenize: {e}")))?;
        let mut out = Vec::with_capacity(encoding.len() + 4);
        if add_special_tokens {
            out.extend(self.spec.prefix_ids.iter().map(|&id| self.special(id)));
        }
        for (&id, &(start, stop)) in encoding.get_ids().iter().zip(encoding.get_offsets()) {
            if self.spec.drop_ids.contains(&id) {
                continue;
            }
            out.push(TokenSpan {
                id,
                text: full.get(start..stop).unwrap_or_default().to_owned(),
                special: false,
                start,
                stop,
            });
        }
        if add_special_tokens {
            out.extend(self.spec.suffix_ids.iter().map(|&id| self.special(id)));
        }
        Ok(out)
    }

    fn prompt_before(&self, text: &str, options: &EmbedOptions) -> Result<String, EmbedderError> {
        Ok(self.prompt_text(&options.prompt, text)?.to_owned())
    }

    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, EmbedderError> {
        self.check_ids(ids)?;
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| EmbedderError::invalid_input(format!("cannot decode: {e}")))
    }
}

/// The model's tokenizer with whatever truncation and padding its file
/// carries turned off (MiniLM's has truncation at 128 and fixed padding to
/// 128): both are decided by the spec instead.
/// Most text a template reranker's pairs may make the tokenizer read in one
/// request, each pair's query counted again (the core's bound on pair text).
pub const MAX_TEMPLATE_PAIR_BYTES: usize = mlx_embed_core::MAX_PAIR_TEXT_BYTES;

/// Refuses template pairs that would make the tokenizer read more than
/// [`MAX_TEMPLATE_PAIR_BYTES`], naming the input that goes over.
fn check_template_reading(inputs: &[EmbedInput]) -> Result<(), (usize, EmbedderError)> {
    let mut bytes = 0usize;
    for (i, input) in inputs.iter().enumerate() {
        bytes += match input {
            EmbedInput::Pair { query, document } => query.len() + document.len(),
            EmbedInput::Text(text) => text.len(),
            EmbedInput::Tokens(_) => 0,
        };
        if bytes > MAX_TEMPLATE_PAIR_BYTES {
            let message = format!(
                "this reranker reads the query again with each document, and the pairs up to \
                 this one are over the {} MiB of text one request may have it tokenize; send a \
                 shorter query or fewer documents per request",
                MAX_TEMPLATE_PAIR_BYTES >> 20
            );
            return Err((i, EmbedderError::invalid_input(message)));
        }
    }
    Ok(())
}

fn load(path: &Path) -> Result<Tokenizer, TokenizerError> {
    let error = |message: String| TokenizerError::Load {
        path: path.display().to_string(),
        message,
    };
    let mut tokenizer = Tokenizer::from_file(path).map_err(|e| error(e.to_string()))?;
    tokenizer
        .with_truncation(None)
        .map_err(|e| error(e.to_string()))?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

/// `text` cut to at most `limit` characters (Unicode scalar values, as
/// Python counts a str), its start kept for right truncation, its end for left.
fn cut_chars(text: &str, limit: usize, direction: TruncationDirection) -> &str {
    match direction {
        TruncationDirection::Right => match text.char_indices().nth(limit) {
            Some((at, _)) => &text[..at],
            None => text,
        },
        TruncationDirection::Left => {
            let chars = text.chars().count();
            if chars <= limit {
                return text;
            }
            let (at, _) = text
                .char_indices()
                .nth(chars - limit)
                .expect("inside the text");
            &text[at..]
        }
    }
}

fn find(hay: &[u32], needle: &[u32]) -> Option<usize> {
    hay.windows(needle.len().max(1))
        .position(|window| window == needle)
}

/// Whether `text` already begins with `prompt` as a client writes it: all of
/// it, ending where a word ends. A prompt that ends inside a word (`"quer"`)
/// is not written at the start of `"query about rivers"`.
fn begins_with_prompt(text: &str, prompt: &str) -> bool {
    if prompt.is_empty() || !text.starts_with(prompt) {
        return false;
    }
    let word_char = |c: char| c.is_alphanumeric();
    !prompt.chars().next_back().is_some_and(word_char)
        || !text[prompt.len()..].chars().next().is_some_and(word_char)
}
