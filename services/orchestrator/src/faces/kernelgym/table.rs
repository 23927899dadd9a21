//! The KernelGym face's results: each task id's evaluation, in flight or finished, in memory and bounded (the
//! oldest forgotten first). An evaluation in flight is shared: a second `/evaluate` of the same task id waits for
//! it (upstream's cache semantics, extended to an evaluation not yet stored).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use kforge_server::json::JsonError;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::wire::EvaluationResponse;

/// Why an evaluation has no result to store: the client is told, and the task id is forgotten.
#[derive(Debug, Clone)]
pub(super) enum Rejection {
    /// The evaluators are busy or unreachable (429, 503): the client retries.
    Busy(JsonError),
    /// The evaluator refused a field (400, naming it).
    Invalid(JsonError),
}

/// What an evaluation ends in.
pub(super) type Outcome = Result<Arc<EvaluationResponse>, Rejection>;

/// The channel an evaluation's outcome is sent on: held by the table and by the evaluation, so that neither a
/// forgotten entry nor a cancelled evaluation leaves a waiter hanging.
pub(super) type Done = Arc<watch::Sender<Option<Outcome>>>;

#[derive(Debug)]
enum State {
    Processing { done: Done, abort: Option<AbortHandle> },
    Finished(Arc<EvaluationResponse>),
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    submitted: SystemTime,
    state: State,
}

/// A task id's state as `/status` and `/results` read it.
#[derive(Debug)]
pub(super) enum View {
    Processing { submitted: SystemTime },
    Finished(Arc<EvaluationResponse>),
}

/// What `/evaluate` finds for a task id.
#[derive(Debug)]
pub(super) enum Found {
    Finished(Arc<EvaluationResponse>),
    InFlight(watch::Receiver<Option<Outcome>>),
}

#[derive(Debug)]
pub(super) struct Table {
    entries: HashMap<String, Entry>,
    /// Task ids by generation, oldest first: what is forgotten first.
    order: BTreeMap<u64, String>,
    next: u64,
    capacity: usize,
    processed: u64,
}

impl Table {
    pub(super) fn new(capacity: usize) -> Self {
        Self { entries: HashMap::new(), order: BTreeMap::new(), next: 0, capacity: capacity.max(1), processed: 0 }
    }

    pub(super) fn view(&self, task_id: &str) -> Option<View> {
        self.entries.get(task_id).map(|entry| match &entry.state {
            State::Processing { .. } => View::Processing { submitted: entry.submitted },
            State::Finished(result) => View::Finished(result.clone()),
        })
    }

    pub(super) fn find(&self, task_id: &str) -> Option<Found> {
        self.entries.get(task_id).map(|entry| match &entry.state {
            State::Processing { done, .. } => Found::InFlight(done.subscribe()),
            State::Finished(result) => Found::Finished(result.clone()),
        })
    }

