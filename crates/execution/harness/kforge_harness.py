"""kforge evaluation harness: the only code that runs next to candidate kernels.

The evaluator (Rust) starts this file in a fresh sandboxed process per stage:

    python kforge_harness.py

The process imports torch first, then reads `{"protocol", "mode", "spec", "env"}` as JSON from stdin until EOF: the
evaluator may start it before a device is free and write the request once it holds the device, so the interpreter's
start and torch's import are not spent on the device's time. The seeds and paths of the spec never touch the disk.
The result is written as JSON to `spec["result_path"]`, with the time of each phase under `phases_ms`. Stages on a
device share it with other evaluations' stages, except timed work, which runs alone (`Gate`).

The protocol (`SPECS`, `RESULTS`) is the evaluator's `protocol.rs`, versioned by `PROTOCOL_VERSION`: a request of
another version is refused (a result saying so, exit status `REFUSED_EXIT`), a spec is checked against its mode's
fields before anything runs, and every result names the version and holds only its mode's fields. Modes:

- compile:   import the candidate module (building its load_inline extensions into TORCH_EXTENSIONS_DIR), and
             list the kernels compiled into them.
- reference: run the task's reference Model on the trial inputs; save its outputs; then, when given a candidate's
             saved outputs, compare them. Clean process, no candidate code.
- candidate: run ModelNew on the same inputs; save its outputs; optionally time it (raw samples only), take a
             kernel census, run calls for a profiler, and run the last trials again after timing. Integrity checks
             report findings.
- check:     compare a candidate's saved outputs with cached reference outputs. Clean process, no candidate code.
- baseline:  time the reference eagerly and under torch.compile. Clean process.
- bindings_pch: precompile torch/extension.h for load_inline's bindings, with the flags torch gives them. No
             candidate code.

Statistics, the profiling ratio and the census checks are computed by the evaluator from raw data; this file only
measures. It works with PyTorch 2.11
and later, on CPU and CUDA.
"""

import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import resource
import shlex
import sys
import threading
import time
import traceback

# The harness's own references to what it measures and saves with, taken before any candidate code runs: a
# candidate that patches these module attributes changes neither the harness's clock nor its channel.
_perf_counter_ns = time.perf_counter_ns
_monotonic = time.monotonic
_getrusage = resource.getrusage
_json_dump = json.dump
_open = open
_exit = os._exit


# ------------------------------------------------------------------------------------------------- protocol

# The version of the messages below; the evaluator's `protocol::PROTOCOL_VERSION` must be the same.
PROTOCOL_VERSION = 7
# The exit status of a harness that refused a request of another protocol version.
REFUSED_EXIT = 5

_PATH, _INT, _BOOL, _LIST, _DICT, _STR, _NONE = str, int, bool, list, dict, str, type(None)

# What every spec carries besides its mode's fields: where the result goes, and the stage's part in the gate
# (false: none; "share" or "idle").
FRAMING = {"result_path": _PATH, "gate": (_BOOL, _STR)}

# Each mode's spec: field -> accepted types (None: the field may be null). The evaluator sends every field.
_COMPARE = {
    "task_path": _PATH, "device": _STR, "init_seed": _INT, "seeds": _LIST, "reference_dir": _PATH,
    "candidate_dir": _PATH, "tolerances": _DICT, "timing_seeds": _LIST, "sensitivity": (_DICT, _NONE),
    "replay": (_INT, _NONE), "output_bytes_budget": _INT, "timed_outputs": _LIST, "digest_key": _INT,
}
SPECS = {
    "compile": {"candidate_path": _PATH, "kernels": _BOOL},
    "candidate": {
        "init_seed": _INT, "seeds": _LIST, "recheck_from": _INT, "sensitivity": (_DICT, _NONE),
        "replay": (_INT, _NONE), "output_bytes_budget": _INT, "timing": (_DICT, _NONE), "timing_seeds": _LIST,
        "census_calls": _INT, "profiled_calls": _INT, "task_path": _PATH, "candidate_path": _PATH,
        "candidate_dir": _PATH, "device": _STR, "timing_cpu": (_INT, _NONE), "keep_timed": (_DICT, _NONE),
    },
    "reference": _COMPARE,
    "check": _COMPARE,
    "baseline": {
        "task_path": _PATH, "device": _STR, "init_seed": _INT, "timing": _DICT, "timing_seeds": _LIST,
        "compile": _BOOL, "timing_cpu": (_INT, _NONE),
    },
    "bindings_pch": {"out_dir": _PATH, "variants": _DICT, "cuda": _BOOL},
}

# What every result may carry, and each mode's own fields (read by the evaluator as documented there).
COMMON_RESULT = {"protocol", "ok", "error", "error_type", "phase", "cpu_ms", "phases_ms", "blocking_sync"}
RESULTS = {
    "compile": {"seconds", "kernels", "kernels_unread"},
    "candidate": {"mutated_inputs", "findings", "samples_ms", "host_ms", "rounds", "timed_outputs", "timing_cpu",
                  "census", "device_peak_bytes", "jit_kernels"},
    "reference": {"mismatch", "compared_trials", "device_peak_bytes", "output_bytes"},
    "check": {"mismatch", "compared_trials"},
    "baseline": {"eager_ms", "eager_host_ms", "eager_rounds", "compile_ms", "compile_error", "timing_cpu"},
    "bindings_pch": {"built", "failed", "host"},
}

# The mode of this process's request, once read: which result fields it may write.
MODE = None


class ProtocolError(Exception):
    """A request this harness cannot read: another protocol version, or a spec unlike its mode's."""


def check_request(request):
    """The request's mode and spec, checked against `SPECS`; ProtocolError when it does not fit."""
    if not isinstance(request, dict):
        raise ProtocolError(f"the request is a {type(request).__name__}, not an object")
    version = request.get("protocol")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"this harness speaks protocol version {PROTOCOL_VERSION}, the evaluator sent "
                            f"{'none' if version is None else version}: the harness file belongs to another kforge "
                            "version")
    mode, spec = request.get("mode"), request.get("spec")
    if mode not in SPECS:
        raise ProtocolError(f"unknown mode {mode!r}")
    if not isinstance(spec, dict):
        raise ProtocolError(f"the {mode} spec is not an object")
    fields = {**SPECS[mode], **FRAMING}
    missing, unknown = sorted(set(fields) - set(spec)), sorted(set(spec) - set(fields))
    if missing or unknown:
        raise ProtocolError(f"the {mode} spec lacks {missing} and has unknown fields {unknown}")
    for name, accepted in fields.items():
        value = spec[name]
        # bool is an int in Python: only fields that take booleans take them.
        wrong_bool = isinstance(value, bool) and _BOOL not in (accepted if isinstance(accepted, tuple) else (accepted,))
        if wrong_bool or not isinstance(value, accepted):
            raise ProtocolError(f"the {mode} spec's {name} is of type {type(value).__name__}")
    return mode, spec


def refuse(request, error):
    """Answers a request this harness cannot read with a result saying why, where the request names a place for
    it, and exits with REFUSED_EXIT."""
    print(f"kforge harness: {error}", file=sys.stderr)
    spec = request.get("spec") if isinstance(request, dict) else None
    path = spec.get("result_path") if isinstance(spec, dict) else None
    if isinstance(path, str):
        with _open(path, "w") as f:
            _json_dump({"protocol": PROTOCOL_VERSION, "ok": False, "error_type": "ProtocolError", "phase": "request",
                        "error": str(error)}, f)
    sys.exit(REFUSED_EXIT)


PHASES_MS = {}
# Whether this process waits for its GPU asleep (`blocking_sync`); None off the GPU.
BLOCKING_SYNC = None


