//! Content-addressed caches on local disk: compiled artifacts, reference outputs, baseline timings.
//!
//! A key is the SHA-256 of everything that determines the entry (sources, backend, software versions, device).
//! Entries are built under an exclusive file lock, so concurrent evaluations (and processes sharing the
//! directory, such as test binaries) build each entry once; a completed entry carries a marker file and is never
//! modified again.

use std::fs::File;
use std::path::PathBuf;

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
}

/// What a completed entry holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// Built; the marker's contents (e.g. a compile log or timing samples).
    Ready(String),
    /// Building failed deterministically (a compile error); the marker's contents say why.
    Failed(String),
}

/// An exclusive lock on one entry, released on drop.
#[derive(Debug)]
pub struct EntryLock {
    _file: File,
}

impl Cache {
    pub fn new(root: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&root)?;
        Ok(Self { root })
    }

    /// The entry's directory (created on demand by the builder).
    pub fn dir(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    /// The completed entry, if any.
    pub fn get(&self, key: &str) -> Option<Entry> {
        let dir = self.dir(key);
        if let Ok(text) = std::fs::read_to_string(dir.join("ready")) {
            return Some(Entry::Ready(text));
        }
        std::fs::read_to_string(dir.join("failed")).ok().map(Entry::Failed)
    }

    /// Waits for the entry's lock (blocking I/O, so on the blocking pool).
    pub async fn lock(&self, key: &str) -> std::io::Result<EntryLock> {
        let path = self.root.join(format!("{key}.lock"));
        tokio::task::spawn_blocking(move || {
            let file = File::options().create(true).truncate(false).write(true).open(&path)?;
            file.lock()?;
            Ok(EntryLock { _file: file })
        })
        .await
        .map_err(std::io::Error::other)?
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
        let cache = Cache::new(root.clone()).expect("cache dir");
        let k = key(&[b"source"]);
        assert_eq!(cache.get(&k), None);
        let lock = cache.lock(&k).await.expect("lock");
        cache.complete(&k, &Entry::Failed("error: expected ;".into()), &lock).expect("complete");
        drop(lock);
        assert_eq!(Cache::new(root.clone()).expect("reopen").get(&k), Some(Entry::Failed("error: expected ;".into())));
        let _ = std::fs::remove_dir_all(root);
    }
}
