//! The protocol between the engine and its harness (`harness/kforge_harness/`, its `protocol` module): what a stage
//! is asked, and what it answers, one request type and one result type per [`Mode`].
//!
//! A stage reads one request from stdin, `{"protocol", "mode", "spec", "env"}`, and writes one result, a JSON
//! object, to `spec.result_path`. Both carry [`PROTOCOL_VERSION`]: the harness refuses a request of another
//! version (it writes a result saying so and exits with [`REFUSED_EXIT`]), and the engine refuses a result of
//! another version ([`Decoded::Version`]). The Python side reads each mode's spec into a frozen dataclass and
//! writes each mode's result from one (`SPECS` and `RESULTS` in the harness's `protocol` module); tests compare both
//! lists of fields with these types, in both directions ([`spec_fields`], [`result_fields`]).
//!
//! Results are read as leniently as they always were: a field of the wrong type reads as absent, so a result
//! half-written or forged by candidate code is judged by what it lacks, never fails to parse as a whole.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::census::ModeRecords;
use crate::config::{TimingBudget, Tolerances};

/// The version of the messages below; the harness's `PROTOCOL_VERSION` must be the same.
pub const PROTOCOL_VERSION: u32 = 7;

/// The exit status of a harness that refused a request of another protocol version.
pub const REFUSED_EXIT: i32 = 5;

/// What a harness stage does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Imports the candidate, building its extensions into the artifact cache.
    Compile,
    /// Runs the reference on the trial inputs, saves its outputs, then compares the candidate's.
    Reference,
    /// Runs the candidate: its trials, timing and census.
    Candidate,
    /// Compares the candidate's saved outputs with a cached reference's.
    Check,
    /// Times the reference, eagerly and under torch.compile.
    Baseline,
    /// Precompiles torch's extension header for the bindings (`crate::precompiled_header`).
    BindingsPch,
}

impl Mode {
    /// The mode's name on the wire and in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Compile => "compile",
            Mode::Reference => "reference",
            Mode::Candidate => "candidate",
            Mode::Check => "check",
            Mode::Baseline => "baseline",
            Mode::BindingsPch => "bindings_pch",
        }
    }

    /// Whether the stage runs no candidate code (the reference, the checker, the baseline, the header): it may
    /// then be trusted to do no device work while it says it is idle, and its result is the harness's own.
    pub fn trusted(self) -> bool {
        match self {
            Mode::Reference | Mode::Check | Mode::Baseline | Mode::BindingsPch => true,
            Mode::Compile | Mode::Candidate => false,
        }
    }
}

/// A request's spec: which mode it is for, and what the stage answers.
pub trait StageSpec: Serialize + std::fmt::Debug {
    /// The mode's result, less the fields every result has ([`Report`]).
    type Result: DeserializeOwned + Default + std::fmt::Debug;

    fn mode(&self) -> Mode;
}

/// `compile`: import the candidate.
#[derive(Debug, Clone, Serialize)]
pub struct CompileSpec {
    pub candidate_path: PathBuf,
    /// Whether to list the kernels compiled into its extensions (a GPU build).
    pub kernels: bool,
}

/// What `compile` answers beyond [`Report`].
#[derive(Debug, Default, Deserialize)]
pub struct CompileResult {
    /// How long the import took.
    #[serde(default, deserialize_with = "lenient")]
    pub seconds: Option<f64>,
    /// The kernels compiled into its extensions, by function name, when asked and readable.
    #[serde(default, deserialize_with = "lenient")]
    pub kernels: Option<Vec<String>>,
    /// Why they could not be read, when asked.
    #[serde(default, deserialize_with = "lenient")]
    pub kernels_unread: Option<String>,
}

impl StageSpec for CompileSpec {
    type Result = CompileResult;
    fn mode(&self) -> Mode {
        Mode::Compile
    }
}

/// The timing loop's budget as the harness reads it (`measure`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TimingSpec {
    pub warmup_runs: u32,
    pub min_runs: u32,
    pub max_runs: u32,
    pub max_seconds: f64,
    pub min_seconds: f64,
    pub target_rel_error: f64,
    /// Paired timing (`devices::pairing`): the calls are timed in this many rounds, each at least `min_runs` and
    /// `min_seconds` over the rounds' count (and at most `max_runs` and `max_seconds` so divided), its turn taken by
    /// turns with the other side's; no early stop. 0: one run alone, stopping early once the error is small.
    pub rounds: u32,
}

