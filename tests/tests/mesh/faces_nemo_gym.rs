//! The NeMo Gym face against real services (gateway, evaluator on the CPU backend with the repository's venv,
//! reward, orchestrator), driven as NeMo Gym's agents drive a resources server: the session cookie taken from each
//! response and sent with the next request, the dataset row sent whole to `/seed_session` and `/verify`, the
//! model's Responses-API output (with its token-in/token-out fields on the turn's last item) in `/verify`.

use kforge::mesh::{Mesh, Service};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use reqwest::header::{COOKIE, HeaderMap, SET_COOKIE};
use serde_json::{Value, json};

const KERNEL: &str = include_str!("../../../examples/tasks/relu/candidates/cpu_loop.py");
const TASK_ID: &str = "examples/relu";
const NAME: &str = "kforge_nemo_gym";

/// A kernel whose C++ source does not compile.
fn broken_kernel() -> String {
    let broken = KERNEL.replace("return output;", "return output");
    assert_ne!(broken, KERNEL, "the example still returns `output;`");
    broken
}

/// The services a step needs, and the HTTP port's URL.
async fn mesh(name: &str) -> (Mesh, String) {
    let config = kforge_tests::cpu_evaluator_config(&format!("faces-nemo-gym/{name}"));
    let services = [Service::Gateway, Service::Evaluator, Service::Reward, Service::Orchestrator];
    let mesh = kforge_tests::start(&services, &config).await;
    let base = mesh.http_address().expect("the orchestrator serves its HTTP port").to_owned();
    (mesh, base)
}

/// A row of a NeMo Gym dataset for the relu task.
fn row(rollout: u32) -> Value {
    json!({
        "responses_create_params": {"input": [{"role": "user", "content": "Write ModelNew for this ReLU."}]},
        "task_id": TASK_ID,
        "verifier_metadata": {"difficulty": 1},
        "_ng_task_index": 0,
        "_ng_rollout_index": rollout,
    })
}

/// The session cookie this response sets (`name=value`): NeMo Gym's agents keep only these.
fn cookie(headers: &HeaderMap) -> String {
    headers
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter_map(|v| v.split(';').next())
        .find(|c| c.starts_with(&format!("{NAME}=")))
        .unwrap_or_else(|| panic!("no {NAME} cookie set: {headers:?}"))
        .to_owned()
}

/// The episode a cookie names.
fn episode(cookie: &str) -> String {
    let value = cookie.strip_prefix(&format!("{NAME}=")).expect("our cookie");
    value.rsplit_once('.').map_or(value, |(episode, _)| episode).to_owned()
}

async fn post(http: &reqwest::Client, url: &str, cookie: Option<&str>, body: &Value) -> (u16, Value, HeaderMap) {
    let mut request = http.post(url).json(body);
    if let Some(cookie) = cookie {
        request = request.header(COOKIE, cookie);
    }
    let response = request.send().await.expect("POST answered");
    let (status, headers) = (response.status().as_u16(), response.headers().clone());
    (status, response.json().await.expect("a JSON body"), headers)
}

