//! The engine's metrics at `/metrics`: stages in flight and their latency, cache lookups and evictions, device
//! probes and quarantined devices, and the device memory reserved on each GPU by memory-aware admission. The
//! series keep the `kforge_evaluator_` prefix they had before the engine was shared with the profiler.
//!
//! Every stage's series, the artifact cache's hits and misses and both probe results exist from registration at 0
//! (a service adds its own caches with [`ExecutionMetrics::create_cache`]): Prometheus's `rate` counts increases
//! between scrapes, so a series created by its first event would hide that event from the dashboards.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::protocol::Mode;

/// Every stage the engine runs: its series exist from the start.
const STAGES: [Mode; 6] =
    [Mode::Compile, Mode::Reference, Mode::Candidate, Mode::Check, Mode::Baseline, Mode::BindingsPch];

/// A mode added to the protocol fails to compile here until [`STAGES`] lists it.
const _: fn(Mode) = |mode| match mode {
    Mode::Compile | Mode::Reference | Mode::Candidate | Mode::Check | Mode::Baseline | Mode::BindingsPch => {}
};

/// The time an evaluation held its device lane, timed beside the stages (`stage_seconds` only).
pub const DEVICE_LANE_STAGE: &str = "device_lane";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabel {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabel {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabel {
    cache: String,
    outcome: String,
}

/// The engine's metrics; clones share the same series.
#[derive(Clone, Debug)]
pub struct ExecutionMetrics {
    running: Family<StageLabel, Gauge>,
    stage_seconds: Family<StageLabel, Histogram>,
    cache: Family<CacheLabel, Counter>,
    device_probes: Family<ProbeLabel, Counter>,
    devices_quarantined: Gauge,
    gpu_reserved_bytes: Family<GpuLabel, Gauge>,
    evictions: Family<CacheLabel, Counter>,
}

/// Decrements its gauge when dropped.
#[derive(Debug)]
pub struct InFlight(Gauge);

impl InFlight {
    /// Counts one more in `gauge` until dropped.
    pub fn enter(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl ExecutionMetrics {
    /// Creates the metrics and registers them (prefix `kforge_evaluator_`).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::unregistered();
        let r = registry.sub_registry_with_prefix("kforge_evaluator");
        r.register("stages_running", "stages running now, by stage", metrics.running.clone());
        r.register("stage_seconds", "stage wall time, by stage", metrics.stage_seconds.clone());
        r.register("cache_lookups", "cache lookups by cache and outcome", metrics.cache.clone());
        r.register("device_probes", "device health probes by result (pass, fail)", metrics.device_probes.clone());
        r.register(
            "devices_quarantined",
            "GPUs out of service after a failed probe",
            metrics.devices_quarantined.clone(),
        );
        r.register(
            "gpu_reserved_bytes",
            "device memory reserved by the evaluations holding a GPU's slots (known footprints only), by GPU",
            metrics.gpu_reserved_bytes.clone(),
        );
        r.register("cache_evictions", "cache entries evicted to stay within the size bound", metrics.evictions.clone());
        metrics
    }

    /// Metrics that no registry exposes (tests, tools).
    pub fn unregistered() -> Self {
        let metrics = Self {
            running: Family::default(),
            // 10 ms to ~3 h: a cached check to a cold compile.
            stage_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.01, 2.0, 20))),
            cache: Family::default(),
            device_probes: Family::default(),
            devices_quarantined: Gauge::default(),
            gpu_reserved_bytes: Family::default(),
            evictions: Family::default(),
        };
        for stage in STAGES.map(Mode::name) {
            let _ = metrics.running.get_or_create(&StageLabel { stage: stage.into() });
            let _ = metrics.stage_seconds.get_or_create(&StageLabel { stage: stage.into() });
        }
        let _ = metrics.stage_seconds.get_or_create(&StageLabel { stage: DEVICE_LANE_STAGE.into() });
        metrics.create_cache("artifact");
        for result in ["pass", "fail"] {
            let _ = metrics.device_probes.get_or_create(&ProbeLabel { result: result.into() });
        }
        metrics
    }

    /// Creates `cache`'s hit and miss series at 0.
    pub fn create_cache(&self, cache: &str) {
        for outcome in ["hit", "miss"] {
            let _ = self.cache.get_or_create(&CacheLabel { cache: cache.into(), outcome: outcome.into() });
        }
    }

    pub fn stage(&self, stage: &str) -> InFlight {
        InFlight::enter(&self.running.get_or_create(&StageLabel { stage: stage.into() }))
    }

    pub fn stage_seconds(&self, stage: &str, elapsed: Duration) {
        self.stage_seconds.get_or_create(&StageLabel { stage: stage.into() }).observe(elapsed.as_secs_f64());
    }

    pub fn cache(&self, cache: &str, hit: bool) {
        let outcome = if hit { "hit" } else { "miss" };
        self.cache.get_or_create(&CacheLabel { cache: cache.into(), outcome: outcome.into() }).inc();
    }

    pub(crate) fn device_probe(&self, passed: bool) {
        let result = if passed { "pass" } else { "fail" };
        self.device_probes.get_or_create(&ProbeLabel { result: result.into() }).inc();
    }

    pub(crate) fn devices_quarantined(&self, count: usize) {
        self.devices_quarantined.set(count as i64);
    }

    /// The gauge of the bytes reserved on GPU `gpu`.
    pub(crate) fn gpu_reserved_bytes(&self, gpu: usize) -> Gauge {
        self.gpu_reserved_bytes.get_or_create(&GpuLabel { gpu: gpu.to_string() }).clone()
    }

    pub fn evicted(&self, cache: &str, entries: usize) {
        let label = CacheLabel { cache: cache.into(), outcome: "evicted".into() };
        self.evictions.get_or_create(&label).inc_by(entries as u64);
    }
}
