//! Runs untrusted programs (candidate kernels and the harness around them) so that one crashed, hung or hostile
//! candidate costs one verdict and never the service.
//!
//! Every job gets: its own process group (killed as a whole on timeout, cancellation or drop), a scrubbed
//! environment (only what the caller passes), a scratch directory as working directory and `TMPDIR`, resource
//! limits (CPU seconds, file size, open files, no core dumps), a wall-clock limit, capped
//! stdout/stderr, death with the parent (`PR_SET_PDEATHSIG`), and, where the kernel allows, no network (a fresh
//! network namespace), a read-only view of the filesystem except the directories the job may write (Landlock, which
//! also keeps its signals to its own processes from abi 6), a cap on its processes (a pids cgroup), and where the
//! evaluator is root a user of its own (`users`: RLIMIT_NPROC, no signals to or tracing of other processes).
//!
//! [`Sandbox::detect`] probes which of the optional protections work on this host, once; the evaluator reports
//! them through `GetCapabilities`. A protection that cannot be enforced is reported, never silently assumed.
//!
//! Restrictions are applied between `fork` and `exec` using only raw system calls (no allocation), because the
//! parent is multi-threaded: the Landlock ruleset is built in the parent and only its file descriptor crosses.

use std::ffi::OsString;
use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

mod cgroup;
mod users;

use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, path_beneath_rules};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// System locations every job may read (and execute from): libraries, compilers, device nodes, `/proc`.
pub const SYSTEM_READABLE: &[&str] =
    &["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys", "/dev", "/run"];

/// Why a job could not be run (as opposed to a job that ran and failed, which is a [`Finished`]).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot start {program}: {source}")]
    Spawn { program: PathBuf, source: std::io::Error },
    #[error("cannot wait for the job: {0}")]
    Wait(std::io::Error),
    #[error("landlock ruleset: {0}")]
    Landlock(String),
}

/// One protection and whether it is enforced on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protection {
    pub name: &'static str,
    pub active: bool,
    pub detail: String,
}

/// Resource limits of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock time before the whole process group is killed.
    pub wall: Duration,
    /// CPU seconds (RLIMIT_CPU), summed over the job's threads.
    pub cpu_seconds: u64,
    /// Largest file the job may write (RLIMIT_FSIZE).
    pub file_bytes: u64,
    /// Open file descriptors (RLIMIT_NOFILE).
    pub open_files: u64,
    /// Bytes of stdout and of stderr kept; the rest is read and dropped so the job never blocks on a full pipe.
    pub output_bytes: usize,
    /// Scheduling niceness (0 to 19): a background job yields the CPU to the others.
    pub nice: i32,
    /// Processes and threads of the job at once (its pids cgroup's `pids.max`), where the host allows one.
    pub processes: u64,
    /// The CPUs the job starts on (its affinity); empty: those of the caller.
    pub cpus: Vec<usize>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            wall: Duration::from_secs(120),
            cpu_seconds: 600,
            file_bytes: 2 << 30,
            open_files: 4096,
            output_bytes: 64 * 1024,
            nice: 0,
            // torch.compile's workers (one per core, up to 32) with their threads stay well under this.
            processes: 2048,
            cpus: Vec::new(),
        }
    }
}

/// A program to run in the sandbox.
#[derive(Debug, Clone)]
pub struct Job {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// The whole environment of the job; nothing is inherited.
    pub env: Vec<(OsString, OsString)>,
    /// Working directory and `TMPDIR`; always writable.
    pub scratch: PathBuf,
    /// Further paths the job may read (the interpreter's installation, its input files). With Landlock active,
    /// nothing else is readable but [`SYSTEM_READABLE`], the scratch directory and `writable`; the evaluator's
    /// caches stay out of a candidate's view.
    pub readable: Vec<PathBuf>,
    /// Further directories the job may write (e.g. the compile cache during a compile).
    pub writable: Vec<PathBuf>,
    pub limits: Limits,
}

/// The caller's hold on a running job in a conversation (see [`Sandbox::run_with_control`]).
#[derive(Debug)]
pub struct Control {
    /// The job's process group, to stop and continue it.
    pub group: libc::pid_t,
    /// The job's own user and group, when it has one: its signals reach every process of that user too (one that
    /// left the group with `setsid`).
    user: Option<(u32, u32)>,
    clock: tokio::sync::watch::Sender<Clock>,
}

/// The job's wall clock: time spent stopped by the caller does not count against its limit.
#[derive(Debug, Default, Clone, Copy)]
struct Clock {
    held_since: Option<Instant>,
    held: Duration,
}

impl Control {
    /// Stops the job's process group (`SIGSTOP`) and its wall clock: it waits for the caller and does no work.
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        self.clock.send_if_modified(|clock| {
            let starts = clock.held_since.is_none();
            clock.held_since.get_or_insert_with(Instant::now);
            starts
        });
    }

    /// Restarts the job's wall clock and continues its process group (`SIGCONT`) after [`Control::stop`].
    pub fn resume(&self) {
        self.clock.send_if_modified(|clock| match clock.held_since.take() {
            Some(since) => {
                clock.held += since.elapsed();
                true
            }
            None => false,
        });
        self.signal(libc::SIGCONT);
    }

    /// Kills the job's process group (`SIGKILL`): for a job that broke the conversation's protocol. Only while the
    /// job is known to be running (it has just spoken), so the group cannot have been reused.
    pub fn kill(&self) {
        self.signal(libc::SIGKILL);
    }

    /// How long the job's process group has wanted a CPU so far: the CPU time it used (its processes' own, and
    /// that of the children they waited for) plus the time its threads waited runnable in a run queue
    /// (`/proc/<pid>/task/<tid>/schedstat`), so that a process starved by others on a loaded machine still counts
    /// as busy, not as waiting. `None` where `/proc` does not say.
    pub fn cpu_demand(&self) -> Option<Duration> {
        let cpu = self.cpu_time()?;
        let mut waited_ns = 0u64;
        for pid in self.pids() {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { continue };
            for task in tasks.flatten() {
                let Ok(schedstat) = std::fs::read_to_string(task.path().join("schedstat")) else { continue };
                // on-CPU ns, run-queue wait ns, time slices
                waited_ns += schedstat.split_whitespace().nth(1).and_then(|w| w.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        Some(cpu + Duration::from_nanos(waited_ns))
    }

    /// The processes of the job's group now.
    fn pids(&self) -> Vec<i32> {
        let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
        entries
            .flatten()
            .filter_map(|entry| {
                let pid = entry.file_name().to_str()?.parse::<i32>().ok()?;
                let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
                let (_, fields) = stat.rsplit_once(')')?;
                (fields.split_whitespace().nth(2)?.parse::<i32>().ok()? == self.group).then_some(pid)
            })
            .collect()
    }

    /// CPU time the job's process group has used so far: its processes' own, and that of the children they
    /// waited for. `None` where `/proc` does not say.
    pub fn cpu_time(&self) -> Option<Duration> {
        // SAFETY: sysconf reads a constant.
        #[allow(unsafe_code)]
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if ticks <= 0 {
            return None;
        }
        let mut total = 0u64;
        let mut found = false;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<i32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            // The command name is in parentheses and may hold spaces; the fields after it are numbers.
            let Some((_, fields)) = stat.rsplit_once(')') else { continue };
            let fields: Vec<&str> = fields.split_whitespace().collect();
            // state ppid pgrp ... utime(11) stime(12) cutime(13) cstime(14), counted from the state.
            if fields.len() < 15 || fields[2].parse::<i32>() != Ok(self.group) {
                continue;
            }
            let field = |index: usize| fields[index].parse::<u64>().unwrap_or(0);
            total += field(11) + field(12);
            if pid == self.group {
                total += field(13) + field(14);
            }
            found = true;
        }
        found.then(|| Duration::from_secs_f64(total as f64 / ticks as f64))
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: killpg takes plain integers; a group already gone returns ESRCH, which is fine.
        #[allow(unsafe_code)]
        unsafe {
            libc::killpg(self.group, signal);
        }
        if let Some((uid, gid)) = self.user {
            users::signal_all_of(uid, gid, signal);
        }
    }
}

/// The CPUs this process may run on (its affinity), in order; empty where the kernel does not say.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity writes only it, CPU_ISSET reads it.
    #[allow(unsafe_code)]
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&cpu| libc::CPU_ISSET(cpu, &set)).collect()
    }
}

