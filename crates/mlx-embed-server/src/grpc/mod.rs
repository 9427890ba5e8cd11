//! Hugging Face TEI's gRPC API (package `tei.v1`, `proto/tei.proto`),
//! served on its own listener with `--grpc-port`.
//!
//! Every method is an adapter: it builds the request the TEI HTTP route
//! builds from the same fields and runs it down the same path (the embed
//! path, the scoring path, the tokenizer routes), so validation, limits,
//! batching and scores are the HTTP API's. What differs is TEI's gRPC
//! shape: one text per message, proto3's defaults (`truncate` and
//! `normalize` false unless sent, as TEI's gRPC reads them), and errors as
//! gRPC status codes ([`code`]). Streams answer one message per message, in
//! the order sent, computing up to [`STREAM_CONCURRENCY`] at a time; the
//! first failure ends the stream with its status, as TEI's do. A large
//! answer waits for the answer room (`--max-unsent-answers-mb`) as over
//! HTTP, but is not counted in it while written (the layer that counts
//! HTTP answers goes by a body's known size, which a gRPC body does not tell).

mod serve;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use axum::extract::State;
use futures_util::stream::{Stream, StreamExt};
use mlx_embed_core::Output;
use serde_json::Value;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::embed::{embed as run_embed, embed_sparse as run_embed_sparse};
use crate::errors::{ApiError, ErrorKind};
use crate::extract::{TeiInputs, TextInputs, TextsOrTokens, TruncationSide};
use crate::routes::ops::{info as http_info, TeiModelType};
use crate::routes::predict::{predict_body, PredictRequest, PredictResponse};
use crate::routes::rerank::{tei_rank, TeiRerankRequest};
use crate::routes::tei::{TeiEmbedRequest, TeiRawRequest};
use crate::routes::tokens::{
    decode_ids, tokenize_texts, DecodeIds, DecodeRequest, TokenizeRequest,
};
use crate::state::AppState;

pub(crate) use serve::{bind, serve};

/// The code generated from `proto/tei.proto` by build.rs.
#[allow(clippy::all, clippy::pedantic, missing_docs, unreachable_pub)]
pub(crate) mod pb {
    tonic::include_proto!("tei.v1");
}

/// Messages of one stream computed at once: enough for a stream of single
/// texts to fill the batcher's batches (each message is a request of its
/// own there), few enough that one stream cannot queue without bound.
pub(crate) const STREAM_CONCURRENCY: usize = 64;

/// The gRPC status code of an error kind, as TEI's gRPC server maps its
/// error types: a request at fault is `INVALID_ARGUMENT`, overload
/// `RESOURCE_EXHAUSTED`, a model that cannot answer (or a server that is
/// draining) `UNAVAILABLE`, a model that failed on the request
/// `FAILED_PRECONDITION` (TEI's code for its backend's errors).
pub(crate) fn code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidRequest | ErrorKind::Unprocessable | ErrorKind::UnsupportedMediaType => {
            Code::InvalidArgument
        }
        ErrorKind::Unauthorized => Code::Unauthenticated,
        ErrorKind::Forbidden => Code::PermissionDenied,
        ErrorKind::Timeout => Code::DeadlineExceeded,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::MethodNotAllowed | ErrorKind::NotImplemented => Code::Unimplemented,
        // A size limit (--max-inputs-per-request, the per-token answer's
        // cap): gRPC's code for a message over a limit.
        ErrorKind::TooLarge => Code::ResourceExhausted,
        ErrorKind::Overloaded => Code::ResourceExhausted,
        ErrorKind::Model => Code::FailedPrecondition,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::ClientClosed => Code::Cancelled,
    }
}

/// `err` as a gRPC status: its code ([`code`]) and message.
pub(crate) fn status(err: ApiError) -> Status {
    Status::new(code(err.kind), err.message)
}

