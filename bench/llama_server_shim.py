#!/usr/bin/env python3
"""llama-server's command line, run as `specd serve`: for llama.cpp's own server tests
(tools/server/tests, unmodified) against specd.

    LLAMA_SERVER_BIN_PATH=bench/llama_server_shim.py pytest tools/server/tests/unit/...

The tests' models are mapped to specd's: every tiny test model (stories260K and the
like, an embedding model too) to SmolLM2-135M-Instruct, the infill model to
Qwen2.5-Coder-0.5B-Instruct; a router (no model given) serves three by the router tests'
names (ROUTER_MODELS), none loaded at start. Flags specd has no counterpart for are
dropped (the ones that change behaviour are listed in the report of the run:
bench/results/).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOL, QWEN_SMALL = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
# llama-server flag -> specd serve flag, for those taking one value
VALUED = {"--port": "--port", "--host": "--host", "--temp": "--temp", "--seed": "--seed",
          "--ctx-size": "-c", "-c": "-c", "--parallel": "--slots", "-np": "--slots",
          "--n-predict": "-n", "-n": "-n", "--threads": "-t", "-t": "-t",
          "--pooling": "--pooling", "--spec-draft-n-max": "--spec-draft-n-max",
          "--spec-draft-n-min": "--spec-draft-n-min", "--api-key": "--api-key",
          "--api-key-file": "--api-key-file", "--chat-template-file": "--chat-template-file",
          "--chat-template-kwargs": "--chat-template-kwargs", "--reasoning": "--reasoning",
          "-rea": "--reasoning", "--reasoning-format": "--reasoning-format",
          "--reasoning-budget": "--reasoning-budget",
          "--reasoning-budget-message": "--reasoning-budget-message",
          "--spec-synth-rates": "--spec-synthetic-rates",
          "--spec-synth-len": "--spec-synthetic-mean", "--alias": "--alias", "-a": "--alias",
          "--tags": "--tags", "--batch-size": "-b", "-b": "-b",
          "--sleep-idle-seconds": "--keep-alive", "--models-max": "--models-max",
          "--models-preset": "--models-preset"}
FLAGS = {"--embedding": "--embeddings", "--embeddings": "--embeddings",
         "--no-models-autoload": "--no-models-autoload"}
# llama-server's router mode (no model given) serves the models of its cache by name, none
# loaded at start; the router tests' three, each mapped to a model of specd's catalog
ROUTER_MODELS = {"ggml-org/tinygemma3-GGUF:Q8_0": "gemma-3-270m",
                 "ggml-org/test-model-stories260K:F32": SMOL,
                 "ggml-org/test-model-stories260K-infill:F32": QWEN_SMALL}
# llama-server flags that take a value and have no specd counterpart
DROPPED_VALUED = {"--ubatch-size", "-ub", "--n-gpu-layers", "-ngl", "-ctk", "-ctv", "-fa",
                  "--grp-attn-n", "--grp-attn-w",
                  "--slot-save-path", "--chat-template", "--mmproj-url",
                  "--media-path", "--cache-ram", "--models-dir",
                  "--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json",
                  "--lora", "--model-url"}


def model_for(repo: str | None, hf_file: str | None, model: str | None) -> str:
    """The specd model standing in for the test's."""
    name = f"{repo or ''}/{hf_file or ''}/{model or ''}".lower()
    return QWEN_SMALL if "infill" in name or "qwen" in name else SMOL


def tiny_vlm(repo: str | None) -> tuple[str, str] | None:
    """The tiny gemma3 VLM's text model and mmproj (tests/support/tiny_vlm.py, made by
    the test suite) standing in for tinygemma3, where one is made (None: none)."""
    if "gemma3" not in (repo or "").lower():
        return None
    made = sorted(Path(tempfile.gettempdir()).glob("specd-tiny-vlm-*/gemma3-text.gguf"),
                  key=lambda p: p.stat().st_mtime)
    if not made:
        return None
    return str(made[-1]), str(made[-1].with_name("gemma3-mmproj.gguf"))


def translate(argv: list[str]) -> list[str]:
    out: list[str] = []
    repo = hf_file = model = draft = None
    spec_type = None
    i = 0
    while i < len(argv):
        a = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if a in ("--n-predict", "-n") and value is not None and int(value) < 0:
            i += 2  # -1 (no limit): specd serve's own default -n stands for it
            continue
        if a == "--cors-origins" and value is not None:  # comma-separated: one flag each
            for origin in value.split(","):
                out += ["--allow-origin", origin.strip()]
            i += 2
            continue
        if a in VALUED:
            out += [VALUED[a], str(value)]
            i += 2
            continue
        if a in ("--hf-repo", "-hf", "-hfr"):
            repo = value
        elif a == "--hf-file":
            hf_file = value
        elif a in ("--model", "-m"):
            model = value
        elif a in ("--model-draft", "-md"):
            draft = value
        elif a == "--spec-type":
            spec_type = value
        elif a in FLAGS:
            out.append(FLAGS[a])
            i += 1
            continue
        elif a not in DROPPED_VALUED:
            i += 1  # a flag without a value (--jinja, --no-slots, --metrics, ...): dropped
            continue
        i += 2
    # llama-server's --ctx-size is shared by its --parallel slots; specd's -c is each's
    if "-c" in out and "--slots" in out:
        at = out.index("-c") + 1
        out[at] = str(max(int(out[at]) // int(out[out.index("--slots") + 1]), 1))
    vlm = tiny_vlm(repo)
    if repo is None and hf_file is None and model is None:  # the router
        (first, first_ref), *others = ROUTER_MODELS.items()
        out += ["-m", first_ref, "--alias", first, "--start-unloaded", "--strict-model-name",
                *(a for name, ref in others for a in ("--models", f"{name}={ref}"))]
    elif vlm:
        out += ["-m", vlm[0], "-mm", vlm[1]]
    else:
        out += ["-m", model_for(repo, hf_file, model)]
    if "--spec-synthetic-rates" in out or "--spec-synthetic-mean" in out:
        # llama.cpp's synthetic acceptance rides on its draft; specd's is a spec type of
        # its own, needing no draft model
        draft, spec_type = None, "synthetic"
    if draft is not None:
        out += ["-md", model_for(None, None, draft)]
    if spec_type is not None:  # llama.cpp's names where specd has the same thing
        out += ["--spec-type", {"draft-simple": "draft", "ngram-simple": "ngram"}.get(
            spec_type, spec_type if spec_type in ("none", "draft", "ngram", "synthetic")
            else "ngram")]
    # llama-server serves the models it is given, not specd's store
    return ["serve", "--no-socket", "--no-fit", "--no-store-models", *out]


def main() -> None:
    args = translate(sys.argv[1:])
    os.environ.setdefault("SPECD_STATE_DIR", tempfile.mkdtemp(prefix="specd-shim-"))
    specd = ROOT / ".venv" / "bin" / "specd"
    print("llama_server_shim: specd " + " ".join(args), file=sys.stderr, flush=True)
    os.execv(str(specd), [str(specd), *args])


if __name__ == "__main__":
    main()
