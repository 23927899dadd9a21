//! The dashboards against a real Prometheus: a mesh (gateway over a replay file, evaluator on the CPU backend,
//! reward, orchestrator) runs one short job whose turns are correct, a compile error, a hack, junk and not okay;
//! a `prometheus` of this test's own scrapes the services' `/metrics` every second; then every panel expression of
//! every dashboard in `helm/kforge/dashboards/` is evaluated through Prometheus's HTTP API over a window covering
//! the job and held to what the job's metrics (GetJob), its recorded turns, or the raw series say.
//!
//! Beside it, the services' `/metrics` pages are read before and after the job: every series the job moved must
//! have existed before it (at 0 for a fresh mesh), since `rate` and `increase` cannot count the event that creates
//! a series.
//!
//! Needs `prometheus` and the Python environment (`scripts/setup.sh --test` installs both): without them the test
//! says `SKIP:`, and fails under `KFORGE_CI=1`. About 60 s on a 2-core machine shared with builds (30 s of CPU),
//! most of it the three evaluations that run on the CPU (a torch import each, the reference, the eager baseline);
//! the other turns end at static checks or before.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kforge::mesh::{MeshConfig, Service};
use kforge_gateway::config::{BackendConfig, BackendKind, PoolConfig};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::client::ClientConfig;
use kforge_test_support::{Wait, python};
use serde_json::{Value, json};

const TASK_ID: &str = "examples/relu";
const TASK: &str = include_str!("../../../examples/tasks/relu/task.py");
const NAMESPACE: &str = "kforge-dashboards";
const SERVICES: [(Service, &str); 4] = [
    (Service::Gateway, "kforge-gateway"),
    (Service::Evaluator, "kforge-evaluator"),
    (Service::Reward, "kforge-reward"),
    (Service::Orchestrator, "kforge-orchestrator"),
];
/// A bound on every wait: a scrape every second, a job of two CPU evaluations.
const PATIENCE: Duration = Duration::from_secs(120);

fn kernel(body: &str) -> String {
    format!(
        "```python\nimport torch\nimport torch.nn as nn\n\n\nclass ModelNew(nn.Module):\n    def __init__(self):\n        \
         super().__init__()\n\n    def forward(self, x):\n        {body}\n```\n"
    )
}

/// The replay: (trajectory, turn, reasoning, answer). Turn 0: correct, correct, a compile error (not okay);
/// turn 1: a hack (a rejection with a hack-category finding), junk (no kernel), incorrect (not okay).
fn replay() -> Vec<(u32, u32, &'static str, String)> {
    let hack = "```python\nimport torch\n\n\nclass ModelNew(Model):\n    pass\n```\n".to_owned();
    vec![
        (0, 0, "Okay, relu is a max with zero.", kernel("return torch.relu(x)")),
        (1, 0, "Okay, clamp at zero.", kernel("return torch.clamp(x, min=0.0)")),
        (2, 0, "Hmm, a quick one.", kernel("return torch.relu(x) +")),
        (0, 1, "Okay, the reference does it already.", hack),
        (1, 1, "Okay, I will think about it.", "No code this time.".to_owned()),
        (2, 1, "Well, half of it will do.", kernel("return torch.relu(x) * 0.5")),
    ]
}

/// What the test needs from the machine, or why it skips (a failure under `KFORGE_CI=1`).
fn tools() -> Option<PathBuf> {
    if Command::new("prometheus").arg("--version").output().is_err() {
        python::skip("prometheus is not installed: run scripts/setup.sh --test");
        return None;
    }
    python::or_skip(&[])
}

