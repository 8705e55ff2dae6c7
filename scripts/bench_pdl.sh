#!/usr/bin/env bash
# Programmatic dependent launch (COLI_PDL, docs/gpu.md) on the device machine (an H200), one call:
#   1. scripts/bench_kernels.py --dense-layer-only: the dense layer captured with ordinary and with programmatic
#      edges, timed interleaved in the same process (its "with PDL" lines; JSON $OUT/k.json);
#   2. `coli bench stream --scenario warm` over the 2-layer slice of scripts/bench_stream.sh with COLI_PDL=0, then 1:
#      the replayed one-token step (no-expert token, dense part of a layer, warm GLM-5 tok/s).
# Budget (~3 min on the H200): bench_kernels' dense rows ~60 s, make-slice ~60 s when /tmp has no slice, ~40 s per
# warm run. JSON + log to $OUT, a short table last.
set -uo pipefail
source "$(dirname "$0")/bench_slice.sh"
OUT=${OUT:-/tmp/bench_pdl_out}
SLICE=${SLICE:-/tmp/coli_slice2}
N=${N:-16}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
LOG="$OUT/bench_pdl.log"
{
  echo "== $(date -u +%FT%TZ) COLI_PDL 0 vs 1: dense layer rows, then the 2-layer slice warm, N=$N"
  timeout 300 "$PY" scripts/bench_kernels.py --dense-layer-only --json-out "$OUT/k.json" | grep -E "dense part|gemv v|with PDL|FAILED|Error"
  ensure_bench_slice
  for p in 0 1; do
    t0=$(date +%s)
    COLI_PDL=$p timeout 200 "$PY" -m coli.cli.main bench stream "$SLICE" --scenario warm --tokens "$N" \
      --vram-gb 16 --ram-gb 64 --json-out "$OUT/warm_pdl$p.json"
    echo "COLI_PDL=$p: exit $?, $(( $(date +%s) - t0 )) s"
  done
  "$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
f = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else str(v)   # noqa: E731
print(f"{'COLI_PDL':>8} {'no-expert token ms':>18} {'dense layer ms':>14} {'warm token ms':>13} {'GLM-5 tok/s':>11}")
for p in ("0", "1"):
    path = Path(sys.argv[1]) / f"warm_pdl{p}.json"
    if not path.exists():
        print(f"{p:>8} (no result)")
        continue
    j = json.loads(path.read_text())
    rows = [r for r in j.get("rows", []) if r.get("scenario") == "warm"] or [{}]
    print(f"{p:>8} {f(j.get('nomoe_token_ms', {}).get('mean')):>18} {f(j.get('dense_layer_ms')):>14} "
          f"{f(rows[0].get('token_ms', {}).get('mean')):>13} {f(rows[0].get('tokens_per_s_glm5')):>11}")
PYEOF
} 2>&1 | tee "$LOG"
