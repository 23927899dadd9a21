"""Fixtures shared by the harness's tests: requests as the evaluator writes them (crates/execution/src/protocol.rs)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kforge_harness import protocol

TOLERANCES = {
    "float16": {"atol": 1e-2, "rtol": 1e-2, "scale_rtol": 1e-4},
    "bfloat16": {"atol": 2e-2, "rtol": 2e-2, "scale_rtol": 2e-4},
    "float32": {"atol": 1e-3, "rtol": 1e-3, "scale_rtol": 1e-5},
    "float64": {"atol": 1e-8, "rtol": 1e-8, "scale_rtol": 1e-10},
}
TIMING = {
    "warmup_runs": 10,
    "min_runs": 20,
    "max_runs": 200,
    "max_seconds": 2.0,
    "min_seconds": 0.5,
    "target_rel_error": 0.01,
    "rounds": 0,
}
COMPARE = {
    "task_path": "/s/task.py",
    "device": "cpu",
    "init_seed": 1,
    "seeds": [2, 3, 4],
    "reference_dir": "/s/reference",
    "candidate_dir": "/s/candidate",
    "tolerances": TOLERANCES,
    "timing_seeds": [5, 6],
    "sensitivity": {"trial": 2, "base": 0, "seed": 9},
    "replay": None,
    "output_bytes_budget": 0,
    "timed_outputs": [{"call": 7, "digest": [1, -2, 3]}],
    "digest_key": 11,
}
# One spec of each mode, less the framing, with every field the evaluator sends.
SPECS: dict[str, dict[str, Any]] = {
    "compile": {"candidate_path": "/s/candidate.py", "kernels": False},
    "candidate": {
        "init_seed": 1,
        "seeds": [2, 3, 4, 5],
        "recheck_from": 3,
        "sensitivity": None,
        "replay": 3,
        "output_bytes_budget": 1 << 30,
        "timing": TIMING,
        "timing_seeds": [5, 6],
        "census_calls": 3,
        "profiled_calls": 0,
        "task_path": "/s/task.py",
        "candidate_path": "/s/candidate.py",
        "candidate_dir": "/s/candidate",
        "device": "cpu",
        "timing_cpu": None,
        "keep_timed": {"digest_key": 11, "sampled_calls": 4, "sampled_bytes": 1 << 30},
    },
    "reference": COMPARE,
    "check": COMPARE,
    "baseline": {
        "task_path": "/s/task.py",
        "device": "cpu",
        "init_seed": 1,
        "timing": TIMING,
        "timing_seeds": [5, 6],
        "compile": True,
        "timing_cpu": 3,
    },
    "bindings_pch": {"out_dir": "/s/pch", "variants": {"default": [], "O3": ["-O3"]}, "cuda": False},
}


def make_request(mode: str, result_path: str = "/s/result.json", **changes: Any) -> dict[str, Any]:
    """A request for `mode` as the evaluator writes it, with `changes` to its spec."""
    spec = {**copy.deepcopy(SPECS[mode]), "result_path": result_path, "gate": False, **changes}
    return {"protocol": protocol.PROTOCOL_VERSION, "mode": mode, "spec": spec, "env": {}}


@pytest.fixture
def request_for():
    return make_request
