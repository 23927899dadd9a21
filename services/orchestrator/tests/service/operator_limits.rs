//! What an operator bounds, against the orchestrator in this process (its real `serve`, an in-memory SQLite store)
//! and fake peers: a job over the configured limits refused naming the field and the limit (SubmitJob and
//! StartEpisode alike), an inline task that is not a task refused at submission, the failing-turns breaker failing
//! a job whose turns keep failing (and not one whose failures are interrupted, nor for infrastructure verdicts), and
//! the named callers' quotas: one caller over its quota refused while another, and the shared token, go on; a
//! caller acting on its own jobs only, a resumed job counted in flight again.

use crate::support::{self, TASK, spec};

use std::path::{Path, PathBuf};

use kforge_orchestrator::OrchestratorConfig;
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::auth::{Outbound, Token};
use kforge_server::config::CallerConfig;
use support::{Answer, key};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

type Client = OrchestratorClient<InterceptedService<Channel, Outbound>>;

/// A client of `running` presenting `token` (none: no `authorization` metadata).
fn with_token(running: &support::Running, token: Option<&str>) -> Client {
    OrchestratorClient::with_interceptor(running.channel.clone(), Outbound::new(token.map(Token::new)))
}

/// The orchestrator with two quick attempts per call, so that a failing peer fails its turn at once.
async fn orchestrator(peers: &str, tune: impl FnOnce(&mut OrchestratorConfig)) -> support::Running {
    support::orchestrator(peers, |config| {
        config.retry = kforge_orchestrator::RetryConfig { attempts: 2, initial_backoff_ms: 1, max_backoff_ms: 2 };
        tune(config);
    })
    .await
}

async fn submit(client: &mut Client, spec: pb::JobSpec) -> Result<pb::Job, tonic::Status> {
    let request = pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() };
    client.submit_job(request).await.map(tonic::Response::into_inner)
}

fn episode(turns: u32) -> pb::StartEpisodeRequest {
    pb::StartEpisodeRequest {
        recipe: "single-turn".into(),
        task: Some(pb::Task { task_id: "a".into(), source: TASK.into() }),
        turns,
        ..Default::default()
    }
}

/// The job once it has ended (WatchJob's last update).
async fn ended(client: &mut Client, job_id: &str) -> pb::Job {
    let mut stream =
        client.watch_job(pb::WatchJobRequest { job_id: job_id.into() }).await.expect("watched").into_inner();
    let mut last = None;
    while let Some(update) = stream.message().await.expect("an update") {
        last = update.job;
    }
    last.expect("an update with the job")
}

async fn jobs(client: &mut Client) -> Vec<pb::Job> {
    client.list_jobs(pb::ListJobsRequest::default()).await.expect("listed").into_inner().jobs
}

