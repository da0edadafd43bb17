"""llama.cpp itself as an oracle: its binaries at the build specd follows, where built
(specd.daemon.benchmark.llama_cpp; the tests that need them skip with the reason
otherwise)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specd.daemon.benchmark.llama_cpp import bin_dir, missing

__all__ = ["bin_dir", "missing", "split_gguf", "speculative_rounds", "speculative_run",
           "greedy_completion", "greedy_with_logprobs", "greedy_with_margins",
           "agreed_until_near_tie", "mtmd_image_embeddings"]

_CANDIDATE = re.compile(r"draft candidate\s+(\d+), pos\s+\d+:\s+(\d+) \(\s*([0-9.]+)\)")
_DRAFTED = re.compile(r"called impl .*, hist size = (\d+),")
_ACCEPTED = re.compile(
    r"accepted (\d+)/(\d+) draft tokens(?:, the last target token is: \((\d+)\))?")


@dataclass
class Round:
    # per drafted position: its top (id, p), best first (empty where the drafter logs none:
    # DFlash2 walks its lattice without logging candidates)
    candidates: list[list[tuple[int, float]]]
    accepted: int
    last: int = -1  # the target's token after the accepted drafts (-1: not in the log)
    n_drafted: int = -1  # tokens the target verified after `last` (-1: not in the log)
    pos: int = -1  # position of the round's first verified token (-1: not in the log)

    @property
    def drafts(self) -> list[int]:
        return [c[0][0] for c in self.candidates]


def served_model(name: str) -> Path:
    """The catalog model `name` for a test beside llama-server: skipped where the binary
    is missing, else fetched (conftest.fetched_model)."""
    import pytest
    from conftest import fetched_model

    if reason := missing("llama-server"):
        pytest.skip(reason)
    return fetched_model(name)


def split_gguf(src: Path, out: Path, *args: str) -> Path:
    """`src` split by llama-gguf-split (`args`: --split-max-tensors N or --split-max-size
    N(M|G)) into `out` as `model-0000i-of-0000n.gguf`; the first part's path."""
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([str(bin_dir() / "llama-gguf-split"), "--split", *args, str(src),
                        str(out / "model")], capture_output=True, text=True, timeout=600)
    parts = sorted(out.glob("model-*-of-*.gguf"))
    if r.returncode != 0 or not parts:
        raise RuntimeError(f"llama-gguf-split exited {r.returncode}: "
                           f"{(r.stdout + r.stderr)[-2000:]}")
    return parts[0]


@dataclass
class SpeculativeRun:
    rounds: list[Round]
    output: bytes  # what llama-speculative-simple printed: the prompt's pieces, then the text's


def speculative_rounds(target: Path, draft: Path, prompt: str, *, spec_type: str,
                       n_predict: int, n_max: int, threads: int = 2) -> list[Round]:
    """Greedy speculative decoding by llama-speculative-simple (float32 KV caches and
    attention): each round's drafted positions with their top candidates and probabilities
    under the draft's top-10 sampler (from its debug log), and how many the target
    accepted."""
    return speculative_run(target, draft, prompt, spec_type=spec_type, n_predict=n_predict,
                           n_max=n_max, threads=threads).rounds


