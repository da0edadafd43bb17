"""Tokenizers rebuilt from a GGUF file's metadata, with the HuggingFace `tokenizers` library.

A GGUF carries no `tokenizer.json`, only llama.cpp's `tokenizer.ggml.*` keys: the vocabulary,
the merges (BPE) or scores (SentencePiece), each token's type and the special-token ids. From
those we build the same tokenizer llama.cpp (`llama-vocab.cpp`) and transformers' GGUF loader
(`transformers/integrations/gguf`) build:

* `tokenizer.ggml.model == "gpt2"`: byte-level BPE, text first split by the regexes that
  `tokenizer.ggml.pre` names (see `_PRE_TOKENIZERS`).
* `tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback (`<0xXX>` tokens) and
  `▁` for spaces; merges are derived from the vocabulary and its scores.

Tokens of type CONTROL are special: parsed out of text only with `parse_special=True`.
USER_DEFINED tokens are always matched whole, as llama.cpp does.

Decoding goes through `token_bytes`, the raw bytes each token stands for, so `decode` and the
streaming `IncrementalDetokenizer` (detokenize.py) agree byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

# llama.cpp's token types (`enum llama_token_type`)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"  # ▁

# --- pre-tokenizer regexes (llama.cpp `llm_tokenizer_bpe`, as the upstream tokenizer.json has them)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
# llama.cpp's fallback for a BPE vocabulary that names no (or the "default") pre-tokenizer
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp treats one `tokenizer.ggml.pre` value."""

    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces of the one before
    ignore_merges: bool = False  # a piece that is a whole token is taken as is (llama3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_LLAMA3_SPEC = PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_SPEC = PreTokenizerSpec((_QWEN2,))
_SMOLLM_SPEC = PreTokenizerSpec((r"\p{N}", _GPT2))  # digits one by one, then GPT-2's regex
_GPT2_SPEC = PreTokenizerSpec((_GPT2,))

_PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        _LLAMA3_SPEC,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizerSpec((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_SPEC),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _SMOLLM_SPEC,
    ),
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion"), _GPT2_SPEC),
    "tekken": PreTokenizerSpec((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4"), PreTokenizerSpec((_GPT4O,))),
    "deepseek-coder": PreTokenizerSpec(_DEEPSEEK_CODER),
    "falcon": PreTokenizerSpec(_FALCON),
    "default": PreTokenizerSpec(_DEFAULT),
}

SUPPORTED_MODELS = ("gpt2", "llama")
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_PRE_TOKENIZERS))

# SentencePiece vocabularies that transformers builds the Gemma way (see `_spm_vocab`)
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n", "gemma-embedding"})

# --- end-of-generation and FIM tokens, found by text as llama.cpp does (`llama_vocab::load`)

_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
)  # fmt: skip
_FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_FIM_KEYS = {
    "pre": ("fim_pre_token_id", "prefix_token_id"),
    "suf": ("fim_suf_token_id", "suffix_token_id"),
    "mid": ("fim_mid_token_id", "middle_token_id"),
    "pad": ("fim_pad_token_id",),
    "rep": ("fim_rep_token_id",),
    "sep": ("fim_sep_token_id",),
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in bytes_to_unicode().items()}


@cache
def _outside_byte_alphabet() -> re.Pattern[str]:
    return re.compile("[^" + re.escape("".join(bytes_to_unicode().values())) + "]")