async fn turns(mesh: &Mesh, episode: &str) -> Vec<pb::TurnRecord> {
    let channel = kforge_tests::connect(mesh, Service::Orchestrator, &Default::default()).await;
    let request = pb::ListTrajectoriesRequest { job_id: episode.to_owned(), ..Default::default() };
    let listed = OrchestratorClient::new(channel).list_trajectories(request).await.expect("listed").into_inner();
    listed.trajectories.into_iter().flat_map(|t| t.turns).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_seeded_rollout_is_verified_with_its_tokens_stored() {
    let (mesh, base) = mesh("verify").await;
    let http = reqwest::Client::new();
    let (code, seeded, headers) = post(&http, &format!("{base}/seed_session"), None, &row(0)).await;
    assert_eq!((code, &seeded), (200, &json!({})));
    let session = cookie(&headers);
    // A retried seed of the same rollout is the same episode.
    let (_, _, again) = post(&http, &format!("{base}/seed_session"), None, &row(0)).await;
    assert_eq!(episode(&cookie(&again)), episode(&session));

    let answer = format!("Here is the kernel.\n\n```python\n{KERNEL}```\n");
    let mut body = row(0);
    body["response"] = json!({
        "id": "resp-1", "object": "response", "status": "completed",
        "output": [
            {"type": "reasoning", "id": "rs-1", "summary": [{"type": "summary_text", "text": "A loop over the elements."}]},
            {"type": "message", "id": "msg-1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": answer, "annotations": []}],
             "prompt_token_ids": [101, 102, 103], "generation_token_ids": [7, 8, 9, 10],
             "generation_log_probs": [-0.5, -0.25, -0.125, -1.0]},
        ],
    });
    let (code, verified, headers) = post(&http, &format!("{base}/verify"), Some(&session), &body).await;
    assert_eq!(code, 200, "{verified}");
    assert_eq!(episode(&cookie(&headers)), episode(&session), "the cookie is re-sent");
    // The request echoed, with the reward.
    for key in ["responses_create_params", "task_id", "verifier_metadata", "_ng_task_index", "response"] {
        assert_eq!(verified[key], body[key], "{key} echoed");
    }
    let reward = verified["reward"].as_f64().expect("a reward");
    assert!(reward > 0.0, "a correct kernel is rewarded: {verified}");
    assert_eq!(verified["reward_components"]["correct"], 1.0);
    assert_eq!(verified["reward_components"]["turns"], 1.0);
    assert_eq!(verified["kforge"]["episode_id"], episode(&session));

    // The step stored the model's tokens as NeMo Gym gave them.
    let stored = turns(&mesh, &episode(&session)).await;
    assert_eq!(stored.len(), 1);
    let completion = stored[0].completion.clone().expect("the response");
    assert_eq!(completion.token_ids, vec![7, 8, 9, 10]);
    assert_eq!(completion.logprobs, vec![-0.5, -0.25, -0.125, -1.0]);
    assert_eq!(completion.reasoning, "A loop over the elements.");
    assert_eq!(stored[0].prompt_token_ids, vec![101, 102, 103]);

    // A retried verify is answered again, without a second turn.
    let (code, retried, _) = post(&http, &format!("{base}/verify"), Some(&session), &body).await;
    assert_eq!((code, retried["reward"].as_f64()), (200, Some(reward)));
    assert_eq!(turns(&mesh, &episode(&session)).await.len(), 1);
    mesh.shutdown().await.expect("mesh drains");
}

