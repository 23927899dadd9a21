//! A model's pool at run time: its backends with their live state (load, health, breaker, pause and sleep,
//! weight version, Retry-After cooldown, concurrency slots) and the choice of a backend for one attempt.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::backends::openai::OpenAiBackend;
use crate::backends::replay::ReplayBackend;
use crate::backends::{BackendClient, BackendError};
use crate::breaker::Breaker;
use crate::config::{BackendConfig, BackendKind, GatewayConfig, Policy, PoolConfig};
use crate::error::SetupError;
use crate::retry::RetryBudget;
use crate::routing::{self, Candidate, Ring};

/// One backend and its live state.
#[derive(Debug)]
pub struct Backend {
    pub label: String,
    pub kind: BackendKind,
    pub client: BackendClient,
    pub breaker: Breaker,
    pub health_path: Option<String>,
    pub max_concurrency: u32,
    outstanding: AtomicU32,
    slots: Option<Arc<Semaphore>>,
    healthy: AtomicBool,
    paused: AtomicBool,
    sleep_level: AtomicU32,
    weight_version: Mutex<String>,
    cooldown_until: Mutex<Option<Instant>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The guarded values are plain data that a panic cannot leave half-written.
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Backend {
    /// The backend of `config`; HTTP kinds share `http` (one connection pool per gateway).
    pub fn new(config: &BackendConfig, gateway: &GatewayConfig, http: &reqwest::Client) -> Result<Self, BackendError> {
        let client = match config.kind {
            BackendKind::Replay => {
                let file = config.file.as_deref().ok_or(BackendError::ReplayFileUnset)?;
                BackendClient::Replay(ReplayBackend::load(file)?)
            }
            BackendKind::Vllm | BackendKind::Sglang | BackendKind::Openai | BackendKind::Llamacpp => {
                BackendClient::OpenAi(OpenAiBackend::new(config, http.clone())?)
            }
        };
        Ok(Self {
            label: config.label(),
            kind: config.kind,
            client,
            breaker: Breaker::new(gateway.breaker.failure_threshold, Duration::from_millis(gateway.breaker.open_ms)),
            health_path: config.health_path().map(str::to_owned),
            max_concurrency: config.max_concurrency,
            outstanding: AtomicU32::new(0),
            slots: (config.max_concurrency > 0).then(|| Arc::new(Semaphore::new(config.max_concurrency as usize))),
            healthy: AtomicBool::new(true),
            paused: AtomicBool::new(false),
            sleep_level: AtomicU32::new(0),
            weight_version: Mutex::new(String::new()),
            cooldown_until: Mutex::new(None),
        })
    }

    pub fn outstanding(&self) -> u32 {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Records a health check; true when the backend just came back.
    pub fn set_healthy(&self, healthy: bool) -> bool {
        let was = self.healthy.swap(healthy, Ordering::Relaxed);
        if healthy && !was {
            self.breaker.on_success();
        }
        healthy && !was
    }

    pub fn paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
    }

    pub fn set_paused(&self, paused: bool) {
        self.paused.store(paused, Ordering::Relaxed);
    }

    pub fn sleep_level(&self) -> u32 {
        self.sleep_level.load(Ordering::Relaxed)
    }

    pub fn set_sleep_level(&self, level: u32) {
        self.sleep_level.store(level, Ordering::Relaxed);
    }

    pub fn weight_version(&self) -> String {
        lock(&self.weight_version).clone()
    }

    pub fn set_weight_version(&self, version: &str) {
        *lock(&self.weight_version) = version.to_owned();
    }

    /// Asks for no request before `until` (a 429's Retry-After).
    pub fn cool_down_until(&self, until: Instant) {
        let mut cooldown = lock(&self.cooldown_until);
        if cooldown.is_none_or(|current| current < until) {
            *cooldown = Some(until);
        }
    }

    /// How long the backend asked to be left alone from `now`.
    pub fn cooldown_left(&self, now: Instant) -> Duration {
        lock(&self.cooldown_until).map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
    }

    /// Held back by an operator (paused or asleep): requests wait rather than fail.
    pub fn held(&self) -> bool {
        self.paused() || self.sleep_level() > 0
    }

    /// Whether new requests may go to it now.
    pub fn routable(&self, now: Instant) -> bool {
        self.healthy() && !self.held() && self.breaker.admits(now)
    }

    /// Counts a request on this backend until the returned guard drops; waits for a concurrency slot when the
    /// backend has a limit (the wait counts as outstanding, so routing sees the queue).
    pub async fn enter(self: &Arc<Self>) -> InFlight {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        let mut in_flight = InFlight { backend: self.clone(), _slot: None };
        if let Some(slots) = &self.slots {
            in_flight._slot = slots.clone().acquire_owned().await.ok();
        }
        in_flight
    }
}

/// One request counted on a backend (and holding its concurrency slot).
#[derive(Debug)]
pub struct InFlight {
    backend: Arc<Backend>,
    _slot: Option<OwnedSemaphorePermit>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.backend.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why no backend was chosen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoRoute {
    /// Every backend that could serve is paused or asleep: wait for RESUME or WAKE.
    Held,
    /// None can serve; the text says why, per backend.
    Unavailable(String),
}

/// The choice of a backend for one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Picked {
    pub index: usize,
    /// For affinity routing: whether the episode's home served it.
    pub affinity_hit: Option<bool>,
}

/// A routed model.
#[derive(Debug)]
pub struct Pool {
    pub config: PoolConfig,
    pub upstream_model: String,
    pub backends: Vec<Arc<Backend>>,
    pub budget: RetryBudget,
    /// Signalled when a backend may have become routable (resume, wake, health back).
    pub changed: Notify,
    ring: Ring,
}

impl Pool {
    pub fn new(config: &PoolConfig, gateway: &GatewayConfig, http: &reqwest::Client) -> Result<Self, SetupError> {
        let mut backends = Vec::with_capacity(config.backends.len());
        for (i, backend) in config.backends.iter().enumerate() {
            let built = Backend::new(backend, gateway, http).map_err(|source| SetupError::Backend {
                model: config.model.clone(),
                index: i,
                source,
            })?;
            backends.push(Arc::new(built));
        }
        let labels: Vec<String> = backends.iter().map(|b| b.label.clone()).collect();
        Ok(Self {
            upstream_model: config.upstream_model.clone().unwrap_or_else(|| config.model.clone()),
            config: config.clone(),
            ring: Ring::new(&labels),
            backends,
            budget: RetryBudget::new(&gateway.retry),
            changed: Notify::new(),
        })
    }

