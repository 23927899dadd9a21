//! An evaluation's outcome, typed: what its stages reported whatever became of it ([`Record`]: their notes, the
//! device, the mismatch, the timing and the census), from which the evaluator's edge (`response.rs`) builds the
//! response once the evaluation has ended.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kforge_execution::census::{self, KernelRecord};
use kforge_execution::devices::{Lane, MemberTimes};
use kforge_execution::metrics::{DEVICE_LANE_STAGE, ExecutionMetrics};
use kforge_execution::protocol::MismatchRecord;
use kforge_execution::times::{Stage, ms};
use kforge_execution::{Engine, Finding, Judgement, Notes};

use super::baseline::Baseline;
use super::check::Compared;
use super::paired::{PairedSpeedup, unsteady};
use super::verdict;
use crate::stats::TimingStats;

/// What an evaluation's stages reported, whatever became of it.
#[derive(Debug, Default)]
pub(crate) struct Record {
    /// Stage times and findings, in the order they came.
    pub(crate) notes: Notes,
    /// The device it ran on, once it had one.
    pub(crate) device: Option<Device>,
    /// When it got its device slot, and its stages' times at the device's gate: its device time, once the slot is
    /// given back.
    pub(crate) lane_held: Option<(Instant, Arc<Mutex<MemberTimes>>)>,
    /// The most device memory the candidate's process held at once, when its stage finished.
    pub(crate) device_peak_bytes: u64,
    /// The first output that differed from the reference's.
    pub(crate) mismatch: Option<MismatchRecord>,
    /// The timing, when the candidate was timed.
    pub(crate) timing: Option<Timing>,
    /// The census's kernels and profiling ratio, when the census ran.
    pub(crate) census: Option<KernelCensus>,
}

/// The device an evaluation ran on.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Device {
    /// As `GetCapabilities` names devices: `cpu`, or the GPU's name.
    pub(crate) name: String,
    /// A GPU's: the task's reference peak device memory there, where known (0 otherwise).
    pub(crate) reference_peak_bytes: u64,
}

/// The census's kernels of every mode, and the profiling ratio of the measured one.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct KernelCensus {
    pub(crate) kernels: Vec<KernelRecord>,
    pub(crate) profiling_ratio: f64,
}

/// How the eager speedup was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Basis {
    /// Against the task's baseline, timed once and cached.
    CachedBaseline,
    /// Over rounds alternating with a paired baseline's (`paired.rs`).
    Paired,
}

/// A timed candidate's statistics, its baselines', and its speedups over them.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Timing {
    pub(crate) candidate: Option<TimingStats>,
    pub(crate) eager: Option<TimingStats>,
    pub(crate) compiled: Option<TimingStats>,
    /// The eager median over the candidate's; 0 without both.
    pub(crate) speedup_eager: f64,
    /// The torch.compile median over the candidate's; 0 without both.
    pub(crate) speedup_compile: f64,
    pub(crate) basis: Option<Basis>,
    /// Paired: the rounds' speedups' interquartile range over their median.
    pub(crate) speedup_spread: f64,
    /// The baseline the candidate's samples were compared with (the remeasure's wall-clock cross-check uses it).
    pub(crate) against: Baseline,
}

impl Record {
    /// Notes the device `lane` gives the evaluation: its name and, on a GPU, the task's reference peak there; its
    /// hold starts now.
    pub(super) fn placed(&mut self, engine: &Engine, lane: &Lane, task_key: &str) {
        let reference_peak_bytes = match lane.gpu() {
            Some(_) => engine.reference_peak(task_key).unwrap_or(0),
            None => 0,
        };
        self.lane_held = Some((Instant::now(), lane.gate_times()));
        let name = engine.checked_python().device_name(lane.gpu()).to_owned();
        self.device = Some(Device { name, reference_peak_bytes });
    }

