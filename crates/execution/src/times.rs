//! Where a run's time went, as the services' responses report it (`stage_ms`): each stage under a [`Stage`], the
//! harness's phases within a stage as `<stage>.<phase>` (`run.trials`), and each harness stage's CPU time as
//! `cpu.<harness stage>` (`cpu.candidate`). The keys are the contract's: [`Stage::as_str`] is the wire's key.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::protocol::Report;

/// A stage of a run, timed in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    /// The static checks.
    Static,
    /// Waiting for a compile worker.
    QueueCompile,
    /// The build itself (its wait for a worker is [`Stage::QueueCompile`]).
    Compile,
    /// Waiting for disk or memory room for the run's files (evaluations on a GPU).
    QueueDisk,
    /// Waiting for a device slot.
    QueueDevice,
    /// The candidate's stage of an evaluation.
    Run,
    /// The comparison with the reference.
    Check,
    /// The baselines and the timing statistics.
    Timing,
    /// An implausible speedup measured again in a fresh process.
    Remeasure,
    /// A profile's census stage.
    Census,
    /// A profile's stage under the profiler.
    Profiled,
    /// How long the run held its device slot.
    Device,
    /// How long its stages ran alone on the device.
    DeviceAlone,
    /// How long its stages waited at the device's gate.
    DeviceGateWait,
}

impl Stage {
    pub const ALL: [Stage; 14] = [
        Stage::Static,
        Stage::QueueCompile,
        Stage::Compile,
        Stage::QueueDisk,
        Stage::QueueDevice,
        Stage::Run,
        Stage::Check,
        Stage::Timing,
        Stage::Remeasure,
        Stage::Census,
        Stage::Profiled,
        Stage::Device,
        Stage::DeviceAlone,
        Stage::DeviceGateWait,
    ];

    /// The stage's key in `stage_ms`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Static => "static",
            Stage::QueueCompile => "queue_compile",
            Stage::Compile => "compile",
            Stage::QueueDisk => "queue_disk",
            Stage::QueueDevice => "queue_device",
            Stage::Run => "run",
            Stage::Check => "check",
            Stage::Timing => "timing",
            Stage::Remeasure => "remeasure",
            Stage::Census => "census",
            Stage::Profiled => "profiled",
            Stage::Device => "device",
            Stage::DeviceAlone => "device.alone",
            Stage::DeviceGateWait => "device.gate_wait",
        }
    }
}

/// A key of `stage_ms`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Key {
    Stage(Stage),
    /// A phase of a stage, as the harness names it.
    Phase(Stage, String),
    /// A harness stage's CPU time, by the harness stage's name (`protocol::Mode::name`).
    Cpu(&'static str),
}

impl Key {
    fn wire(&self) -> String {
        match self {
            Key::Stage(stage) => stage.as_str().to_owned(),
            Key::Phase(stage, phase) => format!("{}.{phase}", stage.as_str()),
            Key::Cpu(stage) => format!("cpu.{stage}"),
        }
    }
}

/// Milliseconds by stage, phase and harness stage; a later time for the same key replaces the earlier.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageTimes(BTreeMap<Key, f64>);

impl StageTimes {
    pub fn insert(&mut self, stage: Stage, ms: f64) {
        self.0.insert(Key::Stage(stage), ms);
    }

    /// The time from `started` to now, as `stage`'s.
    pub fn since(&mut self, stage: Stage, started: Instant) {
        self.insert(stage, ms(started.elapsed()));
    }

    pub fn get(&self, stage: Stage) -> Option<f64> {
        self.0.get(&Key::Stage(stage)).copied()
    }

    /// A phase of `stage` (`<stage>.<phase>`).
    pub fn insert_phase(&mut self, stage: Stage, phase: &str, ms: f64) {
        self.0.insert(Key::Phase(stage, phase.to_owned()), ms);
    }

    /// The harness's time per phase of `stage` (its report's `phases_ms`).
    pub fn phases<R>(&mut self, stage: Stage, report: &Report<R>) {
        for (phase, ms) in &report.phases_ms {
            self.insert_phase(stage, phase, *ms);
        }
    }

    /// The CPU time of the harness stage named `harness_stage` (`cpu.<harness stage>`).
    pub fn insert_cpu(&mut self, harness_stage: &'static str, ms: f64) {
        self.0.insert(Key::Cpu(harness_stage), ms);
    }

    pub fn extend(&mut self, other: StageTimes) {
        self.0.extend(other.0);
    }

    /// The times by their keys on the wire.
    pub fn wire(&self) -> impl Iterator<Item = (String, f64)> + '_ {
        self.0.iter().map(|(key, ms)| (key.wire(), *ms))
    }
}

/// Milliseconds, as `stage_ms` holds them.
pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_are_the_contracts() {
        let keys: Vec<&str> = Stage::ALL.iter().map(|stage| stage.as_str()).collect();
        assert_eq!(
            keys,
            [
                "static",
                "queue_compile",
                "compile",
                "queue_disk",
                "queue_device",
                "run",
                "check",
                "timing",
                "remeasure",
                "census",
                "profiled",
                "device",
                "device.alone",
                "device.gate_wait"
            ]
        );
        let mut times = StageTimes::default();
        times.insert(Stage::Run, 2.0);
        times.insert_phase(Stage::Run, "trials", 1.5);
        times.insert_cpu("candidate", 3.0);
        times.insert(Stage::Run, 2.5);
        let wire: BTreeMap<String, f64> = times.wire().collect();
        let expected = [("cpu.candidate", 3.0), ("run", 2.5), ("run.trials", 1.5)];
        assert_eq!(wire, expected.map(|(key, ms)| (key.to_owned(), ms)).into(), "a later time replaces the earlier");
        assert_eq!((times.get(Stage::Run), times.get(Stage::Check)), (Some(2.5), None));
    }
}
