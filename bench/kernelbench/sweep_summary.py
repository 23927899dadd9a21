"""Summarises a KernelBench-scale sweep: evaluator-kernelbench's JSON lines (one per evaluation) as markdown.

    python3 bench/kernelbench/sweep_summary.py SWEEP.jsonl [MORE.jsonl ...] > summary.md

Per kind of candidate (`reproduce`, `analytical`, `partial`), and per pass (`cold`, `warm`) where the sweep ran
with `--again`: verdicts and finding codes; for the reproducing
candidates, wall time per evaluation (p50, p95, max; from submission to result, with `--in-flight` bounding what
was submitted at once), the stage that dominated each of the slowest, and peak device memory (the candidate's
process and the task's reference), waits at the device gate, and how many evaluations computed their reference
(in a warm pass: one the cache no longer held). Before them, each file's GPU time by what its gates did (lines
that carry `gates`). Then one row per evaluation.
"""

import collections
import json
import sys


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


STAGES = ("static", "compile", "queue_compile", "queue_device", "run", "check", "timing", "remeasure")


def dominant(stage_ms):
    stages = {k: v for k, v in (stage_ms or {}).items() if k in STAGES}
    return max(stages.items(), key=lambda kv: kv[1]) if stages else ("-", 0.0)


def gib(value):
    return f"{(value or 0) / (1 << 30):.2f}"


def gates(paths):
    """Each file's GPU time by what its gates did, from its last line that carries them (`gates`: cumulative)."""
    for path in paths:
        with open(path) as f:
            last = None
            for line in f:
                if line.strip() and "gates" in (row := json.loads(line)):
                    last = row["gates"]
        if not last:
            continue
        parts = ("alone", "draining", "shared", "empty")
        print(f"GPU time by the gate, {path} ({last['since_start_s']:.0f} s):\n")
        for i, gpu in enumerate(last["gpus"]):
            total = sum(gpu[p] for p in parts) or 1.0
            print(f"- GPU {i}: " + ", ".join(f"{p} {gpu[p]:.0f} s ({gpu[p] / total:.0%})" for p in parts))
        print()


def main():
    rows = []
    for path in sys.argv[1:]:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    print(f"# KernelBench sweep: {len(rows)} evaluations ({', '.join(sys.argv[1:])})\n")
    gates(sys.argv[1:])
    by_kind = collections.defaultdict(list)
    for row in rows:
        kind = row.get("kind") or "-"
        by_kind[f"{kind}, {row['pass']}" if row.get("pass") else kind].append(row)
    for kind, group in by_kind.items():
        verdicts = collections.Counter(r.get("verdict") or f"REFUSED {r.get('refused', '')[:60]}" for r in group)
        codes = collections.Counter(f["code"] for r in group for f in r.get("findings", []))
        print(f"## {kind}: {len(group)} evaluations\n")
        print("Verdicts: " + ", ".join(f"{v} {n}" for v, n in verdicts.most_common()) + "\n")
        print("Findings: " + (", ".join(f"`{c}` {n}" for c, n in codes.most_common()) or "none") + "\n")
        walls = [r["wall_s"] for r in group if "wall_s" in r]
        if walls:
            print(
                f"Wall per evaluation: p50 {quantile(walls, 0.5):.1f} s, p95 {quantile(walls, 0.95):.1f} s, "
                f"max {max(walls):.1f} s\n"
            )
            # What the evaluation took besides waiting for its neighbours: the disk budget, a device slot, and
            # the device's gate while another evaluation's exclusive phase ran.
            waits = ("queue_disk", "queue_device", "device.gate_wait")
            own = [
                r["wall_s"] - sum(r.get("stage_ms", {}).get(w, 0.0) for w in waits) / 1e3
                for r in group
                if "wall_s" in r
            ]
            print(
                f"Wall less waits for neighbours ({', '.join(waits)}): p50 {quantile(own, 0.5):.1f} s, "
                f"p95 {quantile(own, 0.95):.1f} s, max {max(own):.1f} s\n"
            )
            gate = [r.get("stage_ms", {}).get("device.gate_wait", 0.0) / 1e3 for r in group if "wall_s" in r]
            print(
                f"Waiting at the device gate (`device.gate_wait`): p50 {quantile(gate, 0.5):.1f} s, "
                f"p95 {quantile(gate, 0.95):.1f} s, {sum(gate):.0f} s in all\n"
            )
            # A reference computed in this evaluation (its stage's CPU time is reported): in a warm pass, one the
            # reference cache no longer held.
            computed = sum("cpu.reference" in r.get("stage_ms", {}) for r in group)
            print(f"References computed: {computed} of {len(group)}\n")
            peaks = [r.get("device_peak_bytes") or 0 for r in group]
            print(
                f"Peak device memory of the candidate's process: p50 {gib(quantile(peaks, 0.5))} GiB, "
                f"max {gib(max(peaks))} GiB\n"
            )
        slowest = sorted((r for r in group if "wall_s" in r), key=lambda r: -r["wall_s"])[:10]
        if slowest:
            print(
                "Slowest: "
                + "; ".join(
                    f"{r['task']} {r['wall_s']:.0f} s ({dominant(r.get('stage_ms'))[0]} "
                    f"{dominant(r.get('stage_ms'))[1] / 1000:.0f} s)"
                    for r in slowest
                )
                + "\n"
            )
    print("## Every evaluation\n")
    print(
        "| task | kind | pass | verdict | wall s | queue_device s | run s | check s | timing s | cand peak GiB | "
        "ref peak GiB | findings |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.get("task", ""), r.get("kind", ""), r.get("pass", ""))):
        s = r.get("stage_ms") or {}

        def sec(k, s=s):
            return f"{s[k] / 1000:.1f}" if k in s else "-"

        codes = " ".join(f["code"] for f in r.get("findings", []))
        verdict = r.get("verdict") or "REFUSED"
        if r.get("error") and verdict != "VERDICT_CORRECT":
            codes += " " + r["error"][:80].replace("|", "/").replace("\n", " ")
        print(
            f"| {r.get('task')} | {r.get('kind')} | {r.get('pass', '-')} | {verdict} | {r.get('wall_s', 0):.1f} | "
            f"{sec('queue_device')} | {sec('run')} | {sec('check')} | {sec('timing')} | "
            f"{gib(r.get('device_peak_bytes'))} | {gib(r.get('reference_peak_bytes'))} | {codes} |"
        )


if __name__ == "__main__":
    main()
