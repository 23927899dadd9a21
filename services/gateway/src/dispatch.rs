//! One generation request through a pool: choose a backend, wait for its concurrency slot, attempt, and on a
//! retryable failure try again — on another backend when one is routable — while the request has attempts
//! left, the pool's retry budget holds a retry, and no token has streamed. A backend's Retry-After is honoured:
//! it is left alone until then, and a retry that has only it waits that long (or fails when the deadline or
//! `max_retry_after_secs` is sooner).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::accounting::Accounting;
use crate::backends::{AttemptError, DeltaSink, Generation};
use crate::config::RetryConfig;
use crate::error::GatewayError;
use crate::pool::{Backend, InFlight, NoRoute, Picked, Pool};
use crate::request::GenerateSpec;
use crate::retry::backoff;
use crate::routing::random_unit;

/// A served request.
#[derive(Debug)]
pub struct Served {
    pub generation: Generation,
    pub backend: Arc<Backend>,
    pub attempts: u32,
}

/// Serves `spec` from `pool` by `deadline`, reporting text to `sink`.
pub async fn generate(
    pool: &Pool,
    retry: &RetryConfig,
    accounting: &Accounting,
    spec: &GenerateSpec,
    deadline: Option<Instant>,
    sink: &mut DeltaSink,
) -> Result<Served, GatewayError> {
    pool.budget.deposit();
    let affinity_key = spec.keys.affinity();
    let mut request = Dispatch {
        pool,
        retry,
        accounting,
        deadline,
        model: pool.config.model.as_str(),
        tried: Vec::new(),
        attempts: 0,
        last_failure: None,
    };
    loop {
        let picked = request.pick(affinity_key.as_deref()).await?;
        let backend = pool.backends[picked.index].clone();
        request.pause_before(&backend, picked.index).await?;
        if request.attempts == 0
            && let Some(hit) = picked.affinity_hit
        {
            accounting.affinity(request.model, hit);
        }
        let in_flight = request.enter(&backend).await?;
        match request.attempt(&backend, in_flight, spec, sink).await {
            Ok(generation) => return Ok(Served { generation, backend, attempts: request.attempts }),
            Err(error) => request.prepare_retry(&backend, picked.index, error, sink.streamed())?,
        }
    }
}

/// One request on its way through a pool: what it is served with, and what its attempts so far have seen.
struct Dispatch<'a> {
    pool: &'a Pool,
    retry: &'a RetryConfig,
    accounting: &'a Accounting,
    deadline: Option<Instant>,
    model: &'a str,
    /// The backends that failed this request: a retry goes elsewhere while another is routable.
    tried: Vec<usize>,
    attempts: u32,
    /// The backend and error of the last failed attempt, reported if no backend is left to try.
    last_failure: Option<(String, AttemptError)>,
}

