"""Fixtures: one real kforge mesh for the session and a client of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kforge_mesh import KforgeMesh

import kforge


@pytest.fixture(scope="session")
def mesh() -> Iterator[KforgeMesh]:
    """Every kforge service, started once for the session by `kforge up`."""
    try:
        mesh = KforgeMesh.start()
    except FileNotFoundError as error:
        pytest.fail(str(error), pytrace=False)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="session")
def client(mesh: KforgeMesh) -> Iterator[kforge.Client]:
    """A sync client of the session's mesh, one address per service."""
    with kforge.Client(mesh.addresses, timeout=300) as client:
        yield client
