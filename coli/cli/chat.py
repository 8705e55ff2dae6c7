"""`coli chat`: talk to a running model — an interactive REPL that streams tokens and keeps the
conversation (coli/cli/chat_repl.py: line editing, history, slash commands, Ctrl-C stops the answer, the KV
cache kept between turns), or one-shot with -p TEXT / --prompt-ids (the same JSON as `coli run`)."""

from __future__ import annotations

import json
import sys
import uuid
from typing import Optional

import typer

from coli.cli.common import clean_errors, parse_ids, sampling_from_options
from coli.errors import ColiError


def chat(
    name: str = typer.Option("default", "--name", help="Run name."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One user message; print the answer and exit."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Raw comma-separated token ids (no template)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", min=1, help="Tokens per answer at most."),
    greedy: bool = typer.Option(False, "--greedy", help="Most likely token every step (default without sampling options)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="Sampling temperature (> 0)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", min=0, help="Sample among the k most likely tokens (0 = all)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence tokens."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message to start the conversation."),
    session: Optional[str] = typer.Option(None, "--session", help="Keep this conversation's KV cache across "
                                          "restarts too (created if new). Without it the interactive chat keeps "
                                          "the cache between turns in a session of its own, dropped at exit."),
    as_json: bool = typer.Option(False, "--json", help="One-shot: print one JSON object (like `coli run --json`)."),
) -> None:
    """Chat with a running model (start one with `coli up`).

    Interactive without -p/--prompt-ids: line editing and history, /help lists the commands, an empty line does
    nothing, Ctrl-C stops the answer (twice at the prompt, Ctrl-D or /quit leaves); each turn prefills only
    what it adds to the conversation."""
    _chat(name, prompt, prompt_ids, max_tokens, greedy, temperature, top_p, top_k, seed, ignore_eos, system, as_json,
          session)


@clean_errors
def _chat(name, prompt, prompt_ids, max_tokens, greedy, temperature, top_p, top_k, seed, ignore_eos, system, as_json,
          session=None):
    from coli.chat_template import load_chat_template
    from coli.serve.client import Client
    from coli.tokenizer import load_tokenizer

    if prompt is not None and prompt_ids is not None:
        raise ColiError("give at most one of --prompt and --prompt-ids")
    sp = sampling_from_options(greedy, temperature, top_p, top_k, seed)
    kw = dict(greedy=sp.greedy, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
              ignore_eos=ignore_eos, session=session, new_session=session is not None)
    with Client(name) as client:
        container = client.info.get("container")
        tok = load_tokenizer(container) if container else None
        template = load_chat_template(container) if container else None
        if prompt_ids is not None or prompt is not None:
            if prompt_ids is not None:
                ids = parse_ids(prompt_ids)
            else:
                ids = _encode_turn(tok, template, ([{"role": "system", "content": system}] if system else [])
                                   + [{"role": "user", "content": prompt}])
            if as_json:
                r = client.generate(ids, max_tokens, **kw)
                out = {"tokens": r.tokens, "finish_reason": r.finish_reason, "prompt_tokens": len(ids), "stats": r.timing}
                if tok is not None:
                    out["text"] = tok.decode(r.tokens)
                print(json.dumps(out))
                return
            _, _, stopped = _stream_answer(client, tok, ids, max_tokens, kw)
            if stopped:
                raise KeyboardInterrupt
            return
        if tok is None:
            raise ColiError("this model has no tokenizer.json: the interactive chat needs one (use --prompt-ids)")
        from coli.cli.chat_repl import repl
        repl(client, tok, template, system, session, max_tokens, kw,
             encode=lambda messages: _encode_turn(tok, template, messages),
             stream_answer=lambda ids, extra: _stream_answer(client, tok, ids, max_tokens, kw | extra))


def _encode_turn(tok, template, messages) -> list[int]:
    if tok is None:
        raise ColiError("this model has no tokenizer.json: use --prompt-ids")
    text = template.render(messages, add_generation_prompt=True) if template is not None else messages[-1]["content"]
    return tok.encode(text)


def _stream_answer(client, tok, ids, max_tokens, kw):
    """Print the answer as it streams; (tokens, the Done message or None, stopped by Ctrl-C). Ctrl-C closes the
    stream, which cancels the request: the executor stops at its next token and the session keeps what was
    generated so far."""
    from coli.tokenizer import StreamDecoder

    eos = set(client.info.get("eos_token_ids") or [])
    stream = StreamDecoder(tok, skip_special_tokens=True) if tok is not None else None
    out: list[int] = []
    done, stopped = None, False
    rid = f"chat-{uuid.uuid4().hex}"
    it = client.stream(ids, max_tokens, request_id=rid, **kw)
    try:
        for item in it:
            if isinstance(item, int):
                out.append(item)
                if stream is not None:
                    if item not in eos:
                        sys.stdout.write(stream.push(item))
                else:
                    sys.stdout.write(f"{item} ")
                sys.stdout.flush()
            else:
                done = item
    except KeyboardInterrupt:
        it.close()                          # sends Cancel
        stopped = True
        done = client.wait_done(rid)        # its real usage (what the session reused and kept)
    if stream is not None:
        sys.stdout.write(stream.flush())
    sys.stdout.write(" [stopped]\n" if stopped else "\n")
    sys.stdout.flush()
    return out, done, stopped


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
