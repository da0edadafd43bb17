"""The user config file (`config_dir()/config.toml`): defaults for `specd start` and the service.

Only a few flat keys; `SPECD_<KEY>` environment variables override the file
(e.g. `SPECD_PORT=0 specd start`).  Read with tomllib, written with a tiny writer. A
list key (a repeatable option of serve's) is an array in the file, and comma-separated
from `specd config set` and the environment.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from specd.ort_models.paths import config_dir

# key -> type; every key is also the argparse `dest` of the matching `specd serve` option
KEYS: dict[str, type] = {
    "model": str,
    "draft": str,
    "spec_type": str,
    "host": str,
    "port": int,
    "slots": int,
    "n_ctx": int,
    "threads": int,
    "keep_alive": str,  # a duration: seconds, or such as "5m" (serve's --keep-alive)
    "history": bool,  # speculation from each user's history (false: serve's --no-history)
    "history_file": str,  # serve's --history-file: a 0600 file under the state dir
    "upstream": list,  # serve's --upstream NAME=URL, one per model forwarded
    "upstream_token_file": list,  # serve's --upstream-token-file NAME=PATH (PATH absolute)
}
ConfigValue = str | int | bool | list[str]
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")

# parallel sequences `specd serve` starts and `specd fit` plans, unless --slots says
DEFAULT_SLOTS = 2
# the values `specd serve` accepts for them (checked when set, not at the next start)
RANGES: dict[str, tuple[int, int | None]] = {"port": (0, 65535), "slots": (1, 64),
                                             "n_ctx": (1, None), "threads": (1, None)}

_HEADER = ("# specd configuration: defaults for `specd start` and the user service.\n"
           "# Keys: " + ", ".join(KEYS) + ". SPECD_<KEY> environment variables override.\n")


class ConfigError(ValueError):
    pass


def config_path() -> Path:
    return config_dir() / "config.toml"


def coerce(key: str, value: Any) -> ConfigValue:
    """`value` (str from the CLI/env, or a TOML value) as the key's type."""
    if key not in KEYS:
        raise ConfigError(f"unknown config key {key!r} (known: {', '.join(KEYS)})")
    typ = KEYS[key]
    if typ is list:
        return _list_value(key, value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in _TRUE + _FALSE:
            return word in _TRUE
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, not {value!r}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be an integer, not {value!r}") from None
        lo, hi = RANGES.get(key, (None, None))
        if lo is not None and number < lo or hi is not None and number > hi:
            raise ConfigError(f"{key} must be at least {lo}"
                              + (f" and at most {hi}" if hi is not None else "")
                              + f", not {number}")
        return number
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, not {value!r}")
    if key == "keep_alive":
        from specd.daemon.serving.durations import parse_duration

        try:
            parse_duration(value)
        except ValueError as exc:
            raise ConfigError(f"keep_alive: {exc}") from None
    if key == "spec_type":
        from specd.daemon.drafters.registry import SPEC_TYPES

        if value not in SPEC_TYPES:
            raise ConfigError(f"spec_type must be one of {', '.join(SPEC_TYPES)}, "
                              f"not {value!r}")
    return value


def _list_value(key: str, value: Any) -> list[str]:
    """A list key's entries (from a comma-separated string, or a TOML array), each
    checked as serve checks it: --upstream's NAME=URL, --upstream-token-file's NAME=PATH
    with PATH made absolute (the daemon runs in the state dir)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{key} must be a list of strings, not {value!r}")
    out = [v.strip() for v in items if v.strip()]
    if key == "upstream":
        from specd.daemon.serving.upstream import UpstreamSpec

        try:
            names = [UpstreamSpec.parse(v).name for v in out]
        except ValueError as exc:
            raise ConfigError(f"upstream: {exc}") from None
        if len(set(names)) < len(names):
            raise ConfigError("upstream: a NAME is given twice")
    if key == "upstream_token_file":
        for i, v in enumerate(out):
            name, sep, path = v.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"upstream_token_file: {v!r}: expected NAME=PATH")
            out[i] = f"{name.strip()}={Path(path.strip()).expanduser().absolute()}"
    return out


def read_file(path: Path | None = None) -> dict[str, ConfigValue]:
    """The file's values only (no env overrides); {} when there is no file."""
    path = path or config_path()
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        return {k: coerce(k, v) for k, v in raw.items()}
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def env_overrides() -> dict[str, ConfigValue]:
    out: dict[str, ConfigValue] = {}
    for key in KEYS:
        value = os.environ.get(f"SPECD_{key.upper()}")
        if value is not None and value != "":
            try:
                out[key] = coerce(key, value)
            except ConfigError as exc:
                raise ConfigError(f"SPECD_{key.upper()}: {exc}") from None
    return out


def load_config(path: Path | None = None) -> dict[str, ConfigValue]:
    """The file's values with `SPECD_<KEY>` environment overrides applied."""
    return {**read_file(path), **env_overrides()}


def _toml_value(value: ConfigValue) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    escaped = (value.replace("\\", "\\\\").replace('"', '\\"')
               .replace("\n", "\\n").replace("\t", "\\t"))
    return f'"{escaped}"'


def dumps(values: dict[str, ConfigValue]) -> str:
    body = "".join(f"{k} = {_toml_value(values[k])}\n" for k in KEYS if k in values)
    return _HEADER + body


def write_file(values: dict[str, ConfigValue], path: Path | None = None) -> Path:
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(dumps(values), encoding="utf-8")
    os.replace(tmp, path)
    return path


def set_value(key: str, value: ConfigValue | None, path: Path | None = None) -> Path:
    """Set (or with value None / "", remove) one key in the file; returns the file's path."""
    values = read_file(path)
    if value is None or value == "":
        if key not in KEYS:
            coerce(key, "")  # raises the unknown-key error
        values.pop(key, None)
    elif (coerced := coerce(key, value)) == []:  # an empty list: the key removed
        values.pop(key, None)
    else:
        values[key] = coerced
    return write_file(values, path)
