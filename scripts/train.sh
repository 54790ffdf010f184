#!/usr/bin/env bash
# Command 1: set up whatever is missing, build, and train the main job: a small GPT-2 on the
# built-in corpus with the shipped configs. Extra arguments override train.yaml keys
# (e.g. `scripts/train.sh --max_steps=50`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh --target launcher memrt_plugins
build=${MEMRT_BUILD_DIR:-build}
exec "$build/bin/launcher" --deepspeed configs/ds_config.json configs/train.yaml "$@"
