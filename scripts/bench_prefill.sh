#!/usr/bin/env bash
# Time to first token on the device machine (an H200), alone: `coli bench stream --prefill` on the 2-layer GLM-5
# slice (issue 15 §1/§3; docs/performance.md "Prefill: time to first token", prediction in docs/perf-notes.md "TTFT").
# warm (the MoE compute reference), cold-ram and the 16 GB budget, prompts of PREFILL tokens, the layer-ahead rows
# (--prefill-ahead) beside cold-ram. DENSE=int4 makes (or reuses) a slice whose dense core runs on the tensor-core
# prefill GEMMs (int8's take the fp32 tiles: the prediction's dense part). Budget: make-slice ~60 s when the slice is
# not there; the run ~2 min (the budget engine reads every expert from the disk per prefill, ~8 s each).
set -uo pipefail
source "$(dirname "$0")/bench_slice.sh"
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
DENSE=${DENSE:-int8}
SLICE=${SLICE:-/tmp/coli_slice2_$DENSE}
PREFILL=${PREFILL:-512,2048,8192}
SCENARIOS=${SCENARIOS:-warm,cold-ram,budget}
PY=${PY:-python3}
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# the device machine's setup, as scripts/h200_acceptance.sh does it (wheels, then the editable install's mapping)
if ls .gpuwheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuwheels/*.whl >"$OUT/pip.log" 2>&1
    export PYTHONPATH=$PWD:/tmp/site
fi
"$PY" -c "import coli.stages" 2>/dev/null || timeout 120 "$PY" -m pip install -q --no-index --no-deps \
    --no-build-isolation -e . >>"$OUT/pip.log" 2>&1
{
  echo "== $(date -u +%FT%TZ) coli bench stream --prefill $PREFILL: 2-layer slice, dense core $DENSE, $SCENARIOS"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
  ensure_bench_slice
  t0=$(date +%s)
  timeout 300 "$PY" -m coli.cli.main bench stream "$SLICE" --scenario "$SCENARIOS" --tokens 4 --vram-gb 16 \
    --ram-gb 64 --tile-kb 1024 --prefill "$PREFILL" --prefill-ahead --json-out "$OUT/bench_prefill.json"
  echo "bench stream --prefill: exit $?, $(( $(date +%s) - t0 )) s"
} 2>&1 | tee "$OUT/bench_prefill.log"
