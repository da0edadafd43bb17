"""The background daemon: start / stop / status with a pid file and a log in `state_dir()`.

`start` spawns `python -m specd.daemon.cli serve ...` in its own session with stdout/stderr
appended to the log, then waits until the daemon answers /health (on its Unix socket, or on
TCP where there is none) or dies (the error then carries the log's tail).  The pid file holds
just the pid; `specd.json` beside it records the socket, port and argv for `status`/`restart`.
A pid file whose process is gone, a zombie or not a specd daemon is stale and is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from specd.ipc.client import Client, DaemonError, DaemonUnavailable
from specd.ort_models.paths import state_dir

LOG_MAX_BYTES = 10 << 20  # rotated to specd.log.1 beyond this (at start, and as it runs)
_SERVING = re.compile(rb"specd: serving http://(\[[^\]\s]+\]|[^\s:/]+):(\d+)")


class ServiceError(RuntimeError):
    pass


class AlreadyRunning(ServiceError):
    pass


class NotRunning(ServiceError):
    pass


def pid_path() -> Path:
    return state_dir() / "specd.pid"


def info_path() -> Path:
    return state_dir() / "specd.json"


def log_path() -> Path:
    return state_dir() / "specd.log"


# -- processes ----------------------------------------------------------------------------
def is_alive(pid: int) -> bool:
    """Running (a zombie is not: in containers nobody may reap an orphan)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True


def is_specd_process(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:  # the pid is reused by a process we may not inspect
        return _may_be_ours(proc, pid)
    joined = " ".join(cmd)
    return "specd" in joined and "serve" in cmd


def _may_be_ours(proc: psutil.Process, pid: int) -> bool:
    """A process whose command line we may not read (macOS: another user's): our daemon
    only if it runs as us and began when `specd start` recorded starting it; when neither
    can be told, it is left alone."""
    try:
        if hasattr(os, "getuid") and proc.uids().real != os.getuid():
            return False
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    info = read_info()
    started = info.get("started")
    if info.get("pid") == pid and isinstance(started, int | float):
        return created <= started + 2.0  # Popen returns after the child exists
    return True


def read_pid() -> int | None:
    try:
        text = pid_path().read_text().strip()
    except FileNotFoundError:
        return None
    try:
        pid = int(text.split()[0])
    except (ValueError, IndexError):
        return -1  # garbage: stale
    return pid if pid > 0 else -1


def read_info() -> dict[str, Any]:
    try:
        data = json.loads(info_path().read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_info(info: dict[str, Any]) -> None:
    tmp = info_path().with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, info_path())


def _clear_files() -> None:
    for p in (pid_path(), info_path()):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def running_pid() -> int | None:
    """The pid of the daemon `specd start` left, or None; a stale pid file is removed."""
    pid = read_pid()
    if pid is None:
        return None
    if pid > 0 and is_specd_process(pid):
        return pid
    _clear_files()
    return None


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """Serialize start/stop between concurrent `specd` commands (POSIX only)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with (state_dir() / "specd.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- argv inspection ----------------------------------------------------------------------
def _opt(argv: list[str], name: str) -> str | None:
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


def socket_for(argv: list[str]) -> Path | None:
    """Where a `serve argv` daemon listens on a Unix socket (None: TCP only)."""
    from specd.ipc.server import default_socket_path

    if "--no-socket" in argv or sys.platform == "win32":
        return None
    sock = _opt(argv, "--socket")
    return Path(sock) if sock else default_socket_path()


def client_for(info: dict[str, Any] | None = None, timeout: float = 5.0) -> Client:
    """A client for the daemon described by `info` (default: the running one, or the
    default socket)."""
    info = read_info() if info is None else info
    sock = info.get("socket", "")
    if (sock is None and info.get("port")) or sys.platform == "win32":
        from specd.ipc.server import DEFAULT_PORT, token_path

        token = None  # TCP may require the bearer token (the socket never does)
        with contextlib.suppress(OSError):
            token = token_path().read_text().strip() or None
        return Client(port=int(info.get("port") or DEFAULT_PORT), token=token, timeout=timeout,
                      host=str(info.get("host") or "127.0.0.1"))
    return Client(Path(sock) if sock else None, timeout=timeout)


# -- log ----------------------------------------------------------------------------------
def log_tail(start: int = 0, max_lines: int = 25, path: Path | None = None) -> str:
    path = path or log_path()
    try:
        with path.open("rb") as f:
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return ""
    lines = data.decode("utf-8", "replace").rstrip().splitlines()
    return "\n".join(lines[-max_lines:])


def _rotate_log() -> None:
    p = log_path()
    with contextlib.suppress(FileNotFoundError):
        if p.stat().st_size > LOG_MAX_BYTES:
            os.replace(p, p.with_suffix(".log.1"))


def _served_port(offset: int) -> int | None:
    try:
        with log_path().open("rb") as f:
            f.seek(offset)
            m = _SERVING.search(f.read())
    except FileNotFoundError:
        return None
    return int(m.group(2)) if m else None


# -- start / stop -------------------------------------------------------------------------
def serve_command(serve_argv: list[str], verbose: bool = False,
                  log: Path | None = None) -> list[str]:
    """The daemon's command line; with `log`, it rotates that log by size as it runs."""
    return [sys.executable, "-m", "specd.daemon.cli", *(["-v"] if verbose else []),
            "serve", *serve_argv, *(["--log-file", str(log)] if log is not None else [])]


def start(serve_argv: list[str], *, verbose: bool = False, timeout: float = 600.0,
          cwd: Path | None = None, on_wait: Callable[[float], None] | None = None) -> int:
    """Start the daemon in the background; returns its pid once it answers /health.

    Raises AlreadyRunning (a `specd start` daemon is alive, or something answers on the
    socket) or ServiceError (it exited during startup, with the log's tail, or did not answer
    within `timeout` seconds; it is then left running for `specd stop`).
    """
    with _lock():
        pid = running_pid()
        if pid is not None:
            raise AlreadyRunning(f"specd is already running (pid {pid}); "
                                 "use `specd restart` to restart it")
        sock = socket_for(serve_argv)
        if sock is not None and Client(sock, timeout=2.0).health():
            raise AlreadyRunning(f"a specd daemon already answers on {sock} (not started by "
                                 "`specd start`: a user service or a foreground `specd serve`)")
        _rotate_log()
        log = log_path()
        with log.open("ab") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} specd start: "
                    f"{' '.join(serve_argv)}\n".encode())
            offset = f.tell()
            cmd = serve_command(serve_argv, verbose, log)
            kwargs: dict[str, Any] = {}
            if sys.platform == "win32":
                kwargs["creationflags"] = (subprocess.DETACHED_PROCESS  # type: ignore[attr-defined]
                                           | subprocess.CREATE_NEW_PROCESS_GROUP)
            else:
                kwargs["start_new_session"] = True
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, cwd=cwd, close_fds=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kwargs)
        pid_path().write_text(f"{proc.pid}\n")
        port = _opt(serve_argv, "--port")
        info: dict[str, Any] = {
            "pid": proc.pid, "socket": None if sock is None else str(sock),
            "host": _opt(serve_argv, "--host") or "127.0.0.1",
            "port": int(port) if port and port != "0" else None,
            "argv": serve_argv, "verbose": verbose, "started": time.time(), "log": str(log),
            "log_offset": offset}
        write_info(info)
    # waited for outside the lock: `specd stop` may stop a daemon still loading (the wait
    # then reports its exit), and a second `specd start` finds its pid file
    _wait_ready(proc, info, offset, timeout, on_wait)
    return proc.pid


