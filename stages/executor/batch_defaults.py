"""Defaults of `coli up --max-batch` and `--step-tokens` (stages/executor/scheduler.py), apart so the CLI reads
them without importing the model code. Measured on the demo model: docs/performance.md, "Continuous batching"."""

DEFAULT_MAX_BATCH = 16      # sequences the executor runs at once
DEFAULT_STEP_TOKENS = 128   # one step's token budget: a token per decoding sequence, the rest prompt chunks