#[tokio::test(flavor = "multi_thread")]
async fn each_tool_call_is_a_step_and_verify_rewards_the_best() {
    let (mesh, base) = mesh("tool").await;
    let http = reqwest::Client::new();
    // Under NeMo Gym's observability prefix, as its agents send when it is on.
    let prefix = format!("{base}/ng-rollout/rollout-7");
    let (code, _, headers) = post(&http, &format!("{prefix}/seed_session"), None, &row(1)).await;
    assert_eq!(code, 200);
    let first = cookie(&headers);

    let (code, broken, headers) =
        post(&http, &format!("{prefix}/submit_kernel"), Some(&first), &json!({"code": broken_kernel()})).await;
    assert_eq!(code, 200, "{broken}");
    assert_eq!((broken["verdict"].as_str(), broken["turn"].as_u64()), (Some("compile_error"), Some(0)), "{broken}");
    assert_eq!(broken["done"], false);
    assert!(broken["feedback"].as_str().is_some_and(|f| !f.is_empty()), "the model reads why: {broken}");
    assert!(broken["prompt"].as_str().is_some_and(|p| p.contains("ModelNew")), "the next prompt: {broken}");
    let second = cookie(&headers);
    assert_ne!(second, first, "the cookie follows the episode's turn");

    let (code, fixed, headers) =
        post(&http, &format!("{prefix}/submit_kernel"), Some(&second), &json!({"kernel": KERNEL})).await;
    assert_eq!(code, 200, "{fixed}");
    assert_eq!((fixed["verdict"].as_str(), fixed["turn"].as_u64()), (Some("correct"), Some(1)), "{fixed}");
    let best = fixed["score"].as_f64().expect("scored");
    assert!(best > 0.0);
    let third = cookie(&headers);
    // The same call again with the cookie it was sent with (its answer lost): a replay, not a third turn.
    let (code, replayed, _) =
        post(&http, &format!("{prefix}/submit_kernel"), Some(&second), &json!({"kernel": KERNEL})).await;
    assert_eq!((code, replayed["turn"].as_u64(), replayed["score"].as_f64()), (200, Some(1), Some(best)));

    let mut body = row(1);
    body["response"] = json!({"id": "resp-2", "output": [
        {"type": "function_call", "name": "submit_kernel", "call_id": "c1", "arguments": json!({"code": broken_kernel()}).to_string()},
        {"type": "function_call_output", "call_id": "c1", "output": broken.to_string()},
        {"type": "function_call", "name": "submit_kernel", "call_id": "c2", "arguments": json!({"kernel": KERNEL}).to_string()},
        {"type": "function_call_output", "call_id": "c2", "output": fixed.to_string()},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ]});
    let (code, verified, headers) = post(&http, &format!("{prefix}/verify"), Some(&third), &body).await;
    assert_eq!(code, 200, "{verified}");
    assert_eq!(cookie(&headers), third);
    assert_eq!(verified["reward"].as_f64(), Some(best), "the episode's best turn: {verified}");
    assert_eq!(verified["reward_components"]["turns"], 2.0);
    assert_eq!(verified["reward_components"]["last_score"].as_f64(), Some(best));
    assert_eq!(turns(&mesh, &episode(&third)).await.len(), 2, "the closing message is not a turn");
    mesh.shutdown().await.expect("mesh drains");
}

