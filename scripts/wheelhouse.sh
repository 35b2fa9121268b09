#!/usr/bin/env bash
# A wheelhouse for a GPU node without internet whose image has torch: bash scripts/wheelhouse.sh DIR [options]
# Downloads every dependency of deit-ablate (pyproject.toml's, with their whole closure) as wheels for the target
# Python and platform, EXCEPT torch and torchvision and their closure (nvidia-*, triton, sympy, ...) and numpy, which
# the image's torchvision brings, builds antlr4-python3-runtime's wheel (hydra-core's; a source archive only) and the
# project's own wheel, and puts them in DIR. The analysis extra (the aggregator's scipy and matplotlib) is left out:
# training and deit-status never import it. On the node: pip install --no-index --find-links DIR deit-ablate, in a
# venv that sees torch (docs/gpu.md). torch, torchvision and numpy are kept out by resolving against stand-in wheels
# of them (no files, no dependencies) that are dropped afterwards; the listing is checked for any torch,
# torchvision, triton, numpy or nvidia wheel. It fails if DIR is over 48 MiB (a 64 MiB transfer with the checkout).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
ANTLR=4.9.3  # omegaconf 2.3 (hydra-core 1.3) pins antlr4-python3-runtime==4.9.*; 4.9.3 is its last
TORCH_STAND_IN=2.14.1  # the versions scripts/install.sh pins; any torch>=2.4 / torchvision>=0.19 on the node does
TORCHVISION_STAND_IN=0.29.1
NUMPY_STAND_IN=2.4.6  # what torchvision 0.29.1 brings; the project's closure asks numpy>=1.19.3 (simplejpeg)
LIMIT_MIB=48  # the wheelhouse's share of a 64 MiB transfer: the checkout and the logs' room beside it

usage() {
    cat >&2 <<EOF
usage: bash scripts/wheelhouse.sh DIR [--python 3.12|local] [--platform P]... [--with-dev] [--with-dali]
                                       [--with-analysis]
       bash scripts/wheelhouse.sh --list [the same options]
  --python     the node's Python, X.Y (default 3.12); 'local' takes this machine's ($PYTHON)
  --platform   a pip platform tag, repeatable (default manylinux_2_28_x86_64: glibc 2.28 and older wheels; wandb
               0.31 ships no older Linux wheel); manylinux_2_N_ARCH brings every manylinux_2_17..N_ARCH with it
  --with-dev   add the dev extra (pytest, pytest-xdist, ruff) to run the tests on the node
  --with-dali  add the dali extra (nvidia-dali, about 476 MB installed): left out by default, as it does not fit a
               small transfer
  --with-analysis  add the analysis extra (scipy and matplotlib: the aggregator's; about 51 MiB), and with it
               no size limit: left out by default, as training and deit-status never import it
  --list       print the requirements it would download and what it leaves out, and stop (no network, no DIR)
EOF
    exit 2
}

DIR="" PY_VERSION=3.12 PLATFORMS=() WITH_DEV=0 WITH_DALI=0 WITH_ANALYSIS=0 LIST=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || usage; PY_VERSION=$2; shift 2 ;;
        --platform) [ $# -ge 2 ] || usage; PLATFORMS+=("$2"); shift 2 ;;
        --with-dev) WITH_DEV=1; shift ;;
        --with-dali) WITH_DALI=1; shift ;;
        --with-analysis) WITH_ANALYSIS=1; shift ;;
        --list) LIST=1; shift ;;
        -h|--help) usage ;;
        -*) echo "wheelhouse: unknown option $1" >&2; usage ;;
        *) [ -z "$DIR" ] || { echo "wheelhouse: one DIR only (got $DIR and $1)" >&2; usage; }; DIR=$1; shift ;;
    esac
done
[ -n "$DIR" ] || [ "$LIST" = 1 ] || usage
"$PYTHON" -c "" 2>/dev/null || { echo "wheelhouse: no Python at $PYTHON; set PYTHON=..." >&2; exit 2; }
[ "$PY_VERSION" != local ] || PY_VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$PY_VERSION" =~ ^3\.[0-9]+$ ]] || { echo "wheelhouse: --python takes X.Y (3.12) or 'local', not '$PY_VERSION'" >&2; exit 2; }
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=(manylinux_2_28_x86_64)

# pip matches a platform tag exactly: manylinux_2_28 alone would skip every manylinux_2_17 (manylinux2014) wheel.
PLATFORM_ARGS=()
for platform in "${PLATFORMS[@]}"; do
    if [[ "$platform" =~ ^manylinux_2_([0-9]+)_(.+)$ ]] && [ "${BASH_REMATCH[1]}" -ge 17 ]; then
        for ((glibc = BASH_REMATCH[1]; glibc >= 17; glibc--)); do
            PLATFORM_ARGS+=(--platform "manylinux_2_${glibc}_${BASH_REMATCH[2]}")
        done
        PLATFORM_ARGS+=(--platform "manylinux2014_${BASH_REMATCH[2]}")
    else
        PLATFORM_ARGS+=(--platform "$platform")
    fi
done

