//! The Parquet form of `kforge export`: one row per `kforge.v1.Sample`, in columns a trainer reads as they are
//! (verl's and OpenRLHF's datasets): `prompt` as a list of `{role, content}` messages, token ids and
//! log-probabilities as lists, the verdict by name, the optional numbers null when unset, the response's Diagnose
//! flags as a struct (null when the turn got no response). The evaluation and the Judge's record are proto3 JSON
//! strings, so nothing a sample holds is lost.
//!
//! Written with the `parquet` crate's column writers rather than through Arrow arrays (docs/DEPENDENCIES.md says
//! why): rows are buffered column by column, nested columns with their definition and repetition levels, and go
//! out as a row group every [`ROW_GROUP_ROWS`] rows or [`ROW_GROUP_BYTES`] of data, so a job of any size takes
//! bounded memory.

use std::io::Write;
use std::sync::Arc;

use anyhow::Context as _;
use kforge_proto::v1 as pb;
use parquet::basic::Compression;
use parquet::data_type::{BoolType, ByteArray, ByteArrayType, DataType, DoubleType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::{SerializedFileWriter, SerializedRowGroupWriter};

/// The file's schema. Lists are Parquet's standard three-level LIST (`list` / `element`), which Arrow, pandas and
/// Spark read as list columns; integers are int64, lossless for the proto's uint32 and uint64 and the dtype
/// trainers index with. Response fields are empty when the turn got no response (`error` says why).
pub const SCHEMA: &str = "
message kforge_sample {
  required binary cursor (STRING);
  required binary job_id (STRING);
  required binary task_id (STRING);
  required int64 trajectory;
  required int64 turn;
  required group prompt (LIST) {
    repeated group list {
      required group element {
        required binary role (STRING);
        required binary content (STRING);
      }
    }
  }
  required group prompt_token_ids (LIST) {
    repeated group list {
      required int64 element;
    }
  }
  required binary response (STRING);
  required binary reasoning (STRING);
  required binary finish_reason (STRING);
  required group response_token_ids (LIST) {
    repeated group list {
      required int64 element;
    }
  }
  required group response_logprobs (LIST) {
    repeated group list {
      required double element;
    }
  }
  required int64 completion_tokens;
  required double ttft_ms;
  required double latency_ms;
  required binary kernel (STRING);
  required binary verdict (STRING);
  optional double score;
  optional double return_value;
  optional double advantage;
  optional boolean keep;
  required binary error (STRING);
  required binary format_error (STRING);
  optional binary evaluation (STRING);
  optional binary judge (STRING);
  optional group flags {
    required boolean truncated;
    required boolean no_kernel;
    required boolean degenerate;
    required boolean junk;
    required boolean not_okay;
    required boolean hack;
    required double repetition_ratio;
  }
}
";

/// Rows per row group: large enough for readers to scan efficiently, small enough that a job's samples (each
/// with its prompt, response and evaluation: tens of kilobytes) stay well within memory.
pub const ROW_GROUP_ROWS: usize = 1024;

/// The data buffered before a row group goes out even with fewer rows: long multi-turn prompts add up.
pub const ROW_GROUP_BYTES: usize = 64 << 20;

/// Writes samples as Parquet rows to `W`, a row group at a time; [`SampleWriter::finish`] writes the footer, without
/// which the file is unreadable.
pub struct SampleWriter<W: Write + Send> {
    file: SerializedFileWriter<W>,
    rows: Rows,
}

impl<W: Write + Send> std::fmt::Debug for SampleWriter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampleWriter").field("buffered_rows", &self.rows.count).finish_non_exhaustive()
    }
}

impl<W: Write + Send> SampleWriter<W> {
    /// Starts a file on `out` (Snappy-compressed pages: the Parquet ecosystem's usual codec).
    pub fn new(out: W) -> anyhow::Result<Self> {
        let schema = parquet::schema::parser::parse_message_type(SCHEMA).context("the sample schema parses")?;
        let properties = WriterProperties::builder().set_compression(Compression::SNAPPY).build();
        let file = SerializedFileWriter::new(out, Arc::new(schema), Arc::new(properties))
            .context("starting the parquet file")?;
        Ok(Self { file, rows: Rows::default() })
    }