/// Resolves when the job has run `wall` since `started`, not counting the time its clock was held.
async fn deadline(wall: Duration, started: Instant, mut clock: tokio::sync::watch::Receiver<Clock>) {
    loop {
        let now = *clock.borrow_and_update();
        if now.held_since.is_some() {
            if clock.changed().await.is_err() {
                return std::future::pending().await;
            }
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep_until((started + wall + now.held).into()) => return,
            changed = clock.changed() => {
                if changed.is_err() {
                    // The caller's side is gone: the clock runs on as it stood.
                    tokio::time::sleep_until((started + wall + now.held).into()).await;
                    return;
                }
            }
        }
    }
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal (its own fault: a segfault, an abort, RLIMIT_CPU's SIGXCPU...).
    Signal(i32),
    /// Ran past its wall-clock limit; the sandbox killed the group.
    TimedOut,
    /// The caller cancelled it; the sandbox killed the group.
    Cancelled,
}

/// A finished job.
#[derive(Debug, Clone)]
pub struct Finished {
    pub exit: Exit,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Whether stdout or stderr went over `output_bytes` and was cut.
    pub output_truncated: bool,
    /// From the start, or for a job given its input later, from the input's delivery, to the end.
    pub wall: Duration,
}

impl Finished {
    pub fn success(&self) -> bool {
        self.exit == Exit::Code(0)
    }

    /// The end of stderr as text, for error messages.
    pub fn stderr_tail(&self, bytes: usize) -> String {
        let start = self.stderr.len().saturating_sub(bytes);
        String::from_utf8_lossy(&self.stderr[start..]).into_owned()
    }
}

/// The sandbox of this host: which optional protections work, probed once.
#[derive(Debug, Clone)]
pub struct Sandbox {
    network_namespace: bool,
    landlock: Option<ABI>,
    pids: Option<cgroup::PidsCgroups>,
    /// What the pids cgroup probe found: where job cgroups go, or why there are none.
    cgroup_report: Result<String, String>,
    users: Option<std::sync::Arc<users::JobUsers>>,
    protections: Vec<Protection>,
}

/// Which optional protections to try; one an operator switches off is reported as disabled. Deserialisable, so
/// services take it straight from their configuration (e.g. `[evaluator.sandbox]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxOptions {
    /// A fresh network namespace per job (no network).
    pub network_namespace: bool,
    /// Landlock: jobs read only system paths and the paths they are given, and write only their scratch.
    pub landlock: bool,
    /// A pids cgroup per job: a cap on its processes and threads (`Limits::processes`), and every process of the
    /// job killed at its end, also those that left its process group.
    pub process_limit: bool,
    /// Where the evaluator is root: each job runs as a user of its own (`job_user_base` and up, group
    /// `job_user_base`), so RLIMIT_NPROC caps its processes and it can signal and trace no other process.
    pub job_users: bool,
    /// The first job user id; the pool has [`JOB_USERS`] ids, unused by anything else on the host.
    pub job_user_base: u32,
}

pub use users::JOB_USERS;

impl Default for SandboxOptions {
    fn default() -> Self {
        Self {
            network_namespace: true,
            landlock: true,
            process_limit: true,
            job_users: true,
            job_user_base: 2_100_000_000,
        }
    }
}

impl Sandbox {
    /// Probes the optional protections by running `/bin/true` under each.
    pub async fn detect() -> Self {
        Self::detect_with(SandboxOptions::default()).await
    }

