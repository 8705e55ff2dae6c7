"""Released KV caches' buffers reused by the next cache of the same capacity (coli/model/cache_pool.py), so that a
replayed decode graph keyed on them (coli/gpu/graphs.py step_key) hits: on the numpy backend with the real model
of a transformers oracle built in this run. The same addresses after a release; never one buffer in two live
caches (two sequences batched); a cache that grows gives its old buffers back; the pool is bounded; released
buffers poisoned with NaN never reach the next sequence's tokens (nothing reads past a cache's length); a session
saved and loaded into reused buffers goes on with transformers' tokens, and gives its cache back when dropped; the
executor's serving loop gives each ended request's caches back."""

from __future__ import annotations

import numpy as np
import pytest
import structlog

from coli.generate import Generation
from coli.gpu.graphs import step_key
from coli.loader import load_model
from coli.model.batch import BatchRow, greedy_batch
from coli.model.cache_pool import MAX_IDLE, PER_CAPACITY, CachePool, bucket
from coli.model.kv_cache import CacheReleased
from coli.model.mtp import load_mtp_head
from oracles import load_oracle, oracle_dir


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    d = oracle_dir(tmp_path_factory.mktemp("pool-oracles"), "default")
    model, _ = load_model(d)
    return model, load_oracle(d), d


@pytest.fixture()
def model(oracle):
    m = oracle[0]
    m.cache_pool = CachePool()      # each test starts from an empty pool (the model is the module's)
    return m


def buffers(cache) -> set[int]:
    """Every buffer address of a cache (step_key's, the graphs' key)."""
    return {p for p in step_key(cache, "router", "k")[1] if p}


def poison(cache) -> None:
    for lc in cache.layers:
        for a in (lc.lat, lc.k_pe, lc.k_idx):
            if a is not None:
                a[...] = np.nan


def test_bucket_rounds_up_to_four_steps_an_octave_and_doubling_stays_on_them():
    assert [bucket(n) for n in (1, 4, 8, 9, 16, 17, 20, 21, 300, 1000)] == [1, 4, 8, 10, 16, 20, 20, 24, 320, 1024]
    for n in range(1, 3000):
        b = bucket(n)
        assert n <= b <= max(8, n * 1.25) and bucket(b) == b and bucket(2 * b) == 2 * b, n
    assert bucket(202000, 202752) == 202752 and bucket(300, 310) == 310 and bucket(400, 310) == 400   # not past
    assert bucket(300, 4096) == 320                                                                  # the context


def test_a_cache_is_never_rounded_past_the_model_s_context(model):
    import dataclasses
    from coli.model.kv_cache import KVCache
    cfg = dataclasses.replace(model.config, max_position_embeddings=4000)       # not a bucket (4096 would be)
    assert KVCache.empty(cfg, model.backend, 3990, pool=CachePool()).capacity == 4000
    assert KVCache.empty(cfg, model.backend, 3000, pool=CachePool()).capacity == 3072


def test_a_released_cache_s_buffers_go_to_the_next_cache_of_its_capacity(model):
    a = model.new_cache(40)
    assert not a.reused
    key = step_key(a, "router", "k")
    a.release()
    assert model.cache_pool.idle() == {40: 1}
    b = model.new_cache(40)
    assert step_key(b, "router", "k") == key and b.length == 0 and b.reused    # the same graph key: a graph hits
    assert model.cache_pool.idle() == {} and model.cache_pool.hits == 1
    c = model.new_cache(80)                                         # another capacity: new buffers
    assert not buffers(c) & buffers(b)


def test_a_released_cache_refuses_use_and_a_second_release_gives_nothing_twice(model):
    a = model.new_cache(40)
    model.forward([1, 2, 3], a)
    a.release()
    a.release()
    assert model.cache_pool.idle() == {40: 1}
    with pytest.raises(CacheReleased, match="was released"):
        model.forward([4], a)
    with pytest.raises(CacheReleased):
        a.host_arrays()


def test_two_live_caches_never_share_a_buffer_and_batched_sequences_keep_their_tokens(oracle, model):
    _, o, _ = oracle
    p = o["prompt_ids"]
    solo = [list(Generation(model, q, 12, ignore_eos=True)) for q in (p, p[3:15])]   # each releases its cache
    assert model.cache_pool.idle_sets >= 1
    assert model.cache_pool.idle() == {32: 1, 24: 1}          # bucket(20 + 12), bucket(max(16, 12 + 12))
    poisoned = model.new_cache(32)                            # the first generation's set, its rows poisoned
    poison(poisoned)
    marked = buffers(poisoned)
    poisoned.release()
    a, b = model.new_cache(32), model.new_cache(16)
    assert buffers(a) == marked and not buffers(a) & buffers(b)
    rows = [BatchRow(a, p), BatchRow(b, p[3:15])]
    got: list[list[int]] = [[], []]
    for _ in range(12):                 # b grows past 16 while batched: its old set goes back, never shared
        toks = greedy_batch(model, rows)
        for g, r, t in zip(got, rows, toks):
            g.append(t)
            r.ids = [t]
        assert not buffers(a) & buffers(b)
    assert b.capacity == 32 and model.cache_pool.idle().get(16) == 1
    assert got == solo and got[0] == o["greedy_tokens"][:12]