    /// Adds a sample's row; a full row group is written out.
    pub fn write(&mut self, sample: pb::Sample) -> anyhow::Result<()> {
        self.rows.push(sample)?;
        if self.rows.count >= ROW_GROUP_ROWS || self.rows.bytes >= ROW_GROUP_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the rows still buffered and the footer, and returns `out`.
    pub fn finish(mut self) -> anyhow::Result<W> {
        self.flush()?;
        self.file.into_inner().context("writing the parquet footer")
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        if self.rows.count == 0 {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.rows);
        let mut row_group = self.file.next_row_group().context("starting a row group")?;
        rows.write(&mut row_group).context("writing a row group")?;
        row_group.close().context("closing a row group")?;
        Ok(())
    }
}

/// One leaf column's buffered values, with their levels where the column has any (an optional value or a list).
#[derive(Debug)]
struct Leaf<T> {
    values: Vec<T>,
    definition: Vec<i16>,
    repetition: Vec<i16>,
}

impl<T> Default for Leaf<T> {
    fn default() -> Self {
        Self { values: Vec::new(), definition: Vec::new(), repetition: Vec::new() }
    }
}

impl<T> Leaf<T> {
    /// A required column's value: no levels.
    fn push(&mut self, value: T) {
        self.values.push(value);
    }

    /// An optional column's value: definition level 1 when set, 0 for null (no value stored).
    fn push_optional(&mut self, value: Option<T>) {
        self.definition.push(i16::from(value.is_some()));
        self.values.extend(value);
    }

