"""A stand-in CUDA runtime for host-side launch tests (no GPU): fake 256-byte aligned device addresses, the H200's
SM count and shared-memory opt-in, and a launch that checks each call's argument count against the kernel's
signature. Subclasses say what a launch records."""

from __future__ import annotations

import numpy as np

from coli.gpu.cuda_runtime import DeviceArray


class RecordingRuntime:
    sm_count = 132
    smem_optin = 232448

    def __init__(self):
        self.launches: list[tuple] = []
        self._next = 1 << 20

    def function(self, module, name, argtypes):
        return (module, name, argtypes)

    def allow_smem(self, fn, nbytes):
        return nbytes <= self.smem_optin

    def resident_blocks(self, fn, threads, smem=0):
        return self.sm_count * 2

    def empty(self, shape, dtype=np.float32):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr, self._next = self._next, self._next + ((n + 255) // 256 + 1) * 256   # 256-byte aligned, like the pool
        return DeviceArray(ptr, shape, dtype)

    def launch(self, fn, grid, block, *args, smem=0):
        module, name, argtypes = fn
        assert len(args) == len(argtypes), f"{name}: {len(args)} arguments for signature {argtypes!r}"
        self.record(name, argtypes, grid, block, args, smem)

    def record(self, name, argtypes, grid, block, args, smem):
        raise NotImplementedError
