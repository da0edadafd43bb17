"""Tokenizer from GGUF metadata, and the streaming detokenizer.

Tiny vocabularies built here need no download. The real models' tests compare against token
ids transformers produced (tests/fixtures/tokenizer_golden.json, made by
tests/fixtures/make_tokenizer_golden.py) and skip when the GGUF is not in the model store.
"""

from __future__ import annotations

import importlib.util
import json
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from specd.daemon.text.detokenize import IncrementalDetokenizer
from specd.daemon.text.tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    Tokenizer,
    bytes_to_unicode,
)

GOLDEN_PATH = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizer_golden.json"
GOLDEN: dict[str, Any] = json.loads(GOLDEN_PATH.read_text())
GOLDEN_MODELS = sorted(name for name in GOLDEN if not name.startswith("_"))

# --- the model store


def model_file(name: str) -> Path:
    try:
        from specd.daemon.models.store import model_path
    except ImportError:
        import platformdirs

        return Path(platformdirs.user_data_dir("specd")) / "models" / f"{name}.gguf"
    return Path(model_path(name))


@cache
def _local_metadata(name: str) -> dict[str, Any] | str:
    """The GGUF's metadata, or why it can't be used for the golden tests."""
    path = model_file(name)
    if not path.is_file():
        from conftest import fetched_model

        path = fetched_model(name)  # a fresh machine tests it too (or skips offline)
    from specd.ort_models.gguf_file import GGUFFile, content_hash

    expected = GOLDEN.get(name, {}).get("gguf_sha256")
    if expected and path.stat().st_size != GOLDEN[name]["gguf_size"]:
        return f"{path} is not the file the golden ids were recorded from (size differs)"
    if expected and content_hash(path) != expected:
        return f"{path} is not the file the golden ids were recorded from (sha256 differs)"
    return GGUFFile(path).metadata


def real_metadata(name: str) -> dict[str, Any]:
    """Metadata of the store's `name`.gguf (cached), or skip the test saying why not."""
    meta = _local_metadata(name)
    if isinstance(meta, str):
        pytest.skip(meta)
    return meta


@cache
def _real_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(real_metadata(name))


def real_tokenizer(name: str) -> Tokenizer:
    real_metadata(name)  # skips when absent
    return _real_tokenizer(name)


QWEN_1_5B = "qwen2.5-coder-1.5b-instruct"

# --- tiny vocabularies, no download

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = [
    "Ġ 1", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
    "1 2", "12 3",
]  # fmt: skip


def tiny_gpt2_meta(pre: str = "qwen2", **extra: Any) -> dict[str, Any]:
    """A byte-level BPE vocabulary: 256 byte tokens, a few merges, specials, a user token."""
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merged = []
    for merge in TINY_MERGES:
        token = merge.replace(" ", "")
        if token not in merged:
            merged.append(token)
    tokens = alphabet + merged + ["xyz"] + SPECIALS + ["<tool>"]
    types = [NORMAL] * (len(alphabet) + len(merged) + 1) + [CONTROL] * 3 + [USER_DEFINED]
    meta: dict[str, Any] = {
        "general.architecture": "qwen2",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(TINY_MERGES),
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
    }
    meta.update(extra)
    return meta