# texts this long (characters) are encoded without holding the GIL
_GIL_FREE_FROM = 16384

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """A GGUF vocabulary's tokenizer. Build it with `Tokenizer.from_metadata(meta)`."""

    def __init__(
        self,
        *,
        backend: _Backend,
        tokens: Sequence[str],
        token_types: Sequence[int],
        byte_level: bool,
        meta: Mapping[str, Any],
        default_add_bos: bool,
        strip_leading_space: bool,
    ) -> None:
        self._backend = backend
        self._plain_backend: _Backend | None = None
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._byte_level = byte_level
        self._strip_leading_space = strip_leading_space
        self._token_bytes: list[bytes] | None = None
        self._ids = {text: i for i, text in enumerate(self._tokens)}  # the last one wins
        n = len(self._tokens)
        self._bos_id = _meta_id(meta, "bos_token_id", n)
        self._eos_id = _meta_id(meta, "eos_token_id", n)
        self._pad_id = _meta_id(meta, "padding_token_id", n)
        self._unk_id = _meta_id(meta, "unknown_token_id", n)
        self._add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        self._add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self._fim = {kind: self._find_fim(meta, kind) for kind in _FIM_TEXTS}
        self._eot_ids = self._find_eog(meta)
        self.model = str(meta.get("tokenizer.ggml.model", ""))
        self.pre = str(meta.get("tokenizer.ggml.pre", "") or "default")

    # --- construction

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a dict of GGUF metadata (`GGUFFile(path).metadata`)."""
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: no vocabulary to use")
        types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
            )
        if model == "gpt2":
            return cls._byte_level_bpe(meta, list(tokens), types)
        if model == "llama":
            return cls._sentencepiece(meta, list(tokens), types)
        raise ValueError(
            f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
            f"supported: {', '.join(SUPPORTED_MODELS)}"
        )

    @classmethod
    def _byte_level_bpe(
        cls, meta: Mapping[str, Any], tokens: list[str], types: list[int]
    ) -> Tokenizer:
        pre_name = str(meta.get("tokenizer.ggml.pre") or "default")
        spec = _PRE_TOKENIZERS.get(pre_name)
        if spec is None:
            raise ValueError(
                f"unsupported pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) for a gpt2 (BPE) "
                f"vocabulary; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
            )
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("gpt2 (BPE) vocabulary without tokenizer.ggml.merges")
        vocab = _byte_level_vocab(tokens, types)
        pairs = [_split_merge(m) for m in merges]
        try:
            model = BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges)
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"tokenizer.ggml.merges cannot be used: {exc}") from None
        backend = _Backend(model)
        splits: list[Any] = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes
        ]
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
        _add_vocab_tokens(backend, tokens, types, parse_special=True)
        return cls(
            backend=backend,
            tokens=tokens,
            token_types=types,
            byte_level=True,
            meta=meta,
            default_add_bos=spec.add_bos,
            strip_leading_space=False,
        )

    @classmethod
    def _sentencepiece(
        cls, meta: Mapping[str, Any], tokens: list[str], types: list[int]
    ) -> Tokenizer:
        arch = str(meta.get("general.architecture", ""))
        gemma = arch in _GEMMA_ARCHS
        vocab, order = _spm_vocab(tokens, gemma=gemma)
        if gemma:
            # Gemma's scores do not follow its merge order; the order of the file does.
            scores: Sequence[float] = [-float(i) for i in range(len(tokens))]
        else:
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = generate_merges(order, vocab, scores)
        unk_id = _meta_id(meta, "unknown_token_id", len(tokens))
        model = BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
        backend = _Backend(model)
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        replace = normalizers.Replace(" ", SPIECE_SPACE)
        if add_space_prefix:
            # llama.cpp puts the space before every run of text, also one after a special token
            backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPIECE_SPACE), replace])
        else:
            backend.normalizer = replace
        _add_vocab_tokens(backend, tokens, types, parse_special=True, vocab=vocab)
        return cls(
            backend=backend,
            tokens=tokens,
            token_types=types,
            byte_level=False,
            meta=meta,
            default_add_bos=True,
            strip_leading_space=add_space_prefix,
        )

    # --- encoding and decoding

    def encode(
        self,
        text: str,
        *,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids for `text`.

        `add_bos`/`add_eos` None: as the file says (`tokenizer.ggml.add_bos_token`, else
        llama.cpp's default for this vocabulary). `parse_special=False` treats control tokens'
        text such as `<|im_start|>` as plain text (use it for untrusted user text).
        """
        backend = self._backend if parse_special else self._plain()
        text = _valid_text(text)
        if len(text) < _GIL_FREE_FROM:
            ids = backend.encode(text, add_special_tokens=False).ids
        else:  # the batch call lets other threads (the server's event loop) run meanwhile
            ids = backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (self._add_bos if add_bos is None else add_bos) and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        if (self._add_eos if add_eos is None else add_eos) and self._eos_id is not None:
            ids.append(self._eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 becomes U+FFFD. skip_special drops control tokens."""
        data = b"".join(
            self.token_bytes(i) for i in ids if not (skip_special and self.is_control(i))
        )
        if self._strip_leading_space and data.startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (a control token: its text)."""
        table = self._token_bytes
        if table is None:
            table = self._token_bytes = self._build_token_bytes()
        return table[token_id]

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it (e.g. 'Ġhello', '▁hello', '<0x0A>')."""
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """The id of the vocabulary entry spelled `text`, if there is one."""
        return self._ids.get(text)

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_control(self, token_id: int) -> bool:
        """A control (special) token: BOS, EOS, `<|im_start|>`... (skip_special hides it)."""
        return self._types[token_id] in (CONTROL, UNKNOWN)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eot_ids

    @property
    def strips_leading_space(self) -> bool:
        """Decoding drops one leading space (SentencePiece vocabularies with a space prefix)."""
        return self._strip_leading_space

    # --- properties

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    @property
    def add_bos(self) -> bool:
        """Whether `encode` adds BOS by default."""
        return self._add_bos and self._bos_id is not None

    @property
    def eot_ids(self) -> frozenset[int]:
        """Every id that ends generation (llama.cpp's `is_eog`)."""
        return self._eot_ids

    @property
    def fim_prefix_id(self) -> int | None:
        return self._fim["pre"]

    @property
    def fim_suffix_id(self) -> int | None:
        return self._fim["suf"]

    @property
    def fim_middle_id(self) -> int | None:
        return self._fim["mid"]

    @property
    def fim_pad_id(self) -> int | None:
        return self._fim["pad"]

    @property
    def fim_repo_id(self) -> int | None:
        """The repo-name token of repo-level FIM prompts (`<|repo_name|>`)."""
        return self._fim["rep"]

    @property
    def fim_sep_id(self) -> int | None:
        """The file separator of repo-level FIM prompts (`<|file_sep|>`)."""
        return self._fim["sep"]

    @property
    def backend(self) -> _Backend:
        """The `tokenizers.Tokenizer` that encodes with special tokens parsed."""
        return self._backend

    # --- internals

    def _plain(self) -> _Backend:
        """The same model, without control tokens as added tokens (built on first use)."""
        if self._plain_backend is None:
            plain = _Backend(self._backend.model)
            plain.normalizer = self._backend.normalizer
            plain.pre_tokenizer = self._backend.pre_tokenizer
            vocab = None if self._byte_level else self._backend.get_vocab(with_added_tokens=False)
            _add_vocab_tokens(plain, self._tokens, self._types, parse_special=False, vocab=vocab)
            self._plain_backend = plain
        return self._plain_backend

    def _build_token_bytes(self) -> list[bytes]:
        if self._byte_level:
            return [
                _byte_level_bytes(t, ty) for t, ty in zip(self._tokens, self._types, strict=True)
            ]
        return [_spm_bytes(t, ty) for t, ty in zip(self._tokens, self._types, strict=True)]

    def _find_fim(self, meta: Mapping[str, Any], kind: str) -> int | None:
        for key in _FIM_KEYS[kind]:
            found = _meta_id(meta, key, len(self._tokens))
            if found is not None:
                return found
        return next((self._ids[t] for t in _FIM_TEXTS[kind] if t in self._ids), None)

    def _find_eog(self, meta: Mapping[str, Any]) -> frozenset[int]:
        n = len(self._tokens)
        ids = {self._eos_id, _meta_id(meta, "eot_token_id", n), _meta_id(meta, "eom_token_id", n)}
        ids |= {self._fim["pad"], self._fim["rep"], self._fim["sep"]}
        ids |= {self._ids[t] for t in _EOG_TEXTS if t in self._ids}
        if "<|return|>" in self._ids and "<|call|>" in self._ids:  # harmony (gpt-oss):
            ids.discard(self._ids.get("<|end|>"))  # <|end|> ends a message, not the reply
        ids.discard(None)
        return frozenset(i for i in ids if i is not None)


# --- helpers


def _meta_id(meta: Mapping[str, Any], key: str, n_tokens: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_tokens else None


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return left, right


def _byte_level_vocab(tokens: Sequence[str], types: Sequence[int]) -> dict[str, int]:
    """token text -> id, in the byte alphabet.

    A normal token spelled outside the byte alphabet is respelled into it (as transformers
    does); special tokens keep their text, so adding them as added tokens maps to their id.
    """
    outside = _outside_byte_alphabet()
    table = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab[token] = i
    for i, token in enumerate(tokens):
        if types[i] in (CONTROL, USER_DEFINED) or not outside.search(token):
            continue
        spelled = "".join(table[b] for b in token.encode("utf-8"))
        if spelled not in vocab:
            del vocab[token]
            vocab[spelled] = i
    return vocab


def _spm_vocab(tokens: Sequence[str], *, gemma: bool) -> tuple[dict[str, int], list[str]]:
    """token text -> id, and the tokens in file order, as the BPE model sees them.

    Gemma files store the tokens of two or more spaces as real spaces; the text is looked up
    with `▁` for spaces, so respell those (transformers' `gemma_tokenizer`).
    """
    order = list(tokens)
    if gemma:
        order = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in order]
    vocab: dict[str, int] = {}
    for i, token in enumerate(order):
        vocab[token] = i
    return vocab, order


def generate_merges(
    order: Sequence[str], vocab: Mapping[str, int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: best-scoring result first.

    Every split of a token into two vocabulary entries is a merge. Same order as transformers'
    `generate_merges(vocab, vocab_scores)`: by score, then longer left, then longer right part,
    then file order, then the parts' ids.
    """
    keys: list[tuple[float, int, int, int]] = []
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()
    get = vocab.get
    for token in order:
        n = len(token)
        if n < 2 or token in seen:
            continue
        seen.add(token)
        local = []
        for k in range(1, n):
            left = get(token[:k])
            if left is not None:
                right = get(token[k:])
                if right is not None:
                    local.append((left, right, k))
        if len(local) > 1:
            local.sort()
        neg_score = -scores[vocab[token]]
        for _, _, k in local:
            keys.append((neg_score, -k, k - n, len(keys)))
            pairs.append((token[:k], token[k:]))
    ranked = sorted(range(len(keys)), key=keys.__getitem__)
    return [pairs[i] for i in ranked]


def _add_vocab_tokens(
    backend: _Backend,
    tokens: Sequence[str],
    types: Sequence[int],
    *,
    parse_special: bool,
    vocab: Mapping[str, int] | None = None,
) -> None:
    """Add control tokens (if parse_special) as special tokens and user-defined ones as added
    tokens, each matched whole in the raw text.

    With `vocab` (SentencePiece), a user-defined token is added only if the model's vocabulary
    spells it that way (transformers' rule: Gemma's respelled space runs are left to BPE).
    """
    if parse_special:
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in (CONTROL, UNKNOWN) and t
        ]
        backend.add_special_tokens(control)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == USER_DEFINED and t and (vocab is None or t in vocab)
    ]
    backend.add_tokens(user)


def _byte_level_bytes(token: str, token_type: int) -> bytes:
    if token_type in (CONTROL, USER_DEFINED, UNKNOWN):
        return token.encode("utf-8")
    table = _unicode_to_bytes()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:  # a token spelled outside the byte alphabet stands for its own text
        return token.encode("utf-8")


def _spm_bytes(token: str, token_type: int) -> bytes:
    if token_type == BYTE:
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
    if token_type in (CONTROL, UNKNOWN):
        return token.encode("utf-8")
    return token.replace(SPIECE_SPACE, " ").encode("utf-8")


def _valid_text(text: str) -> str:
    """`text` with each lone surrogate (JSON's "\\ud800", a non-UTF-8 byte in argv under
    surrogateescape) replaced by U+FFFD, which the tokenizers library needs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text
