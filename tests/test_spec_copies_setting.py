"""COLI_SPEC_COPIES, the switch of the speculative VRAM copies (coli/gpu/vram_experts.py): off by default (issue 14
§4: they cost 15 % in spec-ram on the H200), "1" turns them on, anything else is a one-line error naming it.
The copies themselves are tested on the GPU (tests/gpu/test_gpu_vram.py)."""

import pytest

from coli.errors import ColiError
from coli.gpu.vram_experts import speculative_copies_default


def test_speculative_copies_are_off_unless_asked_for():
    assert speculative_copies_default({}) is False
    assert speculative_copies_default({"COLI_SPEC_COPIES": "0"}) is False
    assert speculative_copies_default({"COLI_SPEC_COPIES": "1"}) is True
    with pytest.raises(ColiError, match="COLI_SPEC_COPIES='yes'.*use 0.*or 1"):
        speculative_copies_default({"COLI_SPEC_COPIES": "yes"})
