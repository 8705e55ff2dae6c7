"""`coli bench`: benchmarks on GLM-5-shaped slices (docs/performance.md).

    slice.py         make-slice: a container of L MoE layers with GLM-5's real shapes and random weights
    trace_router.py  the routing a slice stores and replays (TraceRouting -> GlmMoeDsaModel.route_override)
    stream.py        coli bench stream: the streaming scenarios timing the GPU engine over a slice
"""