/// TEI's truncation side: `RIGHT` is proto3's default, so it cannot be told
/// from unsent; it leaves the side to the model folder (`truncation_side`,
/// else right), as an unsent `truncation_direction` does over HTTP.
fn side(value: i32) -> Result<Option<TruncationSide>, ApiError> {
    match pb::TruncationDirection::try_from(value) {
        Ok(pb::TruncationDirection::Right) => Ok(None),
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
async fn rerank_stream_messages(
    mut incoming: impl Stream<Item = Result<pb::RerankStreamRequest, Status>> + Unpin,
    max_inputs: usize,
    max_bytes: usize,
) -> Result<Vec<pb::RerankStreamRequest>, Status> {
    let mut messages = Vec::new();
    let mut bytes = 0usize;
    while let Some(message) = incoming.next().await {
        let message = message.map_err(serve::size_status)?;
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
fn merge_ranks(groups: Vec<(Vec<u32>, pb::RerankResponse)>) -> Vec<pb::Rank> {
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

/// TEI's per-call figures: what is known here (characters, tokens the
/// model ran, total time); the phases' times are not measured apart.
fn metadata(chars: usize, tokens: u64, start: Instant) -> Option<pb::Metadata> {
    Some(pb::Metadata {
        compute_chars: u32::try_from(chars).unwrap_or(u32::MAX),
        compute_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
        total_time_ns: u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX),
        ..pb::Metadata::default()
    })
}

/// The served model and limits: `/info`'s answer in TEI's gRPC fields.
#[derive(Clone)]
pub(crate) struct Tei {
    state: AppState,
}

async fn embed_one(state: AppState, r: pb::EmbedRequest) -> Result<pb::EmbedResponse, ApiError> {
    let start = Instant::now();
    let chars = r.inputs.chars().count();
    let req = embed_request(r)?.into_request(&state, None)?;
    let mut out = run_embed(&state, req).await?;
    Ok(pb::EmbedResponse {
        embeddings: out.vectors.pop().unwrap_or_default(),
        metadata: metadata(chars, out.prompt_tokens, start),
    })
}

async fn embed_sparse_one(
    state: AppState,
    r: pb::EmbedSparseRequest,
) -> Result<pb::EmbedSparseResponse, ApiError> {
    let start = Instant::now();
    let chars = r.inputs.chars().count();
    let req = raw_request(r.inputs, r.truncate, r.truncation_direction, r.prompt_name)?
        .into_request(&state, None, Output::Pooled)?;
    let mut out = run_embed_sparse(&state, req).await?;
    Ok(pb::EmbedSparseResponse {
        sparse_embeddings: out
            .entries
            .pop()
            .unwrap_or_default()
            .into_iter()
            .map(|(index, value)| pb::SparseValue { index, value })
            .collect(),
        metadata: metadata(chars, out.prompt_tokens, start),
    })
}

async fn embed_all_one(
    state: AppState,
    r: pb::EmbedAllRequest,
) -> Result<pb::EmbedAllResponse, ApiError> {
    let start = Instant::now();
    let chars = r.inputs.chars().count();
    let req = raw_request(r.inputs, r.truncate, r.truncation_direction, r.prompt_name)?
        .into_request(&state, None, Output::Tokens)?;
    let out = run_embed(&state, req).await?;
    let width = out.dimension;
    let rows = out.vectors.into_iter().next().unwrap_or_default();
    Ok(pb::EmbedAllResponse {
        // Width 0: the input had no token (a static model's blank text).
        token_embeddings: match width {
            0 => Vec::new(),
            _ => rows
                .chunks_exact(width)
                .map(|row| pb::TokenEmbedding {
                    embeddings: row.to_vec(),
                })
                .collect(),
        },
        metadata: metadata(chars, out.prompt_tokens, start),
    })
}

async fn predict_one(
    state: AppState,
    texts: Vec<String>,
    truncate: bool,
    raw_scores: bool,
    truncation_direction: i32,
) -> Result<pb::PredictResponse, ApiError> {
    let start = Instant::now();
    let chars = texts.iter().map(|t| t.chars().count()).sum();
    let req = predict_request(texts, truncate, raw_scores, truncation_direction)?;
    let predictions = match predict_body(&state, req, None).await? {
        PredictResponse::Single(p) => p,
        // A one-input request is answered flat; a batch never comes from here.
        PredictResponse::Batch(mut all) => all.pop().unwrap_or_default(),
    };
    Ok(pb::PredictResponse {
        predictions: predictions
            .into_iter()
            .map(|p| pb::Prediction {
                score: p.score,
                label: p.label,
            })
            .collect(),
        metadata: metadata(chars, 0, start),
    })
}

async fn rerank_one(
    state: &AppState,
    req: TeiRerankRequest,
) -> Result<pb::RerankResponse, ApiError> {
    let start = Instant::now();
    let chars = req.query.chars().count() * req.texts.len()
        + req.texts.iter().map(|t| t.chars().count()).sum::<usize>();
    let ranks = tei_rank(state, req, None).await?;
    Ok(pb::RerankResponse {
        ranks: ranks
            .into_iter()
            .map(|r| pb::Rank {
                index: u32::try_from(r.index).unwrap_or(u32::MAX),
                text: r.text,
                score: r.score,
            })
            .collect(),
        metadata: metadata(chars, 0, start),
    })
}

async fn tokenize_one(
    state: AppState,
    r: pb::EncodeRequest,
) -> Result<pb::EncodeResponse, ApiError> {
    let req = TokenizeRequest {
        model: None,
        inputs: TextInputs::One(r.inputs),
        add_special_tokens: Some(r.add_special_tokens),
        prompt_name: r.prompt_name,
    };
    let tokens = tokenize_texts(&state, req).await?.pop().unwrap_or_default();
    let offset = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Ok(pb::EncodeResponse {
        tokens: tokens
            .into_iter()
            .map(|t| pb::SimpleToken {
                id: t.id,
                text: t.text,
                special: t.special,
                start: t.start.map(offset),
                stop: t.stop.map(offset),
            })
            .collect(),
    })
}

async fn decode_one(state: AppState, r: pb::DecodeRequest) -> Result<pb::DecodeResponse, ApiError> {
    let req = DecodeRequest {
        model: None,
        ids: DecodeIds::One(r.ids),
        skip_special_tokens: Some(r.skip_special_tokens),
    };
    let text = decode_ids(&state, req)?.pop().unwrap_or_default();
    Ok(pb::DecodeResponse { text })
}

type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// A stream's answers: `answer` for each message, up to
/// [`STREAM_CONCURRENCY`] at once, in the order the messages came; ends
/// after the first failure (a message tonic could not read included).
fn answer_each<Q, A, F, Fut>(state: &AppState, incoming: Streaming<Q>, answer: F) -> Answers<A>
where
    Q: Send + 'static,
    A: Send + 'static,
    F: Fn(AppState, Q) -> Fut + Send + 'static,
    Fut: Future<Output = Result<A, ApiError>> + Send + 'static,
{
    let state = state.clone();
    let answers = incoming
        .map(move |message| {
            let work = message.map(|q| answer(state.clone(), q));
            async move {
                match work {
                    Ok(work) => work.await.map_err(status),
                    Err(unreadable) => Err(serve::size_status(unreadable)),
                }
            }
        })
        .buffered(STREAM_CONCURRENCY)
        .scan(false, |failed, answer| {
            let next = (!*failed).then(|| {
                *failed = answer.is_err();
                answer
            });
            futures_util::future::ready(next)
        });
    Box::pin(answers)
}

fn reply<T>(answer: Result<T, ApiError>) -> Result<Response<T>, Status> {
    answer.map(Response::new).map_err(status)
}

#[tonic::async_trait]
impl pb::info_server::Info for Tei {
    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let info = http_info(State(self.state.clone())).await.0;
        let size = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let model_type = match info.model_type {
            TeiModelType::Embedding { .. } => pb::ModelType::Embedding,
            TeiModelType::Classifier(_) => pb::ModelType::Classifier,
            TeiModelType::Reranker(_) => pb::ModelType::Reranker,
        };
        Ok(Response::new(pb::InfoResponse {
            version: info.version,
            sha: info.sha,
            docker_label: info.docker_label,
            model_id: info.model_id,
            model_sha: info.model_sha,
            model_dtype: info.model_dtype,
            model_type: model_type.into(),
            max_concurrent_requests: size(info.max_concurrent_requests),
            max_input_length: size(info.max_input_length),
            max_batch_tokens: size(info.max_batch_tokens),
            max_batch_requests: Some(size(info.max_batch_requests)),
            max_client_batch_size: size(info.max_client_batch_size),
            tokenization_workers: size(info.tokenization_workers),
        }))
    }
}

#[tonic::async_trait]
impl pb::embed_server::Embed for Tei {
    async fn embed(
        &self,
        request: Request<pb::EmbedRequest>,
    ) -> Result<Response<pb::EmbedResponse>, Status> {
        reply(embed_one(self.state.clone(), request.into_inner()).await)
    }

    type EmbedStreamStream = Answers<pb::EmbedResponse>;

    async fn embed_stream(
        &self,
        request: Request<Streaming<pb::EmbedRequest>>,
    ) -> Result<Response<Self::EmbedStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            embed_one,
        )))
    }

    async fn embed_sparse(
        &self,
        request: Request<pb::EmbedSparseRequest>,
    ) -> Result<Response<pb::EmbedSparseResponse>, Status> {
        reply(embed_sparse_one(self.state.clone(), request.into_inner()).await)
    }

    type EmbedSparseStreamStream = Answers<pb::EmbedSparseResponse>;

    async fn embed_sparse_stream(
        &self,
        request: Request<Streaming<pb::EmbedSparseRequest>>,
    ) -> Result<Response<Self::EmbedSparseStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            embed_sparse_one,
        )))
    }

    async fn embed_all(
        &self,
        request: Request<pb::EmbedAllRequest>,
    ) -> Result<Response<pb::EmbedAllResponse>, Status> {
        reply(embed_all_one(self.state.clone(), request.into_inner()).await)
    }

    type EmbedAllStreamStream = Answers<pb::EmbedAllResponse>;

    async fn embed_all_stream(
        &self,
        request: Request<Streaming<pb::EmbedAllRequest>>,
    ) -> Result<Response<Self::EmbedAllStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            embed_all_one,
        )))
    }
}

