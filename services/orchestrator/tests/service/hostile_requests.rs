//! Hostile requests against the orchestrator in this process (its real `serve`, an in-memory SQLite store, fake
//! peers): a table of JobSpecs and StartEpisode requests with extreme numbers, huge or malformed task sets, paths
//! that are not what they claim, NaN and negative floats, unknown enum values and oversized keys, each refused
//! INVALID_ARGUMENT (RESOURCE_EXHAUSTED where a named caller's quota applies) with a message naming the field, and
//! nothing stored. Then every call that names a job, with ids that no job has: empty, 1 MB, odd characters.

use crate::support::{self, TASK};

use std::path::Path;

use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::auth::{Outbound, Token};
use kforge_server::config::CallerConfig;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const MB: usize = 1024 * 1024;

type Client = OrchestratorClient<InterceptedService<Channel, Outbound>>;

fn task(id: &str) -> pb::Task {
    pb::Task { task_id: id.into(), source: TASK.into() }
}

/// A job the orchestrator accepts; each row changes one thing.
fn spec() -> pb::JobSpec {
    pb::JobSpec {
        kind: pb::JobKind::Rollout.into(),
        recipe: "single-turn".into(),
        task_set: "inline".into(),
        tasks: vec![task("a")],
        model: "fake".into(),
        trajectories_per_task: 1,
        turns: 1,
        ..Default::default()
    }
}

fn episode() -> pb::StartEpisodeRequest {
    pb::StartEpisodeRequest { recipe: "single-turn".into(), task: Some(task("a")), turns: 1, ..Default::default() }
}

fn sampling(change: impl FnOnce(&mut pb::SamplingParams)) -> pb::JobSpec {
    let mut sampling = pb::SamplingParams::default();
    change(&mut sampling);
    pb::JobSpec { sampling: Some(sampling), ..spec() }
}

fn reward(change: impl FnOnce(&mut pb::RewardSpec)) -> Option<pb::RewardSpec> {
    let mut reward = pb::RewardSpec::default();
    change(&mut reward);
    Some(reward)
}

fn kevin(weight: f64) -> Option<pb::reward_spec::Formula> {
    Some(pb::reward_spec::Formula::Kevin(pb::KevinScore { correctness_weight: Some(weight) }))
}

fn diagnose(threshold: f64) -> Option<pb::DiagnoseParams> {
    Some(pb::DiagnoseParams { repetition_threshold: Some(threshold), ..Default::default() })
}

/// A task whose source is `bytes` long (a valid task, padded with a comment).
fn big_task(bytes: usize) -> pb::Task {
    let mut source = String::from(TASK);
    source.push('#');
    source.push_str(&"x".repeat(bytes.saturating_sub(source.len())));
    pb::Task { task_id: "big".into(), source }
}