def test_a_cache_that_grows_gives_its_old_buffers_back(model):
    a = model.new_cache(8)
    old = buffers(a)
    model.forward(list(range(1, 10)), a)          # 9 positions: 8 -> 16 rows
    assert a.capacity == 16 and not buffers(a) & old
    assert model.cache_pool.idle() == {8: 1}
    assert buffers(model.new_cache(8)) == old


def test_the_pool_keeps_a_few_idle_sets_and_frees_the_rest(model):
    pool = model.cache_pool
    caches = [model.new_cache(40) for _ in range(PER_CAPACITY + 3)]
    newest = buffers(caches[-1])
    for c in caches:
        c.release()
    assert pool.idle() == {40: PER_CAPACITY} and pool.freed == 3
    assert buffers(model.new_cache(40)) == newest              # the most recently released first
    for cap in (10, 12, 14, 20, 24, 28):
        model.new_cache(cap).release()
    assert pool.idle_sets == MAX_IDLE and set(pool.idle()) == {14, 20, 24, 28}   # the oldest released left first


def test_pool_bounds_by_themselves():
    p = CachePool(per_capacity=1, max_idle=2)
    p.give(4, ["a"])
    p.give(4, ["b"])
    p.give(8, ["c"])
    p.give(16, ["d"])
    assert p.idle() == {8: 1, 16: 1} and p.take(16) == ["d"] and p.take(16) is None and p.take(4) is None
    assert p.snapshot()["freed"] == 2
    p.give(8, [])                                            # nothing to keep
    assert p.idle() == {8: 1}


def test_stale_rows_of_a_released_cache_never_reach_the_next_sequence(oracle, model):
    """The rows a released cache leaves (here NaN, worse than any real sequence's) are never read: every kernel
    stops at the cache's length, so reuse needs no zeroing."""
    _, o, _ = oracle
    p, n = o["prompt_ids"], len(o["greedy_tokens"])
    cap = bucket(max(16, len(p) + n))
    c = model.new_cache(cap)
    poison(c)
    marked = buffers(c)
    c.release()
    gen = Generation(model, p, n, ignore_eos=True, keep_cache=True)
    assert list(gen) == o["greedy_tokens"]
    assert buffers(gen.cache) == marked and gen.cache.capacity == cap


def test_a_generation_gives_back_the_cache_it_made_and_never_one_given_to_it(oracle, model):
    _, o, _ = oracle
    p = o["prompt_ids"]
    gen = Generation(model, p, 6, ignore_eos=True)
    first = list(gen)
    assert gen.cache.released and model.cache_pool.idle() == {bucket(len(p) + 6): 1}
    again = Generation(model, p, 6, ignore_eos=True)
    assert list(again) == first and model.cache_pool.hits == 1
    stopped = Generation(model, p, 6, ignore_eos=True)          # a stream abandoned after 2 tokens
    it = iter(stopped)
    next(it), next(it)
    it.close()
    assert stopped.cache.released
    mine = model.new_cache(64)
    assert list(Generation(model, p, 6, ignore_eos=True, cache=mine)) == first
    assert not mine.released and mine.length == len(p) + 5
    kept = Generation(model, p, 6, ignore_eos=True, keep_cache=True)
    list(kept)
    assert not kept.cache.released


def test_mtp_generations_give_back_both_caches_and_keep_their_tokens(oracle, tmp_path):
    from checkpoints import with_mtp_layer
    _, o, src = oracle
    model, _ = load_model(with_mtp_layer(src, tmp_path / "mtp", seed=11))
    head = load_mtp_head(model)
    p = o["prompt_ids"]
    want = list(Generation(model, p, 20, ignore_eos=True))
    for drafts in (1, 3, 1):
        gen = Generation(model, p, 20, ignore_eos=True, mtp=(head, drafts))
        assert list(gen) == want, drafts
        assert gen.cache.released and gen.mtp_carry is None
    assert head.cache_pool.hits == 2 and head.cache_pool.idle_sets == 1     # the second and third reused it
    assert model.cache_pool.hits == 3


