//! The step API's turns: a trainer that generates itself sends each response (Step) for an episode stored as a job
//! of one task and one trajectory (StartEpisode); the response is stored, then evaluated, scored, diagnosed and
//! recorded as a job's turn is, and the episode's turns are credited when it ends. A turn belongs to the first
//! idempotency key that steps it, so a retried step replays or finishes it without a second evaluation.

use std::sync::Arc;
use std::time::Instant;

use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::Channel;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::episode::Episode;
use super::peers::Peers;
use super::plan::Plan;
use super::progress::{Progress, slim};
use crate::failure::TurnFailure;
use crate::recipe::Attempt;
use crate::reward;
use crate::store::{Stage, Store, StoreError};

/// The model a step-API episode's job names: its responses come from the trainer, not through the gateway.
pub const STEP_MODEL: &str = "(step api)";

/// Why a step was refused.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The step does not fit the episode (a turn ahead of it, a different response or key for a turn taken, an
    /// episode that is over).
    #[error("{0}")]
    Precondition(String),
    /// The episode ended, and its returns, advantages or PRS decisions could not be computed.
    #[error(transparent)]
    Credit(#[from] reward::CreditError),
}

/// A step taken (or replayed): the turn as recorded, the next turn's prompt (empty when done), and whether the
/// episode is over.
#[derive(Debug, Clone)]
pub struct Stepped {
    pub record: pb::TurnRecord,
    pub next_turn: u32,
    pub next_prompt: Vec<pb::ChatMessage>,
    pub done: bool,
    /// When done: every turn as stored, with its return, advantage and keep, without prompt, completion and
    /// evaluation (the trainer has them).
    pub turns: Vec<pb::TurnRecord>,
}

impl Stepped {
    /// The step that recorded `record`, the last of the episode's `recorded` turns (its credited turns left to the
    /// caller).
    fn after(plan: &Plan, task: &pb::Task, recorded: &[pb::TurnRecord], record: pb::TurnRecord) -> Self {
        let done = over(plan.spec.turns, recorded);
        let next_prompt = match done {
            true => Vec::new(),
            false => plan.templates.prompt(task, &recorded.iter().map(Attempt::of).collect::<Vec<_>>()),
        };
        Self { next_turn: record.turn + 1, next_prompt, done, record, turns: Vec::new() }
    }

    /// The observation a trainer gets for this step of `episode_id`.
    pub fn observation(self, episode_id: String) -> pb::Observation {
        let record = self.record;
        pb::Observation {
            episode_id,
            turn: self.next_turn,
            prompt: self.next_prompt,
            reward: record.score.unwrap_or(0.0),
            evaluation: record.evaluation.clone(),
            done: self.done,
            record: Some(for_trainer(record)),
            turns: self.turns,
        }
    }
}

/// The first observation's prompt of a step-API episode.
pub fn first_prompt(plan: &Plan) -> Vec<pb::ChatMessage> {
    plan.tasks.first().map(|task| plan.templates.prompt(task, &[])).unwrap_or_default()
}

/// A trainer's answer to one turn of a step-API episode (a StepRequest, checked).
#[derive(Debug, Clone)]
pub struct Answer {
    pub turn: u32,
    pub completion: pb::Completion,
    /// The trainer's tokenization of the prompt, stored with the turn.
    pub prompt_token_ids: Vec<u32>,
    pub idempotency_key: String,
}

