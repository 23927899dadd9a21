"""What bench/timing/fidelity.py and bench/timing/hang.py share: a kforge evaluator started as a separate process,
evaluations submitted through `kforge call`, the candidate sets, result files and the machine's facts.

Not a script: imported by the two benchmarks (stdlib only, so the parent process needs no torch).

- `Evaluator`: `kforge serve evaluator --config OUT/<name>.toml` in a process group of its own; the TOML sets
  `[evaluator] python`, `work_dir` and `[evaluator.server] listen = "127.0.0.1:<free port>"` plus any other
  `[evaluator]` keys given; readiness is a bounded poll of `kforge call Evaluator/GetCapabilities`. Stopped with
  SIGTERM (drain), then SIGKILL of its group and of any process it left behind; also at interpreter exit and on
  SIGTERM/SIGINT of the benchmark.
- `evaluate` / `evaluate_many`: `kforge call Evaluator/Evaluate --addr URL` with the request's proto3 JSON on stdin,
  one subprocess per evaluation; many at once from a thread pool, released together by a barrier.
- `manifest_entries` (make_candidates.py's manifest.json) and `corpus_entries` (services/evaluator/tests/corpus),
  `request_for` (the EvaluateRequest JSON), `outcome` (the fields the benchmarks record from a response).
- `record_machine`: nvidia-smi -q's header lines and GPU name, torch/triton/CUDA versions, CPU count -> machine.txt.
"""

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "services" / "evaluator" / "tests" / "corpus"
EXAMPLE_TASKS = REPO / "examples" / "tasks"

BACKENDS = {"cuda": "BACKEND_CUDA", "triton": "BACKEND_TRITON", "cpu": "BACKEND_CPU"}


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------- binaries


def find_kforge(given=None):
    """The kforge binary: `given`, else target/release/kforge, else target/debug/kforge."""
    if given:
        path = Path(given)
        if not path.exists():
            raise SystemExit(f"kforge binary {given} does not exist")
        return path.resolve()
    for candidate in (REPO / "target" / "release" / "kforge", REPO / "target" / "debug" / "kforge"):
        if candidate.exists():
            return candidate
    raise SystemExit("no kforge binary: build it (cargo build --release --bin kforge) or pass --kforge")


def default_python():
    return sys.executable


# ------------------------------------------------------------------------------------------------- config


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def write_config(path, *, python, port, work_dir, settings=None):
    """Writes an evaluator config: [evaluator] python, work_dir, `settings` (nested dicts become sub-tables,
    e.g. {"timing": {"max_runs": 1000}}) and [evaluator.server] listen on 127.0.0.1:port. Returns the path."""
    settings = dict(settings or {})
    tables = {"server": {"listen": f"127.0.0.1:{port}"}}
    for key, value in list(settings.items()):
        if isinstance(value, dict):
            tables.setdefault(key, {}).update(value)
            del settings[key]
    lines = ["[evaluator]", f"python = {toml_value(python)}", f"work_dir = {toml_value(work_dir)}"]
    lines += [f"{key} = {toml_value(value)}" for key, value in settings.items()]
    for table, values in tables.items():
        lines += ["", f"[evaluator.{table}]"] + [f"{key} = {toml_value(value)}" for key, value in values.items()]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


# ------------------------------------------------------------------------------------------------- processes


def _children_map():
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] in ("Z", "X"):  # exited, not yet reaped: runs nothing
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid):
    """Every live process below `pid` (from /proc)."""
    children = _children_map()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


_LIVE = set()


def _stop_all():
    for evaluator in list(_LIVE):
        evaluator.stop()


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds: finally blocks and atexit stop the evaluators


atexit.register(_stop_all)
for _signal in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(_signal, _on_signal)


