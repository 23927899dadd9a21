//! Configuration loading shared by every kforge process.
//!
//! One TOML file holds a table per service (`[reward]`, `[evaluator.server]`, ...); every process reads the same
//! file format, whether it runs one service or all five. Any key can be overridden from
//! the environment as `KFORGE__<TABLE>__<KEY>` (double underscores separate levels), e.g.
//! `KFORGE__REWARD__SERVER__LISTEN=0.0.0.0:50053`. Every struct rejects unknown keys, so a typo fails at start-up
//! with the key's full path instead of being silently ignored.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::providers::{Env, Format, Serialized, Toml};
use figment::{Figment, Provider};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "KFORGE__";

/// The tables a kforge config file may hold, one per service.
pub const SECTIONS: &[&str] = &["evaluator", "profiler", "reward", "gateway", "orchestrator"];

/// Why configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file does not exist or cannot be read.
    #[error("config file {path}: {source}")]
    Unreadable { path: PathBuf, source: std::io::Error },
    /// A top-level table that is not a service.
    #[error("unknown config section `{section}` (expected one of: {})", SECTIONS.join(", "))]
    UnknownSection { section: String },
    /// The sources themselves could not be read (a file that is not TOML).
    #[error("{0}")]
    Source(Box<figment::Error>),
    /// A key is unknown, has the wrong type, or a value does not parse; figment names the key and its source.
    #[error("[{section}] {error}")]
    Invalid { section: &'static str, error: Box<figment::Error> },
}

/// A service's configuration: the table it reads and its server settings.
pub trait ServiceConfig: DeserializeOwned + Serialize + Default + Send + 'static {
    /// The file's table for this service, e.g. `reward`.
    const SECTION: &'static str;
    /// The gRPC server settings.
    fn server(&self) -> &ServerConfig;
}

/// Loads one service's table: its defaults, then the file (if any), then `KFORGE__*` environment variables.
/// Unknown tables and keys anywhere are rejected, so a typo in any service's table fails every service's start.
pub fn load_section<T: ServiceConfig>(file: Option<&Path>) -> Result<T, ConfigError> {
    let mut sources = Figment::new();
    if let Some(path) = file {
        // figment treats a missing file as empty; a path the user named must exist.
        std::fs::metadata(path).map_err(|source| ConfigError::Unreadable { path: path.to_owned(), source })?;
        sources = sources.merge(Toml::file_exact(path));
    }
    sources = sources.merge(Env::prefixed(ENV_PREFIX).split("__"));
    let data = sources.data().map_err(|e| ConfigError::Source(Box::new(e)))?;
    for section in data.values().flat_map(|dict| dict.keys()) {
        if !SECTIONS.contains(&section.as_str()) {
            return Err(ConfigError::UnknownSection { section: section.clone() });
        }
    }
    Figment::from(Serialized::defaults(T::default()))
        .merge(sources.focus(T::SECTION))
        .extract()
        .map_err(|error| ConfigError::Invalid { section: T::SECTION, error: Box::new(error) })
}

/// Settings every gRPC server has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the gRPC server (and its `/metrics` page) listens on.
    pub listen: SocketAddr,
    /// Largest request message accepted, in bytes; larger ones get OUT_OF_RANGE. Default 16 MiB.
    pub max_message_bytes: usize,
    /// How long in-flight requests may finish after a shutdown signal, in seconds. Default 20.
    pub drain_timeout_secs: u64,
    /// Upper bound on any request's deadline, in seconds; a caller's shorter `grpc-timeout` wins. Default 3600.
    pub request_timeout_secs: u64,
    /// Concurrent requests per connection before callers queue. Default 256.
    pub concurrency_per_connection: usize,
    /// TLS; off when absent.
    pub tls: Option<TlsConfig>,
    /// Bearer-token check; off when neither source is set.
    pub auth: AuthConfig,
    /// Named callers, each with a bearer token of its own (`[[<service>.server.callers]]`): a call presenting one
    /// is that caller's (the orchestrator's per-caller quotas). Any turns the bearer check on; the shared token, when
    /// set, is accepted beside them and names no caller.
    pub callers: Vec<CallerConfig>,
}

impl ServerConfig {
    /// The defaults with another listen address.
    pub fn listening_on(listen: SocketAddr) -> Self {
        Self { listen, ..Self::default() }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            max_message_bytes: 16 * 1024 * 1024,
            drain_timeout_secs: 20,
            request_timeout_secs: 3600,
            concurrency_per_connection: 256,
            tls: None,
            auth: AuthConfig::default(),
            callers: Vec::new(),
        }
    }
}