    /// Records `task_id` as processing (replacing what it held) and returns its generation; the oldest entries
    /// beyond the capacity are forgotten.
    pub(super) fn begin(&mut self, task_id: &str, submitted: SystemTime, done: Done) -> u64 {
        let generation = self.next;
        self.next += 1;
        let entry = Entry { generation, submitted, state: State::Processing { done, abort: None } };
        if let Some(old) = self.entries.insert(task_id.to_owned(), entry) {
            self.order.remove(&old.generation);
        }
        self.order.insert(generation, task_id.to_owned());
        while self.entries.len() > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            self.entries.remove(&oldest);
        }
        generation
    }

    /// Lets `DELETE /tasks/{id}` stop the evaluation of `generation`.
    pub(super) fn set_abort(&mut self, task_id: &str, generation: u64, handle: AbortHandle) {
        if let Some(Entry { generation: g, state: State::Processing { abort, .. }, .. }) = self.entries.get_mut(task_id)
            && *g == generation
        {
            *abort = Some(handle);
        }
    }

    /// Stores the result of `generation`, unless the task id was submitted again or forgotten since.
    pub(super) fn finish(&mut self, task_id: &str, generation: u64, result: Arc<EvaluationResponse>) {
        self.processed += 1;
        if let Some(entry) = self.entries.get_mut(task_id).filter(|e| e.generation == generation) {
            entry.state = State::Finished(result);
        }
    }

    /// Forgets `task_id` if it still holds `generation` (an evaluation that was refused).
    pub(super) fn forget(&mut self, task_id: &str, generation: u64) {
        if self.entries.get(task_id).is_some_and(|e| e.generation == generation) {
            self.entries.remove(task_id);
            self.order.remove(&generation);
        }
    }

    /// `DELETE /tasks/{id}`: an evaluation in flight is stopped and stored as `cancelled` (its waiters get that); a
    /// finished one is forgotten. `None` for an unknown id; else whether it was in flight.
    pub(super) fn cancel(&mut self, task_id: &str, now: SystemTime) -> Option<bool> {
        let entry = self.entries.get_mut(task_id)?;
        match &entry.state {
            State::Processing { done, abort } => {
                let message = format!("cancelled by DELETE /tasks/{task_id}");
                let result = Arc::new(
                    EvaluationResponse::bare(task_id, "cancelled", None, message).stamped(entry.submitted, now),
                );
                // Answered before the abort: the evaluation's guard then finds it answered and leaves the table be.
                done.send_replace(Some(Ok(result.clone())));
                if let Some(abort) = abort {
                    abort.abort();
                }
                entry.state = State::Finished(result);
                Some(true)
            }
            State::Finished(_) => {
                let generation = entry.generation;
                self.entries.remove(task_id);
                self.order.remove(&generation);
                Some(false)
            }
        }
    }

    /// Evaluations in flight, results held, and evaluations finished since the start.
    pub(super) fn counts(&self) -> (usize, usize, u64) {
        let processing = self.entries.values().filter(|e| matches!(e.state, State::Processing { .. })).count();
        (processing, self.entries.len() - processing, self.processed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done() -> Done {
        Arc::new(watch::channel(None).0)
    }

    fn finished(id: &str) -> Arc<EvaluationResponse> {
        Arc::new(EvaluationResponse::bare(id, "completed", None, String::new()))
    }

    #[test]
    fn the_oldest_is_forgotten_first_and_a_resubmission_is_young_again() {
        let mut table = Table::new(2);
        let now = SystemTime::now();
        let a = table.begin("a", now, done());
        table.finish("a", a, finished("a"));
        let b = table.begin("b", now, done());
        table.finish("b", b, finished("b"));
        // `a` again: now the youngest, so `b` goes when `c` comes.
        table.begin("a", now, done());
        table.begin("c", now, done());
        assert!(table.view("b").is_none());
        assert!(matches!(table.view("a"), Some(View::Processing { .. })));
        assert!(matches!(table.view("c"), Some(View::Processing { .. })));
        // A stale generation neither stores nor forgets.
        table.finish("a", a, finished("a"));
        table.forget("a", a);
        assert!(matches!(table.view("a"), Some(View::Processing { .. })));
        assert_eq!(table.counts().0, 2);
    }

    #[test]
    fn cancelling_answers_the_waiters() {
        let mut table = Table::new(4);
        let sender = done();
        table.begin("a", SystemTime::now(), sender.clone());
        let Some(Found::InFlight(receiver)) = table.find("a") else { panic!("in flight") };
        assert_eq!(table.cancel("a", SystemTime::now()), Some(true));
        let outcome = receiver.borrow().clone().expect("answered");
        assert_eq!(outcome.expect("a result").status, "cancelled");
        assert_eq!(table.cancel("a", SystemTime::now()), Some(false));
        assert!(table.view("a").is_none());
        assert_eq!(table.cancel("a", SystemTime::now()), None);
    }
}
