//! A deterministic diagnosis of one profiled launch: what bounds it — memory, compute, latency or occupancy — from
//! its throughput against the device's peak, its occupancy and its limiter, and its stall breakdown, with the
//! metrics that justify the call and a short text a model can act on.
//!
//! It reads either metric set. Each of the three figures the rules compare comes from Nsight Compute's composite
//! metric when the launch has it (the `full` set), else is derived from CudaForge's 24 (the default set,
//! `nsight::CUDAFORGE`) and the launch statistics and device attributes that every raw page carries:
//!
//! - **memory** (percent of peak): `gpu__compute_memory_throughput`, else the largest of `dram__throughput` and
//!   `gpu__dram_throughput` (of peak elapsed), `lts__throughput` and `l1tex__throughput` (of peak active);
//! - **compute** (percent of peak): `sm__throughput`, else the largest of the FMA and tensor pipes' instruction
//!   rates (`sm__inst_executed_pipe_{fma,tensor}`, of peak active) and the issue utilisation,
//!   `sm__inst_executed.sum / (launch__sm_count * sm__cycles_active.avg) / 4 * 100` (an SM's four schedulers issue
//!   one instruction a cycle each);
//! - **theoretical occupancy** (percent of the SM's warps): `sm__maximum_warps_per_active_cycle_pct`, else the
//!   fewest blocks per SM any `launch__occupancy_limit_*` allows, times the block's warps
//!   (`ceil(launch__block_size / 32)`), over `device__attribute_max_warps_per_multiprocessor`, at most 100.
//!
//! Ties go to the first source in the order listed. The rules, in order:
//!
//! 1. A unit at or above [`BUSY`] percent of its peak bounds the kernel: memory when it is at least as busy as
//!    compute, compute otherwise.
//! 2. Otherwise, a theoretical occupancy at or below [`FEW_WARPS`] percent: occupancy-bound, limited by whichever
//!    of registers, shared memory, block size (warps) or the block count allows the fewest blocks per SM.
//! 3. Otherwise latency-bound: warps wait; the two largest stall reasons say on what, read from
//!    `smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio` (the `full` set) when the launch has any,
//!    else from `smsp__warp_issue_stalled_<reason>_per_warp_active.pct` (CudaForge's); `selected` and
//!    `not_selected` are not stalls.
//!
//! Where neither form of memory or compute throughput was collected, the diagnosis is undetermined and names what
//! is missing. The evidence is the 3-4 metrics a call was made from, by their names in the raw page.

use crate::ncu::Launch;

/// Percent of peak at which a unit is the bottleneck.
pub const BUSY: f64 = 60.0;
/// Theoretical occupancy (percent of the SM's warps) at or below which too few warps are resident.
pub const FEW_WARPS: f64 = 50.0;

// The composite metrics of the `full` set.
const MEMORY: &str = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed";
const COMPUTE: &str = "sm__throughput.avg.pct_of_peak_sustained_elapsed";
const THEORETICAL: &str = "sm__maximum_warps_per_active_cycle_pct";
// What CudaForge's set has in their place.
const MEMORY_UNITS: &[&str] = &[
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_active",
    "l1tex__throughput.avg.pct_of_peak_sustained_active",
];
const PIPES: &[&str] = &[
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active",
];
const INSTRUCTIONS: &str = "sm__inst_executed.sum";
const CYCLES: &str = "sm__cycles_active.avg";
// Launch statistics and device attributes: in every raw page, whatever metrics were asked for.
const SMS: &str = "launch__sm_count";
const BLOCK_SIZE: &str = "launch__block_size";
const MAX_WARPS: &str = "device__attribute_max_warps_per_multiprocessor";
/// Warp schedulers per SM, each issuing at most one instruction a cycle.
const SCHEDULERS: f64 = 4.0;

const ACHIEVED: &str = "sm__warps_active.avg.pct_of_peak_sustained_active";
const LIMITS: &[(&str, &str)] = &[
    ("launch__occupancy_limit_registers", "registers per thread"),
    ("launch__occupancy_limit_shared_mem", "shared memory per block"),
    ("launch__occupancy_limit_warps", "threads per block"),
    ("launch__occupancy_limit_blocks", "the blocks-per-SM limit"),
];
/// The two forms of a stall metric, preferred first: prefix, suffix and what its value counts.
const STALLS: &[(&str, &str, &str)] = &[
    ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio", " cycles"),
    ("smsp__warp_issue_stalled_", "_per_warp_active.pct", "% of active warps"),
];
/// Reasons a stall metric names that are not stalls: the warp issued, or was ready and another one did.
const NOT_STALLS: &[&str] = &["selected", "not_selected"];

