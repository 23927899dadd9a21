"""The kernel census and the names of the candidate's own kernels: what ran in each mode of a forward call
(`Census`), the calls into the candidate's compiled extensions (`ExtensionCalls`), the kernels compiled into its
builds (`compiled_kernels`) and the Triton kernels its code makes (`JitKernels`). Raw records only: the evaluator
computes the census's checks."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .process import open_file, synchronize

if TYPE_CHECKING:
    import torch

    from .gate import Gate


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

    def __init__(self) -> None:
        self.calls = 0
        self.functions = 0
        self.complete = True
        self.modules: list[ModuleType] = []

    def counted(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return function(*args, **kwargs)

        return call

    def wrap(self, module: Any) -> Any:
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

    def install(self) -> None:
        """Wraps load_inline and load (after the build recipe's own wrapper, which it calls)."""
        from torch.utils import cpp_extension

        def counting(load: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(load)
            def loading(*args: Any, **kwargs: Any) -> Any:
                return self.wrap(load(*args, **kwargs))

            return loading

        cpp_extension.load_inline = counting(cpp_extension.load_inline)
        cpp_extension.load = counting(cpp_extension.load)


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

    def __init__(
        self,
        model: Any,
        inputs: Sequence[Any],
        device: torch.device,
        calls: int,
        gate: Gate,
        extensions: ExtensionCalls,
    ) -> None:
        from torch.autograd import profiler

        self.model, self.inputs, self.device, self.calls = model, inputs, device, calls
        self.gate, self.extensions = gate, extensions
        self.extension_calls: list[int] = []  # per mode, the calls into the candidate's extensions (`extensions`)
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

    def record(self) -> None:
        import torch
        from torch.profiler import record_function

        model, inputs, device = self.model, self.inputs, self.device
        was_training = model.training
        try:
            for training, grad in CENSUS_MODES:
                model.train(training)
                with torch.set_grad_enabled(grad):
                    self.gate.call()  # the mode's untimed first call
                    model(*inputs)
                    synchronize(device)
                    before = self.extensions.calls
                    with record_function("kforge.mode"):
                        for _ in range(self.calls):
                            self.gate.call()  # each call and its synchronisation is one call to the evaluator
                            with record_function("kforge.call"):
                                model(*inputs)
                            synchronize(device)
                    self.extension_calls.append(self.extensions.calls - before)
        finally:
            model.train(was_training)
            self.profiler.__exit__(None, None, None)

    def records(self) -> list[dict[str, Any]]:
        from torch.autograd import DeviceType  # pyright: ignore[reportPrivateImportUsage]

        device, calls = self.device, self.calls
        names = [
            f"{'train' if training else 'eval'}/{'grad' if grad else 'no_grad'}" for training, grad in CENSUS_MODES
        ]
        events = self.profiler.function_events
        windows = sorted(
            (e.time_range.start, e.time_range.end)
            for e in events  # pyright: ignore[reportOptionalIterable]  (read after the session: set)
            if e.name == "kforge.mode" and e.device_type == DeviceType.CPU
        )
        if len(windows) != len(names):
            raise RuntimeError(f"the census found {len(windows)} mode ranges instead of {len(names)}")
        modes: list[dict[str, Any]] = [
            {"mode": name, "calls": calls, "call_spans": [], "records": []} for name in names
        ]
        if self.extensions.complete and len(self.extension_calls) == len(modes):
            for mode, extension_calls in zip(modes, self.extension_calls):
                mode["extension_functions"] = self.extensions.functions
                mode["extension_calls"] = extension_calls

        def mode_at(start: float) -> dict[str, Any] | None:
            for index, (begin, end) in enumerate(windows):
                if begin <= start <= end:
                    return modes[index]
            return None

        for event in events:  # pyright: ignore[reportOptionalIterable]
            if device.type == "cuda":
                # Device activity only: kernels, copies, sets. A record_function range (ours, or one the candidate
                # opens) also shows on the GPU timeline as a span; it is not work.
                annotation = getattr(event, "is_user_annotation", False) or event.name in ("kforge.call", "kforge.mode")
                if event.device_type == DeviceType.CUDA and not annotation:
                    mode = mode_at(event.time_range.start)
                    if mode is not None:
                        mode["records"].append(
                            {
                                "name": event.name,
                                "start_us": event.time_range.start,
                                "duration_us": event.time_range.elapsed_us(),
                            }
                        )
            elif event.name == "kforge.call":
                mode = mode_at(event.time_range.start)
                if mode is None:
                    continue
                mode["call_spans"].append(
                    {"start_us": event.time_range.start, "duration_us": event.time_range.elapsed_us()}
                )
                for child in event.cpu_children:
                    mode["records"].append(
                        {
                            "name": child.name,
                            "start_us": child.time_range.start,
                            "duration_us": child.time_range.elapsed_us(),
                        }
                    )
        return modes


def extension_libraries() -> list[str]:
    """The shared libraries the candidate's extensions (load_inline, load) were built into: every library under
    TORCH_EXTENSIONS_DIR, which holds this build's alone (torch imports them without entering sys.modules)."""
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        return []
    return sorted(glob.glob(os.path.join(root, "**", "*.so"), recursive=True))


def compiled_kernels(libraries: Sequence[str]) -> tuple[list[str] | None, str | None]:
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
    mangled: set[str] = set()
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


def entry_symbols(listing: str) -> set[str]:
    """The kernel (entry function) symbols of a `cuobjdump -symbols` listing."""
    return {line.split()[-1] for line in listing.splitlines() if "STT_FUNC" in line and "STO_ENTRY" in line}


def function_name(demangled: str) -> str:
    """A demangled function's name alone: no return type, namespace, template arguments or parameters."""

    def before_bracketed(text: str, opening: str, closing: str) -> str:
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

    def __init__(self) -> None:
        self.names: set[str] | None = None  # None: not looked for

    def install(self, candidate_path: str) -> None:
        with open_file(candidate_path) as f:
            if "triton" not in f.read():
                return
        try:
            from triton.runtime import jit
        except ImportError:
            return
        names: set[str] = set()
        self.names = names
        path = os.path.realpath(candidate_path)
        original = jit.JITFunction.__init__

        @functools.wraps(original)
        def init(function: Any, fn: Any, *args: Any, **kwargs: Any) -> None:
            original(function, fn, *args, **kwargs)
            code = getattr(fn, "__code__", None)
            if code is not None and os.path.realpath(code.co_filename) == path:
                names.add(fn.__name__)

        jit.JITFunction.__init__ = init  # pyright: ignore[reportAttributeAccessIssue]
