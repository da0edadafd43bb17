"""llama-server's model presets (`--models-preset FILE`): an INI file, one section per
model name, its keys llama-server's arguments without their dashes (long or short
forms, or their LLAMA_ARG_* environment names), `[*]` holding what every section
inherits. Each section becomes a model served by its name (served_models.ModelPreset):
the model of its `model` or `hf-repo` key (an `hf-repo` is looked up among the names the
daemon serves, as llama-server finds it in its cache), and the options it gives over
the daemon's defaults, as `specd serve` flags.

A key specd has no counterpart for is ignored with a warning naming it; a key
llama-server does not know either is an error, as it is there. The preset-only keys
`dedup-cache-models` and `load-on-startup` are kept; `stop-timeout` is ignored (specd
unloads a model once its requests end, and never cuts them).
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specd.daemon.serving.served_models import ModelPreset

log = logging.getLogger("specd.serving")

GLOBAL_SECTION, DEFAULT_SECTION = "*", "default"
TRUTHY, FALSEY = {"on", "enabled", "true", "1"}, {"off", "disabled", "false", "0"}
_HEADER = re.compile(r"\[\s*([^\]]+?)\s*\]\s*(?:[;#].*)?")
_KEY_VALUE = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)\s*=\s*(.*)")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


class PresetError(ValueError):
    """A preset file that cannot be read: the message names the file and line."""


@dataclass(frozen=True)
class PresetKey:
    """What one llama-server argument does in a preset: `flag`, the `specd serve` flag
    it becomes, or `field`, the model key it is (the model, its draft, its aliases);
    whether it is a switch (a boolean value: the flag or nothing); `values`,
    llama-server's names for values specd names otherwise."""

    flag: str | None = None
    field: str | None = None
    switch: bool = False
    values: tuple[tuple[str, str], ...] = ()


def _keys(*names: str, flag: str | None = None, field: str | None = None,
          switch: bool = False, values: tuple[tuple[str, str], ...] = ()
          ) -> dict[str, PresetKey]:
    return dict.fromkeys(names, PresetKey(flag, field, switch, values))


# llama-server's arguments with a specd counterpart, by every name a preset may use
PRESET_KEYS: dict[str, PresetKey] = {
    **_keys("model", "m", "LLAMA_ARG_MODEL", field="model"),
    **_keys("hf-repo", "hf", "hfr", "LLAMA_ARG_HF_REPO", field="repo"),
    **_keys("model-draft", "md", "spec-draft-model", "LLAMA_ARG_SPEC_DRAFT_MODEL",
            "LLAMA_ARG_MODEL_DRAFT", field="draft"),
    **_keys("spec-draft-hf", "hf-repo-draft", "hfd", "hfrd", "LLAMA_ARG_SPEC_DRAFT_HF_REPO",
            "LLAMA_ARG_HFD_REPO", field="draft_repo"),
    **_keys("alias", "a", "LLAMA_ARG_ALIAS", field="aliases"),
    **_keys("mmproj", "mm", "LLAMA_ARG_MMPROJ", flag="--mmproj"),
    **_keys("tags", "LLAMA_ARG_TAGS", flag="--tags"),
    **_keys("ctx-size", "c", "LLAMA_ARG_CTX_SIZE", flag="--ctx-size"),
    **_keys("parallel", "np", "LLAMA_ARG_N_PARALLEL", flag="--slots"),
    **_keys("n-predict", "n", "predict", "LLAMA_ARG_N_PREDICT", flag="--max-tokens"),
    **_keys("threads", "t", "LLAMA_ARG_THREADS", flag="--threads"),
    **_keys("batch-size", "b", "LLAMA_ARG_BATCH", flag="--batch-size"),
    **_keys("temp", "temperature", flag="--temp"),
    **_keys("top-k", flag="--top-k"),
    **_keys("top-p", flag="--top-p"),
    **_keys("min-p", flag="--min-p"),
    **_keys("repeat-penalty", flag="--repeat-penalty"),
    **_keys("seed", "s", flag="--seed"),
    **_keys("spec-type", "LLAMA_ARG_SPEC_TYPE", flag="--spec-type",
            values=(("draft-simple", "draft"), ("ngram-simple", "ngram"))),
    **_keys("spec-draft-n-max", "draft-max", "draft", "draft-n", "LLAMA_ARG_DRAFT_MAX",
            flag="--spec-draft-n-max"),
    **_keys("spec-draft-n-min", "draft-min", "draft-n-min", "LLAMA_ARG_DRAFT_MIN",
            flag="--spec-draft-n-min"),
    **_keys("spec-draft-p-min", "draft-p-min", "LLAMA_ARG_DRAFT_P_MIN",
            flag="--spec-draft-p-min"),
    **_keys("chat-template-file", "LLAMA_ARG_CHAT_TEMPLATE_FILE", flag="--chat-template-file"),
    **_keys("chat-template-kwargs", "LLAMA_CHAT_TEMPLATE_KWARGS",
            flag="--chat-template-kwargs"),
    **_keys("reasoning", "rea", "LLAMA_ARG_REASONING", flag="--reasoning"),
    **_keys("pooling", "LLAMA_ARG_POOLING", flag="--pooling"),
    **_keys("embedding", "embeddings", "LLAMA_ARG_EMBEDDINGS", flag="--embeddings",
            switch=True),
    **_keys("sleep-idle-seconds", flag="--keep-alive"),
}
# llama-server's preset-only keys (not arguments)
DEDUP_KEY, LOAD_ON_STARTUP_KEY, STOP_TIMEOUT_KEY = (
    "dedup-cache-models", "load-on-startup", "stop-timeout")