def _wait_ready(proc: subprocess.Popen[bytes], info: dict[str, Any], offset: int,
                timeout: float, on_wait: Callable[[float], None] | None) -> None:
    t0 = time.monotonic()
    while True:
        rc = proc.poll()
        if rc is not None:
            _clear_files()
            if rc == -signal.SIGTERM:
                raise ServiceError("specd was stopped while starting (`specd stop`)")
            tail = log_tail(offset)
            raise ServiceError(f"specd exited with status {rc} while starting; "
                               f"log {log_path()}:\n{tail}" if tail else
                               f"specd exited with status {rc} while starting (empty log)")
        _learn_port(info)
        if (info["socket"] is not None or info["port"] is not None) and \
                client_for(info, timeout=2.0).health():
            return
        elapsed = time.monotonic() - t0
        if elapsed > timeout:
            raise ServiceError(f"specd (pid {proc.pid}) did not answer within {timeout:.0f} s; "
                               f"it is left running: see {log_path()} or `specd stop`")
        if on_wait is not None:
            on_wait(elapsed)
        time.sleep(0.2)


@dataclass
class StopResult:
    pid: int
    killed: bool  # SIGTERM was not enough


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return True
        time.sleep(0.1)
    return not is_alive(pid)


def stop(timeout: float = 30.0) -> StopResult:
    """SIGTERM the daemon, SIGKILL it after `timeout` s; raises NotRunning when none is."""
    with _lock():
        pid = running_pid()
        info = read_info()
        if pid is None:
            sock = socket_for([])
            if sock is not None and Client(sock, timeout=2.0).health():
                raise ServiceError(f"a specd daemon answers on {sock} but was not started by "
                                   "`specd start`; stop it where it was started (e.g. "
                                   "`systemctl --user stop specd`)")
            raise NotRunning("specd is not running")
        killed = False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout):
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
            if not _wait_gone(pid, 10.0):
                raise ServiceError(f"specd (pid {pid}) survived SIGKILL")
        _clear_files()
        _remove_dead_socket(info.get("socket"))
        return StopResult(pid, killed)