    /// Closes the record once the evaluation has given its lane back: the CPU time of its harness stages
    /// (`stage_cpu`, by stage), and its hold of the device, which `metrics` count too.
    pub(super) fn close(&mut self, stage_cpu: BTreeMap<&'static str, f64>, metrics: &ExecutionMetrics) {
        for (stage, cpu_ms) in stage_cpu {
            self.notes.times.insert_cpu(stage, cpu_ms);
        }
        if let Some((held, gate)) = self.lane_held.take() {
            let held = held.elapsed();
            self.notes.times.insert(Stage::Device, ms(held));
            metrics.stage_seconds(DEVICE_LANE_STAGE, held);
            let gate = *gate.lock().expect("never poisoned");
            self.notes.times.insert(Stage::DeviceAlone, ms(gate.alone));
            self.notes.times.insert(Stage::DeviceGateWait, ms(gate.waited));
        }
    }

    /// Keeps the comparison's first mismatch; its verdict (`verdict::outputs`).
    pub(super) fn checked(&mut self, compared: Compared) -> Result<(), Judgement> {
        let trial = compared.mismatch.as_ref().map(|(trial, _)| *trial);
        self.mismatch = compared.mismatch.map(|(_, mismatch)| mismatch);
        verdict::outputs(trial)
    }

    /// Keeps the census's kernels, profiling ratio and findings; its verdict (`verdict::census`).
    pub(super) fn censused(&mut self, census: census::Census) -> Result<(), Judgement> {
        let census::Census { kernels, profiling_ratio, findings } = census;
        let verdict = verdict::census(&findings);
        self.notes.findings.extend(findings.into_iter().map(Finding::from));
        self.census = Some(KernelCensus { kernels, profiling_ratio });
        verdict
    }

    /// The candidate's timed median, when it was timed.
    pub(super) fn candidate_median_ms(&self) -> Option<f64> {
        self.timing.as_ref()?.candidate.as_ref().map(|stats| stats.median_ms)
    }
}

impl Timing {
    /// The candidate's statistics against its baseline's (`against`), and the speedups over them.
    pub(super) fn new(candidate: Option<TimingStats>, against: Baseline) -> Self {
        let stats = |samples: &Option<Vec<f64>>| samples.clone().and_then(crate::stats::timing_stats);
        let eager = crate::stats::timing_stats(against.eager.clone());
        let compiled = stats(&against.compiled);
        let speedup = |baseline: &Option<TimingStats>| match (baseline, &candidate) {
            (Some(b), Some(c)) if c.median_ms > 0.0 => b.median_ms / c.median_ms,
            _ => 0.0,
        };
        let (speedup_eager, speedup_compile) = (speedup(&eager), speedup(&compiled));
        let basis = Some(Basis::CachedBaseline);
        Self { candidate, eager, compiled, speedup_eager, speedup_compile, basis, speedup_spread: 0.0, against }
    }

    /// Takes the paired speedup where the rounds paired: it replaces the eager one, with its spread and, beyond
    /// `bound`, the notice `timing.unsteady`; pairing `asked` for that did not pair says so.
    pub(super) fn pair(&mut self, paired: Option<PairedSpeedup>, asked: bool, bound: f64) -> Option<Finding> {
        if let Some(paired) = paired {
            self.speedup_eager = paired.speedup;
            self.speedup_spread = paired.spread;
            self.basis = Some(Basis::Paired);
            return unsteady(paired, bound);
        }
        asked.then(|| {
            Finding::notice(
                "timing.unpaired",
                "paired timing was asked for, but the rounds did not pair (the paired baseline failed, or the \
                 candidate ran again unpaired after running out of device memory): the speedup is against the \
                 cached baseline",
            )
        })
    }

