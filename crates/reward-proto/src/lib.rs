//! Reward-core's types at the wire boundary, for every crate that meets both: the orchestrator turns its stored
//! turns into samples and the job's metrics into their message ([`turn_sample`], [`job_metrics_to_proto`]), and the
//! Reward service reads verdicts with the same mapping ([`verdict`]).
//!
//! A crate of its own so that `kforge-reward-core` stays pure math without the contract's types, and so that no
//! service depends on another service's crate for a conversion (services reach each other only through the
//! generated clients). Nothing here decides a number; reward-core does.

mod metrics;
mod verdict;

pub use metrics::{Checked, job_metrics_to_proto, turn_sample};
pub use verdict::verdict;
