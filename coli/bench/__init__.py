"""`coli bench`: benchmarks on GLM-5-shaped slices (docs/performance.md).

    slice.py         make-slice: a container of L MoE layers with GLM-5's real shapes and random weights
    trace_router.py  the routing a slice stores and replays (TraceRouting -> GlmMoeDsaModel.route_override)

The streaming scenarios (`coli bench stream`) time the GPU engine over such a slice; they are not here yet.
"""
