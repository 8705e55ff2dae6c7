"""Programmatic dependent launch (coli/gpu/pdl.py, COLI_PDL), no GPU needed.

With COLI_PDL=1 a kernel may be launched while its predecessor still runs; it is correct only because every kernel
waits (`griddepcontrol.wait`) before touching memory. A kernel without COLI_PDL_ENTRY() would be a silent race, so:
- every __global__ kernel in cuda/*.cu (macro-defined ones included) opens with COLI_PDL_ENTRY();
- compiled for sm_90, every kernel entry issues launch_dependents, then wait, before its first memory access, and
  for sm_86 neither instruction exists;
- which graph edges become programmatic (kernel -> kernel, ordinary ones only);
- the COLI_PDL setting.
The replays with programmatic edges against the ordinary ones are tests/gpu/test_gpu_graphs.py's.
"""

from __future__ import annotations

import re

import pytest

from coli.errors import ColiError
from coli.gpu.cuda_runtime import kernel_sources, kernels_dir
from coli.gpu.driver import CU_GRAPH_NODE_TYPE_KERNEL
from coli.gpu.pdl import ORDINARY, PROGRAMMATIC, Edge, pdl_enabled, programmatic_edges

ENTRY = "COLI_PDL_ENTRY();"
_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)
_KERNEL = re.compile(r'__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?([A-Za-z_][\w#]*)\s*\(')


def _code_only(src: str) -> str:
    """The source with comments blanked and macro line continuations joined (strings kept: extern "C")."""
    src = _TOKENS.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", src)
    return src.replace("\\\n", " ")


def kernel_openings(src: str) -> tuple[list[tuple[str, str]], int]:
    """(kernel name as written, the first characters of its body) for every __global__ definition, and how many
    times __global__ occurs (a declaration the parser does not understand makes the two differ)."""
    code = _code_only(src)
    found = []
    for m in _KERNEL.finditer(code):
        i, depth = m.end(), 1
        while depth and i < len(code):                       # the parameter list, nested parentheses and all
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        body = code[i:].lstrip()
        if not body.startswith("{"):
            found.append((m.group(1), "<no body: " + body[:30] + ">"))
            continue
        found.append((m.group(1), body[1:].lstrip()[:len(ENTRY)]))
    return found, len(re.findall(r"\b__global__\b", code))


def missing_entries(src: str) -> list[str]:
    found, n = kernel_openings(src)
    bad = [name for name, first in found if first != ENTRY]
    if len(found) != n:
        bad.append(f"<{n - len(found)} __global__ the check cannot parse>")
    return bad


def test_every_kernel_opens_with_the_pdl_entry():
    total = 0
    for p in kernel_sources():
        src = p.read_text()
        assert not missing_entries(src), f"{p.name}: kernels not opening with {ENTRY} {missing_entries(src)}"
        total += len(kernel_openings(src)[0])
    assert total >= 40          # 47 kernel definitions today (106 entries once the format macros expand)


def test_the_check_catches_a_kernel_that_does_not_wait_first():
    ok = 'extern "C" __global__ void a(const float *x) {\n    COLI_PDL_ENTRY();\n    y = x[0];\n}\n'
    assert missing_entries(ok) == []
    late = 'extern "C" __global__ void b(float *x) {\n    x[0] = 1.f;\n    COLI_PDL_ENTRY();\n}\n'
    assert missing_entries(late) == ["b"]
    commented = 'extern "C" __global__ void c(float *x) {\n    // COLI_PDL_ENTRY();\n    x[0] = 1.f;\n}\n'
    assert missing_entries(commented) == ["c"]
    macro = ('#define K(NAME, FMT) \\\n    extern "C" __global__ void __launch_bounds__(32 * W, 2) k_##NAME( \\\n'
             '        QMAT_PARAMS(w), int n) { \\\n        body<FMT>(n); \\\n    }\nK(f32, 0)\n')
    assert missing_entries(macro) == ["k_##NAME"]
    assert missing_entries(macro.replace("{ \\\n", "{ \\\n        COLI_PDL_ENTRY(); \\\n")) == []
    odd = 'extern "C" __global__ __launch_bounds__(64) void d(float *x) { x[0] = 0; }\n'
    assert missing_entries(odd) == ["<1 __global__ the check cannot parse>"]


def _ptx_entries(ptx: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\n\}", ptx, re.S)}


