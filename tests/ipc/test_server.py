"""ipc.server and ipc.client edges: the socket file, a daemon that cannot be reached, how
the serving line is read back."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from specd.daemon.control import service_control as sc
from specd.ipc.client import Client, DaemonUnavailable
from specd.ipc.server import _prepare_socket


def test_a_file_in_the_sockets_place_is_left_alone(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    with pytest.raises(OSError, match="exists and is not a socket"):
        _prepare_socket(notes)
    assert notes.read_text() == "mine\n"


def test_a_stale_socket_is_replaced_with_a_private_one(tmp_path: Path) -> None:
    path = tmp_path / "specd.sock"
    old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old.bind(str(path))
    old.close()  # nobody listens: stale
    sock = _prepare_socket(path)
    try:
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o600
    finally:
        sock.close()


def test_unreachable_daemons_are_unavailable(tmp_path: Path) -> None:
    """Any failure to connect (here an AF_UNIX path too long to bind) means no daemon,
    not a daemon that answered badly."""
    deep = tmp_path / ("d" * 120) / "specd.sock"
    with pytest.raises(DaemonUnavailable):
        Client(deep, timeout=2).get("/health")
    with pytest.raises(DaemonUnavailable):
        Client(port=1, host="::1", timeout=2).get("/health")


@pytest.mark.parametrize("line, port", [
    ("specd: serving http://127.0.0.1:8799 and unix:/run/user/1/specd.sock", 8799),
    ("specd: serving http://[::1]:41027", 41027),
    ("specd: serving http://localhost:5", 5),
])
def test_the_serving_line_gives_the_port(line: str, port: int) -> None:
    m = sc._SERVING.search(line.encode())
    assert m is not None and int(m.group(2)) == port
    assert not re.search(r"\s", m.group(1).decode())


def test_a_served_port_or_socket_is_refused_before_loading(tmp_path: Path) -> None:
    from specd.ipc.server import ServeConfig, check_free

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    path = tmp_path / "specd.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen()
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_free(ServeConfig(port=port, socket_path=None))
        with pytest.raises(OSError, match="another specd is listening"):
            check_free(ServeConfig(port=0, socket_path=path))
    finally:
        busy.close()
        live.close()
    check_free(ServeConfig(port=port, socket_path=path))  # free now; the stale file is fine
