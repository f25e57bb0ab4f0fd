#!/usr/bin/env bash
# Where PyPI is reachable: put into tests/gpu/wheels/ (or the folder given) what tests/gpu/check.sh installs on a
# GPU machine without network: kvpool's own wheel, and wheels of its service dependencies (pyproject.toml's
# [project] dependencies but numpy, which every machine with transformers has) for CPython 3.10, 3.11, 3.12 and
# 3.13 on manylinux x86_64 (glibc 2.17 wheels where they exist, else 2.28; a source archive where a package has
# none: building one needs a compiler there). check.sh installs only those the machine lacks or has too old.
#
#   tests/gpu/pack.sh [FOLDER]        PYTHON: the Python that builds kvpool's wheel (default python3; needs pip
#                                     and setuptools >= 68)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
wheels="${1:-$here/wheels}"
python="${PYTHON:-python3}"
versions=(3.10 3.11 3.12 3.13)
mkdir -p "$wheels"
wheels="$(cd "$wheels" && pwd)"
pip=("$python" -m pip --disable-pip-version-check --no-input)

echo "pack.sh: kvpool's wheel"
rm -f "$wheels"/kvpool-*.whl
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
# a copy of what the wheel is made of (pyproject.toml's package-dir), so the build leaves nothing in the checkout
tar -C "$repo" --exclude=__pycache__ -cf - pyproject.toml README.md kvpool master client | tar -C "$build" -xf -
"${pip[@]}" wheel --quiet --no-deps --no-build-isolation -w "$wheels" "$build"

# the dependencies, one requirement a line, from pyproject.toml
mapfile -t requirements < <("$python" - "$repo/pyproject.toml" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
try:
    import tomllib
    deps = tomllib.loads(text)["project"]["dependencies"]
except ImportError:  # Python 3.10: the list is simple enough to read
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    deps = re.findall(r'^\s*"([^"]+)"', block, re.M)
for dep in deps:
    if re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0].lower() != "numpy":
        print(dep)
EOF
)
echo "pack.sh: ${#requirements[@]} dependencies: ${requirements[*]}"

fallbacks=()
for version in "${versions[@]}"; do
    abi="cp${version/./}"
    target=(--only-binary=:all: --python-version "$version" --implementation cp --abi "$abi" -d "$wheels")
    old=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
    new=("${old[@]}" --platform manylinux_2_28_x86_64)
    echo "pack.sh: CPython $version"
    if "${pip[@]}" download --quiet "${target[@]}" "${old[@]}" "${requirements[@]}"; then
        continue
    fi
    for requirement in "${requirements[@]}"; do  # one at a time, to see which lacks a wheel for glibc 2.17
        "${pip[@]}" download --quiet "${target[@]}" "${old[@]}" "$requirement" 2>/dev/null && continue
        if "${pip[@]}" download --quiet "${target[@]}" "${new[@]}" "$requirement" 2>/dev/null; then
            fallbacks+=("$requirement for $version: a glibc 2.28 wheel")
        else
            "${pip[@]}" download --quiet --no-binary=:all: --no-deps -d "$wheels" "$requirement"
            fallbacks+=("$requirement for $version: source only (needs a compiler on the GPU machine)")
        fi
    done
done

{
    echo "# made by tests/gpu/pack.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ) for CPython ${versions[*]}, manylinux x86_64"
    for line in ${fallbacks[@]+"${fallbacks[@]}"}; do echo "# fallback: $line"; done
    find "$wheels" -maxdepth 1 -type f \( -name '*.whl' -o -name '*.tar.gz' \) -printf '%f\n' | sort
} >"$wheels/MANIFEST.txt"
echo "pack.sh: $(grep -vc '^#' "$wheels/MANIFEST.txt") files, $(du -sh "$wheels" | cut -f1) in $wheels"
for line in ${fallbacks[@]+"${fallbacks[@]}"}; do echo "pack.sh: fallback: $line"; done
