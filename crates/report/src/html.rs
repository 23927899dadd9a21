//! `report.html`: one page, inline CSS and SVG, nothing fetched.

use std::fmt::Write;

use kforge_reward_core::{JobMetrics, Rates, Ratio, TurnSample};

use crate::{ReportMeta, SPEEDUP_BINS, speedup_histogram, task_lines, usage_by_turn};

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 260.0;
const LEFT: f64 = 56.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 40.0;
const COLORS: [&str; 6] = ["#2563eb", "#16a34a", "#ea580c", "#9333ea", "#dc2626", "#0891b2"];

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#111}\
h1{font-size:22px}h2{font-size:17px;margin-top:28px}table{border-collapse:collapse;margin:8px 0}\
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f5}td.l,th.l{text-align:left}\
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px}\
.card .k{color:#555;font-size:12px}.card .v{font-size:17px;font-weight:600}figure{margin:12px 0}\
figcaption{font-weight:600;margin-bottom:4px}svg text{font:11px system-ui,sans-serif;fill:#333}\
.legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}\
.note{color:#555;font-size:12px}";

/// Records each plot's rendered width and mark count on its figure: a headless browser's DOM dump shows that the
/// page laid the plots out. Nothing else depends on it.
const SCRIPT: &str = "for(const f of document.querySelectorAll('figure.plot')){\
const b=f.querySelector('svg').getBoundingClientRect();f.dataset.renderedWidth=Math.round(b.width);\
f.dataset.renderedMarks=f.querySelectorAll('.mark').length;}";

/// The report as one self-contained HTML page.
pub fn report_html(meta: &ReportMeta, metrics: &JobMetrics, samples: &[TurnSample]) -> String {
    let mut page = String::new();
    let title = format!("kforge report: {}", if meta.job_id.is_empty() { "job" } else { &meta.job_id });
    let _ = write!(
        page,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style>\
         </head><body><h1>{}</h1><p class=\"note\">recipe {} · model {} · tasks {} · {}</p>",
        escape(&title),
        escape(&title),
        escape(&meta.recipe),
        escape(&meta.model),
        escape(&meta.task_set),
        escape(&meta.generated_at),
    );
    summary(&mut page, metrics);
    turn_plots(&mut page, metrics);
    speedup_plot(&mut page, metrics, samples);
    cost_plot(&mut page, meta, metrics, samples);
    tables(&mut page, metrics, samples);
    let _ = writeln!(page, "<script>{SCRIPT}</script></body></html>");
    page
}

/// `50.0% (3/6)`; `n/a (0/0)` when nothing was counted.
pub fn format_ratio(ratio: &Ratio) -> String {
    if ratio.denominator == 0 {
        "n/a (0/0)".into()
    } else {
        format!("{:.1}% ({}/{})", 100.0 * ratio.value(), ratio.numerator, ratio.denominator)
    }
}

/// `1.23x` over `count` kernels; `n/a` without any.
pub fn format_speedup(value: f64, count: u64) -> String {
    if count == 0 { "n/a".into() } else { format!("{value:.2}x") }
}

/// A count axis label: `2`, or `1.5` between whole numbers.
fn format_count(value: f64) -> String {
    if value.fract() == 0.0 { format!("{value:.0}") } else { format!("{value:.1}") }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn card(page: &mut String, key: &str, label: &str, value: &str) {
    let _ = write!(
        page,
        "<div class=\"card\"><div class=\"k\">{}</div><div class=\"v\" id=\"summary-{key}\">{}</div></div>",
        escape(label),
        escape(value)
    );
}

fn fast_p_eager(rates: &Rates, threshold: f64) -> Option<Ratio> {
    rates.fast_p.iter().find(|f| f.threshold == threshold).map(|f| f.eager)
}

fn summary(page: &mut String, m: &JobMetrics) {
    let o = &m.overall;
    page.push_str("<h2>Summary</h2><div class=\"cards\">");
    card(page, "tasks", "tasks · trajectories · turns", &format!("{} · {} · {}", m.tasks, m.trajectories, o.turns));
    card(page, "correctness", "correct / evaluated", &format_ratio(&o.correct));
    if let Some(first) = o.fast_p.first() {
        card(page, "fast-eager", &format!("fast_{} vs eager", first.threshold), &format_ratio(&first.eager));
        card(
            page,
            "fast-compile",
            &format!("fast_{} vs torch.compile", first.threshold),
            &format_ratio(&first.compile),
        );
    }
    let e = &m.speedup_eager;
    let c = &m.speedup_compile;
    card(
        page,
        "geomean-eager",
        &format!("geomean speedup vs eager ({} kernels)", e.count),
        &format_speedup(e.geomean, e.count),
    );
    card(
        page,
        "geomean-compile",
        &format!("geomean vs torch.compile ({} kernels, {} without)", c.count, c.missing),
        &format_speedup(c.geomean, c.count),
    );
    card(page, "hack", "hack / evaluated", &format_ratio(&o.hack));
    card(page, "junk", "junk / responses", &format_ratio(&o.junk));
    card(page, "not-okay", "not-okay / responses", &o.not_okay.as_ref().map_or_else(|| "off".into(), format_ratio));
    card(page, "compile-error", "compile errors / evaluated", &format_ratio(&o.compile_error));
    card(page, "infra", "infrastructure errors (in no denominator)", &o.infra_errors.to_string());
    let cost = &m.cost;
    card(
        page,
        "cost-per-task",
        &format!("cost per task ({} tasks)", cost.per_task.count),
        &format!("${:.4}", cost.per_task.cost_usd),
    );
    card(page, "seconds-per-task", "turn seconds per task", &format!("{:.1} s", cost.per_task.seconds));
    card(page, "elapsed", "elapsed", &format!("{:.1} s", cost.elapsed_s));
    page.push_str("</div>");
}

fn legend(page: &mut String, names: &[&str]) {
    page.push_str("<div class=\"legend\">");
    for (i, name) in names.iter().enumerate() {
        let _ = write!(page, "<span><i style=\"background:{}\"></i>{}</span>", COLORS[i % COLORS.len()], escape(name));
    }
    page.push_str("</div>");
}

fn open_plot(page: &mut String, id: &str, caption: &str, names: &[&str]) {
    let _ = write!(page, "<figure class=\"plot\" id=\"plot-{id}\"><figcaption>{}</figcaption>", escape(caption));
    legend(page, names);
    let _ = write!(
        page,
        "<svg viewBox=\"0 0 {WIDTH} {HEIGHT}\" width=\"{WIDTH}\" height=\"{HEIGHT}\" role=\"img\">\
         <line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{}\" stroke=\"#999\"/>\
         <line x1=\"{LEFT}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#999\"/>",
        HEIGHT - BOTTOM,
        HEIGHT - BOTTOM,
        WIDTH - RIGHT,
        HEIGHT - BOTTOM
    );
}

fn y_axis(page: &mut String, y_max: f64, format: impl Fn(f64) -> String) {
    for step in 0..=4 {
        let value = y_max * step as f64 / 4.0;
        let y = y_of(value, y_max);
        let _ = write!(
            page,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#eee\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            escape(&format(value))
        );
    }
}

fn y_of(value: f64, y_max: f64) -> f64 {
    let span = HEIGHT - TOP - BOTTOM;
    HEIGHT - BOTTOM - if y_max > 0.0 { span * value / y_max } else { 0.0 }
}

/// Lines over x positions `labels`, y in [0, 1]; one circle (a mark) per point.
fn line_plot(page: &mut String, id: &str, caption: &str, labels: &[String], series: &[(&str, Vec<f64>)]) {
    let names: Vec<&str> = series.iter().map(|(name, _)| *name).collect();
    open_plot(page, id, caption, &names);
    y_axis(page, 1.0, |v| format!("{:.0}%", 100.0 * v));
    let step = (WIDTH - LEFT - RIGHT) / labels.len().max(1) as f64;
    let x_of = |i: usize| LEFT + step * (i as f64 + 0.5);
    for (i, label) in labels.iter().enumerate() {
        let _ = write!(
            page,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x_of(i),
            HEIGHT - BOTTOM + 16.0,
            escape(label)
        );
    }
    for (s, (name, values)) in series.iter().enumerate() {
        let color = COLORS[s % COLORS.len()];
        let points: Vec<String> =
            values.iter().enumerate().map(|(i, v)| format!("{:.1},{:.1}", x_of(i), y_of(*v, 1.0))).collect();
        let _ = write!(
            page,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        for (i, v) in values.iter().enumerate() {
            let _ = write!(
                page,
                "<circle class=\"mark\" data-series=\"{}\" data-x=\"{}\" data-value=\"{v}\" cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"{color}\">\
                 <title>{}: {:.1}% at {}</title></circle>",
                escape(name),
                escape(&labels[i]),
                x_of(i),
                y_of(*v, 1.0),
                escape(name),
                100.0 * v,
                escape(&labels[i])
            );
        }
    }
    page.push_str("</svg></figure>");
}

/// Grouped bars: one group per label, one bar (a mark) per series in each group.
fn bar_plot(
    page: &mut String,
    id: &str,
    caption: &str,
    labels: &[String],
    series: &[(&str, Vec<f64>)],
    format: impl Fn(f64) -> String,
) {
    let names: Vec<&str> = series.iter().map(|(name, _)| *name).collect();
    open_plot(page, id, caption, &names);
    let y_max = series.iter().flat_map(|(_, values)| values.iter().copied()).fold(0.0, f64::max);
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };
    y_axis(page, y_max, &format);
    let group = (WIDTH - LEFT - RIGHT) / labels.len().max(1) as f64;
    let bar = group * 0.8 / series.len().max(1) as f64;
    for (g, label) in labels.iter().enumerate() {
        let x0 = LEFT + group * g as f64 + group * 0.1;
        let _ = write!(
            page,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x0 + group * 0.4,
            HEIGHT - BOTTOM + 16.0,
            escape(label)
        );
        for (s, (name, values)) in series.iter().enumerate() {
            let value = values[g];
            let y = y_of(value, y_max);
            let _ = write!(
                page,
                "<rect class=\"mark\" data-series=\"{}\" data-x=\"{}\" data-value=\"{value}\" x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\">\
                 <title>{}: {} at {}</title></rect>",
                escape(name),
                escape(label),
                x0 + bar * s as f64,
                bar.max(1.0) - 1.0,
                HEIGHT - BOTTOM - y,
                COLORS[s % COLORS.len()],
                escape(name),
                escape(&format(value)),
                escape(label)
            );
        }
    }
    page.push_str("</svg></figure>");
}

fn turn_plots(page: &mut String, m: &JobMetrics) {
    page.push_str("<h2>By turn</h2>");
    let labels: Vec<String> = m.by_turn.iter().map(|(turn, _)| format!("turn {turn}")).collect();
    let mut series = vec![("correct", m.by_turn.iter().map(|(_, r)| r.correct.value()).collect::<Vec<_>>())];
    let thresholds: Vec<f64> = m.overall.fast_p.iter().map(|f| f.threshold).collect();
    let names: Vec<String> = thresholds.iter().map(|p| format!("fast_{p} (eager)")).collect();
    for (p, name) in thresholds.iter().zip(&names) {
        series.push((name, m.by_turn.iter().map(|(_, r)| fast_p_eager(r, *p).map_or(0.0, |f| f.value())).collect()));
    }
    line_plot(
        page,
        "correctness-by-turn",
        "Correctness and fast_p per turn (of evaluated candidates)",
        &labels,
        &series,
    );

    let mut ratios = vec![
        ("hack / evaluated", m.by_turn.iter().map(|(_, r)| r.hack.value()).collect::<Vec<_>>()),
        ("junk / responses", m.by_turn.iter().map(|(_, r)| r.junk.value()).collect()),
    ];
    if m.overall.not_okay.is_some() {
        ratios.push((
            "not-okay / responses",
            m.by_turn.iter().map(|(_, r)| r.not_okay.map_or(0.0, |n| n.value())).collect(),
        ));
    }
    bar_plot(page, "ratios-by-turn", "Hack, junk and not-okay ratios per turn", &labels, &ratios, |v| {
        format!("{:.0}%", 100.0 * v)
    });
}

fn speedup_plot(page: &mut String, m: &JobMetrics, samples: &[TurnSample]) {
    page.push_str("<h2>Speedups of correct kernels</h2>");
    let labels: Vec<String> = SPEEDUP_BINS.iter().map(|(label, _, _)| format!("{label}x")).collect();
    let counts = |speedup: fn(&TurnSample) -> Option<f64>| {
        speedup_histogram(samples, speedup).iter().map(|&c| c as f64).collect()
    };
    let series = [("vs eager", counts(|s| s.speedup_eager)), ("vs torch.compile", counts(|s| s.speedup_compile))];
    let caption = format!(
        "Speedup distribution: {} kernels against eager, {} against torch.compile ({} correct kernels without that baseline)",
        m.speedup_eager.count, m.speedup_compile.count, m.speedup_compile.missing
    );
    bar_plot(page, "speedups", &caption, &labels, &series, format_count);
    let _ = write!(
        page,
        "<table><tr><th class=\"l\">baseline</th><th>kernels</th><th>without</th><th>geomean</th><th>mean</th><th>median</th><th>min</th><th>max</th>"
    );
    for (q, _) in &m.speedup_eager.quantiles {
        let _ = write!(page, "<th>p{:.0}</th>", 100.0 * q);
    }
    page.push_str("</tr>");
    for (name, s) in [("eager", &m.speedup_eager), ("torch.compile", &m.speedup_compile)] {
        let x = |v: f64| format_speedup(v, s.count);
        let _ = write!(
            page,
            "<tr><td class=\"l\">{name}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
            s.count,
            s.missing,
            x(s.geomean),
            x(s.mean),
            x(s.median),
            x(s.min),
            x(s.max)
        );
        for (_, v) in &s.quantiles {
            let _ = write!(page, "<td>{}</td>", x(*v));
        }
        page.push_str("</tr>");
    }
    page.push_str("</table>");
}

fn cost_plot(page: &mut String, meta: &ReportMeta, m: &JobMetrics, samples: &[TurnSample]) {
    page.push_str("<h2>Cost</h2>");
    if !meta.pricing.is_empty() {
        let _ = write!(page, "<p class=\"note\" id=\"pricing\">Priced at {}.</p>", escape(&meta.pricing));
    }
    let usage = usage_by_turn(samples);
    let labels: Vec<String> = usage.iter().map(|(turn, ..)| format!("turn {turn}")).collect();
    let series = [
        ("prompt tokens", usage.iter().map(|u| u.1 as f64).collect::<Vec<_>>()),
        ("completion tokens", usage.iter().map(|u| u.2 as f64).collect()),
    ];
    let caption = format!("Tokens per turn (${:.4} in all)", m.cost.usage.cost_usd);
    bar_plot(page, "tokens-by-turn", &caption, &labels, &series, format_count);
    page.push_str("<table><tr><th class=\"l\">per</th><th>count</th><th>cost</th><th>turn seconds</th></tr>");
    for (name, spend) in [
        ("task", &m.cost.per_task),
        ("evaluated candidate", &m.cost.per_evaluated),
        ("correct kernel", &m.cost.per_correct),
    ] {
        let _ = write!(
            page,
            "<tr><td class=\"l\">{name}</td><td>{}</td><td>${:.4}</td><td>{:.1}</td></tr>",
            spend.count, spend.cost_usd, spend.seconds
        );
    }
    let _ = write!(
        page,
        "</table><p class=\"note\">{} prompt tokens ({} cached), {} completion tokens ({} reasoning); turn seconds {:.1} in all, \
         elapsed {:.1} s.</p>",
        m.cost.usage.prompt_tokens,
        m.cost.usage.cached_prompt_tokens,
        m.cost.usage.completion_tokens,
        m.cost.usage.reasoning_tokens,
        m.cost.turn_seconds,
        m.cost.elapsed_s
    );
}

fn rates_row(page: &mut String, label: &str, r: &Rates) {
    let fast = r.fast_p.first().map_or_else(|| "n/a".into(), |f| format_ratio(&f.eager));
    let _ = write!(
        page,
        "<tr><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        escape(label),
        r.turns,
        format_ratio(&r.correct),
        fast,
        format_ratio(&r.compile_error),
        format_ratio(&r.hack),
        format_ratio(&r.junk),
        r.not_okay.as_ref().map_or_else(|| "off".into(), format_ratio),
        r.infra_errors
    );
}

fn tables(page: &mut String, m: &JobMetrics, samples: &[TurnSample]) {
    let header = "<tr><th class=\"l\"></th><th>turns</th><th>correct</th><th>fast (first p, eager)</th><th>compile errors</th>\
                  <th>hack</th><th>junk</th><th>not-okay</th><th>infra errors</th></tr>";
    let _ = write!(page, "<h2>Rates by turn and level</h2><table id=\"table-rates\">{header}");
    rates_row(page, "all", &m.overall);
    for (turn, r) in &m.by_turn {
        rates_row(page, &format!("turn {turn}"), r);
    }
    for (level, r) in &m.by_level {
        rates_row(page, &if *level == 0 { "no level".into() } else { format!("level {level}") }, r);
    }
    page.push_str("</table>");

    let last = m.at_k.iter().map(|a| a.turns).max().unwrap_or(0);
    page.push_str(
        "<h2>best@k and avg@k (all turns)</h2><table id=\"table-at-k\"><tr><th>k</th><th>tasks</th><th>best correct</th>\
         <th>avg correct</th><th>best speedup (eager)</th><th>avg speedup (eager)</th><th>best speedup (compile)</th>\
         <th>avg speedup (compile)</th></tr>",
    );
    for a in m.at_k.iter().filter(|a| a.turns == last) {
        let _ = write!(
            page,
            "<tr><td>{}</td><td>{}</td><td>{:.1}%</td><td>{:.1}%</td><td>{:.2}x</td><td>{:.2}x</td><td>{:.2}x</td><td>{:.2}x</td></tr>",
            a.k,
            a.correct.tasks,
            100.0 * a.correct.best,
            100.0 * a.correct.avg,
            a.speedup_eager.best,
            a.speedup_eager.avg,
            a.speedup_compile.best,
            a.speedup_compile.avg
        );
    }
    page.push_str("</table>");

    page.push_str(
        "<h2>Tasks</h2><table id=\"table-tasks\"><tr><th class=\"l\">task</th><th>level</th><th>trajectories</th>\
         <th>turns</th><th>correct turns</th><th>best vs eager</th><th>best vs torch.compile</th></tr>",
    );
    for t in task_lines(samples) {
        let best = |v: Option<f64>| v.map_or_else(|| "-".into(), |s| format!("{s:.2}x"));
        let _ = write!(
            page,
            "<tr><td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&t.task),
            t.level,
            t.trajectories,
            t.turns,
            t.correct_turns,
            best(t.best_speedup_eager),
            best(t.best_speedup_compile)
        );
    }
    page.push_str("</table>");
}
