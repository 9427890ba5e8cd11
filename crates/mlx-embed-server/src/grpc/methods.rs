//! The services of `proto/tei.proto`: each method runs its message, as the
//! HTTP request [`super::requests`] makes of it, down the HTTP route's path.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::HeaderMap;
use futures_util::stream::{Stream, StreamExt};
use mlx_embed_core::Output;
use tokio::sync::watch;
use tonic::metadata::MetadataMap;
use tonic::{Extensions, Request, Response, Status, Streaming};
use tracing::Instrument as _;

use super::requests::{
    embed_request, merge_ranks, predict_request, raw_request, rerank_request,
    rerank_stream_messages, rerank_stream_requests,
};
use super::status::{size_status, status};
use super::{pb, STREAM_CONCURRENCY};
use crate::answer_room::{kept_for_stream_message, Reserved, Turns};
use crate::embed::{embed as run_embed, embed_sparse as run_embed_sparse};
use crate::errors::ApiError;
use crate::extract::TextInputs;
use crate::routes::ops::{info as http_info, TeiModelType};
use crate::routes::predict::{predict_body, PredictResponse};
use crate::routes::rerank::{tei_rank, TeiRerankRequest};
use crate::routes::tokens::{
    decode_ids, tokenize_texts, DecodeIds, DecodeRequest, TokenizeRequest,
};
use crate::state::AppState;
use crate::timing::{self, Usage};

/// TEI's figures of one message's model work, `total` its time.
fn metadata(usage: Option<&Usage>, total: Duration) -> pb::Metadata {
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    let usage = usage.cloned().unwrap_or_default();
    pb::Metadata {
        compute_chars: u32::try_from(usage.chars).unwrap_or(u32::MAX),
        compute_tokens: u32::try_from(usage.tokens).unwrap_or(u32::MAX),
        total_time_ns: nanos(total),
        tokenization_time_ns: nanos(usage.timings.tokenization),
        queue_time_ns: nanos(usage.timings.queue),
        inference_time_ns: nanos(usage.timings.inference),
    }
}

/// An answer message that carries TEI's `Metadata`.
trait WithMetadata {
    fn set_metadata(&mut self, metadata: pb::Metadata);
}

macro_rules! with_metadata {
    ($($message:ty),*) => {$(
        impl WithMetadata for $message {
            fn set_metadata(&mut self, metadata: pb::Metadata) {
                self.metadata = Some(metadata);
            }
        }
    )*};
}

with_metadata!(
    pb::EmbedResponse,
    pb::EmbedSparseResponse,
    pb::EmbedAllResponse,
    pb::PredictResponse,
    pb::RerankResponse
);

/// Runs one message's `work` in a [`timing::measured`] scope: its answer
/// with `Metadata` filled in, and TEI's `x-*` headers of the same figures
/// (none when it ran no model call), which a unary call's response carries
/// as TEI's does.
/// It counts in TEI's `te_request_*` metrics as an HTTP request does, as
/// TEI's gRPC server counts it: `method` a unary call's `Single` (a
/// `Rerank*`'s `Batch`), a stream message's `Stream`.
async fn timed<T: WithMetadata>(
    state: &AppState,
    method: timing::Method,
    work: impl Future<Output = Result<T, ApiError>>,
) -> Result<(T, HeaderMap), ApiError> {
    let work = async move {
        timing::shape(method);
        work.await
    };
    let start = Instant::now();
    let tally = timing::Tally::default();
    let dropped = Dropped {
        state,
        tally: &tally,
        start,
    };
    let (answer, measured) = timing::measured(&tally, work).await;
    std::mem::forget(dropped);
    if method != timing::Method::Stream && measured.sent > 0 {
        // The call's span (a stream's messages share theirs: not each's).
        let sent = i64::try_from(measured.sent).unwrap_or(i64::MAX);
        tracing::Span::current().record("inputs", sent);
    }
    let total = start.elapsed();
    let status = match &answer {
        Ok(_) => 200,
        Err(e) => e.kind.status().as_u16(),
    };
    state.http_metrics().record_tei(&measured, status, total);
    let mut answer = answer?;
    answer.set_metadata(metadata(measured.usage.as_ref(), total));
    let headers = measured
        .usage
        .map_or_else(HeaderMap::new, |u| timing::headers(&u, total));
    Ok((answer, headers))
}

