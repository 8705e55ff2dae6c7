"""UploadedExperts (the MTP layer's experts where the VRAM budget keeps them off the device): each record uploaded
when asked for, checksum-verified by the container's read_record, and a FLUSH after every top-k of them so that at
most top-k uploads are live at once -- the room coli.gpu.setup.plan_mtp reserves. A catch-up step over a prompt asks
for nearly every expert; without the FLUSH the backend would hold them all (4.9 GB for GLM-5 int4)."""

from __future__ import annotations

import types

import numpy as np

from coli.container.format import RecordLayout
from coli.gpu.cuda_weights import FLUSH, DeviceRecord, UploadedExperts


class _Rt:
    """The runtime's to_device, recording what is live: a buffer is live until the last reference to it goes."""

    def __init__(self):
        self.live, self.peak, self.n = 0, 0, 0

    def to_device(self, host):
        rt = self

        class Buf:
            def __init__(self):
                rt.n += 1
                self.ptr = 4096 * rt.n
                rt.live += 1
                rt.peak = max(rt.peak, rt.live)

            def __del__(self):
                rt.live -= 1
        assert isinstance(host, np.ndarray)
        return Buf()


def _weights(top_k=4):
    lay = RecordLayout.make(64, 32, "int4", 32, 64)
    reads = []

    def read_record(layer, e):
        reads.append((layer, e))
        return np.zeros(lay.nbytes, np.uint8)
    cfg = types.SimpleNamespace(num_experts_per_tok=top_k)
    return types.SimpleNamespace(record_layout=lay, read_record=read_record, config=cfg), reads


def _consume(stream):
    """As CudaBackend.moe does: hold records until a FLUSH (or the end), then let them go."""
    held, order = [], []
    for item in stream:
        if item is FLUSH:
            order.append("FLUSH")
            held = []
            continue
        e, rec = item
        assert isinstance(rec, DeviceRecord)
        held.append(rec)
        order.append(e)
    return order


def test_a_flush_after_every_top_k_uploads_keeps_at_most_top_k_live():
    w, reads = _weights(top_k=4)
    rt = _Rt()
    ux = UploadedExperts(rt, w)
    order = _consume(ux.stream(7, list(range(10))))
    assert order == [0, 1, 2, 3, "FLUSH", 4, 5, 6, 7, "FLUSH", 8, 9]
    assert reads == [(7, e) for e in range(10)] and ux.uploaded == 10
    assert rt.peak <= 4 + 1                     # the batch held, plus the one being made before the last goes


def test_a_step_of_top_k_experts_or_fewer_needs_no_flush():
    w, _ = _weights(top_k=8)
    order = _consume(UploadedExperts(_Rt(), w).stream(0, [3, 1, 2]))
    assert order == [3, 1, 2]
