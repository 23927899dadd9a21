//! Harness stages of any kind on the engine: a process started in the sandbox, its request run on a device lane
//! (a device fault has the device probed), the CPU time of a run's stages accounted, scratch directories, and the
//! caches' eviction in the background.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use super::{Engine, STAGE_CPU};
use crate::cache::Cache;
use crate::devices::{self, Lane};
use crate::protocol::StageSpec;
use crate::stage::{self, Joining, Request, Stage, StageError, StageOutcome, Started};

impl Engine {
    /// Runs `run`, accounting the CPU time of the harness stages it runs; returns its output and the CPU
    /// milliseconds by stage.
    pub async fn with_cpu_account<T>(run: impl Future<Output = T>) -> (T, BTreeMap<&'static str, f64>) {
        STAGE_CPU
            .scope(RefCell::default(), async {
                let output = run.await;
                (output, STAGE_CPU.with(RefCell::take))
            })
            .await
    }

    /// Starts a harness process for `stage` now; it waits for its request (see [`stage::start`]).
    pub fn start(&self, stage: Stage, cancel: &CancellationToken) -> Started {
        let inner = &self.inner;
        stage::start(&inner.sandbox, self.checked_python(), &inner.harness, stage, cancel.child_token())
    }

    /// Runs `request` in a started harness process; one on a GPU `lane` that ends in a device fault has the device
    /// probed before the lane is used again.
    pub async fn stage<S: StageSpec>(
        &self,
        started: Started,
        request: Request<S>,
        lane: Option<&Lane>,
    ) -> Result<StageOutcome<S::Result>, StageError> {
        let inner = &self.inner;
        let name = request.mode().name();
        let _running = inner.metrics.stage(name);
        let started_at = std::time::Instant::now();
        // Stages that run no candidate code join idle and share the device only for their device work.
        let trusted = request.mode().trusted();
        let joining = |lane: &Lane| match lane.solo() {
            false if trusted => Joining::Idle,
            solo => Joining::Share { solo },
        };
        let outcome = started.run(request, lane.map(|lane| (lane.gate(), joining(lane)))).await;
        if let (Ok(outcome), Some(lane)) = (&outcome, lane) {
            lane.add_gate_times(outcome.gate);
        }
        inner.metrics.stage_seconds(name, started_at.elapsed());
        if let Some(cpu_ms) = outcome.as_ref().ok().and_then(|outcome| outcome.cpu_ms()) {
            // Work outside an accounted run (a baseline computed ahead) has no account to add to.
            let _ = STAGE_CPU.try_with(|spent| *spent.borrow_mut().entry(name).or_default() += cpu_ms);
        }
        if let (Ok(finished), Some(lane)) = (&outcome, lane)
            && lane.gpu().is_some()
            && let Some(fault) = devices::fault(finished.finished.exit, &finished.error_text())
        {
            inner.lanes.after_fault(lane, &fault).await;
        }
        // Only now may the others on the device run alone without this stage: a stage that was killed, hung or
        // faulted leaves the device once it has been checked.
        outcome.map(|mut outcome| {
            outcome.leave_gate();
            outcome
        })
    }

    /// Evicts from `cache` in the background if it grew past its bound.
    pub fn evict_later(&self, name: &'static str, cache: &Cache) {
        let (cache, metrics) = (cache.clone(), self.inner.metrics.clone());
        tokio::task::spawn_blocking(move || {
            let removed = cache.evict();
            if removed > 0 {
                tracing::info!(cache = name, removed, "evicted cache entries");
                metrics.evicted(name, removed);
            }
        });
    }

    /// A fresh scratch directory's path (`prefix` names what it is for), unique across every engine of this
    /// process and every process sharing the work directory. Not created.
    pub fn scratch_dir(&self, prefix: &str) -> PathBuf {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.scratch_root.join(format!("{}-{prefix}{id}", std::process::id()))
    }
}
