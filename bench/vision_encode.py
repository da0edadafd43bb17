#!/usr/bin/env python3
"""Images: specd's vision encoder beside llama.cpp's mtmd on the same files, and decode
after an image with and without speculation. One run each (a smoke figure: the lead
measures on a quiet machine).

    .venv/bin/python bench/vision_encode.py                        # the tiny test VLMs
    .venv/bin/python bench/vision_encode.py --text m.gguf --mmproj mmproj.gguf

Encode: for each image, specd's `prepare` + `encode` (after one warm-up encode), and
llama-mtmd-cli's own "batch encoding done in N ms" for the same file (its preprocessing
is outside that figure; specd's prepare is timed apart). Decode: a prompt holding the
image, greedy, target alone and with prompt lookup (`--spec ngram`) or any spec type the
engine takes; tokens per second of the generated tokens, and what was drafted.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from specd.daemon.serving.engine import Engine, EngineConfig
from specd.daemon.spec.drafter import DraftParams
from specd.daemon.spec.generation import GenerationParams
from specd.daemon.spec.media import MEDIA_MARKER
from specd.ort_models.vision import load_vision_encoder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

SIZES = ((100, 70), (300, 200), (640, 480))  # pixels (width, height)
CHAT_TEMPLATE = {"gemma3": "gemma"}  # llama-mtmd-cli's template where the file has none


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1) // 2
    buf = io.BytesIO()
    Image.fromarray((rgb + rng.integers(0, 128, rgb.shape)).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def encode_rows(text: Path, mmproj: Path, family: str) -> list[dict[str, object]]:
    """Per image size: specd's prepare and encode ms, llama-mtmd-cli's encode ms."""
    from llama_cpp_oracle import missing, mtmd_image_embeddings

    enc = load_vision_encoder(mmproj)
    enc.encode(enc.prepare(png(64, 64, 0)))  # warm-up: the session's first run
    rows = []
    for i, (w, h) in enumerate(SIZES):
        data = png(w, h, i)
        t0 = time.perf_counter()
        prepared = enc.prepare(data)
        t1 = time.perf_counter()
        out = enc.encode(prepared)  # [n_tokens, n_embd]
        t2 = time.perf_counter()
        row: dict[str, object] = {"family": family, "image": f"{w}x{h}",
                                  "tokens": int(out.shape[0]),
                                  "specd_prepare_ms": round(1e3 * (t1 - t0), 2),
                                  "specd_encode_ms": round(1e3 * (t2 - t1), 2)}
        if not missing("llama-mtmd-cli"):
            with tempfile.NamedTemporaryFile(suffix=".png") as f:
                f.write(data)
                f.flush()
                theirs = mtmd_image_embeddings(text, mmproj, Path(f.name),
                                               chat_template=CHAT_TEMPLATE.get(family, ""))
            row["mtmd_encode_ms"] = theirs.encode_ms
            if theirs.encode_ms:
                row["ratio_specd_over_mtmd"] = round(float(row["specd_encode_ms"])  # type: ignore[arg-type]
                                                     / theirs.encode_ms, 2)
        rows.append(row)
    return rows


def decode_rows(text: Path, mmproj: Path, spec: str, n: int) -> list[dict[str, object]]:
    """Greedy decode after an image, target alone and with `spec`."""
    rows = []
    prompt_text = f"Describe {MEDIA_MARKER} again and again: red blue red blue red blue"
    for spec_type in ("none", spec):
        engine = Engine(EngineConfig(target=str(text), mmproj=str(mmproj), spec_type=spec_type,
                                     n_ctx=1024, fetch=False))
        prompt, images = engine.image_prompt(prompt_text, [png(300, 200, 1)])
        gen = engine.start(0, prompt, GenerationParams(max_tokens=n, ignore_eos=True,
                                                       draft=DraftParams(n_max=4)),
                           images=images)
        t0 = time.perf_counter()
        out = gen.prefill()
        t1 = time.perf_counter()
        while not gen.done:
            out += gen.step()
        t2 = time.perf_counter()
        gen.close()
        s = gen.stats
        rows.append({"spec_type": spec_type, "prompt_tokens": len(prompt),
                     "prefill_s": round(t1 - t0, 3), "tokens": len(out),
                     "decode_tok_s": round((len(out) - 1) / max(t2 - t1, 1e-9), 1),
                     "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, help="text model GGUF (default: the tiny VLMs)")
    ap.add_argument("--mmproj", type=Path, help="its projector GGUF")
    ap.add_argument("--family", default="gemma3", help="label (and mtmd-cli's template)")
    ap.add_argument("--spec", default="ngram", help="the spec type decode is compared with")
    ap.add_argument("-n", type=int, default=64, help="tokens decoded after the image")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.text is not None and args.mmproj is not None:
        models = [(args.family, args.text, args.mmproj)]
    else:
        import tiny_vlm

        if why := tiny_vlm.missing():
            sys.exit(f"vision_encode: {why}")
        models = []
        for family in tiny_vlm.BUILDERS:
            vlm = tiny_vlm.cached_tiny_vlm(family)
            models.append((family, vlm.text, vlm.mmproj))
    report: dict[str, list[dict[str, object]]] = {"encode": [], "decode": []}
    for family, text, mmproj in models:
        report["encode"] += encode_rows(text, mmproj, family)
    # decode after an image: the first family specd's engine runs (Qwen2-VL's text
    # architecture with M-RoPE is not read yet)
    family, text, mmproj = models[0]
    report["decode"] += [{"family": family, **r}
                         for r in decode_rows(text, mmproj, args.spec, args.n)]
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for kind, rows in report.items():
        print(f"## {kind}")
        for r in rows:
            print("  " + ", ".join(f"{k}={v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
