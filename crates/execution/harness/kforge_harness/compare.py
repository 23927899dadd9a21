"""The comparison of outputs, in the reference's and the checker's clean processes: per tensor within tolerance
(`compare_tensor`, `allowed_error`), per trial in the order of judgement (`compare_trials`: the first trials, the
replay, the sensitivity check, then the re-checks), the timed calls kept (`compare_timed_calls`), and which trials are
kept under the output budget (`kept_trials`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .inputs import Task, timed_call_inputs
from .outputs import CHUNK_ELEMENTS, Saved, load_outputs, outputs_digest, prefetch, saved_outputs, timed_output_path
from .process import synchronize
from .protocol import Tolerance, Tolerances

if TYPE_CHECKING:
    import torch

    from .gate import Gate
    from .protocol import CompareSpec, Phases, Sensitivity

# A mismatch as the result reports it (`protocol::MismatchRecord`): trial, output_index, element_index, expected,
# got, max_abs_error, max_rel_error, detail, changed.
Mismatch = dict[str, Any]


def kept_trials(
    total: int, output_bytes_budget: int, sensitivity: Sensitivity | None, replay: int | None, size: int
) -> list[int]:
    """The trials, of `total`, whose outputs are saved and compared when one trial's outputs take `size` bytes:
    every trial while they fit in `output_bytes_budget`, else as many as fit (at least two) in this order: trial 0
    (the base of the sensitivity trial and of the replay), the sensitivity trial, the replay (trial 0's inputs after
    timing), then the others from the last down (the re-check trials are the last ones, so they come first). The
    candidate's harness, the reference stage and the checker each decide from their own trial 0 (the reference's,
    for the checker) and from fields every one of their specs carries, so they keep the same trials: a candidate
    whose outputs differ in size already fails trial 0."""
    budget = output_bytes_budget or 0
    if not budget or size * total <= budget:
        return list(range(total))
    first = [0] + ([sensitivity.trial] if sensitivity else []) + ([replay] if replay is not None else [])
    kept: list[int] = []
    for trial in first + list(range(total - 1, 0, -1)):
        if trial < total and trial not in kept and (len(kept) < 2 or (len(kept) + 1) * size <= budget):
            kept.append(trial)
    return sorted(kept)


def tolerance(dtype: torch.dtype, tolerances: Tolerances) -> tuple[float, float, float]:
    """(atol, rtol, scale_rtol) of a dtype; integers and booleans compare exactly (and ignore them)."""
    import torch

    key = {
        torch.float16: "float16",
        torch.bfloat16: "bfloat16",
        torch.float32: "float32",
        torch.float64: "float64",
    }.get(dtype)
    if key is None:
        return 0.0, 0.0, 0.0
    entry = tolerances[key]
    return entry.atol, entry.rtol, entry.scale_rtol


def allowed_error(
    expected: torch.Tensor, scales: tuple[float, float], atol: float, rtol: float, scale_rtol: float
) -> torch.Tensor:
    """The error allowed per element of an output whose finite values have `scales` (the largest |value|, the mean
    |value|), `expected` in float64: the absolute part shrinks with the largest value (on an output whose values are
    all far below atol, a constant or zero answer would otherwise pass), and a part relative to the mean |value|
    covers the rounding of sums that cancel (an element near zero made of terms as large as the output's typical
    values is off by rounding at that magnitude; outliers move the mean far less than the peak)."""
    peak, typical = scales
    return atol * min(1.0, max(peak, 1e-6)) + scale_rtol * typical + rtol * expected.abs()


def check_outputs(
    spec: CompareSpec,
    device: torch.device,
    reference: Callable[[], tuple[Task, Any]],
    gate: Gate,
    phases: Phases,
) -> tuple[Mismatch | None, list[int] | None]:
    """The first mismatch, the strongest evidence first: the first trials, the replay, the sensitivity check
    (`compare_trials`), then the timed calls kept (`compare_timed_calls`: their reference from `reference()`, the
    task and its model), then the re-checks on fresh inputs after the replay. A timed call is judged wrong only
    while those re-checks pass: both wrong, on inputs the first trials did not have, is a candidate that fails some
    inputs (rounding near the tolerance looks the same), and the re-check's mismatch is reported without judging the
    timed calls. With it, the trials compared (`compare_trials`)."""
    mismatch, late, compared = compare_trials(spec, device, gate, phases)
    if mismatch is not None or late is not None:
        return mismatch or late, compared
    if not spec.timed_outputs:
        return None, compared
    task, model = reference()
    return compare_timed_calls(spec, task, model, device, gate, phases), compared


def compare_timed_calls(
    spec: CompareSpec, task: Task, model: Any, device: torch.device, gate: Gate, phases: Phases
) -> Mismatch | None:
    """Checks the outputs of the candidate's timed calls it kept (the last, and a random sample: `TimedSample`)
    against the reference on the same, rebuilt inputs; a mismatch names its call, and so does a file whose digest
    is not the one the harness took when it wrote it (the candidate's code ran after, and could rewrite it). A task
    whose reference gives another output when called again on the same inputs (dropout in training mode, say) draws
    from torch's generator per call, and a timed call's draw depends on how many calls timing made: for such a task
    the check cannot apply and is passed (the correctness trials, seeded alike on both sides, still hold)."""
    import torch

    for n, kept in enumerate(spec.timed_outputs):
        call = kept.call
        inputs = timed_call_inputs(task, spec.timing_seeds, device, call)
        with torch.no_grad():
            expected = saved_outputs(model(*inputs))
            again = saved_outputs(model(*inputs)) if n == 0 else None
        synchronize(device)
        if again is not None and compare_outputs(expected, again, spec.tolerances) is not None:
            return None
        timed = timed_output_path(spec.candidate_dir, call)
        with phases("prefetch"):
            prefetch([timed], device, gate)
        try:
            with phases("load"):
                got = load_outputs(timed, device)
        except Exception as error:
            return {
                "trial": -1,
                "output_index": 0,
                "detail": f"timed call {call}: outputs unreadable: {type(error).__name__}",
            }
        with phases("compare"):
            digest = outputs_digest([v["tensor"] for v in got if "tensor" in v], got, spec.digest_key)
            if digest != list(kept.digest):
                return {
                    "trial": -1,
                    "output_index": 0,
                    "detail": f"timed call {call}: its outputs file changed after the harness wrote it",
                }
            mismatch = compare_outputs(expected, got, spec.tolerances)
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


def widened(tolerances: Tolerances, factor: float) -> Tolerances:
    """`tolerances` with every tolerance `factor` times as large."""
    return {
        dtype: Tolerance(atol=entry.atol * factor, rtol=entry.rtol * factor, scale_rtol=entry.scale_rtol * factor)
        for dtype, entry in tolerances.items()
    }


def compare_trials(
    spec: CompareSpec, device: torch.device, gate: Gate, phases: Phases
) -> tuple[Mismatch | None, Mismatch | None, list[int] | None]:
    """(the first mismatch over the first trials, the replay and the sensitivity check; the first over the re-checks
    after the replay, or the replay's where it is only a little outside the tolerance), each None where there is
    none; and the trials compared (`kept_trials`, None before trial 0); compared on `device`. The replay (trial 0's
    inputs again after timing) is compared with trial 0's reference: outside REPLAY_CHANGED times the tolerance it is
    changed behaviour, else a candidate near the tolerance. The sensitivity trial takes the absolute and scale parts
    of its tolerance from its base's reference (its moved elements would loosen them for every element)."""

    def path(kind: str, trial: int) -> str:
        folder = spec.reference_dir if kind == "reference" else spec.candidate_dir
        return os.path.join(folder, f"{kind}-{trial}.out")

    def load(kind: str, trial: int) -> list[Saved]:
        return load_outputs(path(kind, trial), device)

    sensitivity, replay = spec.sensitivity, spec.replay
    late: Mismatch | None = None
    kept: dict[int, tuple[list[Saved], list[Saved]]] = {}  # the base and sensitivity trials' outputs, for after
    compared = [0]  # trial 0's reference outputs decide which trials were kept (kept_trials)
    compared_trials = None
    for trial in range(len(spec.seeds)):
        if trial not in compared:
            continue
        after_replay = replay is not None and trial > replay
        reference_trial = 0 if trial == replay else trial  # the replay has no reference of its own
        # Comparing shares the device, with a pause point after each file's load, so timed work elsewhere waits
        # for no more than one load (a second for GiB outputs) or one comparison; reading the files is host work.
        with phases("prefetch"):
            prefetch([path("reference", reference_trial), path("candidate", trial)], device, gate)
        with phases("load"):
            expected = load("reference", reference_trial)
        if trial == 0:
            size = sum(v["tensor"].numel() * v["tensor"].element_size() for v in expected if "tensor" in v)
            compared = kept_trials(len(spec.seeds), spec.output_bytes_budget, sensitivity, replay, size)
            compared_trials = compared
        gate.pause(device)
        try:
            with phases("load"):
                got = load("candidate", trial)
        except Exception as error:  # a missing or malformed file is the candidate's output, not ours
            mismatch = {"trial": trial, "output_index": 0, "detail": f"outputs unreadable: {type(error).__name__}"}
            if not after_replay:
                return mismatch, None, compared_trials
            late = late or mismatch
            break
        gate.pause(device)
        moved = sensitivity is not None and trial == sensitivity.trial
        with phases("compare"):
            base = kept[sensitivity.base][0] if sensitivity is not None and moved else None
            mismatch = compare_outputs(expected, got, spec.tolerances, base)
        if mismatch is None and sensitivity and trial in (sensitivity.base, sensitivity.trial):
            kept[trial] = (expected, got)
        if mismatch is None:
            continue
        mismatch["trial"] = trial
        if moved:
            mismatch["detail"] = (
                "input sensitivity: wrong on the sensitivity trial (trial 0's inputs with a few "
                "elements moved far out of range) " + mismatch.get("detail", "")
            ).strip()
        if trial == replay:
            with phases("compare"):
                changed = compare_outputs(expected, got, widened(spec.tolerances, REPLAY_CHANGED)) is not None
            mismatch["detail"] = (
                f"replay: trial 0's inputs again after timing and the census gave an output outside "
                f"the tolerance, {'and' if changed else 'but not'} outside {REPLAY_CHANGED} times "
                f"it " + mismatch.get("detail", "")
            ).strip()
            if changed:
                mismatch["changed"] = True  # runtime.changed_after_check
                return mismatch, None, compared_trials
            late = late or mismatch  # rounding of a candidate near the tolerance, not changed behaviour
            continue
        if not after_replay:
            return mismatch, None, compared_trials
        late = late or mismatch
        break
    if not sensitivity:
        return None, late, compared_trials
    (ref_base, cand_base), (ref_moved, cand_moved) = kept[sensitivity.base], kept[sensitivity.trial]
    gate.pause(device)
    with phases("compare"):
        judged = compare_sensitivity(ref_base, ref_moved, cand_base, cand_moved, sensitivity.trial, spec.tolerances)
        return judged, late, compared_trials


def compare_sensitivity(
    ref_base: Sequence[Saved],
    ref_moved: Sequence[Saved],
    cand_base: Sequence[Saved],
    cand_moved: Sequence[Saved],
    trial: int,
    tolerances: Tolerances,
) -> Mismatch | None:
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
        tol = tolerance(a.dtype, tolerances)
        a, b, c, d = (t.reshape(-1) for t in (a, b, c, d))  # pyright: ignore[reportOptionalMemberAccess]
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
                return {
                    "trial": trial,
                    "output_index": index,
                    "element_index": [start + at],
                    "expected": float(d_ref[at]),
                    "got": float(d_cand[at]),
                    "detail": "input sensitivity: with a few input elements moved far out of range, the "
                    "reference's output moved by `expected` at this (flattened) element and the "
                    "candidate's by `got`: the candidate does not compute on all of its input",
                }
    return None


def compare_outputs(
    expected: Sequence[Saved], got: Any, tolerances: Tolerances, base: Sequence[Saved] | None = None
) -> Mismatch | None:
    """The first output of `got` that differs from `expected`'s, or None. With `base` (another trial's expected
    outputs, of the same shapes), each tensor's tolerance takes its scales from base's."""
    if not isinstance(got, list) or len(got) != len(expected):
        return {
            "output_index": 0,
            "detail": f"expected {len(expected)} outputs, got {len(got) if isinstance(got, list) else 'none'}",
        }
    for index, (want, have) in enumerate(zip(expected, got)):
        if not isinstance(have, dict) or ("tensor" not in have and "value" not in have):
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
        mismatch = compare_tensor(a, b, *tolerance(a.dtype, tolerances), scales=scales)
        if mismatch is not None:
            mismatch["output_index"] = index
            return mismatch
    return None


def finite_scales(flat: torch.Tensor) -> tuple[float, float]:
    """(the largest finite |value|, the mean finite |value|) of a flat floating-point tensor, read in chunks of
    CHUNK_ELEMENTS; zeros where none is finite."""
    import torch

    peak, total, count = 0.0, 0.0, 0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        part = flat[start : start + CHUNK_ELEMENTS].to(torch.float64).abs()
        finite = torch.isfinite(part)
        part = torch.where(finite, part, torch.zeros_like(part))
        peak = max(peak, float(part.max()))
        total += float(part.sum())
        count += int(finite.sum())
    return peak, total / count if count else 0.0


def compare_tensor(
    a: torch.Tensor,
    b: torch.Tensor,
    atol: float,
    rtol: float,
    scale_rtol: float,
    scales: tuple[float, float] | None = None,
) -> Mismatch | None:
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
        a64 = a[start : start + CHUNK_ELEMENTS].to(torch.float64)
        b64 = b[start : start + CHUNK_ELEMENTS].to(torch.float64)
        diff = (a64 - b64).abs()
        if floating:
            finite_expected = torch.isfinite(a64)
            # NaN never passes, and Inf only where the reference has the same Inf.
            bad_nonfinite = ~torch.isfinite(b64) & ~(torch.isinf(a64) & (a64 == b64))
            diff = torch.where(finite_expected, diff, torch.zeros_like(diff))
            allowed = allowed_error(a64, scales, atol, rtol, scale_rtol)  # pyright: ignore[reportArgumentType]
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
    return {
        "element_index": [int(i) for i in torch.unravel_index(torch.tensor(first[0]), shape)] if len(shape) else [],
        "expected": first[1],
        "got": first[2],
        "max_abs_error": max_abs,
        "max_rel_error": max_rel if floating else 0.0,
        "detail": "",
    }
