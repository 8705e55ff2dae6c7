#!/usr/bin/env bash
# Graph branches (COLI_GRAPH_BRANCHES, docs/gpu.md "Graph branches") on the device machine (an H200), one call:
#   1. their GPU test (tests/gpu/test_gpu_graphs.py -k branches: f32 tokens equal transformers', tokens and cache
#      bit for bit the one-chain graph's, int4 too) -- a failure stops the script before any timing;
#   2. scripts/bench_kernels.py --dense-layer-only: the dense layer captured as one chain and with branches (its
#      "branches" rows), same process (JSON $OUT/k.json);
#   3. `coli bench stream --scenario warm` over the 2-layer int8 slice of the acceptance runs, COLI_GRAPH_BRANCHES
#      0, 1, 0, 1 (interleaved: a drift between runs favours neither): the no-expert token, the dense part of a
#      layer, warm GLM-5 tok/s.
# Budget (~4 min on the H200): the test ~60 s, the dense rows ~40 s, make-slice ~60 s when /tmp has no slice, ~25 s per
# warm run. JSON + log to $OUT, a short table last. Run from the repository root after the usual wheel install.
set -uo pipefail
source "$(dirname "$0")/bench_slice.sh"
OUT=${OUT:-/tmp/bench_branches_out}
SLICE=${SLICE:-/tmp/coli_slice2_int8}
DENSE=${DENSE:-int8}
N=${N:-16}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT"
LOG="$OUT/bench_branches.log"
{
  echo "== $(date -u +%FT%TZ) COLI_GRAPH_BRANCHES 0 vs 1: GPU test, dense layer rows, then the slice warm, N=$N"
  timeout 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/gpu/test_gpu_graphs.py -k branches \
    || { echo "the branches' GPU test failed: no timing"; exit 1; }
  timeout 200 "$PY" scripts/bench_kernels.py --dense-layer-only --json-out "$OUT/k.json" \
    | grep -E "^dense layer|FAILED|Error" | cut -c1-600
  ensure_bench_slice
  for b in 0 1 0 1; do
    t0=$(date +%s)
    COLI_GRAPH_BRANCHES=$b timeout 200 "$PY" -m coli.cli.main bench stream "$SLICE" --scenario warm --tokens "$N" \
      --vram-gb 16 --ram-gb 64 --json-out "$OUT/warm_branches$b-$t0.json" > /dev/null
    echo "COLI_GRAPH_BRANCHES=$b: exit $?, $(( $(date +%s) - t0 )) s"
  done
  "$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
f = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else str(v)   # noqa: E731
k = json.loads((out / "k.json").read_text()).get("dense_layer", {}) if (out / "k.json").exists() else {}
for fmt, r in k.items():
    v3 = r.get("v3", {})
    print(f"dense layer {fmt}: chain {f(v3.get('us_per_layer'))} us, branches {json.dumps(v3.get('branches'))}")
print(f"{'branches':>8} {'no-expert token ms':>18} {'dense layer ms':>14} {'warm token ms':>13} {'GLM-5 tok/s':>11}")
for path in sorted(out.glob("warm_branches*.json"), key=lambda p: p.stem.split("-")[-1]):
    j = json.loads(path.read_text())
    rows = [r for r in j.get("rows", []) if r.get("scenario") == "warm"] or [{}]
    print(f"{path.stem.split('-')[0][-1]:>8} {f(j.get('nomoe_token_ms', {}).get('mean')):>18} "
          f"{f(j.get('dense_layer_ms')):>14} {f(rows[0].get('token_ms', {}).get('mean')):>13} "
          f"{f(rows[0].get('tokens_per_s_glm5')):>11}")
PYEOF
} 2>&1 | tee "$LOG"