/// A `prometheus` process of this test's own, killed when dropped.
struct Prometheus {
    child: Child,
    base: String,
    http: reqwest::Client,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts it on an ephemeral port (read from its log) scraping `targets` (`(service, host:port)`) every second.
    fn start(dir: &Path, targets: &[(&str, String)]) -> Self {
        let jobs: Vec<Value> = targets
            .iter()
            .map(|(service, address)| {
                json!({
                    "job_name": service,
                    "static_configs": [{
                        "targets": [address],
                        "labels": {"namespace": NAMESPACE, "service": service, "pod": format!("{service}-0")},
                    }],
                })
            })
            .collect();
        let config = json!({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": jobs,
        });
        // JSON is YAML.
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config.to_string()).expect("prometheus config written");
        let mut child = Command::new("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg("--web.listen-address=127.0.0.1:0")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("prometheus starts");
        let stderr = child.stderr.take().expect("stderr piped");
        let (address_tx, address_rx) = std::sync::mpsc::channel();
        // Reads its log to the end (a full pipe would stop it); the first "Listening on" names its port.
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !sent && line.contains("msg=\"Listening on\"") {
                    let address = line.split("address=").nth(1).unwrap_or("").split_whitespace().next();
                    let _ = address_tx.send(address.unwrap_or("").to_owned());
                    sent = true;
                }
            }
        });
        let address = address_rx.recv_timeout(PATIENCE).expect("prometheus says where it listens");
        Self { child, base: format!("http://{address}"), http: reqwest::Client::new() }
    }

    async fn ready(&self) {
        let url = format!("{}/-/ready", self.base);
        scraping_wait("prometheus is ready")
            .until(|| async { self.http.get(&url).send().await.ok().filter(|r| r.status().is_success()).map(|_| ()) })
            .await
    }

    /// An instant query at `time` (Unix seconds): each series' labels and value.
    async fn query(&self, query: &str, time: f64) -> Vec<(BTreeMap<String, String>, f64)> {
        let response: Value = self
            .http
            .get(format!("{}/api/v1/query", self.base))
            .query(&[("query", query.to_owned()), ("time", format!("{time:.3}"))])
            .send()
            .await
            .expect("query sent")
            .json()
            .await
            .expect("a JSON answer");
        assert_eq!(response["status"], "success", "{query}: {response}");
        let result = &response["data"]["result"];
        let series = match response["data"]["resultType"].as_str() {
            Some("vector") => result.as_array().cloned().unwrap_or_default(),
            Some("scalar") => vec![json!({"metric": {}, "value": result})],
            other => panic!("{query}: a {other:?} result"),
        };
        series
            .iter()
            .map(|s| {
                let labels = s["metric"]
                    .as_object()
                    .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned())).collect())
                    .unwrap_or_default();
                let value = s["value"][1].as_str().expect("a sample value").parse::<f64>().expect("a number");
                (labels, value)
            })
            .collect()
    }

    /// The timestamp of `service`'s latest successful scrape, once it is later than `after` (Unix seconds).
    async fn scraped_after(&self, service: &str, after: f64) -> f64 {
        // `timestamp` of a selector is its sample's time (of an expression, the evaluation's): `up` has one per
        // scrape.
        let (up, at) = (format!("up{{job=\"{service}\"}}"), format!("timestamp(up{{job=\"{service}\"}})"));
        scraping_wait(format!("a scrape of {service}"))
            .until(|| async {
                let now = unix_now();
                let (up, at) = (self.query(&up, now).await, self.query(&at, now).await);
                let scraped = up.first().is_some_and(|(_, up)| *up == 1.0);
                at.first().map(|(_, t)| *t).filter(|&t| scraped && t > after)
            })
            .await
    }
}

/// A wait for Prometheus: every 100 ms (each ask is an HTTP query), for at most [`PATIENCE`].
fn scraping_wait(what: impl Into<String>) -> Wait {
    Wait::new(what).within(PATIENCE).every(Duration::from_millis(100))
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970").as_secs_f64()
}

/// A service's `/metrics` page as series (name and labels) and values.
async fn scrape(address: &str) -> BTreeMap<String, f64> {
    let page = reqwest::get(format!("http://{address}/metrics")).await.expect("scraped").text().await.expect("text");
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(series, value)| (series.to_owned(), value.parse().expect("a number")))
        .collect()
}

/// Prometheus's `histogram_quantile` over cumulative `(le, count)` buckets: linear within the bucket holding the
/// rank; the last finite bound when it falls in `+Inf`; NaN without observations.
fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> f64 {
    let mut buckets = buckets.to_vec();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().map_or(0.0, |b| b.1);
    if buckets.len() < 2 || total == 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let b = buckets.iter().position(|&(_, count)| count >= rank).expect("+Inf holds every observation");
    if b == buckets.len() - 1 {
        return buckets[b - 1].0;
    }
    let (start, below) = if b == 0 { (0.0, 0.0) } else { buckets[b - 1] };
    let (end, count) = buckets[b];
    start + (end - start) * ((rank - below) / (count - below))
}

