"""Hatch build hook: generates `kforge.v1` from the contract's protos when a wheel (or an editable install) is built.

Into `src/kforge/v1/`, ignored by git:

- `<name>_pb2.py` and `<name>_pb2.pyi` per proto file: protoc's messages and their stubs (grpcio-tools' protoc);
- `clients.py`: a sync and an async client class per service, one typed method per RPC, each a one-line delegation
  to the hand-written core (`kforge.connection`, `kforge.calls`), written from the descriptors with the protos'
  comments as docstrings.

The protos are found in `$KFORGE_PROTO_DIR`, else `proto/` beside this file (an unpacked sdist), else the
repository's `../../proto`. An sdist packs them, so that it builds anywhere.
"""

import keyword
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from grpc_tools import protoc  # type: ignore[import-untyped]
from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PACKAGE = "kforge.v1"
PROTO_SUBDIR = Path("kforge") / "v1"

# FileDescriptorProto field numbers, as SourceCodeInfo paths name them.
_SERVICE = 6
_METHOD = 2


class ProtoBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Generates `kforge.v1` for wheels and editable installs; packs the protos into sdists."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        """Runs before the target is built: `version` is `standard` or `editable` for wheels."""
        root = Path(self.root)
        protos = find_protos(root)
        if self.target_name == "sdist":
            if not protos.is_relative_to(root):
                build_data["force_include"][str(protos / "kforge")] = "proto/kforge"
            return
        generate(protos, root / "src")

    def clean(self, versions: list[str]) -> None:
        """`hatch clean`: removes what `initialize` generated."""
        shutil.rmtree(Path(self.root) / "src" / PROTO_SUBDIR, ignore_errors=True)


def find_protos(root: Path) -> Path:
    """The directory holding `kforge/v1/*.proto`."""
    candidates = [Path(os.environ["KFORGE_PROTO_DIR"])] if os.environ.get("KFORGE_PROTO_DIR") else []
    candidates += [root / "proto", root.parent.parent / "proto"]
    for candidate in candidates:
        if any((candidate / PROTO_SUBDIR).glob("*.proto")):
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no kforge/v1/*.proto under any of: {tried} (set KFORGE_PROTO_DIR)")


def generate(protos: Path, src: Path) -> None:
    """Writes `src/kforge/v1/`: protoc's modules and stubs, `__init__.py` and `clients.py`, replacing what was there."""
    files = sorted(str(p.relative_to(protos)) for p in (protos / PROTO_SUBDIR).glob("*.proto"))
    well_known = resources.files("grpc_tools") / "_proto"
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out"
        out.mkdir()
        descriptor_set = Path(scratch) / "descriptors.pb"
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{protos}",
                f"-I{well_known}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--descriptor_set_out={descriptor_set}",
                "--include_imports",
                "--include_source_info",
                *files,
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed (status {status}) on {', '.join(files)} in {protos}")
        descriptors = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
        generated = out / PROTO_SUBDIR
        (generated / "__init__.py").write_text(
            f'"""The `{PACKAGE}` messages and typed clients, generated from the kforge protos at build time."""\n'
        )
        (generated / "clients.py").write_text(render_clients(descriptors))
        target = src / PROTO_SUBDIR
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(generated, target)


@dataclass(frozen=True)
class Rpc:
    """One method of a service, as the generated clients need it."""

    name: str
    request: str
    response: str
    client_streaming: bool
    server_streaming: bool
    doc: str

    @property
    def attribute(self) -> str:
        """The method's Python name: `GetDeviceSpec` -> `get_device_spec` (`import_`, were an RPC named `Import`)."""
        name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", self.name).lower()
        return f"{name}_" if keyword.iskeyword(name) else name


@dataclass(frozen=True)
class Service:
    """One service of the package."""

    name: str
    doc: str
    rpcs: list[Rpc]


