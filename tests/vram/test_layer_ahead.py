"""When a long prefill copies the next MoE layer's experts ahead (coli/gpu/layer_ahead.py ahead_of): pure."""

from coli.gpu.layer_ahead import AHEAD_FRACTION, ahead_of


def test_a_step_that_asks_for_most_of_a_layer_copies_the_next_moe_layer_whole():
    assert ahead_of(3, 200, [3, 4, 5], 256) == (4, list(range(256)))
    assert ahead_of(0, 192, [0, 2], 256) == (2, list(range(256)))     # the next MoE layer, past a dense one


def test_short_steps_and_the_last_moe_layer_copy_nothing_ahead():
    assert AHEAD_FRACTION * 256 == 192
    assert ahead_of(3, 191, [3, 4], 256) is None        # a decode or a short chunk: its successor's set is a guess
    assert ahead_of(4, 256, [3, 4], 256) is None        # the forward's last MoE layer
    assert ahead_of(0, 8, [0, 1], 8, fraction=1.0) == (1, list(range(8)))
