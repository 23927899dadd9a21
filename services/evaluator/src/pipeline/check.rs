//! The comparison of the candidate's outputs with the reference's: the reference computed and cached in a clean
//! child (`reference` mode) or read from the cache (`check` mode), and the reference's peak device memory kept for
//! memory-aware admission.

use std::time::{Duration, Instant};

use kforge_sandbox::tail;
use serde::{Deserialize, Serialize};

use kforge_execution::cache::{self, Entry, Held};
use kforge_execution::devices::Lane;
use kforge_execution::engine::{InfraError, Submission};
use kforge_execution::protocol::{CompareSpec, MismatchRecord, Sensitivity, StageSpec, TimedOutput};
use kforge_execution::python;
use kforge_execution::stage::{Request, Stage, Started};
use kforge_execution::times::{self, StageTimes};
use kforge_execution::{Finding, Notes, Staged};

use super::{Evaluating, Evaluator};

/// The inputs an evaluation covers: correctness trials by seed (the last `recheck_trials` of them re-checks after
/// timing and the census), the model's seed, the timing inputs' seeds, and the timed calls kept.
#[derive(Debug, Clone)]
pub(super) struct Trials {
    pub(super) seeds: Vec<u64>,
    /// The first re-check: the trials from here run after timing and the census.
    pub(super) recheck_from: usize,
    pub(super) init_seed: u64,
    pub(super) timing_seeds: Vec<u64>,
    /// The sensitivity trial (`Evaluator::sensitivity_trial`).
    pub(super) sensitivity: Option<Sensitivity>,
    /// The re-check that repeats trial 0's inputs (`replay_trial`): compared with trial 0's reference.
    pub(super) replay: Option<usize>,
    /// The key of the timed outputs' digests (`KeepTimed::digest_key`).
    pub(super) digest_key: u64,
}

/// A comparison ready to run: its started clean process, and its hold on the reference cache entry.
pub(super) struct PreparedCheck {
    pub(super) started: Started,
    /// `reference` mode (computes and caches the reference, then compares) or `check` (compares with the cache).
    pub(super) spec: CompareSpec,
    pub(super) key: String,
    /// The task's key and the device's name: where the reference's peak device memory is kept.
    pub(super) peak_key: (String, String),
    /// Held while the reference is computed.
    pub(super) lock: Option<cache::EntryLock>,
    /// Held while a cached reference is read.
    pub(super) _pin: Option<cache::EntryLock>,
}

/// What a reference cache entry's marker records of the reference's run (JSON; empty in entries from before it did).
#[derive(Debug, Default, Serialize, Deserialize)]
struct ReferenceRecord {
    /// Its peak device memory (GPU only): memory-aware admission's footprint for the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device_peak_bytes: Option<u64>,
    /// The most bytes of tensors one trial output: the disk budget's size for a task its dry run cannot size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    output_bytes: Option<u64>,
}

/// What a comparison found: the first mismatch, when the outputs differ, and how many trials were compared
/// (fewer than all where the outputs are large: `output_bytes_budget`).
#[derive(Debug, Default)]
pub(super) struct Compared {
    pub(super) mismatch: Option<(Trial, MismatchRecord)>,
    pub(super) compared: Option<usize>,
}

/// Which output differed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Trial {
    Index(usize),
    /// The replay of trial 0's inputs after timing and the census, far outside the tolerance: changed behaviour.
    Changed(usize),
    Timed,
}

impl Trial {
    fn of(record: &MismatchRecord) -> Self {
        match record.trial {
            Some(index) if index >= 0 && record.changed => Trial::Changed(index as usize),
            Some(index) if index >= 0 => Trial::Index(index as usize),
            _ => Trial::Timed,
        }
    }
}

impl Evaluator {
    /// The reference cache's key for the task's outputs on these trials on a device of this name.
    fn reference_key(&self, submission: &Submission, trials: &Trials, device_name: &str) -> String {
        let Trials { seeds, init_seed, sensitivity, replay, .. } = trials;
        let mut seed_text: String = seeds.iter().map(|s| format!("{s},")).collect();
        if let Some(Sensitivity { trial, base, seed }) = *sensitivity {
            seed_text.push_str(&format!("sensitivity {trial} from {base} with {seed}"));
        }
        if let Some(replay) = replay {
            seed_text.push_str(&format!(" replay {replay}"));
        }
        cache::key(&[
            submission.task.as_bytes(),
            seed_text.as_bytes(),
            init_seed.to_string().as_bytes(),
            device_name.as_bytes(),
            self.inner.engine.checked_python().versions_key().as_bytes(),
            python::harness_digest().as_bytes(),
            // The budget decides which trials' outputs the entry holds.
            self.inner.config.output_bytes_budget.to_string().as_bytes(),
        ])
    }

