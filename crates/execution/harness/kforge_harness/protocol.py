"""The protocol between the evaluator and this harness: `crates/execution/src/protocol.rs` is the other side.

A stage reads one request from stdin, `{"protocol", "mode", "spec", "env"}`, and writes one result, a JSON object,
to the spec's `result_path`. Both carry `PROTOCOL_VERSION`: a request of another version is refused (a result saying
so, exit status `REFUSED_EXIT`), a spec is checked against its mode's fields before anything runs and parsed once into
its frozen dataclass (`check_request`), and every result is its mode's dataclass (`RESULTS`), written with the fields
every result carries (`write_result`). Tests on the evaluator's side compare both lists of fields with its types
(`--specs`, `--results`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import resource
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NoReturn, cast

from . import process

# The version of the messages below; the evaluator's `protocol::PROTOCOL_VERSION` must be the same.
PROTOCOL_VERSION = 7
# The exit status of a harness that refused a request of another protocol version.
REFUSED_EXIT = 5

_PATH, _INT, _BOOL, _LIST, _DICT, _STR, _NONE = str, int, bool, list, dict, str, type(None)

# What a JSON value reads as, where this side does not look inside it.
Json = Any


class ProtocolError(Exception):
    """A request this harness cannot read: another protocol version, or a spec unlike its mode's."""


# ------------------------------------------------------------------------------------------------- specs


def wire(*accepted: type, parse: Callable[[Any], Any] | None = None) -> Any:
    """A spec field: the JSON types it accepts (`_NONE`: it may be null), and how its value is read into the
    dataclass (as it is, by default)."""
    return field(metadata={"accepts": accepted, "parse": parse})


@dataclass(frozen=True)
class Tolerance:
    """One floating dtype's tolerance (`config::Tolerance`)."""

    atol: float
    rtol: float
    scale_rtol: float


# Tolerances by dtype name (`float16`, `bfloat16`, `float32`, `float64`).
Tolerances = Mapping[str, Tolerance]


def tolerances_of(value: Mapping[str, Mapping[str, float]]) -> Tolerances:
    return types.MappingProxyType(
        {name: Tolerance(atol=e["atol"], rtol=e["rtol"], scale_rtol=e["scale_rtol"]) for name, e in value.items()}
    )


@dataclass(frozen=True)
class Sensitivity:
    """The sensitivity trial: `trial` gets trial `base`'s inputs with a few elements moved far out of range, drawn
    from `seed`."""

    trial: int
    base: int
    seed: int

    @classmethod
    def of(cls, value: Mapping[str, int] | None) -> Sensitivity | None:
        return None if value is None else cls(trial=value["trial"], base=value["base"], seed=value["seed"])


@dataclass(frozen=True)
class TimingBudget:
    """The timing loop's budget (`protocol::TimingSpec`); `rounds` 0: unpaired."""

    warmup_runs: int
    min_runs: int
    max_runs: int
    max_seconds: float
    target_rel_error: float
    min_seconds: float = 0.0
    rounds: int = 0

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> TimingBudget:
        return cls(
            warmup_runs=value["warmup_runs"],
            min_runs=value["min_runs"],
            max_runs=value["max_runs"],
            max_seconds=value["max_seconds"],
            target_rel_error=value["target_rel_error"],
            min_seconds=value.get("min_seconds", 0.0),
            rounds=value.get("rounds") or 0,
        )

    @classmethod
    def of_optional(cls, value: Mapping[str, Any] | None) -> TimingBudget | None:
        return None if value is None else cls.of(value)


@dataclass(frozen=True)
class KeepTimed:
    """Which timed calls' outputs the candidate's harness keeps for the checker (`protocol::KeepTimed`)."""

    digest_key: int
    sampled_calls: int
    sampled_bytes: int

    @classmethod
    def of(cls, value: Mapping[str, int] | None) -> KeepTimed | None:
        if value is None:
            return None
        return cls(
            digest_key=value["digest_key"], sampled_calls=value["sampled_calls"], sampled_bytes=value["sampled_bytes"]
        )


@dataclass(frozen=True)
class TimedOutput:
    """A timed call whose outputs the candidate's harness kept, and the keyed digest of the file it wrote."""

    call: int
    digest: tuple[int, ...]

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> TimedOutput:
        return cls(call=value["call"], digest=tuple(value["digest"]))


def timed_outputs_of(value: list[Mapping[str, Any]]) -> tuple[TimedOutput, ...]:
    return tuple(TimedOutput.of(kept) for kept in value)


