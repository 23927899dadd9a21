//! Per-method request metrics recorded by a tower layer around every server, exposed at `/metrics`.
//!
//! Every method of the kforge services a host serves has its series from the start, at 0: a request count for each
//! status code and a latency histogram. Prometheus's `rate` counts increases between scrapes, so a series created
//! by its first call would hide that call from the dashboards. Health and reflection calls are counted from their
//! first.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

/// gRPC request counters and latency histograms, by method and status code.
#[derive(Clone, Debug)]
pub struct Metrics {
    requests: Family<RpcLabels, Counter>,
    latency: Family<MethodLabels, Histogram>,
}

impl Metrics {
    /// Creates the metrics and registers them (prefix `kforge_grpc_`), with the series of every method of the
    /// kforge services named in `services` (`kforge.v1.Evaluator`) at 0: 17 codes and a histogram per method.
    pub fn register(registry: &mut Registry, services: &[&str]) -> Self {
        let requests = Family::<RpcLabels, Counter>::default();
        let latency = Family::<MethodLabels, Histogram>::new_with_constructor(|| {
            // 1 ms to ~65 s: covers a reward batch and a cold evaluation.
            Histogram::new(exponential_buckets(0.001, 2.0, 17))
        });
        let grpc = registry.sub_registry_with_prefix("kforge_grpc");
        grpc.register("requests", "grpc requests by method and status code", requests.clone());
        grpc.register("latency_seconds", "time to response headers by method", latency.clone());
        for method in services.iter().flat_map(|service| kforge_proto::method_paths(service)) {
            for code in (0..=16).map(tonic::Code::from) {
                let _ = requests.get_or_create(&RpcLabels { method: method.clone(), code: code_label(code) });
            }
            let _ = latency.get_or_create(&MethodLabels { method });
        }
        Self { requests, latency }
    }

    fn record(&self, method: &str, code: &str, seconds: f64) {
        self.requests.get_or_create(&RpcLabels { method: method.to_owned(), code: code.to_owned() }).inc();
        self.latency.get_or_create(&MethodLabels { method: method.to_owned() }).observe(seconds);
    }
}

/// The `code` label of a status code: its Rust name (`Ok`, `InvalidArgument`).
fn code_label(code: tonic::Code) -> String {
    format!("{code:?}")
}

/// Renders a registry in the OpenMetrics text format.
pub(crate) fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Encoding into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// Records each gRPC request's method, code and latency. The code is read from the response headers, where
/// tonic puts it for every error a handler returns (a "trailers-only" response); absent, the call succeeded or
/// failed mid-stream, and it counts as OK.
#[derive(Clone, Debug)]
pub(crate) struct MetricsLayer(pub(crate) Arc<Metrics>);

impl<S> tower::Layer<S> for MetricsLayer {
    type Service = MetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        MetricsService { inner, metrics: self.0.clone() }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct MetricsService<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> MetricsService<S> {
    pub(crate) fn new(inner: S, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }
}

impl<S, B, RB> tower::Service<http::Request<B>> for MetricsService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
    S::Error: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.uri().path().to_owned();
        let is_grpc = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let start = Instant::now();
        let response = self.inner.call(request);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let result = response.await;
            if is_grpc {
                let code = match &result {
                    Ok(response) => response
                        .headers()
                        .get("grpc-status")
                        .map(|v| code_label(tonic::Code::from_bytes(v.as_bytes())))
                        .unwrap_or_else(|| code_label(tonic::Code::Ok)),
                    Err(_) => "TransportError".to_owned(),
                };
                metrics.record(&method, &code, start.elapsed().as_secs_f64());
            }
            result
        })
    }
}
