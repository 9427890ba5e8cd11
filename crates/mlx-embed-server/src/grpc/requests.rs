//! A gRPC message as the request the TEI HTTP route builds from the same
//! fields, and answers put back together where one message is several
//! HTTP requests (a `RerankStream` of several queries).

use std::collections::HashMap;

use futures_util::stream::{Stream, StreamExt};
use serde_json::Value;
use tonic::Status;

use super::pb;
use super::status::{size_status, status};
use crate::errors::ApiError;
use crate::extract::{TeiInputs, TextsOrTokens, TruncationSide};
use crate::routes::predict::PredictRequest;
use crate::routes::rerank::TeiRerankRequest;
use crate::routes::tei::{TeiEmbedRequest, TeiRawRequest};

/// TEI's truncation side. TEI's proto declares the field plain (not
/// `optional`), so `RIGHT` is also what a client that sets nothing sends,
/// and TEI cuts it on the right; so do we, whatever the folder's
/// `truncation_side` or `--truncation-side` say. Over HTTP an unsent
/// `truncation_direction` can be told from `"right"`, and takes the folder's.
fn side(value: i32) -> Result<Option<TruncationSide>, ApiError> {
    match pb::TruncationDirection::try_from(value) {
        Ok(pb::TruncationDirection::Right) => Ok(Some(TruncationSide::Right)),
        Ok(pb::TruncationDirection::Left) => Ok(Some(TruncationSide::Left)),
        Err(_) => Err(ApiError::invalid(format!(
            "truncation_direction: {value} is not a TruncationDirection (0 right, 1 left)"
        ))),
    }
}

fn one_text(text: String) -> TeiInputs {
    TeiInputs(TextsOrTokens::Text(text))
}

/// The HTTP `/embed` request for a gRPC `EmbedRequest`.
pub(crate) fn embed_request(r: pb::EmbedRequest) -> Result<TeiEmbedRequest, ApiError> {
    Ok(TeiEmbedRequest {
        model: None,
        inputs: one_text(r.inputs),
        normalize: Some(r.normalize),
        truncate: Some(r.truncate),
        truncation_direction: side(r.truncation_direction)?,
        prompt_name: r.prompt_name,
        task: None,
        dimensions: None,
    })
}

/// The HTTP `/embed_sparse` or `/embed_all` request for a gRPC one's fields.
pub(crate) fn raw_request(
    inputs: String,
    truncate: bool,
    truncation_direction: i32,
    prompt_name: Option<String>,
) -> Result<TeiRawRequest, ApiError> {
    Ok(TeiRawRequest {
        model: None,
        inputs: one_text(inputs),
        truncate: Some(truncate),
        truncation_direction: side(truncation_direction)?,
        prompt_name,
        task: None,
    })
}

/// The HTTP `/predict` request for one text or pair: `[text]` or `[a, b]`
/// (one input, a flat answer), as `/predict` reads it. Any other count is
/// refused here, before the path would read three texts as a batch.
pub(crate) fn predict_request(
    texts: Vec<String>,
    truncate: bool,
    raw_scores: bool,
    truncation_direction: i32,
) -> Result<PredictRequest, ApiError> {
    if !(1..=2).contains(&texts.len()) {
        return Err(ApiError::invalid(format!(
            "inputs: send one text or a pair of two; got {}",
            texts.len()
        )));
    }
    Ok(PredictRequest {
        model: None,
        inputs: Value::Array(texts.into_iter().map(Value::String).collect()),
        raw_scores,
        truncate: Some(truncate),
        truncation_direction: side(truncation_direction)?,
    })
}

/// The HTTP `/rerank` request for a gRPC `RerankRequest`.
pub(crate) fn rerank_request(r: pb::RerankRequest) -> Result<TeiRerankRequest, ApiError> {
    Ok(TeiRerankRequest {
        model: None,
        query: r.query,
        texts: r.texts,
        raw_scores: r.raw_scores,
        return_text: r.return_text,
        truncate: Some(r.truncate),
        truncation_direction: side(r.truncation_direction)?,
        instruction: None,
    })
}

