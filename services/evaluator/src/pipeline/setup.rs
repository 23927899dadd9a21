//! Start-up: an evaluator on an engine (its own, or the one this process shares for the work directory), and the
//! evaluator's own caches in the work directory (references, baselines).

use std::path::PathBuf;
use std::sync::Arc;

use kforge_execution::Engine;
use kforge_execution::cache::Cache;
use kforge_execution::disk;
use kforge_execution::engine::WarmUpFailed;

use super::{Evaluator, Inner};
use crate::config::EvaluatorConfig;
use crate::metrics::EvaluatorMetrics;

impl Evaluator {
    /// The evaluator on this process's engine for `config.work_dir` (`Engine::shared`): the Evaluator and Profiler
    /// services in one process share its device lanes (a profile never runs beside a timed stage), its admission
    /// queue, its compile pool and its caches.
    pub async fn shared(config: EvaluatorConfig, metrics: EvaluatorMetrics) -> std::io::Result<Self> {
        let engine = Engine::shared(config.execution(), metrics.execution.clone()).await?;
        Self::on(engine, config, metrics)
    }

    /// The evaluator on an engine of its own. An environment without PyTorch is not fatal: the evaluator serves
    /// and says why it cannot evaluate.
    pub async fn new(config: EvaluatorConfig, metrics: EvaluatorMetrics) -> std::io::Result<Self> {
        let engine = Engine::new(config.execution(), metrics.execution.clone()).await?;
        Self::on(engine, config, metrics)
    }

    /// The evaluator on `engine`, with its caches in the engine's work directory: the reference cache takes at
    /// most 20% of the space available there.
    fn on(engine: Engine, config: EvaluatorConfig, metrics: EvaluatorMetrics) -> std::io::Result<Self> {
        let work = engine.work_dir().to_owned();
        let limits = config.cache_limits;
        let references_bytes = disk::available_bytes(&work)
            .map_or(limits.references_bytes, |bytes| limits.references_bytes.min(bytes / 5));
        tracing::info!(references_bytes, "reference cache bound");
        Ok(Self {
            inner: Arc::new(Inner {
                references: Cache::new(work.join("references"), references_bytes)?,
                baselines: Cache::new(work.join("baselines"), limits.baselines_bytes)?,
                engine,
                config,
                metrics,
            }),
        })
    }

    /// Waits for the engine's warm-up to end: the bindings' precompiled header in place (its directory), or why it
    /// is not. Evaluations do not wait for it.
    pub async fn warm_up(&self) -> Result<PathBuf, WarmUpFailed> {
        self.inner.engine.warm_up().await
    }
}
