"""User-service files: systemd unit (verified by systemd-analyze), launchd plist, Windows
Startup script; install/uninstall into a temporary home touch exactly the expected files."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from specd.installers import templates as t

PLATFORMS = ("linux", "darwin", "win32")
EXPECTED = {
    "linux": ".config/systemd/user/specd.service",
    "darwin": "Library/LaunchAgents/org.specd.daemon.plist",
    "win32": "AppData/Roaming/Microsoft/Windows/Start Menu/Programs/Startup/specd.cmd",
}


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("STATE", "CONFIG", "RUNTIME"):
        monkeypatch.setenv(f"SPECD_{name}_DIR", str(tmp_path / name.lower()))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    return home


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()}


def _systemd_analyze() -> str:
    """systemd-analyze, installing Debian's `systemd` package when missing (root + apt)."""
    found = shutil.which("systemd-analyze")
    if found:
        return found
    if sys.platform != "linux" or not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip("systemd-analyze is missing and cannot be installed here (needs root "
                    "and apt-get): apt-get install systemd")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "systemd"]
    for attempt in ([], ["update"]):
        if attempt:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True,
                           timeout=300, check=False)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                           check=False)
        if r.returncode == 0 and shutil.which("systemd-analyze"):
            return str(shutil.which("systemd-analyze"))
    pytest.skip(f"could not install systemd with apt-get: {r.stderr.strip()[-200:]}")


@pytest.mark.parametrize("state_dir", ["plain", "with space %and$dollar"])
def test_systemd_unit_verifies(dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               state_dir: str) -> None:
    analyze = _systemd_analyze()
    monkeypatch.setenv("SPECD_STATE_DIR", str(tmp_path / state_dir))
    r = t.install_service(home=dirs, platform="linux")
    unit = r.file.path
    assert unit == dirs / EXPECTED["linux"]
    text = unit.read_text()
    assert f"ExecStart={sys.executable} -m specd.daemon.cli start --foreground" in text
    assert "WantedBy=default.target" in text
    assert "specd.log" in text
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    v = subprocess.run([analyze, "--user", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(xdg)},
                       check=False)
    if v.returncode != 0 and "Failed to initialize manager" in v.stderr:
        # no user manager possible here: the system-mode check parses the same file
        v = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                           timeout=60, check=False)
    assert v.returncode == 0, v.stderr
    assert v.stderr.strip() == "", v.stderr  # no "Unknown key"/"ignoring" warnings either