    /// A required list's elements: each at definition level 1, the first starting the row (repetition 0) and the
    /// rest repeating the list (1); an empty list is a single entry at definition 0.
    fn push_list(&mut self, elements: impl IntoIterator<Item = T>) {
        let before = self.values.len();
        self.values.extend(elements);
        let added = self.values.len() - before;
        if added == 0 {
            self.definition.push(0);
            self.repetition.push(0);
            return;
        }
        self.definition.extend(std::iter::repeat_n(1, added));
        self.repetition.push(0);
        self.repetition.extend(std::iter::repeat_n(1, added - 1));
    }
}

/// Text as Parquet bytes, without a copy.
fn text(value: String) -> ByteArray {
    ByteArray::from(value.into_bytes())
}

/// The buffered rows, a [`Leaf`] per leaf column of [`SCHEMA`], declared and written in its order.
#[derive(Debug, Default)]
struct Rows {
    count: usize,
    /// Roughly the data buffered: text lengths and 8 bytes per number.
    bytes: usize,
    cursor: Leaf<ByteArray>,
    job_id: Leaf<ByteArray>,
    task_id: Leaf<ByteArray>,
    trajectory: Leaf<i64>,
    turn: Leaf<i64>,
    prompt_role: Leaf<ByteArray>,
    prompt_content: Leaf<ByteArray>,
    prompt_token_ids: Leaf<i64>,
    response: Leaf<ByteArray>,
    reasoning: Leaf<ByteArray>,
    finish_reason: Leaf<ByteArray>,
    response_token_ids: Leaf<i64>,
    response_logprobs: Leaf<f64>,
    completion_tokens: Leaf<i64>,
    ttft_ms: Leaf<f64>,
    latency_ms: Leaf<f64>,
    kernel: Leaf<ByteArray>,
    verdict: Leaf<ByteArray>,
    score: Leaf<f64>,
    return_value: Leaf<f64>,
    advantage: Leaf<f64>,
    keep: Leaf<bool>,
    error: Leaf<ByteArray>,
    format_error: Leaf<ByteArray>,
    evaluation: Leaf<ByteArray>,
    judge: Leaf<ByteArray>,
    truncated: Leaf<bool>,
    no_kernel: Leaf<bool>,
    degenerate: Leaf<bool>,
    junk: Leaf<bool>,
    not_okay: Leaf<bool>,
    hack: Leaf<bool>,
    repetition_ratio: Leaf<f64>,
}

impl Rows {
    fn push(&mut self, sample: pb::Sample) -> anyhow::Result<()> {
        // Every field is named, here and in the completion: a field added to the proto fails to compile until it
        // has a column.
        let pb::Sample {
            cursor,
            job_id,
            task_id,
            trajectory,
            turn,
            prompt,
            prompt_token_ids,
            response,
            kernel,
            evaluation,
            verdict,
            score,
            return_value,
            advantage,
            keep,
            error,
            judge,
            format_error,
            flags,
        } = sample;
        let pb::Completion {
            text: answer,
            reasoning,
            finish_reason,
            token_ids,
            logprobs,
            completion_tokens,
            ttft_ms,
            latency_ms,
        } = response.unwrap_or_default();
        // `response_id` echoes a Diagnose request's id, which a turn's record leaves empty: the cursor names the sample.
        let flags = flags.map(
            |pb::ResponseFlags {
                 response_id: _,
                 truncated,
                 no_kernel,
                 degenerate,
                 junk,
                 not_okay,
                 hack,
                 repetition_ratio,
             }| (truncated, no_kernel, degenerate, junk, not_okay, hack, repetition_ratio),
        );
        let evaluation =
            evaluation.map(|evaluation| super::message_json("kforge.v1.EvaluateResponse", &evaluation)).transpose()?;
        let judge = judge.map(|judge| super::message_json("kforge.v1.JudgeRecord", &judge)).transpose()?;
        // An enum value this build does not know keeps its number, as proto3 JSON writes it.
        let verdict =
            pb::Verdict::try_from(verdict).map_or_else(|_| verdict.to_string(), |v| v.as_str_name().to_owned());
        let completion_tokens = i64::try_from(completion_tokens)
            .with_context(|| format!("sample {cursor}: completion_tokens {completion_tokens} exceeds int64"))?;

        let strings =
            [&cursor, &job_id, &task_id, &answer, &reasoning, &finish_reason, &kernel, &verdict, &error, &format_error];
        self.bytes += strings.iter().map(|s| s.len()).sum::<usize>()
            + prompt.iter().map(|m| m.role.len() + m.content.len()).sum::<usize>()
            + evaluation.as_ref().map_or(0, String::len)
            + judge.as_ref().map_or(0, String::len)
            + 8 * (prompt_token_ids.len() + token_ids.len() + logprobs.len() + 9);
        self.count += 1;

        self.cursor.push(text(cursor));
        self.job_id.push(text(job_id));
        self.task_id.push(text(task_id));
        self.trajectory.push(i64::from(trajectory));
        self.turn.push(i64::from(turn));
        let (roles, contents): (Vec<_>, Vec<_>) =
            prompt.into_iter().map(|pb::ChatMessage { role, content }| (text(role), text(content))).unzip();
        self.prompt_role.push_list(roles);
        self.prompt_content.push_list(contents);
        self.prompt_token_ids.push_list(prompt_token_ids.into_iter().map(i64::from));
        self.response.push(text(answer));
        self.reasoning.push(text(reasoning));
        self.finish_reason.push(text(finish_reason));
        self.response_token_ids.push_list(token_ids.into_iter().map(i64::from));
        self.response_logprobs.push_list(logprobs);
        self.completion_tokens.push(completion_tokens);
        self.ttft_ms.push(ttft_ms);
        self.latency_ms.push(latency_ms);
        self.kernel.push(text(kernel));
        self.verdict.push(text(verdict));
        self.score.push_optional(score);
        self.return_value.push_optional(return_value);
        self.advantage.push_optional(advantage);
        self.keep.push_optional(keep);
        self.error.push(text(error));
        self.format_error.push(text(format_error));
        self.evaluation.push_optional(evaluation.map(text));
        self.judge.push_optional(judge.map(text));
        // The group is null or whole: each leaf is null exactly where the group is.
        self.truncated.push_optional(flags.map(|f| f.0));
        self.no_kernel.push_optional(flags.map(|f| f.1));
        self.degenerate.push_optional(flags.map(|f| f.2));
        self.junk.push_optional(flags.map(|f| f.3));
        self.not_okay.push_optional(flags.map(|f| f.4));
        self.hack.push_optional(flags.map(|f| f.5));
        self.repetition_ratio.push_optional(flags.map(|f| f.6));
        Ok(())
    }

