"""HTTP plumbing of `megaopd serve` (stdlib only): a threaded server with a listen backlog, a request handler
over a routes table that enforces the API key and the request limits, and the errors an endpoint raises to
answer with a status other than 200.

    routes = {("POST", "/generate"): lambda req: (200, answer), ...}   # req: the parsed JSON body or None
    httpd = HttpServer((host, port), make_handler(routes, HttpLimits(api_key=key)), backlog=1024)

An endpoint returns (status, body): a str body goes as text/plain, anything else as JSON. It may raise
BadRequest (HTTP 400 with SGLang's body for the error's kind), HttpError (any status and body),
ValueError / TypeError / KeyError / OverflowError (HTTP 400 naming the error); anything else answers 500
and is logged, so a server answers rather than dies. An unknown path answers 404, a known path with another
method 405, as SGLang's FastAPI does.

Before any endpoint runs (in this order, each refusal answered and the connection closed):
  - the key: with HttpLimits.api_key set, a request without `Authorization: Bearer <key>` answers 401
    {"error": "Unauthorized"} (SGLang's answer), except the open /health* paths (serving.access);
  - the body: Content-Length must be a non-negative integer (400), at most max_body_bytes (413, before a
    byte of it is read); a chunked body (no Content-Length) answers 411;
  - every socket read and write times out after socket_timeout_s, so a client that stops sending (a
    Content-Length larger than what it sends) frees its thread instead of holding it forever.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from megaopd.rollout.schema import BadRequest
from megaopd.serving.access import OPEN_PREFIXES, authorized

log = logging.getLogger("megaopd.serve")

Route = Callable[[Any], tuple[int, Any]]


class HttpError(Exception):
    """Answer with this status and body (e.g. 503 while the model loads)."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


@dataclass(frozen=True)
class HttpLimits:
    """What the handler enforces before an endpoint runs (module docstring)."""

    api_key: str | None = field(default=None, repr=False)
    """The key clients must send (None: none needed; then the server binds loopback only, ServeConfig)."""
    max_body_bytes: int = 64 << 20
    socket_timeout_s: float = 60.0
    drain_s: float = 5.0
    """After a refusal sent before the body was read, how long to read and discard what the client still
    sends: a client writes its whole body before it reads the answer, and a socket closed on unread data
    resets the connection, so the client would see a reset instead of the 413 / 401."""


class HttpServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog of `backlog` (the stdlib's is 5: a burst of the trainer's
    concurrent requests overflowed it and connections were reset), one daemon thread per connection."""

    daemon_threads = True

    def __init__(self, address, handler, backlog: int = 1024):
        self.request_queue_size = backlog  # read by server_activate, inside TCPServer.__init__
        super().__init__(address, handler)


class _Refused(Exception):
    """The request is answered `status` before its body is read, and the connection closed after reading
    and discarding up to `drain` bytes of it (HttpLimits.drain_s)."""

    def __init__(self, status: int, message: str, drain: int = 0):
        super().__init__(message)
        self.status, self.drain = status, drain

    def body(self) -> dict:
        return {"error": {"message": str(self)}}


def require(req: Any, keys) -> None:
    """BadRequest (SGLang's schema error) unless the body is an object holding every key."""
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object", kind="schema")
    missing = [k for k in keys if k not in req]
    if missing:
        raise BadRequest(f"missing required field(s) {missing}", kind="schema")


def make_handler(
    routes: dict[tuple[str, str], Route], limits: HttpLimits = HttpLimits()
) -> type[BaseHTTPRequestHandler]:
    """A request handler class serving `routes` ((method, path) -> endpoint) under `limits`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses connections
        timeout = limits.socket_timeout_s  # StreamRequestHandler.setup applies it to the socket

        def log_message(self, fmt, *args):  # route the access log through logging (quiet by default)
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, body: Any, headers: dict[str, str] | None = None):
            if isinstance(body, str):
                data, ctype = body.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self, status: int, body: Any, drain: int, headers: dict[str, str] | None = None):
            """Answers before the body was read, then closes the connection (what is left of the body would
            be read as the next request)."""
            self.close_connection = True
            self._send(status, body, {"Connection": "close", **(headers or {})})
            deadline = time.monotonic() + limits.drain_s
            try:
                while drain > 0 and time.monotonic() < deadline:
                    self.connection.settimeout(max(0.05, deadline - time.monotonic()))
                    chunk = self.rfile.read1(min(drain, 1 << 16))
                    if not chunk:
                        break
                    drain -= len(chunk)
            except OSError:  # the client gave up or reset: nothing more to do for it
                pass

        def _length(self) -> int:
            """The declared body length; _Refused for a missing, malformed, negative or too large one."""
            if self.headers.get("Transfer-Encoding"):
                raise _Refused(411, "send the body with a Content-Length (chunked bodies are not supported)")
            values = set(self.headers.get_all("Content-Length") or [])
            if not values:
                return 0
            text = values.pop().strip()
            if values or not re.fullmatch(r"[0-9]{1,20}", text):
                raise _Refused(
                    400, f"Content-Length {self.headers.get('Content-Length')!r} must be one non-negative integer"
                )
            length = int(text)
            if length > limits.max_body_bytes:
                raise _Refused(
                    413,
                    f"the request body of {length} bytes is over this server's limit of "
                    f"{limits.max_body_bytes} bytes (megaopd serve --max-body-mb); send fewer "
                    "rows per request",
                    drain=length,
                )
            return length

        def _dispatch(self, method: str):
            path = self.path.split("?", 1)[0]
            try:
                length, refused = self._length(), None
            except _Refused as e:
                length, refused = e.drain, e
            # The key first: a client without it learns nothing, not even the limits.
            if not path.startswith(OPEN_PREFIXES) and not authorized(self.headers.get("Authorization"), limits.api_key):
                return self._refuse(401, {"error": "Unauthorized"}, length, {"WWW-Authenticate": "Bearer"})
            if refused is not None:
                return self._refuse(refused.status, refused.body(), refused.drain)
            raw = self.rfile.read(length) if length else b""  # TimeoutError: handle_one_request closes
            if len(raw) < length:
                self.close_connection = True  # the client closed before sending it all: nobody to answer
                return
            fn = routes.get((method, path))
            if fn is None:
                known = any(p == path for _, p in routes)
                return self._send(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            try:
                req = json.loads(raw) if raw.strip() else None
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                return self._send(400, BadRequest(f"JSON decode error: {e}", kind="schema").body())
            try:
                status, body = fn(req)
            except BadRequest as e:
                status, body = 400, e.body()
            except HttpError as e:
                status, body = e.status, e.body
            except (ValueError, TypeError, KeyError, OverflowError) as e:
                status, body = 400, {"error": {"message": f"{type(e).__name__}: {e}"}}
            except Exception as e:  # noqa: BLE001 - a server must answer, not die
                log.exception("megaopd serve: %s %s failed", method, path)
                status, body = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            self._send(status, body)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

    return Handler
