//! What the CLI's integration tests share: the services in this process and a job run through them.

use std::path::PathBuf;

use kforge::mesh::{Mesh, MeshConfig, Service};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;

/// The repository's venv (scripts/setup.sh --test): the evaluator runs in it, so these tests fail, naming it, where
/// it is missing.
pub fn python() -> PathBuf {
    kforge_test_support::python::required(&[])
}

/// The evaluator, reward, gateway and orchestrator in-process with `config`, and a client of the orchestrator.
pub async fn start_mesh(config: &MeshConfig) -> (Mesh, OrchestratorClient<kforge_server::client::Channel>) {
    let services = [Service::Evaluator, Service::Reward, Service::Gateway, Service::Orchestrator];
    let mesh = Mesh::start(&services, config, true).await.expect("the mesh starts");
    let address = mesh.address(Service::Orchestrator).expect("orchestrator runs").to_owned();
    let channel = kforge_server::client::connect(&address, &Default::default()).await.expect("connects");
    (mesh, OrchestratorClient::new(channel))
}

/// Submits `spec` and follows the job to its end: the finished job and its trajectories.
pub async fn submit_and_follow(
    orchestrator: &mut OrchestratorClient<kforge_server::client::Channel>,
    spec: pb::JobSpec,
) -> (pb::Job, Vec<pb::Trajectory>) {
    let submitted = orchestrator
        .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() })
        .await
        .expect("submitted")
        .into_inner();
    let job = kforge::run::follow(orchestrator, &submitted.job_id, |_| {}).await.expect("watched");
    let trajectories = kforge::run::trajectories(orchestrator, &job.job_id).await.expect("listed");
    (job, trajectories)
}
