//! The `kforge` command's tests, one binary for all of them (each test binary links every service; nextest still
//! runs each test in a process of its own).

mod contract;
mod doctor;
mod export;
mod gateway;
mod real_model;
mod run;
mod support;
mod up;
