//! [`Host`]: the gRPC server every kforge service runs inside.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt as _};
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::auth::{AuthError, RequireBearer, Token, resolve_callers};
use crate::config::{ServerConfig, TlsConfig};
use crate::inprocess::InProcess;
use crate::json::{self, JsonError, JsonFace};
use crate::metrics::{Metrics, MetricsLayer, render};

/// Why a server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("tls file {path}: {source}")]
    TlsFile { path: std::path::PathBuf, source: std::io::Error },
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("listener: {0}")]
    Listener(#[from] std::io::Error),
    #[error("server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// A service could not be built from its configuration.
    #[error("{service}: {message}")]
    Setup { service: &'static str, message: String },
}

/// One gRPC server: register services with [`Host::add_service`], then [`Host::serve`].
///
/// What every host provides, in the order a request meets it:
/// 1. the TLS handshake, when configured;
/// 2. the request span (`trace_fn`), continuing the caller's W3C trace;
/// 3. [`MetricsLayer`], so that rejected calls are counted too;
/// 4. deadline: the caller's `grpc-timeout`, capped by `request_timeout_secs` (tonic's built-in timeout layer);
/// 5. per-connection concurrency limit;
/// 6. routing: `/metrics` (plain HTTP), grpc.health.v1 (no auth: kubelet probes carry no credentials), and the
///    services plus reflection behind the bearer-token interceptor (which names the caller of a named token in the
///    request's extensions, for the service's own checks);
/// 7. each service's message size limit, set by the service on its generated server.
///
/// A JSON request (`Content-Type: application/json`) to a unary method is answered by the JSON face
/// ([`crate::json`]) through an [`InProcess`] channel into step 6. A service may also serve HTTP routes of its own
/// on a second, plain-HTTP port ([`Host::serve_http`]): they sit behind the same bearer check and call the
/// services through the same channel.
pub struct Host {
    service: &'static str,
    config: ServerConfig,
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    registry: Registry,
    auth: RequireBearer,
    health: HealthReporter,
    health_service: tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService>,
    readiness: Option<watch::Receiver<bool>>,
    http: Option<(TcpListener, HttpRoutes)>,
}

/// Builds a service's HTTP routes, given the channel into its gRPC services.
type HttpRoutes = Box<dyn FnOnce(InProcess) -> axum::Router + Send>;

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("service", &self.service)
            .field("names", &self.names)
            .field("http", &self.http.as_ref().map(|(listener, _)| listener.local_addr().ok()))
            .finish_non_exhaustive()
    }
}

impl Host {
    /// A host for `service` (the name on its logs, spans and metrics), configured by `config`.
    pub fn new(service: &'static str, config: &ServerConfig) -> Result<Self, ServeError> {
        let token = Token::resolve(&config.auth)?;
        let callers = resolve_callers(&config.callers, token.as_ref())?;
        let auth = RequireBearer::with_callers(token, callers);
        if !auth.is_on() && !config.listen.ip().is_loopback() {
            tracing::warn!(service, listen = %config.listen, "auth is off on a non-loopback address");
        }
        let health = HealthReporter::new();
        let health_service = tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(health.clone()),
        );
        let registry = Registry::with_labels([("service".into(), service.into())].into_iter());
        Ok(Self {
            service,
            config: config.clone(),
            routes: RoutesBuilder::default(),
            names: Vec::new(),
            registry,
            auth,
            health,
            health_service,
            readiness: None,
            http: None,
        })
    }

    /// Adds a generated service behind the bearer-token check; its health entry is NOT_SERVING until serving.
    pub fn add_service<S>(&mut self, service: S) -> &mut Self
    where
        S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(InterceptedService::new(service, self.auth.clone()));
        self
    }

    /// The registry served at `/metrics`, for the service's own metrics.
    pub fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Makes readiness follow `ready` while serving: NOT_SERVING whenever it is false (a quarantined device).
    pub fn follow_readiness(&mut self, ready: watch::Receiver<bool>) -> &mut Self {
        self.readiness = Some(ready);
        self
    }

    /// Serves `routes` (built from a channel into this host's services) on `listener` too: plain HTTP/1.1 with
    /// upgrades (WebSocket), behind the same bearer check (`401` with a JSON body), with the JSON face at every
    /// other path. It drains with the gRPC server.
    pub fn serve_http(
        &mut self,
        listener: TcpListener,
        routes: impl FnOnce(InProcess) -> axum::Router + Send + 'static,
    ) -> &mut Self {
        self.http = Some((listener, Box::new(routes)));
        self
    }

    /// The largest message a service should accept (apply with `max_decoding_message_size`).
    pub fn max_message_bytes(&self) -> usize {
        self.config.max_message_bytes
    }

    /// Serves on `listener` until `shutdown` completes, then drains: health goes NOT_SERVING, the listener stops
    /// accepting, and in-flight calls get `drain_timeout_secs` to finish before they are dropped.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let Host { service, config, mut routes, names, mut registry, auth, health, health_service, readiness, http } =
            self;
        set_status(&health, &names, ServingStatus::NotServing).await;
        add_reflection(&mut routes, &auth)?;
        routes.add_service(health_service);
        let metrics = Arc::new(Metrics::register(&mut registry, &names));
        let grpc = routes.routes().into_axum_router();
        let channel = InProcess::new(grpc.clone(), metrics.clone(), Duration::from_secs(config.request_timeout_secs));
        let face = JsonFace { channel: channel.clone(), max_body_bytes: config.max_message_bytes };
        let router = with_json_face_and_metrics(grpc, face.clone(), registry);
        let router = server(service, &config)?.layer(MetricsLayer(metrics)).add_routes(Routes::from(router));

        let local = listener.local_addr()?;
        let (stop_grpc, grpc_stopped) = tokio::sync::oneshot::channel::<()>();
        let grpc = tokio::spawn(router.serve_with_incoming_shutdown(without_nagle(listener), async {
            let _ = grpc_stopped.await;
        }));
        tracing::info!(service, addr = %local, "serving");
        let (stop_http, http_stopped) = watch::channel(false);
        let http = match http {
            Some((listener, routes)) => Some(serve_http(service, listener, routes(channel), face, auth, http_stopped)?),
            None => None,
        };
        let mut servers = Servers { service, grpc, stop_grpc, http, stop_http };

        tokio::select! {
            result = servers.ended() => return result,
            () = shutdown => {}
            () = follow(&health, &names, readiness) => {}
        }
        tracing::info!(service, "draining");
        set_status(&health, &names, ServingStatus::NotServing).await;
        servers.drain(Duration::from_secs(config.drain_timeout_secs)).await
    }
}

