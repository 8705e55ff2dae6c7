"""The executor's serving loop over the batching core: requests join (`submit`), each `step` runs every running
sequence's next rows through the model in one batched call, and each sequence's tokens go to its own client as
they come. No sockets here: answers leave through `send(peer, message)`; the process wrapper
(stages/executor/process.py) owns the sockets, the control messages and the GPU demotion.

A failing request costs that request only: a batched step that raises is retried row by row from the caches'
lengths before it, and only the rows that fail alone fail (their requests get the Error; the others go on).

A request that asks for MTP (`mtp` on/1..3/auto, or the run's default) drafts with the model's MTP head: its prompt
runs alone (SpeculativeDecoder.prefill), then each step it drafts (begin_round) and takes part in the batched step
with ONE row, the verify row [last, d1..dk] with all its logits; after the step its SpeculativeDecoder accepts and
rolls back (end_round), and the round's accepted tokens stream out, none past eos or max_tokens. Its greedy tokens
are those it gets without MTP; the batch's other sequences are untouched."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from coli.errors import WeightError
from coli.generate import ContextTooLong, context_problem
from coli.errors import ColiError
from coli.model.mtp import MtpUnavailable, SpeculativeDecoder, load_mtp_head, parse_mtp
from coli.model.sampling import SamplingParams
from coli.protocol.messages import ERROR_BAD_REQUEST, ERROR_INTERNAL, Done, Error, GenerateRequest, Token
from coli.stages.executor.batch_step import choose_alone, choose_with_rounds, round_alone
from coli.stages.executor.experts import ExpertUnavailable
from coli.stages.executor.scheduler import Row, Scheduler, Sequence
from coli.stages.executor.sessions import SessionError


class StopRequested(Exception):
    """Shutdown asked (or the supervisor gone) while a step waited for experts: the loop ends now."""


@dataclass
class Ticket:
    """What the executor keeps per sequence beside the scheduler's state: whom to answer, what was asked."""
    peer: bytes
    req: GenerateRequest
    sess: Any = None      # the Session this turn runs on, or None
    drafts: int | str | None = None     # MTP: the draft count 1..3 or "auto"; None: no drafting
    spec: Any = None      # its SpeculativeDecoder (with drafts), over its cache


