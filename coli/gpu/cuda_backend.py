"""The CUDA backend: the Backend interface (coli/model/backend.py) over device memory and the kernels in
`cuda/*.cu`. The forward pass (coli/model/forward.py) is the same as on the numpy backend.

    b = CudaBackend()                     # needs PyCUDA and a device (CudaUnavailable otherwise)
    model = GlmMoeDsaModel(cfg, weights, b, experts=b.expert_source(weights))

Arrays are `DeviceArray` (float32, row-major); weights are `QWeight` (the container's stored format) and
`HeadView` (kv_b_proj's per-head key/value rows). Everything runs in order on one compute stream; the host
waits only where the forward needs a value on the host: the router's choices (`route`), logits (`to_host`)
and the greedy token (`argmax`). The indexer's selection stays on the device as a `DeviceMask` that the
attention kernel reads.

MoE: `moe()` takes the (expert id, handle) pairs of the layer's experts. Handles are `DeviceRecord`s
(device address of a record in container format, optional ready event / consumed callback) or host
`ExpertWeights` (uploaded on the spot as an f32 record, for the RAM-tier executor). Decode (one token) is
two launches per record layout -- gate/up for all K experts from a table of record pointers, then down
with the routing-weighted sum; prefill is a grouped GEMM per expert over the tokens routed to it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from coli.errors import ColiError
from coli.gpu import attention_split, indexer_rows
from coli.gpu.cuda_runtime import CudaError, CudaRuntime, DeviceArray, get_runtime
from coli.gpu.cuda_weights import (
    FLUSH, DeviceRecord, HeadView, HostExpert, QWeight, ResidentExperts, upload_f32, upload_host_expert, upload_weight, vec_ok,
)
from coli.model.backend import Backend
from coli.weights import ExpertWeights

F32 = np.float32
QM = "Piiiiq"        # the six stored-matrix arguments (QMAT_PARAMS)
FORMATS = ("f32", "bf16", "int8", "int4")


def _signatures() -> dict[tuple[str, str], str]:
    """(module, kernel) -> PyCUDA argument types (P pointer, i int32, q int64, f float32). Checked against the
    kernels' C signatures by tests/test_kernels_compile.py (no GPU needed)."""
    s = {
        ("elementwise", "add"): "PPPq", ("elementwise", "silu_mul"): "PPPq",
        ("elementwise", "copy_cols"): "PiiiPi",
        ("norm", "rmsnorm"): "PPPif", ("norm", "layernorm"): "PPPPif",
        ("rope", "rope"): "PPPPiiiii",
        # fused ops (Backend.add_rms_norm, norm_many, rope_many, write_rows_many): fewer nodes per replayed layer
        ("norm", "add_rmsnorm"): "PPPPPPif", ("norm", "norms3"): "PPPiPPPif" + "PPPPif",
        ("rope", "rope4"): "PPii" + "PPiii" * 4, ("graph", "kv_put3"): "P" + "PqP" * 3,
        ("indexer", "indexer_scores"): "PPPiiiiffiP", ("indexer", "topk_select"): "PiiiiPP",
        ("indexer", "indexer_scores_rows"): "PPPiiiiiffiiP",
        ("router", "route_topk"): "PPiiiiifPP",
        ("gemm", "moe_reduce"): "PPiiiPi",
        ("argmax", "argmax_partial"): "PiPP", ("argmax", "argmax_final"): "PPiP",
        # a decode step replayed from a CUDA graph (coli/gpu/graphs.py): per-token values read from device memory
        ("graph", "kv_put"): "PqPP", ("graph", "expert_table"): "PiPP",
        ("indexer", "indexer_scores_dyn"): "PPPiiPffiP", ("indexer", "topk_select_dyn"): "PPiiPP",
    }
    for nj in (1, 2, 4, 8, 16):
        s[("attention", f"mla_attend_{nj}")] = "PPiiPPPPiiiiifP"
        s[("attention", f"mla_attend_part_{nj}")] = "PPiiPPPPiiPiiiifiiPPP"
        s[("attention", f"mla_attend_part1_{nj}")] = "PPiiPPPPiiPiiiifiiPPP"
    s[("attention", "mla_attend_combine")] = "PPPPPiPiiiiiP"
    s[("attention", "mla_attend_tile2")] = s[("attention", "mla_attend_tile1")] = "PPiiPPPPiiPiiiifiiPPP"
    s[("attention", "mla_attend_tile3")] = "PPiiPPPPiiPiiiifiiPPP"
    s[("attention", "mla_attend_combine_onepass")] = "PPPPPiPiiiiiP"
    s[("attention", "mla_attend_combine4")] = "PPPPPiPiiiiiP"
    for f in FORMATS:
        s[("elementwise", f"embed_{f}")] = QM + "PP"
        s[("elementwise", f"dequant_{f}")] = QM + "iP"
        s[("gemv", f"gemv_{f}")] = QM + "iiiPqPq"
        s[("gemv", f"gemv_t_{f}")] = QM + "iiiPqPq"
        s[("gemv", f"gemv2_{f}")] = QM + "iiiPqPqi"
        s[("gemv", f"gemv2x_{f}")] = QM * 4 + "iPPPPPi"
        s[("gemv", f"gemv2r_{f}")] = QM + "iPqPqii"
        s[("gemv", f"moe_gateup_{f}")] = "PPqqiiiiqiPP"
        s[("gemv", f"moe_down_{f}")] = "PPqiiiiqiPPPi"
        s[("gemm", f"gemm_nt_{f}")] = "Pqqi" + QM + "iiiiPqq"
        s[("gemm", f"gemm_nn_{f}")] = "Pqqi" + QM + "iiiiPqq"
        s[("attention", f"mla_qabs_{f}")] = s[("attention", f"mla_o_{f}")] = QM + "iiiPqPq"
        s[("gemm", f"moe_gateup_gemm_{f}")] = "PqqiiiiqPPPP"
        s[("gemm", f"moe_down_gemm_{f}")] = "PqiiiiqPPPPPiP"
    # the first version of the fused MoE decode, kept for scripts/bench_kernels.py's old-vs-new comparison
    s[("gemv", "moe_gateup_int4_v1")] = s[("gemv", "moe_gateup_int4")]
    s[("gemv", "moe_down_int4_v1")] = s[("gemv", "moe_down_int4")]
    # int4 on the tensor cores (cuda/moe_mma.cu)
    s[("moe_mma", "moe_split_x4")] = "PiiPPP"
    s[("moe_mma", "moe_gateup_mma_int4")] = "PqqiiiiqiPPPPPPP"
    s[("moe_mma", "moe_down_mma_int4")] = "PqiiiiqiPPPPPi"
    # int4 prefill (S > 1) on the tensor cores (cuda/prefill_mma.cu)
    s[("prefill_mma", "pf_split_rows")] = "PiiqPP"
    s[("prefill_mma", "pf_linear_int4")] = QM + "iPPPq"
    s[("prefill_mma", "pf_linear_int8")] = QM + "iPPPq"
    s[("prefill_mma", "pf_gateup_int4")] = "PqqiiiiqPPPPPP"
    s[("prefill_mma", "pf_down_int4")] = "PqiiiiqPPPPPPiP"
    return s


SIGNATURES = _signatures()
GEMV_THREADS = 256
NORM_THREADS = 1024  # block of the norm kernels: a decode row's values stay in registers (NORM_THREADS in norm.cu)
MOE_THREADS = 512    # block size of the v1/v2 MoE decode kernels
MMA_THREADS = 256    # block size of the tensor-core ones: 32 * MMA_WARPS in moe_mma.cu (a test keeps them equal)
MMA_DOWN_ROWS = 32   # output rows per block of moe_down_mma_int4: 16 * MMA_DT in moe_mma.cu (the same test)
MOE_MAXK = 8         # experts per moe_gateup / moe_down launch (MOE_MAXK in gemv.cu)
# Fused MoE decode kernels (one token):
#   "auto" (default)  int4 on the tensor cores (cuda/moe_mma.cu) where the layout and shared memory allow it and
#                     the launch has K >= MMA_MIN_K experts, else "v2" (H200, GLM-5's experts, GPU time per
#                     layer v2 / mma: K=1 23.0 / 27.0 us, K=2 33.4 / 31.0, K=4 53.7 / 39.5, K=8 92.7 / 59.7);
#   "mma"             the tensor-core kernels wherever the layout allows (tests: small shapes), else "v2";
#   "v2"              the scalar kernels in gemv.cu (moe_gateup_<fmt>, moe_down_<fmt>): every format;
#   "v1"              their first version (int4 only: *_int4_v1; other formats take v2).
# int4 with a group other than 32/64/128 always takes v1. COLI_MOE_KERNELS selects one (benchmarks, bisecting).
MOE_KERNELS = os.environ.get("COLI_MOE_KERNELS", "auto")
MMA_MIN_K = 2        # "auto": the tensor-core kernels from this many experts per launch (measured above)
# Bound the grouped-MoE prefill buffers ([S, K, H] partial outputs) and the indexer's [S, T] scores.
MOE_CHUNK_BYTES = 256 << 20
INDEXER_CHUNK_BYTES = 256 << 20
# MLA attention: "auto" (default) decode projections as GEMVs and the context split over blocks as two register-tiled
# products per tile (cuda/attention.cu mla_attend_tile2 + mla_attend_combine4; mla_attend_tile1 where the device's
# shared memory per block cannot take tile2's two buffers) where the shapes allow; "tile3" mla_attend_tile3 (32 keys per
# tile, 4 heads x 8 keys per lane; 217 KB of shared memory at GLM-5's shape) + mla_attend_combine_onepass where the
# device allows, else as "auto";
# "tile1" always the one-buffer tile kernel; "split2" the previous split kernel (mla_attend_part_<NJ> + mla_attend_combine: a warp per 2 heads,
# shuffle-summed dots); "split1" the same with the first split kernel (mla_attend_part1_<NJ>: a tile staged in
# dependent load steps); "v1" the first version (one block per head and row, the projections as tiled GEMMs). The
# older ones stay for scripts/bench_kernels.py's comparison and bisecting.
ATTN_KERNELS = os.environ.get("COLI_ATTN_KERNELS", "auto")
# Dense decode GEMV: "v3" (default) as v2, and the matrices that read the same input (linear_many) in one gemv2x_<fmt>
# launch; "v2" gemv2_<fmt> (split-K over the warps of a block, weights prefetched before x is staged) where it
# applies, else gemv_<fmt>, one launch per matrix; "v1" always gemv_<fmt> (the benchmark's old-vs-new, bisecting).
GEMV_KERNELS = os.environ.get("COLI_GEMV_KERNELS", "v3")
GEMV2_WARPS = 8      # warps per gemv2 block: GEMV2_WARPS in gemv.cu (row pairs x column segments)
GEMV2_ROWS = 2       # rows per gemv2 work item of a warp (a pair): GEMV2_RP in gemv.cu
# int4 prefill GEMMs (S > 1: the dense linear and the grouped MoE; the dense linear of int8 weights too): "mma"
# (default) on the tensor cores (cuda/prefill_mma.cu) where pf_layout_ok / pf_int8_layout_ok / pf_moe_layout_ok and
# the shared memory allow, else the fp32 tiled GEMMs;
# "v1" always the fp32 tiled GEMMs (cuda/gemm.cu; scripts/bench_kernels.py's old-vs-new, bisecting).
# A prefill's mla_attend runs this many query rows at a time (_mla_attend_blocks): the absorbed queries and the
# contexts, [rows, nh, Lkv] f32 each (256 KB a row at GLM-5's shape), then take a fixed 134 MB instead of growing
# with the chunk; 512 rows still give the context kernel 2,048 blocks (4 head groups each) to fill the device with.
ATTN_PREFILL_ROWS = 512
PREFILL_KERNELS = os.environ.get("COLI_PREFILL_KERNELS", "mma")
PREFILL_VERSIONS = ("mma", "v1")
# pf_linear_int8 (int8 weights on the tensor cores) is the default since its GPU tests passed on the H200 (2026-12-01,
# 20:45 UTC, tests/gpu/test_gpu_prefill.py's int8 tests: every error within its f64 bound) and took the dense part of a
# 2,048-token prefill layer from 68.4 to 31.4 ms (docs/perf-notes.md, "TTFT"). COLI_PREFILL_INT8=0 keeps an int8
# weight's prefill linear on the fp32 tiles, as before.
PREFILL_INT8_DEFAULT = "1"


def prefill_int8_enabled(env: dict | None = None) -> bool:
    """COLI_PREFILL_INT8: "1" (default, see PREFILL_INT8_DEFAULT) int8 weights' prefill linears on the tensor cores
    (pf_linear_int8), "0" on the fp32 tiles."""
    from coli.gpu.graphs import env_switch
    return env_switch("COLI_PREFILL_INT8", PREFILL_INT8_DEFAULT, "int8 prefill linears on the tensor cores, the default",
                      "int8 prefill linears on the fp32 tiles", env)
