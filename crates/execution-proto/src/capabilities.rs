//! What the engine can run, as the evaluator's `GetCapabilities` answers it.

use kforge_execution::engine::{Backend, Capabilities};
use kforge_proto::v1 as pb;

/// The engine's capabilities, every field of them.
pub fn capabilities(capabilities: Capabilities) -> pb::GetCapabilitiesResponse {
    let Capabilities {
        backends,
        devices,
        policies,
        sandbox,
        versions,
        queue_capacity,
        python,
        disk_budget_bytes,
        memory_files_bytes,
    } = capabilities;
    pb::GetCapabilitiesResponse {
        backends: backends.into_iter().map(|b| backend(b).into()).collect(),
        devices,
        policies,
        sandbox: sandbox
            .into_iter()
            .map(|p| pb::SandboxProtection { name: p.name.into(), active: p.active, detail: p.detail })
            .collect(),
        versions: versions.into_iter().collect(),
        queue_capacity: queue_capacity as u32,
        python,
        disk_budget_bytes,
        memory_files_bytes,
    }
}

/// A backend the engine resolved or offers.
pub fn backend(backend: Backend) -> pb::Backend {
    match backend {
        Backend::Cpu => pb::Backend::Cpu,
        Backend::Cuda => pb::Backend::Cuda,
        Backend::Triton => pb::Backend::Triton,
    }
}
