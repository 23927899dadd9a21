//! `kforge run`: the main job. The embedded default is the example tasks answered by the `replay` model from a
//! replay file built into this binary (cli/build.rs derives it from examples/tasks/*/candidates/); this module
//! hands it to the gateway, follows the job through WatchJob, and renders the final report. A real model is routed
//! the same way for one run: `--model-url` adds a gateway pool for it (docs/REAL_MODEL.md).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kforge_gateway::config::{BackendConfig, BackendKind, PoolConfig, Price};
use kforge_proto::v1 as pb;
use kforge_proto::v1::orchestrator_client::OrchestratorClient;
use kforge_server::client::Channel;
use tokio_stream::StreamExt as _;

use crate::mesh::MeshConfig;

/// The model name of the embedded default.
pub const DEFAULT_MODEL: &str = "replay";

/// The cudaforge Judge's model name of the embedded default.
pub const DEFAULT_JUDGE_MODEL: &str = "replay-judge";

/// Records of trajectories 0-1 and turns 0-3 per example task (cli/build.rs).
pub const DEFAULT_REPLAY: &str = include_str!(concat!(env!("OUT_DIR"), "/default_replay.jsonl"));

/// The Judge's reviews of the same keys (cli/build.rs).
pub const DEFAULT_JUDGE_REPLAY: &str = include_str!(concat!(env!("OUT_DIR"), "/default_judge_replay.jsonl"));

/// The prices of the embedded replay's pools, in US dollars per million tokens: examples, about what a hosted open
/// model of middling size costs, so that the report's cost panels have figures to show. A pool's
/// `[gateway.pools.price]` sets real ones.
pub const EXAMPLE_PRICE: Price = Price { input_per_mtok: 0.5, cached_input_per_mtok: None, output_per_mtok: 1.5 };

/// When `model` is [`DEFAULT_MODEL`] or [`DEFAULT_JUDGE_MODEL`] and the config routes no pool of that name, writes
/// its embedded replay file into `dir` and routes the model to it, priced at [`EXAMPLE_PRICE`]. Returns the file
/// written, if any.
pub fn route_default_replay(config: &mut MeshConfig, model: &str, dir: &Path) -> std::io::Result<Option<PathBuf>> {
    let replay = match model {
        DEFAULT_MODEL => DEFAULT_REPLAY,
        DEFAULT_JUDGE_MODEL => DEFAULT_JUDGE_REPLAY,
        _ => return Ok(None),
    };
    if config.gateway.pools.iter().any(|pool| pool.model == model) {
        return Ok(None);
    }
    std::fs::create_dir_all(dir)?;
    let file = dir.join(format!("{model}.jsonl"));
    std::fs::write(&file, replay)?;
    config.gateway.pools.push(PoolConfig {
        model: model.to_owned(),
        backends: vec![BackendConfig { kind: BackendKind::Replay, file: Some(file.clone()), ..Default::default() }],
        price: EXAMPLE_PRICE,
        ..Default::default()
    });
    Ok(Some(file))
}

/// What the job's cost is priced at, as the report says it: the prices of the gateway pool of `model` in `config`,
/// labelled as examples where they are the embedded replay's. Empty where the config has no such pool (a remote
/// mesh's pools are its own).
pub fn pricing(config: &MeshConfig, model: &str) -> String {
    let Some(pool) = config.gateway.pools.iter().find(|pool| pool.model == model) else {
        return String::new();
    };
    let price = &pool.price;
    let figures =
        format!("${} / ${} per million prompt / completion tokens", price.input_per_mtok, price.output_per_mtok);
    let replayed = pool.backends.iter().all(|backend| backend.kind == BackendKind::Replay);
    if replayed && *price == EXAMPLE_PRICE {
        format!("example prices: {figures}, set for the embedded replay; a pool's [gateway.pools.price] sets real ones")
    } else if *price == Price::default() {
        format!("unpriced: the gateway pool `{model}` sets no [gateway.pools.price]")
    } else {
        format!("the gateway pool `{model}`'s prices: {figures}")
    }
}

/// Which model of the job a server named on the command line serves: the messages name that model's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `--model-url`, `--api-key-env`.
    Model,
    /// `--judge-model-url`, `--judge-api-key-env`.
    Judge,
}

