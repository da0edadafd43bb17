"""Images in a prompt: token runs and image chunks, as one token list and the images beside.

A prompt is a sequence of segments, token runs and images (`ImageChunk`: the encoder's
rows [n_tokens, n_embd] and the sha256 of the image file). `assemble` flattens them into
the prompt's token list, in which each image's positions hold a placeholder id derived
from its digest (negative: no token has it), and the images at their positions
(`PromptImage`). So everything that compares prompts as token lists (the slots' prefix
cache) tells two images apart by their bytes, and sees the same screenshot as the same
prefix; everything that embeds ids (a draft model, a head's pairs) maps the placeholders
to a text id first (`text_ids`), and prompt lookup never proposes one.

In text, an image's place is the media marker (`MEDIA_MARKER`, llama-server's default):
the APIs write one per image into the prompt's text, and the engine splits the text there.

Positions are 1-D here: an image of n tokens occupies n positions (llama.cpp's n_pos for
every projector but M-RoPE's), so a token's position is its index in the list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MEDIA_MARKER = "<__media__>"  # where an image goes in a prompt's text (mtmd splits at it)
# a placeholder's id: minus one minus 60 bits of a hash of the whole digest (never a
# token id; images differing anywhere in their bytes get different ones)
_PLACEHOLDER_BITS = 60


@dataclass(frozen=True)
class ImageChunk:
    """An image as the target takes it: its projected tokens and the file's sha256."""

    embeddings: np.ndarray  # [n_tokens, n_embd] float32
    digest: str

    def __post_init__(self) -> None:
        e = self.embeddings
        if e.ndim != 2 or not len(e):
            raise ValueError(f"an image's embeddings are [n_tokens >= 1, n_embd], got "
                             f"{list(e.shape)}")
        if not self.digest:
            raise ValueError("an image needs its digest (the sha256 of its file)")

    @property
    def n_tokens(self) -> int:
        return int(self.embeddings.shape[0])


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: its chunk at prompt positions start .. start + n_tokens - 1."""

    start: int
    chunk: ImageChunk

    @property
    def end(self) -> int:
        return self.start + self.chunk.n_tokens

    @property
    def embeddings(self) -> np.ndarray:
        return self.chunk.embeddings

    @property
    def digest(self) -> str:
        return self.chunk.digest


Segment = Sequence[int] | ImageChunk


def placeholder_id(digest: str) -> int:
    """The id an image's positions hold in a prompt's token list (negative)."""
    h = hashlib.blake2b(digest.encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(h, "little") >> (64 - _PLACEHOLDER_BITS))


def is_placeholder(token: int) -> bool:
    return token < 0


def assemble(segments: Sequence[Segment]) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt's token list (placeholders at the images' positions) and its images."""
    tokens: list[int] = []
    images: list[PromptImage] = []
    for seg in segments:
        if isinstance(seg, ImageChunk):
            images.append(PromptImage(len(tokens), seg))
            tokens.extend([placeholder_id(seg.digest)] * seg.n_tokens)
        else:
            tokens.extend(int(t) for t in seg)
    return tokens, tuple(images)


def check_images(prompt: Sequence[int], images: Sequence[PromptImage]) -> None:
    """The images must lie in order in the prompt, each over its own placeholders, and
    every placeholder must belong to an image (ValueError naming the first that does not)."""
    covered = 0
    for im in images:
        if im.start < covered or im.end > len(prompt):
            raise ValueError(f"an image at positions {im.start}..{im.end - 1} overlaps another "
                             f"or runs past the prompt's {len(prompt)} tokens")
        want = placeholder_id(im.digest)
        if any(t != want for t in prompt[im.start:im.end]):
            raise ValueError(f"the prompt's positions {im.start}..{im.end - 1} do not hold the "
                             "image's placeholders")
        covered = im.end
    n_held = sum(im.chunk.n_tokens for im in images)
    if sum(1 for t in prompt if is_placeholder(t)) != n_held:
        raise ValueError("the prompt holds image placeholders no image is given for")


def image_at(images: Sequence[PromptImage], pos: int) -> PromptImage | None:
    """The image covering prompt position `pos` (None: a token's position)."""
    for im in images:
        if im.start <= pos < im.end:
            return im
    return None


def next_image_start(images: Sequence[PromptImage], pos: int) -> int | None:
    """The first position after `pos` where an image starts (None: none)."""
    return next((im.start for im in images if im.start > pos), None)


def outside_images(images: Sequence[PromptImage], n: int) -> int:
    """The largest k <= n that does not cut an image: a prefix of the prompt holds each
    image whole or not at all (an image's KV is computed by one call)."""
    im = image_at(images, n)
    return n if im is None or im.start == n else im.start


def text_runs(tokens: Sequence[int]) -> list[list[int] | None]:
    """The prompt as its token runs, None for each image (its run of placeholders)."""
    out: list[list[int] | None] = []
    prev: int | None = None
    for t in tokens:
        if is_placeholder(t):
            if t != prev:
                out.append(None)
        elif out and out[-1] is not None:
            out[-1].append(t)
        else:
            out.append([t])
        prev = t
    return out


def text_ids(tokens: Sequence[int], substitute: int = 0) -> list[int]:
    """The tokens with every image placeholder replaced by `substitute`: ids a model
    without the image's embeddings can take, keeping the positions (llama.cpp's draft
    model gets rows of zeros there for the same reason)."""
    return [substitute if t < 0 else t for t in tokens]
