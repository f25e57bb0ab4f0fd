#!/usr/bin/env bash
# kvpool's GPU check: one command, under 8 minutes, on a machine with an NVIDIA GPU, torch and transformers and
# no network. See tests/gpu/README.md.
#
#   tests/gpu/check.sh [OUTDIR]              the GPU run (OUTDIR, else $OUT, else ./gpu-check-out)
#   tests/gpu/check.sh --cpu [OUTDIR]        the dry run: the same flow on CPU tensors and the host copier
#   tests/gpu/check.sh --pack                where PyPI is reachable: fill tests/gpu/wheels/ (tests/gpu/pack.sh)
#
# Options: --no-install (use $PYTHON as it is: kvpool and its dependencies already importable), --out DIR,
# --timeout-scale X (multiply every step's timeout). Environment: PYTHON (the Python with torch and transformers;
# default python3), KVPOOL_GPU_VENV (where the check's venv goes; default ${TMPDIR:-/tmp}/kvpool-gpu-check-venv).
#
# Unless --no-install: a venv with --system-site-packages (the machine's torch and transformers stay in use;
# nothing here ever installs torch), and `pip install --no-index --find-links tests/gpu/wheels kvpool` into it:
# kvpool's wheel and whichever of its dependencies the machine lacks or has too old. Then tests/gpu/check.py runs
# every check and writes OUTDIR/gpu-check.json and OUTDIR/gpu-check.txt. Exit status: 0 every check passed,
# 1 a check failed, 2 the setup failed (no Python with torch, no wheels, pip refused).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
wheels="$here/wheels"
python="${PYTHON:-python3}"
mode=() install=1 out="" scale=1

die() { echo "check.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) mode=(--cpu) ;;
        --pack) shift; exec "$here/pack.sh" "$@" ;;
        --no-install) install=0 ;;
        --out) [ $# -ge 2 ] || die "--out needs a folder"; out="$2"; shift ;;
        --timeout-scale) [ $# -ge 2 ] || die "--timeout-scale needs a number"; scale="$2"; shift ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) out="$1" ;;
    esac
    shift
done
out="${out:-${OUT:-./gpu-check-out}}"
# the driver's steps take at most 460 s (x the scale): the limit below is a backstop
limit="$(awk -v s="$scale" 'BEGIN { if (s + 0 <= 0) exit 1; printf "%d", 480 * s + 0.5 }')" ||
    die "--timeout-scale must be a positive number, got $scale"
case "$python" in */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac
mkdir -p "$out/logs" || die "cannot create the output folder $out"
out="$(cd "$out" && pwd)"
# from here on every path is absolute, and Python runs in the output folder: a checkout's kvpool/ in the working
# directory would shadow the installed one
cd "$out" || die "cannot enter $out"

# -- the machine's Python: torch, transformers, numpy, Python >= 3.10 -----------------------------------
command -v "$python" >/dev/null 2>&1 || die "no $python: set PYTHON to the Python that has torch and transformers"
"$python" - <<'EOF' || die "$python cannot run the check (above); set PYTHON to the Python with torch and transformers"
import sys
if sys.version_info < (3, 10):
    sys.exit(f"kvpool needs Python >= 3.10, this is {sys.version.split()[0]}")
missing = []
for name in ("torch", "transformers", "numpy"):
    try:
        __import__(name)
    except Exception as exc:  # a broken install is as missing as an absent one
        missing.append(f"{name} ({exc.__class__.__name__}: {exc})")
if missing:
    sys.exit("missing: " + ", ".join(missing))
import numpy
if tuple(int(x) for x in numpy.__version__.split(".")[:2]) < (1, 24):
    sys.exit(f"kvpool needs numpy >= 1.24, this Python has {numpy.__version__}")
EOF

if [ "$install" = 1 ]; then
    ls "$wheels"/kvpool-*.whl >/dev/null 2>&1 ||
        die "no kvpool wheel in $wheels: run tests/gpu/pack.sh where PyPI is reachable and copy the folder along"
    venv="${KVPOOL_GPU_VENV:-${TMPDIR:-/tmp}/kvpool-gpu-check-venv}"
    log="$out/logs/install.log"
    echo "check.sh: installing kvpool from $wheels into $venv (log: $log)"
    rm -rf "$venv"
    # Debian and Ubuntu Pythons may lack ensurepip (python3-venv): then a venv without pip, driven by the
    # system's pip (visible through --system-site-packages)
    if ! "$python" -m venv --system-site-packages "$venv" >"$log" 2>&1; then
        rm -rf "$venv"
        "$python" -m venv --system-site-packages --without-pip "$venv" >>"$log" 2>&1 ||
            die "cannot create a venv with $python (see $log)"
    fi
    py="$venv/bin/python"
    "$py" -m pip --version >>"$log" 2>&1 || die "no pip for $python (see $log): install python3-pip or python3-venv"
    pip=("$py" -m pip install --disable-pip-version-check --no-input --no-index --find-links "$wheels")
    # kvpool with what it lacks, then kvpool itself again into the venv (a kvpool the machine has is not this one)
    { timeout 300 "${pip[@]}" kvpool && timeout 120 "${pip[@]}" --force-reinstall --no-deps kvpool; } >>"$log" 2>&1 ||
        die "pip could not install kvpool from $wheels (the end of $log says which package has no wheel for this
Python and platform; tests/gpu/pack.sh fetches CPython 3.10-3.13, manylinux x86_64):
$(tail -n 15 "$log")"
    "$py" - <<'EOF' >>"$log" 2>&1 || die "the venv cannot import what the check needs (see $log)"
import sys
import kvpool, kvpool.client, kvpool.master, torch, transformers
print("kvpool", kvpool.__file__, "torch", torch.__version__, torch.__file__, "python", sys.version)
assert kvpool.__file__.startswith(sys.prefix), f"kvpool comes from {kvpool.__file__}, not the venv {sys.prefix}"
EOF
else
    py="$python"
    "$py" -c "import kvpool.master, kvpool.client" 2>/dev/null ||
        die "--no-install: $py cannot import kvpool (install it, or drop --no-install to use tests/gpu/wheels)"
fi

echo "check.sh: running the checks with $py; results in $out"
timeout --kill-after=10 "$limit" "$py" "$here/check.py" --out "$out" --timeout-scale "$scale" ${mode[@]+"${mode[@]}"}
status=$?
case "$status" in
    0|1) exit "$status" ;;
    124|137) echo "check.sh: the checks ran past $limit s and were stopped; partial results in $out" >&2; exit 1 ;;
    *) echo "check.sh: the check driver failed ($status); partial results in $out" >&2; exit 1 ;;
esac
