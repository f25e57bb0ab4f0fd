"""Test certificates made with the openssl CLI: a CA and certificates it signs (TLS and etcd tests)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> None:
    """``d/name.pem`` and ``d/name.key``: a self-signed CA (EC P-256, two days)."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=kvpool test {name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=d)


def make_cert(d: Path, name: str, ca: str, cn: str, usage: str, san: str = "") -> None:
    """``d/name.pem`` and ``d/name.key`` signed by the CA ``ca``: common name ``cn``, extended key usage ``usage``
    (``serverAuth``, ``clientAuth``), subject alternative names ``san`` (e.g. ``IP:127.0.0.1,DNS:localhost``)."""
    (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                   f"extendedKeyUsage={usage}\nsubjectKeyIdentifier=hash\n"
                                   "authorityKeyIdentifier=keyid,issuer\n" + (f"subjectAltName={san}\n" if san else ""))
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
