//! The shared start of every run, for the evaluator and the profiler alike: [`Engine::check`] (the static checks,
//! of the candidate and against its task) then [`Engine::build`], the artifact cache's entry point. A candidate
//! that builds extensions builds them once, on the compile pool, in a sandboxed child, into the content-addressed
//! artifact cache (a failure the harness reports is cached too); one that compiles on the GPU when it runs
//! (Triton) gets the cache entry its just-in-time compiler keeps its kernels in.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kforge_sandbox::{Exit, tail as cap};
use kforge_static_checks::{self as static_checks, CandidateReport};
use tokio_util::sync::CancellationToken;

use super::outcome::{Finding, Judgement, Notes, Staged, Stop, Verdict};
use super::{Backend, Engine, InfraError, Submission};
use crate::cache::{self, Entry, EntryLock};
use crate::protocol::{CompileResult, CompileSpec, Mode};
use crate::python::PythonEnv;
use crate::stage::{self, Request, StageOutcome};
use crate::times::{Stage, ms};

/// A submission whose candidate passed the static checks: what [`Engine::build`] builds.
#[derive(Debug, Clone, Copy)]
pub struct Checked<'a> {
    submission: &'a Submission,
}

impl Checked<'_> {
    pub fn submission(&self) -> &Submission {
        self.submission
    }
}

/// A candidate's build in the artifact cache, pinned (eviction cannot take it) while this lives.
#[derive(Debug)]
pub struct Built {
    /// The artifact cache's key of the build.
    pub key: String,
    /// Its directory: the stages that load the candidate get it as `TORCH_EXTENSIONS_DIR` and `TRITON_CACHE_DIR`.
    pub dir: PathBuf,
    /// Whether the candidate builds extensions ahead of time (so it was compiled).
    pub compiles: bool,
    /// The kernels compiled into its extensions by function name (`Err`: why they could not be read); `None`
    /// where it builds nothing ahead of time.
    pub kernels: Option<Result<Vec<String>, String>>,
    _pin: Option<EntryLock>,
}

/// What a compiled build's cache marker records: the kernels compiled into it.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct BuildRecord {
    kernels: Option<Vec<String>>,
    kernels_unread: Option<String>,
}

impl BuildRecord {
    fn kernels(marker: &str) -> Result<Vec<String>, String> {
        match serde_json::from_str::<BuildRecord>(marker) {
            Ok(BuildRecord { kernels: Some(kernels), .. }) => Ok(kernels),
            Ok(BuildRecord { kernels_unread: Some(why), .. }) => Err(why),
            _ => Err("the build's record names no kernels".to_owned()),
        }
    }
}

/// Whether the source builds a C++/CUDA extension (and so needs the compile stage).
pub fn builds_extension(source: &str) -> bool {
    source.contains("load_inline") || source.contains("cpp_extension")
}

fn gpu_arch(python: &PythonEnv) -> String {
    python.gpus.iter().map(|g| g.capability.as_str()).collect::<Vec<_>>().join(",")
}

/// The static checks' verdict: a source that does not parse is a compile error; one with a finding beyond a
/// notice (a policy's, a hack's) is rejected.
fn static_verdict(report: &CandidateReport) -> Result<(), Judgement> {
    if report.syntax_error {
        return Err(Judgement::verdict(Verdict::CompileError));
    }
    if report.rejected() {
        return Err(Judgement::verdict(Verdict::Rejected));
    }
    Ok(())
}

/// How a compile stage ended: what the artifact cache keeps of it, and why the run ends there if it does.
#[derive(Debug, PartialEq)]
enum Compiled {
    /// Built: kept.
    Built,
    /// The harness reported the failure: the same source fails the same way, so the failure is kept (its log).
    Failed(String),
    /// Nothing is kept: cancelled, out of time, or killed or vanished without a report (a crashing compiler,
    /// memory; maybe transient).
    Discarded(Judgement),
    Cancelled,
}

