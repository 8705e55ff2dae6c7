"""How the split-context MLA decode (cuda/attention.cu: mla_attend_tile<NBUF> or mla_attend_part_<NJ>, then a combine)
cuts the work:
the chunk of key positions one block takes, and whether a launch can take that path at all. Pure host logic (no
device), so the choice is tested on the CPU and shared by the backend and the benchmark.

    chunk, nchunk = split_chunks(n_max=2048, S=1, nh=64, Lkv=512, sm_count=132)   # -> (64, 32)

The constants mirror attention.cu's #defines (a test reads them from the source).
"""

from __future__ import annotations

TILE_KEYS = 16          # ATT_TK: keys staged in shared memory per step
HEADS_PER_WARP = 2      # ATT_HPW
WARPS = 8               # ATT_WARPS
HEADS_PER_BLOCK = HEADS_PER_WARP * WARPS   # ATT_HPB
THREADS = 32 * WARPS
COMBINE_THREADS = 128
PARTIAL_CAP_BYTES = 64 << 20   # bound on the [S, nh, nchunk, Lkv] partial contexts (prefill asks for many rows)
BLOCKS_PER_SM = 1              # the part kernel's registers (~190 at Lkv 512) leave room for one 256-thread block


# mla_attend_tile<NBUF> (the default): the context as two register-tiled products per tile, the same tiles, head groups
# and chunks as the part kernel (so split_chunks and attn_span serve both), staged with cp.async.
TILE2_KEYS = 16         # AT2_TK
TILE2_HEADS = 16        # AT2_HB
TILE2_SLICES = 16       # AT2_KS: the score dot's D columns (as float4s) split over this many half-warps
TILE2_THREADS = 256     # AT2_THREADS
COMBINE4_THREADS = 128  # mla_attend_combine4: a thread per 4 latent dims


# mla_attend_tile3: tile2's block and chunks, 32 keys per tile (two of tile2's): a lane's score tile is 4 heads x 8 keys,
# the partial scores at a swizzled column (sp_col), the probabilities in rows of TILE3_PT_STRIDE floats.
TILE3_KEYS = 32         # AT3_TK
TILE3_HEADS = 16        # AT3_HB
TILE3_SLICES = 16       # AT3_KS
TILE3_THREADS = 256     # AT3_THREADS
TILE3_PT_STRIDE = 20    # AT3_PTS
# mla_attend_combine_onepass (tile3's combine): every partial context of a batch in flight before the weights are known
ONEPASS_COMBINE = "mla_attend_combine_onepass"
ONEPASS_COLS = 64       # CMB_COLS: float4 columns of a head's context per block
ONEPASS_LANES = 2       # CMB_LANES: threads splitting a column's chunks
ONEPASS_BATCH = 16      # CMB_BATCH: chunks a thread has in flight at once
ONEPASS_THREADS = ONEPASS_COLS * ONEPASS_LANES


