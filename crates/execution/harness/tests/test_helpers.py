"""The harness's pure helpers: statistics of the timed loop, the trials kept, the tolerance arithmetic, the build
recipe's header choice, kernel names, and the digest and layout of outputs files."""

from __future__ import annotations

import math

import pytest
import torch

from kforge_harness import build, census, compare, inputs, outputs, timing
from kforge_harness.protocol import KeepTimed, Sensitivity, Tolerance

TOLERANCES = {"float32": Tolerance(atol=1e-3, rtol=1e-3, scale_rtol=1e-5)}


def found(mismatch: compare.Mismatch | None) -> compare.Mismatch:
    """A mismatch that must have been found."""
    assert mismatch is not None
    return mismatch


def test_median_share_and_cover():
    assert timing.median_or_none([]) is None
    assert timing.median_or_none([3.0, 1.0, 2.0]) == 2.0
    assert timing.median_or_none([4.0, 1.0, 3.0, 2.0]) == 3.0, "the upper one of an even count"
    assert timing.share([]) is None
    assert timing.share([True, False, False, True]) == 0.5
    assert timing.cover_ms([], []) == 0.1, "no launch measured yet"
    # 1.5x the 75th percentile of the recent launches plus 20 us, capped by the device time + flush + 50 us.
    assert timing.cover_ms([0.04] * 10, [1.0] * 10) == pytest.approx(1.5 * 0.04 + 0.02)
    assert timing.cover_ms([0.2] * 10, [0.005] * 10, flush_ms=0.01) == pytest.approx(0.005 + 0.01 + 0.05)
    assert timing.cover_ms([1.0] * 30 + [0.01] * 20, [10.0]) == pytest.approx(1.5 * 0.01 + 0.02), "the last 20 only"


def test_sampled_timed_calls_fit_their_bytes():
    keep = KeepTimed(digest_key=1, sampled_calls=4, sampled_bytes=1 << 30)
    assert [timing.sampled_timed_calls(n, keep) for n in (0, 1 << 28, 1 << 29, 1 << 30, 1 << 31)] == [4, 4, 2, 1, 0]


def test_random_below_stays_below():
    assert timing.random_below(1) == 0
    assert {timing.random_below(3) for _ in range(200)} <= {0, 1, 2}


@pytest.mark.parametrize(
    ("size", "kept"),
    [(1, list(range(7))), (2, [0, 2, 4, 5, 6]), (3, [0, 2, 5]), (4, [0, 2]), (20, [0, 2])],
)
def test_trials_kept_under_the_output_budget(size, kept):
    sensitivity = Sensitivity(trial=2, base=0, seed=0)
    assert compare.kept_trials(7, 10, sensitivity, 5, size) == kept


def test_every_trial_is_kept_without_a_budget():
    assert compare.kept_trials(4, 0, None, None, 1 << 40) == [0, 1, 2, 3]
    assert compare.kept_trials(4, 10, None, None, 100) == [0, 3], "at least two: trial 0 and the last"


def test_tolerances_by_dtype_and_widened():
    assert compare.tolerance(torch.float32, TOLERANCES) == (1e-3, 1e-3, 1e-5)
    assert compare.tolerance(torch.int64, TOLERANCES) == (0.0, 0.0, 0.0), "integers compare exactly"
    wide = compare.widened(TOLERANCES, 10)
    assert wide["float32"].atol == pytest.approx(1e-2) and wide["float32"].scale_rtol == pytest.approx(1e-4)
    assert TOLERANCES["float32"].atol == 1e-3, "the original is left as it was"


def test_the_allowed_error_shrinks_with_the_output_and_grows_with_its_mean():
    expected = torch.tensor([0.0, 1.0, -100.0], dtype=torch.float64)
    # atol scaled by the largest |value| (capped at 1), scale_rtol times the mean |value|, rtol times |expected|.
    allowed = compare.allowed_error(expected, (100.0, 50.0), 1e-3, 1e-3, 1e-5)
    assert allowed.tolist() == pytest.approx([1e-3 + 5e-4, 1e-3 + 5e-4 + 1e-3, 1e-3 + 5e-4 + 0.1])
    tiny = compare.allowed_error(torch.zeros(1, dtype=torch.float64), (1e-4, 1e-4), 1e-3, 1e-3, 1e-5)
    assert float(tiny[0]) == pytest.approx(1e-3 * 1e-4 + 1e-9)


def test_finite_scales_leave_out_what_is_not_finite():
    flat = torch.tensor([1.0, -3.0, math.inf, math.nan])
    assert compare.finite_scales(flat) == (3.0, 2.0)
    assert compare.finite_scales(torch.tensor([math.nan])) == (0.0, 0.0)


