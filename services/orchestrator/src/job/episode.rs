//! One episode (one trajectory of one task): its turns in order, each recorded before the next starts, resumed
//! from the first turn not yet recorded with the context rebuilt from the recorded ones. A failed call ends the
//! episode, not the job.

use std::sync::Arc;

use kforge_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::peers::Peers;
use super::plan::Plan;
use super::progress::Progress;
use crate::failure::TurnFailure;
use crate::recipe::Attempt;
use crate::store::{Stage, StoreError};

/// One trajectory of one task.
#[derive(Debug)]
pub(super) struct Episode {
    pub(super) plan: Arc<Plan>,
    pub(super) task: pb::Task,
    /// The task's index in the job's task order.
    pub(super) position: i64,
    pub(super) trajectory: u32,
    pub(super) peers: Peers,
    pub(super) progress: Arc<Progress>,
    pub(super) cancel: CancellationToken,
}

impl Episode {
    /// Runs the turns in order, from the first one not yet recorded; a stored response or evaluation of that
    /// turn (written before the orchestrator stopped) is reused, never asked for again. A failing service call is
    /// recorded in the turn and ends the episode, not the job; only a store failure (the record would be lost)
    /// fails the job.
    pub(super) async fn run(self) -> Result<(), StoreError> {
        let job_id = self.progress.job_id.clone();
        let stored = self.progress.store.trajectory(&job_id, &self.task.task_id, self.trajectory).await?;
        let mut earlier = Vec::new();
        let mut first = 0;
        let mut ended = false;
        let mut pending = None;
        for (stage, record) in stored {
            if stage == Stage::Recorded {
                ended |= TurnFailure::of(&record).is_some();
                first = record.turn + 1;
                earlier.push(Attempt::of(&record));
            } else if record.turn == first {
                pending = Some((stage, record));
            }
        }
        if !ended {
            for turn in first..self.plan.spec.turns {
                if self.cancel.is_cancelled() {
                    break;
                }
                let resumed = pending.take().filter(|(_, record)| record.turn == turn);
                let turn_span = tracing::info_span!("turn", turn);
                let taken = tokio::select! {
                    taken = self.turn(&job_id, turn, &earlier, resumed).instrument(turn_span) => taken?,
                    () = self.cancel.cancelled() => break,
                };
                let failed = taken.failure.is_some();
                let record = self.progress.record(self.position, taken).await?;
                earlier.push(Attempt::of(&record));
                if failed {
                    break;
                }
            }
        }
        self.progress.episode_done().await;
        Ok(())
    }
}
