//! The Python side: probing the interpreter (versions, devices, paths), and running harness stages in the sandbox.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use std::sync::{Arc, Mutex, OnceLock};

use kforge_sandbox::{Control, Finished, Job, Limits, Sandbox, SandboxError, resolve_on_path};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::config::BuildRecipe;
use crate::devices::{Gate, Member, MemberTimes};
use crate::protocol::{self, Decoded, GateRole, Mode, PROTOCOL_VERSION, Report, StageSpec};

/// The files written to the work directory's `harness/` at start, embedded so that the binary is self-contained:
/// the harness, and kforge's nvcc (the host and device front ends side by side), which builds name in
/// `PYTORCH_NVCC`.
pub const HARNESS_FILES: [(&str, &str); 2] = [
    ("kforge_harness.py", include_str!("../harness/kforge_harness.py")),
    ("kforge_nvcc.py", include_str!("../harness/kforge_nvcc.py")),
];

/// A digest of the harness's source: part of the keys of cached references and baselines, which depend on how the
/// harness makes inputs and measures (a new harness computes them again rather than comparing with stale ones).
pub fn harness_digest() -> &'static str {
    static DIGEST: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| crate::cache::key(&[HARNESS_FILES[0].1.as_bytes()]));
    &DIGEST
}

/// What the interpreter reported about itself.
#[derive(Debug, Clone, Deserialize)]
struct Probe {
    python: String,
    prefixes: Vec<PathBuf>,
    paths: Vec<PathBuf>,
    torch: Option<String>,
    torch_error: Option<String>,
    #[serde(default)]
    cuda: String,
    #[serde(default)]
    cuda_home: String,
    #[serde(default)]
    devices: Vec<Gpu>,
    triton: Option<String>,
}

/// A GPU the interpreter's PyTorch sees.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Gpu {
    pub name: String,
    pub capability: String,
    /// Device memory in bytes (0: not reported): the basis of its memory budget for admission.
    #[serde(default)]
    pub total_memory: u64,
}

/// A usable interpreter with PyTorch.
#[derive(Debug, Clone)]
pub struct PythonEnv {
    pub python: PathBuf,
    /// python, torch, cuda, triton versions: part of every cache key.
    pub versions: BTreeMap<String, String>,
    pub gpus: Vec<Gpu>,
    /// Where the interpreter and its packages live: readable by every stage.
    pub readable: Vec<PathBuf>,
    cuda_home: Option<PathBuf>,
    /// The command load_inline's builds run for nvcc (`PYTORCH_NVCC`); see [`PythonEnv::use_build_recipe`].
    nvcc: Option<String>,
    /// Whether extensions are built as load_inline builds them (`build_recipe = "stock"`).
    stock_builds: bool,
    /// Where torch's extension header, precompiled for the bindings, lies once built (`crate::bindings_pch`).
    bindings_pch: Arc<OnceLock<PathBuf>>,
    /// CPU threads of each process on a GPU, where limited; see [`PythonEnv::limit_gpu_stage_threads`].
    gpu_stage_threads: Option<usize>,
    /// Per GPU, the CPU kept for the thread that launches its timed work; see [`PythonEnv::reserve_timing_cpus`].
    timing_cpus: Vec<usize>,
    /// The CPUs every stage starts on: all of this process's but the timing CPUs (empty: all).
    stage_cpus: Vec<usize>,
}

const PROBE: &str = r#"
import json, platform, sys
info = {"python": platform.python_version(), "prefixes": sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}),
        "paths": [p for p in sys.path if p]}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda or ""
    info["devices"] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                                    "total_memory": p.total_memory})
    from torch.utils.cpp_extension import CUDA_HOME
    info["cuda_home"] = CUDA_HOME or ""
except Exception as error:
    info["torch_error"] = repr(error)
try:
    import triton
    info["triton"] = triton.__version__
except Exception:
    pass
print(json.dumps(info))
"#;

