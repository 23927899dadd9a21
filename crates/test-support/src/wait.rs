//! Waiting for a condition: a probe called every [`INTERVAL`] until it is ready or [`PATIENCE`] has passed, and a
//! failure that names what was awaited and what the probe saw last. The one poll loop of kforge's tests and
//! benchmarks; a probe is a question to the system under test (a counter, a status call), never a fixed sleep.

use std::fmt::{self, Display};
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How long [`eventually`] waits: generous, for a 2-core machine that is building at the same time.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// How often [`eventually`] asks: short, so that a test goes on soon after the condition holds.
pub const INTERVAL: Duration = Duration::from_millis(10);

/// What a probe returns: ready (with a value) or not yet (with what it saw, for the failure message).
pub trait Probe {
    /// What the wait returns once ready.
    type Value;
    /// `Ok` when ready; otherwise what was seen, if the probe says.
    fn ready(self) -> Result<Self::Value, Option<String>>;
}

impl Probe for bool {
    type Value = ();
    fn ready(self) -> Result<(), Option<String>> {
        if self { Ok(()) } else { Err(None) }
    }
}

impl<T> Probe for Option<T> {
    type Value = T;
    fn ready(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

/// An error is "not yet", and the last one is in the failure message (a server that is still starting).
impl<T, E: Display> Probe for Result<T, E> {
    type Value = T;
    fn ready(self) -> Result<T, Option<String>> {
        self.map_err(|error| Some(error.to_string()))
    }
}

/// A wait that ran out of patience.
#[derive(Debug, Clone)]
pub struct TimedOut {
    /// What was awaited.
    pub what: String,
    /// How long it waited.
    pub waited: Duration,
    /// What the probe saw last, when it said.
    pub last: Option<String>,
}

impl Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "waited {:?} for {}", self.waited, self.what)?;
        match &self.last {
            Some(last) => write!(f, " (last seen: {last})"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for TimedOut {}

/// A wait for `what`, within [`PATIENCE`], asking every [`INTERVAL`]; change either before [`Wait::until`].
#[derive(Debug, Clone)]
pub struct Wait {
    what: String,
    patience: Duration,
    interval: Duration,
}

impl Wait {
    pub fn new(what: impl Into<String>) -> Self {
        Self { what: what.into(), patience: PATIENCE, interval: INTERVAL }
    }

    /// Gives up after `patience`.
    pub fn within(self, patience: Duration) -> Self {
        Self { patience, ..self }
    }

    /// Asks every `interval`.
    pub fn every(self, interval: Duration) -> Self {
        Self { interval, ..self }
    }

    /// Calls `probe` until it is ready and returns its value; panics naming what was awaited when patience runs
    /// out (a probe still running then is dropped).
    pub async fn until<P, F, Fut>(self, probe: F) -> P::Value
    where
        P: Probe,
        F: FnMut() -> Fut,
        Fut: Future<Output = P>,
    {
        match self.try_until(probe).await {
            Ok(value) => value,
            Err(timed_out) => panic!("{timed_out}"),
        }
    }

    /// [`Wait::until`], returning the timeout as an error instead (for a benchmark that reports it).
    pub async fn try_until<P, F, Fut>(self, mut probe: F) -> Result<P::Value, TimedOut>
    where
        P: Probe,
        F: FnMut() -> Fut,
        Fut: Future<Output = P>,
    {
        let started = Instant::now();
        let deadline = started + self.patience;
        let mut last = None;
        loop {
            match tokio::time::timeout_at(deadline, probe()).await.map(Probe::ready) {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(seen)) => last = seen.or(last),
                Err(_) => break,
            }
            if Instant::now() + self.interval >= deadline {
                break;
            }
            tokio::time::sleep(self.interval).await;
        }
        Err(TimedOut { what: self.what, waited: started.elapsed(), last })
    }
}

/// Waits until `probe` is ready, for at most [`PATIENCE`]: `eventually("the job to finish", || async { ... })`.
/// The probe returns a `bool`, an `Option` (its value is returned) or a `Result` (the last error is shown when the
/// wait fails). Panics naming `what` when patience runs out.
pub async fn eventually<P, F, Fut>(what: impl Into<String>, probe: F) -> P::Value
where
    P: Probe,
    F: FnMut() -> Fut,
    Fut: Future<Output = P>,
{
    Wait::new(what).until(probe).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_the_value_once_the_probe_is_ready() {
        let calls = AtomicU32::new(0);
        let value = eventually("the third call", || async {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            (n == 3).then_some(n)
        })
        .await;
        assert_eq!(value, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn names_what_was_awaited_and_the_last_error_when_patience_runs_out() {
        let timed_out = Wait::new("the server")
            .within(Duration::from_secs(1))
            .try_until(|| async { Err::<(), _>("connection refused") })
            .await
            .expect_err("never ready");
        let message = timed_out.to_string();
        assert!(message.starts_with("waited ") && message.contains("for the server"), "{message}");
        assert!(message.ends_with("(last seen: connection refused)"), "{message}");
        assert!(timed_out.waited >= Duration::from_millis(990), "{timed_out:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_never_returns_ends_at_the_deadline() {
        let timed_out = Wait::new("a hung call")
            .within(Duration::from_secs(2))
            .try_until(std::future::pending::<bool>)
            .await
            .expect_err("never ready");
        assert_eq!(timed_out.waited, Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "for a condition that never holds")]
    async fn until_panics_with_the_message() {
        Wait::new("a condition that never holds").within(Duration::from_millis(50)).until(|| async { false }).await;
    }
}
