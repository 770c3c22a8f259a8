"""Certificates the suites make for themselves with the `openssl` command: a CA of the test's own
and server certificates it signs, so that no test trusts or reads a certificate from outside
the repository and the machine's trust store plays no part.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def make_ca(directory: Path, name: str = "ca") -> tuple[Path, Path]:
    """A self-signed CA in `directory`: (its certificate, its key), files `<name>.pem`, `<name>.key`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
             "-subj", f"/CN=atmost test CA {name}")
    return ca, ca_key


def issue(directory: Path, ca: Path, ca_key: Path, dns_name: str, name: str = "server") -> tuple[Path, Path]:
    """A server certificate for `dns_name` (its only subject alternative name) signed by the CA:
    (certificate, key), files `<name>.pem`, `<name>.key` in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
    extensions = directory / f"{name}.cnf"
    extensions.write_text(f"subjectAltName=DNS:{dns_name}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={dns_name}")
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "1",
             "-extfile", extensions)
    return cert, key


def make_certificate(directory: Path, dns_name: str = "localhost") -> tuple[Path, Path, Path]:
    """A CA of the test's own and a certificate for `dns_name` it signed: (CA, cert, key)."""
    ca, ca_key = make_ca(directory)
    cert, key = issue(directory, ca, ca_key, dns_name)
    return ca, cert, key
