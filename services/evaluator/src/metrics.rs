//! Evaluator metrics at `/metrics`: admitted evaluations (queue depth), stages in flight and their latency,
//! verdicts, infrastructure errors by cause, findings by code (for the hack ratio), cache hits, device probes and quarantined devices, and the
//! device memory reserved on each GPU by memory-aware admission.

use std::time::Duration;

use kforge_proto::v1 as pb;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabel {
    verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabel {
    cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FindingLabel {
    code: String,
    category: String,
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

/// The evaluator's metrics; clones share the same series.
#[derive(Clone, Debug)]
pub struct EvaluatorMetrics {
    admitted: Gauge,
    running: Family<StageLabel, Gauge>,
    stage_seconds: Family<StageLabel, Histogram>,
    verdicts: Family<VerdictLabel, Counter>,
    infra_errors: Family<CauseLabel, Counter>,
    findings: Family<FindingLabel, Counter>,
    cache: Family<CacheLabel, Counter>,
    device_probes: Family<ProbeLabel, Counter>,
    devices_quarantined: Gauge,
    gpu_reserved_bytes: Family<GpuLabel, Gauge>,
    evictions: Family<CacheLabel, Counter>,
}

/// Decrements its gauge when dropped.
#[derive(Debug)]
pub struct InFlight(Gauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl EvaluatorMetrics {
    /// Creates the metrics and registers them (prefix `kforge_evaluator_`).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            admitted: Gauge::default(),
            running: Family::default(),
            // 10 ms to ~3 h: a cached check to a cold compile.
            stage_seconds: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.01, 2.0, 20))),
            verdicts: Family::default(),
            infra_errors: Family::default(),
            findings: Family::default(),
            cache: Family::default(),
            device_probes: Family::default(),
            devices_quarantined: Gauge::default(),
            gpu_reserved_bytes: Family::default(),
            evictions: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kforge_evaluator");
        r.register("admitted", "evaluations admitted: queued or running (queue depth)", metrics.admitted.clone());
        r.register("stages_running", "stages running now, by stage", metrics.running.clone());
        r.register("stage_seconds", "stage wall time, by stage", metrics.stage_seconds.clone());
        r.register("verdicts", "evaluations by verdict", metrics.verdicts.clone());
        r.register(
            "infra_errors",
            "evaluations ended by the evaluator's own failure, by cause",
            metrics.infra_errors.clone(),
        );
        r.register("findings", "findings by code and category (hack ratio numerator)", metrics.findings.clone());
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

    pub(crate) fn admitted(&self) -> InFlight {
        self.admitted.inc();
        InFlight(self.admitted.clone())
    }

    pub(crate) fn stage(&self, stage: &str) -> InFlight {
        let gauge = self.running.get_or_create(&StageLabel { stage: stage.into() }).clone();
        gauge.inc();
        InFlight(gauge)
    }

    pub(crate) fn stage_seconds(&self, stage: &str, elapsed: Duration) {
        self.stage_seconds.get_or_create(&StageLabel { stage: stage.into() }).observe(elapsed.as_secs_f64());
    }

    pub(crate) fn verdict(&self, verdict: pb::Verdict, findings: &[pb::Finding]) {
        self.verdicts.get_or_create(&VerdictLabel { verdict: verdict.as_str_name().into() }).inc();
        for finding in findings {
            let category = pb::FindingCategory::try_from(finding.category).map_or("UNKNOWN", |c| c.as_str_name());
            self.findings.get_or_create(&FindingLabel { code: finding.code.clone(), category: category.into() }).inc();
        }
    }

    pub(crate) fn infra_error(&self, cause: &str) {
        self.infra_errors.get_or_create(&CauseLabel { cause: cause.into() }).inc();
    }

    pub(crate) fn cache(&self, cache: &str, hit: bool) {
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

    pub(crate) fn evicted(&self, cache: &str, entries: usize) {
        let label = CacheLabel { cache: cache.into(), outcome: "evicted".into() };
        self.evictions.get_or_create(&label).inc_by(entries as u64);
    }
}
