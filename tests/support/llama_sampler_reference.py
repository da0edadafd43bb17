"""llama.cpp's samplers (src/llama-sampler.cpp, their `*_apply`) written again, plainly, over
a `llama_token_data_array`-like list: the independent reference of specd's sampler chain
(daemon/spec/sampler_chain.py). Float32 where llama.cpp computes in float; the final
draw is llama.cpp's `dist`: the softmax of the logits left."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Token:
    id: int
    logit: float
    p: float = 0.0


@dataclass
class Cur:
    data: list[Token]
    sorted: bool = False


@dataclass
class Vocab:
    eog: set[int]
    eot: int
    pieces: list[bytes]  # token_to_piece without specials


@dataclass
class Settings:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_coin: float = 0.0  # the uniform the XTC sampler draws for this token
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    history: Sequence[int] = ()  # the penalties' window
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_history: Sequence[int] = ()  # DRY's window
    dry_breakers: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    min_keep: int = 0


def _sort(cur: Cur) -> None:
    cur.data.sort(key=lambda t: (-t.logit, t.id))
    cur.sorted = True


def softmax_(cur: Cur, do_sort: bool) -> None:
    if do_sort and not cur.sorted:
        _sort(cur)
    top = max(t.logit for t in cur.data)
    total = 0.0
    for t in cur.data:
        t.p = math.exp(t.logit - top) if t.logit != -math.inf else 0.0
        total += t.p
    for t in cur.data:
        t.p /= total


def top_k(cur: Cur, s: Settings) -> None:
    if s.top_k <= 0:
        return
    _sort(cur)
    cur.data = cur.data[:min(s.top_k, len(cur.data))]


def top_p(cur: Cur, s: Settings) -> None:
    if s.top_p >= 1.0:
        return
    softmax_(cur, True)
    total = 0.0
    for i, t in enumerate(cur.data):
        total += t.p
        if total >= s.top_p and i + 1 >= s.min_keep:
            cur.data = cur.data[:i + 1]
            return


def min_p(cur: Cur, s: Settings) -> None:
    if s.min_p <= 0.0:
        return
    cut = max(t.logit for t in cur.data) + math.log(s.min_p)
    kept = [t for t in cur.data if t.logit >= cut]
    if len(kept) >= s.min_keep:  # the unsorted path
        cur.data = kept
        cur.sorted = False
        return
    _sort(cur)  # too few: the sorted path, which keeps min_keep at least
    i = 1
    while i < len(cur.data) and not (cur.data[i].logit < cut and i >= s.min_keep):
        i += 1
    cur.data = cur.data[:i]


def typical(cur: Cur, s: Settings) -> None:
    if s.typical_p >= 1.0:
        return
    softmax_(cur, True)
    entropy = -sum(t.p * math.log(t.p) for t in cur.data if t.p > 0)
    score = [abs(-math.log(t.p) - entropy) if t.p > 0 else math.inf for t in cur.data]
    order = sorted(range(len(cur.data)), key=lambda i: score[i])
    total, last = 0.0, len(order)
    for n, i in enumerate(order):
        total += cur.data[i].p
        if total > s.typical_p and (s.min_keep == 0 or n >= s.min_keep - 1):
            last = n + 1
            break
    cur.data = [cur.data[i] for i in order[:last]]
    cur.sorted = False


def top_n_sigma(cur: Cur, s: Settings) -> None:
    if s.top_n_sigma <= 0.0 or len(cur.data) <= 1:
        return
    finite = [t.logit for t in cur.data if t.logit != -math.inf]
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
    top = max(finite)
    for t in cur.data:
        if t.logit < top - s.top_n_sigma * std:
            t.logit = -math.inf


def xtc(cur: Cur, s: Settings) -> None:
    if s.xtc_probability <= 0.0 or s.xtc_threshold > 0.5 or len(cur.data) < 2:
        return
    if s.xtc_coin > s.xtc_probability:
        return
    softmax_(cur, True)
    pos_last = 0
    for i, t in enumerate(cur.data):
        if t.p >= s.xtc_threshold:
            pos_last = i
        else:
            break
    if len(cur.data) - pos_last >= s.min_keep and pos_last > 0:
        cur.data = cur.data[pos_last:]


def temperature(cur: Cur, s: Settings) -> None:
    if s.temperature <= 0.0:
        best = max(cur.data, key=lambda t: (t.logit, -t.id))
        for t in cur.data:
            if t is not best:
                t.logit = -math.inf
        return
    for t in cur.data:
        t.logit /= s.temperature


def penalties(cur: Cur, s: Settings) -> None:
    counts: dict[int, int] = {}
    for t in s.history:
        counts[t] = counts.get(t, 0) + 1
    for t in cur.data:
        if t.id in counts:
            t.logit = t.logit * s.repeat_penalty if t.logit <= 0 else t.logit / s.repeat_penalty
            t.logit -= counts[t.id] * s.frequency_penalty + s.presence_penalty
    cur.sorted = False


def dry(cur: Cur, s: Settings) -> None:
    """DRY with the repeat lengths counted directly (llama.cpp uses the Z-algorithm)."""
    if s.dry_multiplier == 0.0:
        return
    hist = list(s.dry_history)
    n = len(hist)
    if n <= s.dry_allowed_length:
        return
    rep_limit = n
    for i in range(n):  # i tokens from the end
        head = hist[n - 1 - i]
        matches = [len(tail) for tail in s.dry_breakers.get(head, [])
                   if len(tail) <= i and all(tail[o] == hist[n - 1 - (i - o - 1)]
                                             for o in range(len(tail)))]
        if matches:
            rep_limit = i - max(matches)
            break
    if rep_limit < s.dry_allowed_length:
        return
    longest: dict[int, int] = {}
    for end in range(n - 1):  # a repetition of the window's tail ending at `end`
        length = 0  # how far the tokens up to `end` equal the window's last ones
        while length <= end and hist[end - length] == hist[n - 1 - length]:
            length += 1
        length = min(length, rep_limit)
        if length >= s.dry_allowed_length:
            nxt = hist[end + 1]
            longest[nxt] = max(longest.get(nxt, 0), length)
    for t in cur.data:
        if t.id in longest and () not in s.dry_breakers.get(t.id, []):
            t.logit -= s.dry_multiplier * s.dry_base ** (longest[t.id] - s.dry_allowed_length)
    cur.sorted = False


def infill(cur: Cur, vocab: Vocab) -> None:
    softmax_(cur, True)
    p_txt = sum(t.p for t in cur.data if t.id not in vocab.eog)
    p_eog = sum(t.p for t in cur.data if t.id in vocab.eog)
    if 3 * p_eog * len(cur.data) > p_txt:
        cur.data = [t for t in cur.data if t.id in vocab.eog]
        return
    _merge_only(cur, vocab)
    kept = [t for t in cur.data if t.p >= 0.2 or t.id in vocab.eog]
    n_text = sum(t.id not in vocab.eog for t in kept)
    if n_text == 0:
        cur.data = [Token(vocab.eot, 1.0)]
        return
    total = sum(t.p for t in kept)
    for t in kept:
        t.p /= total
    cur.data = [t for t in kept if t.p >= 1.0 / (n_text + 1) or t.id in vocab.eog]


def chain_probs(logits: np.ndarray, chain: Sequence[str], s: Settings,
                vocab: Vocab | None = None) -> np.ndarray:
    """The distribution [vocab] llama.cpp's `dist` draws from after `chain`."""
    cur = Cur([Token(i, float(v)) for i, v in enumerate(logits)])
    steps: dict[str, Callable[[Cur], None]] = {
        "penalties": lambda c: penalties(c, s), "dry": lambda c: dry(c, s),
        "top_n_sigma": lambda c: top_n_sigma(c, s), "top_k": lambda c: top_k(c, s),
        "typ_p": lambda c: typical(c, s), "top_p": lambda c: top_p(c, s),
        "min_p": lambda c: min_p(c, s), "xtc": lambda c: xtc(c, s),
        "temperature": lambda c: temperature(c, s),
        "infill": lambda c: infill(c, vocab)}  # type: ignore[arg-type]
    for name in chain:
        steps[name](cur)
    out = np.zeros(len(logits))
    top = max(t.logit for t in cur.data)
    for t in cur.data:
        if t.logit != -math.inf:
            out[t.id] += math.exp(t.logit - top)
    return out / out.sum()


