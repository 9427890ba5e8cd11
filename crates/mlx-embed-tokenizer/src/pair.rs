//! Query/document pairs for cross-encoders (the Python `spec.PairSpec` and
//! `mlx_embed.pairs`; a test holds both to identical ids).
//!
//! Two styles:
//!
//! * **segments** (BERT, XLM-RoBERTa cross-encoders): both texts encoded
//!   without specials, cut by Hugging Face's `longest_first` rule
//!   ([`truncate_pair_lengths`]), then `prefix + query + middle + document +
//!   suffix` (`[CLS] q [SEP] d [SEP]`, `<s> q </s></s> d </s>`), with token
//!   types when the model has them;
//! * **template** (decoder rerankers such as Qwen3-Reranker): the pair is
//!   written into one text ([`PairSpec::template`]), encoded without specials,
//!   cut like a single text and wrapped in the prompt's own ids; a chat
//!   template's closing text is encoded with it ([`PairSpec::suffix_text`]).

use mlx_embed_core::TruncationDirection;

/// How a pair becomes one input; filled by the bridge from the model's
/// `spec().tokenizer.pair`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PairSpec {
    /// Ids before the query (segments) or the prompt before the pair text (template).
    pub prefix_ids: Vec<u32>,
    /// Ids between query and document (segments only).
    pub middle_ids: Vec<u32>,
    /// Ids after the document (segments) or the prompt after the pair text (template).
    pub suffix_ids: Vec<u32>,
    /// Token type of `prefix + query + middle`.
    pub first_type_id: u32,
    /// Token type of `document + suffix`; no types are sent when both are 0.
    pub second_type_id: u32,
    /// Template style: the pair text with `{instruction}`, `{query}` and
    /// `{document}` replaced (in one pass: a query may contain braces).
    pub template: Option<String>,
    /// What `{instruction}` becomes.
    pub default_instruction: Option<String>,
    /// Template: the prompt's closing text, encoded with the pair text (a
    /// chat template's render, which sentence-transformers 6 tokenizes as
    /// one text: a document's last characters may merge with it). The pair
    /// is then `prefix + encode(text + suffix_text)`; where that reaches the
    /// limit, its first `limit - suffix_ids.len()` tokens and `suffix_ids`,
    /// the tail sentence-transformers writes back over a cut. None: the
    /// pair text is encoded alone and `suffix_ids` always follow it.
    pub suffix_text: Option<String>,
    /// Segments: text written before the query and encoded with it
    /// (mxbai-rerank v2's `"query: "`: its library encodes each side apart).
    pub query_prompt: Option<String>,
    /// Segments: text written before the document and encoded with it.
    pub document_prompt: Option<String>,
    /// Segments: with a request's instruction, this text with
    /// `{instruction}` replaced goes before `query_prompt`; without it a
    /// segment pair takes no instruction.
    pub instruction_prompt: Option<String>,
    /// Segments: `(n, d)` replaces `longest_first` by a reranker library's
    /// cut ([`query_first_lengths`]) in its own `max_length`, `room =
    /// max_length - uncounted`: the query keeps at most `room * n / d`
    /// tokens, the document at most `room` and what the budget leaves.
    pub query_share: Option<(usize, usize)>,
    /// The input's tokens the library's `max_length` leaves out
    /// (mxbai-rerank: its fixed prompt; FlagEmbedding's LLM reranker:
    /// twice its separator and task prompt).
    pub uncounted: usize,
    /// Segments (FlagEmbedding's `prompt=`): a request's instruction,
    /// encoded alone without specials, goes after these ids in place of
    /// `suffix_ids` ([`PairSpec::with_instruction_suffix`]). None: the
    /// instruction goes before the query (`instruction_prompt`), if anywhere.
    pub instruction_suffix_ids: Option<Vec<u32>>,
    /// How many times the suffix counts in `uncounted` (FlagEmbedding: 2),
    /// so that a request's own suffix moves it.
    pub suffix_uncounted: usize,
    /// A decoder reranker's pairs in the tokenizer's own pair encoding (a
    /// text-only `LogitScore` folder): a lone text has no meaning for it.
    pub pairs_only: bool,
}

