"""The Profiler live on a GPU machine: `kforge up` (evaluator and profiler on one engine), then through
`kforge call`: GetCapabilities, GetDeviceSpec, Profile of each candidate in candidates/ (cold, then with its
compile cached: --warm times for diag_scale and matmul_tiled, once for the others), Evaluate of the same candidates
(their census and profiling ratio against the profile's), StreamReport read back with `ncu --import`, the bad
requests, a timed evaluation beside a profile, and each correct candidate measured again by Nsight Compute
directly (run_direct.py), outside kforge.

From the repository root, with target/release/kforge built and the KernelBench tasks under --tasks-dir:

    python3 bench/profiler/profile_live.py --out "$OUT" --tasks-dir .kb/kernelbench

Writes OUT/results.jsonl (one record per call, as it goes), OUT/machine.txt, OUT/kforge.log, the first profile of
each candidate (OUT/profile-NAME.json) and the direct runs' CSV; caches and reports go under --scratch.
Stdlib only.
"""

import argparse
import base64
import csv
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROFILER = "http://127.0.0.1:50052"
EVALUATOR = "http://127.0.0.1:50051"


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def header(path):
    """The candidate's `# task:` and `# backend:` lines."""
    fields = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#\s*(task|backend):\s*(\S+)", line)
        if m:
            fields[m.group(1)] = m.group(2)
    return fields


