//! Scratch directories removed however the work in them ends, cancellation included: a run's outputs can take GBs
//! (on a memory-backed filesystem, host memory). Removing them is blocking file work, so it goes to tokio's
//! blocking pool when a runtime is present, never onto the async worker that drops the guard.

use std::path::{Path, PathBuf};

/// A scratch directory, removed when this drops; with what it holds until then (the room its files take, say),
/// given back once the directory is gone.
pub struct RemoveOnDrop {
    dir: PathBuf,
    held: Option<Box<dyn Send>>,
}

impl std::fmt::Debug for RemoveOnDrop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoveOnDrop").field("dir", &self.dir).field("holds", &self.held.is_some()).finish()
    }
}

impl RemoveOnDrop {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir, held: None }
    }

    /// `dir`, and `held` until it is gone.
    pub fn holding(dir: PathBuf, held: impl Send + 'static) -> Self {
        Self { dir, held: Some(Box::new(held)) }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for RemoveOnDrop {
    /// On the blocking pool inside a runtime, inline outside one.
    fn drop(&mut self) {
        let removal = Removal { dir: std::mem::take(&mut self.dir), held: self.held.take() };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            // A task the runtime drops unstarted (it is shutting down) drops its closure, and so removes inline.
            drop(runtime.spawn_blocking(move || drop(removal)));
        }
    }
}

/// A directory removed when this drops, wherever that is, then what it held given back.
struct Removal {
    dir: PathBuf,
    held: Option<Box<dyn Send>>,
}

impl Drop for Removal {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        drop(self.held.take());
    }
}

/// Waits for the removals dropped so far on this runtime, whose blocking pool must have one thread: it takes tasks
/// in the order they came, so a task queued now runs after them. For tests.
#[cfg(test)]
pub(crate) async fn settled() {
    tokio::task::spawn_blocking(|| ()).await.expect("a task that does nothing ends");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kforge-scratch-{name}-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("outputs")).expect("test dir");
        std::fs::write(dir.join("outputs").join("out.bin"), [0u8; 4096]).expect("test file");
        dir
    }

    #[test]
    fn outside_a_runtime_the_directory_goes_at_once() {
        let dir = scratch("inline");
        drop(RemoveOnDrop::new(dir.clone()));
        assert!(!dir.exists());
    }

    /// Dropped on an async worker, the removal goes to the blocking pool. With one blocking thread, which takes
    /// tasks in the order they came, a task queued after the removal finds it done.
    #[test]
    fn on_a_runtime_the_directory_goes_on_the_blocking_pool() {
        let dir = scratch("blocking");
        let runtime = tokio::runtime::Builder::new_current_thread().max_blocking_threads(1).build().expect("runtime");
        runtime.block_on(async {
            let (held, mut given_back) = tokio::sync::oneshot::channel::<()>();
            drop(RemoveOnDrop::holding(dir.clone(), held));
            let worker = std::thread::current().id();
            let next = tokio::task::spawn_blocking(|| std::thread::current().id()).await.expect("the next task ran");
            assert_ne!(next, worker, "the blocking pool's thread, not the async worker");
            assert!(!dir.exists(), "removed before the next task on the pool");
            let closed = matches!(given_back.try_recv(), Err(tokio::sync::oneshot::error::TryRecvError::Closed));
            assert!(closed, "what it held is given back once the directory is gone");
        });
    }

    /// A runtime shutting down waits for the removals it started and runs those it had not inline.
    #[test]
    fn a_runtime_shutting_down_still_removes_the_directory() {
        let dir = scratch("shutdown");
        let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
        runtime.block_on(async { drop(RemoveOnDrop::new(dir.clone())) });
        drop(runtime);
        assert!(!dir.exists());
    }
}
