//! mlx-embed-server: the HTTP layer of mlx-embed.
//!
//! Four embedding APIs (native `/api/v1/embed`, OpenAI `/v1/embeddings`, TEI
//! `/embed`, Ollama `/api/embed`) are thin adapters over one embed path
//! ([`embed::embed`]) that drives a [`mlx_embed_core::Batcher`]; plus `/health`,
//! `/metrics`, `/info`, `/v1/models` and `/openapi.json`. Status codes and
//! error shapes are listed in [`errors`]. Knows nothing of Python.

pub mod config;
pub mod embed;
pub mod errors;
pub mod extract;
mod live;
pub mod metrics;
pub mod middleware;
pub mod openapi;
pub mod routes;
mod serve;
mod shutdown;
pub mod state;

pub use config::ServerArgs;
pub use errors::ServerError;
pub use routes::router;
pub use serve::{serve, serve_on};
pub use state::AppState;