def head_groups(nh: int) -> int:
    return -(-nh // HEADS_PER_BLOCK)


def split_chunks(n_max: int, S: int, nh: int, Lkv: int, sm_count: int, chunk: int | None = None) -> tuple[int, int]:
    """(chunk, nchunk): keys per block (a multiple of TILE_KEYS) and chunks per row for rows of up to n_max keys.
    Enough chunks that the grid (nchunk x head groups x S) fills the device once, no more (every extra chunk is a
    partial context written and combined); one chunk (no combine) when the rows alone fill it or when the partials
    would pass PARTIAL_CAP_BYTES. `chunk` forces a size (benchmarks), rounded up to whole tiles."""
    n_max = max(1, int(n_max))
    tiles = -(-n_max // TILE_KEYS)
    if chunk is None:
        rows = head_groups(nh) * S
        want = max(1, -(-sm_count * BLOCKS_PER_SM // rows))          # chunks per row that fill the device
        per = -(-tiles // min(want, tiles))                          # tiles per chunk
    else:
        per = max(1, -(-int(chunk) // TILE_KEYS))
    nchunk = -(-tiles // per)
    while nchunk > 1 and S * nh * nchunk * Lkv * 4 > PARTIAL_CAP_BYTES:
        per *= 2
        nchunk = -(-tiles // per)
    return per * TILE_KEYS, nchunk


def split_fits(Lkv: int, dr: int, *ptrs: int) -> bool:
    """The part kernel's requirements: 16-byte rows and bases (it stages the cache with float4 loads), rope dim
    <= 64 (two per lane), kv_lora_rank <= 512 (NJ <= 16)."""
    return Lkv % 4 == 0 and dr % 4 == 0 and 0 < dr <= 64 and 0 < Lkv <= 512 and all(p % 16 == 0 for p in ptrs)


def tile_row_stride(D: int) -> int:
    """at2_row_stride(): floats per staged row of D = Lkv + dr values, 4 past a multiple of 32 so that the rows a
    quarter-warp reads at once sit in different banks."""
    return -(-D // 32) * 32 + 4


def tile_smem_bytes(Lkv: int, dr: int, nbuf: int) -> int:
    """Dynamic shared memory of mla_attend_tile<nbuf>: the block's queries, nbuf key tiles, the slices' partial
    scores, the tile's probabilities, and two per-head values (rescale, running sum)."""
    dp = tile_row_stride(Lkv + dr)
    floats = (TILE2_HEADS * dp + nbuf * TILE2_KEYS * dp + TILE2_SLICES * TILE2_HEADS * TILE2_KEYS
              + TILE2_KEYS * TILE2_HEADS + 2 * TILE2_HEADS)
    return 4 * floats


def tile3_row_stride(D: int) -> int:
    """at3_row_stride(): 8 floats past a multiple of 32, so that the 4 query rows (or 4 key rows) and the 2 slices a
    warp's score pass reads at once sit in 8 distinct 16-byte bank groups."""
    return -(-D // 32) * 32 + 8


def tile3_smem_bytes(Lkv: int, dr: int) -> int:
    """Dynamic shared memory of mla_attend_tile3: the block's queries, two 32-key tiles, the slices' partial scores,
    the tile's probabilities, two per-head values (217 KB at GLM-5's shape: sm_90 and sm_100 blocks only)."""
    dp = tile3_row_stride(Lkv + dr)
    floats = (TILE3_HEADS * dp + 2 * TILE3_KEYS * dp + TILE3_SLICES * TILE3_HEADS * TILE3_KEYS
              + TILE3_KEYS * TILE3_PT_STRIDE + 2 * TILE3_HEADS)
    return 4 * floats


def tile3_sp_col(sl: int, h: int, key: int) -> int:
    """at3_sp_col(): the column of `key` (< 32) in the partial-score row of slice sl and head h."""
    return key ^ ((h & 1) << 4) ^ ((h & 2) << 1) ^ ((sl & 1) << 3)


def tile3_pieces(tid: int, D4: int, threads: int = TILE3_THREADS, keys: int = TILE3_KEYS) -> list[tuple[int, int]]:
    """The (row, float4) pieces thread tid stages per tile, as mla_tile3_body steps them: from (tid // D4, tid % D4)
    by (threads // D4, threads % D4) with one carry, AT3_MAXE steps, rows past the tile dropped. keys=TILE3_HEADS:
    the queries' 16-byte staging (rows are heads, AT3_QE steps)."""
    maxe = -(-keys * 144 // threads)
    sr, sf = divmod(threads, D4)
    r, f = divmod(tid, D4)
    out = []
    for _ in range(maxe):
        if r < keys:
            out.append((r, f))
        r, f = r + sr, f + sf
        if f >= D4:
            f, r = f - D4, r + 1
    return out


def combine_grid(name: str, Lkv: int, nh: int, S: int) -> tuple[int, ...]:
    """The combine's grid: a block per (head, row), or for the one-pass combine ONEPASS_COLS float4 columns of a
    head per block (2 blocks per head at Lkv 512)."""
    if name == ONEPASS_COMBINE:
        return (-(-(Lkv // 4) // ONEPASS_COLS), nh, S)
    return (nh, S)


def smem_bytes(Lkv: int, dr: int) -> int:
    """Dynamic shared memory of mla_attend_part_<NJ>: one tile of latent rows and rope keys."""
    return TILE_KEYS * (Lkv + dr) * 4
