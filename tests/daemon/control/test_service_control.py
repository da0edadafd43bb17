"""`specd start/status/stop/restart/config` as subprocesses against a tiny model, plus the
config file, stale pid files and `serve`'s SIGTERM handling."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from specd.daemon.control import config as config_mod
from specd.daemon.control import service_control as sc

CLI = [sys.executable, "-m", "specd.daemon.cli"]
NAME = "tiny-qwen2-Q8_0"  # general.name of the tiny model


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Private state/runtime/config dirs (the cache stays shared: built graphs are reused).
    The runtime dir is short: Unix socket paths are limited to ~100 bytes."""
    run = Path(tempfile.mkdtemp(prefix="specd-run-"))
    values = {"SPECD_STATE_DIR": str(tmp_path / "state"), "SPECD_RUNTIME_DIR": str(run),
              "SPECD_CONFIG_DIR": str(tmp_path / "config")}
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    for key in config_mod.KEYS:
        monkeypatch.delenv(f"SPECD_{key.upper()}", raising=False)
    yield {**os.environ, **values}
    pid = sc.read_pid()  # never leave a daemon behind
    if pid and pid > 0 and sc.is_specd_process(pid):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(run, ignore_errors=True)


def cli(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(arch="qwen2", weight_type="Q8_0")


# -- config -------------------------------------------------------------------------------
def test_config_file_and_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_mod.load_config() == {}
    config_mod.set_value("port", "0")
    config_mod.set_value("model", 'a "quoted" \\ name')
    assert config_mod.load_config() == {"port": 0, "model": 'a "quoted" \\ name'}
    assert config_mod.config_path().read_text().startswith("# specd configuration")
    monkeypatch.setenv("SPECD_PORT", "1234")
    monkeypatch.setenv("SPECD_SLOTS", "3")
    assert config_mod.load_config() == {"port": 1234, "slots": 3,
                                        "model": 'a "quoted" \\ name'}
    config_mod.set_value("model", None)
    assert config_mod.read_file() == {"port": 0}
    with pytest.raises(config_mod.ConfigError, match="unknown config key"):
        config_mod.set_value("colour", "red")
    with pytest.raises(config_mod.ConfigError, match="must be an integer"):
        config_mod.set_value("slots", "many")
    # what `specd serve` would refuse is refused now, not at the next start
    with pytest.raises(config_mod.ConfigError, match="slots must be at least 1"):
        config_mod.set_value("slots", "0")
    with pytest.raises(config_mod.ConfigError, match="port must be at least 0 and at most "
                                                     "65535, not 70000"):
        config_mod.set_value("port", "70000")
    with pytest.raises(config_mod.ConfigError, match="spec_type must be one of auto, none"):
        config_mod.set_value("spec_type", "bogus")
    config_mod.set_value("spec_type", "draft+ngram")
    config_mod.set_value("spec_type", None)
    config_mod.set_value("keep_alive", "1h30m")  # serve's --keep-alive
    with pytest.raises(config_mod.ConfigError, match="keep_alive: not a duration"):
        config_mod.set_value("keep_alive", "soon")
    config_mod.set_value("keep_alive", None)
    monkeypatch.setenv("SPECD_SLOTS", "x")
    with pytest.raises(config_mod.ConfigError, match="SPECD_SLOTS"):
        config_mod.load_config()
    config_mod.config_path().write_text("port = [")
    with pytest.raises(config_mod.ConfigError, match="config.toml"):
        config_mod.read_file()


def test_start_argv_from_options_and_config(env: dict[str, str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from specd.daemon.cli import main as cli
    from specd.daemon.cli import serve as cli_serve
    from specd.daemon.cli.service import _argv_for, _start_args

    p = argparse.ArgumentParser()
    actions = _start_args(p, cli._add_model_args, cli._add_sampling_args,
                          cli_serve.add_serve_args)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    args = p.parse_args(["-m", "m.gguf", "--slots", "3", "--allow-origin", "a",
                         "--allow-origin", "b", "--require-token"])
    assert _argv_for(args, actions, None) == [
        "--model", str(model), "--slots", "3", "--require-token",
        "--allow-origin", "a", "--allow-origin", "b"]
    cfg = {"model": "catalog-name", "slots": 5, "port": 0, "host": "127.0.0.1"}
    argv = _argv_for(p.parse_args([]), actions, cfg)
    assert argv == ["--model", "catalog-name", "--port", "0", "--slots", "5"]  # host: default
    assert _argv_for(p.parse_args(["--slots", "1"]), actions, cfg)[-2:] == ["--slots", "1"]
    # typed at serve's own default, an option still wins over the config
    given = p.parse_args(["-m", "qwen2.5-coder-1.5b-instruct", "--port", "8080", "-c", "4096",
                          "--no-spec-adaptive"])
    cfg = {"model": "smollm2-135m-instruct", "port": 8799, "n_ctx": 1024}
    argv = _argv_for(given, actions, cfg)
    assert argv[argv.index("--model") + 1] == "qwen2.5-coder-1.5b-instruct"
    assert argv[argv.index("--port") + 1] == "8080"
    assert argv[argv.index("--ctx-size") + 1] == "4096"
    assert "--no-spec-adaptive" in argv
    assert _argv_for(p.parse_args(["--spec-adaptive"]), actions, None) == ["--spec-adaptive"]
    # -md twice (a head and a draft model): both passed on, a file made absolute
    (tmp_path / "h.gguf").write_bytes(b"")
    two = _argv_for(p.parse_args(["-md", "h.gguf", "-md", "qwen2.5-coder-0.5b-instruct"]),
                    actions, None)
    assert two == ["--model-draft", str(tmp_path / "h.gguf"),
                   "--model-draft", "qwen2.5-coder-0.5b-instruct"]
    assert _argv_for(p.parse_args([]), actions, {"draft": "d"}) == ["--model-draft", "d"]


def test_upstreams_in_the_config_reach_serve(env: dict[str, str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`specd config set upstream` / `upstream_token_file` (comma-separated, checked as
    serve checks them) round-trip through the file, and `specd start` passes them on as
    serve's repeated options, which serve reads into its upstreams with their tokens."""
    from specd.daemon.cli import main as cli_main
    from specd.daemon.cli import serve as cli_serve
    from specd.daemon.cli.service import _argv_for, _start_args

    token = tmp_path / "big.token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    r = cli(env, "config", "set", "upstream", "big=http://gpu-box:8000/v1, small=http://h:9")
    assert r.returncode == 0, r.stderr
    monkeypatch.chdir(tmp_path)  # a relative PATH is made absolute when set
    config_mod.set_value("upstream_token_file", "big=big.token")
    assert config_mod.read_file() == {"upstream": ["big=http://gpu-box:8000/v1",
                                                   "small=http://h:9"],
                                      "upstream_token_file": [f"big={token}"]}
    shown = json.loads(cli(env, "config", "show", "--json").stdout)
    assert shown["values"]["upstream"] == ["big=http://gpu-box:8000/v1", "small=http://h:9"]
    monkeypatch.setenv("SPECD_UPSTREAM", "env=http://e:1")  # the environment overrides
    assert config_mod.load_config()["upstream"] == ["env=http://e:1"]
    monkeypatch.delenv("SPECD_UPSTREAM")

    p = argparse.ArgumentParser()
    actions = _start_args(p, cli_main._add_model_args, cli_main._add_sampling_args,
                          cli_serve.add_serve_args)
    argv = _argv_for(p.parse_args([]), actions, config_mod.load_config())
    assert argv == ["--upstream", "big=http://gpu-box:8000/v1", "--upstream",
                    "small=http://h:9", "--upstream-token-file", f"big={token}"]
    # an option given to start wins over the config's list
    given = _argv_for(p.parse_args(["--upstream", "x=http://x:1"]), actions,
                      config_mod.load_config())
    assert given[:2] == ["--upstream", "x=http://x:1"] and "big=http://gpu-box:8000/v1" \
        not in given
    serve = argparse.ArgumentParser()
    cli_serve.add_serve_args(serve)
    specs = cli_serve.upstreams(serve.parse_known_args(argv)[0])
    assert [(u.name, u.endpoint, u.token) for u in specs] == [
        ("big", "http://gpu-box:8000/v1/chat/completions", "s3cret"),
        ("small", "http://h:9/v1/chat/completions", None)]

    for key, value, error in [
            ("upstream", "big", "expected NAME=URL"),
            ("upstream", "a=ftp://x", "expected NAME=URL"),
            ("upstream", "a=http://x,a=http://y", "a NAME is given twice"),
            ("upstream_token_file", "big", "expected NAME=PATH")]:
        with pytest.raises(config_mod.ConfigError, match=error):
            config_mod.set_value(key, value)
    config_mod.config_path().write_text('upstream = "big=http://x:1"\n')
    assert config_mod.read_file() == {"upstream": ["big=http://x:1"]}
    config_mod.config_path().write_text("upstream = [1]\n")
    with pytest.raises(config_mod.ConfigError, match="must be a list of strings"):
        config_mod.read_file()
    config_mod.config_path().write_text('upstream = ["big=http://x:1"]\n')
    config_mod.set_value("upstream", "")  # removed
    assert "upstream" not in config_mod.read_file()


# -- pid files ----------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["pytest", "dead", "garbage"])
def test_stale_pid_file(env: dict[str, str], content: str) -> None:
    if content == "pytest":  # alive, but not a specd daemon
        text = str(os.getpid())
    elif content == "dead":
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        text = str(proc.pid)
    else:
        text = "not a pid"
    sc.pid_path().write_text(text + "\n")
    sc.info_path().write_text("{}")
    r = cli(env, "status")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "not running" in r.stdout
    assert not sc.pid_path().exists() and not sc.info_path().exists()
    sc.pid_path().write_text(text + "\n")
    r = cli(env, "stop")
    assert r.returncode == 3 and "not running" in r.stderr
    assert not sc.pid_path().exists()


class _Uids:
    def __init__(self, real: int) -> None:
        self.real = real


@pytest.mark.parametrize("owner, created, ours", [
    ("other", 100.0, False),  # another user's process: never our daemon
    ("us", 100.0, True),  # ours, begun when start recorded it
    ("us", 500.0, False),  # ours, but begun long after: the pid was reused
])
def test_pid_reused_by_a_process_we_may_not_inspect(env: dict[str, str],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    owner: str, created: float,
                                                    ours: bool) -> None:
    """macOS denies reading another user's command line: the pid file's pid, reused by
    such a process, must not block `specd start` forever."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sc.pid_path().write_text(f"{proc.pid}\n")
        sc.write_info({"pid": proc.pid, "started": 100.0})
        uid = os.getuid() if owner == "us" else os.getuid() + 1

        def denied(self: object) -> list[str]:
            raise psutil.AccessDenied(proc.pid)

        monkeypatch.setattr(psutil.Process, "cmdline", denied)
        monkeypatch.setattr(psutil.Process, "uids", lambda self: _Uids(uid))
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: created)
        assert sc.is_specd_process(proc.pid) is ours
        assert (sc.running_pid() == proc.pid) is ours
        assert sc.pid_path().exists() is ours  # a stale pid file is removed
    finally:
        proc.kill()
        proc.wait()


def test_failed_start_reports_the_log(env: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = cli(env, "start", "-m", str(bad), "--port", "0", "--no-fetch")
    assert r.returncode == 1
    assert r.stderr.startswith("specd: error: specd exited with status")
    assert "broken.gguf" in r.stderr  # the daemon's own error, from the log's tail
    assert not sc.pid_path().exists()
    assert "specd start: --model" in sc.log_path().read_text()


# -- the real thing -----------------------------------------------------------------------
def test_start_status_request_restart_stop(env: dict[str, str], tiny: Path) -> None:
    from specd.ipc.client import Client

    assert cli(env, "config", "set", "model", str(tiny)).returncode == 0
    assert cli(env, "config", "set", "port", "0").returncode == 0
    t0 = time.monotonic()
    r = cli(env, "start", "--slots", "1")  # model and port from the config
    assert r.returncode == 0, r.stderr
    assert "specd started (pid" in r.stdout and NAME in r.stdout
    started_in = time.monotonic() - t0
    pid = sc.read_pid()
    assert pid and sc.is_specd_process(pid)

    r = cli(env, "start", "-m", str(tiny), "--port", "0")
    assert r.returncode == 1 and "already running" in r.stderr

    sock = Path(env["SPECD_RUNTIME_DIR"]) / "specd.sock"
    out = Client(sock, timeout=120).post("/completion", {"prompt": "hello", "n_predict": 8})
    assert isinstance(out["content"], str)
    assert out.get("tokens_predicted", 8) > 0

    r = cli(env, "status")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"pid {pid}" in r.stdout and NAME in r.stdout and str(sock) in r.stdout
    assert "slots:      1 (1 idle)" in r.stdout
    st = json.loads(cli(env, "status", "--json").stdout)
    assert st["running"] and st["pid"] == pid and st["socket"] == str(sock)
    assert st["props"]["target"]["name"] == NAME
    assert st["slots"][0]["state"] == "idle"
    assert st["metrics"]["specd_requests_total"] >= 1
    assert st["url"].startswith("http://127.0.0.1:") and not st["url"].endswith(":0")

    r = cli(env, "restart")  # same options as the last start (--slots 1) + config
    assert r.returncode == 0, r.stderr
    assert f"specd stopped (pid {pid})" in r.stdout
    new_pid = sc.read_pid()
    assert new_pid and new_pid != pid and not sc.is_alive(pid)
    assert json.loads(cli(env, "status", "--json").stdout)["props"]["slots"] == 1

    os.kill(new_pid, signal.SIGKILL)  # a crash: stale pid, info and socket files
    deadline = time.monotonic() + 10
    while sc.is_alive(new_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    r = cli(env, "restart")  # still the last start's options
    assert r.returncode == 0, r.stderr
    new_pid = sc.read_pid()
    assert json.loads(cli(env, "status", "--json").stdout)["props"]["slots"] == 1
    # the model unloaded and loaded again, as the tray's item asks (llama-server's routes)
    r = cli(env, "unload")
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 30
    while "(unloaded while idle)" not in cli(env, "status").stdout:
        assert time.monotonic() < deadline, "the model did not unload"
        time.sleep(0.2)
    r = cli(env, "load")
    assert r.returncode == 0 and "model loaded" in r.stdout, r.stderr
    assert json.loads(cli(env, "status", "--json").stdout)["props"]["loaded"] is True

    t1 = time.monotonic()
    r = cli(env, "stop")
    assert r.returncode == 0, r.stderr
    assert f"specd stopped (pid {new_pid})" in r.stdout and "killed" not in r.stdout
    assert time.monotonic() - t1 < 15
    assert not sc.is_alive(new_pid)
    assert not sc.pid_path().exists() and not sock.exists()
    r = cli(env, "stop")
    assert r.returncode == 3 and "not running" in r.stderr
    r = cli(env, "status")
    assert r.returncode == 3 and "not running" in r.stdout
    r = cli(env, "unload")
    assert r.returncode == 3 and "not running" in r.stderr
    assert started_in < 120


def test_start_refuses_when_a_foreground_serve_answers(env: dict[str, str],
                                                       tiny: Path) -> None:
    sock = Path(env["SPECD_RUNTIME_DIR"]) / "specd.sock"
    proc = subprocess.Popen([*CLI, "serve", "-m", str(tiny), "--port", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_socket(proc, sock)
        r = cli(env, "start", "-m", str(tiny), "--port", "0")
        assert r.returncode == 1 and "already answers" in r.stderr
        r = cli(env, "status")
        assert r.returncode == 0 and "not started by `specd start`" in r.stdout
        r = cli(env, "stop")
        assert r.returncode == 1 and "not started by `specd start`" in r.stderr
    finally:
        proc.kill()
        proc.wait()


def _wait_socket(proc: subprocess.Popen, sock: Path, timeout: float = 120) -> None:
    from specd.ipc.client import Client

    deadline = time.monotonic() + timeout
    while not Client(sock, timeout=2).health():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.2)


def test_serve_exits_cleanly_on_sigterm(env: dict[str, str], tiny: Path) -> None:
    """`specd stop` and service managers send SIGTERM: exit 0, socket removed."""
    sock = Path(env["SPECD_RUNTIME_DIR"]) / "specd.sock"
    proc = subprocess.Popen([*CLI, "serve", "-m", str(tiny), "--port", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_socket(proc, sock)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_does_not_wait_for_idle_keep_alive_connections(env: dict[str, str],
                                                                tiny: Path) -> None:
    """An editor plugin holding a keep-alive connection must not delay `specd stop`
    (aiohttp's default grace is 60 s)."""
    import socket

    sock = Path(env["SPECD_RUNTIME_DIR"]) / "specd.sock"
    proc = subprocess.Popen([*CLI, "serve", "-m", str(tiny), "--port", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_socket(proc, sock)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(sock))
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: specd\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            assert time.monotonic() - t0 < 20
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_status_learns_the_port_a_start_stopped_waiting_for(env: dict[str, str],
                                                            tiny: Path) -> None:
    """A TCP-only start on any free port that gave up waiting (--wait 0) leaves the port
    unknown; status reads it from the daemon's log once it serves."""
    r = cli(env, "start", "-m", str(tiny), "--no-socket", "--port", "0", "--wait", "0")
    assert r.returncode == 1 and "it is left running" in r.stderr, r.stderr
    try:
        deadline = time.monotonic() + 120
        st: dict = {}
        while time.monotonic() < deadline:
            st = json.loads(cli(env, "status", "--json").stdout)
            if st.get("props"):
                break
            time.sleep(0.3)
        assert st["running"] and st["props"]["slots"] >= 1, st
        assert st["url"].startswith("http://127.0.0.1:") and st["socket"] is None
    finally:
        assert cli(env, "stop").returncode == 0



def test_sigterm_during_a_stream_ends_it_with_an_error_event(env: dict[str, str],
                                                              tiny: Path) -> None:
    """`specd stop` while a client streams: the generation is cancelled, the stream ends
    with an error event (or [DONE] where it had finished), the daemon exits well within
    its grace, and the log has no tracebacks."""
    import socket

    sock = Path(env["SPECD_RUNTIME_DIR"]) / "specd.sock"
    proc = subprocess.Popen([*CLI, "serve", "-m", str(tiny), "--port", "0", "-c", "1024"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_socket(proc, sock)
        body = json.dumps({"prompt": "hi", "n_predict": 1000, "ignore_eos": True,
                           "stream": True}).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            conn.connect(str(sock))
            conn.sendall(b"POST /completion HTTP/1.1\r\nHost: specd\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            data = conn.recv(65536)
            while b"data: " not in data:
                data += conn.recv(65536)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while chunk := conn.recv(65536):
                data += chunk
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10
        events = [line[6:] for line in data.decode().splitlines()
                  if line.startswith("data: ")]
        last = events[-1]
        assert last == "[DONE]" or json.loads(last).get("stop") is True or (
            "shutting down" in json.loads(last)["error"]["message"]), last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
