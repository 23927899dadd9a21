//! Where a GPU evaluation's outputs files go: memory where the host has room for them, else the disk.
//!
//! The candidate's process writes its kept trials' outputs and its timed calls' outputs, the checker's process maps
//! them and compares; neither needs them on a disk. A task with multi-GiB outputs spent most of its warm
//! evaluation writing and reading them there (27-64 s in the candidate stage and 13-50 s in the check on two H200s)
//! and waiting for disk room held by others. So where a memory-backed filesystem is configured (`memory_files_dir`,
//! by default `/dev/shm`) and is one (tmpfs or ramfs, checked at start), the candidate's files go there, out of a
//! budget of their own ([`MemoryFiles`]); the reference's new cache entry still goes to the disk, which keeps it.
//! An evaluation whose candidate files would not fit the memory budget even alone uses the disk, as before.
//!
//! Landlock cannot keep a candidate out of `/dev/shm` (it may write under `/dev`: its devices and shared memory),
//! so there the candidates' directories are kept apart by names no other job can learn: the engine's directory has
//! a random name and mode 0711 (entered, never listed, by others), each evaluation's a random name inside it, and
//! every command runs as a command user of its own, so no job reads another's working directory through `/proc`.
//! Without command users (an evaluator that is not root), jobs share one user and could: outputs then go to the disk.
//! The engine's directory holds a lock for the engine's life; an engine starting removes the directories of its
//! user whose lock nobody holds (an evaluator that died), in any pid namespace sharing the filesystem.

use std::hash::BuildHasher;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tokio::sync::OwnedSemaphorePermit;

use crate::disk::{self, DiskBudget, OutputPlan, TaskSizes};
use crate::scratch::RemoveOnDrop;

/// `statfs` magic numbers of filesystems that keep their files in memory.
const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// The name of the file whose lock marks an engine's directory as in use.
const LOCK: &str = ".lock";

/// A directory of this engine's on a memory-backed filesystem, and the bytes its files may take at once.
#[derive(Debug)]
pub struct MemoryFiles {
    root: PathBuf,
    budget: DiskBudget,
    /// Held (`flock`) while the engine lives: what tells a later engine this directory is not a dead one's.
    _lock: std::fs::File,
}

impl MemoryFiles {
    /// Files in memory under `dir`, if it is on a memory-backed filesystem, commands run as command users of their own
    /// (`command_users`), and there is room: at most `bytes` at once (0: half the smaller of the room left on the
    /// filesystem and the host's available memory, as they are now). Directories dead engines of this user left
    /// under `dir` are removed first. `None` (files go to the disk) otherwise, saying why.
    pub fn open(dir: &Path, bytes: u64, command_users: bool) -> Option<Self> {
        if dir.as_os_str().is_empty() {
            return None;
        }
        if !command_users {
            tracing::info!(
                dir = %dir.display(),
                "commands share one user (no command users): candidates could reach each other's files in memory, so \
                 outputs files go to the disk"
            );
            return None;
        }
        let kind = match rustix::fs::statfs(dir) {
            #[allow(clippy::unnecessary_cast)] // its type differs between architectures
            Ok(stat) => stat.f_type as i64,
            Err(error) => {
                tracing::info!(%error, dir = %dir.display(), "memory_files_dir unusable: outputs files go to the disk");
                return None;
            }
        };
        if kind != TMPFS_MAGIC && kind != RAMFS_MAGIC {
            tracing::info!(dir = %dir.display(), "memory_files_dir is not memory-backed: outputs files go to the disk");
            return None;
        }
        let bytes = match bytes {
            0 => disk::available_bytes(dir).unwrap_or(0).min(host_available_memory().unwrap_or(0)) / 2,
            bytes => bytes,
        };
        if bytes < (64 << 20) {
            tracing::info!(dir = %dir.display(), bytes, "too little room in memory: outputs files go to the disk");
            return None;
        }
        remove_dead_engines_directories(dir);
        // Made under a name the removal above never matches, locked, then renamed: no engine starting meanwhile
        // sees it unlocked and takes it for a dead one's.
        let name = random_name();
        let (making, root) = (dir.join(format!(".kforge-{name}")), dir.join(format!("kforge-{name}")));
        let made = std::fs::DirBuilder::new().mode(0o711).create(&making).and_then(|()| {
            let lock = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(making.join(LOCK))?;
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
            std::fs::rename(&making, &root)?;
            Ok(lock)
        });
        let lock = match made {
            Ok(lock) => lock,
            Err(error) => {
                tracing::warn!(%error, root = %root.display(), "memory_files_dir: outputs files go to the disk");
                let _ = std::fs::remove_dir_all(&making);
                return None;
            }
        };
        tracing::info!(root = %root.display(), bytes, "candidates' outputs files go to memory");
        Some(Self { root, budget: DiskBudget::new(bytes), _lock: lock })
    }