impl From<&TimingBudget> for TimingSpec {
    /// At least two measured runs, and no fewer at most than at least; unpaired.
    fn from(timing: &TimingBudget) -> Self {
        Self {
            warmup_runs: timing.warmup_runs,
            min_runs: timing.min_runs.max(2),
            max_runs: timing.max_runs.max(timing.min_runs.max(2)),
            max_seconds: timing.max_seconds,
            min_seconds: timing.min_seconds,
            target_rel_error: timing.target_rel_error,
            rounds: 0,
        }
    }
}

impl TimingSpec {
    /// The same budget, timed in `rounds` paired rounds.
    pub fn paired(self, rounds: u32) -> Self {
        Self { rounds, ..self }
    }
}

/// The sensitivity trial: `trial` gets trial `base`'s inputs with a few moved far out of range (seeded by
/// `seed`), and the check compares how both outputs moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sensitivity {
    pub trial: usize,
    pub base: usize,
    pub seed: u64,
}

/// Where a stage finds the task, the candidate and its device.
#[derive(Debug, Clone, Serialize)]
pub struct CandidatePlacement {
    pub task_path: PathBuf,
    pub candidate_path: PathBuf,
    /// Where the candidate's outputs are saved, for the checker.
    pub candidate_dir: PathBuf,
    /// `cpu` or `cuda`.
    pub device: &'static str,
    /// The CPU kept for the timed loop's launching thread, if any.
    pub timing_cpu: Option<usize>,
}

/// What a candidate run covers: its trials, timing and census.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateRun {
    pub init_seed: u64,
    /// One seed per correctness trial.
    pub seeds: Vec<u64>,
    /// Trials from here on run after timing and the census.
    pub recheck_from: usize,
    pub sensitivity: Option<Sensitivity>,
    /// The trial that repeats trial 0's inputs after timing and the census (kept under the output budget).
    pub replay: Option<usize>,
    pub output_bytes_budget: u64,
    /// Absent: not timed.
    pub timing: Option<TimingSpec>,
    pub timing_seeds: Vec<u64>,
    /// Forward calls per census mode (0: no census).
    pub census_calls: u32,
    /// Forward calls inside the profiler's range (`cudaProfilerStart`/`Stop`), after an untimed warm-up call (0:
    /// none). A profiler run only: never with timing or the census, whose measurements it would distort.
    pub profiled_calls: u32,
    /// Timing keeps timed calls' outputs for the checker (the last and a random sample); none in a
    /// re-measurement, whose outputs nobody checks.
    pub keep_timed: Option<KeepTimed>,
}

/// Which timed calls' outputs the candidate's harness keeps for the checker besides the last one's: a random sample
/// of at most `sampled_calls`, while together they take at most `sampled_bytes` (it holds a copy of each on the
/// device while it times); each file's digest is keyed with `digest_key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepTimed {
    pub digest_key: u64,
    pub sampled_calls: u64,
    pub sampled_bytes: u64,
}

impl KeepTimed {
    /// The sample the evaluator reserves disk and device memory for (`disk::SAMPLED_TIMED_CALLS`,
    /// `disk::SAMPLED_TIMED_BYTES`), its digests keyed with `digest_key`.
    pub fn sampled(digest_key: u64) -> Self {
        Self {
            digest_key,
            sampled_calls: crate::disk::SAMPLED_TIMED_CALLS,
            sampled_bytes: crate::disk::SAMPLED_TIMED_BYTES,
        }
    }
}

/// A timed call whose outputs the candidate's harness kept for the checker, with the keyed digest of the file it
/// wrote (the candidate's code ran after, and could rewrite it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimedOutput {
    pub call: i64,
    pub digest: Vec<i64>,
}

/// `candidate`: run the candidate.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateSpec {
    #[serde(flatten)]
    pub run: CandidateRun,
    #[serde(flatten)]
    pub placement: CandidatePlacement,
}

/// A finding the harness made at run time (an integrity check).
#[derive(Debug, Default, Deserialize)]
pub struct RuntimeFinding {
    #[serde(default, deserialize_with = "lenient")]
    pub code: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    pub message: Option<String>,
}

/// How the timed loop's launching thread fared.
#[derive(Debug, Default, Deserialize)]
pub struct TimingCpu {
    /// What competition for the CPU cost it (0 when nothing competed).
    #[serde(default, deserialize_with = "lenient")]
    pub cpu_wait_ms: Option<f64>,
    /// On a GPU, medians over the measured calls: the host's time inside the call, the cover asked for, and the
    /// cover the device ran (see the harness's `Timer`).
    #[serde(default, deserialize_with = "lenient")]
    pub launch_ms: Option<f64>,
    #[serde(default, deserialize_with = "lenient")]
    pub cover_ms: Option<f64>,
    #[serde(default, deserialize_with = "lenient")]
    pub cover_device_ms: Option<f64>,
    /// On a GPU, the share of the measured calls whose cover ran out before the host had enqueued them (their time
    /// may include host launch time); above a half, the median does.
    #[serde(default, deserialize_with = "lenient")]
    pub cover_short_share: Option<f64>,
}

