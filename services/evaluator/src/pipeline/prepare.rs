//! What an evaluation readies before its candidate runs: its directories, its trials' seeds, room for its files,
//! the processes started before a device is free, and its device lane.

use std::path::{Path, PathBuf};
use std::time::Instant;

use kforge_execution::cache::{self};
use kforge_execution::devices::{self, Lane};
use kforge_execution::disk::{OutputPlan, TaskSizes};
use kforge_execution::engine::{Backend, InfraError};
use kforge_execution::handoff::{self, FilesRoom};
use kforge_execution::protocol::Sensitivity;
use kforge_execution::times::Stage;
use kforge_execution::{Notes, Staged, Stop};

use super::candidate::Processes;
use super::check::Trials;
use super::request::Evaluation;
use super::{Evaluating, Evaluator};

/// An evaluation's directories, one per stage under its scratch directory; the candidate's moves to memory where its
/// files fit there (`handoff.rs`).
#[derive(Debug)]
pub(super) struct Dirs {
    pub(super) scratch: PathBuf,
    pub(super) compile: PathBuf,
    pub(super) candidate: PathBuf,
    pub(super) check: PathBuf,
    pub(super) baseline: PathBuf,
    pub(super) paired: PathBuf,
}

impl Dirs {
    /// Makes the stages' directories under `scratch`.
    pub(super) fn make(scratch: &Path) -> Result<Self, InfraError> {
        let dirs = ["compile", "candidate", "check", "baseline", "paired"].map(|stage| scratch.join(stage));
        for dir in &dirs {
            std::fs::create_dir_all(dir).map_err(InfraError::files(format!("scratch directory {}", dir.display())))?;
        }
        let [compile, candidate, check, baseline, paired] = dirs;
        Ok(Self { scratch: scratch.to_owned(), compile, candidate, check, baseline, paired })
    }
}

/// The room an evaluation's files take, and its hold on its task's cached references, both until it ends; and the
/// task's sizes, where its dry run could tell them.
#[derive(Debug, Default)]
pub(super) struct Room {
    files: Option<FilesRoom>,
    _cached_references: Vec<cache::Protected>,
    pub(super) sizes: Option<TaskSizes>,
}

impl Room {
    /// The candidate's working directory in memory, where its files go there.
    pub(super) fn memory_dir(&self) -> Option<&Path> {
        self.files.as_ref()?.memory_dir()
    }
}

impl Evaluator {
    /// The seeds of the evaluation's trials: the last `recheck_trials` of them run after timing and the census, and
    /// the first of those replays trial 0; the sensitivity trial's; the model's and the timing inputs' (the
    /// baseline's too); and the key of the timed outputs' digests.
    pub(super) fn trials(&self, evaluation: &Evaluation, task_key: &str) -> Trials {
        let (engine, config) = (&self.inner.engine, &self.inner.config);
        let mut seeds = engine.seeds(task_key, "trial", (evaluation.trials + config.recheck_trials) as usize);
        let recheck_from = evaluation.trials as usize;
        let replay = replay_trial(&mut seeds, recheck_from);
        let sensitivity = self.sensitivity_trial(task_key, &mut seeds, recheck_from);
        let (init_seed, timing_seeds) = self.baseline_seeds(task_key);
        let digest_key = engine.seeds(task_key, "timed-digest", 1)[0];
        Trials { seeds, recheck_from, init_seed, timing_seeds, sensitivity, replay, digest_key }
    }

    /// On a GPU, the task's sizes (a dry run on the meta device, once per task): the room its files take, and its
    /// footprint before its reference has run. The room is reserved before the candidate starts, and held until the
    /// evaluation ends: the candidate's files in memory where they fit (`handoff.rs`), else on the disk. A reference
    /// cached now is protected from eviction to the evaluation's end and needs no room; a missing one gets room for
    /// the new entry. Its note: `queue_disk`, the wait for the room.
    pub(super) async fn reserve_room(
        &self,
        evaluation: &Evaluation,
        trials: &Trials,
        task_key: &str,
        scratch: &Path,
    ) -> Staged<Room> {
        let (engine, submission) = (&self.inner.engine, &evaluation.submission);
        let mut notes = Notes::default();
        if submission.backend == Backend::Cpu {
            return Staged::new(notes, Ok(Room::default()));
        }
        let started = Instant::now();
        let disk = engine.disk();
        // First the cached references: their entries say the outputs' size where the dry run cannot.
        let (guards, cached) = self.protect_cached_references(submission, trials);
        let python = engine.checked_python();
        let sizes = disk.task_sizes(task_key, &submission.task, engine.sandbox(), python, &scratch.join("sizes")).await;
        let plan = OutputPlan {
            trials: u64::from(evaluation.trials + self.inner.config.recheck_trials),
            budget: self.inner.config.output_bytes_budget,
            new_reference: !cached,
        };
        let room = handoff::reserve(disk, engine.memory_files(), sizes, plan).await;
        let outcome = match room.map_err(InfraError::files("the candidate's directory in memory")) {
            Ok(files) => {
                notes.times.since(Stage::QueueDisk, started);
                Ok(Room { files: Some(files), _cached_references: guards, sizes })
            }
            Err(error) => Err(Stop::Infra(error)),
        };
        Staged::new(notes, outcome)
    }

