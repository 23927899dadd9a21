//! Content-addressed caches on local disk: compiled artifacts, reference outputs, baseline timings.
//!
//! A key is the SHA-256 of everything that determines the entry (sources, backend, software versions, device).
//! Entries are built under an exclusive file lock, so concurrent evaluations (and processes sharing the
//! directory, such as test binaries) build each entry once; a completed entry carries a marker file and is never
//! modified again.
//!
//! A cache may have a size bound: [`Cache::evict`] removes completed entries until those left fit, the one with the
//! largest size times time since last use (the marker's modification time, refreshed on every hit) first, so one
//! multi-GB entry left unused goes before many small ones used a while ago. An entry in use is pinned with a shared
//! lock ([`Cache::pin`]) and an entry being built holds its exclusive lock; eviction skips both. An entry being
//! built does not count against the bound (the evaluator reserves a new reference entry's room in its disk budget),
//! and an unfinished one nobody holds (its builder died or gave up) is removed. Lock files
//! are never removed (a removed lock file could let two holders lock different files of the same name); they are
//! empty.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// The hex SHA-256 of `parts`, each length-prefixed so that no two part lists collide.
pub fn key(parts: &[&[u8]]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

/// One cache: a directory of entries named by key.
#[derive(Debug, Clone)]
pub struct Cache {
    root: PathBuf,
    /// Evict down to this many bytes; `None`: unbounded.
    max_bytes: Option<u64>,
    /// Keys this process's evictions leave alone ([`Cache::protect`]), with how many hold each.
    protected: Arc<Mutex<HashMap<String, usize>>>,
}

/// A key kept from this process's evictions until dropped ([`Cache::protect`]).
#[derive(Debug)]
pub struct Protected {
    protected: Arc<Mutex<HashMap<String, usize>>>,
    key: String,
}

impl Drop for Protected {
    fn drop(&mut self) {
        let mut protected = self.protected.lock().expect("never poisoned");
        if let Some(count) = protected.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                protected.remove(&self.key);
            }
        }
    }
}

/// What a completed entry holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Built; the marker's contents (e.g. a compile log or timing samples).
    Ready(String),
    /// Building failed deterministically (a compile error); the marker's contents say why.
    Failed(String),
}

/// An entry held for use: pinned with what it holds when complete, else locked for its builder.
#[derive(Debug)]
pub enum Held {
    Pinned(EntryLock, Entry),
    Building(EntryLock),
}

/// A lock on one entry (exclusive while building, shared while in use), released on drop.
#[derive(Debug)]
pub struct EntryLock {
    _file: File,
}

impl Cache {
    /// A cache in `root`, bounded to `max_bytes` (0: unbounded).
    pub fn new(root: PathBuf, max_bytes: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        Ok(Self { root, max_bytes: (max_bytes > 0).then_some(max_bytes), protected: Arc::default() })
    }

    /// Keeps the entry from this process's evictions until the guard drops, without locking it: for an entry an
    /// evaluation will pin later, after it has waited for other resources (a lock held while waiting for those could
    /// deadlock with another evaluation that holds them and waits to build the entry).
    pub fn protect(&self, key: &str) -> Protected {
        *self.protected.lock().expect("never poisoned").entry(key.to_owned()).or_default() += 1;
        Protected { protected: self.protected.clone(), key: key.to_owned() }
    }

