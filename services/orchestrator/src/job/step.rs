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
            record: Some(pb::TurnRecord { prompt: Vec::new(), completion: None, evaluation: None, ..record }),
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
    let Answer { turn, completion, prompt_token_ids, idempotency_key } = answer;
    let idempotency_key = idempotency_key.as_str();
    let task = plan.tasks.first().cloned().ok_or_else(|| StepError::Precondition("the episode has no task".into()))?;
    let stored = store.trajectory(&job.job_id, &task.task_id, 0).await?;
    let mut recorded = Vec::new();
    let mut pending = None;
    for (stage, record) in stored {
        if stage == Stage::Recorded {
            recorded.push(record);
        } else {
            pending = Some((stage, record));
        }
    }
    let attempts = |records: &[pb::TurnRecord]| -> Vec<Attempt> { records.iter().map(Attempt::of).collect() };
    let outcome = |records: &[pb::TurnRecord], record: pb::TurnRecord| {
        let done = records.len() as u32 >= plan.spec.turns || !record.error.is_empty();
        Stepped {
            next_turn: record.turn + 1,
            next_prompt: if done { Vec::new() } else { plan.templates.prompt(&task, &attempts(records)) },
            done,
            record,
            turns: Vec::new(),
        }
    };
    let mut reward = peers.reward.clone();
    let next = recorded.len() as u32;
    if turn > next {
        return Err(StepError::Precondition(format!("turn {turn} is ahead of the episode: its next turn is {next}")));
    }
    if !store.claim_step(&job.job_id, turn, idempotency_key).await? {
        return Err(StepError::Precondition(format!("turn {turn} was already stepped with another idempotency key")));
    }
    // A retry carries the response the turn was taken with; another response for it is not a retry.
    let taken = if turn < next { recorded.get(turn as usize) } else { pending.as_ref().map(|(_, record)| record) };
    if let Some(taken) = taken.filter(|record| record.turn == turn)
        && taken.completion.as_ref().map(|c| c.text.as_str()) != Some(completion.text.as_str())
    {
        return Err(StepError::Precondition(format!("turn {turn} was already stepped with another response")));
    }
    if turn < next {
        let record = recorded[turn as usize].clone();
        let mut stepped = outcome(&recorded[..=turn as usize], record);
        if stepped.done {
            stepped.turns = credit_episode(&plan, &mut reward, &store, &job.job_id).await?;
        }
        return Ok(stepped);
    }
    if next >= plan.spec.turns || recorded.last().is_some_and(|r| !r.error.is_empty()) {
        return Err(StepError::Precondition("the episode is over".into()));
    }
    let earlier = attempts(&recorded);
    let resumed = match pending.filter(|(_, record)| record.turn == turn) {
        Some(pending) => pending,
        None => {
            let record = pb::TurnRecord {
                turn,
                prompt: plan.templates.prompt(&task, &earlier),
                task_id: task.task_id.clone(),
                trajectory: 0,
                prompt_token_ids,
                ..Default::default()
            };
            let record = plan.read_completion(record, completion);
            store.put_turn(&job.job_id, 0, Stage::Generated, &record).await?;
            (Stage::Generated, record)
        }
    };
    let job_id = job.job_id.clone();
    let (updates, _) = watch::channel(pb::JobProgress::default());
    let progress = Arc::new(Progress::new(
        job,
        recorded.iter().map(slim).collect(),
        store,
        updates,
        Instant::now(),
        peers.metrics.clone(),
    ));
    let episode = Episode {
        plan: plan.clone(),
        task: task.clone(),
        position: 0,
        trajectory: 0,
        peers,
        progress: progress.clone(),
        cancel: CancellationToken::new(),
    };
    let record = episode.turn(&job_id, turn, &earlier, Some(resumed)).await?;
    progress.record(0, &record).await?;
    recorded.push(record.clone());
    let mut stepped = outcome(&recorded, record);
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
    let task = plan.tasks.first().ok_or_else(|| StepError::Precondition("the episode has no task".into()))?;
    let recorded: Vec<pb::TurnRecord> = store
        .trajectory(job_id, &task.task_id, 0)
        .await?
        .into_iter()
        .filter_map(|(stage, record)| (stage == Stage::Recorded).then_some(record))
        .collect();
    let Some(last) = recorded.last().cloned() else {
        return Ok(pb::Observation { episode_id: job_id.to_owned(), prompt: first_prompt(plan), ..Default::default() });
    };
    let done = recorded.len() as u32 >= plan.spec.turns || !last.error.is_empty();
    let attempts: Vec<Attempt> = recorded.iter().map(Attempt::of).collect();
    let turns = if done {
        store
            .turns(job_id)
            .await?
            .into_iter()
            .map(|turn| pb::TurnRecord { prompt: Vec::new(), completion: None, evaluation: None, ..turn })
            .collect()
    } else {
        Vec::new()
    };
    let next_prompt = if done { Vec::new() } else { plan.templates.prompt(task, &attempts) };
    Ok(Stepped { next_turn: last.turn + 1, next_prompt, done, record: last, turns }.observation(job_id.to_owned()))
}

/// Credits the turns of a step-API episode that has ended (again, for a retried last step: the same values) and
/// returns them as stored, without prompt, completion and evaluation (the trainer has them).
async fn credit_episode(
    plan: &Plan,
    reward: &mut RewardClient<Channel>,
    store: &Store,
    job_id: &str,
) -> Result<Vec<pb::TurnRecord>, StepError> {
    reward::credit(&plan.reward, reward, store, job_id, |_| 0).await?;
    let turns = store.turns(job_id).await?;
    Ok(turns
        .into_iter()
        .map(|turn| pb::TurnRecord { prompt: Vec::new(), completion: None, evaluation: None, ..turn })
        .collect())
}
