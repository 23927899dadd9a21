//! `kforge-profiler`: the Profiler service on its own; the same as `kforge serve profiler`.

fn main() -> std::process::ExitCode {
    kforge_server::binary::main(kforge_profiler::serve)
}