    /// Writes every column, in the schema's order (the unit test reads each one back).
    fn write<W: Write + Send>(self, row_group: &mut SerializedRowGroupWriter<'_, W>) -> anyhow::Result<()> {
        write_leaf::<ByteArrayType, W>(row_group, self.cursor)?;
        write_leaf::<ByteArrayType, W>(row_group, self.job_id)?;
        write_leaf::<ByteArrayType, W>(row_group, self.task_id)?;
        write_leaf::<Int64Type, W>(row_group, self.trajectory)?;
        write_leaf::<Int64Type, W>(row_group, self.turn)?;
        write_leaf::<ByteArrayType, W>(row_group, self.prompt_role)?;
        write_leaf::<ByteArrayType, W>(row_group, self.prompt_content)?;
        write_leaf::<Int64Type, W>(row_group, self.prompt_token_ids)?;
        write_leaf::<ByteArrayType, W>(row_group, self.response)?;
        write_leaf::<ByteArrayType, W>(row_group, self.reasoning)?;
        write_leaf::<ByteArrayType, W>(row_group, self.finish_reason)?;
        write_leaf::<Int64Type, W>(row_group, self.response_token_ids)?;
        write_leaf::<DoubleType, W>(row_group, self.response_logprobs)?;
        write_leaf::<Int64Type, W>(row_group, self.completion_tokens)?;
        write_leaf::<DoubleType, W>(row_group, self.ttft_ms)?;
        write_leaf::<DoubleType, W>(row_group, self.latency_ms)?;
        write_leaf::<ByteArrayType, W>(row_group, self.kernel)?;
        write_leaf::<ByteArrayType, W>(row_group, self.verdict)?;
        write_leaf::<DoubleType, W>(row_group, self.score)?;
        write_leaf::<DoubleType, W>(row_group, self.return_value)?;
        write_leaf::<DoubleType, W>(row_group, self.advantage)?;
        write_leaf::<BoolType, W>(row_group, self.keep)?;
        write_leaf::<ByteArrayType, W>(row_group, self.error)?;
        write_leaf::<ByteArrayType, W>(row_group, self.format_error)?;
        write_leaf::<ByteArrayType, W>(row_group, self.evaluation)?;
        write_leaf::<ByteArrayType, W>(row_group, self.judge)?;
        write_leaf::<BoolType, W>(row_group, self.truncated)?;
        write_leaf::<BoolType, W>(row_group, self.no_kernel)?;
        write_leaf::<BoolType, W>(row_group, self.degenerate)?;
        write_leaf::<BoolType, W>(row_group, self.junk)?;
        write_leaf::<BoolType, W>(row_group, self.not_okay)?;
        write_leaf::<BoolType, W>(row_group, self.hack)?;
        write_leaf::<DoubleType, W>(row_group, self.repetition_ratio)?;
        Ok(())
    }
}

/// Writes the next column of `row_group` from `leaf`. `T` must be the column's physical type (parquet's `typed`
/// panics otherwise): [`Rows::write`] follows [`SCHEMA`], and the unit test writes and reads every column.
fn write_leaf<T: DataType, W: Write + Send>(
    row_group: &mut SerializedRowGroupWriter<'_, W>,
    leaf: Leaf<T::T>,
) -> anyhow::Result<()> {
    let mut column = row_group.next_column()?.context("the schema has a column for every buffer")?;
    column.typed::<T>().write_batch(&leaf.values, levels(&leaf.definition), levels(&leaf.repetition))?;
    column.close()?;
    Ok(())
}

/// A column's levels, none where it has none (a required column that is not in a list).
fn levels(levels: &[i16]) -> Option<&[i16]> {
    (!levels.is_empty()).then_some(levels)
}

#[cfg(test)]
mod tests {
    use parquet::file::reader::{FileReader as _, SerializedFileReader};
    use parquet::record::Field;
    use serde_json::{Value, json};

