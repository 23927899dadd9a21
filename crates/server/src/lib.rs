//! The plumbing every kforge service shares, so that a service crate holds only its own behaviour.
//!
//! - [`config`]: typed configuration from a TOML file plus `KFORGE__...` environment overrides, unknown keys rejected.
//! - [`Host`]: one gRPC server with grpc.health.v1, reflection, optional TLS and bearer-token auth, request size
//!   limits, deadlines, per-method Prometheus metrics at `/metrics`, and graceful drain.
//! - [`client`]: channels for calling other services with the same auth, TLS and trace propagation.
//! - [`json`]: every unary method as proto3 JSON over HTTP (the Connect protocol's unary shape), and the JSON error
//!   body the protocol faces share; [`InProcess`]: the channel through which they reach the host's services.

pub mod auth;
pub mod binary;
pub mod client;
pub mod config;
pub mod dynamic;
mod host;
mod inprocess;
pub mod json;
mod metrics;

pub use config::{ConfigError, ServerConfig, ServiceConfig, TlsConfig, load_section};
pub use host::{Host, ServeError, run_service, shutdown_signal};
pub use inprocess::InProcess;
pub use metrics::Metrics;

/// The answer of an RPC whose behaviour has not landed yet: UNIMPLEMENTED, saying which capability brings it.
pub fn not_yet_implemented(rpc: &str, capability: &str) -> tonic::Status {
    tonic::Status::unimplemented(format!("{rpc} is not implemented yet; it arrives with {capability}"))
}

/// The gRPC spelling of a status code, e.g. `INVALID_ARGUMENT`.
pub fn code_name(code: tonic::Code) -> String {
    let debug = format!("{code:?}");
    let mut name = String::with_capacity(debug.len() + 4);
    for (i, c) in debug.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}
