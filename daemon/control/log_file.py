"""The daemon's log file, rotated by size while it runs.

`specd start` points the daemon's stdout and stderr at the log (so a crash before Python
starts is in it too) and tells it the path (`serve --log-file`). The daemon then checks
the file's size every second: past the limit, the file becomes `<log>.1` (replacing the
previous one) and file descriptors 1 and 2 move to a fresh log, so native libraries'
output is rotated with Python's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

CHECK_EVERY = 1.0  # seconds


class LogRotation:
    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specd-log-rotation",
                                        daemon=True)

    def writes_to_log(self) -> bool:
        """Whether stderr is the log file (a foreground `serve --log-file` may not be)."""
        try:
            ours, log = os.fstat(2), self.path.stat()
        except OSError:
            return False
        return (ours.st_dev, ours.st_ino) == (log.st_dev, log.st_ino)

    def start(self) -> bool:
        """Watch the log (False, and nothing done, where stderr is not the log)."""
        if not self.writes_to_log():
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """Rotate if the log is past its limit; whether it was."""
        try:
            size = os.fstat(2).st_size
        except OSError:
            return False
        if size <= self.max_bytes:
            return False
        self.rotate()
        return True

    def rotate(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)

    def _watch(self) -> None:
        while not self._stop.wait(CHECK_EVERY):
            with contextlib.suppress(OSError):
                self.check()
