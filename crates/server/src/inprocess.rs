//! [`InProcess`]: a gRPC channel to the services of the host it lives in, without a socket. The JSON face and the
//! protocol faces a service mounts beside its gRPC services call through it, so a call arriving as JSON meets the
//! same bearer check, message limits, deadline, metrics and handler as one arriving as gRPC.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::HeaderValue;
use tower::Service;

use crate::metrics::{Metrics, MetricsService};

/// A clonable channel into the host's gRPC routes (auth interceptors included); generated clients take it as
/// their transport (`EvaluatorClient::new(in_process)`).
#[derive(Clone, Debug)]
pub struct InProcess {
    routes: MetricsService<axum::Router>,
    /// The host's `request_timeout_secs`: the deadline of a call that names none, and the longest one.
    longest: Duration,
    /// Presented on every call (the `authorization` header of the HTTP request being served).
    authorization: Option<HeaderValue>,
}

impl InProcess {
    pub(crate) fn new(routes: axum::Router, metrics: Arc<Metrics>, longest: Duration) -> Self {
        Self { routes: MetricsService::new(routes, metrics), longest, authorization: None }
    }

    /// This channel, presenting `authorization` (an HTTP request's header, passed through as it came) on each
    /// call: the services check it as they check a gRPC caller's.
    pub fn authorized(&self, authorization: Option<HeaderValue>) -> Self {
        Self { authorization, ..self.clone() }
    }
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<http::Response<axum::body::Body>, Infallible>> + Send>>;

impl Service<http::Request<tonic::body::Body>> for InProcess {
    type Response = http::Response<axum::body::Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        if let Some(value) = &self.authorization {
            request.headers_mut().insert(http::header::AUTHORIZATION, value.clone());
        }
        let deadline = request
            .headers()
            .get("grpc-timeout")
            .and_then(|value| parse_grpc_timeout(value.as_bytes()))
            .map_or(self.longest, |asked| asked.min(self.longest));
        let call = self.routes.call(request.map(axum::body::Body::new));
        Box::pin(async move {
            match tokio::time::timeout(deadline, call).await {
                Ok(response) => response,
                Err(_) => {
                    let status = tonic::Status::deadline_exceeded(format!(
                        "the call's deadline of {} s passed",
                        deadline.as_secs_f64()
                    ));
                    Ok(status.into_http::<axum::body::Body>())
                }
            }
        })
    }
}

/// A `grpc-timeout` value (`250m`, `30S`: at most 8 digits and a unit) as a duration.
fn parse_grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let amount: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_by_unit_and_bad_ones_are_ignored() {
        assert_eq!(parse_grpc_timeout(b"250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout(b"2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout(b"7n"), Some(Duration::from_nanos(7)));
        for bad in [&b""[..], b"m", b"123456789S", b"12x", b"-1S", b"1.5S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{:?}", std::str::from_utf8(bad));
        }
    }
}