/// One series' value as a panel must show it.
#[derive(Debug, Clone, Copy)]
enum Want {
    Value(f64),
    /// Prometheus's NaN: 0/0 or a quantile without observations; Grafana draws nothing.
    NaN,
    /// Any positive, finite value (a latency quantile of calls this test cannot time itself).
    Positive,
}

/// What a panel's expression must return: every series by its rendered legend.
type Expected = BTreeMap<String, Want>;

fn values<K: ToString>(pairs: impl IntoIterator<Item = (K, f64)>) -> Expected {
    pairs.into_iter().map(|(k, v)| (k.to_string(), Want::Value(v))).collect()
}

/// The orchestrator's `verdict` label of a recorded turn.
fn verdict_label(turn: &pb::TurnRecord) -> String {
    match pb::Verdict::try_from(turn.verdict) {
        Ok(pb::Verdict::Unspecified) | Err(_) if !turn.error.is_empty() => "failed".into(),
        Ok(pb::Verdict::Unspecified) | Err(_) => "none".into(),
        Ok(verdict) => verdict.as_str_name().trim_start_matches("VERDICT_").to_lowercase(),
    }
}

fn ratio(r: Option<&pb::CountRatio>) -> f64 {
    let r = r.expect("a ratio with a denominator");
    assert!(r.denominator > 0, "{r:?}");
    r.value
}

/// The raw series of one metric at `time`, keyed by their labels less the target's.
type Raw = BTreeMap<BTreeMap<String, String>, f64>;

async fn raw(prometheus: &Prometheus, name: &str, time: f64) -> Raw {
    let query = format!("{name}{{namespace=\"{NAMESPACE}\"}}");
    prometheus
        .query(&query, time)
        .await
        .into_iter()
        .map(|(mut labels, value)| {
            for target in ["__name__", "namespace", "service", "pod", "instance", "job"] {
                labels.remove(target);
            }
            (labels, value)
        })
        .collect()
}

/// Each series' increase over the window: its value at the end less its value at the start (0 where absent).
fn increase(start: &Raw, end: &Raw) -> Raw {
    end.iter().map(|(k, v)| (k.clone(), v - start.get(k).copied().unwrap_or(0.0))).collect()
}

/// Cumulative buckets of a histogram's increase, per value of `by`.
fn buckets_by(increase: &Raw, by: &[&str]) -> BTreeMap<Vec<String>, Vec<(f64, f64)>> {
    let mut grouped: BTreeMap<Vec<String>, BTreeMap<String, f64>> = BTreeMap::new();
    for (labels, value) in increase {
        let key = by.iter().map(|l| labels.get(*l).cloned().unwrap_or_default()).collect();
        *grouped.entry(key).or_default().entry(labels["le"].clone()).or_default() += value;
    }
    grouped
        .into_iter()
        .map(|(k, les)| {
            let buckets = les.into_iter().map(|(le, count)| (le.parse::<f64>().expect("a bound"), count)).collect();
            (k, buckets)
        })
        .collect()
}

/// The window of a panel's queries: from the last scrape before the job to the first after it, of one target.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: f64,
    end: f64,
}

impl Window {
    /// The range the panels' `$__rate_interval` and `$__range` become, in milliseconds: a millisecond wider than
    /// the scrapes it spans, so its first sample is the one before the job whether the range's left end is open or
    /// closed. A counter's increase from 0 is then not extrapolated, and `rate` is the increase over the range.
    fn range_ms(&self) -> u64 {
        ((self.end - self.start) * 1e3).round() as u64 + 1
    }