    /// Chooses a backend by the pool's policy. Backends in `tried` (and those cooling down after a 429) are
    /// chosen only when no other is routable; then the caller waits out their cooldown or backoff.
    pub fn pick(&self, affinity_key: Option<&str>, tried: &[usize], now: Instant) -> Result<Picked, NoRoute> {
        let routable: Vec<bool> = self.backends.iter().map(|b| b.routable(now)).collect();
        let fresh: Vec<Candidate> = self
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| Candidate {
                outstanding: b.outstanding(),
                eligible: routable[i] && !tried.contains(&i) && b.cooldown_left(now).is_zero(),
            })
            .collect();
        let any_fresh = fresh.iter().any(|c| c.eligible);
        let candidates: Vec<Candidate> = if any_fresh {
            fresh
        } else {
            fresh.iter().enumerate().map(|(i, c)| Candidate { eligible: routable[i], ..*c }).collect()
        };
        let picked = match (self.config.policy, affinity_key) {
            (Policy::Affinity, Some(key)) => routing::affinity(
                &self.ring,
                key,
                &candidates,
                self.config.affinity_load_factor,
                self.config.affinity_min_load,
            )
            .map(|(index, hit)| Picked { index, affinity_hit: Some(hit) }),
            (Policy::LeastOutstanding, _) => routing::least_outstanding(&candidates, routing::random())
                .map(|index| Picked { index, affinity_hit: None }),
            (Policy::PowerOfTwo | Policy::Affinity, _) => {
                routing::power_of_two(&candidates, routing::random()).map(|index| Picked { index, affinity_hit: None })
            }
        };
        picked.ok_or_else(|| self.why_none(now))
    }

    fn why_none(&self, now: Instant) -> NoRoute {
        let waiting = self.backends.iter().any(|b| b.held() && b.healthy());
        if waiting {
            return NoRoute::Held;
        }
        let reasons: Vec<String> = self
            .backends
            .iter()
            .map(|b| {
                let why = if !b.healthy() {
                    "failing its health check"
                } else if !b.breaker.admits(now) {
                    "circuit breaker open"
                } else {
                    "paused or asleep"
                };
                format!("{} {why}", b.label)
            })
            .collect();
        NoRoute::Unavailable(reasons.join("; "))
    }
}
