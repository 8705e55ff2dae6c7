#!/usr/bin/env bash
# The GPU suite, run on the CUDA machine from the repository root:
#
#   bash scripts/gpu_suite.sh [tests] [compile] [bench]     # no argument = all three; results under $OUT
#
# setup    installs the carried wheels (.gpuwheels/*.whl: PyCUDA + deps, pyzmq, structlog, transformers 5.23)
#          into /tmp/site unless PyCUDA already imports, the repository itself (editable: coli.kernels and
#          coli.stages map to cuda/ and stages/), and compiles the kernel modules once, one process per module,
#          into PyCUDA's on-disk cache;
# tests    the GPU tests (tests/gpu, marker `gpu`), COLI_CUDA_SYNC=1 so a failing kernel is named;
# compile  the nvcc compile test for sm_86/89/90/120 (tests/test_kernels_compile.py; CPU only, runs beside tests);
# bench    scripts/bench_kernels.py (D2D copy vs the fused MoE decode GEMV, other kernels at GLM-5 shapes).
#
# Every step has a timeout and logs straight into $OUT, so even a step cut short leaves its log:
#   env.txt (versions, install, compile), gpu-tests.log, gpu-results.jsonl, compile-test.log, bench.log,
#   bench.json, summary.txt.  Typical wall time for all three: 4-6 min; worst case (every timeout) ~9 min.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
SITE=${COLI_GPU_SITE:-/tmp/site}
STAGES="${*:-tests compile bench}"
has() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/env.txt"; }

# ---- setup ------------------------------------------------------------------------------------------------
if ! python3 -c "import pycuda" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpuwheels/*.whl >>"$OUT/env.txt" 2>&1
fi
export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import coli.kernels, coli.stages" 2>/dev/null; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 \
        || log "editable install failed; coli is imported from the working tree"
fi
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    nvcc --version | tail -1
    python3 -c "import sys, numpy, torch, transformers, pycuda; print(sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'pycuda', pycuda.VERSION_TEXT)"
    python3 -c "import coli.gpu.cuda_runtime as r; print('kernels', r.kernels_dir())"
} >>"$OUT/env.txt" 2>&1
log "setup done; stages: $STAGES"

if has tests || has bench; then      # compile every kernel module once, in parallel, into PyCUDA's cache
    MODS=$(python3 -c "from coli.gpu.cuda_runtime import MODULES; print(' '.join(MODULES))")
    for m in $MODS; do
        timeout 240 python3 -c "
import time; from coli.gpu.cuda_runtime import get_runtime
t = time.perf_counter(); get_runtime().module('$m'); print('compiled $m in %.1f s' % (time.perf_counter() - t))
" >>"$OUT/env.txt" 2>&1 &
    done
    wait
    log "kernel modules compiled"
fi

rc=0
if has compile; then       # CPU only: runs beside the GPU tests
    ( timeout 240 python3 -m pytest -q tests/test_kernels_compile.py -p no:cacheprovider -o addopts="" \
        >"$OUT/compile-test.log" 2>&1; echo "exit $?" >>"$OUT/compile-test.log" ) &
    COMPILE_PID=$!
fi

if has tests; then
    rm -f "$OUT/gpu-results.jsonl"
    XDIST=""
    python3 -c "import xdist" 2>/dev/null && XDIST="-n 5 --dist loadfile"
    COLI_GPU_REPORT=$OUT COLI_CUDA_SYNC=1 timeout 330 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
        -o addopts="" --timeout 280 -ra $XDIST >"$OUT/gpu-tests.log" 2>&1
    st=$?
    [ $st -eq 0 ] || rc=1
    log "gpu tests exit $st"
    tail -30 "$OUT/gpu-tests.log"
fi

if has compile; then
    wait $COMPILE_PID
    grep -q "^exit 0$" "$OUT/compile-test.log" || rc=1
    log "compile test: $(tail -2 "$OUT/compile-test.log" | tr '\n' ' ')"
fi

if has bench; then
    timeout 150 python3 scripts/bench_kernels.py --json-out "$OUT/bench.json" >"$OUT/bench.log" 2>&1
    st=$?
    [ $st -eq 0 ] || rc=1
    log "bench exit $st"
    tail -40 "$OUT/bench.log"
fi

python3 - "$OUT" >"$OUT/summary.txt" 2>&1 <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
p = out / "gpu-results.jsonl"
rows = [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.exists() else []
for r in rows:
    if r["kind"] in ("e2e_f32", "int4_agreement"):
        print(json.dumps(r))
worst = {}
for r in rows:
    if "rel_err" in r:
        worst[r["kind"]] = max(worst.get(r["kind"], 0.0), r["rel_err"])
print("worst relative error per kernel family:", json.dumps(worst))
b = out / "bench.json"
if b.exists():
    j = json.loads(b.read_text())
    for line in j.get("moe_summary", []):     # the fused MoE decode's lines, as scripts/bench_kernels.py printed them
        print(line)
PYEOF
cat "$OUT/summary.txt"
log "gpu suite exit status: $rc"
exit $rc
