//! The replay backend: recorded responses from a JSONL file, keyed by (task, trajectory, turn).
//!
//! A hash of the prompt cannot be the key: turn t+1's prompt holds the evaluator's measured timings of turn t,
//! which differ run to run. One record per line:
//!
//! ```json
//! {"task_id": "examples/relu", "trajectory": 0, "turn": 0,
//!  "completions": [{"text": "...", "reasoning": "", "finish_reason": "stop", "token_ids": [], "logprobs": []}],
//!  "prompt_token_ids": [], "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
//! ```
//!
//! Only `task_id`, `trajectory`, `turn` and `completions[].text` are required. A record whose `usage` leaves out
//! `prompt_tokens` has them counted from the prompt it is sent, at [`CHARS_PER_TOKEN`] characters per token (a
//! recorded prompt's length would not follow the prompt that earlier turns' evaluations make). The file is read once
//! at start-up;
//! a malformed line or a key recorded twice fails the start with the line's number. Every response served from
//! it is labelled `replay` on the wire.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use serde::Deserialize;

use super::{AttemptError, BackendError, CompletionOut, Delta, DeltaSink, Generation, UsageOut};
use crate::request::{GenerateSpec, Input};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Record {
    task_id: String,
    trajectory: u32,
    turn: u32,
    completions: Vec<RecordedCompletion>,
    #[serde(default)]
    prompt_token_ids: Vec<u32>,
    #[serde(default)]
    usage: Option<RecordedUsage>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordedCompletion {
    text: String,
    #[serde(default)]
    reasoning: String,
    #[serde(default = "stop")]
    finish_reason: String,
    #[serde(default)]
    token_ids: Vec<u32>,
    #[serde(default)]
    logprobs: Vec<f64>,
}

fn stop() -> String {
    "stop".into()
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RecordedUsage {
    /// None: counted from the prompt sent.
    prompt_tokens: Option<u64>,
    completion_tokens: u64,
    cached_prompt_tokens: u64,
    reasoning_tokens: u64,
}

/// Characters per token where a record's usage leaves the prompt's tokens to be counted: the rough rate of a BPE
/// tokenizer on English and code.
pub const CHARS_PER_TOKEN: u64 = 4;

/// The tokens of `input` at [`CHARS_PER_TOKEN`], rounded up; token ids count as they are.
fn prompt_tokens(input: &Input) -> u64 {
    let chars: usize = match input {
        Input::Chat(messages) => messages.iter().map(|m| m.content.chars().count()).sum(),
        Input::Prompt(text) => text.chars().count(),
        Input::PromptTokens(ids) => return ids.len() as u64,
    };
    (chars as u64).div_ceil(CHARS_PER_TOKEN)
}

type Key = (String, u32, u32);

/// Recorded responses, in memory.
#[derive(Debug)]
pub struct ReplayBackend {
    records: HashMap<Key, Record>,
}

impl ReplayBackend {
    /// Reads `file`. Errors name the file and the line.
    pub fn load(file: &Path) -> Result<Self, BackendError> {
        let text = std::fs::read_to_string(file)
            .map_err(|source| BackendError::ReplayRead { path: file.to_owned(), source })?;
        let mut records = HashMap::new();
        for (number, line) in text.lines().enumerate() {
            let number = number + 1;
            if line.trim().is_empty() {
                continue;
            }
            let record: Record = serde_json::from_str(line).map_err(|source| BackendError::ReplayLine {
                path: file.to_owned(),
                line: number,
                source,
            })?;
            if record.completions.is_empty() {
                return Err(BackendError::ReplayNoCompletions { path: file.to_owned(), line: number });
            }
            let key = (record.task_id.clone(), record.trajectory, record.turn);
            if records.insert(key.clone(), record).is_some() {
                let (task_id, trajectory, turn) = key;
                return Err(BackendError::ReplayDuplicate {
                    path: file.to_owned(),
                    line: number,
                    task_id,
                    trajectory,
                    turn,
                });
            }
        }
        tracing::info!(file = %file.display(), records = records.len(), "replay file loaded");
        Ok(Self { records })
    }

    /// The record of `spec`'s keys, its first `n` completions.
    pub async fn generate(&self, spec: &GenerateSpec, sink: &mut DeltaSink) -> Result<Generation, AttemptError> {
        let keys = &spec.keys;
        let key = (keys.task_id.clone(), keys.trajectory, keys.turn);
        let record = self.records.get(&key).ok_or_else(|| AttemptError::NoRecord {
            task_id: keys.task_id.clone(),
            trajectory: keys.trajectory,
            turn: keys.turn,
        })?;
        let n = spec.sampling.n;
        if record.completions.len() < n as usize {
            return Err(AttemptError::TooFewRecorded { recorded: record.completions.len(), asked: n });
        }
        let now = Instant::now();
        let mut completions = Vec::with_capacity(n as usize);
        for (index, recorded) in record.completions.iter().take(n as usize).enumerate() {
            sink.send(Delta {
                index: index as u32,
                text: recorded.text.clone(),
                reasoning: recorded.reasoning.clone(),
            })
            .await;
            completions.push(CompletionOut {
                text: recorded.text.clone(),
                reasoning: recorded.reasoning.clone(),
                finish_reason: recorded.finish_reason.clone(),
                token_ids: if spec.return_token_ids { recorded.token_ids.clone() } else { Vec::new() },
                logprobs: if spec.return_logprobs { recorded.logprobs.clone() } else { Vec::new() },
                completion_tokens: (!recorded.token_ids.is_empty()).then_some(recorded.token_ids.len() as u64),
                first_token_at: Some(now),
                finished_at: Some(now),
            });
        }
        let usage_reported = record.usage.is_some();
        let usage = record.usage.unwrap_or_default();
        Ok(Generation {
            usage_reported,
            completions,
            prompt_token_ids: if spec.return_token_ids { record.prompt_token_ids.clone() } else { Vec::new() },
            usage: UsageOut {
                // No usage recorded: none reported, as a server that reports none.
                prompt_tokens: if usage_reported {
                    usage.prompt_tokens.unwrap_or_else(|| prompt_tokens(&spec.input))
                } else {
                    0
                },
                completion_tokens: usage.completion_tokens,
                cached_prompt_tokens: usage.cached_prompt_tokens,
                reasoning_tokens: usage.reasoning_tokens,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kforge-replay-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("replay.jsonl");
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn malformed_lines_and_duplicates_name_the_line() {
        let bad = write(
            "bad",
            "{\"task_id\":\"t\",\"trajectory\":0,\"turn\":0,\"completions\":[{\"text\":\"a\"}]}\nnot json\n",
        );
        let error = ReplayBackend::load(&bad).expect_err("malformed");
        assert!(matches!(error, BackendError::ReplayLine { line: 2, .. }), "{error}");
        assert!(error.to_string().contains("line 2"), "{error}");
        let line = "{\"task_id\":\"t\",\"trajectory\":0,\"turn\":0,\"completions\":[{\"text\":\"a\"}]}\n";
        let twice = write("twice", &line.repeat(2));
        let error = ReplayBackend::load(&twice).expect_err("duplicate");
        assert!(matches!(error, BackendError::ReplayDuplicate { line: 2, trajectory: 0, turn: 0, .. }), "{error}");
        assert!(error.to_string().contains("recorded twice"), "{error}");
    }

    #[test]
    fn a_prompt_without_recorded_tokens_is_counted_at_four_characters_per_token() {
        let usage: RecordedUsage = serde_json::from_str(r#"{"completion_tokens": 7}"#).expect("parses");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (None, 7));
        let message = |content: &str| crate::request::Message { role: "user".into(), content: content.into() };
        let chat = Input::Chat(vec![message("four"), message("and five!")]);
        assert_eq!(prompt_tokens(&chat), 4, "13 characters: 4 tokens, rounded up");
        assert_eq!(prompt_tokens(&Input::Prompt("éééé".into())), 1, "characters, not bytes");
        assert_eq!(prompt_tokens(&Input::PromptTokens(vec![1, 2, 3])), 3, "ids count as they are");
    }
}