    fn range_s(&self) -> f64 {
        self.range_ms() as f64 / 1e3
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_shows_what_the_job_measured() {
    let Some(python) = tools() else { return };
    let started = Instant::now();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dashboards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");

    // The replay: every turn's answer, with token counts so the token panels have figures.
    let lines: Vec<String> = replay()
        .into_iter()
        .map(|(trajectory, turn, reasoning, text)| {
            json!({
                "task_id": TASK_ID, "trajectory": trajectory, "turn": turn,
                "completions": [{"text": text, "reasoning": reasoning}],
                "usage": {"prompt_tokens": 100 + turn, "completion_tokens": 40, "cached_prompt_tokens": 10,
                          "reasoning_tokens": 7},
            })
            .to_string()
        })
        .collect();
    let replay_file = dir.join("replay.jsonl");
    std::fs::write(&replay_file, lines.join("\n") + "\n").expect("replay written");

    let mut config = MeshConfig::default();
    config.gateway.pools = vec![PoolConfig {
        model: "replay".into(),
        backends: vec![BackendConfig {
            kind: BackendKind::Replay,
            file: Some(replay_file),
            ..BackendConfig::default()
        }],
        ..PoolConfig::default()
    }];
    config.evaluator.python = python;
    config.evaluator.work_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboards-evaluator");
    // torch.compile on a CPU takes minutes per task; the eager baseline is enough for fast_1.
    config.evaluator.baseline_torch_compile = false;
    config.evaluator.bindings_pch = false;
    // The evaluator's panels count evaluations, the job's metrics turns: an unsteady timing that the orchestrator
    // measures again (on this loaded machine, now and then) would be one evaluation more than the job has turns.
    config.evaluator.paired_timing.spread_bound = 1e9;
    let services: Vec<Service> = SERVICES.iter().map(|(s, _)| *s).collect();
    let mesh = kforge_tests::start(&services, &config).await;
    let address = |service: Service| mesh.address(service).expect("runs").trim_start_matches("http://").to_owned();
    let targets: Vec<(&str, String)> = SERVICES.iter().map(|(s, name)| (*name, address(*s))).collect();

    let prometheus = Prometheus::start(&dir, &targets);
    prometheus.ready().await;
    // The scrape before the job: every series the panels read is in it.
    let mut before_job = BTreeMap::new();
    for (name, _) in &targets {
        before_job.insert(*name, prometheus.scraped_after(name, 0.0).await);
    }
    let mut pages_before = BTreeMap::new();
    for (name, address) in &targets {
        pages_before.insert(*name, scrape(address).await);
    }

    let channel = kforge_tests::connect(&mesh, Service::Orchestrator, &ClientConfig::default()).await;
    let mut orchestrator = OrchestratorClient::new(channel);
    let spec = pb::JobSpec {
        kind: pb::JobKind::Evaluation.into(),
        recipe: "kevin".into(),
        strict_format: Some(false),
        policy: "permissive".into(),
        task_set: "inline".into(),
        tasks: vec![pb::Task { task_id: TASK_ID.into(), source: TASK.into() }],
        model: "replay".into(),
        trajectories_per_task: 3,
        turns: 2,
        backend: pb::Backend::Cpu.into(),
        ..Default::default()
    };
    let job = orchestrator
        .submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() })
        .await
        .expect("submitted")
        .into_inner();
    let mut updates =
        orchestrator.watch_job(pb::WatchJobRequest { job_id: job.job_id.clone() }).await.expect("watched").into_inner();
    while updates.message().await.expect("an update").is_some() {}
    let job =
        orchestrator.get_job(pb::GetJobRequest { job_id: job.job_id.clone() }).await.expect("the job").into_inner();
    assert_eq!(job.state(), pb::JobState::Succeeded, "{job:?}");
    let metrics = job.metrics.clone().expect("the job's metrics");
    let listed = orchestrator
        .list_trajectories(pb::ListTrajectoriesRequest { job_id: job.job_id.clone(), ..Default::default() })
        .await
        .expect("listed")
        .into_inner();
    let turns: Vec<pb::TurnRecord> = listed.trajectories.into_iter().flat_map(|t| t.turns).collect();
    assert_eq!(turns.len(), 6, "{turns:#?}");
    let labels: BTreeSet<String> = turns.iter().map(verdict_label).collect();
    for wanted in ["correct", "compile_error", "rejected", "none", "incorrect"] {
        assert!(labels.contains(wanted), "a {wanted} turn among {labels:?}: {turns:#?}");
    }
    assert!(metrics.hacks == 1 && metrics.junk == 1 && metrics.not_okay == 2, "{metrics:#?}");

    // Every series the job moved existed before it: `increase` counts every event.
    let mut pages_after = BTreeMap::new();
    for (name, address) in &targets {
        pages_after.insert(*name, scrape(address).await);
    }
    for (name, _) in &targets {
        let (before, after) = (&pages_before[name], &pages_after[name]);
        for (series, value) in after {
            // Health checks and reflection are counted from their first call (docs/METRICS.md), and an evaluator's
            // findings by code from a code's first finding (the panel shows their totals, not their rate).
            let exempt = ["grpc.health.v1", "grpc.reflection", "kforge_evaluator_findings_total"]
                .iter()
                .any(|e| series.contains(e));
            match before.get(series) {
                Some(old) => assert!(value >= old || !series.contains("_total"), "{series}: {old} -> {value}"),
                None => assert!(exempt, "{name}: {series} = {value} was created by the job: rate cannot count it"),
            }
        }
    }
    let job_done = unix_now();

