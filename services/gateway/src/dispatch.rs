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
use crate::pool::{Backend, NoRoute, Pool};
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
    let model = pool.config.model.as_str();
    let affinity_key = spec.keys.affinity();
    let mut tried: Vec<usize> = Vec::new();
    let mut attempts = 0u32;
    let mut last_failure: Option<(String, AttemptError)> = None;
    loop {
        let picked = loop {
            let changed = pool.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so a resume between the look and the wait is not missed.
            changed.as_mut().enable();
            match pool.pick(affinity_key.as_deref(), &tried, Instant::now()) {
                Ok(picked) => break picked,
                Err(NoRoute::Held) => {
                    if !wait_until(changed, deadline).await {
                        return Err(GatewayError::Deadline {
                            model: model.into(),
                            waiting: "waiting for the paused or sleeping pool",
                            attempts,
                        });
                    }
                }
                Err(NoRoute::Unavailable(reason)) => {
                    return Err(match last_failure {
                        Some((backend, error)) => GatewayError::Upstream { backend, attempts, error },
                        None => GatewayError::NoBackend { model: model.into(), reason },
                    });
                }
            }
        };
        let backend = pool.backends[picked.index].clone();
        let now = Instant::now();
        let cooldown = backend.cooldown_left(now);
        let mut wait = cooldown;
        if tried.contains(&picked.index) {
            wait = wait.max(backoff(retry, attempts, random_unit()));
        }
        if !wait.is_zero() {
            if deadline.is_some_and(|d| now + wait >= d) {
                return Err(if cooldown >= wait {
                    GatewayError::RateLimited { backend: backend.label.clone(), retry_after: cooldown, attempts }
                } else {
                    GatewayError::Deadline { model: model.into(), waiting: "backing off before a retry", attempts }
                });
            }
            tokio::time::sleep(wait).await;
        }
        if attempts == 0
            && let Some(hit) = picked.affinity_hit
        {
            accounting.affinity(model, hit);
        }
        let in_flight = match deadline {
            Some(d) => tokio::time::timeout_at(d.into(), backend.enter()).await.map_err(|_| {
                GatewayError::Deadline { model: model.into(), waiting: "waiting for a concurrency slot", attempts }
            })?,
            None => backend.enter().await,
        };
        backend.breaker.on_dispatch(Instant::now());
        attempts += 1;
        let result = backend.client.generate(spec, &pool.upstream_model, deadline, sink).await;
        drop(in_flight);
        let error = match result {
            Ok(generation) => {
                backend.breaker.on_success();
                accounting.attempt(model, &backend.label, "ok");
                return Ok(Served { generation, backend, attempts });
            }
            Err(error) => error,
        };
        accounting.attempt(model, &backend.label, error.class());
        let now = Instant::now();
        if error.backend_fault() {
            backend.breaker.on_failure(now);
        } else {
            backend.breaker.on_neutral(now);
        }
        if let AttemptError::Status { retry_after: Some(retry_after), .. } = &error {
            if *retry_after > Duration::from_secs(retry.max_retry_after_secs) {
                return Err(GatewayError::RateLimited {
                    backend: backend.label.clone(),
                    retry_after: *retry_after,
                    attempts,
                });
            }
            backend.cool_down_until(now + *retry_after);
        }
        let retry_allowed = error.retryable() && !sink.streamed() && attempts < retry.max_attempts;
        // One line per attempt would be one per failed turn of a job whose every generation fails: attempts are
        // DEBUG, counted by class in kforge_gateway_attempts_total; a request that finally fails is logged in
        // proportion (`failures.rs`).
        let fault = error.backend_fault();
        tracing::debug!(model, backend = %backend.label, attempts, %error, fault, retry = retry_allowed, "upstream attempt failed");
        if !(retry_allowed && pool.budget.withdraw()) {
            return Err(GatewayError::Upstream { backend: backend.label.clone(), attempts, error });
        }
        if !tried.contains(&picked.index) {
            tried.push(picked.index);
        }
        last_failure = Some((backend.label.clone(), error));
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