    use super::*;

    /// A sample with every field set, the optional ones as given.
    fn sample(turn: u32, score: Option<f64>, keep: Option<bool>) -> pb::Sample {
        pb::Sample {
            cursor: format!("c{turn}"),
            job_id: "job-1".into(),
            task_id: "examples/relu".into(),
            trajectory: 1,
            turn,
            prompt: vec![
                pb::ChatMessage { role: "system".into(), content: "You write kernels.".into() },
                pb::ChatMessage { role: "user".into(), content: format!("Turn {turn}: write ModelNew.") },
            ],
            prompt_token_ids: vec![1, 2, u32::MAX],
            response: Some(pb::Completion {
                text: "```python\nclass ModelNew: ...\n```".into(),
                reasoning: "Okay.".into(),
                finish_reason: "stop".into(),
                token_ids: vec![7, 8],
                logprobs: vec![-0.5, -0.25],
                completion_tokens: 2,
                ttft_ms: 12.5,
                latency_ms: 40.0,
            }),
            kernel: "class ModelNew: ...\n".into(),
            evaluation: Some(pb::EvaluateResponse { request_id: "r1".into(), ..Default::default() }),
            verdict: pb::Verdict::Correct.into(),
            score,
            return_value: score.map(|s| s / 2.0),
            advantage: None,
            keep,
            error: String::new(),
            judge: None,
            format_error: String::new(),
            flags: Some(pb::ResponseFlags {
                response_id: String::new(),
                truncated: false,
                no_kernel: false,
                degenerate: turn == 1,
                junk: turn == 1,
                not_okay: true,
                hack: false,
                repetition_ratio: 0.625,
            }),
        }
    }

    /// A record field as JSON, lists and groups included, to compare whole rows.
    fn json_of(field: &Field) -> Value {
        match field {
            Field::Null => Value::Null,
            Field::Bool(b) => json!(b),
            Field::Long(n) => json!(n),
            Field::Double(x) => json!(x),
            Field::Str(s) => json!(s),
            Field::ListInternal(list) => Value::Array(list.elements().iter().map(json_of).collect()),
            Field::Group(row) => {
                Value::Object(row.get_column_iter().map(|(name, field)| (name.clone(), json_of(field))).collect())
            }
            other => panic!("a type the schema does not use: {other:?}"),
        }
    }

    fn rows_of(samples: Vec<pb::Sample>) -> Vec<Value> {
        let path =
            std::env::temp_dir().join(format!("kforge-export-unit-{}-{}.parquet", std::process::id(), samples.len()));
        let mut writer = SampleWriter::new(std::fs::File::create(&path).expect("created")).expect("started");
        for sample in samples {
            writer.write(sample).expect("written");
        }
        writer.finish().expect("finished");
        let reader = SerializedFileReader::try_from(path.as_path()).expect("a parquet file");
        let rows =
            reader.get_row_iter(None).expect("rows").map(|row| json_of(&Field::Group(row.expect("a row")))).collect();
        std::fs::remove_file(&path).expect("removed");
        rows
    }