    /// The entry's directory (created on demand by the builder).
    pub fn dir(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    /// The completed entry, if any; a hit counts as a use for eviction.
    pub fn get(&self, key: &str) -> Option<Entry> {
        let dir = self.dir(key);
        for (name, kind) in [("ready", Entry::Ready as fn(String) -> Entry), ("failed", Entry::Failed)] {
            if let Ok(text) = std::fs::read_to_string(dir.join(name)) {
                if self.max_bytes.is_some()
                    && let Ok(marker) = File::options().append(true).open(dir.join(name))
                {
                    let _ = marker.set_modified(SystemTime::now());
                }
                return Some(kind(text));
            }
        }
        None
    }

    /// Waits for the entry's exclusive lock, to build it (blocking I/O, so on the blocking pool).
    pub async fn lock(&self, key: &str) -> std::io::Result<EntryLock> {
        self.lock_as(key, false).await
    }

    /// Waits for a shared lock on the entry: eviction leaves it alone while the lock is held.
    pub async fn pin(&self, key: &str) -> std::io::Result<EntryLock> {
        self.lock_as(key, true).await
    }

    /// The entry pinned with what it holds when it is complete, else its exclusive lock to build it. An entry that
    /// another builder completes while this waits for the lock is pinned, not built again; one evicted between
    /// being found and being pinned is built again: a caller never gets a complete entry it does not hold.
    pub async fn pin_or_lock(&self, key: &str) -> std::io::Result<Held> {
        loop {
            if self.get(key).is_some() {
                let pin = self.pin(key).await?;
                if let Some(entry) = self.get(key) {
                    return Ok(Held::Pinned(pin, entry));
                }
            }
            let lock = self.lock(key).await?;
            if self.get(key).is_none() {
                return Ok(Held::Building(lock));
            }
        }
    }

    async fn lock_as(&self, key: &str, shared: bool) -> std::io::Result<EntryLock> {
        let path = self.lock_path(key);
        tokio::task::spawn_blocking(move || {
            let file = File::options().create(true).truncate(false).write(true).open(&path)?;
            if shared {
                file.lock_shared()?
            } else {
                file.lock()?
            }
            Ok(EntryLock { _file: file })
        })
        .await
        .map_err(std::io::Error::other)?
    }

    fn lock_path(&self, key: &str) -> PathBuf {
        self.root.join(format!("{key}.lock"))
    }

    /// Removes completed entries until those left fit the cache's bound, the largest long unused first (by size
    /// times the time since last use), and unfinished entries nobody holds (a builder that died). Entries pinned or
    /// being built stay, and one being built does not count against the bound (the reference cache's new entries
    /// have room in the evaluator's disk budget). Returns how many were removed. Blocking I/O.
    pub fn evict(&self) -> usize {
        let Some(max_bytes) = self.max_bytes else { return 0 };
        let Ok(listing) = std::fs::read_dir(&self.root) else { return 0 };
        let now = SystemTime::now();
        let mut completed = Vec::new();
        let mut removed = 0;
        for entry in listing.filter_map(|e| e.ok()).filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
            let Ok(key) = entry.file_name().into_string() else { continue };
            match last_use(&entry.path()) {
                Some(used) => {
                    let size = size_of(&entry.path());
                    let idle = now.duration_since(used).unwrap_or_default().as_secs_f64();
                    completed.push((size as f64 * idle, size, key));
                }
                None => removed += usize::from(self.remove_unlocked(&key, Unless::Completed)),
            }
        }
        let mut total: u64 = completed.iter().map(|(_, size, _)| size).sum();
        completed.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, size, key) in completed {
            if total <= max_bytes {
                break;
            }
            if self.remove_unlocked(&key, Unless::Never) {
                total = total.saturating_sub(size);
                removed += 1;
            }
        }
        removed
    }

    /// Removes the entry if nobody holds its lock (pinned or building) or protects it, and unless `unless` says
    /// otherwise once the lock is held (an entry seen unfinished may have been completed since).
    fn remove_unlocked(&self, key: &str, unless: Unless) -> bool {
        if self.protected.lock().expect("never poisoned").contains_key(key) {
            return false;
        }
        let Ok(file) = File::options().create(true).truncate(false).write(true).open(self.lock_path(key)) else {
            return false;
        };
        if file.try_lock().is_err() || (unless == Unless::Completed && last_use(&self.dir(key)).is_some()) {
            return false;
        }
        std::fs::remove_dir_all(self.dir(key)).is_ok()
    }

    /// Marks the entry complete. Hold its lock.
    pub fn complete(&self, key: &str, entry: &Entry, _lock: &EntryLock) -> std::io::Result<()> {
        let dir = self.dir(key);
        std::fs::create_dir_all(&dir)?;
        let (name, text) = match entry {
            Entry::Ready(text) => ("ready", text),
            Entry::Failed(text) => ("failed", text),
        };
        // Write then rename: a reader sees the marker whole or not at all.
        let temporary = dir.join(format!(".{name}.tmp"));
        std::fs::write(&temporary, text)?;
        std::fs::rename(temporary, dir.join(name))
    }

    /// Removes an unfinished entry's directory (after a build that failed for a reason worth retrying).
    pub fn discard(&self, key: &str, _lock: &EntryLock) {
        let _ = std::fs::remove_dir_all(self.dir(key));
    }
}

