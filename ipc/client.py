"""A small client for the daemon over its Unix socket (or TCP), sync and async.

The CLI (`specd status`) and the tray use it; it speaks the same HTTP API as any app.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from .server import default_socket_path


class DaemonError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class DaemonUnavailable(Exception):
    pass


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def _event(data: bytes) -> dict[str, Any]:
    """One SSE data object; an error event (a failure after the stream began) raises."""
    ev = json.loads(data)
    if isinstance(ev, dict) and isinstance(ev.get("error"), dict):
        raise DaemonError(int(ev["error"].get("code") or 500),
                          str(ev["error"].get("message", "error")))
    return ev


def _error_message(raw: bytes) -> str:
    try:
        return json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:200]


class Client:
    """Synchronous client. socket_path=None and port given: TCP on `host` (a loopback
    address, default 127.0.0.1; IPv6 without brackets)."""

    def __init__(self, socket_path: Path | None = None, *, port: int | None = None,
                 token: str | None = None, timeout: float = 600.0, host: str = "127.0.0.1"):
        self.socket_path = None if port is not None else (socket_path or default_socket_path())
        self.port, self.token, self.timeout = port, token, timeout
        self.host = host.strip("[]")

    def _conn(self) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return _UnixHTTPConnection(str(self.socket_path), self.timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Host": "localhost"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def _connected(self) -> http.client.HTTPConnection:
        """An open connection, or DaemonUnavailable: any failure to connect (no socket,
        refused, a path too long, no permission) means no daemon to talk to."""
        conn = self._conn()
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise DaemonUnavailable(f"no daemon at {self.socket_path or self.port}: "
                                    f"{exc.strerror or exc}") from None
        return conn

    def request(self, method: str, path: str, body: Any = None) -> Any:
        conn = self._connected()
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         self._headers())
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        if resp.status >= 400:
            raise DaemonError(resp.status, _error_message(raw))
        ctype = resp.getheader("Content-Type", "")
        return json.loads(raw) if "json" in ctype else raw.decode()

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def health(self) -> bool:
        try:
            return self.get("/health").get("status") == "ok"
        except (DaemonUnavailable, DaemonError, OSError):
            return False

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST with stream=true; yields each SSE data object (stops at [DONE])."""
        conn = self._connected()
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}), self._headers())
            resp = conn.getresponse()
            if resp.status >= 400:
                raise DaemonError(resp.status, _error_message(resp.read()))
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    return
                yield _event(data)
        finally:
            conn.close()


class AsyncClient:
    """asyncio client over the Unix socket (or TCP with port)."""

    def __init__(self, socket_path: Path | None = None, *, port: int | None = None,
                 token: str | None = None, timeout: float = 600.0):
        self.socket_path = None if port is not None else (socket_path or default_socket_path())
        self.port, self.token = port, token
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncClient:
        conn = (aiohttp.UnixConnector(path=str(self.socket_path)) if self.socket_path
                else aiohttp.TCPConnector())
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._session = aiohttp.ClientSession(connector=conn, timeout=self._timeout,
                                              headers=headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def _url(self, path: str) -> str:
        return f"http://localhost{path}" if self.socket_path else \
            f"http://127.0.0.1:{self.port}{path}"

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        assert self._session is not None, "use `async with AsyncClient() as c`"
        try:
            async with self._session.request(method, self._url(path), json=body) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    raise DaemonError(resp.status, _error_message(raw))
                return json.loads(raw) if "json" in resp.content_type else raw.decode()
        except aiohttp.ClientConnectorError as exc:
            raise DaemonUnavailable(str(exc)) from None

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def post(self, path: str, body: Any) -> Any:
        return await self.request("POST", path, body)

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        assert self._session is not None
        async with self._session.post(self._url(path), json={**body, "stream": True}) as resp:
            if resp.status >= 400:
                raise DaemonError(resp.status, _error_message(await resp.read()))
            async for line in resp.content:
                line = line.strip()
                if line.startswith(b"data: "):
                    if line[6:] == b"[DONE]":
                        return
                    yield _event(line[6:])
