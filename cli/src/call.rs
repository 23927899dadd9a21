//! Calls any RPC of the kforge.v1 contract with proto3 JSON in and out, like grpcurl with the descriptors built in;
//! also the services every kforge server serves beside its own: `grpc.health.v1.Health` and
//! `grpc.reflection.v1.ServerReflection` (their descriptors are tonic-health's and tonic-reflection's).
//!
//! Requests are read as a sequence of JSON objects (one for unary and server-streaming methods, any number for
//! client-streaming ones); each response is printed as proto3 JSON. Messages are encoded and decoded dynamically
//! from the contract's descriptor set, so every method of every service is reachable without per-method code.

use std::str::FromStr;
use std::sync::LazyLock;

use kforge_server::dynamic::{self, DynamicCodec};
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MethodDescriptor, SerializeOptions};
use tokio_stream::StreamExt;
use tonic::{Request, Status};

use crate::mesh::Service;

/// Largest request `kforge call` sends; servers apply their own, usually smaller, limit.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

/// What went wrong before or after the RPC itself.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("`{0}` is not Service/Method (e.g. Reward/ComputeReturns)")]
    Syntax(String),
    #[error("unknown service `{service}` (services: {known})")]
    UnknownService { service: String, known: String },
    #[error("unknown method `{method}` of {service} (methods: {known})")]
    UnknownMethod { service: String, method: String, known: String },
    #[error("request {index}: {message}")]
    Json { index: usize, message: String },
    #[error("{method} takes exactly one request, got {got}")]
    RequestCount { method: String, got: usize },
    #[error("request {index} is {size} bytes, over the {limit}-byte limit")]
    TooLarge { index: usize, size: usize, limit: usize },
    #[error("{code}: {message}")]
    Rpc { code: String, message: String },
    #[error("cannot print the response: {0}")]
    Output(String),
}

impl From<Status> for CallError {
    fn from(status: Status) -> Self {
        Self::Rpc { code: code_name(status.code()), message: status.message().to_owned() }
    }
}

pub use kforge_server::code_name;

/// The packages of the services a kforge server serves beside its own: `kforge call` reaches them too.
pub const SERVER_PACKAGES: [&str; 2] = ["grpc.health.v1", "grpc.reflection.v1"];

/// The contract's descriptors (kforge.v1 and its imports), and those of the health and reflection services.
pub fn descriptors() -> &'static DescriptorPool {
    static POOL: LazyLock<DescriptorPool> = LazyLock::new(|| {
        let mut pool = DescriptorPool::decode(kforge_proto::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set is generated from the same protos at build time");
        for set in [tonic_health::pb::FILE_DESCRIPTOR_SET, tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET] {
            pool.decode_file_descriptor_set(set).expect("tonic's descriptor sets are generated and import nothing");
        }
        pool
    });
    &POOL
}

/// Resolves `Service/Method`: the service by its short (`Reward`, `Health`) or full (`kforge.v1.Reward`,
/// `grpc.health.v1.Health`) name.
pub fn resolve(target: &str) -> Result<MethodDescriptor, CallError> {
    let (service, method) =
        target.trim_start_matches('/').split_once('/').ok_or_else(|| CallError::Syntax(target.into()))?;
    if service.is_empty() || method.is_empty() || method.contains('/') {
        return Err(CallError::Syntax(target.into()));
    }
    let pool = descriptors();
    let callable = || {
        pool.services()
            .filter(|s| s.package_name() == kforge_proto::PACKAGE || SERVER_PACKAGES.contains(&s.package_name()))
    };
    let descriptor = callable().find(|s| s.full_name() == service || s.name() == service).ok_or_else(|| {
        CallError::UnknownService {
            service: service.into(),
            known: callable().map(|s| s.name().to_owned()).collect::<Vec<_>>().join(", "),
        }
    })?;
    let found = descriptor.methods().find(|m| m.name() == method);
    found.ok_or_else(|| CallError::UnknownMethod {
        service: descriptor.name().into(),
        method: method.into(),
        known: descriptor.methods().map(|m| m.name().to_owned()).collect::<Vec<_>>().join(", "),
    })
}