impl PythonEnv {
    /// Asks `python` about itself, in a basic sandbox (no Landlock: its paths are what we are learning). A bare
    /// name such as `python3` is looked up on this process's PATH first: stages run with a scrubbed environment,
    /// where it would find a different interpreter.
    pub async fn probe(python: &Path, scratch: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(scratch).map_err(|e| format!("scratch {}: {e}", scratch.display()))?;
        let python = &resolve_on_path(python).ok_or_else(|| format!("{} is not on PATH", python.display()))?;
        let job = Job {
            program: python.to_owned(),
            args: vec!["-c".into(), PROBE.into()],
            env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
            scratch: scratch.to_owned(),
            readable: vec![],
            writable: vec![],
            limits: Limits { wall: Duration::from_secs(120), ..Limits::default() },
        };
        let finished = Sandbox::basic()
            .run(job, CancellationToken::new())
            .await
            .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
        if !finished.success() {
            return Err(format!("{} failed: {}", python.display(), finished.stderr_tail(2000)));
        }
        let probe: Probe = serde_json::from_slice(&finished.stdout)
            .map_err(|e| format!("{} gave an unreadable probe: {e}", python.display()))?;
        let Some(torch) = probe.torch.clone() else {
            return Err(format!(
                "{} (python {}) cannot import torch: {}",
                python.display(),
                probe.python,
                probe.torch_error.unwrap_or_default()
            ));
        };
        let mut versions = BTreeMap::from([("python".to_owned(), probe.python.clone()), ("torch".to_owned(), torch)]);
        if !probe.cuda.is_empty() {
            versions.insert("cuda".into(), probe.cuda.clone());
        }
        if let Some(triton) = &probe.triton {
            versions.insert("triton".into(), triton.clone());
        }
        let cuda_home = (!probe.cuda_home.is_empty()).then(|| PathBuf::from(&probe.cuda_home));
        let mut readable: Vec<PathBuf> = probe.prefixes.iter().chain(&probe.paths).cloned().collect();
        readable.extend(cuda_home.clone());
        if let Ok(real) = std::fs::canonicalize(python)
            && let Some(dir) = real.parent()
        {
            readable.push(dir.to_owned());
        }
        let python = std::path::absolute(python).unwrap_or_else(|_| python.to_owned());
        if let Some(dir) = python.parent() {
            readable.push(dir.to_owned());
        }
        readable.sort();
        readable.dedup();
        Ok(Self {
            python,
            versions,
            gpus: probe.devices,
            readable,
            cuda_home,
            nvcc: None,
            stock_builds: false,
            bindings_pch: Arc::default(),
            gpu_stage_threads: None,
            timing_cpus: Vec::new(),
            stage_cpus: Vec::new(),
        })
    }

    /// How candidates' extensions are built. With kforge's recipe, CUDA builds run nvcc through `nvcc_wrapper`
    /// (kforge_nvcc.py) with this interpreter; every stage that loads a candidate gets the same command, since
    /// ninja rebuilds an object whose command line changed. With the stock recipe the harness leaves load_inline
    /// as it is (`KFORGE_BUILD_RECIPE=stock`).
    pub fn use_build_recipe(&mut self, recipe: BuildRecipe, nvcc_wrapper: &Path) {
        self.stock_builds = recipe == BuildRecipe::Stock;
        self.nvcc = None;
        if recipe == BuildRecipe::Kforge && self.cuda_home.is_some() {
            let quote = |path: &Path| format!("'{}'", path.display().to_string().replace('\'', r"'\''"));
            self.nvcc = Some(format!("{} {}", quote(&self.python), quote(nvcc_wrapper)));
        }
    }

    /// From now on, compiles may use torch's extension header precompiled in `dir` (see [`PythonEnv::compile_env`]).
    pub fn offer_bindings_pch(&self, dir: PathBuf) {
        let _ = self.bindings_pch.set(dir);
    }

    /// What a compile stage needs beyond [`PythonEnv::env_on`]: the precompiled extension header, once built, on
    /// the compiler's include path (`CPATH`, searched before the `-isystem` directories where torch's headers
    /// are; gcc takes a precompiled header only where its flags match, and reads the header otherwise), the
    /// precompiled starts of nvcc's host compile for kforge's nvcc (`KFORGE_HOST_PCH`), and the directory to read
    /// them from.
    pub fn compile_env(&self) -> (Vec<(OsString, OsString)>, Vec<PathBuf>) {
        match self.bindings_pch.get() {
            Some(dir) if !self.stock_builds => (
                vec![("CPATH".into(), dir.into()), ("KFORGE_HOST_PCH".into(), dir.join("nvcc-host").into())],
                vec![dir.clone()],
            ),
            _ => (vec![], vec![]),
        }
    }

    /// Limits each process on a GPU to `threads` CPU threads (`OMP_NUM_THREADS`, `MKL_NUM_THREADS`): evaluations
    /// sharing a machine must not each start torch's thread per core (measured on the H200 with 8 slots and 16
    /// cores: the checker's processes spent 31.7 CPU-seconds each with a thread per core, 10.5 with two).
    pub fn limit_gpu_stage_threads(&mut self, threads: usize) {
        self.gpu_stage_threads = Some(threads.max(1));
    }

    /// Keeps one of this process's CPUs per GPU (the last ones) for the thread that launches that GPU's timed
    /// work (each GPU's gate lets one stage run alone at a time, so GPUs never share one): every stage starts on
    /// the others, and a stage running alone on its GPU moves its launching thread onto that GPU's CPU for the
    /// timed loop (`spec.timing_cpu`), so compiles and host work never delay its launches. Only with at least
    /// four CPUs per GPU. Returns the CPUs kept, by GPU.
    pub fn reserve_timing_cpus(&mut self) -> &[usize] {
        let mut cpus = kforge_sandbox::allowed_cpus();
        let gpus = self.gpus.len();
        if gpus == 0 || cpus.len() < 4 * gpus {
            return &[];
        }
        self.timing_cpus = cpus.split_off(cpus.len() - gpus);
        self.stage_cpus = cpus;
        &self.timing_cpus
    }