# what the router itself sets: llama-server drops these from a preset, and so does specd
ROUTER_KEYS = frozenset({
    "host", "port", "api-key", "api-key-file", "ssl-key-file", "ssl-cert-file", "models-dir",
    "models-max", "models-preset", "models-autoload", "no-models-autoload", "hf-file",
    "hff", "LLAMA_ARG_HF_FILE", "hf-token", "hft"})
# llama-server's arguments specd has no counterpart for: a preset's are ignored, warned of
UNSUPPORTED_KEYS = frozenset({
    "n-gpu-layers", "ngl", "gpu-layers", "mmap", "no-mmap", "mlock", "flash-attn", "fa",
    "ubatch-size", "ub", "cache-type-k", "ctk", "cache-type-v", "ctv", "kv-unified", "kvu",
    "no-kv-unified", "jinja", "no-jinja", "cont-batching", "cb", "no-cont-batching",
    "threads-batch", "tb", "cache-ram", "cram", "cache-reuse", "swa-full", "split-mode",
    "sm", "tensor-split", "ts", "main-gpu", "mg", "device", "dev", "numa", "rope-scaling",
    "rope-scale", "rope-freq-base", "rope-freq-scale", "yarn-orig-ctx", "yarn-ext-factor",
    "yarn-attn-factor", "yarn-beta-slow", "yarn-beta-fast", "chat-template", "cpu-moe",
    "cmoe", "n-cpu-moe", "ncmoe", "override-tensor", "ot", "lora", "lora-scaled",
    "warmup", "no-warmup", "metrics", "slots", "no-slots", "props", "webui", "no-webui",
    "timeout", "to", "threads-http", "ctx-checkpoints", "context-shift",
    "no-context-shift", "defrag-thold", "dt", "keep", "reasoning-format",
    "reasoning-budget", "spec-default", "n-gpu-layers-draft", "ngld", "ctx-size-draft",
    "cd", "device-draft", "devd", "cache-type-k-draft", "cache-type-v-draft",
    "slot-save-path", "media-path", "verbose", "log-verbose", "v", "log-file",
    "log-colors", "log-prefix", "log-timestamps", "verbosity", "lv", "offline",
    "no-op-offload", "op-offload", "repack", "no-repack", "check-tensors", "no-host",
    "direct-io", "mmproj-offload", "no-mmproj-offload", "image-min-tokens",
    "image-max-tokens", "cache-prompt", "no-cache-prompt", "slot-prompt-similarity",
    "sps", "tools", "mcp-servers-config", "ignore-eos", "grammar", "grammar-file",
    "json-schema", "samplers", "sampling-seq", "dry-multiplier", "dry-base",
    "dry-allowed-length", "dry-penalty-last-n", "xtc-probability", "xtc-threshold",
    "typical", "top-nsigma", "presence-penalty", "frequency-penalty", "repeat-last-n",
    "mirostat", "mirostat-lr", "mirostat-ent", "dynatemp-range", "dynatemp-exp",
    "n-probs", "min-keep", "backend-sampling"})


def _location(path: Path, line: int) -> str:
    return f"{path}:{line}"


def canonical_section(name: str) -> str:
    """A section's model name as llama-server keys it: `repo:q8_0` is `repo:Q8_0` (a
    tag's last `-`/`.` part, upper-cased)."""
    if name in (GLOBAL_SECTION, DEFAULT_SECTION) or ":" not in name:
        return name
    head, _, tag = name.rpartition(":")
    m = _TAG.search(tag)
    return f"{head}:{(m.group(1) if m else tag).upper()}"


