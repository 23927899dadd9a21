//! The main job end to end: the gateway (replay), evaluator (CPU backend, the repository's venv), reward and
//! orchestrator services in this process on ephemeral ports, driven through the orchestrator's gRPC API as
//! `kforge run` drives it; and `kforge run` itself, the real binary on the embedded default.

use std::path::{Path, PathBuf};
use std::process::Command;

use kforge::mesh::{Mesh, MeshConfig, Service};
use kforge_gateway::config::{BackendConfig, BackendKind, PoolConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_test_support::ReservedPort;
use support::{python, start_mesh, submit_and_follow};

use crate::support;

/// The evaluator's caches for one test, under cargo's target directory.
fn evaluator_work_dir(test: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-run-evaluator-{test}"))
}

/// `kforge ARGS` with the environment of these tests (the venv, the evaluator's caches) and its store in
/// `dir/orchestrator.db`, run to its end.
fn kforge_on_store(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kforge"))
        .args(args)
        .env("KFORGE__ORCHESTRATOR__STORE", dir.join("orchestrator.db"))
        .env("KFORGE__EVALUATOR__PYTHON", python())
        .env("KFORGE__EVALUATOR__WORK_DIR", evaluator_work_dir("binary"))
        .env("KFORGE__EVALUATOR__BINDINGS_PCH", "false")
        .output()
        .expect("kforge runs")
}

const RELU_TIMES_TWO: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n";
const RELU_TORCH: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n";
const GELU_TANH: &str = include_str!("../../../examples/tasks/gelu_tanh/candidates/builtin.py");

/// A replay record: (task, trajectory, turn) answered with `reasoning` and `text`.
fn record(task: &str, trajectory: u32, turn: u32, reasoning: &str, text: &str) -> String {
    serde_json::json!({
        "task_id": task, "trajectory": trajectory, "turn": turn,
        "completions": [{"reasoning": reasoning, "text": text}],
    })
    .to_string()
}

fn fenced(kernel: &str) -> String {
    format!("Here is ModelNew.\n\n```python\n{kernel}```\n")
}

/// relu/0: a wrong kernel, then a fix; relu/1: no kernel (and a reasoning without the expected opening), then a
/// kernel; gelu_tanh/0: correct, then wrong; gelu_tanh/1: wrong, then no record at all (the gateway's NOT_FOUND is
/// recorded in the turn and ends that episode, not the job).
fn replay_file(dir: &Path) -> PathBuf {
    let lines = [
        record("examples/relu", 0, 0, "Okay, relu.", &fenced(RELU_TIMES_TWO)),
        record("examples/relu", 0, 1, "Okay, fix it.", &fenced(RELU_TORCH)),
        record("examples/relu", 1, 0, "Hmm.", "I am not sure how to write this."),
        record("examples/relu", 1, 1, "Okay, now with code.", &fenced(RELU_TORCH)),
        record("examples/gelu_tanh", 0, 0, "Okay, gelu.", &fenced(GELU_TANH)),
        record("examples/gelu_tanh", 0, 1, "Okay, faster.", &fenced(RELU_TIMES_TWO)),
        record("examples/gelu_tanh", 1, 0, "Okay, gelu.", &fenced(RELU_TIMES_TWO)),
    ];
    std::fs::create_dir_all(dir).expect("replay dir");
    let file = dir.join("replay.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").expect("replay written");
    file
}

fn mesh_config(replay: PathBuf) -> MeshConfig {
    let mut config = MeshConfig::default();
    config.orchestrator.store = "sqlite::memory:".into();
    config.evaluator.python = python();
    config.evaluator.work_dir = evaluator_work_dir("mesh");
    kforge::run::evaluator_for_one_job(&mut config, false);
    config.gateway.pools.push(PoolConfig {
        model: "recorded".into(),
        backends: vec![BackendConfig { kind: BackendKind::Replay, file: Some(replay), ..Default::default() }],
        ..Default::default()
    });
    config
}

fn verdicts(trajectory: &pb::Trajectory) -> Vec<String> {
    trajectory.turns.iter().map(|t| kforge::run::verdict_name(t.verdict)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kevin_job_runs_every_turn_through_the_services_and_reports_its_metrics() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-kevin");
    let config = mesh_config(replay_file(&dir));
    let (mesh, mut orchestrator) = start_mesh(&config).await;

    let spec = pb::JobSpec {
        kind: pb::JobKind::Evaluation.into(),
        recipe: "kevin".into(),
        task_set: "examples".into(),
        model: "recorded".into(),
        trajectories_per_task: 2,
        turns: 2,
        backend: pb::Backend::Cpu.into(),
        max_tasks: 2,
        correctness_trials: 2,
        ..Default::default()
    };
    let submitted = orchestrator
        .submit_job(pb::SubmitJobRequest { spec: Some(spec.clone()), idempotency_key: "kevin-test".into() })
        .await
        .expect("submitted")
        .into_inner();
    assert_eq!((submitted.episodes_total, submitted.turns_total), (4, 8));
    let again = orchestrator
        .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: "kevin-test".into() })
        .await
        .expect("resubmitted")
        .into_inner();
    assert_eq!(again.job_id, submitted.job_id, "the idempotency key returns the existing job");

    let mut seen = Vec::new();
    let job = kforge::run::follow(&mut orchestrator, &submitted.job_id, |progress| {
        seen.push(progress.job.as_ref().map_or(0, |job| job.turns_done))
    })
    .await
    .expect("watched to the end");
    assert_eq!(job.state, pb::JobState::Succeeded as i32, "{job:#?}");
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "progress never goes back: {seen:?}");
    assert_eq!((job.turns_done, job.episodes_done), (8, 4));

    let trajectories = kforge::run::trajectories(&mut orchestrator, &job.job_id).await.expect("listed");
    let ids: Vec<&str> = trajectories.iter().map(|t| t.trajectory_id.as_str()).collect();
    let id = |rest: &str| format!("{}/{rest}", job.job_id);
    assert_eq!(
        ids,
        [id("examples/relu/0"), id("examples/relu/1"), id("examples/gelu_tanh/0"), id("examples/gelu_tanh/1")]
    );
    let by_verdict: Vec<Vec<String>> = trajectories.iter().map(verdicts).collect();
    assert_eq!(
        by_verdict,
        [["incorrect", "correct"], ["-", "correct"], ["correct", "incorrect"], ["incorrect", "-"]],
        "{trajectories:#?}"
    );

    let relu = &trajectories[0].turns;
    assert_eq!(relu[0].kernel, RELU_TIMES_TWO);
    assert_eq!(relu[0].score, Some(0.0), "a wrong kernel scores 0");
    assert!(relu[0].feedback.starts_with("incorrect"), "{}", relu[0].feedback);
    // Kevin's second turn shows the first kernel and its evaluation.
    let second_prompt = &relu[1].prompt.last().expect("a user message").content;
    assert!(second_prompt.contains("Attempt 1:") && second_prompt.contains("return x * 2"), "{second_prompt}");
    assert!(second_prompt.contains(&relu[0].feedback), "{second_prompt}");
    for turn in trajectories.iter().flat_map(|t| &t.turns).filter(|t| t.verdict == pb::Verdict::Correct as i32) {
        let speedup = turn.speedup.expect("a correct kernel is timed");
        assert!(speedup > 0.0);
        assert!(turn.score.is_some_and(|s| s >= 0.3), "Kevin's score of a correct kernel: {:?}", turn.score);
        assert_eq!(turn.flags.as_ref().map(|f| (f.junk, f.not_okay)), Some((false, false)));
    }
    // No kernel: out of kevin's strict format, so not evaluated and scored 0, told why.
    let no_kernel = &trajectories[1].turns[0];
    assert_eq!((no_kernel.kernel.as_str(), no_kernel.evaluation.is_none(), no_kernel.score), ("", true, Some(0.0)));
    assert_eq!(no_kernel.format_error, "the answer has no fenced code block");
    let flags = no_kernel.flags.clone().expect("diagnosed");
    assert!(flags.junk && flags.no_kernel && flags.not_okay, "{flags:?}");
    // Kevin's credit at the job's end: returns by discounted sum (gamma 0.4), GRPO advantages over the task's
    // samples (centred: they sum to 0), nothing for the turn that failed on the way.
    let score = |turn: &pb::TurnRecord| turn.score.unwrap_or(0.0);
    let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
    assert!(close(relu[1].return_value, score(&relu[1])), "{:?}", relu[1].return_value);
    assert!(close(relu[0].return_value, score(&relu[0]) + 0.4 * score(&relu[1])), "{:?}", relu[0].return_value);
    let relu_advantages: Vec<f64> =
        trajectories[..2].iter().flat_map(|t| &t.turns).filter_map(|t| t.advantage).collect();
    assert_eq!(relu_advantages.len(), 4);
    assert!(relu_advantages.iter().sum::<f64>().abs() < 1e-9, "{relu_advantages:?}");
    let missing = &trajectories[3].turns[1];
    assert_eq!((missing.return_value, missing.advantage), (None, None), "a failed turn gets no credit");
    assert!(
        missing.error.starts_with("gateway: NotFound")
            || missing.error.contains("NOT_FOUND")
            || missing.error.contains("not found"),
        "{}",
        missing.error
    );

    let metrics = job.metrics.expect("metrics");
    // Response ratios count the 7 turns with a response: the gateway's NOT_FOUND left one turn without any.
    assert_eq!((metrics.turns, metrics.evaluated, metrics.correct, metrics.no_kernel), (8, 6, 3, 1));
    assert_eq!(metrics.correctness, 0.5);
    assert_eq!((metrics.junk, metrics.not_okay, metrics.hacks, metrics.infra_errors), (1, 1, 0, 0));
    let format = metrics.overall.as_ref().and_then(|o| o.format_error).expect("kevin holds responses to the format");
    assert_eq!((metrics.format_errors, format.numerator, format.denominator), (1, 1, 7));
    assert_eq!(metrics.junk_ratio, 1.0 / 7.0);
    let by_turn: Vec<(u32, u64)> =
        metrics.by_turn.iter().map(|t| (t.turn, t.rates.as_ref().map_or(0, |r| r.turns))).collect();
    assert_eq!(by_turn, [(0, 4), (1, 4)]);
    let fast_1 = trajectories
        .iter()
        .flat_map(|t| &t.turns)
        .filter(|t| t.verdict == pb::Verdict::Correct as i32 && t.speedup.is_some_and(|s| s > 1.0))
        .count();
    assert_eq!(metrics.fast_p["1"], fast_1 as f64 / 6.0);
    assert!(metrics.mean_speedup > 0.0 && metrics.wall_time_s > 0.0);

    let report = kforge::run::report(&job_snapshot(&mut orchestrator, &job.job_id).await, &trajectories);
    assert!(report.contains("incorrect,correct | -,correct"), "{report}");
    mesh.shutdown().await.expect("drains");
}

