//! A pids cgroup per command: a cap on the command's processes and threads that holds for root too (RLIMIT_NPROC does
//! not: it binds neither root nor, usefully, commands that share one user), and a list of every process of the command,
//! including those that left its process group with `setsid`, so that all of them are killed at its end.
//!
//! The evaluator must be able to create cgroups in the pids hierarchy it is in: cgroup v1's `pids` hierarchy, or
//! its own cgroup v2 cgroup, writable, with `pids` available (the processes in it then move to a leaf beside the
//! command cgroups: see [`enable_pids_v2`]). Where it cannot, the protection is reported inactive with the reason.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::sys;

/// Why this host gives commands no pids cgroup (the protection's report says so).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CgroupUnavailable {
    #[error("{}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("no cgroup hierarchy with the pids controller is mounted")]
    NoPidsHierarchy,
    #[error("cgroup v2: the pids controller is not available to {}", dir.display())]
    PidsNotAvailable { dir: PathBuf },
    #[error("{}: {source}", dir.display())]
    Leaf { dir: PathBuf, source: std::io::Error },
    #[error("cgroup v2: enabling pids for the children of {}: {source}", dir.display())]
    Enable { dir: PathBuf, source: std::io::Error },
    #[error("cannot create a cgroup in {}: {source}", dir.display())]
    Create { dir: PathBuf, source: std::io::Error },
}

fn read(path: &Path) -> Result<String, CgroupUnavailable> {
    std::fs::read_to_string(path).map_err(|source| CgroupUnavailable::Read { path: path.to_owned(), source })
}

/// Where this process may create command cgroups: the directory of its own cgroup in a hierarchy with `pids`.
#[derive(Debug, Clone)]
pub(crate) struct PidsCgroups {
    parent: PathBuf,
    version: u8,
}

/// One command's cgroup; removed (after killing what is left in it) on drop.
#[derive(Debug)]
pub(crate) struct CommandCgroup {
    dir: PathBuf,
    /// `cgroup.procs`, opened for the child to write itself into between fork and exec (close-on-exec).
    procs: OwnedFd,
}

impl PidsCgroups {
    /// Finds the pids hierarchy of this process and checks that a command cgroup can be made there.
    pub(crate) fn detect() -> Result<Self, CgroupUnavailable> {
        let (own, mounts) = (read(Path::new("/proc/self/cgroup"))?, read(Path::new("/proc/self/mountinfo"))?);
        let (parent, version) = own_dir(&own, &mounts)?;
        if version == 2 {
            enable_pids_v2(&parent)?;
        }
        let cgroups = Self { parent, version };
        cgroups.remove_stale();
        // A real command cgroup, made and removed: creating and limiting are what commands need.
        let made = cgroups.create(16);
        drop(made.map_err(|source| CgroupUnavailable::Create { dir: cgroups.parent.clone(), source })?);
        Ok(cgroups)
    }

    /// Removes the command cgroups of evaluators that are gone (a crash leaves them), killing what is left in them.
    fn remove_stale(&self) {
        let Ok(entries) = std::fs::read_dir(&self.parent) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(owner) = name.to_str().and_then(|n| n.strip_prefix("kforge-")?.split('-').next()?.parse().ok())
            else {
                continue;
            };
            if sys::process_gone(owner) {
                let (dir, procs) = (entry.path(), std::fs::File::open(entry.path().join("cgroup.procs")));
                if let Ok(procs) = procs {
                    drop(CommandCgroup { dir, procs: procs.into() });
                }
            }
        }
    }

    /// What the protection's report says about where command cgroups go.
    pub(crate) fn describe(&self) -> String {
        format!("cgroup v{} pids controller under {}", self.version, self.parent.display())
    }

    /// A new command cgroup limited to `max` processes and threads.
    pub(crate) fn create(&self, max: u64) -> std::io::Result<CommandCgroup> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = self.parent.join(format!("kforge-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir(&dir)?;
        let made = || -> std::io::Result<OwnedFd> {
            std::fs::OpenOptions::new()
                .write(true)
                .open(dir.join("pids.max"))?
                .write_all(max.to_string().as_bytes())?;
            // Close-on-exec by default in std: the child writes before it execs.
            Ok(std::fs::OpenOptions::new().write(true).open(dir.join("cgroup.procs"))?.into())
        };
        match made() {
            Ok(procs) => Ok(CommandCgroup { dir, procs }),
            Err(error) => {
                let _ = std::fs::remove_dir(&dir);
                Err(error)
            }
        }
    }
}

impl CommandCgroup {
    /// The descriptor the child writes `0` to, to move itself in.
    pub(crate) fn procs_fd(&self) -> i32 {
        self.procs.as_raw_fd()
    }

