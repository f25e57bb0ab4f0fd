"""Who is calling, and which keys they may name: tokens, identities, tenant masks (docs/security.md).

The auth file (JSON; ``auth_file`` in the master's and every node's config)::

    {"secret": "<hex, at least 16 bytes, the same on master and nodes>",
     "node_tokens": ["<token>", ...],
     "clients": {"<token>": {"tenant": "a", "quota_bytes": 0}, ...}}

Invariants:
- Auth is off (no file): every call is allowed, :func:`caller` is None and
  keys are stored exactly as sent. With a file every call but the standard
  health service must present a known token (gRPC metadata
  ``authorization: Bearer <token>``; fast calls and bulk: the connection's
  first frame); tokens are compared with :func:`hmac.compare_digest`.
- A node token may call only the node-facing methods (:data:`NODE_METHODS`)
  and the informational ones (:data:`ANY_ROLE_METHODS`); the master token
  (:meth:`Authority.master_token`, derived from the secret: only masters
  hold it) only a warm standby's (:data:`MASTER_METHODS`: the whole index,
  every tenant's keys) and the informational ones; a client token
  everything else. The wrong role is PERMISSION_DENIED, no or an unknown
  token UNAUTHENTICATED.
- Tenant isolation is the server's doing: every key a client names is
  mapped to its *stored key* ``(key & KEEP) ^ mask(tenant)`` before it
  touches an index or a store, with ``mask = sha256(domain || secret || tenant)``.
  The mask's last 4 bytes replace the key's last 4 bytes: they are the
  tenant's *tag*, unique per tenant (checked when the file is read), so two
  tenants' stored keys can never be equal, whatever keys they send. The
  tag also tells a node whose block a stored key is (quotas), with no
  extra state to persist.
- A client learns its own mask (to check arena rows on the same-host path)
  and nothing else; the secret never leaves master and nodes.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np

from kvpool.config import parse_size, read_json_object
from kvpool.keys import KEY_BYTES

MASK_BYTES = KEY_BYTES
TAG_BYTES = 4  # the last bytes of a stored key: the tenant's tag
MAX_TOKEN_BYTES = 512
ROLE_NODE = "node"
ROLE_CLIENT = "client"
ROLE_MASTER = "master"
_MASTER_TOKEN_LABEL = b"kvpool.v1/master-token"
_TOKEN_RE = re.compile(r"^[\x21-\x7e]{16,512}$")  # printable ASCII, no spaces: valid in gRPC metadata
_TENANT_RE = re.compile(r"^[\x21-\x7e]{1,128}$")
_MASK_TAG = b"kvpool.v1/tenant-mask\x00"
_KEEP = np.array([0xFF] * (KEY_BYTES - TAG_BYTES) + [0] * TAG_BYTES, dtype=np.uint8)
TOKEN_HINT = "generate one with: python -c 'import secrets;print(secrets.token_hex(32))'"

NODE_METHODS = frozenset(
    f"/kvpool.v1.Master/{m}" for m in ("RegisterNode", "Heartbeat", "ReportBlocks", "UnregisterNode")
)
MASTER_METHODS = frozenset(f"/kvpool.v1.Master/{m}" for m in ("Follow", "Snapshot"))
ANY_ROLE_METHODS = frozenset({"/kvpool.v1.Master/Info", "/kvpool.v1.Master/ClusterStatus", "/kvpool.v1.Node/Info"})
OPEN_PREFIX = "/grpc.health.v1.Health/"  # liveness probes carry no token


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller: a node, or a client of one tenant (``mask``: its 32-byte tenant mask)."""

    role: str
    tenant: str = ""
    mask: bytes = b""
    quota_bytes: int = 0


# -- masks --------------------------------------------------------------------------------------------


def tenant_mask(secret: bytes, tenant: str) -> bytes:
    """The 32-byte mask of ``tenant`` under ``secret`` (its last :data:`TAG_BYTES` are the tenant's tag)."""
    return hashlib.sha256(_MASK_TAG + secret + tenant.encode()).digest()