def parse_ini(path: Path) -> dict[str, dict[str, tuple[str, int]]]:
    """The file's sections, each key's value and the line it is on (llama-server's
    INI: `[name]` headers, `key = value` lines, `;` / `#` comments, also after a value;
    keys before any header belong to a section named "default"; a section given twice
    is the later one). PresetError naming the file and line where a line is none of
    these."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PresetError(f"--models-preset: preset file does not exist: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PresetError(f"--models-preset: cannot read {path}: {exc}") from None
    sections: dict[str, dict[str, tuple[str, int]]] = {DEFAULT_SECTION: {}}
    current = DEFAULT_SECTION
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if header := _HEADER.fullmatch(line):
            current = header.group(1)
            if current in sections and current != DEFAULT_SECTION:
                log.warning("%s: section [%s] given again: the earlier one is replaced",
                            _location(path, number), current)
            sections[current] = {}
            continue
        if pair := _KEY_VALUE.fullmatch(line):
            value = re.split(r"[;#]", pair.group(2), maxsplit=1)[0].rstrip()
            sections[current][pair.group(1)] = (value, number)
            continue
        raise PresetError(f"{_location(path, number)}: not a [section] header, a key = "
                          f"value line or a comment: {raw.strip()!r}")
    return sections


def _switch(value: str, where: str, key: str) -> bool:
    if value.lower() in TRUTHY:
        return True
    if value.lower() in FALSEY:
        return False
    raise PresetError(f"{where}: {key} = {value!r}: expected on/off, true/false or 1/0")


def _key_name(key: str) -> str:
    """A key as PRESET_KEYS and the lists name it: an unknown LLAMA_ARG_* environment
    name as its argument (LLAMA_ARG_N_GPU_LAYERS: n-gpu-layers)."""
    if key in PRESET_KEYS or not key.startswith("LLAMA_ARG_"):
        return key
    return key.removeprefix("LLAMA_ARG_").lower().replace("_", "-")


@dataclass
class _Section:
    """One section being read: its model keys, its flags and its preset-only keys."""

    model: str | None = None
    repo: str | None = None
    draft: str | None = None
    draft_repo: str | None = None
    aliases: tuple[str, ...] = ()
    dedup: bool = False
    load_on_startup: bool = False


def _read_section(name: str, entries: dict[str, tuple[str, int]], path: Path,
                  section: _Section, flags: dict[str, list[str]]) -> None:
    """Apply one section's keys to `section` and `flags` (specd serve's flag -> its
    tokens), warning of those ignored; PresetError naming the file and line of a key
    llama-server does not know or a value that is not what the key takes."""
    for key, (value, number) in entries.items():
        where = _location(path, number)
        name_of = _key_name(key)
        if key == "version":  # reserved by llama-server for the file's format
            continue
        if name_of == DEDUP_KEY:
            section.dedup = _switch(value, where, key)
        elif name_of == LOAD_ON_STARTUP_KEY:
            section.load_on_startup = _switch(value, where, key)
        elif name_of == STOP_TIMEOUT_KEY:
            log.info("%s: %s ignored: specd unloads a model once its requests end", where,
                     key)
        elif name_of in ROUTER_KEYS:
            log.warning("%s: %s ignored in a preset: the router sets it", where, key)
        elif name_of in UNSUPPORTED_KEYS or (key.startswith("LLAMA_")
                                            and name_of not in PRESET_KEYS):
            log.warning("%s: %s ignored: specd has no counterpart for it", where, key)
        elif (known := PRESET_KEYS.get(name_of)) is None:
            raise PresetError(f"{where}: option {key!r} not recognized in preset {name!r}")
        elif not value and not known.switch:
            raise PresetError(f"{where}: {key} has no value")
        elif known.field == "aliases":
            section.aliases = tuple(sorted({a.strip() for a in value.split(",")
                                            if a.strip()}))
        elif known.field is not None:
            setattr(section, known.field, value)
        elif known.switch:
            assert known.flag is not None
            flags[known.flag] = [known.flag] if _switch(value, where, key) else []
        elif known.flag == "--max-tokens" and value.startswith("-"):
            flags.pop(known.flag, None)  # llama-server's -1: no limit of its own
        else:
            assert known.flag is not None
            flags[known.flag] = [known.flag, dict(known.values).get(value, value)]


def read_presets(path: Path, check: Callable[[list[str]], argparse.Namespace]
                 ) -> list[ModelPreset]:
    """The models of preset file `path`, each section over `[*]`'s keys; `check` parses
    a section's `specd serve` flags (its errors, as PresetError, name the section)."""
    sections = parse_ini(path)
    flags_of_all: dict[str, list[str]] = {}
    common = _Section()
    _read_section(GLOBAL_SECTION, sections.pop(GLOBAL_SECTION, {}), path, common,
                  flags_of_all)
    if not sections[DEFAULT_SECTION].keys() - {"version"}:  # keys before any header
        del sections[DEFAULT_SECTION]
    presets = []
    for raw_name, entries in sections.items():
        name = canonical_section(raw_name)
        section = _Section(**vars(common))
        flags = dict(flags_of_all)
        _read_section(name, entries, path, section, flags)
        tokens = [t for given in flags.values() for t in given]
        try:
            check(tokens)
        except (ValueError, argparse.ArgumentError) as exc:
            raise PresetError(f"{path}: preset [{name}]: {exc}") from None
        presets.append(ModelPreset(
            name=name, model=section.model or section.repo,
            by_name=section.model is None and section.repo is not None,
            draft=section.draft or section.draft_repo,
            draft_by_name=section.draft is None and section.draft_repo is not None,
            aliases=section.aliases,
            flags=tuple(tokens), dedup=section.dedup,
            load_on_startup=section.load_on_startup))
    return presets
