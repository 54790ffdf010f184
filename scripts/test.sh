#!/usr/bin/env bash
# Command 2: set up whatever is missing, build everything, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test >/dev/null   # the tests also need headless Chromium (memory report)
scripts/build.sh
build=${MEMRT_BUILD_DIR:-build}
# Tests are bounded individually (TIMEOUT property); ctest's own default is a backstop.
ctest --test-dir "$build" --output-on-failure --timeout 600 -j "$(nproc)" "$@"