/// A job of the first example task (relu), one trajectory of `turns` turns, on the CPU, answered by `recorded`.
fn relu_job(recipe: &str, turns: u32) -> pb::JobSpec {
    pb::JobSpec {
        kind: pb::JobKind::Evaluation.into(),
        recipe: recipe.into(),
        task_set: "examples".into(),
        model: "recorded".into(),
        trajectories_per_task: 1,
        turns,
        backend: pb::Backend::Cpu.into(),
        max_tasks: 1,
        correctness_trials: 2,
        ..Default::default()
    }
}

/// Starts the evaluator, reward, gateway and orchestrator in-process with `config`, submits `spec` and follows the
/// job to its end: the mesh (to shut down), the finished job and its trajectories.
async fn run_job(config: &MeshConfig, spec: pb::JobSpec) -> (Mesh, pb::Job, Vec<pb::Trajectory>) {
    let (mesh, mut orchestrator) = start_mesh(config).await;
    let (job, trajectories) = submit_and_follow(&mut orchestrator, spec).await;
    (mesh, job, trajectories)
}

/// drkernel through the real services (CPU backend): every evaluation counts its kernels, the reward service scores
/// a correct kernel with the Dr. Kernel formula and the census's profiling ratio, and the feedback shows the census.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drkernel_job_is_scored_with_the_census_profiling_ratio() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-drkernel");
    let config = mesh_config(replay_file(&dir));
    let (mesh, job, trajectories) = run_job(&config, relu_job("drkernel", 2)).await;
    assert_eq!(job.state, pb::JobState::Succeeded as i32, "{job:#?}");
    let turns = &trajectories[0].turns;
    assert_eq!(verdicts(&trajectories[0]), ["incorrect", "correct"], "{turns:#?}");
    let correct = &turns[1];
    assert_eq!(correct.error, "", "the reward service took the outcome with its profiling ratio");
    let evaluation = correct.evaluation.as_ref().expect("evaluated");
    assert!(!evaluation.kernels.is_empty(), "the evaluation counted what ran: {evaluation:?}");
    assert!(correct.score.is_some_and(|s| s >= 1.0), "w_c of a correct kernel at least: {:?}", correct.score);
    assert!(correct.feedback.contains("Profiling ratio"), "{}", correct.feedback);
    mesh.shutdown().await.expect("drains");
}

