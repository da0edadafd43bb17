"""The llama.cpp build step (daemon/benchmark/llama_cpp.py, which .ci/build_llama_cpp and
`quickstart.py test` run) on small CMake projects standing in for llama.cpp's source: a
failed compile exits 1 printing the compiler's error among the build's last lines, a build
past its time limit is stopped and says so, and a good one puts every target in bin_dir()."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specd.daemon.benchmark import llama_cpp

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                                reason="needs cmake and a C++ compiler")

SCRIPT = Path(llama_cpp.__file__)


def _source(root: Path, main_cpp: str, *, cmake: str | None = None) -> Path:
    """root/src/llama.cpp: a CMake project with an executable per llama_cpp.TARGETS, in
    build/bin as llama.cpp's own build puts them."""
    src = root / "src" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "main.cpp").write_text(main_cpp)
    targets = "\n".join(f"add_executable({t} main.cpp)" for t in llama_cpp.TARGETS)
    (src / "CMakeLists.txt").write_text(cmake or (
        "cmake_minimum_required(VERSION 3.14)\nproject(standin CXX)\n"
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n" + targets + "\n"))
    return root


@pytest.fixture
def build_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("SPECD_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("SPECD_LLAMA_CPP_DIR", str(tmp_path))
    return tmp_path


def test_a_failed_compile_exits_1_with_the_compilers_error(build_root: Path) -> None:
    _source(build_root, "int main() { return this is not C++; }\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--timeout", "300"], capture_output=True,
                       text=True, env=dict(os.environ))
    assert r.returncode == 1
    assert "llama.cpp: the build failed" in r.stderr
    tail = r.stderr.split("its last ", 1)[1].splitlines()[1:]
    assert 0 < len(tail) <= llama_cpp.TAIL_LINES
    assert any("main.cpp" in line and "error" in line for line in tail), r.stderr
    assert llama_cpp.missing("llama-server") is not None


def test_a_build_past_its_time_limit_is_stopped(build_root: Path) -> None:
    # configuring a project without languages is quick; its targets sleep
    sleeps = "\n".join(f"add_custom_target({t} COMMAND sleep 600)" for t in llama_cpp.TARGETS)
    _source(build_root, "", cmake=f"cmake_minimum_required(VERSION 3.14)\n"
                                   f"project(standin NONE)\n{sleeps}\n")
    with pytest.raises(RuntimeError, match="the build failed .* ran out of time"):
        llama_cpp.build(log=lambda _: None, timeout_s=20)


def test_a_good_build_puts_every_target_in_bin_dir(build_root: Path) -> None:
    _source(build_root, "int main() { return 0; }\n")
    assert llama_cpp.build(log=lambda _: None, timeout_s=300) == llama_cpp.bin_dir()
    assert all(llama_cpp.missing(t) is None for t in llama_cpp.TARGETS)
    assert llama_cpp.bin_dir() == build_root / "build" / "bin"
