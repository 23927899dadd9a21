"""Bearer tokens against a kforge whose reward service requires one (`[reward.server.auth] token_env`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Unpack

import pytest
from fake_server import returns_request
from kforge_mesh import KforgeMesh

import kforge
from kforge.v1.clients import RewardClient

TOKEN = "s3cret-token-for-the-python-client-tests"


@pytest.fixture(scope="module")
def guarded() -> Iterator[str]:
    """The address of a reward service that takes calls presenting `TOKEN` only."""
    mesh = KforgeMesh.start(
        extra_config='[reward.server.auth]\ntoken_env = "KFORGE_PYTHON_TEST_TOKEN"\n',
        env={"KFORGE_PYTHON_TEST_TOKEN": TOKEN},
    )
    yield mesh.addresses["reward"]
    mesh.stop()


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests choose the token; the environment's own must not leak in."""
    monkeypatch.delenv("KFORGE_TOKEN", raising=False)
    monkeypatch.delenv("KFORGE_TOKEN_FILE", raising=False)


def compute_returns(address: str, **options: Unpack[kforge.ConnectOptions]) -> None:
    with kforge.connect(address, **options) as connection:
        RewardClient(connection).compute_returns(returns_request())


def test_a_call_without_the_token_is_unauthenticated(guarded: str) -> None:
    with pytest.raises(kforge.Unauthenticated) as raised:
        compute_returns(guarded)
    assert raised.value.code == "UNAUTHENTICATED"


def test_a_wrong_token_is_unauthenticated(guarded: str) -> None:
    with pytest.raises(kforge.Unauthenticated):
        compute_returns(guarded, token="not-the-token")


def test_the_token_argument_is_presented(guarded: str) -> None:
    compute_returns(guarded, token=TOKEN)


def test_a_token_file_is_read(guarded: str, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    compute_returns(guarded, token_file=str(tmp_path / "token"))


def test_the_environment_supplies_the_token(guarded: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KFORGE_TOKEN", TOKEN)
    compute_returns(guarded)


def test_a_client_presents_the_token_to_every_service(guarded: str) -> None:
    with kforge.Client({"reward": guarded}, token=TOKEN) as client:
        client.reward.compute_returns(returns_request())
