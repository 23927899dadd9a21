//! The cross-service tests that start a mesh of real services in this process, one binary for all of them (each
//! test binary links every service; nextest still runs each test in a process of its own). The trace tests stay
//! binaries of their own: each installs the process's global subscriber and exporter before its runtime starts.

mod dashboards;
mod evaluator_lost;
mod faces_kernelgym;
mod faces_nemo_gym;
mod faces_openenv;
mod faces_ors;
mod json_face;
mod reward;
mod server;
