//! `kforge doctor`: what this machine can do for kforge and, where it cannot, why and how to fix it.
//!
//! The evaluator and the profiler start in this process on ephemeral ports and answer `GetCapabilities` from the
//! probes a served one runs (the interpreter and its GPUs, the sandbox's protections, Nsight Compute and the
//! counters' driver setting, the disk budget); the rest is read off the host: the NVIDIA driver, the compilers,
//! `/dev/shm` and the configured ports. [`checks`] turns that [`Evidence`] into findings, a pure function the tests
//! drive with evidence of their own. The command fails (exit status 1) only where the evaluator cannot run.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kforge_proto::v1 as pb;
use serde::Serialize;

use crate::mesh::{Mesh, MeshConfig, Service};

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Works.
    Ok,
    /// Works less well than it could, or something kforge would need is missing; the evaluator still runs.
    Warn,
    /// Not present on this machine, and not needed by what it can run (the GPU checks on a CPU machine).
    Off,
    /// The evaluator cannot run candidates.
    Fail,
}

impl State {
    fn label(self) -> &'static str {
        match self {
            State::Ok => "ok",
            State::Warn => "WARN",
            State::Off => "off",
            State::Fail => "FAIL",
        }
    }
}

/// One finding: what was checked, how it came out, what was seen and, where it is not ok, what to do.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub name: String,
    pub state: State,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn new(name: impl Into<String>, state: State, detail: impl Into<String>) -> Self {
        Self { name: name.into(), state, detail: detail.into(), fix: None }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// A program found on this machine and its version line, or why it was not.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: &'static str,
    pub version: Result<String, String>,
}

/// A filesystem's free and total bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Space {
    pub available: u64,
    pub total: u64,
}

/// A configured listening address, and whether it can be bound now.
#[derive(Debug, Clone, PartialEq)]
pub struct Port {
    /// The configuration table it comes from, e.g. `evaluator` or `orchestrator.http`.
    pub section: String,
    pub address: SocketAddr,
    pub free: Result<(), String>,
}

/// What the doctor read off this machine.
#[derive(Debug, Clone)]
pub struct Evidence {
    /// The evaluator's capabilities, or why it did not start.
    pub evaluator: Result<pb::GetCapabilitiesResponse, String>,
    /// The profiler's capabilities, or why it did not start.
    pub profiler: Result<pb::ProfilerCapabilities, String>,
    /// `[evaluator].work_dir`.
    pub work_dir: PathBuf,
    /// The NVIDIA driver's version line (`/proc/driver/nvidia/version`), where a driver is loaded.
    pub driver: Option<String>,
    /// `c++` and `nvcc`.
    pub compilers: Vec<Tool>,
    /// `/dev/shm`, where it exists.
    pub shm: Option<Space>,
    pub ports: Vec<Port>,
}