    /// The processes in the cgroup now.
    fn pids(&self) -> Vec<libc::pid_t> {
        std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse().ok())
            .collect()
    }

    /// SIGKILLs every process in the cgroup until it is empty (a process forking meanwhile is caught by the next
    /// round; the cap bounds how many there can be).
    pub(crate) fn kill_all(&self) {
        for _ in 0..100 {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                sys::signal_process(pid, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for CommandCgroup {
    fn drop(&mut self) {
        self.kill_all();
        // Killed processes leave the cgroup once they have exited; until then it cannot be removed.
        for _ in 0..200 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        tracing::warn!(dir = %self.dir.display(), "a job cgroup could not be removed");
    }
}

/// The directory of this process's cgroup in a hierarchy with the pids controller, and the cgroup version, from
/// `/proc/self/cgroup` and `/proc/self/mountinfo`.
fn own_dir(own: &str, mountinfo: &str) -> Result<(PathBuf, u8), CgroupUnavailable> {
    // Mount point, root within the hierarchy, file system type and super options of each cgroup mount.
    let mounts: Vec<(&str, &str, &str, &str)> = mountinfo
        .lines()
        .filter_map(|line| {
            let (head, tail) = line.split_once(" - ")?;
            let head: Vec<&str> = head.split(' ').collect();
            let tail: Vec<&str> = tail.split(' ').collect();
            Some((*head.get(4)?, *head.get(3)?, *tail.first()?, *tail.get(2)?))
        })
        .filter(|(_, _, fstype, _)| fstype.starts_with("cgroup"))
        .collect();
    let under = |mount: &str, root: &str, path: &str| {
        let relative = path.strip_prefix(root).unwrap_or(path).trim_start_matches('/');
        Path::new(mount).join(relative)
    };
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        if controllers.split(',').any(|c| c == "pids") {
            let mount = mounts.iter().find(|(_, _, fstype, options)| {
                *fstype == "cgroup" && options.split(',').any(|option| option == "pids")
            });
            if let Some((mount, root, _, _)) = mount {
                return Ok((under(mount, root, path), 1));
            }
        }
    }
    let v2 = own.lines().find_map(|line| line.strip_prefix("0::"));
    let mount = mounts.iter().find(|(_, _, fstype, _)| *fstype == "cgroup2");
    match (v2, mount) {
        (Some(path), Some((mount, root, _, _))) => Ok((under(mount, root, path), 2)),
        _ => Err(CgroupUnavailable::NoPidsHierarchy),
    }
}

/// Under cgroup v2, command cgroups need `pids` in `dir`'s `cgroup.subtree_control`, and a cgroup that enables
/// controllers for its children may hold no processes itself: the processes of `dir` (this evaluator, and
/// whatever shares its cgroup, such as a container's other processes) move to a leaf `kforge-evaluator` beside
/// the commands first. They stay inside `dir`, under its limits.
fn enable_pids_v2(dir: &Path) -> Result<(), CgroupUnavailable> {
    let read = |name: &str| read(&dir.join(name));
    if read("cgroup.subtree_control")?.split_whitespace().any(|c| c == "pids") {
        return Ok(());
    }
    if !read("cgroup.controllers")?.split_whitespace().any(|c| c == "pids") {
        return Err(CgroupUnavailable::PidsNotAvailable { dir: dir.to_owned() });
    }
    let leaf = dir.join("kforge-evaluator");
    std::fs::create_dir_all(&leaf).map_err(|source| CgroupUnavailable::Leaf { dir: leaf.clone(), source })?;
    for _ in 0..10 {
        let pids = read("cgroup.procs")?;
        if pids.trim().is_empty() {
            break;
        }
        for pid in pids.lines() {
            // A process that exited meanwhile cannot move, and need not.
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .open(leaf.join("cgroup.procs"))
                .and_then(|mut procs| procs.write_all(pid.trim().as_bytes()));
        }
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.subtree_control"))
        .and_then(|mut control| control.write_all(b"+pids"))
        .map_err(|source| CgroupUnavailable::Enable { dir: dir.to_owned(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pids_hierarchy_is_found_in_v1_and_v2_layouts() {
        let v1_own = "9:name=systemd:/\n8:pids:/jobs/evaluator\n4:memory:/x\n0::/\n";
        let v1_mounts = "30 25 0:26 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids\n\
                         31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(own_dir(v1_own, v1_mounts).ok(), Some((PathBuf::from("/sys/fs/cgroup/pids/jobs/evaluator"), 1)));
        // A container sees its own cgroup as the mount's root.
        let nested = "30 25 0:26 /kubepods/pod1 /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n";
        assert_eq!(
            own_dir("8:pids:/kubepods/pod1/c\n", nested).ok(),
            Some((PathBuf::from("/sys/fs/cgroup/pids/c"), 1))
        );
        // cgroup v2: the process's own cgroup.
        let v2_mounts = "32 23 0:28 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            own_dir("0::/process_api/0ea5\n", v2_mounts).ok(),
            Some((PathBuf::from("/sys/fs/cgroup/process_api/0ea5"), 2))
        );
        assert!(matches!(
            own_dir("0::/\n", "1 0 8:1 / / rw - ext4 /dev/root rw\n"),
            Err(CgroupUnavailable::NoPidsHierarchy)
        ));
        // A v2 cgroup that cannot have pids: a reason, not a limit.
        let reason = enable_pids_v2(Path::new("/nonexistent-cgroup")).expect_err("no such cgroup").to_string();
        assert!(reason.contains("/nonexistent-cgroup"), "{reason}");
    }
}
