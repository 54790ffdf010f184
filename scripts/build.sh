#!/usr/bin/env bash
# Configures (once) and builds memrt into build/ (or $MEMRT_BUILD_DIR). Extra arguments go to
# `cmake --build`, e.g. `scripts/build.sh --target launcher`.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(scripts/setup.sh)
build=${MEMRT_BUILD_DIR:-build}

if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja \
        -DCMAKE_BUILD_TYPE="${MEMRT_BUILD_TYPE:-RelWithDebInfo}" \
        -DMEMRT_PYTHON="$python" \
        ${MEMRT_CMAKE_ARGS:-}
fi
cmake --build "$build" "$@"
