//! The reward gaps closed for the orchestrator's main job, through the Reward service's real gRPC API: a missing
//! baseline does not fail a batch, infrastructure errors never become a score or a ratio's denominator, and
//! not-okay detection can be switched off.

use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_reward::{RewardConfig, serve};
use kforge_server::client::{self, Channel, ClientConfig};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The service on an ephemeral port (bound before serving, so a client can connect at once), its client, and the
/// sender that shuts it down.
async fn reward() -> (RewardClient<Channel>, oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let address = listener.local_addr().expect("address");
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        serve(RewardConfig::default(), listener, async {
            let _ = stopped.await;
        })
        .await
        .expect("serves");
    });
    let channel = client::connect(&format!("http://{address}"), &ClientConfig::default()).await.expect("connects");
    (RewardClient::new(channel), stop, server)
}

fn outcome(id: &str, verdict: pb::Verdict) -> pb::KernelOutcome {
    pb::KernelOutcome { sample_id: id.into(), verdict: verdict.into(), ..Default::default() }
}

const KERNEL: &str = "```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    pass\n```\n";

fn response(id: &str, text: &str, outcome: Option<pb::KernelOutcome>) -> pb::ModelResponse {
    pb::ModelResponse {
        response_id: id.into(),
        text: text.into(),
        finish_reason: "stop".into(),
        outcome,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_missing_compile_baseline_scores_without_its_speedup_term_and_the_batch_succeeds() {
    let (mut reward, stop, server) = reward().await;
    // The first task's torch.compile baseline failed: its correct kernel has an eager speedup only.
    let no_compile = pb::KernelOutcome {
        speedup_eager: Some(2.0),
        profiling_ratio: Some(0.5),
        ..outcome("a", pb::Verdict::Correct)
    };
    let with_compile = pb::KernelOutcome {
        speedup_eager: Some(2.0),
        speedup_compile: Some(1.5),
        profiling_ratio: Some(0.5),
        ..outcome("b", pb::Verdict::Correct)
    };
    let request = pb::ScoreKernelsRequest {
        formula: Some(pb::score_kernels_request::Formula::Drkernel(pb::DrKernelReward::default())),
        baseline: pb::SpeedupBaseline::Compile.into(),
        hack_penalty: None,
        outcomes: vec![no_compile, with_compile, outcome("c", pb::Verdict::Incorrect)],
    };
    let scores = reward.score_kernels(request).await.expect("the batch is scored").into_inner().scores;
    let got: Vec<(&str, f64, f64, bool)> =
        scores.iter().map(|s| (s.sample_id.as_str(), s.score, s.speedup, s.speedup_missing)).collect();
    // 1 + 0 + 0.5 without the speedup; 1 + 1.5 + 0.5 with it; an incorrect kernel needs no baseline.
    assert_eq!(got, vec![("a", 1.5, 0.0, true), ("b", 3.0, 1.5, false), ("c", 0.0, 0.0, false)]);
    assert!(scores.iter().all(|s| !s.unscored));
    stop.send(()).expect("server runs");
    server.await.expect("drains");
}

#[tokio::test]
async fn infra_errors_are_never_scored_kept_or_counted_in_the_hack_ratio() {
    let (mut reward, stop, server) = reward().await;
    let score = pb::ScoreKernelsRequest {
        formula: Some(pb::score_kernels_request::Formula::Kevin(pb::KevinScore::default())),
        outcomes: vec![outcome("infra", pb::Verdict::InfraError), outcome("wrong", pb::Verdict::Incorrect)],
        ..Default::default()
    };
    let scores = reward.score_kernels(score).await.expect("scored").into_inner().scores;
    let got: Vec<(&str, bool)> = scores.iter().map(|s| (s.sample_id.as_str(), s.unscored)).collect();
    assert_eq!(got, vec![("infra", true), ("wrong", false)]);

    let prs = pb::RejectionSampleRequest {
        method: Some(pb::rejection_sample_request::Method::Prs(pb::PrsParams::default())),
        outcomes: vec![outcome("infra", pb::Verdict::InfraError), outcome("wrong", pb::Verdict::Incorrect)],
        ..Default::default()
    };
    let decisions = reward.rejection_sample(prs).await.expect("decided").into_inner();
    assert_eq!(decisions.kept, 1);
    assert!(!decisions.decisions[0].keep && decisions.decisions[0].reason.starts_with("infrastructure error"));

    let okay_kernel = format!("<think>Okay.</think>{KERNEL}");
    let diagnose = pb::DiagnoseRequest {
        params: None,
        responses: vec![
            response("hack", &okay_kernel, Some(outcome("hack", pb::Verdict::Hack))),
            response("infra", &okay_kernel, Some(outcome("infra", pb::Verdict::InfraError))),
            response("correct", &okay_kernel, Some(outcome("correct", pb::Verdict::Correct))),
            response("junk", "<think>Okay.</think>no kernel", None),
        ],
    };
    let d = reward.diagnose(diagnose).await.expect("diagnosed").into_inner();
    // Hack ratio over the two evaluated candidates; the infra error is in neither side of it.
    assert_eq!((d.evaluated, d.infra_errors, d.hack_ratio), (2, 1, 0.5));
    // Junk reads the text alone: one of four responses.
    assert_eq!(d.junk_ratio, 0.25);
    stop.send(()).expect("server runs");
    server.await.expect("drains");
}

#[tokio::test]
async fn not_okay_detection_can_be_switched_off() {
    let (mut reward, stop, server) = reward().await;
    let responses = vec![response("a", &format!("<think>Let me see.</think>{KERNEL}"), None)];
    let on = pb::DiagnoseRequest { params: None, responses: responses.clone() };
    let d = reward.diagnose(on).await.expect("diagnosed").into_inner();
    assert!(d.flags[0].not_okay && d.not_okay_ratio == 1.0 && !d.not_okay_off);

    let off = pb::DiagnoseRequest {
        params: Some(pb::DiagnoseParams { not_okay_off: true, ..Default::default() }),
        responses: responses.clone(),
    };
    let d = reward.diagnose(off).await.expect("diagnosed").into_inner();
    assert!(!d.flags[0].not_okay && d.not_okay_ratio == 0.0 && d.not_okay_off, "{d:?}");

    let both = pb::DiagnoseRequest {
        params: Some(pb::DiagnoseParams { not_okay_off: true, opening: Some("Okay".into()), ..Default::default() }),
        responses,
    };
    let status = reward.diagnose(both).await.expect_err("contradictory params");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().starts_with("params.opening: "), "{}", status.message());
    stop.send(()).expect("server runs");
    server.await.expect("drains");
}
