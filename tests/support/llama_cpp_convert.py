"""llama.cpp's own converter (convert_hf_to_gguf.py at the build specd follows) on tiny
Hugging Face checkpoints, so that specd reads files llama.cpp itself wrote. It needs the
llama.cpp source (specd.daemon.benchmark.llama_cpp's tree) and torch + transformers in
this interpreter; `missing()` says why it cannot run (tests skip with that reason).

One change to the converter, in its process only: the tokenizer's pre-tokenizer is named
"qwen2" outright, since the converter recognises one by hashing a real model's
tokenization and the tiny tokenizer (`write_tokenizer`) is none of those; it changes only
the `tokenizer.ggml.pre` string (tests/fixtures/make_head_fixtures.py does the same).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from specd.daemon.benchmark.llama_cpp import root

from tiny_gguf import SPECIAL_TOKENS, build_vocab

_RUN = """
import runpy, sys
sys.path[:0] = [sys.argv[1] + "/gguf-py", sys.argv[1]]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""


def source() -> Path:
    """The llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/)."""
    return root() / "src" / "llama.cpp"


def missing() -> str | None:
    """Why the converter cannot run here (None: it can)."""
    for module in ("torch", "transformers", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (llama.cpp's converter needs it)"
    if not (source() / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's source is not at {source()} (python -m specd.daemon.benchmark." \
               "llama_cpp fetches it)"
    return None


def write_tokenizer(folder: Path, *, extra_specials: tuple[str, ...] = (),
                    chat_template: str | None = None) -> int:
    """tokenizer.json and tokenizer_config.json with tiny_gguf's qwen vocabulary (its byte
    tokens and merges; the converter adds the padding rows itself) and `extra_specials`
    after its special tokens; returns the number of tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    voc = build_vocab("qwen3")
    real = [t for t in voc.tokens if not t.startswith("[PAD")]
    vocab = {t: i for i, t in enumerate(real) if t not in SPECIAL_TOKENS}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in voc.merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra_specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def convert(model: Path, out: Path, *, outtype: str = "f32",
            target_model_dir: Path | None = None, mmproj: bool = False) -> Path:
    """`model` (a Hugging Face folder) converted by llama.cpp into `out` (mmproj: its
    vision projector); RuntimeError with the converter's output where it fails."""
    args = [str(model), "--outtype", outtype, "--outfile", str(out)]
    if mmproj:
        args.append("--mmproj")
    if target_model_dir is not None:
        args += ["--target-model-dir", str(target_model_dir)]
    r = subprocess.run([sys.executable, "-c", _RUN, str(source()), *args],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py exited {r.returncode}: "
                           f"{(r.stdout + r.stderr)[-3000:]}")
    return out
