"""Generated token ids -> the text a client sees, with OpenAI `stop` strings.

Tokens are detokenised incrementally (`coli.tokenizer.StreamDecoder`: text is released only as whole
UTF-8 characters; special tokens and the model's end-of-sequence ids are not text). With stop strings,
the last `max(len(stop)) - 1` characters are held back until it is certain that no stop string starts
inside them, so a stop string that spans several tokens is never half-sent; when one appears, the text
ends just before it and the request is finished with finish_reason "stop"."""

from __future__ import annotations

from coli.tokenizer import StreamDecoder, Tokenizer


class TextAssembler:
    def __init__(self, tok: Tokenizer | None, eos_ids=(), stops: list[str] | tuple[str, ...] = ()):
        self.dec = StreamDecoder(tok, skip_special_tokens=True) if tok is not None else None
        self.eos = frozenset(eos_ids)
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""      # decoded, not released yet (may hide the start of a stop string)
        self.text = ""         # released so far
        self.token_ids: list[int] = []
        self.stopped_by: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def push(self, token_id: int) -> str:
        """Feed one generated token; returns the text that may be released now ('' if none)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        if self.dec is None or token_id in self.eos:
            return ""
        self.pending += self.dec.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: release what was held back (up to a stop string, if one is there)."""
        if self.stopped or self.dec is None:
            return ""
        self.pending += self.dec.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        out = ""
        if self.stops:
            hit = min(((self.pending.find(s), s) for s in self.stops if s in self.pending), default=None)
            if hit is not None:
                out, self.pending, self.stopped_by = self.pending[:hit[0]], "", hit[1]
            elif final:
                out, self.pending = self.pending, ""
            else:
                cut = max(0, len(self.pending) - self.hold)
                out, self.pending = self.pending[:cut], self.pending[cut:]
        else:
            out, self.pending = self.pending, ""
        self.text += out
        return out
