"""Images a chat request carries, as llama-server reads them: each image content part
becomes the media marker in the message's text and its file's bytes are kept in order,
for the model's vision projector to encode (the marker is where the image's tokens go).

Each dialect hands its images over as OpenAI image_url parts (`image_part`): Anthropic's
base64 image blocks, Ollama's `images`, Responses' input_image parts. llama-server's
`/completion` takes a prompt string holding the markers and `multimodal_data`, a list
of base64 files (`multimodal_prompt`); an embedding input may be either that or
{"content": [OpenAI parts]} (`media_prompt`). `image_prompt` has the service encode them.

Where an image may come from:
- a data URL (`data:image/png;base64,...`), anywhere;
- a local file (an absolute path or a `file://` URL), only for a caller who is the
  daemon's own OS user (ipc/security.py knows the caller): others cannot make the daemon
  read its user's files;
- never a remote http(s) URL: the daemon fetches nothing (a 400 that says to send the
  image as a data URL).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any

from specd.daemon.serving.facade import ServiceFacade
from specd.daemon.spec.generation import RequestError
from specd.daemon.spec.media import MEDIA_MARKER, PromptImage

from ..validation import BadRequest

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one image file's bytes, whatever its source


def image_bytes(url: str, *, own_user: bool, param: str) -> bytes:
    """The bytes of the image `url` names (the rules: the module docstring)."""
    if url.startswith(("http://", "https://")):
        raise BadRequest("remote image URLs are not fetched (the daemon fetches nothing): "
                         "send the image as a data URL, data:image/png;base64,...",
                         param=param)
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
            raise BadRequest("an image data URL must be data:image/<type>;base64,<data>",
                             param=param)
        return decode_base64(payload, param)
    path = url.removeprefix("file://")
    if not Path(path).is_absolute():
        raise BadRequest("an image URL must be a data URL or, for the daemon's own user, "
                         "an absolute file path", param=param)
    if not own_user:
        raise BadRequest("local image files are read only for the daemon's own OS user: "
                         "send the image as a data URL", param=param)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise BadRequest(f"cannot read the image file {path}: {exc.strerror}",
                         param=param) from None
    return _sized(data, param)


def decode_base64(payload: str, param: str) -> bytes:
    """Base64 image data (a 400 naming `param` where it is not base64)."""
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise BadRequest(f"an image is larger than {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        return _sized(base64.b64decode(payload, validate=True), param)
    except (binascii.Error, ValueError):
        raise BadRequest("the image data is not valid base64", param=param) from None


def _sized(data: bytes, param: str) -> bytes:
    if not data:
        raise BadRequest("an image is empty", param=param)
    if len(data) > MAX_IMAGE_BYTES:
        raise BadRequest(f"an image is larger than {MAX_IMAGE_BYTES} bytes", param=param)
    return data


def chat_images(messages: list[dict[str, Any]], *, own_user: bool
                ) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages with every `image_url` part made the media marker, and the images'
    bytes in the order their markers come. A message's parts holding an image are
    joined into one text as llama-server joins them: newlines between text parts, none
    before or after a marker. Messages without images are left as they are."""
    out: list[dict[str, Any]] = []
    images: list[bytes] = []
    for i, m in enumerate(messages):
        parts = m.get("content")
        if not isinstance(parts, list) or not any(
                isinstance(p, dict) and p.get("type") == "image_url" for p in parts):
            out.append(m)
            continue
        text, found = _parts_media(parts, own_user=own_user, param=f"messages[{i}]",
                                   lines=True)
        images += found
        out.append({**m, "content": text})
    return out, images


