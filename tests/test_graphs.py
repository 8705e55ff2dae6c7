"""The pure parts of the replayed decode step (coli/gpu/graphs.py), no GPU needed: the COLI_GRAPHS setting, the
byte layout of a step's per-token inputs, the slot table, the key a graph is captured under, the reasons a step
stays eager, and the ctypes prototypes of the driver calls (coli/gpu/driver.py) against the CUDA toolkit's cuda.h.
The replays themselves are checked against the eager step on the GPU (tests/gpu/test_gpu_graphs.py)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from coli.errors import ColiError
from coli.gpu.graphs import (StepLayout, build_slot_table, graphs_enabled, route_mode, segments_enabled, step_key,
                             why_not_graphable)
from coli.model.backend import cos_sin_table

DEMO = Path(__file__).resolve().parent.parent / "coli" / "demo" / "model"


def test_coli_graphs_setting():
    assert graphs_enabled({}) is True
    assert graphs_enabled({"COLI_GRAPHS": "1"}) is True
    assert graphs_enabled({"COLI_GRAPHS": "0"}) is False
    with pytest.raises(ColiError, match="COLI_GRAPHS='off'.*use 1.*or 0"):
        graphs_enabled({"COLI_GRAPHS": "off"})


def test_coli_graphs_stream_setting():
    assert segments_enabled({}) is True
    assert segments_enabled({"COLI_GRAPHS_STREAM": "0"}) is False
    with pytest.raises(ColiError, match="COLI_GRAPHS_STREAM='2'"):
        segments_enabled({"COLI_GRAPHS_STREAM": "2"})


def test_step_layout_packs_every_field_where_the_kernels_read_it():
    lay = StepLayout(half=32, moe_layers=(1, 3, 4), K=8)
    assert lay.nbytes == 16 + 8 * 32 + 3 * 8 * 8
    buf = np.zeros(lay.nbytes, np.uint8)
    cos, sin = cos_sin_table([37], 64, 10000.0)                           # [1, 32] each
    forced = {3: (np.arange(8).reshape(1, 8) + 10, np.linspace(0.1, 0.8, 8, dtype=np.float32).reshape(1, 8))}
    lay.pack(buf, token=1234, pos=37, cos=cos, sin=sin, forced=forced)
    head = buf[:16].view(np.int32)
    assert head.tolist() == [1234, 37, 38, 0]                              # token, position, T = position + 1
    a = buf[lay.angles_offset:lay.angles_offset + 8 * 32].view(np.float32)
    assert np.array_equal(a[:32], cos[0]) and np.array_equal(a[32:], sin[0])
    offs = [lay.route_offset(i) for i in (1, 3, 4)]
    assert offs == sorted(offs) and offs[0] == 16 + 8 * 32 and offs[-1] + 64 == lay.nbytes
    o = lay.route_offset(3)
    assert buf[o:o + 32].view(np.int32).tolist() == list(range(10, 18))
    assert np.array_equal(buf[o + 32:o + 64].view(np.float32), forced[3][1][0])
    assert not buf[lay.route_offset(1):lay.route_offset(3)].any()          # layers not forced stay untouched
    with pytest.raises(ValueError, match="uint8 buffer of 464 bytes"):
        lay.pack(np.zeros(10, np.uint8), 0, 0, cos, sin)
    with pytest.raises(ValueError):
        lay.route_offset(2)                                                # not a MoE layer of the layout


def test_slot_table():
    t = build_slot_table(4, 3, [1, 3], lambda layer, e: 0x1000 * (layer + 1) + 0x10 * e)
    assert t.dtype == np.uint64 and t.shape == (4, 3)
    assert t[1].tolist() == [0x2000, 0x2010, 0x2020] and t[3].tolist() == [0x4000, 0x4010, 0x4020]
    assert not t[0].any() and not t[2].any()
    with pytest.raises(ValueError, match="layer 1 expert 2 has no record address"):
        build_slot_table(4, 3, [1], lambda layer, e: 0 if e == 2 else 64)
    with pytest.raises(ValueError, match="layer 4 outside"):
        build_slot_table(4, 3, [4], lambda layer, e: 64)


@pytest.fixture(scope="module")
def demo():
    from coli.loader import load_model
    model, _ = load_model(DEMO, "cpu")
    return model


def test_the_step_key_holds_while_the_cache_keeps_its_buffers(demo):
    cache = demo.new_cache(4)
    keys = []
    tok = 1
    for _ in range(6):
        cache.reserve(1)
        keys.append(step_key(cache, "router", "auto"))
        tok = demo.greedy([tok], cache)
    assert keys[0] == keys[1] == keys[2] == keys[3]            # capacity 4: positions 0..3
    assert keys[4] != keys[3] and keys[4][0] == 8              # it grew (new buffers): a new graph
    assert keys[5] == keys[4]
    assert step_key(cache, "forced", "auto") != step_key(cache, "router", "auto")
    assert step_key(cache, "dropped", "auto") != step_key(cache, "forced", "auto")
    assert step_key(cache, "router", "v2") != step_key(cache, "router", "auto")


def test_why_a_step_stays_eager(demo):
    assert demo.step_graphs is None                            # the numpy backend replays nothing
    assert "prefill" in why_not_graphable(demo, [1, 2])
    assert why_not_graphable(demo, [1]) is None               # the model side allows it (the experts are checked
                                                              # by the decoder, with the routing)
    demo.routing_hook = lambda *a: None
    try:
        assert "routing hook" in why_not_graphable(demo, [1])
    finally:
        demo.routing_hook = None
    demo.topp = 0.9
    try:
        assert "top-p" in why_not_graphable(demo, [1])
    finally:
        demo.topp = None


def test_route_mode():
    K, E = 3, 8
    r = lambda *ids: (np.array([ids]), np.full((1, len(ids)), 0.5, np.float32))   # noqa: E731
    assert route_mode({0: r(1, 2, 3), 2: r(7, 0, 4)}, K, E) == ("forced", None)
    assert route_mode({0: r(-1, -1, -1), 2: r(-1, -1, -1)}, K, E) == ("dropped", None)
    assert "dropped slots" in route_mode({0: r(1, -1, 3)}, K, E)[1]
    assert "outside 0..7" in route_mode({0: r(1, 8, 3)}, K, E)[1]
    assert "some layers only" in route_mode({0: r(-1, -1, -1), 2: r(1, 2, 3)}, K, E)[1]
    assert "keeps the router's choice at layer 2" in route_mode({0: r(1, 2, 3), 2: None}, K, E)[1]
    assert "shape (1, 2)" in route_mode({0: r(1, 2)}, K, E)[1]


# ---- the driver's ctypes prototypes against cuda.h -------------------------------------------------------------
HANDLES = {"CUstream", "CUevent", "CUgraph", "CUgraphExec", "CUcontext", "CUgraphNode"}
ENUMS = {"CUresult", "CUstreamCaptureMode", "CUstreamCaptureStatus", "CUgraphNodeType"}
STRUCTS = {"CUgraphEdgeData"}       # passed by pointer: kind *e


def _cuda_h() -> Path | None:
    for d in ("/usr/local/cuda/include",):
        if Path(d, "cuda.h").is_file():
            return Path(d, "cuda.h")
    nvcc = shutil.which("nvcc")
    if nvcc:
        p = Path(nvcc).resolve().parent.parent / "include" / "cuda.h"
        if p.is_file():
            return p
    return None


def _c_kind(param: str) -> str:
    """A C parameter's kind: h handle/opaque pointer, *h pointer to a handle, *i *z *f *s pointers to
    int/enum, size_t, float, char*; i int/enum, u unsigned int, q 64-bit unsigned."""
    p = " ".join(param.replace("const ", "").split())
    stars = p.count("*")
    base = re.sub(r"\s*\*+\s*\w*$", "", p).strip() if stars else p.rsplit(" ", 1)[0]
    if stars == 0:
        if base in HANDLES:
            return "h"
        if base in ENUMS or base == "int":
            return "i"
        if base == "unsigned int":
            return "u"
        if base in ("size_t", "unsigned long long", "CUdeviceptr"):
            return "q"
    elif stars == 1:
        if base == "void":
            return "h"
        if base in HANDLES:
            return "*h"
        if base in ENUMS or base == "int":
            return "*i"
        if base in ("size_t", "CUdeviceptr"):   # both 8-byte unsigned: ctypes' c_uint64 is c_size_t on LP64
            return "*z"
        if base == "float":
            return "*f"
        if base in STRUCTS:
            return "*e"
    elif stars == 2 and base == "char":
        return "*s"
    raise AssertionError(f"cuda.h parameter of a type the check does not know: {param!r}")


def _ctypes_kind(t) -> str:
    if t is ctypes.c_void_p:
        return "h"
    if t in (ctypes.c_int,):
        return "i"
    if t is ctypes.c_uint:
        return "u"
    if t in (ctypes.c_uint64, ctypes.c_ulonglong, ctypes.c_size_t):
        return "q"
    inner = getattr(t, "_type_", None)
    if inner is ctypes.c_void_p:
        return "*h"
    if inner is ctypes.c_int:
        return "*i"
    if inner is ctypes.c_size_t:
        return "*z"
    if inner is ctypes.c_float:
        return "*f"
    if inner is ctypes.c_char_p:
        return "*s"
    if isinstance(inner, type) and issubclass(inner, ctypes.Structure) and inner.__name__ in STRUCTS:
        return "*e"
    raise AssertionError(f"ctypes type the check does not know: {t!r}")


@pytest.mark.skipif(_cuda_h() is None or shutil.which("gcc") is None,
                    reason="cuda.h or gcc not found (install the CUDA toolkit to check the driver prototypes)")
def test_driver_ctypes_prototypes_match_cuda_h(tmp_path):
    from coli.gpu.driver import signatures
    h = _cuda_h()
    src = tmp_path / "t.c"
    src.write_text("#include <cuda.h>\n")
    pre = subprocess.run(["gcc", "-E", "-I", str(h.parent), str(src)], capture_output=True, text=True, check=True).stdout
    raw = h.read_text()
    for name, args in signatures().items():
        # the exported symbol as the preprocessed header declares it, else its declaration in the raw header
        # (symbols the current API maps to a newer version, e.g. cuEventElapsedTime -> _v2, are still exported)
        m = re.search(rf"CUresult\s+{name}\s*\(([^)]*)\)\s*;", pre) or \
            re.search(rf"CUresult\s+CUDAAPI\s+{name}\s*\(([^)]*)\)\s*;", raw)
        assert m, f"cuda.h declares no {name}"
        params = [p for p in m.group(1).split(",") if p.strip() and p.strip() != "void"]
        want = [_c_kind(p) for p in params]
        got = [_ctypes_kind(t) for t in args]
        assert got == want, f"{name}: ctypes {got}, cuda.h {want} ({m.group(1)})"


@pytest.mark.skipif(_cuda_h() is None or shutil.which("gcc") is None,
                    reason="cuda.h or gcc not found (install the CUDA toolkit to check the driver's graph constants)")
def test_graph_edge_struct_and_constants_match_cuda_h(tmp_path):
    """COLI_PDL writes CUgraphEdgeData structs and compares node types: their layout and the enum values are
    cuda.h's, compiled and printed by gcc, not copied by hand."""
    from coli.gpu import driver as D
    src = tmp_path / "t.c"
    src.write_text("""#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu\\n", sizeof(CUgraphEdgeData), offsetof(CUgraphEdgeData, from_port),
           offsetof(CUgraphEdgeData, to_port), offsetof(CUgraphEdgeData, type), offsetof(CUgraphEdgeData, reserved));
    printf("%d %d %d %d %d\\n", (int)CU_GRAPH_NODE_TYPE_KERNEL, (int)CU_GRAPH_DEPENDENCY_TYPE_DEFAULT,
           (int)CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, (int)CU_GRAPH_KERNEL_NODE_PORT_DEFAULT,
           (int)CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC);
    return 0;
}
""")
    exe = tmp_path / "t"
    subprocess.run(["gcc", "-I", str(_cuda_h().parent), str(src), "-o", str(exe)], check=True, capture_output=True)
    layout, values = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")[:2]
    S = D.CUgraphEdgeData
    assert [int(v) for v in layout.split()] == [ctypes.sizeof(S), S.from_port.offset, S.to_port.offset,
                                                S.type.offset, S.reserved.offset]
    assert [int(v) for v in values.split()] == [D.CU_GRAPH_NODE_TYPE_KERNEL, D.CU_GRAPH_DEPENDENCY_TYPE_DEFAULT,
                                                D.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC,
                                                D.CU_GRAPH_KERNEL_NODE_PORT_DEFAULT,
                                                D.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC]