/// Alive while [`timed`] waits: dropped with it when the call is (its
/// client cancelled it, or left), it counts a request that reached the
/// model path as TEI's `err="dropped"`, as the HTTP layer does.
struct Dropped<'a> {
    state: &'a AppState,
    tally: &'a timing::Tally,
    start: Instant,
}

impl Drop for Dropped<'_> {
    fn drop(&mut self) {
        if self.state.is_abandoning() {
            // The server is exiting without this answer: its client did not leave.
            return;
        }
        self.state.http_metrics().record_tei(
            &self.tally.take(),
            crate::middleware::CLIENT_CLOSED_REQUEST,
            self.start.elapsed(),
        );
    }
}

/// [`timed`] for a stream's message: its figures in its `Metadata` only.
async fn timed_message<T: WithMetadata>(
    state: AppState,
    work: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    timed(&state, timing::Method::Stream, work)
        .await
        .map(|(answer, _)| answer)
}

/// A unary call's answer, TEI's headers as its response metadata.
fn reply_timed<T>(answer: Result<(T, HeaderMap), ApiError>) -> Result<Response<T>, Status> {
    let (answer, headers) = answer.map_err(status)?;
    Ok(Response::from_parts(
        MetadataMap::from_headers(headers),
        answer,
        Extensions::default(),
    ))
}

/// The services: every method on the HTTP routes' state.
#[derive(Clone)]
pub(crate) struct Tei {
    pub(crate) state: AppState,
    /// True once the server begins to shut down ([`until_shutdown`]).
    pub(crate) stopping: watch::Receiver<bool>,
}

async fn embed_one(state: AppState, r: pb::EmbedRequest) -> Result<pb::EmbedResponse, ApiError> {
    let req = embed_request(r)?.into_request(&state, None)?;
    let mut out = run_embed(&state, req).await?;
    Ok(pb::EmbedResponse {
        embeddings: out.vectors.pop().unwrap_or_default(),
        metadata: None,
    })
}

async fn embed_sparse_one(
    state: AppState,
    r: pb::EmbedSparseRequest,
) -> Result<pb::EmbedSparseResponse, ApiError> {
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
        metadata: None,
    })
}

async fn embed_all_one(
    state: AppState,
    r: pb::EmbedAllRequest,
) -> Result<pb::EmbedAllResponse, ApiError> {
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
        metadata: None,
    })
}

async fn predict_one(
    state: AppState,
    texts: Vec<String>,
    truncate: bool,
    raw_scores: bool,
    truncation_direction: i32,
) -> Result<pb::PredictResponse, ApiError> {
    let req = predict_request(texts, truncate, raw_scores, truncation_direction)?;
    let answer = predict_body(&state, req, None).await?;
    let predictions = match answer {
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
        metadata: None,
    })
}

