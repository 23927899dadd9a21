//! Generates the kforge.v1 code with a vendored `protoc`, so a fresh machine needs no system protobuf compiler.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "kforge/v1/common.proto",
    "kforge/v1/evaluator.proto",
    "kforge/v1/profiler.proto",
    "kforge/v1/reward.proto",
    "kforge/v1/gateway.proto",
    "kforge/v1/orchestrator.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // prost-build finds protoc through `PROTOC`. SAFETY: a build script has no other threads reading the environment.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("PROTOC", protoc);
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let well_known_types = protoc_bin_vendored::include_path()?.display().to_string();
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("kforge_descriptor.bin"))
        .compile_protos(PROTOS, &[".", well_known_types.as_str()])?;
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
