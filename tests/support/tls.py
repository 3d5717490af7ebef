"""A throwaway certificate authority for tests, made with the `openssl` command line.

`make_pki(directory)` writes a CA and leaf certificates signed by it, laid out as a
Kubernetes TLS secret mounts them (tls.crt, tls.key, ca.crt), each valid for
localhost and 127.0.0.1 as a server and as a client, plus one leaf from a CA the
deployment does not trust (a stranger's certificate) and one that names only a DNS
name (for --tls-server-name).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
DAYS = "2"
LEAF_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = {names}
"""
LOOPBACK_NAMES = "DNS:localhost, DNS:baton.internal, IP:127.0.0.1"


@dataclass(frozen=True)
class Leaf:
    """One identity's files, as a mounted TLS secret holds them."""

    cert: Path  # tls.crt
    key: Path  # tls.key
    ca: Path  # ca.crt: the CA this deployment trusts


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Leaf  # what every Baton process presents (as server and as client)
    client: Leaf  # another trusted identity (an operator's `baton status`)
    stranger: Leaf  # signed by a CA nobody here trusts
    dns_only: Leaf  # names only baton.internal: dialled at 127.0.0.1, it needs --tls-server-name


def _openssl(*args: str) -> None:
    subprocess.run([OPENSSL, *args], check=True, capture_output=True)


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.crt", directory / "ca.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", DAYS, "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _leaf(directory: Path, name: str, ca_cert: Path, ca_key: Path, trusted_ca: Path,
          names: str = LOOPBACK_NAMES) -> Leaf:
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, request = directory / "tls.crt", directory / "tls.key", directory / "tls.csr"
    extensions = directory / "leaf.ext"
    extensions.write_text(LEAF_EXTENSIONS.format(names=names))
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key), "-out", str(request), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca_cert), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(cert), "-days", DAYS, "-extfile", str(extensions))
    shutil.copy(trusted_ca, directory / "ca.crt")
    return Leaf(cert, key, directory / "ca.crt")


def make_pki(directory: Path) -> Pki:
    """A CA, the leaves it signs and a stranger's leaf, under `directory` (about 0.1 s)."""
    ca_cert, ca_key = _ca(directory / "ca", "baton test CA")
    other_cert, other_key = _ca(directory / "other-ca", "somebody else's CA")
    return Pki(
        ca=ca_cert,
        server=_leaf(directory / "server", "baton", ca_cert, ca_key, ca_cert),
        client=_leaf(directory / "client", "operator", ca_cert, ca_key, ca_cert),
        stranger=_leaf(directory / "stranger", "stranger", other_cert, other_key, ca_cert),
        dns_only=_leaf(directory / "dns-only", "baton", ca_cert, ca_key, ca_cert, names="DNS:baton.internal"),
    )
