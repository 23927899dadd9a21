//! What kforge's benchmark binaries and their CI versions share: the simulated fleet ([`fleet`]), run by the
//! `orchestrator-fleet` benchmark and by `tests/fleet.rs`.

pub mod fleet;