#[tonic::async_trait]
impl pb::predict_server::Predict for Tei {
    async fn predict(
        &self,
        request: Request<pb::PredictRequest>,
    ) -> Result<Response<pb::PredictResponse>, Status> {
        let r = request.into_inner();
        let answer = predict_one(
            self.state.clone(),
            vec![r.inputs],
            r.truncate,
            r.raw_scores,
            r.truncation_direction,
        );
        reply(answer.await)
    }

    async fn predict_pair(
        &self,
        request: Request<pb::PredictPairRequest>,
    ) -> Result<Response<pb::PredictResponse>, Status> {
        let r = request.into_inner();
        let answer = predict_one(
            self.state.clone(),
            r.inputs,
            r.truncate,
            r.raw_scores,
            r.truncation_direction,
        );
        reply(answer.await)
    }

    type PredictStreamStream = Answers<pb::PredictResponse>;

    async fn predict_stream(
        &self,
        request: Request<Streaming<pb::PredictRequest>>,
    ) -> Result<Response<Self::PredictStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            |state, r: pb::PredictRequest| {
                predict_one(
                    state,
                    vec![r.inputs],
                    r.truncate,
                    r.raw_scores,
                    r.truncation_direction,
                )
            },
        )))
    }

    type PredictPairStreamStream = Answers<pb::PredictResponse>;

    async fn predict_pair_stream(
        &self,
        request: Request<Streaming<pb::PredictPairRequest>>,
    ) -> Result<Response<Self::PredictPairStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            |state, r: pb::PredictPairRequest| {
                predict_one(
                    state,
                    r.inputs,
                    r.truncate,
                    r.raw_scores,
                    r.truncation_direction,
                )
            },
        )))
    }
}