def test_the_decoder_remembers_a_bounded_number_of_shapes():
    from coli.gpu.graphs import _Bounded
    b = _Bounded()
    for i in range(_Bounded.KEEP_KEYS + 10):
        b[("key", i)] = True
    assert len(b) == _Bounded.KEEP_KEYS and ("key", 9) not in b and ("key", 10) in b
    b[("key", 10)] = True                                   # touched: now the newest
    b[("key", 999)] = True
    assert ("key", 10) in b and ("key", 11) not in b


@pytest.mark.parametrize("nh,Lkv,sm,topk", [(64, 512, 132, 2048), (4, 32, 132, 8), (16, 64, 84, 100), (64, 512, 46, 2048)])
def test_a_captured_step_chunks_its_attention_like_the_eager_step(nh, Lkv, sm, topk):
    """The split attention sums a row chunk by chunk: a replayed step gives the eager step's bits only if its chunks
    are the eager step's. The eager step sizes them by T (dense mask, T <= topk) or topk (the indexer's top-k);
    attn_span gives a length with the same chunk size and enough chunks for T, constant over each range of T with
    one chunk size (one graph per range: 4 on the H200 at GLM-5's shape, ~11 on a 46-SM card)."""
    from coli.gpu.attention_split import split_chunks
    from coli.gpu.graphs import attn_span
    spans, chunks = set(), set()
    for T in range(1, topk + 40):
        eager_n = T if T <= topk else topk
        chunk, _ = split_chunks(eager_n, 1, nh, Lkv, sm)
        chunks.add(chunk)
        span = attn_span(T, topk, nh, Lkv, sm)
        g_chunk, g_nchunk = split_chunks(span, 1, nh, Lkv, sm)
        assert g_chunk == chunk, (T, span)
        assert g_nchunk * g_chunk >= min(T, topk), (T, span)             # every key of the row has a block
        assert min(T, topk) <= span <= topk
        spans.add(span)
    assert len(spans) == len(chunks), (sorted(spans), sorted(chunks))  # one graph per chunk size the eager step uses


