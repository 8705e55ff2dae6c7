"""The shared-memory arena, across real spawned processes: layout, views, one owner unlinks, no leaks."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from coli.protocol.arena import ALIGN, HEADER_BYTES, SHM_DIR, Arena
from coli.protocol.errors import ArenaError
from coli.protocol.messages import SlotRef

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def name():
    """A fresh arena name; whatever a failing test leaves in /dev/shm is removed."""
    n = f"coli-test-{uuid.uuid4().hex[:12]}"
    yield n
    Arena.unlink_name(n)


def shm_exists(n: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, n))


# -- children (spawned: they import this module by name) --------------------------------------------------


def child_write_slot(n: str, slot: int, value: int) -> None:
    arena = Arena.attach(n, slot_bytes=5000, n_slots=4)
    assert (arena.slot_bytes, arena.n_slots) == (8192, 4)
    view = arena.slot_view(slot)
    view[:] = bytes([value]) * len(view)
    try:
        arena.unlink()
    except ArenaError:
        pass
    else:
        os._exit(3)  # an attacher must never be allowed to unlink
    arena.close()


# -- tests ------------------------------------------------------------------------------------------------


def test_create_rounds_slots_to_pages_and_aligns_them(name):
    with Arena.create(name, 5000, 3) as arena:
        assert arena.owner and arena.slot_bytes == 8192 and arena.n_slots == 3
        assert arena.nbytes == HEADER_BYTES + 3 * 8192 == os.stat(os.path.join(SHM_DIR, name)).st_size
        assert os.stat(os.path.join(SHM_DIR, name)).st_mode & 0o777 == 0o600
        for i in range(3):
            a = arena.slot_array(i)
            assert a.shape == (8192,) and a.dtype == np.uint8
            assert a.ctypes.data % ALIGN == 0  # O_DIRECT and pinning need page-aligned slots
            assert a.ctypes.data == arena.address() + arena.slot_offset(i)
            del a
    assert not shm_exists(name)


def test_spawned_attacher_writes_a_slot_and_the_owner_reads_it(name):
    owner = Arena.create(name, 5000, 4)
    try:
        p = mp.get_context("spawn").Process(target=child_write_slot, args=(name, 2, 0xAB))
        p.start()
        p.join(20)
        assert p.exitcode == 0
        got = owner.slot_array(2)
        assert (got == 0xAB).all()
        assert not owner.slot_array(1).any() and not owner.slot_array(3).any()  # neighbours untouched
        del got
        assert shm_exists(name)  # the attacher's exit unlinked nothing
    finally:
        owner.close()
        owner.unlink()
    assert not shm_exists(name)  # the owner's unlink leaves no /dev/shm entry


@pytest.mark.timeout(90)
def test_attachers_exiting_any_way_leave_the_segment_and_print_no_warnings(tmp_path, name):
    # Run in a fresh interpreter so the resource tracker (started by the spawn context) is its own:
    # its leak warnings and tracebacks only appear when it shuts down, after that interpreter exits.
    script = tmp_path / "scenario.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, signal, sys
        from coli.protocol.arena import Arena

        def attach(name, how):
            arena = Arena.attach(name)
            arr = arena.slot_array(0)
            arr[:4] = [1, 2, 3, 4]
            if how == "close":
                del arr
                arena.close()
            elif how == "exit-mapped":
                sys.exit(0)
            elif how == "os-exit":
                os._exit(0)
            elif how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)

        if __name__ == "__main__":
            name = sys.argv[1]
            owner = Arena.create(name, 4096, 2)
            ctx = mp.get_context("spawn")
            for how in ("close", "exit-mapped", "os-exit", "sigkill"):
                p = ctx.Process(target=attach, args=(name, how))
                p.start()
                p.join(30)
                assert p.exitcode is not None, how
                assert os.path.exists("{SHM_DIR}/" + name), how
            assert bytes(owner.slot_array(0)[:4]) == bytes([1, 2, 3, 4])
            owner.close()
            owner.unlink()
            assert not os.path.exists("{SHM_DIR}/" + name)
            print("scenario ok")
    """))
    r = subprocess.run([sys.executable, str(script), name], capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stderr
    assert "scenario ok" in r.stdout
    for bad in ("resource_tracker", "leaked", "Traceback", "Warning"):
        assert bad not in r.stderr, r.stderr


def test_attach_reads_the_layout_and_refuses_a_mismatch(name):
    with Arena.create(name, 4096 * 3, 5):
        arena = Arena.attach(name)
        assert (arena.slot_bytes, arena.n_slots, arena.owner) == (4096 * 3, 5, False)
        arena.close()
        with pytest.raises(ArenaError, match=rf"arena '{name}' has 12288-byte slots, expected 16384"):
            Arena.attach(name, slot_bytes=4096 * 4)
        with pytest.raises(ArenaError, match=rf"arena '{name}' has 5 slots, expected 6"):
            Arena.attach(name, n_slots=6)


def test_attach_refuses_what_is_not_an_arena(name):
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"NOTARENA" + bytes(HEADER_BYTES))
    with pytest.raises(ArenaError, match="is not a ColiStream arena"):
        Arena.attach(name)
    with open(path, "wb") as f:
        f.write(b"tiny")
    with pytest.raises(ArenaError, match="too small to hold an arena header"):
        Arena.attach(name)
    os.unlink(path)
    with Arena.create(name, 4096, 2):
        os.truncate(path, HEADER_BYTES + 4096)  # one slot lost
        with pytest.raises(ArenaError, match="header describes"):
            Arena.attach(name)
        with open(path, "r+b") as f:
            f.seek(8)
            f.write((99).to_bytes(4, "little"))
        with pytest.raises(ArenaError, match="format version 99"):
            Arena.attach(name)