/// The model's expected opening is the job's (`JobSpec.diagnose`), through the real reward service: relu/0's
/// reasonings open with "Okay", so a job expecting "Hmm" flags both turns not-okay, and a job with the check off
/// flags none and leaves the not-okay ratio without a denominator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_not_okay_opening_is_the_jobs() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-opening");
    let (mesh, mut orchestrator) = start_mesh(&mesh_config(replay_file(&dir))).await;
    for (diagnose, flagged, overall) in [
        (pb::DiagnoseParams { opening: Some("Hmm".into()), ..Default::default() }, [true, true], Some((2, 2))),
        (pb::DiagnoseParams { not_okay_off: true, ..Default::default() }, [false, false], None),
    ] {
        let spec = pb::JobSpec { diagnose: Some(diagnose), ..relu_job("kevin", 2) };
        let (job, trajectories) = submit_and_follow(&mut orchestrator, spec).await;
        assert_eq!(job.state, pb::JobState::Succeeded as i32, "{job:#?}");
        let flags: Vec<bool> =
            trajectories[0].turns.iter().map(|t| t.flags.as_ref().expect("diagnosed").not_okay).collect();
        assert_eq!(flags, flagged);
        let metrics = job.metrics.expect("metrics");
        let not_okay = metrics.overall.and_then(|o| o.not_okay).map(|r| (r.numerator, r.denominator));
        assert_eq!(not_okay, overall, "the not-okay ratio's counts");
    }
    mesh.shutdown().await.expect("drains");
}

const SYNTAX_ERROR: &str =
    "import torch\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x)\n        return x\n";

/// A cudaforge job through the services in-process, the Coder and the Judge as two replayed models: relu/0 is a
/// wrong kernel (the Judge answers in prose, not JSON), a syntax error (the Judge answers with its JSON inside
/// prose), then a correct kernel (the last turn: not reviewed). On the CPU backend there is no profile: a correct
/// kernel that is not the last would get correction-only feedback (the binary test below shows it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cudaforge_job_carries_the_judges_review_and_only_the_last_kernel() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-cudaforge");
    std::fs::create_dir_all(&dir).expect("dir");
    let coder = dir.join("coder.jsonl");
    let lines = [
        record("examples/relu", 0, 0, "Okay.", &fenced(RELU_TIMES_TWO)),
        record("examples/relu", 0, 1, "Okay.", &fenced(SYNTAX_ERROR)),
        record("examples/relu", 0, 2, "Okay.", &fenced(RELU_TORCH)),
    ];
    std::fs::write(&coder, lines.join("\n") + "\n").expect("written");
    let judge = dir.join("judge.jsonl");
    let review = |turn: u32, text: &str| {
        serde_json::json!({
            "task_id": "examples/relu", "trajectory": 0, "turn": turn,
            "completions": [{"text": text}], "usage": {"prompt_tokens": 100, "completion_tokens": 10},
        })
        .to_string()
    };
    let advice = "The issue is plain.\n```json\n{\"critical_issue\": \"the def line lacks its colon\", \
                  \"why_it_matters\": \"Python cannot parse the class\", \"minimal_fix_hint\": \"end the def line with :\"}\n```";
    let reviews = [review(0, "It doubles instead of clamping; use relu."), review(1, advice)];
    std::fs::write(&judge, reviews.join("\n") + "\n").expect("written");
    let mut config = mesh_config(coder);
    config.gateway.pools.push(PoolConfig {
        model: "judge".into(),
        backends: vec![BackendConfig { kind: BackendKind::Replay, file: Some(judge), ..Default::default() }],
        ..Default::default()
    });
    let spec = pb::JobSpec { judge_model: "judge".into(), ..relu_job("cudaforge", 3) };
    let (mesh, job, trajectories) = run_job(&config, spec).await;
    assert_eq!(job.state, pb::JobState::Succeeded as i32, "{job:#?}");
    let turns = &trajectories[0].turns;
    assert_eq!(verdicts(&trajectories[0]), ["incorrect", "compile_error", "correct"], "{turns:#?}");

    // Turn 0: the Judge was asked in correction mode and answered in prose: recorded, not fatal.
    let first = turns[0].judge.as_ref().expect("turn 0 reviewed");
    assert_eq!(first.mode, pb::JudgeMode::Correction as i32);
    assert!(first.error.starts_with("malformed answer: no JSON object"), "{first:?}");
    let user = |turn: &pb::TurnRecord| turn.prompt.last().expect("a user message").content.clone();
    assert!(first.prompt.last().expect("judge prompt").content.contains("return x * 2"), "the judge sees the kernel");
    assert!(turns[0].feedback.contains("(No review: the reviewer's answer was malformed.)"), "{}", turns[0].feedback);
    assert!(user(&turns[1]).contains("return x * 2") && user(&turns[1]).contains("incorrect"), "{}", user(&turns[1]));

    // Turn 1: the advice read from inside the prose, shown to turn 2 with the evaluation; turn 0's kernel is not.
    let second = turns[1].judge.as_ref().expect("turn 1 reviewed");
    assert_eq!((second.mode, second.error.as_str()), (pb::JudgeMode::Correction as i32, ""));
    let parsed: serde_json::Value = serde_json::from_str(&second.advice_json).expect("advice is JSON");
    assert_eq!(parsed["minimal_fix_hint"], "end the def line with :");
    let third = user(&turns[2]);
    assert!(third.contains("Reviewer (correction):\n- Critical issue: the def line lacks its colon"), "{third}");
    assert!(
        third.contains("def forward(self, x)\n") && !third.contains("return x * 2"),
        "only the last kernel: {third}"
    );
    assert!(turns[2].judge.is_none(), "the last turn is not reviewed: no turn reads it");

    // The Judge's tokens count in the job's usage (the replayed coder reports none).
    let usage = job.metrics.and_then(|m| m.usage).expect("usage");
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (200, 20));
    mesh.shutdown().await.expect("drains");
}