def greedy_near_tie(probs: dict[int, float], chain: Sequence[str], s: Settings,
                    vocab: Vocab, eps: float = 0.05, trials: int = 24) -> bool:
    """Whether llama.cpp's greedy choice after `chain` (top-k, top-p, infill...; `s` its
    settings, with temperature 0) could change if each logit moved by up to `eps`, as two
    implementations' logits differ by rounding: given the probabilities of the most likely
    tokens (at least top_k of them), the choice is recomputed under `trials` random moves
    of that size, over those tokens (the rest are beyond top-k)."""
    ids = sorted(probs, key=lambda t: (-probs[t], t))[:s.top_k]
    local = Vocab({i for i, t in enumerate(ids) if t in vocab.eog}, len(ids),
                  [vocab.pieces[t] for t in ids] + [b""])
    logits = np.array([math.log(probs[t]) for t in ids] + [-math.inf])  # [k + 1]
    rng = np.random.default_rng(0)
    choices = set()
    for trial in range(trials + 1):
        moved = logits + (0.0 if trial == 0 else rng.uniform(-eps, eps, logits.shape[0]))
        choices.add(int(np.argmax(chain_probs(moved, chain, s, local))))
        if len(choices) > 1:
            return True
    return False


def _merge_only(cur: Cur, vocab: Vocab) -> None:
    """infill's pooling of tokens whose text is a prefix of another's, alone."""
    for a in cur.data:
        for b in cur.data:
            if a.logit == -math.inf:
                break
            if a is b or b.logit == -math.inf:
                continue
            pa, pb = vocab.pieces[a.id], vocab.pieces[b.id]
            if 0 < len(pa) <= len(pb) and pb[:len(pa)] == pa:
                dst, src = (b, a) if b.p > a.p else (a, b)
                dst.p += src.p
                src.logit, src.p = -math.inf, 0.0