#[tokio::test(flavor = "multi_thread")]
async fn gymnasium_reset_and_step_are_the_step_api() {
    let (mesh, base) = mesh("gymnasium").await;
    let http = reqwest::Client::new();
    let mut bare = row(2);
    bare["responses_create_params"]["input"] = json!([]);
    let (code, reset, headers) = post(&http, &format!("{base}/reset"), None, &bare).await;
    assert_eq!(code, 200, "{reset}");
    let prompt = reset["observation"].as_str().expect("kforge's prompt: the row has none");
    assert!(prompt.contains("class Model"), "the task's source is in it: {prompt}");
    assert_eq!(reset["info"]["supports_explicit_close"], true);
    let session = cookie(&headers);

    let mut body = bare.clone();
    body["response"] = json!({"id": "resp-3", "output": [
        {"type": "function_call", "name": "submit_kernel", "call_id": "call-9",
         "arguments": json!({"code": KERNEL}).to_string(),
         "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.75]},
    ]});
    let (code, stepped, headers) = post(&http, &format!("{base}/step"), Some(&session), &body).await;
    assert_eq!(code, 200, "{stepped}");
    assert!(stepped["reward"].as_f64().is_some_and(|r| r > 0.0), "{stepped}");
    assert_eq!((stepped["terminated"].as_bool(), stepped["truncated"].as_bool()), (Some(false), Some(false)));
    assert_eq!(stepped["observation"], Value::Null, "the tool's output carries the feedback");
    let outputs = stepped["info"]["tool_outputs"].as_array().expect("tool outputs");
    assert_eq!(outputs[0]["call_id"], "call-9");
    let output: Value =
        serde_json::from_str(outputs[0]["output"].as_str().expect("text")).expect("JSON the model reads");
    assert_eq!(output["verdict"], "correct");
    let stored = turns(&mesh, &episode(&session)).await;
    assert_eq!(stored[0].completion.as_ref().map(|c| c.token_ids.clone()), Some(vec![3]));

    let (code, closed, headers_closed) =
        post(&http, &format!("{base}/close"), Some(&cookie(&headers)), &json!({})).await;
    assert_eq!((code, closed), (200, json!({})));
    assert_eq!(episode(&cookie(&headers_closed)), episode(&session));
    mesh.shutdown().await.expect("mesh drains");
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_name_their_field_and_keep_the_cookie() {
    let (mesh, base) = mesh("bad").await;
    let http = reqwest::Client::new();
    let alive = http.get(format!("{base}/")).send().await.expect("GET /");
    assert_eq!(alive.json::<Value>().await.expect("JSON"), json!({"status": "ok"}));
    let alive = http.get(format!("{base}/ng-rollout/r1/")).send().await.expect("GET prefixed /");
    assert_eq!(alive.status().as_u16(), 200);

    let mut unknown = row(0);
    unknown["task_id"] = "examples/no-such-task".into();
    let (code, error, _) = post(&http, &format!("{base}/seed_session"), None, &unknown).await;
    assert_eq!((code, error["field"].as_str()), (404, Some("task_id")), "{error}");
    let mut shaped = row(0);
    shaped["responses_create_params"] = "not an object".into();
    let (code, error, _) = post(&http, &format!("{base}/seed_session"), None, &shaped).await;
    assert_eq!((code, error["field"].as_str()), (400, Some("responses_create_params")), "{error}");
    let (code, error, _) = post(&http, &format!("{base}/submit_kernel"), None, &json!({"code": KERNEL})).await;
    assert_eq!((code, error["code"].as_str()), (400, Some("failed_precondition")), "no session: {error}");

    let (_, _, headers) = post(&http, &format!("{base}/seed_session"), None, &row(5)).await;
    let session = cookie(&headers);
    let (code, error, headers) =
        post(&http, &format!("{base}/submit_kernel"), Some(&session), &json!({"code": 5})).await;
    assert_eq!((code, error["field"].as_str()), (400, Some("code")), "{error}");
    assert_eq!(cookie(&headers), session, "an error keeps the session");
    let (code, error, headers) = post(&http, &format!("{base}/verify"), Some(&session), &row(5)).await;
    assert_eq!((code, error["field"].as_str()), (400, Some("response")), "{error}");
    assert_eq!(cookie(&headers), session);
    let mut uneven = row(5);
    uneven["response"] = json!({"output": [{"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "x"}], "generation_token_ids": [1, 2], "generation_log_probs": [-1.0]}]});
    let (code, error, _) = post(&http, &format!("{base}/verify"), Some(&session), &uneven).await;
    assert_eq!((code, error["field"].as_str()), (400, Some("response.output[0].generation_log_probs")), "{error}");

    let verified = json!({"verify_responses": [
        {"_ng_task_index": 0, "reward": 1.0, "reward_components": {"correct": 1.0}},
        {"_ng_task_index": 0, "reward": 0.0, "reward_components": {"correct": 0.0}},
        {"_ng_task_index": 1, "reward": 0.5, "reward_components": {"correct": 1.0}},
        {"_ng_task_index": 1, "reward": 0.0, "mask_sample": true},
    ]});
    let (code, metrics, _) = post(&http, &format!("{base}/aggregate_metrics"), None, &verified).await;
    assert_eq!(code, 200, "{metrics}");
    assert_eq!(metrics["agent_metrics"]["mean/reward"], 0.5);
    assert_eq!(metrics["agent_metrics"]["masked"], 1);
    assert_eq!(metrics["key_metrics"]["mean/correct"].as_f64().map(|c| (c * 3.0).round()), Some(2.0));
    assert_eq!(metrics["group_level_metrics"].as_array().map(Vec::len), Some(2));
    mesh.shutdown().await.expect("mesh drains");
}
