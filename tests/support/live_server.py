"""A real specd server (engine + scheduler + aiohttp) on loopback and a Unix socket,
running in a background thread for the tests."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.serving.scheduler import NEVER, Scheduler
from specd.daemon.serving.served_models import ServedModels
from specd.daemon.serving.service import Service
from specd.ipc.http.app import create_app
from specd.ipc.server import ServeConfig, resolve_token, start_server

if TYPE_CHECKING:  # the benchmarks import this module without pytest
    import pytest


class LiveServer:
    def __init__(self, service: Service, port: int, socket_path: Path, token: str | None):
        self.service, self.port, self.socket_path, self.token = (service, port, socket_path,
                                                                 token)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: Any = None, *,
                headers: dict[str, str] | None = None, raw: bytes | None = None,
                timeout: float = 120) -> tuple[int, Any]:
        auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return call(self.port, method, path, body, headers={**auth, **(headers or {})},
                    raw=raw, timeout=timeout)


def call(port: int, method: str, path: str, body: Any = None, *,
         headers: dict[str, str] | None = None, raw: bytes | None = None,
         host: str = "127.0.0.1", timeout: float = 120) -> tuple[int, Any]:
    """One request to the server at `port`: (status, the JSON answer, else its text)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(payload)
    except ValueError:
        return resp.status, payload.decode("utf-8", "replace")


@contextlib.contextmanager
def live_server(cfg: EngineConfig, tmp: Path, *, require_token: bool = False,
                allowed_origins: set[str] | None = None, max_queue: int = 64,
                max_body: int = 8 << 20, keep_alive: float = NEVER,
                models: Callable[[Service], ServedModels] | None = None,
                **app_options: Any) -> Iterator[LiveServer]:
    """`app_options`: more of create_app's keywords (strict_model_name, ...);
    `keep_alive`: the scheduler's (default: the model stays loaded); `models`: the
    local models served by name, made from the first (`cfg`'s) service."""
    engine = Engine(cfg)
    scheduler = Scheduler(engine, max_queue=max_queue, keep_alive=keep_alive)
    service = Service(engine, scheduler)
    served = None if models is None else models(service)
    if served is not None:
        app_options["models"] = served
    sock = tmp / "specd.sock"
    scfg = ServeConfig(port=0, socket_path=sock, require_token=require_token,
                       allowed_origins=allowed_origins or set())
    token = resolve_token(scfg)
    app = create_app(service, allowed_origins=scfg.allowed_origins, token=token,
                     max_body=max_body, **app_options)
    try:
        with serving(app, scfg) as (srv, _):
            yield LiveServer(service, srv.port, sock, token)
    finally:
        if served is not None:
            served.stop()
        scheduler.stop()


@contextlib.contextmanager
def live_server_in(tmp_path_factory: pytest.TempPathFactory, name: str, cfg: EngineConfig,
                   **kw: Any) -> Iterator[LiveServer]:
    """live_server (`kw`: its options) in a fresh folder `name`, the daemon's state dir in
    it: a module-scoped server fixture's body."""
    import pytest

    tmp = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECD_STATE_DIR", str(tmp / "state"))
        with live_server(cfg, tmp, **kw) as srv:
            yield srv


@contextlib.contextmanager
def serving(app: Any, cfg: ServeConfig) -> Iterator[tuple[Any, Callable[[], None]]]:
    """start_server() on a loop in a thread: (the running server, a function closing it,
    which the end of the block calls too)."""
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        started["srv"] = loop.run_until_complete(start_server(app, cfg))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    closed: list[bool] = []

    def close() -> None:
        if not closed:
            closed.append(True)
            asyncio.run_coroutine_threadsafe(started["srv"].close(), loop).result(60)

    try:
        yield started["srv"], close
    finally:
        close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
