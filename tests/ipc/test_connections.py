"""Connection hygiene of ipc.server on real sockets: idle and slow clients are timed
out, connections beyond the cap are refused at once, the fd limit is raised, and running
out of descriptors is one log line now and then, not a traceback per accept."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from specd.ipc.server import (
    RateLimitedLog,
    RunningServer,
    ServeConfig,
    _quiet_network_errors,
    connection_limit,
    start_server,
)
from specd.ipc.validation import BODY_TIMEOUT, json_body

WAIT = 20.0  # seconds: generous, for a busy machine


def _app(body_timeout: float = 60.0) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def echo(request: web.Request) -> web.Response:
        from specd.ipc.validation import BadRequest

        try:
            return web.json_response(await json_body(request))
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)

    app = web.Application()
    app[BODY_TIMEOUT] = body_timeout
    app.router.add_get("/health", health)
    app.router.add_post("/echo", echo)
    return app


@pytest.fixture
def serve() -> Iterator[Any]:
    """serve(app, **ServeConfig fields) -> the running server (closed after the test)."""
    loops: list[tuple[asyncio.AbstractEventLoop, threading.Thread, RunningServer]] = []

    def start(app: web.Application, **kw: Any) -> RunningServer:
        loop = asyncio.new_event_loop()
        ready, box = threading.Event(), {}

        def run() -> None:
            asyncio.set_event_loop(loop)
            box["srv"] = loop.run_until_complete(
                start_server(app, ServeConfig(port=0, socket_path=None, **kw)))
            ready.set()
            loop.run_forever()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert ready.wait(WAIT)
        loops.append((loop, thread, box["srv"]))
        return box["srv"]

    yield start
    for loop, thread, srv in loops:
        asyncio.run_coroutine_threadsafe(srv.close(), loop).result(WAIT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT)
        loop.close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    return sock


def _closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _get_health(port: int) -> bytes:
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return _closed_by_server(sock)


def test_idle_and_slow_clients_are_timed_out(serve: Any) -> None:
    srv = serve(_app(body_timeout=0.5), header_timeout=0.5)
    with _connect(srv.port) as silent, _connect(srv.port) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: loc")  # and never the rest
        assert _closed_by_server(silent) == b""
        assert _closed_by_server(slow) == b""
    with _connect(srv.port) as kept:  # a kept-alive connection, idle after its request
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _closed_by_server(kept).startswith(b"HTTP/1.1 200")
    with _connect(srv.port) as no_body:  # headers, then a body that never comes
        no_body.sendall(b"POST /echo HTTP/1.1\r\nHost: localhost\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        reply = _closed_by_server(no_body)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"did not arrive within 0.5 s" in reply


def test_connections_beyond_the_cap_are_refused_at_once(serve: Any) -> None:
    srv = serve(_app(), max_connections=3, header_timeout=60)
    held = [_connect(srv.port) for _ in range(3)]
    try:
        with _connect(srv.port) as extra:
            reply = _closed_by_server(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"too many open connections" in reply
        held.pop().close()
        for _ in range(100):  # the server notices the close
            reply = _get_health(srv.port)
            if reply.startswith(b"HTTP/1.1 200"):
                break
            threading.Event().wait(0.05)
        assert reply.startswith(b"HTTP/1.1 200"), reply
    finally:
        for sock in held:
            sock.close()


def test_accept_errors_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """What asyncio reports at the fd limit, a hundred times per loop pass."""
    loop = asyncio.new_event_loop()
    try:
        handle = _quiet_network_errors(RateLimitedLog(every=3600))
        err = OSError(24, "Too many open files")
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                handle(loop, {"message": "socket.accept() out of system resource",
                              "exception": err})
        lines = [r for r in caplog.records if "out of system resource" in r.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is None
        handle(loop, {"message": "something else", "exception": ValueError("x")})
        assert "something else" in caplog.text  # other errors as asyncio logs them
    finally:
        loop.close()


@pytest.mark.skipif(sys.platform == "win32", reason="no fd limits")
@pytest.mark.parametrize("soft, wanted, cap", [
    (256, 512, 192),  # a low limit keeps a quarter for files, pipes and threads
    (64, 512, 48),
    (4, 512, 3),
    (1024, 512, 512),  # plenty: the cap asked for
    (600, 512, 450),
    (2000, 4096, 1744),  # the reserve is at most 256
    (1 << 20, 512, 512),
])
def test_the_connection_cap_keeps_a_reserve_scaled_to_the_fd_limit(
        monkeypatch: pytest.MonkeyPatch, soft: int, wanted: int, cap: int) -> None:
    """Under a low fd limit most descriptors still serve connections, so one idle client
    does not leave the others a 503 until the header timeout."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))
    assert connection_limit(wanted) == cap


_AT_THE_FD_LIMIT = textwrap.dedent("""
    import asyncio, os, resource, sys, time
    from aiohttp import web
    from specd.ipc.server import ServeConfig, raise_fd_limit, start_server

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 512))
    soft = raise_fd_limit()
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({"ok": True}))

    async def main():
        srv = await start_server(app, ServeConfig(port=0, socket_path=None,
                                                  max_connections=int(sys.argv[1])))
        hog = []
        if sys.argv[2] == "exhaust":  # leave no descriptor for accept()
            while True:
                try:
                    hog.append(os.open(os.devnull, os.O_RDONLY))
                except OSError:
                    break
        print(soft, srv.port, flush=True)
        await asyncio.sleep(float(sys.argv[3]))
        for fd in hog:
            os.close(fd)
        await asyncio.sleep(30)

    asyncio.run(main())
""")


def _flood(port: int, n: int) -> list[socket.socket]:
    socks: list[socket.socket] = []
    failures = 0
    while len(socks) < n and failures < 5:
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:  # the backlog is full
            failures += 1
    return socks


@pytest.mark.skipif(sys.platform == "win32", reason="no fd limits")
@pytest.mark.parametrize("mode", ["cap", "exhaust"])
def test_at_the_fd_limit_the_daemon_logs_a_line_not_a_flood(mode: str) -> None:
    """"cap": the connection cap stays under the raised fd limit, so accept() never
    fails; "exhaust": descriptors run out anyway, and the log says so once."""
    proc = subprocess.Popen([sys.executable, "-c", _AT_THE_FD_LIMIT, "100000", mode, "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        soft, port = map(int, proc.stdout.readline().split())
        assert soft == 512  # raised to the hard limit
        socks = _flood(port, 400)
        assert len(socks) > 256 or mode == "exhaust", len(socks)
        threading.Event().wait(1.5)
        for s in socks:
            s.close()
        if mode == "cap":  # answered once the flood is gone
            assert _get_health(port).startswith(b"HTTP/1.1 200")
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=WAIT)
    assert "Traceback" not in err, err[:2000]
    accept_lines = err.count("out of system resource")
    assert accept_lines == (0 if mode == "cap" else 1), err[:2000]
    if mode == "cap":
        assert "refusing connections" in err