/// The service to start in this process to answer `method` (`kforge call` without `--addr`): the method's own; for
/// health and reflection, which every server serves, the server of the service a health check names
/// (`{"service": "kforge.v1.Evaluator"}`), else the reward service's (it starts without peers or Python).
pub fn in_process_service(method: &MethodDescriptor, requests: &[DynamicMessage]) -> Service {
    if let Some(own) = Service::from_proto_name(method.parent_service().full_name()) {
        return own;
    }
    let named = requests.first().and_then(|request| {
        let value = request.get_field_by_name("service")?;
        value.as_str().and_then(Service::from_proto_name)
    });
    named.unwrap_or(Service::Reward)
}

/// Parses the requests for `method` from `input`: a sequence of JSON objects. Empty input means one empty request
/// for a method that takes one, and no requests for a client-streaming method.
pub fn parse_requests(method: &MethodDescriptor, input: &str) -> Result<Vec<DynamicMessage>, CallError> {
    let descriptor = method.input();
    let mut requests = Vec::new();
    for value in serde_json::Deserializer::from_str(input).into_iter::<serde_json::Value>() {
        let index = requests.len();
        let value = value.map_err(|e| CallError::Json { index, message: format!("malformed json: {e}") })?;
        let message =
            dynamic::from_json(descriptor.clone(), &value).map_err(|message| CallError::Json { index, message })?;
        let size = message.encoded_len();
        if size > MAX_REQUEST_BYTES {
            return Err(CallError::TooLarge { index, size, limit: MAX_REQUEST_BYTES });
        }
        requests.push(message);
    }
    if !method.is_client_streaming() {
        match requests.len() {
            0 => requests.push(DynamicMessage::new(descriptor)),
            1 => {}
            got => return Err(CallError::RequestCount { method: method.full_name().into(), got }),
        }
    }
    Ok(requests)
}

/// Calls `method` on `channel` with `requests` and returns every response; `deadline` goes to the server as the
/// call's `grpc-timeout`.
pub async fn invoke(
    channel: kforge_server::client::Channel,
    method: &MethodDescriptor,
    requests: Vec<DynamicMessage>,
    deadline: Option<std::time::Duration>,
) -> Result<Vec<DynamicMessage>, CallError> {
    let path =
        http::uri::PathAndQuery::from_str(&format!("/{}/{}", method.parent_service().full_name(), method.name()))
            .map_err(|e| CallError::Syntax(e.to_string()))?;
    let codec = DynamicCodec::new(method.output());
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_encoding_message_size(MAX_REQUEST_BYTES)
        .max_decoding_message_size(usize::MAX);
    grpc.ready().await.map_err(|e| Status::unavailable(format!("service not ready: {e}")))?;
    let mut first = requests.into_iter();
    let outcome = async move {
        match (method.is_client_streaming(), method.is_server_streaming()) {
            (false, false) => {
                let request = first.next().expect("parse_requests yields exactly one request for unary methods");
                Ok(vec![grpc.unary(with_deadline(request, deadline), path, codec).await?.into_inner()])
            }
            (false, true) => {
                let request =
                    first.next().expect("parse_requests yields exactly one request for server-streaming methods");
                collect(grpc.server_streaming(with_deadline(request, deadline), path, codec).await?.into_inner()).await
            }
            (true, false) => {
                let stream = tokio_stream::iter(first);
                Ok(vec![grpc.client_streaming(with_deadline(stream, deadline), path, codec).await?.into_inner()])
            }
            (true, true) => {
                let stream = tokio_stream::iter(first);
                collect(grpc.streaming(with_deadline(stream, deadline), path, codec).await?.into_inner()).await
            }
        }
    }
    .await;
    // A deadline that passes on the client's side comes back from tonic as CANCELLED; the call's status is
    // DEADLINE_EXCEEDED (the server stopped the work at the same deadline).
    outcome.map_err(|error| match (deadline, error) {
        (Some(deadline), CallError::Rpc { code, message }) if code == "CANCELLED" && message == "Timeout expired" => {
            CallError::Rpc {
                code: "DEADLINE_EXCEEDED".into(),
                message: format!("the call's deadline of {} s passed", deadline.as_secs_f64()),
            }
        }
        (_, error) => error,
    })
}

fn with_deadline<T>(message: T, deadline: Option<std::time::Duration>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(deadline) = deadline {
        request.set_timeout(deadline);
    }
    request
}

async fn collect(mut stream: tonic::Streaming<DynamicMessage>) -> Result<Vec<DynamicMessage>, CallError> {
    let mut responses = Vec::new();
    while let Some(message) = stream.next().await {
        responses.push(message?);
    }
    Ok(responses)
}

