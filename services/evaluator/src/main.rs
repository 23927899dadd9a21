//! `kforge-evaluator`: the Evaluator service on its own; the same as `kforge serve evaluator`.

fn main() -> std::process::ExitCode {
    kforge_server::binary::main(kforge_evaluator::serve)
}
