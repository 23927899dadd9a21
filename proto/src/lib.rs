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