/// A `RerankStream`'s messages as `/rerank` requests, one per query (in the
/// order the queries first came), each with the positions of its texts in
/// the stream. TEI reads `raw_scores` and `return_text` from the first
/// message; so are `truncate` and the side here.
pub(crate) fn rerank_stream_requests(
    messages: Vec<pb::RerankStreamRequest>,
) -> Result<Vec<(Vec<u32>, TeiRerankRequest)>, ApiError> {
    let Some(first) = messages.first() else {
        return Err(ApiError::invalid("no documents to rank: send at least one"));
    };
    let (raw_scores, return_text, truncate) = (first.raw_scores, first.return_text, first.truncate);
    let truncation_direction = side(first.truncation_direction)?;
    let mut groups: Vec<(Vec<u32>, TeiRerankRequest)> = Vec::new();
    // A stream of distinct queries would make a search per message quadratic.
    let mut group_of: HashMap<String, usize> = HashMap::new();
    for (position, m) in messages.into_iter().enumerate() {
        let position = u32::try_from(position).unwrap_or(u32::MAX);
        match group_of.get(&m.query) {
            Some(&g) => {
                let (positions, r) = &mut groups[g];
                positions.push(position);
                r.texts.push(m.text);
            }
            None => {
                group_of.insert(m.query.clone(), groups.len());
                groups.push((
                    vec![position],
                    TeiRerankRequest {
                        model: None,
                        query: m.query,
                        texts: vec![m.text],
                        raw_scores,
                        return_text,
                        truncate: Some(truncate),
                        truncation_direction,
                        instruction: None,
                    },
                ));
            }
        }
    }
    Ok(groups)
}

/// A `RerankStream`'s messages, held until the client is done, within the
/// limits of one HTTP `/rerank` request: `max_inputs` pairs and
/// `max_bytes` in all (each message alone is capped by tonic, but a stream
/// of many would otherwise be held whole, `max_inputs` times over). Refused
/// as soon as it is over, not once the client is done.
pub(crate) async fn rerank_stream_messages(
    mut incoming: impl Stream<Item = Result<pb::RerankStreamRequest, Status>> + Unpin,
    max_inputs: usize,
    max_bytes: usize,
) -> Result<Vec<pb::RerankStreamRequest>, Status> {
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    while let Some(message) = incoming.next().await {
        let message = message.map_err(size_status)?;
        bytes = bytes.saturating_add(prost::Message::encoded_len(&message));
        messages.push(message);
        if messages.len() > max_inputs {
            return Err(status(ApiError::too_many_inputs(
                messages.len(),
                max_inputs,
            )));
        }
        if bytes > max_bytes {
            return Err(status(ApiError::body_too_large(max_bytes)));
        }
    }
    Ok(messages)
}

