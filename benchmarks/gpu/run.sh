#!/usr/bin/env bash
# Run ON the lent GPU machine, from the repo root, with .whl/ carried (see README.md beside this file):
#   1. installs the wheels of .whl/ (benchmarks/gpu/fetch_wheels.sh) and tokengym itself, offline, into
#      /tmp/site (not editable: setup.py maps folders, so a PYTHONPATH to the repo is not enough);
#   2. writes the versions to $OUT/env.txt;  3. runs test/gpu (-m gpu) into $OUT/gpu_tests.log;
#   4. runs benchmarks/gpu/bench.py (its $OUT/gpu_bench.md and .json; output in $OUT/bench.log);
#   5. prints the markdown table. A failing step does not stop the next; the exit status is the worst.
# Arguments are forwarded to bench.py after the defaults (--device cuda --size real --budget-s N), so they
# override them.
# Dry run here: no wheels installed, the venv's python, the tests' CPU parameters (-m "not gpu": the cuda ones
# carry the gpu mark), bench defaults --device cpu --size tiny:   bash benchmarks/gpu/run.sh --dry-run
# Without nvidia-smi the script always dry-runs. Environment: OUT (default ./gpu_out), PYTHON (interpreter),
# TEST_MARK (pytest -m), TEST_TIMEOUT / BENCH_TIMEOUT (seconds, 180 / 270).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $DRY = 0 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "run.sh: no nvidia-smi here: dry run"; DRY=1
fi
if [ $DRY = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}; MARK=${TEST_MARK:-not gpu}; BENCH_DEFAULTS=(--device cpu --size tiny)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  PY=${PYTHON:-python3}; MARK=${TEST_MARK:-gpu}; BENCH_DEFAULTS=(--device cuda --size real)
fi
TEST_TIMEOUT=${TEST_TIMEOUT:-180} BENCH_TIMEOUT=${BENCH_TIMEOUT:-270}  # seconds, each step
BENCH_DEFAULTS+=(--budget-s $((BENCH_TIMEOUT - 60)))  # bench.py skips throughput sizes that would overrun
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

# 1. offline install (GPU machine only): the image has no tensordict, torchrl, gymnasium, math-verify, datasets
if [ $DRY = 0 ]; then
  step "install .whl/ and tokengym into /tmp/site"
  ls .whl/*.whl >/dev/null 2>&1 || { echo "run.sh: no .whl/*.whl: run fetch_wheels.sh and carry .whl"; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
      --target /tmp/site . || { echo "run.sh: offline install failed"; exit 2; }
  export PYTHONPATH=/tmp/site
fi

# 2. versions. PYTHONSAFEPATH: with `python -m`/`-c` the cwd (repo root, whose tokengym/ holds only the top
# package) would come first on sys.path and hide the installed tokengym.
step "versions -> $OUT/env.txt"
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  dry_run: $DRY"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
  fi
  PYTHONSAFEPATH=1 "$PY" - <<'EOF'
import importlib, importlib.metadata as md, platform
print("python:", platform.python_version(), platform.machine())
import torch
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "cuda available:", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for dist in ["transformers", "tokenizers", "tensordict", "torchrl", "gymnasium", "math-verify", "datasets",
             "numpy", "tokengym"]:
    try:
        v = md.version(dist)
    except md.PackageNotFoundError:
        v = "NOT INSTALLED"
    print(f"{dist}: {v}")
for mod in ["tokengym", "tokengym.collectors", "tokengym.transforms", "tokengym.llm_envs", "tokengym.testing",
            "math_verify", "datasets", "torchrl._torchrl"]:
    try:
        m = importlib.import_module(mod)
        print(f"import {mod}: ok", getattr(m, "__file__", "") if mod == "tokengym" else "")
    except Exception as e:  # noqa: BLE001 -- recorded, not fatal
        print(f"import {mod}: FAILED {type(e).__name__}: {str(e)[:200]}")
EOF
} 2>&1 | tee "$OUT/env.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

# 3. GPU tests: the path given, pyproject's testpaths are not collected (its addopts --doctest-modules and
# --import-mode=importlib then apply to test/gpu alone)
step "pytest test/gpu -m \"$MARK\" -> $OUT/gpu_tests.log"
if [ -d test/gpu ]; then
  PYTHONSAFEPATH=1 timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest test/gpu -m "$MARK" -q -p no:cacheprovider \
    >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  tail -n 15 "$OUT/gpu_tests.log"
else
  echo "no test/gpu folder" | tee "$OUT/gpu_tests.log"; rc=4
fi
echo "pytest exit status: $rc" | tee -a "$OUT/gpu_tests.log" "$OUT/env.txt"
[ $rc = 0 ] || status=1

# 4. benchmark
step "bench.py ${BENCH_DEFAULTS[*]} $* -> $OUT/gpu_bench.md, gpu_bench.json"
if [ -f benchmarks/gpu/bench.py ]; then
  timeout -k 10 "$BENCH_TIMEOUT" "$PY" benchmarks/gpu/bench.py "${BENCH_DEFAULTS[@]}" --out "$OUT" "$@" \
    >"$OUT/bench.log" 2>&1
  rc=$?
  tail -n 3 "$OUT/bench.log"
else
  echo "no benchmarks/gpu/bench.py" | tee "$OUT/bench.log"; rc=4
fi
echo "bench exit status: $rc" | tee -a "$OUT/bench.log" "$OUT/env.txt"
[ $rc = 0 ] || status=1

# 5. the table; at most 8 files come back from $OUT: any beyond the known ones go into one archive
step "results"
cat "$OUT/gpu_bench.md" 2>/dev/null || echo "(no $OUT/gpu_bench.md)"
extra=$(cd "$OUT" && find . -type f ! -name env.txt ! -name gpu_tests.log ! -name bench.log ! -name gpu_bench.md \
  ! -name gpu_bench.json ! -name extra.tar.gz | sort)
if [ -n "$extra" ]; then
  (cd "$OUT" && tar czf extra.tar.gz $extra && rm -f $extra && find . -mindepth 1 -type d -empty -delete)
fi
echo; echo "files in $OUT:"; (cd "$OUT" && find . -type f | sort)
echo "run.sh exit status: $status"
exit $status
