//! Messages known only by their descriptor: proto3 JSON in and out, and a tonic codec for them. What lets `kforge
//! call` and the JSON face reach every method of the contract without per-method code.

use std::sync::LazyLock;

use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, MethodDescriptor, SerializeOptions};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The contract's descriptors: kforge.v1 and its imports.
pub fn contract() -> &'static DescriptorPool {
    static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
        DescriptorPool::decode(kforge_proto::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set is generated from the same protos at build time")
    });
    &POOL
}

/// The kforge.v1 method a request path (`/kforge.v1.Evaluator/Evaluate`) names.
pub fn method_at(path: &str) -> Option<MethodDescriptor> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    if !service.starts_with(kforge_proto::PACKAGE) {
        return None;
    }
    contract().get_service_by_name(service)?.methods().find(|m| m.name() == method)
}

/// Reads a message of type `descriptor` from proto3 JSON (lowerCamelCase or proto field names). An error names the
/// field it is about first, e.g. `spec.trajectoriesPerTask: invalid type: string "x", expected u32`.
pub fn from_json(descriptor: MessageDescriptor, value: &serde_json::Value) -> Result<DynamicMessage, String> {
    let mut track = serde_path_to_error::Track::new();
    DynamicMessage::deserialize(descriptor, serde_path_to_error::Deserializer::new(value, &mut track)).map_err(
        |error| {
            let path = track.path().to_string();
            if path.is_empty() || path == "." { error.to_string() } else { format!("{path}: {error}") }
        },
    )
}

/// A message as proto3 JSON: lowerCamelCase names, defaults omitted, 64-bit integers as strings.
pub fn to_json(message: &DynamicMessage) -> serde_json::Value {
    message
        .serialize_with_options(serde_json::value::Serializer, &SerializeOptions::new())
        .unwrap_or_else(|error| serde_json::Value::String(format!("unprintable message: {error}")))
}

/// Encodes any message and decodes responses of one type, known by descriptor.
#[derive(Debug, Clone)]
pub struct DynamicCodec {
    response: MessageDescriptor,
}

impl DynamicCodec {
    /// A codec whose responses are `response` messages.
    pub fn new(response: MessageDescriptor) -> Self {
        Self { response }
    }
}

impl Codec for DynamicCodec {
    type Encode = DynamicMessage;
    type Decode = DynamicMessage;
    type Encoder = DynamicEncoder;
    type Decoder = DynamicDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        DynamicEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        DynamicDecoder(self.response.clone())
    }
}

#[derive(Debug)]
pub struct DynamicEncoder;

impl Encoder for DynamicEncoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Self::Error> {
        item.encode(dst).map_err(|e| Status::internal(format!("encoding the request: {e}")))
    }
}

#[derive(Debug)]
pub struct DynamicDecoder(MessageDescriptor);

impl Decoder for DynamicDecoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Self::Error> {
        DynamicMessage::decode(self.0.clone(), src)
            .map(Some)
            .map_err(|e| Status::internal(format!("decoding the response: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_to_contract_methods_only() {
        let method = method_at("/kforge.v1.Evaluator/Evaluate").expect("resolves");
        assert_eq!(method.full_name(), "kforge.v1.Evaluator.Evaluate");
        for path in ["/kforge.v1.Evaluator/Nope", "/grpc.health.v1.Health/Check", "kforge.v1.Evaluator/Evaluate", "/"] {
            assert!(method_at(path).is_none(), "{path}");
        }
    }

    #[test]
    fn json_errors_name_the_field() {
        let input = method_at("/kforge.v1.Reward/ComputeReturns").expect("resolves").input();
        let error = from_json(input.clone(), &serde_json::json!({"gamma": "high"})).expect_err("wrong type");
        assert!(error.starts_with("gamma: "), "{error}");
        let error = from_json(input.clone(), &serde_json::json!({"trajectories": [{"values": ["x"]}]}))
            .expect_err("wrong element");
        assert!(error.starts_with("trajectories[0].values[0]: "), "{error}");
        let message = from_json(input, &serde_json::json!({"gamma": 0.5})).expect("parses");
        assert_eq!(to_json(&message), serde_json::json!({"gamma": 0.5}));
    }
}