/// The stall reason a stall metric measures, in either form (`long_scoreboard` for
/// `smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio` and for
/// `smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct`); none for `selected` and `not_selected`.
pub fn stall_reason(metric: &str) -> Option<&str> {
    STALLS
        .iter()
        .find_map(|(prefix, suffix, _)| metric.strip_prefix(prefix)?.strip_suffix(suffix))
        .filter(|reason| !reason.is_empty() && !NOT_STALLS.contains(reason))
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

/// A percentage the rules compare, and the metrics it was read from.
#[derive(Debug, Clone, PartialEq)]
struct Figure {
    percent: f64,
    from: Vec<&'static str>,
}

/// The largest of `candidates`, the first on a tie.
fn largest(candidates: impl IntoIterator<Item = Figure>) -> Option<Figure> {
    candidates.into_iter().fold(None, |best, next| match best {
        Some(best) if best.percent >= next.percent => Some(best),
        _ => Some(next),
    })
}

fn single(launch: &Launch, name: &'static str) -> Option<Figure> {
    launch.value(name).map(|percent| Figure { percent, from: vec![name] })
}

/// Memory throughput against peak (see the module's documentation).
fn memory(launch: &Launch) -> Option<Figure> {
    single(launch, MEMORY).or_else(|| largest(MEMORY_UNITS.iter().filter_map(|name| single(launch, name))))
}

/// Compute throughput against peak (see the module's documentation).
fn compute(launch: &Launch) -> Option<Figure> {
    single(launch, COMPUTE).or_else(|| {
        let issue = match (launch.value(INSTRUCTIONS), launch.value(SMS), launch.value(CYCLES)) {
            (Some(instructions), Some(sms), Some(cycles)) if sms > 0.0 && cycles > 0.0 => Some(Figure {
                percent: instructions / (sms * cycles) / SCHEDULERS * 100.0,
                from: vec![INSTRUCTIONS, CYCLES],
            }),
            _ => None,
        };
        largest(PIPES.iter().filter_map(|name| single(launch, name)).chain(issue))
    })
}

/// The occupancy limit that allows the fewest blocks per SM: its metric, what it limits, and the blocks.
fn limiter(launch: &Launch) -> Option<(&'static str, &'static str, f64)> {
    LIMITS.iter().filter_map(|(name, what)| launch.value(name).map(|blocks| (*name, *what, blocks))).fold(
        None,
        |best, next| match best {
            Some(best) if best.2 <= next.2 => Some(best),
            _ => Some(next),
        },
    )
}

/// Theoretical occupancy (see the module's documentation).
fn theoretical(launch: &Launch) -> Option<Figure> {
    single(launch, THEORETICAL).or_else(|| {
        let (name, _, blocks) = limiter(launch)?;
        let warps_per_block = (launch.value(BLOCK_SIZE)? / 32.0).ceil();
        let max_warps = launch.value(MAX_WARPS).filter(|w| *w > 0.0)?;
        Some(Figure {
            percent: (blocks * warps_per_block / max_warps * 100.0).min(100.0),
            from: vec![name, BLOCK_SIZE, MAX_WARPS],
        })
    })
}

/// Diagnoses one launch by the rules in this module's documentation, in their order: busy (memory or compute),
/// occupancy, then latency.
pub fn diagnose(launch: &Launch) -> Diagnosis {
    let (Some(memory), Some(compute)) = (memory(launch), compute(launch)) else {
        return undetermined(launch);
    };
    let throughput = Throughput { memory, compute };
    busy(launch, &throughput)
        .or_else(|| occupancy_bound(launch, &throughput))
        .unwrap_or_else(|| latency_bound(launch, &throughput))
}

/// The memory and compute throughputs of a launch, each with the metrics it came from.
struct Throughput {
    memory: Figure,
    compute: Figure,
}

/// The values of `names` the launch has, as a diagnosis's evidence.
fn evidence(launch: &Launch, names: &[&str]) -> Vec<(String, f64)> {
    names.iter().filter_map(|name| launch.value(name).map(|value| ((*name).to_owned(), value))).collect()
}

/// No diagnosis: the launch lacks the memory or the compute throughput, named in the text.
fn undetermined(launch: &Launch) -> Diagnosis {
    let mut missing = Vec::new();
    if memory(launch).is_none() {
        missing.push(format!("memory throughput ({MEMORY}, or any of {})", MEMORY_UNITS.join(", ")));
    }
    if compute(launch).is_none() {
        missing.push(format!(
            "compute throughput ({COMPUTE}, or any of {}, or {INSTRUCTIONS} with {CYCLES})",
            PIPES.join(", ")
        ));
    }
    Diagnosis {
        bottleneck: Bottleneck::Undetermined,
        evidence: vec![],
        text: format!("undetermined: {} not collected", missing.join(" and ")),
    }
}

/// Memory- or compute-bound: the busier of the two is at [`BUSY`] or more.
fn busy(launch: &Launch, Throughput { memory, compute }: &Throughput) -> Option<Diagnosis> {
    let kernel = launch.short_name();
    let (memory_pct, compute_pct) = (memory.percent, compute.percent);
    if memory_pct.max(compute_pct) < BUSY {
        return None;
    }
    Some(if memory_pct >= compute_pct {
        Diagnosis {
            bottleneck: Bottleneck::Memory,
            evidence: evidence(launch, &[memory.from.as_slice(), compute.from.as_slice(), &[ACHIEVED]].concat()),
            text: format!(
                "{kernel} is memory-bound: memory throughput is at {memory_pct:.1}% of peak while the SMs are \
                 at {compute_pct:.1}%. Move fewer bytes: fuse passes, reuse data from shared memory or \
                 registers, use wider (vectorised) and coalesced accesses, or a narrower data type where \
                 accuracy allows."
            ),
        }
    } else {
        Diagnosis {
            bottleneck: Bottleneck::Compute,
            evidence: evidence(launch, &[compute.from.as_slice(), memory.from.as_slice(), &[ACHIEVED]].concat()),
            text: format!(
                "{kernel} is compute-bound: the SMs are at {compute_pct:.1}% of peak and memory at {memory_pct:.1}%. \
                 Do less arithmetic per result (hoist invariants, cheaper math), or move it to faster units (tensor \
                 cores, lower precision where accuracy allows)."
            ),
        }
    })
}

/// Occupancy-bound: neither is busy and at most [`FEW_WARPS`] of the SM's warps can be resident.
fn occupancy_bound(launch: &Launch, Throughput { memory, compute }: &Throughput) -> Option<Diagnosis> {
    let occupancy = theoretical(launch).filter(|t| t.percent <= FEW_WARPS)?;
    let limiter = limiter(launch);
    let names: Vec<&str> = if occupancy.from == [THEORETICAL] {
        let mut names = [&[THEORETICAL, ACHIEVED], memory.from.as_slice()].concat();
        names.extend(limiter.map(|(name, _, _)| name));
        names
    } else {
        [occupancy.from.as_slice(), &[ACHIEVED]].concat()
    };
    let because = match limiter {
        Some((_, what, blocks)) => format!("{what} allows only {blocks:.0} blocks per SM"),
        None => "the limiter was not collected".to_owned(),
    };
    let (kernel, theoretical) = (launch.short_name(), occupancy.percent);
    let (memory_pct, compute_pct) = (memory.percent, compute.percent);
    Some(Diagnosis {
        bottleneck: Bottleneck::Occupancy,
        evidence: evidence(launch, &names),
        text: format!(
            "{kernel} is occupancy-bound: at most {theoretical:.1}% of the SM's warps can be resident ({because}), \
             too few to hide latency, and neither memory ({memory_pct:.1}%) nor compute ({compute_pct:.1}%) is \
             busy. Use less of the limiting resource per block, or more threads per block."
        ),
    })
}

/// A launch's stalls in one of [`STALLS`]' forms: (metric, reason, value), largest first, and the form's unit.
struct Stalls<'a> {
    largest_first: Vec<(&'a str, &'a str, f64)>,
    unit: &'static str,
}

