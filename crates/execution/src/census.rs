//! The kernel census: which kernels ran in each mode, which are the candidate's own, the profiling ratio, and the
//! checks that need it. The harness only records raw profiler events; everything here is computed by the
//! evaluator.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};

use kforge_static_checks::{Category, Finding, Policy};
use serde::Deserialize;

/// One mode's raw records, as the harness reports them.
#[derive(Debug, Clone, Deserialize)]
pub struct ModeRecords {
    /// `train/no_grad`, `eval/no_grad`, `train/grad` or `eval/grad`; the first is the measured mode.
    pub mode: String,
    pub calls: u32,
    /// CPU only: when each profiled `forward` call started and how long it took.
    #[serde(default)]
    pub call_spans: Vec<Span>,
    pub records: Vec<Record>,
    /// How many functions the candidate's loaded extensions export (0: none loaded), and how often the recorded
    /// calls of this mode called them; both absent when the harness could not count every call (an extension
    /// exporting classes, or registering torch operators).
    #[serde(default)]
    pub extension_functions: Option<u64>,
    #[serde(default)]
    pub extension_calls: Option<u64>,
}

impl ModeRecords {
    /// Whether the candidate's compiled extensions were loaded but none of their functions called in this mode.
    fn extension_uncalled(&self) -> bool {
        self.extension_functions.is_some_and(|f| f > 0) && self.extension_calls == Some(0)
    }

    /// Whether no compiled code of the candidate's can have run in this mode: nothing loaded, or nothing called.
    fn extension_idle(&self) -> bool {
        self.extension_functions == Some(0) || self.extension_calls == Some(0)
    }

    /// CPU only: per call, the microseconds `forward` spent outside torch operators and inside them (the operators
    /// a call made start within its span).
    fn cpu_split(&self) -> Vec<CallSplit> {
        let mut operators = vec![0.0; self.call_spans.len()];
        for record in &self.records {
            let call = self
                .call_spans
                .iter()
                .position(|s| (s.start_us..s.start_us + s.duration_us).contains(&record.start_us));
            if let Some(call) = call {
                operators[call] += record.duration_us;
            }
        }
        self.call_spans
            .iter()
            .zip(operators)
            .map(|(span, operators_us)| CallSplit {
                outside_us: (span.duration_us - operators_us).max(0.0),
                operators_us,
            })
            .collect()
    }
}

/// When a CPU census call started and how long it took.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Span {
    pub start_us: f64,
    pub duration_us: f64,
}

/// One CPU census call's time, outside torch operators and inside them.
#[derive(Debug, Clone, Copy)]
struct CallSplit {
    outside_us: f64,
    operators_us: f64,
}

impl CallSplit {
    /// Each part at its least over `calls`. Being descheduled only adds time, and it adds it to whichever part was
    /// running: on a loaded host one stall of a few milliseconds outside the operators made a lazy candidate's
    /// 0.05-0.2 of own time read 0.77. Each part's least is the call least disturbed there. `None` without calls.
    fn least(calls: &[CallSplit]) -> Option<CallSplit> {
        let least = |part: fn(&CallSplit) -> f64| calls.iter().map(part).reduce(f64::min);
        Some(CallSplit { outside_us: least(|c| c.outside_us)?, operators_us: least(|c| c.operators_us)? })
    }
}

/// One device activity (GPU) or one torch operator called by `forward` (CPU).
#[derive(Debug, Clone, Deserialize)]
pub struct Record {
    pub name: String,
    pub start_us: f64,
    pub duration_us: f64,
}

/// One kernel that ran in a census mode (on a CPU, one torch operator, or the time outside them): how often and for
/// how long, and whether it is the candidate's own.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelRecord {
    pub name: String,
    pub own: bool,
    pub launches: u64,
    pub total_ms: f64,
    /// The census mode it ran in (`train/no_grad`, ...).
    pub mode: String,
}

/// What the census found.
#[derive(Debug, Default)]
pub struct Census {
    pub kernels: Vec<KernelRecord>,
    /// Own time / all kernel time in the measured mode (on a CPU, each part at its least over the calls:
    /// [`CallSplit::least`]).
    pub profiling_ratio: f64,
    pub findings: Vec<Finding>,
}

/// Name of the CPU census's record for the time `forward` spent outside torch operators.
pub const CPU_OWN_RECORD: &str = "candidate code (outside torch operators)";

/// Torch's and the CUDA libraries' namespaces: a kernel there is never the candidate's, whatever its base name.
const LIBRARY_NAMESPACES: &[&str] = &["at::", "c10::", "cub::", "thrust::", "cutlass::", "cublas", "cudnn", "flash::"];

/// Name of that record when the candidate compiles no code of its own: its time is Python's, not a kernel's.
pub const CPU_PYTHON_RECORD: &str = "python (outside torch operators)";

/// The candidate's own kernels by function name, and which part of them had to be read from its source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnKernels {
    pub names: Vec<String>,
    /// Why a part came from the source rather than from what was built or run (empty: none did).
    pub from_source: Vec<String>,
}