    /// Probes the optional protections that `options` allows.
    pub async fn detect_with(options: SandboxOptions) -> Self {
        let mut sandbox = Self::basic();
        // The probes' own scratch: a job's scratch is handed to its user.
        let scratch = std::env::temp_dir().join(format!("kforge-sandbox-probe-{}", std::process::id()));
        if let Err(error) = std::fs::create_dir_all(&scratch) {
            tracing::warn!(%error, dir = %scratch.display(), "the sandbox's probe directory");
        }
        let probe = |sandbox: &Sandbox| {
            let sandbox = sandbox.clone();
            let scratch = scratch.clone();
            async move {
                let job = Job {
                    program: "/bin/true".into(),
                    args: vec![],
                    env: vec![],
                    scratch,
                    readable: vec![],
                    writable: vec![],
                    limits: Limits { wall: Duration::from_secs(10), ..Limits::default() },
                };
                sandbox.run(job, CancellationToken::new()).await
            }
        };

        let disabled = || "disabled by configuration".to_owned();
        let network_detail = if options.network_namespace {
            sandbox.network_namespace = true;
            let network = probe(&sandbox).await;
            sandbox.network_namespace = matches!(&network, Ok(f) if f.success());
            match &network {
                Ok(f) if f.success() => "fresh network namespace per job (loopback only, down)".to_owned(),
                Ok(f) => {
                    format!("unshare(CLONE_NEWNET) failed in the probe ({:?}); jobs keep the host network", f.exit)
                }
                Err(e) => format!("probe failed: {e}"),
            }
        } else {
            disabled()
        };

        let landlock_detail = if options.landlock {
            sandbox.landlock = Some(ABI::V5);
            let landlock = probe(&sandbox).await;
            if !matches!(&landlock, Ok(f) if f.success()) {
                sandbox.landlock = None;
            }
            match &landlock {
                Ok(f) if f.success() => {
                    let abi = landlock_kernel_abi();
                    let scoped = if abi >= 6 {
                        "signals and abstract unix sockets limited to the job's own processes"
                    } else {
                        "signals not scoped (needs abi 6)"
                    };
                    format!(
                        "reads limited to system and named paths, writes to scratch and named directories; \
                         {scoped} (kernel abi {abi})"
                    )
                }
                Ok(f) => {
                    format!("landlock unavailable ({:?}); the filesystem is protected only by permissions", f.exit)
                }
                Err(e) => format!("landlock unavailable: {e}"),
            }
        } else {
            disabled()
        };
        let landlock_ok = sandbox.landlock.is_some();

        let users_detail = if options.job_users {
            match users::JobUsers::detect(options.job_user_base) {
                Ok(users) => {
                    let detail = format!(
                        "{}: one per running job; it cannot signal or trace the evaluator or other jobs, and all \
                         of its processes are killed at the job's end",
                        users.describe()
                    );
                    sandbox.users = Some(users);
                    let probe = probe(&sandbox).await;
                    if matches!(&probe, Ok(f) if f.success()) {
                        detail
                    } else {
                        sandbox.users = None;
                        format!("a job could not run as its own user ({probe:?})")
                    }
                }
                Err(reason) => reason,
            }
        } else {
            disabled()
        };

        let cap = Limits::default().processes;
        sandbox.cgroup_report = if options.process_limit {
            match cgroup::PidsCgroups::detect() {
                Ok(pids) => {
                    let detail = format!(
                        "{}: at most {cap} processes and threads per job; all of a job's processes killed at its end",
                        pids.describe()
                    );
                    sandbox.pids = Some(pids);
                    let probe = probe(&sandbox).await;
                    if matches!(&probe, Ok(f) if f.success()) {
                        Ok(detail)
                    } else {
                        sandbox.pids = None;
                        Err(format!("a job could not join its cgroup ({probe:?})"))
                    }
                }
                Err(reason) => Err(reason),
            }
        } else {
            Err(disabled())
        };
        let _ = std::fs::remove_dir_all(&scratch);
        sandbox.protections = vec![
            Protection { name: "process_group", active: true, detail: "own process group, killed as a whole".into() },
            Protection { name: "scrubbed_env", active: true, detail: "only the variables the evaluator passes".into() },
            Protection {
                name: "scratch_dir",
                active: true,
                detail: "fresh working directory and TMPDIR per job".into(),
            },
            Protection { name: "rlimits", active: true, detail: "cpu, file size, open files, no core dumps".into() },
            Protection {
                name: "wall_clock_kill",
                active: true,
                detail: "group SIGKILL at the wall-clock limit".into(),
            },
            Protection { name: "output_caps", active: true, detail: "stdout and stderr capped".into() },
            Protection {
                name: "parent_death",
                active: true,
                detail: "PR_SET_PDEATHSIG: jobs die with the evaluator".into(),
            },
            Protection { name: "network_namespace", active: sandbox.network_namespace, detail: network_detail },
            Protection { name: "landlock", active: landlock_ok, detail: landlock_detail },
            Protection { name: "job_user", active: sandbox.users.is_some(), detail: users_detail },
            sandbox.process_limit(),
        ];
        for p in sandbox.protections.iter().filter(|p| !p.active) {
            tracing::warn!(protection = p.name, detail = %p.detail, "sandbox protection unavailable");
        }
        sandbox
    }

    /// A sandbox with only the always-available protections (for hosts where probing is not wanted).
    pub fn basic() -> Self {
        Self {
            network_namespace: false,
            landlock: None,
            pids: None,
            cgroup_report: Err("not probed".into()),
            users: None,
            protections: Vec::new(),
        }
    }

    /// Which protections are enforced.
    pub fn protections(&self) -> &[Protection] {
        &self.protections
    }

    /// Whether Landlock restricts jobs.
    pub fn landlock_active(&self) -> bool {
        self.landlock.is_some()
    }

    /// This sandbox without Landlock, reporting `reason` (for hosts where a job's own needs, such as a GPU
    /// driver, conflict with it).
    pub fn without_landlock(&self, reason: String) -> Self {
        let mut sandbox = self.clone();
        sandbox.landlock = None;
        for protection in sandbox.protections.iter_mut().filter(|p| p.name == "landlock") {
            protection.active = false;
            protection.detail = reason.clone();
        }
        sandbox
    }

    /// This sandbox with jobs running as the evaluator's user, reporting `reason` (for hosts where a job's own
    /// needs, such as an interpreter under a private home directory, are out of a job user's reach).
    pub fn without_job_users(&self, reason: String) -> Self {
        let mut sandbox = self.clone();
        sandbox.users = None;
        let limit = sandbox.process_limit();
        for protection in sandbox.protections.iter_mut() {
            match protection.name {
                "job_user" => (protection.active, protection.detail) = (false, reason.clone()),
                "process_limit" => *protection = limit.clone(),
                _ => {}
            }
        }
        sandbox
    }

    /// Whether jobs run as users of their own.
    pub fn job_users_active(&self) -> bool {
        self.users.is_some()
    }

    /// The process cap as it stands: the pids cgroup's, the job users' RLIMIT_NPROC, both or neither.
    fn process_limit(&self) -> Protection {
        let cap = Limits::default().processes;
        let detail = match (&self.cgroup_report, self.users.is_some()) {
            (Ok(detail), true) => format!("{detail}; and RLIMIT_NPROC of the job's own user"),
            (Ok(detail), false) => detail.clone(),
            (Err(reason), true) => format!(
                "RLIMIT_NPROC of the job's own user: at most {cap} processes and threads per job (no pids cgroup: \
                 {reason})"
            ),
            (Err(reason), false) => reason.clone(),
        };
        Protection { name: "process_limit", active: self.pids.is_some() || self.users.is_some(), detail }
    }

    /// Runs `job` to completion, timeout or cancellation. The process group is killed in every case before this
    /// returns, so nothing the job started outlives it; with a process limit, so is every process in the job's
    /// cgroup (one that left the group with `setsid` too).
    pub async fn run(&self, job: Job, cancel: CancellationToken) -> Result<Finished, SandboxError> {
        self.execute(job, None::<std::future::Ready<Option<Vec<u8>>>>, None::<NoConversation>, cancel).await
    }

