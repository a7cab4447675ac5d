#!/usr/bin/env bash
# Builds the vLLM 0.33 reference environment (default: ../vllm-ref-venv beside
# the repository) in which vLLM's own V1 scheduler runs on CPU with no model:
# tools/drive_vllm.py and tools/vllm_plugin_check.py run in it. Uses
# ../shared/vllm_ref/setup_venv.sh when the checkout has it; otherwise the same
# installs (a CPU torch, vLLM without its dependencies, what its scheduler imports).
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/../vllm-ref-venv}
if [ -x "$V/bin/python" ] && "$V/bin/python" -c "import vllm" 2>/dev/null; then
  exit 0
fi
if [ -f "$ROOT/../shared/vllm_ref/setup_venv.sh" ]; then
  exec bash "$ROOT/../shared/vllm_ref/setup_venv.sh" "$V"
fi
python3.11 -m venv "$V"
"$V/bin/pip" install -q torch==2.13.0
"$V/bin/pip" install -q --no-deps vllm==0.33.0
"$V/bin/pip" install -q regex cachetools psutil numpy requests tqdm blake3 py-cpuinfo "transformers>=5.16.1,<5.21.0" \
  huggingface_hub tokenizers safetensors "pydantic>=2.12" msgspec cloudpickle pyyaml pyzmq einops cbor2 pybase64 \
  setproctitle prometheus_client sentencepiece aiohttp "openai>=2.25" "oss-harmony>=0.0.11" pillow uvloop \
  "xgrammar==0.2.8" fastapi partial-json-parser "llguidance>=1.7,<1.8"
