//! The JSON face: every unary method of the contract as proto3 JSON over HTTP, in the shape of the Connect
//! protocol's unary calls (`POST /kforge.v1.Evaluator/Evaluate`, `Content-Type: application/json`, the request
//! message as the body; `Connect-Timeout-Ms` as the deadline), so `curl` and any Connect client reach kforge without
//! gRPC. The call goes through [`InProcess`] to the same handler, bearer check, limits and metrics as gRPC.
//!
//! Errors are JSON too, [`JsonError`]: `{"code": "invalid_argument", "message": "...", "field": "spec.turns"}` with
//! the HTTP status the Connect protocol gives each code, and `Retry-After` where the server asks for a wait. The
//! protocol faces (KernelGym, OpenEnv, ...) answer their bad requests with the same body.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use prost_reflect::MethodDescriptor;
use tonic::Code;

use crate::dynamic::{self, DynamicCodec};
use crate::inprocess::InProcess;

/// What the JSON face needs: the channel into the host's services and the largest body it reads.
#[derive(Clone, Debug)]
pub(crate) struct JsonFace {
    pub(crate) channel: InProcess,
    pub(crate) max_body_bytes: usize,
}

/// Middleware in front of the gRPC routes: a JSON request to a contract method is answered here; everything else
/// (gRPC, `/metrics`) passes on.
pub(crate) async fn intercept(State(face): State<JsonFace>, request: Request, next: Next) -> Response {
    if !is_json(request.headers()) {
        return next.run(request).await;
    }
    answer(&face, request).await
}

/// Fallback of the HTTP port: JSON calls to contract methods, and a JSON 404 for any other path.
pub(crate) async fn fallback(face: JsonFace, request: Request) -> Response {
    answer(&face, request).await
}

fn is_json(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).is_some_and(|value| {
        let value = value.as_bytes();
        value.starts_with(b"application/json") || value.starts_with(b"application/connect+json")
    })
}

async fn answer(face: &JsonFace, request: Request) -> Response {
    let path = request.uri().path().to_owned();
    let Some(method) = dynamic::method_at(&path) else {
        return JsonError::new(Code::NotFound, format!("no route {path}"), None).into_response();
    };
    if request.method() != http::Method::POST {
        let error = JsonError::new(Code::InvalidArgument, format!("{path} takes POST"), None);
        return (StatusCode::METHOD_NOT_ALLOWED, error).into_response();
    }
    if method.is_client_streaming() || method.is_server_streaming() {
        let message = format!("{path} streams: it is served over gRPC only (the Python client, `kforge call`)");
        return JsonError::new(Code::Unimplemented, message, None).into_response();
    }
    match call(face, method, request).await {
        Ok(json) => (StatusCode::OK, axum::Json(json)).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn call(face: &JsonFace, method: MethodDescriptor, request: Request) -> Result<serde_json::Value, JsonError> {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, face.max_body_bytes).await.map_err(|_| {
        let message = format!("the request body is over the limit of {} bytes", face.max_body_bytes);
        JsonError::new(Code::ResourceExhausted, message, None).with_status(StatusCode::PAYLOAD_TOO_LARGE)
    })?;
    let value: serde_json::Value = if bytes.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Object(serde_json::Map::new())
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|error| JsonError::new(Code::InvalidArgument, format!("malformed json: {error}"), None))?
    };
    let message = dynamic::from_json(method.input(), &value).map_err(JsonError::invalid)?;
    let mut grpc = tonic::Request::new(message);
    if let Some(timeout) = parts.headers.get("connect-timeout-ms") {
        let millis = timeout.to_str().ok().and_then(|ms| ms.parse::<u64>().ok()).ok_or_else(|| {
            JsonError::new(Code::InvalidArgument, "connect-timeout-ms: not a whole number of milliseconds", None)
        })?;
        grpc.set_timeout(Duration::from_millis(millis));
    }
    kforge_telemetry::inject_context(grpc.metadata_mut());
    let channel = face.channel.authorized(parts.headers.get(header::AUTHORIZATION).cloned());
    let path = format!("/{}/{}", method.parent_service().full_name(), method.name())
        .parse()
        .map_err(|_| JsonError::new(Code::Internal, "unroutable method path", None))?;
    let mut client = tonic::client::Grpc::new(channel);
    client.ready().await.map_err(|error| JsonError::new(Code::Unavailable, error.to_string(), None))?;
    let response = client
        .unary(grpc, path, DynamicCodec::new(method.output()))
        .await
        .map_err(|status| JsonError::from_status(&status))?;
    Ok(dynamic::to_json(response.get_ref()))
}

