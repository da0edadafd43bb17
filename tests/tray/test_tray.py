"""The tray: its state logic for every daemon state, its icons, and (under Xvfb, with pystray's
xorg backend docked in trayer) the real app against a real daemon, with screenshots saved to
artifacts/tray*.png."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specd.daemon.control.service_control import DaemonSnapshot
from specd.ipc.client import DaemonError
from specd.tray import state as ts

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


def snap(slot_states: tuple[str, ...] = ("idle", "idle"), draft: str | None = "d-0.5b",
         drafted: int = 40, tps: float = 12.34) -> DaemonSnapshot:
    props: dict = {"target": {"name": "t-1.5b"}, "spec_type": "draft" if draft else "none",
                   "n_ctx": 4096, "slots": len(slot_states)}
    if draft:
        props["draft"] = {"name": draft}
    return DaemonSnapshot(props, [{"id": i, "state": s} for i, s in enumerate(slot_states)],
                          {"specd_tokens_per_second": tps,
                           "specd_mean_acceptance_length": 2.5 if drafted else 0.0,
                           "specd_draft_tokens_total": float(drafted),
                           "specd_draft_tokens_accepted_total": drafted * 0.6})


def texts(v: ts.TrayView) -> list[str]:
    return [i.text for i in v.items]


def defaults(v: ts.TrayView) -> list[str | None]:
    return [i.action for i in v.items if i.default]


# -- state logic --------------------------------------------------------------------------
def test_down() -> None:
    v = ts.view(None)
    assert v.state is ts.IconState.DOWN and v.title == "specd: not running"
    assert v.actions() == ["start", "open_log", "open_config", "quit"]
    assert defaults(v) == ["start"]


def test_starting() -> None:
    """Launched by `specd start`, still loading: Stop works, Start would only fail."""
    v = ts.view(ts.Starting(4242))
    assert v.state is ts.IconState.STARTING and v.title == "specd: starting (pid 4242)"
    assert v.actions() == ["stop", "open_log", "open_config", "quit"]
    assert defaults(v) == ["open_log"]


def test_error() -> None:
    v = ts.view(DaemonError(500, "internal error: boom\ntraceback..."))
    assert v.state is ts.IconState.ERROR
    assert v.title == "specd: error: HTTP 500: internal error: boom"
    assert "Error: HTTP 500: internal error: boom" in texts(v)
    assert v.actions() == ["stop", "restart", "open_log", "open_config", "quit"]
    assert defaults(v) == ["restart"]
    assert ts.view(TimeoutError()).title == "specd: error: TimeoutError"


def test_a_head_beside_a_draft_model_names_both() -> None:
    s = snap()
    s.props["head"] = {"name": "h.gguf"}
    assert s.draft == "h.gguf + d-0.5b"
    assert "Draft: h.gguf + d-0.5b" in texts(ts.view(s))


def test_idle_with_draft() -> None:
    v = ts.view(snap())
    assert v.state is ts.IconState.IDLE
    assert v.title == "specd: idle - t-1.5b + d-0.5b, 12.3 tok/s, acceptance 2.50"
    assert texts(v)[:6] == ["Target: t-1.5b", "Draft: d-0.5b", "Speculation: draft",
                            "Slots: 0/2 busy", "Speed: 12.3 tokens/s",
                            "Acceptance: 2.50 tokens/round"]
    assert v.actions() == ["stop", "restart", "unload", "open_log", "open_config", "quit"]
    assert all(not i.enabled for i in v.items[:6])  # information lines


def test_a_model_unloaded_while_idle_offers_to_load() -> None:
    s = snap()
    s.props["loaded"] = False
    v = ts.view(s)
    assert texts(v)[0] == "Target: t-1.5b (unloaded while idle)"
    assert v.actions() == ["stop", "restart", "load", "open_log", "open_config", "quit"]


def test_the_other_models_are_shown_and_the_loaded_ones_offered_for_unloading() -> None:
    s = snap()
    s.models.extend([{"id": "t-1.5b", "owned_by": "specd", "status": {"value": "loaded"}},
                     {"id": "chat-3b", "owned_by": "specd", "status": {"value": "loaded"}},
                     {"id": "coder-7b", "owned_by": "specd",
                      "status": {"value": "unloaded"}},
                     {"id": "big", "owned_by": "upstream"}])
    v = ts.view(s)
    assert texts(v)[3:5] == ["Model: chat-3b", "Model: coder-7b (unloaded)"]
    assert v.actions() == ["stop", "restart", "unload", "unload:chat-3b", "open_log",
                           "open_config", "quit"]


@pytest.mark.parametrize("states", [("generating", "idle"), ("prefill", "idle"),
                                    ("generating", "prefill")])
def test_generating(states: tuple[str, ...]) -> None:
    v = ts.view(snap(states))
    assert v.state is ts.IconState.GENERATING
    assert v.title.startswith("specd: generating - t-1.5b")
    busy = sum(s != "idle" for s in states)
    assert f"Slots: {busy}/2 busy" in texts(v)


def test_no_draft_fresh_daemon() -> None:
    v = ts.view(snap(draft=None, drafted=0, tps=0.0))
    assert v.state is ts.IconState.IDLE
    assert v.title == "specd: idle - t-1.5b"
    assert "Draft: none" in texts(v) and "Acceptance: -" in texts(v)
    assert "Speculation: none" in texts(v)


def test_app_refresh_and_actions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from specd.tray import app

    monkeypatch.setenv("SPECD_CONFIG_DIR", str(tmp_path / "config"))
    seen: list[ts.Observation] = [None, snap(("generating",))]
    monkeypatch.setattr(app, "poll", lambda: seen.pop(0))
    a = app.TrayApp()
    assert a.refresh().state is ts.IconState.DOWN
    a.note = "specd: error: no model"
    v = a.refresh()
    assert v.state is ts.IconState.GENERATING
    assert texts(v)[0] == "Last action: specd: error: no model"
    opened: list[Path] = []
    monkeypatch.setattr(app, "open_path", opened.append)
    a.act("open_config")
    assert opened == [tmp_path / "config" / "config.toml"] and opened[0].is_file()
    ran: list[list[str]] = []
    monkeypatch.setattr(app.subprocess, "run", lambda argv, **kw: ran.append(argv) or
                        subprocess.CompletedProcess(argv, 0, "", ""))
    a._wake.clear()
    a.act("unload:chat-3b")  # the CLI, on a thread, which wakes the poller when done
    assert a._wake.wait(10)
    assert ran == [app._cli("unload", "chat-3b")] and ran[0][-2:] == ["unload", "chat-3b"]


def test_poll_without_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from specd.tray import app

    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SPECD_RUNTIME_DIR", str(tmp_path / "run"))
    assert app.poll() is None


def test_icons_differ_per_state() -> None:
    pytest.importorskip("PIL")
    from specd.tray.app import COLORS, icon_image

    imgs = {s: icon_image(s) for s in ts.IconState}
    assert all(i.size == (64, 64) and i.mode == "RGBA" for i in imgs.values())
    assert len({i.tobytes() for i in imgs.values()}) == len(ts.IconState)
    for s in (ts.IconState.IDLE, ts.IconState.GENERATING, ts.IconState.ERROR):
        assert imgs[s].getpixel((10, 32))[:3] == COLORS[s]
    assert imgs[ts.IconState.DOWN].getpixel((32, 32))[3] == 0  # a ring: hollow
    assert imgs[ts.IconState.STARTING].getpixel((32, 32))[:3] == COLORS[ts.IconState.STARTING]
    assert imgs[ts.IconState.STARTING].getpixel((14, 32))[3] == 0  # a ring around a dot


# -- the real app under Xvfb --------------------------------------------------------------
def _cli_has(command: str) -> bool:
    from specd.daemon.cli import main as cli

    sub = next(a for a in cli.build_parser()._actions
               if a.__class__.__name__ == "_SubParsersAction")
    return command in sub.choices


def _start_xvfb() -> tuple[subprocess.Popen, str]:
    """Xvfb on a free display number (not -displayfd: it fails now and then here)."""
    errors = ""
    base = 100 + os.getpid() % 400
    for num in range(base, base + 20):
        if Path(f"/tmp/.X{num}-lock").exists() or Path(f"/tmp/.X11-unix/X{num}").exists():
            continue
        log = tempfile.TemporaryFile()  # Xvfb's stderr, for the skip reason
        proc = subprocess.Popen(["Xvfb", f":{num}", "-screen", "0", "320x120x24", "-nolisten",
                                 "tcp"], stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                _titles(f":{num}")
                return proc, f":{num}"
            except Exception:  # Xlib's connection errors: not up yet
                time.sleep(0.1)
        proc.kill()
        proc.wait()
        log.seek(0)
        errors = log.read().decode(errors="replace").strip()[-300:]
    pytest.skip(f"Xvfb did not start: {errors!r}")


def _titles(display: str) -> list[str]:
    from Xlib import display as xdisplay
    from Xlib import error as xerror

    d = xdisplay.Display(display)
    out: list[str] = []

    def walk(w: object) -> None:
        for c in w.query_tree().children:  # type: ignore[attr-defined]
            with contextlib.suppress(xerror.XError):
                name = c.get_wm_name()
                if isinstance(name, str | bytes) and name:
                    out.append(name if isinstance(name, str) else name.decode())
                walk(c)

    try:
        walk(d.screen().root)
    finally:
        d.close()
    return out


def _wait_title(display: str, prefix: str, timeout: float = 60,
                tray: subprocess.Popen | None = None, log: Path | None = None,
                dump: bool = True) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (tray is None or tray.poll() is None):
        for t in _titles(display):
            if t.startswith(prefix):
                return t
        time.sleep(0.2)
    why = "" if tray is None or tray.poll() is None else f" (the tray exited: {tray.poll()})"
    # a stack dump of a running Python's threads can itself crash it (faulthandler reads
    # their frames unlocked): only where this wait failing fails the test
    if dump and tray is not None and tray.poll() is None and hasattr(signal, "SIGUSR1"):
        tray.send_signal(signal.SIGUSR1)  # its threads' stacks, into the log
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""
    raise AssertionError(f"no window titled {prefix!r}{why}; have {_titles(display)}\n{tail}")


def _shot(display: str, name: str) -> object:
    from PIL import ImageGrab

    ARTIFACTS.mkdir(exist_ok=True)
    img = ImageGrab.grab(xdisplay=display)
    img.save(ARTIFACTS / name)
    return img


def _menu_preview(v: ts.TrayView) -> object:
    """What the menu holds (pystray's xorg backend has no menus to screenshot)."""
    from PIL import Image, ImageDraw

    from specd.tray.app import icon_image

    rows = [v.title, *(("  " if not i.enabled else "> ") + i.text if i.text != "-"
                       else "  ------" for i in v.items)]
    img = Image.new("RGB", (460, 40 + 14 * len(rows)), (32, 32, 32))
    img.paste(icon_image(v.state, 32), (4, 4), icon_image(v.state, 32))
    d = ImageDraw.Draw(img)
    for n, row in enumerate(rows):
        d.text((44 if n == 0 else 12, 14 if n == 0 else 30 + 14 * n), row,
               fill=(255, 255, 255) if n == 0 or row.startswith(">") else (160, 160, 160))
    return img


def _start_trayer(display: str) -> subprocess.Popen:
    """A tray host to dock in (without one the icon stays unmapped)."""
    return subprocess.Popen(
        ["trayer", "--edge", "top", "--align", "center", "--widthtype", "request",
         "--height", "32", "--SetDockType", "false", "--SetPartialStrut", "false",
         "--transparent", "false", "--tint", "0x404040"],
        env={**os.environ, "DISPLAY": display}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
        if p.poll() is None:
            p.kill()
            p.wait()


def _need_tray_deps() -> None:
    if not shutil.which("Xvfb"):
        pytest.skip("Xvfb is not installed (apt-get install xvfb)")
    for mod in ("pystray", "PIL", "Xlib"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install 'specd[tray]')")


@pytest.fixture
def xvfb() -> Iterator[str]:
    _need_tray_deps()
    proc, display = _start_xvfb()
    procs = [proc]
    if shutil.which("trayer"):
        procs.append(_start_trayer(display))
    try:
        yield display
    finally:
        _stop_all(procs)


def _idle_icon_on_screen(display: str, name: str, timeout: float) -> bool:
    """Whether the green idle icon shows, screenshotting until `timeout` seconds pass."""
    from specd.tray.app import COLORS

    deadline = time.monotonic() + timeout
    while True:
        img = _shot(display, name)
        if COLORS[ts.IconState.IDLE] in {c for _, c in img.getcolors(1 << 16) or []}:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def test_icon_docks_into_a_tray_host_that_starts_later(tiny_model_factory: Callable[..., Path],
                                                       tmp_path: Path) -> None:
    """A panel still loading at login: the tray app starts first, the host later."""
    _need_tray_deps()
    if not shutil.which("trayer"):
        pytest.skip("trayer is not installed (apt-get install trayer)")
    from specd.ipc.client import Client

    run = Path(tempfile.mkdtemp(prefix="specd-run-"))
    dirs = {"SPECD_STATE_DIR": str(tmp_path / "state"), "SPECD_RUNTIME_DIR": str(run),
            "SPECD_CONFIG_DIR": str(tmp_path / "config")}
    xvfb_proc, display = _start_xvfb()
    env = {**os.environ, **dirs, "DISPLAY": display, "PYSTRAY_BACKEND": "xorg"}
    tiny = tiny_model_factory(arch="qwen2", weight_type="Q8_0")
    procs = [xvfb_proc]
    tray_log = tmp_path / "tray.log"
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "specd.daemon.cli", "serve", "-m", str(tiny), "--port", "0",
             "--slots", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with tray_log.open("wb") as f:
            tray = subprocess.Popen([sys.executable, "-m", "specd.tray", "--interval", "0.25"],
                                    env=env, stdout=f, stderr=subprocess.STDOUT)
        procs.append(tray)
        deadline = time.monotonic() + 120
        while not Client(run / "specd.sock", timeout=2).health():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        _wait_title(display, "specd: idle", 60, tray, tray_log)  # up and idle, in no tray
        time.sleep(1.0)
        assert not _idle_icon_on_screen(display, "tray-late-before.png", 0)
        procs.append(_start_trayer(display))
        assert _idle_icon_on_screen(display, "tray-late.png", 30), \
            tray_log.read_text(errors="replace")[-1500:]
    finally:
        _stop_all(procs)
        shutil.rmtree(run, ignore_errors=True)


def test_tray_under_xvfb(xvfb: str, tiny_model_factory: Callable[..., Path],
                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specd.ipc.client import Client

    run = Path(tempfile.mkdtemp(prefix="specd-run-"))
    dirs = {"SPECD_STATE_DIR": str(tmp_path / "state"), "SPECD_RUNTIME_DIR": str(run),
            "SPECD_CONFIG_DIR": str(tmp_path / "config")}
    for k, v in dirs.items():
        monkeypatch.setenv(k, v)
    env = {**os.environ, **dirs, "DISPLAY": xvfb, "PYSTRAY_BACKEND": "xorg"}
    tiny = tiny_model_factory(arch="qwen2", weight_type="Q8_0")
    sock = run / "specd.sock"
    cli = [sys.executable, "-m", "specd.daemon.cli"]
    serve_args = ["-m", str(tiny), "--port", "0", "--slots", "1"]
    background = _cli_has("start")  # `specd start`, as in test_service_control; else serve
    daemon = subprocess.Popen([*cli, "start" if background else "serve", *serve_args], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tray_log = tmp_path / "tray.log"
    with tray_log.open("wb") as f:  # a file, not a pipe nobody reads (it could fill up)
        tray = subprocess.Popen([sys.executable, "-m", "specd.tray", "--interval", "0.25"],
                                env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait(prefix: str, timeout: float = 60, dump: bool = True) -> str:
        return _wait_title(xvfb, prefix, timeout, tray, tray_log, dump)

    try:
        assert wait("specd: ").startswith("specd: ")  # the tray is up
        deadline = time.monotonic() + 120
        while not Client(sock, timeout=2).health():
            assert (background or daemon.poll() is None) and time.monotonic() < deadline
            time.sleep(0.2)
        title = wait("specd: idle - tiny-qwen2-Q8_0")
        time.sleep(0.5)  # let the icon redraw
        if shutil.which("trayer"):  # a loaded machine redraws late
            assert _idle_icon_on_screen(xvfb, "tray.png", 30), \
                "the green idle icon is not on screen"
        else:
            _shot(xvfb, "tray.png")
        from specd.tray.app import poll

        _menu_preview(ts.view(poll())).save(ARTIFACTS / "tray-menu.png")  # type: ignore[attr-defined]

        # a long request: catch the generating state if the tiny model is slow enough
        body = {"prompt": "hello", "n_predict": 400, "ignore_eos": True}
        worker = threading.Thread(target=lambda: Client(sock, timeout=120).post(
            "/completion", body), daemon=True)
        worker.start()
        with contextlib.suppress(AssertionError):
            wait("specd: generating", timeout=10, dump=False)
            _shot(xvfb, "tray-generating.png")
        worker.join(timeout=120)

        if background:
            assert daemon.wait(timeout=120) == 0
            stop = subprocess.run([*cli, "stop"], env=env, capture_output=True, text=True,
                                  timeout=60, check=False)
            assert stop.returncode == 0, stop.stderr
        else:
            daemon.terminate()
            daemon.wait(timeout=30)
        wait("specd: not running", timeout=30)
        time.sleep(0.5)
        _shot(xvfb, "tray-down.png")
        assert tray.poll() is None, tray_log.read_text(errors="replace")[-1500:]
        assert "tiny-qwen2-Q8_0" in title
    finally:
        for p in (tray, daemon):
            if p.poll() is None:
                p.kill()
                p.wait()
        if background:
            subprocess.run([*cli, "stop", "--timeout", "5"], env=env, capture_output=True,
                           timeout=60, check=False)
        shutil.rmtree(run, ignore_errors=True)
