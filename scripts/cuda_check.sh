#!/usr/bin/env bash
# The CUDA checks, on a machine with a GPU, nvcc and a python3 holding a CUDA torch wheel (the
# device machines of bench/RESULTS.md, "CUDA kernels"): builds memrt against that LibTorch into
# build-cuda/, runs every CUDA kernel against its CPU twin (tests/cuda, a short training on both
# devices included), times the kernels on the GPU (bench_cuda_step) and runs the main job.
#
#   scripts/cuda_check.sh [DEBS_DIR]
#
# DEBS_DIR: Debian packages of memrt's build dependencies (scripts/setup.sh's list and the runtime
# libraries they need), for a machine where apt cannot reach them: each is unpacked into
# build-cuda/deps and the build and the binaries are pointed there. Without it, the dependencies
# must be installed. MEMRT_CUDA_ARCH (default: native) names the GPU architecture to compile for.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-cuda
mkdir -p "$build"
if [ $# -ge 1 ]; then
  deps=$PWD/$build/deps
  for f in "$1"/*.deb; do dpkg -x "$f" "$deps"; done
  libdir=$deps/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH="$deps/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export CPATH="$deps/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$libdir${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
step "configure"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEMRT_PYTHON="$(command -v python3)" \
      -DMEMRT_CUDA_ARCHITECTURES="${MEMRT_CUDA_ARCH:-native}" > "$build/configure.log" ||
  { cat "$build/configure.log"; exit 1; }
grep "memrt:" "$build/configure.log"
targets=(test_cuda_kernels bench_cuda_step launcher memrt_plugins)
# c10d's NCCL backend library, where the wheel's nccl.h was found (its collectives need two GPUs).
grep -q "NCCL backend enabled" "$build/configure.log" && targets+=(memrt_nccl)
step "build"
time cmake --build "$build" --target "${targets[@]}"
step "tests/cuda: every CUDA kernel against its CPU twin"
"$build/bin/test_cuda_kernels"
step "bench_cuda_step: the kernels on the GPU"
"$build/bin/bench_cuda_step"
step "the main job on this machine's CPU, with this build (2 threads)"
OMP_NUM_THREADS=2 "$build/bin/launcher" --deepspeed configs/ds_config.json configs/train.yaml --max_steps=50 \
  --output_dir="$build/main_job"
