//! An in-process OTLP/gRPC trace collector for the trace tests, and kforge's exporter pointed at it.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;

/// The spans the collector received.
#[derive(Clone, Default)]
pub struct Collector {
    pub spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans = request.into_inner().resource_spans.into_iter().flat_map(|r| r.scope_spans).flat_map(|s| s.spans);
        self.spans.lock().expect("collector lock").extend(spans);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Collector {
    /// Serves a collector on `listener` (from [`point_exporter_here`]) until the returned task is aborted.
    pub fn serve(
        listener: std::net::TcpListener,
    ) -> (Self, tokio::task::JoinHandle<Result<(), tonic::transport::Error>>) {
        let collector = Self::default();
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
        (collector, tokio::spawn(server))
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().expect("collector lock").clone()
    }
}

/// Binds the collector's port and points the OTEL_* variables at it, before any runtime exists.
///
/// # Safety
/// No other thread may exist yet (a test binary of one test, before its runtime): nothing reads the environment
/// concurrently.
pub unsafe fn point_exporter_here() -> std::net::TcpListener {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("collector binds");
    let address = listener.local_addr().expect("collector address");
    // SAFETY: the caller's promise: this is the only thread.
    unsafe {
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{address}"));
        std::env::set_var("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc");
    }
    listener
}

/// Waits until the exporter has sent every span. force_flush blocks, and the runtime must keep running meanwhile:
/// it runs on a blocking thread.
pub async fn flush(telemetry: kforge_telemetry::TelemetryGuard) -> kforge_telemetry::TelemetryGuard {
    tokio::task::spawn_blocking(move || {
        assert!(telemetry.flush(), "spans exported");
        telemetry
    })
    .await
    .expect("flush thread")
}

/// A span's string (or integer, as text) attribute.
pub fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key == key).and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    })
}
