//! The compile stage: a candidate that builds extensions builds them once, on the compile pool, in a sandboxed
//! child, into the content-addressed artifact cache (a failure the harness reports is cached too).

use std::path::Path;
use std::time::{Duration, Instant};

use kforge_proto::v1 as pb;
use kforge_sandbox::{Exit, tail as cap};
use tokio_util::sync::CancellationToken;

use super::{Backend, Evaluator, InfraError, Submission, ms};
use crate::cache::{Entry, EntryLock};
use crate::protocol::{CompileSpec, Mode};
use crate::python::PythonEnv;
use crate::stage::{Request, Stage};

pub(super) fn cached_compile(entry: Entry, response: &mut pb::EvaluateResponse) -> Option<pb::Verdict> {
    match entry {
        Entry::Ready(_) => None,
        Entry::Failed(log) => {
            response.compile_log = log;
            Some(pb::Verdict::CompileError)
        }
    }
}

/// Whether the source builds a C++/CUDA extension (and so needs the compile stage).
pub(super) fn builds_extension(source: &str) -> bool {
    source.contains("load_inline") || source.contains("cpp_extension")
}

pub(super) fn gpu_arch(python: &PythonEnv) -> String {
    python.gpus.iter().map(|g| g.capability.as_str()).collect::<Vec<_>>().join(",")
}

impl Evaluator {
    /// The artifact entry of a candidate that builds nothing ahead of time but compiles on a GPU when it runs
    /// (Triton): its stages' just-in-time compiler cache (`TRITON_CACHE_DIR`) lives there, so a kernel compiled in
    /// one stage of a build is not compiled again by its next stage, evaluation or profile. Created complete on
    /// first use so eviction counts it like a build, and returned pinned for the evaluation's length.
    pub(super) async fn jit_cache(&self, key: &str) -> Result<EntryLock, InfraError> {
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
    pub(super) async fn compile(
        &self,
        submission: &Submission,
        key: &str,
        scratch: &Path,
        cancel: &CancellationToken,
        response: &mut pb::EvaluateResponse,
    ) -> Result<Option<pb::Verdict>, InfraError> {
        let inner = &self.inner;
        let python = inner.python.as_ref().expect("validate checked the environment");
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
        // The build directory (`ext`) is the compile's process's to make, so it is its (job users') group's.
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
        let request = Request::plain(CompileSpec { candidate_path: scratch.join("candidate.py") });
        let outcome =
            self.stage(self.start(stage, cancel), request, None).await.map_err(InfraError::stage(Mode::Compile))?;
        let log = outcome.error_text();
        let verdict = match outcome.finished.exit {
            _ if outcome.ok() => {
                let ready = inner.artifacts.complete(key, &Entry::Ready(String::new()), &lock);
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
