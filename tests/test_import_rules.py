"""The dependency rule between specd's packages, checked by walking every import.

Packages are layered: a module may import its own package and those listed after it in
LAYERS, never one listed before it, so no two packages import each other (directly or
around a circle). Imports across top-level folders are absolute (`specd.`): a relative
import that climbs out of a folder points above the checkout for tools that read it by
path.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("daemon", "ort_models", "ipc", "memory_fit", "tray", "installers")

# highest first: each may import only itself and what follows it
LAYERS = (
    "specd.daemon.cli",  # argparse and printing: wires everything
    "specd.daemon.benchmark",
    "specd.tray",
    "specd.daemon.control",
    "specd.ipc",
    "specd.daemon.serving",
    "specd.daemon.training",  # train-draft: distils with the target, trains, writes GGUF
    "specd.daemon.drafters",
    "specd.daemon.models",
    "specd.memory_fit",
    "specd.daemon.spec",
    "specd.daemon.text",
    "specd.installers",
    "specd.ort_models",
)
# a client of the daemon: process control and the IPC client, nothing that runs models
TRAY_MAY_IMPORT = ("specd.tray", "specd.daemon.control", "specd.ipc.client", "specd.ipc.server")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for top in TOP_LEVEL:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((".".join(["specd", *parts]), path))
    return out


def _imports(module: str, path: Path) -> list[tuple[int, str, int]]:
    """(line, imported module, relative level) for each specd import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, 0) for a in node.names if a.name.startswith("specd.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("specd."):
                # `from pkg import module` imports the module
                out += [(node.lineno, f"{name}.{a.name}", node.level) for a in node.names]
    return out


def _unit(module: str) -> str | None:
    return next((u for u in LAYERS if module == u or module.startswith(u + ".")), None)


MODULES = _modules()


def test_every_package_belongs_to_a_layer() -> None:
    # the daemon package's own __init__ is the only module outside the layers
    stray = [m for m, _ in MODULES if _unit(m) is None and m != "specd.daemon"]
    assert not stray, f"modules in no layer of LAYERS: {stray}"


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_follow_the_layers(module: str, path: Path) -> None:
    unit = _unit(module)
    if unit is None:
        return
    rank = LAYERS.index(unit)
    bad = []
    for line, name, level in _imports(module, path):
        if level and name.split(".")[1] != module.split(".")[1]:
            bad.append(f"line {line}: relative import out of its top-level folder: {name}")
            continue
        other = _unit(name)
        if other is None:
            if name.split(".")[:2] != ["specd", "daemon"] or name.count(".") > 2:
                bad.append(f"line {line}: {name} is in no layer")
            continue
        if LAYERS.index(other) < rank:
            bad.append(f"line {line}: {unit} imports {name}, a layer above it")
        if unit == "specd.tray" and not name.startswith(TRAY_MAY_IMPORT):
            bad.append(f"line {line}: the tray is a client; it may not import {name}")
    assert not bad, f"{module}:\n" + "\n".join(bad)


def test_the_walk_sees_imports() -> None:
    # the rule above would pass on an empty walk: make sure it reads real imports
    found = dict(MODULES)
    names = {n for _, n, _ in _imports("specd.daemon.spec.generation",
                                         found["specd.daemon.spec.generation"])}
    assert any(n.startswith("specd.ort_models.runner") for n in names), names
    assert len(MODULES) > 60