def mask_keys(packed: bytes, mask: bytes) -> bytes:
    """Stored keys of packed client keys: ``(key & KEEP) ^ mask`` each; ``mask`` b"": unchanged.

    ValueError if ``packed`` is not a whole number of keys or the mask is not 32 bytes.
    """
    if not mask:
        return packed
    if len(mask) != MASK_BYTES:
        raise ValueError(f"a tenant mask is {MASK_BYTES} bytes, got {len(mask)}")
    if len(packed) % KEY_BYTES:
        raise ValueError(f"packed keys: {len(packed)} bytes is not a multiple of {KEY_BYTES}")
    keys = np.frombuffer(packed, dtype=np.uint8).reshape(-1, KEY_BYTES)
    return ((keys & _KEEP) ^ np.frombuffer(mask, dtype=np.uint8)).tobytes()


def tag_of(stored_key: bytes) -> bytes:
    """The tenant tag a stored key carries (meaningful only for keys stored with auth on)."""
    return stored_key[KEY_BYTES - TAG_BYTES :]


# -- the caller of the call being served ------------------------------------------------------------

_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvpool_caller", default=None)


def caller() -> Identity | None:
    """Who made the call this thread is serving (None: auth is off, or not inside a call)."""
    return _CALLER.get()


@contextlib.contextmanager
def acting_as(identity: Identity | None) -> Iterator[None]:
    """Serve a call on behalf of ``identity`` (both transports wrap each servicer call in this)."""
    token = _CALLER.set(identity)
    try:
        yield
    finally:
        _CALLER.reset(token)


def caller_keys(packed: bytes) -> bytes:
    """The stored keys of packed keys the current caller named (unchanged unless a client of a tenant)."""
    who = _CALLER.get()
    return mask_keys(packed, who.mask) if who is not None else packed


def caller_tenant() -> str:
    """The current caller's tenant ("" when auth is off or the caller is a node)."""
    who = _CALLER.get()
    return who.tenant if who is not None else ""


# -- the auth file ------------------------------------------------------------------------------------


