"""llama.cpp's sampler chain on the host (daemon/spec/sampler_chain.py): each sampler's
distribution against llama.cpp's code written again plainly (tests/support/
llama_sampler_reference.py), draws by chi-square, the `samplers` names, XTC's coin, and
which chains the graph runs."""

from __future__ import annotations

import numpy as np
import pytest

from specd.daemon.spec.graph_sampling import runs_in_graph
from specd.daemon.spec.philox import philox_uniform
from specd.daemon.spec.sampler_chain import XTC_STREAM, parse_samplers
from specd.daemon.spec.sampling import Sampler, SamplerParams, SamplerVocab

import llama_sampler_reference as ref
from chi_square import FAIL_P, PASS_P, chi2_pvalue

V = 48
EOG = frozenset({0, 1})
# token texts with prefix relations for infill's merging: ids 2.. spell "a", "ab", "abc",
# "b", "ba", ... ; ids 0 and 1 end generation (empty text, as control tokens)
_TEXTS = [b"", b""] + [bytes(s, "ascii") for s in (
    "a", "ab", "abc", "b", "ba", "bad", "c", "ca", "cab", "d", "da", "dab", "e", "ea", "eb",
    "f", "fa", "fab", "g", "ga", "h", "ha", "hab", "i", "ia", "j", "ja", "k", "ka", "l", "la",
    "m", "ma", "n", "na", "o", "oa", "p", "pa", "q", "qa", "r", "ra", ":", "\n", "x")]
assert len(_TEXTS) == V


def _encode(text: str) -> list[int]:
    """Greedy longest-match tokenization over _TEXTS."""
    out, i = [], 0
    data = text.encode()
    while i < len(data):
        best = max((t for t in range(2, V) if data.startswith(_TEXTS[t], i)),
                   key=lambda t: len(_TEXTS[t]))
        out.append(best)
        i += len(_TEXTS[best])
    return out


VOCAB = SamplerVocab(eog=EOG, eot=1, piece=lambda i: _TEXTS[i], text=lambda i: _TEXTS[i],
                     encode=_encode, size=V)
REF_VOCAB = ref.Vocab(set(EOG), 1, _TEXTS)


def _logits(seed: int, scale: float = 2.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, V).astype(np.float32)


def _settings(p: SamplerParams, history: list[int], index: int, key: int) -> ref.Settings:
    window = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else []
    return ref.Settings(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        typical_p=p.typical_p, top_n_sigma=p.top_n_sigma, xtc_probability=p.xtc_probability,
        xtc_threshold=p.xtc_threshold,
        xtc_coin=float(philox_uniform(key, index, XTC_STREAM, 0)),
        repeat_penalty=p.repeat_penalty, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, history=window,
        dry_multiplier=p.dry_multiplier, dry_base=p.dry_base,
        dry_allowed_length=p.dry_allowed_length,
        dry_history=history[-p.dry_penalty_last_n:] if p.dry_penalty_last_n > 0 else history,
        dry_breakers=VOCAB.dry_breakers(p.dry_sequence_breakers), min_keep=p.min_keep)


