"""The stages: one function per mode (`mode_compile`, `mode_candidate`, `mode_reference`, `mode_check`,
`mode_baseline`, `mode_bindings_pch`), and `main`, which runs one of them in this process.

The order of a stage's start-up: torch is imported first, then the request is read from stdin until EOF (the
evaluator may start the process before a device is free and write the request once it holds the device, so the
interpreter's start and torch's import are not spent on the device's time), checked and parsed into its spec, the
environment it names set (nothing has touched CUDA yet), the gate joined, and on a GPU the process made to wait for
it asleep; then the mode runs, its result is written, and the process ends at once (`finish`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, NoReturn

from . import process
from .build import bindings_flags, install_build_recipe, precompile_host_prefixes
from .census import Census, ExtensionCalls, JitKernels, compiled_kernels, extension_libraries
from .compare import check_outputs, kept_trials
from .gate import Gate
from .inputs import Task, load_module, make_inputs, make_model, timing_inputs, trial_inputs
from .integrity import RACE_CHECK_BYTES, Integrity, differs_after_sync, poison_free_memory
from .outputs import output_bytes, staged_outputs, staging_buffers, tensor_digest, write_outputs
from .process import monotonic, open_file, originals, synchronize
from .protocol import (
    ABSENT,
    Absent,
    BaselineResult,
    BaselineSpec,
    BindingsPchResult,
    BindingsPchSpec,
    CandidateResult,
    CandidateSpec,
    CheckSpec,
    CompareResult,
    CompareSpec,
    CompileResult,
    CompileSpec,
    Failure,
    Json,
    Phases,
    ProtocolError,
    ReferenceSpec,
    Spec,
    check_request,
    refuse,
    result_fields,
    spec_fields,
    write_result,
)
from .timing import TimedSample, keep_timed_outputs, measure

if TYPE_CHECKING:
    import torch


def device_of(spec: CandidateSpec | CompareSpec | BaselineSpec) -> torch.device:
    import torch

    return torch.device(spec.device)


def reference_model(spec: CompareSpec | BaselineSpec, device: torch.device) -> tuple[Task, Any]:
    task = load_module(spec.task_path, "kforge_task")
    return task, make_model(task.Model, task, spec.init_seed, device)


def mode_compile(spec: CompileSpec, gate: Gate, phases: Phases) -> None:
    started = monotonic()
    install_build_recipe(building=True)
    with phases("import_candidate"):
        module = load_module(spec.candidate_path, "kforge_candidate")
    if not hasattr(module, "ModelNew"):
        raise RuntimeError("the candidate defines no ModelNew")
    seconds = monotonic() - started
    kernels: list[str] | Absent = ABSENT
    kernels_unread: str | Absent = ABSENT
    if spec.kernels:
        with phases("list_kernels"):
            names, why = compiled_kernels(extension_libraries())
        if why is None:
            kernels = names or []
        else:
            kernels_unread = why
    write_result(spec, CompileResult(ok=True, seconds=seconds, kernels=kernels, kernels_unread=kernels_unread), phases)


def mode_reference(spec: ReferenceSpec, gate: Gate, phases: Phases) -> None:
    import torch

    device = device_of(spec)
    gate.share(device)
    task, model = reference_model(spec, device)
    kept = [0]  # as in the candidate's stage: trial 0's outputs decide which trials are kept
    largest = 0  # the most bytes of outputs one trial gave: the disk budget's size for a task it cannot size
    for trial in range(len(spec.seeds)):
        if trial not in kept or trial == spec.replay:
            continue  # the replay repeats trial 0's inputs and is compared with trial 0's reference
        gate.pause(device)
        with phases("reference"):
            inputs = trial_inputs(task, spec.seeds, spec.sensitivity, trial, device)
            with torch.no_grad():
                output = model(*inputs)
        with phases("save_reference"):
            write_outputs(output, os.path.join(spec.reference_dir, f"reference-{trial}.out"))
        size = output_bytes(output)
        largest = max(largest, size)
        if trial == 0:
            kept = kept_trials(len(spec.seeds), spec.output_bytes_budget, spec.sensitivity, spec.replay, size)
        del inputs, output
    device_peak_bytes: int | Absent = ABSENT
    if device.type == "cuda":
        # The most device memory the reference held at once (model, inputs, outputs, workspace): the evaluator
        # estimates the task's footprint from it for memory-aware admission (devices::footprint).
        device_peak_bytes = torch.cuda.max_memory_allocated(device)
    mismatch: dict[str, Json] | Absent | None = ABSENT
    compared_trials: list[int] | Absent | None = ABSENT
    if spec.candidate_dir:
        mismatch, compared_trials = check_outputs(spec, device, lambda: (task, model), gate, phases)
    result = CompareResult(
        ok=True,
        output_bytes=largest,
        device_peak_bytes=device_peak_bytes,
        mismatch=mismatch,
        compared_trials=compared_trials,
    )
    write_result(spec, result, phases)


def run_trial(
    model: Any,
    task: Task,
    device: torch.device,
    trial: int,
    integrity: Integrity,
    mutated_inputs: list[int],
    spec: CandidateSpec,
    gate: Gate,
) -> int:
    """Runs correctness trial `trial` and saves its outputs for the checker; a trial whose inputs the candidate
    changed joins `mutated_inputs`. Returns the bytes of its outputs."""
    import torch

    inputs = trial_inputs(task, spec.seeds, spec.sensitivity, trial, device)
    before = tensor_digest(inputs)
    caller = originals().current_stream(device) if device.type == "cuda" else None
    gate.call()
    with torch.no_grad():
        output = model(*inputs)
    # Read as a consumer on the caller's stream would: copied in that stream's order, before any device-wide
    # synchronisation, so work left running on another stream is read unfinished; the copy is the outputs file.
    # Outputs small enough to be read twice keep a private copy for the race check (the file is the candidate's).
    private = output_bytes(output) <= RACE_CHECK_BYTES
    ordered = write_outputs(output, os.path.join(spec.candidate_dir, f"candidate-{trial}.out"), caller, private)
    synchronize(device)
    gate.pause(device)  # the call is over: synchronised, and a pause point
    if caller is not None:
        unordered = differs_after_sync(output, ordered)
        if unordered is not None:
            integrity.add(
                "runtime.unordered_output",
                f"output {unordered} read on the caller's stream right after forward returned differs from "
                f"the same output after a device-wide synchronisation (trial {trial}): work still ran "
                f"that the caller's stream was not ordered after (another stream, no event wait)",
            )
    if tensor_digest(inputs) != before:
        mutated_inputs.append(trial)
    integrity.check_outputs(inputs, output, trial)
    return output_bytes(output)


def mode_candidate(spec: CandidateSpec, gate: Gate, phases: Phases) -> None:
    import torch

    device = device_of(spec)
    with phases("device_init"):
        task = load_module(spec.task_path, "kforge_task")
        originals()
        poison_free_memory(device)
        if device.type == "cuda" and staged_outputs(spec.candidate_dir):
            staging_buffers()  # made now: making pinned memory later would synchronise the candidate's streams
    integrity = Integrity()
    install_build_recipe(building=False)
    extensions = ExtensionCalls()
    extensions.install()
    jit_kernels = JitKernels()
    jit_kernels.install(spec.candidate_path)
    try:
        with phases("import_candidate"):
            gate.call()  # the module's own code runs, and its extensions load
            candidate = load_module(spec.candidate_path, "kforge_candidate")
    except BaseException as error:
        error.kforge_phase = "import"  # pyright: ignore[reportAttributeAccessIssue]
        raise
    integrity.check_environment("when the candidate was imported")
    with phases("trials"):
        gate.call()
        model = make_model(candidate.ModelNew, task, spec.init_seed, device)
        mutated_inputs: list[int] = []
        seeds = spec.seeds
        # Trials from `recheck_from` on run after timing and the census: behaviour that changes once the
        # correctness check is over is caught by the same comparison.
        recheck_from = spec.recheck_from
        kept = [0]  # trial 0 always runs; its outputs' size decides the rest
        first_bytes = None
        for trial in range(recheck_from):
            if trial not in kept:
                continue
            gate.pause(device)
            size = run_trial(model, task, device, trial, integrity, mutated_inputs, spec, gate)
            if trial == 0:
                kept = kept_trials(len(seeds), spec.output_bytes_budget, spec.sensitivity, spec.replay, size)
                first_bytes = size
    integrity.check_environment("during the correctness trials")
    samples_ms: list[float] | Absent = ABSENT
    host_ms: list[float] | Absent = ABSENT
    timed_rounds: list[int] | Absent = ABSENT
    timing_cpu: dict[str, Json] | Absent = ABSENT
    timed_outputs: list[dict[str, Json]] | Absent = ABSENT
    census_records: list[dict[str, Json]] | Absent = ABSENT
    timing, calls = spec.timing, spec.census_calls
    if timing or calls:
        with phases("census_start"):
            census = (
                Census(model, make_inputs(task, spec.timing_seeds[0], device), device, calls, gate, extensions)
                if calls
                else None
            )
        with phases("timing"):
            input_sets = timing_inputs(task, spec.timing_seeds, device) if timing else None
        paired = bool(timing and timing.rounds)
        measured = None

        def timed() -> tuple[tuple[list[float], list[float], int, Any, dict[str, Any], list[int]], TimedSample | None]:
            """The timed loop (called only when timing was asked for: `timing` and `input_sets` are set)."""
            with phases("timing"):
                keep = spec.keep_timed
                sample = TimedSample(device, keep, first_bytes) if keep is not None else None
                return measure(
                    lambda inputs: model(*inputs),
                    input_sets,  # pyright: ignore[reportArgumentType]
                    spec.timing_seeds,
                    device,
                    timing,  # pyright: ignore[reportArgumentType]
                    gate,
                    sample,
                ), sample

        # The census and unpaired timing share one turn alone on the device. Paired timing takes its turns with
        # the baseline's round by round (`paired_rounds`), after the census.
        if census is not None or (timing and not paired):
            with gate.alone(device):
                if census is not None:
                    with phases("census_calls"):
                        census.record()
                if timing and not paired:
                    measured = timed()
        if paired:
            measured = timed()
        if measured is not None:  # timed: `timing` was asked for
            (samples, host, last_call, output, cpu, rounds), sample = measured
            if cpu.get("threads_changed"):
                integrity.add(
                    "runtime.threads_changed",
                    "the candidate changed torch's thread count while it was timed (timing on a CPU runs "
                    "both sides with one thread)",
                )
            with phases("timing"):
                synchronize(device)
                samples_ms, host_ms, timed_rounds, timing_cpu = samples, host, rounds, cpu
                timed_outputs = keep_timed_outputs(spec.candidate_dir, output, last_call, sample) if sample else []
                del sample, output
        if census is not None:
            with phases("census_read"):
                census_records = census.records()
        integrity.check_environment("during the census and timing")
    if spec.profiled_calls:
        profiled_calls(
            model, make_inputs(task, spec.timing_seeds[0], device), device, spec.profiled_calls, gate, phases
        )
        integrity.check_environment("during the profiled calls")
    with phases("recheck"):
        for trial in range(recheck_from, len(seeds)):
            if trial not in kept:
                continue
            gate.pause(device)
            run_trial(model, task, device, trial, integrity, mutated_inputs, spec, gate)
    integrity.check_environment("after the last trial")
    findings = [{"code": code, "message": message} for code, message in integrity.findings.items()]
    jit_names = sorted(jit_kernels.names) if jit_kernels.names is not None else ABSENT
    device_peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else ABSENT
    result = CandidateResult(
        ok=True,
        mutated_inputs=mutated_inputs,
        samples_ms=samples_ms,
        host_ms=host_ms,
        rounds=timed_rounds,
        timing_cpu=timing_cpu,
        timed_outputs=timed_outputs,
        census=census_records,
        findings=findings,
        jit_kernels=jit_names,
        device_peak_bytes=device_peak_bytes,
    )
    write_result(spec, result, phases)


def profiled_calls(model: Any, inputs: list[Any], device: torch.device, calls: int, gate: Gate, phases: Phases) -> None:
    """`calls` forward calls inside the profiler's range, alone on the device, after one warm-up call outside it
    (lazy compilation, autotuning and caches are not what a profile should show). A profiler started with profiling
    off (`ncu --profile-from-start off`) records the range only."""
    import torch

    cudart = torch.cuda.cudart() if device.type == "cuda" else None
    with gate.alone(device), phases("profiled_calls"):
        gate.call()
        model(*inputs)
        synchronize(device)
        if cudart is not None:
            cudart.cudaProfilerStart()
        try:
            for _ in range(calls):
                gate.call()
                model(*inputs)
                synchronize(device)
        finally:
            if cudart is not None:
                cudart.cudaProfilerStop()


def mode_check(spec: CheckSpec, gate: Gate, phases: Phases) -> None:
    device = device_of(spec)
    gate.share(device)  # outputs are compared on their device
    mismatch, compared_trials = check_outputs(spec, device, lambda: reference_model(spec, device), gate, phases)
    write_result(spec, CompareResult(ok=True, mismatch=mismatch, compared_trials=compared_trials), phases)


def mode_baseline(spec: BaselineSpec, gate: Gate, phases: Phases) -> None:
    import torch

    device = device_of(spec)
    gate.share(device)
    task, model = reference_model(spec, device)
    input_sets = timing_inputs(task, spec.timing_seeds, device)
    seeds = spec.timing_seeds
    # Paired, each round takes its own turn alone; else the whole loop runs alone.
    with gate.alone(device) if not spec.timing.rounds else contextlib.nullcontext():
        eager, eager_host, _, _, cpu, rounds = measure(
            lambda inputs: model(*inputs), input_sets, seeds, device, spec.timing, gate
        )
    eager_rounds: list[int] | Absent = rounds if rounds else ABSENT
    compile_ms: list[float] | Absent = ABSENT
    compile_error: str | Absent = ABSENT
    if spec.compile:
        try:
            compiled = torch.compile(model)
            # Compiled (inductor and Triton work on the CPU) while the device is shared; only the timing runs alone.
            with torch.no_grad():
                compiled(*input_sets[0])
            with gate.alone(device):
                compile_ms, _, _, _, _, _ = measure(
                    lambda inputs: compiled(*inputs), input_sets, seeds, device, spec.timing, gate
                )
        except Exception as error:  # torch.compile is unavailable on some hosts (no C compiler for inductor)
            compile_error = f"{type(error).__name__}: {error}"[:2000]
    result = BaselineResult(
        ok=True,
        eager_ms=eager,
        eager_host_ms=eager_host,
        timing_cpu=cpu,
        eager_rounds=eager_rounds,
        compile_ms=compile_ms,
        compile_error=compile_error,
    )
    write_result(spec, result, phases)


def mode_bindings_pch(spec: BindingsPchSpec, gate: Gate, phases: Phases) -> None:
    """Precompiles torch/extension.h as load_inline's bindings (main.cpp, which starts with it) would read it, once
    per set of extra flags in the spec's `variants`, into `out_dir`/torch/extension.h.gch/<variant>.gch. A build
    given that directory on its include path (CPATH) uses the first variant gcc finds valid for its own flags (the
    macros the header sees included) and reads the header as usual when none is. No candidate code runs here."""
    import subprocess

    import torch
    from torch.utils import cpp_extension

    header = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "extension.h")
    out = os.path.join(spec.out_dir, "torch", "extension.h.gch")
    os.makedirs(out, exist_ok=True)
    # gcc reads the header beside the directory whenever it does not take a precompiled one (another include of
    # it, other flags): this one passes the include on to torch's own.
    with open_file(os.path.join(spec.out_dir, "torch", "extension.h"), "w") as f:
        f.write("#include_next <torch/extension.h>\n")
    builds: list[tuple[str, list[str], subprocess.Popen[bytes]]] = []
    for name, extra in spec.variants.items():
        command = [
            cpp_extension.get_cxx_compiler(),
            *bindings_flags(list(extra), spec.cuda),
            "-x",
            "c++-header",
            header,
            "-o",
            os.path.join(out, f"{name}.gch"),
        ]
        builds.append((name, command, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    host = precompile_host_prefixes(spec.out_dir, spec.variants) if spec.cuda else {}
    built: list[str] = []
    failed: dict[str, str] = {}
    for name, command, compiler in builds:
        _, errors = compiler.communicate()
        if compiler.returncode == 0:
            built.append(name)
        else:
            failed[name] = f"{' '.join(command)}\n{errors.decode(errors='replace')[-4000:]}"
    write_result(spec, BindingsPchResult(ok=bool(built), built=built, failed=failed, host=host), phases)


def run(spec: Spec, gate: Gate, phases: Phases) -> None:
    """Runs the spec's mode."""
    if isinstance(spec, CompileSpec):
        mode_compile(spec, gate, phases)
    elif isinstance(spec, ReferenceSpec):
        mode_reference(spec, gate, phases)
    elif isinstance(spec, CandidateSpec):
        mode_candidate(spec, gate, phases)
    elif isinstance(spec, CheckSpec):
        mode_check(spec, gate, phases)
    elif isinstance(spec, BaselineSpec):
        mode_baseline(spec, gate, phases)
    elif isinstance(spec, BindingsPchSpec):
        mode_bindings_pch(spec, gate, phases)
    else:
        raise ProtocolError(f"no stage runs a {type(spec).__name__}")