def test_missing_duplicate_and_bad_names(name):
    with pytest.raises(ArenaError, match="does not exist"):
        Arena.attach(name)
    with Arena.create(name, 4096, 1):
        with pytest.raises(ArenaError, match="already exists"):
            Arena.create(name, 4096, 1)
    for bad in ("", "a/b", "../etc", "x" * 201, ".hidden"):
        with pytest.raises(ArenaError, match="arena name"):
            Arena.create(bad, 4096, 1)
    with pytest.raises(ArenaError, match="slot_bytes must be a positive int"):
        Arena.create(name, 0, 1)
    with pytest.raises(ArenaError, match="n_slots must be a positive int"):
        Arena.create(name, 4096, 0)
    assert not shm_exists(name)


def test_create_fails_cleanly_when_shm_is_too_small(name):
    st = os.statvfs(SHM_DIR)
    too_big = 4 * st.f_blocks * st.f_frsize  # the kernel refuses at once, allocating nothing
    with pytest.raises(ArenaError, match=r"needs .* GiB .* free .* lower the RAM budget"):
        Arena.create(name, too_big // 4, 4)
    assert not shm_exists(name)


def test_slot_views_are_released_on_close(name):
    arena = Arena.create(name, 4096, 2)
    view = arena.slot_view(1)
    assert arena.slot_view(1) is view  # one shared view per slot, so close() can find them all
    view[0] = 7
    arena.close()
    with pytest.raises(ValueError, match="released memoryview"):
        view[0]
    with pytest.raises(ArenaError, match="is closed"):
        arena.slot_view(0)
    with pytest.raises(ArenaError, match="is closed"):
        arena.slot_array(0)
    arena.close()  # idempotent
    arena.unlink()
    assert not shm_exists(name)


def test_close_refuses_while_arrays_are_alive_and_nothing_dangles(name):
    arena = Arena.create(name, 4096, 2)
    arr = arena.slot_array(0)
    part = arena.slot_view(1)[:16]  # a slice of a slot view cannot be revoked either
    arr[:] = 5
    with pytest.raises(ArenaError, match="views over it are still alive"):
        arena.close()
    assert (arr == 5).all()  # still mapped: the array reads real memory, not a dangling pointer
    with pytest.raises(ArenaError, match="is closed"):
        arena.slot_array(1)  # closing: no new views
    del arr
    with pytest.raises(ArenaError, match="still alive"):
        arena.close()
    del part
    arena.close()
    assert "closed" in repr(arena)
    arena.unlink()


def test_ref_array_checks_the_reference(name):
    with Arena.create(name, 4096, 2) as arena:
        arena.slot_view(1)[100:104] = b"abcd"
        ref = SlotRef(arena=name, slot=1, offset=100, nbytes=4, generation=0)
        assert arena.ref_array(ref).tobytes() == b"abcd"
        del ref
        with pytest.raises(ArenaError, match="names arena 'other'"):
            arena.ref_array(SlotRef(arena="other", slot=1, offset=0, nbytes=1, generation=0))
        with pytest.raises(ArenaError, match="slot 2 is out of range 0..1"):
            arena.ref_array(SlotRef(arena=name, slot=2, offset=0, nbytes=1, generation=0))
        with pytest.raises(ArenaError, match="runs past the end of its 4096-byte slot"):
            arena.ref_array(SlotRef(arena=name, slot=1, offset=4000, nbytes=97, generation=0))
        for bad in (-1, 2, True, 1.0):
            with pytest.raises(ArenaError, match="out of range"):
                arena.slot_view(bad)  # type: ignore[arg-type]


def test_only_the_owner_unlinks_and_only_its_own_segment(name):
    owner = Arena.create(name, 4096, 1)
    attached = Arena.attach(name)
    with pytest.raises(ArenaError, match="only the owner"):
        attached.unlink()
    attached.close()
    owner.close()
    os.unlink(os.path.join(SHM_DIR, name))  # someone else removed it and a new run took the name
    newcomer = Arena.create(name, 4096, 1)
    with pytest.raises(ArenaError, match="no longer the segment this process created"):
        owner.unlink()
    assert shm_exists(name)
    newcomer.close()
    newcomer.unlink()
    newcomer.unlink()  # idempotent
    assert not shm_exists(name)


def test_unlink_name_removes_a_dead_runs_segment(name):
    Arena.create(name, 4096, 1).close()  # an owner that "died" without unlinking
    assert shm_exists(name)
    assert Arena.unlink_name(name) is True
    assert Arena.unlink_name(name) is False
    assert not shm_exists(name)