def test_a_captured_step_sizes_the_split_attention_by_its_span():
    """The wiring of attn_span: inside a captured step (backend.step set) mla_attend sizes the split by the step's
    attn_n_max, not by the top-k index list it reads (which would cut the keys into other chunks than the eager
    step's dense mask at T = 100). On tests/test_decode_launches.py's recording runtime, GLM-5's attention shape."""
    from types import SimpleNamespace

    from coli.gpu.attention_split import split_chunks
    from coli.gpu.cuda_backend import DeviceMask
    from coli.gpu.cuda_weights import HeadView
    from coli.gpu.graphs import attn_span
    from test_decode_launches import _backend, _weight
    nh, dn, dr, dv, L, T, topk = 64, 192, 64, 256, 512, 100, 2048

    def part_grid(step, mask):
        gb = _backend()
        gb.step = step
        kvb = _weight(gb, nh * (dn + dv), L, "int8")
        w_kb, w_vb = HeadView(kvb, 0, dn + dv, dn, nh), HeadView(kvb, dn, dn + dv, dv, nh)
        q, lat, kpe = gb.rt.empty((1, nh, dn + dr)), gb.rt.empty((T, L)), gb.rt.empty((T, dr))
        gb.mla_attend(q, lat, kpe, w_kb, w_vb, mask(gb), 0.1)
        return next(g for name, g, _, _ in gb.rt.launches if name.startswith(("mla_attend_part", "mla_attend_tile")))

    listed = lambda gb: DeviceMask(1, T, T - 1, gb.rt.empty((1, topk), np.int32), gb.rt.empty((1,), np.int32), topk)  # noqa: E731
    span = attn_span(T, topk, nh, L, 132)
    assert part_grid(SimpleNamespace(attn_n_max=span), listed)[0] == split_chunks(span, 1, nh, L, 132)[1]
    assert part_grid(None, listed)[0] == split_chunks(topk, 1, nh, L, 132)[1]         # eager, top-k list: by topk
    assert split_chunks(span, 1, nh, L, 132)[0] == split_chunks(T, 1, nh, L, 132)[0]  # = eager dense's chunks