/// `kforge run --recipe cudaforge` on the embedded default (its first task, relu, on the CPU): three turns of the
/// embedded story (correct, a compile error the replayed Judge corrects, the fix), correction-only feedback for the
/// correct first kernel, and the report.
#[test]
fn kforge_run_cudaforge_on_the_embedded_default() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-cudaforge-binary");
    let _ = std::fs::remove_dir_all(&dir);
    let kforge = |args: &[&str]| kforge_on_store(&dir, args);
    let one_relu_trajectory = ["--tasks", "examples", "--trajectories", "1", "--max-tasks", "1"];
    let output = kforge(&[&["run", "--recipe", "cudaforge", "--backend", "cpu"], &one_relu_trajectory[..]].concat());
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("[3/3 turns, 1/1 episodes]"), "{stderr}");
    let row = stdout.lines().find(|l| l.starts_with("examples/relu")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(row.contains("correct,compile_error,correct"), "{row}");
    assert!(stdout.contains("report: "), "{stdout}");

    let job_id = stdout.lines().next().and_then(|l| l.split_whitespace().nth(1)).expect("job id").to_owned();
    let samples = dir.join("samples.jsonl");
    let exported = kforge(&["export", &job_id, "--out", samples.to_str().expect("utf-8")]);
    assert!(exported.status.success(), "{}", String::from_utf8_lossy(&exported.stderr));
    let samples: Vec<serde_json::Value> = std::fs::read_to_string(&samples)
        .expect("written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one json object per line"))
        .collect();
    assert_eq!(samples.len(), 3);
    // Turn 0 is correct on the CPU: no profile, so no review, and the sample says why.
    let first = &samples[0]["judge"];
    assert_eq!(first["mode"], "JUDGE_MODE_NONE", "{first}");
    assert!(first["profile_note"].as_str().is_some_and(|n| n.contains("CPU")), "{first}");
    // Turn 1's compile error is reviewed with the embedded story's answer, which turn 2's prompt shows.
    assert_eq!(samples[1]["judge"]["mode"], "JUDGE_MODE_CORRECTION", "{}", samples[1]);
    assert!(samples[1]["judge"]["advice_json"].as_str().is_some_and(|a| a.contains("`len`")), "{}", samples[1]);
    let prompt = samples[2]["prompt"].to_string();
    assert!(prompt.contains("Minimal fix") && prompt.contains("i + 4 <= n"), "{prompt}");
    assert!(samples[2]["judge"].is_null(), "the last turn is not reviewed: {}", samples[2]);
}

