"""A real kforge mesh for the tests: `kforge --config FILE up` on free loopback ports, stopped with SIGTERM.

The binary is `$KFORGE_BIN`, else the repository's `target/debug/kforge`. Every service listens on
`127.0.0.1:0`; the addresses are the `name address` lines `kforge up` prints once every service accepts calls.
The mesh's files live in a directory of its own that other users may traverse (the evaluator runs each candidate
as a user of its own where it is root), removed when the mesh stops.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kforge.client import SERVICES, ServiceName

REPO = Path(__file__).resolve().parents[3]

_SERVICE_NAMES: dict[str, ServiceName] = {service: service for service in SERVICES}

# The evaluator tuned for short tests on a small CPU machine: no torch.compile baseline and no precompiled header
# (minutes of compiling at start), fewer trials, a short timing budget against the baseline cached per task (no
# fresh baseline process per evaluation).
EVALUATOR_CONFIG = """
baseline_torch_compile = false
bindings_pch = false
default_trials = 2
recheck_trials = 1

[evaluator.timing]
warmup_runs = 2
min_runs = 5
max_runs = 50
max_seconds = 0.5
min_seconds = 0.05

[evaluator.paired_timing]
on = "off"
"""


def kforge_binary() -> Path:
    """The `kforge` binary the tests run; raises FileNotFoundError naming how to get one."""
    binary = Path(os.environ.get("KFORGE_BIN") or REPO / "target" / "debug" / "kforge")
    if not binary.is_file():
        raise FileNotFoundError(
            f"no kforge binary at {binary}: build it (cargo build -p kforge --bin kforge) or set KFORGE_BIN"
        )
    return binary


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a TOML basic string


def write_config(workdir: Path, extra: str = "") -> Path:
    """A configuration putting every service on a free loopback port and every file under `workdir`."""
    python = REPO / ".venv" / "bin" / "python"
    listen = "".join(f'\n[{service}.server]\nlisten = "127.0.0.1:0"\n' for service in SERVICES)
    config = workdir / "kforge.toml"
    config.write_text(
        f"[evaluator]\npython = {_toml(str(python if python.exists() else sys.executable))}\n"
        f"work_dir = {_toml(str(workdir / 'evaluator'))}\n"
        f"{EVALUATOR_CONFIG}\n"
        f"[orchestrator]\nstore = {_toml(str(workdir / 'orchestrator.db'))}\n"
        '[orchestrator.http]\nlisten = "127.0.0.1:0"\n'
        f"{listen}\n{extra}"
    )
    return config


@dataclass
class KforgeMesh:
    """A running `kforge up` and the address of each service."""

    process: subprocess.Popen[bytes]
    addresses: dict[ServiceName, str]
    workdir: Path
    http_address: str = ""
    """The orchestrator's HTTP port (the protocol faces and JSON)."""

    @property
    def log(self) -> Path:
        """The mesh's stderr."""
        return self.workdir / "kforge.log"

    @classmethod
    def start(cls, *, extra_config: str = "", env: Mapping[str, str] | None = None, timeout: float = 180) -> KforgeMesh:
        """Starts the mesh and waits, at most `timeout` seconds, for the addresses it prints."""
        binary = kforge_binary()
        workdir = Path(tempfile.mkdtemp(prefix="kforge-python-client-"))
        workdir.chmod(0o711)
        config = write_config(workdir, extra_config)
        with (workdir / "kforge.log").open("wb") as stderr:
            process = subprocess.Popen(
                [str(binary), "--config", str(config), "up"],
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, **(env or {})},
            )
        mesh = cls(process, {}, workdir)
        try:
            mesh._read_addresses(time.monotonic() + timeout)
        except BaseException:
            mesh.stop(check=False)
            raise
        return mesh

    def _read_addresses(self, deadline: float) -> None:
        assert self.process.stdout is not None
        stdout = self.process.stdout.fileno()  # read unbuffered: a buffered line would hide from the selector
        pending = b""
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while len(self.addresses) < len(SERVICES) or not self.http_address:
                if not selector.select(timeout=max(deadline - time.monotonic(), 0)):
                    raise TimeoutError(f"kforge up printed no addresses in time; its log:\n{self.log_tail()}")
                chunk = os.read(stdout, 4096)
                if not chunk:
                    raise RuntimeError(f"kforge up exited ({self.process.wait()}); its log:\n{self.log_tail()}")
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    name, address = line.decode().split()
                    if service := _SERVICE_NAMES.get(name):
                        self.addresses[service] = address
                    elif name == "orchestrator-http":
                        self.http_address = address

    def log_tail(self, lines: int = 40) -> str:
        """The end of the mesh's log (its stderr)."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *, check: bool = True) -> None:
        """Stops the mesh as an operator does (SIGTERM, then a drain); with `check`, it must exit 0."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        log = self.log_tail()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if check and self.process.returncode != 0:
            raise RuntimeError(f"kforge up exited {self.process.returncode} on SIGTERM; its log:\n{log}")
