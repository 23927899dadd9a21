//! `kforge run`'s scratch directory: `kforge-run-<pid>` under the temporary directory, where the embedded replay
//! files the gateway reads are written, removed when the run ends.
//!
//! A run killed with SIGKILL cannot remove its own, so each run first removes the ones whose owner is gone. Every
//! such directory holds a `lock` file that its owner keeps locked (`flock`) for as long as it lives; the kernel
//! releases the lock when the process dies, however it dies. (The file is opened close-on-exec, as Rust opens every
//! file, so the processes the run starts do not hold the lock after it.) A lock that can be taken is a dead owner's. The lock is
//! what is tested, not the pid, so a pid reused by another process keeps no stale directory alive and marks no live
//! one stale. A directory without a lock file (made before there was one) is removed when no process has its pid.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

/// The directory name's prefix; the owner's pid follows.
pub const PREFIX: &str = "kforge-run-";

/// The file the owner holds locked.
const LOCK: &str = "lock";

/// This process's scratch directory, locked while it lives and removed when dropped.
#[derive(Debug)]
pub struct Scratch {
    path: PathBuf,
    /// Held open, and so locked, until the directory is removed.
    _lock: File,
}

impl Scratch {
    /// Removes the stale scratch directories under `parent` ([`remove_stale`]), then makes this process's own.
    pub fn create(parent: &Path) -> io::Result<Self> {
        remove_stale(parent);
        let pid = std::process::id();
        let path = parent.join(format!("{PREFIX}{pid}"));
        // Made under a name no run removes, locked, then renamed into place: under its final name, a directory
        // is locked for as long as its owner lives.
        let staging = parent.join(format!(".{PREFIX}{pid}-new"));
        let _ = fs::remove_dir_all(&staging);
        fs::create_dir(&staging)?;
        let lock = File::create(staging.join(LOCK))?;
        lock.try_lock().map_err(io::Error::from)?;
        // A directory named for this pid can only be a dead process's: pids are unique among the living.
        let _ = fs::remove_dir_all(&path);
        fs::rename(&staging, &path)?;
        Ok(Self { path, _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// Removes the scratch directories under `parent` whose owner is gone, and returns them. A directory that cannot
/// be read or removed (another user's) is left as it is.
pub fn remove_stale(parent: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(parent) else { return Vec::new() };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|name| name.strip_prefix(PREFIX)) else { continue };
        if pid.parse::<u32>().is_err() || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let path = entry.path();
        // The lock stays held while the directory goes, so that no other run takes it meanwhile.
        let Owner::Gone(_held) = owner(&path, pid) else { continue };
        if fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// What is known of a scratch directory's owner.
enum Owner {
    /// Alive, or it cannot be told (the lock file cannot be opened: another user's directory).
    Alive,
    /// Gone: its lock, now held by this process (none for a directory without a lock file).
    Gone(Option<File>),
}

/// The owner of `dir`, the scratch directory of `pid`.
fn owner(dir: &Path, pid: &str) -> Owner {
    match File::open(dir.join(LOCK)) {
        Ok(lock) if lock.try_lock().is_ok() => Owner::Gone(Some(lock)),
        Ok(_) => Owner::Alive,
        // No lock file: a directory from before the lock. Its owner is gone when /proc has no such process.
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            let proc = Path::new("/proc");
            if proc.join("self").exists() && !proc.join(pid).exists() { Owner::Gone(None) } else { Owner::Alive }
        }
        Err(_) => Owner::Alive,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own per test, standing for the temporary directory.
    fn parent(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kforge-scratch-unit-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).expect("test dir");
        dir
    }

    /// A scratch directory as a run leaves it: with its lock file (not held), or without one.
    fn left_behind(parent: &Path, pid: u32, with_lock: bool) -> PathBuf {
        let dir = parent.join(format!("{PREFIX}{pid}"));
        fs::create_dir(&dir).expect("made");
        fs::write(dir.join("replay.jsonl"), "{}\n").expect("written");
        if with_lock {
            File::create(dir.join(LOCK)).expect("lock file");
        }
        dir
    }

    /// Above the kernel's largest pid (pid_max is at most 2^22): no process has it.
    const NO_SUCH_PID: u32 = 5_000_000;

    #[test]
    fn a_dead_owners_directory_is_removed_and_a_live_ones_is_not() {
        let parent = parent("owners");
        let dead = left_behind(&parent, 4242, true);
        // A live owner: its lock held (by another open file, as another process's would be).
        let live = left_behind(&parent, 4343, true);
        let held = File::open(live.join(LOCK)).expect("opened");
        held.try_lock().expect("locked");
        // Without a lock file: judged by its pid.
        let old_dead = left_behind(&parent, NO_SUCH_PID, false);
        let old_live = left_behind(&parent, std::process::id(), false);
        // Not a run's scratch: left alone.
        fs::create_dir(parent.join(format!("{PREFIX}unit-test"))).expect("made");
        fs::write(parent.join(format!("{PREFIX}77")), "a file").expect("written");

        let mut removed = remove_stale(&parent);
        removed.sort();
        assert_eq!(removed, [dead.clone(), old_dead.clone()]);
        assert!(!dead.exists() && !old_dead.exists());
        assert!(live.join("replay.jsonl").exists() && old_live.exists(), "a live owner's directory is kept");
        assert!(parent.join(format!("{PREFIX}unit-test")).exists() && parent.join(format!("{PREFIX}77")).exists());

        // Its owner gone, the live one goes at the next look.
        drop(held);
        assert_eq!(remove_stale(&parent), [live]);
        fs::remove_dir_all(&parent).expect("cleanup");
    }

    #[test]
    fn a_runs_own_directory_is_locked_while_it_lives_and_removed_when_it_ends() {
        let parent = parent("own");
        let stale = left_behind(&parent, 4242, true);
        let scratch = Scratch::create(&parent).expect("made");
        assert!(!stale.exists(), "a run removes the stale directories it finds");
        assert_eq!(scratch.path(), parent.join(format!("{PREFIX}{}", std::process::id())));
        assert!(scratch.path().join(LOCK).exists());
        assert_eq!(remove_stale(&parent), Vec::<PathBuf>::new(), "another run keeps it");
        let names: Vec<_> = fs::read_dir(&parent).expect("listed").flatten().map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 1, "no staging directory left: {names:?}");
        let path = scratch.path().to_owned();
        drop(scratch);
        assert!(!path.exists());
        fs::remove_dir_all(&parent).expect("cleanup");
    }
}