    pub fn budget(&self) -> &DiskBudget {
        &self.budget
    }

    /// A fresh directory path in memory for one evaluation, its name random (not created).
    fn new_dir(&self) -> PathBuf {
        self.root.join(random_name())
    }
}

impl Drop for MemoryFiles {
    /// The engine's directory goes with it (its evaluations' directories are gone already).
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// 128 random bits, as hex: a name no other process can guess.
fn random_name() -> String {
    let [a, b] = [0u8, 1].map(|i| std::collections::hash_map::RandomState::new().hash_one(i));
    format!("{a:016x}{b:016x}")
}

/// The room an evaluation's files hold until this drops, and the candidate's directory in memory, if it got one.
#[derive(Debug)]
pub struct FilesRoom {
    /// The candidate's directory in memory, which holds the room until it is gone (removed off the async worker).
    memory_dir: Option<RemoveOnDrop>,
    /// The room, where the files go to the disk.
    _permits: Vec<OwnedSemaphorePermit>,
}

impl FilesRoom {
    /// The candidate's working directory in memory (made, empty), where its files go; `None`: the disk.
    pub fn memory_dir(&self) -> Option<&Path> {
        self.memory_dir.as_ref().map(RemoveOnDrop::path)
    }
}

/// Waits for room for the files of an evaluation of a task of `sizes` and reserves it: the candidate's files in
/// memory, in a directory of their own made here, where `memory` is given and they fit its budget; the reference's
/// new entry (and everything, otherwise) on the disk. An unknown task takes the whole disk budget. The disk is
/// reserved first, always, so two evaluations never each hold what the other waits for.
pub async fn reserve(
    disk: &DiskBudget,
    memory: Option<&MemoryFiles>,
    sizes: Option<TaskSizes>,
    plan: OutputPlan,
) -> std::io::Result<FilesRoom> {
    let memory = sizes.zip(memory).and_then(|(sizes, memory)| {
        let bytes = disk::files_bytes(sizes, plan);
        (bytes.candidate <= memory.budget.largest()).then_some((bytes, memory))
    });
    let Some((bytes, memory)) = memory else {
        let permit = disk.reserve(disk.need(sizes, plan)).await;
        return Ok(FilesRoom { memory_dir: None, _permits: vec![permit] });
    };
    let mut permits = Vec::with_capacity(2);
    if bytes.reference > 0 {
        permits.push(disk.reserve(bytes.reference).await);
    }
    permits.push(memory.budget.reserve(bytes.candidate).await);
    // Not `create_dir_all`: the engine's directory (mode 0711) is never made again here.
    let dir = memory.new_dir();
    std::fs::create_dir(&dir)?;
    Ok(FilesRoom { memory_dir: Some(RemoveOnDrop::holding(dir, permits)), _permits: vec![] })
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn host_available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Removes the engines' directories under `dir` that this user owns and whose lock no engine holds: engines that
/// died (a killed evaluator's outputs would otherwise hold host memory until the next reboot). Links, other users'
/// entries and directories without a lock file are left alone.
fn remove_dead_engines_directories(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let user = rustix::process::geteuid().as_raw();
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with("kforge-") {
            continue;
        }
        let path = entry.path();
        let ours = std::fs::symlink_metadata(&path).is_ok_and(|meta| meta.is_dir() && meta.uid() == user);
        let nofollow = rustix::fs::OFlags::NOFOLLOW.bits() as i32;
        let dead = ours
            && std::fs::OpenOptions::new().read(true).custom_flags(nofollow).open(path.join(LOCK)).is_ok_and(|lock| {
                rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok()
            });
        if dead {
            tracing::info!(dir = %path.display(), "removing a dead evaluator's outputs files in memory");
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn candidate_files_go_to_memory_when_they_fit_and_the_reference_s_entry_to_the_disk() {
        // One blocking thread: the directory's removal, and the room it holds, are awaited (`scratch::settled`).
        let runtime = tokio::runtime::Builder::new_current_thread().max_blocking_threads(1).build().expect("runtime");
        runtime.block_on(files_in_memory_and_on_the_disk());
    }

    async fn files_in_memory_and_on_the_disk() {
        let Some(memory) = MemoryFiles::open(Path::new("/dev/shm"), 30 * GIB, true) else {
            println!("SKIP: /dev/shm is not a memory-backed filesystem here");
            return;
        };
        let disk = DiskBudget::new(100 * GIB);
        let plan = OutputPlan { trials: 8, budget: 12 * GIB, new_reference: true };
        let sizes = |output_bytes| Some(TaskSizes { input_bytes: 0, output_bytes });

        let room = reserve(&disk, Some(&memory), sizes(8 * GIB), plan).await.expect("room");
        let dir = room.memory_dir().expect("in memory").to_owned();
        assert!(dir.starts_with(&memory.root) && dir.is_dir(), "made in the engine's directory");
        assert_eq!(memory.budget().unreserved(), 6 * GIB, "two trials and the timed output in memory");
        assert_eq!(disk.unreserved(), 84 * GIB, "the reference's new entry on the disk");
        drop(room);
        crate::scratch::settled().await;
        assert_eq!((memory.budget().unreserved(), disk.unreserved()), (30 * GIB, 100 * GIB));
        assert!(!dir.exists(), "gone with the room");

        let too_large = reserve(&disk, Some(&memory), sizes(16 * GIB), plan).await.expect("room");
        assert!(too_large.memory_dir().is_none(), "48 GiB of candidate files never fit 30: the disk takes them");
        assert_eq!(memory.budget().unreserved(), 30 * GIB);
        drop(too_large);

        let unknown = reserve(&disk, Some(&memory), None, plan).await.expect("room");
        assert!(unknown.memory_dir().is_none(), "an unknown task writes alone on the disk");
        assert_eq!(disk.unreserved(), 100 * GIB - disk.largest());
        drop(unknown);

        let without_memory = reserve(&disk, None, sizes(GIB), plan).await.expect("room");
        assert!(without_memory.memory_dir().is_none());
        assert_eq!(disk.unreserved(), 100 * GIB - 18 * GIB, "both sides on the disk: ten files and eight");
    }

    #[test]
    fn only_a_memory_backed_directory_with_command_users_holds_files_in_memory() {
        assert!(MemoryFiles::open(Path::new(""), 0, true).is_none(), "empty: off");
        assert!(MemoryFiles::open(Path::new("/no/such/dir"), 0, true).is_none());
        assert!(MemoryFiles::open(Path::new("/proc"), GIB, true).is_none(), "procfs is not tmpfs");
        assert!(MemoryFiles::open(Path::new("/dev/shm"), GIB, false).is_none(), "jobs sharing one user: the disk");
        let Some(memory) = MemoryFiles::open(Path::new("/dev/shm"), GIB, true) else {
            println!("SKIP: /dev/shm is not a memory-backed filesystem here: its directory is not checked");
            return;
        };
        let root = memory.root.clone();
        let meta = std::fs::metadata(&root).expect("the engine's directory");
        assert_eq!(meta.mode() & 0o777, 0o711, "others may enter it, never list it");
        let (first, second) = (memory.new_dir(), memory.new_dir());
        assert!(first.starts_with(&root) && second.starts_with(&root) && first != second);
        assert_eq!(first.file_name().expect("a name").len(), 32, "128 random bits");
        drop(memory);
        assert!(!root.exists(), "gone with its engine");
    }

    #[tokio::test]
    async fn a_sandboxed_job_works_in_a_directory_in_memory() {
        let Some(memory) = MemoryFiles::open(Path::new("/dev/shm"), GIB, true) else {
            println!("SKIP: /dev/shm is not a memory-backed filesystem here");
            return;
        };
        let dir = memory.new_dir();
        std::fs::create_dir(&dir).expect("the directory in memory");
        // Every protection this host has (Landlock, command users, namespaces), as the engine runs candidates.
        let sandbox = kforge_sandbox::Sandbox::detect().await;
        let command = kforge_sandbox::Command {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "head -c 1048576 /dev/zero > out && pwd".into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            scratch: dir.clone(),
            readable: vec![],
            writable: vec![],
            limits: kforge_sandbox::Limits::default(),
        };
        let finished = sandbox.run(command, tokio_util::sync::CancellationToken::new()).await.expect("the job runs");
        assert!(finished.success(), "{}", finished.stderr_tail(2000));
        assert_eq!(String::from_utf8_lossy(&finished.stdout).trim(), dir.display().to_string());
        assert_eq!(std::fs::metadata(dir.join("out")).expect("the job's file").len(), 1 << 20);
    }

    #[test]
    fn a_dead_engine_s_directory_is_removed_and_a_live_one_s_kept() {
        let dir = std::env::temp_dir().join(format!("kforge-handoff-dead-{}", std::process::id()));
        let (live, dead, unlocked) = (dir.join("kforge-live"), dir.join("kforge-dead"), dir.join("kforge-new"));
        for engine in [&live, &dead, &unlocked] {
            std::fs::create_dir_all(engine.join("evaluation")).expect("test dirs");
        }
        let held = std::fs::File::create(live.join(LOCK)).expect("lock file");
        rustix::fs::flock(&held, rustix::fs::FlockOperation::NonBlockingLockExclusive).expect("locked");
        std::fs::File::create(dead.join(LOCK)).expect("lock file");
        remove_dead_engines_directories(&dir);
        assert!(live.exists(), "its lock is held");
        assert!(!dead.exists(), "nobody holds its lock");
        assert!(unlocked.exists(), "no lock file: not an engine's");
        drop(held);
        let _ = std::fs::remove_dir_all(dir);
    }
}
