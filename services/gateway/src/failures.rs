//! How failed requests are logged: in proportion, not one line each. A job whose every generation fails (a replay
//! file without its turns, a backend down) sends the gateway the same failure thousands of times, and a line per
//! request (or per attempt) buried everything else: 15,800 lines for one job. Each upstream attempt is logged at
//! DEBUG (`dispatch.rs`); a request that finally fails is logged here, the first of its kind (the pool, the backend,
//! the status code) in each window, with how many of that kind went unlogged since the kind's last line. Every
//! request is still counted, by final status, in `kforge_gateway_requests_total`.
//!
//! The level follows the outcome: a server fault (the backend unreachable, a 5xx, a broken or malformed answer, no
//! backend left to route to) at ERROR; a refusal the request earned (a 4xx, a replay file without its keys, the
//! caller's deadline, a rate limit) at INFO.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tonic::Code;

use crate::error::GatewayError;

/// A failed request's kind: requests of one kind are one line per window.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Kind {
    model: String,
    backend: String,
    code: Code,
}

#[derive(Debug)]
struct Window {
    opened: Instant,
    /// Failures of the kind not logged since its last line.
    unlogged: u64,
}

/// The failure log's memory of what it has logged lately. Its kinds are bounded by pools x backends x codes.
#[derive(Debug)]
pub struct FailureLog {
    window: Duration,
    kinds: Mutex<HashMap<Kind, Window>>,
}

impl FailureLog {
    /// A log that writes the first failure of each kind per `window`.
    pub fn new(window: Duration) -> Self {
        Self { window, kinds: Mutex::new(HashMap::new()) }
    }

    /// Logs `error`, a request to pool `model` that failed, unless one like it was logged less than a window ago.
    pub fn failed(&self, model: &str, error: &GatewayError) {
        let backend = match error {
            GatewayError::Upstream { backend, .. } | GatewayError::RateLimited { backend, .. } => backend.as_str(),
            GatewayError::Invalid(_)
            | GatewayError::NoBackend { .. }
            | GatewayError::Deadline { .. }
            | GatewayError::Task(_) => "",
        };
        let code = error.code();
        let kind = Kind { model: model.to_owned(), backend: backend.to_owned(), code };
        let Some(unlogged) = self.admit(kind, Instant::now()) else {
            return;
        };
        let code = kforge_server::code_name(code);
        let window_s = self.window.as_secs();
        if server_fault(error) {
            tracing::error!(model, backend, code, %error, unlogged, window_s, "generation failed");
        } else {
            tracing::info!(model, backend, code, %error, unlogged, window_s, "generation refused");
        }
    }

    /// Whether a failure of `kind` at `now` is logged: `Some(unlogged)`, the failures of the kind left unlogged
    /// since its last line, when the kind's window has passed (or it has none yet); `None` otherwise (counted).
    fn admit(&self, kind: Kind, now: Instant) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match kinds.get_mut(&kind) {
            Some(window) if now.saturating_duration_since(window.opened) < self.window => {
                window.unlogged += 1;
                None
            }
            Some(window) => {
                let unlogged = window.unlogged;
                *window = Window { opened: now, unlogged: 0 };
                Some(unlogged)
            }
            None => {
                kinds.insert(kind, Window { opened: now, unlogged: 0 });
                Some(0)
            }
        }
    }
}

/// Whether the gateway or its backends are at fault (ERROR), rather than the request (INFO).
fn server_fault(error: &GatewayError) -> bool {
    match error {
        GatewayError::Upstream { error, .. } => error.backend_fault(),
        GatewayError::NoBackend { .. } | GatewayError::Task(_) => true,
        GatewayError::Invalid(_) | GatewayError::Deadline { .. } | GatewayError::RateLimited { .. } => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(backend: &str, code: Code) -> Kind {
        Kind { model: "qwen".into(), backend: backend.into(), code }
    }

    #[test]
    fn a_flood_of_one_failure_is_one_line_per_window_with_the_count_it_left_out() {
        let log = FailureLog::new(Duration::from_secs(60));
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let missing = kind("replay", Code::NotFound);
        // 15,800 failed turns, 100 a second: the first, then one a minute.
        let logged: Vec<(u64, u64)> = (0..15_800u64)
            .filter_map(|i| log.admit(missing.clone(), at(i / 100)).map(|unlogged| (i / 100, unlogged)))
            .collect();
        assert_eq!(logged, vec![(0, 0), (60, 5_999), (120, 5_999)]);
        // Another kind is not hidden by the flood: its first failure is logged at once.
        assert_eq!(log.admit(kind("replay", Code::Unavailable), at(30)), Some(0));
        assert_eq!(log.admit(kind("vllm-0", Code::NotFound), at(30)), Some(0));
    }

    #[test]
    fn a_backend_fault_is_an_error_and_a_refusal_is_not() {
        use crate::backends::AttemptError;
        let upstream = |error| GatewayError::Upstream { backend: "b".into(), attempts: 3, error };
        assert!(server_fault(&upstream(AttemptError::Status { status: 503, retry_after: None, body: String::new() })));
        assert!(!server_fault(&upstream(AttemptError::Status { status: 400, retry_after: None, body: String::new() })));
        assert!(server_fault(&GatewayError::NoBackend { model: "m".into(), reason: "all open".into() }));
        let deadline = GatewayError::Deadline { model: "m".into(), waiting: "a slot", attempts: 1 };
        assert!(!server_fault(&deadline));
    }
}
