"""History speculation in a real daemon (a real model, real HTTP on loopback): repeated
work drafted from the identity's own history, byte-identical output, nothing drawn from
another identity's history, the memory bound, `--no-history`, `/cache/clear`, and the
history file's rules."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import fetched_model

from specd.daemon.control.config import coerce
from specd.daemon.drafters.history import HISTORY, HistoryDrafter, HistoryStore
from specd.daemon.drafters.suffix_index import BYTES_PER_TOKEN
from specd.daemon.serving.engine import EngineConfig
from specd.daemon.serving.history_file import HistoryFile, HistoryFileError, checked_path
from specd.daemon.spec.drafter import Proposal
from specd.daemon.spec.generation import GenerationParams

from live_server import LiveServer, live_server_in

BOUND = 2048  # tokens of history per principal: a few requests overflow it
ME = f"uid:{os.getuid()}"
STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper "
                                     "who finds a message in a bottle."}]


def _cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(target=str(fetched_model("smollm2-135m-instruct")),
                        spec_type="ngram", n_ctx=1024, slots=2, **kw)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    with live_server_in(tmp_path_factory, "history", _cfg(history=True,
                                                          history_tokens=BOUND)) as srv:
        yield srv


@pytest.fixture(scope="module")
def adaptive(tmp_path_factory) -> Iterator[LiveServer]:
    """The history daemon with `specd serve`'s adaptive draft length."""
    with live_server_in(tmp_path_factory, "adaptive", _cfg(
            history=True, history_tokens=BOUND,
            defaults=GenerationParams(adaptive=True))) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Iterator[LiveServer]:
    """The same daemon with --no-history."""
    with live_server_in(tmp_path_factory, "no-history", _cfg(history=False)) as srv:
        yield srv


def _chat(srv: LiveServer, messages: list[dict[str, str]], cache_key: str,
          **kw: Any) -> str:
    status, body = srv.request("POST", "/v1/chat/completions", {
        "messages": messages, "max_tokens": 64, "temperature": 0, "cache_key": cache_key,
        **kw})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def _history_rounds(srv: LiveServer) -> tuple[int, int]:
    t = srv.service.scheduler.totals
    return t.offer_rounds.get(HISTORY, 0), t.offer_accepted.get(HISTORY, 0)


@pytest.mark.real
def test_repeated_work_is_drafted_from_history_byte_identically(server, plain) -> None:
    want = _chat(plain, STORY, "a")
    first = _chat(server, STORY, "a")
    rounds, accepted = _history_rounds(server)
    again = _chat(server, STORY, "a")
    assert first == again == want
    more_rounds, more_accepted = _history_rounds(server)
    assert more_rounds > rounds and more_accepted - accepted >= 32, \
        server.service.scheduler.totals.as_dict()
    # --no-history: nothing drafted from history, nothing kept
    assert _history_rounds(plain) == (0, 0)
    assert plain.service.engine.history.n_tokens == 0
    assert plain.service.engine.history.nbytes == 0


@pytest.mark.real
def test_a_long_history_match_drafts_past_n_max_byte_identically(adaptive, plain) -> None:
    """Under the adaptive policy a history offer is verified up to free_max tokens a
    round, past the model's n_max: repeated work drafts in long rounds, and greedy
    output stays the target's."""
    n_max = adaptive.service.engine.cfg.defaults.draft.n_max
    want = _chat(plain, STORY, "long", max_tokens=160)
    assert _chat(adaptive, STORY, "long", max_tokens=160) == want
    before = dict(adaptive.service.scheduler.totals.draft_lengths)
    rounds, accepted = _history_rounds(adaptive)
    assert _chat(adaptive, STORY, "long", max_tokens=160) == want
    after = adaptive.service.scheduler.totals.draft_lengths
    longer = sum(c - before.get(n, 0) for n, c in after.items() if n > n_max)
    more_rounds, more_accepted = _history_rounds(adaptive)
    assert longer > 0 and more_accepted - accepted > 2 * n_max, (after, before)
    assert more_rounds > rounds