def _part_image(part: dict[str, Any], *, own_user: bool, param: str) -> bytes:
    """The bytes of the image an image_url content part names."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise BadRequest("an image_url part needs image_url.url", param=param)
    return image_bytes(url, own_user=own_user, param=param)


def content_media(parts: list[Any], *, own_user: bool, param: str
                  ) -> tuple[str, list[bytes]]:
    """OpenAI content parts as an embedding input takes them (llama-server's
    tokenize_oai_content_array): the parts' texts joined with nothing between, a media
    marker in each image_url part's place, and the images' bytes in order."""
    return _parts_media(parts, own_user=own_user, param=param, lines=False)


def _parts_media(parts: list[Any], *, own_user: bool, param: str, lines: bool
                 ) -> tuple[str, list[bytes]]:
    """Text and image_url content parts as text with a media marker in each image's
    place, and the images' bytes in order; `lines`: a text part after another text part
    starts a new line (a chat message's), else the texts are joined as they are."""
    text, images, last_marker = "", [], False
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        where = f"{param}.content[{j}]"
        if kind == "image_url":
            images.append(_part_image(p, own_user=own_user, param=where))
            text += MEDIA_MARKER
            last_marker = True
        elif kind == "text" and isinstance(p.get("text"), str):
            text += ("\n" if lines and text and not last_marker else "") + p["text"]
            last_marker = False
        else:
            raise BadRequest(f"a content part of type {kind!r} is not supported "
                             "(text and image_url parts)", param=where)
    return text, images


def holds_images(value: Any) -> bool:
    """Whether an input holds images, as the embeddings routes take one: llama-server's
    {prompt_string, multimodal_data}, or {"content": [parts]} with image_url parts."""
    if not isinstance(value, dict):
        return False
    parts = value.get("content")
    return "multimodal_data" in value or isinstance(parts, list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in parts)


def media_prompt(svc: ServiceFacade, value: Any, param: str, *, own_user: bool
                 ) -> tuple[str, list[bytes]] | None:
    """An input holding images (holds_images): its text (a media marker per image) and
    the images' bytes (multimodal_prompt, content_media); None for an input of text
    only. A 400 where the model takes no images."""
    if not holds_images(value):
        return None
    check_takes_images(svc, param)
    found = multimodal_prompt(value, param)
    if found is not None:
        return found
    return content_media(value["content"], own_user=own_user, param=param)


def check_takes_images(svc: ServiceFacade, param: str) -> None:
    """A 400 naming `param` where the model has no vision projector."""
    if not svc.takes_images:
        raise BadRequest(f"{svc.model_name} takes no images: start it with --mmproj, the "
                         "vision projector of its family", param=param)


def image_part(url: str) -> dict[str, Any]:
    """An image as OpenAI's image_url content part (what chat_images reads)."""
    return {"type": "image_url", "image_url": {"url": url}}


def base64_image_part(data: Any, media_type: Any, param: str) -> dict[str, Any]:
    """Base64 image data (Anthropic's source, Ollama's images) as an image_url part."""
    if not isinstance(data, str) or not data:
        raise BadRequest("an image needs its base64 'data'", param=param)
    mime = media_type if isinstance(media_type, str) and media_type.startswith("image/") \
        else "image/png"
    return image_part(f"data:{mime};base64,{data}")


def multimodal_prompt(value: Any, param: str = "prompt") -> tuple[str, list[bytes]] | None:
    """llama-server's {prompt_string, multimodal_data: [base64 or data URL, ...]}: its
    text (a media marker per image) and the images' bytes; None for any other prompt."""
    if not isinstance(value, dict) or "multimodal_data" not in value:
        return None
    text, files = value.get("prompt_string"), value["multimodal_data"]
    if not isinstance(text, str):
        raise BadRequest("a prompt with 'multimodal_data' needs 'prompt_string', its text "
                         f"holding a {MEDIA_MARKER} marker per file", param=param)
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise BadRequest("'multimodal_data' must be an array of base64 strings", param=param)
    return text, [image_bytes(f, own_user=False, param=param) if f.startswith("data:")
                  else decode_base64(f, param) for f in files]


def image_prompt(svc: ServiceFacade, text: str, images: list[bytes], param: str
                 ) -> tuple[list[int], tuple[PromptImage, ...]]:
    """The prompt of `text` (a media marker per image) and the images, encoded by the
    service's vision projector; a 400 naming `param` for a model without one, a bad
    image or a marker count that does not match. Runs the encoder: off the event loop."""
    check_takes_images(svc, param)
    try:
        return svc.image_prompt(text, images)
    except RequestError as exc:
        raise BadRequest(str(exc), param=param) from None