/// Refused with `code`, the message opening with `field: ` (or, for a quota, naming the caller), and short enough to
/// travel in a response header.
fn assert_refused<T: std::fmt::Debug>(row: &str, result: Result<T, tonic::Status>, code: Code, field: &str) {
    let status = match result {
        Ok(accepted) => panic!("{row}: accepted: {accepted:?}"),
        Err(status) => status,
    };
    let message = status.message();
    assert_eq!(status.code(), code, "{row}: {message}");
    assert!(message.starts_with(&format!("{field}: ")) || message.contains(field), "{row}: {message}");
    assert!(message.len() <= 2048, "{row}: a message of {} bytes", message.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_submissions_are_refused_naming_the_field_and_nothing_is_stored() {
    let (peers, _fakes) = support::start_fakes().await;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile-requests");
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let token_file = dir.join("alice.token");
    std::fs::write(&token_file, "alice-token").expect("a token");
    let a_file = dir.join("a-file.txt");
    std::fs::write(&a_file, "not a directory").expect("a file");
    let empty_dir = dir.join("prompts-of-nothing");
    std::fs::create_dir_all(&empty_dir).expect("a directory");

    let shared_token = dir.join("shared.token");
    std::fs::write(&shared_token, "shared-token").expect("a token");
    let running = support::orchestrator(&peers, |config| {
        config.retry = Default::default();
        config.server.auth.token_file = Some(shared_token);
        config.server.callers =
            vec![CallerConfig { name: "alice".into(), token_file: Some(token_file), token_env: None }];
        config.quotas = kforge_orchestrator::QuotasConfig { jobs_in_flight: 1, turns_per_hour: 40 };
    })
    .await;
    let channel = running.channel.clone();
    let mut alice: Client =
        OrchestratorClient::with_interceptor(channel.clone(), Outbound::new(Some(Token::new("alice-token"))))
            .max_decoding_message_size(64 * MB)
            .max_encoding_message_size(64 * MB);

    let too_many: Vec<pb::Task> = (0..10_001).map(|i| task(&format!("t{i}"))).collect();
    let invalid = Code::InvalidArgument;
    let submissions: Vec<(&str, pb::SubmitJobRequest, Code, &str)> = vec![
        ("no spec", pb::SubmitJobRequest::default(), invalid, "spec"),
        ("turns 0", job(pb::JobSpec { turns: 0, ..spec() }), invalid, "spec.turns"),
        ("turns u32::MAX", job(pb::JobSpec { turns: u32::MAX, ..spec() }), invalid, "spec.turns"),
        (
            "trajectories 0",
            job(pb::JobSpec { trajectories_per_task: 0, ..spec() }),
            invalid,
            "spec.trajectories_per_task",
        ),
        (
            "trajectories u32::MAX",
            job(pb::JobSpec { trajectories_per_task: u32::MAX, ..spec() }),
            invalid,
            "spec.trajectories_per_task",
        ),
        (
            "correctness_trials u32::MAX (the evaluator refuses over 100)",
            job(pb::JobSpec { correctness_trials: u32::MAX, ..spec() }),
            invalid,
            "spec.correctness_trials",
        ),
        (
            "every number u32::MAX",
            job(pb::JobSpec {
                turns: u32::MAX,
                trajectories_per_task: u32::MAX,
                max_tasks: u32::MAX,
                context_window: u32::MAX,
                context_budget_chars: u32::MAX,
                max_concurrent_episodes: u32::MAX,
                correctness_trials: u32::MAX,
                seed: u64::MAX,
                ..spec()
            }),
            invalid,
            "spec.",
        ),
        (
            "inline tasks over limits.tasks",
            job(pb::JobSpec { tasks: too_many.clone(), ..spec() }),
            invalid,
            "spec.tasks",
        ),
        (
            "an inline task of 10 MB",
            job(pb::JobSpec { tasks: vec![big_task(10 * MB)], ..spec() }),
            invalid,
            "spec.tasks[0].source",
        ),
        ("an empty recipe", job(pb::JobSpec { recipe: String::new(), ..spec() }), invalid, "spec.recipe"),
        ("an unknown recipe", job(pb::JobSpec { recipe: "../../kevin".into(), ..spec() }), invalid, "spec.recipe"),
        (
            "a prompt_dir that is a file",
            job(pb::JobSpec { prompt_dir: a_file.display().to_string(), ..spec() }),
            invalid,
            "spec.prompt_dir",
        ),
        (
            "prompt_dir /proc/self (no templates of the recipe)",
            job(pb::JobSpec { prompt_dir: "/proc/self".into(), ..spec() }),
            invalid,
            "spec.prompt_dir",
        ),
        (
            "a prompt_dir with no templates",
            job(pb::JobSpec { prompt_dir: empty_dir.display().to_string(), ..spec() }),
            invalid,
            "spec.prompt_dir",
        ),
        ("temperature -1", job(sampling(|s| s.temperature = Some(-1.0))), invalid, "spec.sampling.temperature"),
        ("temperature NaN", job(sampling(|s| s.temperature = Some(f64::NAN))), invalid, "spec.sampling.temperature"),
        ("top_p 0", job(sampling(|s| s.top_p = Some(0.0))), invalid, "spec.sampling.top_p"),
        ("top_k -7", job(sampling(|s| s.top_k = Some(-7))), invalid, "spec.sampling.top_k"),
        ("min_p infinity", job(sampling(|s| s.min_p = Some(f64::INFINITY))), invalid, "spec.sampling.min_p"),
        ("max_tokens 0", job(sampling(|s| s.max_tokens = Some(0))), invalid, "spec.sampling.max_tokens"),
        ("n 0", job(sampling(|s| s.n = Some(0))), invalid, "spec.sampling.n"),
        ("an empty stop", job(sampling(|s| s.stop = vec![String::new()])), invalid, "spec.sampling.stop[0]"),
        (
            "presence_penalty NaN",
            job(sampling(|s| s.presence_penalty = Some(f64::NAN))),
            invalid,
            "spec.sampling.presence_penalty",
        ),
        (
            "frequency_penalty -3",
            job(sampling(|s| s.frequency_penalty = Some(-3.0))),
            invalid,
            "spec.sampling.frequency_penalty",
        ),
        (
            "repetition_penalty 0",
            job(sampling(|s| s.repetition_penalty = Some(0.0))),
            invalid,
            "spec.sampling.repetition_penalty",
        ),
        (
            "a Kevin weight of NaN",
            job(pb::JobSpec { reward: reward(|r| r.formula = kevin(f64::NAN)), ..spec() }),
            invalid,
            "spec.reward.kevin.correctness_weight",
        ),
        (
            "a Dr. Kernel cap of -1",
            job(pb::JobSpec {
                reward: reward(|r| {
                    r.formula = Some(pb::reward_spec::Formula::Drkernel(pb::DrKernelReward {
                        speedup_cap: Some(-1.0),
                        ..Default::default()
                    }))
                }),
                ..spec()
            }),
            invalid,
            "spec.reward.drkernel.speedup_cap",
        ),
        (
            "a hack penalty of NaN",
            job(pb::JobSpec { reward: reward(|r| r.hack_penalty = Some(f64::NAN)), ..spec() }),
            invalid,
            "spec.reward.hack_penalty",
        ),
        (
            "gamma NaN",
            job(pb::JobSpec { reward: reward(|r| r.gamma = Some(f64::NAN)), ..spec() }),
            invalid,
            "spec.reward.gamma",
        ),
        (
            "gamma -1",
            job(pb::JobSpec { reward: reward(|r| r.gamma = Some(-1.0)), ..spec() }),
            invalid,
            "spec.reward.gamma",
        ),
        (
            "a diagnose threshold of NaN",
            job(pb::JobSpec { diagnose: diagnose(f64::NAN), ..spec() }),
            invalid,
            "spec.diagnose.repetition_threshold",
        ),
        (
            "a diagnose threshold of -1",
            job(pb::JobSpec { diagnose: diagnose(-1.0), ..spec() }),
            invalid,
            "spec.diagnose.repetition_threshold",
        ),
        ("an unknown kind", job(pb::JobSpec { kind: 99, ..spec() }), invalid, "spec.kind"),
        ("an unknown backend", job(pb::JobSpec { backend: 99, ..spec() }), invalid, "spec.backend"),
        (
            "an unknown baseline",
            job(pb::JobSpec { reward: reward(|r| r.baseline = 99), ..spec() }),
            invalid,
            "spec.reward.baseline",
        ),
        (
            "an unknown return method",
            job(pb::JobSpec { reward: reward(|r| r.return_method = -1), ..spec() }),
            invalid,
            "spec.reward.return_method",
        ),
        (
            "an unknown estimator",
            job(pb::JobSpec { reward: reward(|r| r.estimator = 1000), ..spec() }),
            invalid,
            "spec.reward.estimator",
        ),
        ("levels of inline tasks", job(pb::JobSpec { levels: vec![0, u32::MAX], ..spec() }), invalid, "spec.levels"),
        (
            "a task_set that does not exist",
            job(pb::JobSpec { task_set: "/nonexistent/kernelbench".into(), tasks: Vec::new(), ..spec() }),
            invalid,
            "spec.task_set",
        ),
        (
            "a JSONL task_set that does not exist",
            job(pb::JobSpec { task_set: "/nonexistent/tasks.jsonl".into(), tasks: Vec::new(), ..spec() }),
            invalid,
            "spec.task_set",
        ),
        (
            "a task_set path of 1 MB",
            job(pb::JobSpec { task_set: format!("/{}", "a".repeat(MB)), tasks: Vec::new(), ..spec() }),
            invalid,
            "spec.task_set",
        ),
        ("an empty model", job(pb::JobSpec { model: String::new(), ..spec() }), invalid, "spec.model"),
        (
            "an idempotency key of 1 MB",
            pb::SubmitJobRequest { spec: Some(spec()), idempotency_key: "k".repeat(MB) },
            invalid,
            "idempotency_key",
        ),
        (
            "an idempotency key with a NUL",
            pb::SubmitJobRequest { spec: Some(spec()), idempotency_key: "key\0".into() },
            invalid,
            "idempotency_key",
        ),
        (
            "more turns than alice's quota (40 an hour)",
            job(pb::JobSpec { trajectories_per_task: 2, turns: 32, ..spec() }),
            Code::ResourceExhausted,
            "caller `alice` is over its quota",
        ),
    ];
    for (row, request, code, field) in submissions {
        assert_refused(row, alice.submit_job(request).await, code, field);
    }

    let episodes: Vec<(&str, pb::StartEpisodeRequest, Code, &str)> = vec![
        ("turns 0", pb::StartEpisodeRequest { turns: 0, ..episode() }, invalid, "turns"),
        ("turns u32::MAX", pb::StartEpisodeRequest { turns: u32::MAX, ..episode() }, invalid, "turns"),
        ("no task", pb::StartEpisodeRequest { task: None, ..episode() }, invalid, "task"),
        (
            "a task of 10 MB",
            pb::StartEpisodeRequest { task: Some(big_task(10 * MB)), ..episode() },
            invalid,
            "task.source",
        ),
        (
            "a task that is not one",
            pb::StartEpisodeRequest {
                task: Some(pb::Task { task_id: "a".into(), source: "int main;".into() }),
                ..episode()
            },
            invalid,
            "task.source",
        ),
        ("an empty recipe", pb::StartEpisodeRequest { recipe: String::new(), ..episode() }, invalid, "recipe"),
        ("an unknown recipe", pb::StartEpisodeRequest { recipe: "grpo".into(), ..episode() }, invalid, "recipe"),
        ("cudaforge", pb::StartEpisodeRequest { recipe: "cudaforge".into(), ..episode() }, invalid, "recipe"),
        ("an unknown backend", pb::StartEpisodeRequest { backend: -5, ..episode() }, invalid, "backend"),
        (
            "a Kevin weight of NaN",
            pb::StartEpisodeRequest { reward: reward(|r| r.formula = kevin(f64::NAN)), ..episode() },
            invalid,
            "reward.kevin.correctness_weight",
        ),
        (
            "an idempotency key of 1 MB",
            pb::StartEpisodeRequest { idempotency_key: "k".repeat(MB), ..episode() },
            invalid,
            "idempotency_key",
        ),
        (
            "more turns than alice's quota",
            pb::StartEpisodeRequest { turns: 32, ..episode() },
            Code::Ok,
            "accepted: 32 of 40",
        ),
    ];
    for (row, request, code, field) in episodes {
        if code == Code::Ok {
            alice.start_episode(request).await.unwrap_or_else(|status| panic!("{row}: {status:?}"));
            continue;
        }
        assert_refused(row, alice.start_episode(request).await, code, field);
    }
    assert_refused(
        "an episode past alice's quota",
        alice.start_episode(pb::StartEpisodeRequest { turns: 9, ..episode() }).await,
        Code::ResourceExhausted,
        "caller `alice` is over its quota",
    );
    let jobs = alice.list_jobs(pb::ListJobsRequest::default()).await.expect("listed").into_inner().jobs;
    assert_eq!(jobs.len(), 1, "only the one episode accepted is stored: {jobs:?}");

    // Ids no job has: empty is INVALID_ARGUMENT, longer than any id is too, the rest NOT_FOUND; each names the
    // field (or the job, within the message's bound).
    let ids = [
        String::new(),
        "j".repeat(MB),
        "../../etc/passwd".into(),
        "job\0id".into(),
        "' OR 1=1 --".into(),
        "%s%n{}\u{202e}🙂".into(),
        "\n".into(),
    ];
    for id in ids {
        let expect = |row: &str| {
            let code = match id.as_str() {
                "" => invalid,
                id if id.len() > 128 || id.chars().any(char::is_control) => invalid,
                _ => Code::NotFound,
            };
            let field = if code == Code::NotFound { "not found" } else { "job_id" };
            (format!("{row} of {} bytes", id.len()), code, field)
        };
        let (row, code, field) = expect("GetJob");
        assert_refused(&row, alice.get_job(pb::GetJobRequest { job_id: id.clone() }).await, code, field);
        let (row, code, field) = expect("CancelJob");
        assert_refused(&row, alice.cancel_job(pb::CancelJobRequest { job_id: id.clone() }).await, code, field);
        let (row, code, field) = expect("ResumeJob");
        assert_refused(&row, alice.resume_job(pb::ResumeJobRequest { job_id: id.clone() }).await, code, field);
        let (row, code, field) = expect("WatchJob");
        assert_refused(
            &row,
            first(alice.watch_job(pb::WatchJobRequest { job_id: id.clone() }).await).await,
            code,
            field,
        );
        let (row, code, field) = expect("ExportSamples");
        let export = pb::ExportSamplesRequest { job_id: id.clone(), ..Default::default() };
        assert_refused(&row, first(alice.export_samples(export).await).await, code, field);
        let (row, code, field) = expect("ListTrajectories");
        let list = pb::ListTrajectoriesRequest { job_id: id.clone(), ..Default::default() };
        assert_refused(&row, alice.list_trajectories(list).await, code, field);
    }
    assert_refused(
        "an export cursor of 1 MB",
        alice
            .export_samples(pb::ExportSamplesRequest {
                job_id: jobs[0].job_id.clone(),
                cursor: "c".repeat(MB),
                limit: 0,
            })
            .await,
        invalid,
        "cursor",
    );
    assert_refused(
        "a page token of 1 MB",
        alice.list_jobs(pb::ListJobsRequest { page_token: "9".repeat(MB), ..Default::default() }).await,
        invalid,
        "page_token",
    );
    assert_eq!(alice.list_jobs(pb::ListJobsRequest::default()).await.expect("listed").into_inner().jobs.len(), 1);

    running.shutdown().await;
}

fn job(spec: pb::JobSpec) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() }
}

/// A stream's first message, or the status that refused it.
async fn first<T>(
    response: Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>,
) -> Result<Option<T>, tonic::Status> {
    response?.into_inner().message().await
}
