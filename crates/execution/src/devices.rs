//! The devices evaluations and profiles run on, by concern:
//!
//! - [`admission`](self::admission): which waiting evaluation gets the next free slot, and where (priority, turns
//!   across jobs, memory-aware admission by each evaluation's [`footprint`]);
//! - [`lanes`](self::lanes): a lane is a slot on one device, the CPU's one or one of each GPU's `gpu_slots`, held by
//!   an evaluation from its first stage on the device to its last; quarantine of a GPU that failed its probe;
//! - [`gate`](self::gate): how the evaluations holding slots on one device share it, timed work running alone;
//! - [`pairing`](self::pairing): a candidate and its baseline timing their calls in rounds, by turns;
//! - [`health`](self::health): telling a device fault from a candidate's error ([`fault`]), and the probe that
//!   decides whether a device that faulted can go on serving.
//!
//! Their configuration (`device_probe`, `gpu_slots`, `gpu_memory_fraction`) is in `crate::config` (`ExecutionConfig`).

mod admission;
mod gate;
mod health;
mod lanes;
mod pairing;

pub use admission::footprint;
pub use gate::{Gate, GateAccount, Member, MemberClock, MemberTimes};
pub use health::{PROBE_PROGRAM, ProbeFailed, ProbeMissing, fault};
pub use lanes::{Lane, Lanes, Unavailable};
pub use pairing::{PairSide, Pairing, Side};
