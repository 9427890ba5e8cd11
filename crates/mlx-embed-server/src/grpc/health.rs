//! gRPC's standard health service (`grpc.health.v1.Health`), what a
//! Kubernetes `grpc:` probe and `grpc_health_probe` ask: its answer is
//! HTTP `/health`'s (`SERVING` where `/health` says 200, `NOT_SERVING`
//! where it says 503: a model down, or the server draining), for the
//! server (`""`) and for each `tei.v1` service alike, so the two probes
//! never disagree. Like `/health`, it needs no API key (see `super::serve`).
//!
//! tonic-health's own service is not used: it holds a status that its
//! owner pushes, while readiness here is read from the server's state (the
//! one `/health` reads), and its watches never end, so one open watch would
//! hold the drain to `--drain-timeout-secs`. Its generated messages are.

use std::pin::Pin;
use std::time::Duration;

use futures_util::stream::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::Health;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use super::pb;
use crate::state::AppState;

/// The names a check may ask about: the server's (`""`) and its services'.
const SERVICES: [&str; 6] = [
    "",
    pb::info_server::SERVICE_NAME,
    pb::embed_server::SERVICE_NAME,
    pb::predict_server::SERVICE_NAME,
    pb::rerank_server::SERVICE_NAME,
    pb::tokenize_server::SERVICE_NAME,
];

/// How often a watch looks at the models' health: a model that fails tells
/// no one, so it is read again this often (a shutdown is seen at once).
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// The health service, on the state `/health` reads.
#[derive(Clone)]
pub(crate) struct Probe {
    pub(crate) state: AppState,
    /// True once the shutdown begins: the listener is closed then.
    pub(crate) stopping: watch::Receiver<bool>,
}

impl Probe {
    /// `/health`'s answer as a serving status.
    fn now(&self) -> ServingStatus {
        if *self.stopping.borrow() || !self.state.is_ready() {
            ServingStatus::NotServing
        } else {
            ServingStatus::Serving
        }
    }
}

fn answer(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status.into(),
    }
}

