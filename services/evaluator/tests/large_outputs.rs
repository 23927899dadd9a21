//! Outputs over `output_bytes_budget`: fewer trials are saved and compared, never fewer than the sensitivity
//! trial and its base, and the response says so. On the CPU backend with a real PyTorch (`scripts/setup.sh --test`);
//! a budget of one byte makes the small corpus task "large".

use std::path::PathBuf;

use kforge_evaluator::{Evaluator, EvaluatorConfig, EvaluatorMetrics};
use kforge_proto::v1 as pb;

fn corpus(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("corpus file {}: {e}", path.display()))
}

async fn evaluator(output_bytes_budget: u64) -> Evaluator {
    let config = EvaluatorConfig {
        // A missing `.venv` fails these tests rather than skipping them.
        python: kforge_test_support::python::required(&[]),
        work_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("evaluator-cache"),
        baseline_torch_compile: false,
        bindings_pch: false,
        output_bytes_budget,
        ..EvaluatorConfig::default()
    };
    let metrics = EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default());
    Evaluator::new(config, metrics).await.expect("evaluator starts")
}

fn request(candidate: &str) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        request_id: "r".into(),
        task: Some(pb::Task {
            task_id: "corpus/mean_squared_error".into(),
            source: corpus("tasks/mean_squared_error.py"),
        }),
        candidate_source: candidate.into(),
        backend: pb::Backend::Cpu.into(),
        correctness_trials: 3,
        ..Default::default()
    }
}

fn verdict(response: &pb::EvaluateResponse) -> pb::Verdict {
    pb::Verdict::try_from(response.verdict).expect("a known verdict")
}

fn limited(response: &pb::EvaluateResponse) -> Option<&str> {
    response.findings.iter().find(|f| f.code == "check.trials_limited").map(|f| f.message.as_str())
}

#[tokio::test]
async fn outputs_over_the_budget_keep_two_trials_the_sensitivity_trial_among_them() {
    let tight = evaluator(1).await;
    // 3 trials and the 2 re-check trials; two are kept.
    let honest = tight.evaluate(request(&corpus("legitimate/mse_large_two_pass.py"))).await.expect("evaluates");
    assert_eq!(verdict(&honest), pb::Verdict::Correct, "{honest:#?}");
    assert_eq!(limited(&honest), Some("the outputs are large: 2 of 5 trials were compared (output_bytes_budget)"));

    // The trial that catches a closed form is one of the two.
    let shortcut = tight.evaluate(request(&corpus("exploits/loss_closed_form.py"))).await.expect("evaluates");
    assert_eq!(verdict(&shortcut), pb::Verdict::Incorrect, "{shortcut:#?}");
    let detail = shortcut.mismatch.as_ref().map(|m| m.detail.as_str()).unwrap_or_default();
    assert!(detail.starts_with("input sensitivity"), "{detail}");

    // Unbounded: every trial, and no notice.
    let all = evaluator(0).await;
    let response = all.evaluate(request(&corpus("legitimate/mse_large_two_pass.py"))).await.expect("evaluates");
    assert_eq!(verdict(&response), pb::Verdict::Correct, "{response:#?}");
    assert_eq!(limited(&response), None, "{response:#?}");
}