/// The candidate's own kernels, one rule for the evaluator and the profiler: the kernels compiled into its
/// extensions (`compiled`, listed from the build's device code; `None` where it builds no extension, and then
/// the `__global__` functions of its source, which no extension built), and the Triton kernels its code made
/// (`jit`, reported by the run that made them). Where either cannot be read (a build whose device code could not be
/// listed, a run that did not report), that part is read from the source, and `from_source` says why.
pub fn own_kernels(source: &str, compiled: Option<&Result<Vec<String>, String>>, jit: Option<&[String]>) -> OwnKernels {
    let mut own = OwnKernels::default();
    match compiled {
        Some(Ok(names)) => own.names.extend(names.iter().cloned()),
        Some(Err(why)) => {
            own.from_source.push(format!("the build's kernels: {why}"));
            own.names.extend(kforge_static_checks::cuda_kernel_names(source));
        }
        None => own.names.extend(kforge_static_checks::cuda_kernel_names(source)),
    }
    match jit {
        Some(names) => own.names.extend(names.iter().cloned()),
        None => {
            let named = kforge_static_checks::triton_kernel_names(source);
            if !named.is_empty() {
                own.from_source.push("the Triton kernels: the run did not report them".to_owned());
            }
            own.names.extend(named);
        }
    }
    own.names.sort();
    own.names.dedup();
    own
}

/// What the census knows of the candidate's own code.
#[derive(Debug, Clone, Copy)]
pub struct Candidate<'a> {
    /// Kernels it defines (see [`own_kernels`]).
    pub kernels: &'a [String],
    /// Whether it compiles an extension (on a CPU, the only own code there is).
    pub compiles: bool,
    /// Its timed median, when it was timed.
    pub median_ms: Option<f64>,
    /// The policy it is judged by: whether own code that never runs is a hack (every shipped policy) rather than a
    /// notice, and what a profiling ratio below the policy's threshold is.
    pub policy: Policy,
}

/// Analyses the census of `candidate`; `gpu` says whether the records are device activity or CPU operators.
pub fn analyse(modes: &[ModeRecords], candidate: Candidate<'_>, gpu: bool) -> Census {
    let own_names: BTreeSet<&str> = candidate.kernels.iter().map(String::as_str).collect();
    let is_own = |name: &str| if gpu { is_own_kernel(name, &own_names) } else { name == CPU_OWN_RECORD };
    let mut census = Census::default();
    // Modes in which none of the candidate's own kernels ran (GPU), and in which no function of its compiled
    // extensions was called (both backends, where the harness could count them).
    let (mut unlaunched, mut uncalled) = (Vec::new(), Vec::new());
    let mut own_by_mode: Vec<(&str, BTreeSet<String>)> = Vec::new();
    for (index, mode) in modes.iter().enumerate() {
        let tally = Tally::new(mode, candidate.compiles, gpu);
        let own: BTreeSet<String> = tally
            .by_name
            .iter()
            .filter(|(name, (_, total))| is_own(name) && (gpu || *total > 0.0))
            .map(|(name, _)| name.clone())
            .collect();
        if index == 0 {
            let (ratio, findings) = measured_mode(mode, &tally, candidate, gpu, is_own);
            census.profiling_ratio = ratio;
            census.findings.extend(findings);
        }
        if gpu && !own_names.is_empty() && own.is_empty() {
            unlaunched.push(mode.mode.as_str());
        }
        if mode.extension_uncalled() {
            uncalled.push(mode.mode.as_str());
        }
        own_by_mode.push((mode.mode.as_str(), own));
        census.kernels.extend(tally.by_name.into_iter().map(|(name, (launches, total_ms))| KernelRecord {
            own: is_own(&name),
            name,
            launches,
            total_ms,
            mode: mode.mode.clone(),
        }));
    }
    census.findings.extend(decoy(&own_names, &unlaunched, &uncalled, candidate.policy));
    if gpu {
        census.findings.extend(mode_dependent(&own_by_mode));
    }
    census
}

/// One mode's records by name: how many and their milliseconds, with the CPU's own record (the time `forward`
/// spent outside torch operators) among them.
struct Tally {
    by_name: BTreeMap<String, (u64, f64)>,
    /// CPU only: each call's time outside torch operators and inside them.
    splits: Vec<CallSplit>,
    /// Whether the candidate compiles an extension and the mode called it (CPU: only then is the time outside
    /// torch operators the extension's).
    extension_ran: bool,
}

impl Tally {
    fn new(mode: &ModeRecords, compiles: bool, gpu: bool) -> Self {
        let extension_ran = compiles && !mode.extension_idle();
        let splits = if gpu { Vec::new() } else { mode.cpu_split() };
        let mut by_name: BTreeMap<String, (u64, f64)> = BTreeMap::new();
        let mut add = |name: &str, duration_us: f64| match by_name.get_mut(name) {
            Some((count, total_ms)) => {
                *count += 1;
                *total_ms += duration_us / 1e3;
            }
            None => {
                by_name.insert(name.to_owned(), (1, duration_us / 1e3));
            }
        };
        for record in &mode.records {
            add(&record.name, record.duration_us);
        }
        if !gpu {
            let name = if extension_ran { CPU_OWN_RECORD } else { CPU_PYTHON_RECORD };
            add(name, splits.iter().map(|c| c.outside_us).sum());
        }
        Self { by_name, splits, extension_ran }
    }
}

