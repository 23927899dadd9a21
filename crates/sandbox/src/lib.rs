//! Runs untrusted programs (candidate kernels and the harness around them) so that one crashed, hung or hostile
//! candidate costs one verdict and never the service.
//!
//! Every command gets: its own process group (killed as a whole on timeout, cancellation or drop), a scrubbed
//! environment (only what the caller passes), a scratch directory as working directory and `TMPDIR`, resource
//! limits (CPU seconds, file size, open files, no core dumps), a wall-clock limit, capped
//! stdout/stderr, death with the parent (`PR_SET_PDEATHSIG`), and, where the kernel allows, no network (a fresh
//! network namespace), a read-only view of the filesystem except the directories the command may write (Landlock, which
//! also keeps its signals to its own processes from abi 6), a cap on its processes (a pids cgroup), and where the
//! evaluator is root a user of its own (`users`: RLIMIT_NPROC, no signals to or tracing of other processes).
//!
//! The modules, by concern:
//! - [`Sandbox::detect`] (`detect`) probes which of the optional protections work on this host, once; the
//!   evaluator reports them through `GetCapabilities`;
//! - `spawn` runs one command ([`Sandbox::run`], [`Sandbox::run_with_input`], [`Sandbox::run_with_control`]);
//! - `control` is the caller's hold on a command in a conversation ([`Control`]: stop, resume, CPU used, its clock);
//! - `ruleset` builds a command's Landlock ruleset, `cgroup` its pids cgroup, `users` its own user;
//! - `sys` holds every raw system call, and so all of the crate's `unsafe` code, the steps between fork and exec
//!   among them.

mod cgroup;
mod command;
mod control;
mod detect;
mod ruleset;
mod spawn;
mod sys;
mod users;

pub use command::{Command, Exit, Finished, Limits, SYSTEM_READABLE, resolve_on_path, tail};
pub use control::{Control, Processes, group_stopped};
pub use detect::{Protection, Sandbox, SandboxOptions};
pub use sys::allowed_cpus;
pub use users::COMMAND_USERS;

/// Why a command could not be run (as opposed to a command that ran and failed, which is a [`Finished`]).
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot start {program}: {source}")]
    Spawn { program: std::path::PathBuf, source: std::io::Error },
    #[error("cannot start {program}: all {COMMAND_USERS} command users are in use")]
    NoCommandUser { program: std::path::PathBuf },
    #[error("cannot wait for the job: {0}")]
    Wait(std::io::Error),
    #[error("landlock ruleset: {0}")]
    Landlock(#[from] landlock::RulesetError),
    #[error("landlock ruleset: the kernel does not support landlock")]
    LandlockUnsupported,
}

#[cfg(test)]
mod tests;
