"""When a long prefill copies the next MoE layer's experts ahead (coli/gpu/layer_ahead.py): the step's share, the slot
bound (against the real SlotPool, driven as VramExperts drives it), the COLI_PREFILL_AHEAD switch. Pure."""

import pytest

from coli.errors import ColiError
from coli.gpu.layer_ahead import (AHEAD_FRACTION, ahead_fits, ahead_layers_for, ahead_of, describe_ahead,
                                  expected_share, first_ahead, prefill_ahead_enabled)
from coli.gpu.pool import SlotPool, staging_slots


def test_a_step_that_asks_for_most_of_a_layer_copies_the_next_moe_layer_whole():
    assert ahead_of(3, 200, [3, 4, 5], 256) == (4, list(range(256)))
    assert ahead_of(0, 192, [0, 2], 256) == (2, list(range(256)))     # the next MoE layer, past a dense one


def test_short_steps_and_the_last_moe_layer_copy_nothing_ahead():
    assert AHEAD_FRACTION * 256 == 192
    assert ahead_of(3, 191, [3, 4], 256) is None        # a decode or a short chunk: its successor's set is a guess
    assert ahead_of(4, 256, [3, 4], 256) is None        # the forward's last MoE layer
    assert ahead_of(0, 8, [0, 1], 8, fraction=1.0) == (1, list(range(8)))


def test_the_expected_share_is_one_minus_the_chance_every_row_misses_an_expert():
    assert expected_share(1, 8, 256) == 8 / 256                        # one row: its K experts
    assert expected_share(0, 8, 256) == 0.0
    assert expected_share(128, 8, 256) * 256 == pytest.approx(251.6, abs=0.05)     # docs/runtime.md's figure
    assert expected_share(5, 16, 16) == 1.0                            # top-k of every expert: all of them


def test_the_share_against_counted_uniform_routes():
    # the formula against the thing it estimates: rows of K distinct experts drawn uniformly, the union counted
    import numpy as np
    rng = np.random.default_rng(15)
    E, K, S, trials = 256, 8, 44, 400
    union = [len({e for _ in range(S) for e in rng.choice(E, K, replace=False)}) for _ in range(trials)]
    # the mean of `trials` unions against the expectation, within 4 standard errors of that mean
    sd = float(np.std(union)) / trials ** 0.5
    assert abs(float(np.mean(union)) - E * expected_share(S, K, E)) < 4 * sd


def test_a_step_of_enough_rows_copies_the_forwards_first_moe_layer_from_its_start():
    # GLM-5: top-8 of 256, 3 dense layers first: 44 rows expect 192.7 experts of a layer, 43 rows 190.6
    moe = list(range(3, 78))
    assert first_ahead(44, moe, 256, 8) == (3, list(range(256)))
    assert first_ahead(2048, moe, 256, 8) == (3, list(range(256)))
    assert first_ahead(43, moe, 256, 8) is None          # a short chunk: its first layer's set is a guess
    assert first_ahead(1, moe, 256, 8) is None           # a decode step
    assert first_ahead(300, [], 256, 8) is None          # no MoE layer
    assert first_ahead(300, [5, 2, 9], 16, 4) == (2, list(range(16)))     # the first, whatever the order given


def test_a_decode_step_of_the_default_batch_never_copies_the_first_layer_ahead_on_glm5():
    from coli.stages.executor.batch_defaults import DEFAULT_MAX_BATCH
    assert first_ahead(DEFAULT_MAX_BATCH, list(range(3, 78)), 256, 8) is None       # 16 rows: 40 % of a layer


# ---- the slot condition, against the real pool ----------------------------------------------------------------
def _prefill_through_pool(n_slots: int, E: int, K: int, layers: int, land: bool, policy: str = "freq",
                          forwards: int = 1, first: bool = False):
    """Long prefill steps (each asks for all E experts of its layer) through a SlotPool made as VramExperts makes it,
    driven as VramExperts drives it: the step's lookups and misses, each miss's slot pinned and loading (a miss with
    no slot: the held records launched -- their pins dropped --, the landed copies reaped, one retry: FLUSH); at the
    step's end its last batch launched (pins dropped, copies possibly still loading), then every expert of the next
    layer acquired speculatively; the step's copies reaped at the next step. land: the ahead copies land before the
    next step (loaded, their pin dropped); else the next step cancels them at its lookups (invalidated, the hit
    revoked, copied on demand). forwards: prefills one after another (a prompt's chunks, retaining); first: each
    forward begins by acquiring its first layer's experts speculatively (VramExperts.begin_step). -> (per step (ahead
    copies placed, keys of that layer not resident), demand misses that found no slot after the retry, the same pair
    per forward for its first layer's copies)."""
    pool = SlotPool(n_slots, 1, policy, n_keys=layers * E, staging=staging_slots(n_slots, K), spec_displaces=True)
    placed, starved, firsts, spec_slots, loading = [], 0, [], {}, []

    def reap():
        for s in loading:
            pool.loaded(s)
        loading.clear()

    def ahead(m):                                  # every expert of layer m not mapped: a speculative acquire each
        got, wanted = {}, 0
        for e in range(E):
            key = m * E + e
            if pool.slot_of(key) is None:
                wanted += 1
                s = pool.acquire(key, speculative=True)
                if s is not None:
                    got[key] = s
        if land:
            for s in got.values():
                pool.loaded(s)
                pool.release(s)
        return got, wanted

    for _f in range(forwards):
        if first:
            spec_slots, wanted = ahead(0)
            firsts.append((len(spec_slots), wanted))
            pool.check()
        for m in range(layers):
            reap()
            pool.begin_step()
            held = []
            for e in range(E):
                key = m * E + e
                s = pool.lookup(key)
                if s is not None and key in spec_slots and not land:   # a cancelled ahead copy: not a hit after all
                    pool.invalidate(s)
                    pool.release(s)
                    pool.revoke_hit(s)
                    pool.release(s)
                    s = None
                if s is None:
                    s = pool.acquire(key)
                    if s is None:                 # FLUSH: the held records' kernels queued, their pins dropped
                        for h in held:
                            pool.release(h)
                        held = []
                        reap()                    # the retry waits for the copies in flight
                        s = pool.acquire(key, retry=True)
                    if s is None:
                        starved += 1
                        continue
                    loading.append(s)
                held.append(s)
            for h in held:                        # the step's last batch launched (the FLUSH before the ahead copies)
                pool.release(h)
            spec_slots = {}
            if m + 1 < layers:
                spec_slots, wanted = ahead(m + 1)
                placed.append((len(spec_slots), wanted))
            pool.check()
    return placed, starved, firsts


