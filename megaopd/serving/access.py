"""Who may ask `megaopd serve` for what: the API key, the interfaces it may bind without one, the folders
weights may be loaded from, the hosts a weight-update group may be formed with.

    check_bind(host, api_key)                      # ValueError unless loopback or a key is set
    authorized(request.headers.get("Authorization"), key)
    roots = WeightRoots([hf_dir, *extra]);  roots.check(path)          # AccessDenied (HTTP 403) outside them
    hosts = SyncHosts(["127.0.0.1", *extra]);  ip = hosts.check(addr)  # the address to connect to, resolved once

The key is SGLang's: clients send `Authorization: Bearer <key>`, compared in constant time, and every
endpoint but /health* and /ready (SGLang 0.5.23 leaves /health, /health_generate and /ready open for liveness
probes, as here)
answers 401 {"error": "Unauthorized"} without it. megaopd's clients read the key from the environment
variable API_KEY_ENV (or the one rollout.api_key_env / teacher.api_key_env names), never from a config file.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket

API_KEY_ENV = "MEGAOPD_API_KEY"
"""The environment variable `megaopd serve` reads its key from when --api-key is not given, and megaopd's
clients read the key they send from (by default)."""

OPEN_PREFIXES = ("/health", "/ready")
"""Paths answered without a key: SGLang's middleware leaves /health* and /ready* (and /metrics, which megaopd
serve does not have) open so probes need no secret. They say only whether the model is loaded (and, /ready,
whether generation is paused)."""


class AccessDenied(Exception):
    """A request for something this server is not allowed to do (HTTP 403); the message says which flag
    allows it."""


def check_key(key: str | None) -> None:
    """ValueError for a key that cannot travel in an HTTP header (empty, or not printable ASCII)."""
    if key is None:
        return
    if not key or not key.isascii() or not key.isprintable() or key != key.strip():
        raise ValueError(
            "the API key must be non-empty printable ASCII without leading or trailing spaces "
            f"(it travels as `Authorization: Bearer <key>`); set --api-key or {API_KEY_ENV} to such a key"
        )


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.0/8, ::1)."""
    try:
        return all(ipaddress.ip_address(ip).is_loopback for ip in resolve(host))
    except (OSError, ValueError):
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """ValueError unless `host` is loopback or a key is set: without a key anyone who reaches the port can
    replace the weights, load any folder the server may read, and pause generation."""
    if api_key is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} without an API key would let anyone on the network replace the weights: "
            f"set {API_KEY_ENV}=<key> (or --api-key <key>) and give the trainer the same key, or bind "
            "127.0.0.1"
        )


def authorized(header: str | None, key: str | None) -> bool:
    """Whether an Authorization header carries `key` (always, when no key is set). Constant time in the key."""
    if key is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    # Compared as bytes: compare_digest refuses non-ASCII str, and a header may hold any latin-1 text.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1", "replace"), key.encode())


def resolve(host: str) -> set[str]:
    """The IP addresses `host` (a name or an address) resolves to; OSError when it resolves to none."""
    return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}


class WeightRoots:
    """Folders /update_weights_from_disk may read (and everything under them), symlinks and `..` resolved."""

    def __init__(self, roots: list[str]):
        self.roots = [os.path.realpath(r) for r in roots]

    def check(self, path: str) -> str:
        """The resolved path; AccessDenied unless it lies under a root."""
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in self.roots):
            raise AccessDenied(
                f"model_path {path!r} is outside the folders this server may load weights from "
                f"({', '.join(self.roots)}); start megaopd serve with --allowed-weight-root <folder>"
            )
        return real


class SyncHosts:
    """Hosts /init_weights_update_group may connect to: the trainer's rank 0. Loopback by default."""

    def __init__(self, hosts: list[str]):
        self.hosts = list(hosts)
        self.ips: set[str] = set()
        for h in hosts:
            try:
                self.ips |= resolve(h)
            except OSError as e:
                raise ValueError(
                    f"--allowed-sync-host {h}: cannot resolve it ({e}); give a name or address of "
                    "the trainer's rank 0 (rollout.weight_sync_address)"
                ) from None
        self.loopback = any(ipaddress.ip_address(ip).is_loopback for ip in self.ips)

    def check(self, address: str) -> str:
        """One resolved IP of `address` to connect to (resolved here, once, so the address checked is the
        address used); AccessDenied unless every address it names is allowed."""
        try:
            ips = resolve(address)
        except OSError:
            ips = set()
        ok = ips and all(ip in self.ips or (self.loopback and ipaddress.ip_address(ip).is_loopback) for ip in ips)
        if not ok:
            raise AccessDenied(
                f"master_address {address!r} is not an allowed weight-sync host ({', '.join(self.hosts)}"
                f"); start megaopd serve with --allowed-sync-host {address} (the trainer's "
                "rollout.weight_sync_address)"
            )
        return min(ips, key=lambda ip: (ipaddress.ip_address(ip).version, ip))  # IPv4 first, as a name would
