//! Which of the optional protections work on this host: each is probed once, by running `/bin/true` under it, and
//! reported with why where it is not enforced ([`Protection`]); a protection that cannot be enforced is reported,
//! never silently assumed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use landlock::ABI;
use tokio_util::sync::CancellationToken;

use crate::{Command, Finished, Limits, SandboxError, cgroup, sys, users};

/// One protection and whether it is enforced on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protection {
    pub name: &'static str,
    pub active: bool,
    pub detail: String,
}

/// The sandbox of this host: which optional protections work, probed once.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub(crate) network_namespace: bool,
    pub(crate) landlock: Option<ABI>,
    pub(crate) pids: Option<cgroup::PidsCgroups>,
    /// What the pids cgroup probe found: where command cgroups go (with `pids`), or why there are none.
    cgroup_detail: String,
    pub(crate) users: Option<Arc<users::CommandUsers>>,
    protections: Vec<Protection>,
}

/// Which optional protections to try; one an operator switches off is reported as disabled. Deserialisable, so
/// services take it straight from their configuration (e.g. `[evaluator.sandbox]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxOptions {
    /// A fresh network namespace per command (no network).
    pub network_namespace: bool,
    /// Landlock: commands read only system paths and the paths they are given, and write only their scratch.
    pub landlock: bool,
    /// A pids cgroup per command: a cap on its processes and threads (`Limits::processes`), and every process of the
    /// command killed at its end, also those that left its process group.
    pub process_limit: bool,
    /// Where the evaluator is root: each command runs as a user of its own (`command_user_base` and up, group
    /// `command_user_base`), so RLIMIT_NPROC caps its processes and it can signal and trace no other process (reported as the
    /// protection `command_user`).
    pub command_users: bool,
    /// The first command user id; the pool has [`crate::COMMAND_USERS`] ids, unused by anything else on the host.
    pub command_user_base: u32,
}

