//! The OpenEnv face on a real mesh (evaluator on the CPU backend with the repository's venv, reward, orchestrator,
//! and the gateway the orchestrator connects to), driven as an OpenEnv client drives it: a WebSocket session at
//! `/openenv/ws`, and the HTTP routes beside it. One episode of the `relu` example runs to its end across a
//! disconnect in the middle of a step.

use futures_util::{SinkExt as _, StreamExt as _};
use kforge::mesh::{MeshConfig, Service};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;

const RELU: &str = include_str!("../../../examples/tasks/relu/candidates/cpu_loop.py");

type Socket = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn connect(http: &str) -> Socket {
    let url = format!("{}/openenv/ws", http.replacen("http://", "ws://", 1));
    let (socket, _) = tokio_tungstenite::connect_async(url).await.expect("the WebSocket opens");
    socket
}

async fn send(socket: &mut Socket, message: &Value) {
    socket.send(Message::text(message.to_string())).await.expect("sent");
}

/// The next text frame, as JSON (pongs skipped).
async fn reply(socket: &mut Socket) -> Value {
    loop {
        match socket.next().await.expect("the socket is open").expect("a frame") {
            Message::Text(text) => return serde_json::from_str(&text).expect("a reply is JSON"),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("unexpected frame: {other:?}"),
        }
    }
}

async fn request(socket: &mut Socket, message: Value) -> Value {
    send(socket, &message).await;
    reply(socket).await
}

