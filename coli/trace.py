"""Routing traces: which experts every token chose in every MoE layer, and with what weight.

File layout (little-endian; documented in docs/traces.md):

    magic    8 bytes  b"COLITRAC"
    hlen     uint32   length of the JSON header in bytes
    header   hlen bytes of UTF-8 JSON: {"format": "coli-routing-trace", "version": 1, "moe_layers": [...],
             "n_layers": len(moe_layers), "n_experts": E, "top_k": K, "id_dtype": "uint8"|"uint16",
             "record_bytes": R, "meta": {...}}
    records  fixed-size R-byte records, one per (token, MoE layer), appended as the model runs:
             token uint32 | seq uint16 | layer uint8 | flags uint8 | ids K x id_dtype | weights K x float16

`token` numbers routed tokens from 0 across the whole file (a prefill of S tokens takes S numbers),
`seq` numbers the sequences (requests) in the file (modulo 2**16), `layer` indexes `moe_layers`,
flags bit 0 = the token came in a prefill call (S > 1). An id of the dtype's maximum (255 / 65535)
with weight 0 marks a routed slot that was dropped (expert top-p pruning). Records of one forward call
are written layer by layer, so a token's records are not contiguous; the reader regroups them.

The file is appendable (a writer opened on an existing trace with the same shape continues its token
and sequence numbers, dropping a torn last record) and readable while it grows (`TraceReader.poll`
returns the records completed since the last call; a token is complete once all its layers are in).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

MAGIC = b"COLITRAC"
FORMAT = "coli-routing-trace"
VERSION = 1
FLAG_PREFILL = 1
_PREFIX = len(MAGIC) + 4


class TraceFormatError(ValueError):
    """A file that is not a routing trace this code understands (names the file and the field)."""


def id_dtype_for(n_experts: int) -> np.dtype:
    # the dtype's maximum is the "dropped" sentinel, so it must not be a valid expert id
    return np.dtype(np.uint8) if n_experts <= 255 else np.dtype("<u2")


def record_dtype(top_k: int, id_dtype: np.dtype) -> np.dtype:
    return np.dtype([("token", "<u4"), ("seq", "<u2"), ("layer", "u1"), ("flags", "u1"),
                     ("ids", id_dtype, (top_k,)), ("w", "<f2", (top_k,))])


@dataclass
class TraceHeader:
    moe_layers: list[int]
    n_experts: int
    top_k: int
    meta: dict = field(default_factory=dict)
    version: int = VERSION

    @property
    def n_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def id_dtype(self) -> np.dtype:
        return id_dtype_for(self.n_experts)

    @property
    def dtype(self) -> np.dtype:
        return record_dtype(self.top_k, self.id_dtype)

    @property
    def sentinel(self) -> int:
        return int(np.iinfo(self.id_dtype).max)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": self.version, "moe_layers": list(self.moe_layers),
                "n_layers": self.n_layers, "n_experts": self.n_experts, "top_k": self.top_k,
                "id_dtype": self.id_dtype.name, "weight_dtype": "float16", "record_bytes": self.dtype.itemsize,
                "meta": self.meta}

    def encode(self) -> bytes:
        body = json.dumps(self.to_json(), sort_keys=True).encode()
        return MAGIC + len(body).to_bytes(4, "little") + body

    def same_shape(self, other: "TraceHeader") -> bool:
        return (self.moe_layers, self.n_experts, self.top_k) == (other.moe_layers, other.n_experts, other.top_k)

    def validate(self, where: str = "trace") -> None:
        if self.n_experts < 1 or self.n_experts > 65535:
            raise TraceFormatError(f"{where}: n_experts={self.n_experts} is outside 1..65535")
        if self.top_k < 1 or self.top_k > self.n_experts:
            raise TraceFormatError(f"{where}: top_k={self.top_k} is outside 1..n_experts")
        if not 1 <= self.n_layers <= 255:
            raise TraceFormatError(f"{where}: {self.n_layers} MoE layers; the format holds 1..255")


def read_header(f, where: str) -> tuple[TraceHeader, int]:
    """(header, offset of the first record) from an open binary file."""
    prefix = f.read(_PREFIX)
    if len(prefix) < _PREFIX or prefix[:len(MAGIC)] != MAGIC:
        raise TraceFormatError(f"{where}: not a routing trace (magic {prefix[:len(MAGIC)]!r}, want {MAGIC!r})")
    n = int.from_bytes(prefix[len(MAGIC):], "little")
    if n > 1 << 20:
        raise TraceFormatError(f"{where}: header length {n} is implausible")
    raw = f.read(n)
    if len(raw) < n:
        raise TraceFormatError(f"{where}: header is truncated ({len(raw)} of {n} bytes)")
    try:
        h = json.loads(raw)
    except ValueError as e:
        raise TraceFormatError(f"{where}: header is not JSON ({e})") from None
    if h.get("format") != FORMAT:
        raise TraceFormatError(f"{where}: header field 'format' is {h.get('format')!r}, want {FORMAT!r}")
    if h.get("version") != VERSION:
        raise TraceFormatError(f"{where}: header field 'version' is {h.get('version')!r}; this build reads {VERSION}")
    try:
        hdr = TraceHeader([int(x) for x in h["moe_layers"]], int(h["n_experts"]), int(h["top_k"]), h.get("meta", {}))
    except (KeyError, TypeError, ValueError) as e:
        raise TraceFormatError(f"{where}: header field {e} is missing or malformed") from None
    hdr.validate(where)
    if h.get("record_bytes") != hdr.dtype.itemsize or h.get("id_dtype") != hdr.id_dtype.name:
        raise TraceFormatError(f"{where}: header fields 'record_bytes'/'id_dtype' ({h.get('record_bytes')}, "
                               f"{h.get('id_dtype')}) disagree with E={hdr.n_experts}, K={hdr.top_k}")
    return hdr, _PREFIX + n


# ----------------------------------------------------------------------------------------------------
class TraceWriter:
    """Appends records. `append(tokens, layer_slot, ids [S, K], weights [S, K], seq, flags)`."""

    def __init__(self, path: str | Path, header: TraceHeader, append: bool = True):
        header.validate(str(path))
        self.path = Path(path)
        self.header = header
        self.next_token = 0
        self.next_seq = 0
        if append and self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                old, start = read_header(f, str(self.path))
            if not old.same_shape(header):
                raise TraceFormatError(
                    f"{self.path}: cannot append: it holds E={old.n_experts}, K={old.top_k}, MoE layers "
                    f"{old.moe_layers}, this model has E={header.n_experts}, K={header.top_k}, {header.moe_layers}")
            self.header = old
            size = self.path.stat().st_size
            rb = old.dtype.itemsize
            whole = start + (size - start) // rb * rb
            self._f = open(self.path, "r+b")
            self._f.truncate(whole)  # drop a torn last record
            self._f.seek(whole)
            if whole > start:
                recs = np.fromfile(self.path, dtype=old.dtype, offset=start)
                self.next_token = int(recs["token"].max()) + 1
                self.next_seq = (int(recs["seq"][-1]) + 1) % 65536
        else:
            self._f = open(self.path, "wb")
            self._f.write(header.encode())
            self._f.flush()

    def append(self, tokens: np.ndarray, layer_slot: int, ids: np.ndarray, weights: np.ndarray, seq: int,
               flags: int = 0) -> None:
        h = self.header
        ids = np.asarray(ids)
        S, K = ids.shape
        if K != h.top_k:
            raise ValueError(f"routing of {K} experts per token, the trace holds top_k={h.top_k}")
        rec = np.zeros(S, dtype=h.dtype)
        rec["token"] = tokens
        rec["seq"] = seq % 65536
        rec["layer"] = layer_slot
        rec["flags"] = flags
        bad = (ids < 0) | (ids >= h.n_experts)
        rec["ids"] = np.where(bad, h.sentinel, ids).astype(h.id_dtype)
        rec["w"] = np.where(bad, 0.0, np.asarray(weights, dtype=np.float32)).astype(np.float16)
        self._f.write(rec.tobytes())

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()


class RoutingRecorder:
    """A `GlmMoeDsaModel.routing_hook` that records every MoE router decision to a trace file.

        rec = RoutingRecorder.for_model("run.trace", config, meta={"model": "..."})
        model.routing_hook = rec
        rec.new_sequence()        # at the start of each request (optional: numbering only)
        ... model.forward(...) ...
        rec.close()

    Token numbers are assigned when the first MoE layer of a forward call routes (S rows = S tokens);
    the records of a forward call are flushed to the file once its last MoE layer has routed, so a
    concurrent `TraceReader` sees whole tokens. Thread-safe; appends to an existing trace of the
    same shape.
    """

    def __init__(self, path: str | Path, moe_layers: Sequence[int], n_experts: int, top_k: int,
                 meta: dict | None = None, append: bool = True):
        self._w = TraceWriter(path, TraceHeader([int(x) for x in moe_layers], int(n_experts), int(top_k),
                                                dict(meta or {})), append=append)
        self.path = self._w.path
        self.header = self._w.header
        self._slot = {layer: i for i, layer in enumerate(self.header.moe_layers)}
        self._lock = threading.Lock()
        self._seq = self._w.next_seq
        self._started = False  # new_sequence() not called yet: the first forward opens sequence _seq
        self._base = self._w.next_token
        self._rows = 0
        self.tokens = 0  # tokens recorded by this recorder

    @classmethod
    def for_model(cls, path: str | Path, config, meta: dict | None = None, append: bool = True) -> "RoutingRecorder":
        return cls(path, config.moe_layers, config.n_routed_experts, config.num_experts_per_tok, meta, append)

    def new_sequence(self) -> int:
        """Start a new sequence (request); returns its number."""
        with self._lock:
            if self._started:
                self._seq = (self._seq + 1) % 65536
            self._started = True
            return self._seq

    def __call__(self, layer: int, idx: np.ndarray, weights: np.ndarray) -> None:
        slot = self._slot.get(int(layer))
        if slot is None:
            raise ValueError(f"routing hook called for layer {layer}, which is not a MoE layer of this trace "
                             f"({self.header.moe_layers})")
        idx = np.asarray(idx)
        S = int(idx.shape[0])
        with self._lock:
            self._started = True
            if slot == 0:
                self._base += self._rows
                self._rows = S
                self.tokens += S
            elif S != self._rows:
                raise ValueError(f"layer {layer} routed {S} tokens, the first MoE layer of this call routed {self._rows}")
            self._w.append(self._base + np.arange(S), slot, idx, weights, self._seq,
                           FLAG_PREFILL if S > 1 else 0)
            if slot == self.header.n_layers - 1:
                self._w.flush()

    def flush(self) -> None:
        with self._lock:
            self._w.flush()

    def close(self) -> None:
        with self._lock:
            self._w.close()

    def __enter__(self) -> "RoutingRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------
@dataclass
class Trace:
    """A whole trace as dense arrays (complete tokens only, in token order).

    idx [T, L, K] int32 (-1 = dropped), weights [T, L, K] float32, seq [T], prefill [T] bool."""

    header: TraceHeader
    idx: np.ndarray
    weights: np.ndarray
    seq: np.ndarray
    prefill: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.idx.shape[0])


def records_to_dense(header: TraceHeader, recs: np.ndarray) -> Trace:
    L, K = header.n_layers, header.top_k
    if len(recs) == 0:
        return Trace(header, np.zeros((0, L, K), np.int32), np.zeros((0, L, K), np.float32),
                     np.zeros(0, np.int64), np.zeros(0, bool))
    if int(recs["layer"].max()) >= L:
        raise TraceFormatError(f"record layer index {int(recs['layer'].max())} >= n_layers {L}")
    tok, inv = np.unique(recs["token"], return_inverse=True)
    T = len(tok)
    present = np.zeros((T, L), bool)
    present[inv, recs["layer"]] = True
    idx = np.full((T, L, K), -1, np.int32)
    w = np.zeros((T, L, K), np.float32)
    ids = recs["ids"].astype(np.int32)
    ids[ids == header.sentinel] = -1
    idx[inv, recs["layer"]] = ids
    w[inv, recs["layer"]] = recs["w"].astype(np.float32)
    seq = np.zeros(T, np.int64)
    seq[inv] = recs["seq"]
    pre = np.zeros(T, bool)
    pre[inv] = (recs["flags"] & FLAG_PREFILL) != 0
    done = present.all(axis=1)
    return Trace(header, idx[done], w[done], seq[done], pre[done])


class TraceReader:
    """Reads a trace, also while a writer is still appending to it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.header, self._start = read_header(f, str(self.path))
        self._pos = self._start
        self._pending = np.zeros(0, dtype=self.header.dtype)  # records of tokens not yet complete

    def read_all(self) -> Trace:
        size = self.path.stat().st_size
        rb = self.header.dtype.itemsize
        n = (size - self._start) // rb
        recs = np.fromfile(self.path, dtype=self.header.dtype, count=n, offset=self._start)
        return records_to_dense(self.header, recs)

    def poll(self) -> Trace:
        """The tokens completed since the last poll (all their layers written), in token order."""
        rb = self.header.dtype.itemsize
        size = self.path.stat().st_size
        n = (size - self._pos) // rb
        new = np.fromfile(self.path, dtype=self.header.dtype, count=n, offset=self._pos) if n > 0 else \
            np.zeros(0, dtype=self.header.dtype)
        self._pos += n * rb
        recs = np.concatenate([self._pending, new])
        if len(recs) == 0:
            return records_to_dense(self.header, recs)
        tok, inv, counts = np.unique(recs["token"], return_inverse=True, return_counts=True)
        complete = counts[inv] >= self.header.n_layers
        self._pending = recs[~complete]
        return records_to_dense(self.header, recs[complete])


