//! The report opened in a real browser: headless Chromium loads report.html from disk with no network, and its
//! rendered DOM (`--dump-dom`) must hold every plot, laid out, with one mark per point or bar, and the summary
//! numbers of the metrics.

use std::path::{Path, PathBuf};
use std::process::Command;

use kforge_report::{ReportMeta, format_ratio, write_report};
use kforge_reward_core::{JobMetrics, MetricsParams, ResponseSample, TurnSample, Usage, Verdict, job_metrics};

fn turn(task: &str, trajectory: u32, turn: u32, verdict: Option<Verdict>, eager: Option<f64>) -> TurnSample {
    TurnSample {
        task: task.into(),
        level: if task == "b" { 2 } else { 1 },
        trajectory,
        turn,
        verdict,
        speedup_eager: eager,
        speedup_compile: eager.map(|s| s / 2.0),
        response: Some(ResponseSample { not_okay: Some(false), ..ResponseSample::default() }),
        wall_time_s: 3.0,
        usage: Usage {
            prompt_tokens: 100 + turn as u64 * 50,
            completion_tokens: 20,
            cost_usd: 0.002,
            ..Usage::default()
        },
        ..TurnSample::default()
    }
}

/// Two tasks, two trajectories, three turns: failures, fixes, a hack, junk, an infra error, a missing baseline.
fn samples() -> Vec<TurnSample> {
    let c = Some(Verdict::Correct);
    vec![
        turn("a", 0, 0, Some(Verdict::CompileError), None),
        turn("a", 0, 1, c, Some(1.3)),
        turn("a", 0, 2, c, Some(2.5)),
        turn("a", 1, 0, Some(Verdict::Incorrect), None),
        turn("a", 1, 1, c, Some(0.7)),
        TurnSample { hack: true, ..turn("a", 1, 2, Some(Verdict::Hack), None) },
        TurnSample { speedup_compile: None, ..turn("b", 0, 0, c, Some(5.0)) },
        turn("b", 0, 1, Some(Verdict::InfraError), None),
        turn("b", 0, 2, c, Some(1.1)),
        TurnSample {
            response: Some(ResponseSample { junk: true, no_kernel: true, not_okay: Some(true), format_error: None }),
            ..turn("b", 1, 0, None, None)
        },
        turn("b", 1, 1, Some(Verdict::RuntimeError), None),
        turn("b", 1, 2, c, Some(0.2)),
    ]
}

fn report(name: &str) -> (PathBuf, JobMetrics) {
    let samples = samples();
    let metrics = job_metrics(&MetricsParams { elapsed_s: 12.5, ..MetricsParams::default() }, &samples).expect("valid");
    let meta = ReportMeta {
        job_id: "job-1".into(),
        recipe: "kevin".into(),
        model: "replay <examples>".into(),
        task_set: "examples".into(),
        pricing: "example prices: $0.5 / $1.5 per million prompt / completion tokens".into(),
        generated_at: "2026-01-01 00:00 UTC".into(),
    };
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let files = write_report(&dir, &meta, &metrics, &samples).expect("written");
    assert_eq!(files.json, dir.join("report.json"));
    (files.html, metrics)
}

#[test]
fn the_page_needs_nothing_from_outside() {
    let (html, _) = report("report-offline");
    let page = std::fs::read_to_string(&html).expect("read");
    for outside in ["http:", "https:", "src=", "<link", "@import", "url(", "//cdn"] {
        assert!(!page.contains(outside), "the page refers outside itself: {outside}");
    }
    assert!(page.contains("replay &lt;examples&gt;"), "text is escaped");
    assert!(page.contains("<p class=\"note\" id=\"pricing\">Priced at example prices: $0.5"), "the prices are named");
}

#[test]
fn report_json_holds_the_metrics_with_their_denominators() {
    let (html, metrics) = report("report-json");
    let text = std::fs::read_to_string(html.with_file_name("report.json")).expect("read");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let overall = &json["metrics"]["overall"];
    assert_eq!(overall["correct"]["numerator"], metrics.overall.correct.numerator);
    assert_eq!(overall["correct"]["denominator"], 10, "12 turns less one infra error and one without a verdict");
    assert_eq!(overall["infra_errors"], 1);
    assert_eq!(json["metrics"]["speedup_compile"]["missing"], 1);
    assert_eq!(json["metrics"]["by_turn"].as_array().map(Vec::len), Some(3));
    let eager: u64 = json["speedup_histogram"]["eager"]
        .as_array()
        .expect("bins")
        .iter()
        .map(|b| b["count"].as_u64().expect("count"))
        .sum();
    assert_eq!(eager, metrics.speedup_eager.count);
    assert_eq!(json["tasks"][1]["best_speedup_eager"], 5.0);
    assert!(json["job"]["pricing"].as_str().is_some_and(|p| p.starts_with("example prices")), "{}", json["job"]);
}

fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KFORGE_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .flat_map(|dir| ["chromium", "chromium-browser", "google-chrome"].map(|name| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

/// The text of the element that starts at `open` (an opening tag's prefix) up to `close`.
fn section<'a>(dom: &'a str, open: &str, close: &str) -> &'a str {
    let start = dom.find(open).unwrap_or_else(|| panic!("{open} is in the rendered page"));
    let end = dom[start..].find(close).expect("closed") + start;
    &dom[start..end]
}

fn attribute<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
    Some(&tag[start..start + tag[start..].find('"')?])
}

/// Every `data-value` of the marks of `series` in `figure`.
fn values(figure: &str, series: &str) -> Vec<f64> {
    figure
        .split("class=\"mark\"")
        .skip(1)
        .filter(|mark| attribute(mark, "data-series") == Some(series))
        .map(|mark| attribute(mark, "data-value").expect("a value").parse().expect("a number"))
        .collect()
}

#[test]
fn chromium_renders_every_plot_and_the_summary_matches_the_metrics() {
    let Some(chromium) = chromium() else {
        assert!(
            std::env::var("KFORGE_CI").as_deref() != Ok("1"),
            "chromium is missing (scripts/setup.sh --test installs it)"
        );
        println!("SKIP: chromium not found (Debian package `chromium`; scripts/setup.sh --test installs it)");
        return;
    };
    let (html, metrics) = report("report-browser");
    let profile = html.with_file_name("chromium-profile");
    let output = Command::new(&chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--dump-dom", &format!("file://{}", html.display())])
        .output()
        .expect("chromium runs");
    assert!(output.status.success(), "chromium failed: {}", String::from_utf8_lossy(&output.stderr));
    let dom = String::from_utf8(output.stdout).expect("utf-8 DOM");

    // One mark per point or bar: 3 turns x (correct + 4 fast_p); 3 turns x 3 ratios; 9 bins x 2 baselines;
    // 3 turns x 2 token kinds.
    for (id, marks) in [("correctness-by-turn", 15), ("ratios-by-turn", 9), ("speedups", 18), ("tokens-by-turn", 6)] {
        let figure = section(&dom, &format!("<figure class=\"plot\" id=\"plot-{id}\""), "</figure>");
        assert_eq!(figure.matches("class=\"mark\"").count(), marks, "marks of {id}");
        let tag = &figure[..figure.find('>').expect("tag ends")];
        let width: f64 = attribute(tag, "data-rendered-width").expect("the page's script ran").parse().expect("width");
        assert!(width > 100.0, "{id} was laid out, {width} px wide");
        assert_eq!(attribute(tag, "data-rendered-marks"), Some(marks.to_string().as_str()));
    }

    let curve = section(&dom, "<figure class=\"plot\" id=\"plot-correctness-by-turn\"", "</figure>");
    let want: Vec<f64> = metrics.by_turn.iter().map(|(_, r)| r.correct.value()).collect();
    assert_eq!(values(curve, "correct"), want);
    let fast = metrics.by_turn.iter().map(|(_, r)| r.fast_p[0].eager.value()).collect::<Vec<_>>();
    assert_eq!(values(curve, "fast_1 (eager)"), fast);
    let speedups = section(&dom, "<figure class=\"plot\" id=\"plot-speedups\"", "</figure>");
    assert_eq!(values(speedups, "vs eager").iter().sum::<f64>(), metrics.speedup_eager.count as f64);
    assert_eq!(values(speedups, "vs torch.compile").iter().sum::<f64>(), metrics.speedup_compile.count as f64);
    let ratios = section(&dom, "<figure class=\"plot\" id=\"plot-ratios-by-turn\"", "</figure>");
    let hacks: Vec<f64> = metrics.by_turn.iter().map(|(_, r)| r.hack.value()).collect();
    assert_eq!(values(ratios, "hack / evaluated"), hacks);

    let summary = |key: &str| {
        let cell = section(&dom, &format!("id=\"summary-{key}\">"), "</div>");
        cell[cell.find('>').expect("tag") + 1..].to_owned()
    };
    // By hand: 10 evaluated turns, 6 correct; fast_1 against eager 1.3, 2.5, 5.0, 1.1 of 10; against torch.compile
    // 2.5 / 2 = 1.25 only, of 9 (b's first kernel has no compile baseline).
    assert_eq!(summary("correctness"), "60.0% (6/10)");
    assert_eq!(summary("correctness"), format_ratio(&metrics.overall.correct));
    assert_eq!(summary("fast-eager"), "40.0% (4/10)");
    assert_eq!(summary("fast-compile"), "11.1% (1/9)");
    assert_eq!(summary("hack"), "10.0% (1/10)");
    assert_eq!(summary("junk"), "8.3% (1/12)");
    assert_eq!(summary("not-okay"), "8.3% (1/12)");
    assert_eq!(summary("infra"), "1");
    let geomean = (1.3f64 * 2.5 * 0.7 * 5.0 * 1.1 * 0.2).powf(1.0 / 6.0);
    assert_eq!(summary("geomean-eager"), format!("{geomean:.2}x"));
    assert_eq!(summary("cost-per-task"), "$0.0120");
    assert_eq!(summary("elapsed"), "12.5 s");
}
