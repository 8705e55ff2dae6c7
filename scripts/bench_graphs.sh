#!/usr/bin/env bash
# The replayed decode step on the device machine (an H200): `coli bench stream --scenario $SCEN` (default warm,cold-ram) over the 2-layer
# GLM-5 slice of scripts/bench_stream.sh, with the decode step replayed from CUDA graphs (COLI_GRAPHS=1, the
# default) and then eager (COLI_GRAPHS=0), in the same call; JSON + log to $OUT, a short table last.
# Budget (~2.5 min on the H200): make-slice ~60 s when /tmp has no slice, then ~40 s per warm run.
set -uo pipefail
source "$(dirname "$0")/bench_slice.sh"
OUT=${OUT:-/tmp/bench_graphs_out}
SLICE=${SLICE:-/tmp/coli_slice2}
N=${N:-16}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
LOG="$OUT/bench_graphs.log"
{
  echo "== $(date -u +%FT%TZ) replayed vs eager decode step: 2-layer slice, glm52 trace, --vocab 4096, N=$N"
  ensure_bench_slice
  SCEN=${SCEN:-warm,cold-ram}
  for g in 1 0; do
    t0=$(date +%s)
    COLI_GRAPHS=$g timeout 200 "$PY" -m coli.cli.main bench stream "$SLICE" --scenario "$SCEN" --tokens "$N" \
      --vram-gb 16 --ram-gb 64 --json-out "$OUT/warm_graphs$g.json"
    echo "COLI_GRAPHS=$g: exit $?, $(( $(date +%s) - t0 )) s"
  done
  "$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
f = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else str(v)   # noqa: E731
print(f"{'COLI_GRAPHS':>11} {'scenario':>9} {'token ms':>9} {'p99':>7} {'MoE layer ms':>12} {'GLM-5 tok/s':>11}  "
      f"dense layer ms / graphs")
for g in ("1", "0"):
    p = Path(sys.argv[1]) / f"warm_graphs{g}.json"
    if not p.exists():
        print(f"{g:>11} (no result)")
        continue
    j = json.loads(p.read_text())
    print(f"{g:>11} {'no-expert':>9} {f(j.get('nomoe_token_ms', {}).get('mean')):>9} "
          f"{f(j.get('nomoe_token_ms', {}).get('p99')):>7} {'-':>12} {'-':>11}  {f(j.get('dense_layer_ms'))} "
          f"{j.get('nomoe_graphs')}")
    for row in j.get("rows", []):
        t = row.get("token_ms", {})
        print(f"{g:>11} {row.get('scenario', '?'):>9} {f(t.get('mean')):>9} {f(t.get('p99')):>7} "
              f"{f(row.get('moe_layer_ms')):>12} {f(row.get('tokens_per_s_glm5')):>11}  {row.get('graphs')} "
              f"h2d {(row.get('h2d') or {}).get('wall_over_peak')}")
PYEOF
} 2>&1 | tee "$LOG"