    #[test]
    fn a_sample_becomes_one_row_with_every_field() {
        let rows = rows_of(vec![sample(0, Some(0.75), Some(true)), sample(1, None, None)]);
        let evaluation = super::super::message_json(
            "kforge.v1.EvaluateResponse",
            &pb::EvaluateResponse { request_id: "r1".into(), ..Default::default() },
        )
        .expect("json");
        let expected = |turn: u32, score: Value, return_value: Value, keep: Value| {
            json!({
                "cursor": format!("c{turn}"), "job_id": "job-1", "task_id": "examples/relu",
                "trajectory": 1, "turn": turn,
                "prompt": [
                    {"role": "system", "content": "You write kernels."},
                    {"role": "user", "content": format!("Turn {turn}: write ModelNew.")},
                ],
                "prompt_token_ids": [1, 2, u32::MAX],
                "response": "```python\nclass ModelNew: ...\n```", "reasoning": "Okay.", "finish_reason": "stop",
                "response_token_ids": [7, 8], "response_logprobs": [-0.5, -0.25],
                "completion_tokens": 2, "ttft_ms": 12.5, "latency_ms": 40.0,
                "kernel": "class ModelNew: ...\n", "verdict": "VERDICT_CORRECT",
                "score": score, "return_value": return_value, "advantage": null, "keep": keep,
                "error": "", "format_error": "", "evaluation": evaluation, "judge": null,
                "flags": {
                    "truncated": false, "no_kernel": false, "degenerate": turn == 1, "junk": turn == 1,
                    "not_okay": true, "hack": false, "repetition_ratio": 0.625,
                },
            })
        };
        assert_eq!(
            rows,
            [expected(0, json!(0.75), json!(0.375), json!(true)), expected(1, json!(null), json!(null), json!(null))]
        );
    }

    /// A turn that failed before the model answered: no response, no prompt tokens, no evaluation.
    #[test]
    fn empty_lists_and_a_missing_response_are_empty_not_shifted() {
        let failed = pb::Sample {
            cursor: "c9".into(),
            prompt: Vec::new(),
            prompt_token_ids: Vec::new(),
            response: None,
            evaluation: None,
            verdict: 42,
            error: "gateway: unavailable".into(),
            flags: None,
            ..sample(9, None, Some(false))
        };
        let rows = rows_of(vec![sample(0, Some(1.0), None), failed, sample(2, Some(0.0), None)]);
        assert_eq!(rows.len(), 3);
        let failed = &rows[1];
        assert_eq!(
            (&failed["prompt"], &failed["prompt_token_ids"], &failed["response_token_ids"]),
            (&json!([]), &json!([]), &json!([]))
        );
        assert_eq!(
            (&failed["response"], &failed["evaluation"], &failed["keep"]),
            (&json!(""), &Value::Null, &json!(false))
        );
        assert_eq!((&failed["verdict"], &failed["error"]), (&json!("42"), &json!("gateway: unavailable")));
        assert_eq!(failed["flags"], Value::Null, "no response, no diagnosis: the whole group is null");
        assert_eq!((&rows[0]["flags"]["not_okay"], &rows[2]["flags"]["hack"]), (&json!(true), &json!(false)));
        // The rows on either side keep their own lists: the levels of the empty ones shifted nothing.
        assert_eq!(rows[2]["prompt"][1]["content"], "Turn 2: write ModelNew.");
        assert_eq!((&rows[2]["response_token_ids"], &rows[2]["score"]), (&json!([7, 8]), &json!(0.0)));
    }

    #[test]
    fn rows_go_out_in_row_groups_of_bounded_size() {
        let path = std::env::temp_dir().join(format!("kforge-export-unit-{}-groups.parquet", std::process::id()));
        let mut writer = SampleWriter::new(std::fs::File::create(&path).expect("created")).expect("started");
        for turn in 0..(ROW_GROUP_ROWS as u32 + 3) {
            writer.write(sample(turn, None, None)).expect("written");
        }
        writer.finish().expect("finished");
        let reader = SerializedFileReader::try_from(path.as_path()).expect("a parquet file");
        let groups: Vec<i64> = reader.metadata().row_groups().iter().map(|g| g.num_rows()).collect();
        std::fs::remove_file(&path).expect("removed");
        assert_eq!(groups, [ROW_GROUP_ROWS as i64, 3]);
    }
}
