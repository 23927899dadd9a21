//! Telemetry for every kforge process, set up once by [`init`].
//!
//! - Logs: `tracing` to stderr, filtered by `RUST_LOG` (default chosen by the caller).
//! - Traces: exported over OTLP/gRPC when the standard variables ask for it (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, unless `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`); the
//!   exporter reads the rest of its configuration (headers, timeout, compression) from the same variables.
//! - Propagation: W3C `traceparent`/`tracestate` in gRPC metadata. Servers continue the caller's trace with
//!   [`server_span`]; clients inject the current span's context with [`inject_context`]. Both are wired into the
//!   shared server and client plumbing (`kforge-server`), so every hop carries the trace.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Why telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// `RUST_LOG` did not parse.
    #[error("invalid RUST_LOG filter: {0}")]
    Filter(#[from] tracing_subscriber::filter::ParseError),
    /// The OTLP exporter could not be built from the OTEL_* variables.
    #[error("otlp exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// A global subscriber was already installed in this process.
    #[error("telemetry already initialised: {0}")]
    AlreadyInitialised(#[from] tracing_subscriber::util::TryInitError),
}

/// Flushes and shuts down trace export when dropped; hold it for the life of the process.
#[derive(Debug)]
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Exports every finished span now. Returns false when export is off or failed.
    pub fn flush(&self) -> bool {
        self.provider.as_ref().is_some_and(|p| p.force_flush().is_ok())
    }

    /// Whether spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Shutdown flushes; a collector that is gone must not hold the process hostage.
            let _ = provider.shutdown_with_timeout(Duration::from_secs(5));
        }
    }
}

/// Whether the standard OTEL_* variables ask for trace export.
pub fn otlp_requested() -> bool {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return false;
    }
    if var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none")) {
        return false;
    }
    var("OTEL_EXPORTER_OTLP_ENDPOINT").is_some() || var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
}

/// Sets up logging, trace export and propagation for this process. Call once, inside the Tokio runtime (the OTLP
/// exporter's gRPC channel is driven by it). `service_name` becomes the OTLP resource's `service.name` unless
/// `OTEL_SERVICE_NAME` is set; `default_filter` applies when `RUST_LOG` is unset (`info` for servers, `warn` for
/// commands whose stdout is the product).
pub fn init(service_name: &str, default_filter: &str) -> Result<TelemetryGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => EnvFilter::try_new(spec)?,
        _ => EnvFilter::try_new(default_filter)?,
    };
    // Colour only on a terminal: log collectors store escape codes verbatim.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false).with_ansi(ansi);

    if !otlp_requested() {
        tracing_subscriber::registry().with(filter).with(fmt).try_init()?;
        return Ok(TelemetryGuard { provider: None });
    }

    let exporter = opentelemetry_otlp::SpanExporter::builder().with_tonic().build()?;
    let service_name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service_name.to_owned());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service_name).build())
        .build();
    let tracer = provider.tracer("kforge");
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init()?;
    opentelemetry::global::set_tracer_provider(provider.clone());
    Ok(TelemetryGuard { provider: Some(provider) })
}

/// The span a server opens for one incoming gRPC request: named after the method, continuing the caller's trace
/// when the request carries a `traceparent`. `service` is the kforge service serving it.
pub fn server_span(service: &'static str, request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path();
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = %path.trim_start_matches('/'),
        otel.kind = "server",
        rpc.system = "grpc",
        kforge.service = service,
    );
    let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(request.headers())));
    // Fails only when the span is disabled by the filter, in which case there is nothing to parent.
    let _ = span.set_parent(parent);
    span
}

/// Writes the current span's trace context into outgoing gRPC metadata.
pub fn inject_context(metadata: &mut tonic::metadata::MetadataMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&context, &mut MetadataInjector(metadata)));
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        let key = tonic::metadata::MetadataKey::from_bytes(key.as_bytes());
        let value = tonic::metadata::MetadataValue::try_from(value);
        if let (Ok(key), Ok(value)) = (key, value) {
            self.0.insert(key, value);
        }
    }
}
