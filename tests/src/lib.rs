//! Helpers for kforge's cross-service tests: start services in this process on ephemeral ports and wait until
//! they are ready through grpc.health.v1, never by sleeping. What every test crate shares (waits, the venv's
//! Python, fake peers) is `kforge_test_support`; this crate adds the mesh of real services.

use kforge::mesh::{Mesh, MeshConfig, Service};
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::{self, Channel, ClientConfig};
use kforge_test_support::{health, python};

/// A configuration whose evaluator runs one job's candidates on the CPU with the repository's `.venv` Python and
/// short timing (for tests that check what flows, not the figures), its files under `target/tmp/<work_dir>`. A
/// missing `.venv` fails the test: `scripts/setup.sh --test` makes it.
pub fn cpu_evaluator_config(work_dir: &str) -> MeshConfig {
    let root = python::repo_root();
    let mut config = MeshConfig::default();
    config.evaluator.python = python::required(&[]);
    // Kept between runs (the compile cache makes a second run quicker), under the workspace's target directory.
    config.evaluator.work_dir = root.join("target/tmp").join(work_dir);
    kforge::run::evaluator_for_one_job(&mut config, false);
    config.evaluator.timing.warmup_runs = 2;
    config.evaluator.timing.min_runs = 5;
    config.evaluator.timing.max_seconds = 0.5;
    config.evaluator.paired_timing.rounds = 4;
    config
}

/// Starts `services` with `config` on ephemeral loopback ports and waits until each reports SERVING.
pub async fn start(services: &[Service], config: &MeshConfig) -> Mesh {
    // The orchestrator's store in memory: a test never writes to the user's state directory.
    let mut config = config.clone();
    config.orchestrator.store = "sqlite::memory:".into();
    let mesh = Mesh::start(services, &config, true).await.expect("services start");
    for &service in services {
        let channel = connect(&mesh, service, &ClientConfig::default()).await;
        health::until_serving(channel, service.proto_name()).await;
    }
    mesh
}

/// The Reward service alone, started with `config` and ready, with a client to it.
pub async fn reward(config: &MeshConfig) -> (Mesh, RewardClient<Channel>) {
    let mesh = start(&[Service::Reward], config).await;
    let channel = connect(&mesh, Service::Reward, &ClientConfig::default()).await;
    (mesh, RewardClient::new(channel))
}

/// A channel to `service` in `mesh`.
pub async fn connect(mesh: &Mesh, service: Service, config: &ClientConfig) -> Channel {
    let address = mesh.address(service).expect("service runs in this mesh");
    client::connect(address, config).await.expect("connects")
}