impl Default for SandboxOptions {
    fn default() -> Self {
        Self {
            network_namespace: true,
            landlock: true,
            process_limit: true,
            command_users: true,
            command_user_base: 2_100_000_000,
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
        let probe = Probe::new();
        let disabled = || "disabled by configuration".to_owned();
        let network_detail =
            if options.network_namespace { sandbox.probe_network_namespace(&probe).await } else { disabled() };
        let landlock_detail = if options.landlock { sandbox.probe_landlock(&probe).await } else { disabled() };
        let users_detail = if options.command_users {
            sandbox.probe_command_users(&probe, options.command_user_base).await
        } else {
            disabled()
        };
        sandbox.cgroup_detail =
            if options.process_limit { sandbox.probe_pids_cgroup(&probe).await } else { disabled() };
        probe.remove();
        sandbox.protections = sandbox.report(network_detail, landlock_detail, users_detail);
        for p in sandbox.protections.iter().filter(|p| !p.active) {
            tracing::warn!(protection = p.name, detail = %p.detail, "sandbox protection unavailable");
        }
        sandbox
    }

    /// Keeps a fresh network namespace per command if a probe runs in one; returns what was found.
    async fn probe_network_namespace(&mut self, probe: &Probe) -> String {
        self.network_namespace = true;
        let network = probe.run(self).await;
        self.network_namespace = succeeded(&network);
        match &network {
            Ok(f) if f.success() => "fresh network namespace per job (loopback only, down)".to_owned(),
            Ok(f) => format!("unshare(CLONE_NEWNET) failed in the probe ({:?}); jobs keep the host network", f.exit),
            Err(e) => format!("probe failed: {e}"),
        }
    }

    /// Keeps Landlock if a probe runs restricted by it; returns what was found.
    async fn probe_landlock(&mut self, probe: &Probe) -> String {
        self.landlock = Some(ABI::V5);
        let landlock = probe.run(self).await;
        if !succeeded(&landlock) {
            self.landlock = None;
        }
        match &landlock {
            Ok(f) if f.success() => landlock_enforced(sys::landlock_abi()),
            Ok(f) => format!("landlock unavailable ({:?}); the filesystem is protected only by permissions", f.exit),
            Err(e) => format!("landlock unavailable: {e}"),
        }
    }

    /// Keeps command users (ids from `base`) if the host allows them and a probe runs as one; returns what was found.
    async fn probe_command_users(&mut self, probe: &Probe, base: u32) -> String {
        let users = match users::CommandUsers::detect(base) {
            Ok(users) => users,
            Err(unavailable) => return unavailable.to_string(),
        };
        let detail = format!(
            "{}: one per running job; it cannot signal or trace the evaluator or other jobs, and all of its processes \
             are killed at the job's end",
            users.describe()
        );
        self.users = Some(users);
        let result = probe.run(self).await;
        if succeeded(&result) {
            detail
        } else {
            self.users = None;
            format!("a job could not run as its own user ({result:?})")
        }
    }

    /// Keeps a pids cgroup per command if the host has one to delegate and a probe runs in it; returns what was found.
    async fn probe_pids_cgroup(&mut self, probe: &Probe) -> String {
        let pids = match cgroup::PidsCgroups::detect() {
            Ok(pids) => pids,
            Err(unavailable) => return unavailable.to_string(),
        };
        let cap = Limits::default().processes;
        let detail = format!(
            "{}: at most {cap} processes and threads per job; all of a job's processes killed at its end",
            pids.describe()
        );
        self.pids = Some(pids);
        let result = probe.run(self).await;
        if succeeded(&result) {
            detail
        } else {
            self.pids = None;
            format!("a job could not join its cgroup ({result:?})")
        }
    }

    /// Every protection in the order they are reported: those always enforced, then the probed ones with what their
    /// probes found.
    fn report(&self, network_detail: String, landlock_detail: String, users_detail: String) -> Vec<Protection> {
        let always = |name, detail: &str| Protection { name, active: true, detail: detail.into() };
        vec![
            always("process_group", "own process group, killed as a whole"),
            always("scrubbed_env", "only the variables the evaluator passes"),
            always("scratch_dir", "fresh working directory and TMPDIR per job"),
            always("rlimits", "cpu, file size, open files, no core dumps"),
            always("wall_clock_kill", "group SIGKILL at the wall-clock limit"),
            always("output_caps", "stdout and stderr capped"),
            always("parent_death", "PR_SET_PDEATHSIG: jobs die with the evaluator"),
            Protection { name: "network_namespace", active: self.network_namespace, detail: network_detail },
            Protection { name: "landlock", active: self.landlock.is_some(), detail: landlock_detail },
            Protection { name: "command_user", active: self.users.is_some(), detail: users_detail },
            self.process_limit(),
        ]
    }

    /// A sandbox with only the always-available protections (for hosts where probing is not wanted).
    pub fn basic() -> Self {
        Self {
            network_namespace: false,
            landlock: None,
            pids: None,
            cgroup_detail: "not probed".into(),
            users: None,
            protections: Vec::new(),
        }
    }

    /// Which protections are enforced.
    pub fn protections(&self) -> &[Protection] {
        &self.protections
    }

    /// Whether Landlock restricts commands.
    pub fn landlock_active(&self) -> bool {
        self.landlock.is_some()
    }

    /// This sandbox without Landlock, reporting `reason` (for hosts where a command's own needs, such as a GPU
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

    /// This sandbox with commands running as the evaluator's user, reporting `reason` (for hosts where a command's own
    /// needs, such as an interpreter under a private home directory, are out of a command user's reach).
    pub fn without_command_users(&self, reason: String) -> Self {
        let mut sandbox = self.clone();
        sandbox.users = None;
        let limit = sandbox.process_limit();
        for protection in sandbox.protections.iter_mut() {
            match protection.name {
                "command_user" => (protection.active, protection.detail) = (false, reason.clone()),
                "process_limit" => *protection = limit.clone(),
                _ => {}
            }
        }
        sandbox
    }

    /// Whether commands run as users of their own.
    pub fn command_users_active(&self) -> bool {
        self.users.is_some()
    }

    /// The process cap as it stands: the pids cgroup's, the command users' RLIMIT_NPROC, both or neither.
    fn process_limit(&self) -> Protection {
        let cap = Limits::default().processes;
        let detail = &self.cgroup_detail;
        let detail = match (self.pids.is_some(), self.users.is_some()) {
            (true, true) => format!("{detail}; and RLIMIT_NPROC of the job's own user"),
            (true, false) => detail.clone(),
            (false, true) => format!(
                "RLIMIT_NPROC of the job's own user: at most {cap} processes and threads per job (no pids cgroup: \
                 {detail})"
            ),
            (false, false) => detail.clone(),
        };
        Protection { name: "process_limit", active: self.pids.is_some() || self.users.is_some(), detail }
    }
}

/// Runs `/bin/true` under a sandbox's protections as set so far, in a scratch directory of the probes' own (a
/// command's scratch is handed to its user).
struct Probe {
    scratch: PathBuf,
}

impl Probe {
    fn new() -> Self {
        let scratch = std::env::temp_dir().join(format!("kforge-sandbox-probe-{}", std::process::id()));
        if let Err(error) = std::fs::create_dir_all(&scratch) {
            tracing::warn!(%error, dir = %scratch.display(), "the sandbox's probe directory");
        }
        Self { scratch }
    }

