//! A job's progress while it runs, shared by its episodes: the job's snapshot (state, turns and episodes done,
//! metrics over its recorded turns), each turn's stages written to the store as they complete, the turns in
//! flight by stage, and the failing-turns breaker over the recorded turns. Watchers (WatchJob, GetJob) are sent
//! every change; the store's copy of the snapshot is rewritten at most once a second and at every state change.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::breaker::{Breaker, Failure, Observed};
use crate::failure::TurnFailure;

use crate::metrics::job_metrics;
use crate::monitoring::OrchestratorMetrics;
use crate::store::{Stage, Store, StoreError};

/// Turns in flight by stage, for WatchJob.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    pub(super) generating: AtomicU64,
    pub(super) evaluating: AtomicU64,
    pub(super) scoring: AtomicU64,
}

/// Counts a turn into a stage, in its job's count and across jobs, for as long as it lives.
pub(super) struct StageGuard<'a>(&'a AtomicU64, Gauge);

impl<'a> StageGuard<'a> {
    pub(super) fn enter(counter: &'a AtomicU64, across_jobs: Gauge) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        across_jobs.inc();
        Self(counter, across_jobs)
    }
}

impl Drop for StageGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.dec();
    }
}

/// What the job's metrics need of a turn: the record without its prompt, completion, feedback and the bulk of its
/// evaluation.
pub(super) fn slim(turn: &pb::TurnRecord) -> pb::TurnRecord {
    pb::TurnRecord {
        prompt: Vec::new(),
        completion: None,
        // The verdict, speedups and findings, without logs, outputs and timings.
        evaluation: turn.evaluation.as_ref().map(|e| pb::EvaluateResponse {
            verdict: e.verdict,
            speedup_eager: e.speedup_eager,
            speedup_compile: e.speedup_compile,
            findings: e.findings.clone(),
            ..Default::default()
        }),
        feedback: String::new(),
        prompt_token_ids: Vec::new(),
        ..turn.clone()
    }
}

/// A turn as its stages left it, to be recorded: its record, and why it failed where a call did (stored as the
/// record's `error` when it is recorded).
#[derive(Debug)]
pub(super) struct TakenTurn {
    pub(super) record: pb::TurnRecord,
    pub(super) failure: Option<TurnFailure>,
}

impl TakenTurn {
    /// Keeps the first failure: a later call that fails too does not replace it.
    pub(super) fn fail(&mut self, failure: TurnFailure) {
        self.failure.get_or_insert(failure);
    }
}

/// The job's snapshot, shared by its episodes.
#[derive(Debug)]
pub(super) struct Progress {
    pub(super) job_id: String,
    snapshot: tokio::sync::Mutex<Snapshot>,
    pub(super) store: Store,
    updates: watch::Sender<pb::JobProgress>,
    started: Instant,
    /// The seconds the job ran before this run (its stored `wall_time_s`; 0 for a new job): a resumed job's wall
    /// time is the sum of its runs' spans, not the last run's alone.
    before_s: f64,
    pub(super) in_flight: InFlight,
    /// The orchestrator's Prometheus metrics (every job's turns and stages count there too).
    pub(super) metrics: OrchestratorMetrics,
    /// Whether the job's responses are checked for their opening (not-okay detection on), as its metrics say.
    opening_checked: bool,
    /// Cancelled when the breaker trips, which stops the job's episodes.
    trip: CancellationToken,
    /// Why the breaker tripped, once it has.
    tripped: std::sync::OnceLock<String>,
}

#[derive(Debug)]
struct Snapshot {
    job: pb::Job,
    /// Every recorded turn, slim: the metrics are recomputed from them as turns arrive.
    turns: Vec<pb::TurnRecord>,
    /// When the metrics were last computed.
    metrics_at: Option<Instant>,
    /// When the snapshot was last written to the store.
    stored_at: Option<Instant>,
    /// The failing-turns breaker, over the turns in the order they are recorded.
    breaker: Breaker,
}