def main() -> None:
    if sys.argv[1:] == ["--specs"]:
        # The spec fields of each mode, for the evaluator's test that both sides agree.
        print(json.dumps(spec_fields()))
        return
    if sys.argv[1:] == ["--results"]:
        # The result fields of each mode, for the evaluator's test that both sides agree.
        print(json.dumps(result_fields()))
        return
    phases = Phases()
    with phases("import_torch"):
        # Before the request: the evaluator may not hold the device yet.
        import torch  # noqa: F401  # pyright: ignore[reportUnusedImport]
    with phases("wait"):
        request = json.loads(sys.stdin.buffer.read() or b"null")
    if request is None:
        sys.exit(4)  # the evaluator went away before asking for anything
    try:
        spec = check_request(request)
    except ProtocolError as error:
        refuse(request, error)
    # The device this stage runs on is known only now; nothing has touched CUDA yet.
    os.environ.update(request.get("env") or {})
    timing_cpu = spec.timing_cpu if isinstance(spec, (CandidateSpec, BaselineSpec)) else None
    gate = Gate(spec.gate, phases, timing_cpu)
    if isinstance(spec, (CandidateSpec, CompareSpec, BaselineSpec)) and spec.device == "cuda":
        process.BLOCKING_SYNC = process.blocking_sync()
    try:
        run(spec, gate, phases)
        code = 0
    except BaseException as error:  # report every failure as data; the evaluator classifies it
        failure = Failure(
            error_type=type(error).__name__,
            phase=getattr(error, "kforge_phase", "run"),
            error=traceback.format_exc()[-8000:],
        )
        write_result(spec, failure, phases)
        code = 3
    finish(spec, code)


def finish(spec: Spec, code: int) -> NoReturn:
    """Ends the stage once its result is written. The interpreter's own shutdown (torch's finalisers, the modules'
    destructors) takes seconds on a loaded host, and the evaluator kills a stage that runs on for long after
    closing its control socket; so the process ends here, at once. Under a launcher (ncu) the launcher's library
    in this process writes its data at exit, so the interpreter shuts down normally there."""
    if isinstance(spec, CandidateSpec) and spec.profiled_calls:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    process.exit_now(code)
