#!/usr/bin/env bash
# The consumer-budget rows (issue 14 §3) on the device machine: for each dense-core format (int8, int4: what
# `coli convert --dense` would store), a 2-layer GLM-5-shaped slice in /tmp and `coli bench stream --scenario budget
# --vram-gb 16,24,32`: each budget's rows with and without speculation, coli sim's hit-rate prediction and coli plan's
# tok/s bound beside them (docs/performance.md, "Consumer budgets"). JSON + log to $OUT.
# Budget (H200, estimated, not yet run): make-slice ~60 s per format; 3 budgets x 2 rows x (2 + N) tokens read from
# the slice's O_DIRECT store, ~1-2 min per format.
set -uo pipefail
OUT=${OUT:-/tmp/bench_budgets_out}
N=${N:-16}
FORMATS=${FORMATS:-int8 int4}
BUDGETS=${BUDGETS:-16,24,32}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
LOG="$OUT/bench_budgets.log"
{
  echo "== $(date -u +%FT%TZ) consumer budgets: 2-layer slices, glm52 trace, --vocab 4096, dense $FORMATS, --vram-gb $BUDGETS, N=$N"
  for fmt in $FORMATS; do
    SLICE=/tmp/coli_slice2_dense_$fmt
    if [ ! -f "$SLICE/coli-manifest.json" ]; then
      t0=$(date +%s)
      timeout 240 "$PY" -m coli.cli.main bench make-slice "$SLICE" --layers 2 --trace glm52 --vocab 4096 \
        --dense-format "$fmt" --threads 8 --no-progress --force || { echo "make-slice ($fmt) failed"; continue; }
      echo "make-slice ($fmt): $(( $(date +%s) - t0 )) s"
    fi
    t0=$(date +%s)
    timeout 300 "$PY" -m coli.cli.main bench stream "$SLICE" --scenario budget --tokens "$N" --vram-gb "$BUDGETS" \
      --ram-gb 64 --tile-kb 1024 --json-out "$OUT/bench_budgets_$fmt.json"
    echo "bench stream budget ($fmt): exit $?, $(( $(date +%s) - t0 )) s"
  done
} 2>&1 | tee "$LOG"
