"""Layer-ahead copies for long prefills (issue 15 §1): once a MoE layer's step has asked for nearly every expert of
its layer, the next MoE layer will too (a prompt of hundreds of tokens routes to every expert: docs/runtime.md), so
there is nothing to predict -- its experts go on the speculative copy lane at once, and copy while this layer's last
experts compute and the next layer's attention runs, when the demand lane is idle. The demand step of the next layer
then finds them resident (or takes over the copy in flight: VramExperts' handoff) and copies only the rest.

The decisions are pure and live here; the copies are VramExperts' (its `ahead_layers`), on the speculative lane
whatever COLI_SPEC_COPIES says and outside SpecGovernor's budget (that budget sizes decode's guesses; these are not
guesses). Measured first in `coli bench stream --prefill-ahead` (docs/perf-notes.md "TTFT"): 3-15 % off the cold-ram
time to first token where the pool holds two layers' experts, nothing where it does not.

When (`ahead_fits`). The copies are made once layer l's step is launched: its keys (up to E) hold their slots still
(loading, or used in this step), and a speculative acquire (coli/gpu/pool.py) never takes a pinned, a loading or a
staging slot nor a key used in this step: it maps a key while the pool is below capacity, else displaces a ready,
unpinned key of an earlier step. So all E copies
of layer l+1 find a slot only where the pool maps two layers' keys at once: capacity = n_slots - staging >= 2 E.
Below that they would evict what the pool kept by rank for a part of the next layer only (16 slots: no room,
measured), so they are not made. Demands never starve because of them either way: the staging slack is left to
demands, and every ahead copy still queued when the next step begins is cancelled there (its own keys: the demand
copies them on its faster lane; the others: not needed now), so at most the one copy in the trickle holds a slot
that step did not ask for.

Decode steps ask for a few experts a layer (top-k per sequence: 8 of 256 for GLM-5; the default batch of 16 at most
128), below AHEAD_FRACTION: they never copy ahead.

The forward's first MoE layer (`first_ahead`). It has no MoE layer before it to trigger the rule above, so without
more its copies would start at its router, after the dense layers before it (GLM-5: layers 0-2 and layer 3's
attention) -- a window with an idle bus. So the decision is taken when the forward step begins, from the only thing
known then, its row count S: a step is a long prefill from its start when the expected share of a layer's experts
its rows ask for, 1 - (1 - K/E)^S, is >= AHEAD_FRACTION (GLM-5, top-8 of 256: S >= 44 rows). Why that expectation:
a row picks K distinct experts, so an expert is missed by a row with probability 1 - K/E when every expert is picked
equally often, and by S independent rows with (1 - K/E)^S. A real router is not uniform: for the same K picks a row
and independent rows, a skewed marginal (some experts picked more often) covers fewer experts -- the uniform share is
the largest -- and tokens that route alike cover fewer again; so where routing is skewed this overestimates, and a
step with S near the threshold may ask fewer than 3/4 of its experts. GLM-5's router is balanced by its correction
bias, and its coverage measured at or slightly above the uniform figure (docs/runtime.md: 237 of 256 experts within
75 tokens, uniform 232; the MTP verify step's unions on calibrated routing 15.8/23.5/30.9 for 2/3/4 rows, uniform
15.8/23.3/30.5): the estimate is fair there, and the prompts it is for (hundreds of tokens and more) ask for every
expert under any router that is not degenerate. A wrong guess is harmless by construction: these are the same
speculative copies as above (the lane yields every tile to a demand copy; never the staging slack, a pinned or an
in-use slot), and when the layer's step begins every one still queued is cancelled (`_stop_ahead`; the asked ones
are copied by the demand on its faster lane, the one in flight handed over). What a wrong guess costs is the unasked
experts that landed before the router: idle bus time, and slots that keys of earlier steps gave up (copied again if
a later step wants them). It never changes a result: a copy only makes the same bytes resident earlier."""

from __future__ import annotations

from coli.gpu.pool import staging_slots

AHEAD_FRACTION = 0.75     # a step that asks for at least this share of a layer's experts is a long prefill
# The speculative lane's tile for these copies (VramExperts' ahead_tile). Guesses take --stream-tile-kb (1 MiB) so a
# demand waits behind at most two short tiles; but a long prefill's step is the only step there is (its demands are
# for its own layer, 90-110 ms of GLM-5 copies), so waiting behind two 4 MiB tiles (~160 us) costs nothing, while 1 MiB
# tiles run at 48.5 GB/s against 53.5 for 4 MiB and 55.4 for whole records (H200 tile sweep, docs/performance.md),
# and each tile is a wake-up of the lane's worker thread competing for the GIL with the compute thread's launches:
# at 512 tokens (a 10 ms window) the ahead rows were 2-5 % slower than without them with 1 MiB tiles (20:45/21:15 UTC).
AHEAD_TILE_BYTES = 4 << 20


