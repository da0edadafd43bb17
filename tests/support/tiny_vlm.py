"""Tiny random-weight vision-language checkpoints, converted by llama.cpp's own converter.

`convert_tiny_vlm(family, root)` writes a transformers checkpoint of the family (text and
vision config at a few dozen dimensions, weights drawn from a fixed seed with a spread
that makes every block matter) with a real tokenizer (built by transformers from one of
the catalog's GGUFs), then runs build 11434's `convert_hf_to_gguf.py` twice: `--mmproj`
for the projector (float32, so llama.cpp computes in float32 too) and once for the text
model (f16), which llama-mtmd-cli needs beside it. Needs torch, transformers and
sentencepiece (the converter imports it for Qwen2-VL), and llama.cpp's source tree.

transformers 5 writes Gemma's tokenizer as a BPE one, which the converter names
`granite-embed-multi-311m` (a Gemma 4 pre-tokenizer specd does not read); the gemma3 text
model takes the source GGUF's own SentencePiece tokenizer instead (the same ids), so
specd and llama.cpp tokenize its prompts alike.

Families: "gemma3" (Gemma3ForConditionalGeneration: SigLIP 56-pixel images of 4 × 4
patches pooled 2 × 2), "qwen25vl" (Qwen2_5_VLForConditionalGeneration: a depth-4 tower,
windows of 112 pixels as llama.cpp uses, every second block global).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from specd.daemon.benchmark.llama_cpp import root as llama_cpp_root
from specd.daemon.models.store import ModelStoreError, resolve_model

# the catalog models whose tokenizers the tiny checkpoints take (same ids, real vocabularies)
TOKENIZER_MODEL = {"gemma3": "gemma-3-270m", "qwen25vl": "qwen2.5-coder-0.5b-instruct"}
SEED = 53


@dataclass(frozen=True)
class TinyVlm:
    text: Path  # the text model GGUF
    mmproj: Path  # the projector GGUF


def converter() -> Path:
    return llama_cpp_root() / "src" / "llama.cpp" / "convert_hf_to_gguf.py"


def missing() -> str | None:
    """Why tiny VLMs cannot be made here (None: they can)."""
    for module in ("torch", "transformers", "sentencepiece"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (needed to make tiny VLM checkpoints)"
    if not converter().is_file():
        return f"llama.cpp's converter is not at {converter()}"
    for name in TOKENIZER_MODEL.values():
        try:
            tokenizer_source(name)
        except ModelStoreError as exc:
            return f"the tokenizer source {name} could not be had: {exc}"
    return None


def tokenizer_source(name: str) -> Path:
    """Catalog model `name` from the store, downloaded first where it is not there."""
    return resolve_model(name)


def _randomize(model: object, seed: int) -> None:
    """Every parameter drawn anew: N(0, 0.2²) for matrices, 1 + N(0, 0.1²) for norm
    weights and N(0, 0.1²) for biases (transformers zero-initializes some of them,
    e.g. Gemma 3's input projection, which would make the embeddings all zero)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # type: ignore[attr-defined]
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def _gemma3(folder: Path) -> None:
    import torch  # noqa: F401
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128,
                         vocab_size=262144, max_position_embeddings=4096, sliding_window=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=56, patch_size=14,
                           layer_norm_eps=1e-6, vision_use_head=False),
        mm_tokens_per_image=4, boi_token_index=255999, eoi_token_index=256000,
        image_token_index=262144)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    _randomize(model, SEED)
    model.save_pretrained(folder, safe_serialization=True)
    # transformers 5 writes the tower as vision_tower.*; released checkpoints (and the
    # converter) name it vision_tower.vision_model.*
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file({(f"vision_tower.vision_model.{k[len('vision_tower.'):]}"
                if k.startswith("vision_tower.") else k): v for k, v in tensors.items()},
              path, metadata={"format": "pt"})
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_seq_length": 4,
        "size": {"height": 56, "width": 56}}))


def _qwen25vl(folder: Path) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=151936,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=112, fullatt_block_indexes=[1, 3], out_hidden_size=64,
                           in_chans=3),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    _randomize(model, SEED)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 12845056}))


BUILDERS = {"gemma3": _gemma3, "qwen25vl": _qwen25vl}


def write_checkpoint(family: str, folder: Path) -> None:
    """The family's tiny checkpoint and tokenizer in `folder`."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    source = tokenizer_source(TOKENIZER_MODEL[family])
    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name
                                  ).save_pretrained(folder)
    BUILDERS[family](folder)


def convert(checkpoint: Path, out: Path, *, mmproj: bool, outtype: str) -> None:
    cmd = [sys.executable, str(converter()), str(checkpoint), "--outtype", outtype,
           "--outfile", str(out)] + (["--mmproj"] if mmproj else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {r.stderr[-2000:]}")


def take_tokenizer(path: Path, source: Path, keep: Sequence[str] = ()) -> None:
    """`path` rewritten with `source`'s tokenizer.ggml.* keys in place of its own, but for
    the keys `keep` names (a head's tokenizer.ggml.mask_token_id)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    def fields(r: GGUFReader, tokenizer: bool) -> list[tuple[str, object]]:
        """r's keys: the tokenizer's (less those kept), or all the others."""
        return [(name, f) for name, f in r.fields.items() if not name.startswith("GGUF.")
                and name != "general.architecture"
                and (name.startswith("tokenizer.ggml.") and name not in keep) == tokenizer]

    r, src = GGUFReader(path), GGUFReader(source)
    tmp = path.with_suffix(".tmp")
    w = GGUFWriter(tmp, str(r.fields["general.architecture"].contents()))
    for name, f in fields(r, False) + fields(src, True):
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None  # type: ignore[attr-defined]
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)  # type: ignore[attr-defined]
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)


def convert_tiny_vlm(family: str, root: Path, *, text: bool = True) -> TinyVlm:
    """root/<family>-text.gguf and root/<family>-mmproj.gguf from a fresh checkpoint
    (text=False: the projector only)."""
    checkpoint = root / f"{family}-hf"
    write_checkpoint(family, checkpoint)
    vlm = TinyVlm(root / f"{family}-text.gguf", root / f"{family}-mmproj.gguf")
    convert(checkpoint, vlm.mmproj, mmproj=True, outtype="f32")
    if text:
        convert(checkpoint, vlm.text, mmproj=False, outtype="f16")
        if family == "gemma3":
            take_tokenizer(vlm.text, tokenizer_source(TOKENIZER_MODEL[family]))
    return vlm


def cached_tiny_vlm(family: str) -> TinyVlm:
    """The family's tiny VLM, made once per machine: kept under the temp dir by this
    module's hash (a change here makes them anew)."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"specd-tiny-vlm-{digest}"
    vlm = TinyVlm(root / f"{family}-text.gguf", root / f"{family}-mmproj.gguf")
    if not (vlm.text.is_file() and vlm.mmproj.is_file()):
        scratch = Path(tempfile.mkdtemp(prefix="tiny-vlm-", dir=tempfile.gettempdir()))
        made = convert_tiny_vlm(family, scratch)
        root.mkdir(exist_ok=True)
        made.mmproj.replace(vlm.mmproj)
        made.text.replace(vlm.text)
    return vlm


def tiny_vlm_or_skip(family: str) -> TinyVlm:
    """The family's tiny VLM (cached_tiny_vlm); the calling test skips, saying why, where
    tiny VLMs cannot be made here (missing)."""
    why = missing()
    if why:
        pytest.skip(why)
    return cached_tiny_vlm(family)
