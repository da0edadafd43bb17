#!/usr/bin/env python3
"""Set up specd in ./.venv (once) and run it, or its tests.

    python3 installers/quickstart.py demo          # default model pair, speculative
    python3 installers/quickstart.py test [ARGS]   # the test suite (pytest ARGS)
    python3 installers/quickstart.py check         # ruff and mypy (CI runs it first)
    python3 installers/quickstart.py ARGS          # any `specd ARGS`

Needs only Python 3.11+. Installs specd with the ONNX Runtime build that fits the
machine (onnxruntime-gpu when an NVIDIA driver is present, else onnxruntime). `test` also
sets up the tests' external oracles, once: torch and transformers from the package index,
and llama.cpp built from source (cmake and a C++ compiler; about 20 minutes on two cores;
SPECD_SKIP_LLAMA_CPP=1 skips it); the groups it set up must then run (tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("SPECD_VENV", ROOT / ".venv"))
# where `check` links the package for mypy: pyproject's [tool.mypy] mypy_path
MYPY_TREE = ROOT / "build" / "mypy"
# no -md: specd speculates with the drafter measured fastest for this target, and says why
DEMO = ["generate", "-m", "qwen2.5-coder-1.5b-instruct",
        "--chat", "Write a Python function that checks whether a number is prime."]


def _bin(name: str) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    return VENV / sub / (name + (".exe" if os.name == "nt" else ""))


def runtime_extra() -> str:
    """cpu or gpu: onnxruntime and onnxruntime-gpu must never both be installed."""
    forced = os.environ.get("SPECD_RUNTIME")
    if forced in ("cpu", "gpu"):
        return forced
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:  # a driver that answers, as install.sh asks: an nvidia-smi alone is not a GPU
        ok = subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return "gpu" if ok else "cpu"


def ensure_env() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - runs before specd is installed
        sys.exit("specd needs Python 3.11 or newer")
    extra = runtime_extra()
    # what the install depends on: the project, where it is (an editable install points
    # at it), the runtime build and the Python
    stamp_text = "\n".join([hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest(),
                            extra, str(ROOT), str(VENV), sys.version])
    stamp = VENV / ".specd-installed"
    if stamp.is_file() and stamp.read_text() == stamp_text:
        return
    if not _bin("python").exists():
        print(f"quickstart: creating {VENV}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = str(_bin("python"))
    other = "onnxruntime" if extra == "gpu" else "onnxruntime-gpu"
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", other], check=False,
                   capture_output=True)
    print(f"quickstart: installing specd[{extra},test,tray] (first run only)", file=sys.stderr)
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e",
                    f"{ROOT}[{extra},test,tray]"], check=True)
    stamp.write_text(stamp_text)


# Python packages some tests use as oracles, plain from the package index (on Linux x86-64
# torch's wheel brings its CUDA libraries, about 5.5 GB installed; it runs on CPU), each
# with the marker of the tests that need it (tests/conftest.py)
ORACLE_PACKAGES = {"torch": "needs_torch", "transformers": "needs_transformers",
                   # the converter of the tiny vision checkpoints imports it
                   "sentencepiece": "needs_transformers"}
LLAMA_CPP = ROOT / "daemon" / "benchmark" / "llama_cpp.py"  # standard library only
LLAMA_CPP_GROUP = "llama_cpp_oracle"
REQUIRE_ENV = "SPECD_REQUIRE_ORACLES"  # tests/conftest.py: these groups must run


def _absent_modules(names: list[str]) -> list[str]:
    code = ("import importlib.util as u, sys; print(' '.join(n for n in sys.argv[1:] "
            "if u.find_spec(n) is None))")
    out = subprocess.run([str(_bin("python")), "-c", code, *names], capture_output=True,
                         text=True)
    return out.stdout.split() if out.returncode == 0 else list(names)


def ensure_oracle_packages(packages: dict[str, str] = ORACLE_PACKAGES,
                           stamp: Path | None = None) -> set[str]:
    """Install the packages the oracle tests import where absent, trying once per venv (the
    stamp, in the venv, names what was tried); returns the test groups whose package is
    there (all of the group's). For each one still absent, says that its tests skip and
    how to install it."""
    absent = _absent_modules(list(packages))
    tried = stamp or VENV / ".specd-oracles-tried"
    if absent and not (tried.is_file() and tried.read_text() == " ".join(absent)):
        print(f"quickstart: installing {' and '.join(absent)} from the package index for "
              "the tests that use them as oracles (first run only; torch is about 5.5 GB)",
              file=sys.stderr)
        out = subprocess.run([str(_bin("python")), "-m", "pip", "install", "-q",
                              "--disable-pip-version-check", *absent],
                             capture_output=True, text=True)
        tried.write_text(" ".join(absent))
        if out.returncode != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"quickstart: pip could not install them ({last})", file=sys.stderr)
        absent = _absent_modules(absent)
    for name in absent:
        print(f"quickstart: {name} is not installed, so the {packages[name]} tests skip "
              f"(`{_bin('python')} -m pip install {name}`, then run the tests again)",
              file=sys.stderr)
    return {group for group in packages.values()
            if all(name not in absent for name, g in packages.items() if g == group)}


def ensure_llama_cpp() -> bool:
    """Build llama.cpp for the tests that use it as an oracle (once; bounded), unless
    SPECD_SKIP_LLAMA_CPP=1. Says plainly, before the tests run, where they will skip and
    how to have them run. Whether it is built."""
    py = str(_bin("python"))
    if subprocess.run([py, str(LLAMA_CPP), "--check"], capture_output=True).returncode == 0:
        return True
    how = ("fix what it names (the build needs cmake and a C++ compiler) and run the tests "
           "again, or set SPECD_LLAMA_CPP_BIN to the bin folder of a llama.cpp build 11434")
    if os.environ.get("SPECD_SKIP_LLAMA_CPP") == "1":
        print(f"quickstart: SPECD_SKIP_LLAMA_CPP=1: llama.cpp is not built, so the "
              f"{LLAMA_CPP_GROUP} tests skip", file=sys.stderr)
        return False
    print(f"quickstart: building llama.cpp for the {LLAMA_CPP_GROUP} tests (first run only: "
          "about 20 minutes on two cores, stopped at 50; SPECD_SKIP_LLAMA_CPP=1 skips it "
          "and those tests)", file=sys.stderr)
    if subprocess.run([py, str(LLAMA_CPP)]).returncode != 0:
        print(f"quickstart: llama.cpp was not built (above: why), so the {LLAMA_CPP_GROUP} "
              f"tests skip; to run them, {how}", file=sys.stderr)
        return False
    return True


def test_env(groups: set[str]) -> dict[str, str]:
    """The tests' environment: the oracle groups set up here must run (a skip fails), unless
    SPECD_REQUIRE_ORACLES is set already (.ci/run sets 1: all of them)."""
    env = dict(os.environ)
    if REQUIRE_ENV not in env:
        env[REQUIRE_ENV] = ",".join(sorted(groups)) or "0"
    print(f"quickstart: {REQUIRE_ENV}={env[REQUIRE_ENV]} (the oracle test groups that must "
          "run; tests/conftest.py)", file=sys.stderr)
    return env


def specd_args(argv: list[str]) -> tuple[list[str], bool]:
    """(`specd` arguments, is it the demo) for quickstart's arguments: `demo` (or none)
    is the demo, with any options after it (`demo -n 64`); anything else is passed on."""
    if argv[:1] == ["demo"] or not argv:
        return DEMO + argv[1:], True
    return argv, False


def package_dirs() -> dict[str, str]:
    """The installed package's top folders: {"daemon": "daemon", ...} for each
    `specd.NAME` = folder of pyproject's package-dir (nested entries must be subfolders)."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as fh:
        mapping = tomllib.load(fh)["tool"]["setuptools"]["package-dir"]
    top = {k.split(".")[1]: v for k, v in mapping.items() if k.count(".") == 1}
    for key, folder in mapping.items():
        parts = key.split(".")
        if len(parts) > 2 and folder != "/".join([top[parts[1]], *parts[2:]]):
            raise SystemExit(f"quickstart: package-dir {key} = {folder!r} is not a subfolder "
                             "of its parent's: the mypy link tree cannot show it")
    return top


def link_tree(dest: Path = MYPY_TREE) -> dict[Path, Path]:
    """dest/specd/NAME -> the checkout's folder of specd.NAME, for every top package, so
    that mypy finds `specd` as it is installed. The editable install maps the folders by
    an import hook, which mypy never runs. Returns {link: folder}."""
    pkg = dest / "specd"
    pkg.mkdir(parents=True, exist_ok=True)
    want = {pkg / name: ROOT / folder for name, folder in package_dirs().items()}
    for old in pkg.iterdir():  # a package no longer in pyproject, or a moved folder
        if old not in want or not old.is_symlink() or old.resolve() != want[old].resolve():
            if old.is_symlink() or old.is_file():
                old.unlink()
            else:
                shutil.rmtree(old)
    for link, folder in want.items():
        if not link.is_symlink():
            link.symlink_to(folder, target_is_directory=True)
    return want


def check() -> int:
    """`ruff check .` and `mypy -p specd` from the venv (both run; 1 if either fails)."""
    py = str(_bin("python"))
    rc_ruff = subprocess.run([py, "-m", "ruff", "check", "."], cwd=ROOT).returncode
    links = link_tree()
    out = subprocess.run([py, "-m", "mypy", "-p", "specd"], cwd=ROOT, capture_output=True,
                         text=True)
    # name the checkout's files rather than their links (mypy prints paths under the
    # working directory relative to it)
    prefixes = {}
    for link, folder in links.items():
        name = str(folder.relative_to(ROOT)) + os.sep
        prefixes[str(link) + os.sep] = name
        prefixes[str(link.relative_to(ROOT)) + os.sep] = name
    for stream, text in ((sys.stdout, out.stdout), (sys.stderr, out.stderr)):
        for line in text.splitlines(keepends=True):
            for prefix, name in prefixes.items():
                if line.startswith(prefix):
                    line = name + line[len(prefix):]
                    break
            stream.write(line)
        stream.flush()
    if rc_ruff or out.returncode:
        print(f"quickstart: check failed (ruff exited with {rc_ruff}, mypy with "
              f"{out.returncode})", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    try:
        ensure_env()
    except subprocess.CalledProcessError as exc:  # pip said why above; no traceback
        print(f"quickstart: installing specd failed (pip exited with {exc.returncode}); "
              "see pip's message above (offline? no wheel for this Python?)",
              file=sys.stderr)
        return 1
    if argv == ["check"]:
        return check()
    if argv[:1] == ["test"]:
        groups = ensure_oracle_packages()
        if ensure_llama_cpp():
            groups.add(LLAMA_CPP_GROUP)
        cmd = [str(_bin("python")), "-m", "pytest", *argv[1:]]
        rc = subprocess.run(cmd, cwd=ROOT, env=test_env(groups)).returncode
        if rc == 5:
            print("quickstart: pytest collected no tests", file=sys.stderr)
            return 1
        return rc
    args, demo = specd_args(argv)
    if demo:
        print("quickstart: specd " + " ".join(
            repr(a) if " " in a else a for a in args), file=sys.stderr)
    # the module, not the console script: a moved checkout's script names the old path
    return subprocess.run([str(_bin("python")), "-m", "specd.daemon.cli", *args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