/// A response as proto3 JSON (lowerCamelCase names, defaults omitted, 64-bit integers as strings).
pub fn to_json(message: &DynamicMessage) -> Result<String, CallError> {
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::pretty(&mut out);
    message
        .serialize_with_options(&mut serializer, &SerializeOptions::new())
        .map_err(|e| CallError::Output(e.to_string()))?;
    String::from_utf8(out).map_err(|e| CallError::Output(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_of_every_service_resolves() {
        let mut count = 0;
        for service in descriptors().services().filter(|s| s.package_name() == kforge_proto::PACKAGE) {
            for method in service.methods() {
                let found = resolve(&format!("{}/{}", service.name(), method.name())).expect("resolves");
                assert_eq!(found.full_name(), method.full_name());
                count += 1;
            }
        }
        assert_eq!(count, 3 + 5 + 5 + 4 + 12, "Evaluator, Profiler, Reward, Gateway, Orchestrator");
    }

    #[test]
    fn the_health_and_reflection_services_resolve_by_short_and_full_name() {
        for target in ["grpc.health.v1.Health/Check", "Health/Check", "/grpc.health.v1.Health/Check"] {
            assert_eq!(resolve(target).expect(target).full_name(), "grpc.health.v1.Health.Check");
        }
        assert!(resolve("Health/Watch").expect("watch").is_server_streaming());
        let reflection = resolve("ServerReflection/ServerReflectionInfo").expect("reflection");
        assert_eq!(reflection.parent_service().full_name(), "grpc.reflection.v1.ServerReflection");
        let err = resolve("Health/Probe").expect_err("unknown method").to_string();
        assert!(err.contains("Check, Watch"), "{err}");
        let err = resolve("Nope/Check").expect_err("unknown service").to_string();
        assert!(err.contains("Health") && err.contains("ServerReflection"), "{err}");
    }

    #[test]
    fn a_health_check_in_process_starts_the_service_it_names() {
        let check = resolve("Health/Check").expect("resolves");
        let requests = parse_requests(&check, r#"{"service": "kforge.v1.Evaluator"}"#).expect("parses");
        assert_eq!(in_process_service(&check, &requests), Service::Evaluator);
        let overall = parse_requests(&check, "").expect("parses");
        assert_eq!(in_process_service(&check, &overall), Service::Reward);
        let own = resolve("Orchestrator/GetJob").expect("resolves");
        assert_eq!(in_process_service(&own, &[]), Service::Orchestrator);
    }

    #[test]
    fn bad_targets_name_the_problem() {
        assert!(matches!(resolve("Reward"), Err(CallError::Syntax(_))));
        let err = resolve("Rewards/ScoreKernels").expect_err("unknown service").to_string();
        assert!(err.contains("Rewards") && err.contains("Reward,"), "{err}");
        let err = resolve("Reward/Score").expect_err("unknown method").to_string();
        assert!(err.contains("`Score`") && err.contains("ScoreKernels"), "{err}");
        assert_eq!(resolve("kforge.v1.Reward/Diagnose").expect("full name").name(), "Diagnose");
    }

    #[test]
    fn json_errors_name_the_field_and_counts_are_checked() {
        let method = resolve("Reward/ComputeReturns").expect("resolves");
        let err = parse_requests(&method, r#"{"gamma": "high"}"#).expect_err("wrong type").to_string();
        assert!(err.contains("gamma"), "{err}");
        let err = parse_requests(&method, r#"{"gama": 1}"#).expect_err("unknown field").to_string();
        assert!(err.contains("gama"), "{err}");
        let err = parse_requests(&method, r#"{"gamma": 1"#).expect_err("malformed").to_string();
        assert!(err.contains("malformed json"), "{err}");
        let err = parse_requests(&method, "{} {}").expect_err("two requests").to_string();
        assert!(err.contains("exactly one"), "{err}");
        assert_eq!(parse_requests(&method, "").expect("empty is one empty request").len(), 1);
        let stream = resolve("Evaluator/EvaluateStream").expect("resolves");
        assert_eq!(parse_requests(&stream, "{} {} {}").expect("stream").len(), 3);
    }

    #[test]
    fn code_names_match_the_grpc_spelling() {
        assert_eq!(code_name(tonic::Code::InvalidArgument), "INVALID_ARGUMENT");
        assert_eq!(code_name(tonic::Code::Unimplemented), "UNIMPLEMENTED");
        assert_eq!(code_name(tonic::Code::Ok), "OK");
    }
}