/// The measured mode's profiling ratio, and what it shows: too little of the work the candidate's own, and on a
/// GPU, work the timer did not see and calls that wait for the host.
fn measured_mode(
    mode: &ModeRecords,
    tally: &Tally,
    candidate: Candidate<'_>,
    gpu: bool,
    is_own: impl Fn(&str) -> bool,
) -> (f64, Vec<Finding>) {
    let policy = candidate.policy;
    let mut findings = Vec::new();
    let (own, total) = match CallSplit::least(&tally.splits) {
        _ if gpu => {
            let total: f64 = tally.by_name.values().map(|(_, ms)| ms).sum();
            (tally.by_name.iter().filter(|(name, _)| is_own(name)).map(|(_, (_, ms))| ms).sum(), total)
        }
        Some(least) => {
            (if tally.extension_ran { least.outside_us } else { 0.0 }, least.outside_us + least.operators_us)
        }
        None => (0.0, 0.0),
    };
    // (An empty sum is -0.0: no own time is a plain 0.)
    let ratio = if total > 0.0 && own > 0.0 { (own / total).min(1.0) } else { 0.0 };
    let threshold = policy.min_profiling_ratio();
    if total > 0.0 && ratio < threshold {
        findings.push(low_ratio(ratio, threshold, &mode.mode, policy, gpu));
    }
    if gpu {
        findings.extend(candidate.median_ms.and_then(|median| untimed_work(mode, median)));
        findings.extend(host_waits(&mode.records, mode.calls, &mode.mode));
    }
    (ratio, findings)
}

/// The hack of device work outside the timed region: every kernel of an honest call runs between the timer's two
/// events, so the device cannot be busy for much longer per call than the timed `median` (the slack covers the
/// census's lack of an L2 flush and clock changes). Work on another stream or thread, or deferred, is caught here.
fn untimed_work(mode: &ModeRecords, median: f64) -> Option<Finding> {
    let busy_ms = union_us(&mode.records) / 1e3 / f64::from(mode.calls.max(1));
    (busy_ms > 1.5 * median + 0.02).then(|| {
        hack(
            "timing.untimed_work",
            format!(
                "the device was busy {busy_ms:.4} ms per call, but the timer measured a median of {median:.4} ms: \
                 work escaped the timed region (another stream, a thread, or deferred)"
            ),
        )
    })
}

/// A decoy, on either backend: code of the candidate's own that it compiles but does not run (`own` kernels that
/// did not launch in the `unlaunched` modes; an extension none of whose functions were called in the `uncalled`
/// ones), while other code does the work. One code for both (the GPU's kernels, the CPU's extension calls), so that
/// the dashboards count one class of hack whatever the backend.
fn decoy(own: &BTreeSet<&str>, unlaunched: &[&str], uncalled: &[&str], policy: Policy) -> Option<Finding> {
    let mut decoys = Vec::new();
    if !unlaunched.is_empty() {
        decoys.push(format!(
            "the candidate defines {} but none of them ran in {}",
            own.iter().copied().collect::<Vec<_>>().join(", "),
            unlaunched.join(", ")
        ));
    }
    if !uncalled.is_empty() {
        decoys.push(format!(
            "the candidate compiles an extension but forward called none of its functions in {}",
            uncalled.join(", ")
        ));
    }
    (!decoys.is_empty()).then(|| Finding {
        code: "runtime.own_kernel_not_launched",
        message: format!("{}: the work was done by other code", decoys.join("; ")),
        line: 0,
        category: if policy.unlaunched_kernels_are_hacks() { Category::Hack } else { Category::Notice },
    })
}

/// The hack of own kernels that differ between the measured mode (the first) and the others: what runs depends on
/// train/eval or grad mode (GPU only).
fn mode_dependent(own_by_mode: &[(&str, BTreeSet<String>)]) -> Option<Finding> {
    let ((measured, own), others) = own_by_mode.split_first()?;
    let differing: Vec<&str> = others.iter().filter(|(_, other)| other != own).map(|(mode, _)| *mode).collect();
    (!differing.is_empty()).then(|| {
        hack(
            "runtime.mode_dependent_kernels",
            format!(
                "the candidate's own kernels differ between {measured} ({}) and {}: what runs depends on train/eval \
                 or grad mode",
                own.iter().cloned().collect::<Vec<_>>().join(", "),
                differing.join(", ")
            ),
        )
    })
}

