//! Bearer tokens: the shared one and the named callers' own, resolved once from config, checked by servers (a named
//! caller's token puts its [`Caller`] in the request's extensions, for the service to read), attached by clients.

use std::fmt;
use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

use crate::config::{AuthConfig, CallerConfig};

/// Why the token could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("auth token file {path}: {source}")]
    File { path: std::path::PathBuf, source: std::io::Error },
    #[error("auth token variable {name} is not set")]
    MissingEnv { name: String },
    #[error("auth token from {source_name} is empty")]
    Empty { source_name: String },
    /// `server.callers[index]` cannot name a caller.
    #[error("server.callers[{index}]: {message}")]
    Caller { index: usize, message: String },
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

/// The named caller a call's token belongs to (`server.callers`), in the request's extensions once the bearer check
/// has passed. Absent where the call presented the shared token, or auth is off: such calls name no caller.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller(Arc<str>);

impl Caller {
    pub fn new(name: &str) -> Self {
        Self(name.into())
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    /// The caller of `request`, if its token named one.
    pub fn of<T>(request: &Request<T>) -> Option<&Caller> {
        request.extensions().get::<Caller>()
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reads every named caller's token: each caller needs a unique name and a token of its own, unlike every other
/// caller's and the shared one's (a token that named two callers could not tell them apart).
pub fn resolve_callers(callers: &[CallerConfig], shared: Option<&Token>) -> Result<Vec<(Caller, Token)>, AuthError> {
    let mut resolved: Vec<(Caller, Token)> = Vec::with_capacity(callers.len());
    for (index, config) in callers.iter().enumerate() {
        let fail = |message: &str| AuthError::Caller { index, message: message.to_owned() };
        if config.name.trim().is_empty() {
            return Err(fail("name: required"));
        }
        if resolved.iter().any(|(caller, _)| caller.name() == config.name) {
            return Err(fail(&format!("name `{}` appears twice", config.name)));
        }
        let token = Token::resolve(&config.auth())?.ok_or_else(|| fail("token_file or token_env: required"))?;
        let same = |other: &Token| constant_time_eq(other.0.as_bytes(), token.0.as_bytes());
        if shared.is_some_and(same) || resolved.iter().any(|(_, other)| same(other)) {
            return Err(fail("its token is another caller's or the shared one: each caller needs its own"));
        }
        resolved.push((Caller::new(&config.name), token));
    }
    Ok(resolved)
}

/// Compares without an early exit, so response time does not reveal how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Server interceptor: with a token configured (the shared one, or named callers'), rejects calls that present none
/// of them as UNAUTHENTICATED; a named caller's token puts its [`Caller`] in the request's extensions.
#[derive(Debug, Clone, Default)]
pub struct RequireBearer {
    token: Option<Token>,
    callers: Arc<[(Caller, Token)]>,
}

impl RequireBearer {
    pub fn new(token: Option<Token>) -> Self {
        Self { token, callers: Arc::new([]) }
    }

    /// The shared token (if any) and the named callers' tokens.
    pub fn with_callers(token: Option<Token>, callers: Vec<(Caller, Token)>) -> Self {
        Self { token, callers: callers.into() }
    }

    /// Whether any token is required.
    pub fn is_on(&self) -> bool {
        self.token.is_some() || !self.callers.is_empty()
    }
}

impl RequireBearer {
    /// Checks an `authorization` value: `Ok(Some(caller))` for a named caller's token, `Ok(None)` for the shared
    /// token (or when auth is off), UNAUTHENTICATED otherwise.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<Option<Caller>, Status> {
        if !self.is_on() {
            return Ok(None);
        }
        let Some(header) = authorization else {
            return Err(Status::unauthenticated("missing `authorization: Bearer <token>` metadata"));
        };
        if self.token.as_ref().is_some_and(|token| token.matches_header(header)) {
            return Ok(None);
        }
        // Every caller's token is compared, so the time taken does not tell which one came close.
        let caller = self.callers.iter().fold(None, |found, (caller, token)| {
            let matches = token.matches_header(header);
            found.or(matches.then(|| caller.clone()))
        });
        caller.map(Some).ok_or_else(|| Status::unauthenticated("bearer token does not match"))
    }
}

impl tonic::service::Interceptor for RequireBearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let header = request.metadata().get("authorization").map(|value| value.as_bytes());
        if let Some(caller) = self.check(header)? {
            request.extensions_mut().insert(caller);
        }
        Ok(request)
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
    fn a_caller_s_token_names_it_and_the_shared_token_names_no_one() {
        let callers = vec![(Caller::new("alice"), Token::new("a-token")), (Caller::new("bob"), Token::new("b-token"))];
        let mut check = RequireBearer::with_callers(Some(Token::new("shared")), callers.clone());
        let caller = |check: &mut RequireBearer, header| {
            check.call(with_header(Some(header))).map(|request| Caller::of(&request).map(|c| c.name().to_owned()))
        };
        assert_eq!(caller(&mut check, "Bearer a-token").expect("passes"), Some("alice".into()));
        assert_eq!(caller(&mut check, "Bearer b-token").expect("passes"), Some("bob".into()));
        assert_eq!(caller(&mut check, "Bearer shared").expect("passes"), None);
        let status = caller(&mut check, "Bearer c-token").expect_err("unknown");
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        let mut callers_only = RequireBearer::with_callers(None, callers);
        assert!(callers_only.call(with_header(None)).is_err(), "named callers alone turn the check on");
        assert_eq!(caller(&mut callers_only, "Bearer b-token").expect("passes"), Some("bob".into()));
    }

    #[test]
    fn callers_need_a_name_and_a_token_of_their_own() {
        let dir = std::env::temp_dir().join(format!("kforge-callers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = |name: &str, token: &str| {
            let path = dir.join(name);
            std::fs::write(&path, format!("{token}\n")).expect("written");
            Some(path)
        };
        let caller = |name: &str, token_file| CallerConfig { name: name.into(), token_file, token_env: None };
        let (a, b, shared) = (file("a", "a-token"), file("b", "b-token"), Token::new("shared"));
        let resolved = resolve_callers(&[caller("alice", a.clone()), caller("bob", b.clone())], Some(&shared))
            .expect("two callers");
        assert_eq!(resolved.iter().map(|(c, _)| c.name()).collect::<Vec<_>>(), ["alice", "bob"]);
        let error =
            |callers: &[CallerConfig]| resolve_callers(callers, Some(&shared)).expect_err("refused").to_string();
        assert!(error(&[caller("", a.clone())]).starts_with("server.callers[0]: name"));
        assert!(error(&[caller("alice", a.clone()), caller("alice", b)]).contains("appears twice"));
        assert!(error(&[caller("alice", None)]).contains("token_file or token_env: required"));
        assert!(error(&[caller("alice", a.clone()), caller("bob", a)]).contains("needs its own"));
        assert!(error(&[caller("carol", file("c", "shared"))]).contains("needs its own"));
        std::fs::remove_dir_all(dir).expect("cleanup");
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