impl Dispatch<'_> {
    /// The backend to attempt next; while the pool is paused or asleep, waits (by the deadline) for it to change.
    async fn pick(&mut self, affinity_key: Option<&str>) -> Result<Picked, GatewayError> {
        loop {
            let changed = self.pool.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so a resume between the look and the wait is not missed.
            changed.as_mut().enable();
            match self.pool.pick(affinity_key, &self.tried, Instant::now()) {
                Ok(picked) => return Ok(picked),
                Err(NoRoute::Held) => {
                    if !wait_until(changed, self.deadline).await {
                        return Err(GatewayError::Deadline {
                            model: self.model.into(),
                            waiting: "waiting for the paused or sleeping pool",
                            attempts: self.attempts,
                        });
                    }
                }
                Err(NoRoute::Unavailable(reason)) => {
                    return Err(match self.last_failure.take() {
                        Some((backend, error)) => GatewayError::Upstream { backend, attempts: self.attempts, error },
                        None => GatewayError::NoBackend { model: self.model.into(), reason },
                    });
                }
            }
        }
    }

    /// Waits out `backend`'s Retry-After, and a backoff when it already failed this request; fails instead when
    /// the wait would reach the deadline.
    async fn pause_before(&self, backend: &Backend, index: usize) -> Result<(), GatewayError> {
        let now = Instant::now();
        let cooldown = backend.cooldown_left(now);
        let mut wait = cooldown;
        if self.tried.contains(&index) {
            wait = wait.max(backoff(self.retry, self.attempts, random_unit()));
        }
        if wait.is_zero() {
            return Ok(());
        }
        if self.deadline.is_some_and(|d| now + wait >= d) {
            return Err(pause_past_deadline(&backend.label, self.model, cooldown, wait, self.attempts));
        }
        tokio::time::sleep(wait).await;
        Ok(())
    }

    /// `backend`'s concurrency slot, by the deadline.
    async fn enter(&self, backend: &Arc<Backend>) -> Result<InFlight, GatewayError> {
        match self.deadline {
            Some(d) => tokio::time::timeout_at(d.into(), backend.enter()).await.map_err(|_| GatewayError::Deadline {
                model: self.model.into(),
                waiting: "waiting for a concurrency slot",
                attempts: self.attempts,
            }),
            None => Ok(backend.enter().await),
        }
    }

    /// One attempt on `backend`, holding its slot `in_flight`; the outcome goes to the backend's circuit breaker
    /// and the attempts metric.
    async fn attempt(
        &mut self,
        backend: &Backend,
        in_flight: InFlight,
        spec: &GenerateSpec,
        sink: &mut DeltaSink,
    ) -> Result<Generation, AttemptError> {
        backend.breaker.on_dispatch(Instant::now());
        self.attempts += 1;
        let result = backend.client.generate(spec, &self.pool.upstream_model, self.deadline, sink).await;
        drop(in_flight);
        match &result {
            Ok(_) => {
                backend.breaker.on_success();
                self.accounting.attempt(self.model, &backend.label, "ok");
            }
            Err(error) => {
                self.accounting.attempt(self.model, &backend.label, error.class());
                if error.backend_fault() {
                    backend.breaker.on_failure(Instant::now());
                } else {
                    backend.breaker.on_neutral(Instant::now());
                }
            }
        }
        result
    }

    /// After a failed attempt on `backend`: honours its Retry-After (failing the request when that is longer than
    /// allowed), and fails the request unless the error may be retried and the pool's retry budget holds a retry.
    fn prepare_retry(
        &mut self,
        backend: &Backend,
        index: usize,
        error: AttemptError,
        streamed: bool,
    ) -> Result<(), GatewayError> {
        let attempts = self.attempts;
        if let AttemptError::Status { retry_after: Some(retry_after), .. } = &error {
            if *retry_after > Duration::from_secs(self.retry.max_retry_after_secs) {
                return Err(GatewayError::RateLimited {
                    backend: backend.label.clone(),
                    retry_after: *retry_after,
                    attempts,
                });
            }
            backend.cool_down_until(Instant::now() + *retry_after);
        }
        let retry_allowed = may_retry(&error, streamed, attempts, self.retry.max_attempts);
        // One line per attempt would be one per failed turn of a job whose every generation fails: attempts are
        // DEBUG, counted by class in kforge_gateway_attempts_total; a request that finally fails is logged in
        // proportion (`failures.rs`).
        let fault = error.backend_fault();
        let model = self.model;
        tracing::debug!(model, backend = %backend.label, attempts, %error, fault, retry = retry_allowed, "upstream attempt failed");
        if !(retry_allowed && self.pool.budget.withdraw()) {
            return Err(GatewayError::Upstream { backend: backend.label.clone(), attempts, error });
        }
        if !self.tried.contains(&index) {
            self.tried.push(index);
        }
        self.last_failure = Some((backend.label.clone(), error));
        Ok(())
    }
}

/// Whether a failed attempt may be tried again (the pool's retry budget permitting): not after tokens streamed to
/// the caller, nor once `max_attempts` are made, nor for an error that another attempt would only repeat.
fn may_retry(error: &AttemptError, streamed: bool, attempts: u32, max_attempts: u32) -> bool {
    error.retryable() && !streamed && attempts < max_attempts
}

/// The failure of a request whose next attempt would have to `wait` past its deadline: rate limited when the wait
/// is the backend's Retry-After `cooldown`, out of time when it is a longer backoff.
fn pause_past_deadline(backend: &str, model: &str, cooldown: Duration, wait: Duration, attempts: u32) -> GatewayError {
    if cooldown >= wait {
        GatewayError::RateLimited { backend: backend.into(), retry_after: cooldown, attempts }
    } else {
        GatewayError::Deadline { model: model.into(), waiting: "backing off before a retry", attempts }
    }
}

/// Waits for `changed` or the deadline; false when the deadline came first.
async fn wait_until(
    changed: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    deadline: Option<Instant>,
) -> bool {
    match deadline {
        Some(d) => tokio::time::timeout_at(d.into(), changed).await.is_ok(),
        None => {
            changed.await;
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retryable_error_is_retried_only_before_streaming_and_within_the_attempts() {
        let connect = AttemptError::Connect("refused".into());
        assert!(may_retry(&connect, false, 1, 3));
        assert!(!may_retry(&connect, true, 1, 3));
        assert!(!may_retry(&connect, false, 3, 3));
        let bad_request = AttemptError::Status { status: 400, retry_after: None, body: String::new() };
        assert!(!may_retry(&bad_request, false, 1, 3));
    }

    #[test]
    fn a_wait_past_the_deadline_is_rate_limited_when_the_backend_asked_for_it() {
        let second = Duration::from_secs(1);
        let limited = pause_past_deadline("b0", "m", second, second, 2);
        assert!(matches!(limited, GatewayError::RateLimited { retry_after, attempts: 2, .. } if retry_after == second));
        let backing_off = pause_past_deadline("b0", "m", Duration::ZERO, second, 2);
        assert!(matches!(backing_off, GatewayError::Deadline { waiting: "backing off before a retry", .. }));
    }
}