class BatchServer:
    def __init__(self, sched: Scheduler, cfg, sessions, model: Callable[[], Any], send: Callable[[bytes, Any], None],
                 counters: dict, log, faults=None, recorder=None, on_step_error: Callable[[Exception], bool] | None = None,
                 after_batch: Callable[[], None] | None = None, mtp: str = "off"):
        """`model()` is the model in use (it changes when the GPU is lost); `on_step_error(e)` may handle a failed
        step (the GPU wrapper demotes to the CPU) and return True, after which every running sequence restarts on
        a new cache; `after_batch()` runs whenever the batch empties (the GPU's copies are reaped); `mtp` is the
        run's default for a request that does not say (`coli up --mtp`)."""
        self.sched, self.cfg, self.sessions, self.model, self.send = sched, cfg, sessions, model, send
        self.counters, self.log, self.faults, self.recorder = counters, log, faults, recorder
        self.on_step_error, self.after_batch = on_step_error, after_batch
        self.drop_after: set[str] = set()       # sessions asked to be dropped while a turn held them
        self.mtp = parse_mtp(mtp)               # checked when the run starts: a bad default never reaches a request
        self._heads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> its MtpHead

    @property
    def busy(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    # ---- requests in -------------------------------------------------------------------------------
    def submit(self, peer: bytes, req: GenerateRequest) -> None:
        bad = [t for t in req.prompt_ids if t >= self.cfg.vocab_size]
        if bad:
            self.send(peer, Error(ERROR_BAD_REQUEST, f"prompt token id {bad[0]} is outside the vocabulary "
                                                     f"(0..{self.cfg.vocab_size - 1})", req.request_id))
            return
        try:
            drafts = self.mtp if req.mtp is None else parse_mtp(req.mtp)
        except ColiError as e:
            self.send(peer, Error(ERROR_BAD_REQUEST, f"mtp: {e}", req.request_id))
            return
        params = SamplingParams(greedy=req.greedy or req.temperature == 0.0, temperature=req.temperature or 1.0,
                                top_p=req.top_p, top_k=req.top_k, seed=req.seed)
        eos = frozenset() if req.ignore_eos else frozenset(int(e) for e in self.cfg.eos_token_ids)
        try:
            seq = Sequence(req.request_id, list(req.prompt_ids), req.max_tokens, params, eos, req.session,
                           Ticket(peer, req, drafts=drafts), t_submit=time.perf_counter(),
                           external=drafts is not None)
            self.sched.submit(seq)
        except ValueError as e:
            self.send(peer, Error(ERROR_BAD_REQUEST, str(e), req.request_id))

    def cancel(self, request_id: str) -> None:
        self.sched.cancel(request_id)

    def session_in_use(self, name: str) -> bool:
        return any(s.session == name for s in self.sched.running)

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> None:
        """Cancelled sequences leave, newcomers join, one batched model step, its tokens out."""
        reaped = self.sched.reap()
        for seq in reaped:
            self.counters["cancelled"] += 1
            self._finish(seq)
        for seq in self.sched.admit():
            self._begin(seq)
        rows = self.sched.plan()
        rounds: list = [None] * len(rows)
        drafting = [s for s in self.sched.running if s.external and s.cache is not None and s.finish is None
                    and not s.cancel_requested]
        for seq in drafting:
            row = self._begin_round(seq)
            if row is not None:
                rows.append(row)
                rounds.append(seq.payload.spec)
        chosen = self._run(rows, rounds) if rows else None
        if chosen is not None:
            now = time.perf_counter()
            plain = [(r, c) for r, c, spec in zip(rows, chosen, rounds) if spec is None]
            self._emit(self.sched.commit([r for r, _ in plain], [c for _, c in plain], now))
            for r, c, spec in zip(rows, chosen, rounds):
                if spec is not None and c is not None:      # None: its row failed (its request got the Error)
                    self._count_round(len(r.ids) - 1, len(c) - 1)
                    self._emit(self.sched.commit_tokens(r.seq, c, now))
        self._drop_released_sessions()
        if (rows or drafting or reaped) and not self.sched.running and self.after_batch is not None:
            self.after_batch()          # the batch just emptied

    def _emit(self, out) -> None:
        for seq, tok, index in out.tokens:
            self._token(seq, tok, index)
        for seq in out.finished:
            if seq.finish != "failed":
                self._finish(seq)

    def _begin_round(self, seq: Sequence) -> Row | None:
        """A drafting sequence's part of this step: its verify row (drafted now), or None: its prompt ran alone
        (its first token is out) or its request failed alone."""
        spec: SpeculativeDecoder = seq.payload.spec
        t0 = time.perf_counter()
        try:
            if spec.last is None:       # the prompt (or, after a restart, prompt + tokens sent) -> its next token
                tok = spec.prefill(seq.pending)
                self._emit(self.sched.commit_tokens(seq, [tok], time.perf_counter()))
                return None
            return Row(seq, spec.begin_round(seq.max_tokens - len(seq.out)), True)
        except StopRequested:
            raise
        except Exception as e:
            self._failed(seq, e)
            return None
        finally:
            self.counters["step_s"] += time.perf_counter() - t0

    def _count_round(self, k: int, accepted: int) -> None:
        """A verified round of k drafts, `accepted` of them kept, into the counters `coli stats` shows (MTP drafts:
        tokens per step, acceptance per draft position; coli/stats_view.py)."""
        c = self.counters
        c["mtp_rounds"] = c.get("mtp_rounds", 0) + 1
        c["mtp_tokens"] = c.get("mtp_tokens", 0) + accepted + 1
        for j in range(1, k + 1):
            c[f"mtp_drafted_{j}"] = c.get(f"mtp_drafted_{j}", 0) + 1
            c[f"mtp_accepted_{j}"] = c.get(f"mtp_accepted_{j}", 0) + (j <= accepted)

    def _head(self):
        """The MTP head of the model in use (loaded once per model: the GPU's, or the CPU's after a demotion)."""
        m = self.model()
        if m not in self._heads:
            self._heads[m] = load_mtp_head(m)
        return self._heads[m]

    def fail_all(self, e: Exception) -> None:
        """A step broke outside the model (a bug in this loop): every sequence here fails with it, the executor
        goes on with the next requests."""
        for seq in [*self.sched.running, *self.sched.waiting]:
            self._failed(seq, e)

    def _begin(self, seq: Sequence) -> None:
        t: Ticket = seq.payload
        req = t.req
        try:
            new_ids, cache = list(req.prompt_ids), None
            if req.session is not None:
                try:
                    t.sess = self.sessions.get(req.session, create=req.new_session, ephemeral=req.ephemeral)
                except (SessionError, WeightError, ValueError) as e:
                    self.sched.fail(seq)
                    self.send(t.peer, Error(ERROR_BAD_REQUEST, str(e), req.request_id))
                    return
                new_ids, cache = t.sess.reuse(list(req.prompt_ids)), t.sess.cache
            problem = context_problem(len(req.prompt_ids), req.max_tokens,
                                      int(getattr(self.cfg, "max_position_embeddings", 0) or 0))
            if problem:     # before the cache is sized from max_tokens
                raise ContextTooLong(problem)
            if cache is None:
                cache = self.model().new_cache(max(16, len(new_ids) + req.max_tokens))
                # `coli stats --json`: request caches that got a released one's buffers (their decode graphs replay
                # from the first step) against those allocated anew
                key = "kv_caches_reused" if cache.reused else "kv_caches_new"
                self.counters[key] = self.counters.get(key, 0) + 1
            if self.recorder is not None:
                self.recorder.new_sequence()
            self.counters["requests"] += 1
            self.sched.begin(seq, cache, new_ids, time.perf_counter())
            carry = None
            if t.sess is not None:      # the MTP side of the conversation's last drafting turn, consumed here
                carry, t.sess.mtp_carry = t.sess.mtp_carry, None
            if t.drafts is not None and not SpeculativeDecoder.can_continue(cache, carry):
                # the cache grew without drafting (a turn without MTP, a session loaded from disk): this turn runs
                # without drafts -- the same tokens, MTP is lossless -- and the next one drafts again
                self.log.info("mtp_off_for_turn", request_id=req.request_id, session=req.session,
                              why="the session's cache is not in step with an MTP cache")
                t.drafts, seq.external = None, False
            if t.drafts is not None:
                t.spec = SpeculativeDecoder(self._head(), cache, seq.sampler, t.drafts, carry=carry)
        except StopRequested:
            raise
        except MtpUnavailable as e:     # the request's own choice: a bad_request naming why, the run goes on
            self.sched.fail(seq)
            self._release(seq)
            self.send(t.peer, Error(ERROR_BAD_REQUEST, str(e), req.request_id))
        except Exception as e:
            self._failed(seq, e)

    def _run(self, rows: list[Row], rounds: list) -> list | None:
        """The step's tokens per row (a verify row's: the round's list; its wall time counted in step_s); None: the
        step is void (see _attempt)."""
        t0 = time.perf_counter()
        try:
            return self._attempt(rows, rounds)
        finally:
            self.counters["step_s"] += time.perf_counter() - t0

    def _attempt(self, rows: list[Row], rounds: list) -> list | None:
        """The step's tokens; a failure is isolated to the rows that fail by themselves. None: the step is void
        (the model changed under it and every sequence restarted)."""
        held = [(r.seq.cache, r.seq.cache.length) for r in rows]
        try:
            return choose_with_rounds(self.model(), rows, rounds)
        except StopRequested:
            raise
        except Exception as e:
            for cache, n in held:       # what the failed step wrote past each cache's length is not kept
                cache.truncate(min(n, cache.length))
            if self.on_step_error is not None and self.on_step_error(e):
                self._restart_all()
                return None         # nothing of this step is kept: the restarted rows run again
            if len(rows) == 1:
                self._row_failed(rows[0], e)
                return [None]
        chosen: list = []
        for r, spec, (cache, n) in zip(rows, rounds, held):
            try:
                chosen.append(choose_alone(self.model(), r) if spec is None else round_alone(self.model(), r, spec))
            except StopRequested:
                raise
            except Exception as e:
                cache.truncate(min(n, cache.length))
                self._row_failed(r, e)
                chosen.append(None)
        return chosen

    def _restart_all(self) -> None:
        """The model changed under the running sequences (the GPU was lost: their caches with it): each goes on
        from what its client has, its prompt and the tokens sent so far, on a new cache (a session's: its last
        committed turn, or a new one)."""
        for seq in list(self.sched.running):
            if seq.cache is None:
                continue
            t: Ticket = seq.payload
            full = seq.prompt + seq.out
            try:
                if t.req.session is not None:
                    t.sess = self.sessions.get(t.req.session, create=True, ephemeral=t.req.ephemeral)
                    new_ids, cache = t.sess.reuse(full), t.sess.cache
                else:
                    new_ids = full
                    cache = self.model().new_cache(max(16, len(full) + seq.max_tokens - len(seq.out)))
                self.sched.restart(seq, cache, new_ids)
                if t.drafts is not None and cache.length == 0:  # its MTP cache went with the old: start over
                    t.spec = SpeculativeDecoder(self._head(), cache, seq.sampler, t.drafts)
                elif t.drafts is not None:  # a session's cache kept a prefix the new MTP cache lacks: no drafts
                    t.drafts, t.spec, seq.external = None, None, False
            except StopRequested:
                raise
            except Exception as e:
                self._failed(seq, e)

    def _row_failed(self, row: Row, e: Exception) -> None:
        seq = row.seq
        if isinstance(e, ExpertUnavailable):
            t: Ticket = seq.payload
            self.counters["failed"] += 1
            self.log.error("expert_unavailable", request_id=seq.request_id, error=str(e))
            self.sched.fail(seq)
            self._release(seq)
            self.send(t.peer, Error(ERROR_INTERNAL, f"expert unavailable: {e}", seq.request_id))
            if t.sess is not None:   # what it had before this step stays, as committed with its tokens
                t.sess.tokens = (seq.prompt + seq.out)[:t.sess.cache.length]
                self._commit_session(t.sess, seq.request_id)
            return
        self._failed(seq, e)

    # ---- answers out -------------------------------------------------------------------------------
    def _token(self, seq: Sequence, tok: int, index: int) -> None:
        t: Ticket = seq.payload
        self.send(t.peer, Token(seq.request_id, tok, index))
        self.counters["tokens"] += 1
        if index == 0 and self.faults is not None and self.faults.hit("request_error"):
            self._failed(seq, RuntimeError("injected request failure (COLI_INJECT=request_error)"))

    def _finish(self, seq: Sequence) -> None:
        """Done for a sequence that ended (stop, length, cancelled); a session is saved before it."""
        t: Ticket = seq.payload
        rid = seq.request_id
        if t.sess is not None and seq.cache is not None:     # the tokens the cache covers: prompt, then fed back
            if t.spec is not None:      # a round may have run past the turn's end (eos, max_tokens): cut it back
                t.sess.cache.truncate(min(t.sess.cache.length, len(seq.prompt) + len(seq.out) - 1))
                t.sess.mtp_carry = t.spec.carry_out()
            t.sess.tokens = (seq.prompt + seq.out)[:t.sess.cache.length]
            err = self._commit_session(t.sess, rid)   # saved before Done: a turn the client saw finish survives kill -9
            if err:
                self.send(t.peer, Error(ERROR_INTERNAL, f"the answer was generated but {err}", rid))
                return
        timing = seq.timing
        now = time.perf_counter()
        timing["total_s"] = now - (seq.t_begin if seq.t_begin is not None else seq.t_submit)
        timing["queued_s"] = (seq.t_begin - seq.t_submit) if seq.t_begin is not None else now - seq.t_submit
        c = self.counters
        c["prefill_s"] += timing["prefill_s"]
        c["decode_s"] += timing["decode_s"]
        c["last_tokens_per_s"] = round(timing["decode_tokens_per_s"], 3)
        c["last_latency_s"] = round(timing["total_s"], 4)
        self.send(t.peer, Done(rid, seq.finish, len(seq.out), timing))
        self._release(seq)
        self.log.info("request", request_id=rid, prompt_tokens=len(seq.prompt), reused_tokens=seq.reused,
                      session=seq.session, tokens=len(seq.out), finish=seq.finish, total_s=round(timing["total_s"], 4),
                      queued_s=round(timing["queued_s"], 4), decode_tps=round(timing["decode_tokens_per_s"], 2))

    def _failed(self, seq: Sequence, e: Exception) -> None:
        """Any exception of one request: an Error for it (typed, naming the cause), the traceback in the log, and
        the others go on. A session it was using goes back to its last finished turn (SessionStore.recover)."""
        t: Ticket = seq.payload
        self.sched.fail(seq)
        self.counters["failed"] += 1
        code = ERROR_BAD_REQUEST if isinstance(e, ContextTooLong) else ERROR_INTERNAL
        what = str(e) if code == ERROR_BAD_REQUEST else f"the executor failed on this request: {type(e).__name__}: {e}"
        self.log.error("request_failed", request_id=seq.request_id, session=seq.session,
                       error=f"{type(e).__name__}: {e}", exc_info=e)
        if seq.session is not None:
            self.sessions.recover(seq.session)
        self._release(seq)
        self.send(t.peer, Error(code, what[:2000], seq.request_id))

    def _release(self, seq: Sequence) -> None:
        """A sequence that left the batch gives the cache it was given at _begin back to the model's pool, and its
        MTP decoder's cache to the head's (coli/model/cache_pool.py): the next request of that capacity replays the
        decode graphs captured for those buffers from its first step. A session's cache (and the MTP cache its carry
        keeps) stays with the session. Called once the sequence is out of the scheduler: no step uses it again."""
        t: Ticket = seq.payload
        if t.sess is not None or seq.cache is None:
            return
        if t.spec is not None:
            t.spec.mtp_cache.release()
        seq.cache.release()

    def _commit_session(self, sess, rid: str) -> str | None:
        """Persist the session after a turn; the reason it could not be, or None."""
        try:
            self.sessions.commit(sess)
            return None
        except SessionError as e:
            self.counters["failed"] += 1
            self.log.error("session_not_saved", request_id=rid, session=sess.name, error=str(e))
            return str(e)

    def _drop_released_sessions(self) -> None:
        for name in list(self.drop_after):
            if not self.session_in_use(name):
                self.drop_after.discard(name)
                self.log.info("session_dropped", session=name, found=self.sessions.drop(name))

    def shutdown(self) -> None:
        """The run is stopping (the supervisor tells the clients): every sequence still here ends, and a session
        it held keeps the tokens its cache covers, for the save on the way out."""
        for seq in [*self.sched.running, *self.sched.waiting]:
            self.sched.cancel(seq.request_id)
        gone = self.sched.reap()
        for seq in gone:
            if seq.cache is not None and seq.payload.sess is not None:
                seq.payload.sess.tokens = (seq.prompt + seq.out)[:seq.payload.sess.cache.length]
            self._release(seq)
        if gone:
            self.log.info("batch_stopped", sequences=len(gone))
