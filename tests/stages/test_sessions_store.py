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


def _rewrite(p, **meta_changes):
    """Rewrite a saved session with header fields changed (the arrays kept byte for byte)."""
    f = SafetensorsFile(p)
    arrays = {k: ("F32", np.array(f.float32(k))) for k in f.keys()}
    meta = {**f.metadata, **meta_changes}
    f.close()
    write_safetensors(p, arrays, meta)


def _saved(tmp_path, n=4):
    st = store(tmp_path)
    s = st.get("a", create=True)
    filled(s, n)
    return st.commit(s)


def test_saved_file_is_private_and_leaves_no_temp(tmp_path):
    tmp_path.chmod(0o755)                                 # as an older version left it
    p = _saved(tmp_path)
    assert (p.stat().st_mode & 0o777) == 0o600          # the token ids are the conversation
    assert (tmp_path.stat().st_mode & 0o777) == 0o700
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.session"]


def test_a_flipped_kv_byte_is_refused_by_the_checksum(tmp_path):
    p = _saved(tmp_path)
    f = SafetensorsFile(p)
    t = f.tensors["1.k_pe"]
    f.close()
    raw = bytearray(p.read_bytes())
    raw[t.start + 5] ^= 0x10                              # one bit of one cached value
    p.write_bytes(bytes(raw))
    with pytest.raises(SessionError, match="checksum mismatch"):
        store(tmp_path).get("a", create=False)


@pytest.mark.parametrize("field,value,match", [
    ("tokens", "7", "tokens must be a list of token ids"),
    ("tokens", "[0, 1, 2, \"x\"]", "tokens must be a list of token ids"),
    ("tokens", "[0, 1, 2, 99999999]", "tokens must be a list of token ids"),
    ("tokens", "{not json", "does not parse"),
    ("length", "four", "does not parse"),
])
def test_header_fields_of_the_wrong_type_are_refused_by_name(tmp_path, field, value, match):
    p = _saved(tmp_path)
    _rewrite(p, **{field: value})
    with pytest.raises(SessionError, match=match):
        store(tmp_path).get("a", create=False)


def test_metadata_that_is_not_a_map_is_refused(tmp_path):
    import json
    p = _saved(tmp_path)
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = ["magic", "coli-session"]
    hb = json.dumps(header).encode()
    hb += b" " * (n - len(hb)) if len(hb) <= n else b""
    assert len(hb) == n
    p.write_bytes(raw[:8] + hb + raw[8 + n:])
    with pytest.raises(SessionError, match="__metadata__ must be a map of strings"):
        store(tmp_path).get("a", create=False)


def test_temp_files_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()                                               # a pid that is certainly gone
    dead = tmp_path / f".a.session.tmp{p.pid}"
    mine = tmp_path / f".b.session.tmp{__import__('os').getpid()}"
    other = tmp_path / "notes.tmp123"
    for f in (dead, mine, other):
        f.write_bytes(b"x" * 100)
    st = store(tmp_path)
    assert st.swept == [dead] and not dead.exists() and mine.exists() and other.exists()


def test_a_new_session_in_an_unwritable_directory_is_refused_up_front(tmp_path):
    blocked = tmp_path / "sessions"
    blocked.write_text("a file where the sessions directory should be")
    st = SessionStore(C, lambda cap=16: KVCache.empty(C, NumpyBackend(), cap), blocked, "fp1")
    with pytest.raises(SessionError, match=r"sessions directory .*sessions is not writable"):
        st.get("a", create=True)
    assert not st.live


def test_a_session_whose_save_fails_stays_in_memory(tmp_path):
    st = store(tmp_path)                                   # max 2 in memory
    a = st.get("a", create=True)
    filled(a, 3)
    st.commit(a)
    (tmp_path / "a.session").unlink()
    (tmp_path / "a.session").mkdir()                       # even root cannot rename a file over a directory
    a = st.get("a", create=False)
    with pytest.raises(SessionError, match="could not be saved .* stays in memory"):
        st.commit(a)
    for n in "bc":                                         # two newer sessions would push 'a' out of memory
        filled(st.get(n, create=True), 2)
    assert "a" in st.live and st.live["a"].tokens == [0, 1, 2]
    assert not [x for x in tmp_path.iterdir() if ".tmp" in x.name]   # the failed save left no temp file


def test_recover_after_a_failed_turn_keeps_every_finished_turn(tmp_path):
    st = store(tmp_path)
    a = st.get("a", create=True)
    filled(a, 4)
    st.commit(a)
    a = st.get("a", create=False)
    a.reuse([0, 1, 2, 3, 50])
    a.cache.reserve(3)
    a.cache.length += 3                                    # a turn that wrote 3 positions, then raised
    st.recover("a")
    assert "a" not in st.live                              # its file holds every finished turn
    assert st.get("a", create=False).tokens == [0, 1, 2, 3]

    b = st.get("b", create=True)
    filled(b, 5)
    (tmp_path / "b.session").mkdir()                       # its save fails: memory holds the only copy
    with pytest.raises(SessionError):
        st.commit(b)
    b.reuse([0, 1, 2, 3, 4, 60])
    b.cache.length += 2
    st.recover("b")
    assert st.live["b"].tokens == [0, 1, 2, 3, 4] and st.live["b"].cache.length == 5


def test_ephemeral_sessions_live_only_in_memory_and_drop_forgets_any_session(tmp_path):
    st = store(tmp_path)
    filled(st.get("chat-1", create=True, ephemeral=True), 3)
    assert st.commit(st.live["chat-1"]) is None                  # a turn of it: nothing written
    filled(st.get("kept", create=True), 3)
    assert st.save_all() == [tmp_path / "kept.session"]          # an ephemeral session is never written
    filled(st.get("other", create=True), 3)                      # evicts chat-1 (max 2 in memory): dropped, not spilled
    assert "chat-1" not in st.live and not (tmp_path / "chat-1.session").exists()
    with pytest.raises(SessionError, match="unknown session 'chat-1'"):
        st.get("chat-1", create=False)
    assert st.drop("kept") and not (tmp_path / "kept.session").exists() and "kept" not in st.live
    assert st.drop("other") and not st.drop("other") and not st.drop("never")


def test_recover_keeps_an_ephemeral_session_cut_back_and_save_all_saves_past_a_failure(tmp_path):
    st = store(tmp_path)
    e = st.get("eph", create=True, ephemeral=True)
    filled(e, 4)
    st.commit(e)
    e = st.get("eph", create=False)
    e.reuse([0, 1, 2, 3, 9])
    e.cache.length += 1
    st.recover("eph")                                      # it has no file: memory is its only copy
    assert st.live["eph"].tokens == [0, 1, 2, 3] and st.live["eph"].cache.length == 4

    st = store(tmp_path / "two")
    (tmp_path / "two").mkdir()
    for n in "ab":
        filled(st.get(n, create=True), 2)
    (tmp_path / "two" / "a.session").mkdir()               # a's save fails, b's must still happen
    assert st.save_all() == [tmp_path / "two" / "b.session"]
