//! `kforge-reward`: the Reward service on its own; the same as `kforge serve reward`.

fn main() -> std::process::ExitCode {
    kforge_server::binary::main(kforge_reward::serve)
}
