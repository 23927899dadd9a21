"""Timing: the timed loop (`measure`, `paired_rounds`) and its timer (`Timer`: a spin covering the launch, CUDA
events around the call, the L2 flushed first), and the sample of timed calls' outputs kept for the checker
(`TimedSample`, `keep_timed_outputs`). Raw samples only: the evaluator computes the statistics."""

from __future__ import annotations

import functools
import math
import os
import resource
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .inputs import perturb
from .outputs import as_written, flatten_outputs, outputs_digest, timed_output_path, write_outputs
from .process import getrusage, monotonic, open_file, originals, perf_counter_ns, set_sync, synchronize, urandom

if TYPE_CHECKING:
    import torch

    from .gate import Gate
    from .protocol import KeepTimed, TimingBudget


def thread_cpu_wait() -> tuple[int | None, int | None]:
    """(ns this thread waited runnable for a CPU, its involuntary context switches) so far: what competition for
    the CPU cost the timed loop. (None, None) where the kernel does not say."""
    try:
        with open_file("/proc/thread-self/schedstat") as f:
            waited = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        waited = None
    switches = getrusage(resource.RUSAGE_THREAD).ru_nivcsw if hasattr(resource, "RUSAGE_THREAD") else None
    return waited, switches


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

    def __init__(self, device: torch.device) -> None:
        import torch

        self.device = device
        self.flush_buffer = None
        self.cycles_per_ms = 0.0
        self.flush_ms = 0.0
        # Per call on a GPU: the cover asked for, the one the device ran (flushed -> start, by the events), and
        # whether it ran out before the host had enqueued the call.
        self.covers: list[float] = []
        self.covered: list[float] = []
        self.short: list[bool] = []
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            # Twice the L2 size, written between runs, so no run finds its data already cached.
            self.flush_buffer = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device=device)
            self.cycles_per_ms = spin_rate(device)
            self.flush_ms = self.flush_time()

    def flush_time(self) -> float | None:
        """The flush's device time: the median of five, after one untimed."""
        flush = functools.partial(originals().zero, self.flush_buffer)
        flush()
        return median_or_none([event_ms(self.device, flush) for _ in range(5)])

    def time_ms(self, fn: Callable[[], Any], cover_ms: float = 0.0) -> tuple[float, float, float, Any]:
        """(event ms, host ms, launch ms, result). The host clock spans the whole timed step (flush, call,
        synchronisation) less the cover, as the events measure it: the parent compares the two, so work the
        events miss still shows in wall-clock time. `launch ms` is the host's time inside `fn`."""
        begin = perf_counter_ns()
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
            launch = perf_counter_ns()
            result = fn()
            launch = (perf_counter_ns() - launch) / 1e6
            o.event_record(end)
            short = o.event_query(start)  # after the end event is enqueued: the timed work is not delayed
            o.synchronize(self.device)
            host = (perf_counter_ns() - begin) / 1e6
            covered = o.event_elapsed(flushed, start)
            host -= covered
            self.covers.append(cover_ms)
            self.covered.append(covered)
            self.short.append(short)
            return o.event_elapsed(start, end), host, launch, result
        result = fn()
        host = (perf_counter_ns() - begin) / 1e6
        return host, host, host, result


@functools.cache
def spin_rate(device: torch.device) -> float:
    """Clock cycles per millisecond of `torch.cuda._sleep` on `device`, measured once per process (it spins for
    cycles)."""
    spin = functools.partial(originals().sleep, 1_000_000)
    spin()  # its first launch loads the kernel
    elapsed = event_ms(device, spin)
    return 1_000_000 / elapsed if elapsed > 0 else 0.0


def event_ms(device: torch.device, work: Callable[[], object]) -> float:
    """The device time of what `work()` enqueues, between two events, waited for."""
    o = originals()
    start, end = o.event(enable_timing=True), o.event(enable_timing=True)
    o.event_record(start)
    work()
    o.event_record(end)
    o.synchronize(device)
    return o.event_elapsed(start, end)


def share(flags: Sequence[bool]) -> float | None:
    """The share of true values among `flags`, None when empty."""
    return sum(1 for flag in flags if flag) / len(flags) if flags else None