#[tonic::async_trait]
impl Health for Probe {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        if !SERVICES.contains(&service.as_str()) {
            return Err(Status::not_found(format!("unknown service {service:?}")));
        }
        Ok(Response::new(answer(self.now())))
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    /// The status now, then each change; at the shutdown `NOT_SERVING`,
    /// then the watch ends (OK: the client watches again elsewhere), so an
    /// open watch does not hold the drain. An unknown service is
    /// `SERVICE_UNKNOWN`, its watch left open, as the standard says.
    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let known = SERVICES.contains(&request.into_inner().service.as_str());
        let probe = self.clone();
        let statuses = futures_util::stream::unfold(
            (probe, None::<ServingStatus>),
            move |(probe, last)| async move {
                loop {
                    let now = if known {
                        probe.now()
                    } else {
                        ServingStatus::ServiceUnknown
                    };
                    if last != Some(now) {
                        return Some((Ok(answer(now)), (probe, Some(now))));
                    }
                    // Draining: NOT_SERVING is out (a known service's
                    // status is that from now on), so the watch is done.
                    let mut stopping = probe.stopping.clone();
                    if *stopping.borrow() {
                        return None;
                    }
                    tokio::select! {
                        // Err: the listener is gone, and with it the drain.
                        stopped = stopping.wait_for(|&stop| stop) => {
                            if stopped.is_err() {
                                return None;
                            }
                        }
                        () = tokio::time::sleep(WATCH_EVERY) => {}
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(statuses)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServerArgs;
    use futures_util::StreamExt;
    use mlx_embed_core::{
        BatchOutput, Batcher, BatcherConfig, EmbedInput, EmbedOptions, Embedder, EmbedderError,
        Encoded, ModelInfo, Output, Tokenize,
    };
    use std::sync::Arc;
    use tonic::Code;

    /// A model that dies on its first batch.
    struct Mortal;
    impl Embedder for Mortal {
        fn info(&self) -> ModelInfo {
            ModelInfo {
                name: "mortal".into(),
                dim: 1,
                max_input_tokens: 8,
                vocab_size: 10,
                ..ModelInfo::default()
            }
        }
        fn tokenizer(&self) -> Option<Arc<dyn Tokenize>> {
            None
        }
        fn embed_batch(&mut self, _: &[Encoded], _: Output) -> Result<BatchOutput, EmbedderError> {
            Err(EmbedderError::model_gone("the model is gone"))
        }
    }

    async fn check(probe: &Probe, service: &str) -> Result<i32, Code> {
        let request = Request::new(HealthCheckRequest {
            service: service.into(),
        });
        match probe.check(request).await {
            Ok(answer) => Ok(answer.into_inner().status),
            Err(status) => Err(status.code()),
        }
    }

    #[tokio::test]
    async fn a_check_answers_what_health_answers() {
        let batcher = Batcher::start(BatcherConfig::default(), || Ok(Mortal)).unwrap();
        let args = ServerArgs::default();
        let state = AppState::with_models(vec![batcher.clone()], &args, Duration::ZERO).unwrap();
        let (_stop, stopping) = watch::channel(false);
        let probe = Probe { state, stopping };
        let serving = Ok(ServingStatus::Serving.into());
        for service in SERVICES {
            assert_eq!(check(&probe, service).await, serving, "{service:?}");
        }
        assert_eq!(check(&probe, "tei.v1.Nope").await, Err(Code::NotFound));
        let request = Request::new(HealthCheckRequest::default());
        let mut watch = probe.watch(request).await.unwrap().into_inner();
        let next = |a: Option<Result<HealthCheckResponse, Status>>| a.unwrap().unwrap().status;
        assert_eq!(next(watch.next().await), ServingStatus::Serving as i32);
        // The model dies: /health says 503, and so does every check.
        // Token ids: the fake has no tokenizer.
        let input = vec![EmbedInput::Tokens(vec![1, 2])];
        assert!(batcher.embed(input, EmbedOptions::default()).await.is_err());
        assert!(!batcher.is_healthy());
        let not_serving = Ok(ServingStatus::NotServing.into());
        for service in SERVICES {
            assert_eq!(check(&probe, service).await, not_serving, "{service:?}");
        }
        // A watch reads it again within WATCH_EVERY (nothing tells it).
        let changed = tokio::time::timeout(WATCH_EVERY * 3, watch.next()).await;
        assert_eq!(next(changed.unwrap()), ServingStatus::NotServing as i32);
    }

    #[tokio::test]
    async fn a_watch_ends_with_not_serving_at_the_shutdown() {
        let batcher = Batcher::start(BatcherConfig::default(), || Ok(Mortal)).unwrap();
        let args = ServerArgs::default();
        let state = AppState::with_models(vec![batcher], &args, Duration::ZERO).unwrap();
        let (stop, stopping) = watch::channel(false);
        let probe = Probe {
            state: state.clone(),
            stopping,
        };
        let watch = |service: &str| {
            probe.watch(Request::new(HealthCheckRequest {
                service: service.into(),
            }))
        };
        let mut server = watch("").await.unwrap().into_inner();
        let mut unknown = watch("tei.v1.Nope").await.unwrap().into_inner();
        let status = |a: Option<Result<HealthCheckResponse, Status>>| a.unwrap().unwrap().status;
        assert_eq!(status(server.next().await), ServingStatus::Serving as i32);
        assert_eq!(
            status(unknown.next().await),
            ServingStatus::ServiceUnknown as i32
        );
        state.begin_shutdown();
        stop.send_replace(true);
        assert_eq!(
            status(server.next().await),
            ServingStatus::NotServing as i32
        );
        assert!(server.next().await.is_none());
        assert!(unknown.next().await.is_none());
    }
}
