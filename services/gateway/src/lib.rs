//! The inference gateway: one gRPC front to many OpenAI-compatible backends (vLLM, SGLang, hosted APIs) and
//! replay files, built for multi-turn RL rollouts.
//!
//! A request names a model; the model's pool picks a backend (`routing`: least outstanding, power of two
//! choices, or episode affinity with bounded load), the `dispatch` loop attempts it with retries under a
//! budget, each backend guarded by a `breaker`, `health` checks and a concurrency limit; the `backends`
//! speak OpenAI-compatible HTTP or read a replay file. `control` fans operator actions out to a pool;
//! `accounting` turns usage into metrics and cost. `docs/GATEWAY.md` is the user's guide.

mod accounting;
mod backends;
mod breaker;
pub mod config;
mod control;
mod dispatch;
mod error;
mod failures;
mod health;
mod pool;
mod request;
mod retry;
mod routing;
mod service;

use std::future::Future;

pub use backends::BackendError;
pub use config::{ConfigError, GatewayConfig};
pub use error::SetupError;
use kforge_proto::v1::gateway_server::GatewayServer;
use kforge_server::{Host, ServeError};
pub use service::GatewayService;
use tokio::net::TcpListener;

/// Serves the Gateway service on `listener` until `shutdown` completes.
pub async fn serve(
    config: GatewayConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let mut host = Host::new("gateway", &config.server)?;
    let service = GatewayService::new(&config, host.registry())
        .map_err(|error| ServeError::Setup { service: "gateway", message: error.to_string() })?;
    let limit = host.max_message_bytes();
    host.add_service(GatewayServer::new(service).max_decoding_message_size(limit).max_encoding_message_size(limit));
    host.serve(listener, shutdown).await
}
