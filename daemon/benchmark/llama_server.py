"""A llama-server process on a free loopback port, as users run it: started with the
given model and flags, ready once /health answers, asked over HTTP, stopped on close."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .llama_cpp import bin_dir, missing


class LlamaServerError(RuntimeError):
    """llama-server is not built, did not start, or answered with an error."""


def wait_healthy(url: str, proc: subprocess.Popen[bytes], ready_s: float) -> bool:
    """Wait until the server at `url` answers /health with 200 (True) or its process
    exits (True: the caller sees the exit); False after `ready_s` seconds."""
    deadline = time.monotonic() + ready_s
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
    return True


def process_memory(pid: int) -> tuple[int, int]:
    """A process's resident bytes now and at their peak (Linux /proc; 0, 0 elsewhere or
    where it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
          if line.startswith(("VmRSS:", "VmHWM:"))}
    return 1024 * kb.get("VmRSS", 0), 1024 * kb.get("VmHWM", 0)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Terminate a server process; killed if it is still there after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LlamaServer:
    def __init__(self, model: Path, *, threads: int, n_ctx: int, args: Sequence[str] = (),
                 ready_s: float = 300.0):
        if reason := missing("llama-server"):
            raise LlamaServerError(reason)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [str(bin_dir() / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
               "--port", str(port), "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx),
               *args]
        # its log goes to a file: a pipe nobody reads fills after some requests, and the
        # server then blocks writing to it
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log)
        if not wait_healthy(self.url, self.proc, ready_s):
            self.close()
            raise LlamaServerError("llama-server did not become ready")
        if self.proc.poll() is not None:
            self._log.seek(0)
            err = self._log.read().decode(errors="replace")
            raise LlamaServerError(f"llama-server exited {self.proc.returncode}: "
                                   + " | ".join(err.strip().splitlines()[-5:]))

    def post(self, route: str, body: dict[str, Any], timeout: float = 600.0) -> Any:
        req = urllib.request.Request(f"{self.url}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise LlamaServerError(f"llama-server {route}: {exc.code} "
                                   f"{exc.read().decode(errors='replace')[:300]}") from None

    def memory(self) -> tuple[int, int]:
        """The server's resident bytes now and at their peak (Linux /proc; 0, 0 elsewhere)."""
        return process_memory(self.proc.pid)

    def close(self) -> None:
        self._log.close()
        stop_process(self.proc)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