async fn rerank_one(
    state: &AppState,
    req: TeiRerankRequest,
) -> Result<pb::RerankResponse, ApiError> {
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
        metadata: None,
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

/// A stream's messages until the server begins to shut down, then one
/// `UNAVAILABLE` ("shutting down") in place of those not read yet. A
/// client holds a stream open as long as it likes, idle between messages:
/// without this the drain would wait on it until `--drain-timeout-secs`
/// and then drop it unanswered; with it, the messages already read are
/// answered and the stream ends, so the client retries elsewhere at once.
fn until_shutdown<Q>(
    incoming: Streaming<Q>,
    stopping: watch::Receiver<bool>,
) -> impl Stream<Item = Result<Q, Status>> + Send + 'static
where
    Q: Send + 'static,
{
    futures_util::stream::unfold(Some((incoming, stopping)), |open| async move {
        let (mut incoming, mut stopping) = open?;
        let message = tokio::select! {
            biased;
            message = incoming.next() => Some(message?),
            // A sender gone (the listener done) is a shutdown too.
            _ = stopping.wait_for(|&stop| stop) => None,
        };
        Some(match message {
            Some(message) => (message, Some((incoming, stopping))),
            None => (Err(status(ApiError::shutting_down())), None),
        })
    })
}

/// A stream's answers: `answer` for each message, up to
/// [`STREAM_CONCURRENCY`] at once, in the order the messages came; ends
/// after the first failure (a message tonic could not read included), or
/// at a shutdown ([`until_shutdown`]).
///
/// Each answer counts in the answer room (`--max-unsent-answers-mb`) from
/// before it is computed ([`kept_for_stream_message`]) until tonic takes the
/// next one from the stream (the last one given is in tonic's and hyper's
/// hands until they ask again), so the answers a client does not read are
/// bounded by the room, over all its streams.
fn answer_each<Q, A, F, Fut>(tei: &Tei, incoming: Streaming<Q>, answer: F) -> Answers<A>
where
    Q: Send + 'static,
    A: prost::Message + Send + 'static,
    F: Fn(AppState, Q) -> Fut + Send + 'static,
    Fut: Future<Output = Result<A, ApiError>> + Send + 'static,
{
    let state = tei.state.clone();
    let mut turns = Turns::default();
    // Each message's task runs in the call's span, so the core's phase
    // spans of every message are the call's children.
    let span = tracing::Span::current();
    let answers = until_shutdown(incoming, tei.stopping.clone())
        .map(move |message| {
            let work = message.map(|q| answer(state.clone(), q));
            let room = state.answer_room().clone();
            let turn = turns.next_turn();
            // Each message runs on its own task, as TEI's do: tonic polls
            // the stream only while the client's window has room, and a
            // message waiting for answer room must still reach its
            // `--max-queue-wait-ms` (and not hold the room's line) when its
            // client reads nothing. Aborted with the stream.
            let task = Aborting(tokio::spawn(
                async move {
                    match work {
                        Ok(work) => {
                            let (answer, kept) = kept_for_stream_message(work, turn).await;
                            let answer = answer.map_err(status)?;
                            let held = room.settle(kept, answer.encoded_len());
                            Ok((answer, held))
                        }
                        Err(unreadable) => Err(size_status(unreadable)),
                    }
                }
                .instrument(span.clone()),
            ));
            async move {
                task.await
                    .unwrap_or_else(|_| Err(Status::internal("the message's task failed")))
            }
        })
        .buffered(STREAM_CONCURRENCY);
    Box::pin(handed_on(answers))
}

/// `answers` until the first failure, each one's room given back when tonic
/// asks for the next: it asks once hyper has sent the one before (or, for
/// answers under its write buffer, taken it into that buffer). Kept until
/// the next is ready instead, an answer larger than the room (which goes
/// only into an empty one) kept the next from ever being computed, its
/// client reading: that waited `--max-queue-wait-ms` and ended the stream.
fn handed_on<A>(
    answers: impl Stream<Item = Result<(A, Reserved), Status>> + Send + 'static,
) -> impl Stream<Item = Result<A, Status>> + Send + 'static
where
    A: Send + 'static,
{
    let answers = Box::pin(answers);
    futures_util::stream::unfold(Some((answers, None::<Reserved>)), |open| async move {
        let (mut answers, given) = open?;
        drop(given);
        Some(match answers.next().await? {
            Ok((answer, held)) => (Ok(answer), Some((answers, Some(held)))),
            Err(failed) => (Err(failed), None),
        })
    })
}

/// A spawned task, aborted when dropped unfinished (its stream is gone).
struct Aborting<T>(tokio::task::JoinHandle<T>);

impl<T> Future for Aborting<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for Aborting<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
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
        reply_timed(
            timed(
                &self.state,
                timing::Method::Single,
                embed_one(self.state.clone(), request.into_inner()),
            )
            .await,
        )
    }

    type EmbedStreamStream = Answers<pb::EmbedResponse>;

    async fn embed_stream(
        &self,
        request: Request<Streaming<pb::EmbedRequest>>,
    ) -> Result<Response<Self::EmbedStreamStream>, Status> {
        Ok(Response::new(answer_each(
            self,
            request.into_inner(),
            |state, r| timed_message(state.clone(), embed_one(state, r)),
        )))
    }

    async fn embed_sparse(
        &self,
        request: Request<pb::EmbedSparseRequest>,
    ) -> Result<Response<pb::EmbedSparseResponse>, Status> {
        reply_timed(
            timed(
                &self.state,
                timing::Method::Single,
                embed_sparse_one(self.state.clone(), request.into_inner()),
            )
            .await,
        )
    }

    type EmbedSparseStreamStream = Answers<pb::EmbedSparseResponse>;

    async fn embed_sparse_stream(
        &self,
        request: Request<Streaming<pb::EmbedSparseRequest>>,
    ) -> Result<Response<Self::EmbedSparseStreamStream>, Status> {
        Ok(Response::new(answer_each(
            self,
            request.into_inner(),
            |state, r| timed_message(state.clone(), embed_sparse_one(state, r)),
        )))
    }

    async fn embed_all(
        &self,
        request: Request<pb::EmbedAllRequest>,
    ) -> Result<Response<pb::EmbedAllResponse>, Status> {
        reply_timed(
            timed(
                &self.state,
                timing::Method::Single,
                embed_all_one(self.state.clone(), request.into_inner()),
            )
            .await,
        )
    }

    type EmbedAllStreamStream = Answers<pb::EmbedAllResponse>;

    async fn embed_all_stream(
        &self,
        request: Request<Streaming<pb::EmbedAllRequest>>,
    ) -> Result<Response<Self::EmbedAllStreamStream>, Status> {
        Ok(Response::new(answer_each(
            self,
            request.into_inner(),
            |state, r| timed_message(state.clone(), embed_all_one(state, r)),
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
        reply_timed(timed(&self.state, timing::Method::Single, answer).await)
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
        reply_timed(timed(&self.state, timing::Method::Single, answer).await)
    }

    type PredictStreamStream = Answers<pb::PredictResponse>;

    async fn predict_stream(
        &self,
        request: Request<Streaming<pb::PredictRequest>>,
    ) -> Result<Response<Self::PredictStreamStream>, Status> {
        Ok(Response::new(answer_each(
            self,
            request.into_inner(),
            |state, r: pb::PredictRequest| {
                timed_message(
                    state.clone(),
                    predict_one(
                        state,
                        vec![r.inputs],
                        r.truncate,
                        r.raw_scores,
                        r.truncation_direction,
                    ),
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
            self,
            request.into_inner(),
            |state, r: pb::PredictPairRequest| {
                timed_message(
                    state.clone(),
                    predict_one(
                        state,
                        r.inputs,
                        r.truncate,
                        r.raw_scores,
                        r.truncation_direction,
                    ),
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
        reply_timed(timed(&self.state, timing::Method::Batch, answer).await)
    }

    async fn rerank_stream(
        &self,
        request: Request<Streaming<pb::RerankStreamRequest>>,
    ) -> Result<Response<pb::RerankResponse>, Status> {
        let args = self.state.args();
        let incoming = until_shutdown(request.into_inner(), self.stopping.clone());
        let messages = rerank_stream_messages(
            std::pin::pin!(incoming),
            args.max_inputs_per_request,
            args.max_body_bytes,
        )
        .await?;
        // One scope over the stream's requests: counts summed, phase times
        // averaged over their inputs ([`timing::Usage`]).
        let answer = async {
            let groups = rerank_stream_requests(messages)?;
            let (positions, requests): (Vec<_>, Vec<_>) = groups.into_iter().unzip();
            let answers = futures_util::future::try_join_all(
                requests.into_iter().map(|req| rerank_one(&self.state, req)),
            )
            .await?;
            Ok(pb::RerankResponse {
                ranks: merge_ranks(positions.into_iter().zip(answers).collect()),
                metadata: None,
            })
        };
        reply_timed(timed(&self.state, timing::Method::Batch, answer).await)
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
            self,
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
            self,
            request.into_inner(),
            decode_one,
        )))
    }
}
