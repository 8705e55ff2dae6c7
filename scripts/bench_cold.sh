#!/usr/bin/env bash
# The streaming (cold) MoE layer on the device machine, in one call: the GPU tests of the streaming path
# (tests/gpu/test_gpu_vram.py, test_gpu_graphs.py, test_gpu_e2e.py) while the 2-layer slice is made, then
# `coli bench stream` with cold-ram, sync and spec-ram on/off (the rows whose per-layer device timeline
# `coli/bench/layer_timeline.py` splits: router -> first copy, gaps, copies, tail). ~3 min on the H200.
# Results under $OUT: env.txt, gpu-tests.log, gpu-results.jsonl, summary.txt (scripts/gpu_suite.sh), slice.log,
# bench.log, bench_stream.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
SLICE=${SLICE:-/tmp/coli_slice2}
N=${N:-16}
TESTS=${TESTS:-"tests/gpu/test_gpu_vram.py tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_e2e.py"}
mkdir -p "$OUT"
T0=$(date +%s)
if [ ! -f "$SLICE/coli-manifest.json" ]; then
    ( timeout 200 python3 -m coli.cli.main bench make-slice "$SLICE" --layers 2 --trace glm52 --vocab 4096 \
        --threads 10 --no-progress --force >"$OUT/slice.log" 2>&1; echo "make-slice exit $? at $(( $(date +%s) - T0 )) s" \
        >>"$OUT/slice.log" ) &
    SLICE_PID=$!
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    # scripts/gpu_suite.sh's setup and kernel compile, then only the streaming path's GPU tests
    sed -e "s#-m gpu tests/gpu -p#-m gpu $TESTS -p#" -e 's#timeout 330 python3#timeout 150 python3#' \
        -e 's#--timeout 280#--timeout 140#' scripts/gpu_suite.sh >scripts/_gpu_suite_cold.sh
    OUT=$OUT bash scripts/_gpu_suite_cold.sh tests
    echo "[$(( $(date +%s) - T0 ))s] tests done"
fi
[ -n "${SLICE_PID:-}" ] && wait "$SLICE_PID"
tail -2 "$OUT/slice.log" 2>/dev/null
timeout 200 python3 -m coli.cli.main bench stream "$SLICE" --scenario cold-ram,sync,spec --tokens "$N" --vram-gb 16 \
    --ram-gb 64 --tile-kb 1024 --json-out "$OUT/bench_stream.json" >"$OUT/bench.log" 2>&1
echo "[$(( $(date +%s) - T0 ))s] bench stream exit $?"
tail -25 "$OUT/bench.log"
