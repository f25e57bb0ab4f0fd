#!/usr/bin/env bash
# The real SGLang for kvpool's HiCache tests: `bash tests/sglang_env.sh` makes build/sglang-venv (once; a
# second run only checks it).
#
# What goes in: sglang 0.5.23 without its dependencies (its full set pins torch 2.14, CUDA kernels, flashinfer
# and more, gigabytes that its HiCache storage code does not use), plus the few pure-Python packages the
# modules kvpool's tests import need. The venv sees the caller's site-packages (--system-site-packages), so
# torch 2.13.0 (CPU), kvpool (editable) and kvpool's grpcio/protobuf come from there, unchanged; nothing is
# installed into the caller's environment. Triton (a GPU kernel compiler, ~1 GB) is not installed: the tests
# use sglang's own Triton stub (sglang/_platform_stubs.py, what sglang runs on hosts without Triton).
# SGLang's page hash is a C++ extension it compiles on first use (g++, OpenSSL headers); it is built here,
# into build/sglang-venv/torch_extensions, so the tests do not pay for it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=build/sglang-venv
PY="$VENV/bin/python"
export TORCH_EXTENSIONS_DIR="$PWD/$VENV/torch_extensions"
probe() {
    "$PY" tests/sglang_driver.py --probe >/dev/null 2>&1
}
if [ ! -x "$PY" ] || ! probe; then
    echo "tests/sglang_env.sh: installing sglang 0.5.23 (no deps) into $VENV" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv --system-site-packages "$VENV"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps \
        sglang==0.5.23 SGLANG_DEPS_PLACEHOLDER
    "$PY" tests/sglang_driver.py --probe  # imports what the tests use and builds the hash extension; loud if not
fi
