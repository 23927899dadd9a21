//! `kforge-gateway`: the Gateway service on its own; the same as `kforge serve gateway`.

fn main() -> std::process::ExitCode {
    kforge_server::binary::main(kforge_gateway::serve)
}