impl TimingCpu {
    /// The figures as phases of the candidate's run in `stage_ms` (`run.timing_cpu_wait`, `run.timing_launch`,
    /// `run.timing_cover`, `run.timing_cover_device`), those present only.
    pub fn phases(&self) -> impl Iterator<Item = (&'static str, f64)> {
        [
            ("timing_cpu_wait", self.cpu_wait_ms),
            ("timing_launch", self.launch_ms),
            ("timing_cover", self.cover_ms),
            ("timing_cover_device", self.cover_device_ms),
        ]
        .into_iter()
        .filter_map(|(key, value)| Some((key, value?)))
    }
}

/// What `candidate` answers beyond [`Report`].
#[derive(Debug, Default, Deserialize)]
pub struct CandidateResult {
    /// Trials whose inputs the candidate modified.
    #[serde(default, deserialize_with = "lenient_items")]
    pub mutated_inputs: Vec<i64>,
    #[serde(default, deserialize_with = "lenient_items")]
    pub findings: Vec<RuntimeFinding>,
    /// Timed samples by the events (or the clock on a CPU), and by the host clock; empty when unreadable.
    #[serde(default, deserialize_with = "lenient")]
    pub samples_ms: Vec<f64>,
    #[serde(default, deserialize_with = "lenient")]
    pub host_ms: Vec<f64>,
    /// Paired timing: the samples' count in each round, in order; empty when unpaired or unreadable.
    #[serde(default, deserialize_with = "lenient")]
    pub rounds: Vec<u32>,
    /// The timed calls whose outputs were saved: the last, then a random sample of earlier ones, drawn as the calls
    /// ran; empty when unreadable.
    #[serde(default, deserialize_with = "lenient")]
    pub timed_outputs: Vec<TimedOutput>,
    #[serde(default, deserialize_with = "lenient")]
    pub timing_cpu: Option<TimingCpu>,
    /// The census records when present, or why they are unreadable.
    #[serde(default, deserialize_with = "present")]
    pub census: Option<Result<Vec<ModeRecords>, Unreadable>>,
    #[serde(default, deserialize_with = "lenient")]
    pub device_peak_bytes: Option<u64>,
    /// The Triton kernels the candidate's code made, by function name; absent where its source never names triton.
    #[serde(default, deserialize_with = "lenient")]
    pub jit_kernels: Option<Vec<String>>,
}

impl StageSpec for CandidateSpec {
    type Result = CandidateResult;
    fn mode(&self) -> Mode {
        Mode::Candidate
    }
}

/// `reference` or `check`: compare the candidate's saved outputs with the reference's, computing (and saving)
/// the reference first in `reference` mode.
#[derive(Debug, Clone, Serialize)]
pub struct CompareSpec {
    /// Whether the reference is computed here (`reference`), or read from the cache (`check`).
    #[serde(skip)]
    pub computes_reference: bool,
    pub task_path: PathBuf,
    pub device: &'static str,
    pub init_seed: u64,
    pub seeds: Vec<u64>,
    pub reference_dir: PathBuf,
    pub candidate_dir: PathBuf,
    pub tolerances: Tolerances,
    pub timing_seeds: Vec<u64>,
    pub sensitivity: Option<Sensitivity>,
    /// The trial that repeats trial 0's inputs after timing: compared with trial 0's reference (it has none of its
    /// own), before the timed calls kept and the re-checks after it.
    pub replay: Option<usize>,
    pub output_bytes_budget: u64,
    /// The candidate's timed calls whose outputs it saved, when it was timed (the last and a random sample): their
    /// outputs are checked too, on rebuilt inputs.
    pub timed_outputs: Vec<TimedOutput>,
    /// The key of the timed outputs' digests (`KeepTimed::digest_key`).
    pub digest_key: u64,
}