@pytest.mark.real
def test_another_identity_draws_no_proposal_from_the_firsts_history(server, monkeypatch
                                                                   ) -> None:
    """Every history offer a request gets is what its own tokens alone offer, unless it
    is the identity that asked before: asserted offer by offer, in a batch of two."""
    seen: list[tuple[str | None, list[int], list[int]]] = []
    offer = HistoryDrafter.offer

    def spy(self: HistoryDrafter, seq: int, last: int, pos: int, n_max: int) -> Proposal:
        got = offer(self, seq, last, pos, n_max)
        alone = HistoryDrafter(HistoryStore())
        alone.begin(0, self.context(seq).tolist())
        own = offer(alone, 0, last, pos, n_max)
        seen.append((self.identity(seq), got.tokens, own.tokens))
        return got

    monkeypatch.setattr(HistoryDrafter, "offer", spy)
    _chat(server, STORY, "writer")  # its history: this prompt and answer
    seen.clear()
    answers: dict[str, str] = {}
    threads = [threading.Thread(target=lambda k=k: answers.__setitem__(k, _chat(
        server, STORY, k))) for k in ("writer", "reader")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers["writer"] == answers["reader"]
    mine = [(got, own) for who, got, own in seen if who and who.endswith(
        _key_suffix("writer"))]
    theirs = [(got, own) for who, got, own in seen if who and who.endswith(
        _key_suffix("reader"))]
    assert mine and theirs
    assert any(got != own for got, own in mine)  # the writer's history did draft for it
    assert all(got == own for got, own in theirs)  # ... and never for the reader


def _key_suffix(cache_key: str) -> str:
    from specd.ipc.security import cache_identity

    return cache_identity("", cache_key)


@pytest.mark.real
def test_the_bound_holds_across_requests_and_clear_empties_it(server) -> None:
    for i in range(6):
        text = " ".join(f"item {i}-{j}: {'abcdefgh'[j % 8] * (j % 5 + 1)}" for j in range(60))
        _chat(server, [{"role": "user", "content": f"Summarise this list:\n{text}"}],
              f"bound-{i % 2}", max_tokens=16)
        h = server.service.engine.history
        assert h.nbytes_of(ME) <= BOUND * BYTES_PER_TOKEN
        assert h.n_tokens <= BOUND
    assert server.service.engine.history.n_tokens > BOUND // 2
    status, body = server.request("POST", "/cache/clear", {})
    assert status == 200 and body["history_tokens"] > 0, body
    assert server.service.engine.history.nbytes_of(ME) == 0
    assert server.service.engine.history.n_tokens == 0


def _metrics(srv: LiveServer) -> dict[str, float]:
    status, text = srv.request("GET", "/metrics")
    assert status == 200, text
    return {name: float(value) for name, _, value in (
        line.partition(" ") for line in text.splitlines() if line.startswith("specd_history"))}


@pytest.mark.real
def test_metrics_show_the_history_s_size_and_bound(server, plain) -> None:
    _chat(server, STORY, "metrics")
    h = server.service.engine.history
    m = _metrics(server)
    assert m == {"specd_history_tokens": h.n_tokens, "specd_history_bytes": h.nbytes,
                 "specd_history_bound_bytes": BOUND * BYTES_PER_TOKEN}
    assert 0 < m["specd_history_bytes"] <= m["specd_history_bound_bytes"]
    _chat(plain, STORY, "metrics")
    assert _metrics(plain) == {"specd_history_tokens": 0, "specd_history_bytes": 0,
                               "specd_history_bound_bytes": 0}


# -- the history file ---------------------------------------------------------------------
def test_the_history_file_must_be_private_and_under_the_state_dir(tmp_path,
                                                                  monkeypatch) -> None:
    state = tmp_path / "state"
    monkeypatch.setenv("SPECD_STATE_DIR", str(state))
    state.mkdir()
    with pytest.raises(HistoryFileError, match="under the state dir"):
        checked_path(tmp_path / "elsewhere.npz")
    with pytest.raises(HistoryFileError, match="under the state dir"):
        checked_path(state / ".." / "escape.npz")
    loose = state / "loose.npz"
    loose.write_bytes(b"")
    loose.chmod(0o644)
    with pytest.raises(HistoryFileError, match="mode 0644"):
        checked_path(loose)
    link = state / "link.npz"
    link.symlink_to(tmp_path / "target.npz")
    with pytest.raises(HistoryFileError, match="not a regular file"):
        checked_path(link)

    store = HistoryStore(1 << 12)
    store.add(ME, np.arange(100, 160))
    store.add("key:abc", np.arange(500, 520))
    kept = HistoryFile(state / "history.npz")
    kept.save(store)
    assert stat.S_IMODE((state / "history.npz").stat().st_mode) == 0o600
    back = HistoryStore(1 << 12)
    assert HistoryFile(state / "history.npz").load(back) == 80
    assert {k: v.tolist() for k, v in back.snapshot().items()} == {
        k: v.tolist() for k, v in store.snapshot().items()}
    (state / "history.npz").chmod(0o640)
    with pytest.raises(HistoryFileError, match="mode 0640"):
        HistoryFile(state / "history.npz")


def test_history_is_a_config_switch() -> None:
    assert coerce("history", "off") is False and coerce("history", "true") is True
    with pytest.raises(ValueError, match="true or false"):
        coerce("history", "maybe")