async fn job_snapshot(client: &mut OrchestratorClient<kforge_server::client::Channel>, job_id: &str) -> pb::Job {
    client.get_job(pb::GetJobRequest { job_id: job_id.into() }).await.expect("get").into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_jobs_are_refused_naming_the_field() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-refused");
    let mut config = mesh_config(replay_file(&dir));
    // Only the orchestrator runs here, and its peers' address is a reserved port: nothing listens there.
    let closed = ReservedPort::new();
    config.orchestrator.peers.gateway = closed.url();
    let mesh = Mesh::start(&[Service::Orchestrator], &config, true).await.expect("the mesh starts");
    let channel =
        kforge_server::client::connect(mesh.address(Service::Orchestrator).expect("runs"), &Default::default())
            .await
            .expect("connects");
    let mut orchestrator = OrchestratorClient::new(channel);
    let spec = pb::JobSpec {
        kind: pb::JobKind::Evaluation.into(),
        recipe: "single-turn".into(),
        task_set: "examples".into(),
        model: "recorded".into(),
        trajectories_per_task: 1,
        turns: 1,
        ..Default::default()
    };
    let refused = |spec: pb::JobSpec| {
        let mut client = orchestrator.clone();
        async move { client.submit_job(pb::SubmitJobRequest { spec: Some(spec), ..Default::default() }).await }
    };
    let status = refused(pb::JobSpec { turns: 0, ..spec.clone() }).await.expect_err("n = 0");
    assert_eq!((status.code(), status.message()), (tonic::Code::InvalidArgument, "spec.turns: must be at least 1"));
    let status = refused(pb::JobSpec { recipe: "nope".into(), ..spec.clone() }).await.expect_err("unknown recipe");
    assert!(status.message().starts_with("spec.recipe: unknown recipe"), "{status:?}");
    let diagnose = |opening: Option<&str>, off: bool| pb::DiagnoseParams {
        opening: opening.map(str::to_owned),
        repetition_threshold: None,
        not_okay_off: off,
    };
    let status = refused(pb::JobSpec { diagnose: Some(diagnose(Some("Okay"), true)), ..spec.clone() })
        .await
        .expect_err("an opening with not-okay detection off");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().starts_with("spec.diagnose.opening: must be unset"), "{status:?}");
    let status = refused(pb::JobSpec { diagnose: Some(diagnose(Some(" "), false)), ..spec.clone() })
        .await
        .expect_err("an empty opening");
    assert!(status.message().starts_with("spec.diagnose.opening: empty"), "{status:?}");
    let status = refused(spec).await.expect_err("no peers");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().starts_with(&format!("gateway at {} is unavailable", closed.url())), "{status:?}");
    let status = orchestrator.get_job(pb::GetJobRequest { job_id: "job-none".into() }).await.expect_err("unknown");
    assert_eq!(status.code(), tonic::Code::NotFound);
    mesh.shutdown().await.expect("drains");
}

/// `kforge run` as a new user runs it: the tour (kevin, two trajectories of three turns over two example tasks)
/// through every service, a progress line per turn, the report on stdout and in report.json and report.html, exit
/// 0. Each turn of the stories gets the verdict its story tells (a kernel made faster, a junk answer, a compile
/// error fixed, a wrong answer corrected, a hack caught), the report's figures follow from the stored turns, and
/// the replay's tokens are priced at the labelled example prices.
#[test]
fn kforge_run_on_the_embedded_default_tells_the_tour() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-binary");
    let _ = std::fs::remove_dir_all(&dir);
    let kforge = |args: &[&str]| kforge_on_store(&dir, args);
    let output = kforge(&["run", "--backend", "cpu"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("[12/12 turns, 4/4 episodes] correct 8/11 evaluated"), "{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    let job_id = first.strip_prefix("job ").and_then(|l| l.strip_suffix(" succeeded"));
    let job_id = job_id.unwrap_or_else(|| panic!("the report opens with the job: {stdout}")).to_owned();
    let row = |task: &str| stdout.lines().find(|l| l.starts_with(task)).unwrap_or_else(|| panic!("{task}: {stdout}"));
    // Trajectory 0 gets faster turn by turn; trajectory 1 answers with junk (no kernel), then a syntax error, then
    // the fix.
    assert!(row("examples/gelu_tanh").contains("correct,correct,correct | -,compile_error,correct"), "{stdout}");
    // Trajectory 0 corrects a wrong answer; trajectory 1 writes into its input, is caught, and goes back.
    assert!(row("examples/scaled_add").contains("incorrect,correct,correct | correct,hack,correct"), "{stdout}");
    assert!(stdout.contains("totals: 12 turns, 11 evaluated, 8 correct (72.7%)"), "{stdout}");
    assert!(stdout.contains("hacks 1, junk 1, not-okay 0, no kernel 1, infra errors 0"), "{stdout}");
    assert!(stdout.contains("priced at example prices: $0.5 / $1.5 per million"), "{stdout}");

    // The report's figures are the stored turns': the samples exported from the store, counted here.
    let samples_file = dir.join("samples.jsonl");
    let exported = kforge(&["export", &job_id, "--out", samples_file.to_str().expect("utf-8")]);
    assert!(exported.status.success(), "{}", String::from_utf8_lossy(&exported.stderr));
    let samples: Vec<serde_json::Value> = std::fs::read_to_string(&samples_file)
        .expect("written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one json object per line"))
        .collect();
    assert_eq!(samples.len(), 12);
    let line = stdout.lines().find_map(|l| l.strip_prefix("report: ")).unwrap_or_else(|| panic!("{stdout}"));
    let html = Path::new(line.split(" (").next().expect("the html path"));
    assert!(html.starts_with(dir.join("reports")) && html.ends_with("report.html"), "{line}");
    let page = std::fs::read_to_string(html).expect("report.html written");
    assert!(page.contains("<svg") && !page.contains("<script src"), "a self-contained page with plots");
    assert!(page.contains("Priced at example prices"), "the cost panel names its prices as examples");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(html.with_file_name("report.json")).expect("report.json written"))
            .expect("report.json is JSON");
    let by_turn = report["metrics"]["by_turn"].as_array().expect("by_turn");
    assert_eq!(by_turn.len(), 3, "a point per turn: {by_turn:?}");
    for (turn, rates) in by_turn.iter().enumerate() {
        let of_turn: Vec<&serde_json::Value> = samples.iter().filter(|s| s["turn"] == turn).collect();
        let correct = of_turn.iter().filter(|s| s["verdict"] == "VERDICT_CORRECT").count();
        assert_eq!(rates["rates"]["correct"]["numerator"].as_u64(), Some(correct as u64), "turn {turn}: {rates}");
    }
    // Tokens: the replay's counts for the answers, the prompts counted as sent; kevin's later prompts hold the
    // earlier attempts, so they are longer. The cost is the example prices' on those counts.
    let usage = report["usage_by_turn"].as_array().expect("usage_by_turn");
    let prompt = |turn: usize| usage[turn]["prompt_tokens"].as_u64().expect("prompt tokens");
    assert!(prompt(0) > 0 && prompt(2) > prompt(0), "{usage:?}");
    let cost = &report["metrics"]["cost"];
    let tokens = |key: &str| cost[key].as_f64().expect("a count");
    let priced = (tokens("prompt_tokens") * 0.5 + tokens("completion_tokens") * 1.5) / 1e6;
    let cost_usd = cost["cost_usd"].as_f64().expect("cost");
    assert!(cost_usd > 0.0 && (cost_usd - priced).abs() < 1e-9, "{cost_usd} against {priced}: {cost}");
}

