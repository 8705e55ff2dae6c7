"""Conversations whose compressed KV cache outlives a turn, a crash and a restart.

A session holds the KV cache and the exact token ids it covers. A turn sends the whole conversation
(like the OpenAI API); the longest prefix the cache already covers is reused and only the rest is
prefilled. After every turn the session is saved (`commit`) as a safetensors file: the cache arrays,
the tokens and a header, written to `.<name>.session.tmp<pid>` with mode 0600 (the token ids are the
conversation), fsynced and renamed over the old file, so a kill -9 at any moment leaves the previous
turn or this one, never half a file, and never loses a turn the client was told is done. The header
carries an xxh64 checksum over the tokens and every array; loading checks the magic, the version, the
model it was made with, every field's type, every array's shape and that checksum, and refuses anything
else by name (a flipped byte is refused, not served as a cache of zeros). Temp files left by a killed
writer are swept when the store opens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from coli.config import ModelConfig
from coli.errors import WeightError
from coli.model.kv_cache import KVCache
from coli.safetensors_io import SafetensorsFile, write_safetensors
from coli.stages.tmpfiles import create_private, sweep_dead_temps, write_private

MAGIC = "coli-session"
VERSION = 2          # 2: xxh64 checksum in the header (1 had none; still read, unverified)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_TEMP = r"\.[A-Za-z0-9._-]{1,128}\.session\.tmp(\d+)"     # what a killed save leaves behind
_PROBE = ".probe.session.tmp"                                # the writability probe, same sweepable shape


class SessionError(Exception):
    pass


@dataclass
class Session:
    name: str
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # exactly the positions held by `cache`
    ephemeral: bool = False   # memory only: never saved, dropped instead of spilled (a `coli chat` session)
    mtp_carry: object = None  # coli.model.mtp.MtpCarry: the MTP side of the last turn that drafted (memory only)

    def release(self) -> None:
        """The session ends: its KV cache and its MTP carry's cache back to their pools (nothing may use them after)."""
        carry, self.mtp_carry = self.mtp_carry, None
        if carry is not None:
            carry.mtp_cache.release()
        self.cache.release()

    def reuse(self, prompt: list[int]) -> list[int]:
        """Keep the longest cached prefix of `prompt` (at least one prompt token must stay new so the
        step that follows has logits); returns the tokens still to prefill."""
        n = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        self.cache.truncate(n)
        del self.tokens[n:]
        return prompt[n:]


def model_fingerprint(config: ModelConfig, container_manifest: bytes) -> str:
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    h.update(container_manifest)
    return h.hexdigest()[:32]


def content_checksum(tokens_json: str, arrays) -> str:
    """xxh64 over the token list and every array (name, shape, bytes; in name order). `arrays` yields
    (name, contiguous little-endian float32 array)."""
    h = xxhash.xxh64()
    h.update(tokens_json.encode())
    for name, a in sorted(arrays, key=lambda kv: kv[0]):
        h.update(f"|{name}:{'x'.join(map(str, a.shape))}|".encode())
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return "xxh64:" + h.hexdigest()


