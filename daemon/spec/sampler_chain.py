"""llama.cpp's sampler chain on the host: one step per sampler, in a registry by name.

A request's ``samplers`` (llama-server's field: names, or a string of one letter each)
lists the steps in the order they run, between the logit bias (always first, as in
llama.cpp) and the final draw. Each step takes the candidates (token ids and their logits,
float64) and returns the ones it keeps, with their logits; the draw is from the softmax of
what is left, so a step that only decides *which* tokens stay (top-k, typical, infill...)
leaves the relative odds of the survivors to their logits, as llama.cpp's ``dist`` sampler
recomputes them from the logits. Without ``samplers`` the chain is llama-server's default
(`DEFAULT_CHAIN`); steps whose settings are off are left out when the chain is built.

Steps (llama.cpp's ``src/llama-sampler.cpp``, its ``*_apply``):

- ``penalties``: repeat / frequency / presence penalties over the recent tokens.
- ``dry``: DRY, a penalty on tokens that would extend a repeated sequence.
- ``top_n_sigma``: tokens more than n standard deviations below the top logit get -inf.
- ``top_k``, ``typ_p`` (locally typical), ``top_p``, ``min_p``: filters. ``min_keep``
  (llama.cpp's, 0 or 1: off) is the fewest tokens typical, top-p, min-p and XTC leave
  (the most likely ones; typical: the most typical); top-k takes none, as in llama.cpp.
- ``xtc``: with probability ``xtc_probability``, drops every token at or above
  ``xtc_threshold`` but the least likely of them. Its coin for the n-th token a sampler
  decides (n: tokens accepted before it) is the counter-based uniform
  ``philox_uniform(key, n, XTC_STREAM, 0)``: no draw from the sampler's own stream, so a
  seeded request is reproducible and every token still takes exactly one uniform there.
- ``temperature``: divides the logits (0: the argmax, and the chain ends there).
- ``infill``: llama.cpp's FIM sampler: only the end-of-generation tokens when their share
  (times the number of candidates, times 3) outweighs the text's; else tokens whose text
  is a prefix of another's pool their probability into the likelier, and text tokens
  below 0.2, then below 1 / (n + 1), are dropped (none left: a single end-of-text token).

Ties in an order are broken by the lower token id (llama.cpp's sorts leave them open).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .philox import philox_uniform
from .sampler_vocab import SamplerVocab

if TYPE_CHECKING:
    from .sampling import SamplerParams

__all__ = [
    "DEFAULT_CHAIN",
    "GRAPH_ORDERS",
    "STEPS",
    "XTC_STREAM",
    "Candidates",
    "ChainContext",
    "ChainStep",
    "parse_samplers",
    "softmax",
]

# the counter-based stream of XTC's coins (0 and 1 are the graph's target and draft draws)
XTC_STREAM = 2

# top-p without top-k: look at this many of the most likely tokens first and grow
# the window (8x, then everything) until the nucleus fits, instead of sorting the
# whole vocabulary up front.
_TOP_P_FIRST_WINDOW = 1024

# llama.cpp's infill thresholds: EOG wins at 3 * p_eog * n > p_txt; text tokens below
# this probability are dropped first
_INFILL_EOG_WEIGHT = 3.0
_INFILL_FIRST_THRESHOLD = 0.2
# DRY: exponents are clamped so that base ** exponent stays a float32 (log(FLT_MAX))
_FLOAT_MAX_LOG = 88.7228391


def softmax(logits: np.ndarray) -> np.ndarray:
    """Stable softmax over the last axis, float64 out; -inf entries get probability 0.

    The shift by the maximum is taken in float64, exp in float32 (each term within an
    ulp of float32, ~6e-8 relative; the values are <= 0, so no overflow), the sum and
    the division in float64. NumPy's float64 exp has no SIMD path on AVX2 CPUs, and this
    runs once per sampled row over the whole vocabulary.
    """
    x = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):  # below float32's range: -inf, probability 0
        shifted = (x - np.max(x, axis=-1, keepdims=True)).astype(np.float32)  # <= 0
    np.exp(shifted, out=shifted)
    e = shifted.astype(np.float64)
    e /= np.sum(e, axis=-1, keepdims=True)
    return e


@dataclass
class Candidates:
    """The tokens still in the running: ids ascending [m] (None: every id of the row, in
    order) and their logits [m], float64, the chain's own copy (steps modify it).
    `greedy`: the temperature step picked one token at temperature 0 (the chain ends)."""

    ids: np.ndarray | None
    logits: np.ndarray
    greedy: bool = False

    def keep(self, positions: np.ndarray | None) -> Candidates:
        """Those at `positions` (ascending; None: all)."""
        if positions is None:
            return self
        ids = positions if self.ids is None else self.ids[positions]
        return Candidates(ids, self.logits[positions])

    def token_ids(self) -> np.ndarray:
        return np.arange(self.logits.shape[0]) if self.ids is None else self.ids

    def positions_of(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where those of `tokens` [t] that are candidates sit here, and which they are
        ([t] bool)."""
        if self.ids is None:
            inside = (tokens >= 0) & (tokens < self.logits.shape[0])
            return tokens[inside], inside
        if self.ids.shape[0] == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(tokens.shape[0], dtype=np.bool_)
        at = np.minimum(np.searchsorted(self.ids, tokens), self.ids.shape[0] - 1)
        inside = self.ids[at] == tokens
        return at[inside], inside


