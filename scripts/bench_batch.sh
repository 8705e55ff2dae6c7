#!/usr/bin/env bash
# Batched decode on the device machine (an H200), warm (every expert resident): scripts/bench_batch.py over the 2-layer
# GLM-5 slice of scripts/bench_graphs.sh (glm52 trace, --vocab 4096), B = 1, 4, 8, 16 sequences, the batched steps
# replayed from CUDA graphs (COLI_BATCH_GRAPHS=1) and eager (=0), in the same call; JSON lines + log to $OUT.
# Each line: aggregate tok/s of B sequences stepped one at a time (model.greedy: replayed one-sequence graphs) and
# in one batched step, experts asked per step, whether the tokens agree, the replay counters.
# Budget (~3 min on the H200): make-slice ~60 s when /tmp has no slice; each run loads 10 GB of experts.
set -uo pipefail
source "$(dirname "$0")/bench_slice.sh"
OUT=${OUT:-/tmp/bench_batch_out}
SLICE=${SLICE:-/tmp/coli_slice2}
STEPS=${STEPS:-16}
BATCH=${BATCH:-1,4,8,16}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
LOG="$OUT/bench_batch.log"
{
  echo "== $(date -u +%FT%TZ) batched decode: 2-layer slice, glm52 trace, --vocab 4096, steps=$STEPS, B=$BATCH"
  ensure_bench_slice
  for g in 1 0; do
    t0=$(date +%s)
    COLI_BATCH_GRAPHS=$g timeout 240 "$PY" scripts/bench_batch.py --model "$SLICE" --device gpu --batch "$BATCH" \
      --steps "$STEPS" | tee "$OUT/batch_graphs$g.jsonl"
    echo "COLI_BATCH_GRAPHS=$g: exit ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s"
  done
} 2>&1 | tee "$LOG"
