"""The daemon's log rotated by size while it runs (`serve --log-file`, which `specd start`
passes): Python's output and what native code writes to fd 2 both move to a fresh file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from specd.daemon.control.log_file import LogRotation
from specd.daemon.control.service_control import serve_command

_DAEMON = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from specd.daemon.control.log_file import LogRotation

    rotation = LogRotation(Path(sys.argv[1]), max_bytes=2000)
    assert rotation.start()
    print("python " * 400, flush=True)          # 2.8 kB: past the limit
    os.write(2, b"native " * 10 + b"\\n")       # as a C library writes
    deadline = time.monotonic() + 30
    while not Path(sys.argv[1] + ".1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("after rotation", flush=True)
    os.write(2, b"native after\\n")
    rotation.stop()
""")


def test_a_log_past_its_limit_moves_aside_and_output_goes_on_in_a_fresh_one(
        tmp_path: Path) -> None:
    log = tmp_path / "specd.log"
    with log.open("ab") as f:  # as `specd start` opens it for the daemon
        r = subprocess.run([sys.executable, "-c", _DAEMON, str(log)], stdout=f,
                           stderr=subprocess.STDOUT, timeout=60, check=False)
    assert r.returncode == 0, log.read_text()[-2000:]
    old = (tmp_path / "specd.log.1").read_text()
    assert old.startswith("python python") and "native native" in old
    assert log.read_text() == "after rotation\nnative after\n"


def test_nothing_is_rotated_where_stderr_is_not_the_log(tmp_path: Path) -> None:
    log = tmp_path / "specd.log"
    log.write_text("x" * 5000)
    rotation = LogRotation(log, max_bytes=10)
    assert not rotation.writes_to_log() and not rotation.start()
    assert log.read_text() == "x" * 5000


def test_start_tells_the_daemon_its_log() -> None:
    cmd = serve_command(["-m", "model.gguf"], log=Path("/state/specd.log"))
    assert cmd[-2:] == ["--log-file", "/state/specd.log"] and "serve" in cmd
    assert "--log-file" not in serve_command(["-m", "model.gguf"])