def variants_of(value: Mapping[str, list[str]]) -> Mapping[str, tuple[str, ...]]:
    return types.MappingProxyType({name: tuple(flags) for name, flags in value.items()})


# What every spec carries besides its mode's fields: where the result goes, and the stage's part in the gate
# (false: none; "share" or "idle").
FRAMING = ("result_path", "gate")


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What every spec carries; each mode's spec adds its own fields. The evaluator sends every field."""

    MODE: ClassVar[str] = ""

    result_path: str = wire(_PATH)
    gate: bool | str = wire(_BOOL, _STR)


@dataclass(frozen=True, kw_only=True)
class CompileSpec(Spec):
    MODE: ClassVar[str] = "compile"

    candidate_path: str = wire(_PATH)
    kernels: bool = wire(_BOOL)


@dataclass(frozen=True, kw_only=True)
class CandidateSpec(Spec):
    MODE: ClassVar[str] = "candidate"

    init_seed: int = wire(_INT)
    seeds: tuple[int, ...] = wire(_LIST, parse=tuple)
    recheck_from: int = wire(_INT)
    sensitivity: Sensitivity | None = wire(_DICT, _NONE, parse=Sensitivity.of)
    replay: int | None = wire(_INT, _NONE)
    output_bytes_budget: int = wire(_INT)
    timing: TimingBudget | None = wire(_DICT, _NONE, parse=TimingBudget.of_optional)
    timing_seeds: tuple[int, ...] = wire(_LIST, parse=tuple)
    census_calls: int = wire(_INT)
    profiled_calls: int = wire(_INT)
    task_path: str = wire(_PATH)
    candidate_path: str = wire(_PATH)
    candidate_dir: str = wire(_PATH)
    device: str = wire(_STR)
    timing_cpu: int | None = wire(_INT, _NONE)
    keep_timed: KeepTimed | None = wire(_DICT, _NONE, parse=KeepTimed.of)


@dataclass(frozen=True, kw_only=True)
class CompareSpec(Spec):
    """`reference` and `check` (`ReferenceSpec`, `CheckSpec`): the same fields."""

    task_path: str = wire(_PATH)
    device: str = wire(_STR)
    init_seed: int = wire(_INT)
    seeds: tuple[int, ...] = wire(_LIST, parse=tuple)
    reference_dir: str = wire(_PATH)
    candidate_dir: str = wire(_PATH)
    tolerances: Tolerances = wire(_DICT, parse=tolerances_of)
    timing_seeds: tuple[int, ...] = wire(_LIST, parse=tuple)
    sensitivity: Sensitivity | None = wire(_DICT, _NONE, parse=Sensitivity.of)
    replay: int | None = wire(_INT, _NONE)
    output_bytes_budget: int = wire(_INT)
    timed_outputs: tuple[TimedOutput, ...] = wire(_LIST, parse=timed_outputs_of)
    digest_key: int = wire(_INT)


@dataclass(frozen=True, kw_only=True)
class ReferenceSpec(CompareSpec):
    MODE: ClassVar[str] = "reference"


@dataclass(frozen=True, kw_only=True)
class CheckSpec(CompareSpec):
    MODE: ClassVar[str] = "check"


@dataclass(frozen=True, kw_only=True)
class BaselineSpec(Spec):
    MODE: ClassVar[str] = "baseline"

    task_path: str = wire(_PATH)
    device: str = wire(_STR)
    init_seed: int = wire(_INT)
    timing: TimingBudget = wire(_DICT, parse=TimingBudget.of)
    timing_seeds: tuple[int, ...] = wire(_LIST, parse=tuple)
    compile: bool = wire(_BOOL)
    timing_cpu: int | None = wire(_INT, _NONE)


@dataclass(frozen=True, kw_only=True)
class BindingsPchSpec(Spec):
    MODE: ClassVar[str] = "bindings_pch"

    out_dir: str = wire(_PATH)
    variants: Mapping[str, tuple[str, ...]] = wire(_DICT, parse=variants_of)
    cuda: bool = wire(_BOOL)


SPECS: dict[str, type[Spec]] = {
    spec.MODE: spec for spec in (CompileSpec, CandidateSpec, ReferenceSpec, CheckSpec, BaselineSpec, BindingsPchSpec)
}


def wire_fields(spec: type[Spec]) -> list[dataclasses.Field[Any]]:
    """A spec's fields in the order they are checked: the mode's own, then the framing."""
    every = dataclasses.fields(spec)
    return [f for f in every if f.name not in FRAMING] + [f for f in every if f.name in FRAMING]