/// `kforge run` killed with SIGKILL after its first turn is recorded, then `kforge run --resume JOB` on the same
/// work directory: the job finishes with both turns, once each, its wall time both runs'; the killed run's scratch
/// directory is removed by the next run; `kforge export --work-dir` writes the turns as JSONL.
#[test]
fn a_killed_kforge_run_resumes_and_its_samples_export_as_jsonl() {
    use std::io::BufRead as _;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-resume");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("work dir");
    // The runs' temporary directory, where each makes its scratch directory: this process's, the runs inherit it
    // (the sandbox's command users are shared through it by every kforge on the host: it is not to be changed here).
    let tmp = std::env::temp_dir();
    let store = dir.join("orchestrator.db");
    let kforge = |args: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kforge"));
        command
            .args(args)
            .env("KFORGE__ORCHESTRATOR__STORE", &store)
            .env("KFORGE__EVALUATOR__PYTHON", python())
            .env("KFORGE__EVALUATOR__WORK_DIR", evaluator_work_dir("resume"))
            .env("KFORGE__EVALUATOR__BINDINGS_PCH", "false");
        command
    };
    let single_turn = ["--recipe", "single-turn", "--tasks", "examples", "--max-tasks", "2"];
    let mut first = kforge(&[&["run"], &single_turn[..], &["--backend", "cpu", "--concurrency", "1"]].concat())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kforge runs");
    let stderr = std::io::BufReader::new(first.stderr.take().expect("piped"));
    let mut job_id = None;
    let mut seen = Vec::new();
    for line in stderr.lines() {
        let line = line.expect("stderr line");
        if let Some(rest) = line.strip_prefix("job ").filter(|l| l.contains(" submitted: ")) {
            job_id = rest.split_whitespace().next().map(str::to_owned);
        }
        seen.push(line.clone());
        if line.starts_with("[1/2 turns") {
            break;
        }
    }
    let killed_scratch = tmp.join(format!("kforge-run-{}", first.id()));
    first.kill().expect("SIGKILL");
    first.wait().expect("reaped");
    let job_id = job_id.unwrap_or_else(|| panic!("no job id in {seen:#?}"));
    assert!(seen.iter().any(|l| l.starts_with("[1/2 turns")), "killed after the first turn: {seen:#?}");
    assert!(killed_scratch.join("replay.jsonl").exists(), "a killed run leaves its scratch: {killed_scratch:?}");
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let stored_job = || {
        runtime.block_on(async {
            let store = kforge_orchestrator::store::Store::open(store.to_str().expect("utf-8")).await.expect("opens");
            let job = store.job(&job_id).await.expect("read").expect("stored");
            (job, store.turns(&job_id).await.expect("read"))
        })
    };
    let first_run_s = stored_job().0.metrics.expect("metrics").wall_time_s;
    assert!(first_run_s > 0.0, "the killed run's time, as its last snapshot stored it");

    let resumed = kforge(&["run", "--resume", &job_id])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kforge runs");
    let own_scratch = tmp.join(format!("kforge-run-{}", resumed.id()));
    let resumed = resumed.wait_with_output().expect("kforge exits");
    let (stdout, stderr) = (String::from_utf8_lossy(&resumed.stdout), String::from_utf8_lossy(&resumed.stderr));
    assert!(resumed.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains(&format!("job {job_id} resumed")), "{stderr}");
    assert!(stdout.starts_with(&format!("job {job_id} succeeded")), "{stdout}");
    assert!(stdout.contains("totals: 2 turns, 2 evaluated, 2 correct (100.0%)"), "{stdout}");
    // The next run removed the killed run's scratch, and its own on its way out.
    assert!(!killed_scratch.exists() && !own_scratch.exists(), "{killed_scratch:?} {own_scratch:?}");
    // The wall time is both runs': the killed one's and the resumed one's, which ran the second turn.
    let (job, turns) = stored_job();
    let second_turn_s = turns.iter().find(|t| t.task_id == "examples/gelu_tanh").expect("recorded").wall_time_s;
    let wall_time_s = job.metrics.expect("metrics").wall_time_s;
    assert!(wall_time_s >= first_run_s + second_turn_s, "{wall_time_s} < {first_run_s} + {second_turn_s}");
    let reported: f64 = stdout
        .split(", wall ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|seconds| seconds.parse().ok())
        .unwrap_or_else(|| panic!("a wall time in the totals: {stdout}"));
    assert!((reported - wall_time_s).abs() <= 0.051, "the report's: {reported} against {wall_time_s}");

    // `--work-dir` names the store, as `kforge run --work-dir` does (the variable is not read).
    let export = |args: &[&str]| {
        let mut command = kforge(&["export", &job_id, "--work-dir", dir.to_str().expect("utf-8")]);
        command.args(args).env_remove("KFORGE__ORCHESTRATOR__STORE");
        command.output().expect("kforge runs")
    };
    let samples = dir.join("samples.jsonl");
    let exported = export(&["--out", samples.to_str().expect("utf-8")]);
    assert!(exported.status.success(), "{}", String::from_utf8_lossy(&exported.stderr));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&samples)
        .expect("written")
        .lines()
        .map(|l| serde_json::from_str(l).expect("one json object per line"))
        .collect();
    let tasks: Vec<&str> = lines.iter().map(|s| s["task_id"].as_str().expect("task_id")).collect();
    assert_eq!(tasks, ["examples/relu", "examples/gelu_tanh"], "one sample per turn, in the job's order");
    for sample in &lines {
        assert_eq!(sample["job_id"], job_id.as_str());
        assert_eq!(sample["verdict"], "VERDICT_CORRECT", "{sample}");
        assert!(sample["kernel"].as_str().is_some_and(|k| k.contains("ModelNew")), "{sample}");
        assert!(sample["score"].as_f64().is_some_and(|s| s >= 0.3), "{sample}");
        assert!(sample["response"]["text"].as_str().is_some_and(|t| t.contains("```python")), "{sample}");
        assert_eq!(sample["trajectory"], 0, "zeros are written, not omitted: {sample}");
    }
    // From the first sample's cursor, only the second follows (appended).
    let cursor = lines[0]["cursor"].as_str().expect("a cursor").to_owned();
    let rest = dir.join("rest.jsonl");
    let exported = export(&["--out", rest.to_str().expect("utf-8"), "--after", &cursor]);
    assert!(exported.status.success(), "{}", String::from_utf8_lossy(&exported.stderr));
    let rest = std::fs::read_to_string(&rest).expect("written");
    assert_eq!(rest.lines().count(), 1, "{rest}");
    assert!(rest.contains("examples/gelu_tanh"), "{rest}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the fake OpenAI-compatible server saw of each chat request: its `Authorization` header and its JSON body.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, serde_json::Value)>>>;

/// A fake vLLM on a free loopback port (served by `runtime`): `GET /health`, and `POST /v1/chat/completions`
/// streamed as vLLM streams it: a reasoning opening with `Okay`, the k-th request's text `answers[k]` (the last
/// one again past the end), then the usage.
fn fake_vllm(runtime: &tokio::runtime::Runtime, answers: Vec<String>) -> (std::net::SocketAddr, Seen) {
    use axum::http::{HeaderMap, header};
    use axum::routing::{get, post};
    let chunk = |value: serde_json::Value| format!("data: {value}\n\n");
    let streams: Vec<String> = answers
        .iter()
        .map(|answer| {
            [
                chunk(serde_json::json!({"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"role": "assistant", "reasoning_content": "Okay, let me see."}}
                ]})),
                chunk(serde_json::json!({"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": answer}, "finish_reason": "stop"}
                ]})),
                chunk(serde_json::json!({"choices": [], "usage": {"prompt_tokens": 300, "completion_tokens": 40}})),
                "data: [DONE]\n\n".to_owned(),
            ]
            .concat()
        })
        .collect();
    let seen = Seen::default();
    let recorded = seen.clone();
    let app = axum::Router::new().route("/health", get(|| async { "" })).route(
        "/v1/chat/completions",
        post(move |headers: HeaderMap, body: String| {
            let recorded = recorded.clone();
            let streams = streams.clone();
            async move {
                let auth = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or_default();
                let body = serde_json::from_str(&body).unwrap_or(serde_json::Value::Null);
                let mut recorded = recorded.lock().expect("not poisoned");
                recorded.push((auth.to_owned(), body));
                let stream = streams[(recorded.len() - 1).min(streams.len() - 1)].clone();
                ([(header::CONTENT_TYPE, "text/event-stream")], stream)
            }
        }),
    );
    let addr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move { axum::serve(listener, app).await.expect("serves") });
        addr
    });
    (addr, seen)
}