/// Asserts `reply` is an error with `code`, naming `field`.
fn assert_error(reply: &Value, code: &str, field: Option<&str>) {
    assert_eq!(reply["type"], "error", "{reply}");
    assert_eq!(reply["data"]["code"], code, "{reply}");
    assert!(reply["data"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{reply}");
    if let Some(field) = field {
        assert_eq!(reply["data"]["field"], field, "{reply}");
        assert!(reply["data"]["message"].as_str().expect("a message").starts_with(field), "{reply}");
    }
}

fn mesh_config(turns: u32) -> MeshConfig {
    let mut config = kforge_tests::cpu_evaluator_config("faces-openenv");
    config.orchestrator.http.turns = turns;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openenv_episode_survives_a_disconnect_mid_step() {
    let services = [Service::Gateway, Service::Evaluator, Service::Reward, Service::Orchestrator];
    let mesh = kforge_tests::start(&services, &mesh_config(2)).await;
    let http = mesh.http_address().expect("the orchestrator serves its HTTP port").to_owned();

    let mut socket = connect(&http).await;
    // Bad requests are answered with an error each, and the socket stays open.
    send(&mut socket, &json!("not a message")).await;
    assert_error(&reply(&mut socket).await, "VALIDATION_ERROR", None);
    socket.send(Message::text("{\"type\": ")).await.expect("sent");
    assert_error(&reply(&mut socket).await, "INVALID_JSON", None);
    assert_error(&request(&mut socket, json!({"type": "dance"})).await, "UNKNOWN_TYPE", Some("type"));
    assert_error(&request(&mut socket, json!({"data": {}})).await, "VALIDATION_ERROR", Some("type"));
    let negative_seed = request(&mut socket, json!({"type": "reset", "data": {"seed": -1}})).await;
    assert_error(&negative_seed, "VALIDATION_ERROR", Some("data.seed"));
    let no_task = request(&mut socket, json!({"type": "reset", "data": {"task_id": "examples/nope"}})).await;
    assert_error(&no_task, "VALIDATION_ERROR", Some("data.task_id"));
    let early = request(&mut socket, json!({"type": "step", "data": {"code": RELU}})).await;
    assert_error(&early, "EXECUTION_ERROR", None);
    let state = request(&mut socket, json!({"type": "state"})).await;
    assert_eq!(state, json!({"type": "state", "data": {"episode_id": null, "step_count": 0}}));

    let reset = request(&mut socket, json!({"type": "reset", "data": {"task_id": "examples/relu", "other": 1}})).await;
    assert_eq!(reset["type"], "observation", "{reset}");
    let data = &reset["data"];
    assert_eq!((data["reward"].clone(), data["done"].clone()), (Value::Null, json!(false)), "{data}");
    let observation = &data["observation"];
    let episode = observation["episode_id"].as_str().expect("the episode's id").to_owned();
    assert_eq!(observation["task_id"], "examples/relu");
    assert_eq!((observation["turn"].as_u64(), observation["max_turns"].as_u64()), (Some(0), Some(2)));
    assert!(observation["prompt"].as_str().expect("a prompt").contains("torch.relu"), "{observation}");
    assert!(observation["messages"].as_array().is_some_and(|m| !m.is_empty()), "{observation}");

    let bad_action = request(&mut socket, json!({"type": "step", "data": {"kernel": RELU}})).await;
    assert_error(&bad_action, "VALIDATION_ERROR", Some("data.kernel"));
    let not_code = request(&mut socket, json!({"type": "step", "data": {"code": 7}})).await;
    assert_error(&not_code, "VALIDATION_ERROR", Some("data.code"));

    // A step, then a ping: the pong comes while the step evaluates (no reply before it), which also shows the
    // server has read the step. Then the client goes away without a word.
    send(&mut socket, &json!({"type": "step", "data": {"code": RELU}})).await;
    socket.send(Message::Ping(b"still there?".to_vec().into())).await.expect("ping sent");
    match socket.next().await.expect("open").expect("a frame") {
        Message::Pong(payload) => assert_eq!(&payload[..], b"still there?"),
        other => panic!("the pong is the first frame while the step evaluates, got {other:?}"),
    }
    drop(socket);

    // A new connection resumes the episode by its id: the step was not lost, and the reply is the observation
    // after it (the reset waits for the step still evaluating).
    let mut socket = connect(&http).await;
    let resumed = request(&mut socket, json!({"type": "reset", "data": {"episode_id": episode}})).await;
    assert_eq!(resumed["type"], "observation", "{resumed}");
    let data = &resumed["data"];
    let observation = &data["observation"];
    assert_eq!(observation["episode_id"], episode.as_str());
    assert_eq!(observation["turn"].as_u64(), Some(1), "{observation}");
    assert_eq!(observation["verdict"], "correct", "{observation}");
    assert_eq!(observation["task_id"], "examples/relu");
    assert!(observation["feedback"].as_str().expect("feedback").starts_with("correct"), "{observation}");
    let first_reward = data["reward"].as_f64().expect("the step's reward");
    assert!(first_reward > 0.0, "a correct kernel scores: {data}");
    assert_eq!(data["done"], false);
    let state = request(&mut socket, json!({"type": "state"})).await;
    assert_eq!(state["type"], "state", "{state}");
    assert_eq!(state["data"]["episode_id"], episode.as_str());
    assert_eq!(state["data"]["step_count"].as_u64(), Some(1), "{state}");
    assert_eq!(state["data"]["max_turns"].as_u64(), Some(2), "{state}");

    // The last turn ends the episode: every turn, credited, once each.
    let last = request(&mut socket, json!({"type": "step", "data": {"code": RELU, "metadata": {}}})).await;
    assert_eq!(last["type"], "observation", "{last}");
    let data = &last["data"];
    assert_eq!(data["done"], true, "{data}");
    assert!(data["reward"].as_f64().is_some_and(|r| r > 0.0), "{data}");
    let observation = &data["observation"];
    assert_eq!(observation["turn"].as_u64(), Some(2));
    assert_eq!(observation["prompt"], "", "no prompt once done");
    let turns = observation["turns"].as_array().expect("the turns once done");
    let indexes: Vec<u64> = turns.iter().filter_map(|t| t["turn"].as_u64()).collect();
    assert_eq!(indexes, [0, 1], "each turn recorded once: {turns:?}");
    assert!(turns.iter().all(|t| t["verdict"] == "correct" && t["return"].is_number()), "{turns:?}");
    assert_eq!(turns[0]["score"].as_f64(), Some(first_reward));

    let over = request(&mut socket, json!({"type": "step", "data": {"code": RELU}})).await;
    assert_error(&over, "EXECUTION_ERROR", None);
    // `close` is not answered: the server closes the socket.
    send(&mut socket, &json!({"type": "close"})).await;
    match socket.next().await {
        None | Some(Ok(Message::Close(_))) | Some(Err(_)) => {}
        Some(Ok(other)) => panic!("the socket closes after `close`, got {other:?}"),
    }

    // The HTTP routes: stateful, by the episode's id.
    let client = reqwest::Client::new();
    let base = format!("{http}/openenv");
    let get = |path: &str| client.get(format!("{base}{path}")).send();
    let health: Value = get("/health").await.expect("health").json().await.expect("json");
    assert_eq!(health, json!({"status": "healthy"}));
    let schema: Value = get("/schema").await.expect("schema").json().await.expect("json");
    assert!(schema["action"]["properties"]["code"].is_object(), "{schema}");
    assert!(schema["observation"]["properties"]["verdict"].is_object(), "{schema}");
    assert!(schema["state"]["properties"]["step_count"].is_object(), "{schema}");
    let metadata: Value = get("/metadata").await.expect("metadata").json().await.expect("json");
    assert_eq!(metadata["name"], "kforge");

    let state = get(&format!("/state?episode_id={episode}")).await.expect("state");
    assert_eq!(state.status(), 200);
    let state: Value = state.json().await.expect("json");
    assert_eq!((state["step_count"].as_u64(), state["done"].as_bool()), (Some(2), Some(true)), "{state}");
    let missing = get("/state").await.expect("state");
    assert_eq!(missing.status(), 400);
    assert_eq!(missing.json::<Value>().await.expect("json")["field"], "episode_id");
    let unknown = get("/state?episode_id=job-0-nope-0").await.expect("state");
    assert_eq!(unknown.status(), 404);
    assert_eq!(unknown.json::<Value>().await.expect("json")["field"], "episode_id");

    let post = |path: &str, body: Value| client.post(format!("{base}{path}")).json(&body).send();
    let resumed: Value =
        post("/reset", json!({"episode_id": episode})).await.expect("reset").json().await.expect("json");
    assert_eq!((resumed["done"].as_bool(), resumed["observation"]["turn"].as_u64()), (Some(true), Some(2)));
    let no_id = post("/step", json!({"action": {"code": RELU}})).await.expect("step");
    assert_eq!(no_id.status(), 400);
    assert_eq!(no_id.json::<Value>().await.expect("json")["field"], "episode_id");
    let bad = post("/step", json!({"episode_id": episode, "action": {"code": RELU, "extra": 1}})).await.expect("step");
    assert_eq!(bad.status(), 400);
    assert_eq!(bad.json::<Value>().await.expect("json")["field"], "action.extra");
    let over = post("/step", json!({"episode_id": episode, "action": {"code": RELU}})).await.expect("step");
    assert_eq!(over.status(), 400, "the episode is over");
    // A retry of a step taken names its turn: it is answered with the recorded step.
    let retried =
        post("/step", json!({"episode_id": episode, "action": {"code": RELU}, "turn": 1})).await.expect("step");
    assert_eq!(retried.status(), 200);
    let retried: Value = retried.json().await.expect("json");
    assert_eq!(retried["done"], true, "{retried}");
    assert_eq!(retried["observation"]["turns"].as_array().map(Vec::len), Some(2), "{retried}");
    let fresh: Value = post("/reset", json!({"task_id": 1})).await.expect("reset").json().await.expect("json");
    assert_eq!(fresh["observation"]["task_id"], "examples/gelu_tanh", "{fresh}");
    assert_ne!(fresh["observation"]["episode_id"], episode.as_str());
    let no_task = post("/reset", json!({"task_id": 99})).await.expect("reset");
    assert_eq!(no_task.status(), 404);
    assert_eq!(no_task.json::<Value>().await.expect("json")["field"], "task_id");

    mesh.shutdown().await.expect("the mesh drains");
}
