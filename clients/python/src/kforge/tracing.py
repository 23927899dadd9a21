"""W3C trace context on outgoing calls, so that kforge's server spans continue the caller's trace.

Every call carries `traceparent` (and `tracestate` when there is one), taken from, in order:

1. the call's own `metadata`, when it has a `traceparent` (left as it is);
2. the innermost `trace_context(traceparent, tracestate)` block around the call;
3. the current OpenTelemetry span, when `opentelemetry-api` is installed (the `otel` extra) and a span with a valid
   context is current.

Without any of them a call carries no trace context, and each server starts a trace of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

try:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed
    _otel: TraceContextTextMapPropagator | None = None
else:
    _otel = TraceContextTextMapPropagator()

__all__ = ["TRACEPARENT", "TRACESTATE", "current_trace_metadata", "trace_context"]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# version 00: `00-<trace id: 32 hex>-<parent id: 16 hex>-<flags: 2 hex>`, the ids not all zeros.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")

_explicit: ContextVar[tuple[tuple[str, str], ...] | None] = ContextVar("kforge_trace_context", default=None)


@contextmanager
def trace_context(traceparent: str, tracestate: str | None = None) -> Iterator[None]:
    """Makes every kforge call in the block (this thread or task) carry this W3C trace context.

    For callers that trace without OpenTelemetry's Python API, or that received the context from elsewhere (a
    trainer's own span context). Raises ValueError for a `traceparent` that is not a W3C version-00 one.
    """
    if not _TRACEPARENT.fullmatch(traceparent):
        raise ValueError(f"not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>): {traceparent!r}")
    entries = ((TRACEPARENT, traceparent),) + (((TRACESTATE, tracestate),) if tracestate else ())
    token = _explicit.set(entries)
    try:
        yield
    finally:
        _explicit.reset(token)


def current_trace_metadata() -> tuple[tuple[str, str], ...]:
    """The trace context a call made now carries: `trace_context`'s, else the current OpenTelemetry span's."""
    explicit = _explicit.get()
    if explicit is not None:
        return explicit
    if _otel is None:
        return ()
    carrier: dict[str, str] = {}
    _otel.inject(carrier)
    return tuple((key, carrier[key]) for key in (TRACEPARENT, TRACESTATE) if key in carrier)