# The requirements: pyproject.toml's dependencies (and the extras asked for), torch and torchvision marked.
REQUIREMENTS=$("$PYTHON" - "$ROOT/pyproject.toml" "$WITH_DEV" "$WITH_DALI" "$WITH_ANALYSIS" <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
requirements = list(project["dependencies"])
for extra, wanted in (("dev", sys.argv[2]), ("dali", sys.argv[3]), ("analysis", sys.argv[4])):
    if wanted == "1":
        requirements += project["optional-dependencies"][extra]
print("\n".join(requirements))
EOF
)
is_torch() { [[ "$1" =~ ^(torch|torchvision)([^A-Za-z0-9_.-]|$) ]]; }
if [ "$LIST" = 1 ]; then
    echo "# for Python $PY_VERSION on ${PLATFORMS[*]}, with the whole closure of:"
    while IFS= read -r requirement; do is_torch "$requirement" || echo "$requirement"; done <<< "$REQUIREMENTS"
    echo "antlr4-python3-runtime==$ANTLR  # built here: a source archive only"
    echo "deit-ablate  # this checkout's wheel"
    echo "# left out (the node's image has them): torch, torchvision and their closure (nvidia-*, triton, ...), numpy"
    [ "$WITH_DALI" = 1 ] || echo "# left out: nvidia-dali (about 476 MB installed; --with-dali adds it)"
    [ "$WITH_ANALYSIS" = 1 ] || echo "# left out: the analysis extra, scipy and matplotlib (the aggregator's;" \
        "--with-analysis adds it)"
    exit 0
fi
if [ -e "$DIR" ] && [ -n "$(ls -A "$DIR")" ]; then
    echo "wheelhouse: $DIR exists and is not empty; remove it or name a new folder" >&2
    exit 2
fi

# Built beside DIR and renamed at the end: a failed download leaves no half-filled DIR.
mkdir -p "$(dirname "$DIR")"
WORK=$(mktemp -d "${DIR%/}.partial.XXXXXX")
STAND_INS=$(mktemp -d)
trap 'rm -rf "$WORK" "$STAND_INS"' EXIT
"$PYTHON" - "$STAND_INS" "torch==$TORCH_STAND_IN+standin" "torchvision==$TORCHVISION_STAND_IN+standin" \
    "numpy==$NUMPY_STAND_IN+standin" <<'EOF'
"""Empty wheels that satisfy torch/torchvision/numpy requirements, so the resolver never reaches their closure."""
import base64, hashlib, sys, zipfile
for spec in sys.argv[2:]:
    name, version = spec.split("==")
    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelhouse.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text)}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(f"{sys.argv[1]}/{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            wheel.writestr(path, text)
EOF
printf 'torch==%s+standin\ntorchvision==%s+standin\nnumpy==%s+standin\n' "$TORCH_STAND_IN" "$TORCHVISION_STAND_IN" \
    "$NUMPY_STAND_IN" > "$STAND_INS/constraints.txt"

echo "wheelhouse: antlr4-python3-runtime $ANTLR and deit-ablate, built as wheels"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK" "antlr4-python3-runtime==$ANTLR"
# From a copy of what the wheel holds: an in-tree build would leave build/ and an egg-info in the checkout.
mkdir "$STAND_INS/project"
tar -C "$ROOT" --exclude=__pycache__ -cf - pyproject.toml README.md deit_ablate hydra_plugins | tar -C "$STAND_INS/project" -xf -
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK" "$STAND_INS/project"
echo "wheelhouse: downloading the closure for Python $PY_VERSION on ${PLATFORMS[*]} (torch, torchvision and numpy" \
    "left out)"
mapfile -t REQUIREMENT_ARGS <<< "$REQUIREMENTS"
"$PYTHON" -m pip download --quiet --dest "$WORK" --only-binary=:all: --implementation cp \
    --python-version "$PY_VERSION" "${PLATFORM_ARGS[@]}" --find-links "$WORK" --find-links "$STAND_INS" \
    --constraint "$STAND_INS/constraints.txt" "${REQUIREMENT_ARGS[@]}"
rm -f "$WORK"/torch-*+standin-*.whl "$WORK"/torchvision-*+standin-*.whl "$WORK"/numpy-*+standin-*.whl

FORBIDDEN=$(cd "$WORK" && ls | grep -iE '^(torch|torchvision|triton|numpy)-' || true)
[ "$WITH_DALI" = 1 ] || FORBIDDEN+=$(cd "$WORK" && ls | grep -iE '^nvidia[_-]' || true)
if [ -n "$FORBIDDEN" ]; then
    echo "wheelhouse: the closure brought in what it must leave out: $FORBIDDEN" >&2
    exit 1
fi
BYTES=$(cat "$WORK"/*.whl | wc -c)
MIB=$("$PYTHON" -c "print(f'{$BYTES / 2**20:.1f}')")
if [ "$WITH_ANALYSIS" = 0 ] && [ "$WITH_DALI" = 0 ] && [ "$BYTES" -gt $((LIMIT_MIB * 2**20)) ]; then
    echo "wheelhouse: the wheels add up to $MIB MiB, over the $LIMIT_MIB MiB a node's transfer leaves them; the" \
        "largest: $(cd "$WORK" && ls -S | head -3 | tr '\n' ' ')" >&2
    exit 1
fi
mkdir -p "$DIR" && rmdir "$DIR"
mv "$WORK" "$DIR"
ls -1 "$DIR"
echo "wheelhouse: $(ls "$DIR" | wc -l) wheels in $DIR, $MIB MiB in all (torch, torchvision and numpy not among" \
    "them$([ "$WITH_DALI" = 1 ] || echo "; nvidia-dali left out: about 476 MB installed, too big for a small" \
    "transfer; --with-dali adds it")$([ "$WITH_ANALYSIS" = 1 ] || echo "; the analysis extra (scipy," \
    "matplotlib) left out: --with-analysis adds it"))"