# chains as editors send them and each sampler on its own, with settings that make it act
CHAINS = [
    pytest.param(("top_k", "top_p", "infill"), dict(top_k=40, top_p=0.9), id="llama.vim"),
    pytest.param(("top_k", "top_p", "infill"), dict(top_k=40, top_p=0.99), id="llama.vscode"),
    pytest.param(("infill",), {}, id="infill"),
    pytest.param(("top_k", "top_p", "infill", "temperature"),
                 dict(top_k=40, top_p=0.9, temperature=0.0), id="greedy-infill"),
    pytest.param(("top_k", "infill", "temperature"), dict(top_k=8, temperature=0.7),
                 id="infill-then-temperature"),
    pytest.param(("penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"),
                 dict(top_k=40, top_p=0.95, min_p=0.05, typical_p=0.9, xtc_probability=0.5,
                      xtc_threshold=0.05, dry_multiplier=0.8, repeat_penalty=1.1,
                      temperature=0.8), id="edkypmxt"),
    pytest.param(("typ_p",), dict(typical_p=0.7), id="typical"),
    pytest.param(("top_n_sigma", "temperature"), dict(top_n_sigma=1.0, temperature=1.3),
                 id="top_n_sigma"),
    pytest.param(("xtc",), dict(xtc_probability=1.0, xtc_threshold=0.08), id="xtc"),
    pytest.param(("dry",), dict(dry_multiplier=1.5, dry_allowed_length=1), id="dry"),
    pytest.param(("temperature", "min_p", "top_k"), dict(temperature=2.0, min_p=0.1, top_k=5),
                 id="reordered"),
]
# min_keep on each sampler that takes it, at settings where it binds (llama-server's
# `min_keep`; top-k takes none)
MIN_KEEP_CHAINS = [
    pytest.param(("top_p", "temperature"), dict(top_p=0.05, min_keep=5), id="top_p-min_keep"),
    pytest.param(("min_p", "temperature"), dict(min_p=0.9, min_keep=4), id="min_p-min_keep"),
    pytest.param(("typ_p",), dict(typical_p=0.1, min_keep=6), id="typical-min_keep"),
    pytest.param(("xtc",), dict(xtc_probability=1.0, xtc_threshold=0.02, min_keep=44),
                 id="xtc-min_keep"),
    pytest.param(("top_k", "typ_p", "top_p", "min_p", "temperature"),
                 dict(top_k=40, typical_p=0.5, top_p=0.2, min_p=0.5, min_keep=3,
                      temperature=0.4), id="kypmt-min_keep"),
]
CHAINS += MIN_KEEP_CHAINS
# a history with repetitions (DRY has something to find), ':' (id 45) breaking one
HISTORY = [5, 6, 7, 9, 5, 6, 7, 45, 12, 5, 6]