/// An error answered as JSON: `{"code", "message", "field"}` (`field` where the message names one), with the
/// HTTP status of its code and `Retry-After` when the server asked the caller to wait.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonError {
    code: Code,
    status: StatusCode,
    message: String,
    field: Option<String>,
    retry_after: Option<Duration>,
}

impl JsonError {
    /// An error of `code`; `field` names the request field it is about.
    pub fn new(code: Code, message: impl Into<String>, field: Option<&str>) -> Self {
        Self {
            code,
            status: http_status(code),
            message: message.into(),
            field: field.map(str::to_owned),
            retry_after: None,
        }
    }

    /// INVALID_ARGUMENT from a message that names its field first (`tasks[0].source: empty`).
    pub fn invalid(message: String) -> Self {
        let field = field_of(&message).map(str::to_owned);
        Self { field, ..Self::new(Code::InvalidArgument, message, None) }
    }

    /// The JSON form of a gRPC status from a kforge service: its code, message, the field the message names first,
    /// and its `retry-after-ms` metadata.
    pub fn from_status(status: &tonic::Status) -> Self {
        let retry_after = status
            .metadata()
            .get("retry-after-ms")
            .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
            .map(Duration::from_millis);
        let field = field_of(status.message()).map(str::to_owned);
        Self { field, retry_after, ..Self::new(status.code(), status.message(), None) }
    }

    /// The same error answered with `status` instead of its code's.
    pub fn with_status(self, status: StatusCode) -> Self {
        Self { status, ..self }
    }

    pub fn code(&self) -> Code {
        self.code
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// The body: `{"code": "invalid_argument", "message": ..., "field": ...}`.
    pub fn body(&self) -> serde_json::Value {
        let mut body = serde_json::json!({"code": connect_code(self.code), "message": self.message});
        if let Some(field) = &self.field {
            body["field"] = field.as_str().into();
        }
        body
    }
}

impl IntoResponse for JsonError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(wait) = self.retry_after {
            let headers = response.headers_mut();
            // Retry-After counts whole seconds: rounded up, so a caller that honours it never comes back early.
            let seconds = wait.as_millis().div_ceil(1000).max(1);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds as u64));
            headers.insert("retry-after-ms", HeaderValue::from(wait.as_millis() as u64));
        }
        response
    }
}

/// The field a kforge message names first (`spec.tasks[2].source: ...`), if it does.
pub fn field_of(message: &str) -> Option<&str> {
    let (field, _) = message.split_once(": ")?;
    let valid = !field.is_empty()
        && field.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '[' | ']' | '-'))
        && field.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    valid.then_some(field)
}

/// The Connect protocol's name of a code: `invalid_argument`.
pub fn connect_code(code: Code) -> String {
    crate::code_name(code).to_ascii_lowercase()
}

/// The HTTP status the Connect protocol gives a code.
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_is_read_from_the_message_s_first_words() {
        assert_eq!(field_of("spec.tasks[2].source: empty"), Some("spec.tasks[2].source"));
        assert_eq!(
            field_of("groups[3].trajectories[1].values[0]: must be finite"),
            Some("groups[3].trajectories[1].values[0]")
        );
        assert_eq!(field_of("the episode is over"), None);
        assert_eq!(field_of("turn 3 is ahead: x"), None);
        assert_eq!(field_of(": nothing"), None);
    }

    #[test]
    fn errors_carry_the_connect_code_status_field_and_wait() {
        let mut status = tonic::Status::resource_exhausted("quotas.turns_per_hour: 10 used");
        status.metadata_mut().insert("retry-after-ms", "1500".parse().expect("ascii"));
        let error = JsonError::from_status(&status);
        assert_eq!(
            error.body(),
            serde_json::json!({
                "code": "resource_exhausted", "message": "quotas.turns_per_hour: 10 used", "field": "quotas.turns_per_hour"
            })
        );
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(response.headers()["retry-after-ms"], "1500");
        assert_eq!(http_status(Code::Unauthenticated), StatusCode::UNAUTHORIZED);
        assert_eq!(connect_code(Code::DeadlineExceeded), "deadline_exceeded");
    }
}
