#!/usr/bin/env bash
# The real SGLang for kvpool's HiCache tests: `bash tests/sglang_env.sh` makes build/sglang-venv (once, ~30 s;
# a second run checks a stamp and kvpool's pins, under a second; a run after this file changed, or for another
# Python, makes it anew).
#
# What goes in: sglang 0.5.23 without its dependencies (its full set pins torch 2.14, CUDA kernels, flashinfer
# and more, gigabytes that its HiCache storage code does not use), plus exactly the packages the SGLang modules
# kvpool's tests import need, each pinned, none with its own dependencies (~300 MB in all). The venv sees the
# caller's packages, those of $PYTHON, be it a system Python or a virtualenv: a `.pth` file adds $PYTHON's site
# directories after the venv's own (`venv --system-site-packages` would add the *base* interpreter's, which from
# inside a virtualenv are not the caller's). So torch 2.13.0 (CPU), kvpool (editable) and kvpool's
# grpcio/protobuf come from there, unchanged; nothing is installed into the caller's environment. Triton (a GPU
# kernel compiler, ~1 GB) is not installed: the tests use sglang's own Triton stub (sglang/_platform_stubs.py,
# what sglang runs on hosts without Triton).
# SGLang's page hash is a C++ extension it compiles on first use (g++, OpenSSL headers, ~10 s): the tests
# build it once into build/sglang-venv/torch_extensions.
#
# Two checks, each one line on stderr and exit 1, never a traceback: $PYTHON imports what the venv borrows
# (checked before anything is made), and the venv imports it too, the very kvpool $PYTHON imports. The stamp
# is written only after the venv's check passed, so a run that failed is made anew by the next one.
set -euo pipefail
PYTHON=${PYTHON:-python3}
[[ $PYTHON != */* ]] || PYTHON=$(realpath -s "$PYTHON")  # a path: kept valid across the cd (links kept: a venv's)
cd "$(dirname "$0")/.."
VENV=build/sglang-venv
PY="$VENV/bin/python"
STAMP="$VENV/.kvpool-sglang-env"  # a hash of this file (the pins) and of the caller's site directories

# check WHO PYTHON [KVPOOL]: PYTHON imports kvpool's wire pins, torch and kvpool (the file KVPOOL, if given) and
# prints kvpool's file; else one line on stderr saying what is missing and what to do, and exit 1.
check() {
    "$2" - "$1" "${3:-}" <<'CHECK'
import sys

who, want = sys.argv[1], sys.argv[2]
del sys.path[0]  # the working directory (the checkout, with its kvpool/ folder): what is installed counts


def fail(why):
    if who == "caller":
        fix = ("the SGLang venv borrows torch, kvpool and kvpool's dependencies from this Python: install them "
               f"first: {sys.executable} -m pip install torch==2.13.0 -e '.[client,test]' (tests/run.sh does)")
    else:
        fix = "the venv is left unstamped, so the next run makes it anew"
    raise SystemExit(f"tests/sglang_env.sh: {sys.executable} {why}; {fix}")


try:
    import grpc
    import torch  # noqa: F401
    from google import protobuf

    import kvpool
except ImportError as exc:
    fail(f"cannot import {exc.name} ({exc})")
version = lambda text: tuple(int(x) for x in text.split(".")[:3])  # noqa: E731
if not ((7, 35, 1) <= version(protobuf.__version__) < (8,) and version(grpc.__version__) >= (1, 85, 1)):
    fail(f"has protobuf {protobuf.__version__} and grpcio {grpc.__version__}, not kvpool's pins")
if want and kvpool.__file__ != want:
    fail(f"imports kvpool from {kvpool.__file__}, not from {want} as the caller does")
print(kvpool.__file__)
CHECK
}

KVPOOL=$(check caller "$PYTHON")  # first: a caller lacking kvpool's packages costs one line, not an install
SITES=$("$PYTHON" -c 'import os, site
dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
print([d for d in dirs if os.path.isdir(d)])')
WANT=$( (cat tests/sglang_env.sh; echo "$SITES") | sha256sum | cut -c1-16)
if [ ! -x "$PY" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "tests/sglang_env.sh: installing sglang 0.5.23 (no deps) into $VENV, over the packages of $PYTHON" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    # site.addsitedir, not a bare path: the caller's own .pth files (an editable kvpool's) work in the venv too
    echo "import site; list(map(site.addsitedir, $SITES))" \
        >"$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/kvpool-caller-site.pth"
    # Each package pinned to a version seen working; those the caller already has at that version are
    # skipped (torch's own dependencies and kvpool's are left to the caller's install).
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile sglang==0.5.23 torchvision==0.28.0 \
        aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.7.0 anyio==4.16.0 \
        apache-tvm-ffi==0.1.15.post2 asttokens==3.0.1 attrs==26.1.0 backcall==0.2.0 certifi==2026.5.20 \
        charset-normalizer==3.4.7 colorama==0.4.6 compressed-tensors==0.20.1 decorator==5.2.1 dill==0.4.1 \
        executing==2.2.1 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 \
        huggingface_hub==2.4.0 idna==3.20 ipython==8.12.3 jedi==0.20.0 loguru==0.7.3 msgspec==0.23.0 \
        multidict==7.2.1 orjson==3.8.3 outcome==1.3.0.post0 packaging==26.2 parso==0.8.7 pexpect==4.8.0 \
        pickleshare==0.7.5 pillow==13.0.0 prompt_toolkit==3.0.52 propcache==0.5.4 psutil==7.2.2 ptyprocess==0.7.0 \
        pure_eval==0.2.3 pybase64==1.5.1 pydantic==2.13.4 pydantic_core==2.46.4 Pygments==2.20.0 PyYAML==6.0.3 \
        pyzmq==27.3.0 regex==2026.5.9 requests==2.34.2 safetensors==0.8.0 scipy==1.17.1 sentencepiece==0.2.3 \
        sniffio==1.3.1 sortedcontainers==2.4.0 stack-data==0.6.3 starlette==1.10.0 tokenizers==0.23.3 \
        tqdm==4.70.1 traitlets==5.15.0 transformers==5.24.0 trio==0.22.2 truststore==0.10.5 \
        typing-inspection==0.4.2 urllib3==2.7.0 wcwidth==0.7.0 yarl==1.25.1
fi
if ! check venv "$PY" "$KVPOOL" >/dev/null; then
    rm -f "$STAMP"
    exit 1
fi
echo "$WANT" >"$STAMP"