/// The first output that differed, as the harness found it.
#[derive(Debug, Default, Deserialize)]
pub struct MismatchRecord {
    /// The trial; negative or absent: a timed call kept (the detail names it).
    #[serde(default, deserialize_with = "lenient")]
    pub trial: Option<i64>,
    #[serde(default, deserialize_with = "lenient")]
    pub output_index: Option<u64>,
    #[serde(default, deserialize_with = "lenient")]
    pub element_index: Vec<u64>,
    #[serde(default, deserialize_with = "number")]
    pub expected: f64,
    #[serde(default, deserialize_with = "number")]
    pub got: f64,
    #[serde(default, deserialize_with = "number")]
    pub max_abs_error: f64,
    #[serde(default, deserialize_with = "number")]
    pub max_rel_error: f64,
    #[serde(default, deserialize_with = "lenient")]
    pub detail: String,
    /// The harness judged the output changed behaviour: the replay of trial 0's inputs after timing, far outside
    /// the tolerance (near it, the replay's mismatch is a plain one).
    #[serde(default, deserialize_with = "lenient")]
    pub changed: bool,
}

/// What `reference` and `check` answer beyond [`Report`].
#[derive(Debug, Default, Deserialize)]
pub struct CompareResult {
    /// None: every compared output matched.
    #[serde(default, deserialize_with = "non_null")]
    pub mismatch: Option<MismatchRecord>,
    /// The trials compared, where the outputs were too large to compare all (`output_bytes_budget`).
    #[serde(default, deserialize_with = "lenient")]
    pub compared_trials: Option<Vec<u64>>,
    /// The reference's peak device memory (`reference` on a GPU).
    #[serde(default, deserialize_with = "lenient")]
    pub device_peak_bytes: Option<u64>,
    /// The most bytes of tensors one of the reference's trials output (`reference`), as the harness counts them
    /// to choose the kept trials.
    #[serde(default, deserialize_with = "lenient")]
    pub output_bytes: Option<u64>,
}

impl StageSpec for CompareSpec {
    type Result = CompareResult;
    fn mode(&self) -> Mode {
        if self.computes_reference { Mode::Reference } else { Mode::Check }
    }
}

/// `baseline`: time the reference.
#[derive(Debug, Clone, Serialize)]
pub struct BaselineSpec {
    pub task_path: PathBuf,
    pub device: &'static str,
    pub init_seed: u64,
    pub timing: TimingSpec,
    pub timing_seeds: Vec<u64>,
    /// Whether torch.compile is timed too.
    pub compile: bool,
    pub timing_cpu: Option<usize>,
}

/// What `baseline` answers beyond [`Report`].
#[derive(Debug, Default, Deserialize)]
pub struct BaselineResult {
    #[serde(default, deserialize_with = "lenient")]
    pub eager_ms: Option<Vec<f64>>,
    #[serde(default, deserialize_with = "lenient")]
    pub eager_host_ms: Option<Vec<f64>>,
    /// Paired timing: the eager samples' count in each round, in order.
    #[serde(default, deserialize_with = "lenient")]
    pub eager_rounds: Option<Vec<u32>>,
    #[serde(default, deserialize_with = "lenient")]
    pub compile_ms: Option<Vec<f64>>,
    /// Why torch.compile was not timed.
    #[serde(default, deserialize_with = "lenient")]
    pub compile_error: Option<String>,
}

impl StageSpec for BaselineSpec {
    type Result = BaselineResult;
    fn mode(&self) -> Mode {
        Mode::Baseline
    }
}

/// `bindings_pch`: precompile torch's extension header into `out_dir`, per variant of extra flags.
#[derive(Debug, Clone, Serialize)]
pub struct BindingsPchSpec {
    pub out_dir: PathBuf,
    pub variants: BTreeMap<String, Vec<String>>,
    /// Whether nvcc's host compile is precompiled too.
    pub cuda: bool,
}

/// What `bindings_pch` answers beyond [`Report`].
#[derive(Debug, Default, Deserialize)]
pub struct BindingsPchResult {
    /// The variants built.
    #[serde(default, deserialize_with = "lenient_items")]
    pub built: Vec<String>,
    /// The variants that failed, and the compiler's complaint.
    #[serde(default, deserialize_with = "lenient")]
    pub failed: Option<BTreeMap<String, String>>,
    /// Per variant, why nvcc's host compile was not precompiled (null: it was).
    #[serde(default, deserialize_with = "lenient")]
    pub host: BTreeMap<String, Option<String>>,
}

impl StageSpec for BindingsPchSpec {
    type Result = BindingsPchResult;
    fn mode(&self) -> Mode {
        Mode::BindingsPch
    }
}

/// How a stage takes part in its device's gate, as the harness reads `spec.gate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateRole {
    /// No gate: the stage holds no device (`false`).
    None,
    /// Shares the device from its first step (`"share"`).
    Share,
    /// Joins idle and asks to share before device work (`"idle"`).
    Idle,
}

