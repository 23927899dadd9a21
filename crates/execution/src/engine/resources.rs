//! The parts of the engine a pipeline builds on: its configuration, work directory and sandbox, the checked Python
//! environment, the device lanes, the disk and memory budgets, the censuses kept for profiles, and its metrics.

use std::path::Path;
use std::sync::Arc;

use kforge_sandbox::Sandbox;

use super::Engine;
use crate::census;
use crate::config::ExecutionConfig;
use crate::devices::Lanes;
use crate::disk::DiskBudget;
use crate::handoff::MemoryFiles;
use crate::metrics::ExecutionMetrics;
use crate::python::PythonEnv;

impl Engine {
    pub fn config(&self) -> &ExecutionConfig {
        &self.inner.config
    }

    /// The work directory, absolute.
    pub fn work_dir(&self) -> &Path {
        &self.inner.work_dir
    }

    pub fn sandbox(&self) -> &Sandbox {
        &self.inner.sandbox
    }

    /// The Python environment of a run whose submission was checked (`Engine::submission` refuses every request
    /// while there is none).
    pub fn checked_python(&self) -> &PythonEnv {
        self.inner.python.as_ref().expect("a submission is made only with a usable environment")
    }

    pub fn lanes(&self) -> &Arc<Lanes> {
        &self.inner.lanes
    }

    pub fn disk(&self) -> &DiskBudget {
        &self.inner.disk
    }

    pub fn memory_files(&self) -> Option<&MemoryFiles> {
        self.inner.memory_files.as_ref()
    }

    pub fn censuses(&self) -> &census::Recent {
        &self.inner.censuses
    }

    pub fn metrics(&self) -> &ExecutionMetrics {
        &self.inner.metrics
    }
}