/// When an entry must be kept after all, its lock held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unless {
    Never,
    Completed,
}

/// A completed entry's last use (its marker's modification time); `None` while unfinished.
fn last_use(dir: &Path) -> Option<SystemTime> {
    ["ready", "failed"].iter().find_map(|marker| std::fs::metadata(dir.join(marker)).and_then(|m| m.modified()).ok())
}

/// Bytes of the regular files under `path`.
fn size_of(path: &Path) -> u64 {
    let Ok(listing) = std::fs::read_dir(path) else { return 0 };
    listing
        .filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size_of(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_separate_their_parts() {
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        assert_eq!(key(&[b"x"]), key(&[b"x"]));
        assert_eq!(key(&[b"x"]).len(), 64);
    }

    #[tokio::test]
    async fn entries_complete_once_and_persist() {
        let root = std::env::temp_dir().join(format!("kforge-cache-test-{}", std::process::id()));
        let cache = Cache::new(root.clone(), 0).expect("cache dir");
        let k = key(&[b"source"]);
        assert_eq!(cache.get(&k), None);
        let lock = cache.lock(&k).await.expect("lock");
        cache.complete(&k, &Entry::Failed("error: expected ;".into()), &lock).expect("complete");
        drop(lock);
        assert_eq!(
            Cache::new(root.clone(), 0).expect("reopen").get(&k),
            Some(Entry::Failed("error: expected ;".into()))
        );
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn an_entry_is_held_pinned_when_complete_and_locked_for_its_builder_otherwise() {
        let (root, cache) = fresh("held", 1);
        let k = key(&[b"reference"]);
        // Absent: the caller builds it. A second caller waits, and gets it pinned once the first completes it.
        let Held::Building(lock) = cache.pin_or_lock(&k).await.expect("held") else { panic!("absent: built") };
        let waiting = tokio::spawn({
            let cache = cache.clone();
            let k = k.clone();
            async move { cache.pin_or_lock(&k).await.expect("held") }
        });
        std::fs::create_dir_all(cache.dir(&k)).expect("entry dir");
        std::fs::write(cache.dir(&k).join("outputs.pt"), [0u8; 64]).expect("outputs");
        cache.complete(&k, &Entry::Ready("peak 64".into()), &lock).expect("complete");
        drop(lock);
        let Held::Pinned(pin, entry) = waiting.await.expect("joined") else { panic!("completed meanwhile: pinned") };
        assert_eq!(entry, Entry::Ready("peak 64".into()));
        assert_eq!(cache.evict(), 0, "a pinned entry stays over the bound");
        drop(pin);
        // Evicted while nobody holds it: the next caller builds it again rather than failing.
        assert_eq!(cache.evict(), 1);
        assert!(matches!(cache.pin_or_lock(&k).await.expect("held"), Held::Building(_)));
        let _ = std::fs::remove_dir_all(root);
    }

    async fn filled(cache: &Cache, name: &str, bytes: usize) -> String {
        let k = key(&[name.as_bytes()]);
        let lock = cache.lock(&k).await.expect("lock");
        std::fs::create_dir_all(cache.dir(&k)).expect("entry dir");
        std::fs::write(cache.dir(&k).join("artifact.so"), vec![0u8; bytes]).expect("artifact");
        cache.complete(&k, &Entry::Ready(String::new()), &lock).expect("complete");
        k
    }

    /// An empty cache bounded to `max_bytes` in a directory of its own, and that directory.
    fn fresh(name: &str, max_bytes: u64) -> (PathBuf, Cache) {
        let root = std::env::temp_dir().join(format!("kforge-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        (root.clone(), Cache::new(root, max_bytes).expect("cache dir"))
    }

    /// Dates the completed entry's last use `secs` ago.
    fn last_used_ago(cache: &Cache, key: &str, secs: u64) {
        let marker = File::options().append(true).open(cache.dir(key).join("ready")).expect("marker");
        marker.set_modified(SystemTime::now() - std::time::Duration::from_secs(secs)).expect("mtime");
    }

    #[tokio::test]
    async fn eviction_removes_least_recently_used_entries_but_never_pinned_ones() {
        let (root, cache) = fresh("evict", 2500);
        let old = filled(&cache, "old", 1000).await;
        let pinned = filled(&cache, "pinned", 1000).await;
        let used = filled(&cache, "used", 1000).await;
        // By last use: `used` oldest, then `pinned`, then `old`; the hit below makes `used` the newest.
        for (k, age) in [(&used, 400), (&pinned, 300), (&old, 200)] {
            last_used_ago(&cache, k, age);
        }
        assert!(cache.get(&used).is_some(), "a hit refreshes `used`");
        let pin = cache.pin(&pinned).await.expect("pin");
        assert_eq!(cache.evict(), 1, "3000 bytes over a 2500-byte bound: one entry goes");
        assert!(cache.get(&pinned).is_some(), "the pinned entry stays although it is the oldest");
        assert!(cache.get(&old).is_none(), "the least recently used unpinned entry goes");
        assert!(cache.get(&used).is_some());
        drop(pin);
        assert_eq!(cache.evict(), 0, "2000 bytes fit");
        assert_eq!(Cache::new(root.clone(), 0).expect("unbounded").evict(), 0, "an unbounded cache never evicts");
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn eviction_takes_the_largest_long_unused_entry_first_and_leaves_builds_to_their_builders() {
        let (root, cache) = fresh("size", 2500);
        // Size times idle time: small 500 x 400 s, large 2000 x 200 s, medium 1000 x 100 s. Least recently used
        // first would take `small` and then `large`; the large one alone makes room for both others.
        let small = filled(&cache, "small", 500).await;
        let large = filled(&cache, "large", 2000).await;
        let medium = filled(&cache, "medium", 1000).await;
        for (k, age) in [(&small, 400), (&large, 200), (&medium, 100)] {
            last_used_ago(&cache, k, age);
        }
        // An entry being built, larger than the bound: it neither counts nor goes.
        let building = key(&[b"building"]);
        let lock = cache.lock(&building).await.expect("lock");
        std::fs::create_dir_all(cache.dir(&building)).expect("entry dir");
        std::fs::write(cache.dir(&building).join("outputs"), vec![0u8; 4000]).expect("outputs");
        // An unfinished entry nobody builds (its builder died): removed whatever the bound.
        let abandoned = key(&[b"abandoned"]);
        std::fs::create_dir_all(cache.dir(&abandoned)).expect("entry dir");
        std::fs::write(cache.dir(&abandoned).join("outputs"), vec![0u8; 10]).expect("outputs");

        assert_eq!(cache.evict(), 2, "the abandoned entry and `large`");
        assert!(cache.get(&large).is_none());
        assert!(cache.get(&small).is_some() && cache.get(&medium).is_some(), "1500 bytes fit");
        assert!(cache.dir(&building).join("outputs").exists(), "a build in progress stays");
        assert!(!cache.dir(&abandoned).exists());
        drop(lock);
        let _ = std::fs::remove_dir_all(root);
    }

    #[tokio::test]
    async fn a_protected_entry_stays_until_its_last_guard_drops() {
        let (root, cache) = fresh("protect", 1000);
        let k = filled(&cache, "reference", 2000).await;
        let (first, second) = (cache.protect(&k), cache.clone().protect(&k));
        assert_eq!(cache.evict(), 0, "over the bound, but protected (by a clone too)");
        drop(first);
        assert_eq!(cache.evict(), 0, "one guard is left");
        drop(second);
        assert_eq!(cache.evict(), 1);
        assert!(cache.get(&k).is_none());
        let _ = std::fs::remove_dir_all(root);
    }
}
