//! Test support: the fake peers (`kforge_test_support::peers`: gateway, evaluator, reward and profiler in one
//! in-process server that count the calls they receive, can hold a chosen call and answer scripted failures), the
//! throwaway PostgreSQL cluster, and what only these tests need: a job spec and the orchestrator in this process.

#![allow(dead_code)]

pub use kforge_test_support::Postgres;
use kforge_test_support::health;
pub use kforge_test_support::peers::{Answer, DIAGNOSIS, Hold, KERNEL, State, TASK, key, start_fakes};

use kforge_proto::v1 as pb;

/// A single-turn rollout over inline copies of [`TASK`] named `tasks`, for the `fake` model.
pub fn spec(tasks: &[&str], trajectories: u32, turns: u32) -> pb::JobSpec {
    pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: "single-turn".into(),
        task_set: "inline".into(),
        tasks: tasks.iter().map(|id| pb::Task { task_id: (*id).into(), source: TASK.into() }).collect(),
        model: "fake".into(),
        trajectories_per_task: trajectories,
        turns,
        ..Default::default()
    }
}

/// The orchestrator in this process: its real `serve_with_http` on an ephemeral port, an in-memory SQLite store,
/// every peer at `peers`, eight attempts per call with a backoff of 1-4 ms; `tune` changes the configuration first.
pub async fn orchestrator(peers: &str, tune: impl FnOnce(&mut kforge_orchestrator::OrchestratorConfig)) -> Running {
    let mut config = kforge_orchestrator::OrchestratorConfig {
        store: "sqlite::memory:".into(),
        peers: kforge_orchestrator::PeersConfig {
            gateway: peers.into(),
            evaluator: peers.into(),
            reward: peers.into(),
            profiler: peers.into(),
            client: Default::default(),
        },
        retry: kforge_orchestrator::RetryConfig { attempts: 8, initial_backoff_ms: 1, max_backoff_ms: 4 },
        ..Default::default()
    };
    tune(&mut config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let host_port = listener.local_addr().expect("address").to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        kforge_orchestrator::serve_with_http(config, listener, None, async {
            let _ = stopped.await;
        })
        .await
        .expect("serves");
    });
    let channel = health::connected(&format!("http://{host_port}"), std::time::Duration::from_secs(30)).await;
    Running {
        client: pb::orchestrator_client::OrchestratorClient::new(channel.clone()),
        channel,
        address: host_port,
        stop: Some(stop),
        served,
    }
}

/// An orchestrator [`orchestrator`] started, until [`Running::shutdown`].
pub struct Running {
    pub client: pb::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    pub channel: tonic::transport::Channel,
    /// `host:port` it serves on (gRPC and `/metrics`).
    pub address: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops it and waits until it has drained.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.served).await.expect("the orchestrator stops");
    }
}