    /// Protects the task's cached reference entries on these trials from eviction until the guards drop (one per
    /// kind of GPU the engine has), and says whether every kind has one: else the evaluation may write a new entry,
    /// whose room it reserves. Held to the evaluation's end, so an entry found here is not evicted before its check
    /// pins it (the evaluation, having reserved nothing, would then write it again outside the disk budget). Not a
    /// lock: a pin held while waiting for disk room and a device could deadlock with an evaluation that holds those
    /// and waits to build the entry. The entries' records (peak device memory, output bytes) are kept as a hit's.
    pub(super) fn protect_cached_references(
        &self,
        submission: &Submission,
        trials: &Trials,
    ) -> (Vec<cache::Protected>, bool) {
        let references = &self.inner.references;
        let mut names: Vec<&str> =
            self.inner.engine.checked_python().gpus.iter().map(|gpu| gpu.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let task_key = cache::key(&[submission.task.as_bytes()]);
        let mut guards = Vec::with_capacity(names.len());
        for name in &names {
            let key = self.reference_key(submission, trials, name);
            let guard = references.protect(&key);
            if let Some(entry) = references.get(&key) {
                self.note_reference_entry(&(task_key.clone(), (*name).to_owned()), &entry);
                guards.push(guard);
            }
        }
        let every_kind = !names.is_empty() && guards.len() == names.len();
        (guards, every_kind)
    }

    /// Prepares the comparison of the candidate's outputs with the reference's on `lane`: takes the cached
    /// reference (pinned) or the right to compute it (locked), and starts the clean process that will do it in the
    /// check's directory, so it starts while the candidate runs.
    pub(super) async fn prepare_check(&self, run: &Evaluating<'_>, lane: &Lane) -> Result<PreparedCheck, InfraError> {
        let (submission, trials, cancel) = (&run.evaluation.submission, &run.trials, run.cancel);
        let (scratch, candidate_dir) = (run.dirs.check.as_path(), run.dirs.candidate.as_path());
        std::fs::write(scratch.join("task.py"), &submission.task).map_err(InfraError::files("writing task.py"))?;
        let gpu = lane.gpu();
        let inner = &self.inner;
        let python = inner.engine.checked_python();
        let Trials { seeds, init_seed, timing_seeds, sensitivity, replay, digest_key, .. } = trials;
        let device_name = python.device_name(gpu);
        let key = self.reference_key(submission, trials, device_name);
        let reference_dir = inner.references.dir(&key);
        let mut spec = CompareSpec {
            computes_reference: false,
            task_path: scratch.join("task.py"),
            device: lane.device(),
            init_seed: *init_seed,
            seeds: seeds.clone(),
            reference_dir: reference_dir.clone(),
            candidate_dir: candidate_dir.to_owned(),
            tolerances: inner.config.tolerances,
            timing_seeds: timing_seeds.clone(),
            sensitivity: *sensitivity,
            replay: *replay,
            output_bytes_budget: inner.config.output_bytes_budget,
            timed_outputs: vec![],
            digest_key: *digest_key,
        };
        // Built once per key: the first evaluation computes the reference (and checks), later ones only check.
        // A cached reference is pinned while the checker reads it, so eviction cannot take it meanwhile; one
        // evicted before it could be pinned is computed again, never an infrastructure error (`Cache::pin_or_lock`).
        // The reference's peak device memory, recorded in its cache entry (none in entries from before it was).
        let peak_key = (cache::key(&[submission.task.as_bytes()]), device_name.to_owned());
        let (lock, pin) = match inner.references.pin_or_lock(&key).await.map_err(InfraError::cache("reference"))? {
            Held::Pinned(pin, entry) => {
                self.note_reference_entry(&peak_key, &entry);
                (None, Some(pin))
            }
            Held::Building(lock) => {
                std::fs::create_dir_all(&reference_dir).map_err(InfraError::files("reference dir"))?;
                (Some(lock), None)
            }
        };
        inner.engine.metrics().cache("reference", lock.is_none());
        spec.computes_reference = lock.is_some();
        let stage = Stage {
            scratch: scratch.to_owned(),
            readable: vec![candidate_dir.to_owned(), reference_dir.clone()],
            writable: if spec.computes_reference { vec![reference_dir] } else { vec![] },
            env: python.env_on(scratch, gpu),
            wall: Duration::from_secs(inner.config.run_timeout_secs),
            background: false,
            launcher: vec![],
        };
        Ok(PreparedCheck { started: inner.engine.start(stage, cancel), spec, key, peak_key, lock, _pin: pin })
    }

    /// Compares the candidate's outputs with the reference's, in the prepared clean process on `lane`: the
    /// correctness trials, and the timed calls whose outputs the candidate kept (`timed_outputs`, when it was timed;
    /// checked on rebuilt inputs). Its notes: the check's time and phases, and a notice where the outputs were too
    /// large to compare every trial (`trials` of them).
    pub(super) async fn compare(
        &self,
        prepared: PreparedCheck,
        lane: &Lane,
        timed_outputs: Vec<TimedOutput>,
        trials: usize,
    ) -> Staged<Compared> {
        let started = Instant::now();
        let mut notes = Notes::default();
        let outcome = self.check(prepared, lane, timed_outputs, &mut notes.times).await;
        notes.times.since(times::Stage::Check, started);
        if let Ok(Compared { compared: Some(compared), .. }) = &outcome
            && *compared < trials
        {
            notes.findings.push(Finding::notice(
                "check.trials_limited",
                format!("the outputs are large: {compared} of {trials} trials were compared (output_bytes_budget)"),
            ));
        }
        Staged::new(notes, outcome.map_err(Into::into))
    }

    /// Runs a prepared comparison, its phases into `phases`.
    async fn check(
        &self,
        prepared: PreparedCheck,
        lane: &Lane,
        timed_outputs: Vec<TimedOutput>,
        phases: &mut StageTimes,
    ) -> Result<Compared, InfraError> {
        let inner = &self.inner;
        let PreparedCheck { started, mut spec, key, peak_key, lock, _pin } = prepared;
        spec.timed_outputs = timed_outputs;
        let mode = spec.mode();
        let request = Request::plain(spec);
        let outcome = inner.engine.stage(started, request, Some(lane)).await;
        if let (Some(lock), false) = (&lock, outcome.as_ref().is_ok_and(|o| o.ok())) {
            inner.references.discard(&key, lock); // a failed reference's partial outputs, GBs for large tasks
        }
        let outcome = outcome.map_err(InfraError::stage(mode))?;
        if !outcome.ok() {
            let what = if lock.is_some() { "the reference failed" } else { "the checker failed" };
            return Err(InfraError::TrustedStage { what, error: tail(&outcome.error_text(), 4000) });
        }
        if let Some(lock) = &lock {
            // Kept here and in the cache entry's marker.
            let body = outcome.result.as_ref().map(|r| &r.body);
            let record = ReferenceRecord {
                device_peak_bytes: body.and_then(|b| b.device_peak_bytes),
                output_bytes: body.and_then(|b| b.output_bytes),
            };
            let entry = Entry::Ready(serde_json::to_string(&record).expect("plain fields"));
            self.note_reference_entry(&peak_key, &entry);
            let completed = inner.references.complete(&key, &entry, lock);
            if completed.is_err() {
                inner.references.discard(&key, lock);
            }
            completed.map_err(InfraError::cache("reference cache"))?;
            inner.engine.evict_later("reference", &inner.references);
        }
        if let Some(result) = &outcome.result {
            phases.phases(times::Stage::Check, result);
        }
        let result = outcome.result.map(|r| r.body).unwrap_or_default();
        let compared = result.compared_trials.map(|trials| trials.len());
        let mismatch = result.mismatch.map(|m| (Trial::of(&m), m));
        Ok(Compared { mismatch, compared })
    }

    /// Keeps what a reference cache entry records ([`ReferenceRecord`]), where it does.
    pub(super) fn note_reference_entry(&self, (task_key, device): &(String, String), entry: &Entry) {
        let Entry::Ready(marker) = entry else { return };
        let record: ReferenceRecord = serde_json::from_str(marker).unwrap_or_default();
        if let Some(peak) = record.device_peak_bytes {
            self.inner.engine.note_reference_peak(task_key, device, peak);
        }
        if let Some(bytes) = record.output_bytes {
            self.inner.engine.disk().note_reference_outputs(task_key, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{MismatchRecord, Trial};

    #[test]
    fn only_a_replay_the_harness_judged_changed_is_changed_behaviour() {
        let record = |trial, changed| MismatchRecord { trial, changed, ..Default::default() };
        assert_eq!(Trial::of(&record(Some(5), true)), Trial::Changed(5));
        assert_eq!(Trial::of(&record(Some(5), false)), Trial::Index(5), "the replay near the tolerance");
        assert_eq!(Trial::of(&record(Some(6), false)), Trial::Index(6));
        assert_eq!(Trial::of(&record(Some(-1), false)), Trial::Timed);
        assert_eq!(Trial::of(&record(None, false)), Trial::Timed);
    }
}
