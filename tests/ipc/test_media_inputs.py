"""Images in a chat request's messages (ipc/http/media_inputs.py): where an image may come
from, and the media marker in its place, joined as llama-server joins content parts."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from specd.ipc.http.media_inputs import MEDIA_MARKER, chat_images, image_bytes
from specd.ipc.validation import BadRequest

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def _part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_become_markers_joined_as_llama_server_joins_them() -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look:"},
                                             _part(DATA_URL),
                                             {"type": "text", "text": "what is it?"},
                                             {"type": "text", "text": "and why?"}]}]
    out, images = chat_images(messages, own_user=False)
    assert out[0] is messages[0] and images == [PNG]
    assert out[1]["content"] == f"look:{MEDIA_MARKER}what is it?\nand why?"


def test_remote_urls_are_refused_the_daemon_fetches_nothing() -> None:
    with pytest.raises(BadRequest, match="not fetched.*data URL"):
        chat_images([{"role": "user", "content": [_part("https://example.com/a.png")]}],
                    own_user=True)


def test_local_files_only_for_the_daemons_own_user(tmp_path: Path) -> None:
    f = tmp_path / "shot.png"
    f.write_bytes(PNG)
    for url in (str(f), f"file://{f}"):
        assert image_bytes(url, own_user=True, param="p") == PNG
        with pytest.raises(BadRequest, match="own OS user"):
            image_bytes(url, own_user=False, param="p")
    with pytest.raises(BadRequest, match="cannot read the image file"):
        image_bytes(str(tmp_path / "missing.png"), own_user=True, param="p")
    with pytest.raises(BadRequest, match="absolute file path"):
        image_bytes("shot.png", own_user=True, param="p")


@pytest.mark.parametrize("url,why", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
    ("data:image/png;base64,", "empty"),
])
def test_bad_data_urls_are_refused_by_name(url: str, why: str) -> None:
    with pytest.raises(BadRequest, match=why) as exc:
        chat_images([{"role": "user", "content": [_part(url)]}], own_user=False)
    assert exc.value.param == "messages[0].content[0]"


def test_unknown_parts_are_named() -> None:
    with pytest.raises(BadRequest, match="'input_audio' is not supported"):
        chat_images([{"role": "user", "content": [_part(DATA_URL), {"type": "input_audio"}]}],
                    own_user=False)
