//! Timing an evaluation's candidate: its samples checked, its task's baseline (cached, or timed in a clean child),
//! the paired baseline's rounds where timing is paired, the wall-clock cross-check, and the statistics and
//! speedups (`record.rs`'s [`Timing`]).

use std::time::Instant;

use kforge_execution::devices::Lane;
use kforge_execution::engine::InfraError;
use kforge_execution::protocol::{BaselineResult, CandidateResult};
use kforge_execution::stage::StageOutcome;
use kforge_execution::times::Stage;
use kforge_execution::{Notes, Staged, Stop};

use super::{Evaluating, Evaluator, Timing, paired, verdict};
use crate::stats::timing_stats;

impl Evaluator {
    /// The candidate's timing (its run's `result`) against its task's baseline on `lane`: the `paired` baseline's
    /// eager samples where its rounds paired with the candidate's, else the cached baseline's. Its notes: `timing`
    /// (the baseline, or waiting for the one computed ahead) and the notices of how the speedup was taken; the
    /// evaluation stops here on impossible samples or work the timer could not see.
    pub(super) async fn time(
        &self,
        run: &Evaluating<'_>,
        lane: &Lane,
        result: &CandidateResult,
        paired: Option<Result<StageOutcome<BaselineResult>, InfraError>>,
    ) -> Staged<Timing> {
        let (inner, submission, trials) = (&self.inner, &run.evaluation.submission, &run.trials);
        let started = Instant::now();
        let mut notes = Notes::default();
        let asked = paired.is_some();
        let outcome = async {
            let measured = verdict::samples(result)?;
            let (init_seed, timing_seeds, dir) = (trials.init_seed, &trials.timing_seeds, &run.dirs.baseline);
            let cached = self.baseline(submission, lane, init_seed, timing_seeds, dir, run.cancel).await?;
            // Paired: the eager samples are the paired baseline's, timed in the candidate's window.
            let (baseline, speedup) = paired::reference(&cached, paired, (&measured.events, &result.rounds));
            verdict::wall_clock(&measured, &baseline)?;
            // What a profile of the task on this device takes its call limits from.
            if let Some(eager) = timing_stats(cached.eager.clone()) {
                inner.engine.note_eager_median(&run.task_key, lane.gpu(), eager.median_ms);
            }
            let mut timing = Timing::new(timing_stats(measured.events), baseline);
            notes.findings.extend(timing.pair(speedup, asked, inner.config.paired_timing.spread_bound));
            notes.times.since(Stage::Timing, started);
            Ok::<_, Stop>(timing)
        }
        .await;
        Staged::new(notes, outcome)
    }
}