impl Compiled {
    /// How `outcome` ended, for a compile stage given `timeout_secs`.
    fn of<R>(outcome: &StageOutcome<R>, timeout_secs: u64) -> Self {
        match outcome.finished.exit {
            _ if outcome.ok() => Compiled::Built,
            Exit::TimedOut => Compiled::Discarded(Judgement::error(
                Verdict::Timeout,
                format!("compilation exceeded {timeout_secs} s"),
            )),
            Exit::Cancelled => Compiled::Cancelled,
            Exit::Code(_) if outcome.result.is_some() => Compiled::Failed(cap(&outcome.error_text(), 16 * 1024)),
            Exit::Code(_) | Exit::Signal(_) => {
                Compiled::Discarded(Judgement::compile_error(cap(&outcome.error_text(), 16 * 1024)))
            }
        }
    }
}

impl Engine {
    /// The static checks every run starts with: the candidate's source under its policy, and against its task (a
    /// precision downgrade). Their findings are the run's first; the run stops here on a syntax error (a compile
    /// error) or a finding beyond a notice (rejected).
    pub fn check<'a>(&self, submission: &'a Submission) -> Staged<Checked<'a>> {
        let started = Instant::now();
        let mut report = static_checks::check_candidate(&submission.candidate, submission.policy);
        report.findings.extend(static_checks::precision_downgrade(&submission.candidate, &submission.task));
        let outcome = static_verdict(&report).map(|()| Checked { submission }).map_err(Stop::from);
        let mut notes = Notes::default();
        notes.findings.extend(report.findings.into_iter().map(Finding::from));
        notes.times.since(Stage::Static, started);
        Staged::new(notes, outcome)
    }

    /// The candidate's build, ready to load and pinned: compiled into the artifact cache (`compile_dir` is the
    /// compile's scratch directory) where it builds extensions, the just-in-time compiler's entry on a GPU
    /// otherwise. Its notes: `queue_compile`, the wait for a compile worker, and `compile`, the build itself; the
    /// run stops here on a compile error or timeout.
    pub async fn build(&self, checked: &Checked<'_>, compile_dir: &Path, cancel: &CancellationToken) -> Staged<Built> {
        let started = Instant::now();
        let submission = checked.submission;
        let mut notes = Notes::default();
        let compiles = builds_extension(&submission.candidate);
        let outcome = self.build_into(submission, compiles, compile_dir, cancel, &mut notes).await;
        if compiles && !matches!(outcome, Err(Stop::Infra(_))) {
            let queued = notes.times.get(Stage::QueueCompile).unwrap_or(0.0);
            notes.times.insert(Stage::Compile, ms(started.elapsed()) - queued);
        }
        Staged::new(notes, outcome)
    }

    async fn build_into(
        &self,
        submission: &Submission,
        compiles: bool,
        compile_dir: &Path,
        cancel: &CancellationToken,
        notes: &mut Notes,
    ) -> Result<Built, Stop> {
        let key = self.artifact_key(submission);
        let dir = self.inner.artifacts.dir(&key);
        let mut kernels = None;
        let pin = if compiles {
            self.compile(submission, &key, compile_dir, cancel, notes).await?;
            let artifacts = &self.inner.artifacts;
            match (artifacts.pin(&key).await, artifacts.get(&key)) {
                (Ok(pin), Some(Entry::Ready(marker))) => {
                    kernels = (submission.backend != Backend::Cpu).then(|| BuildRecord::kernels(&marker));
                    Some(pin)
                }
                (Ok(_), _) => return Err(InfraError::Evicted { what: "compiled artifact" }.into()),
                (Err(error), _) => return Err(InfraError::cache("artifact pin")(error).into()),
            }
        } else if submission.backend != Backend::Cpu {
            Some(self.jit_cache(&key).await?)
        } else {
            None
        };
        Ok(Built { key, dir, compiles, kernels, _pin: pin })
    }

    /// The artifact cache's key for `submission`'s build.
    fn artifact_key(&self, submission: &Submission) -> String {
        let python = self.checked_python();
        cache::key(&[
            submission.candidate.as_bytes(),
            submission.backend.name().as_bytes(),
            python.versions_key().as_bytes(),
            gpu_arch(python).as_bytes(),
            self.inner.config.build_recipe.name().as_bytes(),
            // Who owns the build's files: a build made as the engine's user (before command users, or where they are
            // off) has files a command user cannot write, such as the lock a later run takes.
            if self.inner.sandbox.command_users_active() {
                b"owned by the jobs' group"
            } else {
                b"owned by the evaluator"
            },
        ])
    }

    /// The artifact entry of a candidate that builds nothing ahead of time but compiles on a GPU when it runs
    /// (Triton): its stages' just-in-time compiler cache (`TRITON_CACHE_DIR`) lives there, so a kernel compiled in
    /// one stage of a build is not compiled again by its next stage, evaluation or profile. Created complete on
    /// first use so eviction counts it like a build, and returned pinned for the evaluation's length.
    async fn jit_cache(&self, key: &str) -> Result<EntryLock, InfraError> {
        let artifacts = &self.inner.artifacts;
        if artifacts.get(key).is_none() {
            let lock = artifacts.lock(key).await.map_err(InfraError::cache("artifact lock"))?;
            if artifacts.get(key).is_none() {
                let entry = Entry::Ready("the just-in-time compiler's cache of the candidate's stages".into());
                artifacts.complete(key, &entry, &lock).map_err(InfraError::cache("artifact entry"))?;
                self.evict_later("artifact", artifacts);
            }
        }
        let pin = artifacts.pin(key).await.map_err(InfraError::cache("artifact pin"))?;
        match artifacts.get(key) {
            Some(_) => Ok(pin),
            None => Err(InfraError::Evicted { what: "just-in-time compiler cache" }),
        }
    }

    /// Builds the candidate's extensions into the artifact cache under `key`, or finds the build (or its failure)
    /// there.
    async fn compile(
        &self,
        submission: &Submission,
        key: &str,
        scratch: &Path,
        cancel: &CancellationToken,
        notes: &mut Notes,
    ) -> Result<(), Stop> {
        let inner = &self.inner;
        if let Some(entry) = inner.artifacts.get(key) {
            return self.cached(entry, notes).map_err(Stop::from);
        }
        let queued = Instant::now();
        let _slot = inner.compile_slots.acquire().await.expect("the compile pool is never closed");
        notes.times.since(Stage::QueueCompile, queued);
        let lock = inner.artifacts.lock(key).await.map_err(InfraError::cache("artifact lock"))?;
        // Another evaluation may have built it while this one waited.
        if let Some(entry) = inner.artifacts.get(key) {
            return self.cached(entry, notes).map_err(Stop::from);
        }
        inner.metrics.cache("artifact", false);
        let outcome = self.compile_stage(submission, key, scratch, cancel).await?;
        self.keep(key, &lock, &outcome)
    }

    /// A build the artifact cache holds: ready, or the compile error it remembers.
    fn cached(&self, entry: Entry, notes: &mut Notes) -> Result<(), Judgement> {
        self.inner.metrics.cache("artifact", true);
        notes.compile_cache_hit = true;
        match entry {
            Entry::Ready(_) => Ok(()),
            Entry::Failed(log) => Err(Judgement::compile_error(log)),
        }
    }

    /// Runs the compile stage of `submission` into the artifact directory of `key`.
    async fn compile_stage(
        &self,
        submission: &Submission,
        key: &str,
        scratch: &Path,
        cancel: &CancellationToken,
    ) -> Result<StageOutcome<CompileResult>, InfraError> {
        let inner = &self.inner;
        let python = self.checked_python();
        let artifact_dir = inner.artifacts.dir(key);
        // The build directory (`ext`) is the compile's process's to make, so it is its (command users') group's.
        std::fs::create_dir_all(&artifact_dir)
            .and_then(|()| std::fs::write(scratch.join("candidate.py"), &submission.candidate))
            .map_err(InfraError::files("preparing the compile"))?;
        // A CPU build must not pick up a GPU toolchain by accident.
        let gpu = (submission.backend != Backend::Cpu).then_some(0);
        let mut env = python.env_on(scratch, gpu);
        env.push(("TORCH_EXTENSIONS_DIR".into(), artifact_dir.join("ext").into()));
        let (pch_env, pch_readable) = python.compile_env();
        env.extend(pch_env);
        let stage = stage::Stage {
            scratch: scratch.to_owned(),
            readable: pch_readable,
            writable: vec![artifact_dir],
            env,
            wall: Duration::from_secs(inner.config.compile_timeout_secs),
            // Compiles fill every core; the stages holding a device go first.
            background: true,
            launcher: vec![],
        };
        let spec = CompileSpec { candidate_path: scratch.join("candidate.py"), kernels: gpu.is_some() };
        self.stage(self.start(stage, cancel), Request::plain(spec), None)
            .await
            .map_err(InfraError::stage(Mode::Compile))
    }

    /// Keeps what the artifact cache should of a compile stage's `outcome` under `key` (its `lock` held), and
    /// judges it.
    fn keep(&self, key: &str, lock: &EntryLock, outcome: &StageOutcome<CompileResult>) -> Result<(), Stop> {
        let artifacts = &self.inner.artifacts;
        match Compiled::of(outcome, self.inner.config.compile_timeout_secs) {
            Compiled::Built => {
                let body = outcome.result.as_ref().map(|report| &report.body);
                let record = BuildRecord {
                    kernels: body.and_then(|b| b.kernels.clone()),
                    kernels_unread: body.and_then(|b| b.kernels_unread.clone()),
                };
                let marker = serde_json::to_string(&record).unwrap_or_default();
                artifacts.complete(key, &Entry::Ready(marker), lock).map_err(InfraError::cache("artifact cache"))?;
                self.evict_later("artifact", artifacts);
                Ok(())
            }
            Compiled::Failed(log) => {
                if let Err(error) = artifacts.complete(key, &Entry::Failed(log.clone()), lock) {
                    tracing::warn!(%error, "could not cache a compile failure");
                }
                Err(Judgement::compile_error(log).into())
            }
            Compiled::Discarded(judgement) => {
                artifacts.discard(key, lock);
                Err(judgement.into())
            }
            Compiled::Cancelled => {
                artifacts.discard(key, lock);
                Err(InfraError::Cancelled.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kforge_static_checks::Category;

    use super::*;
    use crate::protocol::Report;

    #[test]
    fn a_source_that_does_not_parse_is_a_compile_error_and_a_policy_finding_a_rejection() {
        let finding = |category| kforge_static_checks::Finding { code: "x", message: "y".into(), line: 1, category };
        let report = |syntax_error, findings| CandidateReport { syntax_error, findings };
        let verdict = |report: CandidateReport| static_verdict(&report).map_err(|judgement| judgement.verdict);
        assert_eq!(verdict(report(true, vec![finding(Category::Policy)])), Err(Verdict::CompileError));
        assert_eq!(verdict(report(false, vec![finding(Category::Hack)])), Err(Verdict::Rejected));
        assert_eq!(verdict(report(false, vec![finding(Category::Policy)])), Err(Verdict::Rejected));
        assert_eq!(verdict(report(false, vec![finding(Category::Notice)])), Ok(()), "a notice passes");
    }

    #[test]
    fn a_compile_the_harness_reported_failing_is_kept_and_one_killed_is_not() {
        let report = |ok, error: &str| Report::<CompileResult> {
            ok,
            error: Some(error.to_owned()).filter(|e| !e.is_empty()),
            ..Report::default()
        };
        let compiled = |exit, result| Compiled::of(&StageOutcome::ended(exit, result), 600);
        assert_eq!(compiled(Exit::Code(0), Some(report(true, ""))), Compiled::Built);
        assert_eq!(compiled(Exit::Code(1), Some(report(false, "nvcc: error"))), Compiled::Failed("nvcc: error".into()));
        assert_eq!(
            compiled(Exit::TimedOut, None),
            Compiled::Discarded(Judgement::error(Verdict::Timeout, "compilation exceeded 600 s"))
        );
        let killed = compiled(Exit::Signal(9), None);
        assert!(
            matches!(&killed, Compiled::Discarded(j) if j.verdict == Verdict::CompileError && !j.compile_log.is_empty()),
            "{killed:?}"
        );
        assert_eq!(compiled(Exit::Cancelled, None), Compiled::Cancelled);
    }
}
