//! The library behind the `kforge` command, also used by the cross-service tests.
//!
//! - [`mesh`]: start any set of the five services in this process, on their configured or ephemeral ports.
//! - [`run`]: the main job's embedded default (the replay model), its progress and its report.
//! - [`call`]: call any RPC of the contract with proto3 JSON in and out, through reflection-free descriptors.
//! - [`export`]: a job's training samples as JSONL or Parquet.
//! - [`doctor`]: what this machine can do for kforge, and how to fix what it cannot.
//! - [`scratch`]: `kforge run`'s scratch directory, and the removal of those killed runs left behind.
//! - [`store`]: the job store a command opens, `kforge run`'s report directory beside it, a URL as shown.
//! - [`stdout`]: writing a command's output, where a reader that went away ends the command quietly.

pub mod call;
pub mod doctor;
pub mod export;
pub mod mesh;
pub mod run;
pub mod scratch;
pub mod stdout;
pub mod store;
