#!/usr/bin/env python3
"""Set up specd in ./.venv (once) and run it, or its tests.

    python3 installers/quickstart.py demo          # default model pair, speculative
    python3 installers/quickstart.py test [ARGS]   # the test suite (pytest ARGS)
    python3 installers/quickstart.py ARGS          # any `specd ARGS`

Needs only Python 3.11+. Installs specd with the ONNX Runtime build that fits the
machine (onnxruntime-gpu when an NVIDIA driver is present, else onnxruntime).
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
DEMO = ["generate", "-m", "qwen2.5-coder-1.5b-instruct", "-md", "qwen2.5-coder-0.5b-instruct",
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


def specd_args(argv: list[str]) -> tuple[list[str], bool]:
    """(`specd` arguments, is it the demo) for quickstart's arguments: `demo` (or none)
    is the demo, with any options after it (`demo -n 64`); anything else is passed on."""
    if argv[:1] == ["demo"] or not argv:
        return DEMO + argv[1:], True
    return argv, False


def main(argv: list[str]) -> int:
    try:
        ensure_env()
    except subprocess.CalledProcessError as exc:  # pip said why above; no traceback
        print(f"quickstart: installing specd failed (pip exited with {exc.returncode}); "
              "see pip's message above (offline? no wheel for this Python?)",
              file=sys.stderr)
        return 1
    if argv[:1] == ["test"]:
        cmd = [str(_bin("python")), "-m", "pytest", *argv[1:]]
        rc = subprocess.run(cmd, cwd=ROOT).returncode
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
