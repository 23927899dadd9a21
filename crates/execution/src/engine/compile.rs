//! The compile stage and the artifact cache's entry point, [`Engine::build`]: a candidate that builds extensions
//! builds them once, on the compile pool, in a sandboxed child, into the content-addressed artifact cache (a
//! failure the harness reports is cached too); one that compiles on the GPU when it runs (Triton) gets the cache
//! entry its just-in-time compiler keeps its kernels in.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use kforge_sandbox::{Exit, tail as cap};
use tokio_util::sync::CancellationToken;

use super::{Backend, Engine, InfraError, Submission, ms};
use crate::cache::{self, Entry, EntryLock};
use crate::protocol::{CompileSpec, Mode};
use crate::python::PythonEnv;
use crate::stage::{Request, Stage};

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

fn cached_compile(entry: Entry, response: &mut pb::EvaluateResponse) -> Option<pb::Verdict> {
    match entry {
        Entry::Ready(_) => None,
        Entry::Failed(log) => {
            response.compile_log = log;
            Some(pb::Verdict::CompileError)
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

impl Engine {
    /// The artifact cache's key for `submission`'s build.
    pub fn artifact_key(&self, submission: &Submission) -> String {
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

    /// The candidate's build, ready to load: compiled into the artifact cache (`compile_dir` is the compile's
    /// scratch directory) where it builds extensions, the just-in-time compiler's entry on a GPU otherwise, and
    /// pinned. `Err(verdict)` when the run ends here (a compile error or timeout), with `response` filled in; its
    /// `stage_ms` gets `queue_compile`, the wait for a compile worker.
    pub async fn build(
        &self,
        submission: &Submission,
        compile_dir: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
    ) -> Result<Result<Built, pb::Verdict>, InfraError> {
        let key = self.artifact_key(submission);
        let dir = self.inner.artifacts.dir(&key);
        let compiles = builds_extension(&submission.candidate);
        let mut kernels = None;
        let pin = if compiles {
            if let Some(verdict) = self.compile(submission, &key, compile_dir, cancel, response).await? {
                return Ok(Err(verdict));
            }
            let artifacts = &self.inner.artifacts;
            match (artifacts.pin(&key).await, artifacts.get(&key)) {
                (Ok(pin), Some(Entry::Ready(marker))) => {
                    kernels = (submission.backend != Backend::Cpu).then(|| BuildRecord::kernels(&marker));
                    Some(pin)
                }
                (Ok(_), _) => return Err(InfraError::Evicted { what: "compiled artifact" }),
                (Err(error), _) => return Err(InfraError::cache("artifact pin")(error)),
            }
        } else if submission.backend != Backend::Cpu {
            Some(self.jit_cache(&key).await?)
        } else {
            None
        };
        Ok(Ok(Built { key, dir, compiles, kernels, _pin: pin }))
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

    /// Builds the candidate's extensions into the artifact cache; `Some(verdict)` when the evaluation ends here.
    async fn compile(
        &self,
        submission: &Submission,
        key: &str,
        scratch: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
    ) -> Result<Option<pb::Verdict>, InfraError> {
        let inner = &self.inner;
        let python = self.checked_python();
        if let Some(entry) = inner.artifacts.get(key) {
            inner.metrics.cache("artifact", true);
            response.compile_cache_hit = true;
            return Ok(cached_compile(entry, response));
        }
        let queued = Instant::now();
        let _slot = inner.compile_slots.acquire().await.expect("the compile pool is never closed");
        response.stage_ms.insert("queue_compile".into(), ms(queued.elapsed()));
        let lock = inner.artifacts.lock(key).await.map_err(InfraError::cache("artifact lock"))?;
        // Another evaluation may have built it while this one waited.
        if let Some(entry) = inner.artifacts.get(key) {
            inner.metrics.cache("artifact", true);
            response.compile_cache_hit = true;
            return Ok(cached_compile(entry, response));
        }
        inner.metrics.cache("artifact", false);
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
        let stage = Stage {
            scratch: scratch.to_owned(),
            readable: pch_readable,
            writable: vec![artifact_dir.clone()],
            env,
            wall: Duration::from_secs(inner.config.compile_timeout_secs),
            // Compiles fill every core; the stages holding a device go first.
            background: true,
            launcher: vec![],
        };
        let spec = CompileSpec { candidate_path: scratch.join("candidate.py"), kernels: gpu.is_some() };
        let outcome = self
            .stage(self.start(stage, cancel), Request::plain(spec), None)
            .await
            .map_err(InfraError::stage(Mode::Compile))?;
        let log = outcome.error_text();
        let verdict = match outcome.finished.exit {
            _ if outcome.ok() => {
                let body = outcome.result.as_ref().map(|report| &report.body);
                let record = BuildRecord {
                    kernels: body.and_then(|b| b.kernels.clone()),
                    kernels_unread: body.and_then(|b| b.kernels_unread.clone()),
                };
                let marker = serde_json::to_string(&record).unwrap_or_default();
                let ready = inner.artifacts.complete(key, &Entry::Ready(marker), &lock);
                ready.map_err(InfraError::cache("artifact cache"))?;
                self.evict_later("artifact", &inner.artifacts);
                None
            }
            Exit::TimedOut => {
                inner.artifacts.discard(key, &lock);
                response.error = format!("compilation exceeded {} s", inner.config.compile_timeout_secs);
                Some(pb::Verdict::Timeout)
            }
            Exit::Cancelled => {
                inner.artifacts.discard(key, &lock);
                return Err(InfraError::Cancelled);
            }
            // The harness reported the failure: the same source fails the same way, so remember it.
            Exit::Code(_) if outcome.result.is_some() => {
                let log = cap(&log, 16 * 1024);
                if let Err(error) = inner.artifacts.complete(key, &Entry::Failed(log.clone()), &lock) {
                    tracing::warn!(%error, "could not cache a compile failure");
                }
                response.compile_log = log;
                Some(pb::Verdict::CompileError)
            }
            // Killed or vanished without a report (a crashing compiler, memory): not cached, maybe transient.
            Exit::Code(_) | Exit::Signal(_) => {
                inner.artifacts.discard(key, &lock);
                response.compile_log = cap(&log, 16 * 1024);
                Some(pb::Verdict::CompileError)
            }
        };
        Ok(verdict)
    }
}