@dataclass(frozen=True)
class ChainContext:
    """What the steps read besides the candidates: the request's settings, the model's
    vocabulary (infill, DRY), the recent tokens (`history`: the penalties' window,
    `dry_history`: DRY's, oldest first), `index`: how many tokens the sampler decided
    before this one, `key`: the sampler's counter-based key (XTC's coin)."""

    params: SamplerParams
    vocab: SamplerVocab | None
    history: Sequence[int]
    dry_history: Sequence[int]
    index: int
    key: int


@dataclass(frozen=True)
class ChainStep:
    """One sampler: `apply` maps the candidates to those it keeps; `active(params)`
    whether it does anything at these settings (left out of the chain when not);
    `keeps_max`: it never drops the most likely token nor changes a logit (so greedy
    decoding, an argmax, may skip it); `needs_vocab`: it reads the model's vocabulary."""

    apply: Callable[[Candidates, ChainContext], Candidates]
    active: Callable[[SamplerParams], bool]
    keeps_max: bool = False
    needs_vocab: bool = False


# -- steps ------------------------------------------------------------------------------
def _penalties(c: Candidates, ctx: ChainContext) -> Candidates:
    """Each token among the recent ones: its logit divided by repeat_penalty (multiplied
    where <= 0), less count * frequency_penalty + presence_penalty."""
    if not ctx.history:
        return c
    p = ctx.params
    seen, counts = np.unique(np.fromiter(ctx.history, dtype=np.int64),
                             return_counts=True)  # [s], [s]
    at, inside = c.positions_of(seen)
    counts = counts[inside]
    vals = c.logits[at]
    if p.repeat_penalty != 1.0:
        vals = np.where(vals > 0.0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    c.logits[at] = vals - (counts * p.frequency_penalty + p.presence_penalty)
    return c


def _penalties_active(p: SamplerParams) -> bool:
    return (p.repeat_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0) and p.repeat_last_n != 0


def _dry(c: Candidates, ctx: ChainContext) -> Candidates:
    """DRY (llama.cpp's port of koboldcpp's): a token that would extend a sequence
    repeated from earlier in the window, longer than dry_allowed_length, loses
    multiplier * base ** (length - allowed_length); sequence breakers cut the length."""
    p = ctx.params
    hist = ctx.dry_history
    n = len(hist)
    allowed = p.dry_allowed_length
    if n <= allowed:
        return c
    assert ctx.vocab is not None
    breakers = ctx.vocab.dry_breakers(p.dry_sequence_breakers)

    def rat(i: int) -> int:  # the i-th token from the end
        return hist[n - 1 - i]

    rep_limit = _dry_repeat_limit(rat, n, breakers)
    if rep_limit < allowed:
        return c
    counts = _dry_repeat_counts(rat, n, rep_limit)
    longest: dict[int, int] = {}  # token -> the longest repetition it would extend
    for i in range(n - 1):
        if counts[i] >= allowed:
            token = rat(n - 2 - i)
            longest[token] = max(longest.get(token, 0), counts[i])
    max_exponent = int(_FLOAT_MAX_LOG / math.log(p.dry_base)) if p.dry_base > 1.000001 else 0
    for token, length in longest.items():
        if () in breakers.get(token, ()):  # a breaker on its own is never penalised
            continue
        exponent = length - allowed
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        at, inside = c.positions_of(np.array([token], dtype=np.int64))
        if inside[0]:
            c.logits[at[0]] -= p.dry_multiplier * p.dry_base ** exponent
    return c


def _dry_repeat_limit(rat: Callable[[int], int], n: int,
                      breakers: dict[int, list[tuple[int, ...]]]) -> int:
    """How far back a repetition may reach: up to the latest sequence breaker (its head
    token `i` from the end, then its tail towards the end)."""
    for i in range(n):
        tails = breakers.get(rat(i))
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            if longest < len(tail) <= i and all(
                    tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            return i - longest
    return n


def _dry_repeat_counts(rat: Callable[[int], int], n: int, rep_limit: int) -> list[int]:
    """counts[n - 1 - k]: how many tokens before the one k from the end match the window's
    last tokens (capped at rep_limit): the Z-algorithm over the reversed window."""
    counts = [0] * n
    last = n - 1
    lt = rt = 0
    for k in range(1, n):
        if k > rt:  # outside the current Z-box: compare directly
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            counts[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            pair = k - lt
            right = rt - k + 1
            if counts[last - pair] < right:
                counts[last - k] = min(counts[last - pair], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                counts[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    return counts


def _dry_active(p: SamplerParams) -> bool:
    return p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0


def _top_n_sigma(c: Candidates, ctx: ChainContext) -> Candidates:
    """Logits below max - n * std (over the finite ones) become -inf."""
    x = c.logits
    if x.shape[0] <= 1:
        return c
    finite = x[x != -np.inf]
    if finite.shape[0] == 0:
        return c
    cut = finite.max() - ctx.params.top_n_sigma * finite.std()
    x[x < cut] = -np.inf
    return c


def _top_k(c: Candidates, ctx: ChainContext) -> Candidates:
    return c.keep(_top_k_ids(c.logits, ctx.params.top_k))


def _typical(c: Candidates, ctx: ChainContext) -> Candidates:
    """The smallest set of tokens whose -log p is closest to the entropy with mass over
    typical_p."""
    m = c.logits.shape[0]
    if m <= 1:
        return c
    order = _descending(c)  # [m]
    p = softmax(c.logits[order])  # [m], descending
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p)
        entropy = -float(np.where(p > 0.0, p * logp, 0.0).sum())
        shifted = np.abs(-logp - entropy)  # [m]
    by_typicality = np.argsort(shifted, kind="stable")  # [m]
    cum = np.cumsum(p[by_typicality])
    n_keep = min(max(int(np.searchsorted(cum, ctx.params.typical_p, side="right")) + 1,
                     ctx.params.min_keep), m)
    return c.keep(np.sort(order[by_typicality[:n_keep]]))


def _top_p(c: Candidates, ctx: ChainContext) -> Candidates:
    return c.keep(_top_p_keep(c.logits, ctx.params.top_p, ctx.params.min_keep))


def _min_p(c: Candidates, ctx: ChainContext) -> Candidates:
    return c.keep(_min_p_keep(c.logits, ctx.params.min_p, ctx.params.min_keep))


def _xtc(c: Candidates, ctx: ChainContext) -> Candidates:
    """With probability xtc_probability, every token at or above xtc_threshold but the
    least likely of them is dropped (module doc: the coin)."""
    m = c.logits.shape[0]
    if m < 2:
        return c
    coin = float(philox_uniform(ctx.key, ctx.index, XTC_STREAM, 0))
    if coin > ctx.params.xtc_probability:
        return c
    order = _descending(c)  # [m]
    p = softmax(c.logits[order])  # [m], descending
    above = int(np.argmin(p >= ctx.params.xtc_threshold)) if not (
        p >= ctx.params.xtc_threshold).all() else m
    if above < 2 or m - (above - 1) < ctx.params.min_keep:
        return c
    return c.keep(np.sort(order[above - 1:]))


def _temperature(c: Candidates, ctx: ChainContext) -> Candidates:
    """Logits divided by the temperature, after the best is made 0 (so that a temperature
    however small cannot overflow every value to -inf; softmax is shift-invariant); at 0
    the argmax (ties to the lower id) alone."""
    t = ctx.params.temperature
    if t <= 0.0:
        best = int(np.argmax(c.logits))
        return Candidates(c.token_ids()[best:best + 1], np.zeros(1), greedy=True)
    c.logits -= c.logits.max()
    with np.errstate(over="ignore"):  # -> -inf: probability 0, as it must be
        c.logits /= t
    return c


def _infill(c: Candidates, ctx: ChainContext) -> Candidates:
    """llama.cpp's infill sampler (module doc); the kept tokens keep their logits (a
    merged-away one: -inf)."""
    vocab = ctx.vocab
    assert vocab is not None
    order = _descending(c)  # [m]
    ids = c.token_ids()[order]  # [m] descending probability
    logits = c.logits[order].copy()  # [m]
    p = softmax(logits)  # [m]
    eog = np.fromiter((int(t) in vocab.eog for t in ids), dtype=np.bool_, count=ids.shape[0])
    p_eog = float(p[eog].sum())
    p_txt = float(p[~eog].sum())
    if _INFILL_EOG_WEIGHT * p_eog * ids.shape[0] > p_txt:
        return _sorted_candidates(ids[eog], logits[eog])
    _merge_common_prefixes(ids, logits, p, vocab)
    keep = (p >= _INFILL_FIRST_THRESHOLD) | eog
    n_text = int((keep & ~eog).sum())
    if n_text == 0:
        return Candidates(np.array([vocab.eot], dtype=np.int64), np.ones(1))
    p = np.where(keep, p, 0.0) / p[keep].sum()
    keep &= (p >= 1.0 / (n_text + 1)) | eog
    return _sorted_candidates(ids[keep], logits[keep])


def _merge_common_prefixes(ids: np.ndarray, logits: np.ndarray, p: np.ndarray,
                           vocab: SamplerVocab) -> None:
    """llama.cpp's pass over the candidates (descending probability, `ids`/`logits`/`p`
    [m], modified): for each i0 in order and each i1 whose text starts with i0's, the
    less likely of the two gives its probability to the other and leaves (logit -inf).
    Pairs without a prefix relation change nothing, so only those are visited, in the
    same order."""
    pieces = [vocab.piece(int(t)) for t in ids]
    by_text = sorted(range(len(pieces)), key=lambda i: pieces[i])  # positions by text
    texts = [pieces[i] for i in by_text]
    for i0, piece in enumerate(pieces):
        if not piece:  # a control token's text is empty: a prefix of nothing
            continue
        j = bisect.bisect_left(texts, piece)  # texts starting with piece follow it
        longer = []
        while j < len(texts) and texts[j].startswith(piece):
            longer.append(by_text[j])
            j += 1
        for i1 in sorted(longer):
            if logits[i0] == -np.inf:
                break
            if i1 == i0 or logits[i1] == -np.inf:
                continue
            dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
            p[dst] += p[src]
            logits[src] = -np.inf
            p[src] = 0.0


STEPS: dict[str, ChainStep] = {
    "penalties": ChainStep(_penalties, _penalties_active),
    "dry": ChainStep(_dry, _dry_active, needs_vocab=True),
    "top_n_sigma": ChainStep(_top_n_sigma, lambda p: p.top_n_sigma > 0.0, keeps_max=True),
    "top_k": ChainStep(_top_k, lambda p: p.top_k > 0, keeps_max=True),
    "typ_p": ChainStep(_typical, lambda p: p.typical_p < 1.0),
    "top_p": ChainStep(_top_p, lambda p: p.top_p < 1.0, keeps_max=True),
    "min_p": ChainStep(_min_p, lambda p: p.min_p > 0.0, keeps_max=True),
    "xtc": ChainStep(_xtc, lambda p: p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5),
    "temperature": ChainStep(_temperature, lambda p: True),
    "infill": ChainStep(_infill, lambda p: True, needs_vocab=True),
}

# llama-server's chain when a request names none (common/common.h)
DEFAULT_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature")
# the orders the graph's sampler runs (ort_models/sampling_op.py: penalties, top-k, top-p,
# min-p, with the temperature last or before top-p)
GRAPH_ORDERS = (("penalties", "top_k", "top_p", "min_p", "temperature"),
                ("penalties", "top_k", "temperature", "top_p", "min_p"))


# -- names ------------------------------------------------------------------------------
# llama.cpp's one-letter names (common_sampler_type_to_chr)
_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma",
            "m": "min_p", "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties",
            "a": "adaptive_p"}
# samplers llama-server knows that specd does not run
_NOT_SUPPORTED = {"adaptive_p"}


def _aliases() -> dict[str, str]:
    """Every name llama.cpp accepts for a step (common_sampler_types_from_names): the
    canonical one, kebab-case and without the underscore, and nucleus / temp / typ; also
    "typical" and "typical_p" (the request field's name)."""
    names: dict[str, str] = {}
    for name in [*STEPS, *_NOT_SUPPORTED]:
        names[name] = name
        if "_" in name:
            names[name.replace("_", "-")] = name
            names[name.replace("_", "")] = name
    names.update(nucleus="top_p", temp="temperature", typ="typ_p", typical="typ_p",
                 typical_p="typ_p")
    return names


_NAMES = _aliases()


def parse_samplers(value: str | Iterable[str]) -> tuple[str, ...]:
    """A request's `samplers`: a list of names (any case, llama.cpp's aliases) or a string
    of one letter each ("edkypmxt"), as canonical step names; ValueError naming the first
    one that is unknown or not supported."""
    if isinstance(value, str):
        out = []
        for letter in value:
            if letter not in _LETTERS:
                raise ValueError(f"unknown sampler letter {letter!r} in samplers {value!r} "
                                 f"(known: {''.join(_LETTERS)})")
            out.append(_LETTERS[letter])
        names = out
    else:
        names = []
        for raw in value:
            if not isinstance(raw, str):
                raise ValueError(f"samplers must be names (strings), got {raw!r}")
            name = _NAMES.get(raw.lower())
            if name is None:
                raise ValueError(f"unknown sampler {raw!r} (known: {', '.join(STEPS)})")
            names.append(name)
    for name in names:
        if name in _NOT_SUPPORTED:
            raise ValueError(f"the {name} sampler is not supported by specd")
    return tuple(names)


def graph_order(chain: Sequence[str], params: SamplerParams) -> tuple[str, ...] | None:
    """The chain's active steps where they are one of the orders the graph runs (a
    subsequence of one; a missing step is off there), else None."""
    active = [name for name in chain if STEPS[name].active(params)]
    for order in GRAPH_ORDERS:
        it = iter(order)
        if all(name in it for name in active):
            return tuple(active)
    return None


# -- helpers ----------------------------------------------------------------------------
def _descending(c: Candidates) -> np.ndarray:
    """Positions by descending logit, ties by lower id."""
    return np.lexsort((c.token_ids(), -c.logits))


def _sorted_candidates(ids: np.ndarray, logits: np.ndarray) -> Candidates:
    order = np.argsort(ids, kind="stable")
    return Candidates(ids[order], logits[order])


def _top_k_ids(x: np.ndarray, k: int) -> np.ndarray | None:
    """Ids of the k largest entries of x [vocab], ties at the cut to the lowest ids."""
    if k <= 0 or k >= x.shape[0]:
        return None
    return _top_ids(x, k, kth=_kth_largest(x, k))


def _kth_largest(x: np.ndarray, k: int) -> float:
    """The k-th largest value of x [n] (1 <= k < n) without partitioning all of x.

    Split x into k blocks: the smallest block maximum is a lower bound for the k-th
    largest value (the k maxima are k entries at or above it), so partitioning only
    the entries at or above that bound gives the exact answer, usually from a few
    hundred candidates instead of the whole vocabulary.
    """
    n = x.shape[0]
    bound = x[: n - n % k].reshape(k, -1).max(axis=1).min()
    cand = x[x >= bound]  # [c >= k]
    return float(np.partition(cand, cand.shape[0] - k)[cand.shape[0] - k])


def _top_ids(x: np.ndarray, k: int, kth: float) -> np.ndarray:
    """Ascending ids of the k largest entries of x, given kth = the k-th largest value.

    Everything above kth is kept; ties at kth are filled in from the lowest id.
    """
    above = np.flatnonzero(x > kth)
    ties = np.flatnonzero(x == kth)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, ties]))