impl Serialize for GateRole {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            GateRole::None => serializer.serialize_bool(false),
            GateRole::Share => serializer.serialize_str("share"),
            GateRole::Idle => serializer.serialize_str("idle"),
        }
    }
}

/// The request a stage reads from stdin.
#[derive(Debug, Serialize)]
struct Message<'a, S> {
    protocol: u32,
    mode: Mode,
    spec: Framed<'a, S>,
    env: BTreeMap<&'a str, &'a str>,
}

/// A spec with what every stage is told: where to write its result, and its part in the gate.
#[derive(Debug, Serialize)]
struct Framed<'a, S> {
    #[serde(flatten)]
    spec: &'a S,
    result_path: &'a Path,
    gate: GateRole,
}

/// The bytes of a request for `spec`.
pub fn encode<S: StageSpec>(spec: &S, result_path: &Path, gate: GateRole, env: &[(String, String)]) -> Vec<u8> {
    let message = Message {
        protocol: PROTOCOL_VERSION,
        mode: spec.mode(),
        spec: Framed { spec, result_path, gate },
        env: env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
    };
    serde_json::to_vec(&message).expect("a request always serialises: string keys, finite or absent numbers")
}

/// What every result has, and the mode's own fields. (Serialize only lists the fields: see [`result_fields`].)
#[derive(Debug, Default, Deserialize, Serialize)]
pub struct Report<R> {
    /// Whether the stage did what it was asked (a candidate may still have failed checks).
    #[serde(default, deserialize_with = "lenient")]
    pub ok: bool,
    /// The harness's traceback, on failure.
    #[serde(default, deserialize_with = "lenient")]
    pub error: Option<String>,
    /// The exception's type name, on failure.
    #[serde(default, deserialize_with = "lenient")]
    pub error_type: Option<String>,
    /// Where the failure happened: `import` (the candidate's module) or `run`.
    #[serde(default, deserialize_with = "lenient")]
    pub phase: Option<String>,
    /// CPU time of the process and the children it waited for.
    #[serde(default, deserialize_with = "lenient")]
    pub cpu_ms: Option<f64>,
    /// Wall time per phase of the stage; entries that are not numbers are left out.
    #[serde(default, deserialize_with = "numbers")]
    pub phases_ms: BTreeMap<String, f64>,
    #[serde(flatten)]
    pub body: R,
}

/// How a result file read.
#[derive(Debug)]
pub enum Decoded<R> {
    Report(Report<R>),
    /// Not a JSON object.
    Unreadable(String),
    /// A result of another protocol version (None: it names none).
    Version {
        harness: Option<u64>,
    },
}

/// Reads a result, checking its protocol version first.
pub fn decode<R: DeserializeOwned + Default>(bytes: &[u8]) -> Decoded<R> {
    let value: serde_json::Value = match serde_json::from_slice(bytes) {
        Ok(value @ serde_json::Value::Object(_)) => value,
        Ok(other) => return Decoded::Unreadable(format!("a JSON {} rather than an object", kind(&other))),
        Err(error) => return Decoded::Unreadable(error.to_string()),
    };
    let harness = value.get("protocol").and_then(serde_json::Value::as_u64);
    if harness != Some(PROTOCOL_VERSION.into()) {
        return Decoded::Version { harness };
    }
    match serde_json::from_value(value) {
        Ok(report) => Decoded::Report(report),
        Err(error) => Decoded::Unreadable(error.to_string()),
    }
}

fn kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// A field of the wrong type reads as its default.
fn lenient<'de, D: Deserializer<'de>, T: DeserializeOwned + Default>(deserializer: D) -> Result<T, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    Ok(T::deserialize(value).unwrap_or_default())
}

/// A list whose items of the wrong type read as their default; anything but a list reads as empty.
fn lenient_items<'de, D: Deserializer<'de>, T: DeserializeOwned + Default>(
    deserializer: D,
) -> Result<Vec<T>, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    let serde_json::Value::Array(items) = value else { return Ok(Vec::new()) };
    Ok(items.into_iter().map(|item| T::deserialize(item).unwrap_or_default()).collect())
}

/// Why a field the harness wrote does not read (a finding about the candidate, not a failed result).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(pub String);

/// A field that is present (even null) reads as `Some`, parsed or why not.
fn present<'de, D: Deserializer<'de>, T: DeserializeOwned>(
    deserializer: D,
) -> Result<Option<Result<T, Unreadable>>, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    Ok(Some(T::deserialize(value).map_err(|error| Unreadable(error.to_string()))))
}