def test_compare_tensor_names_the_first_element_outside_the_tolerance():
    want = torch.linspace(1.0, 2.0, 12).reshape(3, 4)
    got = want.clone()
    got[1, 2] += 0.5
    mismatch = compare.compare_tensor(want, got, 1e-3, 1e-3, 1e-5)
    assert mismatch is not None and mismatch["element_index"] == [1, 2]
    assert compare.compare_tensor(want, want.clone(), 1e-3, 1e-3, 1e-5) is None
    nan = want.clone()
    nan[0, 0] = math.nan
    assert compare.compare_tensor(want, nan, 1e-3, 1e-3, 1e-5) is not None, "NaN never passes"
    ints = torch.arange(4)
    assert found(compare.compare_tensor(ints, ints + torch.tensor([0, 0, 1, 0]), 0.0, 0.0, 0.0))["element_index"] == [2]


def test_compare_outputs_says_what_differs_first():
    def saved(value, exact=True):
        return [{"exact_tensor": exact, "device": "cpu", "tensor": value}]

    x = torch.ones(3)
    assert compare.compare_outputs(saved(x), saved(x.clone()), TOLERANCES) is None
    assert "expected 1 outputs, got none" in found(compare.compare_outputs(saved(x), None, TOLERANCES))["detail"]
    assert "not a torch.Tensor" in found(compare.compare_outputs(saved(x), saved(x, exact=False), TOLERANCES))["detail"]
    assert "dtype" in found(compare.compare_outputs(saved(x), saved(x.double()), TOLERANCES))["detail"]
    assert "shape" in found(compare.compare_outputs(saved(x), saved(torch.ones(4)), TOLERANCES))["detail"]
    value = [{"exact_tensor": False, "device": "", "value": "3"}]
    assert (
        found(compare.compare_outputs(value, [{**value[0], "value": "4"}], TOLERANCES))["detail"] == "expected 3, got 4"
    )


def test_the_light_header_replaces_the_full_one_only_where_asked_for():
    source = "#include <torch/extension.h>\n__global__ void k() {}\n"
    assert build.lighten(source) == "#include <torch/types.h>\n__global__ void k() {}\n"
    assert build.lighten(["#include <cuda.h>\n"]) is None
    assert build.lighten(None) is None
    assert build.lighten(['  #  include "torch/extension.h"\n', 3]) == ["  #  include <torch/types.h>\n", 3]
    assert build.names_full_header('k.cu(3): error: name followed by "::" must be a namespace: at::Tensor')
    assert build.names_full_header('k.cu(3): error: identifier "py::module" is undefined')
    assert not build.names_full_header('k.cu(3): error: identifier "undeclared" is undefined')
    assert not build.names_full_header("warning: torch is old"), "only the lines of errors"


def test_kernel_names_from_a_listing_and_demangled_names():
    listing = "STT_FUNC STB_GLOBAL STO_ENTRY _Z1kv\nSTT_FUNC STB_GLOBAL STV_DEFAULT _Z6helperv\n"
    assert census.entry_symbols(listing) == {"_Z1kv"}
    assert census.function_name("void ns::k<float, Pair<int, 2> >(float*)") == "k"
    assert census.function_name("(anonymous namespace)::hidden(float*)") == "hidden"
    assert census.function_name("plain") == "plain"


def test_outputs_files_align_every_part_and_digest_every_byte():
    assert [outputs.aligned(n) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]
    values = [torch.arange(10, dtype=torch.float32), torch.tensor(True), "not a tensor"]
    digest = outputs.tensor_digest(values)
    assert len(digest) == 4, "two sums per tensor"
    changed = values[0].clone()
    changed[3] += 1
    assert outputs.tensor_digest([changed, values[1]]) != digest
    assert outputs.tensor_digest(values, key=1) != outputs.tensor_digest(values, key=2)
    assert outputs.flatten_outputs((1, 2)) == [1, 2] and outputs.flatten_outputs(3) == [3]
    assert outputs.output_bytes((torch.zeros(4), torch.zeros(2, dtype=torch.float64), 7)) == 32


def test_timed_call_inputs_are_the_timing_sets_after_each_perturbation():
    task = type("Task", (), {"get_inputs": staticmethod(lambda: [torch.rand(32)])})
    cpu = torch.device("cpu")
    seeds = (3, 4)
    sets = inputs.timing_inputs(task, seeds, cpu)
    for call in range(5):
        inputs.perturb(sets[call % 2], seeds[call % 2], call)
        assert torch.equal(inputs.timed_call_inputs(task, seeds, cpu, call)[0], sets[call % 2][0]), call