    async fn run(&self, sandbox: &Sandbox) -> Result<Finished, SandboxError> {
        let command = Command {
            program: "/bin/true".into(),
            args: vec![],
            env: vec![],
            scratch: self.scratch.clone(),
            readable: vec![],
            writable: vec![],
            limits: Limits { wall: Duration::from_secs(10), ..Limits::default() },
        };
        sandbox.run(command, CancellationToken::new()).await
    }

    fn remove(self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

/// Whether a probe ran and exited 0: the protection it ran under works.
fn succeeded(probe: &Result<Finished, SandboxError>) -> bool {
    matches!(probe, Ok(f) if f.success())
}

/// What Landlock enforces under kernel abi `abi`: signals are scoped from abi 6.
fn landlock_enforced(abi: i64) -> String {
    let scoped = if abi >= 6 {
        "signals and abstract unix sockets limited to the job's own processes"
    } else {
        "signals not scoped (needs abi 6)"
    };
    format!(
        "reads limited to system and named paths, writes to scratch and named directories; {scoped} (kernel abi {abi})"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Exit;

    fn probe_ended(exit: Exit) -> Result<Finished, SandboxError> {
        Ok(Finished { exit, stdout: vec![], stderr: vec![], output_truncated: false, wall: Duration::ZERO })
    }

    #[test]
    fn only_a_probe_that_exits_0_shows_a_protection_works() {
        assert!(succeeded(&probe_ended(Exit::Code(0))));
        assert!(!succeeded(&probe_ended(Exit::Code(1))));
        assert!(!succeeded(&probe_ended(Exit::Signal(libc::SIGSYS))));
        assert!(!succeeded(&probe_ended(Exit::TimedOut)));
        assert!(!succeeded(&Err(SandboxError::LandlockUnsupported)));
    }

    #[test]
    fn landlock_scopes_signals_from_abi_6() {
        assert!(landlock_enforced(5).contains("signals not scoped (needs abi 6)"));
        assert!(landlock_enforced(6).contains("limited to the job's own processes"));
        assert!(landlock_enforced(6).ends_with("(kernel abi 6)"));
    }

    #[test]
    fn a_basic_sandbox_reports_every_protection_with_the_probed_ones_off() {
        let report = Sandbox::basic().report("n".into(), "l".into(), "u".into());
        let names: Vec<_> = report.iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "process_group",
                "scrubbed_env",
                "scratch_dir",
                "rlimits",
                "wall_clock_kill",
                "output_caps",
                "parent_death",
                "network_namespace",
                "landlock",
                "command_user",
                "process_limit"
            ]
        );
        assert!(report[..7].iter().all(|p| p.active));
        assert!(report[7..].iter().all(|p| !p.active));
        assert_eq!(report[8].detail, "l");
    }
}