# The tensor-core MoE prefill's buffers per token ([K, H] partial outputs, split x and h): the prompt goes through in
# chunks of at most this many bytes. Each chunk sorts its own pairs by expert, so a larger chunk fills the PF_TOKS-pair
# tiles better (a 2,048-token GLM-5 prompt, ~64 pairs per expert, is one chunk).
PREFILL_CHUNK_BYTES = 1 << 30
PF_ROWS, PF_TOKS, PF_STAGES = 256, 32, 3    # prefill_mma.cu: weight rows / activation rows per block, stages
ATTN_VERSIONS = ("auto", "tile3", "tile2", "tile1", "split2", "split1", "v1")
# The indexer's scores of a prefill (S > 1; the replayed decode step's indexer_scores_dyn is S = 1 and unchanged):
# "auto" (default) = "rows", cuda/indexer.cu indexer_scores_rows (4 rows a block, register-tiled: the same bits as
# indexer_scores) where the shape and the device's shared memory allow it (coli/gpu/indexer_rows.py), else
# indexer_scores; "v1" always indexer_scores (scripts/bench_kernels.py's old-vs-new, bisecting).
INDEXER_KERNELS = os.environ.get("COLI_INDEXER_KERNELS", "auto")
INDEXER_VERSIONS = ("auto", "rows", "v1")
ATTN_PROJ_VERSIONS = ("auto", "tile3", "tile2", "tile1")   # decode the projections with mla_qabs_<fmt> / mla_o_<fmt>
MLA_PROJ_THREADS = 256   # mla_qabs_<fmt> / mla_o_<fmt> blocks (cuda/attention.cu)
ROPE_MANY = 4        # tensors per rope4 launch (cuda/rope.cu)
KV_PUT_MANY = 3      # cache rows per kv_put3 launch (cuda/graph.cu)
GEMV2X_MAX = 4       # matrices per gemv2x launch: GEMV2X_MAX in gemv.cu
GEMV2_ROUND_CHUNKS = 64   # gemv2_split's fixed cost of a round of groups, in chunks of a segment (fitted to the sweep)
GEMV_VERSIONS = ("v3", "v2", "v1")


def kernel_choice(setting: str, value: str, allowed: tuple[str, ...]) -> str:
    """A kernel-version setting's value, or a one-line error naming the setting and what it takes."""
    if value not in allowed:
        raise ColiError(f"{setting}={value!r} is not a kernel version: use one of {', '.join(allowed)}")
    return value


GEMV2R_MAX = 4          # input rows per gemv2r launch: GEMV2R_MAX in gemv.cu
GEMV_ROWS_MAX = 16      # steps of 2..this many rows run their linears with gemv2r (weights read once per 4 rows;
                        # the 64x64 fp32 GEMM ran a B = 16 step's dense part at 7.5 ms a layer on the H200)
GEMV_ROWS_INT4 = 4      # int4 weights: beyond this the tensor-core prefill GEMM (pf_linear_int4) takes them
                        # (int8 weights: beyond GEMV_ROWS_MAX, pf_linear_int8)


