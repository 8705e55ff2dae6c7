"""The generation loop shared by `coli run`, the executor stage and the gateway: prefill the new
prompt tokens after whatever the cache already holds, then decode one token per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from coli.errors import ColiError
from coli.model.forward import GlmMoeDsaModel
from coli.model.kv_cache import KVCache
from coli.model.sampling import Sampler, SamplingParams


class ContextTooLong(ColiError):
    """A request that does not fit the model's context window (prompt + max_tokens > positions)."""


def context_problem(n_prompt: int, max_tokens: int, context: int) -> str | None:
    """Why `n_prompt` tokens plus up to `max_tokens` new ones do not fit `context` positions; None if they do.

    Refused, not clamped, as OpenAI-compatible servers refuse: a clamped answer would stop at 'length'
    early without the client knowing why, and the rule is the same on every path (coli run, coli chat,
    the gateway). `context` 0 means the model states no limit."""
    if context <= 0:
        return None
    if n_prompt >= context:
        return (f"the prompt is {n_prompt} tokens but the model's context is {context} tokens "
                f"(shorten the prompt: it must leave room for at least one new token)")
    if n_prompt + max_tokens > context:
        return (f"the prompt ({n_prompt} tokens) plus max_tokens ({max_tokens}) is {n_prompt + max_tokens} tokens, "
                f"over the model's context of {context} tokens (ask for at most {context - n_prompt}: --max-tokens)")
    return None


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""
    mtp: dict | None = None       # speculative decoding's figures (coli.model.mtp.MtpStats) when it was on

    @property
    def decode_tps(self) -> float:
        # the first token comes out of the prefill, so decode steps are new_tokens - 1
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
                "decode_tokens_per_s": round(self.decode_tps, 3), "finish_reason": self.finish_reason,
                **({"mtp": self.mtp} if self.mtp is not None else {})}


class GenerationSpent(ColiError):
    """A Generation that made its own cache is iterated a second time (its cache is back in the pool)."""


