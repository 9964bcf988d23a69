#!/usr/bin/env bash
# Build llama.cpp's llama-server as a benchmark peer for `mlxr bench --against llamacpp`.
#
# Usage: scripts/build_llama_server.sh SDIST_TAR_GZ OUT_DIR
#   SDIST_TAR_GZ  a llama-cpp-python sdist (it vendors llama.cpp), e.g. from
#                 `pip download --no-binary :all: --no-deps llama-cpp-python`
#   OUT_DIR       where to unpack and build (outside this repository); the binary
#                 ends up at OUT_DIR/build/bin/llama-server
#
# GGML_NATIVE=ON tunes the build for THIS CPU only: the binary is a local
# benchmark peer, not something to ship or copy to another machine.
set -euo pipefail

if [ "$#" -ne 2 ]; then
    echo "usage: $0 SDIST_TAR_GZ OUT_DIR" >&2
    exit 2
fi
sdist=$(realpath "$1")
out=$(realpath -m "$2")
jobs=${JOBS:-$(nproc)}

mkdir -p "$out"
tar -xzf "$sdist" -C "$out"
src=$(find "$out" -maxdepth 4 -type d -path '*/vendor/llama.cpp' | head -n 1)
if [ -z "$src" ]; then
    echo "no vendor/llama.cpp inside $sdist" >&2
    exit 1
fi

cmake -S "$src" -B "$out/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$out/build" --target llama-server -j "$jobs"
echo "built $out/build/bin/llama-server"
echo "use it with: MLXR_LLAMA_SERVER=$out/build/bin/llama-server mlxr bench --against llamacpp"