impl PairSpec {
    /// Special ids a pair adds around its content.
    pub fn specials(&self) -> usize {
        self.prefix_ids.len() + self.middle_ids.len() + self.suffix_ids.len()
    }

    /// A decoder reranker's spec (a template, prompted segments, or the
    /// tokenizer's pair marked `pairs_only`) has no meaning for a lone text.
    pub fn pairs_only(&self) -> bool {
        self.pairs_only
            || self.template.is_some()
            || self.query_prompt.is_some()
            || self.query_share.is_some()
    }

    /// Whether the model takes token types (BERT), so pairs carry them.
    pub fn uses_type_ids(&self) -> bool {
        self.template.is_none() && (self.first_type_id != 0 || self.second_type_id != 0)
    }

    /// The text before a segment pair's query: the instruction's (a
    /// non-empty one, as the mxbai-rerank library reads it) and the query's
    /// prompt; None when an instruction is given to a spec that takes none.
    pub fn query_prefix(&self, instruction: Option<&str>) -> Option<String> {
        let prompt = self.query_prompt.as_deref().unwrap_or("");
        match (instruction, self.instruction_prompt.as_deref()) {
            (None, _) => Some(prompt.to_owned()),
            (Some(_), None) => None,
            (Some(""), Some(_)) => Some(prompt.to_owned()),
            (Some(text), Some(template)) => Some(format!(
                "{}{prompt}",
                template.replace("{instruction}", text)
            )),
        }
    }

    /// The spec of a request whose instruction (its ids, `instruction`)
    /// ends the input in place of the task prompt: the suffix is
    /// `instruction_suffix_ids` and the instruction's, and the library's
    /// uncounted tokens move with it, so `max_length` still bounds the whole
    /// input. None when the spec takes no instruction there.
    pub fn with_instruction_suffix(&self, instruction: &[u32]) -> Option<PairSpec> {
        let lead = self.instruction_suffix_ids.as_ref()?;
        let suffix_ids = [&lead[..], instruction].concat();
        let uncounted = (self.uncounted + self.suffix_uncounted * suffix_ids.len())
            .saturating_sub(self.suffix_uncounted * self.suffix_ids.len());
        Some(PairSpec {
            suffix_ids,
            uncounted,
            ..self.clone()
        })
    }

    /// The content lengths a segment pair keeps within `budget` content
    /// tokens: [`query_first_lengths`] with a `query_share`, else
    /// [`truncate_pair_lengths`].
    pub fn segment_lengths(&self, n1: usize, n2: usize, budget: usize) -> (usize, usize) {
        match self.query_share {
            Some(share) => {
                let room = (budget + self.specials()).saturating_sub(self.uncounted);
                query_first_lengths(n1, n2, budget, room, share)
            }
            None => truncate_pair_lengths(n1, n2, budget),
        }
    }

    /// The pair text of the template style.
    pub fn format(&self, query: &str, document: &str) -> Option<String> {
        let template = self.template.as_deref()?;
        let instruction = self.default_instruction.as_deref().unwrap_or("");
        let mut out = String::with_capacity(template.len() + query.len() + document.len());
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let tail = &rest[open..];
            let field = [
                ("{instruction}", instruction),
                ("{query}", query),
                ("{document}", document),
            ]
            .into_iter()
            .find(|(name, _)| tail.starts_with(name));
            match field {
                Some((name, value)) => {
                    out.push_str(value);
                    rest = &tail[name.len()..];
                }
                None => {
                    out.push('{');
                    rest = &tail[1..];
                }
            }
        }
        out.push_str(rest);
        Some(out)
    }
}