@dataclass
class Generation:
    """One generate call. Iterate to get tokens; `stats.finish_reason` is 'stop' (an eos token was
    produced; it is included in the output) or 'length'."""

    model: GlmMoeDsaModel
    prompt_ids: Sequence[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: Sequence[int] = ()
    ignore_eos: bool = False
    cache: KVCache | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    # speculative decoding with the MTP head (coli.model.mtp): (MtpHead, drafts 1..3 | "auto"[, MtpCarry]); None =
    # off. The tokens are the same as without it (greedy) or distributed the same (sampling). With a cache that
    # already holds positions it drafts only given the MtpCarry of the turn before (`mtp_carry` after a turn);
    # otherwise that turn decodes without drafts, the same tokens.
    mtp: tuple | None = None
    mtp_carry: object = None      # after a speculative turn: the MtpCarry to continue this cache with
    # A cache this generation makes itself (cache=None) ends with it: its buffers (and its MTP cache's) go back to the
    # model's pool when the iteration ends -- done, stopped or abandoned -- so the next generation of that capacity
    # gets the same addresses and replays the decode graphs captured for them (coli/model/cache_pool.py). keep_cache:
    # keep it (`cache` and `mtp_carry` after the turn, to continue the conversation). A cache given in is the
    # caller's: never released here.
    keep_cache: bool = False
    _made_cache: bool = field(default=False, init=False, repr=False)   # `cache` is the one the first iteration made

    def __iter__(self) -> Iterator[int]:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0 (got {self.max_tokens})")
        if self._made_cache and self.cache.released:
            # the cache this generation made went back to the pool when its first iteration ended: a second one
            # would write into buffers another sequence may own now (a released cache the caller gave in is the
            # caller's error: CacheReleased, at its first use below)
            raise GenerationSpent("this Generation was iterated already and its KV cache went back to the model's "
                                  "pool: make a new Generation (keep_cache=True keeps the cache to continue from)")
        if len(self.prompt_ids) == 0 and (self.cache is None or self.cache.length == 0):
            raise ValueError("the prompt is empty: give at least one token")
        held = self.cache.length if self.cache is not None else 0       # a session's reused positions
        problem = context_problem(held + len(self.prompt_ids), self.max_tokens,
                                  int(getattr(self.model.config, "max_position_embeddings", 0) or 0))
        if problem:     # before the cache is sized from max_tokens: 10**11 of them would be a 23 TiB allocation
            raise ContextTooLong(problem)
        owned = self.cache is None and not self.keep_cache
        if self.cache is None:
            self.cache = self.model.new_cache(max(16, len(self.prompt_ids) + self.max_tokens))
            self._made_cache = True
        try:
            yield from self._generate()
        finally:
            if owned:
                self._release()

    def _release(self) -> None:
        """The cache this generation made, and its MTP side, back to their pools (nothing here uses them after)."""
        carry, self.mtp_carry = self.mtp_carry, None
        if carry is not None:
            carry.mtp_cache.release()
        self.cache.release()

    def _generate(self) -> Iterator[int]:
        sampler = Sampler(self.sampling)
        eos = set() if self.ignore_eos else set(int(e) for e in self.eos_ids)
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.stats.finish_reason = "length"
        if self.max_tokens == 0:
            return
        t0 = time.perf_counter()
        pending = list(self.prompt_ids)
        if not pending:
            raise ValueError("nothing to continue from: give at least one new prompt token")
        if self.mtp is not None:
            from coli.model.mtp import SpeculativeDecoder
            carry = self.mtp[2] if len(self.mtp) > 2 else None
            if SpeculativeDecoder.can_continue(self.cache, carry):
                yield from self._speculative(pending, sampler, eos, t0, carry)
                return
        tok = self._next(pending, sampler)
        self.stats.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        for n in range(self.max_tokens):
            self.stats.new_tokens = n + 1
            self.stats.decode_s = time.perf_counter() - t1
            yield tok
            if tok in eos:
                self.stats.finish_reason = "stop"
                return
            if n + 1 == self.max_tokens:
                return
            tok = self._next([tok], sampler)
        self.stats.decode_s = time.perf_counter() - t1

    def _speculative(self, prompt: list[int], sampler: Sampler, eos: set[int], t0: float, carry) -> Iterator[int]:
        """The decode loop with MTP drafts: each round yields 1..k+1 tokens. Stopping inside a round (eos,
        max_tokens, an abandoned stream) leaves the cache as the one-token loop would: the prompt and every
        yielded token but the last."""
        from coli.model.mtp import SpeculativeDecoder

        head, drafts = self.mtp[:2]
        base = self.cache.length
        dec = SpeculativeDecoder(head, self.cache, sampler, drafts, carry)
        out = [dec.prefill(prompt)]
        self.stats.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = 0
        try:
            while True:
                for tok in out:
                    n += 1
                    self.stats.new_tokens = n
                    self.stats.decode_s = time.perf_counter() - t1
                    self.stats.mtp = dec.stats.to_dict()
                    yield tok
                    if tok in eos:
                        self.stats.finish_reason = "stop"
                        return
                    if n == self.max_tokens:
                        return
                out = dec.step(self.max_tokens - n)
        finally:
            self.cache.truncate(min(self.cache.length, base + len(prompt) + n - 1))
            self.stats.mtp = dec.stats.to_dict()
            self.mtp_carry = dec.carry_out()

    def _next(self, ids: Sequence[int], sampler: Sampler) -> int:
        """The token after ids. Greedy takes the argmax on the backend (the same first maximum as the sampler's):
        logits stay on the GPU and a decode step may be replayed from a CUDA graph (coli/gpu/graphs.py)."""
        if self.sampling.greedy:
            return self.model.greedy(ids, self.cache)
        return sampler(self.model.forward(ids, self.cache)[-1])