class Authority:
    """The tokens, tenants, masks and quotas of one auth file (immutable; thread-safe)."""

    def __init__(self, secret: bytes, node_tokens: Sequence[str], clients: Mapping[str, tuple[str, int]]):
        if len(secret) < 16:
            raise ValueError("auth: the secret must be at least 16 bytes (32 hex digits)")
        for token in [*node_tokens, *clients]:
            if not isinstance(token, str) or not _TOKEN_RE.match(token):
                raise ValueError(f"auth: a token must be 16-512 printable ASCII characters with no spaces; "
                                 f"{TOKEN_HINT}")
        if len(set(node_tokens)) != len(node_tokens) or set(node_tokens) & set(clients):
            raise ValueError("auth: every token must be unique (a token is a node's or one client's)")
        quotas: dict[str, int] = {}
        for tenant, quota in clients.values():
            if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
                raise ValueError(f"auth: tenant {tenant!r} must be 1-128 printable ASCII characters")
            if quotas.setdefault(tenant, quota) != quota:
                raise ValueError(f"auth: tenant {tenant!r} has two different quota_bytes")
        self._secret = secret
        self._masks = {t: tenant_mask(secret, t) for t in quotas}
        tags: dict[bytes, str] = {}
        for tenant, mask in self._masks.items():
            other = tags.setdefault(tag_of(mask), tenant)
            if other != tenant:  # ~n^2 / 2^33: practically never, but isolation must not depend on luck
                raise ValueError(f"auth: tenants {other!r} and {tenant!r} share a tag; rename one")
        self._by_tag = tags
        self.quotas: dict[str, int] = {t: q for t, q in quotas.items() if q > 0}
        tokens = [(t.encode(), Identity(ROLE_NODE)) for t in node_tokens]
        tokens += [(t.encode(), Identity(ROLE_CLIENT, tenant, self._masks[tenant], quota))
                   for t, (tenant, quota) in clients.items()]
        tokens.append((self.master_token().encode(), Identity(ROLE_MASTER)))
        # Found by the sha256 of the token (a lookup whose timing says nothing usable about the token),
        # then confirmed with a constant-time comparison.
        self._tokens = {hashlib.sha256(t).digest(): (t, identity) for t, identity in tokens}

    @classmethod
    def load(cls, path: str) -> Authority:
        """Read an auth file; ValueError naming the problem if it is unreadable or malformed."""
        data = read_json_object(path, "auth file")
        unknown = sorted(set(data) - {"secret", "node_tokens", "clients"})
        if unknown:
            raise ValueError(f"auth file {path}: unknown field(s) {', '.join(unknown)}")
        try:
            secret = bytes.fromhex(str(data.get("secret", "")))
        except ValueError:
            raise ValueError(f"auth file {path}: secret must be hex digits") from None
        nodes = data.get("node_tokens", [])
        clients_in = data.get("clients", {})
        if not isinstance(nodes, list) or not isinstance(clients_in, dict):
            raise ValueError(f"auth file {path}: node_tokens must be a list and clients an object")
        clients: dict[str, tuple[str, int]] = {}
        for token, entry in clients_in.items():
            if not isinstance(entry, dict) or set(entry) - {"tenant", "quota_bytes"} or "tenant" not in entry:
                raise ValueError(f"auth file {path}: each client is {{\"tenant\": ..., \"quota_bytes\": ...}}")
            try:
                quota = parse_size(entry.get("quota_bytes", 0))
            except ValueError as exc:
                raise ValueError(f"auth file {path}: quota_bytes of tenant {entry['tenant']!r}: {exc}") from None
            clients[token] = (entry["tenant"], quota)
        try:
            return cls(secret, nodes, clients)
        except ValueError as exc:
            raise ValueError(f"auth file {path}: {exc}") from None

    def authenticate(self, token: str | bytes | None) -> Identity | None:
        """The identity a token stands for, or None (confirmed with :func:`hmac.compare_digest`)."""
        if not token:
            return None
        given = token.encode("utf-8", "replace") if isinstance(token, str) else bytes(token)
        entry = self._tokens.get(hashlib.sha256(given).digest())
        if entry is None or not hmac.compare_digest(entry[0], given):
            return None
        return entry[1]

    def node_token(self) -> str | None:
        """One of the node tokens (for ``kvpool serve``, whose node talks to its own master), or None."""
        for known, identity in self._tokens.values():
            if identity.role == ROLE_NODE:
                return known.decode()
        return None

    def master_token(self) -> str:
        """The token masters of this auth file call each other with (a warm standby following its leader):
        derived from the secret, so only holders of the secret (masters and nodes) can make it."""
        return self.derive(_MASTER_TOKEN_LABEL).hex()

    def mask(self, tenant: str) -> bytes:
        """The mask of a tenant named in the file; KeyError otherwise."""
        return self._masks[tenant]

    def tenant_of(self, stored_key: bytes) -> str | None:
        """The tenant whose client stored this key (by its tag), or None (not a tenant's key)."""
        return self._by_tag.get(tag_of(stored_key))

    @property
    def tenants(self) -> list[str]:
        """Every tenant some client token of the file belongs to, sorted."""
        return sorted(self._masks)

    def client_tokens(self) -> list[tuple[str, str]]:
        """(token, tenant) of every client token (the KV event ports derive each one's CURVE key)."""
        return sorted((known.decode(), identity.tenant) for known, identity in self._tokens.values()
                      if identity.role == ROLE_CLIENT)

    def derive(self, label: bytes) -> bytes:
        """32 bytes derived from the secret for one purpose (``label``), e.g. the KV event ports' CURVE key;
        the secret itself never leaves this object."""
        return hashlib.sha256(label + b"\x00" + self._secret).digest()


def load_authority(path: str) -> Authority | None:
    """The auth file at ``path``, or None for "" (auth off)."""
    return Authority.load(path) if path else None


# -- access rules ---------------------------------------------------------------------------------------


