"""Middlewares: loopback Host check (DNS rebinding), Origin check, bearer token, errors."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from .jsonout import json_response
from .validation import BadRequest

if TYPE_CHECKING:
    from aiohttp.typedefs import Middleware

log = logging.getLogger("specd.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"}


def error_response(status: int, message: str, *, code: str = "invalid_request_error",
                   param: str | None = None) -> web.Response:
    etype = {400: "invalid_request_error", 401: "authentication_error",
             403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
             413: "invalid_request_error", 503: "server_busy"}.get(status, "server_error")
    return json_response(
        {"error": {"message": message, "type": etype,
                   "code": code if status in (400, 404) else etype,
                   "param": param}}, status=status)


def is_loopback_host(host: str | None) -> bool:
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [::1]:port
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _via_unix_socket(request: web.Request) -> bool:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and getattr(sock, "family", None) == socket.AF_UNIX


def load_or_create_token(path: Path) -> str:
    """The bearer token, generated once into a 0600 file."""
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def make_middlewares(*, allowed_origins: set[str], token: str | None,
                     check_host: bool = True) -> list[Middleware]:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), code=exc.code, param=exc.param)
        except web.HTTPNotFound:
            return error_response(404, f"no route {request.method} {request.path}")
        except web.HTTPMethodNotAllowed as exc:
            return error_response(405, f"method {request.method} not allowed on "
                                       f"{request.path} (allowed: "
                                       f"{', '.join(sorted(exc.allowed_methods))})")
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(413, f"request body too large: {exc.text}")
        except web.HTTPException:
            raise
        except ConnectionResetError:
            raise
        except Exception as exc:  # the daemon survives every bad request
            log.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        unix = _via_unix_socket(request)
        origin = request.headers.get("Origin")
        if not unix and check_host and not is_loopback_host(request.headers.get("Host")):
            return error_response(403, "Host header must name a loopback address "
                                       "(DNS-rebinding protection)")
        if (request.method == "OPTIONS" and origin in allowed_origins
                and "Access-Control-Request-Method" in request.headers):
            # a browser's CORS preflight (it never carries the token)
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": request.headers.get(
                    "Access-Control-Request-Headers", "Authorization, Content-Type"),
                "Access-Control-Max-Age": "600"})
        if not unix:
            if token is not None and request.path != "/health":
                got = request.headers.get("Authorization", "")
                if not secrets.compare_digest(got.encode(), f"Bearer {token}".encode()):
                    return error_response(401, "missing or wrong bearer token "
                                               "(Authorization: Bearer <token>)")
        if origin is not None and origin not in allowed_origins:
            return error_response(403, f"cross-origin requests from {origin} are not "
                                       "allowed (see --allow-origin)")
        return await handler(request)

    return [errors, guard]


def cors_on_prepare(allowed_origins: set[str]) -> Callable[[web.Request, web.StreamResponse],
                                                           Awaitable[None]]:
    """An `on_response_prepare` signal: every response to an allowed origin (errors and
    streams included, before their headers go out) names it in Access-Control-Allow-Origin."""
    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None and origin in allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
    return add