/// Adds gRPC reflection (v1 and v1alpha, both behind the bearer check) over kforge's and health's protos.
fn add_reflection(routes: &mut RoutesBuilder, auth: &RequireBearer) -> Result<(), ServeError> {
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kforge_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    routes.add_service(InterceptedService::new(reflection().build_v1()?, auth.clone()));
    routes.add_service(InterceptedService::new(reflection().build_v1alpha()?, auth.clone()));
    Ok(())
}

/// The gRPC routes with the JSON face in front of them and `/metrics` (`registry` rendered) beside them.
fn with_json_face_and_metrics(grpc: axum::Router, face: JsonFace, registry: Registry) -> axum::Router {
    let registry = Arc::new(registry);
    grpc.layer(axum::middleware::from_fn_with_state(face, json::intercept)).route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move { render(&registry) }
        }),
    )
}

/// The server's own layers, as [`Host`] lists them: TLS, the request span, the deadline, the concurrency limit.
fn server(service: &'static str, config: &ServerConfig) -> Result<Server, ServeError> {
    let mut builder = Server::builder()
        // HTTP/1.1 for `/metrics` scrapes; gRPC itself is HTTP/2.
        .accept_http1(true)
        .timeout(Duration::from_secs(config.request_timeout_secs))
        .concurrency_limit_per_connection(config.concurrency_per_connection)
        .trace_fn(move |request| kforge_telemetry::server_span(service, request));
    if let Some(tls) = &config.tls {
        builder = builder.tls_config(server_tls(tls)?)?;
    }
    Ok(builder)
}

/// The connections `listener` accepts, with TCP_NODELAY set: Nagle's algorithm would hold a response's last frames
/// until the client acknowledges the first ones, and tonic sets TCP_NODELAY only on listeners it binds itself.
fn without_nagle(listener: TcpListener) -> impl Stream<Item = std::io::Result<TcpStream>> {
    TcpListenerStream::new(listener).map(|stream| {
        if let Ok(stream) = &stream {
            let _ = stream.set_nodelay(true);
        }
        stream
    })
}

/// Starts the HTTP port on `listener`: `routes`, the JSON face at every other path, all behind the bearer check;
/// it stops gracefully once `stopped` turns true.
fn serve_http(
    service: &'static str,
    listener: TcpListener,
    routes: axum::Router,
    face: JsonFace,
    auth: RequireBearer,
    mut stopped: watch::Receiver<bool>,
) -> Result<JoinHandle<std::io::Result<()>>, ServeError> {
    let addr = listener.local_addr()?;
    let router = routes
        .fallback(move |request| json::fallback(face, request))
        .layer(axum::middleware::from_fn_with_state(auth, require_bearer))
        .layer(axum::middleware::from_fn_with_state(service, trace_http));
    let serve = axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })
        .into_future();
    tracing::info!(service, %addr, "serving http");
    Ok(tokio::spawn(serve))
}

/// A host's running servers, the gRPC port's and the HTTP port's (where it has one), each with its stop signal.
struct Servers {
    service: &'static str,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    stop_grpc: tokio::sync::oneshot::Sender<()>,
    http: Option<JoinHandle<std::io::Result<()>>>,
    stop_http: watch::Sender<bool>,
}