def speculative_run(target: Path, draft: Path, prompt: str, *, spec_type: str,
                    n_predict: int, n_max: int, threads: int = 2) -> SpeculativeRun:
    """`speculative_rounds`, each round with the position it drafted at (its debug log's
    history size), the number of drafts the target verified (a drafter logs candidates for
    its whole block, then the draft is cut to the token budget) and its last token; and
    the printed text. Flash attention is off: llama.cpp's CPU flash attention rounds to
    float16 (a random head's drafts then move by up to ~0.04 logits), its plain attention
    computes in float32."""
    cmd = [str(bin_dir() / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
           "--spec-type", spec_type, "--spec-draft-n-max", str(n_max),
           "--spec-draft-p-min", "0", "-p", prompt, "-n", str(n_predict), "--temp", "0",
           "-lv", "5", "-t", str(threads), "-c", "256",
           "-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32", "-fa", "off"]
    env = {**os.environ, "LD_PRELOAD": str(_log_drain())}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        r = subprocess.run(cmd, stdout=out, stderr=err, env=env, timeout=300)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    log = (stdout + stderr).decode("utf-8", errors="replace")
    if r.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple exited {r.returncode}: {log[-2000:]}")
    run = _parse_run(stdout, stderr)
    m = _TOTALS.search(log)
    if not m or (int(m.group(1)), int(m.group(2))) != (
            sum(x.accepted + 1 for x in run.rounds), sum(x.n_drafted for x in run.rounds)):
        raise RuntimeError("llama-speculative-simple's closing counts are missing or "
                           f"disagree with its rounds: {log[-2000:]}")
    return run


_TOTALS = re.compile(r"n_predict = (\d+)\n.*n_drafted = (\d+)", re.DOTALL)

# llama.cpp's logger writes from a thread that the process leaks at exit, so the lines
# still queued then are lost; preloaded, this library's destructor drains the queue
_LOG_DRAIN = b"""
struct common_log;
common_log * common_log_main();
void common_log_pause(common_log * log);
__attribute__((destructor)) static void drain_log() { common_log_pause(common_log_main()); }
"""


def _log_drain() -> Path:
    """The log-draining library, built once per llama.cpp build with its C++ compiler."""
    lib_dir = bin_dir()
    key = hashlib.sha256(_LOG_DRAIN + str(lib_dir).encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"specd-log-drain-{key}.so"
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_bytes(_LOG_DRAIN)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run(["c++", "-shared", "-fPIC", "-o", str(tmp), str(src),
                            f"-L{lib_dir}", "-lllama-common", f"-Wl,-rpath,{lib_dir}"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"building the log-draining library failed: {r.stderr[-2000:]}")
        tmp.replace(lib)
    return lib


def _parse_run(stdout: bytes, stderr: bytes) -> SpeculativeRun:
    """The rounds in llama-speculative-simple's debug log, and its printed text."""
    rounds: list[Round] = []
    positions: list[list[tuple[int, float]]] = []
    pos = -1
    for line in stderr.decode("utf-8", errors="replace").splitlines():
        if m := _CANDIDATE.search(line):
            if m.group(1) == "0":
                positions.append([])
            positions[-1].append((int(m.group(2)), float(m.group(3))))
        elif m := _DRAFTED.search(line):
            pos = int(m.group(1))
        elif m := _ACCEPTED.search(line):
            n = int(m.group(2))
            rounds.append(Round(positions[:n], int(m.group(1)),
                                int(m.group(3)) if m.group(3) else -1, n, pos))
            positions, pos = [], -1
    return SpeculativeRun(rounds, stdout)


def greedy_completion(model: Path, prompt: list[int], n_predict: int, *, threads: int = 2,
                      n_ctx: int = 512) -> list[int]:
    """The token ids llama-server generates greedily after the token ids `prompt` (a server
    started for the call, on a free loopback port, float32 KV cache)."""
    return [t for t, _ in greedy_with_logprobs(model, prompt, n_predict, threads=threads,
                                               n_ctx=n_ctx, n_probs=0)]


def greedy_with_logprobs(model: Path, prompt: list[int], n_predict: int, *, n_probs: int = 5,
                         threads: int = 2, n_ctx: int = 512
                         ) -> list[tuple[int, dict[int, float]]]:
    """Greedy decoding by llama-server (float32 KV cache) after `prompt`: each generated
    token with the log probabilities of the n_probs most likely tokens at its position
    (before sampling)."""
    from specd.daemon.benchmark.llama_server import LlamaServer

    with LlamaServer(model, threads=threads, n_ctx=n_ctx,
                     args=["-np", "1", "-ctk", "f32", "-ctv", "f32", "--no-warmup"]) as server:
        out = server.post("/completion", {
            "prompt": prompt, "n_predict": n_predict, "temperature": 0, "top_k": 1,
            "return_tokens": True, "cache_prompt": False, "ignore_eos": True,
            "n_probs": n_probs, "post_sampling_probs": False})
    return tokens_with_top(out)


def tokens_with_top(out: dict[str, Any]) -> list[tuple[int, dict[int, float]]]:
    """A /completion answer's tokens, each with its position's top log probabilities.
    llama-server leaves out the probabilities of a token that ends inside a UTF-8
    character (an empty dict here); the others come in order, each naming its token."""
    probs = list(out.get("completion_probabilities") or [])
    result: list[tuple[int, dict[int, float]]] = []
    for token in (int(t) for t in out["tokens"]):
        top: dict[int, float] = {}
        if probs and int(probs[0].get("id", -1)) == token:
            top = {int(c["id"]): float(c["logprob"]) for c in probs.pop(0)["top_logprobs"]}
        result.append((token, top))
    return result


def mtmd_greedy(text: Path, mmproj: Path, prompt: str, images: list[bytes], n_predict: int,
                *, threads: int = 2, n_ctx: int = 512) -> tuple[list[int], list[float]]:
    """llama-server's (--mmproj) greedy tokens after a prompt string holding a media
    marker per image (its /completion's multimodal_data), and each step's top-1 minus
    top-2 log probability (the logit margin)."""
    steps = mtmd_greedy_with_logprobs(text, mmproj, prompt, images, n_predict, n_probs=2,
                                      threads=threads, n_ctx=n_ctx)
    margins = []
    for _, top in steps:
        two = sorted(top.values(), reverse=True)
        margins.append(two[0] - two[1] if len(two) > 1 else float("inf") if two else 0.0)
    return [t for t, _ in steps], margins


def mtmd_greedy_with_logprobs(text: Path, mmproj: Path, prompt: str, images: list[bytes],
                              n_predict: int, *, n_probs: int = 5, threads: int = 2,
                              n_ctx: int = 512) -> list[tuple[int, dict[int, float]]]:
    """llama-server's (--mmproj) greedy decoding after a prompt string holding a media
    marker per image (its /completion's multimodal_data): each token with the log
    probabilities of the n_probs most likely at its position (empty where llama-server
    leaves them out). llama-server's marker is random unless LLAMA_MEDIA_MARKER names
    one: it is set to specd's (llama-server's old default)."""
    import base64
    import os

    from specd.daemon.benchmark.llama_server import LlamaServer
    from specd.daemon.spec.media import MEDIA_MARKER

    before = os.environ.get("LLAMA_MEDIA_MARKER")
    os.environ["LLAMA_MEDIA_MARKER"] = MEDIA_MARKER
    try:
        server = LlamaServer(text, threads=threads, n_ctx=n_ctx,
                             args=["--mmproj", str(mmproj), "-np", "1", "-ctk", "f32",
                                   "-ctv", "f32", "--no-warmup"])
    finally:
        if before is None:
            del os.environ["LLAMA_MEDIA_MARKER"]
        else:
            os.environ["LLAMA_MEDIA_MARKER"] = before
    with server:
        out = server.post("/completion", {
            "prompt": {"prompt_string": prompt,
                       "multimodal_data": [base64.b64encode(b).decode() for b in images]},
            "n_predict": n_predict, "temperature": 0, "top_k": 1, "return_tokens": True,
            "cache_prompt": False, "ignore_eos": True, "n_probs": n_probs,
            "post_sampling_probs": False})
    return tokens_with_top(out)


def greedy_with_margins(runner: object, prompt: list[int], n: int
                        ) -> tuple[list[int], list[float]]:
    """specd's greedy continuation (a ModelRunner, one token a call) and each step's top-1
    minus top-2 logit."""
    tokens: list[int] = []
    margins: list[float] = []
    logits = runner.prefill(0, prompt)  # type: ignore[attr-defined]
    for i in range(n):
        two = np.sort(logits)[-2:]
        margins.append(float(two[1] - two[0]))
        tokens.append(int(np.argmax(logits)))
        logits = runner.forward(0, [tokens[-1]], len(prompt) + i)[0]  # type: ignore[attr-defined]
    return tokens, margins


def agreed_until_near_tie(ours: list[int], margins: list[float], theirs: list[int],
                          near: float = 0.25) -> int:
    """How many leading tokens were compared: up to specd's first near tie (top two within
    `near`: two implementations that round activations differently may split there, and
    the texts diverge after). Raises AssertionError where the two differ before it."""
    clear = next((i for i, m in enumerate(margins) if m < near), len(margins))
    assert ours[:clear] == theirs[:clear], (clear, ours[:clear], theirs[:clear])
    return clear


@dataclass
class MtmdEncoding:
    embeddings: np.ndarray  # [n_tokens, n_embd] float32
    encode_ms: float  # llama.cpp's own time for the image batch


def mtmd_image_embeddings(text: Path, mmproj: Path, image: Path, *, chat_template: str = "",
                          threads: int = 2) -> MtmdEncoding:
    """llama.cpp's embeddings of `image` through `mmproj`, as llama-mtmd-cli encodes it
    before the text model (MTMD_DEBUG_EMBEDDINGS dumps them: [n_tokens, n_embd] int32s,
    then the floats), and the encode time it logs."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "embeddings.bin"
        cmd = [str(bin_dir() / "llama-mtmd-cli"), "-m", str(text), "--mmproj", str(mmproj),
               "--image", str(image), "-p", "describe", "-n", "1", "--temp", "0",
               "-t", str(threads)] + (["--chat-template", chat_template] if chat_template
                                      else [])
        r = subprocess.run(cmd, capture_output=True, timeout=300,
                           env={**os.environ, "MTMD_DEBUG_EMBEDDINGS": str(dump)})
        log = (r.stdout + r.stderr).decode("utf-8", errors="replace")
        if r.returncode != 0 or not dump.is_file():
            raise RuntimeError(f"llama-mtmd-cli exited {r.returncode}: {log[-2000:]}")
        raw = np.fromfile(dump, dtype=np.int32)
    n_tokens, n_embd = int(raw[0]), int(raw[1])
    m = re.search(r"batch encoding done in (\d+) ms", log)
    return MtmdEncoding(raw[2:].view(np.float32).reshape(n_tokens, n_embd).copy(),
                        float(m.group(1)) if m else float("nan"))