/// How often a running job's metrics and its stored snapshot are refreshed; exactly at every state change and at
/// the end. Each computation is over every recorded turn, under the lock every turn's record takes: recomputed at
/// each turn, a thousand trajectories finishing their turns together queued behind it (p99 overhead per turn 5.4 ms
/// against 3 ms; bench/results/orchestrator-overhead/2026-11-25-dev). The snapshot in the store is for readers in
/// other processes: the turns are the record, and a resumed job recomputes everything from them; watchers and
/// GetJob here see every recorded turn at once, and the metrics within this period.
const REFRESH_EVERY: Duration = Duration::from_secs(1);

impl Snapshot {
    fn refresh_metrics(&mut self, elapsed_s: f64, force: bool) {
        let due = self.metrics_at.is_none_or(|at| at.elapsed() >= REFRESH_EVERY);
        if force || due {
            self.job.metrics = Some(job_metrics(self.job.spec.as_ref(), &self.turns, elapsed_s));
            self.metrics_at = Some(Instant::now());
        }
    }
}

impl Progress {
    pub(super) fn new(
        job: pb::Job,
        turns: Vec<pb::TurnRecord>,
        store: Store,
        updates: watch::Sender<pb::JobProgress>,
        started: Instant,
        metrics: OrchestratorMetrics,
    ) -> Self {
        // The stored snapshot's figure: exact for a run that stopped (a state change stores it), and at most the
        // refresh period plus the time since its last recorded turn short for a run that was killed.
        let before_s = job.metrics.as_ref().map_or(0.0, |m| m.wall_time_s).max(0.0);
        let opening_checked = crate::metrics::opening_checked(job.spec.as_ref());
        Self {
            job_id: job.job_id.clone(),
            snapshot: tokio::sync::Mutex::new(Snapshot {
                job,
                turns,
                metrics_at: None,
                stored_at: None,
                breaker: Breaker::new(0),
            }),
            store,
            updates,
            started,
            before_s,
            in_flight: InFlight::default(),
            metrics,
            opening_checked,
            trip: CancellationToken::new(),
            tripped: std::sync::OnceLock::new(),
        }
    }

    /// Fails the job once `failed_turns` recorded turns in a row failed for the same reason (0: never): `trip` is
    /// cancelled (the job's episodes stop) and [`Progress::tripped`] says why.
    pub(super) fn with_breaker(mut self, failed_turns: u32, trip: CancellationToken) -> Self {
        self.snapshot.get_mut().breaker = Breaker::new(failed_turns);
        self.trip = trip;
        self
    }

    /// Why the breaker tripped, if it has.
    pub(super) fn tripped(&self) -> Option<&str> {
        self.tripped.get().map(String::as_str)
    }

