#!/usr/bin/env bash
# The streaming (cold) MoE layer on the device machine, in one short call: the kernel modules compiled, the editable
# install and the 2-layer slice made side by side; the streaming path's GPU tests ($TESTS, -k $TESTS_K); then
# `coli bench stream` with cold-ram, sync and spec-ram on/off (the rows whose per-layer device timeline
# coli/bench/layer_timeline.py splits: router -> first copy, gaps, copies, tail). ~70 s on the H200.
# Results under $OUT: slice.log, setup.log, gpu-tests.log, gpu-results.jsonl, bench.log, bench_stream.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
SLICE=${SLICE:-/tmp/coli_slice2}
N=${N:-16}
TESTS=${TESTS:-"tests/gpu/test_gpu_vram.py tests/gpu/test_gpu_graphs.py"}
TESTS_K=${TESTS_K:-"stream or segment or spec or fault or eviction or oversize or stage"}
export PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$OUT"
T0=$(date +%s)
at() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if [ ! -f "$SLICE/coli-manifest.json" ]; then
    ( timeout 200 python3 -m coli.cli.main bench make-slice "$SLICE" --layers 2 --trace glm52 --vocab 4096 \
        --threads 8 --no-progress --force >"$OUT/slice.log" 2>&1; echo "make-slice exit $?" >>"$OUT/slice.log" ) &
fi
if [ "${SKIP_TESTS:-0}" != 1 ] && ! python3 -c "import coli.kernels, coli.stages" 2>/dev/null; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/setup.log" 2>&1 &
fi
for m in $(python3 -c "from coli.gpu.cuda_runtime import MODULES; print(' '.join(MODULES))"); do
    timeout 200 python3 -c "from coli.gpu.cuda_runtime import get_runtime; get_runtime().module('$m')" \
        >>"$OUT/setup.log" 2>&1 &
done
wait
at "setup, kernels and slice done: $(tail -1 "$OUT/slice.log" 2>/dev/null)"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    COLI_GPU_REPORT=$OUT COLI_CUDA_SYNC=1 timeout 150 python3 -m pytest -q -m gpu $TESTS -k "$TESTS_K" \
        -p no:cacheprovider -o addopts="" --timeout 140 -ra -n 2 --dist loadfile >"$OUT/gpu-tests.log" 2>&1
    at "gpu tests exit $?: $(grep -E 'passed|failed' "$OUT/gpu-tests.log" | tail -1)"
fi
timeout 200 python3 -m coli.cli.main bench stream "$SLICE" --scenario cold-ram,sync,spec --tokens "$N" --vram-gb 16 \
    --ram-gb 64 --tile-kb 1024 --json-out "$OUT/bench_stream.json" >"$OUT/bench.log" 2>&1
at "bench stream exit $?"
grep -E "^(cold-ram|sync|spec-ram|spec-ram-off):" "$OUT/bench.log"
python3 - "$OUT/bench_stream.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    lp, sp = r.get("layer_phases") or {}, r.get("spec") or {}
    print(f"{r['scenario']:13s} tok/s {r.get('tokens_per_s_glm5') or 0:.3f} moe_ms {r.get('moe_layer_ms') or 0:.3f} "
          f"dense_us {(lp.get('dense_us') or {}).get('mean') or 0:.0f} handoffs {sp.get('spec_handoffs')} "
          f"handoff_MB {(sp.get('spec_handoff_bytes') or 0) / 1e6:.0f} spec_loads {sp.get('spec_loads')}")
print("dense_layer_ms", d.get("dense_layer_ms"), "h2d peak", (d.get("h2d_peak") or {}).get("whole_GBps"))
PY
