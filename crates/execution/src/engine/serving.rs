//! What the services serve from the engine: a place in the admission queue, readiness, the GPUs' time accounts,
//! and what the engine can run ([`Capabilities`], which each service gives its wire form).

use std::collections::BTreeMap;

use kforge_sandbox::Protection;
use kforge_static_checks::Policy;
use tokio::sync::{OwnedSemaphorePermit, watch};

use super::{Backend, Engine, RequestError};
use crate::devices;

/// What an engine can run.
#[derive(Debug, Clone, PartialEq)]
pub struct Capabilities {
    pub backends: Vec<Backend>,
    /// `cpu`, then each GPU as `cuda:<i> <name> (sm <capability>)`, a quarantined one saying why.
    pub devices: Vec<String>,
    /// The policies' identifiers (`permissive@3`).
    pub policies: Vec<String>,
    /// The sandbox's protections on this host, and the device health probe's.
    pub sandbox: Vec<Protection>,
    /// python, torch, cuda, triton versions.
    pub versions: BTreeMap<String, String>,
    pub queue_capacity: usize,
    /// The interpreter, or why there is none usable.
    pub python: String,
    pub disk_budget_bytes: u64,
    /// The memory budget for candidates' outputs files; 0 where they go to the disk.
    pub memory_files_bytes: u64,
}

impl Engine {
    /// A place in the admission queue (`queue_capacity` runs at once, evaluations and profiles together), or
    /// [`RequestError::QueueFull`].
    pub fn admit(&self) -> Result<OwnedSemaphorePermit, RequestError> {
        self.inner
            .admission
            .clone()
            .try_acquire_owned()
            .map_err(|_| RequestError::QueueFull { capacity: self.inner.config.queue_capacity, retry_after_secs: 30 })
    }

    /// What this engine can run: backends, devices (quarantined ones say why), policies, sandbox protections,
    /// versions and the queue's capacity.
    pub fn capabilities(&self) -> Capabilities {
        let inner = &self.inner;
        let (backends, devices, versions) = match &inner.python {
            Ok(env) => {
                let mut backends = vec![Backend::Cpu];
                if !env.gpus.is_empty() {
                    backends.push(Backend::Cuda);
                    if env.versions.contains_key("triton") {
                        backends.push(Backend::Triton);
                    }
                }
                let mut devices = vec!["cpu".to_owned()];
                devices.extend(env.gpus.iter().enumerate().map(|(i, g)| {
                    let device = format!("cuda:{i} {} (sm {})", g.name, g.capability);
                    match inner.lanes.quarantine_reason(i) {
                        Some(reason) => format!("{device} quarantined: {reason}"),
                        None => device,
                    }
                }));
                (backends, devices, env.versions.clone())
            }
            Err(_) => (vec![], vec![], BTreeMap::new()),
        };
        let mut sandbox = inner.sandbox.protections().to_vec();
        sandbox.push(self.probe_protection());
        Capabilities {
            backends,
            devices,
            policies: Policy::ALL.iter().map(Policy::id).collect(),
            sandbox,
            versions,
            queue_capacity: inner.config.queue_capacity,
            python: match &inner.python {
                Ok(env) => env.python.display().to_string(),
                Err(reason) => reason.to_string(),
            },
            disk_budget_bytes: inner.disk.capacity(),
            memory_files_bytes: inner.memory_files.as_ref().map_or(0, |files| files.budget().capacity()),
        }
    }

    /// The device health probe as a protection: active where there is a GPU and a probe to launch after a fault.
    fn probe_protection(&self) -> Protection {
        let inner = &self.inner;
        let has_gpu = inner.python.as_ref().is_ok_and(|env| !env.gpus.is_empty());
        let (active, detail) = match (has_gpu, inner.lanes.probe_program()) {
            (false, _) => (false, "no GPU to probe".to_owned()),
            (true, Ok(program)) => {
                (true, format!("{} after each device fault; a failing GPU is quarantined", program.display()))
            }
            (true, Err(reason)) => (false, reason.to_string()),
        };
        Protection { name: "device_health_probe", active, detail }
    }

    /// False while every GPU is quarantined: the services' readiness.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.inner.lanes.readiness()
    }

    /// Where each GPU's time went since this engine started: alone, draining, shared, empty.
    pub fn gpu_accounts(&self) -> Vec<devices::GateAccount> {
        self.inner.lanes.gpu_accounts()
    }
}