    /// The CPU kept for `gpu`'s timed work, if any.
    pub fn timing_cpu(&self, gpu: Option<usize>) -> Option<usize> {
        gpu.and_then(|gpu| self.timing_cpus.get(gpu).copied())
    }

    /// The software versions as one string, for cache keys.
    pub fn versions_key(&self) -> String {
        self.versions.iter().map(|(k, v)| format!("{k}={v};")).collect()
    }

    /// The name of GPU `gpu`, or `cpu`: what cached references and baselines are per.
    pub fn device_name(&self, gpu: Option<usize>) -> &str {
        gpu.and_then(|i| self.gpus.get(i)).map_or("cpu", |g| g.name.as_str())
    }

    /// `PATH` for stages: the interpreter's own bin directory first (ninja lives there in a venv), CUDA's, then the system's.
    fn path(&self) -> OsString {
        let mut dirs: Vec<PathBuf> = self.python.parent().map(Path::to_owned).into_iter().collect();
        dirs.extend(self.cuda_home.as_ref().map(|home| home.join("bin")));
        dirs.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from));
        std::env::join_paths(dirs).unwrap_or_default()
    }

    /// A stage's environment, but for its device; `scratch` is its home.
    pub fn env(&self, scratch: &Path) -> Vec<(OsString, OsString)> {
        let mut env: Vec<(OsString, OsString)> = vec![
            ("PATH".into(), self.path()),
            ("HOME".into(), scratch.into()),
            ("PYTHONDONTWRITEBYTECODE".into(), "1".into()),
            ("PYTHONUNBUFFERED".into(), "1".into()),
            ("LANG".into(), "C.UTF-8".into()),
        ];
        if let Some(home) = &self.cuda_home {
            env.push(("CUDA_HOME".into(), home.into()));
        }
        if let Some(nvcc) = &self.nvcc {
            env.push(("PYTORCH_NVCC".into(), nvcc.into()));
        }
        if self.stock_builds {
            env.push(("KFORGE_BUILD_RECIPE".into(), "stock".into()));
        }
        env
    }

    /// The environment that gives a stage its device: GPU `gpu`, or none (the CPU).
    pub fn device_env(&self, gpu: Option<usize>) -> Vec<(String, String)> {
        match gpu {
            Some(index) => {
                let mut env = vec![("CUDA_VISIBLE_DEVICES".to_owned(), index.to_string())];
                env.extend(self.gpu_threads_env());
                if let Some(gpu) = self.gpus.get(index) {
                    // Build for this device only: every extra architecture multiplies nvcc's device passes.
                    env.push(("TORCH_CUDA_ARCH_LIST".to_owned(), gpu.capability.clone()));
                }
                env
            }
            None => vec![("CUDA_VISIBLE_DEVICES".to_owned(), String::new())],
        }
    }

    /// The thread limit of processes on a GPU, as environment variables (read when torch loads).
    pub fn gpu_threads_env(&self) -> Vec<(String, String)> {
        let Some(threads) = self.gpu_stage_threads else { return vec![] };
        ["OMP_NUM_THREADS", "MKL_NUM_THREADS"].map(|name| (name.to_owned(), threads.to_string())).to_vec()
    }

    /// [`PythonEnv::env`] with the device's environment, for a process whose device is known when it starts.
    pub fn env_on(&self, scratch: &Path, gpu: Option<usize>) -> Vec<(OsString, OsString)> {
        let mut env = self.env(scratch);
        env.extend(self.device_env(gpu).into_iter().map(|(k, v)| (k.into(), v.into())));
        env
    }
}

