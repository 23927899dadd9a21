//! Active health checks: each HTTP backend with a health route is probed every `interval_ms`; a failed probe
//! takes it out of routing, a passing one puts it back (closing its breaker) and wakes requests waiting on the
//! pool. Backends start healthy, so requests flow before the first probe returns.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::backends::BackendClient;
use crate::config::HealthConfig;
use crate::pool::Pool;

/// Starts one probe loop per checked backend of `pools`; they stop when `stop` is cancelled.
pub fn spawn(pools: &[Arc<Pool>], config: &HealthConfig, stop: &CancellationToken) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    let interval = Duration::from_millis(config.interval_ms);
    let timeout = Duration::from_millis(config.timeout_ms);
    for pool in pools {
        for (index, backend) in pool.backends.iter().enumerate() {
            let (BackendClient::OpenAi(_), Some(_)) = (&backend.client, &backend.health_path) else {
                continue;
            };
            let pool = pool.clone();
            let stop = stop.clone();
            tasks.spawn(async move {
                let backend = pool.backends[index].clone();
                let (BackendClient::OpenAi(client), Some(path)) = (&backend.client, &backend.health_path) else {
                    return;
                };
                loop {
                    let healthy = tokio::select! {
                        () = stop.cancelled() => return,
                        healthy = client.check_health(path, timeout) => healthy,
                    };
                    let was = backend.healthy();
                    if backend.set_healthy(healthy) {
                        tracing::info!(backend = %backend.label, "health check passes again");
                        pool.changed.notify_waiters();
                    } else if was && !healthy {
                        tracing::warn!(backend = %backend.label, "health check failed; not routing to it");
                    }
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(interval) => {}
                    }
                }
            });
        }
    }
    tasks
}
