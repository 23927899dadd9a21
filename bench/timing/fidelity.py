"""timing-fidelity: kforge's candidate and eager medians and speedups against triton.testing.do_bench in a clean
process, for a fixed set of candidates: idle (one evaluation at a time), under load (the pipeline full), and
run to run.

On the GPU machine, from the repository root (binaries built: target/release/kforge), with the candidates written
by `python3 bench/kernelbench/make_candidates.py CAND_DIR` (or `--mixed CAND_DIR`) and a KernelBench checkout; each
command fits in 10 minutes and they share OUT (run them in this order, on one machine, with OUT kept between them):

    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases dobench-build
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases dobench
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases warm
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases idle --only-repeat 0
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases idle --only-repeat 1
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases full
    python3 bench/timing/fidelity.py --out OUT --summary-only

(`--phases warm,idle,full,dobench` runs them all in one command where time allows.) A command stopped by its time
limit loses nothing already recorded: running it again goes on with what is missing (`--no-resume` measures
everything again). `--deadline-s` (default 480) stops starting evaluations that late into the command.

Candidates: make_candidates.py's manifest entries expected VERDICT_CORRECT (entries without `expect` count as
correct) on KernelBench level 1 and 2 tasks (`--limit N` keeps the first N of them), plus with `--corpus` the
corpus's cuda/ entries expected VERDICT_CORRECT (legit_relu.py, triton_legit_relu.py on examples/tasks/relu).

Phases (each appends to OUT/results.jsonl, one line per task/candidate/phase/repeat; OUT/summary.md is rebuilt from
every line present at the end of each command, or alone with `--summary-only`):

- dobench-build: builds the CUDA candidates' extensions for dobench (load_inline as written, TORCH_EXTENSIONS_DIR
  = OUT/torch_extensions), several at once; compiles only, nothing measured. `dobench` builds what is missing itself.
- dobench: for each candidate, a fresh process (`fidelity.py --dobench-one TASK CAND OUTJSON`) imports the task and
  the candidate from their files, seeds torch (0) before get_init_inputs()/Model(...) and again before ModelNew(...)
  (so the parameters match), seeds 1 before get_inputs(), moves everything to cuda, and under torch.no_grad()
  measures `triton.testing.do_bench(lambda: model(*inputs), warmup=25, rep=200, return_mode="median")` for Model
  (eager) and ModelNew, and return_mode="all" for the spread (p20/p80, IQR). No evaluator runs meanwhile (each
  phase stops its evaluator before the next starts; processes found on the GPU are recorded in the line).
- warm: one evaluator, every candidate submitted at once, so compiles (and the bindings' precompiled header) are
  cached in OUT/work; not measured. It waits for the evaluator's children to end, so no later phase pays for them.
- idle: R repeats (`--repeats`, default 2; `--only-repeat K` runs one), each in a fresh evaluator, evaluations
  one at a time with nothing else running. Recorded per evaluation: the candidate's and eager medians and 10th
  percentiles (from the samples), speedup_eager, the samples (and their count), the verdict, and stage_ms
  (summary.md shows the entries whose key contains `timing` or `cpu_wait` or starts with `run.`).
- full: the pipeline full, one evaluator with its default gpu slots (`--gpu-slots` to change): every candidate
  submitted at once together with a cold-compile copy of each (its source plus a line `# load copy <i>`, <i>
  unique to the run, so the compile cache misses); the same fields are recorded for the measured (non-copy) ones.

Fresh eager measurements: the evaluator caches baselines per task and timing budget, so each evaluator gets its own
value of `[evaluator.timing] max_runs` through KFORGE__EVALUATOR__TIMING__MAX_RUNS: warm 999, idle repeat r
1000 + r, full repeat r 1100 + r. max_runs is part of the timing budget that keys the baseline cache (services/
evaluator/src/pipeline.rs, `baseline_key`), and it only caps the adaptive loop (default 1000; the loop stops past
50 samples and 0.2 s at a relative standard error of 0.5%, or after 5 s), so moving it by a few changes nothing
measured (the candidate's loop uses the same budget). The torch.compile baseline
is off (`baseline_torch_compile = false`, `--compile-baseline` turns it on): it is not compared, the evaluator
measures eager before it, and with a fresh baseline per evaluator it would compile every task again.

summary.md: a table per phase (kforge against do_bench: candidate and eager medians and 10th percentiles, speedup,
% errors; idle run-to-run % differences), the candidate's launch against its cover per evaluation, the stage_ms
entries, and the aggregate: for ops whose do_bench eager median is at least 0.1 ms, the largest |error| of kforge's
candidate and eager medians and of the speedups, idle and full, and the largest run-to-run difference (kforge's
10th percentiles beside them, against do_bench's median, not judged), against the targets (`--target-median 3`,
`--target-speedup 3`, `--target-r2r 2`, in %); smaller ops, and calls that make the host wait mid-call (the
evaluator's notice `timing.host_synchronized`), reported apart, the latter's candidate median and speedup held to
the targets against the range of do_bench's medians across its clean processes (`--dobench-repeats 2` or more).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MAX_RUNS_ENV = "KFORGE__EVALUATOR__TIMING__MAX_RUNS"
WARM_MAX_RUNS = 999
IDLE_MAX_RUNS = 1000
FULL_MAX_RUNS = 1100
PHASES = ("dobench-build", "dobench", "dobench-spin", "warm", "idle", "full")
SMALL_MS = 0.1
HOST_WAITS = "timing.host_synchronized"  # the evaluator's notice for a call that makes the host wait mid-call
DEVICE = "cuda"  # where --dobench-one measures (a test may point it elsewhere)


# ------------------------------------------------------------------------------------------------- do_bench child


def _load_module(path, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _to_device(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _flatten(output):
    return list(output) if isinstance(output, (list, tuple)) else [output]


def _spread(times):
    return {
        "n": len(times),
        "p20": common.percentile(times, 20),
        "p25": common.percentile(times, 25),
        "p50": common.percentile(times, 50),
        "p75": common.percentile(times, 75),
        "p80": common.percentile(times, 80),
        "min": min(times) if times else None,
        "max": max(times) if times else None,
    }


def dobench_one(task_path, candidate_path, out_json, build_only):
    """The child: measures Model and ModelNew with do_bench in this clean process; writes OUT_JSON."""
    result = {"task_path": task_path, "candidate_path": candidate_path, "ok": False}
    began = time.monotonic()
    try:
        import torch
        import triton
        import triton.testing

        result["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
        task = _load_module(task_path, "kforge_timing_task")
        candidate = _load_module(candidate_path, "kforge_timing_candidate")  # builds its load_inline extensions
        result["import_s"] = time.monotonic() - began
        if build_only:
            result["ok"] = True
            return
        device = torch.device(DEVICE)
        result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        if os.environ.get("KFORGE_DOBENCH_SPIN") == "1" and device.type == "cuda":
            # The dobench-spin phase: this process waits for its GPU spinning, as kforge's timed loop does
            # (CU_CTX_SCHED_SPIN on the primary context, which torch has made current).
            import ctypes

            torch.zeros(1, device=device)
            status = ctypes.CDLL("libcuda.so.1").cuCtxSetFlags(ctypes.c_uint(1))
            result["sched"] = "spin" if status == 0 else f"spin refused ({status})"
        torch.manual_seed(0)
        reference = task.Model(*_to_device(list(task.get_init_inputs()), device)).to(device)
        torch.manual_seed(0)
        new = candidate.ModelNew(*_to_device(list(task.get_init_inputs()), device)).to(device)
        torch.manual_seed(1)
        inputs = _to_device(list(task.get_inputs()), device)
        with torch.no_grad():
            expected = _flatten(reference(*inputs))
            got = _flatten(new(*inputs))
            if device.type == "cuda":
                torch.cuda.synchronize()
            diffs = [(g.float() - e.float()).abs().max().item()
                     for g, e in zip(got, expected) if isinstance(g, torch.Tensor) and g.shape == e.shape]
            result["max_abs_diff"] = max(diffs) if diffs else None
            result["allclose"] = len(diffs) == len(expected) and all(
                torch.allclose(g.float(), e.float(), atol=1e-3, rtol=1e-3) for g, e in zip(got, expected))
            del expected, got
            models = {"eager": reference, "candidate": new}
            for name, model in models.items():
                result[f"{name}_median_ms"] = triton.testing.do_bench(
                    lambda: model(*inputs), warmup=25, rep=200, return_mode="median")
            for name, model in models.items():
                times = triton.testing.do_bench(lambda: model(*inputs), warmup=25, rep=200, return_mode="all")
                result[f"{name}_all"] = _spread([float(t) for t in times])
        result["speedup_eager"] = result["eager_median_ms"] / result["candidate_median_ms"]
        result["ok"] = True
    except BaseException as error:  # noqa: BLE001 (reported in the JSON)
        result["error"] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-4000:]}"
    finally:
        result["wall_s"] = time.monotonic() - began
        Path(out_json).write_text(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------------------- phases


def safe_name(key):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.results = self.out / "results.jsonl"
        self.work = self.out / "work"
        self.began = time.monotonic()
        self.kforge = None

    def late(self):
        return self.args.deadline_s > 0 and time.monotonic() - self.began > self.args.deadline_s

    def record(self, phase, repeat, entry, fields):
        line = {"phase": phase, "repeat": repeat, "key": entry["key"], "task": entry["task_id"],
                "backend": entry["backend"], "kind": entry.get("kind", ""), "unix": time.time()}
        line.update(fields)
        common.append_jsonl(self.results, line)

    def done_keys(self, phase, repeat):
        if self.args.no_resume:
            return set()
        # A call that failed, or an infrastructure error, is measured again; any verdict of the candidate's own is kept.
        return {r["key"] for r in common.read_jsonl(self.results)
                if r.get("phase") == phase and r.get("repeat") == repeat and r.get("ok")
                and r.get("verdict") != "VERDICT_INFRA_ERROR"}

    def settings(self, queue):
        settings = {"baseline_torch_compile": bool(self.args.compile_baseline), "queue_capacity": max(64, queue)}
        if self.args.gpu_slots:
            settings["gpu_slots"] = self.args.gpu_slots
        return settings

    def evaluator(self, name, max_runs, queue=64):
        return common.Evaluator(self.kforge, self.out, name, python=self.args.python, work_dir=self.work,
                                settings=self.settings(queue), env={MAX_RUNS_ENV: max_runs})

    def settle(self, evaluator, what, timeout_s):
        waited = evaluator.wait_idle(timeout_s=timeout_s)
        if waited is None:
            common.log(f"{what}: the evaluator still had child processes after {timeout_s} s; going on")
        elif waited > 2:
            common.log(f"{what}: waited {waited:.1f} s for the evaluator's children to end")
        return waited

    # ---- warm

    def warm(self, entries):
        nonce = time.strftime("%H%M%S")
        with self.evaluator("evaluator-warm", WARM_MAX_RUNS, queue=len(entries) + 8) as evaluator:
            requests = [common.request_for(e, f"warm-{e['key']}-{nonce}") for e in entries]

            def done(index, record):
                fields = common.outcome(record)
                self.record("warm", 0, entries[index], fields)
                common.log(f"warm {entries[index]['key']}: {fields['verdict']} in {fields['wall_s']:.1f} s")

            began = time.monotonic()
            records = common.evaluate_many(self.kforge, evaluator.addr, requests, on_done=done)
            common.log(f"warm: {len(records)} evaluations in {time.monotonic() - began:.1f} s")
            again = [e for e, r in zip(entries, records) if common.outcome(r)["verdict"] in
                     ("CALL_FAILED", "VERDICT_INFRA_ERROR", "VERDICT_TIMEOUT")]
            for entry in again:  # once more, alone: a warm-up that failed under load should not fail a measurement
                fields = common.outcome(common.evaluate(self.kforge, evaluator.addr,
                                                        common.request_for(entry, f"warm-again-{entry['key']}-{nonce}")))
                self.record("warm", 1, entry, fields)
                common.log(f"warm again {entry['key']}: {fields['verdict']}")
            self.settle(evaluator, "warm", 300)

    # ---- idle

    def idle(self, entries):
        repeats = [self.args.only_repeat] if self.args.only_repeat is not None else range(self.args.repeats)
        for repeat in repeats:
            done = self.done_keys("idle", repeat)
            todo = [e for e in entries if e["key"] not in done]
            if not todo:
                common.log(f"idle repeat {repeat}: all {len(entries)} recorded already")
                continue
            if self.late():
                common.log(f"idle repeat {repeat}: past the deadline, not started")
                return
            max_runs = IDLE_MAX_RUNS + repeat
            with self.evaluator(f"evaluator-idle-r{repeat}", max_runs) as evaluator:
                self.settle(evaluator, f"idle repeat {repeat} start", 300)
                for entry in todo:
                    if self.late():
                        common.log(f"idle repeat {repeat}: past the deadline; run again to go on")
                        return
                    record = common.evaluate(self.kforge, evaluator.addr,
                                             common.request_for(entry, f"idle-r{repeat}-{entry['key']}"))
                    fields = common.outcome(record)
                    fields["max_runs"] = max_runs
                    self.record("idle", repeat, entry, fields)
                    common.log(f"idle r{repeat} {entry['key']}: {fields['verdict']} cand "
                               f"{fields.get('candidate_median_ms')} eager {fields.get('eager_median_ms')} "
                               f"x{fields.get('speedup_eager')} in {fields['wall_s']:.1f} s")
                    self.settle(evaluator, "idle", 60)

    # ---- full

    def full(self, entries):
        for repeat in range(self.args.full_repeats):
            if self.late():
                common.log(f"full repeat {repeat}: past the deadline, not started")
                return
            max_runs = FULL_MAX_RUNS + repeat
            nonce = f"{repeat}.{time.strftime('%Y%m%d%H%M%S')}"
            requests, kinds = [], []
            for i, entry in enumerate(entries):
                requests.append(common.request_for(entry, f"full-r{repeat}-{entry['key']}"))
                kinds.append(("full", entry))
            for i, entry in enumerate(entries):
                requests.append(common.request_for(entry, f"full-load-r{repeat}-{i}-{entry['key']}",
                                                   suffix=f"\n# load copy {i}.{nonce}\n"))
                kinds.append(("full-load", entry))
            with self.evaluator(f"evaluator-full-r{repeat}", max_runs, queue=len(requests) + 8) as evaluator:
                self.settle(evaluator, f"full repeat {repeat} start", 300)
                began = time.monotonic()

                def done(index, record):
                    phase, entry = kinds[index]
                    fields = common.outcome(record)
                    fields.update(max_runs=max_runs, ended_s=time.monotonic() - began)
                    self.record(phase, repeat, entry, fields)
                    common.log(f"{phase} r{repeat} {entry['key']}: {fields['verdict']} cand "
                               f"{fields.get('candidate_median_ms')} eager {fields.get('eager_median_ms')} "
                               f"(cache hit {fields.get('compile_cache_hit')}) at {fields['ended_s']:.1f} s")

                common.evaluate_many(self.kforge, evaluator.addr, requests, on_done=done)
                common.log(f"full repeat {repeat}: {len(requests)} evaluations in {time.monotonic() - began:.1f} s")

    # ---- dobench

    def child(self, entry, out_json, build_only, timeout_s, spin=False):
        env = dict(os.environ)
        if spin:
            env["KFORGE_DOBENCH_SPIN"] = "1"
        env["TORCH_EXTENSIONS_DIR"] = str(self.out / "torch_extensions")
        # ninja (load_inline needs it) lives beside the interpreter in a virtual environment that is not activated.
        env["PATH"] = f"{Path(self.args.python).parent}{os.pathsep}{env.get('PATH', '')}"
        if build_only:
            env.setdefault("MAX_JOBS", str(max(2, (os.cpu_count() or 8) // self.args.build_workers)))
        args = [self.args.python, str(Path(__file__).resolve()), "--dobench-one", entry["task_path"],
                entry["candidate_path"], str(out_json)] + (["--build-only"] if build_only else [])
        log_path = Path(str(out_json).removesuffix(".json") + ".log")
        began = time.monotonic()
        try:
            Path(out_json).unlink(missing_ok=True)
            with open(log_path, "w") as log_file:
                subprocess.run(args, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=self.out / "dobench",
                               timeout=timeout_s, stdin=subprocess.DEVNULL)
            result = json.loads(Path(out_json).read_text())
        except subprocess.TimeoutExpired:
            result = {"ok": False, "error": f"timed out after {timeout_s} s"}
        except (OSError, json.JSONDecodeError) as error:
            try:
                tail = log_path.read_text(errors="replace")[-2000:]
            except OSError:
                tail = ""
            result = {"ok": False, "error": f"no result ({error}); log: {tail}"}
        result["child_wall_s"] = time.monotonic() - began
        return result

    def dobench_build(self, entries):
        (self.out / "dobench").mkdir(parents=True, exist_ok=True)
        todo = [e for e in entries if "load_inline" in common.read_source(e["candidate_path"])
                and not (self.out / "dobench" / f"{safe_name(e['key'])}.built").exists()]
        if not todo:
            return
        common.log(f"dobench-build: {len(todo)} extensions, {self.args.build_workers} at once")

        def build(entry):
            if self.late():
                return
            out_json = self.out / "dobench" / f"{safe_name(entry['key'])}.build.json"
            result = self.child(entry, out_json, True, 900)
            if result.get("ok"):
                (self.out / "dobench" / f"{safe_name(entry['key'])}.built").write_text(
                    f"{result.get('import_s', 0):.1f} s\n")
            common.log(f"dobench-build {entry['key']}: {'ok' if result.get('ok') else 'FAILED'} in "
                       f"{result['child_wall_s']:.1f} s")

        with ThreadPoolExecutor(max_workers=self.args.build_workers) as pool:
            list(pool.map(build, todo))

    def dobench(self, entries, phase="dobench"):
        self.dobench_build(entries)
        for repeat in range(self.args.dobench_repeats):
            done = self.done_keys(phase, repeat)
            for entry in entries:
                if entry["key"] in done:
                    continue
                if self.late():
                    common.log(f"{phase}: past the deadline; run again to go on")
                    return
                busy = gpu_processes()
                out_json = self.out / "dobench" / f"{safe_name(entry['key'])}.{phase}.{repeat}.json"
                result = self.child(entry, out_json, False, 600, spin=phase == "dobench-spin")
                result["gpu_processes_before"] = busy
                self.record(phase, repeat, entry, result)
                self.log_dobench(phase, entry, result)

    def dobench_spin(self, entries):
        """do_bench again, each child waiting for its GPU spinning (as kforge's timed loop does)."""
        self.dobench(entries, "dobench-spin")

    def log_dobench(self, phase, entry, result):
        common.log(f"{phase} {entry['key']}: "
                   + (f"eager {result.get('eager_median_ms'):.4f} ms cand {result.get('candidate_median_ms'):.4f} ms"
                      f" x{result.get('speedup_eager'):.3f} diff {result.get('max_abs_diff')}"
                      if result.get("ok") else f"FAILED {result.get('error', '')[:300]}"))


def gpu_processes():
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        return ["(nvidia-smi unavailable)"]


# ------------------------------------------------------------------------------------------------- summary


def pct(value, reference):
    if value is None or reference in (None, 0):
        return None
    return 100.0 * (value - reference) / reference


def fmt(value, digits=4):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_pct(value):
    return "-" if value is None else f"{value:+.2f}"


def latest(records):
    """The last line per (phase, repeat, key)."""
    table = {}
    for record in records:
        table[(record.get("phase"), record.get("repeat"), record.get("key"))] = record
    return table


def summary(out, args):
    records = common.read_jsonl(out / "results.jsonl")
    table = latest(records)
    order = []
    for record in records:
        if record.get("key") not in order:
            order.append(record.get("key"))
    # The do_bench a kforge figure is compared with: with several clean processes (`--dobench-repeats`), the one
    # whose candidate median is their median.
    # Its records are one per clean process (the `dobench` phase's repeats; the spinning ones wait otherwise, which
    # is what moves for calls where the host waits).
    dobench_runs = {}
    for (phase, _, key), r in table.items():
        if phase == "dobench" and r.get("ok"):
            dobench_runs.setdefault(key, []).append(r)
    db = {key: sorted(rs, key=lambda r: r["candidate_median_ms"])[(len(rs) - 1) // 2]
          for key, rs in dobench_runs.items()}
    lines = [f"# timing-fidelity: kforge against do_bench ({time.strftime('%Y-%m-%d %H:%M:%S')})", "",
             f"From `{out / 'results.jsonl'}` ({len(records)} lines); machine: `machine.txt`. Errors are "
             "(kforge - do_bench) / do_bench in %; run-to-run is (max - min) / mean over the idle repeats, in %.",
             "Milliseconds throughout.", ""]

    # do_bench children repeated, waiting blocked or spinning (dobench-spin), beside kforge's idle medians
    repeated = [key for key in order if any(phase == "dobench-spin" and k == key for (phase, _, k) in table)]
    if repeated:
        lines += ["## do_bench repeated: default wait against a spinning wait, and kforge idle", "",
                  "| candidate | do_bench cand (default) | do_bench cand (spin) | kforge cand (idle) | "
                  "do_bench eager (default) | do_bench eager (spin) | kforge eager (idle) |",
                  "|---|---|---|---|---|---|---|"]

        def medians(phase, key, field):
            values = [r.get(field) for (p, _, k), r in sorted(table.items(), key=lambda kv: str(kv[0]))
                      if p == phase and k == key and r.get(field) is not None]
            return " / ".join(fmt(v) for v in values) or "-"

        for key in repeated:
            lines.append(f"| {key} | {medians('dobench', key, 'candidate_median_ms')} | "
                         f"{medians('dobench-spin', key, 'candidate_median_ms')} | "
                         f"{medians('idle', key, 'candidate_median_ms')} | {medians('dobench', key, 'eager_median_ms')} | "
                         f"{medians('dobench-spin', key, 'eager_median_ms')} | {medians('idle', key, 'eager_median_ms')} |")
        lines.append("")

    # dobench table
    lines += ["## do_bench (clean process, warmup=25, rep=200)", "",
              "| candidate | task | eager median | eager p20-p80 (n) | candidate median | candidate p20-p80 (n) | "
              "speedup | max abs diff |", "|---|---|---|---|---|---|---|---|"]
    for key in order:
        r = table.get(("dobench", 0, key))
        if r is None:
            continue
        if not r.get("ok"):
            lines.append(f"| {key} | {r.get('task')} | FAILED: {r.get('error', '')[:120].splitlines()[0]} | | | | | |")
            continue
        e, c = r.get("eager_all") or {}, r.get("candidate_all") or {}
        lines.append(f"| {key} | {r.get('task')} | {fmt(r['eager_median_ms'])} | {fmt(e.get('p20'))}-"
                     f"{fmt(e.get('p80'))} ({e.get('n')}) | {fmt(r['candidate_median_ms'])} | {fmt(c.get('p20'))}-"
                     f"{fmt(c.get('p80'))} ({c.get('n')}) | {fmt(r.get('speedup_eager'), 3)} | "
                     f"{fmt(r.get('max_abs_diff'), 6)} |")
    lines.append("")

    # What each error and run-to-run index measures: kforge's field, do_bench's it is compared with, the target,
    # and whether it is judged (kforge's 10th percentiles, from its samples, are shown against do_bench's median).
    measures = (("candidate median", "candidate_median_ms", "candidate_median_ms", "median", True),
                ("eager median", "eager_median_ms", "eager_median_ms", "median", True),
                ("speedup", "speedup_eager", "speedup_eager", "speedup", True),
                ("candidate p10", "candidate_p10_ms", "candidate_median_ms", "median", False),
                ("eager p10", "eager_p10_ms", "eager_median_ms", "median", False))

    def errors(r):
        d = db.get(r["key"])
        if d is None or r.get("verdict") != "VERDICT_CORRECT":
            return (None,) * len(measures)
        return tuple(pct(r.get(mine), d.get(theirs)) for _, mine, theirs, _, _ in measures)

    def phase_table(phase, title):
        rows = sorted(((rep, key), r) for (p, rep, key), r in table.items() if p == phase)
        rows.sort(key=lambda item: (item[0][0], order.index(item[0][1]) if item[0][1] in order else 0))
        if not rows:
            return
        lines.extend([f"## {title}", "",
                      "| candidate | repeat | verdict | kforge cand median / p10 | do_bench cand | err % median / p10 | "
                      "kforge eager median / p10 | do_bench eager | err % median / p10 | kforge speedup | "
                      "do_bench speedup | err % | samples cand/eager | wall s |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"])
        for (rep, key), r in rows:
            d = db.get(key, {})
            ec, ee, es, pc, pe = errors(r)
            lines.append(
                f"| {key} | {rep} | {r.get('verdict')} | {fmt(r.get('candidate_median_ms'))} / "
                f"{fmt(r.get('candidate_p10_ms'))} | {fmt(d.get('candidate_median_ms'))} | {fmt_pct(ec)} / "
                f"{fmt_pct(pc)} | {fmt(r.get('eager_median_ms'))} / {fmt(r.get('eager_p10_ms'))} | "
                f"{fmt(d.get('eager_median_ms'))} | {fmt_pct(ee)} / {fmt_pct(pe)} | {fmt(r.get('speedup_eager'), 3)} | "
                f"{fmt(d.get('speedup_eager'), 3)} | {fmt_pct(es)} | {r.get('candidate_samples', '-')}/"
                f"{r.get('eager_samples', '-')} | {fmt(r.get('wall_s'), 1)} |")
        lines.append("")

    phase_table("idle", "idle: one evaluation at a time")
    # run to run
    idle = {}
    for (phase, rep, key), r in table.items():
        if phase == "idle" and r.get("verdict") == "VERDICT_CORRECT":
            idle.setdefault(key, {})[rep] = r
    r2r = {}
    if any(len(v) > 1 for v in idle.values()):
        reps = sorted({rep for v in idle.values() for rep in v})
        lines += ["## idle run to run", "",
                  "| candidate | " + " | ".join(f"cand r{r}" for r in reps) + " | cand % | "
                  + " | ".join(f"eager r{r}" for r in reps) + " | eager % | speedup % | cand p10 % | eager p10 % |",
                  "|---|" + "---|" * (2 * len(reps) + 5)]
        for key in order:
            v = idle.get(key, {})
            if len(v) < 2:
                continue

            def spread(field):
                values = [x.get(field) for x in v.values() if x.get(field)]
                if len(values) < 2:
                    return None
                return 100.0 * (max(values) - min(values)) / (sum(values) / len(values))

            r2r[key] = tuple(spread(mine) for _, mine, _, _, _ in measures)
            lines.append(f"| {key} | " + " | ".join(fmt(v.get(r, {}).get("candidate_median_ms")) for r in reps)
                         + f" | {fmt(r2r[key][0], 2)} | "
                         + " | ".join(fmt(v.get(r, {}).get("eager_median_ms")) for r in reps)
                         + " | " + " | ".join(fmt(x, 2) for x in r2r[key][1:]) + " |")
        lines.append("")
    phase_table("full", "full: every candidate at once plus a cold-compile copy of each")
    loads = [r for (p, _, _), r in table.items() if p == "full-load"]
    if loads:
        verdicts = {}
        for r in loads:
            verdicts[r.get("verdict")] = verdicts.get(r.get("verdict"), 0) + 1
        ends = [r.get("ended_s") or 0 for (p, _, _), r in table.items() if p in ("full", "full-load")]
        lines += [f"Load copies: {len(loads)} ({verdicts}); cache hits among them: "
                  f"{sum(1 for r in loads if r.get('compile_cache_hit'))}; last evaluation ended at "
                  f"{max(ends):.1f} s.", ""]

    # The candidate's timed step per evaluation: what its launch took against the cover (the harness's medians)
    steps = [(phase, repeat, key, r) for (phase, repeat, key), r in table.items()
             if phase in ("warm", "idle", "full", "full-load") and "run.timing_launch" in (r.get("stage_ms") or {})]
    if steps:
        lines += ["## the candidate's timed step: launch against the cover (medians over the measured calls, us)", "",
                  "A launch longer than the flush and the cover the device ran shows in the candidate's median; "
                  "`timing.launch_exposed`: the evaluator's notice that more than half the calls' covers ran out (binaries "
                  "from 9fbcaaf on; earlier ones never give it).", "",
                  "| candidate | phase | repeat | candidate median | launch | cover asked | cover run | "
                  "timing.launch_exposed |",
                  "|---|---|---|---|---|---|---|---|"]
        for phase, repeat, key, r in sorted(steps, key=lambda s: (order.index(s[2]), s[0], s[1])):
            st = r["stage_ms"]
            us = [r.get("candidate_median_ms"), st.get("run.timing_launch"), st.get("run.timing_cover"),
                  st.get("run.timing_cover_device")]
            exposed = "yes" if "timing.launch_exposed" in (r.get("findings") or []) else "no"
            lines.append(f"| {key} | {phase} | {repeat} | " +
                         " | ".join(fmt(1000 * v, 1) if v is not None else "-" for v in us) + f" | {exposed} |")
        lines.append("")

    # stage_ms
    stage_keys = {}
    for (phase, _, _), r in table.items():
        if phase in ("idle", "full"):
            for k, v in (r.get("stage_ms") or {}).items():
                if v is not None and ("timing" in k or "cpu_wait" in k or k.startswith("run.")):
                    stage_keys.setdefault(k, {}).setdefault(phase, []).append(v)
    if stage_keys:
        lines += ["## stage_ms (entries with `timing` or `cpu_wait`, or starting with `run.`)", "",
                  "| key | idle mean | idle max | full mean | full max |", "|---|---|---|---|---|"]
        for k in sorted(stage_keys):
            cells = []
            for phase in ("idle", "full"):
                v = stage_keys[k].get(phase, [])
                cells += [fmt(sum(v) / len(v), 1) if v else "-", fmt(max(v), 1) if v else "-"]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")

    # aggregate
    host_waits = {key for (phase, _, key), r in table.items()
                  if phase in ("warm", "idle", "full") and HOST_WAITS in (r.get("findings") or [])}

    def group_of(key):
        d = db.get(key)
        if d is None:
            return None
        if key in host_waits:
            return "host"
        return "large" if d["eager_median_ms"] >= SMALL_MS else "small"

    def dobench_spread(key):
        """do_bench's own spread of the candidate's median across its clean processes, in %."""
        values = [r["candidate_median_ms"] for r in dobench_runs.get(key, [])]
        return 100.0 * (max(values) - min(values)) / (sum(values) / len(values)) if len(values) > 1 else None

    def outside_pct(value, references):
        """How far `value` lies outside the range of `references`, in % of the nearer end (0 inside; signed)."""
        references = [v for v in references if v]
        if value is None or not references:
            return None
        lo, hi = min(references), max(references)
        return 0.0 if lo <= value <= hi else pct(value, lo if value < lo else hi)

    def worst(phase, index, group):
        best = None
        for (p, _, key), r in table.items():
            if p != phase or group_of(key) != group:
                continue
            value = errors(r)[index]
            if value is not None and (best is None or abs(value) > abs(best[0])):
                best = (value, key)
        return best

    def worst_r2r(index, group):
        best = None
        for key, values in r2r.items():
            if group_of(key) == group and values[index] is not None and (best is None or values[index] > best[0]):
                best = (values[index], key)
        return best

    targets = {"median": args.target_median, "speedup": args.target_speedup, "r2r": args.target_r2r}
    lines += ["## aggregate", "",
              f"Ops grouped by do_bench's eager median: >= {SMALL_MS} ms (the targets apply) and < {SMALL_MS} ms "
              "(reported apart). Targets, as read from the brief: |error| of the candidate and eager medians "
              f"<= {targets['median']}%, of the speedups <= {targets['speedup']}% (idle and full), run-to-run "
              f"difference between idle repeats <= {targets['r2r']}%. Calls that make the host wait for the device "
              f"mid-call (the evaluator's notice `{HOST_WAITS}`) are reported apart whatever their size: their cost "
              "comes in two levels that switch within a process, and no timer holds them to a few percent of one "
              "process's do_bench; kforge's candidate median and speedup are held to the same targets against "
              "the range of do_bench's medians across its clean processes (at least two: `--dobench-repeats`), and "
              "to the run-to-run target. kforge's 10th percentiles (from its samples) are shown beside the medians, "
              "not judged.", ""]
    failing, measured, unmeasured = [], [], []
    for group, title in (("large", f"eager >= {SMALL_MS} ms"), ("small", f"eager < {SMALL_MS} ms"),
                         ("host", f"the host waits mid-call (`{HOST_WAITS}`)")):
        count = sum(1 for key in order if group_of(key) == group)
        lines += [f"### {title} ({count} ops)", "", "| measure | worst | candidate | target | |", "|---|---|---|---|---|"]
        rows = []  # (measure, (value, candidate) or None, limit, signed, judged against the limit)
        if group != "host":
            for phase in ("idle", "full"):
                for index, (name, _, _, target, judged) in enumerate(measures):
                    rows.append((f"{phase} {name} abs error %", worst(phase, index, group), targets[target], True,
                                 group == "large" and judged))
            for index, (name, _, _, _, judged) in enumerate(measures):
                rows.append((f"run-to-run {name} %", worst_r2r(index, group), targets["r2r"], False,
                             group == "large" and judged))
        for key in [key for key in order if group_of(key) == "host"] if group == "host" else []:
            # Each such op against do_bench's own range across its clean processes: how far kforge's speedup and
            # candidate median, idle and full, fall outside it, held to the targets once do_bench ran in at least
            # two processes; its 10th percentile beside them (informational). Run to run as for the others.
            runs = dobench_runs.get(key, [])
            spread = dobench_spread(key)
            rows.append((f"do_bench's own spread across processes % ({key})",
                         None if spread is None else (spread, key), "-", False, False))
            # With do_bench in one process there is no range to judge it against.
            limit = targets["median"] if len(runs) > 1 else "- (needs --dobench-repeats 2 or more)"
            for name, fields, judged in (("candidate median and speedup", (("candidate_median_ms", "candidate_median_ms"),
                                                                           ("speedup_eager", "speedup_eager")),
                                          len(runs) > 1),
                                         ("candidate p10", (("candidate_p10_ms", "candidate_median_ms"),), False)):
                outside = [(outside_pct(r.get(mine), [d.get(theirs) for d in runs]), key)
                           for (p, _, k), r in table.items() if p in ("idle", "full") and k == key
                           and r.get("verdict") == "VERDICT_CORRECT" for mine, theirs in fields]
                outside = [o for o in outside if o[0] is not None]
                rows.append((f"largest distance % of kforge's {name} from that range, idle and full",
                             max(outside, key=lambda o: abs(o[0]), default=None), limit, True, judged))
            for index, (name, _, _, _, judged) in enumerate(measures):
                found = r2r.get(key)
                if not name.startswith("eager"):  # the reference does not wait: shown above
                    rows.append((f"run-to-run {name} % ({key})",
                                 None if found is None or found[index] is None else (found[index], key),
                                 targets["r2r"], False, judged))
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
            lines.append(f"| {name} | {shown} | {found[1]} | {fmt(limit, 2) if isinstance(limit, float) else limit} "
                         f"| {verdict} |")
        lines.append("")
    if not measured:
        verdict = "nothing measured yet."
    elif failing:
        verdict = f"missed: {', '.join(failing)}."
    else:
        verdict = "all measured ones met" + (f" (not measured: {', '.join(unmeasured)})." if unmeasured else ".")
    lines += [f"Targets on ops >= {SMALL_MS} ms, and on calls where the host waits against do_bench's range: "
              f"{verdict}", ""]

    # failures
    bad = [r for (p, _, _), r in table.items() if p in ("idle", "full", "warm", "full-load")
           and r.get("verdict") != "VERDICT_CORRECT"]
    if bad:
        lines += ["## evaluations that were not VERDICT_CORRECT", "", "| phase | repeat | candidate | verdict | error |",
                  "|---|---|---|---|---|"]
        for r in bad:
            error = (r.get("error") or "").replace("|", "/").replace("\n", " ")[-200:]
            lines.append(f"| {r['phase']} | {r['repeat']} | {r['key']} | {r.get('verdict')} | {error} |")
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines))
    common.log(f"wrote {out / 'summary.md'}")


