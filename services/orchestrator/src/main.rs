//! `kforge-orchestrator`: the Orchestrator service on its own; the same as `kforge serve orchestrator`.

fn main() -> std::process::ExitCode {
    kforge_server::binary::main(kforge_orchestrator::serve)
}
