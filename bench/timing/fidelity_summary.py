"""fidelity.py's OUT/summary.md, rebuilt from every line of OUT/results.jsonl: a table per phase (kforge against
do_bench), idle run to run, the candidate's launch against its cover, the stage_ms entries, and the aggregate
against the targets. Each section is a function of the results that returns its lines (none when it has nothing
to show).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common

SMALL_MS = 0.1
HOST_WAITS = "timing.host_synchronized"  # the evaluator's notice for a call that makes the host wait mid-call

Record = dict[str, Any]
# A results.jsonl line's (phase, repeat, key).
Slot = tuple[Any, Any, Any]
# (measure, (value, candidate) or None, limit, signed, judged against the limit)
Row = tuple[str, "tuple[float, str] | None", Any, bool, bool]

# What each error and run-to-run index measures: kforge's field, do_bench's it is compared with, the target,
# and whether it is judged (kforge's 10th percentiles, from its samples, are shown against do_bench's median).
MEASURES = (
    ("candidate median", "candidate_median_ms", "candidate_median_ms", "median", True),
    ("eager median", "eager_median_ms", "eager_median_ms", "median", True),
    ("speedup", "speedup_eager", "speedup_eager", "speedup", True),
    ("candidate p10", "candidate_p10_ms", "candidate_median_ms", "median", False),
    ("eager p10", "eager_p10_ms", "eager_median_ms", "median", False),
)


def pct(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0:
        return None
    return 100.0 * (value - reference) / reference


def fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def latest(records: list[Record]) -> dict[Slot, Record]:
    """The last line per (phase, repeat, key)."""
    table: dict[Slot, Record] = {}
    for record in records:
        table[(record.get("phase"), record.get("repeat"), record.get("key"))] = record
    return table


@dataclass
class Results:
    """results.jsonl as the summary reads it: every line, the last per (phase, repeat, key), the candidates in the
    order they first appear, and do_bench's clean processes per candidate with the one a kforge figure is
    compared with."""

    path: Path
    records: list[Record]
    table: dict[Slot, Record]
    order: list[Any]
    # One per clean process (the `dobench` phase's repeats; the spinning ones wait otherwise, which is what moves
    # for calls where the host waits).
    dobench_runs: dict[Any, list[Record]]
    # With several clean processes (`--dobench-repeats`), the one whose candidate median is their median.
    db: dict[Any, Record]

    @classmethod
    def read(cls, path: Path) -> Results:
        records = common.read_jsonl(path)
        table = latest(records)
        order: list[Any] = []
        for record in records:
            if record.get("key") not in order:
                order.append(record.get("key"))
        dobench_runs: dict[Any, list[Record]] = {}
        for (phase, _, key), r in table.items():
            if phase == "dobench" and r.get("ok"):
                dobench_runs.setdefault(key, []).append(r)
        db = {
            key: sorted(rs, key=lambda r: r["candidate_median_ms"])[(len(rs) - 1) // 2]
            for key, rs in dobench_runs.items()
        }
        return cls(path, records, table, order, dobench_runs, db)

    def errors(self, r: Record) -> tuple[float | None, ...]:
        """kforge's figures in `r` against do_bench's, in % (one per measure); none for a verdict not correct."""
        d = self.db.get(r["key"])
        if d is None or r.get("verdict") != "VERDICT_CORRECT":
            return (None,) * len(MEASURES)
        return tuple(pct(r.get(mine), d.get(theirs)) for _, mine, theirs, _, _ in MEASURES)


def summary(out: Path, args: argparse.Namespace) -> None:
    """Writes OUT/summary.md from OUT/results.jsonl."""
    results = Results.read(out / "results.jsonl")
    idle = idle_by_repeat(results)
    r2r = run_to_run(idle, results.order)
    lines = [
        f"# timing-fidelity: kforge against do_bench ({time.strftime('%Y-%m-%d %H:%M:%S')})",
        "",
        f"From `{results.path}` ({len(results.records)} lines); machine: `machine.txt`. Errors are "
        "(kforge - do_bench) / do_bench in %; run-to-run is (max - min) / mean over the idle repeats, in %.",
        "Milliseconds throughout.",
        "",
    ]
    lines += dobench_repeated_section(results)
    lines += dobench_section(results)
    lines += phase_section(results, "idle", "idle: one evaluation at a time")
    lines += run_to_run_section(results, idle, r2r)
    lines += phase_section(results, "full", "full: every candidate at once plus a cold-compile copy of each")
    lines += load_copies_section(results)
    lines += timed_step_section(results)
    lines += stage_ms_section(results)
    lines += Aggregate(results, r2r, args).section()
    lines += failures_section(results)
    (out / "summary.md").write_text("\n".join(lines))
    common.log(f"wrote {out / 'summary.md'}")


def dobench_repeated_section(results: Results) -> list[str]:
    """do_bench children repeated, waiting blocked or spinning (dobench-spin), beside kforge's idle medians."""
    table = results.table
    repeated = [key for key in results.order if any(phase == "dobench-spin" and k == key for (phase, _, k) in table)]
    if not repeated:
        return []
    lines = [
        "## do_bench repeated: default wait against a spinning wait, and kforge idle",
        "",
        "| candidate | do_bench cand (default) | do_bench cand (spin) | kforge cand (idle) | "
        "do_bench eager (default) | do_bench eager (spin) | kforge eager (idle) |",
        "|---|---|---|---|---|---|---|",
    ]

    def medians(phase: str, key: Any, field: str) -> str:
        values = [
            r.get(field)
            for (p, _, k), r in sorted(table.items(), key=lambda kv: str(kv[0]))
            if p == phase and k == key and r.get(field) is not None
        ]
        return " / ".join(fmt(v) for v in values) or "-"

    for key in repeated:
        lines.append(
            f"| {key} | {medians('dobench', key, 'candidate_median_ms')} | "
            f"{medians('dobench-spin', key, 'candidate_median_ms')} | "
            f"{medians('idle', key, 'candidate_median_ms')} | {medians('dobench', key, 'eager_median_ms')} | "
            f"{medians('dobench-spin', key, 'eager_median_ms')} | {medians('idle', key, 'eager_median_ms')} |"
        )
    lines.append("")
    return lines


