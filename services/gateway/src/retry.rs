//! When a failed attempt is tried again: the error must be retryable (see
//! [`AttemptError::retryable`](crate::backends::AttemptError::retryable)), the request must have attempts left,
//! and the pool's retry budget must hold a retry. The budget earns a fraction of a retry per request, so under a
//! fleet-wide outage retries add at most that fraction to the load instead of multiplying it.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use crate::config::RetryConfig;

/// One retry, in the budget's units.
const RETRY: i64 = 1000;

/// Retries a pool may spend, earned by requests.
#[derive(Debug)]
pub struct RetryBudget {
    balance: AtomicI64,
    earned_per_request: i64,
    cap: i64,
}

impl RetryBudget {
    pub fn new(config: &RetryConfig) -> Self {
        let cap = i64::from(config.budget_burst) * RETRY;
        Self { balance: AtomicI64::new(cap), earned_per_request: (config.budget_ratio * RETRY as f64) as i64, cap }
    }

    /// A request arrived: it earns its share of a retry.
    pub fn deposit(&self) {
        let _ = self
            .balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| Some((b + self.earned_per_request).min(self.cap)));
    }

    /// Takes one retry if the budget holds one.
    pub fn withdraw(&self) -> bool {
        self.balance.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| (b >= RETRY).then_some(b - RETRY)).is_ok()
    }
}

/// The backoff before retry `retry` (1-based): exponential from `backoff_base_ms`, capped, with full jitter
/// drawn from `random` (uniform in [0, 1)).
pub fn backoff(config: &RetryConfig, retry: u32, random: f64) -> Duration {
    let exponent = retry.saturating_sub(1).min(20);
    let ceiling = config.backoff_base_ms.saturating_mul(1 << exponent).min(config.backoff_max_ms);
    Duration::from_millis((ceiling as f64 * random.clamp(0.0, 1.0)) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_spends_its_burst_then_only_what_requests_earn() {
        let config = RetryConfig { budget_burst: 2, budget_ratio: 0.5, ..RetryConfig::default() };
        let budget = RetryBudget::new(&config);
        assert!(budget.withdraw() && budget.withdraw());
        assert!(!budget.withdraw(), "the burst is spent");
        budget.deposit();
        assert!(!budget.withdraw(), "half a retry is not a retry");
        budget.deposit();
        assert!(budget.withdraw());
        for _ in 0..100 {
            budget.deposit();
        }
        assert!(budget.withdraw() && budget.withdraw() && !budget.withdraw(), "savings are capped at the burst");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let config = RetryConfig { backoff_base_ms: 10, backoff_max_ms: 35, ..RetryConfig::default() };
        let almost_one = 0.999_999;
        assert_eq!(backoff(&config, 1, almost_one), Duration::from_millis(9));
        assert_eq!(backoff(&config, 2, almost_one), Duration::from_millis(19));
        assert_eq!(backoff(&config, 5, almost_one), Duration::from_millis(34));
        assert_eq!(backoff(&config, 5, 0.0), Duration::ZERO);
    }
}