class Evaluator:
    """One `kforge serve evaluator` process. Use as a context manager, or start()/stop()."""

    def __init__(self, kforge, out_dir, name, *, python, work_dir, settings=None, env=None, ready_timeout_s=300):
        self.kforge, self.out_dir, self.name = Path(kforge), Path(out_dir), name
        self.python, self.work_dir = python, Path(work_dir).resolve()
        self.settings, self.env = settings or {}, env or {}
        self.ready_timeout_s = ready_timeout_s
        self.proc = self.addr = self.capabilities = None
        self.started_s = None
        self.never_idle = False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.addr = f"http://127.0.0.1:{port}"
        config = write_config(
            self.out_dir / f"{self.name}.toml",
            python=self.python,
            port=port,
            work_dir=self.work_dir,
            settings=self.settings,
        )
        env = dict(os.environ)
        env.update({k: str(v) for k, v in self.env.items()})
        inherited = sorted(k for k in os.environ if k.startswith("KFORGE__") and k not in self.env)
        self.log_path = self.out_dir / f"{self.name}.log"
        with open(self.log_path, "ab") as log_file:
            log_file.write(
                f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} start {self.name} on {self.addr}; "
                f"env {self.env} inherited {inherited}\n".encode()
            )
            log_file.flush()
            started = time.monotonic()
            self.proc = subprocess.Popen(
                [str(self.kforge), "serve", "evaluator", "--config", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        _LIVE.add(self)
        log(f"evaluator {self.name}: pid {self.proc.pid} on {self.addr} (config {config}, env {self.env})")
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - started
        # wait_ready() returned, so capabilities is set.
        log(f"evaluator {self.name}: ready after {self.started_s:.1f} s; devices {self.capabilities.get('devices')}")  # pyright: ignore[reportOptionalMemberAccess]
        return self

    def log_tail(self, chars=3000):
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self):
        """Bounded poll: GetCapabilities answers, or the process ended, or ready_timeout_s passed."""
        # start() set proc and addr before it called this.
        deadline = time.monotonic() + self.ready_timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # pyright: ignore[reportOptionalMemberAccess]
                raise RuntimeError(
                    f"evaluator exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}"  # pyright: ignore[reportOptionalMemberAccess]
                )
            try:
                done = subprocess.run(
                    [str(self.kforge), "call", "Evaluator/GetCapabilities", "--addr", self.addr],  # pyright: ignore[reportArgumentType, reportCallIssue]
                    input="{}",
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                if done.returncode == 0:
                    self.capabilities = json.loads(done.stdout)
                    return
                last = done.stderr.strip()
            except (subprocess.TimeoutExpired, json.JSONDecodeError) as error:
                last = repr(error)
            time.sleep(0.5)
        raise RuntimeError(f"evaluator not ready after {self.ready_timeout_s} s (last: {last}):\n{self.log_tail()}")

    def wait_idle(self, timeout_s=300.0, settle_s=1.0):
        """Bounded poll until the evaluator has had no child process for `settle_s` (its start-up warm-up, baselines
        computed ahead, killed jobs' processes are over). Returns the seconds waited, or None at the timeout.
        Once a wait has timed out, later ones wait 5 s at most: a child that never ends must not cost every wait."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        if self.never_idle:
            timeout_s = min(timeout_s, 5.0)
        began = time.monotonic()
        quiet_since = None
        while time.monotonic() - began < timeout_s:
            if descendants(self.proc.pid):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= settle_s:
                return time.monotonic() - began
            time.sleep(0.2)
        self.never_idle = True
        return None

    def stop(self, drain_s=30.0):
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        leftovers = descendants(proc.pid) if proc.poll() is None else []
        try:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=drain_s)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            # Jobs run in process groups (and maybe users) of their own: end the ones this evaluator started, by id.
            for pid in leftovers + descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        log(f"evaluator {self.name}: stopped (exit {proc.returncode})")


# ------------------------------------------------------------------------------------------------- evaluations


def evaluate(kforge, addr, request, timeout_s=3600.0):
    """One Evaluate call through `kforge call`. Never raises: failures come back with ok False and the error."""
    record = {"request_id": request.get("requestId", ""), "submitted_unix": time.time()}
    began = time.monotonic()
    try:
        done = subprocess.run(
            [str(kforge), "call", "Evaluator/Evaluate", "--addr", addr],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        record["wall_s"] = time.monotonic() - began
        if done.returncode != 0:
            record.update(ok=False, error=(done.stderr.strip() or f"exit {done.returncode}")[-2000:])
        else:
            record.update(ok=True, response=json.loads(done.stdout))
    except subprocess.TimeoutExpired:
        record.update(ok=False, wall_s=time.monotonic() - began, error=f"client timeout after {timeout_s} s")
    except Exception as error:  # recorded, not fatal
        record.update(ok=False, wall_s=time.monotonic() - began, error=f"{type(error).__name__}: {error}")
    return record


def evaluate_many(kforge, addr, requests, on_done=None, timeout_s=3600.0):
    """All `requests` at once (one thread each, released together); `on_done(index, record)` as each ends.
    Returns the records in request order."""
    if not requests:
        return []
    barrier = threading.Barrier(len(requests))
    records: list[dict | None] = [None] * len(requests)

    def one(index):
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=60)
        record = evaluate(kforge, addr, requests[index], timeout_s)
        records[index] = record
        if on_done is not None:
            on_done(index, record)
        return record

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        list(pool.map(one, range(len(requests))))
    return records


def _get(message, *names, default=None):
    for name in names:
        if isinstance(message, dict) and name in message:
            return message[name]
    return default


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _timing(response, camel, snake, name):
    """`name`'s median, IQR, 10th percentile (from the samples), sample count and samples, from one TimingStats."""
    stats = _get(response, camel, snake, default=None) or {}
    if not stats:
        return {}
    samples = [_float(s) for s in _get(stats, "samplesMs", "samples_ms", default=[]) or []]
    return {
        f"{name}_median_ms": _float(_get(stats, "medianMs", "median_ms", default=0.0)),
        f"{name}_p10_ms": percentile(samples, 10) if samples else None,
        f"{name}_iqr_ms": _float(_get(stats, "iqrMs", "iqr_ms", default=0.0)),
        f"{name}_samples": len(samples),
        f"{name}_samples_ms": samples,
    }


def outcome(record):
    """The fields recorded from one evaluate() record (proto3 JSON: default values are absent)."""
    out = {"ok": record.get("ok", False), "wall_s": record.get("wall_s"), "request_id": record.get("request_id")}
    if not record.get("ok"):
        out.update(verdict="CALL_FAILED", error=record.get("error", ""))
        return out
    response = record["response"]
    stage_ms = {k: _float(v) for k, v in (_get(response, "stageMs", "stage_ms", default={}) or {}).items()}
    out.update(
        verdict=_get(response, "verdict", default="VERDICT_UNSPECIFIED"),
        **_timing(response, "candidateTiming", "candidate_timing", "candidate"),
        **_timing(response, "eagerTiming", "eager_timing", "eager"),
        speedup_eager=_float(_get(response, "speedupEager", "speedup_eager", default=0.0)),
        compile_cache_hit=bool(_get(response, "compileCacheHit", "compile_cache_hit", default=False)),
        device=_get(response, "device", default=""),
        stage_ms=stage_ms,
        findings=[f.get("code", "") for f in _get(response, "findings", default=[]) or []],
    )
    error = _get(response, "error", default="")
    if error:
        out["error"] = error[-2000:]
    return out


# ------------------------------------------------------------------------------------------------- candidates


def corpus_header(source):
    header = {}
    for line in source.splitlines():
        if line.startswith("# ") and ":" in line:
            key, _, value = line[2:].partition(":")
            header.setdefault(key.strip(), value.strip())
    return header


def corpus_task_path(name):
    """A corpus header's task: `relu` is examples/tasks/relu/task.py, `corpus/<n>` tests/corpus/tasks/<n>.py."""
    if name.startswith("corpus/"):
        return CORPUS / "tasks" / f"{name.removeprefix('corpus/')}.py"
    return EXAMPLE_TASKS / name / "task.py"


def corpus_entry(path):
    path = Path(path).resolve()
    header = corpus_header(path.read_text())
    # A candidate judged per policy (`# expect[NAME]: ...`, which replaces `policy` and `expect` as in the corpus
    # test) runs under the first policy its header names.
    named = [(key[len("expect[") : -1], value) for key, value in header.items() if key.startswith("expect[")]
    policy, expect = named[0] if named else (header.get("policy", ""), header.get("expect"))
    expect = (expect or "VERDICT_CORRECT").split()[0]
    return {
        "key": f"corpus/{path.parent.name}/{path.name}",
        "task_id": header["task"],
        "task_path": str(corpus_task_path(header["task"])),
        "candidate_path": str(path),
        "backend": "triton" if header.get("backend") == "triton" else "cuda",
        "policy": policy,
        "expect": expect,
        "kind": "corpus",
    }


def corpus_entries(backends=("cuda", "triton")):
    """The corpus's cuda/ entries that expect exactly VERDICT_CORRECT (legit_relu.py, triton_legit_relu.py)."""
    entries = [corpus_entry(p) for p in sorted((CORPUS / "cuda").glob("*.py"))]
    return [e for e in entries if e["expect"] == "VERDICT_CORRECT" and e["backend"] in backends]


def manifest_entries(candidates_dir, tasks_dir, levels=("level1", "level2"), backends=("cuda", "triton")):
    """make_candidates.py's manifest entries expected VERDICT_CORRECT (entries without `expect`, as the plain set
    writes them, are meant correct), of the given KernelBench levels and backends, in manifest order."""
    candidates_dir, tasks_dir = Path(candidates_dir).resolve(), Path(tasks_dir).resolve()
    manifest = json.loads((candidates_dir / "manifest.json").read_text())
    entries = []
    for item in manifest:
        task = item["task"]
        if task.split("/")[0] not in levels or item.get("expect", "VERDICT_CORRECT") != "VERDICT_CORRECT":
            continue
        backend = item.get("backend", "cuda")
        if backend not in backends:
            continue
        entries.append(
            {
                "key": item["candidate"],
                "task_id": task,  # as the throughput benchmark names it
                "task_path": str(tasks_dir / task),
                "candidate_path": str(candidates_dir / item["candidate"]),
                "backend": backend,
                "policy": "",
                "expect": "VERDICT_CORRECT",
                "kind": item.get("kind", ""),
            }
        )
    missing = [e["task_path"] for e in entries if not Path(e["task_path"]).exists()]
    if missing:
        raise SystemExit(f"tasks missing under {tasks_dir}: {missing[:3]}")
    return entries


_SOURCES = {}


def read_source(path):
    if path not in _SOURCES:
        _SOURCES[path] = Path(path).read_text()
    return _SOURCES[path]


def request_for(entry, request_id, *, suffix="", measure=True, census=True):
    """The EvaluateRequest (proto3 JSON) of an entry; `suffix` is appended to the candidate's source."""
    request = {
        "requestId": request_id,
        "task": {"taskId": entry["task_id"], "source": read_source(entry["task_path"])},
        "candidateSource": read_source(entry["candidate_path"]) + suffix,
        "backend": BACKENDS[entry["backend"]],
        "measurePerformance": measure,
        "census": census,
    }
    if entry.get("policy"):
        request["policy"] = entry["policy"]
    return request


# ------------------------------------------------------------------------------------------------- results


_WRITE = threading.Lock()


def append_jsonl(path, record):
    line = json.dumps(record, sort_keys=True)
    with _WRITE, open(path, "a") as f:
        f.write(line + "\n")
        f.flush()


def read_jsonl(path):
    records = []
    if Path(path).exists():
        for raw in Path(path).read_text().splitlines():
            line = raw.strip()
            if line:
                with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a killed command
                    records.append(json.loads(line))
    return records


def _run(args, timeout=60):
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"({' '.join(map(str, args))}: {error})"


VERSIONS_PY = r"""
import os, platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
    if torch.cuda.is_available():
        print("torch device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
except Exception as e:
    print("torch unavailable:", e)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton unavailable:", e)
"""


def git_state():
    if not (REPO / ".git").exists():
        return "(no .git: a copy of the working tree)"
    head = _run(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(REPO), "status", "--porcelain"]).splitlines()
    return f"{head} ({len(dirty)} files changed or untracked)"


def record_machine(out_dir, python, kforge, note=""):
    """Appends the machine's facts to OUT/machine.txt (one block per invocation, so split runs show their machines)."""
    smi = _run(["nvidia-smi", "-q"])
    header = []
    for line in smi.splitlines():
        if line.startswith("GPU 0"):
            break
        if line.strip() and not line.startswith("="):
            header.append(line.rstrip())
    gpu = [
        line.strip()
        for line in smi.splitlines()
        if line.strip().startswith(
            (
                "Product Name",
                "Product Architecture",
                "GPU Part Number",
                "VBIOS Version",
                "Persistence Mode",
                "Compute Mode",
            )
        )
    ]
    try:
        cpus_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus_usable = os.cpu_count()
    cpu_model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    lines = [
        f"## {time.strftime('%Y-%m-%d %H:%M:%S %Z')} {note}",
        f"command: {' '.join(sys.argv)}",
        f"host: {socket.gethostname()}",
        "nvidia-smi -q:",
        *[f"  {line}" for line in header + gpu],
        f"cpus: {os.cpu_count()} (usable {cpus_usable}) {cpu_model}",
        f"kforge: {kforge} {_run([str(kforge), '--version'])}",
        f"git: {git_state()}",
        f"nvcc: {(_run(['nvcc', '--version']).splitlines() or [''])[-1]}",
        _run([python, "-c", VERSIONS_PY], timeout=120),
        "",
    ]
    with open(Path(out_dir) / "machine.txt", "a") as f:
        f.write("\n".join(lines) + "\n")


def percentile(values, p):
    """Linear interpolation between closest ranks (numpy's default), p in [0, 100]."""
    values = sorted(values)
    if not values:
        return None
    rank = (len(values) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (rank - low)