def spec_fields() -> dict[str, list[str]]:
    """The spec fields of each mode, without the framing: for the evaluator's test that both sides agree."""
    return {mode: sorted(f.name for f in wire_fields(spec) if f.name not in FRAMING) for mode, spec in SPECS.items()}


def check_request(request: object) -> Spec:
    """The request's spec, checked against its mode's fields and read into its dataclass; ProtocolError when it
    does not fit."""
    if not isinstance(request, dict):
        raise ProtocolError(f"the request is a {type(request).__name__}, not an object")
    message = cast("dict[str, Any]", request)
    version = message.get("protocol")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"this harness speaks protocol version {PROTOCOL_VERSION}, the evaluator sent "
            f"{'none' if version is None else version}: the harness file belongs to another kforge "
            "version"
        )
    mode, given = message.get("mode"), message.get("spec")
    if mode not in SPECS:
        raise ProtocolError(f"unknown mode {mode!r}")
    if not isinstance(given, dict):
        raise ProtocolError(f"the {mode} spec is not an object")
    spec = cast("dict[str, Any]", given)
    kind = SPECS[mode]
    fields = wire_fields(kind)
    names = {f.name for f in fields}
    missing, unknown = sorted(names - set(spec)), sorted(set(spec) - names)
    if missing or unknown:
        raise ProtocolError(f"the {mode} spec lacks {missing} and has unknown fields {unknown}")
    for f in fields:
        value, accepted = spec[f.name], f.metadata["accepts"]
        # bool is an int in Python: only fields that take booleans take them.
        wrong_bool = isinstance(value, bool) and _BOOL not in accepted
        if wrong_bool or not isinstance(value, accepted):
            raise ProtocolError(f"the {mode} spec's {f.name} is of type {type(value).__name__}")
    values: dict[str, Any] = {}
    for f in fields:
        parse = f.metadata["parse"]
        try:
            values[f.name] = spec[f.name] if parse is None else parse(spec[f.name])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ProtocolError(f"the {mode} spec's {f.name} is malformed: {type(error).__name__}: {error}") from None
    return kind(**values)


def refuse(request: object, error: ProtocolError) -> NoReturn:
    """Answers a request this harness cannot read with a result saying why, where the request names a place for
    it, and exits with REFUSED_EXIT."""
    print(f"kforge harness: {error}", file=sys.stderr)
    spec = cast("dict[str, Any]", request).get("spec") if isinstance(request, dict) else None
    path = cast("dict[str, Any]", spec).get("result_path") if isinstance(spec, dict) else None
    if isinstance(path, str):
        with process.open_file(path, "w") as f:
            process.json_dump(
                {
                    "protocol": PROTOCOL_VERSION,
                    "ok": False,
                    "error_type": "ProtocolError",
                    "phase": "request",
                    "error": str(error),
                },
                f,
            )
    sys.exit(REFUSED_EXIT)


# ------------------------------------------------------------------------------------------------- results


class Absent(enum.Enum):
    """A result field that is left out of the result (the evaluator reads it as absent), as opposed to null."""

    ABSENT = enum.auto()


ABSENT = Absent.ABSENT


def unread(why: str, default: Any = ABSENT) -> Any:
    """A result field written for the record that the evaluator does not read (`--results` lists it apart)."""
    return field(default=default, metadata={"unread": why})


@dataclass(frozen=True, kw_only=True)
class Result:
    """What every mode's result carries of its own; `write_result` adds `protocol`, `phases_ms`, `cpu_ms` and
    `blocking_sync`."""

    ok: bool

    def fields(self) -> dict[str, Json]:
        """The fields that are not ABSENT, in declaration order."""
        present = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in present if value is not ABSENT}


@dataclass(frozen=True, kw_only=True)
class Failure(Result):
    """Any mode's result when the stage failed: the evaluator classifies it."""

    ok: bool = False
    error_type: str
    # Where the failure happened: `import` (the candidate's module) or `run`.
    phase: str
    error: str


@dataclass(frozen=True, kw_only=True)
class CompileResult(Result):
    seconds: float
    # The kernels compiled into its extensions when asked and readable, else why not.
    kernels: list[str] | Absent = ABSENT
    kernels_unread: str | Absent = ABSENT


@dataclass(frozen=True, kw_only=True)
class CandidateResult(Result):
    mutated_inputs: list[int]
    samples_ms: list[float] | Absent = ABSENT
    host_ms: list[float] | Absent = ABSENT
    rounds: list[int] | Absent = ABSENT
    timing_cpu: dict[str, Json] | Absent = ABSENT
    timed_outputs: list[dict[str, Json]] | Absent = ABSENT
    census: list[dict[str, Json]] | Absent = ABSENT
    findings: list[dict[str, str]]
    jit_kernels: list[str] | Absent = ABSENT
    device_peak_bytes: int | Absent = ABSENT


