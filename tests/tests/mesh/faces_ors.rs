//! The Open Reward Standard face on a real mesh (evaluator on the CPU backend with the repository's venv, reward,
//! orchestrator, and the gateway the orchestrator connects to), driven as the ORS clients drive it: discovery
//! routes, a session created over server-sent events, its prompt, and `submit_kernel` calls read from their event
//! streams as the clients read them (the data of every `chunk` and the `end`, concatenated), one of them dropped
//! after its `task_id` and re-attached.

use std::time::Instant;

use kforge::mesh::{MeshConfig, Service};
use serde_json::{Value, json};

const RELU: &str = include_str!("../../../examples/tasks/relu/candidates/cpu_loop.py");

/// A server-sent event stream, read as the ORS clients read it: `field: value` lines (one leading space of the
/// value dropped), `:` comments, an event at each blank line.
struct Events {
    response: reqwest::Response,
    buffer: Vec<u8>,
    comments: usize,
}

#[derive(Debug, Clone, PartialEq)]
struct Event {
    name: String,
    data: String,
}

impl Events {
    fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), 200, "an event stream");
        let content_type = response.headers()["content-type"].to_str().expect("text").to_owned();
        assert!(content_type.starts_with("text/event-stream"), "{content_type}");
        Self { response, buffer: Vec::new(), comments: 0 }
    }

    /// The next event; `None` once the stream ends.
    async fn next(&mut self) -> Option<Event> {
        let (mut name, mut data) = (String::new(), Vec::<String>::new());
        loop {
            while let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                let line = String::from_utf8(line).expect("utf-8 lines");
                let line = line.trim_end_matches(['\n', '\r']);
                if line.is_empty() {
                    if !name.is_empty() || !data.is_empty() {
                        return Some(Event { name, data: data.join("\n") });
                    }
                } else if line.starts_with(':') {
                    self.comments += 1;
                } else {
                    let (field, value) = line.split_once(':').expect("every other line is `field: value`");
                    let value = value.strip_prefix(' ').unwrap_or(value);
                    match field {
                        "event" => name = value.to_owned(),
                        "data" => data.push(value.to_owned()),
                        _ => {}
                    }
                }
            }
            match self.response.chunk().await.expect("the stream reads") {
                Some(bytes) => self.buffer.extend_from_slice(&bytes),
                None => return None,
            }
        }
    }

    /// The `task_id` event's data: the first event.
    async fn task_id(&mut self) -> String {
        let event = self.next().await.expect("a first event");
        assert_eq!(event.name, "task_id", "{event:?}");
        assert!(!event.data.is_empty());
        event.data
    }

    /// The result after `task_id`: the `chunk`s and the `end`, concatenated, as JSON.
    async fn result(&mut self) -> Value {
        let mut text = String::new();
        loop {
            let event = self.next().await.expect("the stream ends with `end`");
            match event.name.as_str() {
                "chunk" => text.push_str(&event.data),
                "end" => {
                    text.push_str(&event.data);
                    assert!(self.next().await.is_none(), "nothing after `end`");
                    return serde_json::from_str(&text).expect("the result is JSON");
                }
                _ => panic!("unexpected event {event:?}"),
            }
        }
    }
}