    /// Takes the slower of the first measurement and `again`, a measurement of the same candidate in a fresh
    /// process on new inputs, because the first's speedup was above `bound`: the speedups, paired or not, scale to
    /// the slower. The notice `timing.remeasured` says so, when both have a median.
    pub(super) fn take_slower(&mut self, again: Option<TimingStats>, bound: f64) -> Option<Finding> {
        let first = self.speedup_eager;
        let first_ms = self.candidate.as_ref()?.median_ms;
        let again_ms = again.as_ref()?.median_ms;
        if again_ms > first_ms {
            self.candidate = again;
            self.speedup_eager *= first_ms / again_ms;
            self.speedup_compile *= first_ms / again_ms;
        }
        Some(Finding::notice(
            "timing.remeasured",
            format!(
                "a speedup of {first:.1}x over eager is above the plausibility bound of {bound}x: measured again in a \
                 fresh process on new inputs ({first_ms:.4} ms, then {again_ms:.4} ms); the slower counts"
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use kforge_static_checks::Category;

    use super::*;

    fn stats(median_ms: f64) -> Option<TimingStats> {
        Some(TimingStats { median_ms, ..TimingStats::default() })
    }

    fn baseline(eager: &[f64], compiled: Option<&[f64]>) -> Baseline {
        Baseline { eager: eager.to_vec(), eager_host: None, compiled: compiled.map(<[f64]>::to_vec) }
    }

    #[test]
    fn speedups_are_the_baselines_median_over_the_candidates() {
        let timing = Timing::new(stats(2.0), baseline(&[6.0], None));
        assert_eq!((timing.speedup_eager, timing.speedup_compile), (3.0, 0.0));
        assert_eq!(timing.basis, Some(Basis::CachedBaseline));
        let timing = Timing::new(stats(0.0), baseline(&[6.0], Some(&[4.0])));
        assert_eq!((timing.speedup_eager, timing.speedup_compile), (0.0, 0.0), "no speedup from a zero median");
    }

    #[test]
    fn the_basis_says_how_the_speedup_was_taken() {
        let cached = || Timing::new(stats(2.0), baseline(&[6.0], None));
        let mut timing = cached();
        let finding = timing.pair(Some(PairedSpeedup { speedup: 2.0, spread: 0.5 }), true, 0.2);
        assert_eq!((timing.basis, timing.speedup_eager, timing.speedup_spread), (Some(Basis::Paired), 2.0, 0.5));
        assert_eq!(finding.map(|f| f.code), Some("timing.unsteady".into()));
        let mut timing = cached();
        let finding = timing.pair(None, true, 0.2).expect("asked and not paired");
        assert_eq!((timing.basis, timing.speedup_eager), (Some(Basis::CachedBaseline), 3.0));
        assert_eq!((finding.code.as_ref(), finding.category), ("timing.unpaired", Category::Notice));
        assert!(!finding.message.contains("  "), "{}", finding.message);
        assert!(cached().pair(None, false, 0.2).is_none(), "unpaired as configured: nothing to say");
    }

    #[test]
    fn a_remeasure_keeps_the_slower_and_scales_the_speedups() {
        let first = || Timing { speedup_compile: 2.0, ..Timing::new(stats(1.0), baseline(&[100.0], None)) };
        let mut slower = first();
        let finding = slower.take_slower(stats(4.0), 50.0).expect("both medians");
        assert_eq!((slower.candidate, slower.speedup_eager, slower.speedup_compile), (stats(4.0), 25.0, 0.5));
        assert_eq!(finding.code, "timing.remeasured");
        assert!(finding.message.contains("a speedup of 100.0x over eager is above the plausibility bound of 50x"));
        assert!(finding.message.contains("(1.0000 ms, then 4.0000 ms)"), "{}", finding.message);
        let mut faster = first();
        assert!(faster.take_slower(stats(0.5), 50.0).is_some());
        assert_eq!((faster.candidate, faster.speedup_eager), (stats(1.0), 100.0), "the first was slower");
        assert!(first().take_slower(None, 50.0).is_none(), "no median again: nothing to say");
    }
}