#[tonic::async_trait]
impl pb::rerank_server::Rerank for Tei {
    async fn rerank(
        &self,
        request: Request<pb::RerankRequest>,
    ) -> Result<Response<pb::RerankResponse>, Status> {
        let answer = async {
            let req = rerank_request(request.into_inner())?;
            rerank_one(&self.state, req).await
        };
        reply(answer.await)
    }

    async fn rerank_stream(
        &self,
        request: Request<Streaming<pb::RerankStreamRequest>>,
    ) -> Result<Response<pb::RerankResponse>, Status> {
        let args = self.state.args();
        let messages = rerank_stream_messages(
            request.into_inner(),
            args.max_inputs_per_request,
            args.max_body_bytes,
        )
        .await?;
        let start = Instant::now();
        let answer = async {
            let groups = rerank_stream_requests(messages)?;
            let (positions, requests): (Vec<_>, Vec<_>) = groups.into_iter().unzip();
            let answers = futures_util::future::try_join_all(
                requests.into_iter().map(|req| rerank_one(&self.state, req)),
            )
            .await?;
            let chars = answers
                .iter()
                .filter_map(|a| a.metadata.map(|m| m.compute_chars))
                .fold(0u32, u32::saturating_add);
            Ok(pb::RerankResponse {
                ranks: merge_ranks(positions.into_iter().zip(answers).collect()),
                metadata: metadata(chars as usize, 0, start),
            })
        };
        reply(answer.await)
    }
}

