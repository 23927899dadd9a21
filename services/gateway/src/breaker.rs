//! A circuit breaker per backend: consecutive failed attempts open it, an open breaker keeps requests away for a
//! while, then lets one probe through (half-open); the probe's outcome closes or re-opens it. An active health
//! check that passes again closes it at once (the backend is back; no need to wait out the open period).

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    /// No request before `until`; then one probe, which moves `until` on by the open period while it runs, so a
    /// probe whose caller went away (no outcome ever reported) frees the slot after that period.
    Open {
        until: Instant,
        probing: bool,
    },
}

/// The breaker of one backend.
#[derive(Debug)]
pub struct Breaker {
    state: Mutex<State>,
    threshold: u32,
    open_for: Duration,
}

impl Breaker {
    pub fn new(threshold: u32, open_for: Duration) -> Self {
        Self { state: Mutex::new(State::Closed { failures: 0 }), threshold: threshold.max(1), open_for }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock leaves a plain enum behind, which is still valid.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a request may be sent now.
    pub fn admits(&self, now: Instant) -> bool {
        match *self.lock() {
            State::Closed { .. } => true,
            State::Open { until, .. } => now >= until,
        }
    }

    /// A request is being sent: past an open period, it is the probe.
    pub fn on_dispatch(&self, now: Instant) {
        let mut state = self.lock();
        if let State::Open { until, .. } = *state
            && now >= until
        {
            *state = State::Open { until: now + self.open_for, probing: true };
        }
    }

    pub fn on_success(&self) {
        *self.lock() = State::Closed { failures: 0 };
    }

    /// A failure the backend is to blame for.
    pub fn on_failure(&self, now: Instant) {
        let mut state = self.lock();
        *state = match *state {
            State::Closed { failures } if failures + 1 < self.threshold => State::Closed { failures: failures + 1 },
            State::Closed { .. } | State::Open { .. } => State::Open { until: now + self.open_for, probing: false },
        };
    }

    /// An attempt that ended without a verdict on the backend (a 4xx, a replay miss): a probe's slot is freed.
    pub fn on_neutral(&self, now: Instant) {
        let mut state = self.lock();
        if let State::Open { probing: true, .. } = *state {
            *state = State::Open { until: now, probing: false };
        }
    }

    /// `closed`, `open` or `half_open` (a probe may pass or is passing), as ListModels shows it.
    pub fn name(&self, now: Instant) -> &'static str {
        match *self.lock() {
            State::Closed { .. } => "closed",
            State::Open { probing: true, .. } => "half_open",
            State::Open { until, .. } if now < until => "open",
            State::Open { .. } => "half_open",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_then_probes_once() {
        let breaker = Breaker::new(3, Duration::from_secs(5));
        let t0 = Instant::now();
        for _ in 0..2 {
            breaker.on_failure(t0);
        }
        assert!(breaker.admits(t0), "two failures are under the threshold");
        breaker.on_failure(t0);
        assert!(!breaker.admits(t0));
        assert_eq!(breaker.name(t0), "open");
        let later = t0 + Duration::from_secs(6);
        assert!(breaker.admits(later));
        breaker.on_dispatch(later);
        assert!(!breaker.admits(later), "one probe at a time");
        assert_eq!(breaker.name(later), "half_open");
        breaker.on_failure(later);
        assert!(!breaker.admits(later + Duration::from_secs(1)), "a failed probe re-opens");
        let again = later + Duration::from_secs(6);
        breaker.on_dispatch(again);
        breaker.on_success();
        assert_eq!(breaker.name(again), "closed");
    }

    #[test]
    fn a_probe_that_never_reports_frees_its_slot_after_the_open_period() {
        let breaker = Breaker::new(1, Duration::from_secs(5));
        let t0 = Instant::now();
        breaker.on_failure(t0);
        let probe = t0 + Duration::from_secs(5);
        breaker.on_dispatch(probe);
        assert!(!breaker.admits(probe + Duration::from_secs(1)));
        assert!(breaker.admits(probe + Duration::from_secs(5)), "the abandoned probe's slot is free again");
        breaker.on_dispatch(probe + Duration::from_secs(5));
        breaker.on_neutral(probe + Duration::from_secs(6));
        assert!(breaker.admits(probe + Duration::from_secs(6)), "a neutral outcome frees the slot at once");
    }

    #[test]
    fn a_success_resets_the_count() {
        let breaker = Breaker::new(2, Duration::from_secs(5));
        let t0 = Instant::now();
        breaker.on_failure(t0);
        breaker.on_success();
        breaker.on_failure(t0);
        assert!(breaker.admits(t0));
    }
}