    pub(super) async fn set_state(&self, state: pb::JobState, error: String) {
        let mut snapshot = self.snapshot.lock().await;
        snapshot.refresh_metrics(self.wall_time_s(), true);
        let Snapshot { job, turns, .. } = &mut *snapshot;
        job.state = state.into();
        job.error = error;
        job.turns_done = turns.len() as u64;
        job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, None, true).await;
    }

    /// Records a turn (committed before this returns), its failure stored as its `error`, then refreshes the
    /// metrics over every recorded turn. Returns the record as stored.
    pub(super) async fn record(&self, position: i64, taken: TakenTurn) -> Result<pb::TurnRecord, StoreError> {
        let TakenTurn { record, failure } = taken;
        let record = pb::TurnRecord { error: failure.as_ref().map(ToString::to_string).unwrap_or_default(), ..record };
        // The write needs no lock: each (task, trajectory, turn) has one writer, its episode.
        self.store.put_turn(&self.job_id, position, Stage::Recorded, &record).await?;
        self.metrics.turn(&record, failure.as_ref(), self.opening_checked);
        let failed_on = Failure::of(failure.as_ref(), &record);
        let turn = slim(&record);
        let mut snapshot = self.snapshot.lock().await;
        let observed = snapshot.breaker.observe(failed_on);
        self.log_failure(&turn, failed_on, observed);
        snapshot.turns.push(turn.clone());
        snapshot.refresh_metrics(self.wall_time_s(), false);
        let Snapshot { job, turns, .. } = &mut *snapshot;
        job.turns_done = turns.len() as u64;
        job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, Some(turn), false).await;
        Ok(record)
    }

    /// Logs a turn that failed on a service call: the first of a streak at WARN, the rest of it at DEBUG (a peer
    /// down fails every turn that reaches it, and the streak is bounded by the breaker), the breaker's trip at WARN.
    fn log_failure(&self, turn: &pb::TurnRecord, failure: Option<Failure<'_>>, observed: Observed) {
        let Some(error) = failure else { return };
        let job_id = &self.job_id;
        let (task_id, trajectory, turn_index) = (&turn.task_id, turn.trajectory, turn.turn);
        match observed {
            Observed::Passed => {}
            Observed::NewStreak => tracing::warn!(%job_id, %task_id, trajectory, turn = turn_index, %error,
                "turn failed on a service call; its episode ends (the same failure again is logged at debug)"),
            Observed::Again(failed) => tracing::debug!(%job_id, %task_id, trajectory, turn = turn_index, %error,
                failed, "turn failed on a service call again"),
            Observed::Tripped(reason) => match self.tripped.set(reason) {
                Ok(()) => {
                    tracing::warn!(%job_id, reason = self.tripped().unwrap_or_default(),
                        "the failing-turns breaker tripped: failing the job");
                    self.trip.cancel();
                }
                // A turn that was recorded while the job's episodes stopped.
                Err(_) => tracing::debug!(%job_id, %task_id, trajectory, turn = turn_index, %error,
                    "turn failed on a service call after the breaker tripped"),
            },
        }
    }

    /// Stores a turn's stage (committed before this returns) and tells watchers.
    pub(super) async fn stage(&self, position: i64, stage: Stage, turn: &pb::TurnRecord) -> Result<(), StoreError> {
        self.store.put_turn(&self.job_id, position, stage, turn).await?;
        self.notify().await;
        Ok(())
    }

    /// Sends the current snapshot (in-flight counts changed).
    pub(super) async fn notify(&self) {
        let snapshot = self.snapshot.lock().await;
        self.updates.send_replace(self.progress(&snapshot.job, None));
    }

    pub(super) async fn episode_done(&self) {
        let mut snapshot = self.snapshot.lock().await;
        snapshot.job.episodes_done += 1;
        self.publish(&mut snapshot, None, false).await;
    }

    /// Stores the snapshot as it is (the job stops here without a verdict, to be resumed).
    pub(super) async fn stopped(&self) {
        let mut snapshot = self.snapshot.lock().await;
        snapshot.refresh_metrics(self.wall_time_s(), true);
        snapshot.job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, None, true).await;
    }

    pub(super) async fn finish(&self, state: pb::JobState, error: String) {
        let mut snapshot = self.snapshot.lock().await;
        snapshot.refresh_metrics(self.wall_time_s(), true);
        let job = &mut snapshot.job;
        job.state = state.into();
        job.error = error;
        job.updated_at = Some(crate::now());
        self.publish(&mut snapshot, None, true).await;
    }

    /// The job's wall time: its earlier runs' and this one's so far.
    fn wall_time_s(&self) -> f64 {
        self.before_s + self.started.elapsed().as_secs_f64()
    }

    fn progress(&self, job: &pb::Job, recorded: Option<pb::TurnRecord>) -> pb::JobProgress {
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        pb::JobProgress {
            job: Some(job.clone()),
            in_flight: Some(pb::StageCounts {
                generating: count(&self.in_flight.generating),
                evaluating: count(&self.in_flight.evaluating),
                scoring: count(&self.in_flight.scoring),
            }),
            recorded,
        }
    }

    /// Sends the snapshot to watchers, and writes it to the store when `force`d (a state change) or due.
    async fn publish(&self, snapshot: &mut Snapshot, recorded: Option<pb::TurnRecord>, force: bool) {
        if force || snapshot.stored_at.is_none_or(|at| at.elapsed() >= REFRESH_EVERY) {
            match self.store.put_job(&snapshot.job).await {
                Ok(()) => snapshot.stored_at = Some(Instant::now()),
                Err(error) => tracing::error!(job_id = %self.job_id, %error, "job snapshot not stored"),
            }
        }
        self.updates.send_replace(self.progress(&snapshot.job, recorded));
    }
}