class phase:
    """Adds the wall time of a block to PHASES_MS[name]: where a stage's time goes, reported with its result."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.started = _monotonic()

    def __exit__(self, *exc):
        PHASES_MS[self.name] = PHASES_MS.get(self.name, 0.0) + (_monotonic() - self.started) * 1000.0
        return False


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def json_safe(value):
    """Non-finite floats as proto3 JSON spells them ("NaN", "Infinity", "-Infinity"): bare NaN is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_result(spec, result):
    undeclared = sorted(set(result) - COMMON_RESULT - RESULTS.get(MODE, set()))
    if undeclared:
        raise ProtocolError(f"the {MODE} result has undeclared fields {undeclared}")
    result["protocol"] = PROTOCOL_VERSION
    result["phases_ms"] = dict(PHASES_MS)
    if BLOCKING_SYNC is not None:
        result["blocking_sync"] = BLOCKING_SYNC
    # CPU time of this process and of the children it waited for (the compilers of a build), for the evaluator's
    # account of where CPU time goes.
    spent = [_getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result["cpu_ms"] = sum(usage.ru_utime + usage.ru_stime for usage in spent) * 1000.0
    with _open(spec["result_path"], "w") as f:
        _json_dump(json_safe(result), f, allow_nan=False)


def device_of(spec):
    import torch

    return torch.device(spec["device"])


def to_device(value, device):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_inputs(task, seed, device):
    """The task's inputs for `seed`, made where they are used: `get_inputs` runs with `device` as torch's default
    device, so tensors it draws from torch's generators are drawn on the device (no host copy; a device's generator
    gives the same values for a seed in every process). A task whose get_inputs cannot run that way (host-only code)
    runs on the host instead; every process takes the same path for the same task."""
    import torch

    torch.manual_seed(seed)
    if device.type != "cpu":
        try:
            with torch.device(device):
                return to_device(list(task.get_inputs()), device)
        except torch.cuda.OutOfMemoryError:
            # Not a property of the task: another process may make these inputs on the device, and the host's
            # generator would give other values. The stage fails instead (the evaluator retries it alone).
            raise
        except Exception:
            torch.manual_seed(seed)
    return to_device(list(task.get_inputs()), device)


# Elements of each floating-point input moved far out of range on the sensitivity trial.
SENSITIVITY_ELEMENTS = 4


def trial_inputs(task, spec, trial, device):
    """The inputs of correctness trial `trial`; on the sensitivity trial (`spec["sensitivity"]`), its base trial's
    inputs with a few elements moved far out of range (`perturb_sparsely`)."""
    inputs = make_inputs(task, spec["seeds"][trial], device)
    sensitivity = spec.get("sensitivity")
    if sensitivity and trial == sensitivity["trial"]:
        perturb_sparsely(inputs, sensitivity["seed"])
    return inputs


def perturb_sparsely(inputs, seed):
    """Moves SENSITIVITY_ELEMENTS elements of each floating-point input tensor, at positions drawn from `seed`, far
    out of range, keeping each element's sign (positive inputs stay positive). The g-th moved element (counted over
    all inputs) becomes 64 * (1 + the tensor's largest magnitude) * 3**g, capped at the square root of its dtype's
    largest value: each change outweighs all the earlier ones together, so a computation on a sample of the input,
    scaled up to the whole, cannot reproduce how the output moves (whichever elements the sample holds). Integer
    and boolean tensors (indices, labels, masks) and non-contiguous ones are left alone."""
    import torch

    generator = torch.Generator().manual_seed(seed % (1 << 62))
    moved = 0
    with torch.no_grad():
        for value in inputs:
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
                continue
            if not value.is_contiguous():
                continue
            flat = value.view(-1)
            count = min(SENSITIVITY_ELEMENTS, flat.numel())
            positions = torch.randperm(flat.numel(), generator=generator)[:count] if flat.numel() <= count else \
                torch.randint(flat.numel(), (count,), generator=generator)
            base = 64.0 * (1.0 + float(flat.abs().max()))
            cap = float(torch.finfo(flat.dtype).max) ** 0.5
            for position in positions.tolist():
                magnitude = min(base * 3.0 ** moved, cap)
                flat[position] = -magnitude if float(flat[position]) < 0 else magnitude
                moved += 1


def make_model(cls, task, init_seed, device):
    import torch

    torch.manual_seed(init_seed)
    init_inputs = to_device(list(task.get_init_inputs()), device)
    return cls(*init_inputs).to(device)


def flatten_outputs(output):
    """A model's output as a list of values; tuples and lists are flattened one level, in order."""
    if isinstance(output, (list, tuple)):
        return list(output)
    return [output]


# Elements per step of the device-side digest and comparison: bounds their temporary memory (a few hundred MB).
CHUNK_ELEMENTS = 1 << 25


def saved_outputs(output):
    """Outputs in the saved form (see write_outputs), left on their device: for comparing in this process."""
    import torch

    return [{"exact_tensor": type(v) is torch.Tensor, "device": str(v.device), "tensor": v.detach()}
            if isinstance(v, torch.Tensor) else {"exact_tensor": False, "device": "", "value": repr(v)[:200]}
            for v in flatten_outputs(output)]


def tensor_digest(values, key=None):
    """A digest of tensors' bytes, computed where they live (no copy to the host): per tensor, the wrapping sums of
    its 32-bit words (bytes where the size is not a multiple of 4) and of those words times a weight per position:
    a multiplicative hash of the position, or with `key` a random draw from a generator seeded with it, so that
    changes that cancel out cannot be chosen without the key. Any change of a word changes it unless a second change
    cancels it exactly; it compares a tensor with itself earlier in the same process (inputs the candidate must not
    write), or an outputs file with the outputs it was written from (`outputs_digest`)."""
    import torch

    parts = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        flat = as_bytes(value.detach())
        words = flat
        if flat.numel() % 4 == 0:
            try:
                words = flat.view(torch.int32)
            except RuntimeError:  # a view whose first byte is not 4-aligned (a half tensor at an odd offset)
                words = flat.clone().view(torch.int32)
        plain = torch.zeros((), dtype=torch.int64, device=flat.device)
        weighted = torch.zeros_like(plain)
        for start in range(0, words.numel(), CHUNK_ELEMENTS):
            chunk = words[start:start + CHUNK_ELEMENTS].to(torch.int64)
            if key is None:
                position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
                weight = position * 2654435761 + 97531
            else:
                draws = torch.Generator(device=flat.device).manual_seed((key * 1_000_003 + start) % (1 << 62))
                weight = torch.randint(-(1 << 62), 1 << 62, (chunk.numel(),), generator=draws, dtype=torch.int64,
                                       device=flat.device)
            plain += chunk.sum()
            weighted += (chunk * weight).sum()
        parts.append(torch.stack([plain, weighted]))
    return tuple(torch.stack(parts).flatten().tolist()) if parts else ()


# ---------------------------------------------------------------------------------------------------- timing


class Originals:
    """torch's timing and synchronisation functions, and the tensor methods, event calls, file calls and C library
    that writing outputs uses (in the caller's stream order, where a replaced one could synchronise first), as they
    were before the candidate was imported."""

    def __init__(self, torch):
        self.synchronize = torch.cuda.synchronize
        self.event = torch.cuda.Event
        self.event_record = torch.cuda.Event.record
        self.event_elapsed = torch.cuda.Event.elapsed_time
        self.sleep = torch.cuda._sleep
        self.current_stream = torch.cuda.current_stream
        self.stream = torch.cuda.stream
        self.detach = torch.Tensor.detach
        self.resolve_conj = torch.Tensor.resolve_conj
        self.resolve_neg = torch.Tensor.resolve_neg
        self.contiguous = torch.Tensor.contiguous
        self.to = torch.Tensor.to
        self.clone = torch.Tensor.clone
        self.data_ptr = torch.Tensor.data_ptr
        self.copy = torch.Tensor.copy_
        self.reshape = torch.Tensor.reshape
        self.view = torch.Tensor.view
        self.narrow = torch.Tensor.narrow
        self.numpy = torch.Tensor.numpy
        self.numel = torch.Tensor.numel
        self.element_size = torch.Tensor.element_size
        self.event_synchronize = torch.cuda.Event.synchronize
        self.event_query = torch.cuda.Event.query
        self.zero = torch.Tensor.zero_
        self.from_file = torch.from_file
        self.os_open = os.open
        self.pwrite = os.pwrite
        self.fallocate = os.posix_fallocate
        self.ftruncate = os.ftruncate
        self.close = os.close
        self.memoryview = memoryview
        libc_memory()  # loaded (and kept) now: ctypes.CDLL is the candidate's to replace later


ORIGINALS = None


def originals():
    global ORIGINALS
    if ORIGINALS is None:
        import torch

        ORIGINALS = Originals(torch)
    return ORIGINALS


class Gate:
    """The harness's side of the device gate: stages share their device, except timed work, which runs alone.

    With `spec["gate"]`, descriptor 3 is a socket to the evaluator. Before timed work the harness synchronises its
    device work and asks to run alone; the evaluator stops this process until every other process on the device
    stands at such a point (and is stopped) or is idle, then lets it go. After, it synchronises again and asks to
    share. Between steps of shared work it passes pause points, where it is stopped while another process runs alone
    or waits to. A trusted stage (`spec["gate"] == "idle"`) starts idle: it asks to share before its device work,
    and may go idle again for host work. The socket's methods are bound here, before any candidate code runs, so
    replacing them later changes nothing."""

    def __init__(self, joining, timing_cpu=None):
        self.send = self.recv = None
        self.is_idle = self.trusted = joining == "idle"
        self.timing_cpu = timing_cpu
        if joining:
            import socket

            channel = socket.socket(fileno=3)
            self.send, self.recv = channel.sendall, channel.recv

    def ask(self, message, device, sync=True):
        if self.send is None:
            return
        if sync:
            synchronize(device)
        with phase("gate"):  # time waiting for the device (stopped), reported as the `gate` phase
            self.send(message)
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < 16:
                chunk = self.recv(16)
                if not chunk:
                    raise RuntimeError("the evaluator closed the device gate")
                reply += chunk
        if reply != b"go\n":
            raise RuntimeError(f"unexpected answer from the device gate: {reply!r}")

    @contextlib.contextmanager
    def alone(self, device):
        """Runs the block alone on the device, its launching thread on the CPU kept free of other stages (the
        evaluator's `timing_cpu`). A block that raises ends the stage: no need to share again."""
        self.ask(b"alone\n", device)
        with pinned_to(self.timing_cpu):
            yield
        self.ask(b"share\n", device)

    @contextlib.contextmanager
    def round(self, device):
        """One round of paired timing: run alone once it is this stage's turn (the candidate's and its baseline's
        rounds alternate), its launching thread pinned as in `alone`. Sharing again after it passes the turn."""
        self.ask(b"round\n", device)
        with pinned_to(self.timing_cpu):
            yield
        self.ask(b"share\n", device)

    def call(self, timed=False):
        """Tells the evaluator that candidate code starts now: it is stopped as hung if it runs past its call limit
        before the next message. A timed call waits for its GPU spinning, so its CPU use says nothing and its limit
        does not stretch for it. One way: no answer to wait for."""
        if self.send is not None:
            self.send(b"timed\n" if timed else b"call\n")

    def pause(self, device):
        """A pause point between steps of shared work: stopped here while another process runs alone or waits to."""
        self.ask(b"pause\n", device)

    @contextlib.contextmanager
    def host_work(self, device):
        """Host work only in the block (reading outputs' files into the page cache). A trusted stage that joined
        idle goes idle for it, so it holds nobody up and runs on while others run alone, and shares again after,
        waiting while anyone runs alone or waits to. Any other stage runs the block as it is: without a gate, or as
        a solo member (an evaluation retried alone, its checker included), it has the device to itself; a
        candidate's stage does no host work between its pause points."""
        if not self.trusted:
            yield
            return
        was_idle = self.is_idle
        self.idle(device)
        yield
        if not was_idle:
            self.share(device)

    def share(self, device):
        """Before a trusted stage's device work: leaves idle, waiting while timed work runs."""
        if self.is_idle:
            self.ask(b"share\n", device, sync=False)  # nothing ran on the device while idle
            self.is_idle = False

    def idle(self, device):
        """A trusted stage's host work from here on: it holds nobody up."""
        if not self.is_idle:
            self.ask(b"idle\n", device)
            self.is_idle = True


GATE = Gate(False)


@contextlib.contextmanager
def pinned_to(cpu):
    """Runs the block with the calling thread on `cpu` alone (other threads keep their CPUs); then as before."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        before = None  # not ours to use here (a cpuset without it): timing runs where it was
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


def thread_cpu_wait():
    """(ns this thread waited runnable for a CPU, its involuntary context switches) so far: what competition for
    the CPU cost the timed loop. (None, None) where the kernel does not say."""
    try:
        with _open("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        waited = None
    switches = _getrusage(resource.RUSAGE_THREAD).ru_nivcsw if hasattr(resource, "RUSAGE_THREAD") else None
    return waited, switches


def set_sync(spin):
    """Switches how this process waits for its GPU from now on: spinning (`spin`: the fastest wake-up, for the
    timed loop on its reserved CPU, as an independent timer waits) or asleep (`blocking_sync`). Returns whether the
    driver took it (cuCtxSetFlags, CUDA 12.1 and later)."""
    import ctypes

    if not BLOCKING_SYNC:
        return False
    try:
        return libcuda().cuCtxSetFlags(ctypes.c_uint(1 if spin else 4)) == 0
    except (OSError, AttributeError):
        return False


@functools.cache
def libcuda():
    """The CUDA driver library, loaded once (the same library torch's runtime uses)."""
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def blocking_sync():
    """Makes this process wait for its GPU asleep instead of spinning (CU_CTX_SCHED_BLOCKING_SYNC on the primary
    context, before torch creates it): a process waiting on a kernel that never ends then uses no CPU, which is how
    the evaluator tells a hung call from a busy one, and waiting neighbours leave the CPUs to work that needs them.
    Returns whether it took effect."""
    import ctypes

    try:
        cuda = libcuda()
        device = ctypes.c_int()
        return (cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
                and cuda.cuDevicePrimaryCtxSetFlags_v2(device, 4) == 0)
    except (OSError, AttributeError):
        return False


def synchronize(device):
    if device.type == "cuda":
        originals().synchronize(device)


# Outputs files (`write_outputs`, `load_outputs`): this magic, the JSON header's length (8 bytes, little-endian), the
# header, then each tensor's bytes as they lie in memory, every part starting on a multiple of OUTPUTS_ALIGN.
OUTPUTS_MAGIC = b"KFOUT1\n\0"
OUTPUTS_ALIGN = 64
OUTPUTS_HEADER_LIMIT = 1 << 20


def aligned(n):
    return -(-n // OUTPUTS_ALIGN) * OUTPUTS_ALIGN


def write_outputs(output, path, stream=None, private=False):
    """Writes a model's output for another process of the evaluation to read (`load_outputs`): a JSON header (each
    output's dtype, shape and place, or the repr of a value that is not a tensor), then each tensor's bytes as they
    are, at 64-byte aligned offsets. No pickle and no checksum: torch.save computed a CRC32 per record at about
    1 GB/s on one core. On a memory filesystem (/dev/shm), a device tensor is copied off its device in chunks
    through two pinned buffers, each chunk written (pwrite) while the next one copies; on a disk, the file's room is
    allocated and mapped, and each tensor copied into its place (`write_tensor`: what measured fastest on each).
    A full filesystem is an error here. With `stream`, everything that reads the output (resolving conjugate and
    negative views, making it contiguous, the copies) is ordered on that stream, as a consumer on it would read.
    Without `private`, one tensor at a time, so at most one contiguous copy is held on the device. With `private`
    (outputs of at most RACE_CHECK_BYTES), every tensor is first copied on the device, all before any is copied to
    host memory of the harness's own, and the file is written from those host copies, which are what is returned:
    the file is in the candidate's folder, and the candidate's code could rewrite it.

    Returns the outputs in the saved form: `exact_tensor` (the value's type is torch.Tensor itself), `device`, and
    with `private` `tensor` (the copy), or `value` for what is not a tensor."""
    import torch

    o = originals()
    values = flatten_outputs(output)
    # What is written: with `private`, the harness's own copies, taken before any host work. Each output is first
    # copied on the stream (`as_written`'s copy where it made one, else a clone), the copies enqueued one after the
    # other with no host synchronisation between them, then each is copied to the host: work the stream is not
    # ordered after has only until those copies run to end and hide a race (at most RACE_CHECK_BYTES of copies on the
    # device). A copy off the device is already the harness's own; so is a CPU tensor's copy.
    written = values
    if private:
        with o.stream(stream) if stream is not None else contextlib.nullcontext():
            written = [own_copy(value) if isinstance(value, torch.Tensor) else value for value in values]
            written = [o.to(copy, "cpu") if isinstance(copy, torch.Tensor) else copy for copy in written]
    items, offset = [], 0
    for value in values:
        if not isinstance(value, torch.Tensor):
            items.append({"exact_tensor": False, "device": "", "value": repr(value)[:200]})
            continue
        nbytes = value.numel() * value.element_size()
        items.append({"exact_tensor": type(value) is torch.Tensor, "device": str(value.device),
                      "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                      "offset": offset, "nbytes": nbytes})
        offset += aligned(nbytes)
    header = json.dumps({"items": items}).encode()
    if len(header) > OUTPUTS_HEADER_LIMIT:
        raise ValueError(f"{len(items)} outputs: more than an outputs file's header holds")
    start = aligned(len(OUTPUTS_MAGIC) + 8 + len(header))
    saved = []
    fd = o.os_open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        pwrite_all(fd, OUTPUTS_MAGIC + len(header).to_bytes(8, "little") + header, 0)
        mapping = None
        if offset and not memory_backed(fd):
            o.fallocate(fd, start, offset)  # a full disk is an error here, not a SIGBUS in the copy
            mapping = o.from_file(f"/proc/self/fd/{fd}", shared=True, size=start + offset, dtype=torch.uint8)
        with o.stream(stream) if stream is not None else contextlib.nullcontext():
            for value, item in zip(written, items):
                if "dtype" not in item:
                    saved.append(item)
                    continue
                tensor = as_written(value)  # a private copy is as written already: the same memory
                write_tensor(fd, tensor, start + item["offset"], mapping)
                entry = {"exact_tensor": item["exact_tensor"], "device": item["device"]}
                if private:
                    entry["tensor"] = tensor
                saved.append(entry)
                del tensor
        o.ftruncate(fd, start + offset)  # the padding after the last tensor
    finally:
        o.close(fd)
    return saved


def own_copy(value):
    """`as_written(value)` in memory of its own: the same tensor cloned where `as_written` made no copy."""
    o = originals()
    written = as_written(value)
    return o.clone(written) if o.data_ptr(written) == o.data_ptr(value) else written


def as_written(value):
    """A tensor output as `write_outputs` writes its bytes: conjugate and negative views resolved, contiguous."""
    o = originals()
    return o.contiguous(o.resolve_neg(o.resolve_conj(o.detach(value))))


# On a memory filesystem, a device tensor larger than a sixteenth of this goes to its file through pinned staging
# buffers of this size (two, made once per process); a smaller one is copied to host memory at once. Measured on H100
# and H200 hosts (bench/results/evaluator-outputs-io/2026-11-27): a 4 GiB output written to /dev/shm took 3.4-3.9 s
# mapped (one page fault per 4 KiB, the driver's pageable copy) and 1.4-1.7 s staged; to a disk's page cache,
# 1.1 s mapped and 0.9-2.8 s staged.
STAGING_BYTES = 64 << 20
STAGING = []


def staging_buffers():
    """The process's two staging buffers: pinned host memory where the device allows it, pageable otherwise. Making
    pinned memory synchronises the device, so a candidate's process makes them before the candidate is imported
    (`mode_candidate`), where its outputs will be staged."""
    import torch

    if not STAGING:
        try:
            buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        except RuntimeError:
            buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8) for _ in range(2)]
        STAGING[:] = buffers
    return STAGING


def write_tensor(fd, tensor, at, mapping=None):
    """Writes a contiguous tensor's bytes at offset `at` of the file: into the file's `mapping` where there is one (a
    copy on the current stream); else a CPU tensor's (or a small device tensor's host copy) at once, and a device
    tensor's in chunks through the staging buffers (`write_staged`), each written once its copy is done (an event on
    the current stream, not a device-wide synchronisation) while the next one copies."""
    import torch

    o = originals()
    nbytes = o.numel(tensor) * o.element_size(tensor)
    if nbytes == 0:
        return
    flat = o.view(o.reshape(tensor, (-1,)), torch.uint8)
    if mapping is not None:
        o.copy(o.narrow(mapping, 0, at, nbytes), flat)
        return
    if flat.device.type == "cpu" or nbytes <= STAGING_BYTES // 16:
        host = flat if flat.device.type == "cpu" else o.to(flat, "cpu")
        pwrite_all(fd, o.numpy(host), at)
        return
    write_staged(fd, flat, at, nbytes)


def write_staged(fd, flat, at, nbytes):
    """Writes a flat byte tensor of a device through the staging buffers: chunk i is copied on the current stream
    into buffer i % 2 and an event recorded; then chunk i - 1, its event reached, is written while chunk i copies."""
    o = originals()
    buffers, events, pending = staging_buffers(), [None, None], None

    def write(slot, done, length):
        o.event_synchronize(events[slot])
        pwrite_all(fd, o.numpy(o.narrow(buffers[slot], 0, 0, length)), at + done)

    try:
        for index, done in enumerate(range(0, nbytes, STAGING_BYTES)):
            slot, length = index % 2, min(STAGING_BYTES, nbytes - done)
            o.copy(o.narrow(buffers[slot], 0, 0, length), o.narrow(flat, 0, done, length), non_blocking=True)
            events[slot] = o.event()
            o.event_record(events[slot])
            if pending is not None:
                write(*pending)
            pending = (slot, done, length)
        write(*pending)
    finally:
        # A write that failed leaves no copy into a buffer running: the next write reuses them.
        for event in events:
            if event is not None:
                o.event_synchronize(event)


def memory_backed(fd):
    """Whether the open file (or directory) lies on a memory filesystem (tmpfs or ramfs, by fstatfs's f_type)."""
    import ctypes

    buffer = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on x86-64); f_type, a long, comes first
    if libc_memory().fstatfs(fd, buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF in (TMPFS_MAGIC, RAMFS_MAGIC)


# statfs magic numbers of filesystems that keep their files in memory (as the evaluator's handoff.rs).
TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458F6


def staged_outputs(folder):
    """Whether outputs written in `folder` go through the staging buffers (it lies on a memory filesystem)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        return memory_backed(fd)
    finally:
        os.close(fd)


def pwrite_all(fd, data, at):
    """Writes all of a bytes-like object at offset `at` (one pwrite moves at most about 2 GiB)."""
    o = originals()
    view = o.memoryview(data).cast("B")
    while view:
        written = o.pwrite(fd, view, at)
        if written <= 0:
            raise OSError(f"pwrite wrote {written} bytes")
        view, at = view[written:], at + written


def open_regular(path):
    """A read-only descriptor of `path` if it is a regular file (not a link, a FIFO or a device: the candidate's
    process writes its own outputs' folder), and its size; OSError otherwise."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(f"{os.path.basename(path)} is not a regular file")
    return fd, info.st_size


def load_outputs(path, device):
    """Outputs `write_outputs` wrote, onto `device`: the file is mapped, not read into memory first, and for a device
    its pages are made in one call (`populate`: a 4 GiB file onto an H100 in 0.74 s against 0.86 s faulting page by
    page, 0.56 s against 0.93 s with six such loads at once). The file may be the candidate's process's: it must be
    a regular file laid out exactly as `write_outputs` lays it out (tensors one after the other, the file ending
    with the last), with known dtypes and sizes that match the bytes, or nothing is loaded (an exception)."""
    import torch

    fd, size = open_regular(path)
    try:
        head = os.pread(fd, len(OUTPUTS_MAGIC) + 8, 0)
        if len(head) < len(OUTPUTS_MAGIC) + 8 or not head.startswith(OUTPUTS_MAGIC):
            raise ValueError("not an outputs file")
        length = int.from_bytes(head[len(OUTPUTS_MAGIC):], "little")
        if length > OUTPUTS_HEADER_LIMIT:
            raise ValueError("outputs header too long")
        header = json.loads(os.pread(fd, length, len(head)))
        start = aligned(len(head) + length)
        items, offset = [], 0
        for item in header["items"]:
            if "dtype" not in item:
                items.append((item, None, None, None, 0))
                continue
            dtype = getattr(torch, str(item["dtype"]), None)
            shape = item["shape"]
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or len(shape) > 64 or \
                    not all(type(n) is int and 0 <= n <= size for n in shape):
                raise ValueError("outputs header: bad dtype or shape")
            nbytes = math.prod(shape) * dtype.itemsize
            if item["offset"] != offset or item["nbytes"] != nbytes:
                raise ValueError("outputs header: bad extent")
            items.append((item, dtype, shape, start + offset, nbytes))
            offset += aligned(nbytes)
        if size != start + offset:
            raise ValueError("outputs file: its size is not its header's")
        data = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=size, dtype=torch.uint8)
        if device.type != "cpu":
            populate(data)
    finally:
        os.close(fd)
    outputs = []
    for item, dtype, shape, at, nbytes in items:
        if dtype is None:
            outputs.append({"exact_tensor": False, "device": "", "value": str(item.get("value", ""))[:200]})
            continue
        tensor = data[at:at + nbytes].view(dtype).reshape(shape)
        outputs.append({"exact_tensor": item.get("exact_tensor") is True, "device": str(item.get("device", ""))[:64],
                        "tensor": tensor.to(device)})
    return outputs


def in_memory(fd, size):
    """Whether every page of the open file is in memory (the page cache, or a memory-backed filesystem such as the
    evaluator's outputs directory in /dev/shm): mincore(2) over a shared read-only mapping. False where it cannot
    tell; true, whatever is resident, for a file this process may not write (mincore pretends so since Linux 5.0)."""
    import ctypes

    if size == 0:
        return True
    libc = libc_memory()
    address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if address is None or address == ctypes.c_void_p(-1).value:
        return False
    try:
        pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(address, size, vector) != 0:
            return False
        return bytes(vector).count(0) == 0
    finally:
        libc.munmap(address, size)


def populate(mapped):
    """Makes every page of a mapped CPU tensor present in one call (madvise MADV_POPULATE_READ, Linux 5.14) rather
    than one fault per 4 KiB page as it is read; where that is refused, the pages fault as before."""
    if mapped.numel():
        libc_memory().madvise(mapped.data_ptr(), mapped.numel(), 22)


@functools.cache
def libc_memory():
    """The C library with mmap, munmap, mincore, madvise and fstatfs typed, loaded once."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return libc


def prefetch(paths, device):
    """Reads files into the page cache as host work (see Gate.host_work), so that loading them onto the device
    after, while sharing it, copies from memory instead of waiting for the disk. Only regular files, and no more
    than their size; one that cannot be read is left to the load, which reports it. A file already wholly in memory
    is not read (a 6 GiB trial's two files took 2.8 s to read again on an H200 host)."""
    buffer = bytearray(16 << 20)
    with GATE.host_work(device):
        for path in paths:
            try:
                fd, size = open_regular(path)
            except OSError:
                continue
            try:
                # mincore reports every page resident for a file its caller may not write: read such a file.
                if os.access(path, os.W_OK) and in_memory(fd, size):
                    continue
                done = 0
                while done < size:
                    read = os.readv(fd, [buffer])
                    if read <= 0:
                        break
                    done += read
            except OSError:
                pass
            finally:
                os.close(fd)


class Timer:
    """Times one call: CUDA events around it on a GPU, the monotonic clock on CPU; the L2 cache is flushed first.

    On a GPU the call is enqueued behind device work: after the flush, a spin kernel (`torch.cuda._sleep`) covers
    the host's time to launch the call, so the start event fires when the call's first kernel is already queued and
    the events measure the device's work, not the host's launch latency after the previous synchronisation. The
    cover is sized from the calls before (their launch time on the host, 1.5x plus 20 us) and never longer than the
    call's own device time plus the flush's plus 50 us: host work beyond what the device's backlog would hide, as in
    a stream of back-to-back flushed calls (do_bench's), still shows in the events. Each call also records whether
    the cover had run out before the host had enqueued the call and its end event (`short`): the calls whose time
    may include host launch time."""

    def __init__(self, device):
        import torch

        self.device = device
        self.flush_buffer = None
        self.cycles_per_ms = 0.0
        self.flush_ms = 0.0
        # Per call on a GPU: the cover asked for, the one the device ran (flushed -> start, by the events), and
        # whether it ran out before the host had enqueued the call.
        self.covers, self.covered, self.short = [], [], []
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            # Twice the L2 size, written between runs, so no run finds its data already cached.
            self.flush_buffer = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device=device)
            self.cycles_per_ms = spin_rate(device)
            self.flush_ms = self.flush_time()

    def flush_time(self):
        """The flush's device time: the median of five, after one untimed."""
        flush = functools.partial(originals().zero, self.flush_buffer)
        flush()
        return median_or_none([event_ms(self.device, flush) for _ in range(5)])

    def time_ms(self, fn, cover_ms=0.0):
        """(event ms, host ms, launch ms, result). The host clock spans the whole timed step (flush, call,
        synchronisation) less the cover, as the events measure it: the parent compares the two, so work the
        events miss still shows in wall-clock time. `launch ms` is the host's time inside `fn`."""
        begin = _perf_counter_ns()
        if self.flush_buffer is not None:
            o = originals()
            o.zero(self.flush_buffer)
            flushed = o.event(enable_timing=True)
            start = o.event(enable_timing=True)
            end = o.event(enable_timing=True)
            o.event_record(flushed)
            cycles = int(cover_ms * self.cycles_per_ms)
            if cycles > 0:
                o.sleep(cycles)
            o.event_record(start)
            launch = _perf_counter_ns()
            result = fn()
            launch = (_perf_counter_ns() - launch) / 1e6
            o.event_record(end)
            short = o.event_query(start)  # after the end event is enqueued: the timed work is not delayed
            o.synchronize(self.device)
            host = (_perf_counter_ns() - begin) / 1e6
            covered = o.event_elapsed(flushed, start)
            host -= covered
            self.covers.append(cover_ms)
            self.covered.append(covered)
            self.short.append(short)
            return o.event_elapsed(start, end), host, launch, result
        result = fn()
        host = (_perf_counter_ns() - begin) / 1e6
        return host, host, host, result


@functools.cache
def spin_rate(device):
    """Clock cycles per millisecond of `torch.cuda._sleep` on `device`, measured once per process (it spins for
    cycles)."""
    spin = functools.partial(originals().sleep, 1_000_000)
    spin()  # its first launch loads the kernel
    elapsed = event_ms(device, spin)
    return 1_000_000 / elapsed if elapsed > 0 else 0.0


def event_ms(device, work):
    """The device time of what `work()` enqueues, between two events, waited for."""
    o = originals()
    start, end = o.event(enable_timing=True), o.event(enable_timing=True)
    o.event_record(start)
    work()
    o.event_record(end)
    o.synchronize(device)
    return o.event_elapsed(start, end)


def share(flags):
    """The share of true values among `flags`, None when empty."""
    return sum(1 for flag in flags if flag) / len(flags) if flags else None


def median_or_none(values):
    """The median of `values` (the upper one of an even count), None when empty."""
    return sorted(values)[len(values) // 2] if values else None


def cover_ms(launches, device_ms, flush_ms=0.0):
    """How long the spin before the next timed call runs: enough to hide its launch (the 75th percentile of the
    recent calls' launch time, 1.5x plus 20 us), never more than its device time plus the flush's plus 50 us (what
    a stream of back-to-back flushed calls would have queued ahead of it)."""
    if not launches:
        return 0.1
    recent = sorted(launches[-20:])
    launch = recent[min(len(recent) - 1, (3 * len(recent)) // 4)]
    device = median_or_none(device_ms[-20:]) or 0.0
    return min(1.5 * launch + 0.02, device + flush_ms + 0.05)


def perturb(inputs, set_seed, call):
    """Gives a timed call inputs no earlier call has seen: a few elements of each input tensor take the values of
    other elements of the same tensor (so values stay in the task's domain: positive stays positive, indices valid).

    Deterministic in (set_seed, call), so a clean process can rebuild exactly the inputs of any timed call.
    Memoising on input pointers or contents then cannot pay, and the outputs of timed calls can be verified.
    """
    import torch

    generator = torch.Generator().manual_seed((set_seed * 1_000_003 + call) % (1 << 62))
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.numel() > 1 and value.is_contiguous():
            count = min(4, value.numel())
            positions = torch.randint(value.numel(), (2, count), generator=generator).to(value.device)
            with torch.no_grad():
                flat = value.view(-1)
                flat[positions[0]] = flat[positions[1]].clone()


# Timing input sets after the first are made only while all of them fit in this many bytes: a task whose inputs
# take gigabytes rotates fewer sets (each still perturbed per call).
TIMING_SETS_BYTES = 2 << 30


def tensor_bytes(values):
    """The bytes of the tensors among `values`."""
    import torch

    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def timing_set_count(first, seeds):
    """How many timing input sets rotate, given the first: one per seed, as many as fit in TIMING_SETS_BYTES."""
    return max(1, min(len(seeds), TIMING_SETS_BYTES // max(1, tensor_bytes(first))))


def timing_inputs(task, spec, device):
    """The rotating timing input sets (`timing_set_count` of them)."""
    seeds = spec["timing_seeds"]
    sets = [make_inputs(task, seeds[0], device)]
    count = timing_set_count(sets[0], seeds)
    sets.extend(make_inputs(task, seed, device) for seed in seeds[1:count])
    return sets


def timed_call_inputs(task, spec, device, call):
    """The inputs of timed call `call`, rebuilt: its set (as timing_inputs rotates them) after every perturbation
    up to that call."""
    seeds = spec["timing_seeds"]
    inputs = make_inputs(task, seeds[0], device)
    count = timing_set_count(inputs, seeds)
    which = call % count
    if which != 0:
        del inputs
        inputs = make_inputs(task, seeds[which], device)
    for earlier in range(which, call + 1, count):
        perturb(inputs, seeds[which], earlier)
    return inputs


def sampled_timed_calls(output_bytes, keep):
    """How many timed calls' outputs of `output_bytes` each are kept besides the last: at most the spec's
    `keep_timed["sampled_calls"]`, while together they fit in its `sampled_bytes` (a copy of each is held on the
    device during the loop; the evaluator's `disk::sampled_timed_calls` reserves their room alike)."""
    return min(keep["sampled_calls"], keep["sampled_bytes"] // max(1, output_bytes))


class NotATensor:
    """What a sampled call kept in place of an output that is not a tensor (its repr, taken when the call returned),
    or of a tensor whose type is not torch.Tensor itself (a subclass's methods could answer for it later): either
    is written as a value that is not a tensor, which the checker's comparison refuses where a tensor is expected."""

    def __init__(self, value):
        self.text = repr(value)[:200] if not _is_tensor(value) else f"a {type(value).__name__}, not a torch.Tensor"

    def __repr__(self):
        return self.text


class TimedSample:
    """A uniform random sample of the measured calls' outputs (reservoir sampling), each drawn after its call
    returned, with the operating system's randomness: a candidate cannot tell which of its calls are kept, so one
    wrong on a share of its timed calls is caught with the chance that a kept call, or the last, is one of them.
    One slot more than `sampled_timed_calls` allows is drawn, so that `calls(last)` still has that many once the
    last call (whose output is kept anyway) is left out. Copies are taken after the call's timed step and
    synchronised before the next one starts. The sample's size follows from the spec's `keep` and from
    `expected_bytes`, trial 0's outputs (checked against the reference), else the first measured call's; a kept call
    whose outputs take other bytes is kept as what is not a tensor, which the checker refuses (outputs that grow on
    some calls cannot slip past the sample). `draw(n)` gives a uniform integer below n (a test's own, else the
    operating system's, bound before the candidate was imported)."""

    def __init__(self, device, keep, expected_bytes=None, draw=None):
        self.device = device
        self.keep = keep
        self.expected_bytes = expected_bytes
        self.draw = draw or random_below
        self.capacity = None
        self.kept = []  # [call, [copies on the device, or NotATensor]]
        self.seen = 0

    def offer(self, call, output):
        values = flatten_outputs(output)
        # Through the original methods, and of plain tensors only: the candidate's code has run and could have
        # replaced `numel` or returned a subclass answering for itself.
        size = sum(originals().numel(v) * originals().element_size(v) for v in values if type(v) is _tensor_type())
        if self.capacity is None:
            self.expected_bytes = size if self.expected_bytes is None else self.expected_bytes
            self.capacity = sampled_timed_calls(self.expected_bytes, self.keep) + 1
        self.seen += 1
        if self.capacity == 1:
            return  # outputs too large to keep copies of
        if len(self.kept) < self.capacity:
            slot = len(self.kept)
            self.kept.append(None)
        else:
            slot = self.draw(self.seen)
            if slot >= self.capacity:
                return
        if size != self.expected_bytes:
            self.kept[slot] = [call, [NotATensor(f"outputs of {size} bytes where trial 0's took {self.expected_bytes}")]]
            return
        o = originals()
        self.kept[slot] = [call, [o.clone(o.detach(v)) if type(v) is _tensor_type() else NotATensor(v)
                                  for v in values]]
        synchronize(self.device)

    def calls(self, last):
        """The kept calls other than `last`, with their copies: at most `capacity - 1`, a uniform sample."""
        others = [entry for entry in self.kept if entry[0] != last]
        while self.capacity is not None and len(others) > self.capacity - 1:
            others.pop(self.draw(len(others)))
        return sorted(others, key=lambda entry: entry[0])


_urandom = os.urandom


def random_below(n):
    """A uniform integer in [0, n), from the operating system (rejection sampling over 64 bits)."""
    limit = (1 << 64) - (1 << 64) % n
    while True:
        value = int.from_bytes(_urandom(8), "little")
        if value < limit:
            return value % n


def _tensor_type():
    import torch

    return torch.Tensor


def _is_tensor(value):
    return isinstance(value, _tensor_type())


def timed_output_path(spec, call):
    return os.path.join(spec["candidate_dir"], f"timed-{call}.out")


def outputs_digest(tensors, entries, key):
    """The digest of an outputs file: its tensors' bytes (`tensor_digest` with `key`) and a keyed hash of what its
    header says of each output (`entries` in the saved form: a tensor's exact type and device, the repr of what is
    not a tensor). The harness takes it of what it wrote, the checker of what it loaded, so a file the candidate's
    code rewrote in between is seen."""
    import hashlib

    header = json.dumps([(e["exact_tensor"], e["device"], e.get("value")) for e in entries]).encode()
    keyed = hashlib.blake2b(header, digest_size=8, key=key.to_bytes(8, "little"))
    return list(tensor_digest(tensors, key)) + [int.from_bytes(keyed.digest(), "little", signed=True)]


def keep_timed_outputs(spec, output, last_call, sample):
    """Writes the last timed call's outputs and the sampled calls' for the checker; the calls with each file's
    digest (keyed with `spec["keep_timed"]["digest_key"]`), the last first."""
    kept = []
    for call, values in [(last_call, output)] + sample.calls(last_call):
        entries = write_outputs(values, timed_output_path(spec, call))
        tensors = [as_written(v) for v in flatten_outputs(values) if _is_tensor(v)]
        kept.append({"call": call, "digest": outputs_digest(tensors, entries, spec["keep_timed"]["digest_key"])})
    return kept


def measure(fn_for_inputs, input_sets, set_seeds, device, budget, sample=None):
    """Raw samples of fn over rotating, per-call perturbed input sets; warm-up runs the same code path.

    Stops once at least `min_runs` samples and `min_seconds` of measurement are in and the relative standard error
    of the mean is under `budget["target_rel_error"]`, or at `max_runs`, or when `max_seconds` of measurement have
    passed. Each call is announced to the evaluator (`Gate.call`, outside the timed step), which stops a call that
    never returns. Returns the samples as (event ms, host ms) series, the index of the last call, its output, and
    what competition for the CPU cost the loop (`thread_cpu_wait` over the loop). With `sample` (a TimedSample),
    each measured call's output is offered to it after the call's timed step.
    """
    import torch

    timer = Timer(device)
    samples, host, launches, device_ms = [], [], [], []
    call = -1
    output = None
    spinning = device.type == "cuda" and set_sync(spin=True)
    waited_before, switches_before = thread_cpu_wait()

    def step(record=True):
        """One call, timed; warm-up calls (and `record` false) are not recorded. Whether it was recorded."""
        nonlocal call, output
        call += 1
        which = call % len(input_sets)
        inputs = input_sets[which]
        perturb(inputs, set_seeds[which], call)
        GATE.call(timed=spinning)
        elapsed, host_elapsed, launch, output = timer.time_ms(lambda: fn_for_inputs(inputs),
                                                               cover_ms(launches, device_ms, timer.flush_ms))
        launches.append(launch)
        device_ms.append(elapsed)
        if call < budget["warmup_runs"] or not record:
            return False
        samples.append(elapsed)
        host.append(host_elapsed)
        if sample is not None:
            sample.offer(call, output)
        return True

    rounds = []
    # On a CPU both sides time with one torch thread: with a thread per core, a call waits for its slowest thread,
    # and on a machine shared with other work that wait is the load's, not the kernel's (the same eager op read
    # 0.05, 0.3 and 8 ms under one load, by how many of its threads found a free CPU).
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    with torch.no_grad():
        if budget.get("rounds"):
            rounds = paired_rounds(step, device, budget)
        else:
            started = None
            while len(samples) < budget["max_runs"]:
                if not step():
                    continue
                if started is None:
                    started = _monotonic()
                n = len(samples)
                spent = _monotonic() - started
                if n >= budget["min_runs"] and spent >= budget.get("min_seconds", 0.0):
                    mean = sum(samples) / n
                    var = sum((s - mean) ** 2 for s in samples) / (n - 1)
                    if mean > 0 and math.sqrt(var / n) / mean < budget["target_rel_error"]:
                        break
                if spent > budget["max_seconds"]:
                    break
    waited_after, switches_after = thread_cpu_wait()
    # Code that gave itself more threads while it was timed is named (`runtime.threads_changed`).
    threads_changed = device.type == "cpu" and torch.get_num_threads() != 1
    if device.type == "cpu":
        torch.set_num_threads(threads)
    if spinning:
        set_sync(spin=False)
    cpu = {
        "threads_changed": threads_changed,
        "spin_wait": spinning,
        "cpu_wait_ms": (waited_after - waited_before) / 1e6 if waited_before is not None else None,
        "involuntary_switches": switches_after - switches_before if switches_before is not None else None,
        "calls": call + 1,
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        # Medians over the measured calls, on a GPU: the host's time inside the call, the cover asked for, and the
        # cover the device ran (short of the one asked for where the spin's clock rate moved since it was measured).
        "launch_ms": median_or_none(launches[budget["warmup_runs"]:]) if device.type == "cuda" else None,
        "cover_ms": median_or_none(timer.covers[budget["warmup_runs"]:]),
        "cover_device_ms": median_or_none(timer.covered[budget["warmup_runs"]:]),
        # The share of the measured calls whose cover ran out before the host had enqueued them: above a half, the
        # median includes host launch time.
        "cover_short_share": share(timer.short[budget["warmup_runs"]:]),
    }
    return samples, host, call, output, cpu, rounds


def paired_rounds(step, device, budget):
    """Paired timing: `budget["rounds"]` rounds of `step`, each alone on the device in its turn (`Gate.round`). The
    first opens with the warm-up calls, each later one with one unrecorded call (the other side's round ran in
    between, on the same caches). A round records at least one call, and at least its share of `min_runs` and
    `min_seconds` unless its share of `max_seconds` has passed; at most its share of `max_runs`. Returns the
    recorded calls' count in each round."""
    count = budget["rounds"]
    least_calls = max(1, math.ceil(budget["min_runs"] / count))
    most_calls = max(least_calls, budget["max_runs"] // count)
    least_seconds = budget.get("min_seconds", 0.0) / count
    most_seconds = max(least_seconds, budget["max_seconds"] / count)
    counts = []
    for index in range(count):
        recorded = 0
        with GATE.round(device):
            if index > 0:
                step(record=False)
            started = _monotonic()
            while recorded < most_calls:
                if not step():
                    started = _monotonic()  # a warm-up call: the round's time starts after it
                    continue
                recorded += 1
                spent = _monotonic() - started
                if (recorded >= least_calls and spent >= least_seconds) or spent >= most_seconds:
                    break
        counts.append(recorded)
    return counts


# ---------------------------------------------------------------------------------------------------- integrity


def watched_attributes():
    """What a candidate must not replace: clocks, synchronisation, comparison, saving and the profiler."""
    import ctypes

    import torch

    watched = {
        "time.perf_counter": (time, "perf_counter"),
        "time.perf_counter_ns": (time, "perf_counter_ns"),
        "time.monotonic": (time, "monotonic"),
        "time.time": (time, "time"),
        "torch.cuda.synchronize": (torch.cuda, "synchronize"),
        "torch.cuda.Event": (torch.cuda, "Event"),
        "torch.cuda.Event.record": (torch.cuda.Event, "record"),
        "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time"),
        "torch.cuda.Event.synchronize": (torch.cuda.Event, "synchronize"),
        "torch.cuda.current_stream": (torch.cuda, "current_stream"),
        "torch.cuda._sleep": (torch.cuda, "_sleep"),
        "torch.cuda.stream": (torch.cuda, "stream"),
        "torch.allclose": (torch, "allclose"),
        "torch.equal": (torch, "equal"),
        "torch.isclose": (torch, "isclose"),
        "torch.save": (torch, "save"),
        "torch.load": (torch, "load"),
        "torch.Tensor.to": (torch.Tensor, "to"),
        "torch.Tensor.clone": (torch.Tensor, "clone"),
        "torch.Tensor.detach": (torch.Tensor, "detach"),
        "torch.Tensor.cpu": (torch.Tensor, "cpu"),
        "torch.Tensor.contiguous": (torch.Tensor, "contiguous"),
        "torch.Tensor.data_ptr": (torch.Tensor, "data_ptr"),
        "torch.Tensor.copy_": (torch.Tensor, "copy_"),
        "torch.Tensor.resolve_conj": (torch.Tensor, "resolve_conj"),
        "torch.Tensor.resolve_neg": (torch.Tensor, "resolve_neg"),
        "torch.cuda.set_stream": (torch.cuda, "set_stream"),
        "torch.from_file": (torch, "from_file"),
        "torch.Tensor.reshape": (torch.Tensor, "reshape"),
        "torch.Tensor.view": (torch.Tensor, "view"),
        "torch.Tensor.narrow": (torch.Tensor, "narrow"),
        "torch.Tensor.numpy": (torch.Tensor, "numpy"),
        "torch.Tensor.numel": (torch.Tensor, "numel"),
        "torch.Tensor.element_size": (torch.Tensor, "element_size"),
        "torch.Tensor.zero_": (torch.Tensor, "zero_"),
        "os.open": (os, "open"),
        "os.pwrite": (os, "pwrite"),
        "os.posix_fallocate": (os, "posix_fallocate"),
        "os.ftruncate": (os, "ftruncate"),
        "os.close": (os, "close"),
        "ctypes.CDLL": (ctypes, "CDLL"),
        "torch.Tensor.__eq__": (torch.Tensor, "__eq__"),
        "json.dump": (json, "dump"),
        "builtins.open": (__builtins__ if isinstance(__builtins__, dict) else vars(__builtins__), "open"),
    }
    try:
        import torch.autograd.profiler
        import torch.profiler

        watched["torch.profiler.profile"] = (torch.profiler, "profile")
        # What the census profiles with.
        watched["torch.autograd.profiler.profile"] = (torch.autograd.profiler, "profile")
        watched["torch.autograd.profiler.profile.__enter__"] = (torch.autograd.profiler.profile, "__enter__")
        watched["torch.autograd.profiler.profile.__exit__"] = (torch.autograd.profiler.profile, "__exit__")
    except Exception:
        pass
    return watched


def read_attribute(holder, name):
    return holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)


def precision_state():
    import torch

    return {
        "torch.backends.cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


class Integrity:
    """Run-time checks for what a static reading of the source cannot see. Findings are data for the evaluator."""

    def __init__(self):
        self.watched = watched_attributes()
        self.snapshot = {name: read_attribute(*where) for name, where in self.watched.items()}
        self.precision = precision_state()
        self.threads = {thread.ident for thread in threading.enumerate()}
        self.findings = {}

    def add(self, code, message):
        self.findings.setdefault(code, message)

    def check_environment(self, when):
        for name, where in self.watched.items():
            if read_attribute(*where) is not self.snapshot[name]:
                self.add("runtime.harness_tampered", f"`{name}` was replaced {when}")
        now = precision_state()
        for name, value in now.items():
            if value != self.precision[name]:
                self.add("runtime.precision_downgrade", f"`{name}` changed from {self.precision[name]} to {value} {when}")
        extra = [t.name for t in threading.enumerate() if t.ident not in self.threads and self.foreign(t)]
        if extra:
            self.add("runtime.background_thread", f"threads still running {when}: {', '.join(extra[:5])}")

    @staticmethod
    def foreign(thread):
        """A live thread that torch or triton did not start for themselves (inductor's compile pool is theirs)."""
        if not thread.is_alive():
            return False
        target = getattr(thread, "_target", None)
        origin = getattr(target, "__module__", None) or type(thread).__module__ or ""
        if origin.split(".")[0] in ("torch", "triton"):
            return False
        if origin.startswith("concurrent.futures") and "torch._inductor" in sys.modules:
            return False
        return True

    def check_outputs(self, inputs, output, trial):
        """Outputs must be new tensors: not an input, not a view of one, not sharing its memory."""
        import torch

        def spans(values):
            for value in values:
                if isinstance(value, torch.Tensor) and value.numel() > 0:
                    storage = value.untyped_storage()
                    yield value, storage.data_ptr(), storage.data_ptr() + storage.nbytes()

        inputs_spans = list(spans(inputs))
        for index, (out, begin, end) in enumerate(spans(flatten_outputs(output))):
            for inp, in_begin, in_end in inputs_spans:
                if out.device == inp.device and begin < in_end and in_begin < end:
                    self.add("runtime.output_aliases_input", f"output {index} shares memory with an input (trial {trial})")


def poison_free_memory(device):
    """Fills memory the CUDA caching allocator will hand out next with NaN, so a kernel that reads an output it
    never wrote (torch.empty) sees NaN rather than the zeros of fresh device memory."""
    import torch

    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    large = torch.empty(min(1 << 30, free // 4) // 4, dtype=torch.float32, device=device).fill_(float("nan"))
    small = [torch.empty(1 << 17, dtype=torch.float32, device=device).fill_(float("nan")) for _ in range(32)]
    synchronize(device)
    del large, small


# ---------------------------------------------------------------------------------------------------- build recipe

# How kforge builds load_inline extensions. A .cu source includes torch/types.h where it asked for
# torch/extension.h: nvcc parses every header three times (the host front end, the device front end, the host
# compiler), and torch/extension.h adds the C++ frontend and the Python bindings, which kernels and their launchers
# do not use. Device code is unchanged (the same SASS: bench/results/evaluator-throughput/). A source that needs
# the full header fails its light build with errors naming torch's API, and is built again as written. The choice
# is recorded per extension next to the builds, so the run stage loads exactly what the compile stage built.
FULL_HEADER = re.compile(r'^([ \t]*#[ \t]*include[ \t]*)[<"]torch/extension\.h[>"]', re.MULTILINE)
RECIPE_FILE = "kforge-build-recipe.json"


def lighten(cuda_sources):
    """The .cu sources with the light header, or None when none asks for the full one."""
    if cuda_sources is None:
        return None
    sources = [cuda_sources] if isinstance(cuda_sources, str) else list(cuda_sources)
    if not any(isinstance(s, str) and FULL_HEADER.search(s) for s in sources):
        return None
    light = [FULL_HEADER.sub(r"\1<torch/types.h>", s) if isinstance(s, str) else s for s in sources]
    return light[0] if isinstance(cuda_sources, str) else light


FULL_HEADER_NAMES = ("torch", "at::", "c10", "ATen", "pybind", "py::", '"py"')


def names_full_header(log):
    """Whether a light build's errors name torch, ATen, c10 or the Python bindings: what the full header may
    declare. Other errors (a typo, an undeclared variable) would fail the build as written too."""
    return any(name in line for line in log.splitlines() if "error" in line for name in FULL_HEADER_NAMES)


def install_build_recipe(building):
    """Routes load_inline through the recipe; `building` in the compile stage, which decides and records."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root or os.environ.get("KFORGE_BUILD_RECIPE") == "stock":
        return
    import torch.utils.cpp_extension as cpp_extension

    stock = cpp_extension.load_inline
    path = os.path.join(root, RECIPE_FILE)

    def recorded():
        try:
            with _open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def record(name, recipe):
        recipes = recorded()
        recipes[name] = recipe
        with _open(path, "w") as f:
            _json_dump(recipes, f)

    def load_inline(name, cpp_sources, cuda_sources=None, *args, **kwargs):
        light = lighten(cuda_sources)
        if light is None:
            return stock(name, cpp_sources, cuda_sources, *args, **kwargs)
        if not building:
            chosen = light if recorded().get(name) == "light" else cuda_sources
            return stock(name, cpp_sources, chosen, *args, **kwargs)
        try:
            module = stock(name, cpp_sources, light, *args, **kwargs)
        except Exception as error:
            if "cuda.cuda.o" not in str(error) or not names_full_header(str(error)):
                raise  # not a failure the light header explains: built as written, the source fails the same way
            # Built again as written, under the same name and version, so a later process finds it up to date.
            getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(name, None)
            module = stock(name, cpp_sources, cuda_sources, *args, **kwargs)
            record(name, "as_written")
            return module
        record(name, "light")
        return module

    cpp_extension.load_inline = load_inline


class _NinjaFileWritten(Exception):
    pass


def load_inline_flags(extra_cflags, cuda, extra_cuda_cflags=None):
    """The variables (`cflags`, `post_cflags`, and with `cuda` `cuda_cflags` and `cuda_post_cflags`) of the ninja
    file load_inline writes for a probe extension given `extra_cflags` (and `extra_cuda_cflags`); the extension is
    never built."""
    import tempfile

    import torch.utils.cpp_extension as cpp_extension

    def written(*args, **kwargs):
        raise _NinjaFileWritten()

    run_ninja = cpp_extension._run_ninja_build
    cpp_extension._run_ninja_build = written
    try:
        with tempfile.TemporaryDirectory() as build:
            try:
                cpp_extension.load_inline("kforge_flags_probe", "// probe", cuda_sources="// probe" if cuda else None,
                                          extra_cflags=extra_cflags, extra_cuda_cflags=extra_cuda_cflags,
                                          build_directory=build)
            except _NinjaFileWritten:
                pass
            with _open(os.path.join(build, "build.ninja")) as f:
                ninja = f.read()
    finally:
        cpp_extension._run_ninja_build = run_ninja
    return dict(re.findall(r"^(\w+) = (.*)$", ninja, re.MULTILINE))


def bindings_flags(extra_cflags, cuda):
    """The flags load_inline compiles an extension's bindings (main.cpp) with, given `extra_cflags`; without the
    extension's name, which torch/extension.h never reads."""
    values = load_inline_flags(extra_cflags, cuda)
    flags = shlex.split(values.get("cflags", "")) + shlex.split(values.get("post_cflags", ""))
    return [flag for flag in flags if not flag.startswith("-DTORCH_EXTENSION_NAME=")]


def mode_bindings_pch(spec):
    """Precompiles torch/extension.h as load_inline's bindings (main.cpp, which starts with it) would read it, once
    per set of extra flags in spec["variants"], into spec["out_dir"]/torch/extension.h.gch/<variant>.gch. A build
    given that directory on its include path (CPATH) uses the first variant gcc finds valid for its own flags (the
    macros the header sees included) and reads the header as usual when none is. No candidate code runs here."""
    import subprocess

    import torch
    import torch.utils.cpp_extension as cpp_extension

    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "extension.h")
    out = os.path.join(spec["out_dir"], "torch", "extension.h.gch")
    os.makedirs(out, exist_ok=True)
    # gcc reads the header beside the directory whenever it does not take a precompiled one (another include of
    # it, other flags): this one passes the include on to torch's own.
    with _open(os.path.join(spec["out_dir"], "torch", "extension.h"), "w") as f:
        f.write("#include_next <torch/extension.h>\n")
    builds = []
    for name, extra in spec["variants"].items():
        command = [cpp_extension.get_cxx_compiler(), *bindings_flags(extra, spec["cuda"]), "-x", "c++-header", header,
                   "-o", os.path.join(out, f"{name}.gch")]
        builds.append((name, command, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    host = precompile_host_prefixes(spec) if spec["cuda"] else {}
    built, failed = [], {}
    for name, command, process in builds:
        _, errors = process.communicate()
        if process.returncode == 0:
            built.append(name)
        else:
            failed[name] = f"{' '.join(command)}\n{errors.decode(errors='replace')[-4000:]}"
    write_result(spec, {"ok": bool(built), "built": built, "failed": failed, "host": host})


def precompile_host_prefixes(spec):
    """With kforge's nvcc, the start of nvcc's host compile precompiled per variant (kforge_nvcc.HostPch), into
    spec["out_dir"]/nvcc-host, with the flags load_inline gives nvcc (the variant's flags as extra_cuda_cflags).
    Returns {variant: None when built, else why not}."""
    import kforge_nvcc

    if not os.environ.get("PYTORCH_NVCC"):
        return {}
    out = os.path.join(spec["out_dir"], "nvcc-host")
    os.makedirs(out, exist_ok=True)
    # The environment of the compiles that will use them: the bindings' directory on the include path.
    os.environ["CPATH"] = spec["out_dir"]
    return kforge_nvcc.precompile_host_prefixes(kforge_nvcc.real_nvcc(), nvcc_flags_of(spec["variants"]), out,
                                                kforge_nvcc.COMMON_HEADERS, kforge_nvcc.COMMON_OPERATORS)


def nvcc_flags_of(variants):
    """{name: the flags load_inline gives nvcc for a .cu file (cuda_cflags, cuda_post_cflags) with the variant's
    flags as extra_cuda_cflags}, for `variants` ({name: extra flags})."""
    flags = {}
    for name, extra in variants.items():
        values = load_inline_flags([], True, extra_cuda_cflags=extra)
        flags[name] = shlex.split(values.get("cuda_cflags", "")) + shlex.split(values.get("cuda_post_cflags", ""))
    return flags


# ---------------------------------------------------------------------------------------------------- census

# (training, grad enabled); the first is the mode of correctness and timing: KernelBench's own convention.
CENSUS_MODES = [(True, False), (False, False), (True, True), (False, True)]


class ExtensionCalls:
    """Counts calls into the candidate's compiled extensions: every function of a module that load_inline or load
    returns is replaced, on the module and before the candidate sees it, by a wrapper that counts its calls. The
    census reads the count around each mode's recorded calls: an extension compiled and never called by forward is
    the CPU counterpart of a kernel defined and never launched. A module that also exports classes or submodules
    (their methods are not wrapped), or a library registered as torch operators (`is_python_module=False`), makes
    the count incomplete, and the census then reports none rather than a wrong zero. A complete count with no
    functions says that no extension was loaded (a build the candidate caught and fell back from)."""

    def __init__(self):
        self.calls = 0
        self.functions = 0
        self.complete = True
        self.modules = []

    def counted(self, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            self.calls += 1
            return function(*args, **kwargs)

        return call

    def wrap(self, module):
        import types

        if not isinstance(module, types.ModuleType):
            self.complete = False
            return module
        if any(module is seen for seen in self.modules):
            return module  # the same module loaded again: already counted
        self.modules.append(module)
        for name in dir(module):
            if name.startswith("__"):
                continue
            value = getattr(module, name)
            if isinstance(value, (type, types.ModuleType)):
                self.complete = False
            elif callable(value):
                setattr(module, name, self.counted(value))
                self.functions += 1
        return module

    def install(self):
        """Wraps load_inline and load (after the build recipe's own wrapper, which it calls)."""
        import torch.utils.cpp_extension as cpp_extension

        def counting(load):
            @functools.wraps(load)
            def loading(*args, **kwargs):
                return self.wrap(load(*args, **kwargs))

            return loading

        cpp_extension.load_inline = counting(cpp_extension.load_inline)
        cpp_extension.load = counting(cpp_extension.load)


EXTENSIONS = ExtensionCalls()


class Census:
    """What ran during `calls` forward calls in each mode: device kernels with start and duration on a GPU (every
    stream and thread of the process), the direct torch-op children of each call and each call's span on a CPU. Raw
    records only.

    One profiler session covers every mode (a session's start and its event processing cost far more than the
    calls): each mode's calls run inside a `kforge.mode` range that ends after a synchronisation, and a record
    belongs to the mode whose range contains its start. The untimed first call of each mode (lazy compilation and
    caches) runs between the ranges and is not recorded. The profiler starts (`__init__`) and its records are read
    (`records`) while the device is shared; the calls and the profiler's stop (`record`) run alone, so the calls'
    device time is their own and nothing timed after them runs under the profiler."""

    def __init__(self, model, inputs, device, calls):
        from torch.autograd import profiler

        self.model, self.inputs, self.device, self.calls = model, inputs, device, calls
        self.extension_calls = []  # per mode, the calls into the candidate's extensions (ExtensionCalls)
        # Kineto leaves CUPTI attached after a session unless told to finalise it (it then does, from a thread of
        # its own, at the next CUDA call: the timed loop's warm-up), and an attached CUPTI adds host time to every
        # launch after: the timed loop would launch slower than the baselines' stages, which run no census
        # (bench/results/timing-fidelity/2026-11-27d). An explicit "0" (torch.compile's CUDA graphs on CUDA before
        # 12.6, where the teardown crashed them) is kept.
        if os.environ.get("TEARDOWN_CUPTI") != "0":
            os.environ["TEARDOWN_CUPTI"] = "1"
        # torch's autograd profiler, which `torch.profiler.profile` wraps: the wrapper's first start imports
        # torch._inductor (7-8 s on the H100 machine, bench/results/profiler-p50/), which the census never uses.
        self.profiler = profiler.profile(use_device="cuda" if device.type == "cuda" else None, use_kineto=True)
        self.profiler.__enter__()

    def record(self):
        import torch
        from torch.profiler import record_function

        model, inputs, device = self.model, self.inputs, self.device
        was_training = model.training
        try:
            for training, grad in CENSUS_MODES:
                model.train(training)
                with torch.set_grad_enabled(grad):
                    GATE.call()  # the mode's untimed first call
                    model(*inputs)
                    synchronize(device)
                    before = EXTENSIONS.calls
                    with record_function("kforge.mode"):
                        for _ in range(self.calls):
                            GATE.call()  # each call and its synchronisation is one call to the evaluator
                            with record_function("kforge.call"):
                                model(*inputs)
                            synchronize(device)
                    self.extension_calls.append(EXTENSIONS.calls - before)
        finally:
            model.train(was_training)
            self.profiler.__exit__(None, None, None)

    def records(self):
        from torch.autograd import DeviceType

        device, calls = self.device, self.calls
        names = [f"{'train' if training else 'eval'}/{'grad' if grad else 'no_grad'}" for training, grad in CENSUS_MODES]
        events = self.profiler.function_events
        windows = sorted((e.time_range.start, e.time_range.end) for e in events
                         if e.name == "kforge.mode" and e.device_type == DeviceType.CPU)
        if len(windows) != len(names):
            raise RuntimeError(f"the census found {len(windows)} mode ranges instead of {len(names)}")
        modes = [{"mode": name, "calls": calls, "call_spans": [], "records": []} for name in names]
        if EXTENSIONS.complete and len(self.extension_calls) == len(modes):
            for mode, extension_calls in zip(modes, self.extension_calls):
                mode["extension_functions"] = EXTENSIONS.functions
                mode["extension_calls"] = extension_calls

        def mode_at(start):
            for index, (begin, end) in enumerate(windows):
                if begin <= start <= end:
                    return modes[index]
            return None

        for event in events:
            if device.type == "cuda":
                # Device activity only: kernels, copies, sets. A record_function range (ours, or one the candidate
                # opens) also shows on the GPU timeline as a span; it is not work.
                annotation = getattr(event, "is_user_annotation", False) or event.name in ("kforge.call", "kforge.mode")
                if event.device_type == DeviceType.CUDA and not annotation:
                    mode = mode_at(event.time_range.start)
                    if mode is not None:
                        mode["records"].append({"name": event.name, "start_us": event.time_range.start,
                                                "duration_us": event.time_range.elapsed_us()})
            elif event.name == "kforge.call":
                mode = mode_at(event.time_range.start)
                if mode is None:
                    continue
                mode["call_spans"].append({"start_us": event.time_range.start,
                                           "duration_us": event.time_range.elapsed_us()})
                for child in event.cpu_children:
                    mode["records"].append({"name": child.name, "start_us": child.time_range.start,
                                            "duration_us": child.time_range.elapsed_us()})
        return modes


# ---------------------------------------------------------------------------------------------------- modes


def mode_compile(spec):
    started = _monotonic()
    install_build_recipe(building=True)
    with phase("import_candidate"):
        module = load_module(spec["candidate_path"], "kforge_candidate")
    if not hasattr(module, "ModelNew"):
        raise RuntimeError("the candidate defines no ModelNew")
    result = {"ok": True, "seconds": _monotonic() - started}
    if spec["kernels"]:
        with phase("list_kernels"):
            kernels, why = compiled_kernels(extension_libraries())
        result["kernels" if why is None else "kernels_unread"] = kernels if why is None else why
    write_result(spec, result)


def extension_libraries():
    """The shared libraries the candidate's extensions (load_inline, load) were built into: every library under
    TORCH_EXTENSIONS_DIR, which holds this build's alone (torch imports them without entering sys.modules)."""
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return []
    return sorted(glob.glob(os.path.join(root, "**", "*.so"), recursive=True))


def compiled_kernels(libraries):
    """The kernels compiled into `libraries` by function name (`scale` for `void ns::scale<float>(float*)`): the
    entry functions (STO_ENTRY) of their device code, listed by cuobjdump and demangled by c++filt. What the census
    and the profiler count as the candidate's own CUDA kernels, so both read them from what was built, not from the
    source. (names, None), or (None, why) where they cannot be read."""
    import shutil
    import subprocess

    import kforge_nvcc

    if not libraries:
        return [], None
    beside_nvcc = os.path.join(os.path.dirname(kforge_nvcc.real_nvcc()), "cuobjdump")
    cuobjdump = beside_nvcc if os.path.isfile(beside_nvcc) else shutil.which("cuobjdump")
    cxxfilt = shutil.which("c++filt")
    if cuobjdump is None or cxxfilt is None:
        return None, f"{'cuobjdump' if cuobjdump is None else 'c++filt'} not found"
    mangled = set()
    for library in libraries:
        listed = subprocess.run([cuobjdump, "-symbols", library], capture_output=True, text=True)
        if listed.returncode != 0 and "does not contain device code" not in listed.stderr + listed.stdout:
            return None, f"cuobjdump -symbols {os.path.basename(library)}: {listed.stderr.strip()[-300:]}"
        mangled.update(entry_symbols(listed.stdout))
    ordered = sorted(mangled)
    demangled = subprocess.run([cxxfilt], input="\n".join(ordered) + "\n", capture_output=True, text=True)
    lines = demangled.stdout.splitlines()
    if demangled.returncode != 0 or len(lines) != len(ordered):
        return None, f"c++filt: {demangled.stderr.strip()[-300:]}"
    return sorted({function_name(line) for line in lines} - {""}), None


def entry_symbols(listing):
    """The kernel (entry function) symbols of a `cuobjdump -symbols` listing."""
    return {line.split()[-1] for line in listing.splitlines() if "STT_FUNC" in line and "STO_ENTRY" in line}


def function_name(demangled):
    """A demangled function's name alone: no return type, namespace, template arguments or parameters."""

    def before_bracketed(text, opening, closing):
        """`text` less its trailing bracketed part (`<...>` or `(...)`, nested ones included)."""
        depth = 0
        for index in range(len(text) - 1, -1, -1):
            depth += {closing: 1, opening: -1}.get(text[index], 0)
            if depth == 0:
                return text[:index].strip()
        return text

    name = demangled.strip()
    if name.endswith(")"):
        name = before_bracketed(name, "(", ")")  # the parameters
    while name.endswith(">"):
        name = before_bracketed(name, "<", ">")  # template arguments
    return name.rsplit("::", 1)[-1].rsplit(" ", 1)[-1]


class JitKernels:
    """Names of the Triton kernels the candidate's own code makes: every `triton.jit` function created from the
    candidate's file, at import or later (one made inside `forward` too), recorded as it is created; Triton names
    a compiled kernel after its function. Looked for only where the candidate's source mentions triton (importing
    it costs the others time)."""

    def __init__(self):
        self.names = None  # None: not looked for

    def install(self, candidate_path):
        with _open(candidate_path) as f:
            if "triton" not in f.read():
                return
        try:
            from triton.runtime import jit
        except ImportError:
            return
        self.names = set()
        path = os.path.realpath(candidate_path)
        original = jit.JITFunction.__init__

        @functools.wraps(original)
        def init(function, fn, *args, **kwargs):
            original(function, fn, *args, **kwargs)
            code = getattr(fn, "__code__", None)
            if code is not None and os.path.realpath(code.co_filename) == path:
                self.names.add(fn.__name__)

        jit.JITFunction.__init__ = init


JIT_KERNELS = JitKernels()


def reference_model(spec, device):
    task = load_module(spec["task_path"], "kforge_task")
    return task, make_model(task.Model, task, spec["init_seed"], device)


def mode_reference(spec):
    import torch

    device = device_of(spec)
    GATE.share(device)
    task, model = reference_model(spec, device)
    kept = [0]  # as in the candidate's stage: trial 0's outputs decide which trials are kept
    largest = 0  # the most bytes of outputs one trial gave: the disk budget's size for a task it cannot size
    for trial in range(len(spec["seeds"])):
        if trial not in kept or trial == spec.get("replay"):
            continue  # the replay repeats trial 0's inputs and is compared with trial 0's reference
        GATE.pause(device)
        with phase("reference"):
            inputs = trial_inputs(task, spec, trial, device)
            with torch.no_grad():
                output = model(*inputs)
        with phase("save_reference"):
            write_outputs(output, os.path.join(spec["reference_dir"], f"reference-{trial}.out"))
        size = output_bytes(output)
        largest = max(largest, size)
        if trial == 0:
            kept = kept_trials(spec, size)
        del inputs, output
    result = {"ok": True, "output_bytes": largest}
    if device.type == "cuda":
        # The most device memory the reference held at once (model, inputs, outputs, workspace): the evaluator
        # estimates the task's footprint from it for memory-aware admission (devices::footprint).
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    if spec.get("candidate_dir"):
        result["mismatch"] = check_outputs(spec, device, lambda: (task, model))
        result["compared_trials"] = spec.get("compared_trials")
    write_result(spec, result)


def run_trial(model, task, device, trial, integrity, result, spec):
    import torch

    inputs = trial_inputs(task, spec, trial, device)
    before = tensor_digest(inputs)
    caller = originals().current_stream(device) if device.type == "cuda" else None
    GATE.call()
    with torch.no_grad():
        output = model(*inputs)
    # Read as a consumer on the caller's stream would: copied in that stream's order, before any device-wide
    # synchronisation, so work left running on another stream is read unfinished; the copy is the outputs file.
    # Outputs small enough to be read twice keep a private copy for the race check (the file is the candidate's).
    private = output_bytes(output) <= RACE_CHECK_BYTES
    ordered = write_outputs(output, os.path.join(spec["candidate_dir"], f"candidate-{trial}.out"), caller, private)
    synchronize(device)
    GATE.pause(device)  # the call is over: synchronised, and a pause point
    if caller is not None:
        unordered = differs_after_sync(output, ordered)
        if unordered is not None:
            integrity.add("runtime.unordered_output",
                          f"output {unordered} read on the caller's stream right after forward returned differs from "
                          f"the same output after a device-wide synchronisation (trial {trial}): work still ran "
                          f"that the caller's stream was not ordered after (another stream, no event wait)")
    if tensor_digest(inputs) != before:
        result["mutated_inputs"].append(trial)
    integrity.check_outputs(inputs, output, trial)
    return output_bytes(output)


# Outputs up to this size are read twice (in the caller's stream order, then after synchronising) to name a stream
# race; larger ones are read once, in stream order, and a race shows as a mismatch.
RACE_CHECK_BYTES = 64 << 20


def as_bytes(tensor):
    """A CPU tensor's bytes as a flat uint8 tensor (a 0-dim tensor too: a loss is one)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def output_bytes(output):
    """The bytes of a model output's tensors."""
    return tensor_bytes(flatten_outputs(output))


def kept_trials(spec, size):
    """The trials whose outputs are saved and compared when one trial's outputs take `size` bytes: every trial while
    they fit in `output_bytes_budget`, else as many as fit (at least two) in this order: trial 0 (the base of the
    sensitivity trial and of the replay), the sensitivity trial, the replay (trial 0's inputs after timing), then
    the others from the last down (the re-check trials are the last ones, so they come first). The candidate's
    harness, the reference stage and the checker each decide from their own trial 0 (the reference's, for the
    checker) and from fields every one of their specs carries, so they keep the same trials: a candidate whose
    outputs differ in size already fails trial 0."""
    total = len(spec["seeds"])
    budget = spec.get("output_bytes_budget") or 0
    if not budget or size * total <= budget:
        return list(range(total))
    sensitivity = spec.get("sensitivity")
    replay = spec.get("replay")
    first = [0] + ([sensitivity["trial"]] if sensitivity else []) + ([replay] if replay is not None else [])
    kept = []
    for trial in first + list(range(total - 1, 0, -1)):
        if trial < total and trial not in kept and (len(kept) < 2 or (len(kept) + 1) * size <= budget):
            kept.append(trial)
    return sorted(kept)


def differs_after_sync(output, ordered):
    """The index of the first output whose stream-ordered copy differs (bytewise) from its value now, or None."""
    import torch

    values = flatten_outputs(output)
    sizes = [v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor)]
    if sum(sizes) > RACE_CHECK_BYTES:
        return None
    for index, (value, saved) in enumerate(zip(values, ordered)):
        if isinstance(value, torch.Tensor) and value.is_cuda and "tensor" in saved:
            if not torch.equal(as_bytes(value.detach().to("cpu")), as_bytes(saved["tensor"])):
                return index
    return None


def mode_candidate(spec):
    import torch

    device = device_of(spec)
    with phase("device_init"):
        task = load_module(spec["task_path"], "kforge_task")
        originals()
        poison_free_memory(device)
        if device.type == "cuda" and staged_outputs(spec["candidate_dir"]):
            staging_buffers()  # made now: making pinned memory later would synchronise the candidate's streams
    integrity = Integrity()
    install_build_recipe(building=False)
    EXTENSIONS.install()
    JIT_KERNELS.install(spec["candidate_path"])
    try:
        with phase("import_candidate"):
            GATE.call()  # the module's own code runs, and its extensions load
            candidate = load_module(spec["candidate_path"], "kforge_candidate")
    except BaseException as error:
        error.kforge_phase = "import"
        raise
    integrity.check_environment("when the candidate was imported")
    with phase("trials"):
        GATE.call()
        model = make_model(candidate.ModelNew, task, spec["init_seed"], device)
        result = {"ok": True, "mutated_inputs": []}
        seeds = spec["seeds"]
        # Trials from `recheck_from` on run after timing and the census: behaviour that changes once the
        # correctness check is over is caught by the same comparison.
        recheck_from = spec.get("recheck_from", len(seeds))
        kept = [0]  # trial 0 always runs; its outputs' size decides the rest
        first_bytes = None
        for trial in range(recheck_from):
            if trial not in kept:
                continue
            GATE.pause(device)
            size = run_trial(model, task, device, trial, integrity, result, spec)
            if trial == 0:
                kept, first_bytes = kept_trials(spec, size), size
    integrity.check_environment("during the correctness trials")
    timing, calls = spec.get("timing"), spec.get("census_calls")
    if timing or calls:
        with phase("census_start"):
            census = Census(model, make_inputs(task, spec["timing_seeds"][0], device), device, calls) if calls else None
        with phase("timing"):
            input_sets = timing_inputs(task, spec, device) if timing else None
        paired = bool(timing and timing.get("rounds"))
        measured = None

        def timed():
            with phase("timing"):
                keep = spec["keep_timed"]
                sample = TimedSample(device, keep, first_bytes) if keep is not None else None
                return measure(lambda inputs: model(*inputs), input_sets, spec["timing_seeds"], device, timing,
                               sample), sample

        # The census and unpaired timing share one turn alone on the device. Paired timing takes its turns with
        # the baseline's round by round (`paired_rounds`), after the census.
        if census is not None or (timing and not paired):
            with GATE.alone(device):
                if census is not None:
                    with phase("census_calls"):
                        census.record()
                if timing and not paired:
                    measured = timed()
        if paired:
            measured = timed()
        if measured is not None:
            (samples, host, last_call, output, cpu, rounds), sample = measured
            if cpu.get("threads_changed"):
                integrity.add("runtime.threads_changed",
                              "the candidate changed torch's thread count while it was timed (timing on a CPU runs "
                              "both sides with one thread)")
        if timing:
            with phase("timing"):
                synchronize(device)
                result["samples_ms"] = samples
                result["host_ms"] = host
                result["rounds"] = rounds
                result["timing_cpu"] = cpu
                result["timed_outputs"] = keep_timed_outputs(spec, output, last_call, sample) if sample else []
                del sample, output
        if census is not None:
            with phase("census_read"):
                result["census"] = census.records()
        integrity.check_environment("during the census and timing")
    if spec.get("profiled_calls"):
        profiled_calls(model, make_inputs(task, spec["timing_seeds"][0], device), device, spec["profiled_calls"])
        integrity.check_environment("during the profiled calls")
    with phase("recheck"):
        for trial in range(recheck_from, len(seeds)):
            if trial not in kept:
                continue
            GATE.pause(device)
            run_trial(model, task, device, trial, integrity, result, spec)
    integrity.check_environment("after the last trial")
    result["findings"] = [{"code": code, "message": message} for code, message in integrity.findings.items()]
    if JIT_KERNELS.names is not None:
        result["jit_kernels"] = sorted(JIT_KERNELS.names)
    if device.type == "cuda":
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    write_result(spec, result)


def profiled_calls(model, inputs, device, calls):
    """`calls` forward calls inside the profiler's range, alone on the device, after one warm-up call outside it
    (lazy compilation, autotuning and caches are not what a profile should show). A profiler started with profiling
    off (`ncu --profile-from-start off`) records the range only."""
    import torch

    cudart = torch.cuda.cudart() if device.type == "cuda" else None
    with GATE.alone(device), phase("profiled_calls"):
        GATE.call()
        model(*inputs)
        synchronize(device)
        if cudart is not None:
            cudart.cudaProfilerStart()
        try:
            for _ in range(calls):
                GATE.call()
                model(*inputs)
                synchronize(device)
        finally:
            if cudart is not None:
                cudart.cudaProfilerStop()


def tolerance(dtype, spec):
    """(atol, rtol, scale_rtol) of a dtype; integers and booleans compare exactly (and ignore them)."""
    import torch

    table = spec["tolerances"]
    key = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}.get(dtype)
    if key is None:
        return 0.0, 0.0, 0.0
    entry = table[key]
    return entry["atol"], entry["rtol"], entry["scale_rtol"]


def allowed_error(expected, scales, atol, rtol, scale_rtol):
    """The error allowed per element of an output whose finite values have `scales` (the largest |value|, the mean
    |value|), `expected` in float64: the absolute part shrinks with the largest value (on an output whose values are
    all far below atol, a constant or zero answer would otherwise pass), and a part relative to the mean |value|
    covers the rounding of sums that cancel (an element near zero made of terms as large as the output's typical
    values is off by rounding at that magnitude; outliers move the mean far less than the peak)."""
    peak, typical = scales
    return atol * min(1.0, max(peak, 1e-6)) + scale_rtol * typical + rtol * expected.abs()


def mode_check(spec):
    device = device_of(spec)
    GATE.share(device)  # outputs are compared on their device
    mismatch = check_outputs(spec, device, lambda: reference_model(spec, device))
    write_result(spec, {"ok": True, "mismatch": mismatch, "compared_trials": spec.get("compared_trials")})


def check_outputs(spec, device, reference):
    """The first mismatch, the strongest evidence first: the first trials, the replay, the sensitivity check
    (`compare_trials`), then the timed calls kept (`compare_timed_calls`: their reference from `reference()`, the
    task and its model), then the re-checks on fresh inputs after the replay. A timed call is judged wrong only
    while those re-checks pass: both wrong, on inputs the first trials did not have, is a candidate that fails some
    inputs (rounding near the tolerance looks the same), and the re-check's mismatch is reported without judging the
    timed calls."""
    mismatch, late = compare_trials(spec, device)
    if mismatch is not None or late is not None:
        return mismatch or late
    if not spec["timed_outputs"]:
        return None
    task, model = reference()
    return compare_timed_calls(spec, task, model, device)


def compare_timed_calls(spec, task, model, device):
    """Checks the outputs of the candidate's timed calls it kept (the last, and a random sample: `TimedSample`)
    against the reference on the same, rebuilt inputs; a mismatch names its call, and so does a file whose digest
    is not the one the harness took when it wrote it (the candidate's code ran after, and could rewrite it). A task
    whose reference gives another output when called again on the same inputs (dropout in training mode, say) draws
    from torch's generator per call, and a timed call's draw depends on how many calls timing made: for such a task
    the check cannot apply and is passed (the correctness trials, seeded alike on both sides, still hold)."""
    import torch

    for n, kept in enumerate(spec["timed_outputs"]):
        call = kept["call"]
        inputs = timed_call_inputs(task, spec, device, call)
        with torch.no_grad():
            expected = saved_outputs(model(*inputs))
            again = saved_outputs(model(*inputs)) if n == 0 else None
        synchronize(device)
        if again is not None and compare_outputs(expected, again, spec) is not None:
            return None
        timed = timed_output_path(spec, call)
        with phase("prefetch"):
            prefetch([timed], device)
        try:
            with phase("load"):
                got = load_outputs(timed, device)
        except Exception as error:
            return {"trial": -1, "output_index": 0,
                    "detail": f"timed call {call}: outputs unreadable: {type(error).__name__}"}
        with phase("compare"):
            if outputs_digest([v["tensor"] for v in got if "tensor" in v], got, spec["digest_key"]) != kept["digest"]:
                return {"trial": -1, "output_index": 0,
                        "detail": f"timed call {call}: its outputs file changed after the harness wrote it"}
            mismatch = compare_outputs(expected, got, spec)
        del expected, again, got, inputs
        if mismatch is not None:
            mismatch["trial"] = -1
            detail = mismatch.get("detail")
            mismatch["detail"] = f"timed call {call}" + (f": {detail}" if detail else "")
            return mismatch
    return None


# A replay this many times outside the tolerance is changed behaviour: a kernel whose rounding differs from call
# to call (atomics, autotuning) can land on either side of the tolerance, not ten times past it.
REPLAY_CHANGED = 10


def widened(spec, factor):
    """`spec` with every tolerance `factor` times as large."""
    tolerances = {dtype: {name: value * factor for name, value in entry.items()}
                  for dtype, entry in spec["tolerances"].items()}
    return {**spec, "tolerances": tolerances}


def compare_trials(spec, device):
    """(the first mismatch over the first trials, the replay and the sensitivity check; the first over the re-checks
    after the replay, or the replay's where it is only a little outside the tolerance), each None where there is
    none; compared on `device`. The replay (trial 0's inputs again after timing) is compared with trial 0's
    reference: outside REPLAY_CHANGED times the tolerance it is changed behaviour, else a candidate near the
    tolerance. The sensitivity trial takes the absolute and scale parts of its tolerance from its base's reference
    (its moved elements would loosen them for every element)."""
    def path(kind, trial):
        folder = spec["reference_dir"] if kind == "reference" else spec["candidate_dir"]
        return os.path.join(folder, f"{kind}-{trial}.out")

    def load(kind, trial):
        return load_outputs(path(kind, trial), device)

    sensitivity, replay = spec.get("sensitivity"), spec.get("replay")
    late = None
    kept = {}  # the base and sensitivity trials' outputs, for the sensitivity check after the loop
    compared = [0]  # trial 0's reference outputs decide which trials were kept (kept_trials)
    for trial in range(len(spec["seeds"])):
        if trial not in compared:
            continue
        after_replay = replay is not None and trial > replay
        reference_trial = 0 if trial == replay else trial  # the replay has no reference of its own
        # Comparing shares the device, with a pause point after each file's load, so timed work elsewhere waits
        # for no more than one load (a second for GiB outputs) or one comparison; reading the files is host work.
        with phase("prefetch"):
            prefetch([path("reference", reference_trial), path("candidate", trial)], device)
        with phase("load"):
            expected = load("reference", reference_trial)
        if trial == 0:
            compared = kept_trials(spec, sum(v["tensor"].numel() * v["tensor"].element_size()
                                             for v in expected if "tensor" in v))
            spec["compared_trials"] = compared
        GATE.pause(device)
        try:
            with phase("load"):
                got = load("candidate", trial)
        except Exception as error:  # a missing or malformed file is the candidate's output, not ours
            mismatch = {"trial": trial, "output_index": 0, "detail": f"outputs unreadable: {type(error).__name__}"}
            if not after_replay:
                return mismatch, None
            late = late or mismatch
            break
        GATE.pause(device)
        moved = sensitivity is not None and trial == sensitivity["trial"]
        with phase("compare"):
            mismatch = compare_outputs(expected, got, spec, kept[sensitivity["base"]][0] if moved else None)
        if mismatch is None and sensitivity and trial in (sensitivity["base"], sensitivity["trial"]):
            kept[trial] = (expected, got)
        if mismatch is None:
            continue
        mismatch["trial"] = trial
        if moved:
            mismatch["detail"] = ("input sensitivity: wrong on the sensitivity trial (trial 0's inputs with a few "
                                  "elements moved far out of range) " + mismatch.get("detail", "")).strip()
        if trial == replay:
            with phase("compare"):
                changed = compare_outputs(expected, got, widened(spec, REPLAY_CHANGED)) is not None
            mismatch["detail"] = (f"replay: trial 0's inputs again after timing and the census gave an output outside "
                                  f"the tolerance, {'and' if changed else 'but not'} outside {REPLAY_CHANGED} times "
                                  f"it " + mismatch.get("detail", "")).strip()
            if changed:
                mismatch["changed"] = True  # runtime.changed_after_check
                return mismatch, None
            late = late or mismatch  # rounding of a candidate near the tolerance, not changed behaviour
            continue
        if not after_replay:
            return mismatch, None
        late = late or mismatch
        break
    if not sensitivity:
        return None, late
    (ref_base, cand_base), (ref_moved, cand_moved) = kept[sensitivity["base"]], kept[sensitivity["trial"]]
    GATE.pause(device)
    with phase("compare"):
        return compare_sensitivity(ref_base, ref_moved, cand_base, cand_moved, sensitivity["trial"], spec), late


def compare_sensitivity(ref_base, ref_moved, cand_base, cand_moved, trial, spec):
    """Whether the candidate's output moved as the reference's did between the sensitivity trial and its base (the
    same inputs but for a few elements moved far out of range): per element, |d_cand - d_ref| <= 0.1 |d_ref| +
    noise, noise a tenth of the output tolerance. Each trial alone already passed within tolerance; their
    difference is the sharper test, since rounding errors of nearly equal inputs largely cancel in it. Outputs
    whose reference did not move past 2x noise anywhere (or is not finite there, or is not floating-point) are not
    judged; a mismatch names the first element that moved wrongly."""
    import torch

    for index, (rb, rm, cb, cm) in enumerate(zip(ref_base, ref_moved, cand_base, cand_moved)):
        a, b = rb.get("tensor"), rm.get("tensor")
        c, d = cb.get("tensor"), cm.get("tensor")
        if a is None or not a.is_floating_point() or a.numel() == 0:
            continue
        tol = tolerance(a.dtype, spec)
        a, b, c, d = (t.reshape(-1) for t in (a, b, c, d))
        scales = finite_scales(a)
        for start in range(0, a.numel(), CHUNK_ELEMENTS):
            window = slice(start, start + CHUNK_ELEMENTS)
            rb64, rm64 = a[window].to(torch.float64), b[window].to(torch.float64)
            d_ref = rm64 - rb64
            d_cand = d[window].to(torch.float64) - c[window].to(torch.float64)
            noise = allowed_error(torch.maximum(rb64.abs(), rm64.abs()), scales, *tol) / 10
            judged = torch.isfinite(d_ref) & (d_ref.abs() > 2 * noise)
            wrong = judged & ~((d_cand - d_ref).abs() <= 0.1 * d_ref.abs() + noise)
            if bool(wrong.any()):
                at = int(wrong.nonzero()[0])
                return {"trial": trial, "output_index": index, "element_index": [start + at],
                        "expected": float(d_ref[at]), "got": float(d_cand[at]),
                        "detail": "input sensitivity: with a few input elements moved far out of range, the "
                                  "reference's output moved by `expected` at this (flattened) element and the "
                                  "candidate's by `got`: the candidate does not compute on all of its input"}
    return None


def compare_outputs(expected, got, spec, base=None):
    """The first output of `got` that differs from `expected`'s, or None. With `base` (another trial's expected
    outputs, of the same shapes), each tensor's tolerance takes its scales from base's."""
    if not isinstance(got, list) or len(got) != len(expected):
        return {"output_index": 0, "detail": f"expected {len(expected)} outputs, got {len(got) if isinstance(got, list) else 'none'}"}
    for index, (want, have) in enumerate(zip(expected, got)):
        if not isinstance(have, dict) or "tensor" not in have and "value" not in have:
            return {"output_index": index, "detail": "output is not a saved value"}
        if "tensor" not in want:
            if have.get("value") != want.get("value"):
                return {"output_index": index, "detail": f"expected {want.get('value')}, got {have.get('value')}"}
            continue
        if "tensor" not in have or not have.get("exact_tensor"):
            return {"output_index": index, "detail": "output is not a torch.Tensor (type(out) is torch.Tensor failed)"}
        a, b = want["tensor"], have["tensor"]
        if have["device"] != want["device"]:
            return {"output_index": index, "detail": f"device {have['device']} instead of {want['device']}"}
        if b.dtype != a.dtype:
            return {"output_index": index, "detail": f"dtype {b.dtype} instead of {a.dtype}"}
        if tuple(b.shape) != tuple(a.shape):
            return {"output_index": index, "detail": f"shape {tuple(b.shape)} instead of {tuple(a.shape)}"}
        if a.numel() == 0:
            continue
        scales = None
        if base is not None and a.is_floating_point() and index < len(base) and "tensor" in base[index]:
            scales = finite_scales(base[index]["tensor"].reshape(-1))
        mismatch = compare_tensor(a, b, *tolerance(a.dtype, spec), scales=scales)
        if mismatch is not None:
            mismatch["output_index"] = index
            return mismatch
    return None


def finite_scales(flat):
    """(the largest finite |value|, the mean finite |value|) of a flat floating-point tensor, read in chunks of
    CHUNK_ELEMENTS; zeros where none is finite."""
    import torch

    peak, total, count = 0.0, 0.0, 0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start:start + CHUNK_ELEMENTS].to(torch.float64).abs()
        finite = torch.isfinite(part)
        part = torch.where(finite, part, torch.zeros_like(part))
        peak = max(peak, float(part.max()))
        total += float(part.sum())
        count += int(finite.sum())
    return peak, total / count if count else 0.0


def compare_tensor(a, b, atol, rtol, scale_rtol, scales=None):
    """The first element of `b` outside tolerance of `a` (same shape, dtype, device; `allowed_error`, with `a`'s
    scales unless given), or None. Runs where the tensors are, in chunks of CHUNK_ELEMENTS (float64 temporaries stay
    bounded for outputs of gigabytes)."""
    import torch

    shape = a.shape
    a, b = a.reshape(-1), b.reshape(-1)
    floating = a.dtype.is_floating_point or a.dtype.is_complex
    chunks = range(0, a.numel(), CHUNK_ELEMENTS)
    if floating and scales is None:
        scales = finite_scales(a)
    first, max_abs, max_rel = None, 0.0, 0.0
    for start in chunks:
        a64 = a[start:start + CHUNK_ELEMENTS].to(torch.float64)
        b64 = b[start:start + CHUNK_ELEMENTS].to(torch.float64)
        diff = (a64 - b64).abs()
        if floating:
            finite_expected = torch.isfinite(a64)
            # NaN never passes, and Inf only where the reference has the same Inf.
            bad_nonfinite = ~torch.isfinite(b64) & ~(torch.isinf(a64) & (a64 == b64))
            diff = torch.where(finite_expected, diff, torch.zeros_like(diff))
            allowed = allowed_error(a64, scales, atol, rtol, scale_rtol)
            bad = bad_nonfinite | (finite_expected & (diff > allowed))
            rel = diff / a64.abs().clamp_min(1e-12)
            max_rel = max(max_rel, float(torch.nan_to_num(rel, nan=math.inf).max()))
        else:
            bad = a64 != b64  # integers and booleans compare exactly
        max_abs = max(max_abs, float(torch.nan_to_num(diff, nan=math.inf).max()))
        if first is None and bool(bad.any()):
            at = int(bad.nonzero()[0])
            first = (start + at, float(a64[at]), float(b64[at]))
    if first is None:
        return None
    return {"element_index": [int(i) for i in torch.unravel_index(torch.tensor(first[0]), shape)] if len(shape) else [],
            "expected": first[1], "got": first[2], "max_abs_error": max_abs,
            "max_rel_error": max_rel if floating else 0.0, "detail": ""}


def mode_baseline(spec):
    import torch

    device = device_of(spec)
    GATE.share(device)
    task, model = reference_model(spec, device)
    input_sets = timing_inputs(task, spec, device)
    seeds = spec["timing_seeds"]
    # Paired, each round takes its own turn alone; else the whole loop runs alone.
    with GATE.alone(device) if not spec["timing"].get("rounds") else contextlib.nullcontext():
        eager, eager_host, _, _, cpu, rounds = measure(lambda inputs: model(*inputs), input_sets, seeds, device,
                                                       spec["timing"])
    result = {"ok": True, "eager_ms": eager, "eager_host_ms": eager_host, "timing_cpu": cpu}
    if rounds:
        result["eager_rounds"] = rounds
    if spec.get("compile"):
        try:
            compiled = torch.compile(model)
            # Compiled (inductor and Triton work on the CPU) while the device is shared; only the timing runs alone.
            with torch.no_grad():
                compiled(*input_sets[0])
            with GATE.alone(device):
                result["compile_ms"], _, _, _, _, _ = measure(lambda inputs: compiled(*inputs), input_sets, seeds,
                                                           device, spec["timing"])
        except Exception as error:  # torch.compile is unavailable on some hosts (no C compiler for inductor)
            result["compile_error"] = f"{type(error).__name__}: {error}"[:2000]
    write_result(spec, result)


MODES = {
    "compile": mode_compile,
    "reference": mode_reference,
    "candidate": mode_candidate,
    "check": mode_check,
    "baseline": mode_baseline,
    "bindings_pch": mode_bindings_pch,
}


def main():
    if sys.argv[1:] == ["--specs"]:
        # The spec fields of each mode, for the evaluator's test that both sides agree.
        print(json.dumps({mode: sorted(fields) for mode, fields in SPECS.items()}))
        return
    with phase("import_torch"):
        import torch  # noqa: F401  (before the request: the evaluator may not hold the device yet)
    with phase("wait"):
        request = json.loads(sys.stdin.buffer.read() or b"null")
    if request is None:
        sys.exit(4)  # the evaluator went away before asking for anything
    try:
        mode, spec = check_request(request)
    except ProtocolError as error:
        refuse(request, error)
    global MODE
    MODE = mode
    # The device this stage runs on is known only now; nothing has touched CUDA yet.
    os.environ.update(request.get("env") or {})
    global GATE
    GATE = Gate(spec.get("gate"), spec.get("timing_cpu"))
    if spec.get("device") == "cuda":
        global BLOCKING_SYNC
        BLOCKING_SYNC = blocking_sync()
    try:
        MODES[mode](spec)
        code = 0
    except BaseException as error:  # report every failure as data; the evaluator classifies it
        write_result(spec, {
            "ok": False,
            "error_type": type(error).__name__,
            "phase": getattr(error, "kforge_phase", "run"),
            "error": traceback.format_exc()[-8000:],
        })
        code = 3
    finish(spec, code)


def finish(spec, code):
    """Ends the stage once its result is written. The interpreter's own shutdown (torch's finalisers, the modules'
    destructors) takes seconds on a loaded host, and the evaluator kills a stage that runs on for long after
    closing its control socket; so the process ends here, at once. Under a launcher (ncu) the launcher's library
    in this process writes its data at exit, so the interpreter shuts down normally there."""
    if spec.get("profiled_calls"):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    _exit(code)


if __name__ == "__main__":
    main()
