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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web

from specd.ort_models.paths import runtime_dir, state_dir

from .security import Access, is_loopback_host, load_or_create_token

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
    # keys of the owner's choosing (--api-key): every TCP client then needs one (or the token)
    api_keys: frozenset[str] = frozenset()
    allow_non_loopback: bool = False
    allowed_origins: set[str] = field(default_factory=set)
    # loopback TCP serves every local OS user without the token (else only the daemon's)
    allow_other_users: bool = False
    max_connections: int = 512  # open at once (fewer where the fd limit is low)
    header_timeout: float = 15.0  # s for a request's headers to arrive (and idle keep-alive)


def resolve_token(cfg: ServeConfig) -> str | None:
    """Loopback-only needs no token unless asked (--require-token, or --api-key: keys are
    then required); any other bind requires one."""
    if not is_loopback_host(cfg.host):
        if not cfg.allow_non_loopback:
            raise ValueError(f"refusing to listen on {cfg.host}: not a loopback address "
                             "(pass --allow-non-loopback; a bearer token is then required)")
        return load_or_create_token(token_path())
    required = cfg.require_token or bool(cfg.api_keys)
    return load_or_create_token(token_path()) if required else None


def serve_access(cfg: ServeConfig) -> Access:
    """Who may use the TCP port: by default the daemon's own OS user, and anyone with the
    token (created on first use) or an --api-key; every client needs one of them off
    loopback, with --require-token or with an --api-key. Off loopback, Host may name the
    bound address or this machine."""
    required = resolve_token(cfg)
    token = required if required is not None else load_or_create_token(token_path())
    hosts = frozenset() if is_loopback_host(cfg.host) else machine_names(cfg.host)
    return Access(token=token, api_keys=cfg.api_keys, require_token=required is not None,
                  other_users=cfg.allow_other_users, hosts=hosts)


def machine_names(bound: str) -> frozenset[str]:
    """The names a LAN client may put in Host for this machine: the bound address, the
    host's names and every interface's addresses."""
    names = {bound.strip("[]").lower(), socket.gethostname().lower(), socket.getfqdn().lower()}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                names.add(a.address.split("%", 1)[0].lower())
    return frozenset(n for n in names if n)


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
    def __init__(self, runner: web.AppRunner, listeners: list[asyncio.Server], port: int,
                 socket_path: Path | None):
        self.runner, self.listeners = runner, listeners
        self.port, self.socket_path = port, socket_path

    async def close(self) -> None:
        """Stop listening, then end the requests in flight (SHUTDOWN_GRACE at most)."""
        for listener in self.listeners:
            listener.close()
        await self.runner.cleanup()
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()


SHUTDOWN_GRACE = 5.0  # seconds
# descriptors kept from connections: one accept() batch (asyncio takes up to 100 before
# any is answered), model files, pipes and threads; a quarter of a lower fd limit, so
# that most of a small limit still serves connections
FD_RESERVE = 256
LOG_EVERY = 10.0  # s between two log lines of one recurring network error
LINGER = 2.0  # s to read a refused request's body before closing (aiohttp's default: 10)


class RateLimitedLog:
    """One line per `every` seconds for each recurring message, counting the rest."""

    def __init__(self, every: float = LOG_EVERY):
        self.every = every
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def warning(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every) < self.every:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return
        dropped = self._dropped.pop(key, 0)
        self._last[key] = now
        log.warning("%s%s", message, f" ({dropped} more like it since)" if dropped else "")


def raise_fd_limit() -> int | None:
    """Raise the soft limit on open files to the hard one; the soft limit then (None
    where there are no such limits)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # an unlimited hard limit: as many as the system grants (macOS refuses more than 10240)
    wanted = (hard,) if hard != resource.RLIM_INFINITY else (1 << 20, 10240)
    for want in wanted:
        if want <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_limit(wanted: int) -> int:
    """`wanted`, or fewer where the fd limit leaves less room after its reserve
    (FD_RESERVE, or a quarter of a limit under 4 * FD_RESERVE)."""
    try:
        import resource
    except ImportError:
        return wanted
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - min(FD_RESERVE, soft // 4)))


_BUSY_BODY = (b'{"error":{"message":"too many open connections; retry later","type":'
              b'"server_busy","code":"server_busy","param":null}}')
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nRetry-After: 1\r\nContent-Length: "
         + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _Refusal(asyncio.Protocol):
    """A connection over the cap: a 503 and closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_BUSY)
        transport.close()


class _CappedFactory:
    """aiohttp's protocol factory, refusing connections beyond `limit` open ones."""

    def __init__(self, server: web.Server, limit: int, warn: RateLimitedLog):
        self._server, self._limit, self._warn = server, limit, warn
        self.open = 0

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open >= self._limit:
            self._warn.warning("cap", f"refusing connections: {self._limit} are open "
                                      "(--max-connections)")
            return _Refusal()
        self.open += 1
        return _Counted(self._server(), self)


class _Counted(asyncio.Protocol):
    """A connection's protocol, counted open until its connection is lost."""

    def __init__(self, inner: asyncio.Protocol, factory: _CappedFactory):
        self._inner, self._factory = inner, factory

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._factory.open -= 1
        self._inner.connection_lost(exc)


def _quiet_network_errors(warn: RateLimitedLog) -> Any:
    """An event-loop exception handler: accept() failures (out of descriptors or memory)
    are one rate-limited line each, not a traceback per try; the rest as usual."""
    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE,
                                                      errno.ENOBUFS, errno.ENOMEM):
            warn.warning(f"accept:{exc.errno}", f"{context.get('message', 'socket error')}: "
                                                f"{exc.strerror}")
            return
        loop.default_exception_handler(context)
    return handle


async def start_server(app: web.Application, cfg: ServeConfig) -> RunningServer:
    # on stop, requests in flight get SHUTDOWN_GRACE s to finish; a connection that sends
    # no request (a first one, or another on a kept-alive one) is closed after
    # header_timeout; a body left unread (refused) is drained for LINGER s at most
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE,
                           keepalive_timeout=cfg.header_timeout, lingering_time=LINGER)
    await runner.setup()
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    warn = RateLimitedLog()
    loop.set_exception_handler(_quiet_network_errors(warn))
    factory = _CappedFactory(runner.server, connection_limit(cfg.max_connections), warn)
    tcp = await loop.create_server(factory, cfg.host, cfg.port)
    listeners = [tcp]
    port = cfg.port or (tcp.sockets[0].getsockname()[1] if tcp.sockets else 0)
    sock_path = None
    if cfg.socket_path is not None and sys.platform != "win32":
        sock = _prepare_socket(cfg.socket_path)
        listeners.append(await loop.create_unix_server(factory, sock=sock))
        sock_path = cfg.socket_path
    log.info("listening on http://%s:%d%s", cfg.host, port,
             f" and unix:{sock_path}" if sock_path else "")
    return RunningServer(runner, listeners, port, sock_path)


async def serve_forever(app: web.Application, cfg: ServeConfig,
                        ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled or SIGTERM (`specd stop`, systemd, launchd), then close the
    server and remove the socket. SIGTERM sets an event inside the loop: raising from a
    plain signal handler could land anywhere, a cleanup half done included."""
    raise_fd_limit()
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