@pytest.mark.parametrize("E,K", [(8, 2), (16, 4), (12, 8)])
@pytest.mark.parametrize("land", [True, False])
def test_every_ahead_copy_finds_a_slot_exactly_when_ahead_fits_and_no_demand_starves(E, K, land):
    for n_slots in range(E + staging_slots(E, K), 3 * E + 2 * K):
        placed, starved, _ = _prefill_through_pool(n_slots, E, K, layers=5, land=land)
        assert starved == 0, n_slots                          # the ahead copies never cost a demand its slot
        # after the first layer (an empty pool has room for anything), every layer's copies all got a slot iff
        # the pool maps two layers' keys beside its staging
        assert all(got == E for got, _ in placed[1:]) == ahead_fits(n_slots, E, K), (n_slots, placed)


@pytest.mark.parametrize("E,K", [(8, 2), (16, 4), (12, 8)])
@pytest.mark.parametrize("land", [True, False])
def test_a_prompts_chunks_copy_their_first_layer_ahead_where_it_fits_and_no_demand_starves(E, K, land):
    # three forwards (a prompt's chunks) of 4 MoE layers, each copying its first layer from its start: what is kept
    # then is the last forward's last layer (used in its step), so the first layer's copies all find a slot exactly
    # as the next layer's do, where ahead_fits
    for n_slots in range(E + staging_slots(E, K), 3 * E + 2 * K):
        placed, starved, firsts = _prefill_through_pool(n_slots, E, K, layers=4, land=land, forwards=3, first=True)
        assert starved == 0, n_slots
        if n_slots - staging_slots(n_slots, K) >= E:         # an empty pool: room for a layer beside the staging
            assert firsts[0] == (E, E), n_slots
        if ahead_fits(n_slots, E, K):
            assert all(got == wanted for got, wanted in firsts + placed), (n_slots, firsts, placed)


def test_ahead_fits_is_two_layers_of_experts_beside_the_staging_slack():
    assert ahead_fits(2 * 256 + 8, 256, 8) and not ahead_fits(2 * 256 + 7, 256, 8)
    assert not ahead_fits(16, 256, 8) and not ahead_fits(512, 256, 8)      # the bench's 16 and 2E pools
    assert staging_slots(520, 8) == 8 and staging_slots(6, 8) == 3 and staging_slots(1, 8) == 1


def test_the_product_copies_ahead_when_the_switch_is_on_and_the_pool_has_room():
    moe = [1, 2, 3]
    on = {"COLI_PREFILL_AHEAD": "1"}
    assert ahead_layers_for(moe, 256, 8, 520, {}) == moe                       # the default: on (since the GPU run)
    assert ahead_layers_for(moe, 256, 8, 520, on) == moe
    assert ahead_layers_for(moe, 256, 8, 520, {"COLI_PREFILL_AHEAD": "0"}) is None        # switched off
    assert ahead_layers_for(moe, 256, 8, 519, on) is None                                 # no room
    assert ahead_layers_for([3], 256, 8, 4000, on) is None                                # no next MoE layer
    assert prefill_ahead_enabled({}) is True and prefill_ahead_enabled({"COLI_PREFILL_AHEAD": "0"}) is False and prefill_ahead_enabled({"COLI_PREFILL_AHEAD": " 1 "}) is True


def test_a_bad_prefill_ahead_switch_is_a_one_line_error_naming_it_even_without_room():
    for v in ("2", "yes", "on", ""):
        with pytest.raises(ColiError) as e:
            ahead_layers_for([1, 2], 256, 8, 16, {"COLI_PREFILL_AHEAD": v})
        msg = str(e.value)
        assert "COLI_PREFILL_AHEAD" in msg and repr(v.strip()) in msg and "\n" not in msg
        assert "use 1" in msg and "or 0" in msg


def test_the_start_up_line_says_whether_and_why_not():
    on = {"COLI_PREFILL_AHEAD": "1"}
    assert "copy the next MoE layer's experts ahead" in describe_ahead([1, 2], 520, 256, 8, on)
    assert "COLI_PREFILL_AHEAD=0" in describe_ahead(None, 520, 256, 8, {"COLI_PREFILL_AHEAD": "0"})
    assert "copy the next MoE layer's experts ahead" in describe_ahead([1, 2], 520, 256, 8, {})   # the default
    assert "need 520 slots" in describe_ahead(None, 16, 256, 8, on)


def test_a_decode_step_of_the_default_batch_never_copies_ahead_on_glm5():
    from coli.stages.executor.batch_defaults import DEFAULT_MAX_BATCH
    # at most one top-8 per sequence: 16 x 8 = 128 distinct experts of 256, below 3/4
    assert ahead_of(3, DEFAULT_MAX_BATCH * 8, [3, 4], 256) is None
