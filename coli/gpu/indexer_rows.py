"""How the prefill indexer-scores kernel (cuda/indexer.cu indexer_scores_rows) cuts the work: IDXR_ROWS consecutive
rows a block, key tiles of IDXR_TILE keys, a run of tiles per block chosen so the grid fills the device. Pure host
logic (no device), so the choice is tested on the CPU and shared by the backend and the benchmark.

    tiles_per_block, grid = rows_grid(S=8192, T=8192, sm_count=132, topk=2048)   # -> (64, (2, 2048))

The constants mirror indexer.cu's #defines (tests/test_indexer_rows.py reads them from the source).
"""

from __future__ import annotations

ROWS = 4               # IDXR_ROWS: rows per block
WARPS = 4              # IDXR_WARPS
KEYS_PER_WARP = 16     # IDXR_KPW: keys per warp per tile
TILE = WARPS * KEYS_PER_WARP   # IDXR_TILE: keys per tile
THREADS = 32 * WARPS
MAX_HEADS = 32         # a lane per index head: more heads take indexer_scores (its lanes loop over heads)
# Working blocks to ask for per SM: 2 fit at once on sm_90 (96 KiB each), so 16 make ~8 waves: blocks of one chunk of a
# long prompt are near the same size, and with 2 waves (one block per row group) the last one left most SMs idle.
BLOCKS_PER_SM = 16
MIN_RUN_TILES = 4      # a block's q (64 KiB at GLM-5) is staged once for at least 4 tiles of keys (128 KiB)


def smem_bytes(ih: int, ihd: int) -> int:
    """indexer_scores_rows' dynamic shared memory: the block's q rows [ROWS, ih, ihd] and one key tile [TILE, ihd],
    fp32 (98,304 bytes at GLM-5's 32 heads x 128: within sm_86/89's 99 KiB opt-in)."""
    return (ROWS * ih + TILE) * ihd * 4


def rows_applies(ih: int, ihd: int) -> str | None:
    """None where indexer_scores_rows can take the shape, else why not (the backend then takes indexer_scores)."""
    if ih > MAX_HEADS:
        return f"{ih} index heads (> {MAX_HEADS}: a lane per head)"
    if ihd % 4:
        return f"index head dim {ihd} is not a multiple of 4 (16-byte pieces)"
    return None


def rows_grid(S: int, T: int, sm_count: int, start: int = 0, topk: int = 0) -> tuple[int, tuple[int, int]]:
    """(tiles_per_block, grid) for rows start..start+S-1 against T keys: one block per ROWS rows and per run of key
    tiles. Only the groups with a row past topk visible keys do work (rows s >= topk - start): their keys are split
    into runs so that there are about BLOCKS_PER_SM working blocks per SM, each run at least MIN_RUN_TILES tiles
    (a few rows against a long cache: runs of a tile or more, down to one tile where MIN_RUN_TILES would leave the
    device idle); where the groups alone fill the device that many times, a block takes every tile of its rows."""
    groups = -(-S // ROWS)
    working = max(1, groups - max(0, topk - start) // ROWS)
    tiles = -(-T // TILE)
    want = max(1, -(-BLOCKS_PER_SM * sm_count // working))
    longest = max(1, tiles // MIN_RUN_TILES) if working * tiles // MIN_RUN_TILES >= 2 * sm_count else tiles
    runs = min(tiles, want, longest)
    per_block = -(-tiles // runs)
    return per_block, (-(-tiles // per_block), groups)


def scored_pairs(S: int, start: int, T: int, topk: int) -> int:
    """How many (row, key) scores an indexer prefill computes: every visible key of each row with more than topk of
    them (the benchmark's flop count: 2 * ih * ihd per pair)."""
    n = [min(start + s + 1, T) for s in range(S)]
    return sum(v for v in n if v > topk)
