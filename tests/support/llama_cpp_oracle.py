"""llama.cpp itself as an oracle: its binaries at the build specd follows, where built
(`bench/build_llama_cpp.sh`; the tests that need them skip with the reason otherwise)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

VERSION = 11434
_CANDIDATE = re.compile(r"draft candidate\s+(\d+), pos\s+\d+:\s+(\d+) \(\s*([0-9.]+)\)")
_ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens")


def bin_dir() -> Path:
    """Where the binaries are: $SPECD_LLAMA_CPP_BIN, else specd's cache."""
    if env := os.environ.get("SPECD_LLAMA_CPP_BIN"):
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specd" / f"llama.cpp-{VERSION}" / "build" / "bin"


def missing(binary: str) -> str | None:
    """Why `binary` cannot run (None: it can)."""
    path = bin_dir() / binary
    if not os.access(path, os.X_OK):
        return (f"llama.cpp's {binary} is not built at {path} (bench/build_llama_cpp.sh "
                "builds it, or set SPECD_LLAMA_CPP_BIN)")
    return None


@dataclass
class Round:
    candidates: list[list[tuple[int, float]]]  # per drafted position: its top (id, p), best first
    accepted: int

    @property
    def drafts(self) -> list[int]:
        return [c[0][0] for c in self.candidates]


def speculative_rounds(target: Path, draft: Path, prompt: str, *, spec_type: str,
                       n_predict: int, n_max: int, threads: int = 2) -> list[Round]:
    """Greedy speculative decoding by llama-speculative-simple (float32 KV caches): each
    round's drafted positions with their top candidates and probabilities under the
    draft's top-10 sampler (from its debug log), and how many the target accepted."""
    cmd = [str(bin_dir() / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
           "--spec-type", spec_type, "--spec-draft-n-max", str(n_max),
           "--spec-draft-p-min", "0", "-p", prompt, "-n", str(n_predict), "--temp", "0",
           "-lv", "5", "-t", str(threads), "-c", "256",
           "-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32"]
    r = subprocess.run(cmd, capture_output=True, timeout=300)
    log = (r.stdout + r.stderr).decode("utf-8", errors="replace")
    if r.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple exited {r.returncode}: {log[-2000:]}")
    rounds: list[Round] = []
    positions: list[list[tuple[int, float]]] = []
    for line in log.splitlines():
        if m := _CANDIDATE.search(line):
            if m.group(1) == "0":
                positions.append([])
            positions[-1].append((int(m.group(2)), float(m.group(3))))
        elif m := _ACCEPTED.search(line):
            rounds.append(Round(positions, int(m.group(1))))
            positions = []
    return rounds
