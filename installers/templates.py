"""User-service files for specd, from one description: a systemd user unit (Linux), a launchd
LaunchAgent (macOS) and a Startup-folder script (Windows).

All run `python -m specd.daemon.cli start ...` with the Python of this environment, so the
service uses the options in `specd config` (read at each service start).  systemd and launchd
keep the daemon in the foreground (`start --foreground` execs `serve`) and restart it on
failure; on Windows the script starts the background daemon at logon.

`install_service` / `uninstall_service` only write / remove the one file (under `home`, which
tests point at a temporary directory); running the service manager (`systemctl --user enable
--now`, `launchctl bootstrap`) is a separate, optional step whose commands are returned.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specd.ort_models.paths import state_dir

UNIT_NAME = "specd.service"
LAUNCHD_LABEL = "org.specd.daemon"
WINDOWS_SCRIPT = "specd.cmd"
DESCRIPTION = "specd local speculative-decoding daemon"
# dirs that, when overridden at install time, the service must see too
_ENV_DIRS = ("SPECD_CONFIG_DIR", "SPECD_STATE_DIR", "SPECD_RUNTIME_DIR", "SPECD_CACHE_DIR",
             "SPECD_DATA_DIR")


class InstallError(RuntimeError):
    pass


@dataclass
class ServiceFile:
    platform: str  # "linux", "darwin" or "win32"
    path: Path
    content: bytes
    enable: list[list[str]]  # commands that register + start it now (optional step)
    disable: list[list[str]]  # commands that stop + unregister it (before removal)


def normalize_platform(platform: str | None = None) -> str:
    p = platform or sys.platform
    if p.startswith("linux") or p.startswith("freebsd"):
        return "linux"
    if p in ("darwin", "macos", "mac"):
        return "darwin"
    if p in ("win32", "windows", "cygwin"):
        return "win32"
    raise InstallError(f"no user-service support for platform {p!r}")


def service_command(foreground: bool) -> list[str]:
    return [sys.executable, "-m", "specd.daemon.cli", "start",
            *(["--foreground"] if foreground else [])]


def service_environment() -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    env.update({k: os.environ[k] for k in _ENV_DIRS if os.environ.get(k)})
    return env


def log_file() -> Path:
    return state_dir() / "specd.log"


# -- systemd ------------------------------------------------------------------------------
def _systemd_escape(s: str) -> str:
    return s.replace("%", "%%")


def _systemd_quote(s: str, exec_line: bool = False) -> str:
    """One word of ExecStart= (exec_line: `$` expands there) or Environment=, double-quoted
    with C escapes when needed; `%` specifiers escaped."""
    if s and not any(c in s for c in ' \t"\'\\;$%'):
        return s
    inner = s.replace("\\", "\\\\").replace('"', '\\"')
    if exec_line:
        inner = inner.replace("$", "$$")
    return '"' + _systemd_escape(inner) + '"'


def systemd_unit() -> str:
    env = "".join(f"Environment={_systemd_quote(f'{k}={v}')}\n"
                  for k, v in service_environment().items())
    log = _systemd_escape(str(log_file()))
    return (
        "# specd user service (written by `specd install-service`; options: `specd config`)\n"
        "[Unit]\n"
        f"Description={DESCRIPTION}\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={' '.join(_systemd_quote(a, True) for a in service_command(True))}\n"
        f"WorkingDirectory={_systemd_escape(str(state_dir()))}\n"
        f"{env}"
        f"StandardOutput=append:{log}\n"
        "StandardError=inherit\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "TimeoutStopSec=30\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n")


# -- launchd ------------------------------------------------------------------------------
def launchd_plist() -> bytes:
    log = str(log_file())
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": service_command(True),
        "EnvironmentVariables": service_environment(),
        "WorkingDirectory": str(state_dir()),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 5,
        "ProcessType": "Background",
        "StandardOutPath": log,
        "StandardErrorPath": log,
    })


# -- Windows ------------------------------------------------------------------------------
def _cmd_quote(s: str) -> str:
    return f'"{s}"' if any(c in s for c in ' &()^%!') else s


def windows_script() -> bytes:
    lines = [
        "@echo off",
        "rem specd user service: starts the specd daemon at logon.",
        "rem Written by `specd install-service`; remove with `specd uninstall-service`.",
        *(f'set "{k}={v}"' for k, v in service_environment().items()),
        " ".join(_cmd_quote(a) for a in service_command(False)),
    ]
    return ("\r\n".join(lines) + "\r\n").encode("utf-8")


# -- where ---------------------------------------------------------------------------------
def service_path(platform: str | None = None, home: Path | None = None) -> Path:
    plat = normalize_platform(platform)
    if plat == "linux":
        xdg = os.environ.get("XDG_CONFIG_HOME")
        base = home / ".config" if home is not None else Path(xdg) if xdg else \
            Path.home() / ".config"
        return base / "systemd" / "user" / UNIT_NAME
    if plat == "darwin":
        return (home or Path.home()) / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    appdata = os.environ.get("APPDATA")
    roaming = home / "AppData" / "Roaming" if home is not None else Path(appdata) if appdata \
        else Path.home() / "AppData" / "Roaming"
    return (roaming / "Microsoft" / "Windows" / "Start Menu" / "Programs" / "Startup"
            / WINDOWS_SCRIPT)


def render(platform: str | None = None, home: Path | None = None) -> ServiceFile:
    plat = normalize_platform(platform)
    path = service_path(plat, home)
    if plat == "linux":
        return ServiceFile(plat, path, systemd_unit().encode(), enable=[
            ["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", "--now", UNIT_NAME]], disable=[
            ["systemctl", "--user", "disable", "--now", UNIT_NAME]])
    if plat == "darwin":
        domain = f"gui/{os.getuid() if hasattr(os, 'getuid') else 501}"
        return ServiceFile(plat, path, launchd_plist(), enable=[
            ["launchctl", "bootstrap", domain, str(path)]], disable=[
            ["launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}"]])
    return ServiceFile(plat, path, windows_script(), enable=[service_command(False)],
                       disable=[[sys.executable, "-m", "specd.daemon.cli", "stop"]])


# -- install / uninstall -------------------------------------------------------------------
Runner = Callable[[Sequence[str]], None]


def _run(cmd: Sequence[str]) -> None:
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise InstallError(f"{cmd[0]} not found")
    r = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        raise InstallError(f"`{' '.join(cmd)}` failed: {msg[-1] if msg else r.returncode}")


@dataclass
class InstallResult:
    file: ServiceFile
    changed: bool  # the file was written (new or different)
    ran: bool  # the enable/disable commands were run


def install_service(home: Path | None = None, platform: str | None = None, *,
                    enable: bool = False, runner: Runner = _run) -> InstallResult:
    """Write the service file; with enable=True also run `file.enable` (else print them)."""
    sf = render(platform, home)
    old = sf.path.read_bytes() if sf.path.is_file() else None
    changed = old != sf.content
    if changed:
        sf.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = sf.path.with_name(sf.path.name + ".tmp")
        tmp.write_bytes(sf.content)
        os.replace(tmp, sf.path)
    if enable:
        for cmd in sf.enable:
            runner(cmd)
    return InstallResult(sf, changed, enable)


def uninstall_service(home: Path | None = None, platform: str | None = None, *,
                      disable: bool = False, runner: Runner = _run) -> InstallResult:
    """Remove the service file (with disable=True first run `file.disable`, errors ignored:
    the manager may not know it).  `changed` is False when nothing was installed."""
    sf = render(platform, home)
    if disable and sf.path.exists():
        for cmd in sf.disable:
            try:
                runner(cmd)
            except InstallError:
                pass
    existed = sf.path.exists()
    if existed:
        sf.path.unlink()
    if disable and existed and sf.platform == "linux":
        try:
            runner(["systemctl", "--user", "daemon-reload"])
        except InstallError:
            pass
    return InstallResult(sf, existed, disable)