MEMORY_OP = re.compile(r"\b(?:ld|st|atom|red|cp\.async|prefetch)\.(?!param)")


def _ptx_builds(out_dir):
    from test_kernels_compile import NVCC
    jobs = [(p, "sm_90") for p in kernel_sources()] + [(kernels_dir() / "argmax.cu", "sm_86")]
    return {(src.name, arch): ([NVCC, "-ptx", f"-arch={arch}", "-std=c++17", "-I", str(kernels_dir()), "-o",
                                str(out_dir / f"{src.stem}.{arch}.ptx"), str(src)], out_dir / f"{src.stem}.{arch}.ptx")
            for src, arch in jobs}


@pytest.mark.nvcc(builds=_ptx_builds)
@pytest.mark.timeout(600)
def test_every_compiled_kernel_waits_before_its_first_memory_access(nvcc_pool):
    """What the source check cannot see: the macro really expands to both instructions on sm_90, in every kernel the
    format macros instantiate, before any load or store the compiler emits (the "memory" clobber)."""
    from test_kernels_compile import NVCC
    if NVCC is None:
        pytest.skip("nvcc not found (install the CUDA toolkit to check the compiled kernels)")

    def ptx(item):
        (name, arch), r = item
        assert r.returncode == 0, f"{name} for {arch}: {r.stderr}"
        return name, r.out.read_text()

    done = [ptx(item) for item in nvcc_pool.results(_ptx_builds).items()]
    bad, n = [], 0
    for name, text in done[:-1]:
        for entry, body in _ptx_entries(text).items():
            n += 1
            go = body.find("griddepcontrol.launch_dependents;")
            wait = body.find("griddepcontrol.wait;")
            mem = MEMORY_OP.search(body)
            if not (0 <= go < wait and (mem is None or mem.start() > wait)):
                bad.append(f"{name}:{entry}")
    assert n >= 100 and not bad, f"kernels that do not wait before touching memory on sm_90: {bad}"
    assert "griddepcontrol" not in done[-1][1], "sm_86 has no griddepcontrol: the macro must expand to nothing"


# ---- which edges ------------------------------------------------------------------------------------------------
K, MEMCPY, MEMSET = CU_GRAPH_NODE_TYPE_KERNEL, 1, 2


def test_only_ordinary_kernel_to_kernel_edges_become_programmatic():
    types = {1: K, 2: K, 3: MEMSET, 4: K, 5: MEMCPY, 6: K, 7: K}
    edges = [Edge(1, 2, ORDINARY),          # kernel -> kernel: converted
             Edge(2, 3, ORDINARY),          # kernel -> memset: kept (a memset executes no wait)
             Edge(3, 4, ORDINARY),          # memset -> kernel: kept (only kernel nodes have the programmatic port)
             Edge(4, 5, ORDINARY), Edge(5, 6, ORDINARY),
             Edge(6, 7, PROGRAMMATIC),      # already programmatic: left alone
             Edge(6, 4, (2, 0, 1)),         # another annotation (launch-order port): left alone
             Edge(4, 7, ORDINARY),          # a fork: converted too
             Edge(7, 99, ORDINARY)]         # a node of unknown type: never converted
    got = programmatic_edges(edges, types)
    assert got == [Edge(1, 2, ORDINARY), Edge(4, 7, ORDINARY)]
    assert programmatic_edges([], types) == []
    chain = [Edge(i, i + 1, ORDINARY) for i in range(60)]                 # a captured dense layer: one chain
    assert len(programmatic_edges(chain, {i: K for i in range(61)})) == 60
    assert programmatic_edges(chain, {i: (K if i % 2 else MEMCPY) for i in range(61)}) == []


def test_programmatic_edge_data_is_the_headers():
    # from_port CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC (1), to_port 0, type CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC (1);
    # the names' values against cuda.h: tests/test_graphs.py::test_graph_edge_struct_and_constants_match_cuda_h
    from coli.gpu import driver as D
    assert PROGRAMMATIC == (D.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, D.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    assert ORDINARY == (0, 0, 0)


def test_coli_pdl_setting():
    assert pdl_enabled({}) is False                     # off until measured
    assert pdl_enabled({"COLI_PDL": "1"}) is True
    assert pdl_enabled({"COLI_PDL": "0"}) is False
    with pytest.raises(ColiError, match=r"COLI_PDL='yes': use 1 \(programmatic.*or 0"):
        pdl_enabled({"COLI_PDL": "yes"})
