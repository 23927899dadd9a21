//! The Python side: the interpreter probed (versions, devices, paths), the environment and the CPUs each stage
//! gets, and whether torch works in the sandbox. The stages' processes are `crate::stage`'s.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kforge_sandbox::{Command, Limits, Sandbox, resolve_on_path};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::config::BuildRecipe;

/// The files written to the work directory's `harness/` at start, by path under it, embedded so that the binary
/// is self-contained: the harness package (`kforge_harness/`, every module of it; a stage runs
/// `python harness/kforge_harness`), and kforge's nvcc (the host and device front ends side by side), which builds
/// name in `PYTORCH_NVCC`.
pub const HARNESS_FILES: &[(&str, &str)] = &[
    ("kforge_harness/__init__.py", include_str!("../harness/kforge_harness/__init__.py")),
    ("kforge_harness/__main__.py", include_str!("../harness/kforge_harness/__main__.py")),
    ("kforge_harness/build.py", include_str!("../harness/kforge_harness/build.py")),
    ("kforge_harness/census.py", include_str!("../harness/kforge_harness/census.py")),
    ("kforge_harness/compare.py", include_str!("../harness/kforge_harness/compare.py")),
    ("kforge_harness/gate.py", include_str!("../harness/kforge_harness/gate.py")),
    ("kforge_harness/inputs.py", include_str!("../harness/kforge_harness/inputs.py")),
    ("kforge_harness/integrity.py", include_str!("../harness/kforge_harness/integrity.py")),
    ("kforge_harness/modes.py", include_str!("../harness/kforge_harness/modes.py")),
    ("kforge_harness/outputs.py", include_str!("../harness/kforge_harness/outputs.py")),
    ("kforge_harness/process.py", include_str!("../harness/kforge_harness/process.py")),
    ("kforge_harness/protocol.py", include_str!("../harness/kforge_harness/protocol.py")),
    ("kforge_harness/timing.py", include_str!("../harness/kforge_harness/timing.py")),
    (NVCC_WRAPPER, include_str!("../harness/kforge_nvcc.py")),
];

/// The harness package under the harness directory: what every stage's interpreter runs.
pub const HARNESS_PACKAGE: &str = "kforge_harness";

/// kforge's nvcc under the harness directory.
pub const NVCC_WRAPPER: &str = "kforge_nvcc.py";

/// A digest of the harness's source, every file of the package by path and contents: part of the keys of cached
/// references and baselines, which depend on how the harness makes inputs and measures (a new harness computes
/// them again rather than comparing with stale ones). kforge's nvcc is not in it: it builds, and builds are keyed
/// on their own.
pub fn harness_digest() -> &'static str {
    static DIGEST: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let package = HARNESS_FILES.iter().filter(|(path, _)| path.starts_with(HARNESS_PACKAGE));
        let parts: Vec<&[u8]> = package.flat_map(|(path, contents)| [path.as_bytes(), contents.as_bytes()]).collect();
        crate::cache::key(&parts)
    });
    &DIGEST
}

/// Why the configured interpreter cannot run candidates (not found, failing, without torch): every request is
/// refused with this until it is fixed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PythonUnavailable(pub String);

