//! The shared bearer token: resolved once from config, checked by servers, attached by clients.

use std::fmt;
use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

use crate::config::AuthConfig;

/// Why the token could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("auth token file {path}: {source}")]
    File { path: std::path::PathBuf, source: std::io::Error },
    #[error("auth token variable {name} is not set")]
    MissingEnv { name: String },
    #[error("auth token from {source_name} is empty")]
    Empty { source_name: String },
}

/// A bearer token. Its `Debug` output never shows the secret.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// Reads the token named by `config`: `None` when auth is off.
    pub fn resolve(config: &AuthConfig) -> Result<Option<Self>, AuthError> {
        let (raw, source_name) = if let Some(path) = &config.token_file {
            let raw = std::fs::read_to_string(path).map_err(|source| AuthError::File { path: path.clone(), source })?;
            (raw, path.display().to_string())
        } else if let Some(name) = &config.token_env {
            let raw = std::env::var(name).map_err(|_| AuthError::MissingEnv { name: name.clone() })?;
            (raw, format!("${name}"))
        } else {
            return Ok(None);
        };
        let token = raw.trim();
        if token.is_empty() {
            return Err(AuthError::Empty { source_name });
        }
        Ok(Some(Self(token.into())))
    }

    /// A token from a literal value (tests, tooling).
    pub fn new(value: &str) -> Self {
        Self(value.into())
    }

    fn matches_header(&self, header: &[u8]) -> bool {
        let Some(presented) = header.strip_prefix(b"Bearer ") else {
            return false;
        };
        constant_time_eq(presented, self.0.as_bytes())
    }

    fn header_value(&self) -> Option<MetadataValue<tonic::metadata::Ascii>> {
        format!("Bearer {}", self.0).parse().ok()
    }
}

/// Compares without an early exit, so response time does not reveal how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Server interceptor: with a token configured, rejects calls that do not present it as UNAUTHENTICATED.
#[derive(Debug, Clone, Default)]
pub struct RequireBearer {
    token: Option<Token>,
}

impl RequireBearer {
    pub fn new(token: Option<Token>) -> Self {
        Self { token }
    }
}

impl tonic::service::Interceptor for RequireBearer {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return Ok(request);
        };
        match request.metadata().get("authorization") {
            Some(value) if token.matches_header(value.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated("bearer token does not match")),
            None => Err(Status::unauthenticated("missing `authorization: Bearer <token>` metadata")),
        }
    }
}

/// Client interceptor: attaches the token (when configured) and the current trace context to every call.
#[derive(Debug, Clone, Default)]
pub struct Outbound {
    token: Option<Token>,
}

impl Outbound {
    pub fn new(token: Option<Token>) -> Self {
        Self { token }
    }
}

impl tonic::service::Interceptor for Outbound {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        kforge_telemetry::inject_context(request.metadata_mut());
        if let Some(value) = self.token.as_ref().and_then(Token::header_value) {
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use tonic::service::Interceptor;

    use super::*;

    fn with_header(value: Option<&str>) -> Request<()> {
        let mut request = Request::new(());
        if let Some(v) = value {
            request.metadata_mut().insert("authorization", v.parse().expect("ascii header"));
        }
        request
    }

    #[test]
    fn no_token_configured_lets_everything_through() {
        assert!(RequireBearer::new(None).call(with_header(None)).is_ok());
    }

    #[test]
    fn the_right_token_passes_and_others_are_unauthenticated() {
        let mut check = RequireBearer::new(Some(Token::new("s3cret")));
        assert!(check.call(with_header(Some("Bearer s3cret"))).is_ok());
        for bad in [None, Some("Bearer s3cre"), Some("Bearer s3cret2"), Some("s3cret"), Some("Basic s3cret")] {
            let status = check.call(with_header(bad)).expect_err("must be rejected");
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{bad:?}");
        }
    }

    #[test]
    fn outbound_attaches_the_token_the_server_accepts() {
        let token = Token::new("abc");
        let request = Outbound::new(Some(token.clone())).call(Request::new(())).expect("outbound never fails");
        assert!(RequireBearer::new(Some(token)).call(request).is_ok());
    }

    #[test]
    fn debug_never_prints_the_secret() {
        assert!(!format!("{:?}", Token::new("hunter2")).contains("hunter2"));
    }

    #[test]
    fn token_from_env_is_trimmed_and_empty_is_an_error() {
        let config = AuthConfig { token_file: None, token_env: Some("KFORGE_TEST_TOKEN_UNSET_XYZ".into()) };
        assert!(matches!(Token::resolve(&config), Err(AuthError::MissingEnv { .. })));
        assert!(Token::resolve(&AuthConfig::default()).expect("off").is_none());
    }
}
