# Sourced by the bench_*.sh scripts: the 2-layer glm52-trace slice (--vocab 4096) they all measure on, made once
# at $SLICE (reused while its manifest is there). Needs PY and SLICE set; DENSE (optional) is the dense core's format
# (int8 as `coli convert` stores it, int4, bf16; make-slice's default when unset); prints how long the make took.
ensure_bench_slice() {
  if [ ! -f "$SLICE/coli-manifest.json" ]; then
    t0=$(date +%s)
    timeout 240 "$PY" -m coli.cli.main bench make-slice "$SLICE" --layers 2 --trace glm52 --vocab 4096 \
      ${DENSE:+--dense-format "$DENSE"} --threads 8 --no-progress --force || { echo "make-slice failed"; exit 1; }
    echo "make-slice: $(( $(date +%s) - t0 )) s"
  fi
}
