//! The contract documents itself: every service, method, field, oneof and enum value of kforge.v1 carries a
//! comment in its `.proto` file (read from the descriptor set's source info, as protoc recorded it).

use prost_reflect::prost_types::{DescriptorProto, EnumDescriptorProto};

/// Source paths (field numbers of FileDescriptorProto / DescriptorProto / ...) of every element that must be
/// documented, with a readable name.
fn message_paths(message: &DescriptorProto, path: Vec<i32>, name: &str, out: &mut Vec<(Vec<i32>, String)>) {
    for (i, field) in message.field.iter().enumerate() {
        out.push((extend(&path, [2, i as i32]), format!("{name}.{}", field.name())));
    }
    for (i, oneof) in message.oneof_decl.iter().enumerate() {
        // A proto3 `optional` field gets a synthetic oneof that the source does not spell.
        let synthetic = message.field.iter().any(|f| f.oneof_index == Some(i as i32) && f.proto3_optional());
        if synthetic {
            continue;
        }
        out.push((extend(&path, [8, i as i32]), format!("{name}.{} (oneof)", oneof.name())));
    }
    for (i, nested) in message.nested_type.iter().enumerate() {
        // Map entries are synthesised by protoc and carry no comments.
        if !nested.options.as_ref().is_some_and(|o| o.map_entry()) {
            message_paths(nested, extend(&path, [3, i as i32]), &format!("{name}.{}", nested.name()), out);
        }
    }
    for (i, nested) in message.enum_type.iter().enumerate() {
        enum_paths(nested, extend(&path, [4, i as i32]), &format!("{name}.{}", nested.name()), out);
    }
}

fn enum_paths(enumeration: &EnumDescriptorProto, path: Vec<i32>, name: &str, out: &mut Vec<(Vec<i32>, String)>) {
    for (i, value) in enumeration.value.iter().enumerate() {
        out.push((extend(&path, [2, i as i32]), format!("{name}.{}", value.name())));
    }
}

fn extend(path: &[i32], more: [i32; 2]) -> Vec<i32> {
    path.iter().copied().chain(more).collect()
}

#[test]
fn every_element_of_the_contract_is_documented() {
    let mut undocumented = Vec::new();
    for file in kforge::call::descriptors().files().filter(|f| f.package_name() == kforge_proto::PACKAGE) {
        let proto = file.file_descriptor_proto();
        let info = proto.source_code_info.as_ref().expect("protoc recorded source info");
        let documented =
            |path: &[i32]| info.location.iter().any(|l| l.path == path && !l.leading_comments().trim().is_empty());
        let mut required = Vec::new();
        for (i, message) in proto.message_type.iter().enumerate() {
            message_paths(message, vec![4, i as i32], message.name(), &mut required);
        }
        for (i, enumeration) in proto.enum_type.iter().enumerate() {
            enum_paths(enumeration, vec![5, i as i32], enumeration.name(), &mut required);
        }
        for (i, service) in proto.service.iter().enumerate() {
            required.push((vec![6, i as i32], service.name().to_owned()));
            for (j, method) in service.method.iter().enumerate() {
                required.push((vec![6, i as i32, 2, j as i32], format!("{}.{}", service.name(), method.name())));
            }
        }
        undocumented.extend(
            required
                .into_iter()
                .filter(|(path, _)| !documented(path))
                .map(|(_, name)| format!("{}: {name}", proto.name())),
        );
    }
    assert!(undocumented.is_empty(), "{} undocumented elements:\n{}", undocumented.len(), undocumented.join("\n"));
}