def render_clients(descriptors: descriptor_pb2.FileDescriptorSet) -> str:
    """The source of `kforge/v1/clients.py` for every service of `kforge.v1` in `descriptors`."""
    types: dict[str, str] = {}  # `.package.Message` -> `module_pb2.Message`
    modules: dict[str, str] = {}  # `module_pb2` -> its package, for the imports
    for file in descriptors.file:
        module = Path(file.name).stem + "_pb2"
        package = ".".join(Path(file.name).parent.parts)
        if modules.setdefault(module, package) != package:
            raise ValueError(f"two proto files generate the module {module}: rename one")
        for name in _message_names(file.message_type):
            types[f".{file.package}.{name}"] = f"{module}.{name}"
    services = [service for file in descriptors.file if file.package == PACKAGE for service in _services(file, types)]
    used = sorted({t.split(".")[0] for s in services for r in s.rpcs for t in (r.request, r.response)})
    out = [
        f'"""Typed clients of the `{PACKAGE}` services, generated from their protos by hatch_build.py: do not edit.',
        "",
        "Each service has a sync class over a `kforge.Connection` and an async class over a `kforge.AsyncConnection`;",
        "each RPC is a method taking the request (an iterable of requests for client streaming) and, by keyword, the",
        "call's `timeout` in seconds (None: the connection's default for unary calls, none for streams) and extra",
        "`metadata`. Deadlines, retries, errors and trace context are the core's (`kforge.calls`).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from collections.abc import AsyncIterable, Iterable",
        "",
        "from kforge.calls import AsyncResponseStream, Metadata, Method, ResponseStream",
        "from kforge.connection import AsyncConnection, Connection",
        *sorted(f"from {modules[m]} import {m}" for m in used),
        "",
        "__all__ = [",
        *(f'    "{prefix}{s.name}Client",' for s in services for prefix in ("", "Async")),
        "]",
        "",
    ]
    for service in services:
        out += _render_methods(service)
    for service in services:
        out += _render_class(service, asynchronous=False)
        out += _render_class(service, asynchronous=True)
    return "\n".join(out)


def _message_names(messages: Iterable[descriptor_pb2.DescriptorProto], outer: str = "") -> Iterator[str]:
    """Every message's name within its file, nested ones dotted (`Outer.Inner`), as protoc's module names them."""
    for message in messages:
        name = f"{outer}{message.name}"
        yield name
        yield from _message_names(message.nested_type, f"{name}.")


def _services(file: descriptor_pb2.FileDescriptorProto, types: dict[str, str]) -> list[Service]:
    comments = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
    services = []
    for s, service in enumerate(file.service):
        rpcs = [
            Rpc(
                name=method.name,
                request=types[method.input_type],
                response=types[method.output_type],
                client_streaming=method.client_streaming,
                server_streaming=method.server_streaming,
                doc=comments.get((_SERVICE, s, _METHOD, m), ""),
            )
            for m, method in enumerate(service.method)
        ]
        services.append(Service(service.name, comments.get((_SERVICE, s), ""), rpcs))
    return services


def _constant(service: Service, rpc: Rpc) -> str:
    return f"_{service.name.upper()}_{rpc.attribute.upper()}"


def _render_methods(service: Service) -> list[str]:
    return [
        f'{_constant(service, rpc)} = Method("/{PACKAGE}.{service.name}/{rpc.name}", {rpc.request}, {rpc.response})'
        for rpc in service.rpcs
    ] + ["", ""]


def _docstring(text: str, indent: str) -> list[str]:
    lines = [line.removeprefix(" ").rstrip() for line in text.strip().splitlines()] or ["(Undocumented in the proto.)"]
    lines = [line.replace("\\", "\\\\").replace('"""', '\\"\\"\\"') for line in lines]
    if len(lines) == 1:
        return [f'{indent}"""{lines[0]}"""']
    return [f'{indent}"""{lines[0]}', *(f"{indent}{line}" if line else "" for line in lines[1:]), f'{indent}"""']


_KINDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _render_class(service: Service, *, asynchronous: bool) -> list[str]:
    prefix = "Async" if asynchronous else ""
    connection = f"{prefix}Connection"
    summary = f"{'Async' if asynchronous else 'Sync'} client of `{PACKAGE}.{service.name}`: {service.doc.strip()}"
    out = [
        f"class {prefix}{service.name}Client:",
        *_docstring(summary, "    "),
        "",
        f"    def __init__(self, connection: {connection}) -> None:",
        *(
            f"        self._{rpc.attribute} = connection.{_KINDS[rpc.client_streaming, rpc.server_streaming]}"
            f"({_constant(service, rpc)})"
            for rpc in service.rpcs
        ),
        "",
    ]
    for rpc in service.rpcs:
        if rpc.client_streaming:
            iterable = f"Iterable[{rpc.request}]"
            either = f"AsyncIterable[{rpc.request}] | {iterable}"
            parameter = f"requests: {either if asynchronous else iterable}"
            argument = "requests"
        else:
            parameter = f"request: {rpc.request}"
            argument = "request"
        returns = f"{prefix}ResponseStream[{rpc.response}]" if rpc.server_streaming else rpc.response
        awaited = asynchronous and not rpc.server_streaming
        out += [
            f"    {'async ' if awaited else ''}def {rpc.attribute}(",
            f"        self, {parameter}, *, timeout: float | None = None, metadata: Metadata | None = None",
            f"    ) -> {returns}:",
            *_docstring(rpc.doc, "        "),
            f"        return {'await ' if awaited else ''}self._{rpc.attribute}({argument}, timeout=timeout, "
            "metadata=metadata)",
            "",
        ]
    return [*out, ""]
