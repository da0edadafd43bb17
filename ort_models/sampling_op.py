"""The graph's token decision (specd.SampleTokens, kernels/sample_tokens.c, and
specd.TokenLogprobs, kernels/token_logprobs.c): what a call asks of it and what it answers.

A graph built with `BuildOptions.sampler` ends in one SampleTokens node after its logits,
and a TokenLogprobs node after that (the emitted tokens' logprobs, where a call asks).
Each call of a pass may carry a `SampleSpec`: its rows are then decided in the graph (a
draw or the argmax, or the verification of a drafted block by rejection sampling), and
only the emitted tokens, the acceptance probabilities, a few candidates and any logprobs
asked for leave the session (`SampledBlock`). Calls without one are skipped by the nodes
and decided on the host from their logits. Uniforms come from Philox4x32-10 keyed by `key`
and counted by token position, `stream` and draw, so a seeded sequence draws the same
numbers however its tokens fall into calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# graph inputs and outputs of the node, in the op's order
INPUTS = ("sample_plan", "sample_params", "sample_keys", "sample_drafts", "sample_q_ids",
          "sample_q_probs", "sample_history", "sample_bias_ids", "sample_bias_values",
          "sample_masks")
OUTPUTS = ("sampled_tokens", "sampled_counts", "sampled_accept_probs", "sampled_cand_ids",
           "sampled_cand_probs")
# the TokenLogprobs node's own input, and its outputs
LOGPROB_INPUTS = ("sample_logprobs",)
LOGPROB_OUTPUTS = ("sampled_logprobs", "sampled_top_ids", "sampled_top_logprobs")
# the graph's, in the order they are bound and read
GRAPH_INPUTS = INPUTS + LOGPROB_INPUTS
GRAPH_OUTPUTS = OUTPUTS + LOGPROB_OUTPUTS
MAX_LOGPROBS = 1024  # top tokens TokenLogprobs returns at most
PLAN_COLUMNS = 10
PARAM_COLUMNS = 8
# plan flags
TEMPERATURE_LAST = 1
REJECTION = 2
MASKED = 4
# status of a decided call
OK, DEAD_END, NO_TOKEN = 0, 1, 2
TARGET_STREAM, DRAFT_STREAM = 0, 1


@dataclass(frozen=True)
class SampleSpec:
    """How the graph decides one call's rows: row i < len(drafts) verifies draft i, the
    next row draws the bonus (a call without drafts: one draw from its first row).

    The sampler settings are llama.cpp's (temperature 0: the argmax). `history`: the
    tokens emitted before the call, oldest first, of which the last `window` (-1: all, 0:
    none) are penalised, the drafts accepted inside the block joining them. `q_ids` /
    `q_probs` [n, k]: each draft's distribution, sparse, for rejection sampling (None:
    a draft is accepted where the target's own choice equals it). `masks` [n + 1, vocab]
    bool: what the grammar allows at each row along the drafts (None: everything).
    `stop_after`: accepting draft j ends the block (the grammar completes on it).
    `candidates`: how many of each decided row's most probable tokens to return.
    `logprobs`: each emitted token's logprob under its row's logits (before any sampler
    setting) and the `logprobs` most likely tokens' (-1: none)."""

    key: int  # 64-bit Philox key
    position: int  # sequence position of the token decided at the first row
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    temperature_last: bool = True
    window: int = 0
    history: Sequence[int] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    drafts: Sequence[int] = ()
    q_ids: np.ndarray | None = None  # [n, k] int
    q_probs: np.ndarray | None = None  # [n, k] float
    masks: np.ndarray | None = None  # [n + 1, vocab] bool
    stop_after: int = -1
    candidates: int = 0
    stream: int = TARGET_STREAM
    logprobs: int = -1
    want_logits: bool = False  # the call's logits leave the session too

    @property
    def rows(self) -> int:
        return len(self.drafts) + 1


@dataclass(frozen=True)
class EmittedLogprobs:
    """The emitted tokens' logprobs under their rows' logits, and the most likely tokens'
    (log softmax of the raw logits; ties by lower id)."""

    logprobs: np.ndarray  # [n_emitted] float64
    top_ids: np.ndarray  # [n_emitted, k] int64, most likely first
    top_logprobs: np.ndarray  # [n_emitted, k] float64


