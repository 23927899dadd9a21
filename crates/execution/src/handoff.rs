//! Where a GPU evaluation's outputs files go: memory where the host has room for them, else the disk.
//!
//! The candidate's process writes its kept trials' outputs and its timed call's output, the checker's process maps
//! them and compares; neither needs them on a disk. A task with multi-GiB outputs spent most of its warm
//! evaluation writing and reading them there (27-64 s in the candidate stage and 13-50 s in the check on two H200s)
//! and waiting for disk room held by others. So where a memory-backed filesystem is configured (`memory_files_dir`,
//! by default `/dev/shm`) and is one (tmpfs or ramfs, checked at start), the candidate's files go there, out of a
//! budget of their own ([`MemoryFiles`]); the reference's new cache entry still goes to the disk, which keeps it.
//! An evaluation whose candidate files would not fit the memory budget even alone uses the disk, as before.
//!
//! The sandbox already lets a candidate write under `/dev` (its devices and shared memory), so putting the
//! candidate's working directory in memory opens nothing it could not reach; its files are removed with the
//! evaluation, and a crashed evaluator's are removed by the next one to start on the same work directory.

use std::hash::BuildHasher;
use std::path::{Path, PathBuf};

use tokio::sync::OwnedSemaphorePermit;

use crate::disk::{self, DiskBudget, OutputPlan, TaskSizes};

/// `statfs` magic numbers of filesystems that keep their files in memory.
const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// A directory of this engine's on a memory-backed filesystem, and the bytes its files may take at once.
#[derive(Debug)]
pub struct MemoryFiles {
    root: PathBuf,
    budget: DiskBudget,
}

impl MemoryFiles {
    /// Files in memory under `dir`, if it is on a memory-backed filesystem and has room: at most `bytes` at once
    /// (0: half the smaller of the room left on the filesystem and the host's available memory, as they are now).
    /// The engine's directory under it is named after `work_dir`; entries a dead evaluator left there are removed.
    /// `None` (files go to the disk) where `dir` is empty, missing, not in memory, or the budget comes to nothing.
    pub fn open(dir: &Path, bytes: u64, work_dir: &Path) -> Option<Self> {
        if dir.as_os_str().is_empty() {
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
        let hasher = std::hash::BuildHasherDefault::<std::hash::DefaultHasher>::default();
        let root = dir.join(format!("kforge-{:016x}", hasher.hash_one(work_dir)));
        if let Err(error) = std::fs::create_dir_all(&root) {
            tracing::warn!(%error, root = %root.display(), "memory_files_dir: outputs files go to the disk");
            return None;
        }
        remove_dead_evaluators_files(&root);
        tracing::info!(root = %root.display(), bytes, "candidates' outputs files go to memory");
        Some(Self { root, budget: DiskBudget::new(bytes) })
    }

    pub fn budget(&self) -> &DiskBudget {
        &self.budget
    }

    /// The directory in memory for the evaluation whose scratch directory is `scratch` (same name; not created).
    pub fn dir_for(&self, scratch: &Path) -> PathBuf {
        self.root.join(scratch.file_name().unwrap_or(scratch.as_os_str()))
    }
}

impl Drop for MemoryFiles {
    /// The engine's directory goes with it, when no other engine on the same work directory has files there.
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.root);
    }
}

/// The room an evaluation's files hold until this drops, and whether the candidate's files go to memory.
#[derive(Debug)]
pub struct FilesRoom {
    pub candidate_in_memory: bool,
    _permits: Vec<OwnedSemaphorePermit>,
}

