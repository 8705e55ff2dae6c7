#!/usr/bin/env bash
# coli bench stream on the device machine (an H200): a 2-layer GLM-5-shaped slice in /tmp, every scenario with
# N=16 tokens, JSON + plots + log to $OUT. Budget (~4 min on the H200): make-slice ~60 s; MemoryHostTier of 2 layers reads
# ~10 GB (cold-ram, sync); ResidentExperts uploads ~10 GB (warm); the rest is decoding.
#
# The slice is made with --vocab 4096 to keep the dense core (embed + lm_head) small: the head's time is measured
# at that vocabulary and scaled to GLM-5's 154880 in the extrapolation (docs/performance.md). Its dense core is stored as
# `coli convert` stores it by default (DENSE=int8; int4 is what `coli plan` picks at 16 GB; bf16 for the older rows):
# a bf16 slice reads ~430 MB of dense weights per layer, twice what a user's converted model reads.
set -uo pipefail
source "$(dirname "$0")/bench_slice.sh"
OUT=${OUT:-/tmp/bench_stream_out}
DENSE=${DENSE:-int8}
SLICE=${SLICE:-/tmp/coli_slice2_$DENSE}
N=${N:-16}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
LOG="$OUT/bench_stream.log"
{
  echo "== $(date -u +%FT%TZ) coli bench stream: 2-layer slice, glm52 trace, --vocab 4096 (dense kept small), dense core $DENSE, N=$N"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
  df -h /tmp || true
  ensure_bench_slice
  t0=$(date +%s)
  timeout 420 "$PY" -m coli.cli.main bench stream "$SLICE" --scenario all --tokens "$N" --vram-gb 16 --ram-gb 64 \
    --tile-kb 1024 --json-out "$OUT/bench_stream.json" --plots "$OUT/plots"
  echo "bench stream: exit $?, $(( $(date +%s) - t0 )) s"
} 2>&1 | tee "$LOG"