    // The window of each target: its last scrape before the job to its first after the job and the pages above.
    let mut windows = BTreeMap::new();
    for (name, _) in &targets {
        let end = prometheus.scraped_after(name, job_done).await;
        windows.insert(*name, Window { start: before_job[name], end });
    }
    let whole = Window {
        start: windows.values().map(|w| w.start).fold(f64::INFINITY, f64::min),
        end: windows.values().map(|w| w.end).fold(0.0, f64::max),
    };

    let expected = expectations(&prometheus, &windows, &metrics, &turns, &pages_before, &pages_after).await;
    let mut checked = 0;
    let dashboards = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../helm/kforge/dashboards");
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dashboards).expect("dashboards").map(|e| e.expect("entry").path()).collect();
    files.sort();
    let mut failures = Vec::new();
    for file in files.iter().filter(|f| f.extension().is_some_and(|e| e == "json")) {
        let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(file).expect("read")).expect("JSON");
        let file_name = file.file_name().expect("named").to_string_lossy().into_owned();
        for panel in dashboard["panels"].as_array().expect("panels") {
            let title = panel["title"].as_str().expect("a title");
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("an expression");
                let legend = target["legendFormat"].as_str().unwrap_or("");
                let key = format!("{file_name}: {title}: {legend}");
                let want = expected.get(key.as_str()).unwrap_or_else(|| panic!("no expectation for {key}"));
                let window = match target_of(expr) {
                    Some(service) => windows[service],
                    None => whole,
                };
                let query = expr
                    .replace("$namespace", NAMESPACE)
                    .replace("$__rate_interval", &format!("{}ms", window.range_ms()))
                    .replace("$__range", &format!("{}ms", window.range_ms()))
                    .replace("$__interval", "1s");
                let got: BTreeMap<String, f64> = prometheus
                    .query(&query, window.end)
                    .await
                    .into_iter()
                    .map(|(labels, value)| (render(legend, &labels), value))
                    .collect();
                if let Err(why) = compare(want, &got) {
                    failures.push(format!("{key}\n  {query}\n  {why}\n  got {got:?}\n  want {want:?}"));
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, expected.len(), "every expectation belongs to a panel");
    assert!(failures.is_empty(), "{} of {checked} panel queries differ:\n{}", failures.len(), failures.join("\n"));
    println!("dashboards: {checked} panel queries checked in {:.1} s", started.elapsed().as_secs_f64());
    drop(prometheus);
    mesh.shutdown().await.expect("drains");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The target whose series an expression reads, where it reads one target's only.
fn target_of(expr: &str) -> Option<&'static str> {
    if expr.contains("kforge_grpc_") || expr.contains("up{") {
        None
    } else if expr.contains("kforge_orchestrator_") {
        Some("kforge-orchestrator")
    } else if expr.contains("kforge_evaluator_") {
        Some("kforge-evaluator")
    } else if expr.contains("kforge_gateway_") {
        Some("kforge-gateway")
    } else {
        None
    }
}

/// A legend format with `{{label}}` replaced by the series' labels.
fn render(legend: &str, labels: &BTreeMap<String, String>) -> String {
    let mut out = legend.to_owned();
    for (k, v) in labels {
        out = out.replace(&format!("{{{{{k}}}}}"), v);
    }
    out
}

/// Whether `got` has exactly the series of `want`, each with its value (within float rounding).
fn compare(want: &Expected, got: &BTreeMap<String, f64>) -> Result<(), String> {
    let (wanted, found): (BTreeSet<&String>, BTreeSet<&String>) = (want.keys().collect(), got.keys().collect());
    if wanted != found {
        return Err(format!("series {found:?}, want {wanted:?}"));
    }
    for (key, want) in want {
        let got = got[key];
        let ok = match *want {
            Want::Value(v) => (got - v).abs() <= 1e-9 * v.abs().max(1.0),
            Want::NaN => got.is_nan(),
            Want::Positive => got.is_finite() && got > 0.0,
        };
        if !ok {
            return Err(format!("{key}: {got}, want {want:?}"));
        }
    }
    Ok(())
}

