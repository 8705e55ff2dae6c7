"""Request admission at the supervisor, where `coli chat`, the client API and the HTTP gateway all enter:
a request the run cannot serve is refused here with one clear `bad_request`, before the executor sizes
anything from it. Pure: no sockets; the supervisor calls `refusal` for every GenerateRequest.

Types and per-field invariants were already checked by the codec (GenerateRequest.__post_init__); this
checks what needs the run's own geometry: token ids against the vocabulary, and the prompt plus
max_tokens against the context window (refused, not clamped: see coli.generate.context_problem)."""

from __future__ import annotations

from dataclasses import dataclass

from coli.generate import context_problem
from coli.protocol.messages import GenerateRequest


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context: int        # positions the run serves: the model's max_position_embeddings (0 = no limit)

    @classmethod
    def from_model_info(cls, info: dict) -> "Limits":
        return cls(int(info.get("vocab_size") or 0), int(info.get("max_position_embeddings") or 0))


def refusal(req: GenerateRequest, limits: Limits) -> str | None:
    """Why `req` cannot be served by this run (one line naming the field and the limit), or None."""
    if limits.vocab_size:
        top = max(req.prompt_ids)
        if top >= limits.vocab_size:
            return f"prompt token id {top} is outside the vocabulary (0..{limits.vocab_size - 1})"
    return context_problem(len(req.prompt_ids), req.max_tokens, limits.context)