@pytest.mark.parametrize("chain, settings", CHAINS)
def test_each_chain_is_llama_cpps_distribution(chain: tuple[str, ...], settings: dict) -> None:
    for seed in range(40):
        logits = _logits(seed, scale=1.0 + seed % 4)
        if seed % 5 == 0:  # an end of generation likely enough for infill to end
            logits[seed % 2] = logits.max() - 0.5
        p = SamplerParams(samplers=chain, seed=seed, **settings)
        s = Sampler(p, history=HISTORY, vocab=VOCAB)
        want = ref.chain_probs(logits, chain, _settings(p, HISTORY, len(HISTORY), s.key),
                               REF_VOCAB)
        got = s.probs(logits)
        assert np.array_equal(got > 0, want > 0), (seed, np.flatnonzero(got),
                                                   np.flatnonzero(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9, err_msg=f"seed {seed}")


@pytest.mark.parametrize("chain, settings",
                         CHAINS[:3] + CHAINS[4:5] + CHAINS[5:9] + MIN_KEEP_CHAINS)
def test_draws_follow_the_chains_distribution(chain: tuple[str, ...], settings: dict) -> None:
    """Chi-square of 20,000 draws against the reference; a draw from the chain without its
    last sampler is refused (the test can fail)."""
    logits = _logits(11, scale=1.5)
    logits[0] = logits.max() - 3.0  # an end of generation in the running, not winning
    p = SamplerParams(samplers=chain, seed=5, **settings)
    s = Sampler(p, vocab=VOCAB)
    want = ref.chain_probs(logits, chain, _settings(p, [], 0, s.key), REF_VOCAB)
    draws = np.bincount([s.sample(logits) for _ in range(20_000)], minlength=V)
    if (want > 0).sum() > 1:
        keep = want * 20_000 >= 5
        assert chi2_pvalue(np.append(draws[keep], draws[~keep].sum()),
                           np.append(want[keep], want[~keep].sum())) > PASS_P
    else:
        assert draws[np.argmax(want)] == 20_000
    shorter = ref.chain_probs(logits, chain[:-1], _settings(p, [], 0, s.key), REF_VOCAB)
    if not np.allclose(shorter, want):
        with np.errstate(divide="ignore"):
            assert chi2_pvalue(draws, shorter) < FAIL_P


@pytest.mark.parametrize("chain, settings", MIN_KEEP_CHAINS)
def test_min_keep_keeps_at_least_that_many_where_the_filter_keeps_fewer(
        chain: tuple[str, ...], settings: dict) -> None:
    """With min_keep the chain leaves at least that many tokens (XTC: it removes none
    rather than leave fewer); without it, fewer for most rows (the setting binds)."""
    bound = 0
    for seed in range(40):
        logits = _logits(seed, scale=1.0 + seed % 4)
        with_keep = SamplerParams(samplers=chain, seed=seed, **settings)
        without = SamplerParams(samplers=chain, seed=seed, **{**settings, "min_keep": 0})
        kept = int((Sampler(with_keep).probs(logits) > 0).sum())
        alone = int((Sampler(without).probs(logits) > 0).sum())
        assert kept >= min(settings["min_keep"], V if chain != ("xtc",) else 0), seed
        assert kept >= alone, seed
        bound += kept > alone
    assert bound >= 20


def test_min_keep_is_checked() -> None:
    with pytest.raises(ValueError, match="min_keep must be >= 0"):
        SamplerParams(min_keep=-1).validate()
    with pytest.raises(ValueError, match="min_keep must be an integer"):
        SamplerParams(min_keep=2.5).validate()  # type: ignore[arg-type]


def test_infill_ends_where_the_end_outweighs_the_text() -> None:
    """3 * p_eog * n > p_txt: only the ends of generation stay; no text token above the
    thresholds: the end-of-text token alone."""
    logits = np.full(V, -30.0, dtype=np.float32)
    logits[[0, 2, 5]] = [1.0, 2.0, 2.2]  # p_eog = 0.15 of 3 candidates: 3 * 0.15 * 3 > 0.85
    s = Sampler(SamplerParams(samplers=("top_k", "infill"), top_k=3), vocab=VOCAB)
    assert np.flatnonzero(s.probs(logits)).tolist() == [0]
    logits[:] = 0.0  # flat over 48 tokens: none reaches 0.2, the EOGs too unlikely to win
    logits[[0, 1]] = -10.0
    s = Sampler(SamplerParams(samplers=("infill",)), vocab=VOCAB)
    assert np.flatnonzero(s.probs(logits)).tolist() == [VOCAB.eot]


def test_infill_merges_a_prefix_into_the_likelier_token() -> None:
    """"a" (2), "ab" (3), "abc" (4): the three pool into the likeliest, which then clears
    the thresholds that each of them alone would not."""
    logits = np.full(V, -30.0, dtype=np.float32)
    logits[[2, 3, 4, 5, 8, 11]] = [1.0, 1.1, 1.2, 1.3, 1.25, 1.15]
    s = Sampler(SamplerParams(samplers=("infill",), seed=0), vocab=VOCAB)
    p = s.probs(logits)
    assert np.flatnonzero(p[2:]).tolist() == [4 - 2]
    assert p[[0, 1]].sum() < 1e-12  # the ends of generation stay, at their odds


def test_temperature_zero_takes_the_argmax_of_what_the_steps_before_leave() -> None:
    logits = np.full(V, -5.0, dtype=np.float32)
    logits[[0, 6]] = [2.0, 2.6]  # the text token is likelier, but infill ends here
    s = Sampler(SamplerParams(samplers=("top_k", "infill", "temperature"), top_k=2,
                              temperature=0.0), vocab=VOCAB)
    assert s.is_greedy and s.sample(logits) == 0
    # without the temperature step a temperature of 0 is not applied: it samples
    no_t = SamplerParams(samplers=("top_k",), top_k=2, temperature=0.0)
    assert not no_t.is_greedy and no_t.effective_temperature == 1.0


def test_xtc_coin_is_counter_based_and_leaves_the_stream_alone() -> None:
    """A seeded XTC request draws the same tokens again, and each token still takes one
    uniform from the sampler's stream (the coin is Philox(key, tokens decided, XTC))."""
    p = SamplerParams(samplers=("xtc", "temperature"), xtc_probability=0.5,
                      xtc_threshold=0.05, temperature=1.0, seed=3)
    runs = []
    for _ in range(2):
        s = Sampler(p)
        out = []
        for i in range(30):
            t = s.sample(_logits(i))
            s.accept(t)
            out.append(t)
        runs.append(out)
        stream = np.random.Generator(np.random.PCG64(3))
        stream.random(30)
        assert s._rng.bit_generator.state == stream.bit_generator.state
    assert runs[0] == runs[1]
    # the coin decides: with the same logits, removal happens at some indices, not others
    s = Sampler(p)
    logits = _logits(4)
    kept = set()
    for _ in range(12):
        kept.add(int((s.probs(logits) > 0).sum()))
        s.accept(0)
    assert len(kept) == 2


def test_sampler_names_as_llama_server_reads_them() -> None:
    assert parse_samplers(["top_k", "top_p", "infill"]) == ("top_k", "top_p", "infill")
    assert parse_samplers(["Top-K", "nucleus", "typical", "TEMP", "minp", "top-n-sigma"]) == (
        "top_k", "top_p", "typ_p", "temperature", "min_p", "top_n_sigma")
    assert parse_samplers("edkypmxt") == ("penalties", "dry", "top_k", "typ_p", "top_p",
                                          "min_p", "xtc", "temperature")
    assert parse_samplers("si") == ("top_n_sigma", "infill")
    assert parse_samplers([]) == ()
    with pytest.raises(ValueError, match="'mirostat'"):
        parse_samplers(["top_k", "mirostat"])
    with pytest.raises(ValueError, match="'z'"):
        parse_samplers("kz")
    with pytest.raises(ValueError, match="adaptive_p"):
        parse_samplers(["adaptive-p"])


def test_the_default_chain_is_llama_servers_and_today_s() -> None:
    p = SamplerParams(top_k=40, top_p=0.9, min_p=0.05, temperature=0.8)
    assert p.chain == ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                       "min_p", "xtc", "temperature")
    explicit = SamplerParams(top_k=40, top_p=0.9, min_p=0.05, temperature=0.8,
                             samplers=p.chain)
    for seed in range(5):
        logits = _logits(seed)
        np.testing.assert_array_equal(Sampler(p).probs(logits),
                                      Sampler(explicit).probs(logits))


