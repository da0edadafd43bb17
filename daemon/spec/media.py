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

An image of n tokens occupies n KV rows, so a token's KV position is its index in the
list. Its rotary positions are that index too, except on an M-RoPE model (Qwen-VL's
qwen2vl): there, as llama.cpp's mtmd, an image starting at rope position p0 places its
token i (row-major on its grid of `rows` x `cols`) at (t, h, w, e) = (p0, p0 + i // cols,
p0 + i % cols, 0) and takes max(rows, cols) positions, not n; a text token at rope
position p is (p, p, p, 0), so the text after an image runs max(rows, cols) - n positions
behind its KV rows (`mrope_positions`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specd.ort_models.runner import text_rope_positions

MEDIA_MARKER = "<__media__>"  # where an image goes in a prompt's text (mtmd splits at it)
# a placeholder's id: minus one minus 60 bits of a hash of the whole digest (never a
# token id; images differing anywhere in their bytes get different ones)
_PLACEHOLDER_BITS = 60


@dataclass(frozen=True)
class ImageChunk:
    """An image as the target takes it: its projected tokens and the file's sha256."""

    embeddings: np.ndarray  # [n_tokens, n_embd] float32
    digest: str
    # the tokens' grid (rows, cols), row-major: M-RoPE models place them on it
    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        e = self.embeddings
        if e.ndim != 2 or not len(e):
            raise ValueError(f"an image's embeddings are [n_tokens >= 1, n_embd], got "
                             f"{list(e.shape)}")
        if not self.digest:
            raise ValueError("an image needs its digest (the sha256 of its file)")
        if self.grid is not None and self.grid[0] * self.grid[1] != len(e):
            raise ValueError(f"an image's grid {self.grid[0]} x {self.grid[1]} does not hold "
                             f"its {len(e)} tokens")

    @property
    def n_rope_positions(self) -> int:
        """Rotary positions the image takes on an M-RoPE model: max(rows, cols)."""
        if self.grid is None:
            raise ValueError("an image without its token grid cannot be placed by M-RoPE")
        return max(self.grid)

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


def chunk_end(images: Sequence[PromptImage], start: int, end: int, whole_images: bool) -> int:
    """Where a prompt chunk from `start`, which would end at `end`, ends: an image's rows
    in a chunk of their own (the whole image where `whole_images`: its rows see each
    other, so one call computes them), text up to the next image."""
    image = image_at(images, start)
    if image is not None:
        return image.end if whole_images else min(end, image.end)
    return min(end, next_image_start(images, start) or end)


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


def mrope_shift(images: Sequence[PromptImage]) -> int:
    """Rope position minus KV position of the text after all of `images` (<= 0)."""
    return sum(im.chunk.n_rope_positions - im.chunk.n_tokens for im in images)


def mrope_positions(images: Sequence[PromptImage], start: int, end: int) -> np.ndarray:
    """M-RoPE positions [4, end - start] (t, h, w, e) of the rows at KV positions
    start..end-1 of a prompt holding `images` (and of its continuation past them): text
    rows at their KV position less what the images before them saved, image rows on
    their grid from their start's rope position (the module docstring)."""
    out = np.empty((4, end - start), dtype=np.int64)
    shift = 0  # rope position minus KV position, after the images seen so far
    p = start
    for im in images:
        saved = im.chunk.n_rope_positions - im.chunk.n_tokens  # <= 0
        if im.end <= start:
            shift += saved
            continue
        if im.start >= end:
            break
        if p < im.start:  # text before the image
            out[:, p - start:im.start - start] = text_rope_positions(p, im.start - p, shift)
            p = im.start
        assert im.chunk.grid is not None  # (n_rope_positions checked it)
        _, cols = im.chunk.grid
        last = min(end, im.end)
        i = np.arange(p - im.start, last - im.start)
        p0 = im.start + shift
        out[:, p - start:last - start] = np.stack(
            [np.full(len(i), p0), p0 + i // cols, p0 + i % cols, np.zeros(len(i), np.int64)])
        shift += saved
        p = last
    if p < end:
        out[:, p - start:] = text_rope_positions(p, end - p, shift)
    return out


def pinned_rows(images: Sequence[PromptImage], start: int, end: int) -> np.ndarray:
    """Which rows at KV positions start..end-1 belong to a media chunk pinned to one rope
    position: more than one row, all at the same t position (`mrope_positions`: an
    M-RoPE image's rows share their start's). llama.cpp's DFlash drafter injects no rows
    of such a chunk (a windowed draft cache could not free cells for them) and drafts over
    the gap; a chunk whose rows advance (audio) is injected like text. [end - start] bool."""
    out = np.zeros(end - start, dtype=bool)
    for im in images:
        if im.end <= start or im.start >= end or im.chunk.n_tokens < 2:
            continue
        t = mrope_positions((im,), im.start, im.end)[0]  # [n_tokens]
        if t[0] == t[-1]:
            out[max(im.start, start) - start:min(im.end, end) - start] = True
    return out
