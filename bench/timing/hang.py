"""Liveness: N legitimate evaluations beside one hanging candidate, against the same N alone.

On the GPU machine, from the repository root (binaries built: target/release/kforge), one command of about 6
minutes with the defaults (the corpus's legit_relu.py as the legitimate candidate):

    python3 bench/timing/hang.py --out OUT

or with make_candidates.py's candidates (the manifest's first N cuda entries expected VERDICT_CORRECT, cycled when
there are fewer):

    python3 bench/timing/hang.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR
    python3 bench/timing/hang.py --out OUT --summary-only

One evaluator with its default configuration (gpu_slots included; `--gpu-slots N` overrides it), except
`--run-timeout S` (default 60), which sets KFORGE__EVALUATOR__RUN_TIMEOUT_SECS, the wall-clock limit of each run
stage, so the hanging candidate ends in S seconds rather than the default 300 (`--run-timeout 0` keeps the
default; the command then needs more than 10 minutes).

- warm: every distinct legitimate candidate once, and the hanging one (services/evaluator/tests/corpus/cuda/
  fail_infinite_loop.py on its header's task, `relu`: examples/tasks/relu/task.py; policy permissive), all at
  once: compiles, reference outputs and baselines cached, the hang's extension compiled (`--no-hang-warm` skips it:
  the first beside phase then compiles it). Not measured; it waits for the evaluator's children to end.
- then, `--repeats` times (default 2): alone: the N legitimate evaluations submitted at once; each one's wall time
  (client side, from submit to response) and verdict. beside: the same N plus the hanging candidate, all released
  at the same moment; each legitimate one's wall time and verdict, the hang's verdict, wall time and error text.
  Distinct request_ids, no idempotency keys.

Reported: OUT/results.jsonl (one line per evaluation: phase warm/alone/beside/hang, repeat, index), OUT/summary.md
(per legitimate evaluation alone against beside the hang, with the target beside <= 1.2 x alone + 5 s, alone being
the same repeat's; the hang's verdict, expected VERDICT_TIMEOUT, and its time), OUT/machine.txt, the evaluator's
log OUT/evaluator-hang.log. `--repeat-offset K` numbers the repeats from K, so that repeats run by separate commands
do not overwrite each other's lines in the summary (which keeps the last line per phase, repeat and index).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

HANG = common.CORPUS / "cuda" / "fail_infinite_loop.py"
RUN_TIMEOUT_ENV = "KFORGE__EVALUATOR__RUN_TIMEOUT_SECS"


def parse():
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Details: the module docstring.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--candidates", help="make_candidates.py's output directory (default: the corpus's legit_relu.py)"
    )
    parser.add_argument(
        "--tasks-dir",
        default=str(common.REPO.parent / "shared" / "kernelbench"),
        help="KernelBench directory, with --candidates",
    )
    parser.add_argument("--n", type=int, default=6, help="legitimate evaluations per phase (default 6)")
    parser.add_argument("--repeats", type=int, default=2, help="alone/beside repeats (default 2)")
    parser.add_argument("--repeat-offset", type=int, default=0, help="number the repeats from this")
    parser.add_argument(
        "--run-timeout",
        type=int,
        default=60,
        help=f"{RUN_TIMEOUT_ENV} in seconds (default 60; 0: the evaluator's default)",
    )
    parser.add_argument("--gpu-slots", type=int, default=0, help="evaluator gpu_slots (default: its default)")
    parser.add_argument("--no-compile-baseline", action="store_true", help="baseline_torch_compile = false")
    parser.add_argument("--no-hang-warm", action="store_true", help="do not compile the hang during warm")
    parser.add_argument("--python", default=common.default_python(), help="interpreter with torch (default: this one)")
    parser.add_argument("--kforge", default=None, help="kforge binary (default target/release/kforge)")
    parser.add_argument(
        "--deadline-s", type=float, default=480.0, help="start no repeat after this many seconds (0: no limit)"
    )
    parser.add_argument("--summary-only", action="store_true", help="only rebuild summary.md from results.jsonl")
    return parser.parse_args()


def legit_pool(args):
    if args.candidates:
        pool = common.manifest_entries(args.candidates, args.tasks_dir, backends=("cuda",))
    else:
        pool = common.corpus_entries(backends=("cuda",))
    if not pool:
        raise SystemExit("no legitimate cuda candidates")
    return pool


def record(out, phase, repeat, index, entry, fields):
    line = {
        "phase": phase,
        "repeat": repeat,
        "index": index,
        "key": entry["key"],
        "task": entry["task_id"],
        "unix": time.time(),
    }
    line.update(fields)
    common.append_jsonl(out / "results.jsonl", line)


def run(args, out):
    pool = legit_pool(args)
    legit = [pool[i % len(pool)] for i in range(args.n)]
    distinct = list({e["key"]: e for e in legit}.values())
    hang = common.corpus_entry(HANG)
    kforge = common.find_kforge(args.kforge)
    common.record_machine(out, args.python, kforge, note="hang")
    settings = {}
    if args.gpu_slots:
        settings["gpu_slots"] = args.gpu_slots
    if args.no_compile_baseline:
        settings["baseline_torch_compile"] = False
    env = {RUN_TIMEOUT_ENV: args.run_timeout} if args.run_timeout > 0 else {}
    began = time.monotonic()
    nonce = time.strftime("%Y%m%d%H%M%S")
    with common.Evaluator(
        kforge, out, "evaluator-hang", python=args.python, work_dir=out / "work", settings=settings, env=env
    ) as evaluator:

        def settle(what, timeout_s):
            waited = evaluator.wait_idle(timeout_s=timeout_s)
            if waited is None:
                common.log(f"{what}: the evaluator still had child processes after {timeout_s} s; going on")
            elif waited > 2:
                common.log(f"{what}: waited {waited:.1f} s for the evaluator's children to end")

        settle("start", 300)
        # warm
        warm = distinct + ([] if args.no_hang_warm else [hang])
        requests = [common.request_for(e, f"warm-{i}-{e['key']}-{nonce}") for i, e in enumerate(warm)]

        def warm_done(index, rec):
            fields = common.outcome(rec)
            record(out, "warm", 0, index, warm[index], fields)
            common.log(f"warm {warm[index]['key']}: {fields['verdict']} in {fields['wall_s']:.1f} s")

        records = common.evaluate_many(kforge, evaluator.addr, requests, on_done=warm_done)
        for i, (entry, rec) in enumerate(zip(warm, records)):
            if entry is not hang and common.outcome(rec)["verdict"] != "VERDICT_CORRECT":
                fields = common.outcome(
                    common.evaluate(kforge, evaluator.addr, common.request_for(entry, f"warm-again-{i}-{nonce}"))
                )
                record(out, "warm", 1, i, entry, fields)
                common.log(f"warm again {entry['key']}: {fields['verdict']}")
        settle("warm", 300)

        for r in range(args.repeat_offset, args.repeat_offset + args.repeats):
            if args.deadline_s > 0 and time.monotonic() - began > args.deadline_s:
                common.log(f"repeat {r}: past the deadline, not started")
                break
            # alone
            requests = [common.request_for(e, f"alone-r{r}-{i}-{nonce}") for i, e in enumerate(legit)]

            def alone_done(index, rec, r=r):
                fields = common.outcome(rec)
                record(out, "alone", r, index, legit[index], fields)
                common.log(
                    f"alone r{r} #{index} {legit[index]['key']}: {fields['verdict']} in {fields['wall_s']:.1f} s"
                )

            t0 = time.monotonic()
            common.evaluate_many(kforge, evaluator.addr, requests, on_done=alone_done)
            common.log(f"alone r{r}: {time.monotonic() - t0:.1f} s")
            settle("alone", 120)
            # beside the hang
            entries = [*legit, hang]
            requests = [common.request_for(e, f"beside-r{r}-{i}-{nonce}") for i, e in enumerate(legit)]
            requests.append(common.request_for(hang, f"hang-r{r}-{nonce}"))

            def beside_done(index, rec, r=r, entries=entries):
                fields = common.outcome(rec)
                phase = "hang" if index == len(legit) else "beside"
                record(out, phase, r, index, entries[index], fields)
                common.log(
                    f"{phase} r{r} #{index} {entries[index]['key']}: {fields['verdict']} in "
                    f"{fields['wall_s']:.1f} s" + (f": {fields.get('error', '')[:200]}" if phase == "hang" else "")
                )

            t0 = time.monotonic()
            common.evaluate_many(kforge, evaluator.addr, requests, on_done=beside_done)
            common.log(f"beside r{r}: {time.monotonic() - t0:.1f} s")
            settle("beside", 300)


def fmt(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


def summary(out):
    records = common.read_jsonl(out / "results.jsonl")
    table = {}
    for rec in records:
        table[(rec.get("phase"), rec.get("repeat"), rec.get("index"))] = rec
    repeats = sorted({rep for (phase, rep, _) in table if phase in ("alone", "beside", "hang")})
    lines = [
        f"# liveness beside a hanging candidate ({time.strftime('%Y-%m-%d %H:%M:%S')})",
        "",
        f"From `{out / 'results.jsonl'}` ({len(records)} lines); machine: `machine.txt`. Wall times are client "
        "side, from submit to response, in seconds. Target per legitimate evaluation: beside <= 1.2 x alone + 5 s "
        "(alone: the same repeat and index).",
        "",
        "| repeat | # | candidate | alone s | alone verdict | beside s | beside verdict | limit s | ratio | "
        "gate wait alone/beside s | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    passed = failed = 0
    ratios = []

    def gate(rec):
        stage = (rec or {}).get("stage_ms") or {}
        value = stage.get("device.gate_wait")
        return None if value is None else value / 1000.0

    for r in repeats:
        indices = sorted({i for (phase, rep, i) in table if rep == r and phase in ("alone", "beside")})
        for i in indices:
            alone, beside = table.get(("alone", r, i)), table.get(("beside", r, i))
            a = alone.get("wall_s") if alone else None
            b = beside.get("wall_s") if beside else None
            limit = None if a is None else 1.2 * a + 5.0
            # a and b are set only where alone and beside are.
            ok = (
                a is not None
                and b is not None
                and b <= limit
                and beside.get("verdict") == "VERDICT_CORRECT"  # pyright: ignore[reportOptionalMemberAccess]
                and alone.get("verdict") == "VERDICT_CORRECT"  # pyright: ignore[reportOptionalMemberAccess]
            )
            if a is not None and b is not None:
                ratios.append(b / a)
                passed += ok
                failed += not ok
            key = (alone or beside or {}).get("key", "")
            lines.append(
                f"| {r} | {i} | {key} | {fmt(a)} | {(alone or {}).get('verdict', '-')} | {fmt(b)} | "
                f"{(beside or {}).get('verdict', '-')} | {fmt(limit)} | "
                f"{fmt(b / a if a and b else None, 2)} | {fmt(gate(alone))}/{fmt(gate(beside))} | "
                f"{'PASS' if ok else ('FAIL' if a is not None and b is not None else '-')} |"
            )
    lines += [
        "",
        "## the hanging candidate (expected VERDICT_TIMEOUT)",
        "",
        "| repeat | verdict | wall s | compile cache hit | as expected | error |",
        "|---|---|---|---|---|---|",
    ]
    hang_ok = hang_bad = 0
    for r in repeats:
        rec = next((v for (phase, rep, _), v in table.items() if phase == "hang" and rep == r), None)
        if rec is None:
            continue
        expected = rec.get("verdict") == "VERDICT_TIMEOUT"
        hang_ok += expected
        hang_bad += not expected
        error = (rec.get("error") or "").replace("|", "/").replace("\n", " ")[:300]
        lines.append(
            f"| {r} | {rec.get('verdict')} | {fmt(rec.get('wall_s'))} | {rec.get('compile_cache_hit')} | "
            f"{'yes' if expected else 'NO'} | {error} |"
        )
    lines += [
        "",
        "## result",
        "",
        f"- legitimate evaluations within 1.2 x alone + 5 s: {passed} of {passed + failed}"
        + (f" (beside/alone ratio max {max(ratios):.2f}, mean {sum(ratios) / len(ratios):.2f})" if ratios else ""),
        f"- the hang got VERDICT_TIMEOUT: {hang_ok} of {hang_ok + hang_bad}",
        f"- target {'met' if failed == 0 and hang_bad == 0 and passed > 0 else 'NOT met'}",
        "",
    ]
    warm_bad = [
        v
        for (phase, _, _), v in table.items()
        if phase == "warm" and v.get("verdict") != "VERDICT_CORRECT" and not v.get("key", "").endswith(HANG.name)
    ]
    if warm_bad:
        lines += [
            "Warm-up evaluations that were not VERDICT_CORRECT: "
            + ", ".join(f"{v.get('key')} {v.get('verdict')}" for v in warm_bad),
            "",
        ]
    (out / "summary.md").write_text("\n".join(lines))
    common.log(f"wrote {out / 'summary.md'}")


def main():
    args = parse()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        try:
            run(args, out)
        except Exception as error:  # the summary of what was recorded still gets written
            common.log(f"failed: {type(error).__name__}: {error}")
            common.append_jsonl(
                out / "results.jsonl",
                {"phase": "error", "repeat": -1, "index": -1, "error": f"{type(error).__name__}: {error}"[:4000]},
            )
        finally:
            common._stop_all()
    summary(out)


if __name__ == "__main__":
    main()