def median_or_none(values: Sequence[float]) -> float | None:
    """The median of `values` (the upper one of an even count), None when empty."""
    return sorted(values)[len(values) // 2] if values else None


def cover_ms(launches: Sequence[float], device_ms: Sequence[float], flush_ms: float = 0.0) -> float:
    """How long the spin before the next timed call runs: enough to hide its launch (the 75th percentile of the
    recent calls' launch time, 1.5x plus 20 us), never more than its device time plus the flush's plus 50 us (what
    a stream of back-to-back flushed calls would have queued ahead of it)."""
    if not launches:
        return 0.1
    recent = sorted(launches[-20:])
    launch = recent[min(len(recent) - 1, (3 * len(recent)) // 4)]
    device = median_or_none(device_ms[-20:]) or 0.0
    return min(1.5 * launch + 0.02, device + flush_ms + 0.05)


def sampled_timed_calls(output_bytes: int, keep: KeepTimed) -> int:
    """How many timed calls' outputs of `output_bytes` each are kept besides the last: at most the spec's
    `keep_timed.sampled_calls`, while together they fit in its `sampled_bytes` (a copy of each is held on the
    device during the loop; the evaluator's `disk::sampled_timed_calls` reserves their room alike)."""
    return min(keep.sampled_calls, keep.sampled_bytes // max(1, output_bytes))


class NotATensor:
    """What a sampled call kept in place of an output that is not a tensor (its repr, taken when the call returned),
    or of a tensor whose type is not torch.Tensor itself (a subclass's methods could answer for it later): either
    is written as a value that is not a tensor, which the checker's comparison refuses where a tensor is expected."""

    def __init__(self, value: object) -> None:
        self.text = repr(value)[:200] if not _is_tensor(value) else f"a {type(value).__name__}, not a torch.Tensor"

    def __repr__(self) -> str:
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

    def __init__(
        self,
        device: torch.device,
        keep: KeepTimed,
        expected_bytes: int | None = None,
        draw: Callable[[int], int] | None = None,
    ) -> None:
        self.device = device
        self.keep = keep
        self.expected_bytes = expected_bytes
        self.draw = draw or random_below
        self.capacity: int | None = None
        self.kept: list[Any] = []  # [call, [copies on the device, or NotATensor]]
        self.seen = 0

    def offer(self, call: int, output: Any) -> None:
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
            self.kept[slot] = [
                call,
                [NotATensor(f"outputs of {size} bytes where trial 0's took {self.expected_bytes}")],
            ]
            return
        o = originals()
        self.kept[slot] = [call, [o.clone(o.detach(v)) if type(v) is _tensor_type() else NotATensor(v) for v in values]]
        synchronize(self.device)

    def calls(self, last: int) -> list[Any]:
        """The kept calls other than `last`, with their copies: at most `capacity - 1`, a uniform sample."""
        others = [entry for entry in self.kept if entry[0] != last]
        while self.capacity is not None and len(others) > self.capacity - 1:
            others.pop(self.draw(len(others)))
        return sorted(others, key=lambda entry: entry[0])


def random_below(n: int) -> int:
    """A uniform integer in [0, n), from the operating system (rejection sampling over 64 bits)."""
    limit = (1 << 64) - (1 << 64) % n
    while True:
        value = int.from_bytes(urandom(8), "little")
        if value < limit:
            return value % n


def _tensor_type() -> type[torch.Tensor]:
    import torch

    return torch.Tensor


def _is_tensor(value: object) -> bool:
    return isinstance(value, _tensor_type())


def keep_timed_outputs(candidate_dir: str, output: Any, last_call: int, sample: TimedSample) -> list[dict[str, Any]]:
    """Writes the last timed call's outputs and the sampled calls' for the checker, in the candidate's folder; the
    calls with each file's digest (keyed with the spec's `keep_timed.digest_key`, the sample's), the last first."""
    kept: list[dict[str, Any]] = []
    for call, values in [(last_call, output), *sample.calls(last_call)]:
        entries = write_outputs(values, timed_output_path(candidate_dir, call))
        tensors = [as_written(v) for v in flatten_outputs(values) if _is_tensor(v)]
        kept.append({"call": call, "digest": outputs_digest(tensors, entries, sample.keep.digest_key)})
    return kept


def measure(
    fn_for_inputs: Callable[[Any], Any],
    input_sets: Sequence[Any],
    set_seeds: Sequence[int],
    device: torch.device,
    budget: TimingBudget,
    gate: Gate,
    sample: TimedSample | None = None,
) -> tuple[list[float], list[float], int, Any, dict[str, Any], list[int]]:
    """Raw samples of fn over rotating, per-call perturbed input sets; warm-up runs the same code path.

    Stops once at least `min_runs` samples and `min_seconds` of measurement are in and the relative standard error
    of the mean is under `budget.target_rel_error`, or at `max_runs`, or when `max_seconds` of measurement have
    passed. Each call is announced to the evaluator (`Gate.call`, outside the timed step), which stops a call that
    never returns. Returns the samples as (event ms, host ms) series, the index of the last call, its output, and
    what competition for the CPU cost the loop (`thread_cpu_wait` over the loop). With `sample` (a TimedSample),
    each measured call's output is offered to it after the call's timed step.
    """
    import torch

    timer = Timer(device)
    samples: list[float] = []
    host: list[float] = []
    launches: list[float] = []
    device_ms: list[float] = []
    call = -1
    output = None
    spinning = device.type == "cuda" and set_sync(spin=True)
    waited_before, switches_before = thread_cpu_wait()

    def step(record: bool = True) -> bool:
        """One call, timed; warm-up calls (and `record` false) are not recorded. Whether it was recorded."""
        nonlocal call, output
        call += 1
        which = call % len(input_sets)
        inputs = input_sets[which]
        perturb(inputs, set_seeds[which], call)
        gate.call(timed=spinning)
        elapsed, host_elapsed, launch, output = timer.time_ms(
            lambda: fn_for_inputs(inputs),
            cover_ms(launches, device_ms, timer.flush_ms),  # pyright: ignore[reportArgumentType]
        )
        launches.append(launch)
        device_ms.append(elapsed)
        if call < budget.warmup_runs or not record:
            return False
        samples.append(elapsed)
        host.append(host_elapsed)
        if sample is not None:
            sample.offer(call, output)
        return True

    rounds: list[int] = []
    # On a CPU both sides time with one torch thread: with a thread per core, a call waits for its slowest thread,
    # and on a machine shared with other work that wait is the load's, not the kernel's (the same eager op read
    # 0.05, 0.3 and 8 ms under one load, by how many of its threads found a free CPU).
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    with torch.no_grad():
        if budget.rounds:
            rounds = paired_rounds(step, device, budget, gate)
        else:
            started = None
            while len(samples) < budget.max_runs:
                if not step():
                    continue
                if started is None:
                    started = monotonic()
                n = len(samples)
                spent = monotonic() - started
                if n >= budget.min_runs and spent >= budget.min_seconds:
                    mean = sum(samples) / n
                    var = sum((s - mean) ** 2 for s in samples) / (n - 1)
                    if mean > 0 and math.sqrt(var / n) / mean < budget.target_rel_error:
                        break
                if spent > budget.max_seconds:
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
        "cpu_wait_ms": (waited_after - waited_before) / 1e6 if waited_before is not None else None,  # pyright: ignore[reportOptionalOperand]
        "involuntary_switches": switches_after - switches_before if switches_before is not None else None,  # pyright: ignore[reportOptionalOperand]
        "calls": call + 1,
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        # Medians over the measured calls, on a GPU: the host's time inside the call, the cover asked for, and the
        # cover the device ran (short of the one asked for where the spin's clock rate moved since it was measured).
        "launch_ms": median_or_none(launches[budget.warmup_runs :]) if device.type == "cuda" else None,
        "cover_ms": median_or_none(timer.covers[budget.warmup_runs :]),
        "cover_device_ms": median_or_none(timer.covered[budget.warmup_runs :]),
        # The share of the measured calls whose cover ran out before the host had enqueued them: above a half, the
        # median includes host launch time.
        "cover_short_share": share(timer.short[budget.warmup_runs :]),
    }
    return samples, host, call, output, cpu, rounds


def paired_rounds(step: Callable[..., bool], device: torch.device, budget: TimingBudget, gate: Gate) -> list[int]:
    """Paired timing: `budget.rounds` rounds of `step`, each alone on the device in its turn (`Gate.round`). The
    first opens with the warm-up calls, each later one with one unrecorded call (the other side's round ran in
    between, on the same caches). A round records at least one call, and at least its share of `min_runs` and
    `min_seconds` unless its share of `max_seconds` has passed; at most its share of `max_runs`. Returns the
    recorded calls' count in each round."""
    count = budget.rounds
    least_calls = max(1, math.ceil(budget.min_runs / count))
    most_calls = max(least_calls, budget.max_runs // count)
    least_seconds = budget.min_seconds / count
    most_seconds = max(least_seconds, budget.max_seconds / count)
    counts: list[int] = []
    for index in range(count):
        recorded = 0
        with gate.round(device):
            if index > 0:
                step(record=False)
            started = monotonic()
            while recorded < most_calls:
                if not step():
                    started = monotonic()  # a warm-up call: the round's time starts after it
                    continue
                recorded += 1
                spent = monotonic() - started
                if (recorded >= least_calls and spent >= least_seconds) or spent >= most_seconds:
                    break
        counts.append(recorded)
    return counts
