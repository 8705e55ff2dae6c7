"""Where a run keeps its saved sessions, and edits of a saved file the way damage or a hostile user would."""

from __future__ import annotations

import json
from pathlib import Path


def session_file(run, name: str) -> Path:
    """The saved file of session `name` ($COLI_CACHE/sessions/<container>/<name>.session)."""
    found = list((Path(run.env["COLI_CACHE"]) / "sessions").glob(f"*/{name}.session"))
    assert len(found) == 1, f"session {name!r}: found {found}"
    return found[0]


def edit_header(p: Path, change) -> None:
    """Rewrite the safetensors header of `p` as change(header) returns it; the data bytes stay as they are
    (data_offsets count from the end of the header, so its length may change)."""
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = change(json.loads(raw[8:8 + n]))
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    p.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:])


def flip_data_byte(p: Path, tensor: str, at: int = 5) -> None:
    """Flip one bit of one stored value of `tensor` (a bit rot, a torn write)."""
    raw = bytearray(p.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]
    raw[8 + n + begin + at] ^= 0x10
    p.write_bytes(bytes(raw))
