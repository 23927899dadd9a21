"""Connections: addresses, TLS (mutual too, against an in-process server), tokens, the client's services."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from fake_server import echo, fake_reward, returns_request

import kforge
from kforge.connection import Target, resolve_token
from kforge.v1.clients import RewardClient


@pytest.mark.parametrize(
    ("address", "target"),
    [
        ("http://127.0.0.1:50055", Target("127.0.0.1:50055", tls=False)),
        ("127.0.0.1:50055", Target("127.0.0.1:50055", tls=False)),
        ("https://kforge.example", Target("kforge.example:443", tls=True)),
        ("https://kforge.example:8443/", Target("kforge.example:8443", tls=True)),
        ("http://[::1]:50051", Target("[::1]:50051", tls=False)),
    ],
)
def test_addresses(address: str, target: Target) -> None:
    assert Target.parse(address) == target


@pytest.mark.parametrize(
    "address", ["grpc://host:1", "http://host:1/kforge", "http://user:pw@host:1", "http://:1", "http://host:1?x=1"]
)
def test_an_address_that_is_not_scheme_host_port_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match=r"expected|scheme"):
        Target.parse(address)


def test_tls_options_need_an_https_address(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="https"):
        kforge.connect("http://127.0.0.1:1", ca_file=tmp_path / "ca.pem")
    with pytest.raises(ValueError, match="together"):
        kforge.connect("https://127.0.0.1:1", cert_file=tmp_path / "cert.pem")


def test_the_token_comes_from_the_argument_then_its_file_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text(" from-file\n")
    (tmp_path / "env-file").write_text("from-env-file")
    monkeypatch.setenv("KFORGE_TOKEN_FILE", str(tmp_path / "env-file"))
    assert resolve_token(None, None) == "from-env-file"
    monkeypatch.setenv("KFORGE_TOKEN", "from-env")
    assert resolve_token(None, None) == "from-env"
    assert resolve_token(None, tmp_path / "file") == "from-file"
    assert resolve_token("from-argument", tmp_path / "file") == "from-argument"
    monkeypatch.delenv("KFORGE_TOKEN")
    monkeypatch.delenv("KFORGE_TOKEN_FILE")
    assert resolve_token(None, None) is None


@pytest.mark.parametrize("token", ["", "   ", "two words", "caf\u00e9"])
def test_a_token_that_cannot_be_a_header_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="token"):
        resolve_token(token, None)


def test_a_client_without_an_address_for_a_service_says_so() -> None:
    with kforge.Client({"reward": "http://127.0.0.1:1"}) as client:
        assert client.reward is client.reward, "each service's client is made once"
        with pytest.raises(LookupError, match="evaluator"):
            _ = client.evaluator
    with pytest.raises(ValueError, match="rewards"):
        kforge.Client({"rewards": "http://127.0.0.1:1"})  # type: ignore[dict-item]


def make_certificate(directory: Path, name: str, host: str) -> tuple[Path, Path]:
    """A self-signed certificate for `host` and its key, by the openssl command."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={host}",
         "-addext", f"subjectAltName=DNS:{host}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_with_a_ca_file_and_the_servers_name(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path, "server", "kforge.test")
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    with fake_reward(echo, credentials) as server:
        with kforge.connect(server.address, ca_file=cert, tls_domain="kforge.test") as connection:
            RewardClient(connection).compute_returns(returns_request())
        with kforge.connect(server.address, retry=None) as connection, pytest.raises(kforge.Unavailable):
            RewardClient(connection).compute_returns(returns_request(), timeout=5)  # the system's roots refuse it


def test_mutual_tls_presents_the_client_certificate(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path, "server", "kforge.test")
    client_cert, client_key = make_certificate(tmp_path, "client", "trainer")
    credentials = grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())], root_certificates=client_cert.read_bytes(), require_client_auth=True
    )
    with fake_reward(echo, credentials) as server:
        with kforge.connect(
            server.address, ca_file=cert, tls_domain="kforge.test", cert_file=client_cert, key_file=client_key
        ) as connection:
            RewardClient(connection).compute_returns(returns_request())
        with (
            kforge.connect(server.address, ca_file=cert, tls_domain="kforge.test", retry=None) as connection,
            pytest.raises(kforge.Unavailable),
        ):
            RewardClient(connection).compute_returns(returns_request(), timeout=5)  # no client certificate
