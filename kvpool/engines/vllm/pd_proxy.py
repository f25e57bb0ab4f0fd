"""A small proxy for prefill/decode disaggregation through kvpool: vLLM's toy P/D proxy's flow, stdlib only.

    python -m kvpool.engines.vllm.pd_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --port 8000

Each ``POST /v1/completions`` or ``/v1/chat/completions`` (OpenAI bodies) is
served in two requests:

1. to a prefill instance (``kv_role: kv_producer``), the body with
   ``max_tokens`` (and ``max_completion_tokens``) 1, no streaming, and
   ``kv_transfer_params: {"do_remote_decode": true}`` (what vLLM's toy proxy
   sends; kvpool's connector needs nothing from it): it computes the prompt
   and its connector stores every full block in the pool; its reply's
   ``kv_transfer_params`` say how many tokens it stored;
2. to a decode instance (``kv_role: kv_consumer``), the client's body with
   those ``kv_transfer_params``: its connector waits for that many tokens'
   blocks (bounded: ``kvpool_handoff_timeout_ms``), loads them, and decodes.
   Its reply, streamed if the client asked, is the client's.

A prefill instance that fails or cannot be reached costs only recompute:
the body goes to the decode instance without ``kv_transfer_params`` (it
computes the prompt itself). Instances are taken round robin. Other paths
(``GET /v1/models``, ``/health``) go to a decode instance. No dependency
beyond the standard library: each request is a thread
(:class:`http.server.ThreadingHTTPServer`), each upstream call one
:mod:`http.client` connection.

Bounds on what one client can make it spend: a request body of at most
:data:`MAX_BODY_BYTES` (a larger ``Content-Length`` is refused, 413, before a
byte of it is read; a missing, negative or malformed one: 400); a client that
stalls (an idle connection, a half-sent request, a reply it does not read)
is cut after :data:`CLIENT_TIMEOUT_S` per read or write; at most
``max_connections`` connections are served at once, a newcomer past them gets
503 and the connection is closed. It listens on 127.0.0.1 unless told
otherwise (``--host``).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import sys
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
TIMEOUT_S = 600.0  # an upstream call (a long generation streams within it)
MAX_BODY_BYTES = 32 << 20  # a request body (a prompt of a few million tokens as JSON)
CLIENT_TIMEOUT_S = 30.0  # one read or write of the client's connection
MAX_CONNECTIONS = 256  # client connections served at once


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill instance gets: the prompt, one token, no streaming (step 1 of the module docstring)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
    """What the decode instance gets: the client's body with the prefill reply's ``kv_transfer_params`` (none if
    the prefill failed: the decode instance then computes the prompt)."""
    params = (prefill_reply or {}).get("kv_transfer_params")
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if isinstance(params, dict):
        out["kv_transfer_params"] = params
    return out


class Upstreams:
    """The prefill and decode instances (base URLs), each list taken round robin (thread-safe)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]):
        if not prefill or not decode:
            raise ValueError("pd_proxy: at least one --prefill and one --decode instance")
        for url in (*prefill, *decode):
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"pd_proxy: an instance is an http://host:port URL, got {url!r}")
        self._prefill = itertools.cycle(list(prefill))
        self._decode = itertools.cycle(list(decode))
        self._lock = threading.Lock()

    def next(self) -> tuple[str, str]:
        with self._lock:
            return next(self._prefill), next(self._decode)


def _open(base: str, method: str, path: str, body: bytes | None,
          headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=TIMEOUT_S)
    conn.request(method, parts.path.rstrip("/") + path, body=body, headers=headers)
    return conn, conn.getresponse()


def post_json(base: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """POST ``body`` and return the JSON reply; OSError or ValueError when it is not a 200 with JSON."""
    conn, resp = _open(base, "POST", path, json.dumps(body).encode(), headers)
    try:
        data = resp.read()
        if resp.status != 200:
            raise OSError(f"{base}{path} answered {resp.status}: {data[:200]!r}")
        reply = json.loads(data)
        if not isinstance(reply, dict):
            raise ValueError(f"{base}{path} answered {type(reply).__name__}, not an object")
        return reply
    finally:
        conn.close()


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.0"  # one request a connection: the reply ends when the connection closes
    timeout = CLIENT_TIMEOUT_S  # socket timeout of each read and write of the client's connection

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("pd_proxy: " + format, *args)

    def _headers(self) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        if self.headers.get("Authorization"):
            out["Authorization"] = self.headers["Authorization"]
        return out

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.send_error(400, "pd_proxy: a POST needs a Content-Length")
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self.send_error(413 if length > 0 else 400, f"pd_proxy: a body of {length} bytes (at most "
                            f"{MAX_BODY_BYTES})")
            return
        try:
            body = json.loads(self.rfile.read(length))
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            self.send_error(400, f"pd_proxy: {exc}")
            return
        prefill, decode = self.server.upstreams.next()
        if self.path in GENERATE_PATHS:
            try:
                reply: dict[str, Any] | None = post_json(prefill, self.path, prefill_body(body), self._headers())
            except (OSError, ValueError) as exc:
                log.warning("pd_proxy: prefill at %s failed (%s); the decode instance computes the prompt", prefill,
                            exc)
                reply = None
            body = decode_body(body, reply)
        self._relay(decode, "POST", json.dumps(body).encode())

    def do_GET(self) -> None:
        self._relay(self.server.upstreams.next()[1], "GET", None)

    def _relay(self, base: str, method: str, body: bytes | None) -> None:
        """Send the request to ``base`` and copy its reply back as it arrives (a stream stays a stream)."""
        try:
            conn, resp = _open(base, method, self.path, body, self._headers())
        except OSError as exc:
            self.send_error(502, f"pd_proxy: {base} cannot be reached ({exc})")
            return
        try:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
            self.end_headers()
            for chunk in _chunks(resp):
                self.wfile.write(chunk)
                self.wfile.flush()
        finally:
            conn.close()


def _chunks(resp: http.client.HTTPResponse) -> Iterator[bytes]:
    while chunk := resp.read1(65536):
        yield chunk


class ProxyServer(ThreadingHTTPServer):
    """The proxy (see the module docstring): ``serve_forever()``; ``server_address`` says where it listens."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], upstreams: Upstreams, max_connections: int = MAX_CONNECTIONS):
        super().__init__(address, _Handler)
        self.upstreams = upstreams
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.serving = 0  # client connections being served now

    def _serving(self, change: int) -> None:
        with self._lock:
            self.serving += change

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own, or (every slot taken) answer 503 and close it."""
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._serving(1)
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self._serving(-1)  # after the slot is free: serving == 0 means a newcomer is served


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.engines.vllm.pd_proxy",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL, "
                        "http://host:port (repeat for more)")
    parser.add_argument("--decode", action="append", required=True, help="a decode instance's base URL (repeat)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; "
                        "0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        server = ProxyServer((args.host, args.port), Upstreams(args.prefill, args.decode))
    except (ValueError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2
    log.info("pd_proxy: listening on %s:%d; prefill %s, decode %s", args.host, server.server_address[1],
             ", ".join(args.prefill), ", ".join(args.decode))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
