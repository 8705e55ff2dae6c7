"""The executor's batching core: which sequences run, and which of their tokens each model step feeds.
Pure: no sockets, threads or model; the executor (stages/executor/serving.py) asks it for a step's rows,
runs them through the model in one batched call, and hands back the tokens chosen.

The policy (docs/runtime.md, "Continuous batching"):

- **Admission, first come first served.** A request waits until fewer than `max_batch` sequences run, then
  joins at the next token boundary. A request whose session a running sequence holds waits for that turn to
  end (a conversation's turns run in order: they share one KV cache) without holding up the requests behind it.
- **Every step feeds every decoding sequence its one token** (the token it sampled last step), so a running
  stream gets a token per step whatever joins: inter-token latency is one step, whose size the budget bounds.
- **Prefill is chunked into what is left of the step's token budget** (`step_tokens` minus the decode rows),
  oldest sequence first; a prompt longer than that takes several steps. A newcomer's first token comes after
  ceil(prompt / (step_tokens - decoding)) steps: time to first token is bounded too, and a long prompt cannot
  stall the streams already running. At least one prompt token per step goes to prefill, whatever decodes.
- **While the experts stream** (`streaming`: the executor's expert source cannot hold every routed expert, so each
  step copies the union of its rows' experts), the step's budget is `prefill_chunk` instead of `step_tokens`: a
  128-token chunk already routes to nearly every expert of every layer (GLM-5: ~250 of 256), so a step costs about
  one copy of the model whatever its size, and a prompt cut in 128-token chunks copies it once per chunk. One large
  chunk copies it once; decode rows ride along in that step (their experts are in the union anyway). With every
  expert resident the step's cost grows with its tokens, and `step_tokens` stays the budget.
- A row samples a token only when it feeds a sequence's last pending token (a prompt's last chunk, or a decode
  token); a chunk short of the prompt's end only fills the cache.
- **Finish**: an eos id (unless ignore_eos: 'stop', the token included), `max_tokens` ('length'), a cancel
  ('cancelled', at the next boundary: a token of the step in flight is dropped, not sent), or a failure of that
  request alone (the executor's `fail`). Each sequence samples with its own Sampler (its seed, temperature,
  top-k/p), so a sequence in a batch gets exactly the tokens it gets alone.

A sequence's `pending` is what the model has not seen yet: the prompt's uncached rest, then its last sampled
token. Re-running a sequence from scratch (the GPU lost mid-run) is `restart`: its prompt and the tokens sent so
far become pending again, and the next token it samples follows them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from coli.model.sampling import Sampler, SamplingParams


@dataclass
class Sequence:
    """One request's generation. `prompt` is the whole prompt (a session turn: the whole conversation);
    `payload` is the caller's (who to answer, the request); `cache` and `pending` are set at `begin`."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos: frozenset[int] = frozenset()
    session: str | None = None
    payload: Any = None
    cache: Any = None               # its KV cache (a KVCache; a session's own)
    pending: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    reused: int = 0                 # prompt positions a session's cache already held
    finish: str | None = None       # 'stop' | 'length' | 'cancelled' | 'failed' once done
    cancel_requested: bool = False
    sampler: Sampler | None = None
    t_submit: float = 0.0
    t_begin: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    external: bool = False          # its tokens come from outside the batched step (an MTP round: serving.py)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.sampling)   # validates the settings; its rng is this sequence's alone

    @property
    def prefilling(self) -> bool:
        """Still feeding its prompt (no token sampled yet)."""
        return not self.out

    @property
    def timing(self) -> dict:
        """Seconds by phase, as the Done message carries them (prefill: to the first token; decode: after)."""
        pre = (self.t_first - self.t_begin) if self.t_first is not None and self.t_begin is not None else 0.0
        dec = (self.t_last - self.t_first) if self.t_last is not None and self.t_first is not None else 0.0
        n = len(self.out)
        return {"prefill_s": pre, "decode_s": dec, "decode_tokens_per_s": (n - 1) / dec if n > 1 and dec > 0 else 0.0,
                "prefill_tokens": len(self.prompt) - self.reused, "reused_tokens": self.reused}


@dataclass(frozen=True)
class Row:
    """One sequence's part of a step: `ids` fed after what its cache holds; `samples`: a token comes out."""
    seq: Sequence
    ids: list[int]
    samples: bool


@dataclass
class StepOutcome:
    tokens: list[tuple[Sequence, int, int]]     # (sequence, token id, its index in that sequence's output)
    finished: list[Sequence]


