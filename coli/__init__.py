"""ColiStream: serve Mixture-of-Experts models far larger than GPU memory by streaming experts
NVMe -> RAM (shared memory) -> VRAM -> SMs."""

__version__ = "0.1.0"
