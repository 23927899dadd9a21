//! The baselines: the reference timed eagerly and under torch.compile in a clean child, cached per task, device
//! and versions, and computed ahead of the evaluation where that helps.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use kforge_sandbox::tail;
use tokio_util::sync::CancellationToken;

use kforge_execution::cache::{self, Entry};
use kforge_execution::devices::Lane;
use kforge_execution::engine::{Backend, InfraError, Submission};
use kforge_execution::protocol::{BaselineSpec, Mode, TimingSpec};
use kforge_execution::python;
use kforge_execution::scratch::RemoveOnDrop;
use kforge_execution::stage::{Request, Stage};

use super::Evaluator;
use super::request::Evaluation;

/// The reference's timing samples: eager (events and host clock) and torch.compile.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Baseline {
    pub(super) eager: Vec<f64>,
    /// Absent in baselines cached before the host clock was recorded.
    pub(super) eager_host: Option<Vec<f64>>,
    pub(super) compiled: Option<Vec<f64>>,
}

/// A baseline as the cache holds it.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct CachedBaseline {
    pub(super) eager_ms: serde_json::Value,
    #[serde(default)]
    pub(super) eager_host_ms: serde_json::Value,
    #[serde(default)]
    pub(super) compile_ms: serde_json::Value,
}

impl Baseline {
    /// A baseline as the cache holds it.
    pub(super) fn parse(text: &str) -> Result<Self, InfraError> {
        let cached: CachedBaseline =
            serde_json::from_str(text).map_err(|e| InfraError::UnreadableBaseline(format!("baseline cache: {e}")))?;
        let eager = serde_json::from_value(cached.eager_ms)
            .map_err(|e| InfraError::UnreadableBaseline(format!("baseline samples: {e}")))?;
        Ok(Self {
            eager,
            eager_host: serde_json::from_value(cached.eager_host_ms).ok(),
            compiled: serde_json::from_value(cached.compile_ms).ok(),
        })
    }

    /// The cache's text of this baseline.
    pub(super) fn text(&self) -> String {
        let cached = CachedBaseline {
            eager_ms: self.eager.clone().into(),
            eager_host_ms: self.eager_host.clone().into(),
            compile_ms: self.compiled.clone().into(),
        };
        serde_json::to_string(&cached).expect("a baseline serialises")
    }
}

impl Evaluator {
    /// Starts the task's baseline now, beside the candidate's compile and outside the device's slots (a GPU
    /// evaluation that is timed, with `baselines_ahead`): the evaluation then finds it cached, or waits for it on
    /// the cache's lock, instead of holding its slot while the baseline's torch.compile runs. It runs to the end
    /// whatever becomes of the evaluation (the next one of the task needs it too); a failure is only logged, and
    /// met again, and reported, by the evaluation's own [`Self::baseline`].
    pub(super) fn baseline_ahead(&self, evaluation: &Evaluation) {
        let (inner, submission) = (&self.inner, &evaluation.submission);
        if !(inner.config.baselines_ahead && evaluation.measure && submission.backend != Backend::Cpu) {
            return;
        }
        let Some(lane) = inner.engine.lanes().outside_slots() else { return };
        let task_key = cache::key(&[submission.task.as_bytes()]);
        let (init_seed, timing_seeds) = self.baseline_seeds(&task_key);
        let scratch = inner.engine.scratch_dir("baseline-");
        let (evaluator, submission) = (self.clone(), submission.clone());
        tokio::spawn(async move {
            let _cleanup = RemoveOnDrop::new(scratch.clone());
            let cancel = CancellationToken::new();
            let computed = match std::fs::create_dir_all(&scratch) {
                Ok(()) => {
                    evaluator.baseline(&submission, &lane, init_seed, &timing_seeds, &scratch, &cancel).await.map(drop)
                }
                Err(error) => Err(InfraError::files(format!("scratch directory {}", scratch.display()))(error)),
            };
            if let Err(error) = computed {
                tracing::warn!(task = %submission.task_id, %error, "the baseline computed ahead failed");
            }
        });
    }

