//! Paired timing (docs/evaluator/TIMING.md, "Paired timing"): a fresh baseline process, started beside the candidate's,
//! times the reference eagerly in rounds that alternate with the candidate's timing rounds (`devices::pairing`),
//! and the speedup is the median over the rounds of each round's ratio. Load that comes and goes on a shared
//! machine slows both sides of a pair of rounds alike, so the ratio keeps to the kernel; the cached baseline, timed
//! once under whatever load was then, cannot.

use std::path::Path;

use kforge_execution::Finding;
use kforge_execution::devices::{Lane, PairSide};
use kforge_execution::engine::{InfraError, Submission};
use kforge_execution::protocol::{BaselineResult, BaselineSpec, Mode, TimingSpec};
use kforge_execution::stage::{Request, StageOutcome, Started};
use tokio_util::sync::CancellationToken;

use super::Evaluator;
use super::baseline::Baseline;
use crate::stats::quantile;

/// A paired speedup: the median of the rounds' ratios, and how widely they spread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct PairedSpeedup {
    pub(super) speedup: f64,
    /// The ratios' interquartile range over their median.
    pub(super) spread: f64,
}

impl Evaluator {
    /// Starts the paired baseline's process: its interpreter and torch load while the candidate's do.
    pub(super) fn start_paired_baseline(
        &self,
        submission: &Submission,
        scratch: &Path,
        cancel: &CancellationToken,
    ) -> Result<Started, InfraError> {
        let python = self.inner.engine.checked_python();
        let stage = self.baseline_stage(submission, scratch, python.env(scratch))?;
        Ok(self.inner.engine.start(stage, cancel))
    }

    /// Runs the started paired baseline on `lane`: the eager reference timed in the configured rounds, each taking
    /// its turn after one of the candidate's. torch.compile is not timed here (the cached baseline has it).
    pub(super) async fn paired_baseline(
        &self,
        started: Started,
        lane: &Lane,
        side: PairSide,
        init_seed: u64,
        timing_seeds: &[u64],
        scratch: &Path,
    ) -> Result<StageOutcome<BaselineResult>, InfraError> {
        let inner = &self.inner;
        let python = inner.engine.checked_python();
        let spec = BaselineSpec {
            task_path: scratch.join("task.py"),
            device: lane.device(),
            init_seed,
            timing: TimingSpec::from(&inner.config.timing).paired(inner.config.paired_timing.rounds),
            timing_seeds: timing_seeds.to_vec(),
            compile: false,
            timing_cpu: python.timing_cpu(lane.gpu()),
        };
        let request = Request { spec, env: python.device_env(lane.gpu()), limits: None, pair: Some(side) };
        inner.engine.stage(started, request, Some(lane)).await.map_err(InfraError::stage(Mode::Baseline))
    }
}

/// The baseline the candidate's timing is compared with, and the paired speedup where there is one: the paired
/// baseline's eager samples (torch.compile's stay the cached baseline's) where its rounds pair with the
/// candidate's `(samples, rounds)`, else the cached baseline.
pub(super) fn reference(
    cached: &Baseline,
    outcome: Option<Result<StageOutcome<BaselineResult>, InfraError>>,
    candidate: (&[f64], &[u32]),
) -> (Baseline, Option<PairedSpeedup>) {
    let paired = outcome.and_then(|outcome| match outcome {
        Ok(outcome) => paired_eager(outcome),
        Err(error) => {
            tracing::warn!(%error, "the paired baseline did not run: the cached baseline is used");
            None
        }
    });
    let Some((eager, eager_host, rounds)) = paired else { return (cached.clone(), None) };
    match paired_speedup(candidate, (&eager, &rounds)) {
        Some(speedup) => {
            let baseline = Baseline { eager, eager_host: Some(eager_host), compiled: cached.compiled.clone() };
            (baseline, Some(speedup))
        }
        None => (cached.clone(), None),
    }
}

/// The paired baseline's eager samples (events, host clock) and their rounds, when it timed them.
fn paired_eager(outcome: StageOutcome<BaselineResult>) -> Option<(Vec<f64>, Vec<f64>, Vec<u32>)> {
    if !outcome.ok() {
        tracing::warn!(error = %outcome.error_text(), "the paired baseline failed: the cached baseline is used");
        return None;
    }
    let result = outcome.result?.body;
    Some((result.eager_ms?, result.eager_host_ms?, result.eager_rounds?))
}

