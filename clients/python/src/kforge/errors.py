"""Errors of kforge calls: one exception class per gRPC status code, with what kforge servers put in a status.

kforge servers refuse bad input with INVALID_ARGUMENT (FAILED_PRECONDITION, OUT_OF_RANGE) whose message starts with
the path of the offending field, e.g. `groups[3].trajectories[1].values[0]: must be finite, got NaN`; that path is
`KforgeError.field`. A refusal that will pass later (a full evaluation queue, a caller's quota) carries
`retry-after-ms` trailing metadata; that wait is `KforgeError.retry_after`, in seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import grpc

__all__ = [
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "KforgeError",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "error_from_rpc",
]

# A field path as kforge servers write it: dotted names, each with optional indices (`spec.tasks[1].source`).
_FIELD_PREFIX = re.compile(r"(?P<field>[A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*): ")

# Codes whose message starts with the field at fault, by the servers' convention.
_FIELD_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"})

RETRY_AFTER_KEY = "retry-after-ms"


class KforgeError(Exception):
    """A call that ended with a status other than OK.

    Attributes:
        code: The status code's name, e.g. `INVALID_ARGUMENT`.
        message: The status message, as the server wrote it.
        field: The path of the field the server named at the start of `message` (INVALID_ARGUMENT,
            FAILED_PRECONDITION, OUT_OF_RANGE), e.g. `spec.trajectories_per_task`; None when it names none.
        retry_after: Seconds the server asked the caller to wait before retrying (`retry-after-ms`), or None.
        trailing_metadata: The call's trailing metadata.
    """

    status_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    retryable: ClassVar[bool] = False
    """Whether `kforge.retry` retries a unary call that ended so: RESOURCE_EXHAUSTED and UNAVAILABLE only."""

    def __init__(
        self, message: str, *, code: str | None = None, trailing_metadata: Iterable[tuple[str, str | bytes]] = ()
    ) -> None:
        self.code = code or self.status_code.name
        self.message = message
        self.trailing_metadata = tuple(trailing_metadata)
        self.field = parse_field(message) if self.code in _FIELD_CODES else None
        self.retry_after = parse_retry_after(self.trailing_metadata)
        super().__init__(f"{self.code}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments defeat Exception's default pickling; errors cross process pools (Ray, multiprocessing).
        return (_rebuild, (type(self), self.message, self.code, self.trailing_metadata))


def parse_field(message: str) -> str | None:
    """The field path a kforge status message starts with (`turns: 1000 is over ...` -> `turns`), or None."""
    match = _FIELD_PREFIX.match(message)
    return match["field"] if match else None


def parse_retry_after(metadata: Iterable[tuple[str, str | bytes]]) -> float | None:
    """The `retry-after-ms` value in seconds, or None when absent or not a non-negative integer."""
    for key, value in metadata:
        if key == RETRY_AFTER_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            return int(text) / 1000 if text.isascii() and text.isdigit() else None
    return None


class Cancelled(KforgeError):
    """CANCELLED: the call was cancelled, usually by the caller."""

    status_code = grpc.StatusCode.CANCELLED


class Unknown(KforgeError):
    """UNKNOWN: the server failed without saying how."""


class InvalidArgument(KforgeError):
    """INVALID_ARGUMENT: the request is malformed; `field` names what to fix."""

    status_code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KforgeError):
    """DEADLINE_EXCEEDED: the call's deadline passed before it finished."""

    status_code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KforgeError):
    """NOT_FOUND: what the request names (a job, a report, a replayed response) does not exist."""

    status_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KforgeError):
    """ALREADY_EXISTS: what the request would create exists already."""

    status_code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KforgeError):
    """PERMISSION_DENIED: the caller may not act on what it names (another caller's job)."""

    status_code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KforgeError):
    """RESOURCE_EXHAUSTED: the server is full or the caller over a quota; retried, after `retry_after` when set."""

    status_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retryable = True


class FailedPrecondition(KforgeError):
    """FAILED_PRECONDITION: the request does not fit the state of what it names (a step for a turn already taken)."""

    status_code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KforgeError):
    """ABORTED: the operation was aborted, typically by a concurrent one."""

    status_code = grpc.StatusCode.ABORTED


class OutOfRange(KforgeError):
    """OUT_OF_RANGE: a value or a message size beyond what the server takes."""

    status_code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KforgeError):
    """UNIMPLEMENTED: the server does not serve this RPC (yet)."""

    status_code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KforgeError):
    """INTERNAL: the server broke an invariant of its own."""

    status_code = grpc.StatusCode.INTERNAL


class Unavailable(KforgeError):
    """UNAVAILABLE: the server, or a peer it needs, cannot be reached now; retried."""

    status_code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class DataLoss(KforgeError):
    """DATA_LOSS: unrecoverable data loss or corruption."""

    status_code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KforgeError):
    """UNAUTHENTICATED: the bearer token is missing or wrong."""

    status_code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[KforgeError]] = {cls.status_code: cls for cls in KforgeError.__subclasses__()}


def error_from_rpc(error: grpc.RpcError) -> KforgeError:
    """The `KforgeError` subclass for a failed call's status (sync or asyncio)."""
    code = error.code()
    # (key, value) pairs at run time: namedtuples from sync calls, tuples from asyncio ones (the stubs disagree).
    trailing: Iterable[Any] = error.trailing_metadata() or ()
    pairs = tuple((key, value) for key, value in trailing)
    return _BY_CODE.get(code, Unknown)(error.details() or "", code=code.name, trailing_metadata=pairs)


def _rebuild(
    cls: type[KforgeError], message: str, code: str, trailing_metadata: tuple[tuple[str, str | bytes], ...]
) -> KforgeError:
    return cls(message, code=code, trailing_metadata=trailing_metadata)
