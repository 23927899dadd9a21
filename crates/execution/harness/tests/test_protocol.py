"""The protocol's side in the harness: requests checked and parsed once into frozen specs, results written with the
fields every result carries (the evaluator's side is crates/execution/src/protocol.rs)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conftest import SPECS

from kforge_harness import process, protocol
from kforge_harness.protocol import (
    ABSENT,
    CandidateSpec,
    CheckSpec,
    CompareResult,
    CompileResult,
    Failure,
    Phases,
    ProtocolError,
    ReferenceSpec,
    Sensitivity,
    TimedOutput,
    TimingBudget,
    Tolerance,
)


@pytest.mark.parametrize("mode", sorted(SPECS))
def test_every_mode_s_spec_parses_into_its_frozen_dataclass(request_for, mode):
    spec = protocol.check_request(request_for(mode))
    assert type(spec) is protocol.SPECS[mode]
    assert mode == spec.MODE
    assert (spec.result_path, spec.gate) == ("/s/result.json", False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.result_path = "/elsewhere"  # type: ignore[misc]


def test_nested_fields_are_read_into_their_types(request_for):
    candidate = protocol.check_request(request_for("candidate"))
    assert isinstance(candidate, CandidateSpec)
    assert candidate.seeds == (2, 3, 4, 5) and candidate.timing_seeds == (5, 6)
    assert candidate.timing == TimingBudget(
        warmup_runs=10, min_runs=20, max_runs=200, max_seconds=2.0, target_rel_error=0.01, min_seconds=0.5, rounds=0
    )
    assert candidate.keep_timed is not None and candidate.keep_timed.sampled_calls == 4
    check = protocol.check_request(request_for("check"))
    assert isinstance(check, CheckSpec) and not isinstance(check, ReferenceSpec)
    assert check.tolerances["float32"] == Tolerance(atol=1e-3, rtol=1e-3, scale_rtol=1e-5)
    assert check.sensitivity == Sensitivity(trial=2, base=0, seed=9)
    assert check.timed_outputs == (TimedOutput(call=7, digest=(1, -2, 3)),)
    with pytest.raises(TypeError):
        check.tolerances["float32"] = Tolerance(atol=1.0, rtol=1.0, scale_rtol=1.0)  # type: ignore[index]
    pch = protocol.check_request(request_for("bindings_pch"))
    assert dict(pch.variants) == {"default": (), "O3": ("-O3",)}  # type: ignore[attr-defined]


def test_a_timing_budget_without_rounds_or_least_seconds_is_unpaired_and_has_none():
    budget = TimingBudget.of(
        {"warmup_runs": 1, "min_runs": 2, "max_runs": 3, "max_seconds": 4.0, "target_rel_error": 0.5}
    )
    assert (budget.rounds, budget.min_seconds) == (0, 0.0)
    assert TimingBudget.of({**dataclasses.asdict(budget), "rounds": None}).rounds == 0


def test_the_spec_fields_listed_are_the_dataclasses_less_the_framing():
    listed = protocol.spec_fields()
    assert sorted(listed) == sorted(SPECS)
    for mode, fields in SPECS.items():
        assert listed[mode] == sorted(fields), mode
    # The order fields are checked in: the mode's own, then the framing.
    names = [f.name for f in protocol.wire_fields(CandidateSpec)]
    assert names[:3] == ["init_seed", "seeds", "recheck_from"] and names[-2:] == ["result_path", "gate"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"protocol": protocol.PROTOCOL_VERSION + 1}, f"evaluator sent {protocol.PROTOCOL_VERSION + 1}: the harness"),
        ({"protocol": None}, "the evaluator sent none"),
        ({"mode": "dance"}, "unknown mode 'dance'"),
        ({"spec": [1]}, "the compile spec is not an object"),
    ],
)
def test_a_request_of_another_version_mode_or_shape_is_refused(request_for, change, says):
    with pytest.raises(ProtocolError, match=says):
        protocol.check_request({**request_for("compile"), **change})
    with pytest.raises(ProtocolError, match="the request is a list, not an object"):
        protocol.check_request([])


def test_a_spec_unlike_its_mode_s_is_refused_naming_what_differs(request_for):
    spec = request_for("compile")["spec"]
    del spec["kernels"]
    spec["extra"] = 1
    with pytest.raises(ProtocolError, match=r"lacks \['kernels'\] and has unknown fields \['extra'\]"):
        protocol.check_request({**request_for("compile"), "spec": spec})
    with pytest.raises(ProtocolError, match="the compile spec's candidate_path is of type int"):
        protocol.check_request(request_for("compile", candidate_path=3))
    # bool is an int in Python: only fields that take booleans take it.
    with pytest.raises(ProtocolError, match="the candidate spec's init_seed is of type bool"):
        protocol.check_request(request_for("candidate", init_seed=True))
    with pytest.raises(ProtocolError, match="the candidate spec's timing_cpu is of type str"):
        protocol.check_request(request_for("candidate", timing_cpu="3"))
    assert protocol.check_request(request_for("compile", gate="idle")).gate == "idle"


def test_a_malformed_nested_field_is_refused_at_the_boundary(request_for):
    with pytest.raises(ProtocolError, match="the check spec's tolerances is malformed: KeyError"):
        protocol.check_request(request_for("check", tolerances={"float32": {"atol": 1.0}}))
    with pytest.raises(ProtocolError, match="the candidate spec's sensitivity is malformed"):
        protocol.check_request(request_for("candidate", sensitivity={"trial": 1}))


def test_a_result_is_written_with_what_every_result_carries(tmp_path, request_for, monkeypatch):
    spec = protocol.check_request(request_for("compile", result_path=str(tmp_path / "result.json")))
    phases = Phases()
    monkeypatch.setattr(process, "BLOCKING_SYNC", None)
    protocol.write_result(spec, CompileResult(ok=True, seconds=1.5, kernels_unread="no cuobjdump"), phases)
    written = json.loads((tmp_path / "result.json").read_text())
    assert list(written)[:3] == ["ok", "seconds", "kernels_unread"], "absent fields are left out, in order"
    assert written["protocol"] == protocol.PROTOCOL_VERSION and written["phases_ms"] == {}
    assert written["cpu_ms"] > 0 and "blocking_sync" not in written
    monkeypatch.setattr(process, "BLOCKING_SYNC", True)
    protocol.write_result(spec, Failure(error_type="ValueError", phase="run", error="Traceback"), phases)
    failed = json.loads((tmp_path / "result.json").read_text())
    assert (failed["ok"], failed["error_type"], failed["phase"], failed["blocking_sync"]) == (
        False,
        "ValueError",
        "run",
        True,
    )
    with pytest.raises(ProtocolError, match="the compile result is a CompareResult, not a CompileResult"):
        protocol.write_result(spec, CompareResult(ok=True), phases)


def test_non_finite_numbers_are_written_as_proto3_json_spells_them(tmp_path, request_for):
    spec = protocol.check_request(request_for("check", result_path=str(tmp_path / "result.json")))
    mismatch = {"expected": math.nan, "got": -math.inf, "max_abs_error": math.inf, "element_index": (1, 2)}
    protocol.write_result(spec, CompareResult(ok=True, mismatch=mismatch, compared_trials=None), Phases())
    written = json.loads((tmp_path / "result.json").read_text())
    assert written["mismatch"] == {
        "expected": "NaN",
        "got": "-Infinity",
        "max_abs_error": "Infinity",
        "element_index": [1, 2],
    }
    assert written["compared_trials"] is None, "null is written; only ABSENT is left out"
    assert "output_bytes" not in written


def test_the_result_fields_listed_are_the_dataclasses_and_what_every_result_carries():
    listing = protocol.result_fields()
    assert sorted(listing["read"]) == sorted(listing["unread"]) == sorted(SPECS)
    for mode, read in listing["read"].items():
        assert {"protocol", "ok", "error", "error_type", "phase", "cpu_ms", "phases_ms"} <= set(read), mode
        assert not set(read) & set(listing["unread"][mode]), mode
        assert "blocking_sync" in listing["unread"][mode]
    assert "timing_cpu" in listing["unread"]["baseline"] and "timing_cpu" in listing["read"]["candidate"]
    assert listing["read"]["check"] == listing["read"]["reference"]
    assert "seconds" in listing["read"]["compile"] and "kernels_unread" in listing["read"]["compile"]


def test_absent_fields_are_left_out_in_declaration_order():
    result = CompareResult(ok=True, output_bytes=8, mismatch=None)
    assert result.fields() == {"ok": True, "output_bytes": 8, "mismatch": None}
    assert CompareResult(ok=True).device_peak_bytes is ABSENT


def test_a_refused_request_gets_a_result_saying_why_and_exit_status_5(tmp_path, request_for, capsys):
    request = request_for("compile", result_path=str(tmp_path / "refused.json"))
    with pytest.raises(SystemExit) as exited:
        protocol.refuse(request, ProtocolError("another version"))
    assert exited.value.code == protocol.REFUSED_EXIT == 5
    assert "kforge harness: another version" in capsys.readouterr().err
    assert json.loads((tmp_path / "refused.json").read_text()) == {
        "protocol": protocol.PROTOCOL_VERSION,
        "ok": False,
        "error_type": "ProtocolError",
        "phase": "request",
        "error": "another version",
    }
    with pytest.raises(SystemExit):
        protocol.refuse([1], ProtocolError("no place for a result"))


def test_phases_add_up_the_wall_time_of_their_blocks(monkeypatch):
    clock = iter([1.0, 1.5, 2.0, 2.25, 3.0, 4.0])
    monkeypatch.setattr(process, "monotonic", lambda: next(clock))
    phases = Phases()
    with phases("load"):
        pass
    with phases("load"):
        pass
    with pytest.raises(RuntimeError), phases("compare"):
        raise RuntimeError("counted all the same")
    assert phases.ms == {"load": 750.0, "compare": 1000.0}