/// The report: every check, and whether the evaluator can run here.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub evaluator_can_run: bool,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(checks: Vec<Check>) -> Self {
        Self { evaluator_can_run: checks.iter().all(|c| c.state != State::Fail), checks }
    }

    /// One line per check, its fix indented below it, and a closing verdict.
    pub fn render(&self) -> String {
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let mut out = String::new();
        for check in &self.checks {
            out += &format!("{:<4}  {:<width$}  {}\n", check.state.label(), check.name, check.detail);
            if let Some(fix) = &check.fix {
                out += &format!("{:<4}  {:<width$}  fix: {fix}\n", "", "");
            }
        }
        out += if self.evaluator_can_run {
            "\nThe evaluator can run candidates here.\n"
        } else {
            "\nThe evaluator cannot run candidates here: see FAIL above.\n"
        };
        out
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

/// Every check, in the order a reader fixes them: the evaluator, the GPU stack, the sandbox, space, ports.
pub fn checks(evidence: &Evidence) -> Vec<Check> {
    let mut checks = Vec::new();
    let gpus: Vec<&str> = match &evidence.evaluator {
        Ok(caps) => caps.devices.iter().map(String::as_str).filter(|d| *d != "cpu").collect(),
        Err(_) => Vec::new(),
    };
    let has_gpu = !gpus.is_empty();

    checks.push(evaluator_check(&evidence.evaluator));
    if let Ok(caps) = &evidence.evaluator
        && !caps.versions.is_empty()
    {
        let mut versions: Vec<String> =
            caps.versions.iter().map(|(name, version)| format!("{name} {version}")).collect();
        versions.sort();
        checks.push(Check::new("versions", State::Ok, versions.join(", ")));
    }
    checks.push(gpu_check(&gpus));
    checks.push(match &evidence.driver {
        Some(line) => Check::new("nvidia driver", State::Ok, line.clone()),
        None if has_gpu => {
            Check::new("nvidia driver", State::Warn, "GPUs are visible but /proc/driver/nvidia/version is not")
        }
        None => Check::new("nvidia driver", State::Off, "no NVIDIA driver loaded (/proc/driver/nvidia/version)"),
    });
    for tool in &evidence.compilers {
        checks.push(compiler_check(tool, has_gpu));
    }
    checks.extend(profiler_checks(&evidence.profiler, has_gpu));
    if let Ok(caps) = &evidence.evaluator {
        checks.extend(caps.sandbox.iter().map(|p| sandbox_check(p, has_gpu)));
        checks.push(disk_check(caps.disk_budget_bytes, &evidence.work_dir));
    }
    checks.push(shm_check(evidence.shm, evidence.evaluator.as_ref().ok().map(|c| c.memory_files_bytes)));
    checks.extend(evidence.ports.iter().map(port_check));
    checks
}

fn evaluator_check(evaluator: &Result<pb::GetCapabilitiesResponse, String>) -> Check {
    match evaluator {
        Err(error) => Check::new("evaluator", State::Fail, format!("did not start: {error}"))
            .fix("the error names the setting; `kforge doctor` reads the configuration `kforge up` reads"),
        Ok(caps) if caps.backends.is_empty() => {
            Check::new("evaluator", State::Fail, format!("cannot run candidates: {}", caps.python)).fix(
                "run scripts/setup.sh (a .venv with PyTorch and ninja), or set [evaluator].python to an \
                 interpreter that imports torch",
            )
        }
        Ok(caps) => {
            let backends: Vec<String> = caps
                .backends
                .iter()
                .map(|b| match pb::Backend::try_from(*b) {
                    Ok(backend) => backend.as_str_name().trim_start_matches("BACKEND_").to_lowercase(),
                    Err(_) => b.to_string(),
                })
                .collect();
            Check::new("evaluator", State::Ok, format!("backends {} with {}", backends.join(", "), caps.python))
        }
    }
}

fn gpu_check(gpus: &[&str]) -> Check {
    if gpus.is_empty() {
        return Check::new("gpus", State::Off, "no GPU visible to PyTorch: the cpu backend only").fix(
            "for the cuda and triton backends: an NVIDIA GPU, its driver, and a CUDA build of PyTorch \
             (`torch.cuda.is_available()`)",
        );
    }
    let quarantined: Vec<&str> = gpus.iter().copied().filter(|g| g.contains(" quarantined: ")).collect();
    if quarantined.is_empty() {
        Check::new("gpus", State::Ok, gpus.join("; "))
    } else {
        Check::new("gpus", State::Warn, gpus.join("; ")).fix(
            "a quarantined GPU failed its health probe: check it (nvidia-smi -q, dmesg), then restart the evaluator",
        )
    }
}

fn compiler_check(tool: &Tool, has_gpu: bool) -> Check {
    match (&tool.version, tool.name) {
        (Ok(version), name) => Check::new(name, State::Ok, version.clone()),
        (Err(why), "nvcc") if has_gpu => {
            Check::new("nvcc", State::Warn, format!("{why}: CUDA candidates cannot build"))
                .fix("install the CUDA toolkit, or put its bin/ on PATH (CUDA_HOME is read too)")
        }
        (Err(why), "nvcc") => Check::new("nvcc", State::Off, why.clone()),
        (Err(why), name) => Check::new(name, State::Warn, format!("{why}: candidates' C++ extensions cannot build"))
            .fix("install a C++ compiler (Debian: apt-get install g++)"),
    }
}

fn profiler_checks(profiler: &Result<pb::ProfilerCapabilities, String>, has_gpu: bool) -> Vec<Check> {
    let missing = if has_gpu { State::Warn } else { State::Off };
    let caps = match profiler {
        Ok(caps) => caps,
        Err(error) => return vec![Check::new("profiler", State::Warn, format!("did not start: {error}"))],
    };
    let ncu = if caps.ncu_version.is_empty() {
        Check::new("nsight compute", missing, caps.ncu.clone())
            .fix("install Nsight Compute (it ships with the CUDA toolkit), or set [profiler].ncu")
    } else {
        Check::new("nsight compute", State::Ok, format!("{} ({})", caps.ncu_version, caps.ncu))
    };
    let counters = if caps.counters_permitted {
        Check::new("gpu counters", State::Ok, caps.counters.clone())
    } else {
        Check::new("gpu counters", missing, caps.counters.clone()).fix(
            "as root: `echo 'options nvidia NVreg_RestrictProfilingToAdminUsers=0' > \
             /etc/modprobe.d/nvidia-profiling.conf`, then reload the nvidia module (or reboot)",
        )
    };
    vec![ncu, counters]
}

fn sandbox_check(protection: &pb::SandboxProtection, has_gpu: bool) -> Check {
    let name = format!("sandbox {}", protection.name);
    if protection.active {
        return Check::new(name, State::Ok, protection.detail.clone());
    }
    if protection.name == "device_health_probe" && !has_gpu {
        return Check::new(name, State::Off, protection.detail.clone());
    }
    let fix = match protection.name.as_str() {
        "landlock" => Some("a kernel with Landlock (5.13 or later) in its LSM list (`lsm=...,landlock`)"),
        "command_user" => Some("run the evaluator as root: it then runs each job as a user of its own"),
        "process_limit" => Some("a pids cgroup the evaluator may write (cgroup v1 pids, or a delegated v2 subtree)"),
        "network_namespace" => Some("unprivileged user namespaces, or the evaluator run as root"),
        "device_health_probe" => Some(
            "build it beside kforge: `cargo build --locked --bin kforge-device-probe` (with `--release` beside \
                 target/release/kforge)",
        ),
        _ => None,
    };
    let check = Check::new(name, State::Warn, protection.detail.clone());
    match fix {
        Some(fix) => check.fix(fix),
        None => check,
    }
}

/// Below this, a single large task's outputs may not fit: evaluations wait for room, or are refused.
const DISK_BUDGET_FLOOR: u64 = 2 << 30;

fn disk_check(budget: u64, work_dir: &Path) -> Check {
    let detail = format!("{} for evaluations' files under {}", gib(budget), work_dir.display());
    if budget < DISK_BUDGET_FLOOR {
        Check::new("disk", State::Warn, detail).fix(format!(
            "free space there, or set [evaluator].work_dir to a larger disk (its budget is 60% of the free space, \
             or [evaluator].disk_budget_bytes); under {}, large tasks wait or are refused",
            gib(DISK_BUDGET_FLOOR)
        ))
    } else {
        Check::new("disk", State::Ok, detail)
    }
}

/// Below this, PyTorch's and the candidates' shared memory can run out.
const SHM_FLOOR: u64 = 1 << 30;

fn shm_check(shm: Option<Space>, memory_files_bytes: Option<u64>) -> Check {
    let Some(space) = shm else {
        return Check::new("/dev/shm", State::Warn, "missing").fix("mount a tmpfs at /dev/shm");
    };
    let outputs = match memory_files_bytes {
        Some(0) => "; candidates' output files go to disk".to_owned(),
        Some(bytes) => format!("; up to {} of candidates' output files kept there", gib(bytes)),
        None => String::new(),
    };
    let detail = format!("{} free of {}{outputs}", gib(space.available), gib(space.total));
    if space.available < SHM_FLOOR {
        Check::new("/dev/shm", State::Warn, detail).fix(
            "a larger /dev/shm: docker run --shm-size=8g, or in Kubernetes an emptyDir with medium Memory at /dev/shm",
        )
    } else {
        Check::new("/dev/shm", State::Ok, detail)
    }
}

fn port_check(port: &Port) -> Check {
    let name = format!("port {}", port.section);
    match &port.free {
        Ok(()) => Check::new(name, State::Ok, format!("{} free", port.address)),
        Err(error) => {
            Check::new(name, State::Warn, format!("{}: {error}: `kforge up` cannot listen there", port.address)).fix(
                format!(
                    "stop what holds it (another kforge?), or set [{}].listen",
                    if port.section.contains('.') { port.section.clone() } else { format!("{}.server", port.section) }
                ),
            )
        }
    }
}

/// Reads this machine: the configured ports first (before anything of the doctor's own listens), then the
/// evaluator's and the profiler's capabilities from instances started in this process, then the host.
pub async fn gather(config: &MeshConfig) -> Evidence {
    let ports = configured_ports(config);
    let (evaluator, profiler) = match Mesh::start(&[Service::Evaluator, Service::Profiler], config, true).await {
        Ok(mesh) => {
            let evaluator = evaluator_capabilities(&mesh).await;
            let profiler = profiler_capabilities(&mesh).await;
            // Their answers are in hand: how the doctor's own instances drain is not part of the report.
            mesh.shutdown().await.ok();
            (evaluator, profiler)
        }
        Err(error) => (Err(error.to_string()), Err(error.to_string())),
    };
    let compilers = vec![
        Tool { name: "c++", version: version_line("c++", &["--version"], |out| out.lines().next()).await },
        Tool { name: "nvcc", version: version_line(&nvcc(), &["--version"], |out| out.lines().last()).await },
    ];
    Evidence {
        evaluator,
        profiler,
        work_dir: config.evaluator.work_dir.clone(),
        driver: std::fs::read_to_string("/proc/driver/nvidia/version")
            .ok()
            .and_then(|text| text.lines().next().map(|line| line.split_whitespace().collect::<Vec<_>>().join(" "))),
        compilers,
        shm: shm_space(Path::new("/dev/shm")),
        ports,
    }
}

fn configured_ports(config: &MeshConfig) -> Vec<Port> {
    let mut ports: Vec<(String, SocketAddr)> =
        Service::ALL.iter().map(|service| (service.name().to_owned(), config.listen(*service))).collect();
    if let Ok(address) = config.orchestrator.http.listen.parse() {
        ports.push(("orchestrator.http".to_owned(), address));
    }
    ports
        .into_iter()
        .map(|(section, address)| {
            let free = TcpListener::bind(address).map(drop).map_err(|error| error.to_string());
            Port { section, address, free }
        })
        .collect()
}

async fn evaluator_capabilities(mesh: &Mesh) -> Result<pb::GetCapabilitiesResponse, String> {
    let address = mesh.address(Service::Evaluator).ok_or("the evaluator did not start")?;
    let channel = kforge_server::client::connect(address, &Default::default()).await.map_err(|e| e.to_string())?;
    pb::evaluator_client::EvaluatorClient::new(channel)
        .get_capabilities(pb::GetCapabilitiesRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| status.message().to_owned())
}

async fn profiler_capabilities(mesh: &Mesh) -> Result<pb::ProfilerCapabilities, String> {
    let address = mesh.address(Service::Profiler).ok_or("the profiler did not start")?;
    let channel = kforge_server::client::connect(address, &Default::default()).await.map_err(|e| e.to_string())?;
    pb::profiler_client::ProfilerClient::new(channel)
        .get_capabilities(pb::GetProfilerCapabilitiesRequest::default())
        .await
        .map(tonic::Response::into_inner)
        .map_err(|status| status.message().to_owned())
}

/// `nvcc` on PATH, else under CUDA_HOME, else the toolkit's usual place.
fn nvcc() -> String {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).any(|dir| dir.join("nvcc").is_file()))
        .unwrap_or(false);
    if on_path {
        return "nvcc".to_owned();
    }
    let home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".to_owned());
    Path::new(&home).join("bin/nvcc").display().to_string()
}

