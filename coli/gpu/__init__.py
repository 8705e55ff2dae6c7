"""The GPU's streaming side: the CUDA driver calls it needs (ctypes), the copy lanes, the VRAM expert
cache as an expert source, and the host tiers that feed it."""
