"""specd's own ONNX Runtime kernels, compiled on first use for the CPU they run on.

`kernels/gguf_matmul.c` multiplies by weights kept in GGUF's own block layout
(`specd.GgufMatMul`; Q4_0, Q4_1, Q4_K and Q6_K), reading the file's bytes per token instead of the
wider lossless MatMulNBits layout; `kernels/causal_attention.c` (`specd.CausalAttention`,
and `specd.CachedAttention`, which also rotates the new rows and writes them into the
cache) attends over the KV cache in place, row-invariant by construction;
`kernels/sample_tokens.c` (`specd.SampleTokens`) decides a pass's tokens after the logits
(sampling and speculative verification, as daemon/spec's sampler and verifiers do), and
`kernels/token_logprobs.c` (`specd.TokenLogprobs`) the logprobs of the tokens it emitted. They are
built with the machine's C compiler (`$CC`, else cc / gcc / clang) and `-march=native` into the
cache dir, once per source, compiler and CPU; ORT loads them with
`SessionOptions.register_custom_ops_library`. A build compiles into a scratch file named
after its process and renames it into place; scratch files of builds that were killed are
removed the next time the library is looked for.

Where no compiler works the graphs use ONNX Runtime's MatMulNBits: `library()` returns None
and `unavailable_reason()` says why. `SPECD_NATIVE=0` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

from .paths import cache_dir

log = logging.getLogger("specd.native")

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
SOURCES = ("specd_ops.c", "thread_pool.c", "gguf_matmul.c", "causal_attention.c",
           "swiglu.c", "sample_tokens.c", "token_logprobs.c", "moe_router.c")
HEADERS = tuple(sorted(p.name for p in KERNEL_DIR.glob("*.h")))  # all in the build hash
DOMAIN = "specd"
# GGUF tensor types GgufMatMul reads (name -> ggml type id)
GGUF_MATMUL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14}
# -ffp-contract=off: no FMA contraction, so every build rounds as the contract says
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")

_lock = threading.Lock()
_cached: dict[tuple[str, ...], Path | None] = {}
_reasons: dict[tuple[str, ...], str] = {}


class NativeBuildError(RuntimeError):
    pass


def _compiler_command() -> list[str] | None:
    """The command that compiles the kernels: $CC (which may carry arguments, as
    `ccache gcc` or `gcc -m64`), else cc / gcc / clang; None if there is none."""
    cc = os.environ.get("CC")
    if cc:
        parts = shlex.split(cc)
        exe = shutil.which(parts[0]) if parts else None
        return [exe, *parts[1:]] if exe else None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def compiler() -> str | None:
    """The C compiler's executable the kernels are built with, or None."""
    cmd = _compiler_command()
    return cmd[0] if cmd else None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines()
            if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def build(flags: tuple[str, ...] = ("-march=native",), out_dir: Path | None = None) -> Path:
    """Compile the kernels with `flags` (cached by source, compiler, flags and CPU);
    returns the shared library's path. Raises NativeBuildError with the compiler's
    message when it cannot."""
    cc = _compiler_command()
    if cc is None:
        if os.environ.get("CC"):
            raise NativeBuildError(f"CC={os.environ['CC']!r} is not an executable on PATH")
        raise NativeBuildError("no C compiler found (set CC, or install cc / gcc / clang)")
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((KERNEL_DIR / name).read_bytes())
    for part in (" ".join(cc), version, " ".join(BASE_FLAGS + flags), _cpu_signature()):
        h.update(part.encode())
    folder = (out_dir or cache_dir() / "native") / h.hexdigest()[:24]
    lib = folder / "libspecd_kernels.so"
    remove_dead_scratch(folder)
    if lib.is_file():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".build{os.getpid()}-{threading.get_ident()}.so"
    cmd = [*cc, *BASE_FLAGS, *flags, f"-I{KERNEL_DIR}", "-o", str(tmp),
           *(str(KERNEL_DIR / s) for s in SOURCES), "-lm", "-pthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()[-2000:]}")
    os.replace(tmp, lib)
    log.info("built specd kernels: %s", lib)
    return lib


def remove_dead_scratch(folder: Path) -> list[Path]:
    """Remove the scratch libraries (`.build<pid>-<thread>.so`) of builds whose process is
    gone (killed mid-compile: the rename that ends a build never came); a live build's
    is left alone. Returns those removed."""
    import psutil

    gone = []
    for scratch in folder.glob(".build*.so"):
        pid = scratch.name[len(".build"):].split("-", 1)[0]
        if not pid.isdigit() or not psutil.pid_exists(int(pid)):
            scratch.unlink(missing_ok=True)
            gone.append(scratch)
    return gone


def vectorized(lib: Path) -> bool:
    """Whether `lib` was built with the kernels' vector (AVX2) paths."""
    import ctypes

    return bool(ctypes.CDLL(str(lib)).specd_kernels_vectorized())


def library(flags: tuple[str, ...] = ("-march=native",)) -> Path | None:
    """The kernels' shared library for this machine, or None (see unavailable_reason):
    None also where they only build without their vector paths (not x86-64 with AVX2),
    since the plain C paths are slower than ONNX Runtime's own ops."""
    with _lock:
        if flags in _cached:
            return _cached[flags]
        lib: Path | None = None
        if os.environ.get("SPECD_NATIVE", "1") == "0":
            _reasons[flags] = "turned off by SPECD_NATIVE=0"
        else:
            try:
                lib = build(flags)
                if not vectorized(lib):
                    _reasons[flags] = ("built without AVX2 (plain C paths, slower than "
                                       "ONNX Runtime's ops on this CPU)")
                    lib = None
            except (NativeBuildError, OSError) as exc:
                _reasons[flags] = str(exc)
        if lib is None:
            log.warning("specd kernels unavailable, using ONNX Runtime's ops: %s",
                        _reasons[flags])
        _cached[flags] = lib
        return lib


def kernels_for(device: str) -> str:
    """"gguf" where specd's kernels run on `device` (the CPU, compiled), else "ort"."""
    return "gguf" if device == "cpu" and library() is not None else "ort"


def unavailable_reason(flags: tuple[str, ...] = ("-march=native",)) -> str | None:
    library(flags)
    return _reasons.get(flags)


def register(session_options: object, lib: Path | None = None) -> None:
    """Make the kernels known to sessions created with `session_options`."""
    lib = lib or library()
    if lib is None:
        raise NativeBuildError("this graph uses specd's kernels, which are unavailable: "
                               f"{unavailable_reason()}")
    session_options.register_custom_ops_library(str(lib))  # type: ignore[attr-defined]
    threads = session_options.intra_op_num_threads or os.cpu_count() or 1  # type: ignore[attr-defined]
    _handle(lib).specd_set_threads(ctypes.c_int(threads))


_handles: dict[Path, ctypes.CDLL] = {}


def _handle(lib: Path) -> ctypes.CDLL:
    """The loaded library (the one ORT loads too: same path, same object), kept loaded
    for good: its workers run its code."""
    with _lock:
        if lib not in _handles:
            _handles[lib] = ctypes.CDLL(str(lib))
        return _handles[lib]
