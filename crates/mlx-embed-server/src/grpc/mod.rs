//! Hugging Face TEI's gRPC API (package `tei.v1`, `proto/tei.proto`),
//! served on its own listener with `--grpc-port`.
//!
//! Every method is an adapter: it builds the request the TEI HTTP route
//! builds from the same fields and runs it down the same path (the embed
//! path, the scoring path, the tokenizer routes), so validation, limits,
//! batching and scores are the HTTP API's. What differs is TEI's gRPC
//! shape: one text per message, proto3's defaults (`truncate` and
//! `normalize` false unless sent, as TEI's gRPC reads them), and errors as
//! gRPC status codes ([`status::code`]). Streams answer one message per message, in
//! the order sent, computing up to [`STREAM_CONCURRENCY`] at a time; the
//! first failure ends the stream with its status, as TEI's do. A stream's
//! answers, small ones too, count in the answer room
//! (`--max-unsent-answers-mb`) from before they are computed until the stream
//! hands them on (`methods::answer_each`); a unary call's large answer waits
//! for room as over HTTP, but is not counted while written (the layer that
//! counts HTTP answers goes by a body's known size, which a gRPC body does
//! not tell).

mod health;
mod methods;
mod requests;
mod serve;
mod status;

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
