"""coli/gpu/mapped_experts.py, the zero-copy expert source, without a GPU: a recording driver stands for libcuda
(it maps each registered range at an address of its own, as the real one may), the host tier is a plain one over
two pinned ranges. What is checked: every record's device address is its range's mapping plus its offset there, in
the slot table and in the eager stream; a tier that lacks a record, or a record outside the pinned ranges, is refused
by name with nothing left registered; close() gives every range back. The kernels reading those addresses are
tests/gpu/test_gpu_mapped.py's."""

from __future__ import annotations

import numpy as np
import pytest

from coli.errors import ColiError
from coli.gpu.cuda_weights import host_record_layout
from coli.gpu.mapped_experts import MappedHostExperts
from coli.gpu.vram_experts import HostRecord

LAYOUT = host_record_layout(16, 8)
STRIDE = -(-LAYOUT.nbytes // 4096) * 4096     # records 4 KiB-aligned, as MemoryHostTier lays them


class RecordingDriver:
    """host_register / host_device_pointer / host_unregister as libcuda answers them; `fail_at`: the n-th register
    raises (0-based), as a driver refusing a range does; `no_pointer`: host_device_pointer raises (a range registered
    without its mapping); `refuse_unregister`: unregistering that address raises."""

    def __init__(self, fail_at: int | None = None, no_pointer: bool = False, refuse_unregister: int | None = None):
        self.registered: dict[int, int] = {}       # host address -> device address
        self.calls: list[tuple] = []
        self.fail_at, self.no_pointer, self.refuse_unregister = fail_at, no_pointer, refuse_unregister

    def host_register(self, addr, n, device_map=False):
        self.calls.append(("register", addr, n, device_map))
        if self.fail_at is not None and sum(c[0] == "register" for c in self.calls) - 1 == self.fail_at:
            raise ColiError(f"cuMemHostRegister of {n} bytes at 0x{addr:x}: refused")
        assert addr not in self.registered, "registered twice"
        self.registered[addr] = 0x7f00_0000_0000 + 0x1000_0000 * len(self.registered)

    def host_device_pointer(self, addr):
        if self.no_pointer:
            raise ColiError(f"cuMemHostGetDevicePointer at 0x{addr:x}: not mapped")
        return self.registered[addr]

    def host_unregister(self, addr):
        self.calls.append(("unregister", addr))
        if addr == self.refuse_unregister:
            raise ColiError(f"cuMemHostUnregister at 0x{addr:x}: refused")
        del self.registered[addr]


class TwoRangeTier:
    """Layers 0 and 1 of 3 experts: layer 0's records in one pinned range, layer 1's in another (`drop`: a record
    the tier does not hold; `stray`: a record whose address lies outside both ranges)."""

    holds_all_for_life = True

    def __init__(self, drop=None, stray=None):
        self.base = {0: 0x10_0000_0000, 1: 0x20_0000_0000}
        self.drop, self.stray = drop, stray

    def probe(self, layer, e):
        if (layer, e) == self.drop or layer not in self.base or not 0 <= e < 3:
            return None
        addr = 0x30_0000_0000 if (layer, e) == self.stray else self.base[layer] + e * STRIDE
        return HostRecord(layer, e, addr, LAYOUT.nbytes, np.zeros(0, np.uint8))

    def pinned_ranges(self):
        return [(self.base[0], 3 * STRIDE), (self.base[1], 3 * STRIDE)]


def test_records_are_read_at_their_ranges_mapping_plus_their_offset():
    drv, tier, synced = RecordingDriver(), TwoRangeTier(), []
    mx = MappedHostExperts(drv, tier, LAYOUT, [1, 0], 3, sync=lambda: synced.append(len(drv.registered)))
    assert [c[3] for c in drv.calls if c[0] == "register"] == [True, True], "registered with DEVICEMAP"
    d0, d1 = drv.registered[tier.base[0]], drv.registered[tier.base[1]]
    t = mx.slot_table(4)                                  # [L, E]: layers 2, 3 not held
    assert t.dtype == np.uint64 and t.shape == (4, 3)
    assert t[0].tolist() == [d0, d0 + STRIDE, d0 + 2 * STRIDE]
    assert t[1].tolist() == [d1, d1 + STRIDE, d1 + 2 * STRIDE]
    assert not t[2:].any()
    got = [(e, r.ptr, r.layout, r.ready) for e, r in mx.stream(1, [2, 0])]
    assert got == [(2, d1 + 2 * STRIDE, LAYOUT, None), (0, d1, LAYOUT, None)]
    assert mx.nbytes == 0, "no VRAM is taken"
    with pytest.raises(KeyError, match="layer 2 expert 0"):
        mx.record(2, 0)
    mx.close()
    assert drv.registered == {}
    assert synced == [2], "the device is waited for while both ranges are still registered"
    mx.close()                                            # twice: nothing left to give back, nothing waited for
    assert sum(c[0] == "unregister" for c in drv.calls) == 2 and synced == [2]


def test_a_record_the_tier_does_not_hold_is_refused_by_name_before_anything_is_registered():
    drv = RecordingDriver()
    with pytest.raises(ColiError, match="lacks 1, first layer 1 expert 2"):
        MappedHostExperts(drv, TwoRangeTier(drop=(1, 2)), LAYOUT, [0, 1], 3)
    assert drv.calls == []


def test_a_record_outside_the_pinned_ranges_is_refused_and_the_ranges_go_back():
    drv = RecordingDriver()
    with pytest.raises(ColiError, match="layer 0 expert 1: its record at 0x3000000000"):
        MappedHostExperts(drv, TwoRangeTier(stray=(0, 1)), LAYOUT, [0, 1], 3)
    assert drv.registered == {}


def test_a_range_the_driver_refuses_leaves_the_others_unregistered():
    drv = RecordingDriver(fail_at=1)
    with pytest.raises(ColiError, match="refused"):
        MappedHostExperts(drv, TwoRangeTier(), LAYOUT, [0, 1], 3)
    assert drv.registered == {}
    assert [c[0] for c in drv.calls] == ["register", "register", "unregister"]


def test_a_layout_the_kernels_cannot_read_is_refused():
    import dataclasses
    bad = dataclasses.replace(LAYOUT, gate=dataclasses.replace(LAYOUT.gate, fmt="fp8"))
    with pytest.raises(ColiError):
        MappedHostExperts(RecordingDriver(), TwoRangeTier(), bad, [0, 1], 3)


def test_a_tier_that_may_recycle_its_records_is_refused_even_when_it_holds_them_all_now():
    tier = TwoRangeTier()
    tier.holds_all_for_life = False                 # an LRU RAM tier that happens to be full
    drv = RecordingDriver()
    with pytest.raises(ColiError, match="holds every record for its whole life.*TwoRangeTier"):
        MappedHostExperts(drv, tier, LAYOUT, [0, 1], 3)
    assert drv.calls == []


def test_a_range_registered_without_its_mapping_is_given_back():
    drv = RecordingDriver(no_pointer=True)
    with pytest.raises(ColiError, match="not mapped"):
        MappedHostExperts(drv, TwoRangeTier(), LAYOUT, [0, 1], 3)
    assert drv.registered == {}


def test_a_range_the_driver_will_not_unregister_does_not_keep_the_others():
    tier = TwoRangeTier()
    drv = RecordingDriver(refuse_unregister=tier.base[0])
    mx = MappedHostExperts(drv, tier, LAYOUT, [0, 1], 3, sync=lambda: 1 / 0)   # a lost context: still unregisters
    with pytest.raises(ColiError, match="refused"):
        mx.close()
    assert list(drv.registered) == [tier.base[0]], "the second range was unregistered after the first refused"


def test_the_memory_tier_says_it_holds_every_record_for_life():
    from coli.gpu.host_records import CachedHostTier, ContainerHostTier, MemoryHostTier
    assert MemoryHostTier.holds_all_for_life is True
    assert not getattr(CachedHostTier, "holds_all_for_life", False)
    assert not getattr(ContainerHostTier, "holds_all_for_life", False)
