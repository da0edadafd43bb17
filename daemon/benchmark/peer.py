"""The peer in `specd bench`: llama.cpp through llama-cpp-python (an optional dependency),
on the same GGUF files, thread count and prompts as specd's runs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from specd.memory_fit.rss import PeakRss

from .run import RunResult

PEER_DRAFT_N = 4
MODES = ("target-only", "lookup", f"draft n_max={PEER_DRAFT_N}")


def _llama_draft_model(llm: Any, n: int) -> Any:
    """A llama-cpp-python draft model backed by a second Llama (the same draft GGUF
    specd uses): n greedy tokens per call, its KV cache reused by prefix matching within
    a generation (`reset()` between generations, so no run reuses another's prompt)."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaDraftModel

    def greedy() -> int:
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(llm.n_vocab(),))))

    class LlamaModelDraft(LlamaDraftModel):
        def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
            ids = input_ids.tolist()
            cached = llm.input_ids[: llm.n_tokens].tolist()
            keep, most = 0, min(len(cached), len(ids) - 1)
            while keep < most and cached[keep] == ids[keep]:
                keep += 1
            llm.n_tokens = keep  # eval drops the cache from here on
            llm.eval(ids[keep:])
            out = [greedy()]
            while len(out) < n:
                llm.eval(out[-1:])
                out.append(greedy())
            return np.array(out, dtype=np.intc)

        def reset(self) -> None:
            llm.reset()

        def prime(self, ids: list[int]) -> None:
            """Evaluate the prompt now: the first draft call then finds it cached, so
            its pass over the prompt is prompt processing, as specd's drafter.begin is
            (llama-cpp-python would otherwise make it after the first token, in decode)."""
            llm.reset()
            llm.eval(ids)

    return LlamaModelDraft()


class PeerRunner:
    """llama.cpp target-only, prompt lookup, and speculation with a draft model
    (llama-cpp-python's verify loop over llama.cpp). Each mode's models are created on
    its first run, inside that run's memory measurement."""

    MODES = MODES

    def __init__(self, target_path: Path, threads: int, n_ctx: int,
                 draft_path: Path | None = None):
        from llama_cpp import Llama  # optional dependency

        self._Llama = Llama
        self.path, self.threads, self.n_ctx = target_path, threads, n_ctx
        self.draft_path = draft_path
        self._llms: dict[str, Any] = {}

    def _new(self, path: Path, draft_model: Any = None) -> Any:
        return self._Llama(model_path=str(path), n_threads=self.threads,
                           n_threads_batch=self.threads, n_ctx=self.n_ctx, verbose=False,
                           draft_model=draft_model)

    def _llm(self, mode: str) -> Any:
        if mode not in self._llms:
            if mode == "lookup":
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

                dm = LlamaPromptLookupDecoding(num_pred_tokens=8)
            elif mode == MODES[2] and self.draft_path is not None:
                dm = _llama_draft_model(self._new(self.draft_path), PEER_DRAFT_N)
            elif mode == "target-only":
                dm = None
            else:
                raise ValueError(f"peer mode {mode!r} is not available")
            self._llms[mode] = self._new(self.path, dm)
        return self._llms[mode]

    def run(self, prompt: list[int], mode: str, temperature: float,
            max_tokens: int, seed: int) -> RunResult:
        with PeakRss(interval_s=0.05) as peak:
            llm = self._llm(mode)
            llm.reset()
            llm.set_seed(seed)
            draft: Any = getattr(llm, "draft_model", None)  # llama-cpp-python's, if any
            if hasattr(draft, "reset"):
                draft.reset()
            t0 = time.perf_counter()
            if hasattr(draft, "prime"):  # inside time to first token, as for specd
                draft.prime(prompt)
            first = None
            n = 0
            for _tok in llm.generate(prompt, temp=temperature, top_k=0, top_p=1.0,
                                     min_p=0.0, repeat_penalty=1.0, reset=True):
                n += 1
                if first is None:
                    first = time.perf_counter()
                if n >= max_tokens:
                    break
            end = time.perf_counter()
        assert first is not None
        decode = (n - 1) / (end - first) if n > 1 else 0.0
        return RunResult(len(prompt) / (first - t0), decode, first - t0, 1.0, [], {}, n, 0,
                         peak_bytes=peak.peak, start_bytes=peak.start, growth_bytes=peak.growth)
