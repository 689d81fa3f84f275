#!/usr/bin/env bash
# One command for a GPU machine: the backend conformance suite on cuda (or rocm) and the Triton kernel benchmark.
#
#   scripts/gpu_check.sh [cuda|rocm] [OUT_DIR]        (OUT_DIR defaults to $OUT, else ./gpu_check_out)
#
# Writes to OUT_DIR: env.txt (torch/triton/GPU), conformance.txt (pytest output), kernels.txt (benchmark table),
# kernels.json (the benchmark's JSON line), train.txt/train.json (benchmarks/gpu_train.py: whole training runs on the
# device vs the CPU reference; SKIP_TRAIN=1 skips them), summary.txt (one line per step with its exit code).
# Environment: PYTHON (default python3), SIZE (benchmark size: full|small, default full), CONF_TIMEOUT,
# BENCH_TIMEOUT, TRAIN_TIMEOUT (seconds per step, default 900: a hung step is cut and reported, exit 124).
# If crosstrain is not installed, it is made importable offline without building anything: a temporary folder
# maps core/ -> crosstrain (backends/, plugins/ inside it) and carries the entry points from pyproject.toml.
# Exit code: 0 when the conformance suite passed and the benchmark ran, 2 when the backend is unavailable here
# (everything skipped: nothing verified), else 1.
set -uo pipefail

BACKEND="${1:-cuda}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${2:-${OUT:-$REPO/gpu_check_out}}"
PY="${PYTHON:-python3}"
SIZE="${SIZE:-full}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
: > "$OUT_DIR/summary.txt"
say() { echo "[gpu_check] $*" | tee -a "$OUT_DIR/summary.txt"; }
cd "$REPO" || exit 1

"$PY" - > "$OUT_DIR/env.txt" 2>&1 <<'PYEOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "hip", getattr(torch.version, "hip", None))
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton missing:", exc)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
PYEOF
cat "$OUT_DIR/env.txt"

has_crosstrain() {
  "$PY" -c "import importlib.metadata as m, crosstrain; assert any(e.name == '$BACKEND' for e in m.entry_points(group='crosstrain'))" 2>/dev/null
}
if ! has_crosstrain; then
  SHIM="$("$PY" "$REPO/scripts/offline_shim.py" "$REPO")"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  if has_crosstrain; then say "crosstrain not installed: using the offline shim at $SHIM"; else
    say "crosstrain cannot be imported (missing dependency?):"; "$PY" -c "import crosstrain" 2>&1 | tail -3 | tee -a "$OUT_DIR/summary.txt"
  fi
fi

"$PY" -m crosstrain backends --json > "$OUT_DIR/backends.json" 2>&1
say "backends: $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('; '.join(f\"{b['name']}={'yes' if b['available'] else 'no'}\" for b in d['backends']))" "$OUT_DIR/backends.json" 2>&1)"

AVAIL="$("$PY" -c "from crosstrain import registry; a = registry.get_backend('$BACKEND').availability(); print('yes' if a else 'no: ' + a.reason)" 2>&1 | tail -1)"
if [ "$AVAIL" != "yes" ]; then
  say "backend $BACKEND unavailable here ($AVAIL): nothing was verified on hardware"
fi

# From an empty folder and without TRITON_INTERPRET: run from the repo, pytest would load tests/conftest.py (its
# testpaths), which turns the Triton interpreter on for CPU CI, and the kernels would be interpreted, not compiled.
(cd "$(mktemp -d)" && env -u TRITON_INTERPRET timeout "${CONF_TIMEOUT:-900}" "$PY" -m pytest -q -p no:cacheprovider -rs \
  --pyargs crosstrain.testing.conformance --backend "$BACKEND") > "$OUT_DIR/conformance.txt" 2>&1
CONF_RC=$?
say "conformance ($BACKEND): exit $CONF_RC: $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT_DIR/conformance.txt" | tail -1)"

timeout "${BENCH_TIMEOUT:-900}" "$PY" benchmarks/kernels.py --size "$SIZE" > "$OUT_DIR/kernels.txt" 2>&1
BENCH_RC=$?
tail -1 "$OUT_DIR/kernels.txt" > "$OUT_DIR/kernels.json"
say "kernels benchmark: exit $BENCH_RC"
cat "$OUT_DIR/kernels.txt" | sed '$d'
say "kernels json: $(cut -c1-400 "$OUT_DIR/kernels.json")"

# Whole training runs on the device next to the CPU reference (fp32 parity, then a bf16 throughput run).
if [ "$AVAIL" = "yes" ] && [ "${SKIP_TRAIN:-0}" != "1" ]; then
  timeout "${TRAIN_TIMEOUT:-900}" "$PY" benchmarks/gpu_train.py --backend "$BACKEND" --out "$(mktemp -d)" > "$OUT_DIR/train.txt" 2>&1
  TRAIN_RC=$?
  tail -1 "$OUT_DIR/train.txt" > "$OUT_DIR/train.json"
  say "training runs: exit $TRAIN_RC"
  sed '$d' "$OUT_DIR/train.txt"
  say "train json: $(cut -c1-600 "$OUT_DIR/train.json")"
else
  TRAIN_RC=0
fi

[ "$AVAIL" != "yes" ] && exit 2
[ "$CONF_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$TRAIN_RC" -eq 0 ] && exit 0
exit 1