class Scheduler:
    def __init__(self, max_batch: int, step_tokens: int, prefill_chunk: int | None = None, streaming: bool = False):
        """`prefill_chunk` (None: step_tokens) is the step's token budget while `streaming` (the experts stream);
        the executor sets `streaming` from its expert source, and again when the source changes (GPU lost)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 (got {step_tokens})")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (got {prefill_chunk})")
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.prefill_chunk = step_tokens if prefill_chunk is None else prefill_chunk
        self.streaming = bool(streaming)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # running totals for stats: steps, rows, and tokens fed by kind (prefill = prompt tokens)
        self.counters = {"steps": 0, "rows": 0, "prefill_tokens_fed": 0, "decode_tokens_fed": 0}

    # ---- joining -----------------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if self.find(seq.request_id) is not None:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """The waiting sequences that join now (FCFS while fewer than max_batch run; a session's later turn
        waits for its earlier one). The caller gives each its cache with `begin`, or removes it with `fail`."""
        held = {s.session for s in self.running if s.session is not None}
        joined: list[Sequence] = []
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch:
                break
            if seq.session is not None and seq.session in held:
                continue                     # behind its own conversation's running turn, not behind others
            if seq.session is not None:
                held.add(seq.session)
            self.waiting.remove(seq)
            self.running.append(seq)
            joined.append(seq)
        return joined

    def begin(self, seq: Sequence, cache: Any, new_ids: list[int], now: float) -> None:
        """`seq` starts with `cache`, which holds its prompt but for `new_ids` (a session reuses a prefix)."""
        if not new_ids:
            raise ValueError("a sequence needs at least one token to feed")
        seq.cache, seq.pending = cache, list(new_ids)
        seq.reused = len(seq.prompt) - len(new_ids)
        seq.t_begin = now

    def restart(self, seq: Sequence, cache: Any, new_ids: list[int]) -> None:
        """Run `seq` again on a new cache (the old one is lost): `new_ids` is what of prompt + tokens sent so
        far that cache lacks; the token it samples next is the next one it sends."""
        if not new_ids:
            raise ValueError("a restarted sequence needs at least one token to feed")
        seq.cache, seq.pending = cache, list(new_ids)

    # ---- leaving -----------------------------------------------------------------------------------
    def find(self, request_id: str) -> Sequence | None:
        for s in self.running:
            if s.request_id == request_id:
                return s
        for s in self.waiting:
            if s.request_id == request_id:
                return s
        return None

    def cancel(self, request_id: str) -> bool:
        """Mark a sequence cancelled (it leaves at the next `reap`); False if it is not here."""
        seq = self.find(request_id)
        if seq is None or seq.finish is not None:
            return False
        seq.cancel_requested = True
        return True

    def reap(self) -> list[Sequence]:
        """The cancelled sequences, removed (finish 'cancelled'); call between steps."""
        gone = [s for s in (*self.running, *self.waiting) if s.cancel_requested and s.finish is None]
        for s in gone:
            s.finish = "cancelled"
            self._remove(s)
        return gone

    def fail(self, seq: Sequence) -> None:
        """`seq` failed (its request is answered with an error by the caller): it leaves, the others go on."""
        seq.finish = "failed"
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ---- stepping ----------------------------------------------------------------------------------
    @property
    def budget(self) -> int:
        """The next step's token budget: prefill_chunk while the experts stream, else step_tokens."""
        return self.prefill_chunk if self.streaming else self.step_tokens

    def plan(self) -> list[Row]:
        """The next step's rows: every decoding sequence's token, then prompt chunks, oldest first, within
        the budget left (at least one prompt token when any prompt is pending)."""
        live = [s for s in self.running if s.cache is not None and s.pending and not s.cancel_requested
                and not s.external]
        rows = [Row(s, list(s.pending), True) for s in live if len(s.pending) == 1 and not s.prefilling]
        budget = max(1, self.budget - len(rows))
        for s in live:
            if len(s.pending) == 1 and not s.prefilling:
                continue
            if budget <= 0:
                break
            take = min(budget, len(s.pending))
            rows.append(Row(s, s.pending[:take], take == len(s.pending)))
            budget -= take
        return rows

    def commit(self, rows: Iterable[Row], chosen: list[int | None], now: float) -> StepOutcome:
        """After the step ran: `chosen[i]` is the token row i sampled (None for rows that do not sample). The
        fed tokens leave `pending`; sampled tokens are the outcome's, and sequences that finish leave."""
        rows = list(rows)
        if len(chosen) != len(rows):
            raise ValueError(f"{len(chosen)} tokens for {len(rows)} rows")
        c = self.counters
        c["steps"] += 1
        c["rows"] += len(rows)
        out = StepOutcome([], [])
        for row, tok in zip(rows, chosen):
            seq = row.seq
            c["prefill_tokens_fed" if seq.prefilling else "decode_tokens_fed"] += len(row.ids)
            if seq.finish is not None or seq.cancel_requested:
                continue            # it left (or is leaving) during the step: what it computed is dropped
            del seq.pending[:len(row.ids)]
            if not row.samples:
                continue
            if tok is None:
                raise ValueError(f"row of {seq.request_id!r} samples but no token was given")
            self._take(seq, int(tok), now, out)
        return out

    def commit_tokens(self, seq: Sequence, toks: list[int], now: float) -> StepOutcome:
        """An external sequence's tokens of one round (an MTP round emits 1..k+1 at once), taken in order up to the
        first that finishes it (eos, max_tokens): none past it is sent. The last one taken is its pending token."""
        out = StepOutcome([], [])
        if seq.finish is not None or seq.cancel_requested:
            return out              # it left (or is leaving) during the round: what it computed is dropped
        self.counters["prefill_tokens_fed" if seq.prefilling else "decode_tokens_fed"] += len(seq.pending)
        seq.pending = []
        for tok in toks:
            if self._take(seq, int(tok), now, out):
                break
        return out

    def _take(self, seq: Sequence, tok: int, now: float, out: StepOutcome) -> bool:
        """One sampled token into `seq`'s output; True when it finished the sequence (which then leaves)."""
        if seq.t_first is None:
            seq.t_first = now
        seq.t_last = now
        seq.out.append(tok)
        out.tokens.append((seq, tok, len(seq.out) - 1))
        if tok in seq.eos:
            seq.finish = "stop"
        elif len(seq.out) >= seq.max_tokens:
            seq.finish = "length"
        else:
            seq.pending = [tok]
            return False
        self._remove(seq)
        out.finished.append(seq)
        return True

    # ---- observing ---------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """Counters for `coli stats`: running and waiting now, plus running totals (steps, rows, tokens fed)."""
        return {"batch_running": len(self.running), "batch_waiting": len(self.waiting),
                "max_batch": self.max_batch, "step_tokens": self.step_tokens, "prefill_chunk": self.prefill_chunk,
                "experts_stream": int(self.streaming), **self.counters}
