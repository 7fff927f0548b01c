"""HTTPS with vLLM's --ssl-* flags: the openai SDK over TLS with a client certificate the server requires, and
a certificate and CA bundle renewed on disk served to new connections without a restart. trustme's CAs issue
every certificate, and Python's ssl module (through httpx) checks the server's."""

from __future__ import annotations

import dataclasses
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from click.testing import CliRunner
from servers import ServerProcess

from kvfleet.cli import cli

# The refresh looks at the files every second.
REFRESH_WAIT_S = 15.0


def _write_atomically(path: Path, blobs: list[trustme.Blob]) -> None:
    """As a mounted Secret changes: the new file renamed over the old one."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(b"".join(blob.bytes() for blob in blobs))
    os.replace(partial, path)


def _write_leaf(leaf: trustme.LeafCert, folder: Path, name: str) -> tuple[Path, Path]:
    certfile, keyfile = folder / f"{name}.crt", folder / f"{name}.key"
    _write_atomically(keyfile, [leaf.private_key_pem])
    _write_atomically(certfile, leaf.cert_chain_pems)
    return certfile, keyfile


def _client(trusted: trustme.CA, identity: trustme.LeafCert | None) -> ssl.SSLContext:
    """A client's TLS: the CA it trusts the server's certificate by, and the certificate it shows, if any."""
    context = ssl.create_default_context()
    trusted.configure_trust(context)
    if identity is not None:
        identity.configure_cert(context)
    return context


def _completion(server: ServerProcess, verify: ssl.SSLContext) -> openai.types.Completion:
    with httpx.Client(verify=verify, timeout=60) as http_client:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", http_client=http_client, max_retries=0
        )
        return client.completions.create(model=server.model_name, prompt="Once upon a time", max_tokens=4)


def test_the_sdk_talks_https_with_a_required_client_certificate_and_a_renewed_one_is_served_without_a_restart(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    ca, other_ca = trustme.CA(), trustme.CA()
    certfile, keyfile = _write_leaf(ca.issue_cert("127.0.0.1"), tmp_path, "server")
    ca_certs = tmp_path / "clients-ca.pem"
    ca.cert_pem.write_to_path(str(ca_certs))
    client_cert = ca.issue_cert("client.example")
    flags = ["--ssl-certfile", certfile, "--ssl-keyfile", keyfile, "--ssl-ca-certs", ca_certs]
    started = start_server(*map(str, flags), "--ssl-cert-reqs", "2", "--enable-ssl-refresh", wait=False)
    server = dataclasses.replace(
        started, url=started.url.replace("http://", "https://"), verify=_client(ca, client_cert)
    )
    server.wait_ready()

    answer = _completion(server, _client(ca, client_cert))
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    # No client certificate, or one another CA issued: the handshake fails.
    for refused in (_client(ca, None), _client(ca, other_ca.issue_cert("client.example"))):
        with pytest.raises(openai.APIConnectionError):
            _completion(server, refused)
    # A client that does not trust the server's CA refuses the server.
    with pytest.raises(openai.APIConnectionError):
        _completion(server, _client(other_ca, other_ca.issue_cert("client.example")))
    # Plain HTTP on the HTTPS port gets no answer.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{started.url}/ready", timeout=10)

    # The clients' CA is replaced in the bundle, and the certificate renewed by another CA: new connections
    # get the certificate and the bundle as they now are, and the process is the same.
    other_ca.cert_pem.write_to_path(str(ca_certs))
    renewed_ca = trustme.CA()
    _write_leaf(renewed_ca.issue_cert("127.0.0.1"), tmp_path, "server")
    other_client_cert = other_ca.issue_cert("client.example")
    deadline = time.monotonic() + REFRESH_WAIT_S
    while True:
        try:
            answer = _completion(server, _client(renewed_ca, other_client_cert))
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "the renewed certificate and bundle were not served"
            time.sleep(0.5)
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    # The CA taken out of the bundle is trusted no more.
    with pytest.raises(openai.APIConnectionError):
        _completion(server, _client(renewed_ca, client_cert))
    with pytest.raises(openai.APIConnectionError):
        _completion(server, _client(ca, client_cert))
    assert "the TLS certificate was loaded again" in started.log_path.read_text()

    # A bundle that does not load leaves the last files in use.
    ca_certs.write_text("not a certificate")
    deadline = time.monotonic() + REFRESH_WAIT_S
    while "the TLS files changed but were not loaded" not in started.log_path.read_text():
        assert time.monotonic() < deadline, "the bundle that does not load was not noticed"
        time.sleep(0.5)
    answer = _completion(server, _client(renewed_ca, other_client_cert))
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    with pytest.raises(openai.APIConnectionError):
        _completion(server, _client(renewed_ca, client_cert))
    assert started.process.poll() is None


def test_tls_flags_it_cannot_use_are_refused_by_name(tiny_llama: Path, tmp_path: Path) -> None:
    leaf = trustme.CA().issue_cert("127.0.0.1")
    certfile, keyfile = _write_leaf(leaf, tmp_path, "server")
    other_keyfile = _write_leaf(trustme.CA().issue_cert("127.0.0.1"), tmp_path, "other")[1]
    not_a_certificate = tmp_path / "notes.txt"
    not_a_certificate.write_text("not a certificate\n")
    cases = [
        (["--ssl-keyfile", keyfile], "--ssl-keyfile", "certificate"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh", "certificate"),
        (["--ssl-certfile", certfile, "--ssl-keyfile", other_keyfile], "--ssl-certfile", str(other_keyfile)),
        (["--ssl-certfile", not_a_certificate], "--ssl-certfile", str(not_a_certificate)),
        (
            ["--ssl-certfile", certfile, "--ssl-keyfile", keyfile, "--ssl-cert-reqs", "2"],
            "--ssl-cert-reqs",
            "--ssl-ca-certs",
        ),
        (
            ["--ssl-certfile", certfile, "--ssl-keyfile", keyfile, "--ssl-ciphers", "NO-SUCH-CIPHER"],
            "--ssl-ciphers",
            "NO-SUCH-CIPHER",
        ),
        (["--ssl-certfile", certfile, "--ssl-cert-reqs", "3"], "--ssl-cert-reqs", "0<=x<=2"),
    ]
    for flags, named, words in cases:
        completed = CliRunner().invoke(cli, ["serve", str(tiny_llama), *map(str, flags)])
        last = completed.output.splitlines()[-1]
        assert completed.exit_code == 2 and named in last and words in last, (flags, completed.output)