@dataclass
class DeviceMask:
    """Which keys each query row attends to, on the device. Dense (idx None): row s sees keys 0..start+s.
    Otherwise row s sees the cnt[s] keys idx[s, :cnt[s]] (ascending)."""

    S: int
    T: int
    start: int
    idx: DeviceArray | None = None   # [S, kmax] int32
    cnt: DeviceArray | None = None   # [S] int32
    kmax: int = 0

    def to_host(self, rt: CudaRuntime) -> np.ndarray:
        """The mask as a host bool [S, T] (the numpy backend's form)."""
        m = np.zeros((self.S, self.T), bool)
        if self.idx is None:
            for s in range(self.S):
                m[s, :self.start + s + 1] = True
            return m
        idx, cnt = rt.to_host(self.idx), rt.to_host(self.cnt)
        for s in range(self.S):
            m[s, idx[s, :cnt[s]]] = True
        return m


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, device: int = 0, runtime: CudaRuntime | None = None):
        self.rt = runtime or get_runtime(device)
        self._cs: tuple | None = None         # (cos host, sin host, cos dev, sin dev)
        self._route: tuple | None = None      # (idx host, idx dev, w dev) of the last route()
        self._one = self.rt.to_device(np.ones(MOE_MAXK, F32))
        self.faults = None                   # coli.stages.faults.Faults: injects kernel_error (tests, drills)
        self.on_kernel_error = None          # called with (error, expert ids) when a MoE batch falls back
        self.busy = None                     # coli.gpu.busy.BusyClock: marks on the compute stream (SM busy)
        # called right before the host blocks for a router's top-k (or a step's token): the expert source finishes
        # its landed copies' bookkeeping there, while the GPU computes, not between the router and the next copy
        self.before_host_wait: Callable[[], None] | None = None
        self.moe_kernels = MOE_KERNELS       # "auto", "mma", "v2" or "v1" (see MOE_KERNELS)
        self._mma_usable: bool | None = None  # moe_mma.cu compiled here (see _mma_fits)
        self._scratch: dict[tuple, MoeScratch] = {}   # fused-decode buffers by (layout, K, version asked)
        self.attn_kernels = kernel_choice("COLI_ATTN_KERNELS", ATTN_KERNELS, ATTN_VERSIONS)   # see ATTN_KERNELS
        self.attn_chunk: int | None = None   # keys per block of the split attention (None: attention_split picks)
        self.gemv_kernels = kernel_choice("COLI_GEMV_KERNELS", GEMV_KERNELS, GEMV_VERSIONS)   # see GEMV_KERNELS
        self.prefill_kernels = kernel_choice("COLI_PREFILL_KERNELS", PREFILL_KERNELS, PREFILL_VERSIONS)
        self.indexer_kernels = kernel_choice("COLI_INDEXER_KERNELS", INDEXER_KERNELS, INDEXER_VERSIONS)
        self.prefill_int8 = prefill_int8_enabled()            # pf_linear_int8 for int8 weights (COLI_PREFILL_INT8)
        self._pf_usable: bool | None = None  # prefill_mma.cu compiled here (see _pf_ok)
        self.gemv_ks: int | None = None     # gemv2/gemv2x column segments forced (benchmark sweeps); None: gemv2_split
        from coli.gpu.graphs import graph_branches_enabled
        self.graph_branches = graph_branches_enabled()   # COLI_GRAPH_BRANCHES, read (and checked) once: see side()
        # coli.gpu.graphs.DeviceStep while a decode step is being captured into a CUDA graph: the per-token values
        # (token, position, rope angles, routing) are then read from its device buffer instead of the host
        self.step = None

    def graph_decoder(self, model):
        """The replayed decode step for `model` (coli.gpu.graphs.GraphDecoder), or None with COLI_GRAPHS=0."""
        from coli.gpu.batch_graphs import batch_graphs_enabled
        from coli.gpu.graphs import GraphDecoder, graphs_enabled
        batch_graphs_enabled()           # a bad COLI_BATCH_GRAPHS fails here, at model load, like COLI_GRAPHS
        return GraphDecoder(model, self) if graphs_enabled() else None

    def mtp_round_graphs(self, head):
        """Greedy one-draft MTP rounds of `head` replayed from CUDA graphs (coli.gpu.mtp_graphs.MtpRoundGraphs), or
        None with COLI_MTP_GRAPHS=0 or COLI_GRAPHS=0 (rounds run eagerly)."""
        from coli.gpu.graphs import graphs_enabled
        from coli.gpu.mtp_graphs import MtpRoundGraphs, mtp_graphs_enabled
        return MtpRoundGraphs(head, self) if mtp_graphs_enabled() and graphs_enabled() else None

    def verify_graphs(self, model, force: bool = False):
        """Greedy MTP verify steps of `model` replayed from CUDA graphs (coli.gpu.verify_graphs.VerifyGraphs), or None
        where COLI_VERIFY_GRAPHS=0 (force: whatever it says; the benchmark's replayed rows) or COLI_GRAPHS=0."""
        from coli.gpu.graphs import graphs_enabled
        from coli.gpu.verify_graphs import VerifyGraphs, verify_graphs_enabled
        on = verify_graphs_enabled() or force
        return VerifyGraphs(model, self) if on and graphs_enabled() else None

    def batch_graph_decoder(self, model):
        """The replayed batched decode steps for `model` (coli.gpu.batch_graphs.BatchGraphDecoder), or None unless
        COLI_BATCH_GRAPHS=1 (and COLI_GRAPHS is not 0)."""
        from coli.gpu.batch_graphs import BatchGraphDecoder, batch_graphs_enabled
        from coli.gpu.graphs import graphs_enabled
        return BatchGraphDecoder(model, self) if batch_graphs_enabled() and graphs_enabled() else None

    # ---- kernels ---------------------------------------------------------------------------------------
    def _fn(self, module: str, name: str):
        return self.rt.function(module, name, SIGNATURES[(module, name)])

    def _grid1d(self, n: int, threads: int = 256) -> int:
        return max(1, min(-(-n // threads), self.rt.sm_count * 8))

    # ---- storage ---------------------------------------------------------------------------------------
    def upload(self, host: np.ndarray) -> DeviceArray:
        return self.rt.to_device(np.asarray(host, F32), F32)

    def to_host(self, x: DeviceArray) -> np.ndarray:
        if self.busy is not None:
            self.busy.mark("end")
        return self.rt.to_host(x)

    def empty(self, shape: tuple[int, ...]) -> DeviceArray:
        return self.rt.empty(shape, F32)

    def write_rows(self, dst: DeviceArray, start: int, src: DeviceArray) -> None:
        row = dst.nbytes // dst.shape[0]
        if src.nbytes != src.shape[0] * row or start + src.shape[0] > dst.shape[0]:
            raise ValueError(f"cannot write rows {src.shape} into {dst.shape} at {start}")
        if self.step is not None:       # captured step: the row goes where the step's device position says
            st = self.step.check_rows(src.shape[0], "write_rows")
            st.check_start(start)
            n = row // 4
            self.rt.launch(self._fn("graph", "kv_put"), (self._grid1d(n),), 256, src.ptr, n, st.pos_ptr, dst.ptr)
            return
        self.rt.copy(dst.ptr + start * row, src.ptr, src.nbytes)

    def write_rows_many(self, pairs, start: int) -> None:
        """write_rows of each (dst, src); inside a captured step up to KV_PUT_MANY rows in one kv_put3 launch (a layer's
        cache write: one node instead of three), eagerly one copy each."""
        if self.step is None:
            return super().write_rows_many(pairs, start)
        for j in range(0, len(pairs), KV_PUT_MANY):
            self._kv_put3(pairs[j:j + KV_PUT_MANY], start)

    def _kv_put3(self, pairs, start: int) -> None:
        args, ns = [], []
        for dst, src in pairs:
            row = dst.nbytes // dst.shape[0]
            if src.nbytes != src.shape[0] * row or start + src.shape[0] > dst.shape[0]:
                raise ValueError(f"cannot write rows {src.shape} into {dst.shape} at {start}")
            self.step.check_rows(src.shape[0], "write_rows_many").check_start(start)
            ns.append(row // 4)
            args += [src.ptr, row // 4, dst.ptr]
        args += [0, 0, 0] * (KV_PUT_MANY - len(pairs))
        grid = max(self._grid1d(n) for n in ns)
        self.rt.launch(self._fn("graph", "kv_put3"), (grid, len(pairs)), 256, self.step.pos_ptr, *args)

    def rows(self, x: DeviceArray, n: int) -> DeviceArray:
        return x.row_view(0, n)

    def row_range(self, x: DeviceArray, start: int, n: int) -> DeviceArray:
        if start < 0 or n < 0 or start + n > x.shape[0]:
            raise ValueError(f"rows {start}..{start + n} of an array of {x.shape[0]}")
        return x.row_view(start, n)

    def place_rows(self, dst: DeviceArray, start: int, src: DeviceArray) -> None:
        """dst[start:start+n] = src on the compute stream -- also inside a captured step (a batch's own arrays; the
        cache write is write_rows)."""
        row = dst.nbytes // dst.shape[0]
        if src.nbytes != src.shape[0] * row or start + src.shape[0] > dst.shape[0]:
            raise ValueError(f"cannot place rows {src.shape} into {dst.shape} at {start}")
        self.rt.copy(dst.ptr + start * row, src.ptr, src.nbytes)

    # weights in their stored format ------------------------------------------------------------------------
    def weight(self, src: Any, name: str) -> QWeight:
        return upload_weight(self.rt, src, name)

    def kv_b(self, src: Any, name: str, nh: int, dn: int, dv: int) -> tuple[HeadView, HeadView]:
        w = upload_weight(self.rt, src, name)
        return HeadView(w, 0, dn + dv, dn, nh), HeadView(w, dn, dn + dv, dv, nh)

    def matrix(self, w: np.ndarray) -> QWeight:
        """A host float32 matrix as a stored f32 weight (tests, host fallbacks)."""
        return upload_f32(self.rt, w)

    def expert_source(self, weights: Any) -> ResidentExperts:
        return ResidentExperts(self.rt, weights)

    # ---- element-wise / normalisation ----------------------------------------------------------------------
    def embed(self, table: QWeight, ids: np.ndarray) -> DeviceArray:
        if self.busy is not None:
            self.busy.mark("start")
        ids = np.asarray(ids, np.int64)
        S = int(ids.shape[0])
        out = self.empty((S, table.cols))
        if self.step is not None:                 # captured step: the token is in the step's device inputs
            ids_ptr = self.step.check_rows(S, "embed").token_ptr
        else:
            ids_ptr = self.rt.to_device_async(ids.astype(np.int32)).ptr
        fn = self._fn("elementwise", f"embed_{table.fmt}")
        self.rt.launch(fn, (S,), 256, *table.args(), ids_ptr, out.ptr)
        return out

    def add(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        out = self.empty(a.shape)
        fn = self._fn("elementwise", "add")
        self.rt.launch(fn, (self._grid1d(a.size),), 256, a.ptr, b.ptr, out.ptr, a.size)
        return out

    def silu_mul(self, g: DeviceArray, u: DeviceArray) -> DeviceArray:
        out = self.empty(g.shape)
        fn = self._fn("elementwise", "silu_mul")
        self.rt.launch(fn, (self._grid1d(g.size),), 256, g.ptr, u.ptr, out.ptr, g.size)
        return out

    def rms_norm(self, x: DeviceArray, w: DeviceArray, eps: float) -> DeviceArray:
        D = x.shape[-1]
        out = self.empty(x.shape)
        fn = self._fn("norm", "rmsnorm")
        self.rt.launch(fn, (x.size // D,), NORM_THREADS, x.ptr, w.ptr, out.ptr, D, F32(eps))
        return out

    def add_rms_norm(self, h: DeviceArray, a: DeviceArray, w: DeviceArray, eps: float,
                     a2: DeviceArray | None = None) -> tuple[DeviceArray, DeviceArray]:
        """(s, rms_norm(s)), s = h + a or h + (a + a2), in one add_rmsnorm launch: the same bits as add (add) then
        rms_norm."""
        if h.shape != a.shape or (a2 is not None and a2.shape != h.shape):
            raise ValueError(f"add_rms_norm of {h.shape} and {a.shape}" + ("" if a2 is None else f" and {a2.shape}"))
        D = h.shape[-1]
        s, out = self.empty(h.shape), self.empty(h.shape)
        fn = self._fn("norm", "add_rmsnorm")
        self.rt.launch(fn, (h.size // D,), NORM_THREADS, h.ptr, a.ptr, 0 if a2 is None else a2.ptr, w.ptr, s.ptr,
                       out.ptr, D, F32(eps))
        return s, out

    def norm_many(self, rms, eps: float, layer=None) -> list[DeviceArray]:
        """Backend.norm_many: two RMSNorms and the optional LayerNorm of tensors of the same rows in one norms3 launch
        (the q_a and kv_a latents, the indexer key), the same bits as rmsnorm, rmsnorm (and layernorm); other
        combinations one launch each."""
        xs = [x for x, _ in rms] + ([] if layer is None else [layer[0]])
        if len(rms) != 2 or len({x.size // x.shape[-1] for x in xs}) != 1:
            return super().norm_many(rms, eps, layer)
        (x0, w0), (x1, w1) = rms
        ys = [self.empty(x.shape) for x in xs]
        ln = (0, 0, 0, 0, 0, F32(0)) if layer is None else \
            (layer[0].ptr, layer[1].ptr, layer[2].ptr, ys[2].ptr, layer[0].shape[-1], F32(layer[3]))
        fn = self._fn("norm", "norms3")
        self.rt.launch(fn, (x0.size // x0.shape[-1], len(xs)), NORM_THREADS, x0.ptr, w0.ptr, ys[0].ptr, x0.shape[-1],
                       x1.ptr, w1.ptr, ys[1].ptr, x1.shape[-1], F32(eps), *ln)
        return ys

    def layer_norm(self, x: DeviceArray, w: DeviceArray, b: DeviceArray, eps: float) -> DeviceArray:
        D = x.shape[-1]
        out = self.empty(x.shape)
        fn = self._fn("norm", "layernorm")
        self.rt.launch(fn, (x.size // D,), NORM_THREADS, x.ptr, w.ptr, b.ptr, out.ptr, D, F32(eps))
        return out

    def linear(self, x: DeviceArray, w: QWeight) -> DeviceArray:
        _check_width(x, w, "linear")
        out = self.empty((x.shape[0], w.rows))
        self._linear_into(x, w, out)
        return out

    def _linear_into(self, x: DeviceArray, w: QWeight, out: DeviceArray) -> None:
        S, K = x.shape
        if S == 1 and self._gemv(w, 0, 0, w.rows, 1, x.ptr, 0, out.ptr, 0):
            return
        # a step of a few rows (a batch of decode tokens, an MTP verify step): memory-bound like one token, so the
        # rows share one read of the weights (gemv2r) -- the 64x64-tile GEMM idles there, and ran a slice's B = 4
        # step's dense part at 7.5 ms a layer against 0.23 ms for one token (H200, 2026-12-01)
        if 1 < S <= self._rows_gemv_max(w) and self._gemv_rows(w, x.ptr, S, out.ptr):
            return
        # int4 and int8 alike: the tensor cores (prefill_mma.cu) where the layout and the shared memory allow
        pf_fmt = "int4" if pf_layout_ok(w.layout) else \
            "int8" if self.prefill_int8 and pf_int8_layout_ok(w.layout) else None
        if S > 1 and pf_fmt and self._pf_ok(pf_smem(K, w.layout.group, pf_fmt)):
            xq, xm = self._pf_split(x.ptr, S, K)
            fn = self._fn("prefill_mma", f"pf_linear_{pf_fmt}")
            smem = pf_smem(K, w.layout.group, pf_fmt)
            self.rt.allow_smem(fn, smem)
            self.rt.launch(fn, (-(-w.rows // PF_ROWS), -(-S // PF_TOKS)), pf_threads(), *w.args(), S, xq.ptr,
                           xm.ptr, out.ptr, w.rows, smem=smem)
            return
        self._gemm(False, x.ptr, K, 0, S, w, 0, 0, w.rows, K, out.ptr, w.rows, 0, 1)

    def linear_many(self, x: DeviceArray, ws) -> list[DeviceArray]:
        """[linear(x, w) for w in ws], the same values. One token with COLI_GEMV_KERNELS=v3 (the default): the matrices
        of one format, width and group go through gemv2x_<fmt> together, up to GEMV2X_MAX per launch (a decode layer's
        q_a | kv_a | indexer wk, then q_b | indexer wq_b); the rest (the f32 weights_proj beside an int8 core) alone."""
        for w in ws:
            _check_width(x, w, "linear_many")
        S = x.shape[0]
        outs = [self.empty((S, w.rows)) for w in ws]
        done: set[int] = set()
        if S == 1 and self.gemv_kernels == "v3":
            groups = gemv2x_groups(ws, x.ptr)
            alone = [j for j in range(len(ws)) if not any(j in js for js in groups)]
            # the matrices outside every group (the f32 weights_proj beside an int8/int4 core) may run on a second
            # branch of a captured step, beside the groups' launches (COLI_GRAPH_BRANCHES=1); joined before return
            join = self.side(lambda: [self._linear_into(x, ws[j], outs[j]) for j in alone]) if groups and alone \
                else None
            if join is not None:
                done.update(alone)
            for js in groups:
                if self._gemv_many([ws[j] for j in js], x.ptr, [outs[j].ptr for j in js]):
                    done.update(js)
            if join is not None:
                join()
        for j, w in enumerate(ws):
            if j not in done:
                self._linear_into(x, w, outs[j])
        return outs

    def _rows_gemv_max(self, w: QWeight) -> int:
        """The most rows a step may have for gemv2r to take its linear (int4 beyond GEMV_ROWS_INT4: the tensor-core
        prefill GEMM, which reads the weights once for all rows)."""
        if self.gemv_kernels == "v1":
            return 1
        return GEMV_ROWS_INT4 if w.fmt == "int4" else GEMV_ROWS_MAX

    def _gemv_rows(self, w: QWeight, x: int, S: int, y: int) -> bool:
        """y [S, w.rows] = x [S, w.cols] W^T with gemv2r: each launch takes as many rows (<= GEMV2R_MAX) as its
        shared memory holds, every weight byte read once per launch. False when it does not apply (the caller's
        GEMM runs instead)."""
        K = w.cols
        if not (w.vec_ok and gemv2_fits(w.fmt, w.layout.group, x, K)):
            return False
        fn = self._fn("gemv", f"gemv2r_{w.fmt}")
        row_smem = w.layout.row_data_bytes // 16 * _chunk_vals(w.fmt) * 4      # one staged input row, bytes
        plan = gemv_rows_plan(S, row_smem, self.rt.smem_optin)
        if not plan:
            return False
        nchunks = w.layout.row_data_bytes // 16
        for r0, n in plan:
            smem = n * row_smem
            if not self.rt.allow_smem(fn, smem):
                return False
            resident = max(1, self.rt.resident_blocks(fn, GEMV_THREADS, smem))
            ks = self.gemv_ks or gemv2_split(w.rows, nchunks, resident)
            groups = -(-(-(-w.rows // GEMV2_ROWS)) // (GEMV2_WARPS // ks))
            self.rt.launch(fn, (min(groups, resident),), GEMV_THREADS, *w.args(), w.rows, x + 4 * K * r0, K,
                           y + 4 * w.rows * r0, w.rows, n, ks, smem=smem)
        return True

    def _gemv_many(self, ws: list[QWeight], x: int, ys: list[int]) -> bool:
        """ys[m] = W_m x for 2..GEMV2X_MAX matrices of one format, width and group in one gemv2x launch; False when it
        does not fit (shared memory)."""
        w0 = ws[0]
        fn = self._fn("gemv", f"gemv2x_{w0.fmt}")
        smem = w0.layout.row_data_bytes // 16 * _chunk_vals(w0.fmt) * 4
        if not self.rt.allow_smem(fn, smem):
            return False
        rows = sum(w.rows for w in ws)
        items = sum(-(-w.rows // GEMV2_ROWS) for w in ws)
        resident = max(1, self.rt.resident_blocks(fn, GEMV_THREADS, smem))
        ks = self.gemv_ks or gemv2_split(rows, w0.layout.row_data_bytes // 16, resident)
        groups = -(-items // (GEMV2_WARPS // ks))
        blocks = min(groups, resident)
        unused = (0, 0, w0.cols, w0.layout.group or 32, 1, 0)      # a slot past nm: never read
        mats = [a for m in range(GEMV2X_MAX) for a in (ws[m].args() if m < len(ws) else unused)]
        outs = [ys[m] if m < len(ws) else 0 for m in range(GEMV2X_MAX)]
        self.rt.launch(fn, (blocks,), GEMV_THREADS, *mats, len(ws), x, *outs, ks, smem=smem)
        return True

    def _compiles_once(self, attr: str, module: str, kernels: str, fallback: str) -> bool:
        """Whether `module` compiles here, checked once and kept in self.<attr> (None: not yet checked): a toolkit
        that rejects it logs one warning and leaves the `fallback` kernels, not the CPU."""
        usable = getattr(self, attr)
        if usable is None:
            try:
                self.rt.module(module)
                usable = True
            except CudaError as e:
                usable = False
                logging.getLogger("coli.cuda").warning("%s kernels unavailable, using the %s: %s", kernels, fallback,
                                                       str(e)[:300])
            setattr(self, attr, usable)
        return usable

    # ---- int4 prefill on the tensor cores (cuda/prefill_mma.cu) ------------------------------------------------
    def _pf_ok(self, smem: int) -> bool:
        """The tensor-core prefill applies: chosen (prefill_kernels), its shared memory fits this device, and its
        module compiles here (checked once; a toolkit that rejects it leaves the fp32 GEMMs, not the CPU)."""
        if self.prefill_kernels != "mma" or smem > self.rt.smem_optin:
            return False
        return self._compiles_once("_pf_usable", "prefill_mma", "tensor-core prefill", "fp32 GEMMs")

    def _pf_split(self, x: int, R: int, C: int) -> tuple[DeviceArray, DeviceArray]:
        """x [R, C] fp32 at device address x -> its int8 parts and metadata (prefill_mma.cu's split layout)."""
        nblk = R * (C // 64)
        xq = self.rt.empty((nblk * 256,), np.uint8)
        xm = self.rt.empty((nblk * 12,), np.int32)
        fn = self._fn("prefill_mma", "pf_split_rows")
        self.rt.launch(fn, (-(-nblk // 8),), 256, x, R, C, C, xq.ptr, xm.ptr)
        return xq, xm

    def split_cols(self, x: DeviceArray, n: int) -> tuple[DeviceArray, DeviceArray]:
        S, D = x.shape
        if S == 1:
            return DeviceArray(x.ptr, (1, n), F32, x.owner), DeviceArray(x.ptr + 4 * n, (1, D - n), F32, x.owner)
        a, b = self.empty((S, n)), self.empty((S, D - n))
        fn = self._fn("elementwise", "copy_cols")
        self.rt.launch(fn, (self._grid1d(a.size),), 256, x.ptr, D, 0, n, a.ptr, S)
        self.rt.launch(fn, (self._grid1d(b.size),), 256, x.ptr, D, n, D - n, b.ptr, S)
        return a, b

    def last_row(self, x: DeviceArray) -> DeviceArray:
        return x.row_view(x.shape[0] - 1, 1)

    def _cos_sin(self, cos: np.ndarray, sin: np.ndarray) -> tuple[DeviceArray, DeviceArray]:
        if self._cs is None or self._cs[0] is not cos or self._cs[1] is not sin:
            self._cs = (cos, sin, self.rt.to_device_async(np.asarray(cos, F32)),
                        self.rt.to_device_async(np.asarray(sin, F32)))
        return self._cs[2], self._cs[3]

    def rope(self, x: DeviceArray, cos: np.ndarray, sin: np.ndarray, offset: int) -> DeviceArray:
        S, n, d = x.shape
        half = cos.shape[-1]
        if self.step is not None:       # captured step: this position's angles are in the step's device inputs
            cs, sn = self.step.check_rows(S, "rope").angles(half)
        else:
            cs, sn = self._cos_sin(cos, sin)
        out = self.empty(x.shape)
        fn = self._fn("rope", "rope")
        self.rt.launch(fn, (self._grid1d(x.size),), 256, x.ptr, cs.ptr, sn.ptr, out.ptr, S, n, d, offset, half)
        return out

    def rope_many(self, xs, cos: np.ndarray, sin: np.ndarray) -> list[DeviceArray]:
        """[rope(x, cos, sin, offset) for (x, offset) in xs], up to ROPE_MANY tensors of the same rows per rope4 launch
        (one node for a layer's q, k_pe, indexer q and key): the same bits as one rope launch each."""
        outs = []
        for j in range(0, len(xs), ROPE_MANY):
            outs += self._rope4(xs[j:j + ROPE_MANY], cos, sin)
        return outs

    def _rope4(self, xs, cos: np.ndarray, sin: np.ndarray) -> list[DeviceArray]:
        S, half = xs[0][0].shape[0], cos.shape[-1]
        if any(x.shape[0] != S for x, _ in xs):
            raise ValueError(f"rope_many of tensors with different rows: {[x.shape for x, _ in xs]}")
        if self.step is not None:       # captured step: this position's angles are in the step's device inputs
            cs, sn = self.step.check_rows(S, "rope_many").angles(half)
        else:
            cs, sn = self._cos_sin(cos, sin)
        outs = [self.empty(x.shape) for x, _ in xs]
        args = []
        for (x, off), y in zip(xs, outs):
            args += [x.ptr, y.ptr, x.shape[1], x.shape[2], off]
        args += [0, 0, 0, 0, 0] * (ROPE_MANY - len(xs))
        grid = max(self._grid1d(x.size) for x, _ in xs)
        self.rt.launch(self._fn("rope", "rope4"), (grid, len(xs)), 256, cs.ptr, sn.ptr, S, half, *args)
        return outs

    # ---- matrix kernels ------------------------------------------------------------------------------------
    def _gemv(self, w: QWeight, wrow0: int, wz: int, N: int, Z: int, x: int, x_z: int, y: int, y_z: int) -> bool:
        """y[z][n] = W[wrow0 + z*wz + n] . x[z]; False when the GEMV kernel does not apply (use _gemm)."""
        if not w.vec_ok:
            return False
        smem = w.layout.row_data_bytes // 16 * _chunk_vals(w.fmt) * 4
        if self.gemv_kernels != "v1" and gemv2_fits(w.fmt, w.layout.group, x, x_z):
            fn = self._fn("gemv", f"gemv2_{w.fmt}")
            if self.rt.allow_smem(fn, smem):
                per_z = max(1, self.rt.resident_blocks(fn, GEMV_THREADS, smem) // Z)
                ks = self.gemv_ks or gemv2_split(N, w.layout.row_data_bytes // 16, per_z)
                groups = -(-(-(-N // GEMV2_ROWS)) // (GEMV2_WARPS // ks))
                blocks = min(groups, per_z)
                self.rt.launch(fn, (blocks, Z), GEMV_THREADS, *w.args(), wrow0, wz, N, x, x_z, y, y_z, ks, smem=smem)
                return True
        fn = self._fn("gemv", f"gemv_{w.fmt}")
        if not self.rt.allow_smem(fn, smem):
            return False
        pairs = -(-N // 2)
        blocks = min(-(-pairs // (GEMV_THREADS // 32)), max(1, self.rt.resident_blocks(fn, GEMV_THREADS, smem) // Z))
        self.rt.launch(fn, (blocks, Z), GEMV_THREADS, *w.args(), wrow0, wz, N, x, x_z, y, y_z, smem=smem)
        return True

    def _gemm(self, nn: bool, A: int, lda: int, a_z: int, M: int, w: QWeight, wrow0: int, wz: int, N: int, K: int,
              C: int, ldc: int, c_z: int, Z: int) -> None:
        fn = self._fn("gemm", f"gemm_{'nn' if nn else 'nt'}_{w.fmt}")
        self.rt.launch(fn, (-(-N // 64), -(-M // 64), Z), 256, A, lda, a_z, M, *w.args(), wrow0, wz, N, K,
                       C, ldc, c_z)

    # ---- attention ------------------------------------------------------------------------------------------
    def mla_absorb(self, q: DeviceArray, w_kb: HeadView) -> DeviceArray:
        """The absorbed queries of mla_attend's decode path, q_abs[s, h] = q_nope[s, h] @ w_kb[h] [S, nh, Lkv], on
        their own: they read only q, so a captured step computes them on a second graph branch beside the cache
        write and the indexer's selection (forward's _attention_segment, CudaBackend.side) and hands them to
        mla_attend (its q_abs), the same kernels and bits as mla_attend computing them itself."""
        S, nh, dq = q.shape
        dn, Lkv = w_kb.rows_per_head, w_kb.w.cols
        decode = S == 1 and self.attn_kernels != "v1"
        q_abs = self.empty((S, nh, Lkv))
        proj = self.attn_kernels in ATTN_PROJ_VERSIONS   # the projections' own kernels (else the GEMVs)
        if not (decode and (self._mla_qabs if proj else self._gemv_t)(w_kb.w, w_kb.row_off, w_kb.head_stride, dn, nh,
                                                                       q.ptr, dq, q_abs.ptr, Lkv)):
            self._gemm(True, q.ptr, nh * dq, dq, S, w_kb.w, w_kb.row_off, w_kb.head_stride, Lkv, dn,
                       q_abs.ptr, nh * Lkv, Lkv, nh)
        return q_abs

    def mla_attend(self, q: DeviceArray, lat: DeviceArray, k_pe: DeviceArray, w_kb: HeadView, w_vb: HeadView,
                   allowed: Any, scale: float, q_abs: DeviceArray | None = None) -> DeviceArray:
        """MLA over the cache; q_abs: mla_absorb(q, w_kb) computed already (a captured step's side branch), else
        computed here."""
        S, nh, dq = q.shape
        T, Lkv = lat.shape
        dn, dv = w_kb.rows_per_head, w_vb.rows_per_head
        dr = dq - dn
        if Lkv > 512 or dr > 64:
            raise ValueError(f"mla_attend supports kv_lora_rank <= 512 and rope dim <= 64 (got {Lkv}, {dr})")
        mask = self.device_mask(allowed, S, T)
        if S > ATTN_PREFILL_ROWS and self.step is None:
            if q_abs is not None:
                raise ValueError("mla_attend: a long prefill absorbs its queries block by block (no q_abs)")
            return self._mla_attend_blocks(q, lat, k_pe, w_kb, w_vb, mask, scale)
        decode = S == 1 and self.attn_kernels != "v1"
        proj = self.attn_kernels in ATTN_PROJ_VERSIONS   # the projections' own kernels (else the GEMVs)
        if q_abs is None:
            q_abs = self.mla_absorb(q, w_kb)                                # [S, nh, Lkv]
        elif q_abs.shape != (S, nh, Lkv):
            raise ValueError(f"mla_attend: q_abs {q_abs.shape} for queries {q.shape} and a latent of {Lkv}")
        # a captured step (coli/gpu/graphs.py) sizes the split by attn_span: the same chunks as the eager step at this T
        n_max = self.step.attn_n_max if self.step is not None else None
        ctx = self.attend_core(q_abs, q, dn, lat, k_pe, mask, scale, n_max=n_max)
        # o[s, h] = ctx[s, h] @ w_vb[h].T                                       [S, nh * dv] head-major
        o = self.empty((S, nh * dv))
        if not (decode and (self._mla_o if proj else self._gemv)(w_vb.w, w_vb.row_off, w_vb.head_stride, dv, nh,
                                                                 ctx.ptr, Lkv, o.ptr, dv)):
            self._gemm(False, ctx.ptr, nh * Lkv, Lkv, S, w_vb.w, w_vb.row_off, w_vb.head_stride, dv, Lkv,
                       o.ptr, nh * dv, dv, nh)
        return o

    def _mla_attend_blocks(self, q: DeviceArray, lat: DeviceArray, k_pe: DeviceArray, w_kb: HeadView,
                           w_vb: HeadView, mask: DeviceMask, scale: float) -> DeviceArray:
        """mla_attend of a long prefill, ATTN_PREFILL_ROWS query rows at a time: its absorbed queries and contexts
        ([rows, nh, Lkv] each, 256 KB a row at GLM-5's shape) are the largest per-row buffers of a prefill step, so
        they take a fixed block instead of growing with the chunk (coli/gpu/prefill_budget.py counts them so), and
        the same VRAM fits a longer --prefill-chunk. Every row's result is the bits of the one-pass call: each
        kernel computes a row from that row alone (the GEMMs' sums run over their K, not over rows), and each
        block is given the whole call's split (chunk and grid from the whole call's rows and n_max)."""
        S, nh, dq = q.shape
        T, Lkv = lat.shape
        R = ATTN_PREFILL_ROWS
        n_max = mask.kmax if mask.idx is not None else mask.start + S
        chunk, _ = attention_split.split_chunks(n_max, S, nh, Lkv, self.rt.sm_count, self.attn_chunk)
        o = self.empty((S, nh * w_vb.rows_per_head))                     # [S, nh * dv] head-major
        for s0 in range(0, S, R):
            n = min(R, S - s0)
            sub = DeviceMask(n, T, mask.start + s0,
                             None if mask.idx is None else mask.idx.row_view(s0, n),
                             None if mask.cnt is None else mask.cnt.row_view(s0, n), mask.kmax)
            self._mla_attend_rows(q.row_view(s0, n), lat, k_pe, w_kb, w_vb, sub, scale, n_max, chunk,
                                  o.row_view(s0, n))
        return o

    def _mla_attend_rows(self, q: DeviceArray, lat: DeviceArray, k_pe: DeviceArray, w_kb: HeadView,
                         w_vb: HeadView, mask: DeviceMask, scale: float, n_max: int, chunk: int,
                         o: DeviceArray) -> None:
        """One block of _mla_attend_blocks: mla_attend's prefill path (S > 1) over these rows, the split forced,
        into o [S, nh * dv] (the block's rows of the call's output)."""
        S, nh, dq = q.shape
        T, Lkv = lat.shape
        dn, dv = w_kb.rows_per_head, w_vb.rows_per_head
        q_abs = self.empty((S, nh, Lkv))                                  # [S, nh, Lkv]
        self._gemm(True, q.ptr, nh * dq, dq, S, w_kb.w, w_kb.row_off, w_kb.head_stride, Lkv, dn,
                   q_abs.ptr, nh * Lkv, Lkv, nh)
        ctx = self.attend_core(q_abs, q, dn, lat, k_pe, mask, scale, n_max=n_max, chunk=chunk)
        self._gemm(False, ctx.ptr, nh * Lkv, Lkv, S, w_vb.w, w_vb.row_off, w_vb.head_stride, dv, Lkv,
                   o.ptr, nh * dv, dv, nh)

    def attend_core(self, q_abs: DeviceArray, q: DeviceArray, pe_off: int, lat: DeviceArray, k_pe: DeviceArray,
                    mask: DeviceMask, scale: float, T_dev: int = 0, n_max: int | None = None,
                    chunk: int | None = None) -> DeviceArray:
        """ctx [S, nh, Lkv] = softmax over the mask's keys of (q_abs . lat + q_pe . k_pe) * scale, applied to lat;
        q_pe = q[..., pe_off:]. The split-context kernels (cuda/attention.cu, coli/gpu/attention_split.py) where
        they apply, else one block per (head, row). T_dev: device address of the cache length as an int32 (dense
        masks; 0: mask.T), with n_max the most keys a row can have, which sizes the grid (CUDA-graph replay)."""
        S, nh, dq = q.shape
        T, Lkv = lat.shape
        dr = dq - pe_off
        ctx = self.empty((S, nh, Lkv))
        nj = next(j for j in (1, 2, 4, 8, 16) if 32 * j >= Lkv)
        idx = mask.idx.ptr if mask.idx is not None else 0
        cnt = mask.cnt.ptr if mask.cnt is not None else 0
        split = self.attn_kernels != "v1" and attention_split.split_fits(Lkv, dr, lat.ptr, k_pe.ptr)
        if not split:
            if T_dev:
                raise ValueError("attend_core: T_dev needs the split-context kernels (COLI_ATTN_KERNELS != v1)")
            fn = self._fn("attention", f"mla_attend_{nj}")
            self.rt.launch(fn, (nh, S), 256, q_abs.ptr, q.ptr, dq, pe_off, lat.ptr, k_pe.ptr, idx, cnt, mask.kmax,
                           mask.start, nh, Lkv, dr, F32(scale), ctx.ptr, smem=8 * Lkv * 4)
            return ctx
        if n_max is None:
            n_max = mask.kmax if mask.idx is not None else mask.start + S
        chunk, nchunk = attention_split.split_chunks(n_max, S, nh, Lkv, self.rt.sm_count,
                                                     self.attn_chunk if chunk is None else chunk)
        fn, threads, smem, combine, combine_threads = self._split_kernels(Lkv, dr, nj)
        grid = (nchunk, attention_split.head_groups(nh), S)
        args = (q_abs.ptr, q.ptr, dq, pe_off, lat.ptr, k_pe.ptr, idx, cnt, mask.kmax, mask.start, T_dev, S, nh, Lkv,
                dr, F32(scale), chunk, nchunk)
        if nchunk == 1:                   # one chunk per row: the block normalises and writes ctx itself
            self.rt.launch(fn, grid, threads, *args, 0, 0, ctx.ptr, smem=smem)
            return ctx
        pm, pl = self.empty((S, nh, nchunk)), self.empty((S, nh, nchunk))
        pc = self.empty((S, nh, nchunk, Lkv))
        self.rt.launch(fn, grid, threads, *args, pm.ptr, pl.ptr, pc.ptr, smem=smem)
        fc = self._fn("attention", combine)
        self.rt.launch(fc, attention_split.combine_grid(combine, Lkv, nh, S), combine_threads, pm.ptr, pl.ptr, pc.ptr, idx, cnt, mask.start,
                       T_dev, S, nh, Lkv, chunk, nchunk, ctx.ptr)
        return ctx

    def _split_kernels(self, Lkv: int, dr: int, nj: int) -> tuple[Any, int, int, str, int]:
        """(part kernel, its threads, its dynamic shared memory, combine kernel name, its threads) of the split
        context under attn_kernels. "auto" (= "tile3") takes mla_attend_tile3 (32-key tiles, 217 KB at GLM-5's shape:
        sm_90/sm_100) where the device lets a block have its shared memory, else mla_attend_tile2 (two 16-key buffers),
        else mla_attend_tile1 (one buffer: 92 KB, within sm_86/89's 99 KB), else the part kernel; "tile2" starts at
        tile2 (the default before the H200 run of 18:35 UTC, 2026-12-01: 46.1 against tile3's 38.1 us). The choice
        depends only on the device, so a captured step and the eager one agree."""
        AS = attention_split
        tiles = {"auto": (3, 2, 1), "tile3": (3, 2, 1), "tile2": (2, 1), "tile1": (1,)}.get(self.attn_kernels, ())
        for v in tiles:
            fn = self._fn("attention", f"mla_attend_tile{v}")
            smem = AS.tile3_smem_bytes(Lkv, dr) if v == 3 else AS.tile_smem_bytes(Lkv, dr, v)
            if self.rt.allow_smem(fn, smem):
                if v == 3:
                    return fn, AS.TILE3_THREADS, smem, AS.ONEPASS_COMBINE, AS.ONEPASS_THREADS
                return fn, AS.TILE2_THREADS, smem, "mla_attend_combine4", AS.COMBINE4_THREADS
        fn = self._fn("attention", f"mla_attend_part{'1' if self.attn_kernels == 'split1' else ''}_{nj}")
        smem = AS.smem_bytes(Lkv, dr)
        if not self.rt.allow_smem(fn, smem):
            raise RuntimeError(f"mla_attend_part needs {smem} bytes of shared memory")
        return fn, AS.THREADS, smem, "mla_attend_combine", AS.COMBINE_THREADS

    def _mla_qabs(self, w: QWeight, wrow0: int, wz: int, K: int, Z: int, x: int, x_z: int, y: int, y_z: int) -> bool:
        """As _gemv_t, with cuda/attention.cu's mla_qabs_<fmt>: a block per 128 columns of a head (4 per head at
        GLM-5's int8 kv_b), not one per head. False when it does not apply."""
        if not w.vec_ok:
            return False
        nchunks, cpb = w.layout.row_data_bytes // 16, 128 // _chunk_vals(w.fmt)
        fn = self._fn("attention", f"mla_qabs_{w.fmt}")
        self.rt.launch(fn, (-(-nchunks // cpb), Z), MLA_PROJ_THREADS, *w.args(), wrow0, wz, K, x, x_z, y, y_z)
        return True

    def _mla_o(self, w: QWeight, wrow0: int, wz: int, N: int, Z: int, x: int, x_z: int, y: int, y_z: int) -> bool:
        """As _gemv, with cuda/attention.cu's mla_o_<fmt>: a block per 32 rows of a head (8 per head at GLM-5's
        v_head_dim 256). False when it does not apply."""
        if not w.vec_ok:
            return False
        smem = w.layout.row_data_bytes // 16 * _chunk_vals(w.fmt) * 4
        fn = self._fn("attention", f"mla_o_{w.fmt}")
        if not self.rt.allow_smem(fn, smem):
            return False
        self.rt.launch(fn, (-(-N // 32), Z), MLA_PROJ_THREADS, *w.args(), wrow0, wz, N, x, x_z, y, y_z, smem=smem)
        return True

    def _gemv_t(self, w: QWeight, wrow0: int, wz: int, K: int, Z: int, x: int, x_z: int, y: int, y_z: int) -> bool:
        """y[z][n] = x[z] @ W[wrow0 + z*wz : + K] (n < W.cols); False when gemv_t does not apply (use _gemm)."""
        if not w.vec_ok:
            return False
        vals = _chunk_vals(w.fmt)
        nchunks = w.layout.row_data_bytes // 16
        threads = nchunks * ((256 if vals > 16 else 512) // nchunks)
        if threads == 0:
            return False
        fn = self._fn("gemv", f"gemv_t_{w.fmt}")
        self.rt.launch(fn, (Z,), threads, *w.args(), wrow0, wz, K, x, x_z, y, y_z, smem=threads * vals * 4)
        return True

    def device_mask(self, allowed: Any, S: int, T: int) -> DeviceMask:
        """A DeviceMask from the indexer's result or from a host bool [S, T]."""
        if isinstance(allowed, DeviceMask):
            if (allowed.S, allowed.T) != (S, T):
                raise ValueError(f"mask for {allowed.S}x{allowed.T}, attention of {S}x{T}")
            return allowed
        a = np.asarray(allowed, bool)
        if a.shape != (S, T):
            raise ValueError(f"mask of shape {a.shape}, attention of {S}x{T}")
        cnt = a.sum(axis=1).astype(np.int32)
        kmax = max(int(cnt.max()), 1)
        idx = np.zeros((S, kmax), np.int32)
        for s in range(S):
            nz = np.nonzero(a[s])[0]
            idx[s, :nz.size] = nz
        return DeviceMask(S, T, T - S, self.rt.to_device_async(idx), self.rt.to_device_async(cnt), kmax)

    def indexer_select(self, iq: DeviceArray, k_idx: DeviceArray, head_w: DeviceArray, positions: np.ndarray,
                       index_topk: int) -> DeviceMask:
        S, ih, ihd = iq.shape
        T = k_idx.shape[0]
        positions = np.asarray(positions)
        start = int(positions[0])
        if not np.array_equal(positions, np.arange(start, start + S)) or start + S != T:
            raise ValueError("indexer_select on the GPU needs positions start..start+S-1 with T = start + S")
        if self.step is not None:
            return self._indexer_select_step(iq, k_idx, head_w, index_topk)
        if start + S <= index_topk:
            return DeviceMask(S, T, start)                       # every row keeps all its visible keys
        kmax = min(index_topk, T)
        idx = self.rt.empty((S, kmax), np.int32)
        cnt = self.rt.empty((S,), np.int32)
        f_tk = self._fn("indexer", "topk_select")
        rows = max(1, INDEXER_CHUNK_BYTES // (4 * T))
        for s0 in range(0, S, rows):
            n = min(rows, S - s0)
            scores = self.empty((n, T))
            self._indexer_scores(iq.ptr + s0 * ih * ihd * 4, k_idx.ptr, head_w.ptr + s0 * ih * 4, n, ih, ihd,
                                 start + s0, T, index_topk, scores.ptr)
            self.rt.launch(f_tk, (n,), 1024, scores.ptr, T, start + s0, index_topk, kmax,
                           idx.ptr + s0 * kmax * 4, cnt.ptr + s0 * 4)
        return DeviceMask(S, T, start, idx, cnt, kmax)

    def _indexer_scores(self, iq: int, k_idx: int, head_w: int, S: int, ih: int, ihd: int, start: int, T: int,
                        topk: int, scores: int) -> str:
        """scores[s, t] of the rows with more than topk visible keys (see cuda/indexer.cu), by indexer_scores_rows
        for S > 1 where indexer_kernels and the shape allow it, else indexer_scores: the same bits either way (one
        row, an eager decode step, keeps indexer_scores: a 4-row block would compute 3 rows for nothing). Returns the
        kernel's name."""
        qscale, wscale = F32(ihd ** -0.5), F32(ih ** -0.5)
        if S > 1 and self.indexer_kernels != "v1" and indexer_rows.rows_applies(ih, ihd) is None:
            fn = self._fn("indexer", "indexer_scores_rows")
            smem = indexer_rows.smem_bytes(ih, ihd)
            if self.rt.allow_smem(fn, smem):
                per_block, grid = indexer_rows.rows_grid(S, T, self.rt.sm_count, start, topk)
                self.rt.launch(fn, grid, indexer_rows.THREADS, iq, k_idx, head_w, ih, ihd, start, S, T, qscale,
                               wscale, topk, per_block, scores, smem=smem)
                return "indexer_scores_rows"
        self.rt.launch(self._fn("indexer", "indexer_scores"), (-(-T // 64), S), 256, iq, k_idx, head_w, ih, ihd,
                       start, T, qscale, wscale, topk, scores, smem=(ih * (ihd + 1) + ih) * 4)
        return "indexer_scores"

    def _indexer_select_step(self, iq: DeviceArray, k_idx: DeviceArray, head_w: DeviceArray,
                             index_topk: int) -> DeviceMask:
        """indexer_select inside a captured step (S = 1): (start, T) come from the step's device inputs, the
        scores kernel's grid covers the cache's capacity (blocks past T return), and topk_select always writes
        an index list -- all visible keys in order while T <= topk, which mla_attend reads exactly as the dense
        mask the eager step uses then."""
        st = self.step.check_rows(iq.shape[0], "indexer_select")
        _, ih, ihd = iq.shape
        T, cap = k_idx.shape[0], st.capacity
        scores = self.empty((1, cap))
        idx = self.rt.empty((1, index_topk), np.int32)
        cnt = self.rt.empty((1,), np.int32)
        smem = (ih * (ihd + 1) + ih) * 4
        self.rt.launch(self._fn("indexer", "indexer_scores_dyn"), (-(-cap // 64), 1), 256, iq.ptr, k_idx.ptr,
                       head_w.ptr, ih, ihd, st.pos_ptr, F32(ihd ** -0.5), F32(ih ** -0.5), index_topk, scores.ptr,
                       smem=smem)
        self.rt.launch(self._fn("indexer", "topk_select_dyn"), (1,), 1024, scores.ptr, st.pos_ptr, index_topk,
                       index_topk, idx.ptr, cnt.ptr)
        return DeviceMask(1, T, T - 1, idx, cnt, index_topk)

    # ---- MLPs -------------------------------------------------------------------------------------------------
    def swiglu(self, x: DeviceArray, gate: QWeight, up: QWeight, down: QWeight) -> DeviceArray:
        S, H = x.shape
        if S == 1 and gate.layout == up.layout and gate.fmt == down.fmt and gate.vec_ok and down.vec_ok:
            out = self.empty((1, down.rows))
            h = self.empty((1, gate.rows))
            if self._moe_decode_launch(gate.fmt, 0, gate.ptr, gate.layout, up.ptr - gate.ptr, 1, x.ptr, h.ptr):
                if self._moe_down_launch(down.fmt, 0, down.ptr, down.layout, 0, 1, self._one.ptr, h.ptr,
                                         out.ptr, 0):
                    return out
        g = self.linear(x, gate)
        u = self.linear(x, up)
        return self.linear(self.silu_mul(g, u), down)

    def side(self, fn):
        """Run fn (ops that read only what is computed already) beside what follows -> join() giving its result, or
        None: the caller runs it in place. Beside only inside a captured one-sequence decode step (a DeviceStep: the
        replayed step, its streaming segments, the benchmarks' dense layer) with COLI_GRAPH_BRANCHES=1, as a second
        branch of the graph: a MoE layer's shared expert beside the router and the routed experts
        (coli/model/forward.py's _mlp), a projection outside linear_many's gemv2x groups beside them (docs/gpu.md)."""
        if not getattr(self, "graph_branches", False) or not getattr(self.step, "branches", False) \
                or not getattr(self.rt, "capturing", False):
            return None
        return self.rt.on_side_stream(fn)

    def route(self, x: DeviceArray, gate_w: QWeight, bias: DeviceArray, n_group: int, topk_group: int, top_k: int,
              norm_topk_prob: bool, scaling: float, topp: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        S = x.shape[0]
        logits = self.linear(x, gate_w)                                  # [S, E] fp32
        E = logits.shape[1]
        idx_d = self.rt.empty((S, top_k), np.int32)
        w_d = self.empty((S, top_k))
        fn = self._fn("router", "route_topk")
        smem = (2 * E + 2 * n_group) * 4
        self.rt.launch(fn, (S,), 256, logits.ptr, bias.ptr, E, n_group, topk_group, top_k, int(norm_topk_prob),
                       F32(scaling), idx_d.ptr, w_d.ptr, smem=smem)
        if self.step is not None:       # captured step: the choice stays on the device (see moe_step)
            return DeviceRoute(idx_d, w_d, top_k), None
        if self.busy is not None:
            self.busy.mark("route")
        if self.before_host_wait is not None:
            self.before_host_wait()
        idx = self.rt.to_host(idx_d).astype(np.int64)
        w = self.rt.to_host(w_d)
        if topp is not None:          # approximate expert top-p pruning, on the host like the numpy backend
            from coli.model.numpy_backend import prune_topp
            return prune_topp(idx, w, topp)
        self._route = (idx, idx_d, w_d)
        return idx, w

    def moe_step(self, layer: int, x: DeviceArray, route: "DeviceRoute") -> DeviceArray:
        """The routed sum [S, H] of a captured decode step: the experts `route` chose (or the step's forced routing
        for this layer) through the step's slot table, with the same kernels, chunks and order as the eager
        _moe_decode of a resident layer (one layout, slots in the router's order, MOE_MAXK per launch). S > 1: a
        batched decode step (coli/gpu/batch_graphs.py), each row its own fused decode of its K experts, row after
        row (route, or the step's forced routing, [S, K])."""
        st = self.step.check_rows(x.shape[0], "moe_step")
        S, H = x.shape
        out = self.empty((S, H))
        if st.mode == "dropped":             # every slot dropped: the eager step's routed sum is zeros too
            self.rt.zero(out.ptr, out.nbytes)
            return out
        idx_ptr, w_ptr = st.route_ptrs(layer, route)
        slots, lay = st.slots_row(layer), st.rec_layout
        f_tab = self._fn("graph", "expert_table")
        for r in range(S):
            ri, rw = idx_ptr + 4 * route.K * r, w_ptr + 4 * route.K * r       # row r of [S, K]
            xr, yr = x.ptr + 4 * H * r, out.ptr + 4 * H * r
            for c0 in range(0, route.K, MOE_MAXK):
                k = min(MOE_MAXK, route.K - c0)
                table = self.rt.empty((k,), np.uint64)
                self.rt.launch(f_tab, (1,), 32, ri + 4 * c0, k, slots, table.ptr)
                sc = self.moe_scratch(lay, k)
                st.keep.append(sc)                   # the graph uses its buffers for as long as it lives
                if not (self.moe_gateup(sc, table.ptr, xr) and self.moe_down(sc, table.ptr, rw + 4 * c0, yr,
                                                                             c0 > 0)):
                    raise CudaError("MoE decode kernels do not fit this device's shared memory")
        return out

    def moe(self, x: DeviceArray, idx: np.ndarray, weights: np.ndarray, experts: Iterable[Any]) -> DeviceArray:
        """Routed sum [S, H]. `experts` yields (id, handle) pairs -- DeviceRecord (computed here), ExpertWeights
        (uploaded on the spot), HostExpert (computed on the CPU at once) -- and FLUSH markers: at a FLUSH
        the records held so far are launched (the source's next expert is still on its way, or it needs
        their slots back), so the kernels run in a few batches that accumulate into one output. A kernel that fails
        to launch (or an injected kernel_error) falls back to the CPU for that batch's experts."""
        S, H = x.shape
        st = _MoeStep(x, idx, weights)
        try:
            for item in experts:
                if item is FLUSH:
                    if st.pending:           # launch what is held (its slots' pins go back on_consumed)
                        self._moe_batch(st)
                    continue
                e, h = item
                e = int(e)
                if isinstance(h, ExpertWeights):
                    h = upload_host_expert(self.rt, h)     # copied before the source recycles its memory
                if isinstance(h, HostExpert):
                    self._moe_host(st, e, h.weights)
                elif isinstance(h, DeviceRecord):
                    st.pending[e] = h
                else:
                    raise TypeError(f"expert {e}: the CUDA backend takes DeviceRecord, HostExpert or ExpertWeights, "
                                    f"not {type(h)}")
                st.seen.add(e)
            missing = {e for e in np.unique(idx).tolist() if e >= 0} - st.seen   # -1: a pruned slot
            if missing:
                raise ValueError(f"the expert source did not yield expert(s) {sorted(missing)}")
            if st.pending:
                self._moe_batch(st)
        except BaseException:
            # records held but never launched (cancel, a failed read, ...) give their slots back: nothing queued
            # reads them, so an event recorded now is past their last reader
            self._consumed(list(st.pending.values()))
            st.pending = {}
            raise
        out = st.out
        if st.host_sum is not None:
            hs = self.upload(st.host_sum)
            out = hs if out is None else self.add(out, hs)
        if out is None:                                    # every slot pruned: nothing routed
            out = self.upload(np.zeros((S, H), F32))
        return out

    def _consumed(self, recs) -> None:
        """Tell each record's owner that the kernels reading it are queued (an event behind them)."""
        consumed = [r for r in recs if r.on_consumed is not None]
        if consumed:
            ev = self.rt.event()
            ev.record(self.rt.stream)
            for r in consumed:
                r.on_consumed(ev)

    def _moe_batch(self, st: "_MoeStep") -> None:
        """Launch the fused MoE kernels for the records in st.pending and add their sum to st.out. A batch after
        the first runs into its own buffer, added only once it launched, so a failure in the middle of a
        batch never leaves part of it in st.out when its experts are then computed on the CPU."""
        recs, st.pending = st.pending, {}
        S, H = st.x.shape
        try:
            try:
                if self.faults is not None and self.faults.hit("kernel_error"):
                    raise CudaError(f"injected kernel_error (MoE batch of {len(recs)} experts)")
                groups: dict[Any, list[int]] = {}
                for e, r in recs.items():
                    groups.setdefault(r.layout, []).append(e)
                out = self.empty((S, H))
                if S == 1 and all(self._decode_ok(lay) for lay in groups):
                    self._moe_decode(st.x, st.idx, st.weights, recs, groups, out)
                else:
                    for r in recs.values():
                        self._wait(r.ready)
                        self._wait(r.ready_down)
                    if self.busy is not None:
                        self.busy.mark("moe_start")
                    self._moe_prefill(st.x, st.idx, st.weights, recs, groups, out, splits=st.splits)
                st.out = out if st.out is None else self.add(st.out, out)
                if self.busy is not None:
                    self.busy.mark("moe_end")
            except CudaError as err:
                # the kernels did not run: compute these experts on the CPU from their host copies
                if self.on_kernel_error is not None:
                    self.on_kernel_error(err, sorted(recs))
                for e, r in recs.items():
                    ew = r.fetch_host() if r.fetch_host is not None else self._record_to_host(r)
                    self._moe_host(st, e, ew)
        finally:
            self._consumed(recs.values())

    def _moe_host(self, st: "_MoeStep", e: int, ew: ExpertWeights) -> None:
        """Expert e on the CPU (numpy, fp32, the numpy backend's formula) for the rows routed to it."""
        from coli.model.numpy_backend import expert_ffn
        if st.x_host is None:
            st.x_host = self.rt.to_host(st.x)                                     # [S, H]
            st.host_sum = np.zeros_like(st.x_host)
        rows, slot = np.nonzero(st.idx == e)
        y = expert_ffn(st.x_host[rows], ew.gate, ew.up, ew.down)                  # [n, H]
        st.host_sum[rows] += y * np.asarray(st.weights, F32)[rows, slot][:, None]

    def _record_to_host(self, r: DeviceRecord) -> ExpertWeights:
        from coli.container.reader import decode_expert_record
        raw = np.empty(r.layout.nbytes, np.uint8)
        self.rt.synchronize()
        self.rt.drv.memcpy_dtoh(raw, r.ptr)
        return decode_expert_record(raw, r.layout)

    def _wait(self, ev: Any) -> None:
        """Make the compute stream wait for an event (PyCUDA Event or raw driver handle)."""
        if ev is None:
            return
        if isinstance(ev, int):
            from coli.gpu.driver import get_driver
            get_driver().stream_wait(int(self.rt.stream.handle), ev)
        else:
            self.rt.stream.wait_for_event(ev)

    def _decode_ok(self, lay) -> bool:
        return all(vec_ok(m) for m in lay.matrices) and lay.gate.fmt == lay.up.fmt == lay.down.fmt

    def _moe_decode(self, x, idx, weights, recs, groups, out, accumulate: bool = False) -> None:
        first = not accumulate
        route_w = None
        if self._route is not None and self._route[0] is idx:
            route_w = self._route[2]
        for lay, members in groups.items():
            mem = set(members)
            slots = [k for k in range(idx.shape[1]) if int(idx[0, k]) in mem]
            for c0 in range(0, len(slots), MOE_MAXK):
                ks = slots[c0:c0 + MOE_MAXK]
                rs = [recs[int(idx[0, k])] for k in ks]
                table = self.rt.to_device_async(np.array([r.ptr for r in rs], np.uint64))
                if route_w is not None and ks == list(range(idx.shape[1])):
                    wts = route_w.ptr
                else:
                    wts_d = self.rt.to_device_async(np.asarray(weights[0, ks], F32))
                    wts = wts_d.ptr
                for r in rs:                 # gate/up may start while the down parts are still on the bus
                    self._wait(r.ready)
                if self.busy is not None and c0 == 0:
                    self.busy.mark("moe_start")
                scratch = self.moe_scratch(lay, len(ks))
                ok = self.moe_gateup(scratch, table.ptr, x.ptr)
                for r in rs:
                    self._wait(r.ready_down)
                ok = ok and self.moe_down(scratch, table.ptr, wts, out.ptr, not first)
                if not ok:
                    raise RuntimeError("MoE decode kernels do not fit this device's shared memory")
                first = False

    # The fused decode in two halves, so that the caller can wait for the down matrices in between:
    #   s = moe_scratch(record layout, K); moe_gateup(s, table, x); moe_down(s, table, wts, y, accumulate)
    # `table` is the device address of K record pointers; x [H], wts [K], y [H] are device addresses.
    def moe_scratch(self, lay, K: int, version: str | None = None) -> "MoeScratch":
        """The kernel version for K experts of layout `lay` and its device buffers (h, and for the tensor-core
        kernels x and h split into int8 parts). Kept per (layout, K, version asked): a decode step asks for the
        same few every layer, and reusing them is safe for the same reason the memory pool is -- every kernel runs
        in order on the one compute stream, so the next user of a buffer is queued after the last one."""
        key = (lay, K, version or self.moe_kernels)
        sc = self._scratch.get(key)
        if sc is None:
            if len(self._scratch) >= 64:            # bounded: layouts x K x versions seen by this backend
                self._scratch.clear()
            sc = self._scratch[key] = self._new_moe_scratch(lay, K, version)
        return sc

    def _new_moe_scratch(self, lay, K: int, version: str | None) -> "MoeScratch":
        ver = self._moe_version(lay, K, version)
        H, Im = lay.gate.cols, lay.gate.rows
        sc = MoeScratch(ver, lay, K, self.empty((K, Im)))
        if ver == "mma":
            sc.xq = self.rt.empty((H * 4,), np.uint8)
            sc.xc, sc.xf = self.rt.empty((H // 16,), np.int32), self.empty((H // 16,))
            sc.hq = self.rt.empty((K * Im * 4,), np.uint8)
            sc.hc, sc.hf = self.rt.empty((K * Im // 16,), np.int32), self.empty((K * Im // 16,))
        return sc

    def _moe_version(self, lay, K: int, version: str | None = None) -> str:
        ver = version or self.moe_kernels
        if ver in ("auto", "mma"):
            enough = ver == "mma" or K >= MMA_MIN_K
            ver = "mma" if enough and mma_layout_ok(lay, K) and self._mma_fits(lay, K) else "v2"
        fmt, group = lay.gate.fmt, lay.gate.group
        if fmt == "int4" and (ver == "v1" or group not in (32, 64, 128)):   # v2 finds a group by a shift
            return "v1"
        return "v2" if ver == "v1" else ver

    def _mma_fits(self, lay, K: int) -> bool:
        """The tensor-core kernels' shared memory fits this device (a consumer card allows ~99 KiB per block: the
        down kernel's 4.5 K Im bytes of split h can exceed it where v2's 4 K Im still fit), and their module
        compiles here (checked once; a toolkit that rejects it leaves the scalar kernels, not the CPU)."""
        H, Im = lay.gate.cols, lay.gate.rows
        gate_smem = mma_gateup_smem(H)
        down_smem = mma_down_smem(Im, K) + MMA_DOWN_STATIC_SMEM
        if max(gate_smem, down_smem) > self.rt.smem_optin:
            return False
        return self._compiles_once("_mma_usable", "moe_mma", "tensor-core MoE", "scalar ones")

    def moe_gateup(self, sc: "MoeScratch", table: int, x: int) -> bool:
        lay, K = sc.lay, sc.K
        if sc.version == "mma":
            H, Im = lay.gate.cols, lay.gate.rows
            f_split = self._fn("moe_mma", "moe_split_x4")
            self.rt.launch(f_split, (H // 64, 1), 32, x, 1, H, sc.xq.ptr, sc.xc.ptr, sc.xf.ptr)
            fn = self._fn("moe_mma", "moe_gateup_mma_int4")
            smem = mma_gateup_smem(H)
            if not self.rt.allow_smem(fn, smem):
                return False
            g = lay.gate
            self.rt.launch(fn, (K * Im // 64,), MMA_THREADS, table, g.offset, lay.up.offset, Im, H, g.group,
                           g.rows_per_tile, g.tile_bytes, K, sc.xq.ptr, sc.xc.ptr, sc.xf.ptr, sc.h.ptr, sc.hq.ptr,
                           sc.hc.ptr, sc.hf.ptr, smem=smem)
            return True
        return self._moe_decode_launch(lay.gate.fmt, table, 0, lay.gate, lay.up.offset - lay.gate.offset, K, x,
                                       sc.h.ptr, gate_off=lay.gate.offset, version=sc.version)

    def moe_down(self, sc: "MoeScratch", table: int, wts: int, y: int, accumulate: bool) -> bool:
        lay, K = sc.lay, sc.K
        if sc.version == "mma":
            d = lay.down
            H, Im = d.rows, d.cols
            fn = self._fn("moe_mma", "moe_down_mma_int4")
            smem = mma_down_smem(Im, K)
            if not self.rt.allow_smem(fn, smem):
                return False
            self.rt.launch(fn, (H // MMA_DOWN_ROWS,), MMA_THREADS, table, d.offset, H, Im, d.group, d.rows_per_tile,
                           d.tile_bytes, K, wts, sc.hq.ptr, sc.hc.ptr, sc.hf.ptr, y, int(accumulate), smem=smem)
            return True
        return self._moe_down_launch(lay.down.fmt, table, 0, lay.down, lay.down.offset, K, wts, sc.h.ptr, y,
                                     int(accumulate), version=sc.version)

    def _moe_kernel(self, part: str, fmt: str, version: str | None, group: int) -> str:
        """Name of the scalar fused decode kernel `part` ("gateup" / "down") for a format."""
        ver = version or self.moe_kernels
        if fmt == "int4" and (ver == "v1" or group not in (32, 64, 128)):   # v2 finds a group by a shift
            return f"moe_{part}_int4_v1"
        return f"moe_{part}_{fmt}"

    def _moe_decode_launch(self, fmt, table, base, lay, up_off, K, x, h, gate_off: int = 0,
                           version: str | None = None) -> bool:
        fn = self._fn("gemv", self._moe_kernel("gateup", fmt, version, lay.group))
        smem = lay.row_data_bytes // 16 * _chunk_vals(fmt) * 4
        if not self.rt.allow_smem(fn, smem):
            return False
        need = -(-K * lay.rows // (MOE_THREADS // 32))
        blocks = min(need, self.rt.resident_blocks(fn, MOE_THREADS, smem))
        self.rt.launch(fn, (blocks,), MOE_THREADS, table, base, gate_off, gate_off + up_off, lay.rows, lay.cols,
                       lay.group or 32, lay.rows_per_tile, lay.tile_bytes, K, x, h, smem=smem)
        return True

    def _moe_down_launch(self, fmt, table, base, lay, down_off, K, wts, h, y, accumulate,
                         version: str | None = None) -> bool:
        fn = self._fn("gemv", self._moe_kernel("down", fmt, version, lay.group))
        smem = K * (lay.row_data_bytes // 16 * _chunk_vals(fmt)) * 4
        if not self.rt.allow_smem(fn, smem):
            return False
        need = -(-((lay.rows + 1) // 2) // (MOE_THREADS // 32))
        blocks = min(need, self.rt.resident_blocks(fn, MOE_THREADS, smem))
        self.rt.launch(fn, (blocks,), MOE_THREADS, table, base, down_off, lay.rows, lay.cols, lay.group or 32,
                       lay.rows_per_tile, lay.tile_bytes, K, wts, h, y, accumulate, smem=smem)
        return True

    def _moe_prefill(self, x, idx, weights, recs, groups, out, accumulate: bool = False,
                     splits: dict | None = None) -> None:
        S, H = x.shape
        K = idx.shape[1]
        # record layouts the tensor-core kernels take run there; the rest (other formats, host experts uploaded as
        # f32 records) through the fp32 GEMMs below, accumulating into the same output
        mma = {lay: m for lay, m in groups.items() if pf_moe_layout_ok(lay)
               and self._pf_ok(max(pf_smem(lay.gate.cols, lay.gate.group), pf_smem(lay.down.cols, lay.down.group)))}
        if mma:
            self._moe_prefill_mma(x, idx, weights, recs, mma, out, accumulate, splits)
            accumulate = True
            groups = {lay: m for lay, m in groups.items() if lay not in mma}
            if not groups:
                return
        lay0 = next(iter(groups))
        handled = {e for m in groups.values() for e in m}
        Im = lay0.gate.rows
        per_token = K * max(H, Im) * 4 * 2
        chunk = max(1, MOE_CHUNK_BYTES // per_token)
        f_red = self._fn("gemm", "moe_reduce")
        for s0 in range(0, S, chunk):
            n = min(chunk, S - s0)
            xi = x.row_view(s0, n)
            ii = idx[s0:s0 + n]
            wi = np.asarray(weights[s0:s0 + n], F32)
            Y = self.empty((n, K, H))
            if (ii < 0).any() or not set(ii[ii >= 0].tolist()) <= handled:
                # pruned slots (expert top-p), or experts of another batch or layout: their rows of Y stay zero
                self.rt.zero(Y.ptr, Y.nbytes)
            for lay, members in groups.items():
                self._moe_prefill_group(xi, ii, wi, recs, lay, members, Y)
            self.rt.launch(f_red, (self._grid1d(n * H),), 256, Y.ptr, 0, n, K, H, out.ptr + s0 * H * 4,
                           int(accumulate))

    def _moe_prefill_mma(self, x, idx, weights, recs, groups, out, accumulate: bool = False,
                         splits: dict | None = None) -> None:
        """The grouped MoE prefill on the tensor cores: x split once per chunk, then per record layout one gate/up
        launch and one down launch over every expert's pair tiles, the (token, slot) rows summed in slot order.

        A step whose experts arrive in several batches (a pool smaller than the layer's experts) calls this once a
        batch; what does not depend on the batch is not redone for each: x's split is kept in `splits` (the
        step's, keyed by chunk), and a batch that covers only some of a chunk's (token, slot) pairs sums just
        those (moe_reduce with a mask) instead of zeroing and summing the whole [rows, K, H] partials -- the same bits,
        since the skipped slots were zeros added. Before, each batch did both over every row of the step: ~1 ms a
        batch at 8,192 rows, 32 batches a layer on 16 slots (docs/perf-notes.md, "A long step on a small pool")."""
        S, H = x.shape
        K = idx.shape[1]
        Im = max(lay.gate.rows for lay in groups)
        per_token = K * H * 4 + K * Im * 19 // 4 + H * 19 // 4      # Y [K, H] + split h + split x
        chunk = max(1, PREFILL_CHUNK_BYTES // per_token)
        handled = {e for m in groups.values() for e in m}
        f_red = self._fn("gemm", "moe_reduce")
        for s0 in range(0, S, chunk):
            n = min(chunk, S - s0)
            ii = idx[s0:s0 + n]
            wi = np.asarray(weights[s0:s0 + n], F32)
            xs = None if splits is None else splits.get((s0, n))
            if xs is None:
                xs = self._pf_split(x.ptr + s0 * H * 4, n, H)
                if splits is not None:
                    splits[(s0, n)] = xs
            xq, xm = xs
            Y = self.empty((n, K, H))
            # pruned slots, another batch's or layout's experts: their rows of Y are never written, and the reduce
            # below skips them
            mine = np.isin(ii, np.fromiter(handled, np.int64, len(handled)))        # [n, K] bool
            mask = None if mine.all() else self.rt.to_device_async(mine.astype(np.uint8))
            for lay, members in groups.items():
                pairs = self._moe_pairs(ii, wi, recs, members, PF_TOKS)
                if pairs is None:
                    continue
                table, tiles_d, tok_d, slot_d, pw_d, n_tiles, P = pairs
                g, d = lay.gate, lay.down
                hq = self.rt.empty((P * g.rows * 4,), np.uint8)
                hm = self.rt.empty((P * (g.rows // 64) * 12,), np.int32)
                f_gu = self._fn("prefill_mma", "pf_gateup_int4")
                smem = pf_smem(g.cols, g.group)
                self.rt.allow_smem(f_gu, smem)
                self.rt.launch(f_gu, (g.rows // (PF_ROWS // 2), n_tiles), pf_threads(), table.ptr, g.offset,
                               lay.up.offset, g.rows, g.cols, g.group, g.rows_per_tile, g.tile_bytes, tiles_d.ptr,
                               tok_d.ptr, xq.ptr, xm.ptr, hq.ptr, hm.ptr, smem=smem)
                f_dn = self._fn("prefill_mma", "pf_down_int4")
                smem = pf_smem(d.cols, d.group)
                self.rt.allow_smem(f_dn, smem)
                self.rt.launch(f_dn, (d.rows // PF_ROWS, n_tiles), pf_threads(), table.ptr, d.offset, d.rows, d.cols,
                               d.group, d.rows_per_tile, d.tile_bytes, tiles_d.ptr, tok_d.ptr, slot_d.ptr, pw_d.ptr,
                               hq.ptr, hm.ptr, K, Y.ptr, smem=smem)
            self.rt.launch(f_red, (self._grid1d(n * H),), 256, Y.ptr, 0 if mask is None else mask.ptr, n, K, H,
                           out.ptr + s0 * H * 4, int(accumulate))

    def _moe_pairs(self, idx, weights, recs, members, tile: int = 64):
        """The (token, slot) pairs routed to `members`, sorted by expert (stable: token order inside an expert), on
        the device: (record table, tiles [(member, first pair, count <= tile)], pair token, pair slot, pair weight,
        number of tiles, number of pairs); None when no pair routes there."""
        tok, slot, gid, tiles = moe_pair_tiles(idx, members, tile)
        if tok.size == 0:
            return None
        pw = weights[tok, slot].astype(F32)
        packed = [np.array([recs[e].ptr for e in members], np.uint64), tiles.reshape(-1),
                  tok.astype(np.int32), slot.astype(np.int32), pw]
        return (*(self.rt.to_device_async(a) for a in packed), len(tiles), tok.size)

    def _moe_prefill_group(self, x, idx, weights, recs, lay, members, Y) -> None:
        n, K = idx.shape
        H, Im = lay.down.rows, lay.gate.rows
        pairs = self._moe_pairs(idx, weights, recs, members)
        if pairs is None:
            return
        table, tiles_d, tok_d, slot_d, pw_d, n_tiles, P = pairs
        hb = self.empty((P, Im))
        fmt = lay.gate.fmt
        f_gu = self._fn("gemm", f"moe_gateup_gemm_{fmt}")
        self.rt.launch(f_gu, (n_tiles, -(-Im // 64)), 256, table.ptr, lay.gate.offset, lay.up.offset, Im, H,
                       lay.gate.group or 32, lay.gate.rows_per_tile, lay.gate.tile_bytes, tiles_d.ptr, tok_d.ptr,
                       x.ptr, hb.ptr)
        f_dn = self._fn("gemm", f"moe_down_gemm_{lay.down.fmt}")
        self.rt.launch(f_dn, (n_tiles, -(-H // 64)), 256, table.ptr, lay.down.offset, H, Im,
                       lay.down.group or 32, lay.down.rows_per_tile, lay.down.tile_bytes, tiles_d.ptr, tok_d.ptr,
                       slot_d.ptr, pw_d.ptr, hb.ptr, K, Y.ptr)

    # ---- logits ---------------------------------------------------------------------------------------------
    def argmax(self, x: DeviceArray) -> np.ndarray:
        """Index of the first maximum of each row of x [S, V] (greedy decoding), computed on the device."""
        out = self.rt.empty((x.shape[0],), np.int32)
        self.argmax_into(x, out.ptr)
        if self.busy is not None:
            self.busy.mark("end")
        return self.rt.to_host(out).astype(np.int64)


    def argmax_into(self, x: DeviceArray, out: int) -> None:
        """out[s] (int32, device) = the first maximum of row s of x [S, V]; queued, nothing read back."""
        S, V = x.shape
        G = max(1, min(-(-V // 1024), 64))
        pv = self.empty((S, G))
        pi = self.rt.empty((S, G), np.int32)
        self.rt.launch(self._fn("argmax", "argmax_partial"), (G, S), 1024, x.ptr, V, pv.ptr, pi.ptr)
        self.rt.launch(self._fn("argmax", "argmax_final"), (S,), 1024, pv.ptr, pi.ptr, G, out)


@dataclass
class DeviceRoute:
    """A router's choice left on the device (a captured decode step): idx [1, K] int32, weights [1, K] fp32."""

    idx: DeviceArray
    weights: DeviceArray
    K: int


@dataclass
class _MoeStep:
    """One MoE call's state across its batches."""

    x: DeviceArray                      # [S, H]
    idx: np.ndarray                     # [S, K]
    weights: np.ndarray                 # [S, K]
    pending: dict = None                # expert id -> DeviceRecord, not launched yet
    seen: set = None
    out: DeviceArray | None = None      # [S, H] once a batch ran
    x_host: np.ndarray | None = None    # [S, H], fetched for the first CPU expert
    host_sum: np.ndarray | None = None  # [S, H] the CPU experts' weighted sum
    splits: dict = None                 # (first row, rows) -> x's int8 split for the tensor-core prefill, made once

    def __post_init__(self):
        self.pending = {} if self.pending is None else self.pending
        self.seen = set() if self.seen is None else self.seen
        self.splits = {} if self.splits is None else self.splits


@dataclass
class MoeScratch:
    """One fused decode's kernel version and device buffers (CudaBackend.moe_scratch)."""
    version: str
    lay: Any                 # the records' RecordLayout
    K: int
    h: DeviceArray           # [K, Im] fp32: silu(gate) * up
    xq: Any = None           # tensor-core kernels: x split into int8 parts (moe_mma.cu's layout) ...
    xc: Any = None
    xf: Any = None
    hq: Any = None           # ... and h split the same way (written by gate/up, read by down)
    hc: Any = None
    hf: Any = None


def mma_gateup_smem(H: int) -> int:
    """Dynamic shared memory of moe_gateup_mma_int4: split x (H / 32 chunks x 128 B, H / 64 blocks x 32 B) + h."""
    return H // 32 * 128 + H // 64 * 32 + 256


def mma_down_smem(Im: int, K: int) -> int:
    """Dynamic shared memory of moe_down_mma_int4: the K experts' split h."""
    return K * (Im // 32 * 128 + Im // 64 * 32)


MMA_DOWN_STATIC_SMEM = (MMA_THREADS // 32) * MMA_DOWN_ROWS * 4     # its static `red` array


def mma_layout_ok(lay, K: int) -> bool:
    """Whether the tensor-core MoE kernels (cuda/moe_mma.cu) can run K experts of this record layout: int4 with
    groups of 64 or 128, widths in whole 128-column steps, 1 <= K <= 8."""
    g, u, d = lay.gate, lay.up, lay.down
    return (1 <= K <= MOE_MAXK and all(m.fmt == "int4" and m.group in (64, 128) and vec_ok(m) for m in (g, u, d))
            and g.cols % 128 == 0 and g.rows % 128 == 0 and g.cols % MMA_DOWN_ROWS == 0
            and d.rows == g.cols and d.cols == g.rows
            and u.rows == g.rows and u.cols == g.cols and u.group == g.group
            and (u.rows_per_tile, u.tile_bytes) == (g.rows_per_tile, g.tile_bytes))


def moe_pair_tiles(idx: np.ndarray, members, tile: int):
    """The grouped MoE's work list, vectorised (a 2,048-token GLM-5 prompt has 16,384 pairs a layer: a Python loop
    over them cost ~30 ms of host time per layer, twice the kernels' GPU time). idx [S, K] expert ids (-1: pruned);
    members: the expert ids of this launch, in table order. -> (token [P], slot [P], member index [P]) of the pairs
    routed to members, sorted by member (stable: (token, slot) order inside a member), and tiles [T, 3] int32 of
    (member index, first pair, count <= tile), every member's pairs cut into consecutive tiles."""
    members = np.asarray(members, np.int64)
    K = idx.shape[1]
    lut = np.full(int(max(members.max(), idx.max(initial=0))) + 1, -1, np.int64)
    lut[members] = np.arange(members.size)
    flat = idx.reshape(-1)
    g = np.where(flat >= 0, lut[np.maximum(flat, 0)], -1)
    sel = np.flatnonzero(g >= 0)                            # row-major: (token, slot) order
    order = np.argsort(g[sel], kind="stable")
    sel, gid = sel[order], g[sel][order]
    counts = np.bincount(gid, minlength=members.size)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    ntile = -(-counts // tile)
    tg = np.repeat(np.arange(members.size), ntile)
    k = np.arange(tg.size) - np.repeat(np.cumsum(ntile) - ntile, ntile)   # tile number inside its member
    p0 = bounds[tg] + k * tile
    cnt = np.minimum(tile, bounds[tg + 1] - p0)
    return sel // K, sel % K, gid, np.stack([tg, p0, cnt], axis=1).astype(np.int32)


def pf_layout_ok(lay) -> bool:
    """Whether the tensor-core prefill GEMM (pf_linear_int4) takes this stored matrix: int4 in groups of 64 or 128
    that divide the columns (whole 64-column blocks), rows in whole blocks of PF_ROWS, 16-byte aligned rows."""
    return (lay.fmt == "int4" and lay.group in (64, 128) and lay.cols % lay.group == 0 and lay.rows % PF_ROWS == 0
            and vec_ok(lay))


def pf_int8_layout_ok(lay) -> bool:
    """Whether pf_linear_int8 (the tensor-core prefill GEMM for int8 weights, one fp16 scale per row) takes this
    stored matrix: whole 64-column blocks (the split x's), 16-byte aligned rows; any number of rows (the block's rows
    past the end repeat the last one and are not written)."""
    return lay.fmt == "int8" and lay.cols % 64 == 0 and lay.rows >= 1 and vec_ok(lay)


def pf_moe_layout_ok(lay) -> bool:
    """Whether the tensor-core grouped MoE prefill takes this record layout: gate and up alike ([Im, H], Im in whole
    blocks of PF_ROWS / 2: a block holds that many gate and the same up rows) and down [H, Im] as pf_layout_ok wants."""
    g, u, d = lay.gate, lay.up, lay.down
    return (all(m.fmt == "int4" and m.group in (64, 128) and m.cols % m.group == 0 and vec_ok(m) for m in (g, u, d))
            and g.rows % (PF_ROWS // 2) == 0 and d.rows % PF_ROWS == 0 and d.rows == g.cols and d.cols == g.rows
            and (u.rows, u.cols, u.group, u.rows_per_tile, u.tile_bytes)
            == (g.rows, g.cols, g.group, g.rows_per_tile, g.tile_bytes))


def pf_threads() -> int:
    """Threads per prefill_mma.cu GEMM block: a warp per 64 weight rows x 16 activation rows (PF_THREADS there)."""
    return 32 * (PF_ROWS // 64) * (PF_TOKS // 16)


def pf_smem(cols: int, group: int, fmt: str = "int4") -> int:
    """Dynamic shared memory of the prefill_mma.cu GEMMs over `cols` columns: PF_STAGES stages (weights, split x,
    metadata), the block's fp16 group scales, its row-address and activation-row tables. int8 (pf_linear_int8): a
    weight row stages 64 bytes per 64 columns, and its one scale per row is read at the end (none staged)."""
    if fmt == "int8":
        return PF_STAGES * (PF_ROWS * 64 + PF_TOKS * 256 + PF_TOKS * 48) + PF_ROWS * 16 + PF_TOKS * 4
    stage = PF_ROWS * 32 + PF_TOKS * 256 + PF_TOKS * 48
    scales = -(-(PF_ROWS * (cols // group) * 2) // 16) * 16
    return PF_STAGES * stage + scales + PF_ROWS * 16 + PF_TOKS * 4


def gemv_rows_plan(S: int, row_smem: int, smem_optin: int, reserve: int = 1024) -> list[tuple[int, int]]:
    """gemv2r launches for S input rows: (first row, rows) each, as many rows per launch as fit in the shared memory
    (row_smem bytes each, `reserve` left for the kernel's static arrays) up to GEMV2R_MAX, spread evenly (5 rows
    -> 3 + 2, not 4 + 1); [] when fewer than 2 fit (the GEMM is better than gemv2r one row at a time)."""
    fit = min(GEMV2R_MAX, (smem_optin - reserve) // max(1, row_smem))
    if fit < 2 or S < 2:
        return []
    launches = -(-S // fit)
    base, extra = divmod(S, launches)
    out, r0 = [], 0
    for i in range(launches):
        n = base + (i < extra)
        out.append((r0, n))
        r0 += n
    return out


def gemv2_fits(fmt: str, group: int, x: int, x_z: int) -> bool:
    """gemv2_<fmt> stages x with 16-byte loads and finds an int4 group by a shift."""
    return x % 16 == 0 and x_z % 4 == 0 and (fmt != "int4" or group in (32, 64, 128))


def gemv2x_groups(ws, x: int) -> list[list[int]]:
    """Indices of `ws` that gemv2x can take together: groups of 2..GEMV2X_MAX matrices of one format, width and group
    (in the order given), each one gemv2 could take alone (16-byte rows, x aligned, an int4 group by a shift)."""
    by: dict[tuple, list[int]] = {}
    for j, w in enumerate(ws):
        if w.vec_ok and gemv2_fits(w.fmt, w.layout.group, x, 0):
            by.setdefault((w.fmt, w.cols, w.layout.group or 0), []).append(j)
    out = []
    for js in by.values():
        out += [js[c:c + GEMV2X_MAX] for c in range(0, len(js), GEMV2X_MAX) if len(js[c:c + GEMV2X_MAX]) > 1]
    return out


def _check_width(x: DeviceArray, w: QWeight, what: str) -> None:
    if x.shape[1] != w.cols:
        raise ValueError(f"{what}: input of width {x.shape[1]} for a weight of shape [{w.rows}, {w.cols}]")


def gemv2_split(N: int, nchunks: int, blocks: int) -> int:
    """Column segments per work item (ks) of gemv2 / gemv2x over N rows of nchunks 16-byte chunks, on `blocks`
    resident blocks: of ks = 1, 2, 4, 8 the one with the least work on the busiest block -- ceil(groups / blocks)
    rounds, each a segment's nchunks / ks chunks plus GEMV2_ROUND_CHUNKS of fixed cost (a round trip, the partial
    sums), groups = ceil(ceil(N / GEMV2_ROWS) / (8 / ks)) -- keeping >= 2 chunks per lane per segment
    (nchunks / ks >= 64) for ks > 1; a tie goes to the smaller ks (fewer partial sums to add). Against the forced-ks
    sweep on the H200 (scripts/bench_kernels.py, 2026-12-01): o_proj 6144 x 16384 int4 38.3 / 34.5 / 34.2 / 43.0 us at
    ks 1 / 2 / 4 / 8 -> 2 (at 1, 384 groups on 264 blocks left half the blocks a second round); q_a | kv_a | wk in one
    launch 13.1 / 13.6 / 14.8 us -> 1; q_b 16384 x 2048 15.2 / 22.6 -> 1; kv_a 7.9 / 6.6 / 6.6 -> 4; the router's
    256 x 6144 f32 11.4 / 8.1 / 6.5 / 6.5 -> 8."""
    items = -(-N // GEMV2_ROWS)
    best, best_cost = 1, None
    for ks in (1, 2, 4, 8):
        if ks > GEMV2_WARPS or (ks > 1 and nchunks // ks < 64):
            break
        groups = -(-items // (GEMV2_WARPS // ks))
        cost = -(-groups // max(1, blocks)) * (-(-nchunks // ks) + GEMV2_ROUND_CHUNKS)
        if best_cost is None or cost < best_cost:
            best, best_cost = ks, cost
    return best


def _chunk_vals(fmt: str) -> int:
    return {"f32": 4, "bf16": 8, "int8": 16, "int4": 32}[fmt]
