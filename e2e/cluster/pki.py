"""The cluster's keys and certificates, made with the openssl command (no Python crypto dependency)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClusterPKI:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    service_account_key: Path
    service_account_public_key: Path


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is needed to make the local cluster's certificates")
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _ec_key(path: Path) -> None:
    # P-256 keys take milliseconds to make, where RSA keys take a noticeable fraction of a second.
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
    path.chmod(0o600)


def make_pki(directory: Path, days: int = 30) -> ClusterPKI:
    """A CA, a serving certificate for 127.0.0.1 and localhost signed by it, and a service-account key."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = ClusterPKI(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        service_account_key=directory / "sa.key",
        service_account_public_key=directory / "sa.pub",
    )
    ca_key = directory / "ca.key"
    _ec_key(ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(ca_key), "-out", str(pki.ca_cert), "-days", str(days),
        "-subj", "/CN=kvfleet-local-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _ec_key(pki.serving_key)
    csr = directory / "apiserver.csr"
    _openssl("req", "-new", "-key", str(pki.serving_key), "-out", str(csr), "-subj", "/CN=kube-apiserver")
    extensions = directory / "apiserver.ext"
    extensions.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:10.0.0.1\n"
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(pki.serving_cert), "-days", str(days), "-extfile", str(extensions),
    )  # fmt: skip
    _ec_key(pki.service_account_key)
    # The API server reads verification keys only as public keys or traditional (not PKCS#8) private keys.
    _openssl(
        "pkey", "-in", str(pki.service_account_key), "-pubout", "-out", str(pki.service_account_public_key)
    )
    return pki
