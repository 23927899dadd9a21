//! Runs kforge services inside this process: one (`kforge serve`), all five (`kforge up`), or the one a
//! `kforge call` needs. Each service gets the same `serve(config, listener, shutdown)` its own binary uses.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;

use kforge_server::{ConfigError, ServeError, ServiceConfig, load_section};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// One of the five services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Service {
    Evaluator,
    Profiler,
    Reward,
    Gateway,
    Orchestrator,
}

impl Service {
    /// All five, in the order `kforge up` prints them.
    pub const ALL: [Service; 5] = [Self::Evaluator, Self::Profiler, Self::Reward, Self::Gateway, Self::Orchestrator];

    /// The config table and log name, e.g. `reward`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Evaluator => "evaluator",
            Self::Profiler => "profiler",
            Self::Reward => "reward",
            Self::Gateway => "gateway",
            Self::Orchestrator => "orchestrator",
        }
    }

    /// The fully qualified proto service, e.g. `kforge.v1.Reward`.
    pub fn proto_name(self) -> &'static str {
        match self {
            Self::Evaluator => "kforge.v1.Evaluator",
            Self::Profiler => "kforge.v1.Profiler",
            Self::Reward => "kforge.v1.Reward",
            Self::Gateway => "kforge.v1.Gateway",
            Self::Orchestrator => "kforge.v1.Orchestrator",
        }
    }

    /// The service serving a fully qualified proto service name.
    pub fn from_proto_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.proto_name() == name)
    }
}

/// Every service's configuration, read from one file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MeshConfig {
    pub evaluator: kforge_evaluator::EvaluatorConfig,
    pub profiler: kforge_profiler::ProfilerConfig,
    pub reward: kforge_reward::RewardConfig,
    pub gateway: kforge_gateway::GatewayConfig,
    pub orchestrator: kforge_orchestrator::OrchestratorConfig,
}

impl MeshConfig {
    /// Loads every table (defaults, then the file, then `KFORGE__*` variables).
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Ok(Self {
            evaluator: load_section(file)?,
            profiler: load_section(file)?,
            reward: load_section(file)?,
            gateway: load_section(file)?,
            orchestrator: load_section(file)?,
        })
    }

    /// Where `service` is configured to listen.
    pub fn listen(&self, service: Service) -> SocketAddr {
        match service {
            Service::Evaluator => self.evaluator.server().listen,
            Service::Profiler => self.profiler.server().listen,
            Service::Reward => self.reward.server().listen,
            Service::Gateway => self.gateway.server().listen,
            Service::Orchestrator => self.orchestrator.server().listen,
        }
    }

    /// Whether `service` serves TLS (its address is then `https://`).
    pub fn tls(&self, service: Service) -> bool {
        match service {
            Service::Evaluator => self.evaluator.server().tls.is_some(),
            Service::Profiler => self.profiler.server().tls.is_some(),
            Service::Reward => self.reward.server().tls.is_some(),
            Service::Gateway => self.gateway.server().tls.is_some(),
            Service::Orchestrator => self.orchestrator.server().tls.is_some(),
        }
    }
}

/// Serves `service` with its configuration until `shutdown` completes; the orchestrator serves its HTTP port on
/// `http` when given.
pub async fn serve(
    service: Service,
    config: &MeshConfig,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    match service {
        Service::Evaluator => kforge_evaluator::serve(config.evaluator.clone(), listener, shutdown).await,
        Service::Profiler => {
            // One engine per process: the profiler runs its candidates on the evaluator's (`[evaluator]`).
            let profiler =
                kforge_profiler::ProfilerConfig { execution: config.evaluator.execution(), ..config.profiler.clone() };
            kforge_profiler::serve(profiler, listener, shutdown).await
        }
        Service::Reward => kforge_reward::serve(config.reward.clone(), listener, shutdown).await,
        Service::Gateway => kforge_gateway::serve(config.gateway.clone(), listener, shutdown).await,
        Service::Orchestrator => {
            kforge_orchestrator::serve_with_http(config.orchestrator.clone(), listener, http, shutdown).await
        }
    }
}