fn assert_refused(result: Result<impl std::fmt::Debug, tonic::Status>, code: tonic::Code, message: &str) {
    let status = result.expect_err(message);
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(status.message(), message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_over_the_limits_are_refused_naming_the_field_and_the_limit() {
    let (peers, fakes) = support::start_fakes().await;
    let running = orchestrator(&peers, |_| {}).await;
    let mut client = with_token(&running, None);
    let invalid = tonic::Code::InvalidArgument;
    // The defaults: the submissions that were once accepted and flooded the store.
    assert_refused(
        submit(&mut client, spec(&["a"], 1_000_000_000, 1)).await,
        invalid,
        "spec.trajectories_per_task: 1000000000 is over the limit of 64 (orchestrator.limits.trajectories_per_task)",
    );
    assert_refused(
        submit(&mut client, spec(&["a"], 1, u32::MAX)).await,
        invalid,
        "spec.turns: 4294967295 is over the limit of 32 (orchestrator.limits.turns)",
    );
    assert_refused(
        client.start_episode(episode(1000)).await,
        invalid,
        "turns: 1000 is over the limit of 32 (orchestrator.limits.turns)",
    );
    assert!(jobs(&mut client).await.is_empty(), "nothing stored");
    running.shutdown().await;

    let running = orchestrator(&peers, |c| {
        c.limits = kforge_orchestrator::LimitsConfig {
            tasks: 2,
            trajectories_per_task: 4,
            turns: 3,
            total_turns: 10,
            ..Default::default()
        };
    })
    .await;
    let mut client = with_token(&running, None);
    assert_refused(
        submit(&mut client, spec(&["a", "b", "c"], 1, 1)).await,
        invalid,
        "spec.tasks: 3 tasks is over the limit of 2 (orchestrator.limits.tasks)",
    );
    assert_refused(
        submit(&mut client, pb::JobSpec { task_set: "examples".into(), tasks: Vec::new(), ..spec(&[], 1, 1) }).await,
        invalid,
        "spec.task_set: 13 tasks is over the limit of 2 (orchestrator.limits.tasks)",
    );
    assert_refused(
        submit(&mut client, spec(&["a", "b"], 4, 3)).await,
        invalid,
        "spec: 24 turns (2 tasks x 4 trajectories x 3 turns) is over the limit of 10 (orchestrator.limits.total_turns)",
    );
    assert!(jobs(&mut client).await.is_empty(), "nothing stored");
    // The examples cut to the limit by max_tasks, and a job at the limits, are accepted and run.
    let examples = pb::JobSpec { task_set: "examples".into(), tasks: Vec::new(), max_tasks: 2, ..spec(&[], 1, 1) };
    let job = submit(&mut client, examples).await.expect("two tasks are within the limit");
    assert_eq!(job.turns_total, 2);
    let job = submit(&mut client, spec(&["a", "b"], 1, 3)).await.expect("at the limits");
    assert_eq!(ended(&mut client, &job.job_id).await.state(), pb::JobState::Succeeded);
    assert_eq!(fakes.generate_counts().1.get(&key("b", 0, 2)), Some(&1), "its last turn ran");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inline_task_that_is_not_python_is_refused_at_submission() {
    let (peers, fakes) = support::start_fakes().await;
    let running = orchestrator(&peers, |_| {}).await;
    let mut client = with_token(&running, None);
    let cuda = "#include <cuda_runtime.h>\n__global__ void relu(float* x) { x[threadIdx.x] = 0; }\n";
    let mut job = spec(&["good", "cuda"], 1, 1);
    job.tasks[1].source = cuda.into();
    let status = submit(&mut client, job).await.expect_err("not Python");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("spec.tasks[1].source: not a task: syntax error at line "), "{status:?}");
    let mut job = spec(&["no-inputs"], 1, 1);
    job.tasks[0].source = "import torch\n\nclass Model(torch.nn.Module):\n    pass\n".into();
    assert_refused(
        submit(&mut client, job).await,
        tonic::Code::InvalidArgument,
        "spec.tasks[0].source: not a task: defines no get_inputs()",
    );
    let request =
        pb::StartEpisodeRequest { task: Some(pb::Task { task_id: "cuda".into(), source: cuda.into() }), ..episode(1) };
    let status = client.start_episode(request).await.expect_err("not Python");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with("task.source: not a task: "), "{status:?}");
    assert!(jobs(&mut client).await.is_empty(), "nothing stored");
    assert!(fakes.generate_counts().0.is_empty(), "nothing generated");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_fails_a_job_whose_turns_keep_failing_the_same_way() {
    let (peers, fakes) = support::start_fakes().await;
    // One episode at a time, so that the turns are recorded in the job's order.
    let running = orchestrator(&peers, |c| {
        c.breaker.failed_turns = 5;
        c.max_concurrent_episodes = 1;
    })
    .await;
    let mut client = with_token(&running, None);
    for trajectory in 0..64 {
        fakes.fail_generation(&key("a", trajectory, 0));
    }
    let job = submit(&mut client, spec(&["a"], 64, 2)).await.expect("submitted");
    let failed = ended(&mut client, &job.job_id).await;
    assert_eq!(failed.state(), pb::JobState::Failed, "{failed:?}");
    assert_eq!(
        failed.error,
        "breaker: 5 consecutive turns failed with gateway: Unavailable (the last: \"gateway: Unavailable: backend \
         down\")"
    );
    assert_eq!((failed.turns_done, failed.turns_total), (5, 128), "no episode started after the fifth failure");
    let asked: u32 = fakes.generate_counts().0.values().sum();
    assert_eq!(asked, 5);
    let stored = client.get_job(pb::GetJobRequest { job_id: job.job_id.clone() }).await.expect("a job").into_inner();
    assert_eq!((stored.state(), stored.error), (pb::JobState::Failed, failed.error));

    // Eight failures in two streaks of four broken by a turn that went through, then four infrastructure verdicts,
    // a correct turn and four more, do not trip it.
    for trajectory in [0, 1, 2, 3, 5, 6, 7, 8] {
        fakes.fail_generation(&key("b", trajectory, 0));
    }
    for trajectory in [0, 1, 2, 3, 5, 6, 7, 8] {
        fakes.script(&key("c", trajectory, 0), [Answer::Infra { retryable: false }]);
    }
    let job = submit(&mut client, spec(&["b", "c"], 10, 1)).await.expect("submitted");
    let finished = ended(&mut client, &job.job_id).await;
    assert_eq!((finished.state(), finished.turns_done), (pb::JobState::Succeeded, 20), "{finished:?}");
    let metrics = finished.metrics.expect("metrics");
    assert_eq!(metrics.infra_errors, 8, "{metrics:?}");

    // An evaluator that fails every evaluation (retries spent or not retryable) fails the job too.
    for trajectory in 0..10 {
        fakes.script(&key("d", trajectory, 0), [Answer::Infra { retryable: false }]);
    }
    let job = submit(&mut client, spec(&["d"], 10, 1)).await.expect("submitted");
    let failed = ended(&mut client, &job.job_id).await;
    assert_eq!((failed.state(), failed.turns_done), (pb::JobState::Failed, 5), "{failed:?}");
    assert_eq!(
        failed.error,
        "breaker: 5 consecutive turns failed with evaluator: INFRA_ERROR (the last: \"evaluator: INFRA_ERROR: device \
         lost\")"
    );
    running.shutdown().await;
}

/// Writes `token` to a file of its own under `dir`.
fn token_file(dir: &Path, name: &str, token: &str) -> Option<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, format!("{token}\n")).expect("token written");
    Some(path)
}

