//! Which of the optional protections work on this host: each is probed once, by running `/bin/true` under it, and
//! reported with why where it is not enforced ([`Protection`]); a protection that cannot be enforced is reported,
//! never silently assumed.

use std::sync::Arc;
use std::time::Duration;

use landlock::ABI;
use tokio_util::sync::CancellationToken;

use crate::{Command, Limits, cgroup, sys, users};

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
        // The probes' own scratch: a command's scratch is handed to its user.
        let scratch = std::env::temp_dir().join(format!("kforge-sandbox-probe-{}", std::process::id()));
        if let Err(error) = std::fs::create_dir_all(&scratch) {
            tracing::warn!(%error, dir = %scratch.display(), "the sandbox's probe directory");
        }
        let probe = |sandbox: &Sandbox| {
            let sandbox = sandbox.clone();
            let scratch = scratch.clone();
            async move {
                let command = Command {
                    program: "/bin/true".into(),
                    args: vec![],
                    env: vec![],
                    scratch,
                    readable: vec![],
                    writable: vec![],
                    limits: Limits { wall: Duration::from_secs(10), ..Limits::default() },
                };
                sandbox.run(command, CancellationToken::new()).await
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
                    let abi = sys::landlock_abi();
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

        let users_detail = if options.command_users {
            match users::CommandUsers::detect(options.command_user_base) {
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
                Err(unavailable) => unavailable.to_string(),
            }
        } else {
            disabled()
        };

        let cap = Limits::default().processes;
        sandbox.cgroup_detail = if options.process_limit {
            match cgroup::PidsCgroups::detect() {
                Ok(pids) => {
                    let detail = format!(
                        "{}: at most {cap} processes and threads per job; all of a job's processes killed at its end",
                        pids.describe()
                    );
                    sandbox.pids = Some(pids);
                    let probe = probe(&sandbox).await;
                    if matches!(&probe, Ok(f) if f.success()) {
                        detail
                    } else {
                        sandbox.pids = None;
                        format!("a job could not join its cgroup ({probe:?})")
                    }
                }
                Err(unavailable) => unavailable.to_string(),
            }
        } else {
            disabled()
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
            Protection { name: "command_user", active: sandbox.users.is_some(), detail: users_detail },
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