    /// Runs `job` like [`Sandbox::run`], its stdin a pipe: the job starts at once, and what `input` resolves to
    /// is written to its stdin, which then closes. The wall-clock limit (and [`Finished::wall`]) counts from that
    /// moment, so a job can be started before the resource it needs is free and prepare while it waits. `None`
    /// from `input` cancels the job; a job that exits first is finished as it ended.
    pub async fn run_with_input(
        &self,
        job: Job,
        input: impl Future<Output = Option<Vec<u8>>>,
        cancel: CancellationToken,
    ) -> Result<Finished, SandboxError> {
        self.execute(job, Some(input), None::<NoConversation>, cancel).await
    }

    /// Runs `job` like [`Sandbox::run_with_input`], with a control channel: the job's file descriptor 3 is a
    /// stream socket whose other end goes to `converse`, with a [`Control`] of the job's process group and wall
    /// clock, once the input is delivered. `converse` runs until the job ends (it is dropped then) and may hold the
    /// job's clock while the job waits for it.
    pub async fn run_with_control<F, Fut>(
        &self,
        job: Job,
        input: impl Future<Output = Option<Vec<u8>>>,
        converse: F,
        cancel: CancellationToken,
    ) -> Result<Finished, SandboxError>
    where
        F: FnOnce(Control, tokio::net::UnixStream) -> Fut,
        Fut: Future<Output = ()>,
    {
        self.execute(job, Some(input), Some(converse), cancel).await
    }

    async fn execute<F, Fut>(
        &self,
        job: Job,
        input: Option<impl Future<Output = Option<Vec<u8>>>>,
        converse: Option<F>,
        cancel: CancellationToken,
    ) -> Result<Finished, SandboxError>
    where
        F: FnOnce(Control, tokio::net::UnixStream) -> Fut,
        Fut: Future<Output = ()>,
    {
        let ruleset = match self.landlock {
            Some(abi) => Some(landlock_ruleset(abi, &job)?),
            None => None,
        };
        let user = match &self.users {
            Some(users) => {
                let spawn_error = |source| SandboxError::Spawn { program: job.program.clone(), source };
                let user = users.take().ok_or_else(|| {
                    spawn_error(std::io::Error::other(format!("all {JOB_USERS} job users are in use")))
                })?;
                for dir in std::iter::once(&job.scratch).chain(&job.writable).filter(|dir| dir.exists()) {
                    users::share_with_group(dir, user.gid).map_err(spawn_error)?;
                }
                Some(user)
            }
            None => None,
        };
        let mut command = tokio::process::Command::new(&job.program);
        command.env_clear();
        if let Some(user) = &user {
            // Tools that look their user up (Python's getpass) find it here: job users are in no passwd file.
            let name = format!("kforge-job-{}", user.uid);
            command.env("USER", &name).env("LOGNAME", &name);
        }
        command
            .args(&job.args)
            .envs(job.env.iter().map(|(k, v)| (k, v)))
            .env("TMPDIR", &job.scratch)
            .current_dir(&job.scratch)
            .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // Both ends are close-on-exec; the child's end becomes its descriptor 3 (without the flag) in `apply`.
        let control = match converse {
            Some(_) => Some(
                std::os::unix::net::UnixStream::pair()
                    .map_err(|source| SandboxError::Spawn { program: job.program.clone(), source })?,
            ),
            None => None,
        };
        let cgroup = match &self.pids {
            Some(pids) => Some(
                pids.create(job.limits.processes)
                    .map_err(|source| SandboxError::Spawn { program: job.program.clone(), source })?,
            ),
            None => None,
        };
        let setup = ChildSetup {
            cgroup_procs_fd: cgroup.as_ref().map(cgroup::JobCgroup::procs_fd),
            limits: job.limits.clone(),
            network_namespace: self.network_namespace,
            landlock_fd: ruleset.as_ref().map(AsRawFd::as_raw_fd),
            control_fd: control.as_ref().map(|(_, child)| child.as_raw_fd()),
            user: user.as_ref().map(|user| (user.uid, user.gid)),
        };
        let job_user = setup.user;
        // SAFETY: `ChildSetup::apply` makes only async-signal-safe system calls on plain integers it owns; it
        // allocates nothing and touches no lock, as required between fork and exec in a multi-threaded parent.
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(move || setup.apply());
        }

        let mut started = Instant::now();
        let mut child =
            command.spawn().map_err(|source| SandboxError::Spawn { program: job.program.clone(), source })?;
        drop(ruleset);
        let ours = match control {
            Some((ours, theirs)) => {
                drop(theirs);
                ours.set_nonblocking(true).map_err(SandboxError::Wait)?;
                Some(tokio::net::UnixStream::from_std(ours).map_err(SandboxError::Wait)?)
            }
            None => None,
        };
        let pid = child.id().map(|pid| pid as libc::pid_t);
        let group = GroupKiller(pid);
        let stdout = tokio::spawn(read_capped(child.stdout.take(), job.limits.output_bytes));
        let stderr = tokio::spawn(read_capped(child.stderr.take(), job.limits.output_bytes));

        let exit = 'run: {
            if let Some(input) = input {
                // Taken first: waiting on the child closes a stdin it still holds.
                let pipe = child.stdin.take();
                let bytes = tokio::select! {
                    bytes = input => bytes,
                    status = child.wait() => break 'run exit_of(status.map_err(SandboxError::Wait)?),
                    () = cancel.cancelled() => None,
                };
                let (Some(bytes), Some(mut pipe)) = (bytes, pipe) else { break 'run Exit::Cancelled };
                // Written aside, so a job that never reads cannot hold this up; closing the pipe is the end.
                tokio::spawn(async move {
                    let _ = pipe.write_all(&bytes).await;
                });
                started = Instant::now();
            }
            let (clock, clock_seen) = tokio::sync::watch::channel(Clock::default());
            let conversation = async move {
                if let (Some(converse), Some(socket), Some(group)) = (converse, ours, pid) {
                    converse(Control { group, user: job_user, clock }, socket).await;
                }
                std::future::pending::<()>().await
            };
            tokio::select! {
                status = child.wait() => exit_of(status.map_err(SandboxError::Wait)?),
                () = deadline(job.limits.wall, started, clock_seen) => Exit::TimedOut,
                () = cancel.cancelled() => Exit::Cancelled,
                () = conversation => unreachable!("a conversation never ends by itself"),
            }
        };
        // Kill whatever is left of the group (the job itself on timeout, background children otherwise) and of
        // its cgroup (what left the group), so the pipes close and the readers finish.
        drop(group);
        // The cgroup's reads, kills and waits for emptiness block: off the async threads.
        let cgroup = match cgroup {
            Some(cgroup) => tokio::task::spawn_blocking(move || {
                cgroup.kill_all();
                cgroup
            })
            .await
            .ok(),
            None => None,
        };
        let _ = child.wait().await;
        if let Some(user) = user {
            // Every process of the job's user (one that left the group too) is gone before this returns.
            let _ = tokio::task::spawn_blocking(move || user.release()).await;
        }
        let (stdout, stdout_cut) = stdout.await.unwrap_or_default();
        let (stderr, stderr_cut) = stderr.await.unwrap_or_default();
        if let Some(cgroup) = cgroup {
            // Removed once its killed processes have exited; nothing waits for that.
            tokio::task::spawn_blocking(move || drop(cgroup));
        }
        Ok(Finished { exit, stdout, stderr, output_truncated: stdout_cut || stderr_cut, wall: started.elapsed() })
    }
}