def dobench_section(results: Results) -> list[str]:
    """do_bench's first clean process per candidate: medians, spreads, speedup, the outputs' difference."""
    lines = [
        "## do_bench (clean process, warmup=25, rep=200)",
        "",
        "| candidate | task | eager median | eager p20-p80 (n) | candidate median | candidate p20-p80 (n) | "
        "speedup | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in results.order:
        r = results.table.get(("dobench", 0, key))
        if r is None:
            continue
        if not r.get("ok"):
            lines.append(f"| {key} | {r.get('task')} | FAILED: {r.get('error', '')[:120].splitlines()[0]} | | | | | |")
            continue
        e, c = r.get("eager_all") or {}, r.get("candidate_all") or {}
        lines.append(
            f"| {key} | {r.get('task')} | {fmt(r['eager_median_ms'])} | {fmt(e.get('p20'))}-"
            f"{fmt(e.get('p80'))} ({e.get('n')}) | {fmt(r['candidate_median_ms'])} | {fmt(c.get('p20'))}-"
            f"{fmt(c.get('p80'))} ({c.get('n')}) | {fmt(r.get('speedup_eager'), 3)} | "
            f"{fmt(r.get('max_abs_diff'), 6)} |"
        )
    lines.append("")
    return lines


def phase_section(results: Results, phase: str, title: str) -> list[str]:
    """kforge's figures of one phase per evaluation, against do_bench's, with the errors."""
    order = results.order
    rows = sorted(((rep, key), r) for (p, rep, key), r in results.table.items() if p == phase)
    rows.sort(key=lambda item: (item[0][0], order.index(item[0][1]) if item[0][1] in order else 0))
    if not rows:
        return []
    lines = [
        f"## {title}",
        "",
        "| candidate | repeat | verdict | kforge cand median / p10 | do_bench cand | err % median / p10 | "
        "kforge eager median / p10 | do_bench eager | err % median / p10 | kforge speedup | "
        "do_bench speedup | err % | samples cand/eager | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (rep, key), r in rows:
        d = results.db.get(key, {})
        ec, ee, es, pc, pe = results.errors(r)
        lines.append(
            f"| {key} | {rep} | {r.get('verdict')} | {fmt(r.get('candidate_median_ms'))} / "
            f"{fmt(r.get('candidate_p10_ms'))} | {fmt(d.get('candidate_median_ms'))} | {fmt_pct(ec)} / "
            f"{fmt_pct(pc)} | {fmt(r.get('eager_median_ms'))} / {fmt(r.get('eager_p10_ms'))} | "
            f"{fmt(d.get('eager_median_ms'))} | {fmt_pct(ee)} / {fmt_pct(pe)} | {fmt(r.get('speedup_eager'), 3)} | "
            f"{fmt(d.get('speedup_eager'), 3)} | {fmt_pct(es)} | {r.get('candidate_samples', '-')}/"
            f"{r.get('eager_samples', '-')} | {fmt(r.get('wall_s'), 1)} |"
        )
    lines.append("")
    return lines


def idle_by_repeat(results: Results) -> dict[Any, dict[Any, Record]]:
    """The idle evaluations that ended VERDICT_CORRECT, per candidate and repeat."""
    idle: dict[Any, dict[Any, Record]] = {}
    for (phase, rep, key), r in results.table.items():
        if phase == "idle" and r.get("verdict") == "VERDICT_CORRECT":
            idle.setdefault(key, {})[rep] = r
    return idle


def spread_pct(values: list[Any]) -> float | None:
    """(max - min) / mean in %, of at least two values."""
    if len(values) < 2:
        return None
    return 100.0 * (max(values) - min(values)) / (sum(values) / len(values))


def run_to_run(idle: dict[Any, dict[Any, Record]], order: list[Any]) -> dict[Any, tuple[float | None, ...]]:
    """Per candidate with at least two idle repeats, in `order`: each measure's spread across them, in %."""
    r2r: dict[Any, tuple[float | None, ...]] = {}
    for key in order:
        repeats = idle.get(key, {})
        if len(repeats) < 2:
            continue
        r2r[key] = tuple(
            spread_pct([x.get(mine) for x in repeats.values() if x.get(mine)]) for _, mine, _, _, _ in MEASURES
        )
    return r2r


def run_to_run_section(
    results: Results, idle: dict[Any, dict[Any, Record]], r2r: dict[Any, tuple[float | None, ...]]
) -> list[str]:
    """The idle repeats' medians side by side with their spreads, where a candidate has two or more."""
    if not any(len(v) > 1 for v in idle.values()):
        return []
    reps = sorted({rep for v in idle.values() for rep in v})
    lines = [
        "## idle run to run",
        "",
        "| candidate | "
        + " | ".join(f"cand r{r}" for r in reps)
        + " | cand % | "
        + " | ".join(f"eager r{r}" for r in reps)
        + " | eager % | speedup % | cand p10 % | eager p10 % |",
        "|---|" + "---|" * (2 * len(reps) + 5),
    ]
    for key in results.order:
        if key not in r2r:
            continue
        v = idle[key]
        lines.append(
            f"| {key} | "
            + " | ".join(fmt(v.get(r, {}).get("candidate_median_ms")) for r in reps)
            + f" | {fmt(r2r[key][0], 2)} | "
            + " | ".join(fmt(v.get(r, {}).get("eager_median_ms")) for r in reps)
            + " | "
            + " | ".join(fmt(x, 2) for x in r2r[key][1:])
            + " |"
        )
    lines.append("")
    return lines


def load_copies_section(results: Results) -> list[str]:
    """The full phase's cold-compile copies: their verdicts, cache hits, and when the last evaluation ended."""
    table = results.table
    loads = [r for (p, _, _), r in table.items() if p == "full-load"]
    if not loads:
        return []
    verdicts: dict[Any, int] = {}
    for r in loads:
        verdicts[r.get("verdict")] = verdicts.get(r.get("verdict"), 0) + 1
    ends = [r.get("ended_s") or 0 for (p, _, _), r in table.items() if p in ("full", "full-load")]
    return [
        f"Load copies: {len(loads)} ({verdicts}); cache hits among them: "
        f"{sum(1 for r in loads if r.get('compile_cache_hit'))}; last evaluation ended at "
        f"{max(ends):.1f} s.",
        "",
    ]


def timed_step_section(results: Results) -> list[str]:
    """The candidate's timed step per evaluation: what its launch took against the cover (the harness's medians)."""
    order = results.order
    steps = [
        (phase, repeat, key, r)
        for (phase, repeat, key), r in results.table.items()
        if phase in ("warm", "idle", "full", "full-load") and "run.timing_launch" in (r.get("stage_ms") or {})
    ]
    if not steps:
        return []
    lines = [
        "## the candidate's timed step: launch against the cover (medians over the measured calls, us)",
        "",
        "A launch longer than the flush and the cover the device ran shows in the candidate's median; "
        "`timing.launch_exposed`: the evaluator's notice that more than half the calls' covers ran out (binaries "
        "from 9fbcaaf on; earlier ones never give it).",
        "",
        "| candidate | phase | repeat | candidate median | launch | cover asked | cover run | timing.launch_exposed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for phase, repeat, key, r in sorted(steps, key=lambda s: (order.index(s[2]), s[0], s[1])):
        st = r["stage_ms"]
        us = [
            r.get("candidate_median_ms"),
            st.get("run.timing_launch"),
            st.get("run.timing_cover"),
            st.get("run.timing_cover_device"),
        ]
        exposed = "yes" if "timing.launch_exposed" in (r.get("findings") or []) else "no"
        lines.append(
            f"| {key} | {phase} | {repeat} | "
            + " | ".join(fmt(1000 * v, 1) if v is not None else "-" for v in us)
            + f" | {exposed} |"
        )
    lines.append("")
    return lines


def stage_ms_section(results: Results) -> list[str]:
    """The stage_ms entries about timing, idle and full: mean and largest."""
    stage_keys: dict[str, dict[str, list[float]]] = {}
    for (phase, _, _), r in results.table.items():
        if phase in ("idle", "full"):
            for k, v in (r.get("stage_ms") or {}).items():
                if v is not None and ("timing" in k or "cpu_wait" in k or k.startswith("run.")):
                    stage_keys.setdefault(k, {}).setdefault(phase, []).append(v)
    if not stage_keys:
        return []
    lines = [
        "## stage_ms (entries with `timing` or `cpu_wait`, or starting with `run.`)",
        "",
        "| key | idle mean | idle max | full mean | full max |",
        "|---|---|---|---|---|",
    ]
    for k in sorted(stage_keys):
        cells = []
        for phase in ("idle", "full"):
            v = stage_keys[k].get(phase, [])
            cells += [fmt(sum(v) / len(v), 1) if v else "-", fmt(max(v), 1) if v else "-"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def outside_pct(value: float | None, references: list[Any]) -> float | None:
    """How far `value` lies outside the range of `references`, in % of the nearer end (0 inside; signed)."""
    references = [v for v in references if v]
    if value is None or not references:
        return None
    lo, hi = min(references), max(references)
    return 0.0 if lo <= value <= hi else pct(value, lo if value < lo else hi)


class Aggregate:
    """The aggregate: per group of ops (>= SMALL_MS, smaller, and calls where the host waits), the worst error and
    run-to-run difference of each measure against its target, and the verdict over the targets."""

    def __init__(self, results: Results, r2r: dict[Any, tuple[float | None, ...]], args: argparse.Namespace):
        self.results = results
        self.r2r = r2r
        self.targets = {"median": args.target_median, "speedup": args.target_speedup, "r2r": args.target_r2r}
        self.host_waits = {
            key
            for (phase, _, key), r in results.table.items()
            if phase in ("warm", "idle", "full") and HOST_WAITS in (r.get("findings") or [])
        }

    def group_of(self, key: Any) -> str | None:
        d = self.results.db.get(key)
        if d is None:
            return None
        if key in self.host_waits:
            return "host"
        return "large" if d["eager_median_ms"] >= SMALL_MS else "small"

    def dobench_spread(self, key: Any) -> float | None:
        """do_bench's own spread of the candidate's median across its clean processes, in %."""
        values = [r["candidate_median_ms"] for r in self.results.dobench_runs.get(key, [])]
        return 100.0 * (max(values) - min(values)) / (sum(values) / len(values)) if len(values) > 1 else None

    def worst(self, phase: str, index: int, group: str) -> tuple[float, str] | None:
        best = None
        for (p, _, key), r in self.results.table.items():
            if p != phase or self.group_of(key) != group:
                continue
            value = self.results.errors(r)[index]
            if value is not None and (best is None or abs(value) > abs(best[0])):
                best = (value, key)
        return best

    def worst_r2r(self, index: int, group: str) -> tuple[float, str] | None:
        best = None
        for key, values in self.r2r.items():
            value = values[index]
            if self.group_of(key) == group and value is not None and (best is None or value > best[0]):
                best = (value, key)
        return best

    def section(self) -> list[str]:
        targets = self.targets
        lines = [
            "## aggregate",
            "",
            f"Ops grouped by do_bench's eager median: >= {SMALL_MS} ms (the targets apply) and < {SMALL_MS} ms "
            "(reported apart). Targets, as read from the brief: |error| of the candidate and eager medians "
            f"<= {targets['median']}%, of the speedups <= {targets['speedup']}% (idle and full), run-to-run "
            f"difference between idle repeats <= {targets['r2r']}%. Calls that make the host wait for the device "
            f"mid-call (the evaluator's notice `{HOST_WAITS}`) are reported apart whatever their size: their cost "
            "comes in two levels that switch within a process, and no timer holds them to a few percent of one "
            "process's do_bench; kforge's candidate median and speedup are held to the same targets against "
            "the range of do_bench's medians across its clean processes (at least two: `--dobench-repeats`), and "
            "to the run-to-run target. kforge's 10th percentiles (from its samples) are shown beside the medians, "
            "not judged.",
            "",
        ]
        failing: list[str] = []
        measured: list[str] = []
        unmeasured: list[str] = []
        for group, title in (
            ("large", f"eager >= {SMALL_MS} ms"),
            ("small", f"eager < {SMALL_MS} ms"),
            ("host", f"the host waits mid-call (`{HOST_WAITS}`)"),
        ):
            count = sum(1 for key in self.results.order if self.group_of(key) == group)
            lines += [
                f"### {title} ({count} ops)",
                "",
                "| measure | worst | candidate | target | |",
                "|---|---|---|---|---|",
            ]
            rows = self.host_rows() if group == "host" else self.sized_rows(group)
            for name, found, limit, signed, judged in rows:
                if found is None:
                    lines.append(f"| {name} | - | - | {limit} | not measured |")
                    if group == "large":
                        unmeasured.append(name)
                    continue
                if group == "large":
                    measured.append(name)
                value = abs(found[0])
                verdict = ("PASS" if value <= limit else "FAIL") if judged else "(informational)"
                if verdict == "FAIL":
                    failing.append(name if group == "large" or found[1] in name else f"{name} ({found[1]})")
                shown = fmt_pct(found[0]) if signed else fmt(found[0], 2)
                lines.append(
                    f"| {name} | {shown} | {found[1]} | {fmt(limit, 2) if isinstance(limit, float) else limit} "
                    f"| {verdict} |"
                )
            lines.append("")
        if not measured:
            verdict = "nothing measured yet."
        elif failing:
            verdict = f"missed: {', '.join(failing)}."
        else:
            verdict = "all measured ones met" + (f" (not measured: {', '.join(unmeasured)})." if unmeasured else ".")
        lines += [
            f"Targets on ops >= {SMALL_MS} ms, and on calls where the host waits against do_bench's range: {verdict}",
            "",
        ]
        return lines

    def sized_rows(self, group: str) -> list[Row]:
        """The worst error of each measure, idle and full, and the worst run-to-run difference (judged for the
        large ops)."""
        rows: list[Row] = []
        for phase in ("idle", "full"):
            for index, (name, _, _, target, judged) in enumerate(MEASURES):
                rows.append(
                    (
                        f"{phase} {name} abs error %",
                        self.worst(phase, index, group),
                        self.targets[target],
                        True,
                        group == "large" and judged,
                    )
                )
        for index, (name, _, _, _, judged) in enumerate(MEASURES):
            rows.append(
                (
                    f"run-to-run {name} %",
                    self.worst_r2r(index, group),
                    self.targets["r2r"],
                    False,
                    group == "large" and judged,
                )
            )
        return rows

    def host_rows(self) -> list[Row]:
        """Each op where the host waits, against do_bench's own range across its clean processes: how far kforge's
        speedup and candidate median, idle and full, fall outside it, held to the targets once do_bench ran in at
        least two processes; its 10th percentile beside them (informational). Run to run as for the others."""
        rows: list[Row] = []
        for key in [key for key in self.results.order if self.group_of(key) == "host"]:
            runs = self.results.dobench_runs.get(key, [])
            spread = self.dobench_spread(key)
            rows.append(
                (
                    f"do_bench's own spread across processes % ({key})",
                    None if spread is None else (spread, key),
                    "-",
                    False,
                    False,
                )
            )
            # With do_bench in one process there is no range to judge it against.
            limit = self.targets["median"] if len(runs) > 1 else "- (needs --dobench-repeats 2 or more)"
            for name, fields, judged in (
                (
                    "candidate median and speedup",
                    (("candidate_median_ms", "candidate_median_ms"), ("speedup_eager", "speedup_eager")),
                    len(runs) > 1,
                ),
                ("candidate p10", (("candidate_p10_ms", "candidate_median_ms"),), False),
            ):
                rows.append(
                    (
                        f"largest distance % of kforge's {name} from that range, idle and full",
                        self.largest_outside(key, fields, runs),
                        limit,
                        True,
                        judged,
                    )
                )
            found = self.r2r.get(key)
            for index, (name, _, _, _, judged) in enumerate(MEASURES):
                if not name.startswith("eager"):  # the reference does not wait: shown above
                    value = None if found is None else found[index]
                    rows.append(
                        (
                            f"run-to-run {name} % ({key})",
                            None if value is None else (value, key),
                            self.targets["r2r"],
                            False,
                            judged,
                        )
                    )
        return rows

    def largest_outside(
        self, key: Any, fields: tuple[tuple[str, str], ...], runs: list[Record]
    ) -> tuple[float, str] | None:
        """The largest distance (signed, in %) of kforge's `fields` of `key`, idle and full, from the range of
        do_bench's corresponding fields across `runs`; per pair (kforge's, do_bench's)."""
        outside = [
            (outside_pct(r.get(mine), [d.get(theirs) for d in runs]), key)
            for (p, _, k), r in self.results.table.items()
            if p in ("idle", "full") and k == key and r.get("verdict") == "VERDICT_CORRECT"
            for mine, theirs in fields
        ]
        present = [(value, candidate) for value, candidate in outside if value is not None]
        return max(present, key=lambda o: abs(o[0]), default=None)


def failures_section(results: Results) -> list[str]:
    """The evaluations that did not end VERDICT_CORRECT, with the end of their error."""
    bad = [
        r
        for (p, _, _), r in results.table.items()
        if p in ("idle", "full", "warm", "full-load") and r.get("verdict") != "VERDICT_CORRECT"
    ]
    if not bad:
        return []
    lines = [
        "## evaluations that were not VERDICT_CORRECT",
        "",
        "| phase | repeat | candidate | verdict | error |",
        "|---|---|---|---|---|",
    ]
    for r in bad:
        error = (r.get("error") or "").replace("|", "/").replace("\n", " ")[-200:]
        lines.append(f"| {r['phase']} | {r['repeat']} | {r['key']} | {r.get('verdict')} | {error} |")
    lines.append("")
    return lines
