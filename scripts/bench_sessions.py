#!/usr/bin/env python3
"""Prefill time saved by sessions: a conversation grows turn by turn; each turn is sent once without a
session (the whole conversation is prefilled) and once with one (only the new tokens are). Needs a run
that is up (`coli up --name NAME`); uses the run's tokenizer and chat template.

    python scripts/bench_sessions.py [--name default] [--turns 6] [--answer-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys

from coli.chat_template import load_chat_template
from coli.serve.client import Client
from coli.tokenizer import load_tokenizer

QUESTIONS = ["What does os.path.join do?", "Tell me about the json module.", "What is collections.deque?",
             "What does str.split do?", "How do I read a file?", "What is functools.partial?",
             "Tell me about the re module.", "What does sorted do?"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="default")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=48)
    a = ap.parse_args()
    with Client(a.name) as c:
        d = c.info["container"]
        tok, tpl = load_tokenizer(d), load_chat_template(d)
        eos = set(c.info.get("eos_token_ids") or [])
        messages, rows = [], []
        session = f"bench-{id(c) % 100000}"
        for t in range(a.turns):
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
            ids = tok.encode(tpl.render(messages, add_generation_prompt=True))
            full = c.generate(ids, a.answer_tokens, greedy=True)
            sess = c.generate(ids, a.answer_tokens, greedy=True, session=session, new_session=True)
            assert sess.tokens == full.tokens, "a session must not change the tokens"
            rows.append({"turn": t + 1, "prompt_tokens": len(ids), "prefilled_with_session": int(sess.timing["prefill_tokens"]),
                         "prefill_s_full": round(full.timing["prefill_s"], 4),
                         "prefill_s_session": round(sess.timing["prefill_s"], 4)})
            answer = [x for x in full.tokens if x not in eos]
            messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
    print(f"{'turn':>4} {'prompt':>7} {'prefilled':>9} {'full s':>8} {'session s':>9} {'saved':>6}")
    for r in rows:
        saved = 1 - r["prefill_s_session"] / r["prefill_s_full"] if r["prefill_s_full"] else 0.0
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['prefilled_with_session']:>9} {r['prefill_s_full']:>8.3f} "
              f"{r['prefill_s_session']:>9.3f} {100 * saved:>5.0f}%")
    tf = sum(r["prefill_s_full"] for r in rows)
    ts = sum(r["prefill_s_session"] for r in rows)
    print(json.dumps({"turns": rows, "prefill_s_full_total": round(tf, 4), "prefill_s_session_total": round(ts, 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
