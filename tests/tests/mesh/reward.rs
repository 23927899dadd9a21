//! The Reward service through its generated client, as the orchestrator and trainers call it.

use kforge::mesh::{Mesh, MeshConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::client::Channel;

async fn reward() -> (Mesh, RewardClient<Channel>) {
    kforge_tests::reward(&MeshConfig::default()).await
}

fn correct(id: &str, speedup: f64, pr: f64) -> pb::KernelOutcome {
    pb::KernelOutcome {
        sample_id: id.into(),
        verdict: pb::Verdict::Correct.into(),
        speedup_eager: Some(speedup),
        profiling_ratio: Some(pr),
        ..Default::default()
    }
}

fn values(id: &str, values: &[f64]) -> pb::TrajectoryValues {
    pb::TrajectoryValues { trajectory_id: id.into(), values: values.to_vec() }
}

fn assert_invalid(result: Result<impl std::fmt::Debug, tonic::Status>, field: &str) {
    let status = result.expect_err("bad input must be rejected");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().starts_with(&format!("{field}: ")), "expected `{field}: ...`, got {:?}", status.message());
}

#[tokio::test]
async fn score_kernels_applies_each_formula_and_the_hack_penalty() {
    let (mesh, mut reward) = reward().await;
    let static_hack = pb::KernelOutcome {
        sample_id: "static-hack".into(),
        verdict: pb::Verdict::Rejected.into(),
        findings: vec![pb::Finding {
            code: "static.inherits_reference".into(),
            message: "ModelNew only inherits Model".into(),
            line: 3,
            category: pb::FindingCategory::Hack.into(),
        }],
        ..Default::default()
    };
    let timed = pb::KernelOutcome {
        sample_id: "timed".into(),
        verdict: pb::Verdict::Correct.into(),
        candidate_median_ms: Some(0.5),
        eager_median_ms: Some(1.0),
        profiling_ratio: Some(1.0),
        ..Default::default()
    };
    let outcomes = vec![correct("fast", 5.0, 0.8), static_hack, timed];

    let kevin = pb::ScoreKernelsRequest {
        formula: Some(pb::score_kernels_request::Formula::Kevin(pb::KevinScore { correctness_weight: None })),
        baseline: pb::SpeedupBaseline::Eager.into(),
        hack_penalty: Some(-1.0),
        outcomes: outcomes.clone(),
    };
    let scores = reward.score_kernels(kevin).await.expect("kevin").into_inner().scores;
    let got: Vec<(&str, f64, bool)> = scores.iter().map(|s| (s.sample_id.as_str(), s.score, s.hack)).collect();
    assert_eq!(got, vec![("fast", 5.3, false), ("static-hack", -1.0, true), ("timed", 2.3, false)]);

    let drkernel = pb::ScoreKernelsRequest {
        formula: Some(pb::score_kernels_request::Formula::Drkernel(pb::DrKernelReward::default())),
        outcomes,
        ..Default::default()
    };
    let scores = reward.score_kernels(drkernel).await.expect("drkernel").into_inner().scores;
    let got: Vec<f64> = scores.iter().map(|s| s.score).collect();
    // 1 + min(5, 3) + 0.8; the default penalty 0; 1 + 2 + 1.
    assert_eq!(got, vec![4.8, 0.0, 4.0]);
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn returns_then_advantages_keep_shape_and_ids() {
    let (mesh, mut reward) = reward().await;
    let returns = reward
        .compute_returns(pb::ComputeReturnsRequest {
            method: pb::ReturnMethod::Sum.into(),
            gamma: Some(0.4),
            trajectories: vec![values("a", &[0.3, 0.0, 1.3]), values("b", &[1.0])],
        })
        .await
        .expect("returns")
        .into_inner()
        .trajectories;
    assert_eq!(returns.iter().map(|t| t.trajectory_id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert!((returns[0].values[0] - 0.508).abs() < 1e-12, "{returns:?}");

    let advantages = reward
        .compute_advantages(pb::ComputeAdvantagesRequest {
            estimator: pb::AdvantageEstimator::Trloo.into(),
            groups: vec![pb::AdvantageGroup {
                group_id: "task-1".into(),
                trajectories: vec![values("a", &[1.0, 4.0]), values("b", &[2.0]), values("c", &[6.0])],
            }],
            normalize_std: None,
            epsilon: None,
        })
        .await
        .expect("advantages")
        .into_inner()
        .groups;
    assert_eq!(advantages[0].group_id, "task-1");
    assert_eq!(advantages[0].trajectories[0].values, vec![-3.0, 4.0]);
    assert_eq!(advantages[0].trajectories[2].values, vec![4.5]);
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn rejection_sampling_by_profiling_ratio_and_by_mismatch() {
    let (mesh, mut reward) = reward().await;
    let prs = pb::RejectionSampleRequest {
        method: Some(pb::rejection_sample_request::Method::Prs(pb::PrsParams::default())),
        seed: 42,
        outcomes: vec![correct("low-pr", 2.0, 0.1), correct("high-pr", 2.0, 0.95)],
        trajectories: vec![],
    };
    let response = reward.rejection_sample(prs.clone()).await.expect("prs").into_inner();
    let decisions: Vec<(bool, f64)> = response.decisions.iter().map(|d| (d.keep, d.keep_probability)).collect();
    assert_eq!(decisions, vec![(false, 0.0), (true, 1.0)]);
    assert_eq!(response.kept, 1);
    assert_eq!(reward.rejection_sample(prs).await.expect("prs again").into_inner(), response, "deterministic");

    let mrs = pb::RejectionSampleRequest {
        method: Some(pb::rejection_sample_request::Method::Mrs(pb::MrsParams::default())),
        trajectories: vec![
            pb::TokenLogprobs {
                trajectory_id: "same".into(),
                rollout_logprobs: vec![-0.5, -1.0],
                train_logprobs: vec![-0.5, -1.0],
            },
            pb::TokenLogprobs {
                trajectory_id: "drift".into(),
                rollout_logprobs: vec![-0.5, -1.0],
                train_logprobs: vec![-0.4, -0.9],
            },
        ],
        ..Default::default()
    };
    let response = reward.rejection_sample(mrs).await.expect("mrs").into_inner();
    assert!(response.decisions[0].keep && !response.decisions[1].keep, "{response:?}");
    assert!(response.decisions[1].reason.contains("importance weight"), "{response:?}");
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn diagnose_flags_junk_not_okay_and_hacks() {
    let (mesh, mut reward) = reward().await;
    let kernel = "```python\nclass ModelNew(nn.Module):\n    pass\n```";
    let responses = vec![
        pb::ModelResponse {
            response_id: "good".into(),
            text: kernel.into(),
            reasoning: "Okay, the task is a ReLU.".into(),
            finish_reason: "stop".into(),
            outcome: Some(correct("good", 1.2, 0.9)),
        },
        pb::ModelResponse {
            response_id: "loop".into(),
            text: "Wait, let me reconsider the indexing. ".repeat(50),
            reasoning: String::new(),
            finish_reason: "length".into(),
            outcome: None,
        },
    ];
    let response =
        reward.diagnose(pb::DiagnoseRequest { params: None, responses }).await.expect("diagnose").into_inner();
    let flags: Vec<(bool, bool, bool, bool)> =
        response.flags.iter().map(|f| (f.junk, f.truncated, f.degenerate, f.not_okay)).collect();
    assert_eq!(flags, vec![(false, false, false, false), (true, true, true, true)]);
    assert_eq!(
        (response.junk_ratio, response.not_okay_ratio, response.hack_ratio, response.evaluated),
        (0.5, 0.5, 0.0, 1)
    );
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn bad_input_is_invalid_argument_naming_the_field() {
    let (mesh, mut reward) = reward().await;
    let group = |trajectories| pb::AdvantageGroup { group_id: String::new(), trajectories };
    let mut groups: Vec<pb::AdvantageGroup> = (0..3).map(|_| group(vec![values("x", &[1.0])])).collect();
    groups.push(group(vec![values("ok", &[1.0]), values("bad", &[f64::NAN])]));
    let advantages = |estimator: i32, groups: Vec<pb::AdvantageGroup>| pb::ComputeAdvantagesRequest {
        estimator,
        groups,
        normalize_std: None,
        epsilon: None,
    };
    assert_invalid(
        reward.compute_advantages(advantages(pb::AdvantageEstimator::Grpo.into(), groups)).await,
        "groups[3].trajectories[1].values[0]",
    );
    assert_invalid(
        reward.compute_advantages(advantages(99, vec![group(vec![values("x", &[1.0])])])).await,
        "estimator",
    );
    assert_invalid(
        reward.compute_advantages(advantages(pb::AdvantageEstimator::Rloo.into(), vec![group(vec![])])).await,
        "groups[0].trajectories",
    );

    let score = |outcomes| pb::ScoreKernelsRequest {
        formula: Some(pb::score_kernels_request::Formula::Kevin(pb::KevinScore::default())),
        outcomes,
        ..Default::default()
    };
    let unspecified = pb::KernelOutcome { verdict: pb::Verdict::Unspecified.into(), ..Default::default() };
    assert_invalid(reward.score_kernels(score(vec![correct("a", 1.0, 0.5), unspecified])).await, "outcomes[1].verdict");
    assert_invalid(
        reward.score_kernels(score(vec![correct("a", f64::INFINITY, 0.5)])).await,
        "outcomes[0].speedup_eager",
    );
    let negative_time = pb::KernelOutcome { candidate_median_ms: Some(-3.0), ..correct("a", 1.0, 0.5) };
    assert_invalid(reward.score_kernels(score(vec![negative_time])).await, "outcomes[0].candidate_median_ms");
    assert_invalid(reward.score_kernels(score(vec![correct("a", 1.0, 1.2)])).await, "outcomes[0].profiling_ratio");
    assert_invalid(reward.score_kernels(pb::ScoreKernelsRequest { formula: None, ..score(vec![]) }).await, "formula");

    let ragged = pb::RejectionSampleRequest {
        method: Some(pb::rejection_sample_request::Method::Mrs(pb::MrsParams::default())),
        trajectories: vec![pb::TokenLogprobs {
            trajectory_id: "t".into(),
            rollout_logprobs: vec![-1.0, -2.0],
            train_logprobs: vec![-1.0],
        }],
        ..Default::default()
    };
    assert_invalid(reward.rejection_sample(ragged).await, "trajectories[0].train_logprobs");
    assert_invalid(
        reward
            .compute_returns(pb::ComputeReturnsRequest {
                method: pb::ReturnMethod::Max.into(),
                gamma: None,
                trajectories: vec![],
            })
            .await,
        "gamma",
    );
    assert_invalid(reward.diagnose(pb::DiagnoseRequest { params: None, responses: vec![] }).await, "responses");
    mesh.shutdown().await.expect("drains");
}
