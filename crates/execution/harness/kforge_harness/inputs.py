"""What a stage loads and feeds: the task's and the candidate's modules, models, and the inputs of correctness
trials (seeded, the sensitivity trial's perturbed) and of timed calls (rotating sets, perturbed per call)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .outputs import tensor_bytes

if TYPE_CHECKING:
    import torch

    from .protocol import Sensitivity

# A task's module (`get_inputs`, `get_init_inputs`, `Model`), or anything with its functions.
Task = Any


def load_module(path: str, name: str) -> ModuleType:
    # A task's and a candidate's paths end in .py: they have a spec and a loader.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # pyright: ignore[reportArgumentType]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # pyright: ignore[reportOptionalMemberAccess]
    return module


def to_device(value: Any, device: torch.device) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def make_inputs(task: Task, seed: int, device: torch.device) -> list[Any]:
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


def trial_inputs(
    task: Task, seeds: Sequence[int], sensitivity: Sensitivity | None, trial: int, device: torch.device
) -> list[Any]:
    """The inputs of correctness trial `trial` (drawn from `seeds[trial]`); on the sensitivity trial, its base
    trial's inputs with a few elements moved far out of range (`perturb_sparsely`)."""
    inputs = make_inputs(task, seeds[trial], device)
    if sensitivity and trial == sensitivity.trial:
        perturb_sparsely(inputs, sensitivity.seed)
    return inputs


def perturb_sparsely(inputs: Sequence[Any], seed: int) -> None:
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
            positions = (
                torch.randperm(flat.numel(), generator=generator)[:count]
                if flat.numel() <= count
                else torch.randint(flat.numel(), (count,), generator=generator)
            )
            base = 64.0 * (1.0 + float(flat.abs().max()))
            cap = float(torch.finfo(flat.dtype).max) ** 0.5
            for position in positions.tolist():
                magnitude = min(base * 3.0**moved, cap)
                flat[position] = -magnitude if float(flat[position]) < 0 else magnitude
                moved += 1


def make_model(cls: Any, task: Task, init_seed: int, device: torch.device) -> Any:
    import torch

    torch.manual_seed(init_seed)
    init_inputs = to_device(list(task.get_init_inputs()), device)
    return cls(*init_inputs).to(device)


def perturb(inputs: Sequence[Any], set_seed: int, call: int) -> None:
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


def timing_set_count(first: Sequence[Any], seeds: Sequence[int]) -> int:
    """How many timing input sets rotate, given the first: one per seed, as many as fit in TIMING_SETS_BYTES."""
    return max(1, min(len(seeds), TIMING_SETS_BYTES // max(1, tensor_bytes(first))))


def timing_inputs(task: Task, seeds: Sequence[int], device: torch.device) -> list[list[Any]]:
    """The rotating timing input sets (`timing_set_count` of them), drawn from the timing seeds."""
    sets = [make_inputs(task, seeds[0], device)]
    count = timing_set_count(sets[0], seeds)
    sets.extend(make_inputs(task, seed, device) for seed in seeds[1:count])
    return sets


def timed_call_inputs(task: Task, seeds: Sequence[int], device: torch.device, call: int) -> list[Any]:
    """The inputs of timed call `call`, rebuilt from the timing seeds: its set (as timing_inputs rotates them) after
    every perturbation up to that call."""
    inputs = make_inputs(task, seeds[0], device)
    count = timing_set_count(inputs, seeds)
    which = call % count
    if which != 0:
        del inputs
        inputs = make_inputs(task, seeds[which], device)
    for earlier in range(which, call + 1, count):
        perturb(inputs, seeds[which], earlier)
    return inputs