/// A program's version line, picked from its output by `pick`; or why there is none.
async fn version_line(program: &str, args: &[&str], pick: fn(&str) -> Option<&str>) -> Result<String, String> {
    let output =
        tokio::time::timeout(Duration::from_secs(20), tokio::process::Command::new(program).args(args).output())
            .await
            .map_err(|_| format!("{program} did not answer within 20 s"))?
            .map_err(|error| match error.kind() {
                std::io::ErrorKind::NotFound => format!("{program} not found"),
                _ => format!("{program}: {error}"),
            })?;
    let text = String::from_utf8_lossy(&output.stdout);
    match pick(&text).map(str::trim).filter(|line| !line.is_empty()) {
        Some(line) if output.status.success() => Ok(line.to_owned()),
        _ => Err(format!("{program} --version failed ({})", output.status)),
    }
}

fn shm_space(path: &Path) -> Option<Space> {
    Some(Space {
        available: kforge_execution::disk::available_bytes(path)?,
        total: kforge_execution::disk::total_bytes(path)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn protection(name: &str, active: bool, detail: &str) -> pb::SandboxProtection {
        pb::SandboxProtection { name: name.into(), active, detail: detail.into() }
    }

    fn cpu_machine() -> Evidence {
        Evidence {
            evaluator: Ok(pb::GetCapabilitiesResponse {
                backends: vec![pb::Backend::Cpu as i32],
                devices: vec!["cpu".into()],
                sandbox: vec![
                    protection("landlock", true, "kernel abi 7"),
                    protection("device_health_probe", false, "no GPU to probe"),
                ],
                versions: [("python".to_owned(), "3.11.2".to_owned()), ("torch".to_owned(), "2.15.0".to_owned())]
                    .into(),
                python: "/repo/.venv/bin/python".into(),
                disk_budget_bytes: 40 << 30,
                ..Default::default()
            }),
            profiler: Ok(pb::ProfilerCapabilities {
                ncu: "Nsight Compute (ncu) not found: not on PATH".into(),
                counters: "no NVIDIA driver parameters".into(),
                ..Default::default()
            }),
            work_dir: PathBuf::from("/tmp/kforge"),
            driver: None,
            compilers: vec![
                Tool { name: "c++", version: Ok("c++ (Debian 12.2.0-14) 12.2.0".into()) },
                Tool { name: "nvcc", version: Err("nvcc not found".into()) },
            ],
            shm: Some(Space { available: 8 << 30, total: 8 << 30 }),
            ports: vec![Port {
                section: "evaluator".into(),
                address: "127.0.0.1:50052".parse().expect("address"),
                free: Ok(()),
            }],
        }
    }

    fn gpu_machine() -> Evidence {
        let mut evidence = cpu_machine();
        if let Ok(caps) = &mut evidence.evaluator {
            caps.backends = vec![pb::Backend::Cpu as i32, pb::Backend::Cuda as i32, pb::Backend::Triton as i32];
            caps.devices = vec!["cpu".into(), "cuda:0 NVIDIA H200 (sm 9.0)".into()];
            caps.sandbox[1] = protection(
                "device_health_probe",
                false,
                "kforge-device-probe is neither next to this executable nor on PATH",
            );
        }
        evidence.driver = Some("NVRM version: NVIDIA UNIX x86_64 Kernel Module 580.95.05".into());
        evidence
    }

    fn find<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no check {name}: {checks:?}"))
    }

    #[test]
    fn a_cpu_machine_runs_the_evaluator_and_reports_the_gpu_stack_off_not_failed() {
        let checks = checks(&cpu_machine());
        let report = Report::new(checks.clone());
        assert!(report.evaluator_can_run, "{checks:?}");
        assert_eq!(find(&checks, "evaluator").state, State::Ok);
        assert_eq!(find(&checks, "evaluator").detail, "backends cpu with /repo/.venv/bin/python");
        for name in ["gpus", "nvidia driver", "nvcc", "nsight compute", "gpu counters", "sandbox device_health_probe"] {
            assert_eq!(find(&checks, name).state, State::Off, "{name}");
        }
        assert_eq!(find(&checks, "sandbox landlock").state, State::Ok);
        assert_eq!(find(&checks, "versions").detail, "python 3.11.2, torch 2.15.0");
    }

    #[test]
    fn an_interpreter_without_torch_fails_the_evaluator_naming_why_and_the_fix() {
        let mut evidence = cpu_machine();
        if let Ok(caps) = &mut evidence.evaluator {
            caps.backends.clear();
            caps.devices.clear();
            caps.versions.clear();
            caps.python = "/usr/bin/python3 (python 3.11.2) cannot import torch".into();
        }
        let checks = checks(&evidence);
        let evaluator = find(&checks, "evaluator");
        assert_eq!(evaluator.state, State::Fail);
        assert!(evaluator.detail.contains("cannot import torch"), "{evaluator:?}");
        assert!(evaluator.fix.as_deref().is_some_and(|fix| fix.contains("scripts/setup.sh")));
        assert!(!Report::new(checks).evaluator_can_run);
    }

    #[test]
    fn an_evaluator_that_did_not_start_fails() {
        let mut evidence = cpu_machine();
        evidence.evaluator = Err("work_dir /proc/x: permission denied".into());
        let report = Report::new(checks(&evidence));
        assert!(!report.evaluator_can_run);
        assert!(report.render().contains("FAIL  evaluator"), "{}", report.render());
    }

    #[test]
    fn on_a_gpu_machine_missing_gpu_tools_are_warnings_that_name_their_fix() {
        let checks = checks(&gpu_machine());
        assert!(Report::new(checks.clone()).evaluator_can_run);
        assert_eq!(find(&checks, "evaluator").detail, "backends cpu, cuda, triton with /repo/.venv/bin/python");
        assert_eq!(find(&checks, "gpus").state, State::Ok);
        assert_eq!(find(&checks, "nvidia driver").state, State::Ok);
        let counters = find(&checks, "gpu counters");
        assert_eq!(counters.state, State::Warn);
        assert!(counters.fix.as_deref().is_some_and(|fix| fix.contains("NVreg_RestrictProfilingToAdminUsers=0")));
        assert_eq!(find(&checks, "nvcc").state, State::Warn);
        assert_eq!(find(&checks, "nsight compute").state, State::Warn);
        let probe = find(&checks, "sandbox device_health_probe");
        assert_eq!(probe.state, State::Warn);
        assert!(probe.fix.as_deref().is_some_and(|fix| fix.contains("--bin kforge-device-probe")));
    }

    #[test]
    fn a_quarantined_gpu_a_small_disk_a_small_shm_and_a_taken_port_are_warnings() {
        let mut evidence = gpu_machine();
        if let Ok(caps) = &mut evidence.evaluator {
            caps.devices[1] = "cuda:0 NVIDIA H200 (sm 9.0) quarantined: the probe did not finish within 60 s".into();
            caps.disk_budget_bytes = 1 << 30;
        }
        evidence.shm = Some(Space { available: 64 << 20, total: 64 << 20 });
        evidence.ports[0].free = Err("Address already in use (os error 98)".into());
        let checks = checks(&evidence);
        for name in ["gpus", "disk", "/dev/shm", "port evaluator"] {
            let check = find(&checks, name);
            assert_eq!(check.state, State::Warn, "{check:?}");
            assert!(check.fix.is_some(), "{check:?}");
        }
        assert!(
            find(&checks, "port evaluator").fix.as_deref().is_some_and(|f| f.contains("[evaluator.server].listen"))
        );
        assert!(Report::new(checks).evaluator_can_run, "warnings do not stop the evaluator");
    }

    #[test]
    fn the_json_names_each_state_in_lower_case_and_leaves_out_absent_fixes() {
        let report = Report::new(checks(&cpu_machine()));
        let json = serde_json::to_value(&report).expect("serialises");
        assert_eq!(json["evaluator_can_run"], true);
        let evaluator = &json["checks"][0];
        assert_eq!(evaluator["name"], "evaluator");
        assert_eq!(evaluator["state"], "ok");
        assert!(evaluator.get("fix").is_none());
    }
}