/// Content lengths Hugging Face tokenizers keep under `longest_first`
/// truncation of a pair to `budget` content tokens: the longer side gives up
/// tokens until both fit; when both are long they share the budget and the
/// second gets the odd token.
pub fn truncate_pair_lengths(n1: usize, n2: usize, budget: usize) -> (usize, usize) {
    if n1 + n2 <= budget {
        return (n1, n2);
    }
    let swap = n1 > n2;
    // Only the shorter length matters from here: the longer side is cut to fit it.
    let mut short = n1.min(n2);
    let mut long = if short > budget {
        short
    } else {
        short.max(budget - short)
    };
    if short + long > budget {
        short = budget / 2;
        long = short + budget % 2;
    }
    if swap {
        (long, short)
    } else {
        (short, long)
    }
}

/// Content lengths kept by a reranker library's query-first cut in its own
/// `max_length` (`room`): the query keeps at most `room * n / d` tokens
/// (`max_length * 3 // 4` in mxbai-rerank v2 and FlagEmbedding), the
/// document at most `room` and what the budget leaves.
pub fn query_first_lengths(
    n1: usize,
    n2: usize,
    budget: usize,
    room: usize,
    (num, den): (usize, usize),
) -> (usize, usize) {
    let query = n1.min(room * num / den.max(1)).min(budget);
    (query, n2.min(room).min(budget - query))
}

/// The first `n` tokens (`Right`) or the last `n` (`Left`).
pub(crate) fn cut(ids: &[u32], n: usize, direction: TruncationDirection) -> &[u32] {
    if ids.len() <= n {
        return ids;
    }
    match direction {
        TruncationDirection::Right => &ids[..n],
        TruncationDirection::Left => &ids[ids.len() - n..],
    }
}

