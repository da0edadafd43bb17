"""The peer in `specd bench`: llama.cpp as its users run it, llama-server at the build specd
follows (daemon/benchmark/llama_cpp.py builds it), on the same GGUF files, threads,
context and prompts as specd's runs, over HTTP.

Modes (one server process each, started at its first run and kept until close):

    target-only                  no speculation
    ngram-mod                    --spec-type ngram-mod (prompt lookup)
    draft-simple                 -md DRAFT --spec-type draft-simple, llama.cpp's defaults
    draft-simple n_max=8 p_min=0.5   the same, tuned for a small CPU draft
    draft-dflash                 -md HEAD --spec-type draft-dflash (a DFlash-family head),
                                 llama.cpp's defaults (3 drafts a round)
    draft-dflash n_max=16        the same, drafting the head's whole block (llama.cpp
                                 clamps n_max to it)

Each run is one /completion of the prompt's token ids (no prompt cache between runs), the
sampler reduced to the temperature as in specd's runs; the server's own timings give
prefill and decode rates, its draft counters the acceptance length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .llama_server import LlamaServer
from .run import RunResult

TUNED_N_MAX, TUNED_P_MIN = 8, 0.5
BLOCK_N_MAX = 16  # above any block a head is trained for: llama.cpp drafts the whole block
DRAFT_MODES = ("draft-simple", f"draft-simple n_max={TUNED_N_MAX} p_min={TUNED_P_MIN}")
HEAD_MODES = ("draft-dflash", f"draft-dflash n_max={BLOCK_N_MAX}")
MODES = ("target-only", "ngram-mod", *DRAFT_MODES, *HEAD_MODES)


class LlamaServerPeer:
    MODES = MODES

    def __init__(self, target_path: Path, threads: int, n_ctx: int,
                 draft_path: Path | None = None, head_path: Path | None = None):
        self.path, self.threads, self.n_ctx = target_path, threads, n_ctx
        self.draft_path, self.head_path = draft_path, head_path
        self._servers: dict[str, LlamaServer] = {}

    def _args(self, mode: str) -> list[str]:
        if mode == "target-only":
            return []
        if mode == "ngram-mod":
            return ["--spec-type", "ngram-mod"]
        if mode.startswith("draft-simple"):
            if self.draft_path is None:
                raise ValueError(f"peer mode {mode!r} needs a draft model")
            args = ["-md", str(self.draft_path), "--spec-type", "draft-simple",
                    "-td", str(self.threads)]
            if mode != "draft-simple":
                args += ["--spec-draft-n-max", str(TUNED_N_MAX),
                         "--spec-draft-p-min", str(TUNED_P_MIN)]
            return args
        if mode.startswith("draft-dflash"):
            if self.head_path is None:
                raise ValueError(f"peer mode {mode!r} needs a drafter head")
            args = ["-md", str(self.head_path), "--spec-type", "draft-dflash"]
            if mode != "draft-dflash":
                args += ["--spec-draft-n-max", str(BLOCK_N_MAX)]
            return args
        raise ValueError(f"unknown peer mode {mode!r} (one of {', '.join(MODES)})")

    def _server(self, mode: str) -> LlamaServer:
        if mode not in self._servers:
            self._servers[mode] = LlamaServer(self.path, threads=self.threads,
                                              n_ctx=self.n_ctx,
                                              args=["-np", "1", *self._args(mode)])
        return self._servers[mode]

    def run(self, prompt: list[int], mode: str, temperature: float,
            max_tokens: int, seed: int) -> RunResult:
        server = self._server(mode)
        start, _ = server.memory()
        out: dict[str, Any] = server.post("/completion", {
            "prompt": prompt, "n_predict": max_tokens, "temperature": temperature,
            "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": seed,
            "cache_prompt": False, "ignore_eos": True})
        end, peak = server.memory()
        t = out["timings"]
        n = int(t.get("predicted_n", 0))
        accepted = int(t.get("draft_n_accepted", 0) or 0)
        rounds = max(n - accepted, 1)  # each round emits its accepted drafts and one more
        ttft = float(t.get("prompt_ms", 0.0)) / 1e3
        return RunResult(float(t.get("prompt_per_second", 0.0)),
                         float(t.get("predicted_per_second", 0.0)), ttft, n / rounds, [], {},
                         n, 0, peak_bytes=peak, start_bytes=start, growth_bytes=end - start)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