/// Server TLS material, PEM files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain.
    pub cert_file: PathBuf,
    /// Private key.
    pub key_file: PathBuf,
    /// When set, clients must present a certificate signed by this CA (mutual TLS).
    pub client_ca_file: Option<PathBuf>,
}

/// Where the shared bearer token comes from. The file wins when both are set. The token protects every RPC except
/// grpc.health.v1 (kubelet probes carry no credentials) and `/metrics` (scraped inside the cluster).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// File holding the token (a mounted secret); surrounding whitespace is ignored.
    pub token_file: Option<PathBuf>,
    /// Name of an environment variable holding the token.
    pub token_env: Option<String>,
}

/// A named caller and where its own bearer token comes from (the file wins when both are set).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CallerConfig {
    /// The caller's name, as recorded on what it submits (`Job.caller`). Required, unique.
    pub name: String,
    /// File holding the caller's token; surrounding whitespace is ignored.
    pub token_file: Option<PathBuf>,
    /// Name of an environment variable holding the caller's token.
    pub token_env: Option<String>,
}

impl CallerConfig {
    /// The caller's token sources, as the shared token's are read.
    pub fn auth(&self) -> AuthConfig {
        AuthConfig { token_file: self.token_file.clone(), token_env: self.token_env.clone() }
    }
}

#[cfg(test)]
// `Jail::expect_with` fixes the closures' error type to figment's own, large, error.
#[allow(clippy::result_large_err)]
mod tests {
    use figment::Jail;

    use super::*;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Svc {
        server: ServerConfig,
        knob: u32,
    }

    impl Default for Svc {
        fn default() -> Self {
            Self { server: ServerConfig::default(), knob: 7 }
        }
    }

    impl ServiceConfig for Svc {
        const SECTION: &'static str = "reward";
        fn server(&self) -> &ServerConfig {
            &self.server
        }
    }

    fn load_err(jail: &Jail, contents: &str) -> String {
        jail.create_file("k.toml", contents).expect("jail file");
        load_section::<Svc>(Some(Path::new("k.toml"))).expect_err("must fail").to_string()
    }

    #[test]
    fn defaults_apply_without_a_file() {
        Jail::expect_with(|_| {
            assert_eq!(load_section::<Svc>(None).expect("defaults load"), Svc::default());
            Ok(())
        });
    }

    #[test]
    fn file_then_env_override_defaults() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "k.toml",
                "[reward.server]\nlisten = \"127.0.0.1:7000\"\nmax_message_bytes = 10\n[evaluator]\nother = 1\n",
            )?;
            jail.set_env("KFORGE__REWARD__SERVER__MAX_MESSAGE_BYTES", "11");
            let svc: Svc = load_section(Some(Path::new("k.toml"))).expect("file loads");
            assert_eq!(svc.server.listen, SocketAddr::from(([127, 0, 0, 1], 7000)));
            assert_eq!(svc.server.max_message_bytes, 11, "env wins over the file");
            assert_eq!(svc.server.drain_timeout_secs, 20, "unset keys keep defaults");
            assert_eq!(svc.knob, 7, "unset service keys keep the service's defaults");
            Ok(())
        });
    }

    #[test]
    fn unknown_key_is_rejected_with_its_name() {
        Jail::expect_with(|jail| {
            let err = load_err(jail, "[reward.server]\nlisten_adress = \"127.0.0.1:7000\"\n");
            assert!(err.contains("listen_adress"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn unknown_section_is_rejected_with_its_name() {
        Jail::expect_with(|jail| {
            let err = load_err(jail, "[rewards]\nknob = 1\n");
            assert!(err.contains("`rewards`"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn unknown_env_key_is_rejected_with_its_name() {
        Jail::expect_with(|jail| {
            jail.set_env("KFORGE__REWARD__KNOBB", "3");
            let err = load_section::<Svc>(None).expect_err("unknown env key").to_string();
            assert!(err.contains("knobb"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn wrong_type_names_the_key() {
        Jail::expect_with(|jail| {
            let err = load_err(jail, "[reward.server]\nmax_message_bytes = \"lots\"\n");
            assert!(err.contains("max_message_bytes"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn missing_file_is_an_error() {
        let err = load_section::<Svc>(Some(Path::new("/nonexistent/kforge.toml"))).expect_err("missing file");
        assert!(matches!(err, ConfigError::Unreadable { .. }));
    }
}
