//! The kforge.v1 contract, generated from `proto/kforge/v1/*.proto`.
//!
//! Every service and client in kforge depends on this crate and on nothing else for wire types. Conversions to
//! domain types live at each service's boundary, not here.

#![allow(missing_debug_implementations, clippy::large_enum_variant, clippy::doc_lazy_continuation)]

/// Package `kforge.v1`.
pub mod v1 {
    tonic::include_proto!("kforge.v1");
}

/// The encoded `FileDescriptorSet` of every kforge.v1 file and its imports: served by reflection and used by
/// `kforge call` to translate proto3 JSON.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kforge_descriptor");

/// The proto package of this contract version.
pub const PACKAGE: &str = "kforge.v1";

/// The request paths (`/kforge.v1.Evaluator/Evaluate`) of every method of the service named `service`
/// (`kforge.v1.Evaluator`), read from [`FILE_DESCRIPTOR_SET`]; none for a service this contract does not define.
pub fn method_paths(service: &str) -> Vec<String> {
    use prost::Message;
    // The set is generated from this crate's own files at build time: it always decodes.
    let Ok(set) = prost_types::FileDescriptorSet::decode(FILE_DESCRIPTOR_SET) else { return Vec::new() };
    set.file
        .iter()
        .flat_map(|file| file.service.iter().map(move |s| (file.package(), s)))
        .filter(|(package, s)| format!("{package}.{}", s.name()) == service)
        .flat_map(|(_, s)| s.method.iter().map(|m| format!("/{service}/{}", m.name())))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_services_method_paths_come_from_the_descriptor_set() {
        let paths = super::method_paths("kforge.v1.Evaluator");
        assert!(paths.contains(&"/kforge.v1.Evaluator/Evaluate".to_owned()), "{paths:?}");
        assert!(super::method_paths("grpc.health.v1.Health").is_empty());
    }
}
