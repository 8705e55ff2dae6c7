"""Tokenising big prompts off the gateway's event loop.

`tokenizers` holds the GIL for part of an encode (building the id list above all), so a thread is not
enough: a 3.9 MB prompt in a thread still stalled every stream and /health for seconds. Prompts above
`inline_chars` are encoded in a separate process (spawned, never forked: the gateway holds ZeroMQ
threads), at most `workers` at a time; smaller ones are encoded inline, where a process round trip
would cost more than the encode.

The worker is told the context length: a prompt longer than it comes back as its token count only,
so a huge prompt never ships a million ids back to be refused."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from coli.errors import ColiError

INLINE_CHARS = 16384  # ~40 ms of encoding on a slow core: below this a process round trip is not worth it

_worker_tok = None


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the gateway dies, however it dies (a pool worker holds both
    ends of its queue's pipe, so it would never see EOF and would wait forever)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _init_worker(path: str, parent: int) -> None:
    global _worker_tok
    _die_with_parent()
    if os.getppid() != parent:  # the gateway died before the line above took effect
        os._exit(0)
    from tokenizers import Tokenizer
    _worker_tok = Tokenizer.from_file(path)


def _encode_in_worker(text: str, limit: int | None) -> list[int] | int:
    ids = _worker_tok.encode(text, add_special_tokens=False).ids
    return len(ids) if limit is not None and len(ids) > limit else ids


class TokenizerWorkerDied(ColiError):
    """The tokeniser process died (killed, out of memory) while encoding a prompt."""


class TokenizePool:
    def __init__(self, tok, workers: int = 1, inline_chars: int = INLINE_CHARS):
        self.tok = tok                      # coli.tokenizer.Tokenizer: encodes the small prompts inline
        self.path: Path = tok.path
        self.workers = workers
        self.inline_chars = inline_chars
        self._pool: ProcessPoolExecutor | None = None
        self._slots = asyncio.Semaphore(workers)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:  # made on first use: most gateways never see a big prompt
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init_worker, initargs=(str(self.path), os.getpid()))
        return self._pool

    async def encode(self, text: str, limit: int | None = None) -> list[int] | int:
        """-> the ids, or (when `limit` is given and the prompt is longer) just the token count."""
        if len(text) <= self.inline_chars:
            ids = self.tok.encode(text)
            return len(ids) if limit is not None and len(ids) > limit else ids
        async with self._slots:
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(self._executor(), _encode_in_worker, text, limit)
            except BrokenProcessPool:
                self.close()  # the next big prompt gets a fresh process
                raise TokenizerWorkerDied("the tokeniser process died while encoding this prompt; "
                                          "retry the request") from None

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            procs = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:  # a worker in the middle of a huge prompt is not waited for
                p.terminate()
