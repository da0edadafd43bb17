"""Serve the HTTP API on loopback TCP and on a Unix socket in the user runtime dir."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from aiohttp import web

from specd.ort_models.paths import runtime_dir, state_dir

from .security import is_loopback_host, load_or_create_token

log = logging.getLogger("specd.server")
# 8 + 0x5EED: unassigned by IANA, away from 8080/8000/11434 (Ollama)/1234 (LM Studio)
DEFAULT_PORT = 8799


def default_socket_path() -> Path:
    return runtime_dir() / "specd.sock"


def token_path() -> Path:
    return state_dir() / "token"


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 = pick a free port
    socket_path: Path | None = field(default_factory=default_socket_path)  # None: no socket
    require_token: bool = False
    allow_non_loopback: bool = False
    allowed_origins: set[str] = field(default_factory=set)


def resolve_token(cfg: ServeConfig) -> str | None:
    """Loopback-only needs no token unless asked; any other bind requires one."""
    if not is_loopback_host(cfg.host):
        if not cfg.allow_non_loopback:
            raise ValueError(f"refusing to listen on {cfg.host}: not a loopback address "
                             "(pass --allow-non-loopback; a bearer token is then required)")
        return load_or_create_token(token_path())
    return load_or_create_token(token_path()) if cfg.require_token else None


def check_free(cfg: ServeConfig) -> None:
    """OSError if the port or the Unix socket is already served: checked before the models
    load (minutes), so a second daemon, or a service restarting in a loop beside one,
    fails at once. (Binding happens after loading; this is a check, not a reservation.)"""
    if cfg.port:
        family, kind, proto, _, addr = socket.getaddrinfo(cfg.host, cfg.port,
                                                          type=socket.SOCK_STREAM)[0]
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            probe.bind(addr)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {cfg.host}:{cfg.port}: "
                                     f"{exc.strerror} (another specd? `specd status`)") from None
        finally:
            probe.close()
    path = cfg.socket_path
    if path is not None and sys.platform != "win32" and path.is_socket() and _listened(path):
        raise OSError(errno.EADDRINUSE, f"another specd is listening on {path}")


def _listened(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket `path` (else it is stale)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    else:
        return True
    finally:
        probe.close()


def url_host(host: str) -> str:
    """`host` as a URL writes it: IPv6 literals in brackets."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


def _prepare_socket(path: Path) -> socket.socket:
    """Bind a Unix socket (mode 0600), replacing a stale socket file but not a live one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if (path.exists() or path.is_symlink()) and not stat.S_ISSOCK(path.lstat().st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; not replacing it")
    if path.exists() or path.is_symlink():
        if _listened(path):
            raise OSError(errno.EADDRINUSE, f"another specd is listening on {path}")
        path.unlink()  # nobody listens: stale
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock


class RunningServer:
    def __init__(self, runner: web.AppRunner, port: int, socket_path: Path | None):
        self.runner, self.port, self.socket_path = runner, port, socket_path

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()


SHUTDOWN_GRACE = 5.0  # seconds


async def start_server(app: web.Application, cfg: ServeConfig) -> RunningServer:
    # on stop, requests in flight get SHUTDOWN_GRACE s to finish; idle keep-alive
    # connections must not hold the exit for aiohttp's default 60 s
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE)
    await runner.setup()
    tcp = web.TCPSite(runner, cfg.host, cfg.port)
    await tcp.start()
    port = cfg.port
    if port == 0:
        # the bound port of an ephemeral site (aiohttp types the loop's Server as its base)
        server = cast("asyncio.Server | None", tcp._server)
        port = server.sockets[0].getsockname()[1] if server and server.sockets else 0
    sock_path = None
    if cfg.socket_path is not None and sys.platform != "win32":
        sock = _prepare_socket(cfg.socket_path)
        await web.SockSite(runner, sock).start()
        sock_path = cfg.socket_path
    log.info("listening on http://%s:%d%s", cfg.host, port,
             f" and unix:{sock_path}" if sock_path else "")
    return RunningServer(runner, port, sock_path)


async def serve_forever(app: web.Application, cfg: ServeConfig,
                        ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled or SIGTERM (`specd stop`, systemd, launchd), then close the
    server and remove the socket. SIGTERM sets an event inside the loop: raising from a
    plain signal handler could land anywhere, a cleanup half done included."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handles_term = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGTERM, stop.set)  # main thread, Unix only
        handles_term = True
    srv = await start_server(app, cfg)
    print(f"specd: serving http://{url_host(cfg.host)}:{srv.port}"
          + (f" and unix:{srv.socket_path}" if srv.socket_path else ""), file=sys.stderr,
          flush=True)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        await srv.close()
        if handles_term:
            loop.remove_signal_handler(signal.SIGTERM)
