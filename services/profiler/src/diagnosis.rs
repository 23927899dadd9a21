//! A deterministic diagnosis of one profiled launch: what bounds it — memory, compute, latency or occupancy — from
//! its throughput against the device's peak, its occupancy and its limiter, and its stall breakdown, with the
//! metrics that justify the call and a short text a model can act on. The rules, in order:
//!
//! 1. A unit at or above [`BUSY`] percent of its peak bounds the kernel: memory (`gpu__compute_memory_throughput`)
//!    when it is at least as busy as the SMs (`sm__throughput`), compute otherwise.
//! 2. Otherwise, a theoretical occupancy (`sm__maximum_warps_per_active_cycle_pct`) at or below [`FEW_WARPS`]
//!    percent: occupancy-bound, limited by whichever of registers, shared memory, block size (warps) or the
//!    block count allows the fewest blocks per SM (`launch__occupancy_limit_*`).
//! 3. Otherwise latency-bound: warps wait; the largest stall reasons
//!    (`smsp__average_warps_issue_stalled_*_per_issue_active.ratio`) say on what.
//!
//! Where the metrics a rule needs were not collected, the diagnosis is undetermined and names what is missing.

use crate::ncu::Launch;

/// Percent of peak at which a unit is the bottleneck.
pub const BUSY: f64 = 60.0;
/// Theoretical occupancy (percent of the SM's warps) at or below which too few warps are resident.
pub const FEW_WARPS: f64 = 50.0;

const MEMORY: &str = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed";
const COMPUTE: &str = "sm__throughput.avg.pct_of_peak_sustained_elapsed";
const ACHIEVED: &str = "sm__warps_active.avg.pct_of_peak_sustained_active";
const THEORETICAL: &str = "sm__maximum_warps_per_active_cycle_pct";
const LIMITS: &[(&str, &str)] = &[
    ("launch__occupancy_limit_registers", "registers per thread"),
    ("launch__occupancy_limit_shared_mem", "shared memory per block"),
    ("launch__occupancy_limit_warps", "threads per block"),
    ("launch__occupancy_limit_blocks", "the blocks-per-SM limit"),
];
const STALL_PREFIX: &str = "smsp__average_warps_issue_stalled_";
const STALL_SUFFIX: &str = "_per_issue_active.ratio";

/// The stall reason a stall metric measures (`long_scoreboard` for
/// `smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio`).
pub fn stall_reason(metric: &str) -> Option<&str> {
    metric.strip_prefix(STALL_PREFIX)?.strip_suffix(STALL_SUFFIX)
}

/// What bounds a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bottleneck {
    Memory,
    Compute,
    Latency,
    Occupancy,
    /// The metrics collected cannot decide.
    Undetermined,
}

/// A launch's diagnosis.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnosis {
    pub bottleneck: Bottleneck,
    /// The metrics that justify it, by name, with their values (3-4 of them).
    pub evidence: Vec<(String, f64)>,
    /// One or two sentences for a model.
    pub text: String,
}