/// Applies the trainer's `completion` as turn `turn` of a step-API episode (a job of one task, one trajectory):
/// the response is stored, then evaluated, scored and diagnosed as a job's turn is, and recorded. The first
/// `idempotency_key` to claim a turn owns it: a retry with it returns the recorded turn (or finishes a step
/// interrupted after storing its response or evaluation); another key, or a turn ahead of the episode, is refused.
pub async fn step(
    plan: Arc<Plan>,
    job: pb::Job,
    peers: Peers,
    store: Store,
    answer: Answer,
) -> Result<Stepped, StepError> {
    let task = plan.tasks.first().cloned().ok_or_else(no_task)?;
    let (mut recorded, pending) = read_turns(&store, &job.job_id, &task.task_id).await?;
    claim(&store, &job.job_id, &answer, &recorded, pending.as_ref()).await?;
    let turn = answer.turn;
    let mut reward = peers.reward.clone();
    if let Some(record) = recorded.get(turn as usize).cloned() {
        // A retried step: the turn as recorded, and the episode credited again where it is over (the same values).
        let mut stepped = Stepped::after(&plan, &task, &recorded[..=turn as usize], record);
        if stepped.done {
            stepped.turns = credit_episode(&plan, &mut reward, &store, &job.job_id).await?;
        }
        return Ok(stepped);
    }
    if over(plan.spec.turns, &recorded) {
        return Err(StepError::Precondition("the episode is over".into()));
    }
    let earlier: Vec<Attempt> = recorded.iter().map(Attempt::of).collect();
    let resumed = match pending.filter(|(_, record)| record.turn == turn) {
        Some(pending) => pending,
        None => store_response(&plan, &store, &job.job_id, &task, &earlier, answer).await?,
    };
    let job_id = job.job_id.clone();
    let (updates, _) = watch::channel(pb::JobProgress::default());
    let turns = recorded.iter().map(slim).collect();
    let progress = Arc::new(Progress::new(job, turns, store, updates, Instant::now(), peers.metrics.clone()));
    let record = take_turn(&plan, &task, peers, &progress, turn, &earlier, resumed).await?;
    recorded.push(record.clone());
    let mut stepped = Stepped::after(&plan, &task, &recorded, record);
    if stepped.done {
        stepped.turns = credit_episode(&plan, &mut reward, &progress.store, &job_id).await?;
        progress.episode_done().await;
        progress.finish(pb::JobState::Succeeded, String::new()).await;
    }
    Ok(stepped)
}

/// Where a step-API episode stands, for a trainer (or a protocol face's session) that reconnects: its last step as
/// recorded, or `None` before the first; the next turn and prompt; whether it is over, and then every turn as
/// credited.
pub async fn current(plan: &Plan, store: &Store, job_id: &str) -> Result<pb::Observation, StepError> {
    let task = plan.tasks.first().ok_or_else(no_task)?;
    let (recorded, _) = read_turns(store, job_id, &task.task_id).await?;
    let Some(last) = recorded.last().cloned() else {
        return Ok(pb::Observation { episode_id: job_id.to_owned(), prompt: first_prompt(plan), ..Default::default() });
    };
    let mut stepped = Stepped::after(plan, task, &recorded, last);
    if stepped.done {
        stepped.turns = store.turns(job_id).await?.into_iter().map(for_trainer).collect();
    }
    Ok(stepped.observation(job_id.to_owned()))
}

fn no_task() -> StepError {
    StepError::Precondition("the episode has no task".into())
}

/// The episode's stored turns: those recorded, in order, and the stage and record of one stored but not yet
/// recorded (a step interrupted after storing its response or evaluation).
async fn read_turns(
    store: &Store,
    job_id: &str,
    task_id: &str,
) -> Result<(Vec<pb::TurnRecord>, Option<(Stage, pb::TurnRecord)>), StoreError> {
    let mut recorded = Vec::new();
    let mut pending = None;
    for (stage, record) in store.trajectory(job_id, task_id, 0).await? {
        if stage == Stage::Recorded {
            recorded.push(record);
        } else {
            pending = Some((stage, record));
        }
    }
    Ok((recorded, pending))
}

/// Whether an episode of `turns` turns whose recorded turns are `recorded` is over: every turn taken, or the last
/// one failed.
fn over(turns: u32, recorded: &[pb::TurnRecord]) -> bool {
    recorded.len() as u32 >= turns || recorded.last().is_some_and(|last| TurnFailure::of(last).is_some())
}