#[tonic::async_trait]
impl pb::tokenize_server::Tokenize for Tei {
    async fn tokenize(
        &self,
        request: Request<pb::EncodeRequest>,
    ) -> Result<Response<pb::EncodeResponse>, Status> {
        reply(tokenize_one(self.state.clone(), request.into_inner()).await)
    }

    type TokenizeStreamStream = Answers<pb::EncodeResponse>;

    async fn tokenize_stream(
        &self,
        request: Request<Streaming<pb::EncodeRequest>>,
    ) -> Result<Response<Self::TokenizeStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            tokenize_one,
        )))
    }

    async fn decode(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<pb::DecodeResponse>, Status> {
        reply(decode_one(self.state.clone(), request.into_inner()).await)
    }

    type DecodeStreamStream = Answers<pb::DecodeResponse>;

    async fn decode_stream(
        &self,
        request: Request<Streaming<pb::DecodeRequest>>,
    ) -> Result<Response<Self::DecodeStreamStream>, Status> {
        Ok(Response::new(answer_each(
            &self.state,
            request.into_inner(),
            decode_one,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kinds_map_to_tei_codes() {
        let cases = [
            (ErrorKind::InvalidRequest, Code::InvalidArgument),
            (ErrorKind::Unprocessable, Code::InvalidArgument),
            (ErrorKind::Unauthorized, Code::Unauthenticated),
            (ErrorKind::Overloaded, Code::ResourceExhausted),
            (ErrorKind::TooLarge, Code::ResourceExhausted),
            (ErrorKind::Unavailable, Code::Unavailable),
            (ErrorKind::Model, Code::FailedPrecondition),
            (ErrorKind::ClientClosed, Code::Cancelled),
        ];
        for (kind, want) in cases {
            assert_eq!(code(kind), want, "{kind:?}");
        }
        let s = status(ApiError::shutting_down());
        assert_eq!(s.code(), Code::Unavailable);
        assert_eq!(s.message(), "server is shutting down; retry elsewhere");
    }

    #[test]
    fn embed_request_keeps_proto3_defaults() {
        let r = embed_request(pb::EmbedRequest {
            inputs: "hi".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(r.inputs, one_text("hi".into()));
        assert_eq!((r.normalize, r.truncate), (Some(false), Some(false)));
        assert_eq!(r.truncation_direction, None);
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
