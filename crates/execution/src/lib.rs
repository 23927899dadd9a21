//! Executing untrusted candidate kernels, for the Evaluator and the Profiler services alike.
//!
//! The [`Engine`] is what one process shares between them: the Python environment ([`python`]), harness processes
//! in the sandbox ([`stage`], speaking the typed [`protocol`] with the harness in `harness/`), the artifact cache
//! ([`cache`], compiled through [`Engine::build`]) with torch's extension header precompiled for the bindings
//! ([`precompiled_header`]), the device lanes and their gate, admission and health ([`devices`]), the disk
//! budget ([`disk`]), the memory candidates' outputs are handed over in ([`handoff`]) and the scratch directories
//! removed off the async workers ([`scratch`]). The static checks (`kforge-static-checks`, below this crate) and the
//! kernel census ([`census`]) define what a candidate may do and which kernels are its own, for both services.
//!
//! The crate speaks its own types, never the contract's: a run ends in the engine's outcome types (a [`Verdict`],
//! [`Finding`]s, a [`Stop`], each step's [`Staged`] notes) with its stage times keyed by [`times::Stage`]; a
//! request comes as a [`SubmissionRequest`]. A service keeps its gRPC face (converting to and from the contract at
//! that edge, once) and its own pipeline: the evaluator's checks and timing, the profiler's Nsight Compute run.
//!
//! The crate's one binary, `kforge-device-probe`, is the GPU health probe the device lanes launch after a fault
//! (`src/bin/kforge-device-probe.rs`); it is built with the engine that runs it.

pub mod cache;
pub mod census;
pub mod config;
pub mod devices;
pub mod disk;
pub mod engine;
pub mod handoff;
pub mod metrics;
pub mod precompiled_header;
pub mod protocol;
pub mod python;
pub mod scratch;
pub mod stage;
pub mod times;

pub use config::ExecutionConfig;
pub use engine::{Engine, InfraError, RequestError, Submission, SubmissionRequest};
pub use engine::{Finding, Judgement, Notes, Staged, Stop, Verdict};
pub use metrics::ExecutionMetrics;