impl Role {
    pub fn url_flag(self) -> &'static str {
        match self {
            Self::Model => "--model-url",
            Self::Judge => "--judge-model-url",
        }
    }

    pub fn key_flag(self) -> &'static str {
        match self {
            Self::Model => "--api-key-env",
            Self::Judge => "--judge-api-key-env",
        }
    }
}

/// An OpenAI-compatible server (vLLM, SGLang, a hosted API) that serves a model for one `kforge run`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelServer {
    pub role: Role,
    /// The OpenAI base URL as given, e.g. `http://host:8000/v1`; the gateway adds `/v1` to a URL without a path
    /// (`BackendConfig::url`).
    pub url: String,
    pub kind: BackendKind,
    /// The environment variable holding the API key: a key given as a flag's value would show in `ps`.
    pub api_key_env: Option<String>,
}

/// Why a server named on the command line cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelServerError {
    #[error("{flag} {url:?} is not an http(s) URL: {reason}")]
    BadUrl { flag: &'static str, url: String, reason: String },
    #[error("{flag} {url:?} names a route: give the base URL, e.g. http://host:8000/v1 (the gateway adds the route)")]
    RouteUrl { flag: &'static str, url: String },
    #[error("{flag} {var}: the environment variable is not set")]
    KeyUnset { flag: &'static str, var: String },
    #[error("{flag} {var}: the environment variable is empty")]
    KeyEmpty { flag: &'static str, var: String },
    #[error("{flag} {var}: the environment variable is not valid unicode")]
    KeyNotUnicode { flag: &'static str, var: String },
}

/// How [`route_model_server`] routed the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routed {
    /// A new pool.
    Added,
    /// The config's pool of that name, whose `backends` (this many) the server replaced.
    Replaced { backends: usize },
}

impl ModelServer {
    /// Checks the URL and the API key's variable, so that a mistake is named before any service starts. The key is
    /// not kept: the gateway reads the variable itself when it starts, in this process.
    pub fn check(&self) -> Result<(), ModelServerError> {
        let bad = |reason: &str| ModelServerError::BadUrl {
            flag: self.role.url_flag(),
            url: self.url.clone(),
            reason: reason.to_owned(),
        };
        if !self.url.contains("://") {
            return Err(bad("no scheme; write it as http://host:port/v1"));
        }
        let uri: http::Uri = self.url.parse().map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            Some(other) => return Err(bad(&format!("the scheme is `{other}`"))),
            None => return Err(bad("no scheme; write it as http://host:port/v1")),
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(bad("no host"));
        }
        if uri.query().is_some() {
            return Err(bad("a base URL has no query"));
        }
        if uri.path().trim_end_matches('/').ends_with("completions") {
            return Err(ModelServerError::RouteUrl { flag: self.role.url_flag(), url: self.url.clone() });
        }
        if let Some(var) = &self.api_key_env {
            let (flag, var) = (self.role.key_flag(), var.clone());
            match std::env::var(&var) {
                Ok(key) if key.is_empty() => return Err(ModelServerError::KeyEmpty { flag, var }),
                Ok(_) => {}
                Err(std::env::VarError::NotPresent) => return Err(ModelServerError::KeyUnset { flag, var }),
                Err(std::env::VarError::NotUnicode(_)) => return Err(ModelServerError::KeyNotUnicode { flag, var }),
            }
        }
        Ok(())
    }
}

/// Routes `model` to `server` in the gateway `kforge run` starts: a pool whose one backend is the server. A pool of
/// that name in the config keeps its settings (upstream model, sampling defaults, limits, prices) and gets the
/// server as its only backend: the command line wins over the file, as `KFORGE__*` variables do.
pub fn route_model_server(
    config: &mut MeshConfig,
    model: &str,
    server: &ModelServer,
) -> Result<Routed, ModelServerError> {
    server.check()?;
    let backend = BackendConfig {
        kind: server.kind,
        url: server.url.clone(),
        api_key_env: server.api_key_env.clone(),
        ..Default::default()
    };
    if let Some(pool) = config.gateway.pools.iter_mut().find(|pool| pool.model == model) {
        let backends = std::mem::replace(&mut pool.backends, vec![backend]).len();
        return Ok(Routed::Replaced { backends });
    }
    config.gateway.pools.push(PoolConfig { model: model.to_owned(), backends: vec![backend], ..Default::default() });
    Ok(Routed::Added)
}

/// The first turn's error when the job recorded turns and every one of them failed on the way (no evaluation, an
/// `error`); `None` when any turn got through.
pub fn every_turn_failed(trajectories: &[pb::Trajectory]) -> Option<&str> {
    let mut turns = trajectories.iter().flat_map(|t| &t.turns).peekable();
    turns.peek()?;
    let mut first = None;
    for turn in turns {
        if turn.error.is_empty() {
            return None;
        }
        first.get_or_insert(turn.error.as_str());
    }
    first
}

/// Tunes the in-process evaluator of `kforge run` for one job in a short-lived process: no torch.compile
/// baseline unless asked (this slice scores against eager; on a CPU, compiling the baseline takes minutes per
/// task), and no precompiled bindings header (its warm-up keeps two compilers busy for minutes, which a 13-task
/// job on two cores cannot spare, and the process would often end with it half built).
pub fn evaluator_for_one_job(config: &mut MeshConfig, compile_baseline: bool) {
    config.evaluator.baseline_torch_compile = compile_baseline;
    config.evaluator.bindings_pch = false;
}

/// Writes the job's report (report.json and a self-contained report.html, crates/report) from its recorded turns,
/// with the metrics the orchestrator computes from them.
pub fn write_report(
    dir: &Path,
    job: &pb::Job,
    trajectories: &[pb::Trajectory],
    pricing: &str,
) -> anyhow::Result<kforge_report::ReportFiles> {
    let turns: Vec<pb::TurnRecord> = trajectories.iter().flat_map(|t| t.turns.iter().cloned()).collect();
    let samples = kforge_orchestrator::metrics::samples(job.spec.as_ref(), &turns);
    let wall_time_s = job.metrics.as_ref().map_or(0.0, |m| m.wall_time_s);
    let metrics = kforge_reward_core::job_metrics(&kforge_orchestrator::metrics::params(wall_time_s), &samples)?;
    let spec = job.spec.clone().unwrap_or_default();
    let meta = kforge_report::ReportMeta {
        job_id: job.job_id.clone(),
        recipe: spec.recipe,
        model: spec.model,
        task_set: spec.task_set,
        pricing: pricing.to_owned(),
        generated_at: httpdate::fmt_http_date(std::time::SystemTime::now()),
    };
    Ok(kforge_report::write_report(dir, &meta, &metrics, &samples)?)
}

/// Submits `spec`, or resumes the job `resume` names (its stored spec applies).
pub async fn submit_or_resume(
    client: &mut OrchestratorClient<Channel>,
    spec: pb::JobSpec,
    resume: Option<&str>,
) -> Result<pb::Job, tonic::Status> {
    let job = match resume {
        Some(job_id) => client.resume_job(pb::ResumeJobRequest { job_id: job_id.to_owned() }).await?,
        None => client.submit_job(pb::SubmitJobRequest { spec: Some(spec), idempotency_key: String::new() }).await?,
    };
    Ok(job.into_inner())
}

/// Follows the job until it ends, calling `progress` with each update; returns the job's last state.
pub async fn follow(
    client: &mut OrchestratorClient<Channel>,
    job_id: &str,
    mut progress: impl FnMut(&pb::JobProgress),
) -> Result<pb::Job, tonic::Status> {
    let mut stream = client.watch_job(pb::WatchJobRequest { job_id: job_id.to_owned() }).await?.into_inner();
    let mut last = None;
    while let Some(update) = stream.next().await {
        let update = update?;
        progress(&update);
        last = update.job;
    }
    match last {
        Some(job) => Ok(job),
        None => client.get_job(pb::GetJobRequest { job_id: job_id.to_owned() }).await.map(tonic::Response::into_inner),
    }
}

/// Every trajectory of the job, all pages.
pub async fn trajectories(
    client: &mut OrchestratorClient<Channel>,
    job_id: &str,
) -> Result<Vec<pb::Trajectory>, tonic::Status> {
    let mut all = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_trajectories(pb::ListTrajectoriesRequest {
                job_id: job_id.to_owned(),
                task_id: String::new(),
                page_size: 0,
                page_token,
            })
            .await?
            .into_inner();
        all.extend(page.trajectories);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}

/// A verdict as the report prints it: `correct`, `compile_error`, ...; `-` when nothing was evaluated.
pub fn verdict_name(verdict: i32) -> String {
    match pb::Verdict::try_from(verdict) {
        Ok(pb::Verdict::Unspecified) | Err(_) => "-".into(),
        Ok(verdict) => verdict.as_str_name().trim_start_matches("VERDICT_").to_ascii_lowercase(),
    }
}

/// One progress line: turns and episodes done, correct kernels, and turns in flight by stage.
pub fn progress_line(progress: &pb::JobProgress) -> String {
    let job = progress.job.clone().unwrap_or_default();
    let metrics = job.metrics.clone().unwrap_or_default();
    let (generating, evaluating, scoring) =
        progress.in_flight.as_ref().map_or((0, 0, 0), |s| (s.generating, s.evaluating, s.scoring));
    format!(
        "[{}/{} turns, {}/{} episodes] correct {}/{} evaluated; in flight: {} generating, {} evaluating, {} scoring",
        job.turns_done,
        job.turns_total,
        job.episodes_done,
        job.episodes_total,
        metrics.correct,
        metrics.evaluated,
        generating,
        evaluating,
        scoring
    )
}

/// [`progress_line`] behind a bar of the job's turns done, `width` characters wide: what `kforge run` redraws in
/// place on a terminal.
pub fn progress_bar(progress: &pb::JobProgress, width: usize) -> String {
    let job = progress.job.clone().unwrap_or_default();
    let filled = match job.turns_total {
        0 => 0,
        total => (width as u64 * job.turns_done.min(total) / total) as usize,
    };
    format!("[{}{}] {}", "#".repeat(filled), "-".repeat(width - filled), progress_line(progress))
}

/// How `kforge run` shows progress: a bar redrawn in place on a terminal, else a line per change (logs, CI).
#[derive(Debug)]
pub struct Progress {
    terminal: bool,
    shown: String,
}

impl Progress {
    pub fn new(terminal: bool) -> Self {
        Self { terminal, shown: String::new() }
    }

    /// What to write to the terminal or log for `progress`, if it changed anything shown.
    pub fn update(&mut self, progress: &pb::JobProgress) -> Option<String> {
        let text = if self.terminal { progress_bar(progress, 24) } else { progress_line(progress) };
        if text == self.shown {
            return None;
        }
        self.shown.clone_from(&text);
        // On a terminal: back to the line's start and clear it; the last bar stays (`finish`).
        Some(if self.terminal { format!("\r\x1b[2K{text}") } else { format!("{text}\n") })
    }

    /// What ends the display: the newline after a bar left in place.
    pub fn finish(&self) -> &'static str {
        if self.terminal && !self.shown.is_empty() { "\n" } else { "" }
    }
}

/// The final report: per task, each trajectory's verdicts by turn and the job's best correct kernel (its speedup,
/// trajectory and turn); then the totals.
pub fn report(job: &pb::Job, trajectories: &[pb::Trajectory]) -> String {
    let mut out = String::new();
    let state = pb::JobState::try_from(job.state).map_or("unknown", |s| s.as_str_name());
    let _ = writeln!(out, "job {} {}", job.job_id, state.trim_start_matches("JOB_STATE_").to_ascii_lowercase());
    let _ = writeln!(out, "{:<28} {:<44} {:>12}", "task", "verdicts by trajectory (turn 0, 1, ...)", "best @t/turn");
    let mut tasks: Vec<&str> = Vec::new();
    for trajectory in trajectories {
        if !tasks.contains(&trajectory.task_id.as_str()) {
            tasks.push(&trajectory.task_id);
        }
    }
    let m = job.metrics.clone().unwrap_or_default();
    for task in tasks {
        let of_task: Vec<&pb::Trajectory> = trajectories.iter().filter(|t| t.task_id == task).collect();
        let verdicts: Vec<String> = of_task
            .iter()
            .map(|t| t.turns.iter().map(|turn| verdict_name(turn.verdict)).collect::<Vec<_>>().join(","))
            .collect();
        // The job's answer for the task: its best correct kernel, and where it is (trajectory/turn).
        let best = m.best_kernels.iter().find(|b| b.task_id == task).map_or("-".into(), |b| {
            let speedup = if b.speedup_eager > 0.0 { format!("{:.2}x", b.speedup_eager) } else { "untimed".into() };
            format!("{speedup} @{}/{}", b.trajectory, b.turn)
        });
        let _ = writeln!(out, "{task:<28} {:<44} {best:>12}", verdicts.join(" | "));
        for turn in of_task.iter().flat_map(|t| &t.turns).filter(|turn| !turn.error.is_empty()) {
            let _ = writeln!(out, "{:<28}   trajectory {} turn {}: {}", "", turn.trajectory, turn.turn, turn.error);
        }
    }
    let percent = |ratio: f64| format!("{:.1}%", ratio * 100.0);
    let _ = writeln!(
        out,
        "totals: {} turns, {} evaluated, {} correct ({}), fast_1 {}, mean speedup {:.2}x (geomean {:.2}x), \
         compile errors {}, hacks {}, junk {}, not-okay {}, no kernel {}, infra errors {}, wall {:.1} s",
        m.turns,
        m.evaluated,
        m.correct,
        percent(m.correctness),
        percent(m.fast_p.get("1").copied().unwrap_or_default()),
        m.mean_speedup,
        m.geomean_speedup,
        percent(m.compile_error_rate),
        m.hacks,
        m.junk,
        m.not_okay,
        m.no_kernel,
        m.infra_errors,
        m.wall_time_s,
    );
    let usage = m.usage.unwrap_or_default();
    let _ = writeln!(
        out,
        "tokens: {} prompt, {} completion ({} reasoning), cost ${:.4}",
        usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens, usage.cost_usd
    );
    if !job.error.is_empty() {
        let _ = writeln!(out, "error: {}", job.error);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_is_a_bar_on_a_terminal_and_a_line_per_change_elsewhere() {
        let at = |done: u64| pb::JobProgress {
            job: Some(pb::Job { turns_done: done, turns_total: 8, ..Default::default() }),
            ..Default::default()
        };
        assert!(progress_bar(&at(2), 8).starts_with("[##------] [2/8 turns"), "{}", progress_bar(&at(2), 8));
        assert!(progress_bar(&at(8), 8).starts_with("[########]"));
        let empty = pb::JobProgress::default();
        assert!(progress_bar(&empty, 4).starts_with("[----] [0/0 turns"));

        let mut terminal = Progress::new(true);
        let first = terminal.update(&at(1)).expect("the first update shows");
        assert!(first.starts_with("\r\x1b[2K[###") && !first.ends_with('\n'), "{first:?}");
        assert_eq!(terminal.update(&at(1)), None, "nothing changed, nothing redrawn");
        assert!(terminal.update(&at(2)).is_some());
        assert_eq!(terminal.finish(), "\n");

        let mut log = Progress::new(false);
        let line = log.update(&at(1)).expect("shown");
        assert!(line.starts_with("[1/8 turns") && line.ends_with('\n'), "{line:?}");
        assert_eq!(log.update(&at(1)), None);
        assert_eq!(log.finish(), "");
    }

    #[test]
    fn the_embedded_replay_answers_every_example_task_with_its_candidate_at_turn_0() {
        let records: Vec<serde_json::Value> =
            DEFAULT_REPLAY.lines().map(|l| serde_json::from_str(l).expect("a json line")).collect();
        assert_eq!(records.len(), 13 * 2 * 4, "13 example tasks, two trajectories of four turns each");
        let relu = records.iter().find(|r| r["task_id"] == "examples/relu").expect("relu is answered");
        assert_eq!((relu["trajectory"].as_u64(), relu["turn"].as_u64()), (Some(0), Some(0)));
        let completion = &relu["completions"][0];
        assert!(completion["reasoning"].as_str().is_some_and(|r| r.starts_with("Okay")), "{completion}");
        let text = completion["text"].as_str().expect("text");
        let kernel = kforge_model_text::extract_kernel(text).expect("the orchestrator finds the kernel");
        assert_eq!(kernel.trim_end(), include_str!("../../examples/tasks/relu/candidates/cpu_loop.py").trim_end());
        // Every record carries its usage: the answer's tokens at four characters per token; the prompt's are the
        // gateway's to count.
        let usage = &relu["usage"];
        let chars = text.chars().count() + completion["reasoning"].as_str().expect("reasoning").chars().count();
        let tokens = usage["completion_tokens"].as_u64().expect("completion tokens");
        assert!(tokens.abs_diff(chars as u64 / 4) <= 2, "{tokens} for {chars} characters");
        assert!(usage.get("prompt_tokens").is_none(), "{usage}");
    }

    #[test]
    fn the_embedded_stories_and_reviews_follow_the_examples_story_folders() {
        let parse = |text: &str| -> Vec<serde_json::Value> {
            text.lines().map(|l| serde_json::from_str(l).expect("a json line")).collect()
        };
        let (coder, judge) = (parse(DEFAULT_REPLAY), parse(DEFAULT_JUDGE_REPLAY));
        let answer = |records: &[serde_json::Value], task: &str, trajectory: u64, turn: u64| {
            let found =
                records.iter().find(|r| r["task_id"] == task && r["turn"] == turn && r["trajectory"] == trajectory);
            found.expect("recorded")["completions"][0]["text"].as_str().expect("text").to_owned()
        };
        let text = |records: &[serde_json::Value], task: &str, turn: u64| answer(records, task, 0, turn);
        let kernel = |task: &str, trajectory: u64, turn: u64| {
            kforge_model_text::extract_kernel(&answer(&coder, task, trajectory, turn)).map(str::to_owned)
        };
        let relu = |turn| kernel("examples/relu", 0, turn).expect("a kernel");
        assert_eq!(relu(1).trim_end(), include_str!("../../examples/tasks/relu/story/0/1_unrolled_typo.py").trim_end());
        assert_eq!(relu(2).trim_end(), include_str!("../../examples/tasks/relu/story/0/2_unrolled.py").trim_end());
        assert_eq!(relu(3), relu(2), "a turn with no file keeps the last kernel");
        assert!(text(&coder, "examples/relu", 3).starts_with("No change"));
        assert_eq!(kernel("examples/relu", 1, 2), Some(relu(0)), "a trajectory without a story keeps its candidate");
        // A `.txt` turn is the answer as written: the tour's junk answer has no kernel; the next turn's file does.
        let junk = answer(&coder, "examples/gelu_tanh", 1, 0);
        assert_eq!(junk, include_str!("../../examples/tasks/gelu_tanh/story/1/0_looping.txt"));
        assert_eq!(kernel("examples/gelu_tanh", 1, 0), None);
        let fixed = kernel("examples/gelu_tanh", 1, 2).expect("a kernel");
        assert_eq!(fixed.trim_end(), include_str!("../../examples/tasks/gelu_tanh/story/1/2_in_place.py").trim_end());
        // Turn 0 of a story without a turn-0 file is the task's candidate.
        let candidate = include_str!("../../examples/tasks/scaled_add/candidates/add_alpha.py");
        assert_eq!(kernel("examples/scaled_add", 1, 0).expect("a kernel").trim_end(), candidate.trim_end());
        let review = text(&judge, "examples/relu", 1);
        assert!(review.contains("`len`"), "the story's review of turn 1: {review}");
        assert_eq!(judge.len(), coder.len(), "every key has a review");
        assert!(text(&judge, "examples/matmul", 0).contains("(replayed review)"));
    }

    #[test]
    fn the_default_pool_is_added_only_when_the_config_has_none() {
        let dir = std::env::temp_dir().join(format!("kforge-run-unit-{}", std::process::id()));
        let mut config = MeshConfig::default();
        let file = route_default_replay(&mut config, "replay", &dir).expect("written").expect("a file");
        assert_eq!(std::fs::read_to_string(&file).expect("read"), DEFAULT_REPLAY);
        assert_eq!(config.gateway.pools.len(), 1);
        let judge = route_default_replay(&mut config, DEFAULT_JUDGE_MODEL, &dir).expect("written").expect("a file");
        assert_eq!(std::fs::read_to_string(&judge).expect("read"), DEFAULT_JUDGE_REPLAY);
        assert_eq!(config.gateway.pools.len(), 2);
        assert_eq!(route_default_replay(&mut config, "replay", &dir).expect("ok"), None, "already routed");
        assert_eq!(route_default_replay(&mut MeshConfig::default(), "gpt", &dir).expect("ok"), None);
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn a_job_whose_every_turn_failed_is_named_and_one_that_got_through_is_not() {
        let turn = |error: &str| pb::TurnRecord { error: error.into(), ..Default::default() };
        let trajectory = |turns| pb::Trajectory { turns, ..Default::default() };
        let down = "gateway: Unavailable: backend down";
        assert_eq!(every_turn_failed(&[]), None, "no turns: nothing to say");
        assert_eq!(every_turn_failed(&[trajectory(vec![turn(down)]), trajectory(vec![turn("x")])]), Some(down));
        assert_eq!(every_turn_failed(&[trajectory(vec![turn(down)]), trajectory(vec![turn("")])]), None);
    }

    #[test]
    fn a_model_url_adds_a_pool_or_replaces_the_configured_pools_backends() {
        let server = |url: &str| ModelServer {
            role: Role::Model,
            url: url.to_owned(),
            kind: BackendKind::Vllm,
            api_key_env: None,
        };
        let mut config = MeshConfig::default();
        let routed = route_model_server(&mut config, "qwen", &server("http://10.0.0.5:8000/v1")).expect("routed");
        assert_eq!(routed, Routed::Added);
        assert_eq!(config.gateway.pools[0].model, "qwen");
        assert_eq!(config.gateway.pools[0].backends[0].url, "http://10.0.0.5:8000/v1");
        config.gateway.validate().expect("the gateway takes the pool");

        // A configured pool keeps its settings; the command line's server is its only backend.
        config.gateway.pools[0].upstream_model = Some("Qwen/Qwen3-8B".into());
        config.gateway.pools[0]
            .backends
            .push(BackendConfig { url: "http://10.0.0.6:8000".into(), ..Default::default() });
        let routed = route_model_server(&mut config, "qwen", &server("https://models.example/v1")).expect("routed");
        assert_eq!(routed, Routed::Replaced { backends: 2 });
        let pool = &config.gateway.pools[0];
        assert_eq!(pool.upstream_model.as_deref(), Some("Qwen/Qwen3-8B"));
        let urls: Vec<&str> = pool.backends.iter().map(|b| b.url.as_str()).collect();
        assert_eq!(urls, ["https://models.example/v1"]);

        for (url, reason) in [
            ("localhost:8000/v1", "no scheme"),
            ("10.0.0.5:8000", "no scheme"),
            ("ftp://host/v1", "the scheme is `ftp`"),
            ("http://", ""),
            ("http://host:8000/v1 ", ""),
            ("http://host:8000/v1?key=x", "no query"),
        ] {
            let error = route_model_server(&mut config, "qwen", &server(url)).expect_err(url);
            let text = error.to_string();
            assert!(text.starts_with(&format!("--model-url {url:?} is not an http(s) URL")), "{text}");
            assert!(text.contains(reason), "{text}");
        }
        let route = route_model_server(&mut config, "qwen", &server("http://host:8000/v1/chat/completions"));
        assert!(route.expect_err("a route").to_string().contains("names a route: give the base URL"));

        let keyed = |var: &str| ModelServer {
            role: Role::Judge,
            api_key_env: Some(var.to_owned()),
            ..server("http://host:8000/v1")
        };
        let unset = "KFORGE_RUN_UNIT_TEST_UNSET_KEY";
        assert_eq!(
            keyed(unset).check().expect_err("unset").to_string(),
            format!("--judge-api-key-env {unset}: the environment variable is not set")
        );
        keyed("PATH").check().expect("a set variable");
    }

    #[test]
    fn the_report_lists_verdicts_by_trajectory_and_the_best_kernel() {
        let turn = |trajectory, turn, verdict: pb::Verdict, speedup| pb::TurnRecord {
            task_id: "examples/relu".into(),
            trajectory,
            turn,
            verdict: verdict as i32,
            speedup,
            ..Default::default()
        };
        let trajectories = [
            pb::Trajectory {
                trajectory_id: "j/examples/relu/0".into(),
                task_id: "examples/relu".into(),
                turns: vec![turn(0, 0, pb::Verdict::Incorrect, None), turn(0, 1, pb::Verdict::Correct, Some(1.5))],
            },
            pb::Trajectory {
                trajectory_id: "j/examples/relu/1".into(),
                task_id: "examples/relu".into(),
                turns: vec![turn(1, 0, pb::Verdict::Unspecified, None)],
            },
        ];
        // The job's metrics name the best correct kernel: trajectory 0, turn 1.
        let metrics = pb::JobMetrics {
            best_kernels: vec![pb::BestKernel {
                task_id: "examples/relu".into(),
                trajectory: 0,
                turn: 1,
                speedup_eager: 1.5,
                speedup_compile: 0.0,
            }],
            ..Default::default()
        };
        let job = pb::Job {
            job_id: "j".into(),
            state: pb::JobState::Succeeded as i32,
            metrics: Some(metrics),
            ..Default::default()
        };
        let text = report(&job, &trajectories);
        assert!(text.starts_with("job j succeeded\n"), "{text}");
        let row = text.lines().find(|l| l.starts_with("examples/relu")).expect("a row per task");
        assert!(row.contains("incorrect,correct | -") && row.trim_end().ends_with("1.50x @0/1"), "{row}");
        assert!(text.contains("totals: 0 turns"), "{text}");
    }
}
