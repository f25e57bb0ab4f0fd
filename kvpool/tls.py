"""TLS for kvpool's three transports: gRPC, fast calls and bulk TCP (optional; docs/security.md).

- Servers (master, node) present ``tls_cert`` (PEM chain) with ``tls_key``;
  clients (and nodes dialing the master) verify it against ``tls_ca`` and
  check that it names the host they dialed (an IP address needs an IP SAN).
- Plain TCP sockets are wrapped with Python's :mod:`ssl` (TLS 1.2 or newer);
  gRPC gets the same files as channel / server credentials.
- A file that cannot be read or parsed is a ValueError naming it, at start.
"""

from __future__ import annotations

import ssl

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read TLS {what} {path}: {exc.strerror}") from None


def check_pair(cert: str, key: str, where: str) -> bool:
    """Whether TLS serving is on; ValueError if only one of cert and key is set."""
    if bool(cert) != bool(key):
        raise ValueError(f"{where}: set both tls_cert and tls_key, or neither")
    return bool(cert)


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A server-side context presenting ``cert`` (PEM, leaf first) with ``key``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _read(cert, "certificate")
    _read(key, "key")
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"TLS certificate {cert} / key {key} cannot be used: {exc}") from None
    return context


def client_context(ca: str) -> ssl.SSLContext:
    """A client-side context trusting only ``ca`` (PEM), verifying the peer and its host name."""
    _read(ca, "CA certificate")
    try:
        context = ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise ValueError(f"TLS CA certificate {ca} cannot be used: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    """gRPC server credentials from the same files as :func:`server_context` (checked the same way)."""
    server_context(cert, key)
    return grpc.ssl_server_credentials([(_read(key, "key"), _read(cert, "certificate"))])


def channel_credentials(ca: str) -> grpc.ChannelCredentials:
    """gRPC channel credentials trusting only ``ca``."""
    client_context(ca)
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"))
