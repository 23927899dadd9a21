//! Recorded turns as training samples (ExportSamples): each turn converted to a `kforge.v1.Sample` with its cursor,
//! its position in the job's order, and the job's turns read from the store a page at a time as the client takes
//! them, so that a large job never sits in memory whole and an export can continue after the last cursor it got.

use kforge_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::{OrchestratorError, store_status};
use crate::store::{Store, TurnPosition};

/// Sends the job's samples after `after` (at most `left`) to `sender`, a page of turns at a time, until they or
/// the receiver run out; a store failure is sent as the stream's last item.
pub(crate) async fn send_samples(
    store: Store,
    job_id: String,
    mut after: Option<TurnPosition>,
    mut left: u64,
    sender: mpsc::Sender<Result<pb::Sample, Status>>,
) {
    const PAGE: u32 = 256;
    while left > 0 {
        let page = match store.turns_after(&job_id, after, PAGE.min(left as u32)).await {
            Ok(page) => page,
            Err(error) => {
                let _ = sender.send(Err(store_status(error))).await;
                return;
            }
        };
        let full = page.len() as u32 == PAGE;
        for (position, turn) in page {
            after = Some(position);
            left -= 1;
            if sender.send(Ok(sample(&job_id, position, turn))).await.is_err() {
                return;
            }
        }
        if !full {
            return;
        }
    }
}

/// A sample's cursor: its position in the job's order, `task.trajectory.turn`.
fn cursor((task, trajectory, turn): TurnPosition) -> String {
    format!("{task}.{trajectory}.{turn}")
}

/// The position a cursor names (none for an empty one: from the start); INVALID_ARGUMENT for text this service did
/// not write.
pub(crate) fn parse_cursor(text: &str) -> Result<Option<TurnPosition>, OrchestratorError> {
    if text.is_empty() {
        return Ok(None);
    }
    let bad = || OrchestratorError::invalid("cursor", "not a cursor from ExportSamples");
    let mut parts = text.split('.');
    let mut next = || parts.next().ok_or_else(bad);
    let position =
        (next()?.parse().map_err(|_| bad())?, next()?.parse().map_err(|_| bad())?, next()?.parse().map_err(|_| bad())?);
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(Some(position))
}

/// A recorded turn as a training sample.
fn sample(job_id: &str, position: TurnPosition, turn: pb::TurnRecord) -> pb::Sample {
    pb::Sample {
        cursor: cursor(position),
        job_id: job_id.to_owned(),
        task_id: turn.task_id,
        trajectory: turn.trajectory,
        turn: turn.turn,
        prompt: turn.prompt,
        prompt_token_ids: turn.prompt_token_ids,
        response: turn.completion,
        kernel: turn.kernel,
        evaluation: turn.evaluation,
        verdict: turn.verdict,
        score: turn.score,
        return_value: turn.return_value,
        advantage: turn.advantage,
        keep: turn.keep,
        error: turn.error,
        judge: turn.judge,
        format_error: turn.format_error,
        flags: turn.flags,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_reject_what_they_did_not_write() {
        assert_eq!(parse_cursor("").expect("empty"), None);
        assert_eq!(parse_cursor(&cursor((3, 1, 7))).expect("parses"), Some((3, 1, 7)));
        for bad in ["x", "1.2", "1.2.3.4", "1.-2.3"] {
            assert!(parse_cursor(bad).expect_err(bad).to_string().starts_with("cursor:"), "{bad}");
        }
    }

    /// The job's junk, not-okay and hack counts are over the turns' flags: a sample carries them, so an export can
    /// recompute those ratios.
    #[test]
    fn a_sample_carries_its_turns_diagnosis() {
        let flags = pb::ResponseFlags { junk: true, degenerate: true, repetition_ratio: 0.9, ..Default::default() };
        let turn = pb::TurnRecord { task_id: "t".into(), flags: Some(flags.clone()), ..Default::default() };
        let sample = sample("job-1", (0, 1, 2), turn);
        assert_eq!((sample.cursor.as_str(), sample.flags), ("0.1.2", Some(flags)));
        let undiagnosed = super::sample("job-1", (0, 0, 0), pb::TurnRecord::default());
        assert_eq!(undiagnosed.flags, None, "a turn without a response has no diagnosis");
    }
}