/// Runs torch inside `sandbox`: with `gpu`, initialises CUDA and allocates on GPU 0; without, finds torch's
/// package. The error is the last line the job printed.
pub async fn sandbox_probe(sandbox: &Sandbox, python: &PythonEnv, scratch: &Path, gpu: bool) -> Result<(), String> {
    std::fs::create_dir_all(scratch).map_err(|e| format!("scratch {}: {e}", scratch.display()))?;
    // Without a GPU, a look at torch's package is enough (an import takes seconds): the interpreter, its standard
    // library and torch's files are within the job's reach.
    let script = if gpu {
        "import torch; torch.zeros(1, device='cuda'); print('ok')"
    } else {
        "import importlib.util as u; open(u.find_spec('torch').origin).close(); print('ok')"
    };
    let job = Job {
        program: python.python.clone(),
        args: vec!["-c".into(), script.into()],
        env: python.env_on(scratch, gpu.then_some(0)),
        scratch: scratch.to_owned(),
        readable: python.readable.clone(),
        writable: vec![],
        limits: Limits { wall: Duration::from_secs(120), ..Limits::default() },
    };
    let finished = sandbox.run(job, CancellationToken::new()).await.map_err(|e| e.to_string())?;
    if finished.success() {
        return Ok(());
    }
    let stderr = finished.stderr_tail(2000);
    Err(stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no error text").trim().to_owned())
}

/// The process of one harness stage: where it runs and what it may touch, fixed when it starts.
#[derive(Debug)]
pub struct Stage {
    pub scratch: PathBuf,
    pub readable: Vec<PathBuf>,
    pub writable: Vec<PathBuf>,
    pub env: Vec<(OsString, OsString)>,
    pub wall: Duration,
    /// Yields the CPU to stages on a device (compiles): see [`Limits::nice`].
    pub background: bool,
}

/// What a started stage is asked to do: its mode's spec, and environment variables known only now (the device of
/// the lane it was given).
#[derive(Debug)]
pub struct Request<S> {
    pub spec: S,
    pub env: Vec<(String, String)>,
    /// How long each call into candidate code may run (stages that run candidate code); see [`converse`].
    pub limits: Option<CallLimits>,
}

/// How long a call into candidate code may run before its stage is stopped as hung. A call is what follows the
/// harness's `call` message up to its next message: loading the module, building the model, one forward call of
/// a trial, a census mode's calls, one timed call. Its limit counts from the message, while the stage runs.
#[derive(Debug, Clone)]
pub struct CallLimits {
    /// A call that waits (on its device, or asleep): a kernel that never ends uses no CPU time while the harness
    /// waits for it (the harness waits for its GPU asleep).
    pub call: Duration,
    /// A call busy on the CPU for at least half of the time (JIT compiles, autotuning, host code; running or
    /// runnable, so a call starved by a loaded machine counts: `Control::cpu_demand`): it may run
    /// this long, checked every second.
    pub busy: Duration,
    /// How `call` was chosen, for the error a hung stage gets.
    pub basis: String,
}

impl<S: StageSpec> Request<S> {
    /// A request with no environment of its own and no call limits.
    pub fn plain(spec: S) -> Self {
        Self { spec, env: vec![], limits: None }
    }

    pub fn mode(&self) -> Mode {
        self.spec.mode()
    }
}

/// Why a stage gave no outcome.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// The harness answered in another protocol version: a harness file of another kforge version (evaluators
    /// sharing a work directory must be of one version).
    #[error(
        "the {mode} stage's harness speaks protocol version {}, this evaluator {PROTOCOL_VERSION}: the harness \
         file belongs to another kforge version (evaluators sharing a work directory must be of one version)",
        harness.map_or("none".to_owned(), |v| v.to_string())
    )]
    Protocol { mode: &'static str, harness: Option<u64> },
}

/// A stage that ran: how it ended and the result it wrote, if any.
#[derive(Debug)]
pub struct StageOutcome<R> {
    pub finished: Finished,
    pub result: Option<Report<R>>,
    /// How long it ran alone on its device and waited at the device's gate.
    pub gate: MemberTimes,
    /// Why it was stopped as hung: a call into candidate code ran past its [`CallLimits`].
    pub hung: Option<String>,
    /// How long it spent in calls into candidate code (announced by the harness; see [`converse`]), a call still
    /// open at its end included: what a stage killed at its wall-clock limit is charged to the candidate.
    pub in_calls: Duration,
    /// Its place at the device's gate, kept after the process ended until the caller lets it go
    /// ([`StageOutcome::leave_gate`]): a device left in doubt (a kill, a fault) is checked first.
    membership: Option<Arc<Member>>,
}

/// How a stage takes part in its device's [`Gate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joining {
    /// Shares the device from its first step (waiting while timed work runs); `solo` keeps the device to itself.
    Share { solo: bool },
    /// Joins idle and asks to share before it uses the device: trusted stages only (no candidate code runs in
    /// them, so they do no device work while they say they are idle).
    Idle,
}

impl Joining {
    /// The harness's `spec.gate`.
    fn role(self) -> GateRole {
        match self {
            Joining::Share { .. } => GateRole::Share,
            Joining::Idle => GateRole::Idle,
        }
    }
}

impl<R> StageOutcome<R> {
    /// Leaves the device's gate: other members may run alone without this stage from now on.
    pub fn leave_gate(&mut self) {
        self.membership = None;
    }

    /// The result's `ok` flag; false when there is no result.
    pub fn ok(&self) -> bool {
        self.finished.success() && self.result.as_ref().is_some_and(|r| r.ok)
    }

    /// The error text the harness reported, or the end of stderr, or what is known of how the stage ended.
    pub fn error_text(&self) -> String {
        if let Some(error) = self.result.as_ref().and_then(|r| r.error.as_deref()) {
            return error.to_owned();
        }
        let stderr = self.finished.stderr_tail(4000);
        if !stderr.trim().is_empty() {
            return stderr;
        }
        match &self.result {
            None => format!("ended ({:?}) without a readable result", self.finished.exit),
            Some(_) => format!("ended ({:?}) and reported failure without an error", self.finished.exit),
        }
    }