/// The stalls of the first of [`STALLS`]' forms the launch has any of.
fn stalls(launch: &Launch) -> Option<Stalls<'_>> {
    STALLS.iter().find_map(|(prefix, suffix, unit)| {
        let mut stalls: Vec<(&str, &str, f64)> = launch
            .metrics
            .iter()
            .filter(|(name, _)| name.starts_with(prefix) && name.ends_with(suffix))
            .filter_map(|(name, metric)| Some((name.as_str(), stall_reason(name)?, metric.value)))
            .collect();
        stalls.sort_by(|a, b| b.2.total_cmp(&a.2));
        (!stalls.is_empty()).then_some(Stalls { largest_first: stalls, unit })
    })
}

/// Latency-bound: what is left when nothing is busy and occupancy is not the limit, with the leading stalls.
fn latency_bound(launch: &Launch, Throughput { memory, compute }: &Throughput) -> Diagnosis {
    let mut names: Vec<&str> = [memory.from.as_slice(), compute.from.as_slice()].concat();
    let waits = match stalls(launch) {
        Some(Stalls { largest_first, unit }) => {
            let leading: Vec<String> =
                largest_first.iter().take(2).map(|(_, r, v)| format!("{r} ({v:.1}{unit})")).collect();
            names.push(largest_first[0].0);
            format!("warps wait mostly on {}", leading.join(" and "))
        }
        None => "the stall breakdown was not collected".to_owned(),
    };
    let (kernel, memory_pct, compute_pct) = (launch.short_name(), memory.percent, compute.percent);
    Diagnosis {
        bottleneck: Bottleneck::Latency,
        evidence: evidence(launch, &names),
        text: format!(
            "{kernel} is latency-bound: neither memory ({memory_pct:.1}%) nor compute ({compute_pct:.1}%) is busy and \
             occupancy is not the limit; {waits}. Give each warp more independent work (more loads in flight, \
             unrolling) or launch more work per kernel."
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ncu::{Metric, parse_raw};
    use crate::nsight;

    fn fixture(kind: &str) -> Launch {
        let path = format!("{}/tests/fixtures/h100/{kind}.full.csv", env!("CARGO_MANIFEST_DIR"));
        let launches = parse_raw(&std::fs::read_to_string(path).expect("fixture")).expect("parses");
        assert_eq!(launches.len(), 2, "two profiled launches");
        launches.into_iter().next().expect("one")
    }

    fn launch(metrics: &[(&str, f64)]) -> Launch {
        let metrics =
            metrics.iter().map(|(name, value)| ((*name).to_owned(), Metric { value: *value, unit: String::new() }));
        Launch {
            id: 0,
            kernel: "k(int)".into(),
            block_size: String::new(),
            grid_size: String::new(),
            metrics: metrics.collect(),
        }
    }

    fn names(diagnosis: &Diagnosis) -> Vec<&str> {
        diagnosis.evidence.iter().map(|(name, _)| name.as_str()).collect()
    }

    /// A recorded `--set full` launch cut down to what a run with CudaForge's set reports: its 24 metrics and the
    /// raw page's launch statistics (`launch__*`) and device attributes (`device__*`). Nine of the 24 are not in the
    /// full set's page under their own name:
    ///
    /// - `sm__inst_executed.sum` is taken from `smsp__inst_executed.sum`, the same count summed over the SM's
    ///   sub-partitions;
    /// - `dram__throughput` and `lts__throughput` of peak active (the page has `gpu__dram_throughput`, and
    ///   `lts__throughput` of peak elapsed only), the tensor pipe (the page has it by operation only, all zero for
    ///   these kernels) and the five `smsp__warp_issue_stalled_*_per_warp_active.pct` (the page has the per-issue
    ///   ratios) are left out: memory is read from `gpu__dram_throughput` and `l1tex__throughput`, compute from
    ///   the FMA pipe and the issue utilisation, and none of the three kernels is latency-bound.
    fn as_cudaforge(full: &Launch) -> Launch {
        let mut launch = full.clone();
        launch.metrics.retain(|name, _| {
            nsight::CUDAFORGE.contains(&name.as_str()) || name.starts_with("launch__") || name.starts_with("device__")
        });
        launch.metrics.insert(INSTRUCTIONS.to_owned(), full.metrics["smsp__inst_executed.sum"].clone());
        let absent: Vec<&str> =
            nsight::CUDAFORGE.iter().copied().filter(|name| !launch.metrics.contains_key(*name)).collect();
        assert_eq!(
            absent,
            [
                "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "lts__throughput.avg.pct_of_peak_sustained_active",
                "smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct",
                "smsp__warp_issue_stalled_short_scoreboard_per_warp_active.pct",
                "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct",
                "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
                "smsp__warp_issue_stalled_branch_resolving_per_warp_active.pct",
            ]
        );
        for composite in [MEMORY, COMPUTE, THEORETICAL] {
            assert!(!launch.metrics.contains_key(composite), "{composite}");
        }
        launch
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
    fn recorded_kernels_get_the_same_bottleneck_from_cudaforges_metrics() {
        let memory = diagnose(&as_cudaforge(&fixture("memory")));
        assert_eq!(memory.bottleneck, Bottleneck::Memory, "{}", memory.text);
        assert_eq!(memory.evidence[0], ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed".to_owned(), 81.51));
        assert_eq!(
            names(&memory),
            ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", INSTRUCTIONS, CYCLES, ACHIEVED]
        );
        // The issue utilisation, 126,006,528 instructions over 132 SMs' 1,857,770.57 active cycles: 12.8% (ncu's
        // smsp__issue_active: 12.89%), above the FMA pipe's 1.71%.
        assert!(
            memory.text.contains("memory throughput is at 81.5% of peak while the SMs are at 12.8%"),
            "{}",
            memory.text
        );

        let compute = diagnose(&as_cudaforge(&fixture("compute")));
        assert_eq!(compute.bottleneck, Bottleneck::Compute, "{}", compute.text);
        assert_eq!(
            names(&compute),
            [INSTRUCTIONS, CYCLES, "l1tex__throughput.avg.pct_of_peak_sustained_active", ACHIEVED]
        );
        // 95.2% issue utilisation (smsp__issue_active 95.18%, sm__throughput 95.11%); the FMA pipe is at 84.6%.
        assert!(compute.text.contains("the SMs are at 95.2% of peak and memory at 0.0%"), "{}", compute.text);

        let occupancy = diagnose(&as_cudaforge(&fixture("occupancy")));
        assert_eq!(occupancy.bottleneck, Bottleneck::Occupancy, "{}", occupancy.text);
        assert!(occupancy.text.contains("at most 6.2% of the SM's warps"), "{}", occupancy.text);
        assert!(occupancy.text.contains("shared memory per block allows only 2 blocks per SM"), "{}", occupancy.text);
        assert_eq!(
            occupancy.evidence,
            [
                ("launch__occupancy_limit_shared_mem".to_owned(), 2.0),
                (BLOCK_SIZE.to_owned(), 64.0),
                (MAX_WARPS.to_owned(), 64.0),
                (ACHIEVED.to_owned(), 6.24)
            ]
        );
    }

    #[test]
    fn kernels_recorded_with_cudaforges_set_get_the_bottleneck_they_were_written_to_have() {
        // Recorded on an H200 with exactly the default set (`h200/README.md`): neither throughput composite is on
        // the page (the theoretical occupancy is, among the launch statistics ncu always reports).
        let recorded = |kind: &str| {
            let path = format!("{}/tests/fixtures/h200/{kind}.cudaforge.csv", env!("CARGO_MANIFEST_DIR"));
            let launches = parse_raw(&std::fs::read_to_string(path).expect("fixture")).expect("parses");
            assert_eq!(launches.len(), 2, "two profiled launches");
            let launch = launches.into_iter().next().expect("one");
            for name in nsight::CUDAFORGE {
                assert!(launch.metrics.contains_key(name), "{kind}: {name} recorded");
            }
            for composite in [MEMORY, COMPUTE] {
                assert!(!launch.metrics.contains_key(composite), "{kind}: {composite}");
            }
            diagnose(&launch)
        };
        let memory = recorded("memory");
        assert_eq!(memory.bottleneck, Bottleneck::Memory, "{}", memory.text);
        // L2 at 82.4% of its peak is the busiest memory unit (DRAM 74.0%); the SMs issue at 12.8%.
        assert_eq!(memory.evidence[0], ("lts__throughput.avg.pct_of_peak_sustained_active".to_owned(), 82.44));
        assert!(memory.text.contains("memory throughput is at 82.4% of peak while the SMs are at"), "{}", memory.text);

        let compute = recorded("compute");
        assert_eq!(compute.bottleneck, Bottleneck::Compute, "{}", compute.text);
        assert_eq!(names(&compute)[..2], [INSTRUCTIONS, CYCLES]);
        assert!(compute.text.contains("the SMs are at 95.2% of peak"), "{}", compute.text);

        let occupancy = recorded("occupancy");
        assert_eq!(occupancy.bottleneck, Bottleneck::Occupancy, "{}", occupancy.text);
        assert!(occupancy.text.contains("shared memory per block allows only 2 blocks per SM"), "{}", occupancy.text);
        assert!(occupancy.text.contains("at most 6.2% of the SM's warps"), "{}", occupancy.text);
    }

    #[test]
    fn the_derived_theoretical_occupancy_is_the_one_ncu_reports() {
        for kind in ["memory", "compute", "occupancy"] {
            let full = fixture(kind);
            let derived = theoretical(&as_cudaforge(&full)).expect("derived");
            assert_eq!(Some(derived.percent), full.value(THEORETICAL), "{kind}");
        }
    }

    #[test]
    fn cudaforges_figures_are_the_largest_of_their_sources() {
        let metrics = [
            ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 40.0),
            ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 40.0),
            ("lts__throughput.avg.pct_of_peak_sustained_active", 70.0),
            ("l1tex__throughput.avg.pct_of_peak_sustained_active", 65.0),
            ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", 10.0),
            ("sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active", 30.0),
            // Half of 132 SMs' four schedulers' 1000 cycles: 50%.
            (INSTRUCTIONS, 0.5 * 4.0 * 132.0 * 1000.0),
            (SMS, 132.0),
            (CYCLES, 1000.0),
            (ACHIEVED, 90.0),
        ];
        let diagnosis = diagnose(&launch(&metrics));
        assert_eq!(diagnosis.bottleneck, Bottleneck::Memory, "{}", diagnosis.text);
        assert_eq!(
            names(&diagnosis),
            ["lts__throughput.avg.pct_of_peak_sustained_active", INSTRUCTIONS, CYCLES, ACHIEVED]
        );
        assert!(diagnosis.text.contains("at 70.0% of peak while the SMs are at 50.0%"), "{}", diagnosis.text);

        // On a tie the first source in the documented order is the one named.
        let tie = launch(&[metrics[0], metrics[1], metrics[4]]);
        assert_eq!(memory(&tie).expect("memory").from, [metrics[0].0]);
        // Without the issue utilisation's inputs, the pipes alone.
        let pipes = launch(&metrics[4..6]);
        assert_eq!(compute(&pipes), Some(Figure { percent: 30.0, from: vec![metrics[5].0] }));
        // The full set's composite wins over CudaForge's sources when both are there.
        let both = launch(&[metrics[2], (MEMORY, 12.0), metrics[4], (COMPUTE, 11.0)]);
        assert_eq!(memory(&both), Some(Figure { percent: 12.0, from: vec![MEMORY] }));
        assert_eq!(compute(&both), Some(Figure { percent: 11.0, from: vec![COMPUTE] }));
    }

    #[test]
    fn theoretical_occupancy_is_the_fewest_blocks_times_whole_warps_over_the_sms_warps() {
        let limits = [
            ("launch__occupancy_limit_registers", 3.0),
            ("launch__occupancy_limit_shared_mem", 5.0),
            ("launch__occupancy_limit_warps", 16.0),
            ("launch__occupancy_limit_blocks", 32.0),
            (MAX_WARPS, 64.0),
            // 100 threads are four warps, the last one partly filled.
            (BLOCK_SIZE, 100.0),
            ("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 20.0),
            ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", 15.0),
        ];
        let diagnosis = diagnose(&launch(&limits));
        assert_eq!(diagnosis.bottleneck, Bottleneck::Occupancy, "{}", diagnosis.text);
        assert!(diagnosis.text.contains("at most 18.8% of the SM's warps"), "{}", diagnosis.text);
        assert!(diagnosis.text.contains("registers per thread allows only 3 blocks per SM"), "{}", diagnosis.text);
        assert_eq!(names(&diagnosis), ["launch__occupancy_limit_registers", BLOCK_SIZE, MAX_WARPS]);

        // Room for every warp is 100%, however many blocks the limits would allow.
        let roomy = launch(&[("launch__occupancy_limit_blocks", 32.0), (MAX_WARPS, 64.0), (BLOCK_SIZE, 256.0)]);
        assert_eq!(theoretical(&roomy).map(|t| t.percent), Some(100.0));
        // Without the block size there is no theoretical occupancy to judge by.
        assert_eq!(theoretical(&launch(&limits[..5])), None);
    }

    #[test]
    fn a_launch_with_nothing_busy_and_room_for_warps_is_latency_bound_on_its_largest_stall() {
        let ratio = |reason: &str| format!("smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio");
        let (long, selected, barrier) = (ratio("long_scoreboard"), ratio("selected"), ratio("barrier"));
        let full = launch(&[
            (MEMORY, 20.0),
            (COMPUTE, 10.0),
            (THEORETICAL, 100.0),
            (&long, 30.0),
            (&selected, 99.0),
            (&barrier, 2.0),
        ]);
        let diagnosis = diagnose(&full);
        assert_eq!(diagnosis.bottleneck, Bottleneck::Latency);
        assert!(diagnosis.text.contains("long_scoreboard (30.0 cycles) and barrier"), "{}", diagnosis.text);
        assert_eq!(names(&diagnosis), [MEMORY, COMPUTE, long.as_str()]);

        let bare = launch(&[]);
        let diagnosis = diagnose(&bare);
        assert_eq!(diagnosis.bottleneck, Bottleneck::Undetermined);
        assert!(diagnosis.text.contains("not collected"), "{}", diagnosis.text);
    }

    #[test]
    fn cudaforges_stalls_are_read_as_percent_of_active_warps_and_the_full_sets_preferred() {
        let pct = |reason: &str| format!("smsp__warp_issue_stalled_{reason}_per_warp_active.pct");
        let (long, lg, selected, not_selected) =
            (pct("long_scoreboard"), pct("lg_throttle"), pct("selected"), pct("not_selected"));
        let mut metrics = vec![
            ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 20.0),
            ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", 10.0),
            ("launch__occupancy_limit_blocks", 32.0),
            (BLOCK_SIZE, 256.0),
            (MAX_WARPS, 64.0),
            (&lg, 25.0),
            (&selected, 90.0),
            (&not_selected, 80.0),
            (&long, 40.0),
        ];
        let diagnosis = diagnose(&launch(&metrics));
        assert_eq!(diagnosis.bottleneck, Bottleneck::Latency, "{}", diagnosis.text);
        assert!(
            diagnosis.text.contains("long_scoreboard (40.0% of active warps) and lg_throttle (25.0% of active warps)"),
            "{}",
            diagnosis.text
        );
        assert_eq!(
            names(&diagnosis),
            [
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
                long.as_str()
            ]
        );

        let wait = "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio";
        metrics.push((wait, 3.0));
        let diagnosis = diagnose(&launch(&metrics));
        assert!(diagnosis.text.contains("warps wait mostly on wait (3.0 cycles)."), "{}", diagnosis.text);
        assert_eq!(names(&diagnosis)[2], wait);
    }

    #[test]
    fn stall_reasons_are_read_from_either_form_and_selection_is_not_a_stall() {
        assert_eq!(
            stall_reason("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"),
            Some("long_scoreboard")
        );
        assert_eq!(stall_reason("smsp__warp_issue_stalled_lg_throttle_per_warp_active.pct"), Some("lg_throttle"));
        for not_a_stall in [
            "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
            "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio",
            "smsp__warp_issue_stalled_selected_per_warp_active.pct",
            "smsp__warp_issue_stalled_not_selected_per_warp_active.pct",
            "smsp__warp_issue_stalled_barrier_per_issue_active.ratio",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        ] {
            assert_eq!(stall_reason(not_a_stall), None, "{not_a_stall}");
        }
    }

    #[test]
    fn without_either_form_of_a_throughput_the_diagnosis_names_what_is_missing() {
        let only_memory = launch(&[("lts__throughput.avg.pct_of_peak_sustained_active", 90.0)]);
        let diagnosis = diagnose(&only_memory);
        assert_eq!(diagnosis.bottleneck, Bottleneck::Undetermined);
        assert!(diagnosis.evidence.is_empty());
        assert!(diagnosis.text.starts_with("undetermined: compute throughput (sm__throughput"), "{}", diagnosis.text);
        assert!(
            diagnosis.text.contains("sm__inst_executed.sum with sm__cycles_active.avg) not collected"),
            "{}",
            diagnosis.text
        );
        assert!(!diagnosis.text.contains("memory throughput"), "{}", diagnosis.text);

        let neither = diagnose(&launch(&[]));
        assert!(neither.text.contains("memory throughput (") && neither.text.contains(" and compute throughput ("));
    }
}
