"""TLS for kvpool's three transports: gRPC, fast calls and bulk TCP (optional; docs/security.md).

- Servers (master, node) present ``tls_cert`` (PEM chain) with ``tls_key``;
  clients (and nodes dialing the master) verify it against ``tls_ca`` and
  check that it names the host they dialed (an IP address needs an IP SAN).
- kvpool's etcd client (:mod:`kvpool.etcd`) may also present a client
  certificate (mutual TLS, etcd's ``--client-cert-auth``).
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


def _load_pair(context: ssl.SSLContext, cert: str, key: str) -> None:
    _read(cert, "certificate")
    _read(key, "key")
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"TLS certificate {cert} / key {key} cannot be used: {exc}") from None


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A server-side context presenting ``cert`` (PEM, leaf first) with ``key``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_pair(context, cert, key)
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


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """gRPC channel credentials trusting only ``ca``; with ``cert`` and ``key`` (PEM), presenting that client
    certificate too (mutual TLS). Every file is checked as :func:`client_context` and :func:`server_context` do."""
    context = client_context(ca)
    if not cert:
        return grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"))
    _load_pair(context, cert, key)
    return grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"),
                                        private_key=_read(key, "key"), certificate_chain=_read(cert, "certificate"))