    /// Starts the candidate's process before the lane: the interpreter and torch load while other evaluations use
    /// the device. So does a paired baseline's, which a failed candidate stops (`paired.rs`).
    pub(super) fn start_processes(&self, run: &Evaluating<'_>) -> Result<Processes, InfraError> {
        let (inner, submission) = (&self.inner, &run.evaluation.submission);
        let candidate = inner.engine.start_candidate(submission, &run.dirs.candidate, &run.built.dir, run.cancel)?;
        let paired_cancel = run.cancel.child_token();
        let on_gpu = submission.backend != Backend::Cpu;
        let paired = match run.evaluation.measure && inner.config.paired_timing.applies(on_gpu) {
            true => Some(self.start_paired_baseline(submission, &run.dirs.paired, &paired_cancel)?),
            false => None,
        };
        Ok(Processes { candidate, paired, paired_cancel })
    }

    /// The evaluation's device lane, by its priority and job, its footprint on a GPU known from the task's
    /// reference or its sizes (`sizes`). Its note: `queue_device`, the wait for it.
    pub(super) async fn acquire_lane(&self, run: &Evaluating<'_>, sizes: Option<TaskSizes>) -> Staged<Lane> {
        let (engine, submission) = (&self.inner.engine, &run.evaluation.submission);
        let on_gpu = submission.backend != Backend::Cpu;
        let started = Instant::now();
        let footprint = match on_gpu {
            true => {
                let sized = sizes.map(|s| devices::footprint(s.input_bytes + s.output_bytes));
                engine.footprint(&run.task_key).or(sized)
            }
            false => None,
        };
        let lane = engine.lanes().acquire(on_gpu, submission.priority, &submission.job_id, footprint).await;
        let mut notes = Notes::default();
        if lane.is_ok() {
            notes.times.since(Stage::QueueDevice, started);
        }
        Staged::new(notes, lane.map_err(|unavailable| InfraError::from(unavailable).into()))
    }

    /// Picks the sensitivity trial among the first `trials` (not trial 0, its base), from the secret per task, and
    /// gives it trial 0's seed: the harness moves a few of those inputs far out of range (`perturb_sparsely`) and
    /// the check compares how both outputs moved. None when disabled or with fewer than two first trials.
    fn sensitivity_trial(&self, task_key: &str, seeds: &mut [u64], trials: usize) -> Option<Sensitivity> {
        if !self.inner.config.sensitivity_check || trials < 2 {
            return None;
        }
        let drawn = self.inner.engine.seeds(task_key, "sensitivity", 2);
        let trial = 1 + drawn[0] as usize % (trials - 1);
        seeds[trial] = seeds[0];
        Some(Sensitivity { trial, base: 0, seed: drawn[1] })
    }
}

/// Gives the first re-check (trial `recheck_from`, run after timing and the census) trial 0's seed: on the inputs
/// trial 0 passed, an output far outside the tolerance is changed behaviour, not rounding on new inputs. Its index,
/// or None without a first trial or a re-check.
fn replay_trial(seeds: &mut [u64], recheck_from: usize) -> Option<usize> {
    if recheck_from == 0 || recheck_from >= seeds.len() {
        return None;
    }
    seeds[recheck_from] = seeds[0];
    Some(recheck_from)
}

#[cfg(test)]
mod tests {
    use super::replay_trial;

    #[test]
    fn the_first_recheck_replays_trial_zero_and_later_ones_keep_their_seeds() {
        let mut seeds = vec![10, 11, 12, 13, 14];
        assert_eq!(replay_trial(&mut seeds, 3), Some(3));
        assert_eq!(seeds, vec![10, 11, 12, 10, 14]);
        let mut no_recheck = vec![10, 11, 12];
        assert_eq!(replay_trial(&mut no_recheck, 3), None);
        assert_eq!(no_recheck, vec![10, 11, 12]);
        let mut no_first_trial = vec![10, 11];
        assert_eq!(replay_trial(&mut no_first_trial, 0), None);
        assert_eq!(no_first_trial, vec![10, 11]);
    }
}