/// Why torch does not work inside a sandbox: the last line the probe printed, or why it could not run.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct SandboxProbeFailed(pub String);

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
    /// Where torch's extension header, precompiled for the bindings, lies once built (`crate::precompiled_header`).
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
    pub async fn probe(python: &Path, scratch: &Path) -> Result<Self, PythonUnavailable> {
        let unavailable = PythonUnavailable;
        std::fs::create_dir_all(scratch).map_err(|e| unavailable(format!("scratch {}: {e}", scratch.display())))?;
        let python =
            &resolve_on_path(python).ok_or_else(|| unavailable(format!("{} is not on PATH", python.display())))?;
        let command = Command {
            program: python.to_owned(),
            args: vec!["-c".into(), PROBE.into()],
            env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
            scratch: scratch.to_owned(),
            readable: vec![],
            writable: vec![],
            limits: Limits { wall: Duration::from_secs(120), ..Limits::default() },
        };
        let finished = Sandbox::basic()
            .run(command, CancellationToken::new())
            .await
            .map_err(|e| unavailable(format!("cannot run {}: {e}", python.display())))?;
        if !finished.success() {
            return Err(unavailable(format!("{} failed: {}", python.display(), finished.stderr_tail(2000))));
        }
        let probe: Probe = serde_json::from_slice(&finished.stdout)
            .map_err(|e| unavailable(format!("{} gave an unreadable probe: {e}", python.display())))?;
        let Some(torch) = probe.torch.clone() else {
            return Err(unavailable(format!(
                "{} (python {}) cannot import torch: {}",
                python.display(),
                probe.python,
                probe.torch_error.unwrap_or_default()
            )));
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
        Ok(Self { versions, gpus: probe.devices, readable, ..Self::bare(python, cuda_home) })
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
    /// precompiled prefix of nvcc's host compile for kforge's nvcc (`KFORGE_HOST_PCH`: the headers a source starts with, compiled once), and the directory to read
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

    /// The CPUs every stage starts on (empty: all of this process's).
    pub fn stage_cpus(&self) -> &[usize] {
        &self.stage_cpus
    }

    /// An environment with nothing probed yet: no versions, GPUs or readable paths, the stock build settings and
    /// no CPUs kept. `probe` fills in what it learns; tests use it as it is.
    pub(crate) fn bare(python: PathBuf, cuda_home: Option<PathBuf>) -> Self {
        Self {
            python,
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
pub async fn sandbox_probe(
    sandbox: &Sandbox,
    python: &PythonEnv,
    scratch: &Path,
    gpu: bool,
) -> Result<(), SandboxProbeFailed> {
    std::fs::create_dir_all(scratch).map_err(|e| SandboxProbeFailed(format!("scratch {}: {e}", scratch.display())))?;
    // Without a GPU, a look at torch's package is enough (an import takes seconds): the interpreter, its standard
    // library and torch's files are within the job's reach.
    let script = if gpu {
        "import torch; torch.zeros(1, device='cuda'); print('ok')"
    } else {
        "import importlib.util as u; open(u.find_spec('torch').origin).close(); print('ok')"
    };
    let command = Command {
        program: python.python.clone(),
        args: vec!["-c".into(), script.into()],
        env: python.env_on(scratch, gpu.then_some(0)),
        scratch: scratch.to_owned(),
        readable: python.readable.clone(),
        writable: vec![],
        limits: Limits { wall: Duration::from_secs(120), ..Limits::default() },
    };
    let finished =
        sandbox.run(command, CancellationToken::new()).await.map_err(|e| SandboxProbeFailed(e.to_string()))?;
    if finished.success() {
        return Ok(());
    }
    let stderr = finished.stderr_tail(2000);
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no error text");
    Err(SandboxProbeFailed(last.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every module of the package is embedded (a module left out would fail to import in every stage), and nothing
    /// else is: the package's own folder, as the source tree has it.
    #[test]
    fn every_file_of_the_harness_package_is_embedded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("harness").join(HARNESS_PACKAGE);
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("the harness package")
            .map(|entry| entry.expect("an entry").file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".py"))
            .map(|name| format!("{HARNESS_PACKAGE}/{name}"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = HARNESS_FILES
            .iter()
            .map(|(path, _)| (*path).to_owned())
            .filter(|path| path.starts_with(HARNESS_PACKAGE))
            .collect();
        embedded.sort();
        assert_eq!(embedded, on_disk);
        for (path, contents) in HARNESS_FILES {
            let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("harness").join(path);
            assert_eq!(std::fs::read_to_string(&file).expect("an embedded file"), *contents, "{path}");
        }
        assert!(HARNESS_FILES.iter().any(|(path, _)| *path == NVCC_WRAPPER));
    }

    #[test]
    fn the_harness_digest_covers_every_module_of_the_package() {
        let modules = HARNESS_FILES.iter().filter(|(path, _)| path.starts_with(HARNESS_PACKAGE));
        let parts: Vec<&[u8]> = modules.flat_map(|(path, contents)| [path.as_bytes(), contents.as_bytes()]).collect();
        assert_eq!(harness_digest(), crate::cache::key(&parts));
        let mut changed = parts.clone();
        let last = changed.len() - 1;
        changed[last] = b"# another timing module";
        assert_ne!(harness_digest(), crate::cache::key(&changed));
    }

    fn env_with(cuda_home: Option<PathBuf>) -> PythonEnv {
        PythonEnv::bare("/venv/bin/python".into(), cuda_home)
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