/// `kforge run` with the environment of these tests (the venv, the evaluator's caches), `args` and a fresh `work_dir`.
fn kforge_run(work_dir: &Path, args: &[&str]) -> Command {
    let _ = std::fs::remove_dir_all(work_dir);
    let mut command = Command::new(env!("CARGO_BIN_EXE_kforge"));
    command
        .arg("run")
        .args(args)
        .arg("--work-dir")
        .arg(work_dir)
        .env("KFORGE__EVALUATOR__PYTHON", python())
        .env("KFORGE__EVALUATOR__WORK_DIR", evaluator_work_dir("binary"))
        .env("KFORGE__EVALUATOR__BINDINGS_PCH", "false");
    command
}

/// `kforge run` against a real model as a new user points it at one, with flags alone: the model served by an
/// OpenAI-compatible server (a fake vLLM here) at `--model-url`, its key in the variable `--api-key-env` names. The
/// server gets the model's name, the key and the sampling flags; its kernel is evaluated correct; the report prints.
#[test]
fn kforge_run_against_a_model_url_evaluates_its_kernel() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let (addr, seen) = fake_vllm(&runtime, vec![fenced(RELU_TORCH)]);
    let url = format!("http://{addr}/v1");
    let output = kforge_run(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-model-url"),
        &["--model", "fake-model", "--model-url", &url, "--api-key-env", "KFORGE_FAKE_MODEL_KEY"],
    )
    .args(["--recipe", "single-turn", "--tasks", "examples", "--max-tasks", "1", "--backend", "cpu"])
    .args(["--temperature", "0.6", "--max-tokens", "2048"])
    .env("KFORGE_FAKE_MODEL_KEY", "sk-fake-test")
    .output()
    .expect("kforge runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains(&format!("fake-model at http://{addr}/v1 (vllm)")), "{stderr}");

    let seen = seen.lock().expect("not poisoned").clone();
    assert_eq!(seen.len(), 1, "one task, one trajectory, one turn: {seen:#?}");
    let (auth, body) = &seen[0];
    assert_eq!(auth, "Bearer sk-fake-test");
    assert_eq!(body["model"], "fake-model");
    assert_eq!((body["temperature"].as_f64(), body["max_tokens"].as_u64()), (Some(0.6), Some(2048)), "{body}");
    let prompt = body["messages"].to_string();
    assert!(prompt.contains("examples/relu") && prompt.contains("ModelNew"), "the task's prompt: {prompt}");

    assert!(stdout.lines().next().is_some_and(|l| l.starts_with("job job-") && l.ends_with(" succeeded")), "{stdout}");
    let row = stdout.lines().find(|l| l.starts_with("examples/relu")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(row.contains(" correct "), "the fake's kernel is correct: {row}");
    assert!(stdout.contains("totals: 1 turns, 1 evaluated, 1 correct (100.0%)"), "{stdout}");
    assert!(stdout.contains("not-okay 0"), "the reasoning opens with `Okay`: {stdout}");
    // The server's token counts reach the report.
    let line = stdout.lines().find_map(|l| l.strip_prefix("report: ")).unwrap_or_else(|| panic!("{stdout}"));
    let html = Path::new(line.split(" (").next().expect("the html path"));
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(html.with_file_name("report.json")).expect("report.json written"))
            .expect("report.json is JSON");
    let cost = &report["metrics"]["cost"];
    assert_eq!((cost["prompt_tokens"].as_u64(), cost["completion_tokens"].as_u64()), (Some(300), Some(40)), "{cost}");
}