def test_which_chains_the_graph_runs() -> None:
    """The graph runs penalties, top-k, top-p, min-p and temperature in that order (or the
    temperature before top-p); a chain of those (steps that are off do not count) decides
    in the graph, with what it leaves out switched off; anything else on the host."""
    assert runs_in_graph(SamplerParams(top_k=40))
    vim = SamplerParams(samplers=("top_k", "top_p", "infill"), top_k=40, top_p=0.9)
    assert not runs_in_graph(vim)
    vscode_chat = SamplerParams(samplers=parse_samplers("edkypmxt"), top_k=40, top_p=0.95,
                                min_p=0.05, typical_p=1.0, xtc_probability=0.0,
                                dry_multiplier=0.0, temperature=0.8)
    assert runs_in_graph(vscode_chat)
    assert not runs_in_graph(SamplerParams(samplers=parse_samplers("edkypmxt"),
                                           dry_multiplier=0.5))
    assert not runs_in_graph(SamplerParams(samplers=("top_p", "top_k"), top_k=4, top_p=0.5))
    early = SamplerParams(samplers=("top_k", "temperature", "min_p"), top_k=4, min_p=0.1,
                          temperature=1.5, repeat_penalty=1.3)
    g = early.graph_equivalent()
    assert g is not None and g.samplers is None and not g.temperature_last
    assert (g.top_k, g.top_p, g.min_p, g.repeat_penalty) == (4, 1.0, 0.1, 1.0)
    # min_keep on a top-p or min-p the graph would run: the host's (the graph has none);
    # on steps that are off, or at 0 / 1 (no effect), the graph still decides
    assert not runs_in_graph(SamplerParams(top_p=0.9, min_keep=3))
    assert not runs_in_graph(SamplerParams(samplers=("top_k", "min_p"), top_k=4, min_p=0.2,
                                           min_keep=2))
    assert runs_in_graph(SamplerParams(samplers=("top_k", "min_p"), top_k=4, min_keep=2))
    assert runs_in_graph(SamplerParams(top_k=40, top_p=0.9, min_p=0.1, min_keep=1))
    no_t = SamplerParams(samplers=("top_k",), top_k=4, temperature=0.0).graph_equivalent()
    assert no_t is not None and no_t.temperature == 1.0
    for seed in range(5):  # the same distribution as the host's chain
        logits = _logits(seed)
        np.testing.assert_allclose(Sampler(g).probs(logits), Sampler(early).probs(logits),
                                   rtol=1e-12)


def test_chains_reading_the_vocabulary_need_it() -> None:
    with pytest.raises(ValueError, match="infill sampler needs the model's vocabulary"):
        Sampler(SamplerParams(samplers=("infill",)))
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        SamplerParams(samplers=("nope",)).validate()


def test_dry_breakers_as_llama_cpp_processes_them() -> None:
    """A token containing a breaker stands alone (empty tail); one ending in a breaker's
    start carries the breaker's rest, tokenized."""
    b = VOCAB.dry_breakers(("\n", ":", "ab:"))
    assert b[45] == [()] and b[46] == [()]  # ":" and "\n"
    assert (5, 45) in b[2] and (5, 45) in b[44]  # "a", "ra" + "b:"
    assert (45,) in b[3]  # "ab" + ":"
    assert VOCAB.dry_breakers(("\n", ":", "ab:")) is b  # computed once
