"""Prompts holding images: rendered text with a media marker per image, and the images'
file bytes, made into the prompt's tokens and image chunks as llama.cpp's mtmd makes them.

The text is split at each `MEDIA_MARKER`; each text part is tokenized with specials
parsed, BOS only before the first (where the vocabulary adds one), and each image is
the projector family's begin text, the image's rows, its end text (gemma3:
`<start_of_image>` … `<end_of_image>`, Qwen-VL: `<|vision_start|>` … `<|vision_end|>`,
muse-glimmer: `<|image_start|>` … `<|image_end|>`; mtmd.cpp adds nothing else around
them). An image is decoded and preprocessed
(`VisionEncoder.prepare`: a bad one is a RequestError naming it) and encoded once per
distinct file: the last few images' rows are kept by their sha256, so a follow-up about
the same screenshot costs neither the encoder nor, through the slots' prefix cache
(placeholders derived from the digest), its prefill.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

from specd.daemon.spec.generation import RequestError
from specd.daemon.spec.media import MEDIA_MARKER, ImageChunk, PromptImage, Segment, assemble
from specd.daemon.text.tokenizer import Tokenizer
from specd.ort_models.vision import ImageError, OrtVisionEncoder

KEPT_IMAGES = 8  # encoded images kept by digest (a follow-up's image is not re-encoded)


class ImagePrompter:
    """An engine's text-and-images prompts: its tokenizer and vision encoder."""

    def __init__(self, tokenizer: Tokenizer, encoder: OrtVisionEncoder,
                 kept: int = KEPT_IMAGES):
        self.tokenizer, self.encoder = tokenizer, encoder
        self._kept: OrderedDict[str, ImageChunk] = OrderedDict()
        self._n_kept = kept
        self._lock = threading.Lock()
        self.encoded = 0  # images run through the encoder (not found among those kept)

    def prompt(self, text: str, images: Sequence[bytes], *, add_bos: bool | None = None
               ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt of `text` with one media marker per image in `images` (in order):
        its token list (placeholders at the images' positions) and its images.
        `add_bos`: before the first text part (None: as the vocabulary says)."""
        parts = text.split(MEDIA_MARKER)
        if len(parts) - 1 != len(images):
            raise RequestError(f"the prompt holds {len(parts) - 1} media markers "
                               f"({MEDIA_MARKER}) for {len(images)} images: each image "
                               "needs its marker")
        tok, family = self.tokenizer, self.encoder.family
        segments: list[Segment] = []
        for i, part in enumerate(parts):  # EOS (where the vocabulary adds one) at the end
            segments.append(tok.encode(part, add_bos=add_bos if i == 0 else False,
                                       add_eos=None if i == len(images) else False))
            if i < len(images):
                chunk = self.chunk(images[i], i)
                segments += [tok.encode(family.image_begin, add_bos=False, add_eos=False),
                             chunk,
                             tok.encode(family.image_end, add_bos=False, add_eos=False)]
        return assemble(segments)

    def chunk(self, data: bytes, index: int = 0) -> ImageChunk:
        """The image file's rows for the text model (those kept, if it was seen lately);
        RequestError naming image `index` (0-based) if it cannot be used."""
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            kept = self._kept.get(digest)
            if kept is not None:
                self._kept.move_to_end(digest)
                return kept
        try:
            prepared = self.encoder.prepare(data)
        except ImageError as exc:
            raise RequestError(f"image {index + 1}: {exc}") from None
        # [n_tokens, n_embd] on its grid (rows, cols)
        chunk = ImageChunk(self.encoder.encode(prepared), digest, prepared.grid)
        with self._lock:
            self.encoded += 1
            self._kept[digest] = chunk
            while len(self._kept) > self._n_kept:
                self._kept.popitem(last=False)
        return chunk