/// Services running in this process. Dropping it without [`Mesh::shutdown`] cancels them without a drain.
#[derive(Debug)]
pub struct Mesh {
    addresses: Vec<(Service, String)>,
    /// The orchestrator's HTTP port (protocol faces and JSON), when it serves one.
    http: Option<String>,
    stop: CancellationToken,
    tasks: JoinSet<(Service, Result<(), ServeError>)>,
}

impl Mesh {
    /// Binds every listener first (so a port conflict fails before anything serves), then starts each service.
    /// With `ephemeral`, every service listens on a free loopback port instead of its configured address, the
    /// orchestrator's HTTP port too (when `orchestrator.http.listen` names one; one-shot commands clear it). An
    /// orchestrator started here is handed the addresses of the gateway, evaluator and reward started with it.
    pub async fn start(services: &[Service], config: &MeshConfig, ephemeral: bool) -> Result<Self, ServeError> {
        let mut bound = Vec::with_capacity(services.len());
        for &service in services {
            let addr = if ephemeral { SocketAddr::from(([127, 0, 0, 1], 0)) } else { config.listen(service) };
            let listener = TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?;
            bound.push((service, listener));
        }
        let mut http = None;
        if services.contains(&Service::Orchestrator)
            && let Some(configured) = kforge_orchestrator::http_address(&config.orchestrator.http)?
        {
            let addr = if ephemeral { SocketAddr::from(([127, 0, 0, 1], 0)) } else { configured };
            http = Some(TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?);
        }
        let http_address = match &http {
            Some(listener) => Some(format!("http://{}", listener.local_addr()?)),
            None => None,
        };
        let mut addresses = Vec::with_capacity(bound.len());
        for (service, listener) in &bound {
            let scheme = if config.tls(*service) { "https" } else { "http" };
            addresses.push((*service, format!("{scheme}://{}", listener.local_addr()?)));
        }
        // The orchestrator calls the peers that run beside it here, wherever they listen (ports may be ephemeral).
        let mut config = config.clone();
        let peers = &mut config.orchestrator.peers;
        for (service, address) in &addresses {
            match service {
                Service::Gateway => peers.gateway.clone_from(address),
                Service::Evaluator => peers.evaluator.clone_from(address),
                Service::Reward => peers.reward.clone_from(address),
                Service::Profiler => peers.profiler.clone_from(address),
                Service::Orchestrator => {}
            }
        }
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();
        for (service, listener) in bound {
            let config = config.clone();
            let shutdown = stop.clone().cancelled_owned();
            let http = if service == Service::Orchestrator { http.take() } else { None };
            tasks.spawn(async move { (service, serve(service, &config, listener, http, shutdown).await) });
        }
        Ok(Self { addresses, http: http_address, stop, tasks })
    }

    /// The URL each service listens on, in start order.
    pub fn addresses(&self) -> &[(Service, String)] {
        &self.addresses
    }

    /// The URL of the orchestrator's HTTP port, if it serves one here.
    pub fn http_address(&self) -> Option<&str> {
        self.http.as_deref()
    }

    /// The URL of `service`, if it runs here.
    pub fn address(&self, service: Service) -> Option<&str> {
        self.addresses.iter().find(|(s, _)| *s == service).map(|(_, a)| a.as_str())
    }

    /// Runs until `signal` completes (then drains every service) or a service stops on its own (an error).
    pub async fn run_until(mut self, signal: impl Future<Output = ()>) -> Result<(), ServeError> {
        tokio::select! {
            () = signal => self.shutdown().await,
            Some(joined) = self.tasks.join_next() => {
                let (service, result) = joined?;
                self.shutdown().await?;
                result?;
                Err(ServeError::Setup { service: service.name(), message: "stopped unexpectedly".into() })
            }
        }
    }

    /// Drains every service and waits for all of them; the first error wins.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        self.stop.cancel();
        let mut first_error = None;
        while let Some(joined) = self.tasks.join_next().await {
            let result = joined.map_err(ServeError::from).and_then(|(_, result)| result);
            if let Err(error) = result {
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}