def _top_p_keep(vals: np.ndarray, top_p: float, min_keep: int = 0) -> np.ndarray | None:
    """Positions of the minimal most-likely set whose probability mass reaches top_p,
    and at least `min_keep` of them.

    Tokens are taken by descending probability (ties by lower position) and the one
    that crosses top_p is kept, as llama.cpp does.  Only the largest values are
    sorted: a window of 1024, then 8x larger, then everything, so a full sort of the
    vocabulary happens only for flat distributions.
    """
    n = vals.shape[0]
    if top_p >= 1.0 or n <= 1:
        return None
    p = softmax(vals)  # [m]
    window = min(n, _TOP_P_FIRST_WINDOW)
    while True:
        top = p if window >= n else p[p >= _kth_largest(p, window)]  # [>= window]
        desc = np.sort(top)[::-1][:window]  # [window] the largest values, descending
        cut = max(int(np.searchsorted(np.cumsum(desc), top_p, side="left")), min_keep - 1)
        if cut < window or window >= n:
            n_keep = min(cut + 1, window)
            return None if n_keep >= n else _top_ids(p, n_keep, kth=desc[n_keep - 1])
        window = window * 8 if window * 8 <= n // 4 else n


def _min_p_keep(vals: np.ndarray, min_p: float, min_keep: int = 0) -> np.ndarray | None:
    """Positions whose probability is at least min_p times the largest (max always kept);
    fewer than `min_keep` of them: the `min_keep` most likely (ties to the lower position)."""
    n = vals.shape[0]
    if min_p <= 0.0 or n <= 1:
        return None
    # in logit space: p_i >= min_p * p_max  <=>  v_i - v_max >= log(min_p)
    kept = np.flatnonzero(vals - np.max(vals) >= math.log(min_p))
    if kept.shape[0] >= min_keep:
        return kept
    return None if min_keep >= n else _top_ids(vals, min_keep, kth=_kth_largest(vals, min_keep))