def ahead_of(layer: int, asked: int, moe_layers: list[int], n_experts: int,
             fraction: float = AHEAD_FRACTION) -> tuple[int, list[int]] | None:
    """(next MoE layer, every expert of it) when `layer`'s step asked for >= fraction of its n_experts; None for a
    short step or the forward's last MoE layer."""
    if asked < fraction * n_experts:
        return None
    later = [m for m in moe_layers if m > layer]
    if not later:
        return None
    return later[0], list(range(n_experts))


def expected_share(tokens: int, top_k: int, n_experts: int) -> float:
    """The expected share of a layer's n_experts that `tokens` rows of top_k distinct experts each ask for, every
    expert picked equally often and the rows independent: 1 - (1 - top_k/E)^tokens (an upper estimate for a real,
    skewed router: see the module docstring)."""
    if tokens <= 0 or n_experts <= 0:
        return 0.0
    return 1.0 - (1.0 - min(int(top_k), int(n_experts)) / int(n_experts)) ** int(tokens)


def first_ahead(tokens: int, moe_layers: list[int], n_experts: int, top_k: int,
                fraction: float = AHEAD_FRACTION) -> tuple[int, list[int]] | None:
    """(the forward's first MoE layer, every expert of it) when a step of `tokens` rows is a long prefill from its
    start (expected_share >= fraction); None for a short step or a model without MoE layers."""
    if not moe_layers or expected_share(tokens, top_k, n_experts) < fraction:
        return None
    return min(int(m) for m in moe_layers), list(range(n_experts))


def ahead_fits(n_slots: int, n_experts: int, top_k: int) -> bool:
    """Whether a pool of n_slots maps the current step's E keys and the next layer's E beside them (see the module
    docstring): n_slots - staging >= 2 E."""
    return int(n_slots) - staging_slots(n_slots, top_k) >= 2 * int(n_experts)


# On by default since the product's path (VramExperts' ahead_layers, the extra FLUSH, the cancellation at the next step)
# passed tests/gpu/test_gpu_prefill_ahead.py on the H200 (2026-12-01, 20:45 UTC: tokens equal with and without, equal
# to the numpy path's) and took 2,048-token TTFT on a pool of two layers from 10.05 to 9.30 s (docs/perf-notes.md,
# "TTFT"). It changes no result, only when copies are made; COLI_PREFILL_AHEAD=0 turns it off.
PREFILL_AHEAD_DEFAULT = "1"


def prefill_ahead_enabled(env: dict | None = None) -> bool:
    """COLI_PREFILL_AHEAD: "1" (default, see PREFILL_AHEAD_DEFAULT) a long prefill copies the next MoE layer's experts
    ahead where the pool has room (ahead_fits); "0" never (each layer's experts are copied on demand only)."""
    from coli.gpu.graphs import env_switch
    return env_switch("COLI_PREFILL_AHEAD", PREFILL_AHEAD_DEFAULT,
                      "long prefills copy the next MoE layer's experts ahead, the default",
                      "experts copied on demand only", env)


def ahead_layers_for(moe_layers: list[int], n_experts: int, top_k: int, n_slots: int,
                     env: dict | None = None) -> list[int] | None:
    """What the product's VramExperts gets as `ahead_layers`: the MoE layers (copies go to the next of them) when the
    switch is on and the pool has room, else None (no ahead copies). A bad COLI_PREFILL_AHEAD is an error even where
    the pool has no room: the setting is wrong either way."""
    on = prefill_ahead_enabled(env)
    if not on or len(moe_layers) < 2 or not ahead_fits(n_slots, n_experts, top_k):
        return None
    return list(moe_layers)


def describe_ahead(ahead_layers: list[int] | None, n_slots: int, n_experts: int, top_k: int,
                   env: dict | None = None) -> str:
    """The start-up log's words for the choice (appended to the VRAM pool line)."""
    if ahead_layers is not None:
        return "; long prefills copy the next MoE layer's experts ahead"
    if not prefill_ahead_enabled(env):
        return "; no layer-ahead prefill copies (COLI_PREFILL_AHEAD=0; 1, the default, turns them on)"
    need = 2 * n_experts + staging_slots(2 * n_experts + top_k, top_k)
    if n_slots < need:
        return f"; no layer-ahead prefill copies (they need {need} slots, two layers' experts and the staging)"
    return ""
