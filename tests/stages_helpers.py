"""Helpers for stage-core tests."""

from coli.stages.ramtier.core import RamTierCore, ResidencyTable


def make_core(n_slots, n_keys, pinned=(), max_inflight_reads=8):
    buf = bytearray(ResidencyTable.nbytes(n_keys, max(n_slots, 0)))
    table = ResidencyTable(buf, n_keys, max(n_slots, 0))
    return RamTierCore(n_slots, n_keys, table, pinned=pinned, max_inflight_reads=max_inflight_reads), table
