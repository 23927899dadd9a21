//! A user of its own per command: where the evaluator runs as root, each command runs as an unprivileged user id that no
//! other running command has. The kernel then enforces, for root too:
//!
//! - RLIMIT_NPROC on the command's processes and threads (root is exempt from it, a user is not), so a fork bomb
//!   stops at [`crate::Limits::processes`] without a pids cgroup;
//! - no signals to, and no tracing of, the evaluator or other commands (they run under other users);
//! - file permissions: without Landlock, a command writes only where its group may.
//!
//! Commands share one group: the directories a command may write (its scratch and `Job::writable`) get that group,
//! group write and the set-group-id bit, and commands run with umask 002, so what one command writes in a shared directory
//! (an extension's build directory, a reference cache entry) the next command of another user can still replace.
//!
//! When a command ends, a helper running as its user kills every process that user has (`kill(-1, SIGKILL)` reaches
//! exactly the caller's own user's processes), in rounds until `/proc` shows none left: a process that left the
//! command's group with `setsid` dies too. The id returns to the pool only then.

use std::collections::VecDeque;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::sys;

/// Why commands cannot run as users of their own on this host (the protection's report says so).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CommandUsersUnavailable {
    #[error("the evaluator runs as user {euid}, not root: jobs run as its user")]
    NotRoot { euid: u32 },
    #[error("command user ids from {base} are out of range")]
    OutOfRange { base: u32 },
    #[error("command users' lock directory {}: {source}", dir.display())]
    LockDirectory { dir: PathBuf, source: std::io::Error },
}

/// How many command users exist: more than commands ever run at once.
pub const COMMAND_USERS: u32 = 4096;

/// The pool of command user ids `base..base + COMMAND_USERS`, all in group `base`. Evaluators in other processes on the
/// host (sharing `/tmp`) take ids from the same range: a lock file per id, held while a command runs as it, keeps
/// two commands from ever sharing one.
#[derive(Debug)]
pub struct CommandUsers {
    base: u32,
    locks: PathBuf,
    free: Mutex<VecDeque<u32>>,
}

/// One command's user, taken from the pool. [`CommandUser::release`] gives it back once its processes are gone; a user
/// dropped without it (a command that failed to start) is released on a thread of its own.
#[derive(Debug)]
pub struct CommandUser {
    pub uid: u32,
    pub gid: u32,
    held: Option<(Arc<CommandUsers>, std::fs::File)>,
}

impl CommandUsers {
    /// The pool, when this process may switch to other users (it runs as root); otherwise why not.
    pub fn detect(base: u32) -> Result<Arc<Self>, CommandUsersUnavailable> {
        let euid = sys::effective_uid();
        if euid != 0 {
            return Err(CommandUsersUnavailable::NotRoot { euid });
        }
        if base == 0 || base.checked_add(COMMAND_USERS).is_none_or(|end| end > i32::MAX as u32) {
            return Err(CommandUsersUnavailable::OutOfRange { base });
        }
        let locks = std::env::temp_dir().join(format!("kforge-job-users-{base}"));
        private_dir(&locks).map_err(|source| CommandUsersUnavailable::LockDirectory { dir: locks.clone(), source })?;
        Ok(Arc::new(Self { base, locks, free: Mutex::new((base..base + COMMAND_USERS).collect()) }))
    }

    pub fn describe(&self) -> String {
        format!("user ids {}..{} in group {}", self.base, self.base + COMMAND_USERS, self.base)
    }

    /// A user no running command has (here or in another evaluator), or `None` when all are taken.
    pub fn take(self: &Arc<Self>) -> Option<CommandUser> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..free.len() {
            let uid = free.pop_front()?;
            let lock = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(self.locks.join(uid.to_string()));
            match lock {
                Ok(file) if sys::try_lock_exclusive(&file) => {
                    return Some(CommandUser { uid, gid: self.base, held: Some((Arc::clone(self), file)) });
                }
                // Another evaluator's command runs as it: tried again later.
                _ => free.push_back(uid),
            }
        }
        None
    }
}

impl CommandUser {
    /// Kills every process of this user and returns the id to the pool; an id whose processes outlast the
    /// attempts (a zombie nobody reaps) stays out of it. Blocking (it forks and waits).
    pub fn release(mut self) {
        release(self.uid, self.gid, self.held.take());
    }
}

impl Drop for CommandUser {
    fn drop(&mut self) {
        let (uid, gid, held) = (self.uid, self.gid, self.held.take());
        if held.is_some() {
            std::thread::spawn(move || release(uid, gid, held));
        }
    }
}

fn release(uid: u32, gid: u32, held: Option<(Arc<CommandUsers>, std::fs::File)>) {
    let Some((users, lock)) = held else { return };
    // Rounds of killing until no process of the user is left (a process forking meanwhile is caught by the next
    // round; a killed one is seen until its parent reaps it).
    for _ in 0..400 {
        if !any_process_of(uid) {
            drop(lock);
            users.free.lock().unwrap_or_else(|e| e.into_inner()).push_back(uid);
            return;
        }
        sys::signal_all_as_user(uid, gid, libc::SIGKILL);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The lock is kept for the life of this evaluator: no command of any evaluator runs as this user again meanwhile.
    std::mem::forget(lock);
    tracing::warn!(uid, "processes of a command user outlived its end; the id is not reused");
}

/// A directory only root may write: made with mode 0700, or one that exists as such (not a link).
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(dir)?;
            if meta.is_dir() && meta.uid() == 0 && meta.mode() & 0o022 == 0 {
                Ok(())
            } else {
                Err(std::io::Error::other("exists, but is not a directory only root may write"))
            }
        }
        Err(e) => Err(e),
    }
}

/// Whether a process whose real or saved user is `uid` exists (what a kill as that user reaches), zombies
/// included, from `/proc/<pid>/status`.
fn any_process_of(uid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else { return true };
    entries.flatten().filter(|e| e.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))).any(
        |entry| {
            let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
            status.lines().find_map(|line| line.strip_prefix("Uid:")).is_some_and(|ids| {
                let ids: Vec<&str> = ids.split_whitespace().collect();
                let wanted = uid.to_string();
                // Real, effective, saved, filesystem.
                ids.first() == Some(&wanted.as_str()) || ids.get(2) == Some(&wanted.as_str())
            })
        },
    )
}

/// Gives `dir` group `gid` with group write and the set-group-id bit (what is made in it inherits the group), when
/// this process owns it. Only `dir` itself: what the evaluator made inside it stays as it is, and what a command made
/// has the group already. A directory with the sticky bit (`/tmp`) is writable by everyone and left alone. Opened
/// without following a link, so a command that swapped the directory for a link cannot redirect this elsewhere.
pub(crate) fn share_with_group(dir: &Path, gid: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW).open(dir)?;
    let meta = dir.metadata()?;
    if meta.uid() != sys::effective_uid() || meta.mode() & libc::S_ISVTX != 0 {
        return Ok(());
    }
    std::os::unix::fs::fchown(&dir, None, Some(gid))?;
    dir.set_permissions(std::fs::Permissions::from_mode((meta.mode() & 0o7777) | 0o2070))
}