    /// The CPU time the stage reported for itself and the children it waited for, in milliseconds.
    pub fn cpu_ms(&self) -> Option<f64> {
        self.result.as_ref()?.cpu_ms
    }

    /// The harness's exception type name, when it reported one.
    pub fn error_type(&self) -> Option<&str> {
        self.result.as_ref()?.error_type.as_deref()
    }

    /// How long the stage ran, less its waits at the device's gate (its wall clock is held there).
    pub fn running(&self) -> Duration {
        self.finished.wall.saturating_sub(self.gate.waited)
    }

    /// Whether a stage killed at its wall-clock limit spent most of its running time in the candidate's calls,
    /// rather than in the harness's own work (making inputs, copying and checking outputs): only then is the
    /// timeout the candidate's.
    pub fn candidate_used_its_time(&self) -> bool {
        self.in_calls.as_secs_f64() >= 0.5 * self.running().as_secs_f64()
    }
}

/// A harness process started before its request: its interpreter starts and imports torch meanwhile, off the
/// device's time. Dropped without a request, the process is killed.
#[derive(Debug)]
pub struct Started {
    request: Option<tokio::sync::oneshot::Sender<(Vec<u8>, Option<Conversation>)>>,
    finished: tokio::task::JoinHandle<Result<Finished, SandboxError>>,
    result_path: PathBuf,
    /// What the conversation saw: calls into candidate code, and why it stopped the stage as hung, if it did.
    watch: Arc<Mutex<Watch>>,
}

/// What a stage's conversation records for its outcome.
#[derive(Debug, Default)]
struct Watch {
    hung: Option<String>,
    /// Time in calls into candidate code that ended, and when the open one began.
    in_calls: Duration,
    open_call: Option<tokio::time::Instant>,
    /// Whether candidate code may have run: a call was announced.
    called: bool,
}

impl Watch {
    fn call_starts(&mut self) {
        self.call_ends();
        self.called = true;
        self.open_call = Some(tokio::time::Instant::now());
    }

    fn call_ends(&mut self) {
        if let Some(since) = self.open_call.take() {
            self.in_calls += since.elapsed();
        }
    }
}

/// What a stage's conversation serves: its place at the gate, and the limits of its calls.
#[derive(Debug)]
struct Conversation {
    member: Arc<Member>,
    limits: Option<CallLimits>,
}

/// Starts the harness for `stage`; its wall-clock limit counts from [`Started::run`].
pub fn start(
    sandbox: &Sandbox,
    python: &PythonEnv,
    harness: &Path,
    stage: Stage,
    cancel: CancellationToken,
) -> Started {
    let mut readable = stage.readable;
    readable.extend(python.readable.iter().cloned());
    readable.extend(harness.parent().map(Path::to_owned));
    let result_path = stage.scratch.join("result.json");
    let job = Job {
        program: python.python.clone(),
        args: vec![harness.into()],
        env: stage.env,
        scratch: stage.scratch,
        readable,
        writable: stage.writable,
        limits: Limits {
            wall: stage.wall,
            nice: if stage.background { 10 } else { 0 },
            cpus: python.stage_cpus.clone(),
            ..Limits::default()
        },
    };
    let (request, delivered) = tokio::sync::oneshot::channel::<(Vec<u8>, Option<Conversation>)>();
    let sandbox = sandbox.clone();
    // The conversation comes with the request, and goes to `converse` once the request is delivered.
    let conversation = Arc::new(Mutex::new(None));
    let input = {
        let conversation = conversation.clone();
        async move {
            let (bytes, joined) = delivered.await.ok()?;
            *conversation.lock().expect("never poisoned") = joined;
            Some(bytes)
        }
    };
    let watch = Arc::new(Mutex::new(Watch::default()));
    let converse = {
        let watch = watch.clone();
        move |control, socket| async move {
            let joined = conversation.lock().expect("never poisoned").take();
            if let Some(Conversation { member, limits }) = joined {
                match converse(&member, &control, socket, limits.as_ref(), &watch).await {
                    // The harness's socket closes as its interpreter shuts down; a stage that closed it and runs
                    // on would use the device outside the gate.
                    Ended::Closed => tokio::time::sleep(CLOSED_GRACE).await,
                    Ended::Broken => {}
                    Ended::Hung(reason) => {
                        tracing::info!(%reason, "stopping a stage whose call never returned");
                        watch.lock().expect("never poisoned").hung = Some(reason);
                    }
                }
                // Unless it ended meanwhile (this future is dropped then).
                control.kill();
            }
        }
    };
    let finished = tokio::spawn(async move { sandbox.run_with_control(job, input, converse, cancel).await });
    Started { request: Some(request), finished, result_path, watch }
}

/// The longest message the harness sends on its control socket.
const MESSAGE_BYTES: u64 = 64;

/// How long a stage may run on after closing its control socket (its interpreter shutting down).
const CLOSED_GRACE: Duration = Duration::from_secs(5);