/// Claims `answer`'s turn for its idempotency key (the first key to step a turn owns it), refusing a turn ahead of
/// the episode, a turn claimed by another key, and a response other than the one the turn was taken with.
async fn claim(
    store: &Store,
    job_id: &str,
    answer: &Answer,
    recorded: &[pb::TurnRecord],
    pending: Option<&(Stage, pb::TurnRecord)>,
) -> Result<(), StepError> {
    let (turn, next) = (answer.turn, recorded.len() as u32);
    if turn > next {
        return Err(StepError::Precondition(format!("turn {turn} is ahead of the episode: its next turn is {next}")));
    }
    if !store.claim_step(job_id, turn, &answer.idempotency_key).await? {
        return Err(StepError::Precondition(format!("turn {turn} was already stepped with another idempotency key")));
    }
    // A retry carries the response the turn was taken with; another response for it is not a retry.
    let taken = if turn < next { recorded.get(turn as usize) } else { pending.map(|(_, record)| record) };
    if let Some(taken) = taken.filter(|record| record.turn == turn)
        && taken.completion.as_ref().map(|c| c.text.as_str()) != Some(answer.completion.text.as_str())
    {
        return Err(StepError::Precondition(format!("turn {turn} was already stepped with another response")));
    }
    Ok(())
}

/// Stores the trainer's response as its turn's record (stage generated), with the prompt the episode's `earlier`
/// turns make; returned as the stage the turn resumes from.
async fn store_response(
    plan: &Plan,
    store: &Store,
    job_id: &str,
    task: &pb::Task,
    earlier: &[Attempt],
    answer: Answer,
) -> Result<(Stage, pb::TurnRecord), StoreError> {
    let Answer { turn, completion, prompt_token_ids, idempotency_key: _ } = answer;
    let record = pb::TurnRecord {
        turn,
        prompt: plan.templates.prompt(task, earlier),
        task_id: task.task_id.clone(),
        trajectory: 0,
        prompt_token_ids,
        ..Default::default()
    };
    let record = plan.read_completion(record, completion);
    store.put_turn(job_id, 0, Stage::Generated, &record).await?;
    Ok((Stage::Generated, record))
}

/// Takes turn `turn` of the episode from its stored stage (`resumed`) as a job's turn is taken, and records it.
async fn take_turn(
    plan: &Arc<Plan>,
    task: &pb::Task,
    peers: Peers,
    progress: &Arc<Progress>,
    turn: u32,
    earlier: &[Attempt],
    resumed: (Stage, pb::TurnRecord),
) -> Result<pb::TurnRecord, StoreError> {
    let episode = Episode {
        plan: plan.clone(),
        task: task.clone(),
        position: 0,
        trajectory: 0,
        peers,
        progress: progress.clone(),
        cancel: CancellationToken::new(),
    };
    let taken = episode.turn(&progress.job_id, turn, earlier, Some(resumed)).await?;
    progress.record(0, taken).await
}

/// Credits the turns of a step-API episode that has ended (again, for a retried last step: the same values) and
/// returns them as stored, for the trainer.
async fn credit_episode(
    plan: &Plan,
    reward: &mut RewardClient<Channel>,
    store: &Store,
    job_id: &str,
) -> Result<Vec<pb::TurnRecord>, StepError> {
    reward::credit(&plan.reward, reward, store, job_id, |_| 0).await?;
    Ok(store.turns(job_id).await?.into_iter().map(for_trainer).collect())
}

/// A turn as a trainer gets it back: without prompt, completion and evaluation (it has them).
fn for_trainer(turn: pb::TurnRecord) -> pb::TurnRecord {
    pb::TurnRecord { prompt: Vec::new(), completion: None, evaluation: None, ..turn }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_episode_is_over_when_every_turn_is_taken_or_its_last_one_failed() {
        let taken = |error: &str| pb::TurnRecord { error: error.into(), ..Default::default() };
        assert!(!over(3, &[]));
        assert!(!over(3, &[taken(""), taken("")]));
        assert!(over(2, &[taken(""), taken("")]), "every turn taken");
        assert!(over(3, &[taken(""), taken("gateway: Unavailable: down")]), "its last turn failed");
        assert!(over(3, &[taken("gateway: unavailable")]), "a stored text not recognized is a failure all the same");
    }
}
