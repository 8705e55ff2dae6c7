"""The hub converter's journal: DST/coli-hub.journal, one JSON object per line, each batch fsync'd.

Line 1 is the header (repo, pinned commit, options, plan digest). Then, in the order they became durable:
  {"shard": NAME, "fp": {...}, "skipped": [...]}   the shard was downloaded and checked; its fingerprint
  {"units": [[i, xxh64], ...]}                      these units' bytes are fsync'd in the data files
  {"staged": NAME, "file": REL}                     what pending records still need from shard NAME was copied
                                                    (fsync'd, renamed into place) to REL under DST
  {"consumed": NAME}                                nothing needs shard NAME any more: it is (being) deleted
A torn last line (a kill mid-append) is ignored; so is everything after a malformed line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

JOURNAL = "coli-hub.journal"


@dataclass
class HubState:
    header: dict | None = None
    units: dict[int, int] = field(default_factory=dict)
    shards: dict[str, dict] = field(default_factory=dict)     # name -> {"fp": ..., "skipped": [...]}
    staged: dict[str, str] = field(default_factory=dict)      # shard name -> stage file (relative to DST)
    consumed: set[str] = field(default_factory=set)


def read_journal(path: Path) -> HubState:
    st = HubState()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return st
    lines = raw.split(b"\n")
    for k, line in enumerate(lines[:-1]):   # the last piece has no newline: torn or empty
        try:
            rec = json.loads(line)
        except ValueError:
            break
        if not isinstance(rec, dict):
            break
        if k == 0:
            st.header = rec
        elif "units" in rec:
            st.units.update({int(i): int(h) for i, h in rec["units"]})
        elif "shard" in rec:
            st.shards[rec["shard"]] = {"fp": rec["fp"], "skipped": rec.get("skipped", [])}
        elif "staged" in rec:
            st.staged[rec["staged"]] = rec["file"]
        elif "consumed" in rec:
            st.consumed.add(rec["consumed"])
        else:
            break
    return st


class JournalWriter:
    def __init__(self, path: Path, header: dict | None = None):
        """header given: start a new journal (replacing any); None: append to the existing one, after dropping a
        torn tail so new lines follow the last good one."""
        self.path = path
        if header is not None:
            _atomic(path, (json.dumps(header, sort_keys=True) + "\n").encode())
        else:
            raw = path.read_bytes()
            good = raw[:raw.rfind(b"\n") + 1]
            if good != raw:
                _atomic(path, good)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def append(self, *records: dict) -> None:
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
        done = 0
        while done < len(data):
            done += os.write(self.fd, data[done:])
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
