#!/usr/bin/env bash
# Installs what memrt needs to build and run, and nothing that is already there.
#
#   scripts/setup.sh            # prints the Python interpreter of the LibTorch venv on its last line
#   scripts/setup.sh --test     # the same, plus what only the tests need (headless Chromium,
#                               # the quantization oracles bitsandbytes, torchao and accelerate)
#
# Debian packages come from apt-get; LibTorch comes from the `torch` wheel on PyPI, installed into
# a virtual environment outside the source tree ($MEMRT_VENV, default ~/.cache/memrt/venv-torch<ver>)
# so that every clone and every run reuses it. A second run with everything in place takes < 1 s.
set -euo pipefail

# torch 2.13.0 is the newest wheel whose headers still accept C++17 (2.14+ require C++20) and whose
# CUDA runtime (13.0) matches the CUDA toolkit our machines carry.
MEMRT_TORCH_VERSION=2.13.0
venv=${MEMRT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/memrt/venv-torch${MEMRT_TORCH_VERSION}}

log() { echo "[setup] $*" >&2; }

with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    *) log "unknown argument: $arg (the only one is --test)"; exit 2 ;;
  esac
done

debs=(g++ cmake ninja-build ccache git python3 python3-venv
      rapidjson-dev libyaml-cpp-dev libboost-dev libboost-filesystem-dev
      libboost-program-options-dev libgtest-dev libgmock-dev libgloo-dev libpcre2-dev libutf8proc-dev
      libsentencepiece-dev)
# The memory report test renders memory_report.html in headless Chromium. Without recommends
# Chromium pulls in no font, so text would draw as boxes: DejaVu is the one font it needs.
if [ "$with_test" -eq 1 ]; then
  debs+=(chromium fonts-dejavu-core)
fi
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
    sudo=sudo
  fi
  log "installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

want_torch() {
  "$venv/bin/python" - "$MEMRT_TORCH_VERSION" <<'PY' 2>/dev/null
import sys, torch, safetensors, numpy, transformers
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
PY
}
# Written once the venv has been verified; the name changes when the package list does.
stamp="$venv/.memrt-deps2-torch-$MEMRT_TORCH_VERSION"
if [ ! -f "$stamp" ] && ! want_torch; then
  log "creating $venv with torch==$MEMRT_TORCH_VERSION (a few GiB, once)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
      "torch==${MEMRT_TORCH_VERSION}" numpy safetensors transformers >&2
  want_torch || { log "torch==$MEMRT_TORCH_VERSION (with numpy, safetensors, transformers) did not import from $venv"; exit 1; }
fi
touch "$stamp"

# The quantization, LoRA and tokenizer tests' oracles (docs/quant.md, docs/lora.md, docs/tokenizers.md), pinned: they run on the venv's torch, so pip must
# not replace it (--no-deps: their other dependencies, numpy, packaging, pyyaml and huggingface_hub,
# come with transformers). accelerate (with psutil) is what transformers needs to load a model
# quantized by bitsandbytes, as the pre-quantized checkpoint test makes one. The chat template tests
# read axolotl's template files (utils/chat_templates/templates) from its package, and
# tests/data/sft_records.py imports its chat_template strategy, which needs colorama and addict.
# LLaMA-Factory's data modules (parser, converter, template, supervised processor) are imported by
# tests/data/llamafactory_records.py alone, without its package's __init__ files. datasets (with
# dill, multiprocess, pandas, pyarrow, python-dateutil, tzdata and xxhash, which it imports) finds
# a dataset directory's splits for tests/data/dataset_dirs.py.
MEMRT_BNB_VERSION=0.50.2
MEMRT_TORCHAO_VERSION=0.18.0
MEMRT_ACCELERATE_VERSION=1.15.0
MEMRT_PSUTIL_VERSION=7.2.2
MEMRT_PEFT_VERSION=0.21.2
MEMRT_TOKENIZERS_VERSION=0.23.3
MEMRT_SENTENCEPIECE_VERSION=0.2.0
MEMRT_AXOLOTL_VERSION=0.19.0
MEMRT_COLORAMA_VERSION=0.4.6
MEMRT_ADDICT_VERSION=2.4.0
MEMRT_LLAMAFACTORY_VERSION=0.9.5
MEMRT_DATASETS_VERSION=5.2.0
MEMRT_DATASETS_DEPS="dill==0.4.1 multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 python-dateutil==4.0.0 tzdata==2026.6 xxhash==4.1.0"
test_stamp="$venv/.memrt-test-deps-bnb$MEMRT_BNB_VERSION-ao$MEMRT_TORCHAO_VERSION-acc$MEMRT_ACCELERATE_VERSION-peft$MEMRT_PEFT_VERSION-tok$MEMRT_TOKENIZERS_VERSION-sp$MEMRT_SENTENCEPIECE_VERSION-ax$MEMRT_AXOLOTL_VERSION-colorama$MEMRT_COLORAMA_VERSION-addict$MEMRT_ADDICT_VERSION-lf$MEMRT_LLAMAFACTORY_VERSION-ds$MEMRT_DATASETS_VERSION"
if [ "$with_test" -eq 1 ] && [ ! -f "$test_stamp" ]; then
  log "installing bitsandbytes==$MEMRT_BNB_VERSION, torchao==$MEMRT_TORCHAO_VERSION, accelerate==$MEMRT_ACCELERATE_VERSION, peft==$MEMRT_PEFT_VERSION, tokenizers==$MEMRT_TOKENIZERS_VERSION, sentencepiece==$MEMRT_SENTENCEPIECE_VERSION, axolotl==$MEMRT_AXOLOTL_VERSION (with colorama==$MEMRT_COLORAMA_VERSION and addict==$MEMRT_ADDICT_VERSION), llamafactory==$MEMRT_LLAMAFACTORY_VERSION and datasets==$MEMRT_DATASETS_VERSION into $venv (test oracles)"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps \
      "bitsandbytes==${MEMRT_BNB_VERSION}" "torchao==${MEMRT_TORCHAO_VERSION}" \
      "accelerate==${MEMRT_ACCELERATE_VERSION}" "psutil==${MEMRT_PSUTIL_VERSION}" \
      "peft==${MEMRT_PEFT_VERSION}" "tokenizers==${MEMRT_TOKENIZERS_VERSION}" \
      "sentencepiece==${MEMRT_SENTENCEPIECE_VERSION}" "axolotl==${MEMRT_AXOLOTL_VERSION}" \
      "colorama==${MEMRT_COLORAMA_VERSION}" "addict==${MEMRT_ADDICT_VERSION}" \
      "llamafactory==${MEMRT_LLAMAFACTORY_VERSION}" "datasets==${MEMRT_DATASETS_VERSION}" $MEMRT_DATASETS_DEPS >&2
  "$venv/bin/python" -c "import importlib.util, bitsandbytes, torchao, accelerate, peft, tokenizers, sentencepiece, colorama, addict, datasets; assert importlib.util.find_spec('axolotl') and importlib.util.find_spec('llamafactory')" >/dev/null 2>&1 ||
    { log "bitsandbytes, torchao, accelerate, peft, tokenizers, sentencepiece, colorama, addict, datasets, axolotl or llamafactory did not import from $venv"; exit 1; }
  touch "$test_stamp"
fi
echo "$venv/bin/python"
