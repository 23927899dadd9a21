"""fidelity.py's phases: dobench-build, dobench and dobench-spin (do_bench in clean child processes), warm, idle
and full (kforge evaluators); each appends its lines to OUT/results.jsonl and, run again, goes on with what is
missing. The module docstring of fidelity.py says what each phase does and why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common

MAX_RUNS_ENV = "KFORGE__EVALUATOR__TIMING__MAX_RUNS"
WARM_MAX_RUNS = 999
IDLE_MAX_RUNS = 1000
FULL_MAX_RUNS = 1100
PHASES = ("dobench-build", "dobench", "dobench-spin", "warm", "idle", "full")
# The do_bench child runs as `fidelity.py --dobench-one ...`.
FIDELITY = Path(__file__).resolve().parent / "fidelity.py"


def safe_name(key):
    """`key` as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


class Run:
    """One command's phases over OUT: where results go, the deadline, the evaluators and do_bench children."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.results = self.out / "results.jsonl"
        self.work = self.out / "work"
        self.began = time.monotonic()
        self.kforge: Path | str | None = None  # the kforge binary, set before a phase runs

    def late(self):
        return self.args.deadline_s > 0 and time.monotonic() - self.began > self.args.deadline_s

    def record(self, phase, repeat, entry, fields):
        line = {
            "phase": phase,
            "repeat": repeat,
            "key": entry["key"],
            "task": entry["task_id"],
            "backend": entry["backend"],
            "kind": entry.get("kind", ""),
            "unix": time.time(),
        }
        line.update(fields)
        common.append_jsonl(self.results, line)

    def done_keys(self, phase, repeat):
        if self.args.no_resume:
            return set()
        # A call that failed, or an infrastructure error, is measured again; any verdict of the candidate's own is kept.
        return {
            r["key"]
            for r in common.read_jsonl(self.results)
            if r.get("phase") == phase
            and r.get("repeat") == repeat
            and r.get("ok")
            and r.get("verdict") != "VERDICT_INFRA_ERROR"
        }

    def settings(self, queue):
        settings = {"baseline_torch_compile": bool(self.args.compile_baseline), "queue_capacity": max(64, queue)}
        if self.args.gpu_slots:
            settings["gpu_slots"] = self.args.gpu_slots
        return settings

    def evaluator(self, name, max_runs, queue=64):
        return common.Evaluator(
            self.kforge,
            self.out,
            name,
            python=self.args.python,
            work_dir=self.work,
            settings=self.settings(queue),
            env={MAX_RUNS_ENV: max_runs},
        )

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
            again = [
                e
                for e, r in zip(entries, records)
                if common.outcome(r)["verdict"] in ("CALL_FAILED", "VERDICT_INFRA_ERROR", "VERDICT_TIMEOUT")
            ]
            for entry in again:  # once more, alone: a warm-up that failed under load should not fail a measurement
                fields = common.outcome(
                    common.evaluate(
                        self.kforge, evaluator.addr, common.request_for(entry, f"warm-again-{entry['key']}-{nonce}")
                    )
                )
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
                    record = common.evaluate(
                        self.kforge, evaluator.addr, common.request_for(entry, f"idle-r{repeat}-{entry['key']}")
                    )
                    fields = common.outcome(record)
                    fields["max_runs"] = max_runs
                    self.record("idle", repeat, entry, fields)
                    common.log(
                        f"idle r{repeat} {entry['key']}: {fields['verdict']} cand "
                        f"{fields.get('candidate_median_ms')} eager {fields.get('eager_median_ms')} "
                        f"x{fields.get('speedup_eager')} in {fields['wall_s']:.1f} s"
                    )
                    self.settle(evaluator, "idle", 60)

    # ---- full

    def full(self, entries):
        for repeat in range(self.args.full_repeats):
            if self.late():
                common.log(f"full repeat {repeat}: past the deadline, not started")
                return
            self.full_repeat(entries, repeat)

    def full_repeat(self, entries, repeat):
        """Every candidate at once, together with a cold-compile copy of each, in a fresh evaluator."""
        max_runs = FULL_MAX_RUNS + repeat
        nonce = f"{repeat}.{time.strftime('%Y%m%d%H%M%S')}"
        requests, kinds = [], []
        for entry in entries:
            requests.append(common.request_for(entry, f"full-r{repeat}-{entry['key']}"))
            kinds.append(("full", entry))
        for i, entry in enumerate(entries):
            requests.append(
                common.request_for(
                    entry, f"full-load-r{repeat}-{i}-{entry['key']}", suffix=f"\n# load copy {i}.{nonce}\n"
                )
            )
            kinds.append(("full-load", entry))
        with self.evaluator(f"evaluator-full-r{repeat}", max_runs, queue=len(requests) + 8) as evaluator:
            self.settle(evaluator, f"full repeat {repeat} start", 300)
            began = time.monotonic()

            def done(index, record):
                phase, entry = kinds[index]
                fields = common.outcome(record)
                fields.update(max_runs=max_runs, ended_s=time.monotonic() - began)
                self.record(phase, repeat, entry, fields)
                common.log(
                    f"{phase} r{repeat} {entry['key']}: {fields['verdict']} cand "
                    f"{fields.get('candidate_median_ms')} eager {fields.get('eager_median_ms')} "
                    f"(cache hit {fields.get('compile_cache_hit')}) at {fields['ended_s']:.1f} s"
                )

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
        args = [
            self.args.python,
            str(FIDELITY),
            "--dobench-one",
            entry["task_path"],
            entry["candidate_path"],
            str(out_json),
        ] + (["--build-only"] if build_only else [])
        log_path = Path(str(out_json).removesuffix(".json") + ".log")
        began = time.monotonic()
        try:
            Path(out_json).unlink(missing_ok=True)
            with open(log_path, "w") as log_file:
                subprocess.run(
                    args,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.out / "dobench",
                    timeout=timeout_s,
                    stdin=subprocess.DEVNULL,
                )
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
        todo = [
            e
            for e in entries
            if "load_inline" in common.read_source(e["candidate_path"])
            and not (self.out / "dobench" / f"{safe_name(e['key'])}.built").exists()
        ]
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
                    f"{result.get('import_s', 0):.1f} s\n"
                )
            common.log(
                f"dobench-build {entry['key']}: {'ok' if result.get('ok') else 'FAILED'} in "
                f"{result['child_wall_s']:.1f} s"
            )

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
        common.log(
            f"{phase} {entry['key']}: "
            + (
                f"eager {result.get('eager_median_ms'):.4f} ms cand {result.get('candidate_median_ms'):.4f} ms"
                f" x{result.get('speedup_eager'):.3f} diff {result.get('max_abs_diff')}"
                if result.get("ok")
                else f"FAILED {result.get('error', '')[:300]}"
            )
        )


def gpu_processes():
    """The compute processes on the GPU now, as nvidia-smi lists them."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        return ["(nvidia-smi unavailable)"]
