//! Channels for calling kforge services, in-process or remote alike: the same auth, TLS and trace propagation.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use crate::auth::{AuthError, Outbound, Token};
use crate::config::AuthConfig;

/// A channel with kforge's outbound interceptor; every generated client is built on it.
pub type Channel = InterceptedService<tonic::transport::Channel, Outbound>;

/// Why a channel could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid address {url:?}: {source}")]
    Address { url: String, source: tonic::transport::Error },
    #[error("cannot connect to {url}: {source}")]
    Connect { url: String, source: tonic::transport::Error },
    #[error("tls ca file {path}: {source}")]
    TlsFile { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Auth(#[from] AuthError),
}

/// How to reach other services.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// CA that signs the servers' certificates (`https://` addresses).
    pub tls_ca_file: Option<PathBuf>,
    /// Server name to verify when it differs from the address's host.
    pub tls_domain: Option<String>,
    /// Token to present; the same sources as the servers'.
    pub auth: AuthConfig,
}

fn endpoint(url: &str, config: &ClientConfig) -> Result<Endpoint, ClientError> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|source| ClientError::Address { url: url.to_owned(), source })?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true);
    if url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(path) = &config.tls_ca_file {
            let pem = std::fs::read(path).map_err(|source| ClientError::TlsFile { path: path.clone(), source })?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        if let Some(domain) = &config.tls_domain {
            tls = tls.domain_name(domain.clone());
        }
        endpoint = endpoint.tls_config(tls).map_err(|source| ClientError::Address { url: url.to_owned(), source })?;
    }
    Ok(endpoint)
}

/// A channel that connects on its first call and reconnects as needed: for endpoints that come and go (a pool's
/// pods); an unreachable server fails the call, UNAVAILABLE.
pub fn connect_lazy(url: &str, config: &ClientConfig) -> Result<Channel, ClientError> {
    let outbound = Outbound::new(Token::resolve(&config.auth)?);
    Ok(InterceptedService::new(endpoint(url, config)?.connect_lazy(), outbound))
}

/// Connects now, failing if the server is unreachable.
pub async fn connect(url: &str, config: &ClientConfig) -> Result<Channel, ClientError> {
    let outbound = Outbound::new(Token::resolve(&config.auth)?);
    let channel = endpoint(url, config)?
        .connect()
        .await
        .map_err(|source| ClientError::Connect { url: url.to_owned(), source })?;
    Ok(InterceptedService::new(channel, outbound))
}