def denied(identity: Identity | None, method: str) -> tuple[grpc.StatusCode, str] | None:
    """Why ``identity`` may not call the full gRPC ``method`` name (None: it may), with auth on."""
    if method.startswith(OPEN_PREFIX):
        return None
    if identity is None:
        return grpc.StatusCode.UNAUTHENTICATED, f"{method}: no valid token (send authorization: Bearer <token>)"
    if method in ANY_ROLE_METHODS:
        return None
    need = ROLE_NODE if method in NODE_METHODS else ROLE_MASTER if method in MASTER_METHODS else ROLE_CLIENT
    if identity.role != need:
        return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs a {need} token"
    return None


def token_from_metadata(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The bearer token in gRPC metadata (``authorization: Bearer <token>``), or None."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call's bearer token against an :class:`Authority` and serves it as its caller.

    Refusals are UNAUTHENTICATED / PERMISSION_DENIED before the servicer runs
    (counted through ``on_refused(kind)``); an allowed call runs inside
    :func:`acting_as`, so servicers read :func:`caller` whatever the transport.
    """

    def __init__(self, authority: Authority, on_refused: Callable[[str], None] | None = None):
        self._authority = authority
        self._on_refused = on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        # Any: one interceptor serves every method, each with request and reply messages of its own.
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIX):
            return handler
        identity = self._authority.authenticate(token_from_metadata(handler_call_details.invocation_metadata))
        refusal = denied(identity, method)
        if refusal is not None:
            code, details = refusal
            if self._on_refused is not None:
                self._on_refused(code.name.lower())

            def refuse(request: Any, context: grpc.ServicerContext) -> NoReturn:
                context.abort(code, details)

            return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=lambda raw: raw)
        if handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def as_caller(request: Any, context: grpc.ServicerContext) -> Any:
            with acting_as(identity):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            as_caller, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# -- the client side ----------------------------------------------------------------------------------


_Request = TypeVar("_Request")
_Call = TypeVar("_Call")  # what the channel returns for a call: a grpc.Call that is also a grpc.Future


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every unary call of a channel."""

    def __init__(self, token: str):
        if not _TOKEN_RE.match(token):
            raise ValueError(f"a token must be 16-512 printable ASCII characters with no spaces; {TOKEN_HINT}")
        self._entry = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, _Request], _Call],
        client_call_details: grpc.ClientCallDetails,
        request: _Request,
    ) -> _Call:
        metadata = (*(client_call_details.metadata or ()), self._entry)
        details = _CallDetails(client_call_details.method, client_call_details.timeout, metadata,
                               client_call_details.credentials, getattr(client_call_details, "wait_for_ready", None),
                               getattr(client_call_details, "compression", None))
        return continuation(details, request)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: tuple[tuple[str, str | bytes], ...] | None,
                 credentials: grpc.CallCredentials | None, wait_for_ready: bool | None,
                 compression: grpc.Compression | None):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


class Peer:
    """One wire connection's authentication state (:mod:`kvpool.wire`).

    With an authority, nothing but the AUTH frame is served until a token was
    accepted (:meth:`login`); without one, everything is (auth off).
    """

    __slots__ = ("authority", "identity")

    def __init__(self, authority: Authority | None):
        self.authority = authority
        self.identity: Identity | None = None

    @property
    def needs_auth(self) -> bool:
        return self.authority is not None and self.identity is None

    def login(self, token: bytes | str) -> bool:
        """Take the token of an AUTH frame; False: unknown token (the listener then closes the connection)."""
        if self.authority is None:
            return True
        self.identity = self.authority.authenticate(token)
        return self.identity is not None

    def denied(self, method: str) -> tuple[grpc.StatusCode, str] | None:
        """Why this connection may not call ``method`` (see :func:`denied`); None with auth off."""
        return None if self.authority is None else denied(self.identity, method)

    def keys(self, packed: bytes) -> bytes:
        """Stored keys of packed keys this connection's client named."""
        return mask_keys(packed, self.identity.mask) if self.identity is not None else packed

    @property
    def tenant(self) -> str:
        return self.identity.tenant if self.identity is not None else ""
