//! mlx-embed-server: the HTTP layer of mlx-embed.
//!
//! The embedding APIs (native `/api/v1/embed`, OpenAI `/v1/embeddings`, TEI
//! `/embed`, Ollama `/api/embed` and `/api/embeddings`, Cohere `/v1/embed` and
//! `/v2/embed`, Weaviate's `/vectors`, and TEI's `/similarity`) are thin
//! adapters over one embed path ([`embed::embed`]); the cross-encoder APIs
//! (TEI `/rerank` and `/predict`, Cohere/Jina `/v1/rerank` and `/v2/rerank`,
//! NVIDIA NIM's `/v1/ranking`,
//! vLLM's `/score` and `/classify`, the Inference API's `POST /`) over one
//! scoring path ([`score::score`]); vLLM's `/pooling` and the cloud
//! platforms' `/invocations` and `/vertex` over the routes they stand for.
//! Both drive the [`mlx_embed_core::Batcher`] of the model the request picks
//! ([`models`]: one batcher, queue and model thread per served model). Plus
//! `/tokenize`, `/decode`, the model listings (`/v1/models`, Ollama's
//! `/api/tags`, `/api/ps`, `/api/show`, Weaviate's `/meta`), `/health` and the
//! `/.well-known` probes, `/metrics`, `/info` and `/openapi.json`. Status
//! codes and error shapes are listed in [`errors`]. With `--grpc-port`,
//! Hugging Face TEI's gRPC API (`proto/tei.proto`) on a listener of its
//! own, each method an adapter over the TEI HTTP route it stands for.
//! Knows nothing of Python.

mod answer_room;
pub mod config;
pub mod embed;
pub mod errors;
pub mod extract;
mod grpc;
mod live;
pub mod metrics;
pub mod middleware;
pub mod models;
pub mod openapi;
pub mod routes;
pub mod score;
mod serve;
mod shutdown;
pub mod state;
pub mod timing;

pub use config::ServerArgs;
pub use errors::ServerError;
pub use routes::router;
pub use serve::{serve, serve_models, serve_models_with, serve_on};
pub use shutdown::Trigger;
pub use state::AppState;
