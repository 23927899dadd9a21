//! The `kforge` command's tests, one binary for all of them (each test binary links every service; nextest still
//! runs each test in a process of its own).

mod contract;
mod doctor;
mod export;
mod gateway;
#[path = "../../../tests/src/model_server.rs"]
#[allow(dead_code)] // the gateway's tests use the rest of it
mod model_server;
mod real_model;
mod run;
mod support;
mod up;
