"""gRPC plumbing shared by the master, the node and the client: one place for each decision.

- :class:`ErrorInterceptor` maps domain errors to status codes for every
  servicer: an undecodable request or a ValueError -> INVALID_ARGUMENT (with
  the message), anything else unexpected -> INTERNAL (logged with its
  traceback). Servicers just raise.
- :func:`make_server` builds a server with the standard health service (and,
  configured, token checks and TLS); :func:`make_channel` the matching client channel.
  A port it cannot listen on (taken, bad address) is a one-line ValueError
  naming the address, and nothing of the server is left running.
- Per-block flags and tiers travel as one byte per block (:func:`tier_bytes`).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, Protocol, cast

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvpool.auth import AuthInterceptor, Authority, BearerInterceptor
from kvpool.tls import channel_credentials, check_pair, server_credentials
from kvpool.v1 import common_pb2
from kvpool.vocabulary import NO_TIER, Tier, TierStats

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for both ends of a channel that carries up to ``max_message_bytes`` per message."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


class _StatusOf(Protocol):
    """``grpc.ServicerContext.code()``: in grpcio (an experimental API), not declared by types-grpcio."""

    def code(self) -> grpc.StatusCode | None: ...


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions raised by servicers into gRPC statuses (see module docstring)."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        # Any: one interceptor serves every method, each with request and reply messages of its own.
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method
        deserialize = handler.request_deserializer

        def guarded(raw: bytes, context: grpc.ServicerContext) -> Any:
            # Decode here, not in gRPC: its own decode failure is INTERNAL ("Exception deserializing request!").
            try:
                request = raw if deserialize is None else deserialize(raw)
            except Exception as exc:  # noqa: BLE001 - DecodeError, or ValueError for invalid UTF-8
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: undecodable request: {exc}")
            try:
                return inner(request, context)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # the one place that turns bugs into INTERNAL
                if cast(_StatusOf, context).code() is not None:  # the servicer aborted with a status of its own
                    raise
                log.exception("%s failed", method)
                context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=None, response_serializer=handler.response_serializer
        )


def _split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` / ``[v6]:port``, or None if it is not that shape."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def port_taken(address: str) -> bool:
    """Whether listening on ``address`` would fail because its port is in use (checked as gRPC binds).

    gRPC binds every address ``host`` resolves to and succeeds if one binds,
    with SO_REUSEADDR and (for IPv6) dual-stack sockets: taken means no
    address binds and at least one failed with EADDRINUSE. Port 0 is never taken.
    """
    parts = _split_address(address)
    if parts is None or parts[1] == 0:
        return False
    host, port = parts
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # gRPC will say what is wrong with the name
    in_use = False
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind(where)
            except OSError as exc:
                in_use = in_use or exc.errno == errno.EADDRINUSE
                continue
        return False
    return in_use


class StatusError(grpc.RpcError):
    """A failure that is not a gRPC call's own but reads like one: ``code()`` and ``details()`` (callers handle
    every transport's failures as ``grpc.RpcError``)."""

    def __init__(self, code: grpc.StatusCode, details: str, message: str | None = None):
        super().__init__(details if message is None else message)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def make_server(
    address: str,
    register: Sequence[Callable[[grpc.Server], str]],
    *,
    max_message_bytes: int,
    workers: int = 16,
    authority: Authority | None = None,
    on_refused: Callable[[str], None] | None = None,
    tls_cert: str = "",
    tls_key: str = "",
    max_concurrent_rpcs: int = 0,
    name: str = "gRPC server",
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started-ready (not yet started) server on ``address`` with the health service.

    Each ``register`` callable adds one servicer and returns its full service
    name, which the health service reports SERVING once started. Returns the
    server, the bound port (``address`` may say port 0) and the health servicer.
    With ``authority`` every call but the health service's needs a token
    (:class:`kvpool.auth.AuthInterceptor`; refusals counted via ``on_refused``);
    with ``tls_cert``/``tls_key`` the port speaks TLS only; past
    ``max_concurrent_rpcs`` calls in flight (0: no limit) gRPC answers RESOURCE_EXHAUSTED.
    A port in use, or an address gRPC cannot bind, is a ValueError ("``name``
    cannot listen on ...", one line), checked before gRPC logs its own error.
    """
    interceptors: list[grpc.ServerInterceptor] = [ErrorInterceptor()]
    if authority is not None:
        interceptors.insert(0, AuthInterceptor(authority, on_refused))
    if max_concurrent_rpcs < 0:
        raise ValueError(f"max_concurrent_rpcs must be >= 0, got {max_concurrent_rpcs}")
    if port_taken(address):
        raise ValueError(f"{name} cannot listen on {address}: the port is already in use")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers),
        interceptors=interceptors,
        options=channel_options(max_message_bytes),
        maximum_concurrent_rpcs=max_concurrent_rpcs or None,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        names = [add(server) for add in register]
        if check_pair(tls_cert, tls_key, f"server on {address}"):
            port = server.add_secure_port(address, server_credentials(tls_cert, tls_key))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # gRPC's "Failed to bind": taken since we looked, or an address it cannot bind
        port = 0
    except BaseException:
        server.stop(None)
        raise
    if port == 0:
        server.stop(None)
        taken = " (the port is in use)" if port_taken(address) else ""
        raise ValueError(f"{name} cannot listen on {address}{taken}")
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def make_channel(address: str, *, max_message_bytes: int, token: str = "", tls_ca: str = "",
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to ``address``: TLS verified against ``tls_ca`` if given, ``token`` sent as a bearer token if given."""
    opts = channel_options(max_message_bytes) + list(options)
    if tls_ca:
        channel = grpc.secure_channel(address, channel_credentials(tls_ca), options=opts)
    else:
        channel = grpc.insecure_channel(address, options=opts)
    return grpc.intercept_channel(channel, BearerInterceptor(token)) if token else channel


def tier_bytes(tiers: Sequence[Tier | None]) -> bytes:
    """One byte per block: the tier value, or NO_TIER."""
    return bytes(NO_TIER if t is None else int(t) for t in tiers)


def flag_bytes(flags: Sequence[bool] | np.ndarray) -> bytes:
    """One byte a flag, 1 or 0 (a numpy array of any dtype, or any sequence of truthy values)."""
    if isinstance(flags, np.ndarray):
        return flags.astype(bool).tobytes()
    return bytes(map(bool, flags))


def flags_from_bytes(data: bytes) -> list[bool]:
    return list(map(bool, data))


def proto_tier(tier: Tier) -> common_pb2.Tier:
    """``tier`` as the wire enum ``kvpool.v1.Tier`` (the same numbers: see common.proto).

    The generated stubs type an enum field as its enum class; at run time that
    class is an ``EnumTypeWrapper`` (no constructor) and the field takes any int.
    """
    return cast("common_pb2.Tier", int(tier))


def tier_usage(stats: TierStats) -> common_pb2.TierUsage:
    return common_pb2.TierUsage(
        tier=proto_tier(stats.tier), capacity_bytes=stats.capacity_bytes, used_bytes=stats.used_bytes,
        blocks=stats.blocks,
    )


def local_host_id() -> str:
    """Hostname plus boot id: two processes share /dev/shm iff their host ids are equal."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