def test_systemd_analyze_catches_a_broken_unit(dirs: Path, tmp_path: Path) -> None:
    """The verify step above would notice a bad unit (a nonexistent interpreter)."""
    analyze = _systemd_analyze()
    text = t.systemd_unit().replace(sys.executable, "/nonexistent/python")
    bad = tmp_path / "specd.service"
    bad.write_text(text)
    v = subprocess.run([analyze, "verify", str(bad)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert v.returncode != 0 and "nonexistent" in v.stderr


def test_launchd_plist_round_trips(dirs: Path) -> None:
    r = t.install_service(home=dirs, platform="darwin")
    assert r.file.path == dirs / EXPECTED["darwin"]
    data = r.file.path.read_bytes()
    plist = plistlib.loads(data)
    assert plistlib.dumps(plist) == data
    assert plist["Label"] == t.LAUNCHD_LABEL
    assert plist["ProgramArguments"] == [sys.executable, "-m", "specd.daemon.cli", "start",
                                         "--foreground"]
    assert plist["RunAtLoad"] is True
    assert plist["StandardOutPath"] == str(t.log_file())
    assert plist["EnvironmentVariables"]["SPECD_STATE_DIR"] == os.environ["SPECD_STATE_DIR"]
    if shutil.which("plutil"):  # macOS
        subprocess.run(["plutil", "-lint", str(r.file.path)], check=True)


def test_windows_startup_script(dirs: Path) -> None:
    r = t.install_service(home=dirs, platform="win32")
    assert r.file.path == dirs / EXPECTED["win32"]
    text = r.file.path.read_bytes().decode()
    assert text.startswith("@echo off\r\n") and text.endswith("\r\n")
    assert "\n" not in text.replace("\r\n", "")
    assert sys.executable in text and "-m specd.daemon.cli start" in text
    assert "--foreground" not in text  # the background daemon: the script must return


@pytest.mark.parametrize("platform", PLATFORMS)
def test_install_uninstall_touch_exactly_the_service_file(dirs: Path, platform: str) -> None:
    before = _files(dirs)
    r = t.install_service(home=dirs, platform=platform)
    assert r.changed and not r.ran
    assert _files(dirs) - before == {EXPECTED[platform]}
    assert not t.install_service(home=dirs, platform=platform).changed  # idempotent
    assert _files(dirs) - before == {EXPECTED[platform]}
    u = t.uninstall_service(home=dirs, platform=platform)
    assert u.changed
    assert _files(dirs) == before
    assert not t.uninstall_service(home=dirs, platform=platform).changed


@pytest.mark.parametrize("platform", PLATFORMS)
def test_enable_and_disable_run_the_manager_commands(dirs: Path, platform: str) -> None:
    ran: list[list[str]] = []

    def runner(cmd: Sequence[str]) -> None:
        ran.append(list(cmd))

    r = t.install_service(home=dirs, platform=platform, enable=True, runner=runner)
    assert r.ran and ran == r.file.enable
    ran.clear()
    u = t.uninstall_service(home=dirs, platform=platform, disable=True, runner=runner)
    assert ran[:len(u.file.disable)] == u.file.disable
    if platform == "linux":
        assert ran == [["systemctl", "--user", "disable", "--now", "specd.service"],
                       ["systemctl", "--user", "daemon-reload"]]
    assert not u.file.path.exists()


def test_failed_manager_command_is_one_clear_error(dirs: Path) -> None:
    def runner(cmd: Sequence[str]) -> None:
        raise t.InstallError(f"{cmd[0]} not found")

    with pytest.raises(t.InstallError, match="systemctl not found"):
        t.install_service(home=dirs, platform="linux", enable=True, runner=runner)
    assert (dirs / EXPECTED["linux"]).is_file()  # the file is written first
    t.uninstall_service(home=dirs, platform="linux", disable=True, runner=runner)  # no raise
    assert not (dirs / EXPECTED["linux"]).exists()


def test_unknown_platform() -> None:
    with pytest.raises(t.InstallError, match="no user-service support"):
        t.render("plan9")


def test_cli_install_service_no_enable(dirs: Path) -> None:
    if sys.platform != "linux":
        pytest.skip("checks the Linux (systemd) file layout")
    env = {**os.environ, "HOME": str(dirs)}
    env.pop("XDG_CONFIG_HOME", None)
    cli = [sys.executable, "-m", "specd.daemon.cli"]
    r = subprocess.run([*cli, "install-service", "--no-enable"], env=env, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "systemctl --user enable --now specd.service" in r.stdout
    assert _files(dirs) == {EXPECTED["linux"]}
    r = subprocess.run([*cli, "uninstall-service", "--no-disable"], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert _files(dirs) == set()


INSTALL_SH = Path(__file__).resolve().parents[2] / "installers" / "install.sh"


def _install_sh(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "XDG_"))}
    env["HOME"] = str(home)
    return subprocess.run(["sh", str(INSTALL_SH), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_install_sh_dry_run(tmp_path: Path) -> None:
    if not shutil.which("sh"):
        pytest.skip("no POSIX sh")
    r = _install_sh(tmp_path, "--dry-run")
    assert r.returncode == 0, r.stderr
    venv = tmp_path / ".local/share/specd/venv"
    gpu = bool(shutil.which("nvidia-smi")) and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0
    extra = "gpu" if gpu else "cpu"
    src = INSTALL_SH.parent.parent
    lines = [x.removeprefix("specd-install: + ") for x in r.stderr.splitlines()
             if x.startswith("specd-install: + ")]
    assert lines[0].endswith(f"-m venv {venv}")
    assert f"pip_ install --quiet {src}[{extra}]" in lines
    assert f"pip_uninstall specd onnxruntime{'' if gpu else '-gpu'}" in lines
    specd = f"{venv}/bin/specd"
    assert f"ln -sf {specd} {tmp_path}/.local/bin/specd" in lines
    assert lines[-5:] == [f"{specd} models pull qwen2.5-coder-1.5b-instruct",
                          f"{specd} models pull qwen2.5-coder-0.5b-instruct",
                          f"{specd} config set model qwen2.5-coder-1.5b-instruct",
                          f"{specd} config set draft qwen2.5-coder-0.5b-instruct",
                          f"{specd} install-service"]
    assert not (tmp_path / ".local").exists()  # a dry run changes nothing

    r = _install_sh(tmp_path, "--dry-run", "--no-models", "--no-service", "--gpu", "--tray")
    assert r.returncode == 0, r.stderr
    assert f"pip_ install --quiet {src}[gpu,tray]" in r.stderr
    assert "models pull" not in r.stderr and "install-service" not in r.stderr

    r = _install_sh(tmp_path, "--bogus")
    assert r.returncode == 1 and "unknown option --bogus" in r.stderr


def _quickstart():  # the module, loaded from its file (not a package)
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "installers" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for nvidia-smi")
@pytest.mark.parametrize("answers, want", [(True, "gpu"), (False, "cpu"), (None, "cpu")])
def test_quickstart_picks_gpu_only_where_the_driver_answers(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            answers: bool | None,
                                                            want: str) -> None:
    """An nvidia-smi that exits with an error (a driver not loaded) is no GPU, as
    install.sh decides; it used to pick onnxruntime-gpu whenever the file existed."""
    qs = _quickstart()
    monkeypatch.delenv("SPECD_RUNTIME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    if answers is not None:
        smi = tmp_path / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nexit {0 if answers else 9}\n")
        smi.chmod(0o755)
    assert qs.runtime_extra() == want


def test_quickstart_demo_takes_more_options() -> None:
    qs = _quickstart()
    assert qs.specd_args([]) == (qs.DEMO, True)
    assert qs.specd_args(["demo", "-n", "64"]) == ([*qs.DEMO, "-n", "64"], True)
    assert qs.specd_args(["models", "list"]) == (["models", "list"], False)


def test_quickstart_tries_the_oracle_packages_once_and_says_which_tests_skip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """This venv's pip, offline (no index): an installed package's group is there, one that
    cannot be installed says why and that its tests skip; the next run does not try again."""
    qs = _quickstart()
    monkeypatch.setattr(qs, "VENV", Path(sys.prefix))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    packages = {"pytest": "group_a", "specd_no_such_module": "group_b"}
    stamp = tmp_path / "tried"
    assert qs.ensure_oracle_packages(packages, stamp) == {"group_a"}
    err = capsys.readouterr().err
    assert "installing specd_no_such_module from the package index" in err
    assert "pip could not install them (ERROR: No matching distribution found" in err
    assert "specd_no_such_module is not installed, so the group_b tests skip" in err
    assert stamp.read_text() == "specd_no_such_module"
    assert qs.ensure_oracle_packages(packages, stamp) == {"group_a"}
    err = capsys.readouterr().err
    assert "installing" not in err and "the group_b tests skip" in err


def test_quickstart_requires_the_groups_it_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    qs = _quickstart()
    monkeypatch.delenv(qs.REQUIRE_ENV, raising=False)
    assert qs.test_env({"needs_torch", "llama_cpp_oracle"})[qs.REQUIRE_ENV] == \
        "llama_cpp_oracle,needs_torch"
    assert qs.test_env(set())[qs.REQUIRE_ENV] == "0"
    monkeypatch.setenv(qs.REQUIRE_ENV, "1")  # .ci/run's: every group
    assert qs.test_env(set())[qs.REQUIRE_ENV] == "1"


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                    reason="needs cmake and a C++ compiler")
def test_quickstart_says_before_the_tests_where_llama_cpp_did_not_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A source that does not compile (a stand-in for llama.cpp's): the build's error, then
    that the oracle tests skip and how to have them; SPECD_SKIP_LLAMA_CPP=1 builds nothing."""
    qs = _quickstart()
    monkeypatch.setattr(qs, "VENV", Path(sys.prefix))
    monkeypatch.delenv("SPECD_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("SPECD_LLAMA_CPP_DIR", str(tmp_path))
    src = tmp_path / "src" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "main.cpp").write_text("int main() { return not C++; }\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(standin CXX)\n"
        "add_executable(llama-server main.cpp)\n")
    monkeypatch.setenv("SPECD_SKIP_LLAMA_CPP", "1")
    assert not qs.ensure_llama_cpp()
    assert "SPECD_SKIP_LLAMA_CPP=1: llama.cpp is not built, so the llama_cpp_oracle tests " \
        "skip" in capsys.readouterr().err
    assert not (tmp_path / "build").exists()
    monkeypatch.delenv("SPECD_SKIP_LLAMA_CPP")
    assert not qs.ensure_llama_cpp()
    err = capsys.readouterr().err  # the build's own lines come from its process
    assert "building llama.cpp for the llama_cpp_oracle tests" in err
    assert "llama.cpp was not built (above: why), so the llama_cpp_oracle tests skip" in err


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks need a privilege there")
def test_quickstart_check_links_the_package_as_it_is_installed(tmp_path: Path) -> None:
    """`quickstart.py check` runs `mypy -p specd`; mypy cannot see the editable install's
    import hook, so the checkout's folders are linked as the installed package's."""
    import importlib.util

    qs = _quickstart()
    links = qs.link_tree(tmp_path)
    for link, folder in links.items():
        spec = importlib.util.find_spec(f"specd.{link.name}")  # as installed
        assert spec is not None and spec.submodule_search_locations is not None
        assert Path(spec.submodule_search_locations[0]).resolve() == folder.resolve()
        assert link.parent == tmp_path / "specd" and link.resolve() == folder.resolve()
    assert (tmp_path / "specd" / "ort_models" / "arch" / "__init__.py").is_file()
    stale = tmp_path / "specd" / "gone"
    stale.symlink_to(tmp_path, target_is_directory=True)
    assert qs.link_tree(tmp_path) == links and not os.path.lexists(stale)