/// The notice for a call that makes the host wait for the device mid-call: a copy between host and device, which
/// torch makes blocking unless asked not to (`float()`, `.item()` or `.cpu()` of a device tensor, `torch.tensor(...)`
/// onto the device). The device runs dry while the host wakes and launches the rest, and that cost comes in two
/// levels that switch within a process: such a call has no single time to within a few percent, under kforge's timer
/// or do_bench (bench/results/timing-host-sync/2026-11-26-*). Named so that a reward built on its speedup knows.
/// Approximate: a copy asked to be asynchronous (`non_blocking=True`) is named too, and a bare
/// `torch.cuda.synchronize()`, which makes no copy, is not seen.
fn host_waits(records: &[Record], calls: u32, mode: &str) -> Option<Finding> {
    let mut copies: BTreeMap<&str, u64> = BTreeMap::new();
    for record in records.iter().filter(|r| r.name.starts_with("Memcpy DtoH") || r.name.starts_with("Memcpy HtoD")) {
        *copies.entry(record.name.as_str()).or_default() += 1;
    }
    if copies.is_empty() {
        return None;
    }
    let count: u64 = copies.values().sum();
    let names: Vec<&str> = copies.into_keys().collect();
    Some(Finding {
        code: "timing.host_synchronized",
        message: format!(
            "{count} copies between host and device in {calls} calls in {mode} ({}): the host waits for the device \
             mid-call, so the timing includes its wake-up and relaunch, which vary by several percent between \
             processes",
            names.join(", ")
        ),
        line: 0,
        category: Category::Notice,
    })
}

/// The lazy-work finding: the candidate's own code did less than `threshold` of the measured mode's work. A notice
/// where the policy lets torch and libraries do the work (the dashboards count it), a hack where it does not.
fn low_ratio(ratio: f64, threshold: f64, mode: &str, policy: Policy, gpu: bool) -> Finding {
    let measure = if gpu { "device time" } else { "time in forward (CPU census)" };
    let allowed = if policy.torch_compute_allowed() {
        format!("allowed by {}, and named so that it is counted", policy.id())
    } else {
        format!("{} requires the candidate's own code to do the work", policy.id())
    };
    Finding {
        code: "runtime.low_profiling_ratio",
        message: format!(
            "the candidate's own code took {ratio:.3} of the {measure} in {mode}, below {threshold}: torch or \
             library code did most of the work ({allowed})"
        ),
        line: 0,
        category: if policy.torch_compute_allowed() { Category::Notice } else { Category::Hack },
    }
}

fn hack(code: &'static str, message: String) -> Finding {
    Finding { code, message, line: 0, category: Category::Hack }
}

/// Whether a kernel name from the profiler is one of `own` (by its base name, outside library namespaces).
///
/// Profiler names look like `void ns::scale_kernel<float>(float const*, float*, int)` for CUDA and
/// `fused_kernel` for Triton.
pub fn is_own_kernel(name: &str, own: &BTreeSet<&str>) -> bool {
    let name = name.trim().strip_prefix("void ").unwrap_or(name.trim());
    let name = name.split(['(', '<']).next().unwrap_or("");
    let (namespace, base) = name.rsplit_once("::").map_or(("", name), |(ns, base)| (ns, base));
    let namespace = format!("{namespace}::");
    own.contains(base) && !LIBRARY_NAMESPACES.iter().any(|library| namespace.starts_with(library))
}