/// Diagnoses one launch by the rules in this module's documentation.
pub fn diagnose(launch: &Launch) -> Diagnosis {
    let (Some(memory), Some(compute)) = (launch.value(MEMORY), launch.value(COMPUTE)) else {
        let missing: Vec<&str> = [MEMORY, COMPUTE].into_iter().filter(|m| launch.value(m).is_none()).collect();
        return Diagnosis {
            bottleneck: Bottleneck::Undetermined,
            evidence: vec![],
            text: format!("undetermined: {} not collected", missing.join(" and ")),
        };
    };
    let evidence = |names: &[&str]| -> Vec<(String, f64)> {
        names.iter().filter_map(|name| launch.value(name).map(|value| ((*name).to_owned(), value))).collect()
    };
    let evidence_of = |names: Vec<String>| -> Vec<(String, f64)> {
        names.into_iter().filter_map(|name| launch.value(&name).map(|value| (name, value))).collect()
    };
    let kernel = launch.short_name();
    if memory.max(compute) >= BUSY {
        if memory >= compute {
            return Diagnosis {
                bottleneck: Bottleneck::Memory,
                evidence: evidence(&[MEMORY, COMPUTE, ACHIEVED]),
                text: format!(
                    "{kernel} is memory-bound: memory throughput is at {memory:.1}% of peak while the SMs are at \
                     {compute:.1}%. Move fewer bytes: fuse passes, reuse data from shared memory or registers, use \
                     wider (vectorised) and coalesced accesses, or a narrower data type where accuracy allows."
                ),
            };
        }
        return Diagnosis {
            bottleneck: Bottleneck::Compute,
            evidence: evidence(&[COMPUTE, MEMORY, ACHIEVED]),
            text: format!(
                "{kernel} is compute-bound: the SMs are at {compute:.1}% of peak and memory at {memory:.1}%. Do less \
                 arithmetic per result (hoist invariants, cheaper math), or move it to faster units (tensor cores, \
                 lower precision where accuracy allows)."
            ),
        };
    }
    if let Some(theoretical) = launch.value(THEORETICAL).filter(|t| *t <= FEW_WARPS) {
        let limiter = LIMITS
            .iter()
            .filter_map(|(name, what)| launch.value(name).map(|blocks| (blocks, *name, *what)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let mut names = vec![THEORETICAL, ACHIEVED, MEMORY];
        let because = match limiter {
            Some((blocks, name, what)) => {
                names.push(name);
                format!("{what} allows only {blocks:.0} blocks per SM")
            }
            None => "the limiter was not collected".to_owned(),
        };
        return Diagnosis {
            bottleneck: Bottleneck::Occupancy,
            evidence: evidence(&names),
            text: format!(
                "{kernel} is occupancy-bound: at most {theoretical:.1}% of the SM's warps can be resident ({because}), \
                 too few to hide latency, and neither memory ({memory:.1}%) nor compute ({compute:.1}%) is busy. \
                 Use less of the limiting resource per block, or more threads per block."
            ),
        };
    }
    let mut stalls: Vec<(&str, f64)> = launch
        .metrics
        .iter()
        .filter_map(|(name, metric)| {
            let reason = name.strip_prefix(STALL_PREFIX)?.strip_suffix(STALL_SUFFIX)?;
            (reason != "selected").then_some((reason, metric.value))
        })
        .collect();
    stalls.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut names = vec![MEMORY.to_owned(), COMPUTE.to_owned()];
    let waits = match stalls.first() {
        Some((reason, _)) => {
            let leading: Vec<String> = stalls.iter().take(2).map(|(r, v)| format!("{r} ({v:.1} cycles)")).collect();
            names.push(format!("{STALL_PREFIX}{reason}{STALL_SUFFIX}"));
            format!("warps wait mostly on {}", leading.join(" and "))
        }
        None => "the stall breakdown was not collected".to_owned(),
    };
    let evidence = evidence_of(names);
    Diagnosis {
        bottleneck: Bottleneck::Latency,
        evidence,
        text: format!(
            "{kernel} is latency-bound: neither memory ({memory:.1}%) nor compute ({compute:.1}%) is busy and \
             occupancy is not the limit; {waits}. Give each warp more independent work (more loads in flight, \
             unrolling) or launch more work per kernel."
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::ncu::{Metric, parse_raw};

    fn fixture(kind: &str) -> Launch {
        let path = format!("{}/tests/fixtures/h100/{kind}.full.csv", env!("CARGO_MANIFEST_DIR"));
        let launches = parse_raw(&std::fs::read_to_string(path).expect("fixture")).expect("parses");
        assert_eq!(launches.len(), 2, "two profiled launches");
        launches.into_iter().next().expect("one")
    }

    #[test]
    fn recorded_kernels_get_the_bottleneck_they_were_written_to_have() {
        let memory = diagnose(&fixture("memory"));
        assert_eq!(memory.bottleneck, Bottleneck::Memory, "{}", memory.text);
        assert_eq!(memory.evidence[0], (MEMORY.to_owned(), 81.51));
        assert!(memory.text.starts_with("stream_axpy is memory-bound"), "{}", memory.text);

        let compute = diagnose(&fixture("compute"));
        assert_eq!(compute.bottleneck, Bottleneck::Compute, "{}", compute.text);
        assert_eq!(compute.evidence[0], (COMPUTE.to_owned(), 95.11));

        let occupancy = diagnose(&fixture("occupancy"));
        assert_eq!(occupancy.bottleneck, Bottleneck::Occupancy, "{}", occupancy.text);
        assert!(occupancy.text.contains("shared memory per block allows only 2 blocks per SM"), "{}", occupancy.text);
        assert_eq!(occupancy.evidence.len(), 4);
    }

    #[test]
    fn a_launch_with_nothing_busy_and_room_for_warps_is_latency_bound_on_its_largest_stall() {
        let metric = |value| Metric { value, unit: String::new() };
        let mut metrics = BTreeMap::new();
        metrics.insert(MEMORY.to_owned(), metric(20.0));
        metrics.insert(COMPUTE.to_owned(), metric(10.0));
        metrics.insert(THEORETICAL.to_owned(), metric(100.0));
        metrics.insert(format!("{STALL_PREFIX}long_scoreboard{STALL_SUFFIX}"), metric(30.0));
        metrics.insert(format!("{STALL_PREFIX}selected{STALL_SUFFIX}"), metric(99.0));
        metrics.insert(format!("{STALL_PREFIX}barrier{STALL_SUFFIX}"), metric(2.0));
        let launch =
            Launch { id: 0, kernel: "k(int)".into(), block_size: String::new(), grid_size: String::new(), metrics };
        let diagnosis = diagnose(&launch);
        assert_eq!(diagnosis.bottleneck, Bottleneck::Latency);
        assert!(diagnosis.text.contains("long_scoreboard (30.0 cycles) and barrier"), "{}", diagnosis.text);
        assert_eq!(diagnosis.evidence.len(), 3);

        let bare = Launch { metrics: BTreeMap::new(), ..launch };
        let diagnosis = diagnose(&bare);
        assert_eq!(diagnosis.bottleneck, Bottleneck::Undetermined);
        assert!(diagnosis.text.contains("not collected"), "{}", diagnosis.text);
    }
}