@dataclass(frozen=True)
class SampledBlock:
    """What the graph decided for one call."""

    tokens: list[int]  # accepted drafts, then the target's token (unless the block ended)
    n_accepted: int
    status: int  # OK, DEAD_END (a later row's mask allowed nothing), NO_TOKEN
    accept_probs: tuple[float, ...]  # per draft position decided
    cand_ids: np.ndarray  # [rows, k] per row, most probable first; -1 past the end
    cand_probs: np.ndarray  # [rows, k]
    logprobs: EmittedLogprobs | None = None  # where the spec asked for them


def pack_masks(masks: np.ndarray) -> np.ndarray:
    """bool [n, vocab] -> int32 [n, ceil(vocab / 32)]: token t is bit t % 32 of word t // 32."""
    n, vocab = masks.shape
    words = -(-vocab // 32)
    padded = np.zeros((n, words * 32), dtype=np.bool_)
    padded[:, :vocab] = masks
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32).view(
        np.int32)


def pack_inputs(specs: Sequence[SampleSpec | None], first_rows: Sequence[int],
                vocab: int) -> dict[str, np.ndarray]:
    """The nodes' inputs for a pass whose calls have these specs (None: skipped) and
    whose logits rows begin at `first_rows`. Inputs no call uses are shared constants."""
    c = len(specs)
    live = [(i, s) for i, s in enumerate(specs) if s is not None]
    d = max((len(s.drafts) for _, s in live), default=0)
    k = max((s.q_ids.shape[1] for _, s in live if s.q_ids is not None), default=0)
    h = max((len(s.history) for _, s in live), default=0)
    nb = max((len(s.logit_bias) for _, s in live), default=0)
    fill = _fillers(c, max(d, 1), -(-vocab // 32))
    drafts = np.full((c, d), -1, dtype=np.int64) if d else fill["sample_drafts"]
    if k:
        q_ids = np.full((c, d, k), -1, dtype=np.int64)
        q_probs = np.zeros((c, d, k), dtype=np.float32)
    else:
        q_ids, q_probs = fill["sample_q_ids"], fill["sample_q_probs"]
    history = np.full((c, h), -1, dtype=np.int64) if h else fill["sample_history"]
    if nb:
        bias_ids = np.full((c, nb), -1, dtype=np.int64)
        bias_values = np.zeros((c, nb), dtype=np.float64)
    else:
        bias_ids, bias_values = fill["sample_bias_ids"], fill["sample_bias_values"]
    plan = [_SKIPPED_PLAN] * c
    params = [_SKIPPED_PARAMS] * c
    keys = [0] * c
    n_top = [-1] * c
    mask_rows: list[np.ndarray] = []
    n_masks = 0
    for i, s in live:
        n = len(s.drafts)
        flags = TEMPERATURE_LAST if s.temperature_last else 0
        if s.q_ids is not None and s.q_probs is not None and s.temperature > 0.0:
            flags |= REJECTION
            q_ids[i, :n, :s.q_ids.shape[1]] = s.q_ids
            q_probs[i, :n, :s.q_ids.shape[1]] = s.q_probs
        mask_row = 0
        if s.masks is not None:
            flags |= MASKED
            mask_row = n_masks
            mask_rows.append(pack_masks(s.masks))
            n_masks += s.masks.shape[0]
        plan[i] = (1, first_rows[i], n, s.position, flags, mask_row, s.window, s.stop_after,
                   s.candidates, s.stream)
        params[i] = (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty,
                     s.presence_penalty, s.frequency_penalty, 0.0)
        keys[i] = s.key & _KEY_BITS
        if s.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs {s.logprobs} is above {MAX_LOGPROBS}")
        n_top[i] = s.logprobs
        if n:
            drafts[i, :n] = s.drafts
        if s.history:
            history[i, h - len(s.history):] = s.history
        for j, (token, bias) in enumerate(s.logit_bias):
            bias_ids[i, j], bias_values[i, j] = token, bias
    return {"sample_plan": np.array(plan, dtype=np.int64),
            "sample_params": np.array(params, dtype=np.float64),
            "sample_keys": np.array(keys, dtype=np.uint64).view(np.int64),
            "sample_drafts": drafts, "sample_q_ids": q_ids, "sample_q_probs": q_probs,
            "sample_history": history, "sample_bias_ids": bias_ids,
            "sample_bias_values": bias_values,
            "sample_masks": np.concatenate(mask_rows) if mask_rows else fill["sample_masks"],
            "sample_logprobs": (np.array(n_top, dtype=np.int64) if max(n_top, default=-1) >= 0
                                else fill["sample_logprobs"])}


_SKIPPED_PLAN = (0,) * PLAN_COLUMNS
_SKIPPED_PARAMS = (0.0,) * PARAM_COLUMNS


@functools.lru_cache(maxsize=64)
def _fillers(c: int, d: int, words: int) -> dict[str, np.ndarray]:
    """Read-only fillers for the inputs no call of a pass of c calls (d rows of drafts)
    uses, made once per shape."""
    return {"sample_drafts": _unused((c, 1), np.int64, -1),
            "sample_q_ids": _unused((c, d, 1), np.int64, -1),
            "sample_q_probs": _unused((c, d, 1), np.float32, 0),
            "sample_history": _unused((c, 1), np.int64, -1),
            "sample_bias_ids": _unused((c, 1), np.int64, -1),
            "sample_bias_values": _unused((c, 1), np.float64, 0),
            "sample_masks": _unused((1, words), np.int32, 0),
            "sample_logprobs": _unused((c,), np.int64, -1)}


_KEY_BITS = 2**64 - 1


@functools.lru_cache(maxsize=64)
def _unused(shape: tuple[int, ...], dtype: type, fill: float) -> np.ndarray:
    """A read-only filler for an input no call of a pass uses (made once per shape)."""
    out: np.ndarray = np.full(shape, fill, dtype=dtype)
    out.flags.writeable = False
    return out


def bind(binding: Any, specs: Sequence[SampleSpec | None], first_rows: Sequence[int],
         vocab: int, bound: dict[str, np.ndarray]) -> None:
    """Bind the nodes' inputs for these calls to an onnxruntime.IOBinding (those still
    bound from its last pass, `bound`, kept: the shared constants), and their outputs,
    whose shapes vary by pass (ORT allocates them per run)."""
    for name, array in pack_inputs(specs, first_rows, vocab).items():
        held = bound.get(name)
        if held is array:
            continue
        # ORT reads a bound input where it lies: a pass's own array of the same shape is
        # overwritten in place instead of bound anew (shared fillers are read-only)
        if (held is not None and held.flags.writeable and array.flags.writeable
                and held.shape == array.shape):
            held[...] = array
            continue
        binding.bind_cpu_input(name, array)
        bound[name] = array
    for name in GRAPH_OUTPUTS:
        binding.bind_output(name, "cpu")


def read(outputs: Any, first: int, specs: Sequence[SampleSpec | None],
         first_rows: Sequence[int]) -> list[SampledBlock | None]:
    """Each call's SampledBlock from a run's outputs, the nodes' from index `first` on."""
    return unpack_outputs([outputs[first + j] for j in range(len(GRAPH_OUTPUTS))], specs,
                          first_rows)


def unpack_outputs(outputs: Sequence[Any], specs: Sequence[SampleSpec | None],
                   first_rows: Sequence[int]) -> list[SampledBlock | None]:
    """Each call's SampledBlock from the nodes' outputs (in GRAPH_OUTPUTS' order; anything
    with `.numpy()`, read only where a call needs it)."""
    tokens, counts = outputs[0].numpy(), outputs[1].numpy()
    drafted = any(s is not None and s.drafts for s in specs)
    accept = outputs[2].numpy() if drafted else None
    wanted = any(s is not None and s.candidates for s in specs)
    cand_ids = outputs[3].numpy() if wanted else None
    cand_probs = outputs[4].numpy() if wanted else None
    lp = ([o.numpy() for o in outputs[5:8]]
          if any(s is not None and s.logprobs >= 0 for s in specs) else None)
    out: list[SampledBlock | None] = []
    for i, s in enumerate(specs):
        if s is None:
            out.append(None)
            continue
        n_emitted, n_accepted, status = counts[i].tolist()
        first = first_rows[i]
        if cand_ids is not None and cand_probs is not None:
            ids, probs = cand_ids[first:first + s.rows], cand_probs[first:first + s.rows]
        else:
            ids, probs = _unused((s.rows, 0), np.int64, -1), _unused((s.rows, 0), np.float32, 0)
        out.append(SampledBlock(
            tokens[i, :n_emitted].tolist(), n_accepted, status,
            () if accept is None or not s.drafts else  # -1: undecided
            tuple(a for a in accept[i, :len(s.drafts)].tolist() if a >= 0.0),
            ids, probs,
            None if lp is None or s.logprobs < 0 else EmittedLogprobs(
                lp[0][i, :n_emitted], lp[1][i, :n_emitted, :s.logprobs],
                lp[2][i, :n_emitted, :s.logprobs])))
    return out