class SessionStore:
    """Sessions in memory (at most `max_in_memory`, least recently used leave first) over a directory of
    saved ones. A session is `clean` from a successful save (`commit`) until it is next handed out by
    `get`; leaving memory saves one that is not clean first, and keeps it (over the limit, logged) when
    that save fails, so nothing is dropped that is not on disk."""

    def __init__(self, config: ModelConfig, new_cache, directory: Path, fingerprint: str, max_in_memory: int = 16,
                 log=None):
        self.config = config
        self.new_cache = new_cache  # () -> KVCache on the executor's backend
        self.dir = directory
        self.fingerprint = fingerprint
        self.max_in_memory = max(1, max_in_memory)
        self.live: OrderedDict[str, Session] = OrderedDict()
        self.clean: set[str] = set()      # in memory and identical to its file
        self.save_failed: set[str] = set()  # its last commit failed: memory holds turns the file lacks
        self.log = log
        self.swept = sweep_dead_temps(self.dir, _TEMP)
        if self.swept and log is not None:
            log.info("session_temps_swept", count=len(self.swept), dir=str(self.dir))

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.session"

    def get(self, name: str, create: bool, ephemeral: bool = False) -> Session:
        if not _NAME.match(name):
            raise SessionError(f"session name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if name in self.live:
            self.live.move_to_end(name)
            self.clean.discard(name)        # the caller is about to change it
            return self.live[name]
        s = self.load(name) if self.path(name).is_file() else None
        if s is None:
            if not create:
                raise SessionError(f"unknown session {name!r}")
            if not ephemeral:               # an ephemeral session never touches the disk
                self._check_writable(name)
            s = Session(name, self.new_cache(), ephemeral=ephemeral)
        self.live[name] = s
        self._evict()
        return s

    def forget(self, name: str) -> None:
        """Drop a session from memory without saving; the next use loads its last committed turn from disk."""
        self.live.pop(name, None)
        self.clean.discard(name)
        self.save_failed.discard(name)

    def recover(self, name: str) -> None:
        """After a turn failed half-way (its cache may hold part of a step): a session whose file has every
        finished turn is dropped from memory and comes back from the file; one holding turns the file lacks
        (a save failed) or kept in memory only (ephemeral) is cut back to the positions its tokens cover,
        which the failed turn never wrote."""
        s = self.live.get(name)
        if s is None:
            return
        if name not in self.save_failed and not s.ephemeral:
            self.forget(name)
            return
        s.cache.truncate(min(len(s.tokens), s.cache.length))
        del s.tokens[s.cache.length:]

    def drop(self, name: str) -> bool:
        """Forget a session, in memory and on disk; False when there was none. Its caches go back to their pools
        (coli/model/cache_pool.py): the caller drops only a session no turn is using (the executor defers a drop
        asked during a turn: BatchServer.drop_after)."""
        s = self.live.pop(name, None)
        if s is not None:
            s.release()
        self.clean.discard(name)
        self.save_failed.discard(name)
        p = self.path(name)
        on_disk = _NAME.match(name) is not None and p.is_file()
        if on_disk:
            p.unlink()
        return s is not None or on_disk

    def commit(self, s: Session) -> Path | None:
        """Save `s` after a turn. On failure it stays in memory, not clean, and SessionError names the file.
        An ephemeral session is not saved (None) but counts as clean: evicted, it is dropped, not spilled."""
        if s.ephemeral:
            self.clean.add(s.name)
            return None
        try:
            p = self.save(s)
        except OSError as e:
            self.clean.discard(s.name)
            self.save_failed.add(s.name)
            raise SessionError(f"session {s.name!r} could not be saved to {self.path(s.name)}: {e.strerror or e} "
                               f"(it stays in memory until a save succeeds; free space or fix the directory, "
                               f"which lives under $COLI_CACHE/sessions)") from None
        self.clean.add(s.name)
        self.save_failed.discard(s.name)
        return p

    def _evict(self) -> None:
        """Leave memory, oldest first, down to max_in_memory; one that is not clean is saved first and
        kept (over the limit, logged) if that fails, never dropped."""
        for old_name in list(self.live)[:-1]:       # never the one just handed out
            if len(self.live) <= self.max_in_memory:
                return
            if old_name not in self.clean:
                try:
                    self.commit(self.live[old_name])
                except SessionError as e:
                    if self.log is not None:
                        self.log.error("session_kept_in_memory", session=old_name, error=str(e))
                    continue
            del self.live[old_name]

    def _check_writable(self, name: str) -> None:
        """A new session is refused up front when its directory cannot take files, rather than after the
        turn it was asked for (the probe is a real create, not os.access, which root always passes)."""
        try:
            self._ensure_dir()
            probe = self.dir / f"{_PROBE}{os.getpid()}"
            create_private(probe)
            os.unlink(probe)
        except OSError as e:
            raise SessionError(f"cannot keep session {name!r}: the sessions directory {self.dir} is not writable "
                               f"({e.strerror or e}); fix its permissions, or point $COLI_CACHE elsewhere "
                               f"(sessions live in $COLI_CACHE/sessions)") from None

    # ---- persistence -------------------------------------------------------------------------------
    def _ensure_dir(self) -> None:
        """The directory, owner-only: file names are session names, and an older run may have made it 0755."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.dir.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(self.dir, 0o700)

    def save(self, s: Session) -> Path:
        self._ensure_dir()
        arrays = s.cache.host_arrays()  # {"<layer>.lat": [T, Lkv], ...}
        tokens = json.dumps([int(t) for t in s.tokens])
        meta = {"magic": MAGIC, "version": str(VERSION), "model": self.fingerprint, "name": s.name,
                "tokens": tokens, "length": str(s.cache.length),
                "checksum": content_checksum(tokens, arrays.items())}
        final = self.path(s.name)
        write_private(final, lambda tmp: write_safetensors(tmp, {k: ("F32", v) for k, v in arrays.items()},
                                                           metadata=meta), prefix=f".{final.name}.tmp")
        return final

    def save_all(self) -> list[Path]:
        """On shutdown: what is not on disk yet (every committed turn already is); never an ephemeral one.
        One that cannot be saved is logged and does not keep the others from being saved."""
        saved = []
        for n, s in list(self.live.items()):
            if n in self.clean or s.ephemeral:
                continue
            try:
                saved.append(self.commit(s))
            except SessionError as e:
                if self.log is not None:
                    self.log.error("session_not_saved", session=n, error=str(e))
        return saved

    def load(self, name: str) -> Session:
        p = self.path(name)
        try:
            f = SafetensorsFile(p)
        except WeightError as e:
            raise SessionError(f"session file is damaged: {e} (delete it to start the session again)") from None
        try:
            return self._read(p, f, name)
        finally:
            f.close()

    def _read(self, p: Path, f: SafetensorsFile, name: str) -> Session:
        def bad(what: str) -> SessionError:
            return SessionError(f"{p}: {what} (the file is damaged or not a session: delete it to start "
                                f"session {name!r} again)")

        m = f.metadata
        if not isinstance(m, dict) or not all(isinstance(v, str) for v in m.values()):
            raise bad(f"__metadata__ must be a map of strings, got {type(m).__name__}")
        if m.get("magic") != MAGIC:
            raise SessionError(f"{p}: not a ColiStream session file (magic {m.get('magic')!r})")
        if m.get("version") not in ("1", str(VERSION)):
            raise SessionError(f"{p}: session format version {m.get('version')!r}, this build reads 1 and {VERSION}")
        if m.get("model") != self.fingerprint:
            raise SessionError(f"{p}: saved with another model (fingerprint {m.get('model')!r}); "
                               f"delete it or serve the model it was made with")
        try:
            tokens = json.loads(m.get("tokens", "[]"))
            n = int(m.get("length", "-1"))
        except ValueError as e:
            raise bad(f"header field tokens/length does not parse ({e})") from None
        c = self.config
        if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < c.vocab_size for t in tokens)):
            raise bad(f"header field tokens must be a list of token ids in 0..{c.vocab_size - 1}, "
                      f"got {m.get('tokens', '')[:40]!r}")
        if n != len(tokens):
            raise SessionError(f"{p}: header says {n} cached positions but holds {len(tokens)} tokens")
        if n >= c.max_position_embeddings > 0:
            raise bad(f"{n} cached positions exceed the model's context of {c.max_position_embeddings}")
        want: dict[str, int] = {}
        for i in range(c.num_hidden_layers):
            want[f"{i}.lat"], want[f"{i}.k_pe"] = c.kv_lora_rank, c.qk_rope_head_dim
            if c.indexer_types[i] == "full":
                want[f"{i}.k_idx"] = c.index_head_dim
        extra = sorted(set(f.keys()) - set(want))
        if extra:
            raise bad(f"unexpected array {extra[0]!r}")
        got: dict[str, np.ndarray] = {}
        for key, width in want.items():
            a = f.float32(key) if key in f else None
            if a is None or a.shape != (n, width):
                raise SessionError(f"{p}: array {key} has shape {None if a is None else a.shape}, "
                                   f"expected ({n}, {width})")
            got[key] = a
        if m["version"] != "1":
            stored = m.get("checksum")
            actual = content_checksum(m.get("tokens", "[]"), got.items())
            if stored != actual:
                raise bad(f"checksum mismatch (header {stored!r}, content {actual!r})")
        cache = self.new_cache(max(16, n + 1))
        cache.reserve(n)
        b = cache.backend
        for i in range(c.num_hidden_layers):
            cache.write(i, 0, b.upload(np.array(got[f"{i}.lat"])), b.upload(np.array(got[f"{i}.k_pe"])),
                        b.upload(np.array(got[f"{i}.k_idx"])) if f"{i}.k_idx" in got else None)
        cache.length = n
        return Session(name, cache, list(tokens))
