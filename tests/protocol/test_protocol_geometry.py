"""Data-plane fields checked against one run's geometry: each refusal names the field."""

from coli.protocol.geometry import RecordSpec, RunGeometry

G = RunGeometry(n_layers=4, moe_layers=(1, 2, 3), n_experts=16, n_slots=5, slot_bytes=8192)
SPEC = RecordSpec("/c/experts-00000.coli", 4096, 8192, 0xABCDEF)


def record_of(layer, expert):
    return SPEC


def check(**kw):
    f = dict(layer=1, expert=2, slot=4, file=SPEC.file, offset=SPEC.offset, length=SPEC.length,
             checksum=SPEC.checksum)
    f.update(kw)
    return G.read_request_problem(**f, record_of=record_of)


def test_expert_requests():
    assert G.expert_request_problem(2, [0, 15]) is None
    assert G.expert_request_problem(0, [0]) == "field 'layer': layer 0 is a dense layer (MoE layers are 1..3)"
    assert "field 'layer': 9 is out of range" in G.expert_request_problem(9, [0])
    assert G.expert_request_problem(1, [3, 16]) == "field 'experts': 16 is out of range (experts 0..15)"


def test_read_requests():
    assert check() is None
    assert check(slot=10**9).startswith("field 'slot': slot 1000000000 is out of range (the arena has slots 0..4)")
    assert check(layer=0).startswith("field 'layer'")
    assert check(expert=99).startswith("field 'expert':")
    assert check(file="/etc/passwd").startswith("field 'file': /etc/passwd is not the container's record")
    assert check(offset=0).startswith("field 'offset'")
    assert check(length=4096).startswith("field 'length'")
    assert check(checksum=1).startswith("field 'checksum': 0000000000000001 is not")


def test_record_larger_than_a_slot():
    g = RunGeometry(4, (1, 2, 3), 16, 5, 4096)
    assert g.read_request_problem(1, 2, 0, SPEC.file, SPEC.offset, SPEC.length, SPEC.checksum,
                                  record_of).startswith("field 'length': 8192 B does not fit")