fn exit_of(status: std::process::ExitStatus) -> Exit {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => Exit::Code(code),
        (None, Some(signal)) => Exit::Signal(signal),
        (None, None) => Exit::Signal(0),
    }
}

/// The conversation of a job that has none.
type NoConversation = fn(Control, tokio::net::UnixStream) -> std::future::Ready<()>;

/// SIGKILLs the process group when dropped.
struct GroupKiller(Option<libc::pid_t>);

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(pgid) = self.0 {
            // SAFETY: killpg takes plain integers; an already-empty group returns ESRCH, which is fine.
            #[allow(unsafe_code)]
            unsafe {
                libc::killpg(pgid, libc::SIGKILL);
            }
        }
    }
}

/// Reads up to `cap` bytes, then keeps draining so the writer never blocks; returns the bytes and whether it cut.
async fn read_capped(stream: Option<impl AsyncRead + Unpin>, cap: usize) -> (Vec<u8>, bool) {
    let Some(mut stream) = stream else { return (Vec::new(), false) };
    let mut kept = Vec::new();
    let mut buffer = [0u8; 16 * 1024];
    let mut cut = false;
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buffer[..n.min(room)]);
                cut |= n > room;
            }
        }
    }
    (kept, cut)
}

fn landlock_ruleset(abi: ABI, job: &Job) -> Result<OwnedFd, SandboxError> {
    let error = |e: landlock::RulesetError| SandboxError::Landlock(e.to_string());
    // Rules are opened by path; a path that does not exist on this host is simply not granted.
    let mut writable: Vec<&Path> = vec![&job.scratch, Path::new("/dev")];
    writable.extend(job.writable.iter().map(PathBuf::as_path));
    let mut readable: Vec<&Path> = SYSTEM_READABLE.iter().map(Path::new).collect();
    readable.extend(job.readable.iter().map(PathBuf::as_path));
    readable.retain(|p| p.exists());
    writable.retain(|p| p.exists());
    let ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .map_err(error)?
        // Kernels from Landlock abi 6: no signals to, and no abstract unix sockets of, processes outside the job
        // (the evaluator, other jobs). Older kernels ignore it (best effort); the report says which.
        .scope(Scope::Signal | Scope::AbstractUnixSocket)
        .map_err(error)?
        .create()
        .map_err(error)?
        .add_rules(path_beneath_rules(readable, AccessFs::from_read(abi)))
        .map_err(error)?
        .add_rules(path_beneath_rules(writable, AccessFs::from_all(abi)))
        .map_err(error)?;
    let fd: Option<OwnedFd> = ruleset.into();
    fd.ok_or_else(|| SandboxError::Landlock("the kernel does not support landlock".into()))
}

/// The Landlock abi of the running kernel (0 without Landlock).
fn landlock_kernel_abi() -> i64 {
    const LANDLOCK_CREATE_RULESET_VERSION: u32 = 1;
    // SAFETY: landlock_create_ruleset with a null attribute and the version flag only returns a number.
    #[allow(unsafe_code)]
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    abi.max(0)
}

/// What the child does to itself between fork and exec. Plain data only.
#[derive(Debug, Clone)]
struct ChildSetup {
    /// The job cgroup's `cgroup.procs`: the child moves itself in first, so everything it starts is counted.
    cgroup_procs_fd: Option<i32>,
    limits: Limits,
    network_namespace: bool,
    landlock_fd: Option<i32>,
    /// Becomes the child's descriptor 3.
    control_fd: Option<i32>,
    /// The job's own user and group, switched to once what needs root is done.
    user: Option<(u32, u32)>,
}

impl ChildSetup {
    #[allow(unsafe_code)]
    fn apply(&self) -> std::io::Result<()> {
        let check = |result: libc::c_int| if result == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
        let limit = |resource, value: u64| {
            let rlimit = libc::rlimit { rlim_cur: value, rlim_max: value };
            // SAFETY: setrlimit reads the struct we pass and nothing else.
            check(unsafe { libc::setrlimit(resource, &rlimit) })
        };
        // SAFETY (all calls below): raw system calls on integers; no allocation, no locks.
        if let Some(fd) = self.cgroup_procs_fd {
            // "0": the writing process itself.
            if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
                return Err(std::io::Error::last_os_error());
            }
        }
        unsafe {
            check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0))?;
        }
        limit(libc::RLIMIT_CPU, self.limits.cpu_seconds)?;
        limit(libc::RLIMIT_FSIZE, self.limits.file_bytes)?;
        limit(libc::RLIMIT_NOFILE, self.limits.open_files)?;
        limit(libc::RLIMIT_CORE, 0)?;
        if self.limits.nice > 0 {
            // SAFETY: setpriority on this process, with integers.
            unsafe { check(libc::setpriority(libc::PRIO_PROCESS, 0, self.limits.nice))? };
        }
        if !self.limits.cpus.is_empty() {
            // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET and sched_setaffinity write and read only it.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                for &cpu in &self.limits.cpus {
                    libc::CPU_SET(cpu, &mut set);
                }
                check(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set))?;
            }
        }
        if let Some(fd) = self.control_fd {
            const CONTROL: libc::c_int = 3;
            if fd == CONTROL {
                unsafe { check(libc::fcntl(fd, libc::F_SETFD, 0))? };
            } else if unsafe { libc::dup2(fd, CONTROL) } != CONTROL {
                return Err(std::io::Error::last_os_error());
            }
        }
        if self.network_namespace {
            unsafe { check(libc::unshare(libc::CLONE_NEWNET))? };
        }
        if let Some((uid, gid)) = self.user {
            // Binds a user, not root: counted over every process and thread of the job's user.
            limit(libc::RLIMIT_NPROC, self.limits.processes)?;
            unsafe {
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setresgid(gid, gid, gid))?;
                check(libc::setresuid(uid, uid, uid))?;
                libc::umask(0o002);
                // A change of user clears the parent-death signal.
                check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0))?;
            }
        }
        if let Some(fd) = self.landlock_fd {
            unsafe {
                allow_own_proc_dir(fd);
                check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
                let result = libc::syscall(libc::SYS_landlock_restrict_self, fd, 0u32);
                if result != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        Ok(())
    }
}