impl Servers {
    /// Resolves only if a server stops by itself, with how it ended.
    async fn ended(&mut self) -> Result<(), ServeError> {
        let http = async {
            match &mut self.http {
                Some(task) => task.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = &mut self.grpc => Ok(result??),
            result = http => Ok(result??),
        }
    }

    /// Stops both servers accepting and gives their in-flight calls `grace` to finish; those still running then
    /// are dropped.
    async fn drain(self, grace: Duration) -> Result<(), ServeError> {
        let Servers { service, mut grpc, stop_grpc, mut http, stop_http } = self;
        let _ = stop_grpc.send(());
        let _ = stop_http.send(true);
        let drained = async {
            let grpc = (&mut grpc).await;
            if let Some(http) = &mut http {
                http.await??;
            }
            grpc??;
            Ok::<(), ServeError>(())
        };
        match tokio::time::timeout(grace, drained).await {
            Ok(result) => result?,
            Err(_) => {
                tracing::warn!(service, "drain timed out; dropping in-flight calls");
                grpc.abort();
                if let Some(http) = &http {
                    http.abort();
                }
            }
        }
        tracing::info!(service, "stopped");
        Ok(())
    }
}

/// The bearer check of the HTTP port: a request presenting none of the configured tokens (as `Authorization: Bearer`
/// or `X-API-Key`) gets `401` with a JSON body; a named caller's token puts its [`crate::auth::Caller`] in the
/// request's extensions.
async fn require_bearer(
    axum::extract::State(auth): axum::extract::State<RequireBearer>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    // Clients of the Open Reward Standard present their key as `X-API-Key`: it counts as the bearer token, and is
    // passed on as one to the services the faces call.
    if !request.headers().contains_key(http::header::AUTHORIZATION)
        && let Some(bearer) = request
            .headers()
            .get("x-api-key")
            .and_then(|key| http::HeaderValue::from_bytes(&[b"Bearer ", key.as_bytes()].concat()).ok())
    {
        request.headers_mut().insert(http::header::AUTHORIZATION, bearer);
    }
    let header = request.headers().get(http::header::AUTHORIZATION).map(|value| value.as_bytes());
    match auth.check(header) {
        Ok(caller) => {
            if let Some(caller) = caller {
                request.extensions_mut().insert(caller);
            }
            next.run(request).await
        }
        Err(status) => JsonError::from_status(&status).into_response(),
    }
}

/// The request span of the HTTP port, continuing the caller's W3C trace as the gRPC port's does.
async fn trace_http(
    axum::extract::State(service): axum::extract::State<&'static str>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let mut head = http::Request::new(());
    *head.uri_mut() = request.uri().clone();
    *head.headers_mut() = request.headers().clone();
    let span = kforge_telemetry::server_span(service, &head);
    tracing::Instrument::instrument(next.run(request), span).await
}

/// Serving while `readiness` (if any) is true; never returns.
async fn follow(health: &HealthReporter, names: &[&'static str], readiness: Option<watch::Receiver<bool>>) {
    let Some(mut ready) = readiness else {
        set_status(health, names, ServingStatus::Serving).await;
        return std::future::pending().await;
    };
    loop {
        let status = if *ready.borrow_and_update() { ServingStatus::Serving } else { ServingStatus::NotServing };
        if status == ServingStatus::NotServing {
            tracing::warn!("not ready: health is NOT_SERVING");
        }
        set_status(health, names, status).await;
        if ready.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

async fn set_status(health: &HealthReporter, names: &[&'static str], status: ServingStatus) {
    health.set_service_status("", status).await;
    for name in names {
        health.set_service_status(*name, status).await;
    }
}

fn server_tls(tls: &TlsConfig) -> Result<ServerTlsConfig, ServeError> {
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|source| ServeError::TlsFile { path: path.to_owned(), source })
    };
    let mut config = ServerTlsConfig::new().identity(Identity::from_pem(read(&tls.cert_file)?, read(&tls.key_file)?));
    if let Some(ca) = &tls.client_ca_file {
        config = config.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(config)
}

/// Binds `config.server().listen` and runs `serve` until SIGTERM or SIGINT, then drains. What `kforge serve` and
/// each service's own binary run.
pub async fn run_service<C, F, Fut>(config: C, serve: F) -> Result<(), ServeError>
where
    C: crate::ServiceConfig,
    F: FnOnce(C, TcpListener, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
    Fut: Future<Output = Result<(), ServeError>>,
{
    let listen = config.server().listen;
    let listener = TcpListener::bind(listen).await.map_err(|source| ServeError::Bind { addr: listen, source })?;
    serve(config, listener, Box::pin(shutdown_signal())).await
}

/// Completes on the first SIGTERM or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the server");
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