class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results = open(self.out / "results.jsonl", "a")  # noqa: SIM115 (open for the run, written by record())
        self.kforge = str(Path(args.kforge).resolve())

    def record(self, **fields):
        self.results.write(json.dumps(fields) + "\n")
        self.results.flush()

    def call(self, method, request, addr=PROFILER, timeout=600, deadline=None) -> tuple[bool, Any, float]:
        """(ok, response or error text, seconds) of `kforge call method`, with the call's deadline if given."""
        started = time.monotonic()
        limit = ["--deadline", str(deadline)] if deadline else []
        proc = subprocess.run(
            [self.kforge, "call", method, "--addr", addr, *limit],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            return False, proc.stderr.strip(), seconds
        decoder, text, objects = json.JSONDecoder(), proc.stdout.strip(), []
        while text:
            obj, end = decoder.raw_decode(text)
            objects.append(obj)
            text = text[end:].lstrip()
        return True, objects[0] if len(objects) == 1 else objects, seconds

    def task(self, name):
        path = Path(self.args.tasks_dir) / f"{name}.py"
        return {"taskId": name, "source": path.read_text()}


def machine(out, python):
    lines = []
    for cmd in (
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        ["ncu", "--version"],
        [
            python,
            "-c",
            "import torch, triton; print('torch', torch.__version__, "
            "'cuda', torch.version.cuda, 'triton', triton.__version__)",
        ],
        ["nproc"],
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
    ):
        try:
            lines.append(subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip())
        except OSError as error:
            lines.append(f"{cmd[0]}: {error}")
    (out / "machine.txt").write_text("\n".join(lines) + "\n")
    return lines


def parse_ncu_csv(text):
    """Rows of a raw-page CSV (after any ==PROF== lines; the units row dropped) as dicts."""
    start = text.find('"ID"')
    if start < 0:
        return []
    rows = list(csv.reader(io.StringIO(text[start:])))
    names = rows[0]
    # `ncu --import` prints numbers with thousands separators ("41,952").
    return [{k: v.replace(",", "") for k, v in zip(names, row)} for row in rows[2:] if len(row) == len(names)]


def summarize_profile(response):
    kernels = response.get("kernels", [])
    diagnosis = response.get("diagnosis", {})
    return {
        "verdict": response.get("verdict"),
        "kernels_profiled": len(kernels),
        "kernel": kernels[0]["name"] if kernels else None,
        "median_duration_ms": statistics.median([k.get("durationMs", 0) for k in kernels]) if kernels else None,
        "metrics_per_launch": len(kernels[0].get("metrics", [])) if kernels else 0,
        "bottleneck": diagnosis.get("bottleneck"),
        "diagnosis": diagnosis.get("summary"),
        "evidence": diagnosis.get("evidence"),
        "census": [
            (k["name"][:80], k.get("own", False), k.get("launches"), round(k.get("totalMs", 0), 4))
            for k in response.get("census", [])
        ],
        "profiling_ratio": response.get("profilingRatio"),
        "missing_metrics": response.get("missingMetrics", []),
        "report_id": response.get("reportId"),
        "stage_ms": response.get("stageMs"),
        "error": (response.get("error") or "")[-600:],
        "compile_log_tail": (response.get("compileLog") or "")[-400:],
        "findings": [f.get("code") for f in response.get("findings", [])],
    }


def kforge_arguments(scratch, tasks_required=True):
    """The arguments every script that starts `kforge up` takes (`start_kforge` reads them); add the script's own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--tasks-dir", required=tasks_required, default="", help="KernelBench's task directory (holding level1/)"
    )
    parser.add_argument("--kforge", default=str(REPO / "target" / "release" / "kforge"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--scratch", default=scratch)
    parser.add_argument("--profile-timeout", type=int, default=300, help="the profiler's timeout_secs")
    return parser


def start_kforge(run, args, scratch):
    """`kforge up` with the evaluator and profiler on one engine, once the profiler answers; GetCapabilities
    recorded."""
    config = run.out / "kforge.toml"
    config.write_text(
        f"[evaluator]\npython = {json.dumps(args.python)}\nwork_dir = {json.dumps(str(scratch / 'work'))}\n"
        "bindings_pch = false\nbaseline_torch_compile = false\n\n"
        f"[profiler]\ntimeout_secs = {args.profile_timeout}\n\n"
        f"[orchestrator]\nstore = {json.dumps(str(scratch / 'orchestrator.db'))}\n"
    )
    up = subprocess.Popen(
        [run.kforge, "up", "--config", str(config)],
        stdout=open(run.out / "kforge.log", "w"),  # noqa: SIM115 (kforge up's log, open while it runs)
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while True:
        ok, caps, _ = run.call("Profiler/GetCapabilities", {})
        if ok or time.monotonic() > deadline or up.poll() is not None:
            break
        time.sleep(0.5)  # a readiness poll of a separate process, bounded above
    run.record(call="GetCapabilities", ok=ok, response=caps)
    log(f"capabilities: {json.dumps(caps)[:400]}")
    if not ok:
        stop_kforge(up)
        raise SystemExit("profiler not ready")
    return up


def stop_kforge(up):
    os.killpg(up.pid, signal.SIGTERM)
    try:
        up.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(up.pid, signal.SIGKILL)


def main():
    parser = kforge_arguments("/tmp/kforge-profile-live")
    parser.add_argument("--warm", type=int, default=5)
    parser.add_argument("--hang-deadline", type=float, default=3.0, help="the hanging profile's call deadline")
    parser.add_argument(
        "--profiled-hang-deadline",
        type=float,
        default=45.0,
        help="the call deadline of the profile that hangs in its profiled stage only",
    )
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    args = parser.parse_args()
    run = Run(args)
    out = run.out
    log(" | ".join(machine(out, args.python)))

    candidates = sorted((HERE / "candidates").glob("*.py"))
    if args.only:
        candidates = [c for c in candidates if c.stem in args.only.split(",")]
    direct = [
        c for c in candidates if c.stem in ("diag_scale", "matmul_tiled", "diag_scale_occupancy", "diag_scale_triton")
    ]
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(scratch / "direct-ext"))
    builds = [
        subprocess.Popen(
            [
                args.python,
                str(HERE / "run_direct.py"),
                str(Path(args.tasks_dir) / f"{header(c)['task']}.py"),
                str(c),
                "--build-only",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(out / f"direct-build-{c.stem}.log", "w"),  # noqa: SIM115 (the build's log, open while it runs)
        )
        for c in direct
    ]

    up = start_kforge(run, args, scratch)
    try:
        ok, spec, seconds = run.call("Profiler/GetDeviceSpec", {})
        run.record(call="GetDeviceSpec", ok=ok, response=spec, seconds=seconds)
        log(f"device spec: {json.dumps(spec)[:600]}")

        profiles = {}
        for candidate in candidates:
            fields = header(candidate)
            request = {
                "task": run.task(fields["task"]),
                "candidateSource": candidate.read_text(),
                "backend": "BACKEND_" + fields.get("backend", "cuda").upper(),
                "requestId": candidate.stem,
            }
            warm = args.warm if candidate.stem in ("diag_scale", "matmul_tiled") else 1
            for attempt in range(1 + warm):
                ok, response, seconds = run.call("Profiler/Profile", request)
                summary = summarize_profile(response) if ok else {"error": response}
                run.record(call="Profile", candidate=candidate.stem, attempt=attempt, ok=ok, seconds=seconds, **summary)
                log(
                    f"Profile {candidate.stem} #{attempt}: {seconds:.2f} s, {summary.get('verdict')}, "
                    f"{summary.get('bottleneck')}, kernels {summary.get('kernels_profiled')}, "
                    f"ratio {summary.get('profiling_ratio')}, stages {summary.get('stage_ms')}, "
                    f"error {str(summary.get('error'))[:300]}"
                )
                if attempt == 0:
                    profiles[candidate.stem] = (request, response if ok else None)
                    if ok and attempt == 0 and response.get("kernels"):
                        (out / f"profile-{candidate.stem}.json").write_text(json.dumps(response, indent=1))
                if not ok or summary.get("verdict") != "VERDICT_CORRECT":
                    break  # failures are not timed again

            # The same candidate evaluated: census and profiling ratio beside the profile's.
            # (The loop above runs at least once: 1 + warm attempts.)
            if ok and summary.get("verdict") == "VERDICT_CORRECT":  # pyright: ignore[reportPossiblyUnboundVariable]
                evaluate = {
                    "requestId": candidate.stem,
                    "task": request["task"],
                    "candidateSource": request["candidateSource"],
                    "backend": request["backend"],
                    "census": True,
                    "measurePerformance": True,
                }
                eok, evaluation, eseconds = run.call("Evaluator/Evaluate", evaluate, addr=EVALUATOR)
                fields = (
                    {
                        "verdict": evaluation.get("verdict"),
                        "profiling_ratio": evaluation.get("profilingRatio"),
                        "census": [
                            (k["name"][:80], k.get("own", False), k.get("launches"), round(k.get("totalMs", 0), 4))
                            for k in evaluation.get("kernels", [])
                        ],
                        "candidate_median_ms": evaluation.get("candidateTiming", {}).get("medianMs"),
                        "eager_median_ms": evaluation.get("eagerTiming", {}).get("medianMs"),
                        "speedup": evaluation.get("speedupEager"),
                    }
                    if eok
                    else {"error": evaluation}
                )
                run.record(call="Evaluate", candidate=candidate.stem, ok=eok, seconds=eseconds, **fields)
                log(f"Evaluate {candidate.stem}: {eseconds:.1f} s {json.dumps(fields)[:500]}")

        # Bad requests.
        good = profiles.get("diag_scale", (None, None))[0]
        if good:
            for name, change in [
                ("unknown metric", {"metricSet": "METRIC_SET_LIST", "metrics": ["not a metric"]}),
                ("launch limit", {"launchLimit": 1000}),
                ("no candidate", {"candidateSource": ""}),
                ("cpu backend", {"backend": "BACKEND_CPU"}),
                ("strict policy", {"policy": "kevin-strict"}),
            ]:
                ok, response, seconds = run.call("Profiler/Profile", {**good, **change})
                verdict = response if not ok else summarize_profile(response)
                run.record(call="Profile", case=name, ok=ok, seconds=seconds, response=verdict)
                log(f"bad request `{name}`: {str(verdict)[:300]}")
            # A kernel that never returns (a loop of sleeps: an asm volatile the compiler keeps, where a loop on a
            # volatile local was optimised away).
            # Everywhere, first without a deadline: it compiles, and its census call runs past the call limit (from
            # the reference's measured time), which stops the stage: VERDICT_TIMEOUT. Then, its build cached, with a
            # call deadline shorter than that limit: the deadline stops the profile and kills its processes. Then
            # only in the profiled stage (by the HOME the profiler's launcher gives it), so the census passes and
            # Nsight Compute replays a kernel that never ends: the deadline again. After each, the GPU profiles the
            # next candidate.
            spin = "for (;;) { __nanosleep(1000); }\n    if (i >= rows * cols4) return;"
            everywhere = (
                good["candidateSource"]
                .replace("if (i >= rows * cols4) return;", spin)
                .replace("kforge_bench_diag_scale", "kforge_bench_hang")
            )
            profiled_only = (
                (
                    "import os\nSPIN = int(os.path.basename(os.environ.get('HOME', '')) == 'home' or "
                    "os.path.basename(os.getcwd()).startswith('profiled'))\n" + good["candidateSource"]
                )
                .replace("if (i >= rows * cols4) return;", "if (spin) " + spin)
                .replace("int64_t rows, int64_t cols4) {", "int64_t rows, int64_t cols4, int spin) {")
                .replace("rows, cols4);", "rows, cols4, (int)spin);")
                .replace(
                    "scale_rows(torch::Tensor d, torch::Tensor b)",
                    "scale_rows(torch::Tensor d, torch::Tensor b, int64_t spin)",
                )
                .replace("ext.scale_rows(A, B)", "ext.scale_rows(A, B, SPIN)")
                .replace("kforge_bench_diag_scale", "kforge_bench_hang_profiled")
            )

            def harnesses():
                return len(
                    subprocess.run(
                        ["pgrep", "-f", "harness/kforge_harness"], capture_output=True, text=True
                    ).stdout.split()
                )

            before = harnesses()
            for case, source, deadline in [
                ("everywhere", everywhere, None),
                ("everywhere", everywhere, args.hang_deadline),
                ("in the profiled stage", profiled_only, args.profiled_hang_deadline),
            ]:
                hang = {**good, "candidateSource": source, "requestId": "hang"}
                ok, response, seconds = run.call("Profiler/Profile", hang, deadline=deadline)
                gone_after = None
                waited = time.monotonic()
                while time.monotonic() - waited < 30:
                    if harnesses() <= before:
                        gone_after = time.monotonic() - waited
                        break
                    time.sleep(0.1)
                ok2, after, seconds2 = run.call("Profiler/Profile", good)
                after = summarize_profile(after) if ok2 else {"error": after}
                shown = response if not ok else {k: response.get(k) for k in ("verdict", "error", "stageMs")}
                run.record(
                    call="Profile",
                    case=f"a kernel that never returns, {case}",
                    deadline_s=deadline,
                    ok=ok,
                    seconds=seconds,
                    response=shown,
                    harnesses_before=before,
                    processes_gone_after_s=gone_after,
                    next_profile_s=seconds2,
                    next_profile_verdict=after.get("verdict"),
                )
                log(
                    f"hang {case}, deadline {deadline}: {seconds:.1f} s, {str(shown)[:300]}; "
                    f"processes gone {gone_after} s after; next profile {after.get('verdict')} in {seconds2:.1f} s"
                )

            # Two metrics by name, and the full set.
            for name, change in [
                (
                    "list of two",
                    {
                        "metricSet": "METRIC_SET_LIST",
                        "launchLimit": 2,
                        "metrics": ["gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed"],
                    },
                ),
                ("full set", {"metricSet": "METRIC_SET_FULL", "launchLimit": 2}),
            ]:
                ok, response, seconds = run.call("Profiler/Profile", {**good, **change})
                summary = summarize_profile(response) if ok else {"error": response}
                run.record(call="Profile", case=name, ok=ok, seconds=seconds, **summary)
                log(
                    f"`{name}`: {seconds:.1f} s, metrics per launch {summary.get('metrics_per_launch')}, "
                    f"missing {summary.get('missing_metrics')}, {summary.get('bottleneck')}"
                )

        # The kept report, streamed and read back by ncu.
        first = next((r for _, r in profiles.values() if r and r.get("reportId")), None)
        if first:
            ok, chunks, seconds = run.call("Profiler/StreamReport", {"reportId": first["reportId"]})
            chunks = chunks if isinstance(chunks, list) else [chunks]
            data = b"".join(base64.b64decode(c.get("data", "")) for c in chunks) if ok else b""
            (scratch / "streamed.ncu-rep").write_bytes(data)
            imported = subprocess.run(
                [
                    "ncu",
                    "--import",
                    str(scratch / "streamed.ncu-rep"),
                    "--csv",
                    "--page",
                    "raw",
                    "--print-units",
                    "base",
                ],
                capture_output=True,
                text=True,
            )
            rows = parse_ncu_csv(imported.stdout)
            mine = [k["durationMs"] for k in first["kernels"]]
            theirs = [float(r["gpu__time_duration.sum"]) / 1e6 for r in rows if r.get("gpu__time_duration.sum")]
            run.record(
                call="StreamReport",
                ok=ok,
                seconds=seconds,
                bytes=len(data),
                chunks=len(chunks),
                imported_rows=len(rows),
                response_durations_ms=mine,
                imported_durations_ms=theirs,
            )
            log(
                f"StreamReport: {len(data)} bytes in {len(chunks)} chunks, {seconds:.2f} s; ncu --import: "
                f"{len(rows)} launches, durations equal: {[round(x, 6) for x in mine] == [round(x, 6) for x in theirs]}"
            )

        # A timed evaluation alone, then beside a profile of another candidate: the same device lease.
        diag, matmul = profiles.get("diag_scale", (None,))[0], profiles.get("matmul_tiled", (None,))[0]
        if diag and matmul:
            evaluate = {
                "task": diag["task"],
                "candidateSource": diag["candidateSource"],
                "backend": "BACKEND_CUDA",
                "measurePerformance": True,
            }
            ok, alone, seconds = run.call("Evaluator/Evaluate", evaluate, addr=EVALUATOR)
            beside = {}

            def profile_beside():
                beside["profile"] = run.call("Profiler/Profile", matmul)

            thread = threading.Thread(target=profile_beside)
            thread.start()
            ok2, during, seconds2 = run.call("Evaluator/Evaluate", evaluate, addr=EVALUATOR)
            thread.join()

            def med(r):
                return r.get("candidateTiming", {}).get("medianMs") if isinstance(r, dict) else None

            run.record(
                call="TimedBesideProfile",
                alone_median_ms=med(alone),
                beside_median_ms=med(during),
                alone_s=seconds,
                beside_s=seconds2,
                profile_s=beside["profile"][2],
                profile_ok=beside["profile"][0],
            )
            log(
                f"timed evaluation alone: median {med(alone)} ms ({seconds:.1f} s); beside a profile: "
                f"{med(during)} ms ({seconds2:.1f} s), the profile took {beside['profile'][2]:.1f} s"
            )
    finally:
        stop_kforge(up)

    # Nsight Compute directly, outside kforge: the same metrics on the same kernels.
    for build in builds:
        build.wait()
    for candidate in direct:
        request, response = profiles.get(candidate.stem, (None, None))
        if not response or not response.get("kernels"):
            continue
        names = sorted({m["name"] for m in response["kernels"][0]["metrics"]})
        kernels = sorted({k["name"].split("(")[0].split("<")[0].split()[-1] for k in response["kernels"]})
        log_file = out / f"direct-{candidate.stem}.csv"
        cmd = [
            "ncu",
            "--profile-from-start",
            "off",
            "--replay-mode",
            "kernel",
            "--clock-control",
            "none",
            "--launch-count",
            str(len(response["kernels"])),
            "--kernel-name-base",
            "function",
            "--kernel-name",
            f"regex:^({'|'.join(kernels)})$",
            "--metrics",
            ",".join(names),
            "--csv",
            "--page",
            "raw",
            "--print-units",
            "base",
            "--log-file",
            str(log_file),
            args.python,
            str(HERE / "run_direct.py"),
            str(Path(args.tasks_dir) / f"{header(candidate)['task']}.py"),
            str(candidate),
            "--calls",
            str(len(response["kernels"])),
        ]
        started = time.monotonic()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        seconds = time.monotonic() - started
        rows = parse_ncu_csv(log_file.read_text() if log_file.exists() else "")
        compare = {}
        for metric in (
            "gpu__time_duration.sum",
            "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "sm__warps_active.avg.pct_of_peak_sustained_active",
        ):
            theirs = [float(r[metric]) for r in rows if r.get(metric)]
            mine = [m["value"] for k in response["kernels"] for m in k["metrics"] if m["name"] == metric]
            if theirs and mine:
                compare[metric] = {
                    "kforge_median": statistics.median(mine),
                    "direct_median": statistics.median(theirs),
                    "ratio": statistics.median(mine) / statistics.median(theirs) if statistics.median(theirs) else None,
                }
        run.record(
            call="DirectNcu",
            candidate=candidate.stem,
            rc=proc.returncode,
            seconds=seconds,
            launches=len(rows),
            compare=compare,
            stderr=proc.stderr[-500:],
        )
        log(
            f"direct ncu {candidate.stem}: rc {proc.returncode}, {seconds:.1f} s, {len(rows)} launches, "
            f"{json.dumps(compare)}"
        )


if __name__ == "__main__":
    main()
