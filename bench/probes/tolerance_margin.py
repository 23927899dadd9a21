"""How close a candidate's outputs sit to the evaluator's tolerance, over many input seeds, with and without the
part of the tolerance relative to the output's mean |value| (`scale_rtol`, docs/evaluator/OUTPUTS.md "Tolerances").

    python3 bench/probes/tolerance_margin.py TASK.py CANDIDATE.py [--seeds 40]

Per seed: inputs from torch.manual_seed(seed) and get_inputs(), parameters from seed 0 for both models (as the
evaluator builds them from one init seed); the reference (Model) and the candidate (ModelNew) called once on the
device; per output, the largest |got - expected| / allowed, allowed as the harness computes it
(`kforge_harness.compare.allowed_error`) from the evaluator's default tolerances, with scale_rtol as configured and
at 0. A ratio above 1 fails the check.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "crates" / "execution" / "harness"))

from kforge_harness import compare  # noqa: E402
from kforge_harness.inputs import load_module  # noqa: E402

# The evaluator's defaults (crates/execution/src/config.rs, `Tolerances::default`).
DEFAULTS = {
    "float16": (1e-2, 1e-2, 1e-4),
    "bfloat16": (2e-2, 2e-2, 2e-4),
    "float32": (1e-3, 1e-3, 1e-5),
    "float64": (1e-8, 1e-8, 1e-10),
}


def to_device(values, device):
    import torch

    return [v.to(device) if isinstance(v, torch.Tensor) else v for v in values]


def flat(output):
    return list(output) if isinstance(output, (list, tuple)) else [output]


def worst_ratio(expected, got, tol):
    import torch

    a, b = expected.reshape(-1).to(torch.float64), got.reshape(-1).to(torch.float64)
    scales = compare.finite_scales(expected.reshape(-1))
    allowed = compare.allowed_error(a, scales, *tol)
    return float(((a - b).abs() / allowed).max()), scales[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task")
    parser.add_argument("candidate")
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = load_module(args.task, "margin_task")
    candidate = load_module(args.candidate, "margin_candidate")
    torch.manual_seed(0)
    reference = task.Model(*to_device(list(task.get_init_inputs()), device)).to(device)
    torch.manual_seed(0)
    new = candidate.ModelNew(*to_device(list(task.get_init_inputs()), device)).to(device)
    print(
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; {args.task} / "
        f"{Path(args.candidate).name}; ratio = max |got - expected| / allowed (fails above 1)"
    )
    print(f"{'seed':>4} {'mean |out|':>10} {'max abs err':>12} {'ratio with scale_rtol':>22} {'ratio without':>14}")
    failed_with = failed_without = 0
    worst_with = worst_without = 0.0
    with torch.no_grad():
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            inputs = to_device(list(task.get_inputs()), device)
            expected, got = flat(reference(*inputs)), flat(new(*inputs))
            with_, without, scale, err = 0.0, 0.0, 0.0, 0.0
            for e, g in zip(expected, got):
                if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
                    continue
                atol, rtol, scale_rtol = DEFAULTS[str(e.dtype).removeprefix("torch.")]
                ratio, s = worst_ratio(e, g, (atol, rtol, scale_rtol))
                with_, scale = max(with_, ratio), max(scale, s)
                without = max(without, worst_ratio(e, g, (atol, rtol, 0.0))[0])
                err = max(err, float((e.double() - g.double()).abs().max()))
            failed_with += with_ > 1
            failed_without += without > 1
            worst_with, worst_without = max(worst_with, with_), max(worst_without, without)
            print(f"{seed:>4} {scale:>10.4g} {err:>12.3e} {with_:>22.4f} {without:>14.4f}")
    print(
        f"# {args.seeds} seeds: fail with scale_rtol {failed_with} (worst ratio {worst_with:.4f}), "
        f"without {failed_without} (worst ratio {worst_without:.4f})"
    )


if __name__ == "__main__":
    main()