/// Null reads as `None`; anything else as `Some`, leniently.
fn non_null<'de, D: Deserializer<'de>, T: DeserializeOwned + Default>(deserializer: D) -> Result<Option<T>, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    Ok((!value.is_null()).then(|| T::deserialize(value).unwrap_or_default()))
}

/// A number, or a non-finite one as proto3 JSON spells it (the harness's `json_safe`); anything else is 0.
fn number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<f64, D::Error> {
    Ok(match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(text) => match text.as_str() {
            "NaN" => f64::NAN,
            "Infinity" => f64::INFINITY,
            "-Infinity" => f64::NEG_INFINITY,
            _ => 0.0,
        },
        value => value.as_f64().unwrap_or(0.0),
    })
}

/// An object's entries that are numbers.
fn numbers<'de, D: Deserializer<'de>>(deserializer: D) -> Result<BTreeMap<String, f64>, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    let serde_json::Value::Object(entries) = value else { return Ok(BTreeMap::new()) };
    Ok(entries.into_iter().filter_map(|(key, value)| Some((key, value.as_f64()?))).collect())
}

/// The field names of each mode's spec as this side sends them, without the framing (`result_path`, `gate`):
/// what the harness's `SPECS` must list (checked by a test that asks the harness).
pub fn spec_fields() -> BTreeMap<&'static str, Vec<String>> {
    let fields = |spec: serde_json::Value| -> Vec<String> {
        let mut names: Vec<String> = spec.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        names.sort();
        names
    };
    let placement = CandidatePlacement {
        task_path: PathBuf::new(),
        candidate_path: PathBuf::new(),
        candidate_dir: PathBuf::new(),
        device: "cpu",
        timing_cpu: None,
    };
    let run = CandidateRun {
        init_seed: 0,
        seeds: vec![],
        recheck_from: 0,
        sensitivity: None,
        replay: None,
        output_bytes_budget: 0,
        timing: None,
        timing_seeds: vec![],
        census_calls: 0,
        profiled_calls: 0,
        keep_timed: None,
    };
    let compare = CompareSpec {
        computes_reference: true,
        task_path: PathBuf::new(),
        device: "cpu",
        init_seed: 0,
        seeds: vec![],
        reference_dir: PathBuf::new(),
        candidate_dir: PathBuf::new(),
        tolerances: Tolerances::default(),
        timing_seeds: vec![],
        sensitivity: None,
        replay: None,
        output_bytes_budget: 0,
        timed_outputs: vec![],
        digest_key: 0,
    };
    let baseline = BaselineSpec {
        task_path: PathBuf::new(),
        device: "cpu",
        init_seed: 0,
        timing: TimingSpec::from(&TimingBudget::default()),
        timing_seeds: vec![],
        compile: false,
        timing_cpu: None,
    };
    let pch = BindingsPchSpec { out_dir: PathBuf::new(), variants: BTreeMap::new(), cuda: false };
    BTreeMap::from([
        (Mode::Compile.name(), fields(json(&CompileSpec { candidate_path: PathBuf::new(), kernels: false }))),
        (Mode::Candidate.name(), fields(json(&CandidateSpec { run, placement }))),
        (Mode::Reference.name(), fields(json(&compare))),
        (Mode::Check.name(), fields(json(&CompareSpec { computes_reference: false, ..compare.clone() }))),
        (Mode::Baseline.name(), fields(json(&baseline))),
        (Mode::BindingsPch.name(), fields(json(&pch))),
    ])
}

/// A spec as a JSON value.
fn json<S: StageSpec>(spec: &S) -> serde_json::Value {
    serde_json::to_value(spec).expect("specs serialise")
}

/// The field names of each mode's result as this side reads them: `protocol` (read by [`decode`]), the fields every
/// [`Report`] has, and the mode's own (its spec's [`StageSpec::Result`]). What the harness's result types write for
/// the evaluator, no more and no less (checked by a test that asks the harness); what it writes for the record only
/// is listed apart on its side.
pub fn result_fields() -> BTreeMap<&'static str, Vec<String>> {
    /// A report with no fields of its own: those every result has.
    #[derive(Default, Serialize)]
    struct NoBody {}
    let report = serde_json::to_value(Report::<NoBody>::default()).expect("a report serialises");
    let mut common = vec!["protocol".to_owned()];
    common.extend(report.as_object().into_iter().flat_map(|fields| fields.keys().cloned()));
    let with = |body: &[&str]| -> Vec<String> {
        let mut names: Vec<String> = common.iter().cloned().chain(body.iter().map(|&name| name.to_owned())).collect();
        names.sort();
        names.dedup();
        names
    };
    BTreeMap::from([
        (Mode::Compile.name(), with(struct_fields::<<CompileSpec as StageSpec>::Result>())),
        (Mode::Candidate.name(), with(struct_fields::<<CandidateSpec as StageSpec>::Result>())),
        (Mode::Reference.name(), with(struct_fields::<<CompareSpec as StageSpec>::Result>())),
        (Mode::Check.name(), with(struct_fields::<<CompareSpec as StageSpec>::Result>())),
        (Mode::Baseline.name(), with(struct_fields::<<BaselineSpec as StageSpec>::Result>())),
        (Mode::BindingsPch.name(), with(struct_fields::<<BindingsPchSpec as StageSpec>::Result>())),
    ])
}

