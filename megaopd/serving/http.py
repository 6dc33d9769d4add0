"""HTTP plumbing of `megaopd serve` (stdlib only): a request handler over a routes table, and the errors
an endpoint raises to answer with a status other than 200.

    routes = {("POST", "/generate"): lambda req: (200, answer), ...}   # req: the parsed JSON body or None
    httpd = ThreadingHTTPServer((host, port), make_handler(routes))

An endpoint returns (status, body): a str body goes as text/plain, anything else as JSON. It may raise
BadRequest (HTTP 400 with SGLang's body for the error's kind), HttpError (any status and body),
ValueError / TypeError / KeyError (HTTP 400 naming the error); anything else answers 500 and is logged,
so a server answers rather than dies. An unknown path answers 404, a known path with another method 405,
as SGLang's FastAPI does.
"""
from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

from megaopd.rollout.schema import BadRequest

log = logging.getLogger("megaopd.serve")

Route = Callable[[Any], tuple[int, Any]]


class HttpError(Exception):
    """Answer with this status and body (e.g. 503 while the model loads)."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


def require(req: Any, keys) -> None:
    """BadRequest (SGLang's schema error) unless the body is an object holding every key."""
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object", kind="schema")
    missing = [k for k in keys if k not in req]
    if missing:
        raise BadRequest(f"missing required field(s) {missing}", kind="schema")


def make_handler(routes: dict[tuple[str, str], Route]) -> type[BaseHTTPRequestHandler]:
    """A request handler class serving `routes` ((method, path) -> endpoint)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the client reuses connections

        def log_message(self, fmt, *args):  # route the access log through logging (quiet by default)
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, body: Any):
            if isinstance(body, str):
                data, ctype = body.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _dispatch(self, method: str):
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            fn = routes.get((method, path))
            if fn is None:
                known = any(p == path for _, p in routes)
                return self._send(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            try:
                req = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError as e:
                return self._send(400, BadRequest(f"JSON decode error: {e}", kind="schema").body())
            try:
                status, body = fn(req)
            except BadRequest as e:
                status, body = 400, e.body()
            except HttpError as e:
                status, body = e.status, e.body
            except (ValueError, TypeError, KeyError) as e:
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
