#!/usr/bin/env bash
# Run HERE (a machine with PyPI), before a device call: downloads into .whl/ (git-ignored, repo root) the
# cp312 x86-64 wheels of tokengym's requirements that the lent GPU machine's image lacks. run.sh installs
# them there offline. Idempotent: a wheel already in .whl/ is not fetched again; another version of the
# same package is removed (two versions stop the offline install). Prints each wheel and the total size.
#
# The image (Python 3.12, torch 2.11, transformers 5.17, numpy, sympy, pyarrow, pandas, fsspec, xxhash,
# huggingface-hub, cloudpickle, packaging, zipp, ...) already holds everything else these wheels require:
# the check at the end lists any requirement found neither here nor in IMAGE below.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${WHL_DIR:-.whl}
PY=${PYTHON:-python3}
# WHL_PYTHON=3.11 WHL_DIR=/tmp/whl311: the same versions for Python 3.11, to test the offline install here
PYV=${WHL_PYTHON:-3.12}

# Versions: those of the dev virtualenv (.venv), so what runs on the GPU is what the CPU tests ran.
WHEELS=(
  tensordict==0.14.3 orjson==3.13.0 pyvers==0.2.3 importlib_metadata==10.2.0 lazy-importer==0.1.0
  torchrl==0.14.1 hoptorch==0.1.4
  gymnasium==1.4.0 farama-notifications==0.0.6
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  # datasets is imported lazily (llm_envs/tasks/files.py); small, so it travels too
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
# Distributions in the GPU image ('cuda'; /work/.library/device/KINDS.md, "Python packages already there").
IMAGE="aiohttp aiosignal attrs certifi charset-normalizer click cloudpickle filelock fsspec hf-xet httpx
huggingface-hub idna jinja2 markupsafe mpmath networkx numpy packaging pandas peft pillow psutil pyarrow
pytest pytest-benchmark python-dateutil pyyaml regex requests safetensors six sympy tokenizers torch
tqdm transformers triton typing-extensions urllib3 xxhash yarl zipp hypothesis setuptools wheel"

PLATFORM=(--python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64)
mkdir -p "$DEST"
norm() { echo "$1" | tr 'A-Z.-' 'a-z__'; }  # a wheel file's name part, lower-cased

for spec in "${WHEELS[@]}"; do
  name=$(norm "${spec%%==*}") version=${spec##*==}
  other=$(find "$DEST" -maxdepth 1 -iname "${name}-*.whl" ! -iname "${name}-${version}-*" -printf '%f\n')
  [ -z "$other" ] || (cd "$DEST" && rm -v $other)
  if ls "$DEST" | grep -qi "^${name}-${version}-"; then continue; fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$DEST" "$spec" 2>&1 |
    { grep -v 'is ignored: it is neither a file nor a directory' || true; }
  ls "$DEST" | grep -qi "^${name}-${version}-" || { echo "fetch_wheels: no wheel for $spec" >&2; exit 1; }
done

# Every Requires-Dist (extras skipped, markers for Python 3.12 on Linux x86-64) must be a wheel here or
# a package of the image.
"$PY" - "$DEST" "$IMAGE" "$PYV" <<'EOF'
import re, sys, zipfile, pathlib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
dest, image = pathlib.Path(sys.argv[1]), set(sys.argv[2].split())
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
env = {"python_version": sys.argv[3], "python_full_version": sys.argv[3] + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
have, reqs = {}, []
for whl in sorted(dest.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    name = canon(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip())
    have[name] = re.search(r"^Version: (.+)$", meta, re.M).group(1).strip()
    reqs += [(name, Requirement(r)) for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
bad = 0
for who, r in reqs:
    if r.marker is not None and not r.marker.evaluate(env):
        continue
    n = canon(r.name)
    if n in have:
        if have[n] not in r.specifier:
            print(f"CONFLICT: {who} needs {r}, .whl has {n} {have[n]}"); bad += 1
    elif n not in image:
        print(f"MISSING: {who} needs {r}: neither in .whl/ nor in the GPU image"); bad += 1
sys.exit(1 if bad else 0)
EOF

ls -l "$DEST"/*.whl | awk '{printf "%9d  %s\n", $5, $NF}'
du -cb "$DEST"/*.whl | tail -1 | awk '{printf "total: %d wheels, %.1f MiB\n", n, $1/1048576}' n="$(ls "$DEST"/*.whl | wc -l)"