/// Total time covered by at least one record, in microseconds.
fn union_us(records: &[Record]) -> f64 {
    let mut spans: Vec<(f64, f64)> = records.iter().map(|r| (r.start_us, r.start_us + r.duration_us)).collect();
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut current: Option<(f64, f64)> = None;
    for (start, end) in spans {
        current = match current {
            Some((s, e)) if start <= e => Some((s, e.max(end))),
            Some((s, e)) => {
                total += e - s;
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    total + current.map_or(0.0, |(s, e)| e - s)
}

/// The raw census records of the latest candidates, by the build and the task they ran (the artifact cache's key,
/// which names the candidate's source, backend, versions and GPU architecture, and the task's key): a profile of a
/// candidate just evaluated or profiled reads its census here instead of running the candidate under torch's
/// profiler again. Records are kept raw, so each reader analyses them by its own policy.
#[derive(Debug)]
pub struct Recent {
    capacity: usize,
    entries: Mutex<VecDeque<RecentEntry>>,
}

/// (artifact key, task key) and the census records.
type RecentEntry = ((String, String), Arc<Records>);

/// A run's raw census records, and the Triton kernels it reported making (part of what [`own_kernels`] reads).
#[derive(Debug)]
pub struct Records {
    pub modes: Vec<ModeRecords>,
    pub jit_kernels: Option<Vec<String>>,
}

impl Recent {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, entries: Mutex::default() }
    }

    /// The records of `artifact` on `task`, when they are among the latest.
    pub fn get(&self, artifact: &str, task: &str) -> Option<Arc<Records>> {
        let mut entries = self.entries.lock().expect("never poisoned");
        let index = entries.iter().position(|((a, t), _)| a == artifact && t == task)?;
        // The one read last is the last evicted.
        let entry = entries.remove(index).expect("found above");
        let records = entry.1.clone();
        entries.push_back(entry);
        Some(records)
    }

    /// Keeps `records` of `artifact` on `task`, the oldest entry leaving past the capacity.
    pub fn put(&self, artifact: &str, task: &str, records: Arc<Records>) {
        if self.capacity == 0 || records.modes.is_empty() {
            return;
        }
        let mut entries = self.entries.lock().expect("never poisoned");
        entries.retain(|((a, t), _)| !(a == artifact && t == task));
        if entries.len() == self.capacity {
            entries.pop_front();
        }
        entries.push_back(((artifact.to_owned(), task.to_owned()), records));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, start_us: f64, duration_us: f64) -> Record {
        Record { name: name.into(), start_us, duration_us }
    }

    fn span(start_us: f64, duration_us: f64) -> Span {
        Span { start_us, duration_us }
    }

    fn mode(mode: &str, records: Vec<Record>) -> ModeRecords {
        ModeRecords {
            mode: mode.into(),
            calls: 2,
            call_spans: Vec::new(),
            records,
            extension_functions: None,
            extension_calls: None,
        }
    }

    fn gpu_candidate(kernels: &[String], median_ms: Option<f64>, policy: Policy) -> Candidate<'_> {
        Candidate { kernels, compiles: true, median_ms, policy }
    }

    fn codes(census: &Census) -> Vec<&'static str> {
        census.findings.iter().map(|f| f.code).collect()
    }

    fn category(census: &Census, code: &str) -> Option<Category> {
        census.findings.iter().find(|f| f.code == code).map(|f| f.category)
    }

    const OWN: &str = "void scale_kernel<float>(float const*, float*, int)";
    const TORCH: &str = "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>(int)";

    #[test]
    fn own_kernels_are_read_from_the_build_and_the_run_and_from_the_source_only_where_those_cannot_say() {
        let source =
            "cuda = '__global__ void from_source(float* x) {}'\n@triton.jit\ndef jit_in_source(x):\n    pass\n";
        let built: Result<Vec<String>, String> = Ok(vec!["from_build".into()]);
        let made = ["made_at_run".to_owned()];
        let both = own_kernels(source, Some(&built), Some(&made));
        assert_eq!(both, OwnKernels { names: vec!["from_build".into(), "made_at_run".into()], from_source: vec![] });
        // A build whose device code could not be listed, a run that did not report: the source stands in, saying so.
        let unread: Result<Vec<String>, String> = Err("cuobjdump not found".into());
        let guessed = own_kernels(source, Some(&unread), None);
        assert_eq!(guessed.names, ["from_source", "jit_in_source"]);
        assert_eq!(guessed.from_source.len(), 2, "{:?}", guessed.from_source);
        assert!(guessed.from_source[0].contains("cuobjdump not found"), "{:?}", guessed.from_source);
        // No extension built: its CUDA source strings were built by nothing the build lists, and are read as before.
        let unbuilt = own_kernels(source, None, Some(&[]));
        assert_eq!(unbuilt, OwnKernels { names: vec!["from_source".into()], from_source: vec![] });
        // A build that compiled no kernel and a run that made none: nothing is the candidate's own.
        let none = own_kernels(source, Some(&Ok(vec![])), Some(&[]));
        assert!(none.names.is_empty() && none.from_source.is_empty(), "{none:?}");
    }

    #[test]
    fn own_kernels_are_recognised_by_base_name_outside_library_namespaces() {
        let own = BTreeSet::from(["scale_kernel", "vectorized_elementwise_kernel", "fused"]);
        assert!(is_own_kernel(OWN, &own));
        assert!(is_own_kernel("fused", &own));
        assert!(is_own_kernel("mine::scale_kernel(float*)", &own));
        assert!(!is_own_kernel(TORCH, &own), "a torch kernel stays torch's even when the candidate reuses its name");
        assert!(!is_own_kernel("other_kernel(float*)", &own));
    }

    #[test]
    fn profiling_ratio_is_own_time_over_all_kernel_time_in_the_measured_mode() {
        let records = vec![record(OWN, 0.0, 30.0), record(TORCH, 40.0, 10.0), record(OWN, 60.0, 30.0)];
        let modes: Vec<ModeRecords> =
            ["train/no_grad", "eval/no_grad"].iter().map(|m| mode(m, records.clone())).collect();
        let own = ["scale_kernel".to_owned()];
        for policy in Policy::ALL {
            let census = analyse(&modes, gpu_candidate(&own, Some(0.05), policy), true);
            assert!((census.profiling_ratio - 60.0 / 70.0).abs() < 1e-12, "{}", census.profiling_ratio);
            assert!(codes(&census).is_empty(), "{}: {:?}", policy.id(), census.findings);
            let own = census.kernels.iter().find(|k| k.own && k.mode == "train/no_grad").expect("own kernel listed");
            assert_eq!((own.launches, own.total_ms), (2, 0.06));
        }
    }

    #[test]
    fn work_the_timer_did_not_see_is_a_hack() {
        // 2 calls keeping the device busy 1 ms each, while the timer claimed 0.1 ms.
        let records = vec![record(OWN, 0.0, 1000.0), record(OWN, 1000.0, 1000.0)];
        let own = ["scale_kernel".to_owned()];
        let policy = Policy::PERMISSIVE;
        let census = analyse(&[mode("train/no_grad", records.clone())], gpu_candidate(&own, Some(0.1), policy), true);
        assert_eq!(codes(&census), vec!["timing.untimed_work"]);
        let honest = analyse(&[mode("train/no_grad", records)], gpu_candidate(&own, Some(1.0), policy), true);
        assert!(codes(&honest).is_empty(), "{:?}", honest.findings);
    }

    #[test]
    fn a_call_that_copies_to_or_blocks_on_the_host_is_named_for_its_timing() {
        // KernelBench level2/68 with `float()` of a CUDA parameter in forward, as the H200's census recorded it.
        let float = "Memcpy DtoH (Device -> Pinned)";
        let records =
            vec![record(OWN, 0.0, 30.0), record(float, 31.0, 1.0), record(OWN, 60.0, 30.0), record(float, 91.0, 1.0)];
        let own = ["scale_kernel".to_owned()];
        for policy in Policy::ALL {
            let census =
                analyse(&[mode("train/no_grad", records.clone())], gpu_candidate(&own, Some(0.05), policy), true);
            assert_eq!(codes(&census), vec!["timing.host_synchronized"], "{}", policy.id());
            assert_eq!(category(&census, "timing.host_synchronized"), Some(Category::Notice));
            let message = &census.findings[0].message;
            assert!(message.starts_with("2 copies between host and device in 2 calls") && message.contains(float));
        }
        // A copy from host memory onto the device waits too (torch makes it blocking); a copy on the device does not,
        // nor does a copy in a mode that is not timed.
        let pageable = vec![record(OWN, 0.0, 30.0), record("Memcpy HtoD (Pageable -> Device)", 31.0, 1.0)];
        let census =
            analyse(&[mode("train/no_grad", pageable)], gpu_candidate(&own, Some(0.05), Policy::PERMISSIVE), true);
        assert_eq!(codes(&census), vec!["timing.host_synchronized"]);
        assert!(census.findings[0].message.starts_with("1 copies between host and device in 2 calls"));
        let quiet = vec![record(OWN, 0.0, 30.0), record("Memcpy DtoD (Device -> Device)", 31.0, 1.0)];
        let modes = [mode("train/no_grad", quiet), mode("eval/no_grad", records)];
        let census = analyse(&modes, gpu_candidate(&own, Some(0.05), Policy::PERMISSIVE), true);
        assert!(codes(&census).is_empty(), "{:?}", census.findings);
    }

    #[test]
    fn defined_but_never_launched_and_mode_dependent_kernels() {
        let torch_only = vec![record(TORCH, 0.0, 10.0)];
        let own = ["scale_kernel".to_owned()];
        // Every shipped policy makes a decoy kernel a hack; a policy may relax it to a notice.
        for policy in Policy::ALL {
            assert!(policy.unlaunched_kernels_are_hacks(), "{}", policy.id());
            let unused = analyse(&[mode("train/no_grad", torch_only.clone())], gpu_candidate(&own, None, policy), true);
            assert_eq!(codes(&unused), vec!["runtime.low_profiling_ratio", "runtime.own_kernel_not_launched"]);
            assert_eq!(category(&unused, "runtime.own_kernel_not_launched"), Some(Category::Hack));
            assert_eq!(unused.profiling_ratio, 0.0);
        }
        let relaxed = Policy::PERMISSIVE.relaxing_unlaunched_kernels();
        let notice = analyse(&[mode("train/no_grad", torch_only.clone())], gpu_candidate(&own, None, relaxed), true);
        assert_eq!(category(&notice, "runtime.own_kernel_not_launched"), Some(Category::Notice));

        // Own kernels in the measured mode but none in another: not launched there, and mode-dependent.
        let modes = vec![mode("train/no_grad", vec![record(OWN, 0.0, 10.0)]), mode("train/grad", torch_only)];
        let switching = analyse(&modes, gpu_candidate(&own, None, Policy::KEVIN_STRICT), true);
        assert_eq!(codes(&switching), vec!["runtime.own_kernel_not_launched", "runtime.mode_dependent_kernels"]);
        assert!(switching.findings[0].message.contains("train/grad"), "{}", switching.findings[0].message);
    }

    /// A CPU mode of two calls taking `call_us` in all, `torch_us` of it in torch operators (half in each call).
    fn cpu_mode(name: &str, call_us: f64, torch_us: f64, extension_calls: Option<u64>) -> ModeRecords {
        let half = call_us / 2.0;
        let records = vec![record("aten::mul", 0.0, torch_us / 2.0), record("aten::add", half, torch_us / 2.0)];
        ModeRecords {
            mode: name.into(),
            calls: 2,
            call_spans: vec![span(0.0, half), span(half, half)],
            records,
            extension_functions: extension_calls.map(|_| 1),
            extension_calls,
        }
    }

    fn cpu_candidate(compiles: bool, policy: Policy) -> Candidate<'static> {
        Candidate { kernels: &[], compiles, median_ms: Some(0.05), policy }
    }

    #[test]
    fn on_a_cpu_the_time_outside_torch_operators_is_the_candidates() {
        let modes = [ModeRecords {
            mode: "train/no_grad".into(),
            calls: 2,
            call_spans: vec![span(0.0, 50.0), span(50.0, 50.0)],
            records: vec![record("aten::empty_like", 0.0, 5.0), record("aten::empty_like", 50.0, 5.0)],
            extension_functions: Some(1),
            extension_calls: Some(2),
        }];
        let compiled = cpu_candidate(true, Policy::KEVIN_STRICT);
        let census = analyse(&modes, compiled, false);
        assert!((census.profiling_ratio - 0.9).abs() < 1e-12, "{}", census.profiling_ratio);
        let own: Vec<_> = census.kernels.iter().filter(|k| k.own).map(|k| k.name.as_str()).collect();
        assert_eq!(own, vec![CPU_OWN_RECORD]);
        assert!(codes(&census).is_empty(), "{:?}", census.findings);
        // Without compiled code, time outside torch is Python's: nothing is the candidate's own kernel.
        let python_only = analyse(&modes, Candidate { compiles: false, ..compiled }, false);
        assert_eq!(python_only.profiling_ratio, 0.0);
        assert!(python_only.kernels.iter().all(|k| !k.own));
    }

    #[test]
    fn on_a_cpu_a_stall_in_one_call_does_not_move_the_ratio() {
        // An extension calling ATen's matmul: 8 of each 10 us are the operator's. One call stalls outside the
        // operators (the host descheduled the process there), one inside: each part is read where it did not stall.
        let stalled = |outside_stall: f64, operator_stall: f64| ModeRecords {
            mode: "train/no_grad".into(),
            calls: 2,
            call_spans: vec![span(0.0, 10.0 + outside_stall), span(5000.0, 10.0 + operator_stall)],
            records: vec![record("aten::matmul", 1.0, 8.0), record("aten::matmul", 5001.0, 8.0 + operator_stall)],
            extension_functions: Some(1),
            extension_calls: Some(2),
        };
        for (outside_stall, operator_stall) in [(0.0, 0.0), (4000.0, 0.0), (0.0, 4000.0), (4000.0, 4000.0)] {
            let census =
                analyse(&[stalled(outside_stall, operator_stall)], cpu_candidate(true, Policy::PERMISSIVE), false);
            assert!(
                (census.profiling_ratio - 0.2).abs() < 1e-12,
                "{outside_stall}, {operator_stall}: {}",
                census.profiling_ratio
            );
            assert_eq!(codes(&census), vec!["runtime.low_profiling_ratio"]);
            // The reported times stay what was measured.
            let own = census.kernels.iter().find(|k| k.own).expect("the own record");
            assert!((own.total_ms - (4.0 + outside_stall) / 1e3).abs() < 1e-12, "{}", own.total_ms);
        }
    }

    #[test]
    fn an_extension_compiled_and_never_called_is_a_decoy_under_every_policy() {
        // The lazy candidate: its extension is never called, `a * alpha + b` runs in torch operators, and the rest
        // of the call is Python. Without the call count the Python time would pass for the extension's.
        let modes: Vec<ModeRecords> =
            CENSUS_MODE_NAMES.iter().map(|name| cpu_mode(name, 100.0, 6.0, Some(0))).collect();
        for policy in Policy::ALL {
            let census = analyse(&modes, cpu_candidate(true, policy), false);
            assert_eq!(census.profiling_ratio, 0.0, "{}", policy.id());
            assert_eq!(category(&census, "runtime.own_kernel_not_launched"), Some(Category::Hack), "{}", policy.id());
            let message = &census
                .findings
                .iter()
                .find(|f| f.code == "runtime.own_kernel_not_launched")
                .expect("the decoy finding")
                .message;
            assert!(message.contains("extension") && message.contains("eval/grad"), "{message}");
            assert!(census.kernels.iter().all(|k| !k.own), "{:?}", census.kernels);
        }
        // Called in the measured mode only: a decoy in the other modes, which the finding names.
        let mut partly = modes.clone();
        partly[0].extension_calls = Some(2);
        let census = analyse(&partly, cpu_candidate(true, Policy::PERMISSIVE), false);
        let finding = census.findings.iter().find(|f| f.code == "runtime.own_kernel_not_launched").expect("a decoy");
        assert!(!finding.message.contains("train/no_grad") && finding.message.contains("eval/no_grad"), "{finding:?}");
        // Nothing loaded (a build the candidate caught, falling back to torch): no decoy, but the time outside
        // torch is Python's, and the ratio names the lazy work.
        let mut unloaded = modes.clone();
        unloaded.iter_mut().for_each(|m| m.extension_functions = Some(0));
        let census = analyse(&unloaded, cpu_candidate(true, Policy::PERMISSIVE), false);
        assert_eq!(codes(&census), vec!["runtime.low_profiling_ratio"]);
        assert_eq!(census.profiling_ratio, 0.0);
        // Called in every mode, or not countable (an extension exporting classes): no decoy finding.
        for calls in [Some(2), None] {
            let honest: Vec<ModeRecords> =
                CENSUS_MODE_NAMES.iter().map(|name| cpu_mode(name, 100.0, 1.0, calls)).collect();
            let census = analyse(&honest, cpu_candidate(true, Policy::KEVIN_STRICT), false);
            assert!(codes(&census).is_empty(), "{calls:?}: {:?}", census.findings);
            assert!((census.profiling_ratio - 0.99).abs() < 1e-12, "{}", census.profiling_ratio);
        }
    }

    #[test]
    fn a_low_profiling_ratio_is_a_notice_where_torch_may_work_and_a_hack_where_it_may_not() {
        let threshold = Policy::PERMISSIVE.min_profiling_ratio();
        assert_eq!(threshold, Policy::KEVIN_STRICT.min_profiling_ratio());
        // An extension that calls library compute (`at::relu(at::matmul(..))`): called, but 71% of the time is
        // torch's operators. Then just under and just over the threshold, and an honest 0.99.
        for (torch_us, lazy) in [(71.0, true), (100.0 * (1.0 - threshold) + 0.5, true), (49.0, false), (1.0, false)] {
            let modes = [cpu_mode("train/no_grad", 100.0, torch_us, Some(2))];
            for policy in Policy::ALL {
                let census = analyse(&modes, cpu_candidate(true, policy), false);
                let expected = lazy.then(|| if policy.strict() { Category::Hack } else { Category::Notice });
                assert_eq!(
                    category(&census, "runtime.low_profiling_ratio"),
                    expected,
                    "{} at ratio {}",
                    policy.id(),
                    census.profiling_ratio
                );
                assert_eq!(codes(&census).len(), usize::from(lazy), "{:?}", census.findings);
            }
        }
        // A candidate with no code of its own (the reference's torch code, reproduced): exactly the notice under
        // permissive, which lets torch do the work.
        let reproducing =
            analyse(&[cpu_mode("train/no_grad", 100.0, 90.0, None)], cpu_candidate(false, Policy::PERMISSIVE), false);
        assert_eq!(codes(&reproducing), vec!["runtime.low_profiling_ratio"]);
        assert_eq!(reproducing.findings[0].category, Category::Notice);
        assert!(reproducing.findings[0].message.contains("permissive@"), "{}", reproducing.findings[0].message);
        // On a GPU the same rule over device time; no device work at all measures nothing and names nothing.
        let own = ["scale_kernel".to_owned()];
        let gemm_in_cublas =
            [mode("train/no_grad", vec![record("sm90_xmma_gemm", 0.0, 90.0), record(OWN, 90.0, 10.0)])];
        let census = analyse(&gemm_in_cublas, gpu_candidate(&own, None, Policy::KEVIN_STRICT), true);
        assert_eq!(codes(&census), vec!["runtime.low_profiling_ratio"]);
        assert_eq!(census.findings[0].category, Category::Hack);
        let idle = analyse(&[mode("train/no_grad", Vec::new())], gpu_candidate(&[], None, Policy::KEVIN_STRICT), true);
        assert!(codes(&idle).is_empty(), "{:?}", idle.findings);
    }

    const CENSUS_MODE_NAMES: [&str; 4] = ["train/no_grad", "eval/no_grad", "train/grad", "eval/grad"];

    #[test]
    fn overlapping_records_count_once() {
        let records = [record("a", 0.0, 10.0), record("b", 5.0, 10.0), record("c", 20.0, 5.0)];
        assert_eq!(union_us(&records), 20.0);
    }

    #[test]
    fn recent_censuses_are_found_by_build_and_task_and_the_least_read_leaves_first() {
        let records = |mode: &str| {
            let modes = vec![ModeRecords {
                mode: mode.into(),
                calls: 1,
                call_spans: vec![],
                records: vec![],
                extension_functions: None,
                extension_calls: None,
            }];
            Arc::new(Records { modes, jit_kernels: None })
        };
        let recent = Recent::new(2);
        recent.put("a", "t", records("a"));
        recent.put("b", "t", records("b"));
        assert!(recent.get("a", "u").is_none(), "another task's census is not this one's");
        assert_eq!(recent.get("a", "t").expect("kept").modes[0].mode, "a");
        // `b` is now the least recently read: it leaves for `c`.
        recent.put("c", "t", records("c"));
        assert!(recent.get("b", "t").is_none());
        assert_eq!(recent.get("a", "t").expect("kept").modes[0].mode, "a");
        // A new census of the same build and task replaces the old one.
        recent.put("a", "t", records("a2"));
        assert_eq!(recent.get("a", "t").expect("kept").modes[0].mode, "a2");
        let none = Recent::new(0);
        none.put("a", "t", records("a"));
        assert!(none.get("a", "t").is_none());
    }
}