def _remove_dead_socket(sock: str | None) -> None:
    if sock and Path(sock).exists() and not Client(Path(sock), timeout=1.0).health():
        with contextlib.suppress(OSError):
            Path(sock).unlink()


# -- status -------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{labels}: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name.strip()] = float(value)
    return out


@dataclass
class DaemonSnapshot:
    """What the daemon says about itself: /props, /slots and /metrics (of the model it
    started with), and /v1/models (every model it serves, loaded or not)."""

    props: dict[str, Any]
    slots: list[dict[str, Any]]
    metrics: dict[str, float]
    models: list[dict[str, Any]] = field(default_factory=list)

    def local_models(self) -> list[tuple[str, bool]]:
        """(name, loaded) of each local model (not an --upstream's), the first first."""
        return [(str(m.get("id")), (m.get("status") or {}).get("value") == "loaded")
                for m in self.models if m.get("owned_by") != "upstream"]

    @property
    def target(self) -> str:
        return str((self.props.get("target") or {}).get("name", "?"))

    @property
    def draft(self) -> str | None:
        """The drafter's name: a draft model's or a head's, or both (a head + a model)."""
        names = [str(d.get("name")) for d in (self.props.get("head"), self.props.get("draft"))
                 if isinstance(d, dict)]
        return " + ".join(names) or None

    @property
    def spec_type(self) -> str:
        return str(self.props.get("spec_type", "none"))

    @property
    def tokens_per_second(self) -> float:
        return self.metrics.get("specd_tokens_per_second", 0.0)

    @property
    def acceptance(self) -> float:
        return self.metrics.get("specd_mean_acceptance_length", 0.0)

    @property
    def loaded(self) -> bool:
        """The model is loaded (not unloaded while idle for its keep-alive)."""
        return bool(self.props.get("loaded", True))

    def slot_states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.slots:
            state = str(s.get("state", "?"))
            counts[state] = counts.get(state, 0) + 1
        return counts

    @property
    def busy(self) -> bool:
        return any(s.get("state") in ("prefill", "generating") for s in self.slots)

    def to_json(self) -> dict[str, Any]:
        return {"props": self.props, "slots": self.slots, "metrics": self.metrics,
                "models": self.models}


def fetch_snapshot(client: Client) -> DaemonSnapshot:
    """Raises DaemonUnavailable when nothing listens, DaemonError/OSError on other trouble."""
    props = client.get("/props")
    slots = client.get("/slots")
    metrics = client.get("/metrics")
    models = client.get("/v1/models")
    if not isinstance(props, dict) or not isinstance(slots, list):
        raise DaemonError(500, "unexpected /props or /slots reply")
    listed = models.get("data") if isinstance(models, dict) else None
    return DaemonSnapshot(props, slots, parse_metrics(metrics if isinstance(metrics, str)
                                                      else ""),
                          [m for m in listed or [] if isinstance(m, dict)])


@dataclass
class Status:
    running: bool
    pid: int | None = None  # None: not started by `specd start` (or not running)
    socket: str | None = None
    url: str | None = None
    started: float | None = None
    snapshot: DaemonSnapshot | None = None
    error: str | None = None  # running but not answering properly
    log: str = field(default_factory=lambda: str(log_path()))

    def to_json(self) -> dict[str, Any]:
        return {"running": self.running, "pid": self.pid, "socket": self.socket,
                "url": self.url, "started": self.started, "error": self.error, "log": self.log,
                **(self.snapshot.to_json() if self.snapshot else {})}


def _learn_port(info: dict[str, Any]) -> None:
    """A daemon asked for any free port announces it in the log once it serves; a start
    that stopped waiting before then (timed out, interrupted) left the port unknown."""
    if info.get("port") is None and "log_offset" in info:
        port = _served_port(int(info["log_offset"]))
        if port is not None:
            info["port"] = port
            write_info(info)


def status(timeout: float = 5.0) -> Status:
    pid = running_pid()
    info = read_info() if pid is not None else {}
    _learn_port(info)
    client = client_for(info, timeout=timeout)
    st = Status(running=pid is not None, pid=pid, started=info.get("started"),
                socket=None if client.socket_path is None else str(client.socket_path))
    if info.get("port"):
        from specd.ipc.server import url_host

        st.url = f"http://{url_host(str(info.get('host') or '127.0.0.1'))}:{info['port']}"
    try:
        st.snapshot = fetch_snapshot(client)
        st.running = True
    except DaemonUnavailable as exc:
        if pid is not None:
            st.error = f"not answering (starting up, or hung): {exc}"
    except (DaemonError, OSError, ValueError) as exc:
        st.running = True
        st.error = f"bad answer: {exc}"
    return st