/// `struct landlock_path_beneath_attr` of the kernel's uapi (packed).
#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// Lets the job read and write its own `/proc/<pid>`: a thread naming another thread writes
/// `/proc/self/task/<tid>/comm`, and the CUDA driver fails to start without it (error 304 at
/// `cudaGetDeviceCount`, seen on the H200 hosts). The rule must be added in the child: in the parent,
/// `/proc/self` is the parent. Best effort: without it the job runs as before, and a GPU job may fail to start.
#[allow(unsafe_code)]
unsafe fn allow_own_proc_dir(ruleset_fd: i32) {
    const WRITE_FILE: u64 = 1 << 1;
    const READ_FILE: u64 = 1 << 2;
    const READ_DIR: u64 = 1 << 3;
    const TRUNCATE: u64 = 1 << 14;
    const LANDLOCK_RULE_PATH_BENEATH: libc::c_int = 1;
    // SAFETY: open with a static C string, landlock_add_rule with a struct that lives across the call, close of
    // the descriptor opened here: raw system calls, no allocation.
    unsafe {
        let dir = libc::open(c"/proc/self".as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
        if dir < 0 {
            return;
        }
        // Truncation is a right of its own from Landlock ABI 3; an older kernel refuses the bit, so retry without.
        for allowed_access in [WRITE_FILE | READ_FILE | READ_DIR | TRUNCATE, WRITE_FILE | READ_FILE | READ_DIR] {
            let rule = PathBeneathAttr { allowed_access, parent_fd: dir };
            let added = libc::syscall(
                libc::SYS_landlock_add_rule,
                ruleset_fd,
                LANDLOCK_RULE_PATH_BENEATH,
                &rule as *const PathBeneathAttr,
                0u32,
            );
            if added == 0 {
                break;
            }
        }
        libc::close(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kforge-sandbox-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch");
        dir
    }

    fn shell(script: &str, name: &str, limits: Limits) -> Job {
        Job {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            scratch: scratch(name),
            readable: vec![],
            writable: vec![],
            limits,
        }
    }

    /// Whether process `pid` is still alive (neither gone nor a zombie) after up to 2 s, with its
    /// `/proc/<pid>/stat` line: a SIGKILL is sent at once, but a process on a loaded machine dies when next scheduled.
    fn alive(pid: &str) -> (bool, Option<String>) {
        for _ in 0..100 {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
            let alive = state
                .as_deref()
                .and_then(|s| s.rsplit(')').next())
                .is_some_and(|rest| !rest.trim_start().starts_with('Z'));
            if !alive {
                return (false, state);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        (true, std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
    }

    /// The state letter of process `pid` once it is `wanted`, or as it is after up to 2 s.
    async fn state_becomes(pid: &str, wanted: impl Fn(Option<char>) -> bool) -> Option<char> {
        let state = || {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
        };
        // Up to 5 s: a stopped or continued process changes state when it next runs, late on a loaded machine.
        for _ in 0..250 {
            if wanted(state()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        state()
    }

    async fn run(sandbox: &Sandbox, job: Job) -> Finished {
        sandbox.run(job, CancellationToken::new()).await.expect("job runs")
    }

    #[tokio::test]
    async fn environment_is_scrubbed_and_scratch_is_the_working_directory() {
        let sandbox = Sandbox::basic();
        let finished = run(&sandbox, shell("env; pwd", "env", Limits::default())).await;
        let out = String::from_utf8_lossy(&finished.stdout);
        assert!(finished.success());
        assert!(!out.contains("CARGO"), "inherited variables leaked: {out}");
        assert!(out.contains(&format!("TMPDIR={}", scratch("env").display())), "{out}");
        assert!(out.trim_end().ends_with(&scratch("env").display().to_string()), "{out}");
    }

    #[tokio::test]
    async fn input_given_later_starts_the_wall_clock_and_none_cancels() {
        let sandbox = Sandbox::basic();
        let limits = Limits { wall: Duration::from_secs(2), ..Limits::default() };
        // The input arrives after longer than the wall limit: the limit counts from its delivery.
        let later = async {
            tokio::time::sleep(Duration::from_millis(2500)).await;
            Some(b"hello\n".to_vec())
        };
        let job = shell("read x; echo got $x", "input", limits.clone());
        let finished = sandbox.run_with_input(job, later, CancellationToken::new()).await.expect("job runs");
        assert_eq!(finished.exit, Exit::Code(0));
        assert_eq!(String::from_utf8_lossy(&finished.stdout).trim(), "got hello");

        let job = shell("read x; echo got $x", "no-input", limits.clone());
        let finished = sandbox.run_with_input(job, async { None }, CancellationToken::new()).await.expect("runs");
        assert_eq!(finished.exit, Exit::Cancelled);
        assert!(finished.stdout.is_empty());

        // A job that ends before its input is finished as it ended.
        let job = shell("exit 7", "early-exit", limits);
        let never = std::future::pending::<Option<Vec<u8>>>();
        let finished = sandbox.run_with_input(job, never, CancellationToken::new()).await.expect("runs");
        assert_eq!(finished.exit, Exit::Code(7));
    }

    #[tokio::test]
    async fn a_controlled_job_talks_on_descriptor_3_and_waits_off_the_clock() {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let sandbox = Sandbox::basic();
        // One second of wall clock; the job waits 1.5 s for its reply, stopped, then works 0.5 s.
        let job = shell(
            "read request; echo \"ready $request\" >&3; read reply <&3; echo \"$reply\"; sleep 0.5",
            "control",
            Limits { wall: Duration::from_secs(1), ..Limits::default() },
        );
        let (states, seen) = tokio::sync::oneshot::channel();
        let converse = |control: Control, socket: tokio::net::UnixStream| async move {
            let (read, mut write) = socket.into_split();
            let mut lines = BufReader::new(read).lines();
            let first = lines.next_line().await.expect("read").expect("a line");
            control.stop();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let state = |pid: libc::pid_t| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
            };
            let stopped = state(control.group);
            tokio::time::sleep(Duration::from_millis(1300)).await;
            control.resume();
            let resumed = state(control.group);
            write.write_all(b"go\n").await.expect("reply");
            let _ = states.send((first, stopped, resumed));
            std::future::pending::<()>().await
        };
        let finished = sandbox
            .run_with_control(job, async { Some(b"hello\n".to_vec()) }, converse, CancellationToken::new())
            .await
            .expect("ran");
        let (first, stopped, resumed) = seen.await.expect("the conversation happened");
        assert_eq!(first, "ready hello");
        assert_eq!(stopped, Some('T'), "stop stopped the job");
        assert_ne!(resumed, Some('T'), "resume continued it");
        assert_eq!(finished.exit, Exit::Code(0), "held time did not count: {:?}", finished.wall);
        assert_eq!(String::from_utf8_lossy(&finished.stdout), "go\n");
        assert!(finished.wall >= Duration::from_millis(1800), "{:?}", finished.wall);
    }

    #[tokio::test]
    async fn wall_clock_kills_the_whole_group() {
        let sandbox = Sandbox::basic();
        let pid_file = scratch("hang").join("child.pid");
        // The wall clock starts once the job has recorded its child (its input comes then), so a slow start on a
        // loaded machine cannot end it before it has a child to leave behind.
        // The child does not hold the job's output pipes, so nothing but the group kill can end it in time.
        let script = format!("sleep 600 >/dev/null 2>&1 & echo $! > {}; read go; sleep 60", pid_file.display());
        let limits = Limits { wall: Duration::from_millis(500), ..Limits::default() };
        let recorded = {
            let pid_file = pid_file.clone();
            async move {
                while std::fs::read_to_string(&pid_file).map_or(true, |pid| !pid.ends_with('\n')) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Some(b"go\n".to_vec())
            }
        };
        let job = shell(&script, "hang", limits);
        let finished = sandbox.run_with_input(job, recorded, CancellationToken::new()).await.expect("job runs");
        assert_eq!(finished.exit, Exit::TimedOut);
        let pid = std::fs::read_to_string(&pid_file).expect("the job recorded its child").trim().to_owned();
        // SIGKILL is delivered before `run` returns; the child is then gone or a zombie awaiting its reaper.
        // Gone (already reaped) or a zombie both mean dead.
        let (alive, state) = alive(&pid);
        assert!(!alive, "a child of the timed-out job survived: {state:?}");
    }

    #[tokio::test]
    async fn output_is_capped_without_blocking_the_job() {
        let sandbox = Sandbox::basic();
        let limits = Limits { output_bytes: 1000, ..Limits::default() };
        let finished = run(&sandbox, shell("head -c 5000000 /dev/zero; echo done >&2", "output", limits)).await;
        assert!(finished.success());
        assert_eq!(finished.stdout.len(), 1000);
        assert!(finished.output_truncated);
        assert_eq!(finished.stderr_tail(100).trim(), "done");
    }

    #[tokio::test]
    async fn signals_and_exit_codes_are_reported() {
        let sandbox = Sandbox::basic();
        assert_eq!(run(&sandbox, shell("exit 7", "code", Limits::default())).await.exit, Exit::Code(7));
        assert_eq!(
            run(&sandbox, shell("kill -SEGV $$", "signal", Limits::default())).await.exit,
            Exit::Signal(libc::SIGSEGV)
        );
    }

    #[tokio::test]
    async fn cancellation_kills_the_job() {
        let sandbox = Sandbox::basic();
        let cancel = CancellationToken::new();
        let job = shell("sleep 30", "cancel", Limits::default());
        let handle = tokio::spawn({
            let cancel = cancel.clone();
            let sandbox = sandbox.clone();
            async move { sandbox.run(job, cancel).await }
        });
        cancel.cancel();
        assert_eq!(handle.await.expect("task").expect("runs").exit, Exit::Cancelled);
    }

    #[tokio::test]
    async fn detected_protections_are_enforced() {
        let sandbox = Sandbox::detect().await;
        let active = |name: &str| sandbox.protections().iter().any(|p| p.name == name && p.active);
        if active("network_namespace") {
            // Only a down loopback exists in the job's namespace.
            let finished = run(&sandbox, shell("cat /proc/net/dev", "net", Limits::default())).await;
            let interfaces = String::from_utf8_lossy(&finished.stdout);
            assert!(!interfaces.lines().skip(2).any(|l| !l.trim_start().starts_with("lo:")), "{interfaces}");
        }
        if active("landlock") {
            let outside = std::env::temp_dir().join(format!("kforge-sandbox-outside-{}", std::process::id()));
            let secret = scratch("secret").join("reference.pt");
            std::fs::write(&secret, "expected outputs").expect("secret file");
            let script =
                format!("touch {} 2>/dev/null; cat {} 2>/dev/null; touch inside", outside.display(), secret.display());
            let finished = run(&sandbox, shell(&script, "landlock", Limits::default())).await;
            assert!(finished.success(), "{}", finished.stderr_tail(500));
            assert!(!outside.exists(), "a write outside scratch got through");
            assert!(finished.stdout.is_empty(), "a file outside the readable paths was read");
            assert!(scratch("landlock").join("inside").exists(), "scratch must stay writable");
            // Its own /proc entry stays writable (thread names; the GPU driver needs it), its parent's does not.
            let script = "echo kforge-job > /proc/self/comm && read name < /proc/self/comm && echo $name; echo x 2>/dev/null > /proc/$PPID/comm || echo denied";
            let finished = run(&sandbox, shell(script, "proc", Limits::default())).await;
            assert_eq!(
                String::from_utf8_lossy(&finished.stdout),
                "kforge-job\ndenied\n",
                "{}",
                finished.stderr_tail(500)
            );
        }
        if active("process_limit") {
            // A fork loop stops at the cap (the shell exits when it cannot fork); without it, it reaches 100.
            let limits = Limits { processes: 20, ..Limits::default() };
            let script = "i=0; while [ $i -lt 100 ]; do sleep 30 & i=$((i+1)); echo $i > forked; done";
            let finished = run(&sandbox, shell(script, "forks", limits)).await;
            let forked: u32 =
                std::fs::read_to_string(scratch("forks").join("forked")).map_or(0, |n| n.trim().parse().unwrap_or(0));
            assert!(forked > 0 && forked < 20, "{forked} children under a cap of 20: {finished:?}");
            // A process that left the job's group and session is still in its cgroup, and killed at the end.
            let script = "setsid sh -c 'echo $$ > escaped.pid; exec sleep 600' </dev/null >/dev/null 2>&1 & \
                          while [ ! -s escaped.pid ]; do sleep 0.01; done";
            let finished = run(&sandbox, shell(script, "escape", Limits::default())).await;
            assert!(finished.success(), "{}", finished.stderr_tail(500));
            let pid = std::fs::read_to_string(scratch("escape").join("escaped.pid")).expect("pid").trim().to_owned();
            let (alive, state) = alive(&pid);
            assert!(!alive, "a process that left the job's group survived it: {state:?}");
        }
        if active("job_user") || landlock_scopes_signals(&sandbox) {
            // Its parent (this test, standing for the evaluator) is out of its reach.
            assert_eq!(signal_to_parent(&sandbox, "signal-parent").await, "denied\n");
        }
        // Which protections exist depends on the host; the report must say, one way or the other.
        for name in ["network_namespace", "landlock", "process_group", "rlimits", "process_limit", "job_user"] {
            assert!(sandbox.protections().iter().any(|p| p.name == name), "{name} not reported");
        }
    }

    /// A sandbox with the job users alone (no cgroup, Landlock or namespace), so what a test sees is their doing.
    async fn job_users_only() -> Sandbox {
        let options = SandboxOptions {
            network_namespace: false,
            landlock: false,
            process_limit: false,
            ..SandboxOptions::default()
        };
        Sandbox::detect_with(options).await
    }

    /// What a job prints after trying to signal its parent (this test, standing for the evaluator): `reached` or
    /// `denied`, with its stderr when it printed neither.
    async fn signal_to_parent(sandbox: &Sandbox, name: &str) -> String {
        let script = "kill -0 $PPID 2>/dev/null && echo reached || echo denied";
        let finished = run(sandbox, shell(script, name, Limits::default())).await;
        let out = String::from_utf8_lossy(&finished.stdout).into_owned();
        if out.is_empty() { finished.stderr_tail(500) } else { out }
    }

    fn landlock_scopes_signals(sandbox: &Sandbox) -> bool {
        sandbox.protections().iter().any(|p| p.name == "landlock" && p.active && p.detail.contains("signals and"))
    }

    /// A fork loop's count, a `setsid` escapee's pid and what `id` said, from a job as its own user.
    const AS_A_USER: &str = "id -u > uid; id -g > gid; touch made; \
        setsid sh -c 'echo $$ > escaped.pid; exec sleep 600' </dev/null >/dev/null 2>&1 & \
        while [ ! -s escaped.pid ]; do sleep 0.01; done; \
        i=0; while [ $i -lt 100 ]; do sleep 30 & i=$((i+1)); echo $i > forked; done";

    #[tokio::test]
    async fn a_job_user_caps_processes_keeps_signals_in_and_leaves_nothing_behind_without_cgroups() {
        let sandbox = job_users_only().await;
        let report = |name: &str| sandbox.protections().iter().find(|p| p.name == name).cloned().expect(name);
        // SAFETY: geteuid has no arguments and cannot fail.
        #[allow(unsafe_code)]
        if unsafe { libc::geteuid() } != 0 {
            assert!(!report("job_user").active, "{:?}", report("job_user"));
            assert!(!report("process_limit").active, "{:?}", report("process_limit"));
            return;
        }
        assert!(report("job_user").active, "{:?}", report("job_user"));
        assert!(report("process_limit").active && report("process_limit").detail.contains("RLIMIT_NPROC"));

        // Two jobs at once run as two users, both in the jobs' group, with a cap of 20 each.
        let limits = Limits { processes: 20, ..Limits::default() };
        let (a, b) = tokio::join!(
            run(&sandbox, shell(AS_A_USER, "user-a", limits.clone())),
            run(&sandbox, shell(AS_A_USER, "user-b", limits))
        );
        let read = |dir: &str, file: &str| {
            std::fs::read_to_string(scratch(dir).join(file)).unwrap_or_default().trim().to_owned()
        };
        let base = SandboxOptions::default().job_user_base;
        let (uid_a, uid_b): (u32, u32) =
            (read("user-a", "uid").parse().expect("uid"), read("user-b", "uid").parse().expect("uid"));
        assert!(uid_a >= base && uid_b >= base && uid_a != uid_b, "{uid_a} {uid_b}: {a:?} {b:?}");
        assert_eq!(read("user-a", "gid"), base.to_string());
        use std::os::unix::fs::MetadataExt;
        let made = std::fs::metadata(scratch("user-a").join("made")).expect("the job wrote its scratch");
        assert_eq!(
            (made.uid(), made.gid(), made.mode() & 0o020),
            (uid_a, base, 0o020),
            "group-writable, the jobs' group"
        );
        for dir in ["user-a", "user-b"] {
            let forked: u32 = read(dir, "forked").parse().unwrap_or(0);
            assert!(forked > 0 && forked < 20, "{forked} children under a cap of 20");
            // The escapee left the group and the session, and no cgroup holds it: the job user's end killed it.
            let pid = read(dir, "escaped.pid");
            let (alive, state) = alive(&pid);
            assert!(!alive, "a process of a finished job's user survived: {state:?}");
        }
        assert_eq!(signal_to_parent(&sandbox, "user-signal").await, "denied\n");
    }

    #[tokio::test]
    async fn stopping_a_job_with_its_own_user_stops_what_left_its_group() {
        use tokio::io::{AsyncBufReadExt, BufReader};
        let sandbox = job_users_only().await;
        if !sandbox.job_users_active() {
            return; // Not root: reported, and the group is all a stop reaches.
        }
        // The job starts a child in a session of its own, which says its pid on descriptor 3; the job then waits.
        let script = "setsid sh -c 'echo $$ >&3; exec 3>&-; while :; do sleep 0.05; done' </dev/null >/dev/null 2>&1 & \
                      read reply <&3";
        let job = shell(script, "stop-user", Limits::default());
        let (states, seen) = tokio::sync::oneshot::channel();
        let converse = |control: Control, socket: tokio::net::UnixStream| async move {
            let (read, mut write) = socket.into_split();
            let leader = BufReader::new(read).lines().next_line().await.expect("read").expect("a pid");
            control.stop();
            let stopped = state_becomes(&leader, |s| s == Some('T')).await;
            control.resume();
            let resumed = state_becomes(&leader, |s| s != Some('T')).await;
            write.write_all(b"done\n").await.expect("reply");
            let _ = states.send((stopped, resumed));
            std::future::pending::<()>().await
        };
        let finished = sandbox
            .run_with_control(job, async { Some(Vec::new()) }, converse, CancellationToken::new())
            .await
            .expect("ran");
        let (stopped, resumed) = seen.await.expect("the conversation happened");
        assert_eq!(stopped, Some('T'), "the stop reached the process outside the group: {finished:?}");
        assert_ne!(resumed, Some('T'), "the resume reached it too");
    }

    #[tokio::test]
    async fn landlock_keeps_a_job_s_signals_to_its_own_processes() {
        let options = SandboxOptions {
            network_namespace: false,
            process_limit: false,
            job_users: false,
            ..SandboxOptions::default()
        };
        let sandbox = Sandbox::detect_with(options).await;
        if !landlock_scopes_signals(&sandbox) {
            return; // Reported: landlock absent, or a kernel before abi 6.
        }
        // Its own child it may signal; its parent (the evaluator here) it may not, though both run as one user.
        let script =
            "sleep 30 & kill $! && echo child-signalled; kill -0 $PPID 2>/dev/null && echo reached || echo denied";
        let finished = run(&sandbox, shell(script, "scoped-signal", Limits::default())).await;
        assert_eq!(
            String::from_utf8_lossy(&finished.stdout),
            "child-signalled\ndenied\n",
            "{}",
            finished.stderr_tail(500)
        );
    }
}
