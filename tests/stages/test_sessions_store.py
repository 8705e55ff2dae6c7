import numpy as np
import pytest

from coli.config import PRESETS
from coli.model.kv_cache import KVCache
from coli.model.numpy_backend import NumpyBackend
from coli.safetensors_io import SafetensorsFile, write_safetensors
from coli.stages.executor.sessions import Session, SessionError, SessionStore

C = PRESETS["tiny-shared"]


def store(tmp_path, fp="fp1"):
    return SessionStore(C, lambda cap=16: KVCache.empty(C, NumpyBackend(), cap), tmp_path, fp, max_in_memory=2)


def filled(s: Session, n: int, seed=0):
    rng = np.random.default_rng(seed)
    s.cache.reserve(n)
    for i in range(C.num_hidden_layers):
        s.cache.write(i, 0, rng.standard_normal((n, C.kv_lora_rank)).astype(np.float32),
                      rng.standard_normal((n, C.qk_rope_head_dim)).astype(np.float32),
                      rng.standard_normal((n, C.index_head_dim)).astype(np.float32))
    s.cache.length = n
    s.tokens = list(range(n))


def test_round_trip_and_reuse(tmp_path):
    st = store(tmp_path)
    s = st.get("a", create=True)
    filled(s, 10)
    st.save(s)
    back = store(tmp_path).get("a", create=False)
    assert back.tokens == s.tokens
    for k, v in s.cache.host_arrays().items():
        np.testing.assert_array_equal(back.cache.host_arrays()[k], v)
    assert back.reuse(list(range(6)) + [99, 98]) == [99, 98] and back.cache.length == 6
    assert back.reuse(list(range(6))) == [5]  # at least one token stays new


def test_unknown_and_bad_names(tmp_path):
    st = store(tmp_path)
    with pytest.raises(SessionError, match="unknown session 'x'"):
        st.get("x", create=False)
    with pytest.raises(SessionError, match="must be"):
        st.get("../etc", create=True)


def test_lru_spills_to_disk(tmp_path):
    st = store(tmp_path)
    for n in "abc":
        filled(st.get(n, create=True), 3)
    assert list(st.live) == ["b", "c"] and (tmp_path / "a.session").is_file()
    assert st.get("a", create=False).tokens == [0, 1, 2]


def test_load_refuses_other_model_version_and_damage(tmp_path):
    st = store(tmp_path)
    s = st.get("a", create=True)
    filled(s, 4)
    p = st.save(s)
    with pytest.raises(SessionError, match="another model"):
        store(tmp_path, fp="other").get("a", create=False)
    f = SafetensorsFile(p)
    arrays = {k: ("F32", np.array(f.float32(k))) for k in f.keys()}
    meta = dict(f.metadata)
    f.close()
    write_safetensors(p, arrays, {**meta, "version": "9"})
    with pytest.raises(SessionError, match="version '9'"):
        store(tmp_path).get("a", create=False)
    arrays["0.lat"] = ("F32", np.zeros((4, 3), np.float32))
    write_safetensors(p, arrays, meta)
    with pytest.raises(SessionError, match=r"0\.lat has shape \(4, 3\)"):
        store(tmp_path).get("a", create=False)


def test_ephemeral_sessions_live_only_in_memory_and_drop_forgets_any_session(tmp_path):
    st = store(tmp_path)
    filled(st.get("chat-1", create=True, ephemeral=True), 3)
    filled(st.get("kept", create=True), 3)
    assert st.save_all() == [tmp_path / "kept.session"]          # an ephemeral session is never written
    filled(st.get("other", create=True), 3)                      # evicts chat-1 (max 2 in memory): dropped, not spilled
    assert "chat-1" not in st.live and not (tmp_path / "chat-1.session").exists()
    with pytest.raises(SessionError, match="unknown session 'chat-1'"):
        st.get("chat-1", create=False)
    assert st.drop("kept") and not (tmp_path / "kept.session").exists() and "kept" not in st.live
    assert st.drop("other") and not st.drop("other") and not st.drop("never")