def tiny_spm_meta(**extra: Any) -> dict[str, Any]:
    """A SentencePiece vocabulary with byte fallback: <unk> <s> </s>, 256 <0xXX>, pieces."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "▁hell", "▁hello"]
    pieces += ["lo", "llo", "▁w", "or", "▁wor", "▁worl", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [float(len(p)) for p in pieces]  # longer pieces rank higher
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(extra)
    return meta


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_metadata(tiny_gpt2_meta())


def ids_of(tok: Tokenizer, *texts: str) -> list[int]:
    ids = [tok.token_to_id(t) for t in texts]
    assert None not in ids, texts
    return ids  # type: ignore[return-value]


def test_tiny_encode_decode(tiny: Tokenizer) -> None:
    assert tiny.encode("hello world") == ids_of(tiny, "hello", "Ġworld")
    for text in ["hello world", "", "  spaces\n\ttabs", "naïve 日本 😀", "a\r\nb"]:
        assert tiny.decode(tiny.encode(text)) == text
    assert tiny.encode("") == []
    # lone surrogates (JSON "\\ud800", undecodable argv bytes) become U+FFFD
    assert tiny.encode("a\ud800b\udce9") == tiny.encode("a\ufffdb\ufffd")
    assert tiny.vocab_size == len(tiny_gpt2_meta()["tokenizer.ggml.tokens"])
    assert tiny.token_text(tiny.token_to_id("Ġworld")) == "Ġworld"
    assert tiny.token_bytes(tiny.token_to_id("Ġworld")) == b" world"


def test_tiny_special_parsing(tiny: Tokenizer) -> None:
    text = "<|im_start|>hello<|im_end|>"
    start, end = ids_of(tiny, "<|im_start|>", "<|im_end|>")
    assert tiny.encode(text) == [start, *ids_of(tiny, "hello"), end]
    plain = tiny.encode(text, parse_special=False)
    assert start not in plain and end not in plain
    assert tiny.decode(plain) == text
    # user-defined tokens are matched whole either way (llama.cpp)
    tool = tiny.token_to_id("<tool>")
    assert tool in tiny.encode("a<tool>b", parse_special=False)
    assert tiny.decode([start, *ids_of(tiny, "hello"), end], skip_special=True) == "hello"
    assert tiny.is_control(start) and not tiny.is_control(tool)


def test_tiny_bos_eos_and_eog(tiny: Tokenizer) -> None:
    eot, end = ids_of(tiny, "<|endoftext|>", "<|im_end|>")
    assert tiny.bos_id == eot and tiny.eos_id == end and tiny.pad_id == eot
    assert tiny.encode("hello") == ids_of(tiny, "hello")  # qwen2: no BOS by default
    assert tiny.encode("hello", add_bos=True) == [eot, *ids_of(tiny, "hello")]
    assert tiny.encode("hello", add_eos=True)[-1] == end
    assert tiny.eot_ids == {eot, end}
    llama3 = Tokenizer.from_metadata(tiny_gpt2_meta("llama-bpe"))
    assert llama3.add_bos and llama3.encode("hello")[0] == eot
    told = Tokenizer.from_metadata(
        tiny_gpt2_meta("llama-bpe", **{"tokenizer.ggml.add_bos_token": False})
    )
    assert told.encode("hello") == ids_of(told, "hello")
    assert tiny.fim_prefix_id is None


def test_tiny_pre_tokenizers_differ_on_digits() -> None:
    by_pre = {
        pre: Tokenizer.from_metadata(tiny_gpt2_meta(pre)).encode("x 123", add_bos=False)
        for pre in ("qwen2", "smollm", "llama3", "gpt2")
    }
    tok = Tokenizer.from_metadata(tiny_gpt2_meta())
    x, space, one, two, three = ids_of(tok, "x", "Ġ", "1", "2", "3")
    assert by_pre["qwen2"] == [x, space, one, two, three]  # single digits
    assert by_pre["smollm"] == [x, space, one, two, three]
    assert by_pre["llama3"] == [x, space, tok.token_to_id("123")]  # up to 3 digits together
    assert by_pre["gpt2"] == [x, tok.token_to_id("Ġ1"), two, three]  # " 123" one piece


def test_tiny_llama3_ignores_merges_for_whole_tokens() -> None:
    # "xyz" is in the vocabulary with no merges to build it: only llama3 takes it whole
    assert Tokenizer.from_metadata(tiny_gpt2_meta("llama3")).encode("xyz", add_bos=False) == [
        tiny_gpt2_meta()["tokenizer.ggml.tokens"].index("xyz")
    ]
    assert len(Tokenizer.from_metadata(tiny_gpt2_meta("qwen2")).encode("xyz")) == 3


def test_unsupported_tokenizers_are_named() -> None:
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_metadata(tiny_gpt2_meta(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="'made-up-pre'"):
        Tokenizer.from_metadata(tiny_gpt2_meta("made-up-pre"))
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})


def test_tiny_sentencepiece() -> None:
    tok = Tokenizer.from_metadata(tiny_spm_meta())
    hello, world = ids_of(tok, "▁hello", "▁world")
    assert tok.add_bos and tok.encode("hello world") == [1, hello, world]
    assert tok.encode("hello world", add_bos=False) == [hello, world]
    assert tok.decode([1, hello, world]) == "<s> hello world"
    assert tok.decode([1, hello, world], skip_special=True) == "hello world"
    assert tok.decode([hello, world]) == "hello world"  # the prefix space is dropped
    # "é" is not a piece: byte fallback
    ids = tok.encode("hé", add_bos=False)
    assert ids == [*ids_of(tok, "▁h"), 3 + 0xC3, 3 + 0xA9]
    assert tok.decode(ids) == "hé"
    assert tok.token_bytes(3 + 0xC3) == b"\xc3"
    # a special token in text, and a space prefix after it (llama.cpp)
    assert tok.encode("</s>hello", add_bos=False) == [2, hello]
    assert tok.encode("</s>hello", add_bos=False, parse_special=False)[0] != 2
    no_prefix = Tokenizer.from_metadata(tiny_spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    assert no_prefix.encode("hello", add_bos=False)[0] != hello
    assert no_prefix.decode(no_prefix.encode(" hello", add_bos=False)) == " hello"


# --- the streaming detokenizer


def stream(tok: Tokenizer, ids: list[int], **kwargs: Any) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_detokenizer_holds_back_split_characters(tiny: Tokenizer) -> None:
    ids = tiny.encode("a😀b")  # the emoji is 4 byte tokens
    assert len(ids) == 6
    pieces = stream(tiny, ids)
    assert pieces == ["a", "", "", "", "😀", "b", ""]
    assert "".join(pieces) == tiny.decode(ids)


def test_detokenizer_invalid_tail_and_specials(tiny: Tokenizer) -> None:
    ids = tiny.encode("x😀")[:-1]  # cut inside the emoji
    pieces = stream(tiny, ids)
    assert pieces[-1] == "\ufffd" and "".join(pieces) == tiny.decode(ids) == "x\ufffd"
    text = "<|im_start|>hi 日本<|im_end|>"
    ids = tiny.encode(text)
    assert "".join(stream(tiny, ids)) == text
    assert "".join(stream(tiny, ids, skip_special=True)) == tiny.decode(ids, skip_special=True)
    detok = IncrementalDetokenizer(tiny)
    assert detok.push(ids[0]) == "<|im_start|>" and detok.ids == ids[:1]
    detok.push_many(tiny.encode("😀")[:2])
    assert detok.pending


def test_detokenizer_sentencepiece_byte_fallback() -> None:
    tok = Tokenizer.from_metadata(tiny_spm_meta())
    text = "hello 😀 world 日本"
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == "<s> hello 😀 world 日本"
    assert "\ufffd" not in "".join(pieces)
    assert "".join(stream(tok, ids, skip_special=True)) == text


# --- real models, against transformers' ids


@pytest.mark.real
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_encode(name: str) -> None:
    tok = real_tokenizer(name)
    golden = GOLDEN[name]
    wrong = []
    for case in golden["cases"]:
        text = case["text"]
        if tok.encode(text, add_bos=False) != case["ids"]:
            wrong.append(f"{text!r}: {tok.encode(text, add_bos=False)} != {case['ids']}")
        if tok.encode(text) != case["with_bos"]:
            wrong.append(f"{text!r} with BOS: {tok.encode(text)} != {case['with_bos']}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.real
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_decode_and_stream(name: str) -> None:
    tok = real_tokenizer(name)
    for case in GOLDEN[name]["cases"]:
        ids = case["ids"]
        assert tok.decode(ids) == case["decoded"], case["text"]
        assert "".join(stream(tok, ids)) == case["decoded"], case["text"]
        for piece in stream(tok, ids):
            assert "\ufffd" not in piece or "\ufffd" in case["text"]


@pytest.mark.real
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_special_parsing(name: str) -> None:
    tok = real_tokenizer(name)
    for case in GOLDEN[name]["special"]:
        assert tok.encode(case["text"], add_bos=False) == case["parsed"], case["text"]
        plain = tok.encode(case["text"], add_bos=False, parse_special=False)
        assert plain == case["plain"], case["text"]
        assert tok.decode(plain) == case["text"]


EXPECTED_IDS = {
    "smollm2-135m-instruct": {"bos": 1, "eos": 2, "eog": {0, 2}, "fim": None},
    "qwen2.5-coder-0.5b-instruct": {
        "bos": 151643,
        "eos": 151645,
        "eog": {151643, 151645, 151662, 151663, 151664},
        "fim": (151659, 151661, 151660),
    },
    "gemma-3-270m": {"bos": 2, "eos": 1, "eog": {1, 106}, "fim": None},
}


@pytest.mark.real
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_real_special_ids(name: str) -> None:
    tok = real_tokenizer(name)
    want = EXPECTED_IDS[name]
    assert (tok.bos_id, tok.eos_id) == (want["bos"], want["eos"])
    assert want["eog"] <= tok.eot_ids
    assert all(tok.is_control(i) for i in tok.eot_ids)
    if want["fim"]:
        assert (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id) == want["fim"]
    bos_expected = GOLDEN[name]["cases"][2]["with_bos"][:1] == [want["bos"]]
    assert tok.add_bos == bos_expected


@pytest.mark.real
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_real_streaming_emoji_and_cjk(name: str) -> None:
    tok = real_tokenizer(name)
    text = "表情 😀🎉👍🏽 👨‍👩‍👧‍👦 and 中文文本，한국어 e\u0301"
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    out = []
    for i in ids:
        piece = detok.push(i)
        assert "\ufffd" not in piece
        out.append(piece)
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids) == text


@pytest.mark.real
def test_qwen_1_5b_shares_the_vocabulary() -> None:
    """The 1.5B file has no golden entry of its own: it must tokenize as the 0.5B does."""
    path = model_file(QWEN_1_5B)
    if not path.is_file():
        pytest.skip(f"{QWEN_1_5B}.gguf is not in the model store ({path})")
    from specd.ort_models.gguf_file import GGUFFile

    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    golden = GOLDEN["qwen2.5-coder-0.5b-instruct"]
    for case in golden["cases"]:
        assert tok.encode(case["text"]) == case["with_bos"], case["text"]
    assert tok.eot_ids >= {151643, 151645}


@pytest.mark.real
def test_qwen_builds_fast() -> None:
    meta = real_metadata("qwen2.5-coder-0.5b-instruct")
    start = time.perf_counter()
    Tokenizer.from_metadata(meta)
    assert time.perf_counter() - start < 5.0  # about 0.5 s; lenient for a loaded machine


# --- live comparison, only where transformers is installed (never a project dependency)


def _oracle_module() -> Any:
    path = Path(__file__).resolve().parents[2] / "fixtures" / "make_tokenizer_golden.py"
    spec = importlib.util.spec_from_file_location("make_tokenizer_golden", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.real
@pytest.mark.needs_transformers
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_live_against_transformers(name: str) -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (it is only a test oracle, not a dependency)")
    tok = real_tokenizer(name)
    oracle, _ = _oracle_module().load_oracle(model_file(name).parent, name)
    texts = [
        "import os\nfor k, v in os.environ.items():\n\tprint(f'{k}={v!r}')  # 😀\n",
        "Ünïcödé   wörds,\u3000全角スペース and 10,000.5 numbers\n\n\n  end",
        "<|im_start|>system\nBe brief.<|im_end|>\n",
    ]
    for text in texts:
        assert tok.encode(text, add_bos=False) == oracle.encode(text, add_special_tokens=False)


def test_a_merge_of_an_unknown_token_is_a_clear_error(tiny_model_factory) -> None:
    """Corrupt merges name the key instead of the tokenizers library's bare Exception."""
    from specd.ort_models.gguf_file import GGUFFile

    meta = dict(GGUFFile(tiny_model_factory(arch="qwen2")).metadata)
    meta["tokenizer.ggml.merges"] = ["Ġ zzz_not_a_token"]
    with pytest.raises(ValueError, match="tokenizer.ggml.merges cannot be used"):
        Tokenizer.from_metadata(meta)


def test_long_texts_encode_as_short_ones_do(tiny: Tokenizer) -> None:
    """Long texts take the tokenizers library's GIL-free path: the same ids."""
    from specd.daemon.text.tokenizer import _GIL_FREE_FROM

    text = "<|im_start|>user\nhello world 123, " * (_GIL_FREE_FROM // 10)
    assert len(text) >= _GIL_FREE_FROM
    assert tiny.encode(text) == tiny.backend.encode(text, add_special_tokens=False).ids
    plain = tiny.encode(text, parse_special=False)
    assert tiny.decode(plain) == text and len(plain) > len(tiny.encode(text))
