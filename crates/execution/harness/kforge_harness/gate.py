"""The harness's side of the device gate (`Gate`), and the timing CPU its solo work is pinned to (`pinned_to`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

from .process import synchronize

if TYPE_CHECKING:
    import torch

    from .protocol import Phases


class Gate:
    """The harness's side of the device gate: stages share their device, except timed work, which runs alone.

    With the spec's `gate`, descriptor 3 is a socket to the evaluator. Before timed work the harness synchronises its
    device work and asks to run alone; the evaluator stops this process until every other process on the device
    stands at such a point (and is stopped) or is idle, then lets it go. After, it synchronises again and asks to
    share. Between steps of shared work it passes pause points, where it is stopped while another process runs alone
    or waits to. A trusted stage (`gate` "idle") starts idle: it asks to share before its device work,
    and may go idle again for host work. The socket's methods are bound here, before any candidate code runs, so
    replacing them later changes nothing."""

    def __init__(self, joining: bool | str, phases: Phases, timing_cpu: int | None = None) -> None:
        self.send: Callable[[bytes], None] | None = None
        self.recv: Callable[[int], bytes] | None = None
        self.is_idle = self.trusted = joining == "idle"
        self.phases = phases
        self.timing_cpu = timing_cpu
        if joining:
            import socket

            channel = socket.socket(fileno=3)
            self.send, self.recv = channel.sendall, channel.recv

    def ask(self, message: bytes, device: torch.device, sync: bool = True) -> None:
        if self.send is None or self.recv is None:
            return
        if sync:
            synchronize(device)
        with self.phases("gate"):  # time waiting for the device (stopped), reported as the `gate` phase
            self.send(message)
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < 16:
                chunk = self.recv(16)
                if not chunk:
                    raise RuntimeError("the evaluator closed the device gate")
                reply += chunk
        if reply != b"go\n":
            raise RuntimeError(f"unexpected answer from the device gate: {reply!r}")

    @contextlib.contextmanager
    def alone(self, device: torch.device) -> Generator[None, None, None]:
        """Runs the block alone on the device, its launching thread on the CPU kept free of other stages (the
        evaluator's `timing_cpu`). A block that raises ends the stage: no need to share again."""
        self.ask(b"alone\n", device)
        with pinned_to(self.timing_cpu):
            yield
        self.ask(b"share\n", device)

    @contextlib.contextmanager
    def round(self, device: torch.device) -> Generator[None, None, None]:
        """One round of paired timing: run alone once it is this stage's turn (the candidate's and its baseline's
        rounds alternate), its launching thread pinned as in `alone`. Sharing again after it passes the turn."""
        self.ask(b"round\n", device)
        with pinned_to(self.timing_cpu):
            yield
        self.ask(b"share\n", device)

    def call(self, timed: bool = False) -> None:
        """Tells the evaluator that candidate code starts now: it is stopped as hung if it runs past its call limit
        before the next message. A timed call waits for its GPU spinning, so its CPU use says nothing and its limit
        does not stretch for it. One way: no answer to wait for."""
        if self.send is not None:
            self.send(b"timed\n" if timed else b"call\n")

    def pause(self, device: torch.device) -> None:
        """A pause point between steps of shared work: stopped here while another process runs alone or waits to."""
        self.ask(b"pause\n", device)

    @contextlib.contextmanager
    def host_work(self, device: torch.device) -> Generator[None, None, None]:
        """Host work only in the block (reading outputs' files into the page cache). A trusted stage that joined
        idle goes idle for it, so it holds nobody up and runs on while others run alone, and shares again after,
        waiting while anyone runs alone or waits to. Any other stage runs the block as it is: without a gate, or as
        a solo member (an evaluation retried alone, its checker included), it has the device to itself; a
        candidate's stage does no host work between its pause points."""
        if not self.trusted:
            yield
            return
        was_idle = self.is_idle
        self.idle(device)
        yield
        if not was_idle:
            self.share(device)

    def share(self, device: torch.device) -> None:
        """Before a trusted stage's device work: leaves idle, waiting while timed work runs."""
        if self.is_idle:
            self.ask(b"share\n", device, sync=False)  # nothing ran on the device while idle
            self.is_idle = False

    def idle(self, device: torch.device) -> None:
        """A trusted stage's host work from here on: it holds nobody up."""
        if not self.is_idle:
            self.ask(b"idle\n", device)
            self.is_idle = True


@contextlib.contextmanager
def pinned_to(cpu: int | None) -> Generator[None, None, None]:
    """Runs the block with the calling thread on `cpu` alone (other threads keep their CPUs); then as before."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        before = None  # not ours to use here (a cpuset without it): timing runs where it was
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
