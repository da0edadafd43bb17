"""`specd serve` as a process of its own on a free loopback port, for benchmarks and soaks
that measure the daemon as users run it."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .llama_server import stop_process, wait_healthy


@dataclass
class ServeProcess:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path  # its stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def specd_serve(args: Sequence[str], ready_s: float = 900.0) -> Iterator[ServeProcess]:
    """`specd serve ARGS --port P --no-socket`, ready (its /health answers), stopped after.
    Its log goes to a file: a pipe nobody reads would fill and block the daemon."""
    port = free_port()
    cmd = [sys.executable, "-m", "specd.daemon.cli", "serve", *args, "--port", str(port),
           "--no-socket"]
    log = Path(tempfile.mkstemp(prefix="specd-serve-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(url, proc, ready_s):
            raise RuntimeError("specd serve did not become ready")
        if proc.poll() is not None:
            raise RuntimeError(f"specd serve exited: {log.read_text()[-800:]}")
        yield ServeProcess(url, port, proc, log)
    finally:
        stop_process(proc)