# ------------------------------------------------------------------------------------------------- main


def parse():
    default_kb = common.REPO.parent / "shared" / "kernelbench"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Commands and phases: see the module docstring (python3 -m pydoc or the file).")
    parser.add_argument("--out", help="output directory, shared by every phase's command")
    parser.add_argument("--candidates", help="make_candidates.py's output directory (manifest.json and candidates)")
    parser.add_argument("--tasks-dir", default=str(default_kb), help=f"KernelBench directory (default {default_kb})")
    parser.add_argument("--corpus", action="store_true", help="add the corpus's legitimate cuda/ entries")
    parser.add_argument("--limit", type=int, default=None, help="keep the manifest's first N candidates")
    parser.add_argument("--phases", default="warm,idle,full,dobench",
                        help=f"comma-separated, run in the order given, from {','.join(PHASES)}")
    parser.add_argument("--repeats", type=int, default=2, help="idle repeats (default 2)")
    parser.add_argument("--dobench-repeats", type=int, default=1,
                        help="do_bench children per candidate in the dobench phases (default 1)")
    parser.add_argument("--only-repeat", type=int, default=None, help="run only this idle repeat (0-based)")
    parser.add_argument("--full-repeats", type=int, default=1, help="full repeats (default 1)")
    parser.add_argument("--gpu-slots", type=int, default=0, help="evaluator gpu_slots (default: its default)")
    parser.add_argument("--compile-baseline", action="store_true", help="keep the torch.compile baseline on")
    parser.add_argument("--python", default=common.default_python(), help="interpreter with torch (default: this one)")
    parser.add_argument("--kforge", default=None, help="kforge binary (default target/release/kforge)")
    parser.add_argument("--deadline-s", type=float, default=480.0,
                        help="start no evaluation or do_bench child after this many seconds (0: no limit)")
    parser.add_argument("--build-workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                        help="dobench-build: extensions built at once")
    parser.add_argument("--no-resume", action="store_true", help="measure again what results.jsonl already has")
    parser.add_argument("--summary-only", action="store_true", help="only rebuild summary.md from results.jsonl")
    parser.add_argument("--target-median", type=float, default=3.0)
    parser.add_argument("--target-speedup", type=float, default=3.0)
    parser.add_argument("--target-r2r", type=float, default=2.0)
    parser.add_argument("--dobench-one", nargs=3, metavar=("TASK", "CAND", "OUTJSON"),
                        help="internal: measure one task/candidate with do_bench in this process")
    parser.add_argument("--build-only", action="store_true", help="with --dobench-one: import (build) only")
    args = parser.parse_args()
    if not args.dobench_one and not args.out:
        parser.error("--out is required")
    return args


def select(args):
    entries = []
    if args.candidates:
        entries = common.manifest_entries(args.candidates, args.tasks_dir)
        if args.limit is not None:
            entries = entries[:args.limit]
    if args.corpus:
        entries += common.corpus_entries()
    if not entries:
        raise SystemExit("no candidates: pass --candidates DIR and/or --corpus")
    return entries


def main():
    args = parse()
    if args.dobench_one:
        dobench_one(*args.dobench_one, build_only=args.build_only)
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise SystemExit(f"unknown phases {unknown}; known: {PHASES}")
        entries = select(args)
        (out / "candidates.json").write_text(json.dumps(entries, indent=1))
        run = Run(args)
        needs_evaluator = any(p in ("warm", "idle", "full") for p in phases)
        run.kforge = common.find_kforge(args.kforge) if needs_evaluator else (args.kforge or "(not used)")
        common.record_machine(out, args.python, run.kforge, note=f"fidelity phases {','.join(phases)}")
        common.log(f"{len(entries)} candidates; phases {phases}; out {out}")
        try:
            for phase in phases:
                common.log(f"phase {phase}")
                try:
                    getattr(run, phase.replace("-", "_"))(entries)
                except Exception as error:  # noqa: BLE001 (the next phases and the summary still run)
                    common.log(f"phase {phase} failed: {type(error).__name__}: {error}")
                    traceback.print_exc()
                    common.append_jsonl(run.results, {"phase": f"{phase}-error", "repeat": 0, "key": "",
                                                      "error": f"{type(error).__name__}: {error}"[:4000],
                                                      "unix": time.time()})
        finally:
            common._stop_all()
    summary(out, args)


if __name__ == "__main__":
    main()
