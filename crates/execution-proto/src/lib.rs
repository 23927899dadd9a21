//! The execution engine's types at the wire boundary, for every service that runs candidates on it: the evaluator
//! and the profiler report how a run ended ([`ending`], with [`verdict`] and [`finding`]) and its kernel census
//! ([`kernel`]), read a request's task and backend ([`task`], [`requested_backend`]), and answer a refused request
//! with one status ([`status`]); the evaluator's `GetCapabilities` is the engine's [`capabilities`].
//!
//! A crate of its own so that `kforge-execution` stays free of the contract's types, and so that neither service
//! depends on the other's crate for a conversion (as `kforge-reward-proto` does for reward-core). Each message is
//! written out field by field and each engine type destructured, so a new field on either side fails to compile
//! until it is handled. What a response holds beyond these (timings, mismatches, Nsight Compute's metrics) is its
//! service's own, converted at that service's edge.

mod capabilities;
mod outcome;
mod request;

pub use capabilities::{backend, capabilities};
pub use outcome::{Ending, ending, finding, kernel, verdict};
pub use request::{requested_backend, status, task};