fn mesh_config() -> MeshConfig {
    let mut config = kforge_tests::cpu_evaluator_config("faces-ors");
    // One turn: the first submission finishes the episode.
    config.orchestrator.http.turns = 1;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ors_session_submits_a_kernel_over_server_sent_events() {
    let services = [Service::Gateway, Service::Evaluator, Service::Reward, Service::Orchestrator];
    let mesh = kforge_tests::start(&services, &mesh_config()).await;
    let base = mesh.http_address().expect("the orchestrator serves its HTTP port").to_owned();
    let client = reqwest::Client::new();
    let get = |path: &str, sid: Option<&str>| {
        let request = client.get(format!("{base}{path}"));
        match sid {
            Some(sid) => request.header("X-Session-ID", sid),
            None => request,
        }
        .send()
    };
    let post = |path: &str, sid: Option<&str>, body: Value| {
        let request = client.post(format!("{base}{path}")).header("Accept", "text/event-stream").json(&body);
        match sid {
            Some(sid) => request.header("X-Session-ID", sid),
            None => request,
        }
        .send()
    };
    let json = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        (status, response.json::<Value>().await.expect("a JSON body"))
    };

    // Discovery, under the environment's name and bare (the `openreward` client's paths).
    assert_eq!(json(get("/health", None).await.expect("health")).await, (200, json!({"status": "ok"})));
    assert_eq!(json(get("/list_environments", None).await.expect("list")).await, (200, json!(["kforge"])));
    for path in ["/kforge/tools", "/tools", "/kforge/task_tools"] {
        let (status, tools) = json(get(path, None).await.expect("tools")).await;
        assert_eq!(status, 200, "{path}");
        assert_eq!(tools["tools"][0]["name"], "submit_kernel", "{path}: {tools}");
        assert_eq!(tools["tools"][0]["input_schema"]["properties"]["code"]["type"], "string", "{tools}");
        assert_eq!(tools["tools"].as_array().map(Vec::len), Some(1));
    }
    let (_, splits) = json(get("/kforge/splits", None).await.expect("splits")).await;
    assert_eq!(splits, json!([{"name": "train", "type": "train"}]));
    let (_, count) = json(post("/kforge/num_tasks", None, json!({"split": "train"})).await.expect("num")).await;
    let count = count["num_tasks"].as_u64().expect("a count");
    assert!(count >= 12, "the example tasks: {count}");
    let (_, listed) = json(post("/tasks", None, json!({"split": "train"})).await.expect("tasks")).await;
    assert_eq!(listed["tasks"].as_array().map(Vec::len), Some(count as usize));
    assert_eq!(listed["env_name"], "kforge");
    let (_, first) = json(post("/kforge/task", None, json!({"split": "train", "index": 0})).await.expect("task")).await;
    assert_eq!(first["task"], json!({"task_id": "examples/relu", "index": 0}));
    let range = json!({"split": "train", "start": 1, "stop": 3});
    let (_, ranged) = json(post("/task_range", None, range).await.expect("range")).await;
    let indexes: Vec<u64> =
        ranged["tasks"].as_array().expect("tasks").iter().filter_map(|t| t["index"].as_u64()).collect();
    assert_eq!(indexes, [1, 2]);
    let (status, error) = json(post("/kforge/tasks", None, json!({"split": "test"})).await.expect("tasks")).await;
    assert_eq!((status, error["field"].as_str()), (404, Some("split")), "{error}");
    let (status, error) =
        json(post("/kforge/task", None, json!({"split": "train", "index": 999})).await.expect("task")).await;
    assert_eq!((status, error["field"].as_str()), (400, Some("index")), "{error}");
    assert_eq!(get("/elsewhere/tools", None).await.expect("tools").status(), 404);

    // A session: its id over SSE, then its episode.
    let mut created = Events::new(post("/create_session", None, json!({})).await.expect("create_session"));
    let sid = created.task_id().await;
    assert_eq!(created.next().await.expect("an end event").name, "end");
    assert!(created.next().await.is_none());
    let (status, error) =
        json(post("/create", None, json!({"task_spec": {"task_id": "examples/relu"}})).await.expect("create")).await;
    assert_eq!((status, error["field"].as_str()), (400, Some("X-Session-ID")), "{error}");
    let (status, error) =
        json(post("/create", Some(&sid), json!({"task_spec": {"task_id": "nope"}})).await.expect("create")).await;
    assert_eq!((status, error["field"].as_str()), (404, Some("task_spec.task_id")), "{error}");
    assert_eq!(post("/kforge/prompt", Some(&sid), json!({})).await.expect("prompt").status(), 405, "GET only");
    let (status, _) = json(get("/kforge/prompt", Some(&sid)).await.expect("prompt")).await;
    assert_eq!(status, 400, "no episode before /create");
    // What the clients send: the spec, the env name, secrets; unknown keys are ignored.
    let create = json!({"task_spec": {"task_id": "examples/relu", "index": 0}, "env_name": "kforge",
                        "secrets": {"KEY": "value"}, "toolset_name": "default"});
    assert_eq!(
        json(post("/create", Some(&sid), create.clone()).await.expect("create")).await,
        (200, json!({"sid": sid}))
    );
    assert_eq!(json(post("/ping", Some(&sid), json!({})).await.expect("ping")).await, (200, json!({"status": "ok"})));
    assert_eq!(post("/ping", Some("no-such-session"), json!({})).await.expect("ping").status(), 404);

    let (status, prompt) = json(get("/kforge/prompt", Some(&sid)).await.expect("prompt")).await;
    assert_eq!(status, 200);
    let blocks = prompt.as_array().expect("blocks");
    assert_eq!(blocks.len(), 1, "{prompt}");
    assert_eq!((blocks[0]["type"].as_str(), blocks[0]["detail"].clone()), (Some("text"), Value::Null));
    assert!(blocks[0]["text"].as_str().expect("text").contains("torch.relu"), "{prompt}");
    assert_eq!(json(get("/prompt", Some(&sid)).await.expect("prompt")).await.1, prompt, "bare /prompt");

    // An unknown tool and a bad input are the tool's answers, `ok: false`.
    let mut unknown =
        Events::new(post("/kforge/call", Some(&sid), json!({"name": "rm", "input": {}})).await.expect("call"));
    unknown.task_id().await;
    let refused = unknown.result().await;
    assert_eq!(refused["ok"], false, "{refused}");
    assert!(refused["error"].as_str().expect("why").contains("rm"), "{refused}");
    let no_code = json!({"name": "submit_kernel", "input": {"source": RELU}});
    let mut bad = Events::new(post("/kforge/call", Some(&sid), no_code).await.expect("call"));
    bad.task_id().await;
    let refused = bad.result().await;
    assert_eq!(refused["ok"], false, "{refused}");
    assert!(refused["error"].as_str().expect("why").starts_with("input.code"), "{refused}");

    // The kernel: the stream is dropped after its task_id, as a connection lost mid-call, and asked for again.
    let submit = json!({"name": "submit_kernel", "input": {"code": RELU}});
    let mut dropped = Events::new(post("/call", Some(&sid), submit.clone()).await.expect("call"));
    let task_id = dropped.task_id().await;
    drop(dropped);
    let mut again = submit.clone();
    again["task_id"] = task_id.clone().into();
    let started = Instant::now();
    let mut attached = Events::new(post("/kforge/call", Some(&sid), again.clone()).await.expect("call"));
    assert_eq!(attached.task_id().await, task_id, "the same call");
    let result = attached.result().await;
    assert_eq!(result["ok"], true, "{result}");
    let output = &result["output"];
    for key in ["blocks", "metadata", "reward", "finished"] {
        assert!(output.get(key).is_some(), "{key} in {output}");
    }
    assert!(output["reward"].as_f64().is_some_and(|r| r > 0.0), "a correct kernel scores: {output}");
    assert_eq!(output["finished"], true, "one turn: {output}");
    assert_eq!(output["blocks"][0]["type"], "text");
    assert!(output["blocks"][0]["text"].as_str().expect("text").starts_with("correct"), "{output}");
    assert_eq!(output["metadata"]["verdict"], "correct");
    assert_eq!(output["metadata"]["task_id"], "examples/relu");
    if started.elapsed().as_secs_f64() > 8.0 {
        assert!(attached.comments > 0, "a `:` comment at least every 5 s while the call runs");
    }

    // Re-attaching to the finished call gives its result, not a second run (which would find the episode over).
    let mut finished = Events::new(post("/kforge/call", Some(&sid), again).await.expect("call"));
    assert_eq!(finished.task_id().await, task_id);
    assert_eq!(finished.result().await, result);
    let mut lost = Events::new(
        post("/kforge/call", Some(&sid), json!({"name": "submit_kernel", "task_id": "nope"})).await.expect("call"),
    );
    let event = lost.next().await.expect("an event");
    assert_eq!((event.name.as_str(), event.data.as_str()), ("error", "unknown task_id"));
    let mut over = Events::new(post("/kforge/call", Some(&sid), submit).await.expect("call"));
    over.task_id().await;
    let refused = over.result().await;
    assert_eq!(refused["ok"], false, "{refused}");
    assert!(refused["error"].as_str().expect("why").contains("over"), "{refused}");

    // The face forgets a deleted session; creating it again reaches the same episode (over: no prompt left).
    assert_eq!(json(post("/delete", Some(&sid), json!({})).await.expect("delete")).await, (200, json!({"sid": sid})));
    assert_eq!(post("/ping", Some(&sid), json!({})).await.expect("ping").status(), 404);
    assert_eq!(get("/kforge/prompt", Some(&sid)).await.expect("prompt").status(), 404);
    assert_eq!(json(post("/create", Some(&sid), create).await.expect("create")).await, (200, json!({"sid": sid})));
    assert_eq!(json(get("/kforge/prompt", Some(&sid)).await.expect("prompt")).await, (200, json!([])));
    let delete_session = post("/delete_session", Some(&sid), json!({})).await.expect("delete_session");
    assert_eq!(json(delete_session).await, (200, json!({"sid": sid})));

    mesh.shutdown().await.expect("the mesh drains");
}
