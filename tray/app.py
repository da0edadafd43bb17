"""`specd tray`: a system-tray icon for the daemon (pystray + Pillow, the `tray` extra).

A thread polls the daemon (/props, /slots, /metrics over the Unix socket) every few
seconds; `tray.state.view` turns what it saw into the icon, tooltip and menu.  Start / stop /
restart run the `specd` CLI in the background so the tray never blocks on a model load.
Backends without menus (pystray's xorg) get the default action on click.
Under a bare X server use PYSTRAY_BACKEND=xorg (and a tray host, e.g. trayer).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specd.daemon.control import config as config_mod
from specd.daemon.control import service_control as sc
from specd.ipc.client import DaemonUnavailable

from .state import (
    SEPARATOR,
    UNLOAD_ONE,
    IconState,
    MenuItem,
    Observation,
    Starting,
    TrayView,
    view,
)

ICON_SIZE = 64
COLORS: dict[IconState, tuple[int, int, int]] = {
    IconState.DOWN: (128, 128, 128),
    IconState.STARTING: (214, 150, 20),
    IconState.IDLE: (46, 160, 67),
    IconState.GENERATING: (31, 111, 235),
    IconState.ERROR: (207, 34, 46),
}


def icon_image(state: IconState, size: int = ICON_SIZE) -> Any:
    """A Pillow RGBA image per state: grey ring (down), amber ring around a dot (starting),
    green disc (idle), blue disc with a play arrow (generating), red disc with a bar and
    dot (error)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    m = size // 16
    box = (m, m, size - m - 1, size - m - 1)
    color = COLORS[state]
    if state in (IconState.DOWN, IconState.STARTING):
        d.ellipse(box, outline=color + (255,), width=max(size // 10, 2))
        if state is IconState.STARTING:
            q = size * 5 // 16
            d.ellipse((q, q, size - q - 1, size - q - 1), fill=color + (255,))
        return img
    d.ellipse(box, fill=color + (255,))
    c, r = size / 2, size / 4
    white = (255, 255, 255, 255)
    if state is IconState.GENERATING:
        d.polygon([(c - r * 0.6, c - r), (c - r * 0.6, c + r), (c + r, c)], fill=white)
    elif state is IconState.ERROR:
        w = size / 14
        d.rectangle((c - w, c - r * 1.1, c + w, c + r * 0.35), fill=white)
        d.ellipse((c - w * 1.2, c + r * 0.65, c + w * 1.2, c + r * 0.65 + w * 2.4), fill=white)
    else:
        d.ellipse((c - r * 0.45, c - r * 0.45, c + r * 0.45, c + r * 0.45), fill=white)
    return img


def poll(timeout: float = 3.0) -> Observation:
    """One look at the daemon: a snapshot, Starting (launched, not answering yet), None
    (down) or the exception (bad answer)."""
    pid = sc.running_pid()  # first: a crashed daemon's files must not point the client away
    try:
        return sc.fetch_snapshot(sc.client_for(timeout=timeout))
    except DaemonUnavailable:
        return Starting(pid) if pid is not None else None
    except Exception as exc:  # shown in the menu, never fatal
        return exc


def open_path(path: Path) -> None:
    if sys.platform == "win32":
        os.startfile(str(path))  # type: ignore[attr-defined]
        return
    opener = "open" if sys.platform == "darwin" else "xdg-open"
    with contextlib.suppress(OSError):
        subprocess.Popen([opener, str(path)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specd.daemon.cli", *args]


class TrayApp:
    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.view: TrayView = view(None)
        self.note: str | None = None  # the outcome of the last failed action
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._icon: Any = None

    # -- actions ---------------------------------------------------------------------------
    def act(self, action: str) -> None:
        if action in ("start", "stop", "restart", "load", "unload"):
            threading.Thread(target=self._run_cli, args=(action,), daemon=True).start()
        elif action.startswith(UNLOAD_ONE):  # another of the daemon's models
            threading.Thread(target=self._run_cli, args=("unload", action[len(UNLOAD_ONE):]),
                             daemon=True).start()
        elif action == "open_log":
            open_path(sc.log_path())
        elif action == "open_config":
            path = config_mod.config_path()
            if not path.exists():
                config_mod.write_file(config_mod.read_file())
            open_path(path)
        elif action == "quit":
            self._stop.set()
            self._wake.set()
            if self._icon is not None:
                self._icon.stop()

    def _run_cli(self, action: str, *args: str) -> None:
        r = subprocess.run(_cli(action, *args), capture_output=True, text=True, check=False,
                           stdin=subprocess.DEVNULL)
        lines = (r.stderr or r.stdout).strip().splitlines()
        # a failed start prints its summary first and the daemon's log tail after it,
        # whose last error line is the cause
        cause = next((ln for ln in reversed(lines) if "error" in ln.lower()),
                     lines[0] if lines else f"{action} failed ({r.returncode})")
        self.note = None if r.returncode in (0, 3) else cause
        self._wake.set()

    # -- polling ---------------------------------------------------------------------------
    def refresh(self) -> TrayView:
        v = view(poll())
        if self.note:
            v.items.insert(0, MenuItem(f"Last action: {self.note[:80]}", enabled=False))
        changed = (v.state, v.title, v.items) != (self.view.state, self.view.title,
                                                  self.view.items)
        self.view = v
        if self._icon is not None and (changed or self._undocked()):
            self._apply(v)
        return v

    def _undocked(self) -> bool:
        """The icon is not in a tray yet (pystray's xorg backend docks only when the icon
        is set: a tray host that starts after us, a panel still loading at login, would
        otherwise never show it; setting the icon again retries)."""
        icon = self._icon
        return (type(icon).__module__.endswith("_xorg") and getattr(icon, "_running", False)
                and getattr(icon, "_systray_manager", True) is None)

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._wake.wait(self.interval)
            self._wake.clear()

    # -- pystray ---------------------------------------------------------------------------
    def _menu(self, v: TrayView) -> Any:
        import pystray

        def item(i: MenuItem) -> Any:
            if i is SEPARATOR or i.text == "-":
                return pystray.Menu.SEPARATOR
            action = i.action
            return pystray.MenuItem(i.text, (lambda: self.act(action)) if action else None,
                                    enabled=i.enabled and action is not None,
                                    default=i.default)
        return pystray.Menu(*(item(i) for i in v.items))

    def _apply(self, v: TrayView) -> None:
        icon = self._icon
        icon.title = v.title
        icon.icon = icon_image(v.state)
        icon.menu = self._menu(v)
        with contextlib.suppress(NotImplementedError):
            icon.update_menu()
        display = getattr(icon, "_display", None)  # pystray's xorg backend leaves the last
        if display is not None:  # requests (title, image) queued until some later round trip
            with contextlib.suppress(Exception):
                display.flush()

    def run(self) -> None:
        import pystray

        v = self.refresh()
        self._icon = pystray.Icon("specd", icon_image(v.state), v.title, menu=self._menu(v))

        def setup(icon: Any) -> None:
            # pystray's xorg backend runs setup before it records its loop thread, and calls
            # from other threads then fail: wait for it
            if type(icon).__module__.endswith("_xorg"):
                deadline = time.monotonic() + 10
                while not hasattr(icon, "_thread") and time.monotonic() < deadline:
                    time.sleep(0.02)
            icon.visible = True
            threading.Thread(target=self._poll_loop, daemon=True, name="specd-tray-poll").start()

        self._icon.run(setup=setup)
        self._stop.set()
        self._wake.set()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "backend", None):
        os.environ["PYSTRAY_BACKEND"] = args.backend
    try:
        import PIL  # noqa: F401
        import pystray  # noqa: F401
    except ImportError as exc:
        print(f"specd: error: the tray needs pystray and Pillow ({exc.name} is missing): "
              "pip install 'specd[tray]'", file=sys.stderr)
        return 1
    except Exception as exc:  # e.g. no display for the chosen backend
        print(f"specd: error: no tray available ({exc}): is a desktop session running?",
              file=sys.stderr)
        return 1
    try:
        TrayApp(interval=args.interval).run()
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # e.g. Xlib's "Bad display name"
        if getattr(args, "verbose", False):
            raise
        print(f"specd: error: no tray available ({exc}): is a desktop session running?",
              file=sys.stderr)
        return 1
    return 0


def add_tray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often to poll the daemon (default 2)")
    p.add_argument("--backend", default=None,
                   help="pystray backend (appindicator, gtk, xorg, darwin, win32)")


def add_tray_command(sub: argparse._SubParsersAction) -> None:
    """Add `specd tray` to `specd`'s subparsers."""
    p = sub.add_parser("tray", help="a system-tray icon showing and controlling the daemon")
    add_tray_args(p)
    p.set_defaults(func=run)