/// How a stage's conversation ended.
#[derive(Debug)]
enum Ended {
    /// The stage closed its socket.
    Closed,
    /// The stage sent what the harness never sends.
    Broken,
    /// A call ran past its limit: why.
    Hung(String),
}

/// Serves a stage's gate requests, one line each, answered with `go` once granted:
///
/// - `alone`: run alone on the device; `share`: share it again (or start to, from idle);
/// - `pause`: a pause point between steps of shared work; it pauses only while someone runs alone or waits to;
/// - `idle`: host work only from now on (trusted stages; see [`Joining::Idle`]);
///
/// and two notices, not answered: `call`, a call into candidate code starts (see [`CallLimits`]), and `timed`,
/// a timed call starts (its process waits for the GPU spinning: no longer limit for CPU use). A call still
/// running at its limit ends the conversation with the reason; the caller kills the stage.
///
/// While it waits, the stage is stopped and its wall clock held: it is at a pause point, its device work
/// synchronised, and it is not working. A message it does not know, or may not send, kills the stage: only
/// candidate code forging the harness's messages sends one, and a stage left outside the gate could use the device
/// while others run alone.
async fn converse(
    member: &Member,
    control: &Control,
    socket: tokio::net::UnixStream,
    limits: Option<&CallLimits>,
    watch: &Mutex<Watch>,
) -> Ended {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let (read, mut write) = socket.into_split();
    let mut read = BufReader::new(read);
    let mut line = Vec::new();
    let mut call: Option<Call> = None;
    loop {
        let check_at = call.as_ref().map(|call| call.check_at);
        // A message cut short by a check keeps its bytes in `line`; the limit counts over the whole message.
        let mut message = (&mut read).take(MESSAGE_BYTES.saturating_sub(line.len() as u64));
        tokio::select! {
            read = message.read_until(b'\n', &mut line) => match read {
                Ok(n) if n > 0 && line.ends_with(b"\n") => {}
                Ok(0) if line.is_empty() => return Ended::Closed,
                _ => return Ended::Broken,
            },
            () = sleep_until(check_at) => {
                let call = call.as_mut().expect("a deadline comes with a call");
                let limits = limits.expect("a call is watched only with limits");
                match call.check(limits, control.cpu_demand()) {
                    Ok(()) => continue,
                    Err(reason) => return Ended::Hung(reason),
                }
            }
        }
        let message = std::mem::take(&mut line);
        call = None;
        watch.lock().expect("never poisoned").call_ends();
        match &message[..] {
            b"call\n" | b"timed\n" => {
                watch.lock().expect("never poisoned").call_starts();
                // A timed call's CPU use says nothing (it spins), so its CPU time is not read (a /proc scan).
                let spinning = message == b"timed\n";
                let cpu = if spinning { None } else { control.cpu_demand() };
                call = limits.map(|limits| Call::new(limits, cpu, spinning));
                continue;
            }
            b"alone\n" => stopped(control, member.alone()).await,
            b"share\n" => stopped(control, member.share()).await,
            b"pause\n" if member.must_pause() => stopped(control, member.share()).await,
            b"pause\n" => {}
            b"idle\n" if member.idle() => {}
            _ => return Ended::Broken,
        }
        if write.write_all(b"go\n").await.is_err() {
            return Ended::Closed;
        }
    }
}

/// Resolves at `at`, or never.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A call into candidate code, as its conversation watches it.
#[derive(Debug)]
struct Call {
    since: tokio::time::Instant,
    /// When its CPU time was last read, and what it was.
    checked: (tokio::time::Instant, Option<Duration>),
    check_at: tokio::time::Instant,
    /// A timed call: it waits for its GPU spinning, so CPU use does not tell it from a hang.
    spinning: bool,
}

impl Call {
    fn new(limits: &CallLimits, cpu: Option<Duration>, spinning: bool) -> Self {
        let now = tokio::time::Instant::now();
        Self { since: now, checked: (now, cpu), check_at: now + limits.call, spinning }
    }

    /// At `check_at`: `Ok` (checked again later) while the call is busy on the CPU and within the busy limit,
    /// else why it is hung.
    fn check(&mut self, limits: &CallLimits, cpu: Option<Duration>) -> Result<(), String> {
        let now = tokio::time::Instant::now();
        let ran = now - self.since;
        let busy = match (self.checked.1, cpu) {
            _ if self.spinning => false,
            (Some(before), Some(after)) => {
                let wall = (now - self.checked.0).as_secs_f64();
                wall > 0.0 && after.saturating_sub(before).as_secs_f64() / wall >= 0.5
            }
            _ => false,
        };
        if busy && ran < limits.busy {
            self.checked = (now, cpu);
            self.check_at = (now + Duration::from_secs(1)).min(self.since + limits.busy);
            return Ok(());
        }
        Err(if self.spinning {
            format!(
                "a timed call of the candidate did not return within {:.1} s: a kernel that never ends ({})",
                ran.as_secs_f64(),
                limits.basis
            )
        } else if busy {
            format!(
                "a call into the candidate's code was still running, busy on the CPU, after {:.1} s (the limit for \
                 calls busy on the CPU)",
                ran.as_secs_f64()
            )
        } else {
            format!(
                "a call into the candidate's code did not return within {:.1} s and was waiting, not computing on \
                 the CPU: a kernel that never ends ({})",
                ran.as_secs_f64(),
                limits.basis
            )
        })
    }
}

