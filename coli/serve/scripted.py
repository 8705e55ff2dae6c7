"""A scripted generation source at the gateway's seam, for what the demo model cannot do (call tools, think):
it takes the place of the run's connection (`Gateway(connect=ScriptedRun(...).connect)`) and answers each
request with the next scripted reply, as token ids made by the model's own tokenizer, through the same
streaming path as the run's tokens (RequestStream-shaped: next() gives ids, then Done). It records the
prompt ids it was given, so a test can read what the chat template rendered."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from coli.protocol.messages import Done


@dataclass
class Reply:
    text: str
    finish: str = "stop"  # "stop": the model's end-of-turn token follows the text


class ScriptedStream:
    def __init__(self, request_id: str, ids: list[int], finish: str, delay: float):
        self.request_id, self.ids, self.finish, self.delay = request_id, ids, finish, delay
        self.pos = 0
        self.finished = False
        self.cancelled = False

    async def next(self, timeout: float | None = None) -> int | Done:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.pos < len(self.ids):
            self.pos += 1
            return self.ids[self.pos - 1]
        self.finished = True
        return Done(self.request_id, "cancelled" if self.cancelled else self.finish, self.pos, {})

    def cancel(self) -> None:
        self.cancelled = True
        self.finished = True
        self.ids = self.ids[:self.pos]


class ScriptedLane:
    def __init__(self, run: "ScriptedRun"):
        self.run = run
        self.info = dict(run.info)
        self.alive = True
        self.in_flight = 0

    async def submit(self, prompt_ids: list[int], max_tokens: int, request_id: str | None = None,
                     **kw: Any) -> ScriptedStream:
        self.run.prompts.append(list(prompt_ids))
        if not self.run.replies:
            raise AssertionError("the script has no reply left for this request")
        r = self.run.replies.pop(0)
        r = Reply(r) if isinstance(r, str) else r
        ids = self.run.tok.encode(r.text)
        if r.finish == "stop":
            ids.append(self.run.eos_id)
        finish = r.finish
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        stream = ScriptedStream(request_id or "scripted", ids, finish, self.run.delay)
        self.run.streams.append(stream)
        return stream

    async def status(self, timeout: float = 5.0) -> dict:
        return {"queued": 0, "stages": {}, "stats": {}}

    async def close(self) -> None:
        self.alive = False


class ScriptedRun:
    """`replies`: what the "model" answers, in order (a string or a Reply). `info` is what a run's READY
    says: its `container` must hold the tokenizer.json and chat template to serve with."""

    def __init__(self, tok, info: dict, replies: list, eos_id: int, delay: float = 0.0):
        self.tok, self.info, self.replies, self.eos_id, self.delay = tok, info, list(replies), eos_id, delay
        self.prompts: list[list[int]] = []
        self.streams: list[ScriptedStream] = []  # every request's stream, to see what was cancelled

    async def connect(self, name: str, base: str | None = None, timeout: float = 10.0, ctx=None,
                      tag: str = "") -> ScriptedLane:
        return ScriptedLane(self)