/// `kforge run --model-url` refuses what it cannot route, naming the flag, before any service starts.
#[test]
fn kforge_run_model_url_refuses_bad_input() {
    let work_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-model-url-refused");
    let refused = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_kforge"))
            .arg("run")
            .args(args)
            .arg("--work-dir")
            .arg(&work_dir)
            .env_remove("KFORGE_UNSET_MODEL_KEY")
            .output()
            .expect("kforge runs");
        assert!(!output.status.success(), "{args:?} was accepted");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let url = "http://127.0.0.1:9/v1";
    let stderr = refused(&["--model", "m", "--model-url", "localhost:8000/v1"]);
    assert!(stderr.contains(r#"--model-url "localhost:8000/v1" is not an http(s) URL: no scheme"#), "{stderr}");
    let stderr = refused(&["--model", "m", "--model-url", url, "--addr", "http://127.0.0.1:9"]);
    assert!(stderr.contains("--model-url routes a model in the gateway this command starts; with --addr"), "{stderr}");
    let stderr = refused(&["--model", "m", "--model-url", url, "--api-key-env", "KFORGE_UNSET_MODEL_KEY"]);
    assert!(stderr.contains("--api-key-env KFORGE_UNSET_MODEL_KEY: the environment variable is not set"), "{stderr}");
    let stderr = refused(&["--model-url", url]);
    assert!(stderr.contains("--model-url needs --model NAME"), "{stderr}");
    let stderr = refused(&["--model", "m", "--api-key-env", "KFORGE_UNSET_MODEL_KEY"]);
    assert!(stderr.contains("--model-url"), "a key without a server: {stderr}");
    let stderr = refused(&["--recipe", "cudaforge", "--model", "m", "--judge-model", "m", "--judge-model-url", url]);
    assert!(stderr.contains("--judge-model-url needs a Judge model other than the job's model `m`"), "{stderr}");
}

/// cudaforge against two servers, as flags alone set them up: the Coder at `--model-url` (a wrong kernel, then a
/// correct one) and the Judge at `--judge-model-url` with a key of its own, asked once (the last turn is not
/// reviewed), its advice shown to the Coder's second turn.
#[test]
fn kforge_run_cudaforge_with_a_judge_model_url() {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let (coder, coder_seen) = fake_vllm(&runtime, vec![fenced(RELU_TIMES_TWO), fenced(RELU_TORCH)]);
    let advice =
        r#"{"critical_issue": "it doubles x", "why_it_matters": "relu clamps", "minimal_fix_hint": "use max(x, 0)"}"#;
    let (judge, judge_seen) = fake_vllm(&runtime, vec![advice.to_owned()]);
    let (coder_url, judge_url) = (format!("http://{coder}/v1"), format!("http://{judge}"));
    let output = kforge_run(
        &Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-run-judge-model-url"),
        &["--recipe", "cudaforge", "--tasks", "examples", "--trajectories", "1", "--turns", "2", "--max-tasks", "1"],
    )
    .args(["--backend", "cpu", "--model", "coder", "--model-url", &coder_url])
    .args(["--judge-model", "judge", "--judge-model-url", &judge_url, "--judge-api-key-env", "KFORGE_FAKE_JUDGE_KEY"])
    .env("KFORGE_FAKE_JUDGE_KEY", "sk-judge")
    .output()
    .expect("kforge runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let row = stdout.lines().find(|l| l.starts_with("examples/relu")).unwrap_or_else(|| panic!("{stdout}"));
    assert!(row.contains("incorrect,correct"), "{row}");

    let coder_seen = coder_seen.lock().expect("not poisoned").clone();
    let judge_seen = judge_seen.lock().expect("not poisoned").clone();
    assert_eq!(coder_seen.len(), 2, "{coder_seen:#?}");
    assert!(
        coder_seen.iter().all(|(auth, body)| auth.is_empty() && body["model"] == "coder"),
        "no key: {coder_seen:#?}"
    );
    assert_eq!(judge_seen.len(), 1, "only the first turn is reviewed: {judge_seen:#?}");
    let (auth, body) = &judge_seen[0];
    assert_eq!((auth.as_str(), &body["model"]), ("Bearer sk-judge", &serde_json::json!("judge")));
    let second_prompt = coder_seen[1].1["messages"].to_string();
    assert!(second_prompt.contains("use max(x, 0)"), "the Judge's advice reaches the Coder: {second_prompt}");
}