/// Waits for room for the files of an evaluation of a task of `sizes` and reserves it: the candidate's files in
/// memory where `memory` is given and they fit its budget, the reference's new entry (and everything, otherwise) on
/// the disk. An unknown task takes the whole disk budget. The disk is reserved first, always, so two evaluations
/// never each hold what the other waits for.
pub async fn reserve(
    disk: &DiskBudget,
    memory: Option<&MemoryFiles>,
    sizes: Option<TaskSizes>,
    plan: OutputPlan,
) -> FilesRoom {
    let memory = sizes.zip(memory).and_then(|(sizes, memory)| {
        let bytes = disk::files_bytes(sizes, plan);
        (bytes.candidate <= memory.budget.largest()).then_some((bytes, memory))
    });
    let Some((bytes, memory)) = memory else {
        let permit = disk.reserve(disk.need(sizes, plan)).await;
        return FilesRoom { candidate_in_memory: false, _permits: vec![permit] };
    };
    let mut permits = Vec::with_capacity(2);
    if bytes.reference > 0 {
        permits.push(disk.reserve(bytes.reference).await);
    }
    permits.push(memory.budget.reserve(bytes.candidate).await);
    FilesRoom { candidate_in_memory: true, _permits: permits }
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn host_available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Removes the entries under `root` of evaluator processes no longer alive (scratch names start with the pid).
fn remove_dead_evaluators_files(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|name| name.split('-').next()).and_then(|pid| pid.parse::<u32>().ok());
        if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn memory(bytes: u64) -> Option<MemoryFiles> {
        let dir = Path::new("/dev/shm");
        let work_dir = std::env::temp_dir().join(format!("kforge-handoff-test-{}", std::process::id()));
        MemoryFiles::open(dir, bytes, &work_dir)
    }

    #[tokio::test]
    async fn candidate_files_go_to_memory_when_they_fit_and_the_reference_s_entry_to_the_disk() {
        let Some(memory) = memory(30 * GIB) else {
            println!("SKIP: /dev/shm is not a memory-backed filesystem here");
            return;
        };
        let disk = DiskBudget::new(100 * GIB);
        let plan = OutputPlan { trials: 8, budget: 12 * GIB, new_reference: true };
        let sizes = |output_bytes| Some(TaskSizes { input_bytes: 0, output_bytes });

        let room = reserve(&disk, Some(&memory), sizes(8 * GIB), plan).await;
        assert!(room.candidate_in_memory);
        assert_eq!(memory.budget().unreserved(), 6 * GIB, "two trials and the timed output in memory");
        assert_eq!(disk.unreserved(), 84 * GIB, "the reference's new entry on the disk");
        drop(room);
        assert_eq!((memory.budget().unreserved(), disk.unreserved()), (30 * GIB, 100 * GIB));

        let too_large = reserve(&disk, Some(&memory), sizes(16 * GIB), plan).await;
        assert!(!too_large.candidate_in_memory, "48 GiB of candidate files never fit 30: the disk takes them");
        assert_eq!(memory.budget().unreserved(), 30 * GIB);
        drop(too_large);

        let unknown = reserve(&disk, Some(&memory), None, plan).await;
        assert!(!unknown.candidate_in_memory, "an unknown task writes alone on the disk");
        assert_eq!(disk.unreserved(), 100 * GIB - disk.largest());
        drop(unknown);

        let without_memory = reserve(&disk, None, sizes(GIB), plan).await;
        assert!(!without_memory.candidate_in_memory);
        assert_eq!(disk.unreserved(), 100 * GIB - 17 * GIB, "both sides on the disk: nine files and eight");
    }

    #[test]
    fn only_a_memory_backed_directory_holds_files_in_memory() {
        let work_dir = std::env::temp_dir().join("kforge-handoff-test-kinds");
        assert!(MemoryFiles::open(Path::new(""), 0, &work_dir).is_none(), "empty: off");
        assert!(MemoryFiles::open(Path::new("/no/such/dir"), 0, &work_dir).is_none());
        assert!(MemoryFiles::open(Path::new("/proc"), GIB, &work_dir).is_none(), "procfs is not tmpfs");
        if let Some(memory) = MemoryFiles::open(Path::new("/dev/shm"), GIB, &work_dir) {
            let dir = memory.dir_for(Path::new("/work/scratch/123-7"));
            assert!(dir.starts_with("/dev/shm") && dir.ends_with("123-7"), "{}", dir.display());
        }
    }

    #[tokio::test]
    async fn a_sandboxed_job_works_in_a_directory_in_memory() {
        let work_dir = std::env::temp_dir().join(format!("kforge-handoff-sandbox-{}", std::process::id()));
        let Some(memory) = MemoryFiles::open(Path::new("/dev/shm"), GIB, &work_dir) else {
            println!("SKIP: /dev/shm is not a memory-backed filesystem here");
            return;
        };
        let dir = memory.dir_for(&work_dir.join(format!("{}-1", std::process::id()))).join("candidate");
        std::fs::create_dir_all(&dir).expect("the directory in memory");
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
        let _ = std::fs::remove_dir_all(dir.parent().expect("the evaluation's directory"));
    }

    #[test]
    fn a_dead_evaluator_s_files_are_removed_and_a_live_one_s_kept() {
        let root = std::env::temp_dir().join(format!("kforge-handoff-dead-{}", std::process::id()));
        let live = root.join(format!("{}-3", std::process::id()));
        let dead = root.join(format!("{}-4", u32::MAX - 1));
        for dir in [&live, &dead] {
            std::fs::create_dir_all(dir.join("candidate")).expect("test dirs");
        }
        remove_dead_evaluators_files(&root);
        assert!(live.exists() && !dead.exists());
        let _ = std::fs::remove_dir_all(root);
    }
}