/// Waits for `turn` with the stage stopped and its wall clock held.
async fn stopped(control: &Control, turn: impl std::future::Future<Output = ()>) {
    control.stop();
    turn.await;
    control.resume();
}

impl Started {
    /// Sends `request` and waits for the stage to end. With a `gate`, the stage joins its device as `Joining`
    /// says and may ask to run alone (`spec.gate`); it keeps its place there until the outcome leaves it.
    ///
    /// A result in another protocol version is [`StageError::Protocol`] where the harness wrote it: in trusted
    /// modes, and in the candidate's before its first call into candidate code. After that call it may be candidate
    /// code's forgery, and reads as no result (the candidate's failure, not the evaluator's). The compile stage has
    /// no calls announced (no control channel): a forged version there reads as the harness's.
    pub async fn run<S: StageSpec>(
        mut self,
        request: Request<S>,
        gate: Option<(&Arc<Gate>, Joining)>,
    ) -> Result<StageOutcome<S::Result>, StageError> {
        let mode = request.mode();
        let role = gate.map_or(GateRole::None, |(_, joining)| joining.role());
        let message = protocol::encode(&request.spec, &self.result_path, role, &request.env);
        let member = match gate {
            Some((gate, Joining::Share { solo })) => Some(Arc::new(gate.join(solo).await)),
            Some((gate, Joining::Idle)) => Some(Arc::new(gate.join_idle())),
            None => None,
        };
        let clock = member.as_deref().map(Member::clock).unwrap_or_default();
        let conversation = member.clone().map(|member| Conversation { member, limits: request.limits });
        if let Some(sender) = self.request.take() {
            let _ = sender.send((message, conversation));
        }
        // If this future is dropped (the evaluation was cancelled), `self` goes with it and the child is killed.
        let finished = match (&mut self.finished).await {
            Ok(result) => result?,
            Err(join) => return Err(StageError::Sandbox(SandboxError::Wait(std::io::Error::other(join.to_string())))),
        };
        let (hung, in_calls, called) = {
            let mut watch = self.watch.lock().expect("never poisoned");
            watch.call_ends();
            (watch.hung.take(), watch.in_calls, watch.called)
        };
        let result_path = &self.result_path;
        let result = match std::fs::read(result_path) {
            Ok(bytes) => match protocol::decode(&bytes) {
                Decoded::Report(report) => Some(report),
                Decoded::Version { harness } if mode.trusted() || !called => {
                    return Err(StageError::Protocol { mode: mode.name(), harness });
                }
                Decoded::Version { harness } => {
                    tracing::warn!(?harness, path = %result_path.display(), "a stage result of another protocol version, written after candidate code ran");
                    None
                }
                Decoded::Unreadable(error) => {
                    tracing::warn!(%error, bytes = bytes.len(), path = %result_path.display(), "unreadable stage result");
                    None
                }
            },
            Err(_) => None,
        };
        Ok(StageOutcome { finished, result, gate: clock.times(), hung, in_calls, membership: member })
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        // Kills a process never asked, or abandoned mid-way; a no-op once it finished.
        self.finished.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An environment as probed, without GPUs, with or without CUDA.
    fn env_with(cuda_home: Option<PathBuf>) -> PythonEnv {
        PythonEnv {
            python: "/venv/bin/python".into(),
            versions: BTreeMap::new(),
            gpus: vec![],
            readable: vec![],
            cuda_home,
            nvcc: None,
            stock_builds: false,
            bindings_pch: Arc::default(),
            gpu_stage_threads: None,
            timing_cpus: Vec::new(),
            stage_cpus: Vec::new(),
        }
    }

    /// Runs `script` (sh) as a stage on `gate` with call limits of 1 s waiting and 2 s busy.
    fn shell_stage(
        script: &str,
        gate: &Arc<Gate>,
    ) -> tokio::task::JoinHandle<Result<StageOutcome<protocol::CompileResult>, StageError>> {
        let dir = std::env::temp_dir().join(format!("kforge-python-{}-{}", std::process::id(), script.len()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch");
        let path = dir.join("stage.sh");
        std::fs::write(&path, script).expect("script");
        let env = PythonEnv { python: "/bin/sh".into(), ..env_with(None) };
        let stage = Stage {
            scratch: dir.clone(),
            readable: vec![],
            writable: vec![],
            env: vec![],
            wall: Duration::from_secs(600),
            background: false,
        };
        let started = start(&Sandbox::basic(), &env, &path, stage, CancellationToken::new());
        let limits = CallLimits { call: Duration::from_secs(1), busy: Duration::from_secs(2), basis: "test".into() };
        let spec = protocol::CompileSpec { candidate_path: dir.join("candidate.py") };
        let request = Request { spec, env: vec![], limits: Some(limits) };
        let gate = gate.clone();
        tokio::spawn(async move { started.run(request, Some((&gate, Joining::Share { solo: false }))).await })
    }

    /// Waits (polling) until `gate` has `members`.
    async fn members(gate: &Gate, members: usize) {
        tokio::time::timeout(Duration::from_secs(30), async {
            while gate.members() != members {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("members joined");
    }

    #[tokio::test]
    async fn a_call_that_never_returns_is_stopped_and_its_neighbour_then_runs_alone() {
        // Asleep in its call (as a process waiting on a kernel that never ends), and spinning on the CPU.
        let cases = [
            ("printf 'call\\n' >&3; exec sleep 3600", "did not return within"),
            ("printf 'call\\n' >&3; while :; do :; done", "busy on the CPU"),
            // A timed call spins while it waits for its GPU: its CPU use earns it no longer limit.
            ("printf 'timed\\n' >&3; while :; do :; done", "timed call of the candidate did not return within 1.0"),
        ];
        for (script, says) in cases {
            let gate = Arc::new(Gate::default());
            let hung = shell_stage(script, &gate);
            members(&gate, 1).await;
            // A neighbour that wants to run alone: the hung stage never reaches a pause point.
            let neighbour = Arc::new(gate.join(false).await);
            let alone = tokio::spawn({
                let neighbour = neighbour.clone();
                async move { neighbour.alone().await }
            });
            let outcome = hung.await.expect("task").expect("the stage ran");
            let reason = outcome.hung.clone().expect("stopped as hung");
            assert!(reason.contains(says), "{reason}");
            assert_eq!(outcome.finished.exit, kforge_sandbox::Exit::Signal(9), "killed: {:?}", outcome.finished);
            // Until the caller has checked the device and lets the stage go, nobody runs alone.
            assert!(!alone.is_finished(), "the killed stage still holds its place");
            drop(outcome);
            tokio::time::timeout(Duration::from_secs(30), alone).await.expect("runs alone").expect("task");
        }
    }

    #[test]
    fn gpu_stages_get_the_thread_limit_and_cpu_stages_do_not() {
        let mut env = env_with(None);
        let threads = |env: &[(String, String)]| {
            env.iter().filter(|(k, _)| k.ends_with("_NUM_THREADS")).cloned().collect::<Vec<_>>()
        };
        assert!(threads(&env.device_env(Some(0))).is_empty(), "no limit set: torch's default");
        env.limit_gpu_stage_threads(2);
        let two = |name: &str| (name.to_owned(), "2".to_owned());
        assert_eq!(threads(&env.device_env(Some(0))), [two("OMP_NUM_THREADS"), two("MKL_NUM_THREADS")]);
        assert_eq!(threads(&env.gpu_threads_env()), threads(&env.device_env(Some(0))));
        assert!(threads(&env.device_env(None)).is_empty(), "a CPU stage keeps torch's threads");
    }

    #[test]
    fn the_stock_recipe_leaves_builds_as_load_inline_makes_them() {
        let mut env = env_with(Some("/usr/local/cuda".into()));
        let names = |env: &PythonEnv| {
            let mut all: Vec<String> =
                env.env(Path::new("/scratch")).into_iter().map(|(k, _)| k.to_string_lossy().into_owned()).collect();
            all.extend(env.compile_env().0.into_iter().map(|(k, _)| k.to_string_lossy().into_owned()));
            all
        };
        env.use_build_recipe(BuildRecipe::Kforge, Path::new("/work/harness/kforge_nvcc.py"));
        env.offer_bindings_pch("/work/pch/key".into());
        let kforge = names(&env);
        assert!(kforge.contains(&"PYTORCH_NVCC".into()) && kforge.contains(&"CPATH".into()), "{kforge:?}");
        assert!(kforge.contains(&"KFORGE_HOST_PCH".into()), "{kforge:?}");
        assert!(!kforge.contains(&"KFORGE_BUILD_RECIPE".into()));
        assert_eq!(env.compile_env().1, [PathBuf::from("/work/pch/key")], "the header is readable to compiles");

        env.use_build_recipe(BuildRecipe::Stock, Path::new("/work/harness/kforge_nvcc.py"));
        let stock = names(&env);
        assert!(stock.contains(&"KFORGE_BUILD_RECIPE".into()), "{stock:?}");
        assert!(!stock.contains(&"PYTORCH_NVCC".into()) && !stock.contains(&"CPATH".into()), "{stock:?}");
        assert!(!stock.contains(&"KFORGE_HOST_PCH".into()), "{stock:?}");
    }
}