@dataclass(frozen=True, kw_only=True)
class CompareResult(Result):
    """`reference` and `check` (the evaluator reads both as one type): `check` writes no `output_bytes` nor
    `device_peak_bytes`, and `reference` compares (`mismatch`, `compared_trials`) only when given a candidate."""

    output_bytes: int | Absent = ABSENT
    device_peak_bytes: int | Absent = ABSENT
    mismatch: dict[str, Json] | Absent | None = ABSENT
    compared_trials: list[int] | Absent | None = ABSENT


@dataclass(frozen=True, kw_only=True)
class BaselineResult(Result):
    eager_ms: list[float]
    eager_host_ms: list[float]
    timing_cpu: dict[str, Json] | Absent = unread("the eager loop's CPU figures, for the record")
    eager_rounds: list[int] | Absent = ABSENT
    compile_ms: list[float] | Absent = ABSENT
    compile_error: str | Absent = ABSENT


@dataclass(frozen=True, kw_only=True)
class BindingsPchResult(Result):
    built: list[str]
    failed: dict[str, str]
    host: dict[str, str | None]


# Each mode's result type.
RESULTS: dict[str, type[Result]] = {
    "compile": CompileResult,
    "candidate": CandidateResult,
    "reference": CompareResult,
    "check": CompareResult,
    "baseline": BaselineResult,
    "bindings_pch": BindingsPchResult,
}

# What `write_result` adds to every result, and those of them the evaluator does not read.
WRITTEN = ("protocol", "phases_ms", "blocking_sync", "cpu_ms")
WRITTEN_UNREAD = ("blocking_sync",)


def result_fields() -> dict[str, dict[str, list[str]]]:
    """Per mode, the result fields the evaluator reads (`read`) and those written for the record only (`unread`):
    for the evaluator's test that both sides agree."""
    listing: dict[str, dict[str, list[str]]] = {"read": {}, "unread": {}}
    for mode, result in RESULTS.items():
        every = [*dataclasses.fields(Failure), *dataclasses.fields(result)]
        apart = {f.name for f in every if "unread" in f.metadata} | set(WRITTEN_UNREAD)
        names = {f.name for f in every} | set(WRITTEN)
        listing["read"][mode] = sorted(names - apart)
        listing["unread"][mode] = sorted(apart)
    return listing


class Phases:
    """Where a stage's time goes, reported with its result (`phases_ms`): `with phases(name):` adds the wall time
    of the block to that phase."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def __call__(self, name: str) -> Phase:
        return Phase(self.ms, name)


class Phase:
    """Adds the wall time of a block to `ms[name]`."""

    def __init__(self, ms: dict[str, float], name: str) -> None:
        self.ms = ms
        self.name = name
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = process.monotonic()

    def __exit__(self, *exc: object) -> Literal[False]:
        self.ms[self.name] = self.ms.get(self.name, 0.0) + (process.monotonic() - self.started) * 1000.0
        return False


def json_safe(value: Json) -> Json:
    """Non-finite floats as proto3 JSON spells them ("NaN", "Infinity", "-Infinity"): bare NaN is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in cast("dict[Any, Any]", value).items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in cast("list[Any] | tuple[Any, ...]", value)]
    return value


def write_result(spec: Spec, result: Result, phases: Phases) -> None:
    """Writes `result`, the spec's mode's result or a `Failure`, to the spec's `result_path`, with the protocol
    version, the phases' times, how the process waited for its GPU, and its CPU time."""
    expected = RESULTS[spec.MODE]
    if not isinstance(result, (expected, Failure)):
        raise ProtocolError(f"the {spec.MODE} result is a {type(result).__name__}, not a {expected.__name__}")
    written = result.fields()
    written["protocol"] = PROTOCOL_VERSION
    written["phases_ms"] = dict(phases.ms)
    if process.BLOCKING_SYNC is not None:
        written["blocking_sync"] = process.BLOCKING_SYNC
    # CPU time of this process and of the children it waited for (the compilers of a build), for the evaluator's
    # account of where CPU time goes.
    spent = [process.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    written["cpu_ms"] = sum(usage.ru_utime + usage.ru_stime for usage in spent) * 1000.0
    with process.open_file(spec.result_path, "w") as f:
        process.json_dump(json_safe(written), f, allow_nan=False)
