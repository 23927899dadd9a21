//! The orchestrator's service tests against fake peers, one binary for all of them (nextest still runs each test in
//! a process of its own).

mod durability;
mod flow;
mod hostile_requests;
mod operator_limits;
mod support;
