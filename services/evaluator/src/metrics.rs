//! Evaluator metrics at `/metrics`: admitted evaluations (queue depth), verdicts, hacks (the hack ratio's
//! numerator), infrastructure errors by cause, findings by code, and the engine's (`kforge_execution::metrics`:
//! stages, caches, devices).
//!
//! Every verdict's series and the hack counter exist from registration at 0, and so do the evaluator's caches'
//! (reference, baseline): Prometheus's `rate` counts increases between scrapes, so a series created by its first
//! event would hide that event from the dashboards' ratios.

use kforge_execution::metrics::{ExecutionMetrics, InFlight};
use kforge_proto::v1 as pb;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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

/// The evaluator's metrics; clones share the same series.
#[derive(Clone, Debug)]
pub struct EvaluatorMetrics {
    admitted: Gauge,
    verdicts: Family<VerdictLabel, Counter>,
    hacks: Counter,
    infra_errors: Family<CauseLabel, Counter>,
    findings: Family<FindingLabel, Counter>,
    /// The engine's: stages, caches, devices.
    pub execution: ExecutionMetrics,
}

impl EvaluatorMetrics {
    /// Creates the metrics, the engine's among them, and registers them (prefix `kforge_evaluator_`).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            admitted: Gauge::default(),
            verdicts: Family::default(),
            hacks: Counter::default(),
            infra_errors: Family::default(),
            findings: Family::default(),
            execution: ExecutionMetrics::register(registry),
        };
        let r = registry.sub_registry_with_prefix("kforge_evaluator");
        r.register("admitted", "evaluations admitted: queued or running (queue depth)", metrics.admitted.clone());
        r.register("verdicts", "evaluations by verdict", metrics.verdicts.clone());
        r.register(
            "hacks",
            "evaluations that were hacks: VERDICT_HACK, or a rejection with a hack-category finding (hack ratio numerator)",
            metrics.hacks.clone(),
        );
        r.register(
            "infra_errors",
            "evaluations ended by the evaluator's own failure, by cause",
            metrics.infra_errors.clone(),
        );
        r.register("findings", "findings by code and category", metrics.findings.clone());
        for verdict in (1..).map_while(|v| pb::Verdict::try_from(v).ok()) {
            let _ = metrics.verdicts.get_or_create(&VerdictLabel { verdict: verdict.as_str_name().into() });
        }
        for cache in ["reference", "baseline"] {
            metrics.execution.create_cache(cache);
        }
        metrics
    }

    pub(crate) fn admitted(&self) -> InFlight {
        InFlight::enter(&self.admitted)
    }

    pub(crate) fn verdict(&self, verdict: pb::Verdict, findings: &[pb::Finding]) {
        self.verdicts.get_or_create(&VerdictLabel { verdict: verdict.as_str_name().into() }).inc();
        let hack_category = pb::FindingCategory::Hack as i32;
        let hack = verdict == pb::Verdict::Hack
            || (verdict == pb::Verdict::Rejected && findings.iter().any(|f| f.category == hack_category));
        if hack {
            self.hacks.inc();
        }
        for finding in findings {
            let category = pb::FindingCategory::try_from(finding.category).map_or("UNKNOWN", |c| c.as_str_name());
            self.findings.get_or_create(&FindingLabel { code: finding.code.clone(), category: category.into() }).inc();
        }
    }

    pub(crate) fn infra_error(&self, cause: &str) {
        self.infra_errors.get_or_create(&CauseLabel { cause: cause.into() }).inc();
    }
}
