"""Host-side token sampling (pure numpy, float64).

The pipeline is llama.cpp's sampler chain (sampler_chain.py: one step per sampler)::

    logit bias -> the chain's steps, in order -> draw

Without a request's ``samplers`` the chain is llama-server's default, of which the steps
specd's defaults leave on are::

    penalties -> top-k -> top-p -> min-p -> temperature

The penalties (llama.cpp's, over the last ``repeat_last_n`` emitted tokens): each token
seen there has its logit divided by ``repeat_penalty`` (multiplied where negative), then
lowered by ``count * frequency_penalty + presence_penalty`` (OpenAI's two, as llama.cpp
applies them).

llama.cpp applies temperature *after* the truncation filters, so top-p and min-p
see the untempered distribution.  ``SamplerParams.temperature_last=False`` moves
temperature in front of the filters instead (the HF transformers / vLLM order).
Temperature 0 means greedy: argmax of the penalised logits, ties to the lowest
token id, no rng draw (with an explicit chain: of what the steps before the
temperature leave; a chain without ``temperature`` samples at temperature 1).

Every non-greedy draw consumes exactly one uniform from the sampler's own PCG64
generator and inverts the CDF of :meth:`Sampler.probs` in ascending token-id
order, so a seeded request is reproducible token for token and the verifier can
reason about how many draws each step takes (XTC's coin is a counter-based draw,
not from that stream: sampler_chain.py).

Constrained generation passes a ``mask`` ([vocab] bool, e.g. ``GrammarState.allowed``):
disallowed tokens are removed before everything else (as if their logits were -inf), so
the filters and the temperature act on the allowed tokens only and the result is the
renormalised distribution over them; greedy is the argmax among the allowed tokens.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from specd.ort_models.sampling_op import TARGET_STREAM

from .philox import philox_uniform
from .sampler_chain import DEFAULT_CHAIN, STEPS, Candidates, ChainContext, graph_order, softmax
from .sampler_vocab import SamplerVocab

__all__ = [
    "NoAllowedToken",
    "Sampler",
    "SamplerParams",
    "SamplerVocab",
    "TokenLogprob",
    "derive_seeds",
    "mask_logits",
    "post_sampling_logprob",
    "sample_from_probs",
    "softmax",
    "token_logprob",
]

@dataclass
class SamplerParams:
    """Per-request sampling settings (llama.cpp names and defaults for the 'off' values).

    temperature: 0 = greedy.  top_k: 0 = off.  top_p: 1.0 = off.  min_p: 0 = off.
    repeat_penalty: 1.0 = off; applied over the distinct tokens among the last
    ``repeat_last_n`` accepted tokens (0 = off, -1 = the whole history).
    presence_penalty, frequency_penalty: 0 = off; over the same tokens (module doc).
    logit_bias: token id -> what is added to its logit (-inf: never drawn).
    seed: None = fresh OS entropy.  temperature_last: llama.cpp order (see module doc).
    samplers: the chain's steps in order (sampler_chain.STEPS names; None: llama-server's
    default chain, DEFAULT_CHAIN, with temperature_last deciding where the temperature is).
    typical_p: 1.0 = off.  top_n_sigma: <= 0 = off.  xtc_probability: 0 = off;
    xtc_threshold: > 0.5 = off.  dry_multiplier: 0 = off; dry_base (>= 1),
    dry_allowed_length, dry_penalty_last_n (0 = off, -1 = the whole history) and
    dry_sequence_breakers as llama-server's.  min_keep: the fewest tokens typical, top-p,
    min-p and XTC leave (0 or 1 = off; sampler_chain.py).
    """

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    temperature_last: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    samplers: tuple[str, ...] | None = None
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    min_keep: int = 0

    @property
    def chain(self) -> tuple[str, ...]:
        """The steps in the order they run (those off at these settings included)."""
        if self.samplers is not None:
            return self.samplers
        if self.temperature_last:
            return DEFAULT_CHAIN
        rest = tuple(s for s in DEFAULT_CHAIN if s != "temperature")
        at = rest.index("top_k") + 1
        return rest[:at] + ("temperature",) + rest[at:]

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 in a chain that has the temperature step (without it the
        temperature is not applied: llama.cpp samples the chain's output as it is)."""
        return self.temperature == 0.0 and "temperature" in self.chain

    @property
    def effective_temperature(self) -> float:
        """The temperature the chain applies (1.0 where it has no temperature step)."""
        return self.temperature if "temperature" in self.chain else 1.0

    def graph_equivalent(self) -> SamplerParams | None:
        """These settings as the graph's sampler runs them (its fixed order: penalties,
        top-k, top-p, min-p, temperature, or the temperature before top-p), where the
        chain's active steps fit that order: the steps the chain leaves out switched off.
        None where they do not, or where min_keep would act on a filter the graph runs
        (its top-p and min-p have no min_keep): the request samples on the host."""
        if self.min_keep > 1 and any(name in ("top_p", "min_p") and STEPS[name].active(self)
                                     for name in self.chain):
            return None
        if self.samplers is None:
            return self
        order = graph_order(self.samplers, self)
        if order is None:
            return None
        on = set(order)
        last_t = "temperature" not in on or order.index("temperature") == len(order) - 1
        return replace(
            self, samplers=None,
            temperature=self.temperature if "temperature" in on else 1.0,
            temperature_last=last_t,
            top_k=self.top_k if "top_k" in on else 0,
            top_p=self.top_p if "top_p" in on else 1.0,
            min_p=self.min_p if "min_p" in on else 0.0,
            repeat_penalty=self.repeat_penalty if "penalties" in on else 1.0,
            presence_penalty=self.presence_penalty if "penalties" in on else 0.0,
            frequency_penalty=self.frequency_penalty if "penalties" in on else 0.0,
            typical_p=1.0, top_n_sigma=-1.0, xtc_probability=0.0, dry_multiplier=0.0)

    def validate(self) -> SamplerParams:
        """Raise ValueError naming the first out-of-range field; return self when valid."""
        _check_real("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        _check_real("repeat_penalty", self.repeat_penalty)
        if self.repeat_penalty <= 0.0:
            raise ValueError(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        _check_int("repeat_last_n", self.repeat_last_n)
        if self.repeat_last_n < -1:
            raise ValueError(
                f"repeat_last_n must be >= -1 (0 = off, -1 = whole history), "
                f"got {self.repeat_last_n}"
            )
        _check_real("presence_penalty", self.presence_penalty)
        _check_real("frequency_penalty", self.frequency_penalty)
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias token", token)
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not (isinstance(bias, int | float) and not isinstance(bias, bool)) or not (
                    math.isfinite(bias) or bias == -math.inf):
                raise ValueError(f"logit_bias for token {token} must be a finite number "
                                 f"or -inf, got {bias!r}")
        _check_int("min_keep", self.min_keep)
        if self.min_keep < 0:
            raise ValueError(f"min_keep must be >= 0 (0 = off), got {self.min_keep}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if self.seed < 0:
                raise ValueError(f"seed must be a non-negative integer or None, got {self.seed}")
        self._validate_chain()
        return self

    def _validate_chain(self) -> None:
        if self.samplers is not None:
            unknown = [s for s in self.samplers if s not in STEPS]
            if unknown:
                raise ValueError(f"unknown sampler {unknown[0]!r} (known: {', '.join(STEPS)})")
        _check_real("typical_p", self.typical_p)
        _check_real("top_n_sigma", self.top_n_sigma)
        _check_real("xtc_probability", self.xtc_probability)
        if not 0.0 <= self.xtc_probability <= 1.0:
            raise ValueError(f"xtc_probability must be in [0, 1] (0 = off), "
                             f"got {self.xtc_probability}")
        _check_real("xtc_threshold", self.xtc_threshold)
        if not 0.0 <= self.xtc_threshold <= 1.0:
            raise ValueError(f"xtc_threshold must be in [0, 1] (> 0.5 = off), "
                             f"got {self.xtc_threshold}")
        _check_real("dry_multiplier", self.dry_multiplier)
        _check_real("dry_base", self.dry_base)
        _check_int("dry_allowed_length", self.dry_allowed_length)
        if self.dry_allowed_length < 0:
            raise ValueError(f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}")
        _check_int("dry_penalty_last_n", self.dry_penalty_last_n)
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be >= -1 (0 = off, -1 = whole "
                             f"history), got {self.dry_penalty_last_n}")
        if not self.dry_sequence_breakers or not all(
                isinstance(b, str) for b in self.dry_sequence_breakers):
            raise ValueError("dry_sequence_breakers must be a non-empty list of strings")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def derive_seeds(seed: int | None) -> tuple[int, int]:
    """Split one request seed into independent (target_seed, draft_seed) streams.

    Uses ``SeedSequence(seed).spawn(2)``; ``None`` draws fresh OS entropy.
    """
    children = np.random.SeedSequence(seed).spawn(2)
    target, draft = (int(child.generate_state(1, np.uint64)[0]) for child in children)
    return target, draft


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the model's distribution (the softmax of
    its logits row, before any sampler setting), and the `k` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (id, logprob), most likely first, ties by lower id


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """log softmax(logits [vocab]) at `token`, and its `k` largest entries."""
    x = np.asarray(logits, dtype=np.float64)  # [vocab]
    top = float(x.max())
    log_total = top + math.log(float(np.exp(x - top).sum()))
    k = min(k, x.shape[0])
    if k > 0:  # those at or above the k-th largest (ties at the cut kept), then the order
        ids = np.flatnonzero(x >= np.partition(x, x.shape[0] - k)[x.shape[0] - k])
        ids = ids[np.lexsort((ids, -x[ids]))][:k]  # [k] descending logit, ties by lower id
    else:
        ids = np.zeros(0, dtype=np.int64)
    return TokenLogprob(int(token), float(x[token]) - log_total,
                        tuple((int(i), float(x[i]) - log_total) for i in ids))


def top_probability(logits: np.ndarray) -> float:
    """The largest probability of softmax(logits [vocab]): 1 / sum(exp(x - max)), in
    float32 (a draft's confidence, compared against a threshold only)."""
    x = np.asarray(logits, dtype=np.float32)
    return float(1.0 / np.exp(x - x.max()).sum(dtype=np.float64))


def post_sampling_logprob(sampler: Sampler, logits: np.ndarray, token: int, k: int, *,
                          history: Iterable[int], mask: np.ndarray | None = None
                          ) -> TokenLogprob:
    """`token`'s log-probability in the distribution `sampler` draws from for these
    logits [vocab] (after its bias, penalties, filters and temperature: llama.cpp's
    post-sampling probabilities), with the penalties over `history` instead of the
    sampler's own, and its `k` most probable tokens (never one of probability 0; ties by
    lower id). The sampler is left unchanged."""
    view = copy.copy(sampler)  # shares params and rng (not drawn from), its own history
    view._reset_history(history)
    ids, p = view._filtered(logits, mask)  # [m], [m]
    ids = np.arange(p.shape[0]) if ids is None else ids
    at = int(np.searchsorted(ids, token))  # ids ascend
    p_token = float(p[at]) if at < ids.shape[0] and ids[at] == token else 0.0
    k = max(k, 0)
    cand = np.flatnonzero(p > 0.0)  # [z]
    if k < cand.shape[0]:  # those at or above the k-th largest only, ties kept
        kth = np.partition(p[cand], cand.shape[0] - k)[cand.shape[0] - k] if k else np.inf
        cand = cand[p[cand] >= kth]
    order = cand[np.lexsort((ids[cand], -p[cand]))][:k]  # [<= k]
    with np.errstate(divide="ignore"):
        return TokenLogprob(int(token), float(np.log(p_token)),
                            tuple((int(ids[i]), float(np.log(p[i]))) for i in order))


class NoAllowedToken(ValueError):
    """The token mask allows nothing: there is no distribution to sample from."""


def mask_logits(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """float64 copy of ``logits`` [vocab] with disallowed tokens set to -inf."""
    x = np.array(logits, dtype=np.float64)  # [vocab]
    if mask is None:
        return x
    x[~_check_mask(mask, x.shape[-1])] = -np.inf
    return x


def _check_mask(mask: np.ndarray, vocab: int) -> np.ndarray:
    m = np.asarray(mask)
    if m.dtype != np.bool_ or m.shape != (vocab,):
        raise ValueError(f"mask must be a bool array [vocab] = [{vocab}], got {m.dtype} {m.shape}")
    return m


_CDF_BLOCK = 1024  # inverse-CDF sampling: block sums first, then one block's running sum


def sample_from_probs(probs: np.ndarray, u: float) -> int:
    """Invert the CDF of ``probs`` ([vocab], need not be normalised) at ``u`` in [0, 1).

    Tokens are ordered by ascending id; a zero-probability token is never returned. The
    CDF is the running sum of per-block sums (blocks of 1024 ids) and, inside the block
    that holds the point, of that block's values: a running sum over the whole vocabulary
    is one dependent add per token, this a small fraction of them.
    """
    p = np.asarray(probs, dtype=np.float64)  # [vocab]
    n = p.shape[0]
    full = n - n % _CDF_BLOCK
    sums = p[:full].reshape(-1, _CDF_BLOCK).sum(axis=1)  # [n_blocks]
    if full < n:
        sums = np.append(sums, p[full:].sum())
    block_cdf = np.cumsum(sums)  # [n_blocks]
    total = block_cdf[-1]
    if not total > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    point = u * total
    b = min(int(np.searchsorted(block_cdf, point, side="right")), sums.shape[0] - 1)
    while sums[b] <= 0.0:  # the point rounded onto a boundary before empty blocks
        b -= 1
    start = b * _CDF_BLOCK
    inside = np.cumsum(p[start:start + _CDF_BLOCK])  # [<= 1024]
    before = block_cdf[b - 1] if b else 0.0
    idx = start + min(int(np.searchsorted(inside, point - before, side="right")),
                      inside.shape[0] - 1)
    if p[idx] <= 0.0:  # rounding put the point past an end of the block's nonzero tokens
        nonzero = start + np.flatnonzero(p[start:start + inside.shape[0]] > 0.0)
        after = nonzero[nonzero >= idx]
        idx = int(after[0]) if after.shape[0] else int(nonzero[-1])
    return idx


class Sampler:
    """Sampling state for one request and one model role (target or draft).

    Owns the parameters, a PCG64 generator and the recent-token history used by
    the repetition penalty and DRY.  ``history`` seeds that history (llama.cpp feeds the
    prompt tokens to the penalty sampler too); ``seed`` overrides ``params.seed``
    (pass the values from :func:`derive_seeds`); ``vocab``: the model's vocabulary, which
    a chain with ``infill`` or DRY needs (ValueError without it).
    """

    def __init__(
        self,
        params: SamplerParams,
        *,
        seed: int | None = None,
        history: Iterable[int] = (),
        vocab: SamplerVocab | None = None,
        position: int | None = None,
    ) -> None:
        """position: the sequence position of the first token this sampler decides, where
        its draws are keyed by position as a graph's are (a request's target sampler: its
        tokens are then the same on the host and in a graph, whatever the drafts); None:
        its draws are the PCG64 stream's, in order."""
        self.params = params.validate()
        self.position = position
        rng_seed = params.seed if seed is None else seed
        self._rng = np.random.Generator(np.random.PCG64(rng_seed))
        # the key of the counter-based draws made for this sampler in a graph (graph_sampling)
        # and of XTC's coins (sampler_chain)
        self.key = (int(rng_seed) if rng_seed is not None
                    else int(np.random.SeedSequence().generate_state(1, np.uint64)[0]))
        self.vocab = vocab
        # the chain's steps that do something at these settings, in order
        self._steps = [(name, STEPS[name]) for name in params.chain
                       if STEPS[name].active(params)]
        for name, step in self._steps:
            if step.needs_vocab and vocab is None:
                raise ValueError(f"the {name} sampler needs the model's vocabulary")
        # greedy: the argmax of what the steps before the temperature leave; the filters
        # right before it that keep the most likely token cannot change that argmax
        cut = next((i for i, (name, _) in enumerate(self._steps) if name == "temperature"),
                   len(self._steps))
        first = cut
        while first > 0 and self._steps[first - 1][1].keeps_max:
            first -= 1
        self._greedy_steps = self._steps[:first] + self._steps[cut:cut + 1]
        self._reset_history(history)
        # logit_bias as arrays: ids [b] ascending, what is added to their logits [b]
        self._bias_ids = np.array(sorted(params.logit_bias), dtype=np.int64)
        self._bias = np.array([params.logit_bias[int(t)] for t in self._bias_ids],
                              dtype=np.float64)

    def _reset_history(self, history: Iterable[int]) -> None:
        """The recent tokens are `history` (oldest first), the tokens decided so far as
        many (XTC's coin index)."""
        p = self.params
        tokens = [int(t) for t in history]
        self._history: deque[int] = deque(tokens, maxlen=None if p.repeat_last_n < 0
                                          else p.repeat_last_n)
        self._dry_history: deque[int] = deque(
            tokens, maxlen=None if p.dry_penalty_last_n < 0 else p.dry_penalty_last_n)
        self._index = len(tokens)

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy

    @property
    def history(self) -> list[int]:
        """The tokens the repetition penalty currently looks at, oldest first."""
        return list(self._history)

    def accept(self, token: int) -> None:
        """Record an emitted token in the penalties' and DRY's history."""
        self._history.append(int(token))
        self._dry_history.append(int(token))
        self._index += 1
        if self.position is not None:
            self.position += 1

    def uniform(self, position: int | None = None, draw: int = 0) -> float:
        """One uniform in [0, 1). Keyed by position: the graph's counter-based uniform
        (spec/philox.py) for the token at `position` (default: the next one this sampler
        decides), `draw` 0 for its coin or plain draw and 1 for a residual draw, as
        sample_tokens.c draws them. Otherwise the next of its PCG64 stream (`position`,
        which a coupled draft's sampler keys its noise by, and `draw` unused)."""
        if self.position is None:
            return float(self._rng.random())
        at = self.position if position is None else position
        return float(philox_uniform(self.key, at, TARGET_STREAM, draw))

    def copy(self) -> Sampler:
        """Independent deep copy: same params, history and rng state."""
        return copy.deepcopy(self)

    # -- distribution ---------------------------------------------------------

    def probs(self, logits: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """The float64 [vocab] distribution :meth:`sample` draws from for these logits.

        ``mask`` [vocab] bool: only these tokens may be drawn (0 elsewhere, renormalised).
        """
        ids, p = self._filtered(logits, mask)
        return _densify(ids, p, np.shape(logits)[-1])

    def candidates(
        self, logits: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sparse form of :meth:`probs`: (token ids ascending [m], probabilities [m])."""
        ids, p = self._filtered(logits, mask)
        return (np.arange(p.shape[0]) if ids is None else ids), p

    def biased_logits(self, logits: np.ndarray) -> np.ndarray:
        """float64 copy of ``logits`` [vocab] with the logit bias added (ids past the
        row's width, a draft's narrower one, are left out)."""
        x = np.array(logits, dtype=np.float64)  # [vocab]
        if x.ndim != 1:
            raise ValueError(f"expected one row of logits [vocab], got shape {x.shape}")
        if self._bias_ids.shape[0]:
            n = int(np.searchsorted(self._bias_ids, x.shape[0]))  # ids ascend
            x[self._bias_ids[:n]] += self._bias[:n]
        return x

    def penalised_logits(self, logits: np.ndarray) -> np.ndarray:
        """float64 copy of ``logits`` [vocab] with the logit bias, then the penalties
        applied (whatever the chain's order)."""
        c = Candidates(None, self.biased_logits(logits))
        return STEPS["penalties"].apply(c, self._context()).logits

    def _context(self) -> ChainContext:
        return ChainContext(self.params, self.vocab, self._history, list(self._dry_history),
                            self._index, self.key)

    def _filtered(
        self, logits: np.ndarray, mask: np.ndarray | None = None
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """(surviving ids ascending [m] or None for all, their probabilities [m])."""
        x = self.biased_logits(logits)  # [vocab]
        if mask is None or np.all(_check_mask(mask, x.shape[0])):
            c = Candidates(None, x)
        else:
            allowed = np.flatnonzero(mask)  # [a] ascending ids
            if allowed.shape[0] == 0:
                raise NoAllowedToken("the token mask allows no token")
            # the steps see only the allowed tokens
            c = Candidates(allowed, x[allowed])
        if c.logits.max() == -np.inf:
            raise NoAllowedToken("logit_bias leaves no token that may be drawn")
        ctx = self._context()
        for _, step in self._greedy_steps if self.is_greedy else self._steps:
            c = step.apply(c, ctx)
            if c.greedy:
                return c.ids, np.ones(1)
        if c.logits.shape[0] == 0 or c.logits.max() == -np.inf:
            raise NoAllowedToken("the sampler chain leaves no token that may be drawn")
        return c.ids, softmax(c.logits)

    # -- drawing --------------------------------------------------------------

    def sample(self, logits: np.ndarray, mask: np.ndarray | None = None) -> int:
        """Greedy: argmax, no draw.  Otherwise one uniform, inverted through :meth:`probs`.

        With ``mask`` [vocab] bool only allowed tokens can come out (greedy: the argmax
        among them); NoAllowedToken if the mask allows nothing.
        """
        token, _, _ = self._draw(logits, mask)
        return token

    def sample_with_probs(
        self, logits: np.ndarray, mask: np.ndarray | None = None, position: int | None = None
    ) -> tuple[int, np.ndarray]:
        """Like :meth:`sample` but also return the dense [vocab] distribution drawn from.

        This is what a draft model needs for rejection-sampling verification (under a
        mask: the masked, renormalised distribution, zero off the mask).
        """
        token, ids, p = self._draw(logits, mask, position)
        return token, _densify(ids, p, np.shape(logits)[-1])

    def sample_with_prob_of(
        self, logits: np.ndarray, token: int, mask: np.ndarray | None = None
    ) -> tuple[int, float]:
        """Like :meth:`sample`, and the probability the distribution drawn from gives
        ``token`` (greedy: 1.0 if it is the argmax, else 0.0)."""
        choice, ids, p = self._draw(logits, mask)
        if ids is None:
            return choice, float(p[token]) if 0 <= token < p.shape[0] else 0.0
        at = int(np.searchsorted(ids, token))  # ids ascend
        return choice, float(p[at]) if at < ids.shape[0] and ids[at] == token else 0.0

    def _draw(
        self, logits: np.ndarray, mask: np.ndarray | None = None, position: int | None = None
    ) -> tuple[int, np.ndarray | None, np.ndarray]:
        ids, p = self._filtered(logits, mask)
        pos = 0 if self.is_greedy else sample_from_probs(p, self.uniform(position))
        return (pos if ids is None else int(ids[pos])), ids, p


def _densify(ids: np.ndarray | None, p: np.ndarray, vocab: int) -> np.ndarray:
    if ids is None:
        return p
    out = np.zeros(vocab, dtype=np.float64)  # [vocab]
    out[ids] = p
    return out