/// A fresh directory for a test's token files.
fn token_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

/// A named caller whose token, `<name>-token`, is in a file of its own under `dir`.
fn named_caller(dir: &Path, name: &str) -> CallerConfig {
    CallerConfig { name: name.into(), token_file: token_file(dir, name, &format!("{name}-token")), token_env: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_over_its_quota_is_refused_while_another_goes_on() {
    let (peers, fakes) = support::start_fakes().await;
    let dir = token_dir("operator-limits-quotas");
    let caller = |name: &str| named_caller(&dir, name);
    let running = orchestrator(&peers, |c| {
        c.server.auth.token_file = token_file(&dir, "shared", "shared-token");
        c.server.callers = vec![caller("alice"), caller("bob")];
        c.quotas = kforge_orchestrator::QuotasConfig { jobs_in_flight: 1, turns_per_hour: 10 };
    })
    .await;
    let (mut alice, mut bob) = (with_token(&running, Some("alice-token")), with_token(&running, Some("bob-token")));
    let mut shared = with_token(&running, Some("shared-token"));
    let status = submit(&mut with_token(&running, None), spec(&["a"], 1, 1)).await.expect_err("no token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    // Evaluations wait until the test lets them go: the jobs stay in flight.
    let gate = fakes.gate_evaluations();

    let first = submit(&mut alice, spec(&["a"], 1, 2)).await.expect("within alice's quotas");
    assert_eq!(first.caller, "alice");
    assert_refused(
        submit(&mut alice, spec(&["b"], 1, 1)).await,
        tonic::Code::ResourceExhausted,
        "caller `alice` is over its quota: 1 jobs queued or running, the quota is 1 (orchestrator.quotas.jobs_in_flight)",
    );
    let theirs = submit(&mut bob, spec(&["b"], 1, 2)).await.expect("bob has his own quota");
    assert_eq!(theirs.caller, "bob");
    let unnamed = submit(&mut shared, spec(&["c"], 1, 1)).await.expect("the shared token has no quota");
    assert_eq!(unnamed.caller, "");

    // Turns per hour: bob has asked for 2; episodes count their turns (not as jobs in flight).
    let started = bob.start_episode(episode(3)).await.expect("2 + 3 turns within 10").into_inner();
    let stored = bob.get_job(pb::GetJobRequest { job_id: started.episode_id }).await.expect("a job").into_inner();
    assert_eq!((stored.caller, stored.turns_total), ("bob".into(), 3));
    let status = bob.start_episode(episode(6)).await.expect_err("5 + 6 turns are over 10");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        "caller `bob` is over its quota: 5 turns asked for in the last hour and 6 now, the quota is 10 per hour \
         (orchestrator.quotas.turns_per_hour)"
    );
    let retry_ms: u64 =
        status.metadata().get("retry-after-ms").expect("a hint").to_str().expect("ascii").parse().expect("ms");
    assert!((1..=3_600_000).contains(&retry_ms), "{retry_ms}");
    assert_refused(
        bob.start_episode(episode(11)).await,
        tonic::Code::ResourceExhausted,
        "caller `bob` is over its quota: 11 turns asked for, more than the quota of 10 per hour \
         (orchestrator.quotas.turns_per_hour)",
    );
    alice.start_episode(episode(8)).await.expect("2 + 8 turns: alice's own quota has room");

    // Once alice's job ends, she may submit again (within her turns: 10 asked for, so only an empty hour would do).
    gate.add_permits(1000);
    assert_eq!(ended(&mut alice, &first.job_id).await.state(), pb::JobState::Succeeded);
    assert_refused(
        submit(&mut alice, spec(&["b"], 1, 1)).await,
        tonic::Code::ResourceExhausted,
        "caller `alice` is over its quota: 10 turns asked for in the last hour and 1 now, the quota is 10 per hour \
         (orchestrator.quotas.turns_per_hour)",
    );
    assert_eq!(ended(&mut bob, &theirs.job_id).await.state(), pb::JobState::Succeeded);
    running.shutdown().await;

    // Without quotas, a named caller is only named.
    let running = orchestrator(&peers, |c| {
        c.server.callers = vec![caller("alice")];
    })
    .await;
    let job = submit(&mut with_token(&running, Some("alice-token")), spec(&["a"], 1, 1)).await.expect("no quotas");
    assert_eq!(job.caller, "alice");
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A named caller cancels and resumes only its own jobs, and a job it resumes counts against its jobs in flight
/// again; the shared token (the operator's) may act on any job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_acts_on_its_own_jobs_and_a_resumed_job_is_in_flight_again() {
    let (peers, fakes) = support::start_fakes().await;
    let dir = token_dir("operator-limits-owners");
    let caller = |name: &str| named_caller(&dir, name);
    let running = orchestrator(&peers, |c| {
        c.server.auth.token_file = token_file(&dir, "shared", "shared-token");
        c.server.callers = vec![caller("alice"), caller("bob")];
        c.quotas = kforge_orchestrator::QuotasConfig { jobs_in_flight: 1, turns_per_hour: 0 };
    })
    .await;
    let (mut alice, mut bob) = (with_token(&running, Some("alice-token")), with_token(&running, Some("bob-token")));
    let mut shared = with_token(&running, Some("shared-token"));
    // Evaluations wait until the test lets them go: the jobs stay in flight.
    let gate = fakes.gate_evaluations();
    let first = submit(&mut alice, spec(&["a"], 1, 2)).await.expect("within alice's quota");
    let cancel = |job_id: &str| pb::CancelJobRequest { job_id: job_id.into() };
    let resume = |job_id: &str| pb::ResumeJobRequest { job_id: job_id.into() };
    let not_his = format!("caller `bob` may not act on job `{}`: another caller submitted it", first.job_id);
    assert_refused(bob.cancel_job(cancel(&first.job_id)).await, tonic::Code::PermissionDenied, &not_his);
    assert_refused(bob.resume_job(resume(&first.job_id)).await, tonic::Code::PermissionDenied, &not_his);
    alice.cancel_job(cancel(&first.job_id)).await.expect("her own job");
    assert_eq!(ended(&mut alice, &first.job_id).await.state(), pb::JobState::Cancelled);
    let second = submit(&mut alice, spec(&["b"], 1, 2)).await.expect("the cancelled job is not in flight");
    assert_refused(
        alice.resume_job(resume(&first.job_id)).await,
        tonic::Code::ResourceExhausted,
        "caller `alice` is over its quota: 1 jobs queued or running, the quota is 1 (orchestrator.quotas.jobs_in_flight)",
    );
    shared.cancel_job(cancel(&second.job_id)).await.expect("the operator may cancel any job");
    assert_eq!(ended(&mut alice, &second.job_id).await.state(), pb::JobState::Cancelled);
    alice.resume_job(resume(&first.job_id)).await.expect("room again: her job resumes");
    gate.add_permits(1000);
    assert_eq!(ended(&mut alice, &first.job_id).await.state(), pb::JobState::Succeeded);
    running.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}
