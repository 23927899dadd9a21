//! What kforge's tests and benchmarks share, so that none keeps a copy of its own.
//!
//! - [`eventually`] and [`Wait`]: poll a condition under a deadline, failing with what was awaited. Tests wait for
//!   readiness this way (or on a stream), never with a fixed sleep.
//! - [`peers`]: fake gateway, evaluator, reward and profiler services in one in-process server that count what
//!   they receive, can hold a call until the test releases it, and answer what a test or a benchmark scripts.
//! - [`python`]: the repository's `.venv` interpreter, or a visible `SKIP:` line (a failure under `KFORGE_CI=1`).
//! - [`Postgres`]: a throwaway PostgreSQL cluster on a Unix socket of its own.
//! - [`ReservedPort`]: a loopback port that no other bind of port 0 can take, for a child process that must be
//!   told its address (or a server that stops and serves again on the same one).
//! - [`health`]: follow grpc.health.v1's Watch until a service reports a status.
//! - [`model_server`]: llama.cpp's OpenAI-compatible server with a small model, for the real-model tests.
//!
//! A dev-dependency of the crates whose tests use it, and a dependency of the benchmarks.

pub mod health;
pub mod model_server;
pub mod peers;
mod ports;
mod postgres;
pub mod python;
mod wait;

pub use ports::ReservedPort;
pub use postgres::Postgres;
pub use wait::{INTERVAL, PATIENCE, Probe, TimedOut, Wait, eventually};