/// Every panel's expected series, by `file: title: legend`.
async fn expectations(
    prometheus: &Prometheus,
    windows: &BTreeMap<&str, Window>,
    metrics: &pb::JobMetrics,
    turns: &[pb::TurnRecord],
    pages_before: &BTreeMap<&str, BTreeMap<String, f64>>,
    pages_after: &BTreeMap<&str, BTreeMap<String, f64>>,
) -> BTreeMap<&'static str, Expected> {
    let (orchestrator, evaluator, gateway) =
        (windows["kforge-orchestrator"], windows["kforge-evaluator"], windows["kforge-gateway"]);
    let per_second = |count: f64, window: Window| count / window.range_s();
    let delta = |name: &'static str, window: Window| async move {
        let (start, end) = (raw(prometheus, name, window.start).await, raw(prometheus, name, window.end).await);
        increase(&start, &end)
    };
    let by_turn = |rate: fn(&pb::JobRates) -> f64| -> Expected {
        values(metrics.by_turn.iter().map(|t| (format!("turn {}", t.turn), rate(t.rates.as_ref().expect("rates")))))
    };
    let count = |label: &str| turns.iter().filter(|t| verdict_label(t) == label).count() as f64;
    let mut e: BTreeMap<&'static str, Expected> = BTreeMap::new();

    // episodes.json: the job's metrics, turn by turn.
    e.insert("episodes.json: Correctness per turn: turn {{turn}}", by_turn(|r| ratio(r.correct.as_ref())));
    e.insert(
        "episodes.json: fast_1 per turn: turn {{turn}}",
        by_turn(|r| {
            let fast_1 = r.fast_p.iter().find(|f| f.threshold == 1.0).expect("fast_1");
            ratio(fast_1.eager.as_ref())
        }),
    );
    e.insert("episodes.json: Hack ratio per turn: turn {{turn}}", by_turn(|r| ratio(r.hack.as_ref())));
    e.insert("episodes.json: Junk ratio per turn: turn {{turn}}", by_turn(|r| ratio(r.junk.as_ref())));
    e.insert("episodes.json: Not-okay ratio per turn: turn {{turn}}", by_turn(|r| ratio(r.not_okay.as_ref())));
    e.insert(
        "episodes.json: Turns in flight by stage: {{stage}}",
        values(["generating", "evaluating", "scoring"].map(|s| (s, 0.0))),
    );
    let mut turn_buckets: Vec<(f64, f64)> = std::iter::successors(Some(0.01), |b| Some(b * 2.0))
        .take(20)
        .chain([f64::INFINITY])
        .map(|le| (le, turns.iter().filter(|t| t.wall_time_s.max(0.0) <= le).count() as f64))
        .collect();
    turn_buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (q, legend) in [(0.5, "p50"), (0.95, "p95")] {
        let key = if q == 0.5 {
            "episodes.json: Turn latency p50 / p95: p50"
        } else {
            "episodes.json: Turn latency p50 / p95: p95"
        };
        e.insert(key, values([(legend, histogram_quantile(q, &turn_buckets))]));
    }
    let verdicts = [
        "correct",
        "incorrect",
        "compile_error",
        "runtime_error",
        "timeout",
        "rejected",
        "hack",
        "infra_error",
        "none",
        "failed",
    ];
    e.insert(
        "episodes.json: Turns by verdict: {{verdict}}",
        values(verdicts.map(|v| (v, per_second(count(v), orchestrator)))),
    );

    // evaluation.json: the evaluator's verdicts are the job's evaluated turns.
    let evaluated = metrics.evaluated as f64;
    e.insert("evaluation.json: Hack ratio: hack", values([("hack", metrics.hack_ratio)]));
    e.insert("evaluation.json: Correctness: correct", values([("correct", metrics.correctness)]));
    e.insert("evaluation.json: Correctness: compile error", values([("compile error", metrics.compile_error_rate)]));
    e.insert("evaluation.json: Correctness: incorrect", values([("incorrect", count("incorrect") / evaluated)]));
    e.insert(
        "evaluation.json: Verdicts: {{verdict}}",
        values((1..=8).map(|v| {
            let verdict = pb::Verdict::try_from(v).expect("a verdict");
            let label = verdict.as_str_name().trim_start_matches("VERDICT_").to_lowercase();
            (verdict.as_str_name(), per_second(count(&label), evaluator))
        })),
    );
    let mut hack_findings: BTreeMap<String, f64> = BTreeMap::new();
    for finding in turns.iter().filter_map(|t| t.evaluation.as_ref()).flat_map(|e| &e.findings) {
        if finding.category == pb::FindingCategory::Hack as i32 {
            *hack_findings.entry(finding.code.clone()).or_default() += 1.0;
        }
    }
    assert!(!hack_findings.is_empty(), "the hack turn's finding: {turns:#?}");
    e.insert("evaluation.json: Hack findings by code (since each pod started): {{code}}", values(hack_findings));
    e.insert(
        "evaluation.json: Queue depth (admitted evaluations) per pod: {{pod}}",
        values([("kforge-evaluator-0", 0.0)]),
    );
    e.insert("evaluation.json: Queue depth (admitted evaluations) per pod: pool", values([("pool", 0.0)]));
    e.insert(
        "evaluation.json: Stages running: {{stage}}",
        values(["compile", "reference", "candidate", "check", "baseline", "bindings_pch"].map(|s| (s, 0.0))),
    );
    let stage_buckets = buckets_by(&delta("kforge_evaluator_stage_seconds_bucket", evaluator).await, &["stage"]);
    assert!(stage_buckets.keys().any(|k| k[0] == "candidate"), "{stage_buckets:?}");
    for (q, key) in [
        (0.5, "evaluation.json: Stage latency p50 / p95: p50 {{stage}}"),
        (0.95, "evaluation.json: Stage latency p50 / p95: p95 {{stage}}"),
    ] {
        let prefix = if q == 0.5 { "p50" } else { "p95" };
        let series = stage_buckets
            .iter()
            .map(|(stage, buckets)| {
                let value = histogram_quantile(q, buckets);
                (format!("{prefix} {}", stage[0]), if value.is_nan() { Want::NaN } else { Want::Value(value) })
            })
            .collect();
        e.insert(key, series);
    }
    // Every kforge method a service serves has a histogram from the start: NaN without calls in the window, a
    // latency with them. Methods called during the job, as the services' own pages counted them:
    let moved = |name: &str, suffix: &str| -> BTreeSet<String> {
        let mut found = BTreeSet::new();
        for (service, after) in pages_after {
            for (series, value) in after.iter().filter(|(s, _)| s.starts_with(name) && s.contains(suffix)) {
                if pages_before[service].get(series).is_none_or(|old| old != value) {
                    let method = series.split("method=\"").nth(1).and_then(|m| m.split('"').next());
                    found.insert(method.unwrap_or("").to_owned());
                }
            }
        }
        found
    };
    let called = moved("kforge_grpc_latency_seconds_count", "");
    assert!(called.contains("/kforge.v1.Evaluator/Evaluate"), "{called:?}");
    let mut latency: Expected = BTreeMap::new();
    for page in pages_after.values() {
        for series in page.keys().filter(|s| s.starts_with("kforge_grpc_latency_seconds_count")) {
            let method = series.split("method=\"").nth(1).and_then(|m| m.split('"').next()).unwrap_or("").to_owned();
            let want = if called.contains(&method) { Want::Positive } else { Want::NaN };
            latency.insert(method, want);
        }
    }
    e.insert("evaluation.json: RPC latency p95 by method: {{method}}", latency);
    // The CPU backend: no GPU is quarantined, no device is probed. The device memory reserved is a gauge per GPU
    // the evaluator found: none on a machine without one, 0 on each after the job on a machine with some.
    e.insert("evaluation.json: GPU pool: quarantined GPUs: {{pod}}", values([("kforge-evaluator-0", 0.0)]));
    e.insert("evaluation.json: GPU pool: device probes: {{result}}", values([("pass", 0.0), ("fail", 0.0)]));
    let gpus = raw(prometheus, "kforge_evaluator_gpu_reserved_bytes", evaluator.end).await;
    e.insert(
        "evaluation.json: GPU pool: memory reserved by admission: {{pod}} gpu {{gpu}}",
        values(gpus.keys().map(|labels| (format!("kforge-evaluator-0 gpu {}", labels["gpu"]), 0.0))),
    );
    e.insert("evaluation.json: Pods up: {{service}}", values(SERVICES.map(|(_, name)| (name, 1.0))));
    let caches = delta("kforge_evaluator_cache_lookups_total", evaluator).await;
    let mut hit_ratio = BTreeMap::new();
    for cache in caches.keys().map(|l| l["cache"].clone()).collect::<BTreeSet<_>>() {
        let of = |outcome: &str| -> f64 {
            caches.iter().filter(|(l, _)| l["cache"] == cache && l["outcome"] == outcome).map(|(_, v)| v).sum()
        };
        let (hits, all) = (of("hit"), of("hit") + of("miss"));
        if all > 0.0 {
            hit_ratio.insert(cache, hits / all);
        }
    }
    e.insert("evaluation.json: Cache hit ratio: {{cache}}", values(hit_ratio));
    // Errors: the calls of the job that failed, as the services' own pages counted them (none, in a good run).
    let mut failed: Expected = BTreeMap::new();
    for (service, after) in pages_after {
        for (series, value) in after.iter().filter(|(s, _)| s.starts_with("kforge_grpc_requests_total")) {
            let code = series.split("code=\"").nth(1).and_then(|c| c.split('"').next()).unwrap_or("");
            let method = series.split("method=\"").nth(1).and_then(|m| m.split('"').next()).unwrap_or("");
            if code != "Ok" && pages_before[service].get(series).is_none_or(|v| v != value) {
                failed.insert(format!("{method} {code}"), Want::Positive);
            }
        }
    }
    e.insert("evaluation.json: RPC errors by code: {{method}} {{code}}", failed);

    // generation-cost.json: a replay pool has no price and its answers cost nothing, so no job has a cost series
    // (by job: nothing to plot) and the cost in range is $0.
    e.insert("generation-cost.json: Cost (USD per hour) by job: {{exported_job}}", BTreeMap::new());
    e.insert("generation-cost.json: Cost (USD) in range: total", values([("total", 0.0)]));
    let usage = metrics.usage.expect("usage");
    e.insert(
        "generation-cost.json: Tokens per second by kind: {{kind}}",
        values([
            ("prompt", per_second(usage.prompt_tokens as f64, gateway)),
            ("completion", per_second(usage.completion_tokens as f64, gateway)),
            ("cached_prompt", per_second(usage.cached_prompt_tokens as f64, gateway)),
            ("reasoning", per_second(usage.reasoning_tokens as f64, gateway)),
        ]),
    );
    let requests = turns.len() as f64;
    let mut by_code: Expected =
        (0..=16).map(|c| (kforge_server::code_name(tonic::Code::from(c)), Want::Value(0.0))).collect();
    by_code.insert("OK".into(), Want::Value(per_second(requests, gateway)));
    e.insert("generation-cost.json: Requests by status: {{code}}", by_code);
    let ttft = buckets_by(&delta("kforge_gateway_ttft_seconds_bucket", gateway).await, &["model"]);
    let completion = buckets_by(&delta("kforge_gateway_latency_seconds_bucket", gateway).await, &["backend"]);
    for (q, prefix, key) in [
        (0.5, "p50", "generation-cost.json: Time to first token p50 / p95: p50 {{model}}"),
        (0.95, "p95", "generation-cost.json: Time to first token p50 / p95: p95 {{model}}"),
    ] {
        e.insert(key, values(ttft.iter().map(|(m, b)| (format!("{prefix} {}", m[0]), histogram_quantile(q, b)))));
    }
    e.insert(
        "generation-cost.json: Completion latency p95 by backend: {{backend}}",
        values(completion.iter().map(|(b, buckets)| (b[0].clone(), histogram_quantile(0.95, buckets)))),
    );
    e.insert(
        "generation-cost.json: Upstream attempts by outcome: {{outcome}}",
        values(
            [
                "ok",
                "connect",
                "deadline",
                "rate_limited",
                "upstream_timeout",
                "server_error",
                "client_error",
                "broken_stream",
                "malformed",
                "replay_miss",
            ]
            .map(|o| (o, per_second(if o == "ok" { requests } else { 0.0 }, gateway))),
        ),
    );
    let affinity = delta("kforge_gateway_affinity_total", gateway).await;
    let hits: f64 = affinity.iter().filter(|(l, _)| l["result"] == "hit").map(|(_, v)| v).sum();
    let all: f64 = affinity.values().sum();
    assert!(all > 0.0, "the replay pool routes by affinity: {affinity:?}");
    e.insert("generation-cost.json: Affinity hit ratio: {{model}}", values([("replay", hits / all)]));
    e
}
