//! The contract's verdict as reward-core's: one exhaustive mapping, so a verdict added to the contract does not
//! compile until its reward meaning is decided.

use kforge_proto::v1 as pb;
use kforge_reward_core as core;

/// Reward-core's verdict for `wire`; `None` for `VERDICT_UNSPECIFIED` (a turn that was never evaluated, or a
/// request that left the field out: the caller says which).
pub fn verdict(wire: pb::Verdict) -> Option<core::Verdict> {
    use pb::Verdict as V;
    match wire {
        V::Unspecified => None,
        V::Correct => Some(core::Verdict::Correct),
        V::Incorrect => Some(core::Verdict::Incorrect),
        V::CompileError => Some(core::Verdict::CompileError),
        V::RuntimeError => Some(core::Verdict::RuntimeError),
        V::Timeout => Some(core::Verdict::Timeout),
        V::Rejected => Some(core::Verdict::Rejected),
        V::Hack => Some(core::Verdict::Hack),
        V::InfraError => Some(core::Verdict::InfraError),
    }
}
