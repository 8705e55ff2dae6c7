"""Programmatic dependent launch (PDL) inside the replayed graphs (COLI_PDL=1, sm_90+).

A graph captured from one stream is a chain of nodes; every edge says "the next node starts when this one has
finished". Each kernel launch inside a graph pays a fixed 2-3 us (launch, ramp-up, the tail of the last wave)
with the SMs partly idle. A *programmatic* edge between two kernel nodes lets the driver launch the dependent
kernel's grid while its predecessor still runs, as soon as every predecessor block has executed
`griddepcontrol.launch_dependents`; the dependent then waits at `griddepcontrol.wait` until the predecessor grid
has completed and its memory is visible. Every kernel in cuda/*.cu opens with COLI_PDL_ENTRY() (both
instructions, in that order: tests/test_pdl.py checks every kernel), so a converted edge orders memory exactly
as an ordinary one; only the launch latency overlaps.

After cuStreamEndCapture and before instantiation, `make_programmatic` turns every ordinary kernel -> kernel edge
into a programmatic one (memcpy, memset, event and other nodes keep their ordinary edges: only kernels execute
the wait). Any driver failure leaves the graph as captured, with one warning; a graph that cannot be put back
(an edge removed and not re-added) raises, so the capture fails and the step runs eagerly.

    programmatic_edges(edges, node_types)   pure: which edges to convert
    make_programmatic(drv, graph)           converts them on a captured graph -> the converted edges
    revert(drv, graph, converted)           puts them back (instantiation refused the converted graph)
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, NamedTuple

from coli.gpu.driver import (CU_GRAPH_DEPENDENCY_TYPE_DEFAULT, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC,
                             CU_GRAPH_KERNEL_NODE_PORT_DEFAULT, CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC,
                             CU_GRAPH_NODE_TYPE_KERNEL, OPTIONAL, DriverError)

log = logging.getLogger("coli.cuda")

ORDINARY = (CU_GRAPH_KERNEL_NODE_PORT_DEFAULT, 0, CU_GRAPH_DEPENDENCY_TYPE_DEFAULT)           # (from_port, to_port, type)
PROGRAMMATIC = (CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
MIN_CC = (9, 0)      # griddepcontrol is sm_90+


def pdl_enabled(env: dict | None = None) -> bool:
    """COLI_PDL: "1" kernel -> kernel edges of every captured graph become programmatic (sm_90+), "0" (default)
    the graphs as captured."""
    from coli.gpu.graphs import env_switch
    return env_switch("COLI_PDL", "0", "programmatic kernel->kernel edges in the replayed graphs, sm_90+",
                      "graphs as captured, the default", env)


class Edge(NamedTuple):
    src: int
    dst: int
    data: tuple[int, int, int]      # (from_port, to_port, type) of its CUgraphEdgeData


def programmatic_edges(edges: Iterable[Edge], node_types: Mapping[int, int]) -> list[Edge]:
    """The edges to make programmatic: ordinary edges (zeroed edge data) whose both ends are kernel nodes, in the
    order given. An edge already annotated (a port or a type) is left as it is; a node missing from node_types
    counts as not a kernel (never converted: only a kernel executes griddepcontrol.wait)."""
    out = []
    for e in edges:
        if tuple(e.data) != ORDINARY:
            continue
        if node_types.get(e.src) == CU_GRAPH_NODE_TYPE_KERNEL and node_types.get(e.dst) == CU_GRAPH_NODE_TYPE_KERNEL:
            out.append(Edge(e.src, e.dst, tuple(e.data)))
    return out


class GraphBroken(DriverError):
    """An edge was removed and could not be put back: the graph must not be instantiated."""


def _swap(drv, graph: int, e: Edge, old: tuple, new: tuple) -> None:
    """Replace edge e's data old -> new; on a failed add, put old back (GraphBroken if that fails too)."""
    drv.graph_remove_edge(graph, e.src, e.dst, old)
    try:
        drv.graph_add_edge(graph, e.src, e.dst, new)
    except DriverError as err:
        try:
            drv.graph_add_edge(graph, e.src, e.dst, old)
        except DriverError as err2:
            raise GraphBroken(f"an edge of the captured graph could not be restored after {err}: {err2}",
                              err2.code) from None
        raise


def revert(drv, graph: int, converted: list[Edge]) -> None:
    """Put converted edges back to ordinary ones (GraphBroken if one cannot be)."""
    for e in reversed(converted):
        try:
            _swap(drv, graph, e, PROGRAMMATIC, ORDINARY)
        except GraphBroken:
            raise
        except DriverError as err:
            raise GraphBroken(f"a programmatic edge could not be turned back: {err}", err.code) from None


def make_programmatic(drv, graph: int) -> list[Edge]:
    """Convert every ordinary kernel -> kernel edge of the (not yet instantiated) graph -> the converted edges.
    On a driver error the graph is left as captured and the error raised (GraphBroken: it could not be)."""
    missing = sorted(OPTIONAL & set(getattr(drv, "missing", ())))
    if missing:
        raise DriverError(f"the CUDA driver lacks {', '.join(missing)} (programmatic edges need CUDA >= 12.3)", 0)
    edges = [Edge(a, b, d) for a, b, d in drv.graph_edges(graph)]
    nodes = {n for e in edges for n in (e.src, e.dst)}
    types = {n: drv.node_type(n) for n in nodes}
    todo = programmatic_edges(edges, types)
    done: list[Edge] = []
    try:
        for e in todo:
            _swap(drv, graph, e, ORDINARY, PROGRAMMATIC)
            done.append(e)
    except GraphBroken:
        raise
    except DriverError:
        revert(drv, graph, done)
        raise
    return done


_warned: set[str] = set()


def warn_once(why: str) -> None:
    """One warning per reason and process (graphs are captured per shape: a reason would repeat for each)."""
    if why not in _warned:
        _warned.add(why)
        log.warning("COLI_PDL=1 but the graphs keep their ordinary edges: %s", why)
