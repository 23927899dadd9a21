//! Where jobs and their turns are kept. One interface, [`JobStore`]; this slice has only the in-memory store
//! (a process restart loses every job). The durable stores the design asks for (SQLite by default, PostgreSQL by
//! URL) implement the same trait; writes are idempotent by (job, task, trajectory, turn) so that a resumed job
//! can write a turn again without duplicating it.

use std::collections::HashMap;
use std::sync::Mutex;

use kforge_proto::v1 as pb;

/// Why the store could not answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backing database could not be reached or refused the write (never for the in-memory store).
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// Jobs and their turn records.
#[tonic::async_trait]
pub trait JobStore: Send + Sync + std::fmt::Debug + 'static {
    /// Writes the job's header (spec, state, metrics), replacing the one stored under its id.
    async fn put_job(&self, job: &pb::Job, idempotency_key: &str) -> Result<(), StoreError>;
    /// The job with this id.
    async fn job(&self, job_id: &str) -> Result<Option<pb::Job>, StoreError>;
    /// The job submitted with this idempotency key (never matches an empty key).
    async fn job_by_key(&self, idempotency_key: &str) -> Result<Option<pb::Job>, StoreError>;
    /// Records the job's tasks in the order its turns are listed in (written once, at submission).
    async fn put_task_order(&self, job_id: &str, task_ids: &[String]) -> Result<(), StoreError>;
    /// Writes one turn; a second write of the same (task, trajectory, turn) replaces the first.
    async fn put_turn(&self, job_id: &str, turn: &pb::TurnRecord) -> Result<(), StoreError>;
    /// Every turn of the job, ordered by task (in the job's task order; a task not in it after those that are, in
    /// order of first write), trajectory and turn.
    async fn turns(&self, job_id: &str) -> Result<Vec<pb::TurnRecord>, StoreError>;
}

/// A store in this process's memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    jobs: HashMap<String, pb::Job>,
    keys: HashMap<String, String>,
    /// Per job: turns by (task order, trajectory, turn), and the order tasks were first written in.
    turns: HashMap<String, JobTurns>,
}

#[derive(Debug, Default)]
struct JobTurns {
    task_order: Vec<String>,
    records: std::collections::BTreeMap<(usize, u32, u32), pb::TurnRecord>,
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain maps, still consistent: every write is a single insert.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[tonic::async_trait]
impl JobStore for MemoryStore {
    async fn put_job(&self, job: &pb::Job, idempotency_key: &str) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if !idempotency_key.is_empty() {
            inner.keys.entry(idempotency_key.to_owned()).or_insert_with(|| job.job_id.clone());
        }
        inner.jobs.insert(job.job_id.clone(), job.clone());
        Ok(())
    }

    async fn job(&self, job_id: &str) -> Result<Option<pb::Job>, StoreError> {
        Ok(self.lock().jobs.get(job_id).cloned())
    }

    async fn job_by_key(&self, idempotency_key: &str) -> Result<Option<pb::Job>, StoreError> {
        if idempotency_key.is_empty() {
            return Ok(None);
        }
        let inner = self.lock();
        Ok(inner.keys.get(idempotency_key).and_then(|id| inner.jobs.get(id)).cloned())
    }

    async fn put_task_order(&self, job_id: &str, task_ids: &[String]) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let turns = inner.turns.entry(job_id.to_owned()).or_default();
        if turns.task_order.is_empty() {
            turns.task_order = task_ids.to_vec();
        }
        Ok(())
    }

    async fn put_turn(&self, job_id: &str, turn: &pb::TurnRecord) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let turns = inner.turns.entry(job_id.to_owned()).or_default();
        let task = match turns.task_order.iter().position(|t| *t == turn.task_id) {
            Some(index) => index,
            None => {
                turns.task_order.push(turn.task_id.clone());
                turns.task_order.len() - 1
            }
        };
        turns.records.insert((task, turn.trajectory, turn.turn), turn.clone());
        Ok(())
    }

    async fn turns(&self, job_id: &str) -> Result<Vec<pb::TurnRecord>, StoreError> {
        Ok(self.lock().turns.get(job_id).map(|t| t.records.values().cloned().collect()).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(task: &str, trajectory: u32, turn: u32, kernel: &str) -> pb::TurnRecord {
        pb::TurnRecord { task_id: task.into(), trajectory, turn, kernel: kernel.into(), ..Default::default() }
    }

    #[tokio::test]
    async fn turns_are_idempotent_and_ordered_by_the_job_s_tasks() {
        let store = MemoryStore::default();
        store.put_task_order("job", &["b".into()]).await.expect("written");
        for record in [turn("a", 0, 0, "z"), turn("b", 1, 0, "x"), turn("b", 0, 1, "y"), turn("b", 0, 0, "w")] {
            store.put_turn("job", &record).await.expect("written");
        }
        store.put_turn("job", &turn("b", 1, 0, "x again")).await.expect("rewritten");
        let keys: Vec<(String, u32, u32, String)> = store
            .turns("job")
            .await
            .expect("read")
            .into_iter()
            .map(|t| (t.task_id, t.trajectory, t.turn, t.kernel))
            .collect();
        assert_eq!(
            keys,
            [
                ("b".into(), 0, 0, "w".into()),
                ("b".into(), 0, 1, "y".into()),
                ("b".into(), 1, 0, "x again".into()),
                ("a".into(), 0, 0, "z".into()),
            ]
        );
        assert!(store.turns("other").await.expect("read").is_empty());
    }

    #[tokio::test]
    async fn jobs_by_id_and_idempotency_key() {
        let store = MemoryStore::default();
        let job = pb::Job { job_id: "j1".into(), ..Default::default() };
        store.put_job(&job, "key").await.expect("written");
        store.put_job(&pb::Job { job_id: "j2".into(), ..Default::default() }, "key").await.expect("written");
        assert_eq!(store.job_by_key("key").await.expect("read").map(|j| j.job_id), Some("j1".into()));
        assert_eq!(store.job_by_key("").await.expect("read"), None);
        assert_eq!(store.job("j2").await.expect("read").map(|j| j.job_id), Some("j2".into()));
    }
}