/// The median over the rounds of each round's ratio, eager / candidate, of the two sides' lower quartiles, and the
/// ratios' spread. A call's time on a shared CPU is its own plus what the load makes it wait (for a CPU, for memory
/// another process evicted from the caches), and a fast call and a memory-bound reference wait differently: the
/// lower quartile of a round is the calls that met the least of it, and still a quarter of them (a candidate that
/// skips its work on a few calls does not set it). `None` unless both sides timed the same number of rounds, each
/// with samples, whose counts add up to their samples.
pub(super) fn paired_speedup(candidate: (&[f64], &[u32]), eager: (&[f64], &[u32])) -> Option<PairedSpeedup> {
    let (candidate_rounds, eager_rounds) = (split(candidate)?, split(eager)?);
    if candidate_rounds.len() != eager_rounds.len() || candidate_rounds.is_empty() {
        return None;
    }
    let mut ratios = Vec::with_capacity(candidate_rounds.len());
    for (candidate, eager) in candidate_rounds.into_iter().zip(eager_rounds) {
        let (candidate, eager) = (lower_quartile(candidate)?, lower_quartile(eager)?);
        if !(candidate > 0.0 && eager > 0.0) {
            return None;
        }
        ratios.push(eager / candidate);
    }
    ratios.sort_by(f64::total_cmp);
    let speedup = quantile(&ratios, 0.5);
    let spread = (quantile(&ratios, 0.75) - quantile(&ratios, 0.25)) / speedup;
    Some(PairedSpeedup { speedup, spread })
}

/// The notice for paired rounds that spread beyond `bound`: the machine's load moved faster than the rounds
/// alternate, and the speedup is uncertain by about the spread.
pub(super) fn unsteady(paired: PairedSpeedup, bound: f64) -> Option<Finding> {
    (paired.spread > bound).then(|| {
        Finding::notice(
            "timing.unsteady",
            format!(
                "the paired rounds' speedups spread {:.0}% (interquartile range over the median {:.3}x), beyond the \
             bound of {:.0}%: the machine's load changed within rounds, and the speedup is uncertain by about as much",
                paired.spread * 100.0,
                paired.speedup,
                bound * 100.0
            ),
        )
    })
}

/// `samples` cut into rounds of `counts` samples each; `None` when the counts do not add up or a round is empty.
fn split<'a>((samples, counts): (&'a [f64], &[u32])) -> Option<Vec<&'a [f64]>> {
    let total: u64 = counts.iter().map(|&count| u64::from(count)).sum();
    if total != samples.len() as u64 || counts.contains(&0) {
        return None;
    }
    let mut rest = samples;
    Some(
        counts
            .iter()
            .map(|&count| {
                let (round, tail) = rest.split_at(count as usize);
                rest = tail;
                round
            })
            .collect(),
    )
}

fn lower_quartile(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (!sorted.is_empty()).then(|| quantile(&sorted, 0.25))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_compares_the_sides_lower_quartiles() {
        // One round each: the candidate's calls 1-4 ms (lower quartile 1.75), the eager calls 2 ms but for one slow
        // outlier and a burst of load (lower quartile 2.0).
        let candidate = [4.0, 1.0, 3.0, 2.0];
        let eager = [2.0, 9.0, 2.0, 6.0, 2.0];
        let paired = paired_speedup((&candidate, &[4]), (&eager, &[5])).expect("paired");
        assert_eq!(paired.speedup, 2.0 / 1.75);
    }

    #[test]
    fn the_speedup_is_the_median_of_the_rounds_ratios() {
        // Three rounds; the machine slowed both sides fourfold in the second.
        let candidate = [1.0, 1.0, 4.0, 4.0, 4.0, 1.0];
        let eager = [2.0, 2.0, 8.0, 8.0, 2.0, 2.0];
        let paired = paired_speedup((&candidate, &[2, 3, 1]), (&eager, &[2, 2, 2])).expect("paired");
        assert_eq!(paired, PairedSpeedup { speedup: 2.0, spread: 0.0 });
    }

    #[test]
    fn a_spread_beyond_the_bound_is_named() {
        let candidate = [1.0, 1.0, 1.0, 1.0];
        let eager = [1.0, 2.0, 3.0, 4.0];
        let paired = paired_speedup((&candidate, &[1; 4]), (&eager, &[1; 4])).expect("paired");
        // Ratios 1, 2, 3, 4: median 2.5, quartiles 1.75 and 3.25.
        assert_eq!(paired, PairedSpeedup { speedup: 2.5, spread: 0.6 });
        let finding = unsteady(paired, 0.2).expect("beyond 20%");
        assert_eq!(finding.code, "timing.unsteady");
        assert!(finding.message.contains("spread 60%"), "{}", finding.message);
        assert!(unsteady(paired, 0.6).is_none(), "at the bound");
    }

    #[test]
    fn rounds_that_do_not_pair_give_no_speedup() {
        let samples = [1.0, 1.0, 1.0];
        let cases: [(&[u32], &[u32]); 5] = [
            (&[1, 2], &[1, 1, 1]), // unequal round counts
            (&[1, 1], &[1, 2]),    // counts that do not add up to the samples
            (&[3, 0], &[1, 2]),    // an empty round
            (&[], &[]),            // no rounds
            (&[1, 2], &[2, 2]),    // more counted than sampled
        ];
        for (candidate, eager) in cases {
            assert_eq!(paired_speedup((&samples, candidate), (&samples, eager)), None, "{candidate:?} {eager:?}");
        }
        let zero = [0.0, 1.0];
        assert_eq!(paired_speedup((&zero, &[1, 1]), (&[1.0, 1.0], &[1, 1])), None, "a zero median");
    }
}