def read_trace(path: str | Path) -> Trace:
    return TraceReader(path).read_all()


def write_trace(path: str | Path, idx: np.ndarray, weights: np.ndarray | None = None, n_experts: int = 256,
                moe_layers: Sequence[int] | None = None, meta: dict | None = None,
                seq: np.ndarray | None = None) -> TraceHeader:
    """Write dense routing [T, L, K] (e.g. a synthetic trace) as a new trace file."""
    idx = np.asarray(idx)
    T, L, K = idx.shape
    if weights is None:
        weights = np.full(idx.shape, 1.0 / K, np.float32)
    layers = list(moe_layers) if moe_layers is not None else list(range(L))
    if len(layers) != L:
        raise ValueError(f"{len(layers)} moe_layers for routing of {L} layers")
    hdr = TraceHeader(layers, n_experts, K, dict(meta or {}))
    w = TraceWriter(path, hdr, append=False)
    try:
        tokens = np.arange(T)
        sq = np.zeros(T, np.int64) if seq is None else np.asarray(seq)
        for l in range(L):
            # one call per layer and sequence keeps the seq field right; order within the file is free
            for s in np.unique(sq):
                m = sq == s
                w.append(tokens[m], l, idx[m, l], weights[m, l], int(s))
    finally:
        w.close()
    return hdr