def test_a_session_saved_and_loaded_into_reused_buffers_goes_on_exactly(oracle, model, tmp_path):
    from coli.stages.executor.sessions import SessionStore
    _, o, _ = oracle
    p = o["prompt_ids"]
    st = SessionStore(model.config, model.new_cache, tmp_path, "fp", max_in_memory=1)
    s = st.get("chat", create=True)
    first = list(Generation(model, p, 32, ignore_eos=True, cache=s.cache))
    s.tokens = (p + first)[:s.cache.length]
    st.commit(s)
    n = s.cache.length
    stale = model.new_cache(max(16, n + 1))             # the capacity a load asks for, its rows poisoned
    poison(stale)
    marked = buffers(stale)
    stale.release()
    st.forget("chat")                                   # out of memory: the next turn loads it from its file
    back = st.get("chat", create=False)
    assert buffers(back.cache) == marked and back.cache.length == n and back.tokens == s.tokens
    extra = o["continuation"]["extra_ids"]
    second = list(Generation(model, [first[-1]] + extra, 32, ignore_eos=True, cache=back.cache))
    assert second == o["continuation"]["greedy_tokens"]
    dropped, cap = buffers(back.cache), back.cache.capacity
    assert st.drop("chat") and back.cache.released                  # a dropped session's cache goes back
    assert buffers(model.new_cache(cap)) == dropped


def test_the_serving_loop_gives_each_ended_request_s_cache_back(oracle, model, tmp_path):
    """The executor's BatchServer (stages/executor/serving.py) in process, real model and session store: a request
    that finishes, one that is cancelled and one that fails give their caches back; a session's stays."""
    from coli.protocol.messages import Done, Error, GenerateRequest, Token
    from coli.stages.executor.scheduler import Scheduler
    from coli.stages.executor.serving import BatchServer
    from coli.stages.executor.sessions import SessionStore
    _, o, _ = oracle
    p = o["prompt_ids"]
    sent: list = []
    counters = {k: 0 for k in ("requests", "tokens", "cancelled", "failed")}
    counters.update(decode_s=0.0, prefill_s=0.0, step_s=0.0)
    sessions = SessionStore(model.config, model.new_cache, tmp_path, "fp")
    server = BatchServer(Scheduler(4, 64), model.config, sessions, lambda: model, lambda peer, m: sent.append(m),
                         counters, structlog.get_logger("test"))

    def req(rid, n, session=None):
        return GenerateRequest(rid, list(p), n, 0.0, 1.0, 0, None, True, True, session=session,
                               new_session=session is not None)

    def run():
        for _ in range(100):
            if not server.busy:
                return
            server.step()

    server.submit(b"c", req("a", 8))
    run()
    toks = [m.token_id for m in sent if isinstance(m, Token) and m.request_id == "a"]
    assert toks == o["greedy_tokens"][:8] and isinstance(sent[-1], Done)
    cap = bucket(len(p) + 8)
    assert model.cache_pool.idle() == {cap: 1} and counters["kv_caches_new"] == 1
    server.submit(b"c", req("b", 8))                    # takes a's buffers; cancelled after its first step
    server.submit(b"c", req("s", 8, session="conv"))    # a session: its cache stays with it
    server.step()
    assert model.cache_pool.idle() == {} and counters["kv_caches_reused"] == 1
    server.cancel("b")
    run()
    assert model.cache_pool.idle() == {cap: 1} and not sessions.live["conv"].cache.released
    server.submit(b"c", req("bad", 10 ** 9))            # fails before it has a cache: nothing to give back
    run()
    assert isinstance(sent[-1], Error) and model.cache_pool.idle() == {cap: 1}


def test_a_cache_that_grows_is_never_doubled_past_the_model_s_context(model):
    import dataclasses
    from coli.model.kv_cache import KVCache
    cfg = dataclasses.replace(model.config, max_position_embeddings=4000)
    c = KVCache.empty(cfg, model.backend, 3000, pool=CachePool())
    assert c.capacity == 3072
    c.reserve(3500)                                 # doubling would give 6144 rows; the context holds 4000
    assert c.capacity == 4000
    d = KVCache.empty(cfg, model.backend, 4000, pool=CachePool())
    d.reserve(4100)                                 # past the context (nothing above refused it): doubling as before
    assert d.capacity == 8000


def test_iterating_a_spent_generation_again_is_a_clear_error_not_a_released_cache_deep_inside(oracle, model):
    from coli.generate import GenerationSpent
    _, o, _ = oracle
    p = o["prompt_ids"]
    gen = Generation(model, p, 4, ignore_eos=True)
    first = list(gen)
    with pytest.raises(GenerationSpent, match="iterated already.*make a new Generation"):
        list(gen)
    assert list(Generation(model, p, 4, ignore_eos=True)) == first     # the model and its pool are unharmed
    kept = Generation(model, p, 4, ignore_eos=True, keep_cache=True)   # a kept cache is not released: no error
    list(kept)
    assert not kept.cache.released


def test_a_released_cache_given_in_is_the_caller_s_error_not_a_spent_generation(oracle, model):
    """GenerationSpent says "make a new Generation": true only for a cache the generation made itself. A cache the
    caller gave in and released is the caller's bug, and a new Generation with it would fail the same: that one is
    CacheReleased (the cache's own message), as before GenerationSpent existed."""
    _, o, _ = oracle
    p = o["prompt_ids"]
    cache = model.new_cache(len(p) + 8)
    cache.release()
    with pytest.raises(CacheReleased, match="was released"):
        list(Generation(model, p, 4, ignore_eos=True, cache=cache))