/// The ranks of several queries' requests as one ranking, best first, each
/// text's index its position in the stream: by score, as TEI orders a
/// stream's pairs (ties in stream order), where one query's ranking is the
/// path's own.
pub(crate) fn merge_ranks(groups: Vec<(Vec<u32>, pb::RerankResponse)>) -> Vec<pb::Rank> {
    let several = groups.len() > 1;
    let mut ranks: Vec<pb::Rank> = groups
        .into_iter()
        .flat_map(|(positions, answer)| {
            answer.ranks.into_iter().map(move |mut rank| {
                rank.index = positions[rank.index as usize];
                rank
            })
        })
        .collect();
    if several {
        ranks.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
    }
    ranks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::status::code;
    use tonic::Code;

    #[test]
    fn embed_request_keeps_proto3_defaults() {
        let r = embed_request(pb::EmbedRequest {
            inputs: "hi".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(r.inputs, one_text("hi".into()));
        assert_eq!((r.normalize, r.truncate), (Some(false), Some(false)));
        // Unsent is RIGHT, which TEI cuts on the right, whatever the folder.
        assert_eq!(r.truncation_direction, Some(TruncationSide::Right));
        let r = embed_request(pb::EmbedRequest {
            inputs: "hi".into(),
            normalize: true,
            truncate: true,
            truncation_direction: pb::TruncationDirection::Left.into(),
            prompt_name: Some("query".into()),
        })
        .unwrap();
        assert_eq!((r.normalize, r.truncate), (Some(true), Some(true)));
        assert_eq!(r.truncation_direction, Some(TruncationSide::Left));
        assert_eq!(r.prompt_name.as_deref(), Some("query"));
        let bad = embed_request(pb::EmbedRequest {
            truncation_direction: 7,
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(code(bad.kind), Code::InvalidArgument);
    }

    #[test]
    fn predict_takes_a_text_or_a_pair() {
        let r = predict_request(vec!["a".into(), "b".into()], true, true, 0).unwrap();
        assert_eq!(r.inputs, serde_json::json!(["a", "b"]));
        assert!(r.raw_scores);
        for n in [0, 3] {
            let e = predict_request(vec!["a".into(); n], true, false, 0).unwrap_err();
            assert_eq!(code(e.kind), Code::InvalidArgument, "{n}");
        }
    }

    #[test]
    fn a_rerank_stream_is_a_request_per_query_on_its_first_messages_flags() {
        let message = |query: &str, text: &str, raw: bool| pb::RerankStreamRequest {
            query: query.into(),
            text: text.into(),
            raw_scores: raw,
            return_text: raw,
            ..Default::default()
        };
        let groups = rerank_stream_requests(vec![
            message("q", "a", true),
            message("p", "b", false),
            message("q", "c", false),
        ])
        .unwrap();
        assert_eq!(groups.len(), 2);
        let (positions, r) = &groups[0];
        assert_eq!(
            (positions.as_slice(), r.query.as_str()),
            ([0, 2].as_slice(), "q")
        );
        assert_eq!(r.texts, ["a", "c"]);
        assert!(r.raw_scores && r.return_text);
        let (positions, r) = &groups[1];
        assert_eq!(
            (positions.as_slice(), r.texts.as_slice()),
            ([1].as_slice(), ["b".to_owned()].as_slice())
        );
        assert!(r.raw_scores && r.return_text);
        assert!(rerank_stream_requests(Vec::new()).is_err());
    }

    #[tokio::test]
    async fn a_rerank_stream_is_held_within_one_rerank_requests_limits() {
        let stream = |texts: Vec<String>| {
            futures_util::stream::iter(texts.into_iter().map(|text| {
                Ok(pb::RerankStreamRequest {
                    query: "q".into(),
                    text,
                    ..Default::default()
                })
            }))
        };
        let held = rerank_stream_messages(stream(vec!["a".into(), "b".into()]), 2, 100)
            .await
            .unwrap();
        assert_eq!(held.len(), 2);
        let many = rerank_stream_messages(stream(vec!["a".into(), "b".into(), "c".into()]), 2, 100)
            .await
            .unwrap_err();
        assert_eq!(many.code(), Code::ResourceExhausted);
        assert!(
            many.message().contains("--max-inputs-per-request"),
            "{many:?}"
        );
        // Each message is 3 + 7 bytes: the third goes over 25 in all.
        let big = "x".repeat(5);
        let heavy = rerank_stream_messages(stream(vec![big.clone(), big.clone(), big]), 10, 25)
            .await
            .unwrap_err();
        assert_eq!(heavy.code(), Code::ResourceExhausted);
        assert_eq!(
            heavy.message(),
            "request body is larger than the limit of 25 bytes (--max-body-bytes)"
        );
    }

    #[test]
    fn several_queries_ranks_merge_by_score_at_their_stream_positions() {
        let rank = |index, score| pb::Rank {
            index,
            text: None,
            score,
        };
        let answer = |ranks| pb::RerankResponse {
            ranks,
            metadata: None,
        };
        let merged = merge_ranks(vec![
            (vec![0, 2], answer(vec![rank(1, 0.9), rank(0, 0.1)])),
            (vec![1, 3], answer(vec![rank(0, 0.5), rank(1, 0.1)])),
        ]);
        let got: Vec<(u32, f32)> = merged.iter().map(|r| (r.index, r.score)).collect();
        assert_eq!(got, [(2, 0.9), (1, 0.5), (0, 0.1), (3, 0.1)]);
        // One query: the path's own order, indices mapped.
        let one = merge_ranks(vec![(vec![4, 7], answer(vec![rank(1, 0.2), rank(0, 0.2)]))]);
        assert_eq!(one.iter().map(|r| r.index).collect::<Vec<_>>(), [7, 4]);
    }

    #[test]
    fn rerank_request_fields() {
        let r = rerank_request(pb::RerankRequest {
            query: "q".into(),
            texts: vec!["a".into()],
            truncate: true,
            raw_scores: true,
            return_text: true,
            truncation_direction: 0,
        })
        .unwrap();
        assert_eq!((r.query.as_str(), r.texts.len()), ("q", 1));
        assert_eq!(r.truncate, Some(true));
        assert!(r.raw_scores && r.return_text && r.instruction.is_none());
    }
}
