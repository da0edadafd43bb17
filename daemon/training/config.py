"""The shape of the head to train, chosen from the target: which target layers it reads
(llama.cpp's ids), its width and attention (the target's: a DFlash head reads features of
its own width and shares the target's embeddings), the mask token, the block, and a DSpark
head's Markov rank."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from specd.ort_models.arch import HParams
from specd.ort_models.gguf_file import GGUFFile
from specd.ort_models.heads import EAGLE3_TARGET_LAYERS

from . import TrainError

UNUSED_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: padding rows of a vocabulary
DEFAULT_FEATURE_LAYERS = 5  # target layers read, as z-lab's and SpecForge's heads read
DEFAULT_HEAD_LAYERS = 2
DEFAULT_BLOCK = 16
DEFAULT_GAMMA = 7.0  # the loss weight of block slot k is exp(-(k - 1) / gamma)
DEFAULT_DRAFT_VOCAB = 32768  # a reduced vocabulary (with d2t) where the target's is larger
HEAD_RMS_EPS = 1e-6
DEFAULT_MARKOV_RANK = 256  # DeepSpec's
DEFAULT_PARALLEL = 4  # replies distilled at once (their rows in one pass of the target)


@dataclass(frozen=True)
class HeadConfig:
    n_layer: int
    n_embd: int  # the target's n_embd
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_base: float
    n_ctx_train: int
    block_size: int  # [anchor, MASK x (block_size - 1)]: block_size - 1 drafts a pass
    gamma: float
    target_layers: tuple[int, ...]  # llama.cpp's ids: L = the stream entering target layer L
    mask_token_id: int
    target_vocab: int  # the target's vocabulary (token_embd rows)
    draft_vocab: int  # rows of the head's logits: < target_vocab means a d2t map
    # "dflash": slot 0 holds the anchor, slots 1..B-1 draft the tokens at their own
    # positions; "dspark": anchor-first, slot k drafts the token after its position
    # (a + k + 1), biased by a Markov head of this rank, with a confidence head;
    # "eagle3": B - 1 autoregressive steps (model.Eagle3Head)
    kind: str = "dflash"
    markov_rank: int = 0

    @property
    def first_slot(self) -> int:
        """The block's first drafting slot."""
        return 0 if self.kind == "dspark" else 1

    @property
    def n_slots(self) -> int:
        """Drafts a block proposes: B - 1, or B anchor-first."""
        return self.block_size - self.first_slot

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """specd's target outputs for target_layers (hidden_{L-1}), in the head's order."""
        return tuple(layer - 1 for layer in self.target_layers)

    @property
    def feature_width(self) -> int:
        return len(self.target_layers) * self.n_embd

    @property
    def reduced(self) -> bool:
        return self.draft_vocab < self.target_vocab

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.kind == "dflash":  # as DFlash runs recorded it before other kinds
            del d["kind"], d["markov_rank"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadConfig:
        d = dict(d)
        d["target_layers"] = tuple(d["target_layers"])
        return cls(**d)


def default_target_layers(n_target: int, count: int = DEFAULT_FEATURE_LAYERS
                          ) -> tuple[int, ...]:
    """llama.cpp ids (HF ids + 1) of `count` target layers to read: z-lab's rule
    HF id round(1 + i (N - 4) / (count - 1)), i = 0..count - 1, where the target is deep
    enough; else as evenly spread over HF ids 0..N - 2 as its depth allows (llama.cpp
    reads no stream after the last layer: `head_config`)."""
    last = max(n_target - 2, 0)  # the highest HF id llama.cpp can read
    count = max(1, min(count, last + 1))
    if count > 1 and n_target - 4 >= count - 1:
        ids = [math.floor(1 + i * (n_target - 4) / (count - 1) + 0.5) for i in range(count)]
    elif count > 1:
        ids = sorted({math.floor(i * last / (count - 1) + 0.5) for i in range(count)})
    else:
        ids = [last // 2]
    return tuple(i + 1 for i in ids)


def mask_token(f: GGUFFile, n_vocab: int) -> int:
    """The token filling a block's draft slots: the target's mask token where it names one,
    else its first unused (padding) token, whose embedding row no text ever reads."""
    named = f.get("tokenizer.ggml.mask_token_id")
    if isinstance(named, int) and 0 <= named < n_vocab:
        return named
    types = f.get("tokenizer.ggml.token_type") or []
    for i, t in enumerate(types[:n_vocab]):
        if t == UNUSED_TOKEN_TYPE:
            return i
    raise TrainError(f"{f.path}: the target's vocabulary has no mask token and no unused "
                     "(padding) token to draft with; pass --mask-token-id")


def eagle3_target_layers(n_target: int) -> tuple[int, ...]:
    """llama.cpp ids of the three target layers an EAGLE-3 head reads by default (its
    converter's [2, N / 2, N - 3]), each within the 1..N - 1 llama.cpp can read."""
    return tuple(min(max(x, 1), n_target - 1) for x in (2, n_target // 2, n_target - 3))


# a kind's defaults where the request leaves them: layers, block (EAGLE-3: the steps of
# the training-time test + 1) and gamma (EAGLE-3: step j weighted 0.8^j)
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "dflash": {"n_layer": DEFAULT_HEAD_LAYERS, "block_size": DEFAULT_BLOCK,
               "gamma": DEFAULT_GAMMA},
    "dspark": {"n_layer": DEFAULT_HEAD_LAYERS, "block_size": DEFAULT_BLOCK,
               "gamma": DEFAULT_GAMMA},
    "eagle3": {"n_layer": 1, "block_size": 8, "gamma": 1.0 / math.log(1.25)},
}


def head_config(f: GGUFFile, hp: HParams, *, n_layer: int | None = None,
                n_ff: int | None = None, block_size: int | None = None,
                gamma: float | None = None, feature_layers: int = DEFAULT_FEATURE_LAYERS,
                target_layers: tuple[int, ...] | None = None, mask_token_id: int | None = None,
                draft_vocab: int = DEFAULT_DRAFT_VOCAB, kind: str = "dflash",
                markov_rank: int = DEFAULT_MARKOV_RANK) -> HeadConfig:
    """The `kind` head for target `f` (hyper-parameters `hp`): its attention is the
    target's (heads, KV heads, head size, rope base); n_ff defaults to the target's, the
    rest to the kind's (KIND_DEFAULTS)."""
    d = KIND_DEFAULTS[kind]
    n_layer = d["n_layer"] if n_layer is None else n_layer
    block_size = d["block_size"] if block_size is None else block_size
    gamma = d["gamma"] if gamma is None else gamma
    if block_size < 2:
        raise TrainError(f"--block {block_size}: a block is the anchor and at least one "
                         "draft slot")
    if kind == "eagle3":
        if n_layer != 1:
            raise TrainError(f"--layers {n_layer}: an EAGLE-3 head has one layer (llama.cpp "
                             "loads no other)")
        layers = target_layers or eagle3_target_layers(hp.n_layer)
        if len(layers) != EAGLE3_TARGET_LAYERS:
            raise TrainError(f"target layers {list(layers)}: EAGLE-3 reads exactly "
                             f"{EAGLE3_TARGET_LAYERS}")
    else:
        layers = target_layers or default_target_layers(hp.n_layer, feature_layers)
    bad = [x for x in layers if not 1 <= x < hp.n_layer]
    if bad:
        # specd reads id n_layer (the stream after the last layer), but llama.cpp b11434
        # aborts on it ("layer input tensor is null"): the head would not be portable
        raise TrainError(f"target layers {bad} are outside 1..{hp.n_layer - 1} (llama.cpp's "
                         "ids: L reads the stream entering target layer L, and llama.cpp "
                         "has no input to read after the last layer)")
    mask = mask_token(f, hp.n_vocab) if mask_token_id is None else mask_token_id
    if not 0 <= mask < hp.n_vocab:
        raise TrainError(f"mask token id {mask} is outside the vocabulary of {hp.n_vocab}")
    vocab = hp.n_vocab if not draft_vocab or draft_vocab >= hp.n_vocab else draft_vocab
    return HeadConfig(n_layer=n_layer, n_embd=hp.n_embd, n_head=hp.n_head,
                      n_head_kv=hp.n_head_kv, head_dim=hp.head_dim, n_ff=n_ff or hp.n_ff,
                      rms_eps=HEAD_RMS_EPS, rope_base=hp.rope_base,
                      n_ctx_train=hp.n_ctx_train, block_size=block_size, gamma=gamma,
                      target_layers=tuple(layers), mask_token_id=mask,
                      target_vocab=hp.n_vocab, draft_vocab=vocab, kind=kind,
                      markov_rank=markov_rank if kind == "dspark" else 0)
