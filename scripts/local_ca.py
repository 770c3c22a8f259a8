"""A local CA and a certificate for the ledger it signed, for `make run` and the suites: the
ledger serves TLS with the certificate (`--tls-cert-file`, `--tls-key-file`), Envoy and the
admin CLI trust the CA (`trusted_ca` in envoy/atmost-sidecar.yaml, `--ledger-ca-file`).

Made here with the `cryptography` package (requirements.txt), nothing fetched. The CA's key is
not kept: nothing else can ever be signed by it. Run it by hand for a sidecar started outside
`make run`:

    .venv/bin/python scripts/local_ca.py .run/tls

writes ca.pem, ledger.pem and ledger.key (mode 0600) there. A deployment uses its own PKI
(cert-manager, say) instead; the ledger reads its files again when they change.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The ledger's name in envoy/atmost-sidecar.yaml: the TLS `sni` Envoy sends and the DNS name it
# requires in the certificate (`match_typed_subject_alt_names`), the plugin's `ledger.authority`.
LEDGER_SERVER_NAME = "atmost-ledger"
# Besides that name, the certificate names what local clients connect to: the admin CLI, the
# suites and a browser at https://127.0.0.1:8082/admin/ or https://localhost:8082/admin/.
LOCAL_NAMES = ("localhost",)
LOCAL_ADDRESSES = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class LedgerTls:
    """The files: the CA certificate to trust, the ledger's certificate and its key."""

    ca: Path
    cert: Path
    key: Path
    server_name: str = LEDGER_SERVER_NAME


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "atmost local"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def issue_ledger_certificate(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                             server_name: str = LEDGER_SERVER_NAME, days: int = 30) -> tuple[bytes, bytes]:
    """A server certificate for the ledger signed by the CA: (certificate PEM, key PEM)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(server_name), *(x509.DNSName(n) for n in LOCAL_NAMES)]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in LOCAL_ADDRESSES]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(server_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_ca(days: int = 30) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("atmost local CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def write_private(path: Path, data: bytes) -> None:
    """Writes a key readable by its owner only, replacing the file in one step (a running ledger
    reading it again sees the old file or the new one, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def make_ledger_tls(directory: Path, server_name: str = LEDGER_SERVER_NAME, days: int = 30) -> LedgerTls:
    """A new CA and ledger certificate in `directory`: ca.pem, ledger.pem, ledger.key."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca(days)
    cert_pem, key_pem = issue_ledger_certificate(ca_cert, ca_key, server_name, days)
    tls = LedgerTls(ca=directory / "ca.pem", cert=directory / "ledger.pem", key=directory / "ledger.key",
                    server_name=server_name)
    write_public(tls.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    write_private(tls.key, key_pem)
    write_public(tls.cert, cert_pem)
    return tls


def spki_sha256(cert: Path) -> str:
    """Base64 of the SHA-256 of the certificate's public key (its SubjectPublicKeyInfo): the form
    Chromium's `--ignore-certificate-errors-spki-list` takes, to accept this one certificate."""
    import base64
    import hashlib

    public_key = x509.load_pem_x509_certificate(cert.read_bytes()).public_key()
    spki = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write ca.pem, ledger.pem and ledger.key")
    parser.add_argument("--server-name", default=LEDGER_SERVER_NAME, help="the ledger's DNS name (default %(default)s)")
    parser.add_argument("--days", type=int, default=30, help="validity of both certificates (default %(default)s)")
    args = parser.parse_args()
    tls = make_ledger_tls(args.directory, args.server_name, args.days)
    print(f"CA {tls.ca}\ncertificate {tls.cert}\nkey {tls.key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
