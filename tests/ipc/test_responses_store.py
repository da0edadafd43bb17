"""ipc/http/responses_store.py: conversations kept per identity, bounded by count and by
bytes, the least recently used dropped first."""

from __future__ import annotations

from specd.ipc.http.responses_store import ResponseStore


def _items(text: str) -> list[dict[str, str]]:
    return [{"type": "message", "role": "user", "content": text}]


def test_a_response_is_found_by_its_own_identity_only() -> None:
    store = ResponseStore()
    store.put("uid:1000", "resp_a", _items("hi"))
    assert store.get("uid:1000", "resp_a") == _items("hi")
    assert store.get("uid:1001", "resp_a") is None
    assert store.get("token", "resp_a") is None
    assert store.get("uid:1000", "resp_b") is None
    # the same id under another identity is another entry, never the first's
    store.put("uid:1001", "resp_a", _items("mine"))
    assert store.get("uid:1000", "resp_a") == _items("hi")
    assert store.get("uid:1001", "resp_a") == _items("mine")


def test_past_its_count_the_least_recently_used_goes() -> None:
    store = ResponseStore(max_responses=3)
    for name in "abc":
        store.put("u", name, _items(name))
    assert store.get("u", "a") is not None  # a used: b is now the oldest
    store.put("u", "d", _items("d"))
    assert len(store) == 3
    assert store.get("u", "b") is None
    assert [store.get("u", n) is not None for n in "acd"] == [True] * 3


def test_past_its_bytes_the_oldest_go_and_an_oversized_one_is_not_kept() -> None:
    one = len('[{"type":"message","role":"user","content":"xxxxxxxxxx"}]')
    store = ResponseStore(max_bytes=2 * one)
    for name in "abc":
        store.put("u", name, _items("x" * 10))
    assert len(store) == 2 and store.get("u", "a") is None
    store.put("u", "big", _items("x" * (2 * one)))
    assert store.get("u", "big") is None and len(store) == 2
    store.put("u", "b", _items("x" * 10))  # replaced, not counted twice
    store.put("u", "d", _items("x" * 10))
    assert len(store) == 2 and store.get("u", "c") is None
