"""Middlewares: Host check (DNS rebinding), Origin check, who may talk (the daemon's own
OS user, or the bearer token), whose prompt cache a request uses, errors."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from specd.ort_models.paths import privacy_problem

from .jsonout import json_response
from .peer import tcp_peer_uid, unix_peer_uid
from .validation import BadRequest

if TYPE_CHECKING:
    from aiohttp.typedefs import Middleware

log = logging.getLogger("specd.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"}
IDENTITY = web.RequestKey("identity", str)  # whose request: see request_identity()
# an error's JSON body in a dialect's shape: (status, message, code, param) -> body
ErrorShape = Callable[[int, str, str, str | None], dict[str, Any]]
ERROR_SHAPE: web.RequestKey[ErrorShape] = web.RequestKey("error_shape")  # not OpenAI's


@dataclass(frozen=True)
class Access:
    """Who may use the TCP port (the Unix socket is its owner's, by its mode)."""

    # the bearer token: admits whoever presents it (None, an app built without one as
    # tests build it: a peer the kernel does not name is admitted, there being nothing
    # to ask it for; `specd serve` always has one)
    token: str | None = None
    # keys of the owner's choosing (llama-server's --api-key), admitted as the token is
    api_keys: frozenset[str] = frozenset()
    require_token: bool = False  # every TCP client needs it (non-loopback, --require-token)
    # loopback TCP admits every local OS user without the token (--allow-other-users);
    # else only the daemon's own user, as the kernel names the peer (Linux)
    other_users: bool = False
    # Host header values accepted beyond loopback names (the bound and machine addresses)
    hosts: frozenset[str] = field(default_factory=frozenset)


def openai_error(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """An error body as OpenAI's API (and llama-server) send it."""
    etype = {400: "invalid_request_error", 401: "authentication_error",
             403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
             413: "invalid_request_error", 503: "server_busy"}.get(status, "server_error")
    return {"error": {"message": message, "type": etype,
                      "code": code if status in (400, 404) else etype, "param": param}}


def error_response(status: int, message: str, *, code: str = "invalid_request_error",
                   param: str | None = None, request: web.Request | None = None
                   ) -> web.Response:
    """An error in the shape of the request's dialect (OpenAI's unless its route set
    another, see make_middlewares' `error_shapes`)."""
    shape = openai_error if request is None else request.get(ERROR_SHAPE, openai_error)
    return json_response(shape(status, message, code, param), status=status)


def host_name(host: str) -> str:
    """A Host header's name or address, without its port or IPv6 brackets."""
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:port
        return name[1:].split("]", 1)[0]
    if name.count(":") == 1:
        return name.rsplit(":", 1)[0]
    return name


def is_loopback_host(host: str | None) -> bool:
    if not host:
        return False
    name = host_name(host)
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _via_unix_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and getattr(sock, "family", None) == socket.AF_UNIX


class TokenFileError(ValueError):
    pass


def load_or_create_token(path: Path) -> str:
    """The bearer token, generated once into a 0600 file. An existing file must be this
    user's, private and not empty: anything else is refused, not used as it is."""
    if path.is_file():
        return _read_private_token(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _read_private_token(path: Path) -> str:
    if problem := privacy_problem(path.stat()):
        fix = f"`chmod 600 {path}` if nobody else has read it, else " if (
            problem.chmod_fixes) else ""
        raise TokenFileError(f"the token file {path} {problem.text}: {fix}delete it (a new "
                             "token is then generated)")
    token = path.read_text().strip()
    if not token:
        raise TokenFileError(f"the token file {path} is empty: write a token in it or "
                             "delete it (a new token is then generated)")
    return token


def read_secret_file(path: Path, what: str) -> str:
    """A secret kept in a file of one's own (an upstream's token): refused if the file
    is missing, another user's, readable by others or empty. The secret is never in a
    message."""
    if not path.is_file():
        raise TokenFileError(f"{what}: no file {path}")
    if problem := privacy_problem(path.stat()):
        fix = f": `chmod 600 {path}`" if problem.chmod_fixes else ""
        raise TokenFileError(f"{what}: {path} {problem.text}{fix}")
    secret = path.read_text().strip()
    if not secret:
        raise TokenFileError(f"{what}: {path} is empty")
    return secret


def cache_identity(base: str, cache_key: str | None) -> str:
    """A request's prompt-cache identity: who sent it, narrowed by the client's own
    `cache_key` (a key never widens it to another user's cache)."""
    if not cache_key:
        return base
    return f"{base}|key:{hashlib.sha256(cache_key.encode()).hexdigest()[:32]}"


def _peer_uid(request: web.Request, unix: bool) -> int | None:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return None
    if unix:
        return unix_peer_uid(sock)
    try:
        local, remote = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    if not ipaddress.ip_address(str(remote[0]).split("%", 1)[0]).is_loopback:
        return None
    return tcp_peer_uid(local, remote)


def _own_uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _credential(request: web.Request) -> str | None:
    """The key a request presents: Authorization's (its "Bearer " dropped), else
    X-Api-Key's (Anthropic's clients send that), as llama-server reads them."""
    got = request.headers.get("Authorization") or request.headers.get("X-Api-Key")
    if got is None:
        return None
    return got[len("Bearer "):] if got.startswith("Bearer ") else got


def _matches(got: str, key: str) -> bool:
    return secrets.compare_digest(got.encode(), key.encode())


def _admit(request: web.Request, access: Access, unix: bool) -> str | web.Response:
    """The identity of the request's sender, or the response refusing it."""
    uid = _peer_uid(request, unix)
    if unix:
        return f"uid:{_own_uid() if uid is None else uid}"
    got = _credential(request)
    if got is not None and access.token is not None and _matches(got, access.token):
        return "token" if uid is None else f"uid:{uid}"
    key = None if got is None else next((k for k in sorted(access.api_keys)
                                         if _matches(got, k)), None)
    if key is not None:  # each key's holder is an identity of its own
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return f"key:{digest}" if uid is None else f"uid:{uid}"
    if access.require_token:
        return error_response(401, "missing or wrong API key or bearer token "
                                   "(Authorization: Bearer <token>, or X-Api-Key: <token>)",
                              request=request)
    if uid is not None and (access.other_users or uid == _own_uid()):
        return f"uid:{uid}"
    if access.other_users or uid is None and access.token is None:
        return "anyone"  # the kernel does not say who (not Linux), and no token to ask for
    return error_response(401, "this daemon serves only its own OS user on TCP without "
                               "the bearer token: send Authorization: Bearer <token> (the "
                               "token file in the daemon user's state dir), or start it "
                               "with --allow-other-users", request=request)


def is_own_user(identity: str) -> bool:
    """Whether a request's identity (`_admit`'s) is the daemon's own OS user."""
    uid = _own_uid()
    return uid is not None and identity == f"uid:{uid}"


def origin_allowed(origin: str, allowed: set[str]) -> bool:
    """Whether a browser Origin may call the API: one of `allowed`, or, where "localhost"
    is, any loopback origin whatever its port (llama-server's --cors-origins localhost)."""
    if origin in allowed:
        return True
    if "localhost" not in allowed:
        return False
    try:
        url = urllib.parse.urlsplit(origin)
        host = url.hostname
    except ValueError:
        return False
    return url.scheme in ("http", "https") and host is not None and is_loopback_host(
        f"[{host}]" if ":" in host else host)


def make_middlewares(*, allowed_origins: set[str], access: Access, check_host: bool = True,
                     error_shapes: dict[str, ErrorShape] | None = None) -> list[Middleware]:
    """`error_shapes`: a dialect's error shape for the paths under each prefix (every
    error a request there gets, its refusals here included)."""
    shapes = error_shapes or {}

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        shape = next((s for prefix, s in shapes.items() if request.path == prefix
                      or request.path.startswith(prefix + "/")), None)
        if shape is not None:
            request[ERROR_SHAPE] = shape
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), code=exc.code, param=exc.param,
                                  request=request)
        except web.HTTPNotFound:
            return error_response(404, f"no route {request.method} {request.path}",
                                  request=request)
        except web.HTTPMethodNotAllowed as exc:
            return error_response(405, f"method {request.method} not allowed on "
                                       f"{request.path} (allowed: "
                                       f"{', '.join(sorted(exc.allowed_methods))})",
                                  request=request)
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, f"request body too large: {exc.text}",
                                  request=request)
        except web.HTTPException:
            raise
        except ConnectionResetError:
            raise
        except Exception as exc:  # the daemon survives every bad request
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                                  request=request)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        unix = _via_unix_socket(request)
        origin = request.headers.get("Origin")
        host = request.headers.get("Host")
        if not unix and check_host and not is_loopback_host(host) and (
                host is None or host_name(host) not in access.hosts):
            return error_response(403, "Host header must name a loopback address "
                                       "(DNS-rebinding protection)" if not access.hosts else
                                       "Host header must name this machine (DNS-rebinding "
                                       "protection)", request=request)
        if (request.method == "OPTIONS" and origin is not None
                and origin_allowed(origin, allowed_origins)
                and "Access-Control-Request-Method" in request.headers):
            # a browser's CORS preflight (it never carries the token)
            return web.Response(status=200, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600"})
        if request.path != "/health":
            admitted = _admit(request, access, unix)
            if isinstance(admitted, web.Response):
                return admitted
            request[IDENTITY] = admitted
        if origin is not None and not origin_allowed(origin, allowed_origins):
            return error_response(403, f"cross-origin requests from {origin} are not "
                                       "allowed (see --allow-origin)", request=request)
        return await handler(request)

    return [errors, guard]


def cors_on_prepare(allowed_origins: set[str]) -> Callable[[web.Request, web.StreamResponse],
                                                           Awaitable[None]]:
    """An `on_response_prepare` signal: every response to an allowed origin (errors and
    streams included, before their headers go out) names it in Access-Control-Allow-Origin."""
    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin_allowed(origin, allowed_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
    return add