/// A template pair's `content` (its pair text's ids) cut to `budget`
/// tokens from the start of its document, so the instruction and the query
/// stay and the document keeps its end: what `Left` truncation means for a
/// pair. `frame` is the same pair text with an empty document; the document
/// is where the two differ (common leading and trailing ids are the frame's,
/// so a token merged across the document's edge counts as the document's).
/// Only when the frame alone is over the budget is the rest cut from the
/// left as well.
pub(crate) fn cut_document_start(content: &[u32], frame: &[u32], budget: usize) -> Vec<u32> {
    if content.len() <= budget {
        return content.to_vec();
    }
    let head = content
        .iter()
        .zip(frame)
        .take_while(|(a, b)| a == b)
        .count();
    let tail = content[head..]
        .iter()
        .rev()
        .zip(frame[head.min(frame.len())..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let document_end = content.len() - tail;
    let overflow = content.len() - budget;
    if overflow <= document_end - head {
        return [&content[..head], &content[head + overflow..]].concat();
    }
    let rest = [&content[..head], &content[document_end..]].concat();
    cut(&rest, budget, TruncationDirection::Left).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_gives_up_its_first_tokens() {
        // frame: [1 2 3 | 9]; content: [1 2 3 | 5 6 7 8 | 9].
        let frame = [1, 2, 3, 9];
        let content = [1, 2, 3, 5, 6, 7, 8, 9];
        assert_eq!(cut_document_start(&content, &frame, 8), content);
        assert_eq!(cut_document_start(&content, &frame, 6), [1, 2, 3, 7, 8, 9]);
        assert_eq!(cut_document_start(&content, &frame, 4), [1, 2, 3, 9]);
        // The frame alone is over the budget: its start goes too.
        assert_eq!(cut_document_start(&content, &frame, 3), [2, 3, 9]);
        // A token merged across the document's start belongs to the document.
        let merged = [1, 2, 4, 6, 7, 8, 9];
        assert_eq!(cut_document_start(&merged, &frame, 5), [1, 2, 7, 8, 9]);
        // The document at the very end of the pair text.
        assert_eq!(cut_document_start(&[1, 2, 5, 6, 7], &[1, 2], 3), [1, 2, 7]);
    }

    #[test]
    fn longest_first_cases() {
        // Fits: untouched.
        assert_eq!(truncate_pair_lengths(3, 4, 7), (3, 4));
        // Only the longer side is cut.
        assert_eq!(truncate_pair_lengths(2, 10, 7), (2, 5));
        assert_eq!(truncate_pair_lengths(10, 2, 7), (5, 2));
        // Both long: the budget is shared, the second side gets the odd token.
        assert_eq!(truncate_pair_lengths(10, 10, 7), (3, 4));
        assert_eq!(truncate_pair_lengths(10, 9, 8), (4, 4));
        // The shorter side alone is over the budget.
        assert_eq!(truncate_pair_lengths(9, 12, 5), (2, 3));
        assert_eq!(truncate_pair_lengths(0, 12, 5), (0, 5));
    }

    #[test]
    fn query_first_cases() {
        // A short query: the document takes the rest.
        assert_eq!(query_first_lengths(10, 500, 127, 128, (3, 4)), (10, 117));
        // A long one keeps 128 * 3 / 4, beside any document.
        assert_eq!(query_first_lengths(300, 500, 127, 128, (3, 4)), (96, 31));
        assert_eq!(query_first_lengths(300, 5, 127, 128, (3, 4)), (96, 5));
        assert_eq!(query_first_lengths(100, 0, 3, 4, (3, 4)), (3, 0));
        // FlagEmbedding's: a budget past the room (its prompt's room given
        // to the pair); the document alone is cut to the room.
        assert_eq!(query_first_lengths(10, 500, 194, 128, (3, 4)), (10, 128));
        assert_eq!(query_first_lengths(300, 500, 194, 128, (3, 4)), (96, 98));
        assert_eq!(query_first_lengths(300, 5, 194, 128, (3, 4)), (96, 5));
    }

    #[test]
    fn query_prefix_with_and_without_an_instruction() {
        let spec = PairSpec {
            query_prompt: Some("query: ".into()),
            instruction_prompt: Some("instruction: {instruction}\n".into()),
            ..PairSpec::default()
        };
        assert_eq!(spec.query_prefix(None).unwrap(), "query: ");
        assert_eq!(spec.query_prefix(Some("")).unwrap(), "query: ");
        assert_eq!(
            spec.query_prefix(Some("find")).unwrap(),
            "instruction: find\nquery: "
        );
        assert_eq!(PairSpec::default().query_prefix(Some("find")), None);
        assert_eq!(PairSpec::default().query_prefix(None).unwrap(), "");
    }

    #[test]
    fn an_instruction_replaces_the_task_prompt() {
        let spec = PairSpec {
            prefix_ids: vec![2],
            middle_ids: vec![9],
            suffix_ids: vec![9, 5, 6, 7],
            query_share: Some((3, 4)),
            uncounted: 8,
            instruction_suffix_ids: Some(vec![9]),
            suffix_uncounted: 2,
            ..PairSpec::default()
        };
        let long = spec.with_instruction_suffix(&[1, 1, 1, 1, 1]).unwrap();
        assert_eq!(
            (long.suffix_ids, long.uncounted),
            (vec![9, 1, 1, 1, 1, 1], 12)
        );
        let empty = spec.with_instruction_suffix(&[]).unwrap();
        assert_eq!((empty.suffix_ids, empty.uncounted), (vec![9], 2));
        let none = PairSpec {
            instruction_suffix_ids: None,
            ..spec
        };
        assert!(none.with_instruction_suffix(&[1]).is_none());
    }

    #[test]
    fn template_fills_each_field_once() {
        let spec = PairSpec {
            template: Some("<I>: {instruction}\n<Q>: {query}\n<D>: {document} {x}".into()),
            default_instruction: Some("find".into()),
            ..PairSpec::default()
        };
        assert_eq!(
            spec.format("{document}", "d{query}").unwrap(),
            "<I>: find\n<Q>: {document}\n<D>: d{query} {x}"
        );
        assert_eq!(PairSpec::default().format("q", "d"), None);
    }

    #[test]
    fn cut_keeps_the_chosen_end() {
        let ids = [1, 2, 3, 4, 5];
        assert_eq!(cut(&ids, 2, TruncationDirection::Right), &[1, 2]);
        assert_eq!(cut(&ids, 2, TruncationDirection::Left), &[4, 5]);
        assert_eq!(cut(&ids, 9, TruncationDirection::Left), &ids);
    }
}