    /// Eager and torch.compile samples of the reference, from the cache or a clean child.
    pub(super) async fn baseline(
        &self,
        submission: &Submission,
        lane: &Lane,
        init_seed: u64,
        timing_seeds: &[u64],
        scratch: &Path,
        cancel: &CancellationToken,
    ) -> Result<Baseline, InfraError> {
        let gpu = lane.gpu();
        let inner = &self.inner;
        let python = inner.engine.checked_python();
        let with_compile = inner.config.baseline_torch_compile;
        let key = self.baseline_key(submission, gpu);
        if let Some(Entry::Ready(text)) = inner.baselines.get(&key) {
            inner.engine.metrics().cache("baseline", true);
            return Baseline::parse(&text);
        }
        let lock = inner.baselines.lock(&key).await.map_err(InfraError::cache("baseline lock"))?;
        if let Some(Entry::Ready(text)) = inner.baselines.get(&key) {
            inner.engine.metrics().cache("baseline", true);
            return Baseline::parse(&text);
        }
        inner.engine.metrics().cache("baseline", false);
        let stage = self.baseline_stage(submission, scratch, python.env_on(scratch, gpu))?;
        let request = Request::plain(BaselineSpec {
            task_path: scratch.join("task.py"),
            device: lane.device(),
            init_seed,
            timing: TimingSpec::from(&inner.config.timing),
            timing_seeds: timing_seeds.to_vec(),
            compile: with_compile,
            timing_cpu: python.timing_cpu(gpu),
        });
        let outcome = self
            .inner
            .engine
            .stage(inner.engine.start(stage, cancel), request, Some(lane))
            .await
            .map_err(InfraError::stage(Mode::Baseline))?;
        if !outcome.ok() {
            return Err(InfraError::TrustedStage {
                what: "the baseline failed",
                error: tail(&outcome.error_text(), 4000),
            });
        }
        let result = outcome.result.map(|r| r.body).unwrap_or_default();
        if let Some(error) = &result.compile_error {
            tracing::warn!(task = %submission.task_id, %error, "torch.compile baseline unavailable");
        }
        let Some(eager) = result.eager_ms else {
            let error = "no readable eager samples".to_owned();
            return Err(InfraError::TrustedStage { what: "the baseline failed", error });
        };
        let baseline = Baseline { eager, eager_host: result.eager_host_ms, compiled: result.compile_ms };
        let text = baseline.text();
        inner
            .baselines
            .complete(&key, &Entry::Ready(text.clone()), &lock)
            .map_err(InfraError::cache("baseline cache"))?;
        inner.engine.evict_later("baseline", &inner.baselines);
        Ok(baseline)
    }

    /// A baseline's stage in `scratch`, the task written there, with `env` (the interpreter's, and the device's
    /// where it is known when the process starts).
    pub(super) fn baseline_stage(
        &self,
        submission: &Submission,
        scratch: &Path,
        mut env: Vec<(OsString, OsString)>,
    ) -> Result<Stage, InfraError> {
        std::fs::write(scratch.join("task.py"), &submission.task).map_err(InfraError::files("writing task.py"))?;
        env.push(("TORCHINDUCTOR_CACHE_DIR".into(), scratch.join("inductor").into()));
        env.push(("TRITON_CACHE_DIR".into(), scratch.join("triton").into()));
        Ok(Stage {
            scratch: scratch.to_owned(),
            readable: vec![],
            writable: vec![],
            env,
            wall: Duration::from_secs(self.inner.config.run_timeout_secs),
            background: false,
            launcher: vec![],
        })
    }

    /// The baseline cache's key of `submission`'s task on `gpu` (or the CPU).
    pub(super) fn baseline_key(&self, submission: &Submission, gpu: Option<usize>) -> String {
        let inner = &self.inner;
        let python = inner.engine.checked_python();
        let timing = serde_json::to_string(&inner.config.timing).unwrap_or_default();
        cache::key(&[
            submission.task.as_bytes(),
            python.device_name(gpu).as_bytes(),
            python.versions_key().as_bytes(),
            timing.as_bytes(),
            &[u8::from(inner.config.baseline_torch_compile)],
            python::harness_digest().as_bytes(),
        ])
    }

    /// The task's model initialisation seed and timing input seeds: the same for the candidate, its checks and
    /// the baseline, so all of them see the same model and inputs.
    pub(super) fn baseline_seeds(&self, task_key: &str) -> (u64, Vec<u64>) {
        let sets = self.inner.config.timing.input_sets.max(1) as usize;
        let engine = &self.inner.engine;
        (engine.seeds(task_key, "init", 1)[0], engine.seeds(task_key, "timing", sets))
    }
}
