"""Conversations whose compressed KV cache outlives a turn, and a restart.

A session holds the KV cache and the exact token ids it covers. A turn sends the whole conversation
(like the OpenAI API); the longest prefix the cache already covers is reused and only the rest is
prefilled. On shutdown every session is saved as a safetensors file (the cache arrays, the tokens and
a header) written atomically (tmp + fsync + rename); loading checks the magic, the version, the model
it was made with and every array's shape, and refuses anything else by name.
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

from coli.config import ModelConfig
from coli.model.kv_cache import KVCache
from coli.safetensors_io import SafetensorsFile, write_safetensors

MAGIC = "coli-session"
VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class SessionError(Exception):
    pass


@dataclass
class Session:
    name: str
    cache: KVCache
    tokens: list[int] = field(default_factory=list)  # exactly the positions held by `cache`
    ephemeral: bool = False   # memory only: never saved, dropped instead of spilled (a `coli chat` session)

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


class SessionStore:
    def __init__(self, config: ModelConfig, new_cache, directory: Path, fingerprint: str, max_in_memory: int = 16):
        self.config = config
        self.new_cache = new_cache  # () -> KVCache on the executor's backend
        self.dir = directory
        self.fingerprint = fingerprint
        self.max_in_memory = max(1, max_in_memory)
        self.live: OrderedDict[str, Session] = OrderedDict()

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.session"

    def get(self, name: str, create: bool, ephemeral: bool = False) -> Session:
        if not _NAME.match(name):
            raise SessionError(f"session name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if name in self.live:
            self.live.move_to_end(name)
            return self.live[name]
        s = self.load(name) if self.path(name).is_file() else None
        if s is None:
            if not create:
                raise SessionError(f"unknown session {name!r}")
            s = Session(name, self.new_cache(), ephemeral=ephemeral)
        self.live[name] = s
        while len(self.live) > self.max_in_memory:
            old_name, old = self.live.popitem(last=False)
            if not old.ephemeral:
                self.save(old)
        return s

    def drop(self, name: str) -> bool:
        """Forget a session, in memory and on disk; False when there was none."""
        s = self.live.pop(name, None)
        p = self.path(name)
        on_disk = _NAME.match(name) is not None and p.is_file()
        if on_disk:
            p.unlink()
        return s is not None or on_disk

    # ---- persistence -------------------------------------------------------------------------------
    def save(self, s: Session) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        arrays = s.cache.host_arrays()  # {"<layer>.lat": [T, Lkv], ...}
        meta = {"magic": MAGIC, "version": str(VERSION), "model": self.fingerprint, "name": s.name,
                "tokens": json.dumps(s.tokens), "length": str(s.cache.length)}
        final = self.path(s.name)
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        write_safetensors(tmp, {k: ("F32", v) for k, v in arrays.items()}, metadata=meta)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        return final

    def save_all(self) -> list[Path]:
        return [self.save(s) for s in self.live.values() if not s.ephemeral]

    def load(self, name: str) -> Session:
        p = self.path(name)
        f = SafetensorsFile(p)
        try:
            m = f.metadata
            if m.get("magic") != MAGIC:
                raise SessionError(f"{p}: not a ColiStream session file (magic {m.get('magic')!r})")
            if m.get("version") != str(VERSION):
                raise SessionError(f"{p}: session format version {m.get('version')!r}, this build reads {VERSION}")
            if m.get("model") != self.fingerprint:
                raise SessionError(f"{p}: saved with another model (fingerprint {m.get('model')!r}); "
                                   f"delete it or serve the model it was made with")
            tokens = json.loads(m.get("tokens", "[]"))
            n = int(m.get("length", -1))
            if n != len(tokens):
                raise SessionError(f"{p}: header says {n} cached positions but holds {len(tokens)} tokens")
            c = self.config
            cache = self.new_cache(max(16, n + 1))
            for i in range(c.num_hidden_layers):
                want = {"lat": c.kv_lora_rank, "k_pe": c.qk_rope_head_dim}
                if c.indexer_types[i] == "full":
                    want["k_idx"] = c.index_head_dim
                got = {k: f.float32(f"{i}.{k}") if f"{i}.{k}" in f else None for k in want}
                for k, width in want.items():
                    a = got[k]
                    if a is None or a.shape != (n, width):
                        raise SessionError(f"{p}: array {i}.{k} has shape {None if a is None else a.shape}, "
                                           f"expected ({n}, {width})")
                cache.reserve(n)
                cache.write(i, 0, cache.backend.upload(np.array(got["lat"])), cache.backend.upload(np.array(got["k_pe"])),
                            cache.backend.upload(np.array(got["k_idx"])) if "k_idx" in got else None)
            cache.length = n
            return Session(name, cache, list(tokens))
        finally:
            f.close()