/// The fields a struct's derived `Deserialize` reads: the names it hands to `deserialize_struct`, taken there
/// before anything is read.
fn struct_fields<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);

    impl<'de> Deserializer<'de> for Names<'_> {
        type Error = serde::de::value::Error;

        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct: no fields to list"))
        }

        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("the fields are listed, nothing is read"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option unit
            unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut fields));
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded<R: DeserializeOwned + Default>(value: serde_json::Value) -> Decoded<R> {
        decode(&serde_json::to_vec(&value).expect("json"))
    }

    fn report<R: DeserializeOwned + Default + std::fmt::Debug>(mut value: serde_json::Value) -> Report<R> {
        value["protocol"] = PROTOCOL_VERSION.into();
        match decoded(value) {
            Decoded::Report(report) => report,
            other => panic!("not a report: {other:?}"),
        }
    }

    #[test]
    fn a_request_names_its_protocol_mode_and_framing() {
        let spec = CompileSpec { candidate_path: "/s/candidate.py".into(), kernels: false };
        let env = [("CUDA_VISIBLE_DEVICES".to_owned(), "1".to_owned())];
        let bytes = encode(&spec, Path::new("/s/result.json"), GateRole::None, &env);
        let message: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(
            message,
            serde_json::json!({
                "protocol": PROTOCOL_VERSION,
                "mode": "compile",
                "spec": { "candidate_path": "/s/candidate.py", "kernels": false, "result_path": "/s/result.json", "gate": false },
                "env": { "CUDA_VISIBLE_DEVICES": "1" },
            })
        );
        let compare = |computes_reference| CompareSpec { computes_reference, ..compare_spec() };
        let idle = encode(&compare(false), Path::new("/r"), GateRole::Idle, &[]);
        let idle: serde_json::Value = serde_json::from_slice(&idle).expect("json");
        assert_eq!((idle["mode"].as_str(), idle["spec"]["gate"].as_str()), (Some("check"), Some("idle")));
        assert_eq!(compare(true).mode(), Mode::Reference);
        assert!(idle["spec"].get("computes_reference").is_none(), "the mode says it");
    }

    fn compare_spec() -> CompareSpec {
        CompareSpec {
            computes_reference: false,
            task_path: "/t".into(),
            device: "cpu",
            init_seed: 1,
            seeds: vec![2, 3],
            reference_dir: "/ref".into(),
            candidate_dir: "/cand".into(),
            tolerances: Tolerances::default(),
            timing_seeds: vec![4],
            sensitivity: Some(Sensitivity { trial: 1, base: 0, seed: 9 }),
            replay: None,
            output_bytes_budget: 10,
            timed_outputs: vec![TimedOutput { call: 7, digest: vec![1, -2] }],
            digest_key: 5,
        }
    }

    #[test]
    fn a_result_of_another_version_or_none_is_refused() {
        let other = serde_json::json!({ "protocol": PROTOCOL_VERSION + 1, "ok": true });
        assert!(
            matches!(decoded::<CompileResult>(other), Decoded::Version { harness: Some(v) } if v == u64::from(PROTOCOL_VERSION + 1))
        );
        let unversioned = serde_json::json!({ "ok": true });
        assert!(matches!(decoded::<CompileResult>(unversioned), Decoded::Version { harness: None }));
        assert!(matches!(decode::<CompileResult>(b"[1]"), Decoded::Unreadable(_)));
        assert!(matches!(decode::<CompileResult>(b"{\"ok\": tr"), Decoded::Unreadable(_)));
    }

    #[test]
    fn fields_of_the_wrong_type_read_as_absent() {
        let result: Report<CandidateResult> = report(serde_json::json!({
            "ok": "yes",
            "cpu_ms": 12,
            "phases_ms": { "trials": 3.5, "bad": "x" },
            "samples_ms": [1.0, "NaN"],
            "host_ms": [1.0, 2.0],
            "findings": [{ "code": "runtime.x", "message": "m" }, 4, { "message": 5 }],
            "mutated_inputs": [1, "two"],
            "timing_cpu": { "cpu_wait_ms": 0.5, "launch_ms": 0.03, "cover_ms": null, "cover_device_ms": "x",
                            "cover_short_share": 0.75 },
            "census": null,
        }));
        assert!(!result.ok, "only true is ok");
        assert_eq!(result.cpu_ms, Some(12.0));
        assert_eq!(result.phases_ms, BTreeMap::from([("trials".to_owned(), 3.5)]));
        let body = result.body;
        assert!(body.samples_ms.is_empty(), "a non-finite sample makes the series unreadable");
        assert_eq!(body.host_ms, [1.0, 2.0]);
        let codes: Vec<_> = body.findings.iter().map(|f| f.code.as_deref()).collect();
        assert_eq!(codes, [Some("runtime.x"), None, None]);
        assert_eq!(body.mutated_inputs, [1, 0], "still a mutation, whatever the index");
        let timing_cpu: Vec<_> = body.timing_cpu.as_ref().map(|t| t.phases().collect()).unwrap_or_default();
        assert_eq!(timing_cpu, [("timing_cpu_wait", 0.5), ("timing_launch", 0.03)]);
        assert_eq!(body.timing_cpu.as_ref().and_then(|t| t.cover_short_share), Some(0.75));
        assert!(matches!(body.census, Some(Err(_))), "present but unreadable: a finding, not an absence");
        let absent: Report<CandidateResult> = report(serde_json::json!({ "ok": true }));
        assert!(absent.ok && absent.body.census.is_none() && absent.body.timed_outputs.is_empty());
    }

    #[test]
    fn a_mismatch_reads_non_finite_numbers_as_the_harness_spells_them() {
        let result: Report<CompareResult> = report(serde_json::json!({
            "ok": true,
            "mismatch": { "trial": -1, "output_index": 2, "element_index": [0, 3], "expected": "NaN",
                          "got": "-Infinity", "max_abs_error": "Infinity", "max_rel_error": 0.5 },
            "compared_trials": [0, 1],
        }));
        let mismatch = result.body.mismatch.expect("a mismatch");
        assert_eq!(
            (mismatch.trial, mismatch.output_index, &mismatch.element_index[..]),
            (Some(-1), Some(2), &[0, 3][..])
        );
        assert!(mismatch.expected.is_nan());
        assert_eq!(
            (mismatch.got, mismatch.max_abs_error, mismatch.max_rel_error),
            (f64::NEG_INFINITY, f64::INFINITY, 0.5)
        );
        assert_eq!(result.body.compared_trials, Some(vec![0, 1]));
        let matched: Report<CompareResult> = report(serde_json::json!({ "ok": true, "mismatch": null }));
        assert!(matched.body.mismatch.is_none());
        let odd: Report<CompareResult> = report(serde_json::json!({ "ok": true, "mismatch": "x" }));
        assert!(odd.body.mismatch.is_some_and(|m| m.trial.is_none()), "not null: a mismatch of the timed call");
    }

    #[test]
    fn every_mode_has_its_result_fields() {
        let fields = result_fields();
        assert_eq!(fields.len(), 6);
        let common = ["cpu_ms", "error", "error_type", "ok", "phase", "phases_ms", "protocol"];
        for (mode, names) in &fields {
            assert!(common.iter().all(|name| names.contains(&(*name).to_owned())), "{mode}: {names:?}");
        }
        assert!(fields["compile"].contains(&"kernels_unread".to_owned()));
        assert!(fields["candidate"].contains(&"timed_outputs".to_owned()));
        assert!(fields["baseline"].contains(&"eager_rounds".to_owned()));
        assert_eq!(fields["reference"], fields["check"], "one result type for both");
        assert!(struct_fields::<Vec<u8>>().is_empty(), "not a struct");
    }

    #[test]
    fn every_mode_has_its_spec_fields() {
        let fields = spec_fields();
        assert_eq!(fields.len(), 6);
        assert_eq!(fields["compile"], ["candidate_path", "kernels"]);
        assert!(fields["candidate"].contains(&"census_calls".to_owned()));
        assert!(fields["candidate"].contains(&"timing_cpu".to_owned()));
        assert_eq!(fields["reference"], fields["check"]);
        assert!(Mode::Check.trusted() && !Mode::Candidate.trusted() && !Mode::Compile.trusted());
    }
}
