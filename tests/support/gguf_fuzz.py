"""A seeded fuzzer for specd's GGUF loading: mutants of a GGUF file's header, and what
specd does with each.

A mutant is one mutation of a base file (a tiny model written by `tiny_gguf.py`, or a real
model such as SmolLM2), drawn from a generator seeded by (seed, base, index), so a
mutant is the same on every run. The mutations work on the header as parsed here (from
the GGUF spec, independently of specd's reader): a count, length, value type, metadata
value, tensor dimension, type or offset set to a value a fuzzer likes (0, 1, powers of
two and their neighbours, the largest values, NaN, ...); bytes of a string changed; bits
flipped; bytes inserted or deleted; tensor names swapped; a metadata entry dropped or
repeated; a `general.alignment` key added; the file cut short.

Each mutant goes the daemon's way: `GGUFFile`, the tokenizer, `validate_gguf` (on the
mutant's header over a sparse hole: they read no tensor data); where the base is built,
a mutant they all accept is written out whole, built with the target's options and run
(a prompt and one step). Outcomes:

* `rejected`: a GGUFError, or the tokenizer's ValueError, of one line (a GGUFError
  naming the file);
* `accepted`: built and run with finite logits (for bases not built: accepted unbuilt);
* failures: `crash` (any other exception, or the worker process dying), `unclear` (a
  rejection of more than one line, or a GGUFError not naming the file), `nan` (logits
  not finite), `hang` (over the time limit), `memory` (peak RSS grew past the limit).

Mutants run in a worker process (`python gguf_fuzz.py worker ...`, one JSON line per
mutant) under an address-space limit; `fuzz` restarts it after a hang or a death.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# ------------------------------------------------------------------------- the base file

_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q",
               11: "q", 12: "d"}
_FLOAT_FMTS = ("f", "d")
HEADER_LIMIT = 64 << 20  # a real model's header (vocabulary included) fits in this


@dataclass(frozen=True)
class Field:
    """One value in the header: where, its struct format, what it is, whose it is."""

    at: int
    fmt: str
    role: str
    label: str


@dataclass
class Base:
    """A valid GGUF file, parsed: its header bytes, fields and entries."""

    path: Path
    build: bool  # accepted mutants are built and run
    header: bytes  # bytes before the data section, without the padding
    data_start: int
    size: int
    align: int
    fields: dict[str, list[Field]] = field(default_factory=dict)  # by role
    kvs: list[tuple[str, int, int]] = field(default_factory=list)  # key, start, end
    infos: list[tuple[str, int, int]] = field(default_factory=list)  # tensor, start, end
    n_kv_at: int = 16
    n_tensors_at: int = 8

    def add(self, f: Field) -> None:
        self.fields.setdefault(f.role, []).append(f)


def parse_base(path: str | os.PathLike[str], build: bool) -> Base:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        blob = fh.read(min(size, HEADER_LIMIT))
    base = Base(path, build, b"", 0, size, 32)
    pos = 0

    def read(fmt: str, role: str, label: str) -> Any:
        nonlocal pos
        base.add(Field(pos, fmt, role, label))
        value = struct.unpack_from("<" + fmt, blob, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def read_str(role: str, label: str) -> str:
        nonlocal pos
        n = read("Q", role + "_len", label)
        text = blob[pos:pos + n].decode("utf-8", "replace")
        if n:
            base.add(Field(pos, f"{n}s", role + "_bytes", label or text))
        pos += n
        return text

    assert blob[:4] == b"GGUF"
    pos = 4
    read("I", "version", "")
    n_tensors = read("Q", "count", "n_tensors")
    n_kv = read("Q", "count", "n_kv")
    align = 32
    for _ in range(n_kv):
        start = pos
        key = read_str("key", "")
        vtype = read("I", "vtype", key)
        if vtype == 8:
            read_str("value_str", key)
        elif vtype == 9:
            etype = read("I", "arr_type", key)
            count = read("Q", "arr_count", key)
            for _ in range(count):
                if etype == 8:
                    read_str("arr_str", key)
                else:
                    read(_SCALAR_FMT[etype], "arr_item", key)
        else:
            fmt = _SCALAR_FMT[vtype]
            value = read(fmt, "value_float" if fmt in _FLOAT_FMTS else "value_int", key)
            if key == "general.alignment":
                align = value
        base.kvs.append((key, start, pos))
    for _ in range(n_tensors):
        start = pos
        name = read_str("tname", "")
        n_dims = read("I", "n_dims", name)
        for _ in range(n_dims):
            read("Q", "dim", name)
        read("I", "ggml_type", name)
        read("Q", "offset", name)
        base.infos.append((name, start, pos))
    base.header, base.align = blob[:pos], align
    base.data_start = -(-pos // align) * align
    return base


# ------------------------------------------------------------------------- mutations

_INTERESTING = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 63, 64, 255, 256, 1023, 1024, 4096,
                65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1,
                2**63, 2**64 - 1)
_FLOATS = (0.0, -0.0, -1.0, 1.0, math.nan, math.inf, -math.inf, 1e-45, 1e-30, 1e30, 3.4e38)
# integer hyper-parameters and ids: the keys whose values the loader reads as counts
_HPARAM_SUFFIXES = ("block_count", "context_length", "embedding_length",
                    "feed_forward_length", "head_count", "head_count_kv", "key_length",
                    "value_length", "dimension_count", "vocab_size", "_token_id",
                    "sliding_window")
# how often each mutation is drawn (field roles, then whole-header operations)
WEIGHTS: dict[str, float] = {
    "count": 3, "version": 1, "key_len": 2, "key_bytes": 3, "vtype": 4, "value_int": 6,
    "hparam": 16, "value_float": 5, "value_str_len": 2, "value_str_bytes": 3, "arr_type": 3,
    "arr_count": 5, "arr_item": 2, "arr_str_len": 3, "arr_str_bytes": 7, "tname_len": 2,
    "tname_bytes": 3, "n_dims": 3, "dim": 10, "ggml_type": 8, "offset": 8,
    "bitflip": 6, "random_bytes": 3, "truncate": 4, "insert": 2, "delete": 2,
    "swap_names": 4, "drop_kv": 3, "dup_kv": 2, "add_alignment": 5, "overlap": 3,
}


@dataclass
class Mutant:
    what: str  # the mutation, for the report
    header: bytes
    cut: int | None = None  # the file's size, where it was cut short
    align: int | None = None  # the padding before the data, where the header changed size


def _pack(fmt: str, value: Any) -> bytes:
    if fmt in _FLOAT_FMTS:
        return struct.pack("<" + fmt, float(value))
    bits = struct.calcsize(fmt) * 8
    value = int(value) & ((1 << bits) - 1)
    if fmt.islower() and value >= 1 << (bits - 1):  # signed: wrap around
        value -= 1 << bits
    return struct.pack("<" + fmt, value)


def _int_value(rng: np.random.Generator, orig: int, fmt: str) -> int:
    bits = struct.calcsize(fmt) * 8
    near = [orig + 1, orig - 1, orig + 32, orig - 32, orig * 2, orig // 2, orig * 1000,
            int(rng.integers(0, 1 << min(bits, 62)))]
    pool = list(_INTERESTING) + near
    return int(pool[rng.integers(len(pool))])


def _set(header: bytearray, f: Field, value: Any) -> str:
    header[f.at:f.at + struct.calcsize(f.fmt)] = _pack(f.fmt, value)
    return f"{f.role} {f.label!r} := {value!r}"


def _mutate_field(rng: np.random.Generator, base: Base, h: bytearray, role: str) -> str:
    pool = base.fields[role]
    if role == "hparam":
        pool = base.fields["value_int"]
    f = pool[int(rng.integers(len(pool)))]
    if f.role.endswith("_bytes"):
        n = int(f.fmt[:-1])
        picks = (0x00, 0x20, 0xFF, 0xC4, 0xA0, int(rng.integers(256)), int(rng.integers(256)))
        changes = []
        for _ in range(int(rng.integers(1, 4))):
            at = f.at + int(rng.integers(n))
            h[at] = picks[int(rng.integers(len(picks)))]
            changes.append(at - f.at)
        return f"{role} {f.label!r}: bytes {changes} changed"
    orig = struct.unpack_from("<" + f.fmt, h, f.at)[0]
    if f.fmt in _FLOAT_FMTS:
        pool_f = list(_FLOATS) + [orig * 1e6, orig / 1e6, -orig]
        return _set(h, f, pool_f[int(rng.integers(len(pool_f)))])
    if role == "vtype" or role == "arr_type":
        return _set(h, f, int(rng.integers(0, 14)))
    if role == "ggml_type":
        return _set(h, f, int(rng.integers(0, 42)))
    if role == "dim":
        others = [16, 32, 64, 128, 256, 320, 352]
        pool_d = [orig + 1, orig - 1, orig * 2, orig // 2, orig + 32, 1, 0, 2**62, 2**63,
                  *others]
        return _set(h, f, pool_d[int(rng.integers(len(pool_d)))])
    if role == "offset":
        offsets = [struct.unpack_from("<Q", h, g.at)[0] for g in base.fields["offset"]]
        pool_o = [orig + 1, orig - 1, orig + 32, orig - 32, orig + 64, orig - 64, 0, 2**63,
                  offsets[int(rng.integers(len(offsets)))]]
        return _set(h, f, pool_o[int(rng.integers(len(pool_o)))])
    return _set(h, f, _int_value(rng, orig, f.fmt))


def make_mutant(base: Base, seed: int, base_index: int, i: int) -> Mutant:
    """Mutant `i` of `base` (the `base_index`-th base) under `seed`: always the same."""
    rng = np.random.default_rng([seed, base_index, i])
    roles = [r for r in WEIGHTS if r in base.fields or r in _OPERATIONS or r == "hparam"]
    if "hparam" in roles and not base.fields.get("value_int"):
        roles.remove("hparam")
    p = np.array([WEIGHTS[r] for r in roles], dtype=float)
    role = roles[int(rng.choice(len(roles), p=p / p.sum()))]
    if role == "hparam":  # the integer values of the hyper-parameter keys and ids
        keys = [f for f in base.fields["value_int"] if f.label.endswith(_HPARAM_SUFFIXES)]
        if keys:
            h = bytearray(base.header)
            f = keys[int(rng.integers(len(keys)))]
            orig = struct.unpack_from("<" + f.fmt, h, f.at)[0]
            return Mutant(_set(h, f, _int_value(rng, orig, f.fmt)), bytes(h))
        role = "value_int"
    if role in _OPERATIONS:
        return _OPERATIONS[role](rng, base)
    h = bytearray(base.header)
    return Mutant(_mutate_field(rng, base, h, role), bytes(h))


def _bitflip(rng: np.random.Generator, base: Base) -> Mutant:
    h = bytearray(base.header)
    flips = []
    for _ in range(int(rng.integers(1, 9))):
        at = int(rng.integers(len(h)))
        bit = int(rng.integers(8))
        h[at] ^= 1 << bit
        flips.append(at)
    return Mutant(f"bits flipped at {sorted(flips)}", bytes(h))


def _random_bytes(rng: np.random.Generator, base: Base) -> Mutant:
    h = bytearray(base.header)
    n = int(rng.integers(1, 33))
    at = int(rng.integers(len(h) - n))
    h[at:at + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return Mutant(f"{n} random bytes at {at}", bytes(h))


def _truncate(rng: np.random.Generator, base: Base) -> Mutant:
    in_header = rng.random() < 0.5
    cut = int(rng.integers(len(base.header))) if in_header else int(
        rng.integers(base.data_start, base.size))
    return Mutant(f"cut at byte {cut:,}", base.header, cut=cut)


def _insert(rng: np.random.Generator, base: Base) -> Mutant:
    h = base.header
    at, n = int(rng.integers(24, len(h))), int(rng.integers(1, 17))
    return Mutant(f"{n} bytes inserted at {at}", h[:at] + bytes(n) + h[at:], align=base.align)


def _delete(rng: np.random.Generator, base: Base) -> Mutant:
    h = base.header
    at, n = int(rng.integers(24, len(h) - 16)), int(rng.integers(1, 17))
    return Mutant(f"{n} bytes deleted at {at}", h[:at] + h[at + n:], align=base.align)


def _swap_names(rng: np.random.Generator, base: Base) -> Mutant:
    names = base.fields["tname_bytes"]
    by_len: dict[str, list[Field]] = {}
    for f in names:
        by_len.setdefault(f.fmt, []).append(f)
    groups = [g for g in by_len.values() if len(g) > 1]
    h = bytearray(base.header)
    group = groups[int(rng.integers(len(groups)))]
    a, b = (group[int(k)] for k in rng.choice(len(group), 2, replace=False))
    n = int(a.fmt[:-1])
    h[a.at:a.at + n], h[b.at:b.at + n] = base.header[b.at:b.at + n], base.header[a.at:a.at + n]
    return Mutant(f"tensor names {a.label!r} and {b.label!r} swapped", bytes(h))


def _with_n_kv(h: bytes, base: Base, delta: int) -> bytes:
    n_kv = struct.unpack_from("<Q", h, base.n_kv_at)[0]
    return h[:base.n_kv_at] + struct.pack("<Q", n_kv + delta) + h[base.n_kv_at + 8:]


def _drop_kv(rng: np.random.Generator, base: Base) -> Mutant:
    key, start, end = base.kvs[int(rng.integers(len(base.kvs)))]
    h = _with_n_kv(base.header[:start] + base.header[end:], base, -1)
    return Mutant(f"metadata key {key!r} dropped", h, align=base.align)


def _dup_kv(rng: np.random.Generator, base: Base) -> Mutant:
    key, start, end = base.kvs[int(rng.integers(len(base.kvs)))]
    h = _with_n_kv(base.header[:end] + base.header[start:end] + base.header[end:], base, 1)
    return Mutant(f"metadata key {key!r} repeated", h, align=base.align)


def _add_alignment(rng: np.random.Generator, base: Base) -> Mutant:
    values = (0, 1, 2, 3, 8, 16, 24, 31, 32, 48, 64, 128, 4096, 2**31, 2**32 - 1)
    value = int(values[int(rng.integers(len(values)))])
    vtype = int(rng.choice([4, 4, 4, 10, 5, 6, 8]))
    key = b"general.alignment"
    payload = (struct.pack("<Q", 3) + b"abc" if vtype == 8
               else _pack(_SCALAR_FMT[vtype], value))
    entry = struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + payload
    _, start, _ = base.kvs[0]
    h = _with_n_kv(base.header[:start] + entry + base.header[start:], base, 1)
    pad = value if 32 <= value <= 4096 and not value & (value - 1) else base.align
    return Mutant(f"general.alignment (type {vtype}) := {value}", h, align=pad)


def _overlap(rng: np.random.Generator, base: Base) -> Mutant:
    offsets = base.fields["offset"]
    a, b = (offsets[int(k)] for k in rng.choice(len(offsets), 2, replace=False))
    h = bytearray(base.header)
    h[a.at:a.at + 8] = base.header[b.at:b.at + 8]
    return Mutant(f"tensor {a.label!r} given the offset of {b.label!r}", bytes(h))


_OPERATIONS: dict[str, Callable[[np.random.Generator, Base], Mutant]] = {
    "bitflip": _bitflip, "random_bytes": _random_bytes, "truncate": _truncate,
    "insert": _insert, "delete": _delete, "swap_names": _swap_names, "drop_kv": _drop_kv,
    "dup_kv": _dup_kv, "add_alignment": _add_alignment, "overlap": _overlap,
}


def write_mutant(base: Base, m: Mutant, dst: Path, data: bool) -> None:
    """The mutant's file: its header, padding, then the base's data section (`data`: copied;
    else a sparse hole of the same size, for the checks, which read no tensor data)."""
    with open(base.path, "rb") as src, open(dst, "wb") as out:
        if m.align is None:  # same size: the base's own padding
            src.seek(len(m.header))
            out.write(m.header + src.read(base.data_start - len(m.header)))
        else:
            out.write(m.header + bytes(-len(m.header) % m.align))
        size = base.size - base.data_start
        if data:
            src.seek(base.data_start)
            shutil.copyfileobj(src, out, size)
        else:
            out.truncate(out.tell() + size)
        if m.cut is not None:
            out.truncate(m.cut)


# ------------------------------------------------------------------------- one mutant


class _TimeUp(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _TimeUp()


def check(path: Path) -> tuple[str, str, int]:
    """(outcome, detail, vocabulary size) of the checks the daemon makes before a build:
    `GGUFFile` (the engine opens the file), the tokenizer, `validate_gguf`."""
    from specd.daemon.text.tokenizer import Tokenizer
    from specd.ort_models.gguf_file import GGUFError, GGUFFile
    from specd.ort_models.model_cache import validate_gguf

    try:
        f = GGUFFile(path)
        try:
            Tokenizer.from_metadata(f.metadata)
        except ValueError as exc:  # the tokenizer's own error, one line
            return _rejected(path, exc, named=False) + (0,)
        hp = validate_gguf(f)
    except GGUFError as exc:
        return _rejected(path, exc, named=True) + (0,)
    except _TimeUp:
        raise
    except Exception as exc:
        return "crash", f"{type(exc).__name__}: {exc}"[:400] + " | " + _where(exc), 0
    return "accepted", "checked", hp.n_vocab


def build_and_run(path: Path, n_vocab: int, tokens: Sequence[int] = (1, 5, 9, 2, 7)
                  ) -> tuple[str, str]:
    """(outcome, detail) of building a checked file with the target's options and running a
    prompt and one step: its logits must be finite."""
    from specd.daemon.models.building import build_options
    from specd.ort_models.gguf_file import GGUFError
    from specd.ort_models.model_cache import load_or_build
    from specd.ort_models.runner import ModelRunner

    try:
        built = load_or_build(path, build_options("target", device="cpu"))
    except GGUFError as exc:  # the weights' values, checked before a build
        return _rejected(path, exc, named=True)
    except _TimeUp:
        raise
    except Exception as exc:
        return "crash", f"at build: {type(exc).__name__}: {exc}"[:400] + " | " + _where(exc)
    try:
        runner = ModelRunner(built, n_ctx=256, threads=1)
        # a prompt and a step that fit the context (a model may claim a tiny one)
        ids = [t % n_vocab for t in tokens][:max(1, runner.n_ctx - 1)]
        rows = [runner.prefill(0, ids)]
        if len(ids) < runner.n_ctx:
            rows.append(runner.forward(0, [ids[0]], len(ids)))
        finite = all(bool(np.isfinite(r).all()) for r in rows)
        return ("accepted", "built, logits finite") if finite else ("nan", "logits not finite")
    except _TimeUp:
        raise
    except Exception as exc:
        return "crash", f"at run: {type(exc).__name__}: {exc}"[:400] + " | " + _where(exc)
    finally:
        shutil.rmtree(built.folder, ignore_errors=True)
        built.folder.with_name(built.folder.name + ".lock").unlink(missing_ok=True)


def _rejected(path: Path, exc: Exception, named: bool) -> tuple[str, str]:
    """A rejection must be one line, and a GGUFError must name the file."""
    msg = str(exc)
    if "\n" in msg or (named and path.name not in msg):
        return "unclear", msg[:400]
    return "rejected", msg[:400]


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return " < ".join(f"{Path(fr.filename).name}:{fr.lineno}" for fr in frames[-3:][::-1])


def run_worker(bases: list[Base], seed: int, jobs: list[tuple[int, int]], limit_s: float,
               rss_limit: int, workdir: Path, out: Any) -> None:
    """Evaluate the mutants `jobs` ((base index, mutant index)); a JSON line each."""
    signal.signal(signal.SIGALRM, _alarm)
    for b, i in jobs:
        base = bases[b]
        mutant = make_mutant(base, seed, b, i)
        path = workdir / f"mutant-{b}-{i}.gguf"
        write_mutant(base, mutant, path, data=False)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, limit_s)
        try:
            outcome, detail, n_vocab = check(path)
            if outcome == "accepted" and base.build:
                write_mutant(base, mutant, path, data=True)
                outcome, detail = build_and_run(path, n_vocab)
        except _TimeUp:
            outcome, detail = "hang", f"over {limit_s:.0f} s"
        except MemoryError:
            outcome, detail = "memory", "MemoryError under the address-space limit"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            path.unlink(missing_ok=True)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        if grew > rss_limit and outcome != "crash":
            outcome, detail = "memory", f"peak RSS grew {grew / 1e6:.0f} MB; {detail}"
        out.write(json.dumps({"base": b, "i": i, "what": mutant.what, "outcome": outcome,
                              "detail": detail, "s": round(time.monotonic() - t0, 3)}) + "\n")
        out.flush()


# ------------------------------------------------------------------------- the parent

FAILURES = ("crash", "unclear", "nan", "hang", "memory")


@dataclass
class Report:
    results: list[dict[str, Any]]
    bases: list[str]
    seconds: float

    def counts(self) -> Counter[str]:
        return Counter(r["outcome"] for r in self.results)

    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["outcome"] in FAILURES]

    def summary(self) -> str:
        lines = [f"{len(self.results)} mutants in {self.seconds:.0f} s: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.counts().items()))]
        for b, name in enumerate(self.bases):
            mine = Counter(r["outcome"] for r in self.results if r["base"] == b)
            lines.append(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(mine.items())))
        lines += [f"  FAIL {r['outcome']}: base {r['base']} mutant {r['i']} ({r['what']}): "
                  f"{r['detail']}" for r in self.failures()]
        return "\n".join(lines)


def fuzz(bases: Sequence[tuple[str | os.PathLike[str], bool, int]], seed: int = 0,
         limit_s: float = 60.0, rss_limit: int = 1 << 30, address_space: int = 16 << 30,
         progress: Callable[[dict[str, Any]], None] | None = None) -> Report:
    """Run (path, build, mutant count) per base in worker processes; a Report."""
    t0 = time.monotonic()
    jobs = [(b, i) for b, (_, _, n) in enumerate(bases) for i in range(n)]
    spec = [[str(p), build] for p, build, _ in bases]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmp:
        env = {**os.environ, "SPECD_CACHE_DIR": str(_cache_with_kernels(Path(tmp)))}
        while len(results) < len(jobs):
            todo = jobs[len(results):]
            cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--seed", str(seed),
                   "--bases", json.dumps(spec), "--jobs", json.dumps(todo),
                   "--limit", str(limit_s), "--rss-limit", str(rss_limit),
                   "--address-space", str(address_space), "--workdir", tmp]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            lines: queue.Queue[str | None] = queue.Queue()
            errs: list[str] = []
            threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
            threading.Thread(target=_drain, args=(proc.stderr, errs), daemon=True).start()
            while True:
                try:  # the worker's own alarm stops a slow mutant; this, a stuck one
                    line = lines.get(timeout=limit_s + 60)
                except queue.Empty:
                    proc.kill()
                    b, i = todo[0]
                    results.append({"base": b, "i": i, "what": "?", "outcome": "hang",
                                    "detail": "the worker stopped answering", "s": None})
                    break
                if line is None:  # the worker ended: done, or died mid-mutant
                    proc.wait()
                    if len(results) < len(jobs) and proc.returncode != 0:
                        b, i = jobs[len(results)]
                        tail = "".join(errs)[-300:].strip().replace("\n", " | ")
                        results.append({"base": b, "i": i, "what": "?", "outcome": "crash",
                                        "detail": f"worker died ({proc.returncode}): {tail}",
                                        "s": None})
                    break
                result = json.loads(line)
                results.append(result)
                todo = todo[1:]
                if progress is not None:
                    progress(result)
            proc.wait()
    return Report(results, [str(p) for p, _, _ in bases], time.monotonic() - t0)


def _drain(stream: Any, into: list[str]) -> None:
    into.append(stream.read())


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        if line.strip():
            lines.put(line)
    lines.put(None)


def _cache_with_kernels(tmp: Path) -> Path:
    """A cache dir of the worker's own whose `native/` is the real cache's (so specd's
    kernels are not compiled again for every run)."""
    from specd.ort_models.paths import cache_dir

    cache = tmp / "cache"
    cache.mkdir()
    native = cache_dir() / "native"
    native.mkdir(parents=True, exist_ok=True)
    (cache / "native").symlink_to(native, target_is_directory=True)
    return cache


def _worker_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int)
    ap.add_argument("--bases")
    ap.add_argument("--jobs")
    ap.add_argument("--limit", type=float)
    ap.add_argument("--rss-limit", type=int)
    ap.add_argument("--address-space", type=int)
    ap.add_argument("--workdir")
    a = ap.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_AS, (a.address_space, a.address_space))
    bases = [parse_base(p, build) for p, build in json.loads(a.bases)]
    jobs = [(int(b), int(i)) for b, i in json.loads(a.jobs)]
    run_worker(bases, a.seed, jobs, a.limit, a.rss_limit, Path(a.workdir), sys.stdout)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit("usage: gguf_fuzz.py worker ... (run by fuzz(); see bench/gguf_fuzz.py)")

