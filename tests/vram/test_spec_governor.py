"""The speculative lane's budget (coli/gpu/spec_governor.py): what the idle window delivered decides how many guesses
are copied; nothing delivered for a while pauses speculation, then one copy probes again."""

import pytest

from coli.gpu.spec_governor import SpecGovernor

MB = 1 << 20


def test_one_copy_to_start_and_as_long_as_the_window_fills_part_of_a_record():
    g = SpecGovernor(20 * MB)
    assert g.budget() == 1
    for _ in range(50):                      # the H200's window: ~8 MB of a 20 MB record landed each layer
        g.demanded(8 * MB)
        assert g.budget() == 1


def test_the_budget_grows_with_what_landed_and_shrinks_back():
    g = SpecGovernor(20 * MB)
    for _ in range(40):                      # a long window: 2.25 records landed and used a layer
        g.demanded(45 * MB)
    assert g.budget() == 3
    for _ in range(40):
        g.demanded(5 * MB)
    assert g.budget() == 1


def test_a_window_that_lands_every_copy_it_gets_is_given_one_more():
    g = SpecGovernor(20 * MB)
    for _ in range(10):                      # the one copy landed whole each time
        g.demanded(20 * MB)
    assert g.budget() == 2


def test_nothing_used_for_idle_steps_pauses_then_one_probe():
    g = SpecGovernor(20 * MB, idle_steps=4, pause_prefetches=3)
    g.demanded(30 * MB)
    for _ in range(3):
        g.demanded(0)
        assert g.budget() >= 1               # not yet: 3 idle steps of 4
    g.demanded(0)
    assert [g.budget() for _ in range(4)] == [0, 0, 0, 1]
    assert g.pauses == 1
    g.demanded(1 * MB)                       # a probe that pays resets the idle count
    for _ in range(3):
        g.demanded(0)
    assert g.budget() >= 1 and g.pauses == 1


def test_a_cap_and_bad_settings():
    g = SpecGovernor(1 * MB, max_budget=2)
    for _ in range(30):
        g.demanded(10 * MB)
    assert g.budget() == 2
    with pytest.raises(ValueError, match="record_bytes"):
        SpecGovernor(0)
    with pytest.raises(ValueError, match="alpha"):
        SpecGovernor(MB, alpha=0)
